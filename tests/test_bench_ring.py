"""python -m cuflash bench --mode ring without GPUs: the sweep, the FLOP count, the options that do
not go with it, and the whole harness run on two CPU processes over gloo (tiny shapes), its
table and files."""

from __future__ import annotations

import json

import pytest

from cuflash.bench import ring as bench_ring
from cuflash.cli.main import build_parser, mode_conflict
from cuflash._cpu.reference import attention_flops

pytest.importorskip("torch", reason="torch is not installed (pip install torch, a CPU build is enough)")


def test_sweep_and_flops():
    cases = bench_ring.sweep()
    assert [(c.total, c.causal) for c in cases[:2]] == [(131072, False), (131072, True)]
    assert {c.total for c in bench_ring.sweep(quick=True, causal="yes")} == {131072}
    case = bench_ring.RingCase(4096, True)
    assert case.heads * case.head_dim == 2048
    assert case.flops("fwd_bwd") == attention_flops(1, 16, 4096, 4096, 128, causal=True, mode="fwd_bwd")


@pytest.mark.parametrize("argv, words", [
    (["bench", "--mode", "ring", "--memory"], "--memory do not apply to --mode ring"),
    (["bench", "--mode", "ring", "--head-dims", "64"], "--head-dims do not apply to --mode ring"),
    (["bench", "--mode", "fwd", "--ranks", "2"], "--ranks only applies to --mode ring"),
    (["bench", "--mode", "ring", "--batches", "4"], "--batches only apply to --mode decode and mla"),
])
def test_options_that_do_not_go_with_ring(argv, words):
    assert words in mode_conflict(build_parser().parse_args(argv))


def test_ring_options_are_accepted():
    args = build_parser().parse_args(["bench", "--mode", "ring", "--ranks", "2", "--seqlens", "65536", "--quick"])
    assert mode_conflict(args) is None and args.ranks == 2 and args.seqlens == [65536]


def test_harness_on_two_cpu_processes(tmp_path):
    cases = [bench_ring.RingCase(16, True, heads=2, head_dim=64)]
    report = bench_ring.run(cases, ranks=2, repeats=1, command="test", device="cpu")
    rows = report["measurements"]
    assert [(r["mode"], r["ranks"]) for r in rows] == [("fwd", 2), ("fwd_bwd", 2)]
    for row in rows:
        for key in ("ring ms", "ulysses ms", "ring without transfers ms", "one GPU ms", "ring speedup",
                    "exposed transfer ms", "ring TFLOP/s per GPU"):
            assert row[key] >= 0, key
    table = bench_ring.markdown_table(report)
    assert "| 16 | yes | fwd |" in table and "exposed" in table
    written = bench_ring.write_outputs(report, tmp_path)
    assert written == [f"wrote {tmp_path / 'gpu-ring.md'}", f"wrote {tmp_path / 'gpu-ring.json'}"]
    assert json.loads((tmp_path / "gpu-ring.json").read_text())["ranks"] == 2


def test_heads_the_ranks_do_not_divide_are_reported_not_fatal():
    cases = [bench_ring.RingCase(12, False, heads=3, head_dim=64)]
    report = bench_ring.run(cases, ranks=2, repeats=1, device="cpu")
    row = report["measurements"][0]
    assert "ring ms" in row and "ulysses ms" not in row and "divide the query heads" in row["ulysses error"]
    assert "| error |" in bench_ring.markdown_table(report)
