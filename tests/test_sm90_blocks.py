"""The sm90 building blocks (cuda_src/sm90/: mbarrier, TMA, wgmma; cuflash/_core/tma.py) on a GEMM.

tests/cuda/sm90_gemm_check.cu computes C = A * B^T (A 64 x K, B N x K, 16-bit; C fp32) on one
CTA: TMA loads with the 128-byte swizzle into a 2-stage mbarrier ring, wgmma from shared memory
(or A from registers), and a TMA store of every A stage back out. On the CPU: it compiles for
sm_90a with cuflash's NVRTC options, and the tensor-map arguments, their validation and the
parameter-struct layout are checked. On a compute-capability-9.x GPU: the maps are encoded by
the driver and C is compared with a float64 A * B^T.
"""

from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path

import numpy as np
import pytest

from cuflash._core import kernels, nvrtc, tma

SOURCE = Path(__file__).resolve().parent / "cuda" / "sm90_gemm_check.cu"
M, BLOCK_K, STAGES, THREADS = 64, 64, 2, 256
ELEMS = {"bfloat16": "cuflash::bf16", "float16": "cuflash::f16"}

# (dtype, N, A from registers, 3-D/4-D maps, setmaxnreg, B MN-major, A MN-major, K). Simplest
# first: with -x the first failure is the most telling one.
CASES = [
    (dtype, n, a_regs, False, False, False, False, 256)
    for a_regs in (False, True) for dtype in ("bfloat16", "float16") for n in (64, 128)
] + [
    ("bfloat16", 128, False, True, False, False, False, 256),  # A through a 3-D map, B through a 4-D BSHD-like map
    ("float16", 64, True, True, False, False, False, 256),
    ("bfloat16", 128, False, False, True, False, False, 256),  # producer / consumer register split
    ("bfloat16", 64, True, True, True, False, False, 256),
    ("bfloat16", 128, True, False, False, False, False, 1024),  # 16 k-blocks: each stage's barriers cycle 8 times
    ("float16", 64, False, False, False, False, False, 64),  # a single k-block
    # B stored K x N (N contiguous), read MN-major with imm-trans-b: how the sm90 forward reads V.
    ("bfloat16", 64, True, False, False, True, False, 256),
    ("float16", 128, True, False, False, True, False, 256),
    ("bfloat16", 128, True, False, True, True, False, 1024),
    # A stored K x M too, read MN-major with imm-trans-a: how the sm90 backward reads dS for dQ.
    ("bfloat16", 64, False, False, False, True, True, 256),
    ("float16", 64, False, False, True, True, True, 1024),
]


def case_id(case) -> str:
    dtype, n, a_regs, high_rank, setmaxnreg, b_mn, a_mn, k = case
    return (f"{'bf16' if dtype == 'bfloat16' else 'f16'}-n{n}-{'rs' if a_regs else 'ss'}-"
            f"{'4d' if high_rank else '2d'}{'-maxnreg' if setmaxnreg else ''}{'-bmn' if b_mn else ''}"
            f"{'-amn' if a_mn else ''}-k{k}")


def name_expression(dtype, n, a_regs, high_rank, setmaxnreg, b_mn, a_mn) -> str:
    flags = ", ".join("true" if f else "false" for f in (a_regs, high_rank, setmaxnreg, b_mn, a_mn))
    return f"cuflash::sm90_check::gemm_check<{n}, {flags}, {ELEMS[dtype]}>"


def smem_bytes(n: int) -> int:
    # Both stages of A and B, plus 1 KiB to round the dynamic window up to a 1024-byte boundary.
    return STAGES * (M + n) * BLOCK_K * 2 + 1024


@functools.lru_cache(maxsize=None)
def compiled() -> nvrtc.CompiledProgram:
    """Every instantiation the cases use, in one NVRTC program, with cuflash's options (the
    include root cuda_src/, -std=c++17, the ptxas report) for sm_90a."""
    expressions = sorted({name_expression(*case[:7]) for case in CASES})
    return nvrtc.compile_program(SOURCE.read_text(), SOURCE.name, kernels._options("sm_90a"), expressions)


GEMM_CHECK_PARAMS = tma.param_dtype(
    [("a", tma.TENSOR_MAP), ("b", tma.TENSOR_MAP), ("a_copy", tma.TENSOR_MAP), ("c", np.uint64),
     ("status", np.uint64), ("k_blocks", np.int32), ("a_batch", np.int32), ("b_batch", np.int32),
     ("b_head", np.int32)]
)


# ---------------------------------------------------------------------------------------------
# CPU


def test_smoke_kernel_compiles_for_sm90a():
    program = compiled()
    assert program.cubin[:4] == b"\x7fELF"
    assert len(program.lowered_names) == len({name_expression(*case[:7]) for case in CASES})
    # No ptxas warning: a serialised wgmma pipeline or an ignored setmaxnreg (C7508) says so here.
    assert "warning" not in program.log.lower(), program.log
    # Every instantiation fits 256 threads on one SM (setmaxnreg ones report the consumers' 232),
    # without spills.
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", program.log)]
    assert len(registers) == len(program.lowered_names), program.log
    assert all(0 < r <= 65536 // THREADS for r in registers), program.log
    assert set(re.findall(r"(\d+) bytes spill (?:stores|loads)", program.log)) == {"0"}, program.log


def test_param_struct_layout_matches_the_kernel():
    # sm90_gemm_check.cu static_asserts 448 bytes, alignment 64, c at 384 and b_head at 412.
    fields = GEMM_CHECK_PARAMS.fields
    assert GEMM_CHECK_PARAMS.itemsize == 448
    assert [fields[n][1] for n in ("a", "b", "a_copy", "c", "status", "k_blocks", "b_head")] == \
        [0, 128, 256, 384, 392, 400, 412]
    # A tensor map after a smaller field moves to the next 64-byte boundary; the size rounds up to 64.
    mixed = tma.param_dtype([("n", np.int32), ("map", tma.TENSOR_MAP), ("x", np.float32)])
    assert mixed.fields["map"][1] == 64 and mixed.fields["x"][1] == 192 and mixed.itemsize == 256
    packed = np.zeros(1, GEMM_CHECK_PARAMS)
    packed["b"][0] = bytes(range(128))
    assert packed.tobytes()[128:256] == bytes(range(128))


def test_tiled_map_args_reverse_to_innermost_first():
    # A (64, 256) bf16 row-major matrix, box 64 x 64.
    args = tma.tiled_map_args(0x10000, (64, 256), (512, 2), "bfloat16", (64, 64))
    assert args.global_dim == (256, 64) and args.global_strides == (512,) and args.box_dim == (64, 64)
    assert args.element_strides == (1, 1) and args.data_type == 9 and args.swizzle == 3
    assert args.box_bytes == 8192
    # A BSHD tensor (batch 2, seqlen 300, heads 3, head_dim 128) with a head-dim slice of 64.
    shape, item = (2, 300, 3, 128), 2
    strides = (300 * 3 * 128 * item, 3 * 128 * item, 128 * item, item)
    args = tma.tiled_map_args(0x20000, shape, strides, np.float16, (1, 128, 1, 64))
    assert args.global_dim == (128, 3, 300, 2)
    assert args.global_strides == (256, 768, 230400)
    assert args.box_dim == (64, 1, 128, 1) and args.data_type == 6 and args.box_bytes == 16384


def test_tiled_map_args_of_e4m3_bytes():
    # e4m3 travels as UINT8 with the 64-byte swizzle: a 64-element box row is 64 bytes.
    args = tma.tiled_map_args(0x20000, (2, 300, 8, 128), (300 * 8 * 128, 8 * 128, 128, 1), "float8_e4m3fn",
                              (1, 128, 1, 64))
    assert (args.data_type, args.swizzle, args.itemsize) == (0, 2, 1)
    assert args.global_strides == (128, 8 * 128, 300 * 8 * 128) and args.box_bytes == 8192
    with pytest.raises(ValueError, match="stride 1 bytes"):
        tma.tiled_map_args(0x20000, (64, 256), (512, 2), "float8_e4m3fn", (64, 64))
    with pytest.raises(ValueError, match="64 bytes"):
        tma.tiled_map_args(0x20000, (64, 256), (256, 1), "float8_e4m3fn", (64, 128))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"dtype": "float32"}, "dtype"),
        ({"shape": (256,), "strides": (2,), "box": (64,)}, "dimensions"),
        ({"shape": (1,) * 5 + (256,), "strides": (512,) * 5 + (2,), "box": (1,) * 5 + (64,)}, "dimensions"),
        ({"strides": (512,)}, "one per dimension"),
        ({"address": 0x10008}, "16-byte"),
        ({"shape": (0, 256)}, "shape"),
        ({"strides": (512, 4)}, "contiguous"),
        ({"strides": (520, 2)}, "multiples of 16"),
        ({"strides": (1 << 40, 2)}, "2\\^40"),
        ({"box": (257, 64)}, "box"),
        ({"box": (64, 32)}, "128 bytes"),
        ({"box": (64, 128)}, "128 bytes"),
    ],
)
def test_tiled_map_args_validation(change, message):
    arguments = {"address": 0x10000, "shape": (64, 256), "strides": (512, 2), "dtype": "bfloat16",
                 "box": (64, 64)} | change
    with pytest.raises(ValueError, match=message):
        tma.tiled_map_args(**arguments)


# ---------------------------------------------------------------------------------------------
# GPU (compute capability 9.x)


@pytest.fixture(scope="module")
def hopper():
    import cupy as cp

    capability = cp.cuda.Device().compute_capability
    if not capability.startswith("9"):
        pytest.skip(f"sm_90a kernels need compute capability 9.x, this device is {capability}")
    program = compiled()
    module = cp.cuda.function.Module()
    module.load(program.cubin)
    return module, program.lowered_names


def _random(shape, dtype, rng):
    from cuflash.bench.attention import random_normal

    return random_normal(shape, dtype, seed=int(rng.integers(2**31)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gemm_check_matches_float64(hopper, case):
    import cupy as cp
    from cupy.cuda import driver

    from tests.gpu_reference import as_float64

    dtype, n, a_regs, high_rank, setmaxnreg, b_mn, a_mn, k = case
    rng = np.random.default_rng(abs(hash(case_id(case))) % 2**32)
    if high_rank:
        # A is slice a_batch of (2, 64, K); B is (batch, :, head) of a (2, N, 3, K) BSHD tensor.
        a_batch, b_batch, b_head = 1, 1, 2
        a_full, b_full = _random((2, M, k), dtype, rng), _random((2, n, 3, k), dtype, rng)
        a, b = a_full[a_batch], b_full[b_batch, :, b_head]
        a_box, b_box = (1, M, BLOCK_K), (1, n, 1, BLOCK_K)
    elif b_mn:
        # B is K x N row-major; the product is A B, so b (N x K as below) is its transpose. With
        # a_mn, A is stored K x M as well, so a (M x K) is its transpose.
        a_batch = b_batch = b_head = 0
        a_full = _random((k, M), dtype, rng) if a_mn else _random((M, k), dtype, rng)
        b_full = _random((k, n), dtype, rng)
        a, b = (a_full.T if a_mn else a_full), b_full.T
        a_box, b_box = ((BLOCK_K, M) if a_mn else (M, BLOCK_K)), (BLOCK_K, 64)
    else:
        a_batch = b_batch = b_head = 0
        a_full, b_full = _random((M, k), dtype, rng), _random((n, k), dtype, rng)
        a, b = a_full, b_full
        a_box, b_box = (M, BLOCK_K), (n, BLOCK_K)
    # Poison the outputs: all-ones bits are a NaN in float16 and bfloat16.
    a_copy = cp.empty_like(a_full)
    a_copy.view(cp.uint16).fill(0xFFFF)
    c = cp.full((M, n), cp.nan, dtype=cp.float32)
    status = cp.zeros(1, dtype=cp.int32)

    def encode(x, box):
        return tma.encode_tiled(tma.tiled_map_args(x.data.ptr, x.shape, x.strides, dtype, box))

    params = np.zeros(1, GEMM_CHECK_PARAMS)
    params["a"][0], params["b"][0], params["a_copy"][0] = (
        encode(a_full, a_box), encode(b_full, b_box), encode(a_copy, a_box))
    params["c"], params["status"], params["k_blocks"] = c.data.ptr, status.data.ptr, k // BLOCK_K
    params["a_batch"], params["b_batch"], params["b_head"] = a_batch, b_batch, b_head

    module, lowered = hopper
    function = module.get_function(lowered[name_expression(dtype, n, a_regs, high_rank, setmaxnreg, b_mn, a_mn)])
    driver.funcSetAttribute(function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes(n))
    argument = (ctypes.c_void_p * 1)(params.ctypes.data)
    stream = cp.cuda.get_current_stream()
    driver.launchKernel(function.ptr, 1, 1, 1, THREADS, 1, 1, smem_bytes(n), stream.ptr,
                        ctypes.addressof(argument), 0)
    stream.synchronize()

    code = int(status.get()[0])
    assert code == 0, (f"a wait timed out: {'producer on empty' if code < 200 else 'consumer on full'}"
                       f" barrier at k-block {code % 100}")
    # TMA load then TMA store, both 128-byte swizzled: the A tile comes back bit for bit.
    copied, stored = (a_copy[a_batch], a_full[a_batch]) if high_rank else (a_copy, a_full)
    wrong = cp.asnumpy(copied.view(cp.uint16) != stored.view(cp.uint16))
    assert not wrong.any(), f"a_copy differs at {wrong.sum()} elements, first (row, k) {np.argwhere(wrong)[0]}"

    # Products of 16-bit floats are exact in fp32, so the only error is fp32 accumulation over K
    # terms: at most (K - 1) rounding errors of at most 2^-24 (2^-23 if the tensor cores truncate)
    # of the running |sum|, bounded by K * 2^-23 * sum_k |a_mk b_nk|. A layout error is O(|C|).
    a64, b64 = as_float64(a), as_float64(b)
    expected = a64 @ b64.T
    bound = k * 2.0**-23 * (cp.abs(a64) @ cp.abs(b64).T)
    got = c.astype(cp.float64)
    assert bool(cp.isfinite(got).all()), f"C has {int((~cp.isfinite(got)).sum())} unwritten (NaN) elements"
    error = cp.abs(got - expected)
    bad = cp.asnumpy(error > bound)
    assert not bad.any(), (
        f"C differs at {bad.sum()} of {bad.size} elements, first (row, col) {np.argwhere(bad)[0]}; "
        f"max error {float(error.max()):.3e}, max |C| {float(cp.abs(expected).max()):.3e}")
