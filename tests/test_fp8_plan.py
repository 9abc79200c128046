"""The FP8 forward's launch policy and argument struct, without a GPU: the sm80 kernel on every
family, its shared memory, FwdParamsFp8's layout, the descales folded into it or filled per call,
and the plan key's FP8 part. An FP8 launch's struct: tests/test_forward_plan.py."""

from __future__ import annotations

import math

import pytest

from cuflash import checks, dispatch, interop, params, plan

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
    with pytest.raises(ValueError, match="out_dtype"):
        dispatch.forward_kernel("sm80", 64, "none", FP8)
    with pytest.raises(ValueError, match="family"):
        dispatch.forward_kernel("sm90", 64, "none", FP8, out_dtype="bfloat16")
    with pytest.raises(ValueError, match="forward only"):
        dispatch.backward_kernels("sm80", 64, "none", FP8)


def test_fp8_runs_sm80_on_the_sm90_family():
    q = _tensor((2, 4096, 8, 128))
    mask = dispatch.make_mask(False, (-1, -1), 0.0, 4096, 4096)
    choice = dispatch.forward_choice("sm90", q, q, q, mask, 4096, "float16")
    assert choice == dispatch.forward_kernel("sm80", 128, "none", FP8, out_dtype="float16")
    narrow = _tensor((2, 4096, 8, 72))
    with pytest.raises(ValueError, match="q: FP8 inputs need a head_dim that is a multiple of 16"):
        dispatch.forward_choice("sm80", narrow, narrow, narrow, mask, 4096, "float16")


def test_every_fp8_instantiation_is_listed_after_the_16bit_kernels():
    # The KV cache kernels come last of all (test_kvcache_plan); the attention kernels end with FP8's.
    names = [c.name_expression for c in dispatch.all_kernels("sm80") if c.source != dispatch.KV_SOURCE]
    fp8 = [n for n in names if n.endswith("cuflash::e4m3>")]
    assert len(fp8) == len(dispatch.HEAD_DIM_BUCKETS) * len(dispatch.ELEMENT_TYPES) * 4
    assert names[-len(fp8):] == fp8
    assert not any(n.endswith("cuflash::e4m3>") for n in map(lambda c: c.name_expression,
                                                              dispatch.all_kernels("sm90")))


def test_fwd_params_fp8_layout():
    fields = params.FWD_PARAMS_FP8.fields
    assert params.FWD_PARAMS_FP8.itemsize == params.FWD_PARAMS_FP8_SIZE == 296
    # FwdParams' fields at their own offsets, then the descales (params.cuh: FwdParamsFp8 derives from it).
    assert all(fields[name][1] == offset for name, (_, offset) in params.FWD_PARAMS.fields.items())
    assert [fields[name][1] for name in params.FWD_DESCALES] == [216, 224, 232]
    assert fields["v_scale"][1] == 288


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


def test_fp8_key_holds_out_dtype_scalars_and_array_layouts():
    array = _tensor((2, 2), "float32", ptr=5 << 20)
    moved = array._replace(ptr=9 << 20)
    key = plan.fp8_key(checks.Fp8("bfloat16", array, 0.5, 1.0))
    assert key == plan.fp8_key(checks.Fp8("bfloat16", moved, 0.5, 1.0))  # pointers are filled per call
    assert key != plan.fp8_key(checks.Fp8("float16", array, 0.5, 1.0))
    assert key != plan.fp8_key(checks.Fp8("bfloat16", array, 0.25, 1.0))
    assert key != plan.fp8_key(checks.Fp8("bfloat16", array._replace(strides=(1, 2)), 0.5, 1.0))
