"""``python -m cuflash bench --mode bias`` without a GPU: the cases, the options that do not go with
it, the report writers on synthetic timings, the eager gpt-oss formula against cuflash's CPU path,
and every timed call built and run once on CPU tensors, cuflash's functions answered by its NumPy
path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cuflash
from cuflash.bench import bias as bb
from cuflash.bench import decode as bench_decode
from cuflash.cli.main import build_parser, main, mode_conflict
from cuflash._core.device import gpu_unavailable

ROOT = Path(__file__).resolve().parents[1]


def test_full_and_quick_cases():
    cases = bb.sweep()
    for mode in ("fwd", "bwd"):
        mine = [c for c in cases if c.mode == mode]
        assert [(c.windowed, c.seqlen) for c in mine] == [(w, s) for w in (False, True) for s in
                                                          (4096, 8192, 16384, 32768)]
        assert {c.batch for c in mine} == {1}
    decode = [c for c in cases if c.mode == "decode"]
    assert [(c.batch, c.seqlen) for c in decode] == [(1, 8192), (1, 32768), (64, 8192), (64, 32768)]
    train = [c for c in cases if c.mode == "train"]
    assert [(c.batch, c.seqlen, c.windowed) for c in train] == [(1, s, False) for s in (4096, 8192, 16384, 32768)]
    assert len(cases) == 24 and [c.mode for c in cases] == ["fwd"] * 8 + ["bwd"] * 8 + ["decode"] * 4 + ["train"] * 4
    quick = bb.sweep(quick=True)
    assert {c.seqlen for c in quick if c.mode != "decode"} == {4096, 16384} and len(quick) == 14
    assert [c for c in quick if c.mode == "decode"] == decode


def test_shapes_window_and_slopes():
    assert (bb.HEADS, bb.HEADS_KV, bb.HEAD_DIM) == (64, 8, 64)
    assert bb.BiasCase("fwd", 4096, windowed=True).window == (128, 0)
    assert bb.BiasCase("fwd", 4096).window == (-1, -1)
    assert bb.BiasCase("decode", 8192, 64).decode_shape() == bench_decode.DecodeShape(1, 64, 8192, 64, 8, 64)
    slopes = bb.alibi_slopes()
    assert len(slopes) == 64 and slopes[0] == 2 ** -0.125 and slopes[-1] == 2 ** -8
    assert slopes == sorted(slopes, reverse=True)


def test_what_is_skipped_and_why():
    window, full = bb.BiasCase("fwd", 4096, windowed=True), bb.BiasCase("fwd", 4096)
    assert "sliding-window" in bb.skip_reason("sdpa-cudnn", window)
    assert bb.skip_reason("sdpa-flash", full) is None and bb.skip_reason(bb.EAGER, window) is None
    assert bb.skip_reason(bb.EAGER, bb.BiasCase("fwd", 8192)) is None
    assert "above 8192 tokens" in bb.skip_reason(bb.EAGER, bb.BiasCase("fwd", 16384))
    assert "above 4096 tokens" in bb.skip_reason(bb.EAGER, bb.BiasCase("bwd", 8192))
    assert all(bb.skip_reason(impl, bb.BiasCase("decode", 32768, 64)) is None for impl in bb.IMPLS["decode"])
    assert bb.EAGER not in bb.IMPLS["decode"]


def test_set_bytes_count_what_a_call_touches():
    # q and out: 64 heads; k and v: 8 heads; the backward doubles it with dout, dq, dk, dv.
    assert bb.set_bytes(bb.BiasCase("fwd", 1024)) == 1024 * 64 * (2 * 64 + 2 * 8) * 2
    assert bb.set_bytes(bb.BiasCase("bwd", 1024)) == 2 * bb.set_bytes(bb.BiasCase("fwd", 1024))
    assert bb.set_bytes(bb.BiasCase("train", 1024)) == bb.set_bytes(bb.BiasCase("bwd", 1024))


# ----------------------------------------------------------------------------- options


def test_bias_options_are_accepted():
    args = build_parser().parse_args(["bench", "--mode", "bias", "--quick", "--eager", "--repeats", "3",
                                      "--out", "results"])
    assert args.mode == "bias" and mode_conflict(args) is None


@pytest.mark.parametrize("option", [["--seqlens", "4096"], ["--head-dims", "64"], ["--memory"], ["--batches", "1"],
                                    ["--contexts", "8192"], ["--dtype", "float16"], ["--causal", "no"],
                                    ["--impls", "cuflash"], ["--ranks", "2"]])
def test_options_of_other_modes_are_refused_before_the_gpu_check(option, capsys):
    assert main(["bench", "--mode", "bias", *option]) == 2
    assert f"{option[0]} do not apply to --mode bias" in capsys.readouterr().err


def test_bias_bench_without_gpu_says_so(capsys):
    if gpu_unavailable() is None:
        pytest.skip("this machine has a GPU")
    assert main(["bench", "--mode", "bias", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_imports_without_torch_or_cupy():
    code = ("import sys; sys.modules['torch'] = sys.modules['cupy'] = None\n"
            "import cuflash.bench.bias, cuflash.cli.main\n"
            "assert len(cuflash.bench.bias.sweep()) == 24")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------- report writing


def _synthetic_report() -> bb.BiasReport:
    full, window, long = (bb.BiasCase("fwd", 4096), bb.BiasCase("fwd", 4096, windowed=True),
                          bb.BiasCase("fwd", 16384))
    backward, decode = bb.BiasCase("bwd", 4096), bb.BiasCase("decode", 8192, 64)
    found = []
    for case, plain, sinks, alibi in ((full, 1.0, 1.01, 1.04), (window, 0.1, 0.103, 0.104), (long, 10.0, 10.1, 10.2),
                                      (backward, 2.0, 2.05, 2.02), (decode, 0.5, 0.505, 0.55)):
        found += [bb.BiasMeasurement("cuflash", case, plain), bb.BiasMeasurement("cuflash+sinks", case, sinks),
                  bb.BiasMeasurement("cuflash+alibi", case, alibi)]
        for peer in ("sdpa-cudnn", "sdpa-flash"):
            reason = bb.skip_reason(peer, case)
            found.append(bb.BiasMeasurement(peer, case, None if reason else 1.2 * plain, reason or ""))
        if case.mode != "decode":
            reason = bb.skip_reason(bb.EAGER, case)
            found.append(bb.BiasMeasurement(bb.EAGER, case, None if reason else 20 * plain, reason or ""))
    train = bb.BiasCase("train", 4096)
    found += [bb.BiasMeasurement(impl, train, ms) for impl, ms in zip(bb.TRAIN_IMPLS, (3.0, 3.3, 3.5, 4.0))]
    found[3] = bb.BiasMeasurement("sdpa-cudnn", full, None, "RuntimeError: No available kernel.\nAborting")
    return bb.BiasReport(found, {"date": "2026-12-05", "device": "NVIDIA Synthetic GPU", "driver": 13000,
                                 "cuDNN": 91900},
                         command="python -m cuflash bench --mode bias --out results")


def _row(text: str, start: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(start))
    return [c.strip() for c in line.strip("|").split("|")]


def test_tables_ratios_and_footnotes():
    text = bb.markdown_document(_synthetic_report())
    header = _row(text, "| mask | tokens")
    assert header == ["mask", "tokens", "cuflash", "cuflash+sinks", "cuflash+alibi", "sdpa-cudnn", "sdpa-flash",
                      bb.EAGER, "sinks / no bias", "alibi / no bias"]
    assert _row(text, "| causal | 4096 |") == ["causal", "4096", "1.000", "1.010", "1.040", "— [1]", "1.200",
                                               "20.000", "1.010", "1.040"]
    # The window: SDPA skipped with a footnote; sinks 3% over (target 2%), ALiBi 4% (target 5%).
    assert _row(text, "| causal, window 128 | 4096 |") == ["causal, window 128", "4096", "0.100", "0.103", "0.104",
                                                           "— [2]", "— [2]", "2.000", "1.030 (over)", "1.040"]
    assert _row(text, "| causal | 16384 |")[7] == "— [3]"
    assert "[1] RuntimeError: No available kernel. Aborting" in text  # on one line
    assert "[2] SDPA has no sliding-window argument" in text and "[3] not run above 8192 tokens" in text
    # Decode: a row per batch and context, no eager column, ALiBi's ratio unjudged.
    assert _row(text, "| batch | context")[-3:] == ["sdpa-flash", "sinks / no bias", "alibi / no bias"]
    assert _row(text, "| 64 | 8192 |")[-2:] == ["1.010", "1.100"]
    assert "### Backward, ms per call (the forward run once, untimed" in text


def test_header_targets_and_verdicts():
    text = bb.markdown_document(_synthetic_report())
    assert text.startswith("# cuflash with attention sinks, ALiBi and dropout, gpt-oss's shapes, NVIDIA Synthetic GPU\n")
    assert "Regenerate: `python -m cuflash bench --mode bias --out results`" in text
    assert "Measured 2026-12-05 on NVIDIA Synthetic GPU; CUDA driver 13.0, cuDNN 9.19.0." in text
    assert "sdpa-cudnn: torch SDPA, CUDNN_ATTENTION backend" in text and f"{bb.EAGER}: gpt-oss's reference" in text
    assert "sinks within 2% fwd, 3% bwd, 2% decode; alibi within 5% fwd, 5% bwd; dropout within 15% train" in text
    assert "64 query heads, 8 KV heads, head_dim 64, bf16, causal" in text
    assert f"Decode steps are timed as {bench_decode.TIMING_GRAPH};" in text
    assert "- sinks, fwd: worst 1.030 over 3 cases, target 1.02: NOT met" in text
    assert "- sinks, bwd: worst 1.025 over 1 cases, target 1.03: met" in text
    assert "- sinks, decode: worst 1.010 over 1 cases, target 1.02: met" in text
    assert "- alibi, fwd: worst 1.040 over 3 cases, target 1.05: met" in text
    assert "- alibi, decode" not in text
    assert "- dropout, train: worst 1.100 over 1 cases, target 1.15: met" in text
    assert "sdpa-flash+dropout: the same with dropout_p=0.1" in text
    assert _row(text, "| causal | 4096 | 3.000") == ["causal", "4096", "3.000", "3.300", "3.500", "4.000", "1.100"]
    assert "| mask | tokens | cuflash | cuflash+dropout | sdpa-flash | sdpa-flash+dropout | dropout / no dropout |" in text


def test_files_named_for_the_gpu_and_mode(tmp_path):
    messages = bb.write_outputs(_synthetic_report(), tmp_path)
    assert "synthetic-gpu-bias.md" in messages[0] and "synthetic-gpu-bias.json" in messages[0]
    assert (tmp_path / "synthetic-gpu-bias.md").read_text().startswith("# cuflash with attention sinks")
    data = json.loads((tmp_path / "synthetic-gpu-bias.json").read_text())
    assert data["command"] == "python -m cuflash bench --mode bias --out results"
    assert data["targets"]["sinks"] == {"fwd": 1.02, "bwd": 1.03, "decode": 1.02}
    assert data["shapes"] == {"heads": 64, "heads_kv": 8, "head_dim": 64, "dtype": "bfloat16", "causal": True}
    first = data["measurements"][1]
    assert first["impl"] == "cuflash+sinks" and first["ratio_to_cuflash"] == pytest.approx(1.01)
    assert first["window"] == [-1, -1] and first["seqlen"] == 4096 and first["mode"] == "fwd"
    assert data["measurements"][0]["ratio_to_cuflash"] is None
    assert len(data["measurements"]) == 4 * 6 + 5 + 4  # 3 forward and 1 backward cases of 6, a decode case of 5, a train case of 4


# ----------------------------------------------------------------------------- the calls, on the CPU

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch, a CPU build is enough)")


@pytest.mark.parametrize("windowed", [False, True], ids=["causal", "window"])
def test_eager_formula_is_cuflash_with_sinks(windowed):
    """The eager peer computes what cuflash computes (float64, GQA, the window, a sink per head),
    forward and, through autograd, the backward with dsinks."""
    rng = np.random.default_rng(0)
    q, dout = (rng.standard_normal((1, 200, 8, 16)) for _ in range(2))
    k, v = (rng.standard_normal((1, 200, 2, 16)) for _ in range(2))
    sinks = rng.standard_normal(8) * 2
    window = bb.WINDOW if windowed else (-1, -1)
    out, lse = cuflash.attention(q, k, v, causal=True, window=window, sinks=sinks, return_lse=True)
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v, sinks)]
    eager = bb.eager_sinks_attention(*leaves, bb.hidden_keys(200, windowed, "cpu"))
    np.testing.assert_allclose(eager.detach().numpy(), out, atol=1e-5)  # its softmax is float32
    grads = torch.autograd.grad(eager, leaves, torch.from_numpy(dout))
    want = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, window=window, sinks=sinks)
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-4)


def _to_numpy(x):
    if isinstance(x, torch.Tensor):
        return (x.float() if x.is_floating_point() else x).numpy()
    return x


def _to_torch(x):
    if isinstance(x, tuple):
        return tuple(_to_torch(y) for y in x)
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


@pytest.fixture
def cuflash_on_cpu_tensors(monkeypatch):
    """cuflash's three functions taking CPU torch tensors: converted to float32 NumPy arrays for the
    CPU path, the results converted back."""
    for name in ("attention", "attention_backward", "attention_with_kvcache"):
        function = getattr(cuflash, name)

        def answered(*args, _function=function, **kwargs):
            return _to_torch(_function(*map(_to_numpy, args), **{k: _to_numpy(v) for k, v in kwargs.items()}))

        monkeypatch.setattr(cuflash, name, answered)


def _measured(case: bb.BiasCase) -> dict[str, tuple]:
    """measure_case on CPU tensors, with a timer that runs each implementation's first call once:
    impl -> (its measurement, and where it was timed: its first call's result, the timing, the
    repeats and the number of rotated calls)."""
    runs = []

    def timer(calls, repeats, timing):
        runs.append((calls[0](), timing, repeats, len(calls)))
        return 1.0

    found = bb.measure_case(case, 4, bench_decode.TIMING_GRAPH, timer, "cpu")
    assert [m.impl for m in found] == list(bb.IMPLS[case.mode])
    timed = iter(runs)  # the timer ran for the measured ones, in order
    return {m.impl: (m, next(timed) if m.ms is not None else None) for m in found}


def test_forward_calls_run(cuflash_on_cpu_tensors):
    found = _measured(bb.BiasCase("fwd", 256, windowed=True))
    assert all(found[i][0].ms == 1.0 for i in (*bb.CUFLASH_IMPLS, bb.EAGER)), found
    for peer in bb.SDPA_BACKENDS:
        assert found[peer][0].ms is None and "sliding-window" in found[peer][0].note
    (plain, timing, repeats, count), sinks, alibi, eager = (found[i][1] for i in (*bb.CUFLASH_IMPLS, bb.EAGER))
    assert timing == bench_decode.TIMING_EAGER and repeats == 4 and count == 8  # small sets: 8 rotated
    assert eager[2] == bb.EAGER_REPEATS
    assert plain.shape == sinks[0].shape == eager[0].shape == (1, 256, 64, 64)
    # The sinks reach cuflash (its answer is the eager formula's, bf16 there, not the plain one's), and
    # so do the slopes.
    assert (sinks[0] - eager[0].float()).abs().max() < 0.02 < (plain - sinks[0]).abs().max()
    assert (plain - alibi[0]).abs().max() > 0.02


def test_backward_calls_run(cuflash_on_cpu_tensors):
    found = _measured(bb.BiasCase("bwd", 128))
    assert all(found[i][0].ms == 1.0 for i in (*bb.CUFLASH_IMPLS, bb.EAGER)), found
    for peer in bb.SDPA_BACKENDS:  # CPU torch may run or refuse a backend: either is reported
        assert found[peer][0].ms == 1.0 or found[peer][0].note, found[peer]
    plain, sinks, alibi, eager = (found[i][1][0] for i in (*bb.CUFLASH_IMPLS, bb.EAGER))
    assert len(plain) == len(alibi) == 3 and len(sinks) == len(eager) == 4
    assert sinks[0].shape == (1, 128, 64, 64) and sinks[1].shape == (1, 128, 8, 64) and sinks[3].shape == (64,)
    assert torch.allclose(eager[3], sinks[3], rtol=0.05, atol=0.05)  # dsinks, eager in bf16
    assert (plain[0] - alibi[0]).abs().max() > 0.01


def test_decode_calls_run(cuflash_on_cpu_tensors):
    found = _measured(bb.BiasCase("decode", 256, 2))
    assert all(found[i][0].ms == 1.0 for i in bb.CUFLASH_IMPLS), found
    for peer in bb.SDPA_BACKENDS:  # bench/decode.py's peers make CuPy arrays: no CuPy here
        assert found[peer][0].ms is None and found[peer][0].note
    (plain, timing, repeats, count), (sinks, *_), (alibi, *_) = (found[i][1] for i in bb.CUFLASH_IMPLS)
    assert plain.shape == (2, 1, 64, 64) and timing == bench_decode.TIMING_GRAPH and (repeats, count) == (4, 8)
    assert (plain - sinks).abs().max() > 1e-3 and (plain - alibi).abs().max() > 1e-3


def test_train_calls_run():  # cuflash.torch takes CPU tensors itself
    found = _measured(bb.BiasCase("train", 128))
    assert all(found[i][0].ms == 1.0 for i in ("cuflash", "cuflash+dropout")), found
    for peer in ("sdpa-flash", "sdpa-flash+dropout"):  # CPU torch may run or refuse the backend
        assert found[peer][0].ms == 1.0 or found[peer][0].note, found[peer]
    (plain, timing, repeats, count), (dropped, *_) = (found[i][1] for i in ("cuflash", "cuflash+dropout"))
    assert timing == bench_decode.TIMING_EAGER and (repeats, count) == (4, 8)
    assert len(plain) == len(dropped) == 3 and plain[0].shape == (1, 128, 64, 64) and plain[1].shape == (1, 128, 8, 64)
    assert (plain[0] - dropped[0]).abs().max() > 1e-3  # the dropout reaches the call


@pytest.mark.gpu
@pytest.mark.parametrize("case", [bb.BiasCase("fwd", 2048, windowed=True), bb.BiasCase("bwd", 2048),
                                  bb.BiasCase("decode", 4096, 2), bb.BiasCase("train", 2048)],
                         ids=["fwd-window", "bwd", "decode", "train"])
def test_every_implementation_is_timed_or_says_why_on_a_gpu(case):
    found = bb.measure_case(case, repeats=3)
    assert all(m.ms is not None and m.ms > 0 for m in found if m.impl.startswith("cuflash")), found
    assert all((m.ms or 0) > 0 or m.note for m in found), found
