"""Every kernel instantiation compiles with NVRTC, without a GPU, for sm_80 and sm_90a."""

import dataclasses

import pytest

from cuflash import dispatch, kernels, nvrtc


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_kernel_compiles(arch):
    for choice in dispatch.all_kernels("sm80"):
        compiled = kernels.compile_kernel(choice, arch, use_cache=False)
        assert compiled.cubin[:4] == b"\x7fELF"
        assert compiled.symbol.startswith("_ZN7cuflash")
        assert compiled.resources()["registers"] > 0


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
