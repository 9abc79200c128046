"""Dropout's device header (cuda_src/common/philox.cuh) against its NumPy twin
(cuflash/_cpu/philox.py). tests/cuda/dropout_check.cu writes, one warp per 16 x 16 tile, the keep
mask as keep_rows (rows = queries: both forwards, sm80's backward), keep_keys (rows = keys: sm90's
backward, with its lane swap) and drop_rows (the forward's zeroing) give it. On the CPU it compiles
with cuflash's NVRTC options for sm_80 and sm_90a; on a GPU all three masks must equal
philox.keep_mask bit for bit."""

from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path

import numpy as np
import pytest

from cuflash._core import kernels, nvrtc
from cuflash._cpu import philox

SOURCE = Path(__file__).resolve().parent / "cuda" / "dropout_check.cu"
EXPRESSION = "cuflash::dropout_check::masks"
# Mirrors dropout_check.cu's Params.
PARAMS = np.dtype([("seed", np.uint64), ("offset", np.uint64), ("by_rows", np.uint64), ("by_keys", np.uint64),
                   ("dropped", np.uint64), ("rows", np.int32), ("cols", np.int32), ("batch", np.int32),
                   ("heads", np.int32), ("head", np.int32), ("threshold", np.uint32)], align=True)


@functools.lru_cache(maxsize=None)
def compiled(arch: str) -> nvrtc.CompiledProgram:
    return nvrtc.compile_program(SOURCE.read_text(), SOURCE.name, kernels._options(arch), [EXPRESSION])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_header_compiles_without_spills(arch):
    program = compiled(arch)
    assert program.cubin[:4] == b"\x7fELF" and EXPRESSION in program.lowered_names
    assert "warning" not in program.log.lower(), program.log
    assert set(re.findall(r"(\d+) bytes spill (?:stores|loads)", program.log)) == {"0"}, program.log


@pytest.mark.gpu
@pytest.mark.parametrize("seed, offset, p, rows, cols, batch, heads, head", [
    (0, 0, 0.5, 16, 16, 0, 1, 0),
    (2024, 7, 0.1, 113, 67, 3, 8, 5),  # partial tiles at both ends
    (2**64 - 1, 2**64 - 2, 0.9, 64, 200, 1, 2, 1),  # the offset's 64 bits wrap
    (0x123456789ABCDEF, 2**32 - 1, 0.37, 48, 48, 2**20, 16, 15),
])
def test_every_layout_draws_the_cpu_mask(seed, offset, p, rows, cols, batch, heads, head):
    import cupy as cp
    from cupy.cuda import driver

    capability = int(cp.cuda.Device().compute_capability)
    arch = "sm_90a" if capability // 10 == 9 else "sm_80"
    module = cp.cuda.function.Module()
    module.load(compiled(arch).cubin)
    function = module.get_function(compiled(arch).lowered_names[EXPRESSION])
    outputs = [cp.full((rows, cols), 0xAB, cp.uint8) for _ in range(3)]  # poisoned: neither 0 nor 1
    params = np.zeros(1, PARAMS)
    params["seed"], params["offset"] = seed, offset
    params["by_rows"], params["by_keys"], params["dropped"] = (x.data.ptr for x in outputs)
    params["rows"], params["cols"], params["batch"], params["heads"], params["head"] = rows, cols, batch, heads, head
    params["threshold"] = philox.keep_threshold(p)
    argument = (ctypes.c_void_p * 1)(params.ctypes.data)
    stream = cp.cuda.get_current_stream()
    driver.launchKernel(function.ptr, -(-rows // 16), -(-cols // 16), 1, 32, 1, 1, 0, stream.ptr,
                        ctypes.addressof(argument), 0)
    stream.synchronize()
    expected = philox.keep_mask(seed, offset, p, heads, rows, cols, [batch])[0, head]
    for name, got in zip(("keep_rows", "keep_keys", "drop_rows"), outputs):
        wrong = cp.asnumpy(got) != expected
        assert not wrong.any(), f"{name}: {wrong.sum()} elements differ, first (row, key) {np.argwhere(wrong)[0]}"
