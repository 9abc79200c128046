"""The bench CLI's arguments, FLOP counting and report writing, with synthetic timings (CPU);
``python -m cuflash bench --quick`` end to end on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cuflash.bench import attention as bench
from cuflash.cli.main import build_parser, main
from cuflash._core.device import gpu_unavailable


def test_parser_defaults_and_quick():
    args = build_parser().parse_args(["bench"])
    assert args.dtype == "bfloat16" and args.causal == "both" and args.mode == "fwd"
    assert args.head_dims is None and args.seqlens is None and not args.memory
    args = build_parser().parse_args(["bench", "--quick", "--head-dims", "64,128", "--seqlens", "512 2048"])
    assert args.quick and args.head_dims == [64, 128] and args.seqlens == [512, 2048]


@pytest.mark.parametrize("argv", [["bench", "--head-dims", "60"], ["bench", "--head-dims", "264"],
                                  ["bench", "--seqlens", "0"], ["bench", "--seqlens", "1k"],
                                  ["bench", "--dtype", "float32"], ["bench", "--impls", "flash3"]])
def test_parser_rejects(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2


def test_bench_without_gpu_says_so(capsys):
    if gpu_unavailable() is None:
        pytest.skip("this machine has a GPU")
    assert main(["bench", "--quick", "--mode", "fwd_bwd"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_sweep_cases_and_flops():
    sweep = bench.cases("bfloat16", [64, 128], [1024, 4096], "both")
    assert len(sweep) == 8 and sweep[0] == bench.Case("bfloat16", 64, 1024, False)
    case = bench.Case("bfloat16", 128, 16384, False)
    assert (case.batch, case.heads) == (1, 16)
    assert case.flops() == 4 * 1 * 16 * 16384 * 16384 * 128
    assert bench.Case("bfloat16", 128, 16384, True).flops() == case.flops() / 2
    assert bench.cases("float16", [64], [512], "yes") == [bench.Case("float16", 64, 512, True)]
    assert bench.Case("bfloat16", 128, 16384, False, "bwd").flops() == 2.5 * case.flops()
    assert bench.Case("bfloat16", 128, 16384, False, "fwd_bwd").flops() == 3.5 * case.flops()
    assert bench.cases("bfloat16", [64], [512], "no", "bwd")[0].mode == "bwd"
    assert build_parser().parse_args(["bench", "--mode", "fwd_bwd"]).mode == "fwd_bwd"


def _synthetic_report() -> bench.Report:
    fast, slow = bench.Case("bfloat16", 128, 1024, False), bench.Case("bfloat16", 128, 4096, True)
    ms = {"cuflash": 1.0, "sdpa-flash": 1.25, "sdpa-cudnn": 0.5}
    measurements = [bench.Measurement(name, case, t * (4 if case is slow else 1))
                    for case in (fast, slow) for name, t in ms.items()]
    measurements.append(bench.Measurement("standard", fast, None, "OutOfMemoryError: synthetic"))
    return bench.Report(measurements, {"date": "2026-11-30", "device": "NVIDIA Synthetic GPU", "driver": 13000,
                                       "cuDNN": 91900},
                        [{"kernel": "k<128>", "arch": "sm_90", "cold_compile_s": 0.4, "warm_load_ms": 2.5}],
                        command="python -m cuflash bench --out results")


def test_markdown_table_has_ratios_failures_and_compile_times():
    text = bench.markdown_table(_synthetic_report())
    row = next(line for line in text.splitlines() if line.startswith("| bfloat16 | 128 | no | 1024"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    tflops = bench.Case("bfloat16", 128, 1024, False).flops() / 1e-3 / 1e12
    assert cells[4] == f"{tflops:.1f}" and cells[-2] == "1.25" and cells[-1] == "0.50"
    assert "n/a" in cells  # the failed standard run
    assert "OutOfMemoryError: synthetic" in text and "cold NVRTC compile 0.40 s" in text


def test_results_file_names_its_command_date_gpu_versions_and_peers():
    report = _synthetic_report()
    assert bench.file_stem(report) == "synthetic-gpu-fwd"
    text = bench.markdown_document(report)
    assert text.startswith("# cuflash forward, NVIDIA Synthetic GPU\n")
    assert "Regenerate: `python -m cuflash bench --out results`" in text
    assert "Measured 2026-11-30 on NVIDIA Synthetic GPU; CUDA driver 13.0, cuDNN 9.19.0." in text
    assert "sdpa-cudnn: torch SDPA, CUDNN_ATTENTION backend (cuDNN)" in text
    assert "standard: standard attention in CuPy" in text
    assert bench.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert "| bfloat16 | 128 | no | 1024 |" in text and "![TFLOP/s against seqlen](synthetic-gpu-fwd.png)" in text


def test_table_title_names_the_mode():
    case = bench.Case("bfloat16", 64, 1024, True, "bwd")
    report = bench.Report([bench.Measurement("cuflash", case, 2.0)], {"device": "Synthetic GPU"})
    assert bench.markdown_table(report).startswith("Backward TFLOP/s")


def test_json_and_plot_written(tmp_path):
    pytest.importorskip("matplotlib")
    messages = bench.write_outputs(_synthetic_report(), tmp_path)
    data = json.loads((tmp_path / "synthetic-gpu-fwd.json").read_text())
    assert {m["impl"] for m in data["measurements"]} == {"cuflash", "sdpa-flash", "sdpa-cudnn", "standard"}
    assert data["measurements"][0]["tflops"] > 0 and data["environment"]["device"] == "NVIDIA Synthetic GPU"
    assert data["command"] == "python -m cuflash bench --out results"
    assert (tmp_path / "synthetic-gpu-fwd.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "synthetic-gpu-fwd.md").read_text().startswith("# cuflash forward")
    assert "synthetic-gpu-fwd.png" in messages[0]


def test_plot_skipped_with_a_message_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    messages = bench.write_outputs(_synthetic_report(), tmp_path)
    assert not (tmp_path / "synthetic-gpu-fwd.png").exists()
    assert "![" not in (tmp_path / "synthetic-gpu-fwd.md").read_text()
    assert any("matplotlib is not installed" in m for m in messages)


def test_hbm_model():
    model = bench.hbm_model_bytes(seqlen=1024, head_dim=64, batch_heads=64 * 16, block_m=128)
    n, d, bh = 1024, 64, 64 * 16
    assert model["standard_bytes"] == (4 * n * d + 4 * n * n) * bh * 2
    assert model["tiled_bytes"] == (2 * n * d + 2 * n * d * 8) * bh * 2
    assert model["tiled_bytes"] < model["standard_bytes"]


def test_memory_table_reports_where_standard_stops_fitting():
    rows = [
        {"case": "scaling", "batch": 1, "heads": 8, "head_dim": 128, "seqlen": s, "standard_bytes": 1e9,
         "tiled_bytes": 1e8, "standard_ms": None if s > 2048 else 1.0, "cuflash_ms": 0.1,
         "standard_peak_bytes": None if s > 2048 else 2e9, "cuflash_peak_bytes": 1e7}
        for s in (1024, 2048, 4096, 8192)
    ]
    text = bench.memory_table(rows)
    assert "does not fit" in text and "no longer fits from seqlen 4096" in text


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_bench_quick_end_to_end(tmp_path, mode):
    result = subprocess.run([sys.executable, "-m", "cuflash", "bench", "--quick", "--repeats", "3",
                             "--mode", mode, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    (table,) = tmp_path.glob(f"*-{mode}.md")
    for suffix in (".md", ".json", ".png"):
        assert table.with_suffix(suffix).stat().st_size > 0, suffix
    assert f"Regenerate: `python -m cuflash bench --quick --repeats 3 --mode {mode} --out " in table.read_text()
    data = json.loads(table.with_suffix(".json").read_text())
    assert any(m["impl"] == "cuflash" and (m["tflops"] or 0) > 0 for m in data["measurements"])


def test_e4m3_sweep_is_forward_only(capsys):
    assert main(["bench", "--dtype", "e4m3", "--mode", "bwd"]) == 2
    assert "forward only" in capsys.readouterr().err


def test_e4m3_report_names_its_file_peers_and_matmul_rates():
    case = bench.Case("e4m3", 128, 4096, False)
    report = bench.Report([bench.Measurement("cuflash", case, 1.0), bench.Measurement("cudnn-fp8", case, 1.1),
                           bench.Measurement("cuflash-bf16", case, 2.0)],
                          {"date": "2026-12-03", "device": "NVIDIA H200"},
                          rates={"e4m3 matmul 8192^3 (torch._scaled_mm)": 1477.0})
    assert bench.file_stem(report) == "h200-fwd-e4m3"
    text = bench.markdown_table(report)
    row = next(line for line in text.splitlines() if line.startswith("| e4m3 | 128 | no | 4096"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-2:] == ["1.10", "2.00"]  # cuflash / cudnn-fp8, cuflash / cuflash-bf16
    assert "e4m3 matmul 8192^3 (torch._scaled_mm): 1477 TFLOP/s" in text
    assert "cuDNN's FP8 attention" in bench.markdown_document(report, with_plot=False)
