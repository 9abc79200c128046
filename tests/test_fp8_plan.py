"""The FP8 forward's launch policy and argument struct, without a GPU: each family's kernel (sm80's
where no tensor map fits), their shared memory, the descales folded into the struct or filled per
call, and the plan key's FP8 part. FwdParamsFp8's layout: tests/test_param_structs.py; an FP8
launch's struct: tests/test_forward_plan.py; the sm90 kernels' compile check:
tests/test_sm90_forward.py."""

from __future__ import annotations

import math

import pytest

from cuflash._core import dispatch, interop, params
from cuflash.cli import compile_check

FP8 = "float8_e4m3fn"


def _tensor(shape, dtype=FP8, ptr=1 << 20, strides=None):
    strides = strides or tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    itemsize = {FP8: 1, "float32": 4, "int32": 4}.get(dtype, 2)
    return interop.DeviceTensor(None, ptr, tuple(shape), strides, dtype, itemsize, 0)


def test_fp8_kernel_is_the_sm80_forward_with_e4m3_input():
    for out_dtype, elem in (("bfloat16", "bf16"), ("float16", "f16")):
        choice = dispatch.forward_kernel("sm80", 128, "causal", FP8, out_dtype=out_dtype)
        same_16bit = dispatch.forward_kernel("sm80", 128, "causal", out_dtype)
        # The 16-bit tiles plus the K and V staging bytes (rows of the 64-column-padded bucket).
        tile = dispatch.SM80_FWD_TILES[128]
        assert choice.smem_bytes == same_16bit.smem_bytes + 2 * tile.block_n * 128
        assert choice.name_expression == (same_16bit.name_expression[:-1] + ", cuflash::e4m3>").replace(
            f", {same_16bit.smem_bytes}, ", f", {choice.smem_bytes}, ")
        assert choice.name_expression.endswith(f"cuflash::{elem}, cuflash::e4m3>")
        assert choice.tile == same_16bit.tile and choice.blocks_slowest
    for family in dispatch.FAMILIES:
        with pytest.raises(ValueError, match="out_dtype"):
            dispatch.forward_kernel(family, 64, "none", FP8)
    with pytest.raises(ValueError, match="forward only"):
        dispatch.backward_kernels("sm80", 64, "none", FP8)


# (head-dim bucket, mask) -> the sm90 FP8 kernel's template arguments up to SMEM_BYTES: kernel head
# dim, consumers, block_n, stages, Q buffers.
SM90_FP8_ARGS = {
    (64, "causal"): (64, 3, 128, 4, 2),
    (64, "window"): (64, 3, 128, 4, 2),
    (96, "causal"): (128, 2, 128, 3, 2),
    (128, "causal"): (128, 2, 128, 3, 2),
    (128, "none"): (128, 2, 192, 2, 2),  # unmasked: the wide key blocks
    (192, "causal"): (192, 2, 128, 2, 2),
    (192, "none"): (192, 2, 128, 2, 2),
    (256, "window"): (256, 2, 64, 3, 2),
    (256, "none"): (256, 2, 64, 3, 2),
}


@pytest.mark.parametrize("bucket, mask", list(SM90_FP8_ARGS))
def test_sm90_fp8_kernel_template_arguments(bucket, mask):
    head_dim, consumers, block_n, stages, q_buffers = SM90_FP8_ARGS[bucket, mask]
    for out_dtype, elem in (("bfloat16", "bf16"), ("float16", "f16")):
        choice = dispatch.forward_kernel("sm90", bucket, mask, FP8, out_dtype=out_dtype)
        causal, window = mask == "causal", mask == "window"
        # One byte per element of Q (two buffers), K and V, and a stage of V's transpose per stage
        # (flash_fwd.cu, FwdSmem), plus the alignment slack.
        smem = (q_buffers * 64 * consumers + 3 * stages * block_n) * head_dim + 1024
        assert choice.smem_bytes == smem <= dispatch.SM90_SMEM_BYTES - dispatch.SM90_STATIC_SMEM_MARGIN
        assert choice.name_expression == (
            f"cuflash::sm90::flash_fwd_sm90<{head_dim}, {consumers}, {block_n}, {stages}, {q_buffers}, {smem}, "
            f"{str(causal).lower()}, {str(window).lower()}, false, cuflash::{elem}, cuflash::e4m3>")
        assert choice.family == "sm90" and choice.threads == 128 * (consumers + 1) and choice.blocks_slowest == causal
    # Whole 64-key panels of V's transpose, k32 steps of the e4m3 products.
    assert block_n % 64 == 0


def test_sm90_fp8_narrow_tiles_follow_the_16bit_rules():
    """d64 takes two consumers for softcap in the window kernel and for short causal calls."""
    for mask, softcap, short in (("window", True, False), ("causal", False, True)):
        assert dispatch.forward_kernel("sm90", 64, mask, FP8, softcap, short=short,
                                       out_dtype="bfloat16").tile == dispatch.SM90_FP8_NARROW_TILES[64]
    assert dispatch.forward_kernel("sm90", 64, "causal", FP8, out_dtype="bfloat16").tile.block_m == 192
    # Softcap keeps each mask's own kernel, as for 16-bit inputs.
    assert dispatch.forward_kernel("sm90", 128, "causal", FP8, True, out_dtype="bfloat16").name_expression.endswith(
        "true, false, true, cuflash::bf16, cuflash::e4m3>")


def test_fp8_runs_each_familys_kernel():
    q = _tensor((2, 4096, 8, 128))
    mask = dispatch.make_mask(False, (-1, -1), 0.0, 4096, 4096)
    for family in dispatch.FAMILIES:
        choice = dispatch.forward_choice(family, q, q, q, mask, 4096, "float16")
        assert choice == dispatch.forward_kernel(family, 128, "none", FP8, out_dtype="float16")
        assert choice.family == family
    # K broadcast over heads: no tensor map describes it, sm80's kernel reads it on an sm90 device.
    k = _tensor((2, 4096, 8, 128), strides=(4096 * 128, 128, 0, 1))
    assert dispatch.forward_choice("sm90", q, k, k, mask, 4096, "float16") == dispatch.forward_kernel(
        "sm80", 128, "none", FP8, out_dtype="float16")
    narrow = _tensor((2, 4096, 8, 72))
    for family in dispatch.FAMILIES:
        with pytest.raises(ValueError, match="q: FP8 inputs need a head_dim that is a multiple of 16"):
            dispatch.forward_choice(family, narrow, narrow, narrow, mask, 4096, "float16")


def test_every_fp8_instantiation_is_listed_after_the_16bit_kernels():
    # The KV cache and then the MLA kernels come last of all (test_kvcache_plan), after sm80's
    # backward kernels for a v head dim of its own, and around sm90's (192, 128) backward; the others
    # end with FP8's.
    kv = {c.name_expression for c in dispatch.kvcache_all_kernels()}
    mla = {c.name_expression for family in dispatch.FAMILIES for c in dispatch.mla_all_kernels(family)}
    mla |= {c.name_expression for c in dispatch.mla_tma_kernels() + dispatch.mla_narrow_kernels()}
    names = [c.name_expression for c in dispatch.all_kernels("sm80")
             if c.name_expression not in kv | mla and not compile_check.own_v_dim(c)]
    fp8 = [n for n in names if n.endswith("cuflash::e4m3>")]
    assert len(fp8) == len(dispatch.HEAD_DIM_BUCKETS) * len(dispatch.ELEMENT_TYPES) * 4
    assert names[-len(fp8):] == fp8
    # sm90's d64 ALiBi forwards (two consumers, window, no softcap) come last of all.
    alibi = {dispatch.forward_kernel("sm90", 64, "window", dtype, alibi=True, out_dtype=out).name_expression
             for dtype, out in [(d, None) for d in dispatch.ELEMENT_TYPES]
             + [(d, o) for d in dispatch.FP8_TYPES for o in dispatch.ELEMENT_TYPES]}
    names = [c.name_expression for c in dispatch.all_kernels("sm90")
             if c.name_expression not in mla | alibi
             and not c.name_expression.startswith("cuflash::sm90::flash_bwd_sm90<192, ")]
    fp8 = [n for n in names if n.endswith("cuflash::e4m3>")]
    # As for 16-bit inputs: kernel head dims x output dtypes x three masks x softcap or not, d64's
    # two-consumer causal (with and without softcap) and d128's unmasked short calls.
    assert len(fp8) == 4 * 2 * 3 * 2 + 2 * 2 + 2
    assert names[-len(fp8):] == fp8


def _fp8_struct(descales, softcap=0.0):
    q, k = _tensor((2, 300, 8, 64)), _tensor((2, 500, 2, 64), ptr=3 << 20)
    out, lse = _tensor((2, 300, 8, 64), "bfloat16"), _tensor((2, 8, 300), "float32")
    return params.pack_fwd_params_fp8(q, k, k, out, lse, 0.125, (-1, -1), softcap, None, None, descales)[0]


def test_scalar_descales_are_folded_into_the_struct():
    struct = _fp8_struct((0.5, 0.25, 3.0))
    assert struct["scale_log2"] == pytest.approx(0.125 * 0.5 * 0.25 * math.log2(math.e))
    assert struct["v_scale"] == pytest.approx(3.0)
    assert all(struct[name] == 0 for name in params.FWD_DESCALES)
    capped = _fp8_struct((0.5, 0.25, 1.0), softcap=20.0)
    # The descales scale the raw scores inside the tanh; the cap stays outside.
    assert capped["scale_log2"] == pytest.approx(20.0 * math.log2(math.e))
    assert capped["softcap_tanh_scale"] == pytest.approx(0.125 * 0.5 * 0.25 / 20.0)


def test_descale_arrays_keep_their_strides_and_the_scalar_scale():
    per_head = _tensor((2, 2), "float32", ptr=7 << 20)
    transposed = _tensor((2, 2), "float32", ptr=8 << 20, strides=(1, 2))
    struct = _fp8_struct((per_head, 2.0, transposed))
    assert (struct["descale_q_batch_stride"], struct["descale_q_head_stride"]) == (2, 1)
    assert (struct["descale_v_batch_stride"], struct["descale_v_head_stride"]) == (1, 2)
    assert (struct["descale_k_batch_stride"], struct["descale_k_head_stride"]) == (0, 0)
    assert struct["scale_log2"] == pytest.approx(0.125 * 2.0 * math.log2(math.e))
    assert struct["v_scale"] == 1.0
