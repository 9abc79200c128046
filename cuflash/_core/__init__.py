"""Internals: argument checks, launch plans and their keys, the dispatch table, kernel parameters and
tensor maps, framework interop, NVRTC loading and device detection. No public names."""
