"""python -m cuflash bench --mode serving: its sweep, report, verdicts and options without a GPU; its
calls on a GPU at small shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash.bench import serving as bs
from cuflash.cli.main import build_parser, main, mode_conflict

ROOT = Path(__file__).resolve().parents[1]


def test_cases():
    assert [(c.mode, c.context) for c in bs.sweep()] == [("mixed", 4096), ("mixed", 16384), ("mixed", 32768),
                                                          ("prefix", 32768)]
    assert [(c.mode, c.context) for c in bs.sweep(quick=True)] == [("mixed", 4096), ("mixed", 32768),
                                                                    ("prefix", 32768)]


def _synthetic() -> bs.ServingReport:
    mixed, long, prefix = bs.ServingCase("mixed", 4096), bs.ServingCase("mixed", 32768), bs.ServingCase("prefix",
                                                                                                       32768)
    found = [bs.ServingMeasurement("cuflash vllm", mixed, 1.0), bs.ServingMeasurement("cuflash split", mixed, 1.1),
             bs.ServingMeasurement("sdpa per sequence", mixed, None, "RuntimeError: no kernel"),
             bs.ServingMeasurement("cuflash vllm", long, 2.2), bs.ServingMeasurement("cuflash split", long, 2.0),
             bs.ServingMeasurement("sdpa per sequence", long, 9.0),
             bs.ServingMeasurement("per sequence", prefix, 3.0), bs.ServingMeasurement("cascade", prefix, 0.25)]
    return bs.ServingReport(found, {"date": "2026-12-08", "device": "NVIDIA Synthetic GPU"},
                            command="python -m cuflash bench --mode serving")


def test_ratios_verdicts_and_tables():
    report = _synthetic()
    assert report.ratio(bs.ServingCase("mixed", 4096)) == pytest.approx(1 / 1.1)
    assert report.ratio(bs.ServingCase("prefix", 32768)) == pytest.approx(12.0)
    assert bs.verdicts(report) == ["- mixed: cuflash vllm / cuflash split worst 1.10, target <= 1: NOT met",
                                   "- prefix: per sequence / cascade worst 12.00, target >= 10: met"]
    text = bs.markdown_document(report)
    assert text.startswith("# cuflash serving steps, NVIDIA Synthetic GPU\n")
    assert "| 4096 | 1.000 | 1.100 | — (RuntimeError: no kernel) | 0.91 |" in text
    assert "| 32768 | 3.000 | 0.250 | 12.00 |" in text
    data = json.loads(bs.report_json(report))
    assert len(data["measurements"]) == 8 and data["targets"] == {"mixed": 1.0, "prefix": 10.0}


def test_files_named_for_the_gpu(tmp_path):
    message = bs.write_outputs(_synthetic(), tmp_path)[0]
    assert "synthetic-gpu-serving.md" in message and (tmp_path / "synthetic-gpu-serving.json").exists()


def test_options():
    args = build_parser().parse_args(["bench", "--mode", "serving", "--quick", "--eager", "--repeats", "3"])
    assert args.mode == "serving" and mode_conflict(args) is None
    args = build_parser().parse_args(["bench", "--mode", "serving", "--seqlens", "4096"])
    assert mode_conflict(args) == "--seqlens do not apply to --mode serving"


def test_without_gpu_says_so(capsys):
    from cuflash._core.device import gpu_unavailable

    if gpu_unavailable() is None:
        pytest.skip("this machine has a GPU")
    assert main(["bench", "--mode", "serving", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_imports_without_torch_or_cupy():
    code = ("import sys; sys.modules['torch'] = sys.modules['cupy'] = None\n"
            "import cuflash.bench.serving as s\nassert len(s.sweep()) == 4")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert result.returncode == 0, result.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("case", [bs.ServingCase("mixed", 1024), bs.ServingCase("prefix", 2048)],
                         ids=["mixed", "prefix"])
def test_every_implementation_is_timed_or_says_why_on_a_gpu(case, monkeypatch):
    """At small shapes: cuflash's implementations time, and the cascade's answer is the
    per-sequence one (the merge through the LSEs is exact up to bf16 rounding)."""
    import torch

    monkeypatch.setattr(bs, "MIXED_DECODES", 5)
    monkeypatch.setattr(bs, "PREFIX_BATCH", 4)
    found = bs.measure_case(case, repeats=2)
    assert all(m.ms is not None and m.ms > 0 for m in found if m.impl != "sdpa per sequence"), found
    if case.mode == "prefix":
        s = bs.make_prefix(case, 1)
        whole, merged = (bs.prefix_call(impl, s)() for impl in bs.PREFIX_IMPLS)
        torch.testing.assert_close(merged.float(), whole.float(), atol=2e-2, rtol=2e-2)
    else:
        s = bs.make_mixed(case, 1)
        one, (chunks, decodes) = bs.mixed_call("cuflash vllm", s)(), bs.mixed_call("cuflash split", s)()
        torch.testing.assert_close(one, torch.cat([chunks, decodes.squeeze(1)]), atol=2e-2, rtol=2e-2)
