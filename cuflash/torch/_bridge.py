"""Torch tensors to and from cuflash's entry points, for the modules of cuflash.torch: CPU tensors
as NumPy views (so that cuflash takes its CPU path and in-place updates reach the tensor), CUDA
tensors as they are, and the check that tensor arguments are tensors."""

import ml_dtypes
import numpy as np
import torch

__all__ = ["as_cuflash", "as_torch", "check_tensors", "direct", "from_numpy", "numpy_view"]

# The torch dtypes NumPy lacks, each with an integer type of its size (in torch and NumPy) and
# ml_dtypes' type of the same format.
_THROUGH_BITS = ((torch.bfloat16, torch.int16, np.int16, ml_dtypes.bfloat16),
                 (torch.float8_e4m3fn, torch.uint8, np.uint8, ml_dtypes.float8_e4m3fn),
                 (torch.float8_e5m2, torch.uint8, np.uint8, ml_dtypes.float8_e5m2))
_TO_NUMPY = {dtype: (bits, np.dtype(ml)) for dtype, bits, _, ml in _THROUGH_BITS}
_TO_TORCH = {np.dtype(ml): (np.dtype(bits), dtype) for dtype, _, bits, ml in _THROUGH_BITS}


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor; bfloat16 and the float8 types, which NumPy lacks, viewed
    through their bits as ml_dtypes'."""
    t = t.detach()
    viewed = _TO_NUMPY.get(t.dtype)
    if viewed is not None:
        return t.view(viewed[0]).numpy().view(viewed[1])
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    viewed = _TO_TORCH.get(a.dtype)
    if viewed is not None:
        return torch.from_numpy(a.view(viewed[0])).view(viewed[1])
    return torch.from_numpy(a)


def check_tensors(names: tuple[str, ...], values: tuple, required: int) -> None:
    """The tensor arguments ``names``, given as ``values``: the first ``required`` must be torch
    tensors, the others tensors or None. Checked first, because anything else reaches an op's
    schema (whose error prints a whole NumPy array) or a tensor attribute (an AttributeError).
    Two plain loops before any naming: a decoding step calls this every time."""
    for x in values[:required]:
        if not isinstance(x, torch.Tensor):
            break
    else:
        for x in values[required:]:
            if x is not None and not isinstance(x, torch.Tensor):
                break
        else:
            return
    for index, (name, x) in enumerate(zip(names, values)):
        optional = index >= required
        if not isinstance(x, torch.Tensor) and not (optional and x is None):
            hint = ("; cuflash's own functions (cuflash.attention, ...) take NumPy arrays"
                    if isinstance(x, np.ndarray) else "")
            raise TypeError(f"{name}: expected a torch.Tensor{' or None' if optional else ''}, got "
                            f"{type(x).__name__}{hint}")


def as_cuflash(t: torch.Tensor):
    """A CPU tensor as a NumPy view (sharing its memory, so in-place cache updates reach it); any
    other tensor as it is. ``is_cuda`` first: it answers for CUDA tensors without building a
    ``device`` object per tensor on every decoding call."""
    return numpy_view(t) if not t.is_cuda and t.device.type == "cpu" else t


def as_torch(x):
    return from_numpy(x) if isinstance(x, np.ndarray) else x


def direct(function, *args, **options):
    """``function`` (a cuflash entry point, called directly rather than as a custom op) on torch
    tensors: CPU tensors as NumPy views, so that it takes its CPU path, and its NumPy results
    back as tensors; CUDA tensors as they are. Only tensors are looked at further: a decoding
    step passes a dozen other options."""
    args = [as_cuflash(x) if isinstance(x, torch.Tensor) else x for x in args]
    options = {name: as_cuflash(x) if isinstance(x, torch.Tensor) else x for name, x in options.items()}
    result = function(*args, **options)
    return tuple(as_torch(x) for x in result) if isinstance(result, tuple) else as_torch(result)
