"""Host cost of cuflash's pure-Python launch path, runnable without a GPU.

CuPy is replaced by a stand-in module whose arrays, allocations, stream, device switch and
kernel launch cost next to nothing, and ``kernels.get_function`` by a stub, so the figure is
what cuflash's own Python costs per call: framework detection, describing the tensors,
validation, kernel choice, grid, parameter packing and the bookkeeping around allocation and
launch. What real CuPy and the driver add (an allocation ~2-4 us, cuLaunchKernel ~2-4 us) comes
on top; tools/host_overhead.py measures the whole on a GPU.

    PYTHONPATH=. python tools/host_overhead_cpu.py [--calls N]

It imports whichever cuflash PYTHONPATH finds, so the same script times an older checkout
(``git archive <commit> | tar -x -C /tmp/old; PYTHONPATH=/tmp/old python benchmarks/...``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
import types

import numpy as np


def _fake_cupy() -> types.ModuleType:
    """A module named ``cupy`` with the few entry points cuflash's launch path touches."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    runtime = types.SimpleNamespace(getDevice=lambda: 0, memsetAsync=lambda ptr, value, size, stream: None)
    driver = types.SimpleNamespace(launchKernel=lambda *args: None, funcSetAttribute=lambda *args: None,
                                   CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8)
    heap = [1 << 30]

    class MemoryPointer:
        __slots__ = ("ptr", "device_id")

        def __init__(self, nbytes: int):
            self.ptr, self.device_id = heap[0], 0
            heap[0] += -(-max(nbytes, 1) // 512) * 512

    class Device:
        def __init__(self, device_id: int = 0):
            self.id = device_id
            self.compute_capability = "90"
            self.attributes = {"MultiProcessorCount": 132}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class ndarray:  # noqa: N801 (CuPy's name)
        def __init__(self, shape, dtype, strides=None):
            self.shape = shape = tuple(shape)
            self.dtype = dtype = dtypes.get(dtype) or np.dtype(dtype)
            self.itemsize = itemsize = dtype.itemsize
            self.strides = strides or (tuple(math.prod(shape[i + 1:]) * itemsize for i in range(len(shape)))
                                       if len(shape) != 4 else  # the common case, as cheaply as CuPy does it
                                       (shape[1] * shape[2] * shape[3] * itemsize, shape[2] * shape[3] * itemsize,
                                        shape[3] * itemsize, itemsize))
            self.data = MemoryPointer(math.prod(shape) * itemsize)
            self.device = device

    dtypes = {np.float16: np.dtype(np.float16), np.float32: np.dtype(np.float32), np.int32: np.dtype(np.int32)}
    device = Device(0)
    ndarray.__module__ = "cupy._core.core"
    stream = types.SimpleNamespace(ptr=0)
    cuda.Device, cuda.runtime, cuda.driver = Device, runtime, driver
    cuda.get_current_stream = lambda: stream
    cuda.alloc = MemoryPointer
    cupy.cuda, cupy.ndarray = cuda, ndarray
    cupy.empty = lambda shape, dtype=np.float32: ndarray(shape, dtype)
    cupy.zeros = cupy.empty
    return cupy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()

    cupy = _fake_cupy()
    sys.modules["cupy"], sys.modules["cupy.cuda"] = cupy, cupy.cuda

    import cuflash
    from cuflash._core import kernels

    kernels.get_function = lambda choice, arch, device_id: types.SimpleNamespace(ptr=1)
    with contextlib.suppress(ImportError):  # versions with the sm90 family: the stand-in device is 9.0
        from cuflash._core import tma

        tma.encode_tiled = lambda args: bytes(128)  # the driver's encoder (once per new buffer, then cached)
    print(f"cuflash from {cuflash.__file__}; Python {sys.version.split()[0]}; {args.calls} calls per row")

    def tensor(shape, dtype=np.float16):
        return cupy.ndarray(shape, dtype)

    q, k, v = tensor((1, 128, 1, 64)), tensor((1, 128, 1, 64)), tensor((1, 128, 1, 64))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    kg = tensor((1, 128, 1, 64))
    qg = tensor((1, 128, 4, 64))
    out_g, lse_g = cuflash.attention(qg, kg, kg, causal=True, return_lse=True)
    packed = tensor((128, 2, 64))
    cu = cupy.ndarray((3,), np.int32)
    out_p, lse_p = cuflash.attention_varlen(packed, packed, packed, cu, cu, 64, 64, return_lse=True, validate=False)

    cases = {
        "attention": lambda: cuflash.attention(q, k, v),
        "attention causal, return_lse": lambda: cuflash.attention(q, k, v, causal=True, return_lse=True),
        "attention_backward": lambda: cuflash.attention_backward(out, q, k, v, out, lse),
        "attention_backward GQA 4:1": lambda: cuflash.attention_backward(out_g, qg, kg, kg, out_g, lse_g,
                                                                         causal=True),
        "attention_backward deterministic": lambda: cuflash.attention_backward(out, q, k, v, out, lse,
                                                                               deterministic=True),
        "attention_varlen (validate=False)": lambda: cuflash.attention_varlen(packed, packed, packed, cu, cu, 64, 64,
                                                                              validate=False),
        "attention_varlen_backward (validate=False)": lambda: cuflash.attention_varlen_backward(
            out_p, packed, packed, packed, out_p, lse_p, cu, cu, 64, 64, validate=False),
    }
    if hasattr(cuflash, "attention_with_kvcache"):  # a decoding step: 32/8 heads, d128, pages of 16, an append
        q1, new = tensor((1, 1, 32, 128)), tensor((1, 1, 8, 128))
        cache, table, lengths = tensor((64, 16, 8, 128)), cupy.ndarray((1, 16), np.int32), cupy.ndarray((1,), np.int32)
        cases["attention_with_kvcache (paged, append)"] = lambda: cuflash.attention_with_kvcache(
            q1, cache, cache, new, new, cache_seqlens=lengths, page_table=table, causal=True)
    for name, call in cases.items():
        call()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(args.calls // 5):
                call()
            best = min(best, (time.perf_counter() - start) / (args.calls // 5))
        print(f"{name:45s} {best * 1e6:7.2f} us per call (best of 5)")


if __name__ == "__main__":
    main()
