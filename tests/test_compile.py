"""Kernel instantiations compile with NVRTC, without a GPU, for sm_80 and sm_90a: a representative
few by default, every one (in parallel processes) under ``-m compile_all``; the compile check's
verdict, its --arch validation and ``python -m cuflash`` without a GPU."""

import ctypes
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import dataclasses

import pytest

from cuflash.cli import main as cli
from cuflash.cli import compile_check
from cuflash._core import device, dispatch, kernels, nvrtc


def assert_compiled_within_allowance(outcomes, arch):
    for outcome in outcomes:
        assert outcome.compiled is not None, outcome.error
        assert outcome.compiled.cubin[:4] == b"\x7fELF"
        assert outcome.compiled.symbol.startswith("_ZN7cuflash")
        assert outcome.compiled.resources()["registers"] > 0
    problems, notes, line = compile_check.verdict(outcomes, arch, nvrtc.version())
    assert problems == [] and line.endswith("ok"), (problems, line)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_representative_kernels_compile(arch):
    outcomes = compile_check.compile_all(compile_check.representative_kernels("sm80"), arch)
    assert_compiled_within_allowance(outcomes, arch)


@pytest.mark.compile_all
def test_every_kernel_compiles():
    # The sm80 family for its own target; the same sources for sm_90 (a Hopper device's fallback)
    # are left to the representative kernels above and `python -m cuflash compile-check --arch
    # sm_90a`, which CI's time budget does not hold.
    assert_compiled_within_allowance(compile_check.compile_all(dispatch.all_kernels("sm80"), "sm_80"), "sm_80")


def test_representative_kernels_are_instantiations_of_the_family():
    for family in dispatch.FAMILIES:
        names = {choice.name_expression for choice in dispatch.all_kernels(family)}
        chosen = compile_check.representative_kernels(family)
        assert {choice.name_expression for choice in chosen} <= names
        assert {choice.source for choice in chosen} == {choice.source for choice in dispatch.all_kernels(family)}


def test_verdict_names_failures_spills_over_the_allowance_and_serialised_wgmma():
    backward = dispatch.backward_kernels("sm80", 64, "causal", "float16")[1]
    forward = dispatch.forward_kernel("sm80", 192, "none", "float16")
    allowed = compile_check.spill_allowance(backward)
    assert allowed > 0 and compile_check.spill_allowance(forward) == 0

    def outcome(choice, spill_bytes, note=""):
        log = f"{note}\nUsed 128 registers, {spill_bytes} bytes spill stores, 0 bytes spill loads"
        return compile_check.Outcome(choice, kernels.CompiledKernel(b"", "symbol", log, 1.0))

    measured = compile_check.ALLOWANCE_NVRTC
    problems, notes, line = compile_check.verdict([outcome(backward, allowed), outcome(forward, 0)], "sm_80", measured)
    assert problems == notes == [] and line == ("sm_80: 2 of 2 kernels compiled; 1 spill, 1 of them within the sm80 "
                                                "register-ceiling allowance; ok")
    failed = compile_check.Outcome(replace(forward, name_expression="cuflash::missing<1>"), None, "error: no")
    spilling = [outcome(backward, allowed + 4), outcome(forward, 4)]
    problems, notes, line = compile_check.verdict([*spilling, failed], "sm_80", measured)
    spills = [f"SPILLS {backward.name_expression}: {allowed + 4} B, allowed {allowed} B",
              f"SPILLS {forward.name_expression}: 4 B, allowed 0 B"]
    assert problems == ["FAILED cuflash::missing<1>\nerror: no", *spills] and notes == []
    assert line.endswith("PROBLEM: 1 failed, 2 spill too much, 0 serialise their wgmma")
    note = ("ptxas info    : (C7519) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
            "to program dependence on compiler-inserted WG.AR in divergent path in the function 'k'")
    problems, notes, line = compile_check.verdict([outcome(forward, 0, note)], "sm_90a", measured)
    assert problems == [f"SERIALIZED {forward.name_expression}: ptxas serialised its wgmma"]
    assert line.endswith("PROBLEM: 0 failed, 0 spill too much, 1 serialise their wgmma")


def test_verdict_under_another_nvrtc_notes_spills_and_names_both_versions():
    """The allowances are ALLOWANCE_NVRTC's: under another NVRTC (torch's CUDA wheels pin an older
    one within the extras' range) spills beyond them are notes and the verdict is ok, naming both
    versions; failures and serialised wgmma stay problems."""
    backward = dispatch.backward_kernels("sm80", 64, "causal", "float16")[1]
    allowed = compile_check.spill_allowance(backward)
    log = f"Used 128 registers, {allowed + 64} bytes spill stores, 0 bytes spill loads"
    spilling = compile_check.Outcome(backward, kernels.CompiledKernel(b"", "symbol", log, 1.0))
    measured = ".".join(map(str, compile_check.ALLOWANCE_NVRTC))
    problems, notes, line = compile_check.verdict([spilling], "sm_80", (13, 0))
    assert problems == [] and notes == [f"note: SPILLS {backward.name_expression}: {allowed + 64} B, allowed {allowed} B"]
    assert line.startswith("sm_80: 1 of 1 kernels compiled; 1 spill; spills not judged")
    assert f"measured with NVRTC {measured}, this is NVRTC 13.0" in line
    assert f"run this under NVRTC {measured}" in line and line.endswith("; ok")
    failed = compile_check.Outcome(replace(backward, name_expression="cuflash::missing<1>"), None, "error: no")
    problems, notes, line = compile_check.verdict([spilling, failed], "sm_80", (13, 0))
    assert problems == ["FAILED cuflash::missing<1>\nerror: no"] and len(notes) == 1
    assert line.endswith("PROBLEM: 1 failed, 0 serialise their wgmma")


def test_compile_check_under_another_nvrtc_exits_0_with_notes(monkeypatch, capsys):
    """What `python -m cuflash compile-check` prints and returns after `pip install torch` moved
    NVRTC to an older 13.x: the kernels compile, the verdict is ok."""
    backward = dispatch.backward_kernels("sm80", 64, "causal", "float16")[1]
    log = f"Used 128 registers, {compile_check.spill_allowance(backward) + 64} bytes spill stores, 0 bytes spill loads"
    compiled = kernels.CompiledKernel(b"", "symbol", log, 1.0)
    monkeypatch.setattr(compile_check, "compile_all",
                        lambda choices, arch, jobs=None: [compile_check.Outcome(c, compiled) for c in choices])
    monkeypatch.setattr(nvrtc, "version", lambda: (13, 0))
    monkeypatch.setattr(nvrtc, "version_text", lambda: "13.0")
    assert cli.main(["compile-check", "--arch", "sm_80"]) == 0
    report = capsys.readouterr().out
    assert "note: SPILLS" in report and "PROBLEM" not in report and "this is NVRTC 13.0" in report


@pytest.mark.parametrize("arch", ["sm_75", "sm_80a", "sm80", "compute_80", "sm_9999", 80])
def test_unknown_arch_is_refused(arch):
    with pytest.raises(ValueError, match=f"arch: expected one of sm_80, .*got {arch!r}"):
        compile_check.check_arch(arch)


def test_compile_check_refuses_an_unknown_arch_before_compiling(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compile-check", "--arch", "sm_75"])
    assert exit_info.value.code == 2 and "argument --arch: arch: expected one of" in capsys.readouterr().err


def test_no_gpu_message_says_the_driver_is_missing(monkeypatch):
    def no_library(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    reason = device.gpu_unavailable()
    assert reason.startswith("no NVIDIA driver found") and "insufficient" not in reason


@pytest.mark.skipif(device.gpu_unavailable() is None, reason="a GPU is present: python -m cuflash runs the GPU report")
def test_main_without_gpu_checks_the_cpu_path_and_one_compile(capsys):
    assert cli.main([]) == 0
    report = capsys.readouterr().out
    assert f"No CUDA GPU: {device.gpu_unavailable()}." in report
    assert f"compiled {compile_check.representative_kernel().name_expression} for sm_80" in report
    assert report.endswith("ok: the CPU path and the kernel compiler work here\n")


# `python -m cuflash` where `pip install .` ran without an extra: neither CuPy nor cuda-pathfinder
# (NVRTC's locator) can be imported.
WITHOUT_THE_EXTRA = """
import runpy, sys
for name in ("cupy", "cuda", "cuda.pathfinder"):
    sys.modules[name] = None
runpy.run_module("cuflash", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("argv", [[], ["compile-check"], ["compile-check", "--arch", "sm_90a", "--front-end"]])
def test_main_without_the_cuda_extra_stops_after_its_diagnosis(argv):
    root = Path(__file__).resolve().parent.parent
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", WITHOUT_THE_EXTRA, *argv], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    report = done.stdout + done.stderr
    assert "cuda-pathfinder is not importable" in report and "pip install 'cuflash[cuda13]'" in report
    if not argv:
        assert "No CUDA GPU: CuPy is not importable" in report and "CPU path (blockwise online softmax)" in report


def test_disk_cache_key_follows_header_content(tmp_path, monkeypatch):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    choice = dispatch.forward_kernel("sm80", 64, "none", "float16")
    first = kernels.compile_kernel(choice, "sm_80")
    assert first.seconds > 0 and len(list(tmp_path.glob("*.cubin"))) == 1
    again = kernels.compile_kernel(choice, "sm_80")
    assert again.seconds == 0.0 and again.cubin == first.cubin
    kernels.sources_fingerprint.cache_clear()
    monkeypatch.setattr(kernels, "sources_fingerprint", lambda: "a header changed")
    changed = kernels.compile_kernel(choice, "sm_80")
    assert changed.seconds > 0 and len(list(tmp_path.glob("*.cubin"))) == 2


def test_compile_error_carries_the_log():
    with pytest.raises(nvrtc.CompileError, match="error"):
        nvrtc.compile_program("this is not C++", "bad.cu", ["-arch=sm_80"], [])


@pytest.mark.parametrize("family, arch", [("sm80", "sm_80"), ("sm90", "sm_90a")])
def test_shared_memory_the_host_and_a_kernel_disagree_on_fails_the_compile(family, arch):
    # Every main kernel takes the bytes the host launches with and static_asserts its own layout.
    for choice in (dispatch.forward_kernel(family, 64, "causal", "float16"),
                   dispatch.backward_kernels(family, 64, "causal", "float16")[1]):
        wrong = choice.name_expression.replace(f", {choice.smem_bytes}, ", f", {choice.smem_bytes + 128}, ")
        assert wrong != choice.name_expression
        with pytest.raises(nvrtc.CompileError, match="shared memory differs"):
            kernels.compile_kernel(dataclasses.replace(choice, name_expression=wrong), arch, use_cache=False)
