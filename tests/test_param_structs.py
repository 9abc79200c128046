"""Every kernel argument struct against its host mirror, without a GPU or a compiler: the NumPy
dtype's size equals the size cuflash/_core/params.py names it by and the size its CUDA source
static_asserts (read from the source text), and the fields whose offsets C's layout rules decide
(inheritance, tensor maps' 64-byte alignment, padding) sit where C puts them."""

from __future__ import annotations

import re

import pytest

from cuflash._core import kernels, params

# C struct: (its NumPy mirror, the host's size constant).
STRUCTS = {
    "FwdParams": (params.FWD_PARAMS, params.FWD_PARAMS_SIZE),
    "FwdParamsFp8": (params.FWD_PARAMS_FP8, params.FWD_PARAMS_FP8_SIZE),
    "FwdParamsPaged": (params.FWD_PARAMS_PAGED, params.FWD_PARAMS_PAGED_SIZE),
    "FwdParamsSm90": (params.FWD_PARAMS_SM90, params.FWD_PARAMS_SM90_SIZE),
    "FwdParamsSm90Of<FwdParamsFp8>": (params.FWD_PARAMS_SM90_FP8, params.FWD_PARAMS_SM90_FP8_SIZE),
    "BwdParams": (params.BWD_PARAMS, params.BWD_PARAMS_SIZE),
    "BwdParamsSm90": (params.BWD_PARAMS_SM90, params.BWD_PARAMS_SM90_SIZE),
    "ConvertParams": (params.CONVERT_PARAMS, params.CONVERT_PARAMS_SIZE),
    "KvParams": (params.KV_PARAMS, params.KV_PARAMS_SIZE),
    "CombineParams": (params.COMBINE_PARAMS, params.COMBINE_PARAMS_SIZE),
    "MergeParams": (params.MERGE_PARAMS, params.MERGE_PARAMS_SIZE),
    "MlaParams": (params.MLA_PARAMS, params.MLA_PARAMS_SIZE),
    "MlaParamsTma": (params.MLA_PARAMS_TMA, params.MLA_PARAMS_TMA_SIZE),
    "QuantizeArgs": (params.QUANTIZE_ARGS, params.QUANTIZE_ARGS_SIZE),
}
# The driver's CUtensorMap, asserted in sm90/tma.cuh: a field of the sm90 structs, not an argument.
NOT_ARGUMENTS = {"TensorMap"}
_SIZE_ASSERT = re.compile(r"static_assert\(sizeof\(([\w<>, ]+?)\) == (\d+)")


def asserted_sizes() -> dict[str, int]:
    """The size of every struct a `static_assert(sizeof(S) == N ...)` in cuda_src/ names."""
    found = {}
    for path in sorted(kernels.source_root().rglob("*")):
        if path.suffix in (".cu", ".cuh"):
            for name, size in _SIZE_ASSERT.findall(path.read_text()):
                assert name not in found, f"{name}: asserted twice"
                found[name] = int(size)
    return found


def test_every_asserted_struct_has_a_mirror():
    assert set(asserted_sizes()) - NOT_ARGUMENTS == set(STRUCTS)


@pytest.mark.parametrize("name", list(STRUCTS))
def test_mirror_size_is_the_kernels(name):
    dtype, size = STRUCTS[name]
    assert dtype.itemsize == size == asserted_sizes()[name]


def test_fwd_params_offsets():
    fields = params.FWD_PARAMS.fields
    assert fields["lse"][1] == 32 and fields["cu_seqlens_k"][1] == 48
    assert fields["seq_end_q"][1] == 56 and fields["seq_end_k"][1] == 64
    assert fields["sinks"][1] == 72 and fields["alibi_slopes"][1] == 80
    assert fields["q_batch_stride"][1] == 88 and fields["lse_head_stride"][1] == 192
    assert fields["alibi_batch_stride"][1] == 200
    assert fields["kv_group"][1] == 208 and fields["window_right"][1] == 228
    assert fields["softcap_tanh_scale"][1] == 236
    # Dropout's fields after head_dim_v (240), so that the ones above keep their offsets.
    assert fields["dropout_threshold"][1] == 244 and fields["dropout_scale"][1] == 248
    assert [fields[name][1] for name in params.DROPOUT_WORDS] == [256, 264, 272]


def test_derived_fwd_params_keep_the_base_offsets():
    # FwdParamsFp8 and FwdParamsPaged derive from FwdParams: its fields first, where they are in it.
    for derived in (params.FWD_PARAMS_FP8, params.FWD_PARAMS_PAGED):
        assert all(derived.fields[name][1] == offset for name, (_, offset) in params.FWD_PARAMS.fields.items())
    fields = params.FWD_PARAMS_FP8.fields
    assert [fields[name][1] for name in params.FWD_DESCALES] == [280, 288, 296]
    assert fields["v_scale"][1] == 352
    assert [params.FWD_PARAMS_PAGED.fields[name][1] for name in params.FWD_CACHE_POINTERS] == [280, 288, 296]


def test_bwd_and_convert_params_offsets():
    fields = params.BWD_PARAMS.fields
    assert fields["cu_seqlens_k"][1] == 112 and fields["alibi_slopes"][1] == 120
    assert fields["q_batch_stride"][1] == 128
    assert fields["accum_batch_rows"][1] == 336 and fields["alibi_batch_stride"][1] == 344
    assert fields["heads"][1] == 352
    assert fields["dq_splits"][1] == 372 and fields["window_right"][1] == 388
    assert fields["scale"][1] == 396 and fields["softcap_tanh_scale"][1] == 400
    assert fields["head_dim_v"][1] == 404
    assert fields["dropout_threshold"][1] == 408 and fields["dropout_scale"][1] == 412
    assert [fields[name][1] for name in params.DROPOUT_WORDS] == [416, 424, 432]
    fields = params.CONVERT_PARAMS.fields
    assert fields["batch"][1] == 72 and fields["group"][1] == 88 and fields["scale"][1] == 92


def test_sm90_forward_params_offsets():
    # Three 128-byte maps, then the base struct, then the persistent grid's four int32 tile counts
    # in the padding up to the next 64 bytes.
    for dtype, base, counts in ((params.FWD_PARAMS_SM90, params.FWD_PARAMS, [664, 668, 672, 676]),
                                (params.FWD_PARAMS_SM90_FP8, params.FWD_PARAMS_FP8, [744, 748, 752, 756])):
        fields = dtype.fields
        assert [fields[name][1] for name in ("q", "k", "v", "base")] == [0, 128, 256, 384]
        assert fields["base"][0] == base
        assert [fields[name][1] for name in ("m_blocks", "heads", "batches", "tiles")] == counts


def test_sm90_backward_params_offsets():
    # Four 128-byte maps, then BwdParams.
    fields = params.BWD_PARAMS_SM90.fields
    assert [fields[name][1] for name in ("q", "k", "v", "dout", "base")] == [0, 128, 256, 384, 512]
    assert fields["base"][0] == params.BWD_PARAMS


def test_mla_tma_params_offsets():
    # Two 128-byte maps, then MlaParams.
    fields = params.MLA_PARAMS_TMA.fields
    assert [fields[name][1] for name in ("kv_cache", "kv_rope", "base")] == [0, 128, 256]
    assert fields["base"][0] == params.MLA_PARAMS
