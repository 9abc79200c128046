"""mla_decode's checks and CPU path, and the --mode mla benchmark's sweep and table (no GPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash.bench import mla as bench_mla
from cuflash.cli.main import build_parser, mode_conflict
from cuflash._cpu.reference_kvcache import mla_decode_reference

D = 576


def case(rng, batch=2, seqlen_q=2, heads=4, page_size=16, lengths=(40, 7), head_dim=D):
    max_pages = 3
    kv = rng.standard_normal((batch * max_pages, page_size, 1, head_dim)).astype(np.float32)
    table = rng.permutation(batch * max_pages).astype(np.int32).reshape(batch, max_pages)
    q = rng.standard_normal((batch, seqlen_q, heads, head_dim)).astype(np.float32)
    return q, kv, table, np.asarray(lengths, np.int32)


def test_cpu_path_is_the_reference():
    rng = np.random.default_rng(0)
    q, kv, table, lengths = case(rng)
    out, lse = cuflash.mla_decode(q, kv, table, lengths, head_dim_v=500, return_lse=True)
    ref_out, ref_lse = mla_decode_reference(q, kv, table, lengths, head_dim_v=500)
    assert out.shape == (2, 2, 4, 500) and out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_cpu_path_takes_an_fp8_cache_as_bytes():
    rng = np.random.default_rng(1)
    q, kv, table, lengths = case(rng)
    kv8 = kv.astype(ml_dtypes.float8_e4m3fn)
    out = cuflash.mla_decode(q, kv8.view(np.uint8), table, lengths, dtype="e4m3", descale_kv=0.5)
    ref, _ = mla_decode_reference(q, kv8, table, lengths, descale_kv=0.5)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a | {"q": a["q"][0]}, ValueError, "q: expected 4 dims"),
    (lambda a: a | {"kv_cache": np.repeat(a["kv_cache"], 2, axis=2)}, ValueError, "kv_cache: .*one latent head"),
    (lambda a: a | {"kv_cache": a["kv_cache"][..., :512]}, ValueError, "kv_cache: head_dim 512 must equal"),
    (lambda a: a | {"kv_cache": a["kv_cache"].astype(np.float16)}, TypeError, "kv_cache: dtype float16"),
    (lambda a: a | {"head_dim_v": 600}, ValueError, "head_dim_v"),
    (lambda a: a | {"head_dim_v": 2.0}, TypeError, "head_dim_v"),
    (lambda a: a | {"num_splits": -1}, ValueError, "num_splits"),
    (lambda a: a | {"num_splits": True}, TypeError, "num_splits"),
    (lambda a: a | {"descale_kv": 2.0}, ValueError, "descale_kv: only taken with an FP8"),
    (lambda a: a | {"page_table": a["page_table"][:1]}, ValueError, "page_table: expected shape"),
    (lambda a: a | {"cache_seqlens": a["cache_seqlens"].astype(np.int64)}, TypeError, "cache_seqlens: expected int32"),
    (lambda a: a | {"cache_seqlens": np.array([49, 7], np.int32)}, ValueError, "cache_seqlens: entry 0"),
    (lambda a: a | {"page_table": np.full((2, 3), 6, np.int32)}, ValueError, "page_table: entry"),
    (lambda a: a | {"causal": "yes"}, TypeError, "causal"),
    *((lambda a, name=name: a | {name: None}, TypeError, f"{name}: expected a CuPy array")
      for name in ("q", "kv_cache", "page_table", "cache_seqlens")),
])
def test_bad_arguments_are_named(change, error, match):
    q, kv, table, lengths = case(np.random.default_rng(2))
    arguments = change({"q": q, "kv_cache": kv, "page_table": table, "cache_seqlens": lengths})
    with pytest.raises(error, match=match):
        cuflash.mla_decode(**arguments)


def test_bench_mode_mla_takes_its_own_sweep():
    args = build_parser().parse_args(["bench", "--mode", "mla", "--quick", "--batches", "16", "--contexts", "1024"])
    assert mode_conflict(args) is None
    assert "--mode decode and mla" in mode_conflict(build_parser().parse_args(["bench", "--mode", "mla", "--head-dims",
                                                                             "64"]))
    cases = bench_mla.sweep(True, [16], [1024])
    assert {c.heads for c in cases} == {16, 128} and all(c.batch == 16 and c.context == 1024 for c in cases)
    c = bench_mla.MlaCase(2, 16, 1024, 128, "e4m3")
    assert c.cache_bytes() == 16 * 1024 * 576 and c.flops() == 2 * 16 * 2 * 128 * 1024 * (576 + 512)


def test_bench_table_names_the_peers_and_rates():
    report = {"measurements": [{"cache": "16-bit", "seqlen_q": 1, "heads": 16, "batch": 64, "context": 4096,
                                "ms": 0.1, "GB/s": 3000.0, "TFLOP/s": 90.0},
                               {"cache": "e4m3", "seqlen_q": 1, "heads": 16, "batch": 64, "context": 4096,
                                "error": "RuntimeError: x"}],
              "copy_GB/s": 4200.0, "matmul_TFLOP/s": {"bf16 matmul": 800.0}, "flashmla_h800": bench_mla.FLASHMLA_H800,
              "timing": "t"}
    table = bench_mla.markdown_table(report)
    assert "| 16-bit | 1 | 16 | 64 | 4096 | 100.0 | 3000 | 90 |" in table and "RuntimeError: x" in table
    assert "4200 GB/s" in table and "bf16 matmul: 800 TFLOP/s" in table and "3000 GB/s, 660 TFLOP/s" in table


def test_split_form_is_the_single_array_attention():
    rng = np.random.default_rng(3)
    q, kv, table, lengths = case(rng, head_dim=40)
    out, lse = cuflash.mla_decode(q[..., :32], kv[..., :32], table, lengths, head_dim_v=32, q_rope=q[..., 32:],
                                  kv_rope_cache=kv[..., 32:], return_lse=True)
    ref_out, ref_lse = mla_decode_reference(q, kv, table, lengths, head_dim_v=32)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a | {"kv_rope_cache": None}, ValueError, "the split form takes both"),
    (lambda a: a | {"q_rope": a["q_rope"][:, :1]}, ValueError, "q_rope: expected q's"),
    (lambda a: a | {"kv_rope_cache": a["kv_rope_cache"][..., :4]}, ValueError, "kv_rope_cache: expected"),
    (lambda a: a | {"q_rope": a["q_rope"].astype(np.float64)}, TypeError, "q_rope: dtype float64"),
    (lambda a: a | {"head_dim_v": 16}, ValueError, "head_dim_v: in the split form"),
])
def test_split_form_bad_arguments_are_named(change, error, match):
    q, kv, table, lengths = case(np.random.default_rng(4), head_dim=40)
    arguments = change({"q": q[..., :32], "kv_cache": kv[..., :32], "page_table": table, "cache_seqlens": lengths,
                        "head_dim_v": 32, "q_rope": q[..., 32:], "kv_rope_cache": kv[..., 32:]})
    with pytest.raises(error, match=match):
        cuflash.mla_decode(**arguments)


@pytest.mark.parametrize("family,cache,page_size,max_pages,expected", [
    ("sm90", "bfloat16", 64, 40, True),      # a step is a page
    ("sm90", "float16", 256, 40, True),      # a step is a quarter page
    ("sm90", "bfloat16", 320, 1, True),      # one page per sequence: only its last step reaches past it
    ("sm90", "bfloat16", 100, 40, False),    # steps straddle pages
    ("sm90", "bfloat16", 32, 40, False),     # a step spans two pages
    ("sm90", "bfloat16", 48, 1, False),      # shorter than a step
    ("sm90", "float8_e4m3fn", 64, 40, False),  # widened in registers, by the threads
    ("sm80", "bfloat16", 64, 40, False),
])
def test_which_caches_load_by_tma(family, cache, page_size, max_pages, expected):
    from cuflash._core import dispatch

    dtype = "float16" if cache == "float16" else "bfloat16"
    assert dispatch.mla_tma(family, dtype, cache, page_size, max_pages) is expected
    choice = dispatch.mla_kernel(family, dtype, cache, expected)
    assert (choice.name_expression.startswith(dispatch.MLA_TMA_KERNEL + "<")) is expected
    assert choice.smem_bytes == dispatch.mla_smem_bytes(family, expected)


@pytest.mark.parametrize("tma,rows,keys_per_split,expected", [
    (True, 16, 1024, 16),
    (True, 12, 4096, 16),
    (True, 16, 1023, 0),     # too few keys a split: the 64-row tile's shared steps are shorter
    (True, 24, 8192, 32),
    (True, 32, 8191, 0),
    (True, 33, 1 << 20, 0),  # more rows than wgmma's N takes here
    (False, 16, 1 << 20, 0),  # the threads' loads keep the 64-row tile
])
def test_which_calls_take_the_transposed_kernel(tma, rows, keys_per_split, expected):
    from cuflash._core import dispatch

    assert dispatch.mla_narrow_rows(tma, rows, keys_per_split) == expected
    choice = dispatch.mla_kernel("sm90", "bfloat16", "bfloat16", tma, expected)
    assert choice.name_expression.startswith(dispatch.MLA_NARROW_KERNEL + "<") is bool(expected)
    if expected:
        assert choice.smem_bytes == dispatch.mla_narrow_smem_bytes(expected) <= 227 * 1024


@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
def test_tma_argument_maps_the_cache_and_the_rope(split):
    """The rope map describes the split form's own array, or the cache again; boxes of a step's rows."""
    from types import SimpleNamespace

    from cuflash._core.params import MLA_PARAMS_TMA, MLA_POINTERS, mla_tma_argument, pack_mla_params

    def tensor(dim):  # what tma_view reads of a DeviceTensor: (pages, page_size, 1, dim), contiguous
        return SimpleNamespace(shape=(10, 64, 1, dim), strides=(64 * dim, dim, dim, 1), itemsize=2, dtype="bfloat16")
    cache, rope = tensor(512 if split else 576), tensor(64) if split else None
    ints = dict.fromkeys(("batch", "seqlen_q", "heads", "page_size", "max_pages", "num_splits", "row_tiles",
                          "causal"), 1)
    argument = mla_tma_argument(pack_mla_params((0,) * 13, ints, 1.0), cache, rope, 64)
    offsets = [8 + MLA_PARAMS_TMA.fields[name][1] for name in ("kv_cache", "kv_rope")]
    pointers = [MLA_POINTERS.index("kv_cache"), MLA_POINTERS.index("kv_rope" if split else "kv_cache")]
    assert [(offset, index) for offset, index, _ in argument._maps] == list(zip(offsets, pointers))
    rows = [encode.args[3] for _, _, encode in argument._maps]
    assert rows == [64, 64] and argument._maps[1][2].args[0][-1] == (64 if split else 576)
