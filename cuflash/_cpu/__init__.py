"""The CPU path (NumPy in, NumPy out) and the float64 references that it and the tests compute with."""
