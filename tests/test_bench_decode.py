"""``python -m cuflash bench --mode decode``: its arguments, sweep, byte counting and report writing,
with synthetic timings (CPU); the quick run end to end on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cuflash.bench import decode as bd
from cuflash.cli.main import build_parser, main, mode_conflict
from cuflash._core.device import gpu_unavailable


def test_parser_takes_decode_batches_and_contexts():
    args = build_parser().parse_args(["bench", "--mode", "decode", "--quick", "--batches", "1,8", "--contexts",
                                      "4096", "--eager"])
    assert args.mode == "decode" and args.quick and args.batches == [1, 8] and args.contexts == [4096] and args.eager
    assert mode_conflict(args) is None


@pytest.mark.parametrize("argv, message", [
    (["--mode", "decode", "--head-dims", "64"], "--head-dims do not apply to --mode decode"),
    (["--mode", "decode", "--memory"], "--memory do not apply to --mode decode"),
    (["--batches", "8"], "--batches only apply to --mode decode"),
    (["--mode", "bwd", "--contexts", "1024"], "--contexts only apply to --mode decode"),
    (["--eager"], "--eager only apply to --mode decode"),
])
def test_options_of_another_mode_are_refused_before_the_gpu_check(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_parser_rejects_bad_contexts():
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--mode", "decode", "--contexts", "0"])
    assert exit_info.value.code == 2


def test_full_sweep_leaves_out_what_does_not_fit():
    sweep = bd.sweep(["cuflash", "sdpa-cudnn", "sdpa-flash"])
    shapes = list(dict.fromkeys(c.shape for c in sweep))
    # 2 head counts x 2 query counts x 4 batches x 4 contexts, less batch 256 at 128k (137 GB a copy).
    assert len(shapes) == 60 and len(sweep) == 60 * (2 * 3 + 2)
    assert bd.DecodeShape(1, 256, 131072, 32, 8) not in shapes and bd.DecodeShape(1, 64, 131072, 32, 8) in shapes
    assert {c.label for c in sweep} == {
        "cuflash 16-bit contiguous", "cuflash 16-bit page 16", "cuflash 16-bit page 64", "cuflash e4m3 contiguous",
        "cuflash e4m3 page 16", "cuflash e4m3 page 64", "sdpa-cudnn", "sdpa-flash"}
    assert {(s.heads, s.heads_kv, s.head_dim) for s in shapes} == {(32, 8, 128), (64, 8, 128)}


def test_quick_sweep_and_overrides():
    quick = bd.sweep(["cuflash", "sdpa-cudnn"], quick=True)
    assert len(quick) == 4 * (2 * 2 + 1)
    assert {(c.shape.batch, c.shape.context, c.shape.seqlen_q) for c in quick} == {
        (1, 8192, 1), (1, 32768, 1), (64, 8192, 1), (64, 32768, 1)}
    only = bd.sweep(["cuflash"], quick=True, batches=[8], contexts=[1024])
    assert {(c.shape.batch, c.shape.context) for c in only} == {(8, 1024)} and len(only) == 4
    assert bd.sweep(["sdpa-flash"], max_case_bytes=0) == []


def test_bytes_read_counts_the_cache_and_the_appended_tokens():
    shape = bd.DecodeShape(seqlen_q=4, batch=2, context=1024, heads=32, heads_kv=8)
    kv_elements = 2 * 2 * 1024 * 8 * 128  # K and V, batch x context x kv heads x head_dim
    new_elements = 2 * 2 * 4 * 8 * 128  # k and v of 4 tokens per sequence
    assert bd.DecodeCase("cuflash", shape, "16-bit", 16).bytes_read() == 2 * kv_elements + 2 * new_elements
    assert bd.DecodeCase("cuflash", shape, "e4m3", 0).bytes_read() == kv_elements + 2 * new_elements
    assert bd.DecodeCase("sdpa-cudnn", shape).bytes_read() == 2 * kv_elements  # no append
    measured = bd.DecodeMeasurement(bd.DecodeCase("sdpa-cudnn", shape), ms=0.5)
    assert measured.gbps == pytest.approx(2 * kv_elements / 0.5e-3 / 1e9)
    assert bd.DecodeMeasurement(bd.DecodeCase("sdpa-cudnn", shape), None, "refused").gbps is None


def _synthetic_report() -> bd.DecodeReport:
    small, large = (bd.DecodeShape(1, 8, context, 32, 8) for context in (8192, 32768))
    ms = {("cuflash", "16-bit", 0): 1.0, ("cuflash", "16-bit", 64): 1.05, ("cuflash", "e4m3", 64): 0.5,
          ("sdpa-cudnn", "16-bit", 0): 1.5, ("sdpa-flash", "16-bit", 0): None}
    measurements = [bd.DecodeMeasurement(bd.DecodeCase(impl, shape, cache, page),
                                         None if t is None else t * shape.context / 8192,
                                         "" if t is not None else "RuntimeError: no kernel for GQA")
                    for shape in (small, large) for (impl, cache, page), t in ms.items()]
    return bd.DecodeReport(measurements, 4321.0, {"date": "2026-12-01", "device": "NVIDIA Synthetic GPU",
                                                  "driver": 13000},
                           command="python -m cuflash bench --mode decode --out results")


def test_markdown_table_has_gbps_ratios_copy_bandwidth_and_failures():
    text = bd.markdown_table(_synthetic_report())
    assert "device-to-device copy in the same run: 4,321 GB/s" in text
    assert f"each step timed as {bd.TIMING_GRAPH};" in text
    header = next(line for line in text.splitlines() if line.startswith("| q heads"))
    assert [c.strip() for c in header.strip("|").split("|")][4:] == [
        "cuflash 16-bit contiguous", "cuflash 16-bit page 64", "cuflash e4m3 page 64", "sdpa-cudnn", "sdpa-flash",
        "cuflash / sdpa-cudnn", "cuflash / sdpa-flash"]
    row = next(line for line in text.splitlines() if line.startswith("| 32 / 8 | 1 | 8 | 8192 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    cache_bytes = 2 * 8 * 8192 * 8 * 128 * 2 + 2 * 8 * 8 * 128 * 2
    assert cells[4] == f"{cache_bytes / 1e-3 / 1e9:,.0f}"
    assert cells[-3] == "n/a" and cells[-2] == "1.50" and cells[-1] == "n/a"
    assert "RuntimeError: no kernel for GQA" in text


def test_outputs_named_for_the_gpu_and_mode(tmp_path):
    pytest.importorskip("matplotlib")
    messages = bd.write_outputs(_synthetic_report(), tmp_path)
    text = (tmp_path / "synthetic-gpu-decode.md").read_text()
    assert text.startswith("# cuflash decode against a KV cache, NVIDIA Synthetic GPU\n")
    assert "Regenerate: `python -m cuflash bench --mode decode --out results`" in text
    assert "sdpa-cudnn: torch SDPA, CUDNN_ATTENTION backend (cuDNN)" in text
    assert "![GB/s against context](synthetic-gpu-decode.png)" in text
    data = json.loads((tmp_path / "synthetic-gpu-decode.json").read_text())
    assert data["copy_gbps"] == 4321.0 and len(data["measurements"]) == 10
    assert data["timing"] == bd.TIMING_GRAPH
    first = data["measurements"][0]
    assert first["label"] == "cuflash 16-bit contiguous" and first["gbps"] > 0 and first["bytes"] > 0
    assert (tmp_path / "synthetic-gpu-decode.png").read_bytes()[:4] == b"\x89PNG"
    assert "synthetic-gpu-decode.png" in messages[0]


def test_plot_skipped_with_a_message_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    messages = bd.write_outputs(_synthetic_report(), tmp_path)
    assert not (tmp_path / "synthetic-gpu-decode.png").exists()
    assert any("matplotlib is not installed" in m for m in messages)


def test_decode_bench_without_gpu_says_so(capsys):
    if gpu_unavailable() is None:
        pytest.skip("this machine has a GPU")
    assert main(["bench", "--mode", "decode", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [[], ["--eager"]], ids=["graph", "eager"])
def test_decode_bench_end_to_end(tmp_path, launch):
    result = subprocess.run([sys.executable, "-m", "cuflash", "bench", "--mode", "decode", "--quick", "--batches",
                             "2", "--contexts", "2048", "--repeats", "3", "--out", str(tmp_path), *launch],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    (table,) = tmp_path.glob("*-decode.md")
    for suffix in (".md", ".json"):
        assert table.with_suffix(suffix).stat().st_size > 0, suffix
    data = json.loads(table.with_suffix(".json").read_text())
    assert data["copy_gbps"] > 0
    assert data["timing"] == (bd.TIMING_EAGER if launch else bd.TIMING_GRAPH)
    ran = {m["label"]: m["gbps"] for m in data["measurements"]}
    assert all((ran[label] or 0) > 0 for label in ran if label.startswith("cuflash")), ran
