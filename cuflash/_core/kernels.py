"""Finds cuda_src/, compiles kernels with NVRTC, caches them in memory and on disk, launches.

Compilation is lazy: the first call that needs an instantiation compiles that one alone. A
compiled cubin is kept under ``CUFLASH_CACHE_DIR`` (default ``~/.cache/cuflash``) keyed by a hash
of every file in cuda_src/ (CuPy's own cache key ignores ``#include``d headers), the target
architecture, the options, the NVRTC version and the name expression; loaded modules are kept in
memory per device. A launch plan resolves its kernels to ``Launch`` records once; ``launch`` is
then one driver call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cuflash._core import nvrtc
from cuflash._core.dispatch import KernelChoice

__all__ = ["Launch", "cache_dir", "compile_kernel", "get_function", "launch", "prepare", "source_root",
           "sources_fingerprint"]

_SOURCE_SUFFIXES = (".cu", ".cuh", ".h")


def source_root() -> Path:
    """cuda_src/ of an installed package (``cuflash/cuda_src``) or of a checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "cuda_src", package.parent / "cuda_src"):
        if (candidate / "common").is_dir():
            return candidate
    raise FileNotFoundError(f"cuflash: no cuda_src/ next to {package}; the installation is broken")


@functools.lru_cache(maxsize=None)
def sources_fingerprint() -> str:
    """SHA-256 over the relative path and content of every source file under cuda_src/."""
    root = source_root()
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("CUFLASH_CACHE_DIR", Path.home() / ".cache" / "cuflash"))


def _options(arch: str) -> list[str]:
    # -Xptxas=-v puts the register / spill report in the log, which the compile check reads.
    return ["-std=c++17", f"-arch={arch}", f"-I{source_root()}", "-lineinfo", "-Xptxas=-v"]


@dataclass(frozen=True)
class CompiledKernel:
    cubin: bytes
    symbol: str
    log: str
    seconds: float  # NVRTC time; 0.0 when read from the disk cache

    def resources(self) -> dict[str, int]:
        """Registers, spill bytes and stack frame from the ptxas report."""
        found = {}
        for key, pattern in (
            ("registers", r"Used (\d+) registers"),
            ("spill_stores", r"(\d+) bytes spill stores"),
            ("spill_loads", r"(\d+) bytes spill loads"),
            ("stack_frame", r"(\d+) bytes stack frame"),
        ):
            match = re.search(pattern, self.log)
            found[key] = int(match.group(1)) if match else -1
        return found


def compile_kernel(choice: KernelChoice, arch: str, use_cache: bool = True) -> CompiledKernel:
    """Compile one instantiation for ``arch`` (``sm_80``, ``sm_90``, ``sm_90a``...); needs no GPU."""
    options = _options(arch)
    key = hashlib.sha256(
        json.dumps(
            [sources_fingerprint(), choice.source, choice.name_expression, arch,
             options[:2] + options[3:], nvrtc.version()]
        ).encode()
    ).hexdigest()[:32]
    path = cache_dir() / f"{key}.cubin"
    meta_path = path.with_suffix(".json")
    if use_cache and path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        return CompiledKernel(path.read_bytes(), meta["symbol"], meta["log"], 0.0)

    source = f'#include "{choice.source}"\n'
    start = time.perf_counter()
    program = nvrtc.compile_program(source, "cuflash_kernel.cu", options, [choice.name_expression])
    seconds = time.perf_counter() - start
    compiled = CompiledKernel(
        program.cubin, program.lowered_names[choice.name_expression], program.log, seconds
    )
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Write-then-rename so a concurrent reader never sees half a file.
            for target, data in ((path, compiled.cubin),
                                 (meta_path, json.dumps({"symbol": compiled.symbol,
                                                         "log": compiled.log}).encode())):
                tmp = target.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(data)
                tmp.replace(target)
        except OSError:
            pass  # an unwritable cache only costs the next process a compile
    return compiled


# Loaded functions by (device, arch, name expression). Public so that a harness timing two source
# trees in one process (tools/ab_trees.py) can give each tree its own.
LOADED: dict[tuple[int, str, str], object] = {}
_lock = threading.Lock()


def get_function(choice: KernelChoice, arch: str, device_id: int):
    """The loaded ``cupy.cuda.function.Function`` for ``choice`` on device ``device_id``, with its
    dynamic shared-memory limit raised to what the tile needs."""
    key = (device_id, arch, choice.name_expression)
    function = LOADED.get(key)
    if function is not None:
        return function
    with _lock:
        function = LOADED.get(key)
        if function is None:
            import cupy
            from cupy.cuda import driver, function as cuda_function

            compiled = compile_kernel(choice, arch)
            with cupy.cuda.Device(device_id):
                module = cuda_function.Module()
                module.load(compiled.cubin)
                function = module.get_function(compiled.symbol)
                driver.funcSetAttribute(
                    function.ptr,
                    driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    choice.smem_bytes,
                )
            LOADED[key] = function
    return function


@dataclass(frozen=True)
class Launch:
    """A loaded kernel and its launch configuration: everything cuLaunchKernel takes but the
    stream and the argument."""

    function: int  # CUfunction handle (its Module is kept alive by get_function's cache)
    grid: tuple[int, int, int]
    threads: int
    smem_bytes: int


def prepare(choice: KernelChoice, arch: str, device_id: int, grid: tuple[int, int, int]) -> Launch:
    """``choice`` loaded on ``device_id`` (compiled first if need be), to run over ``grid``."""
    return Launch(get_function(choice, arch, device_id).ptr, tuple(grid), choice.threads, choice.smem_bytes)


@functools.lru_cache(maxsize=None)
def _driver():
    from cupy.cuda import driver

    return driver


def launch(kernel: Launch, stream: int, argument) -> None:
    """Launch ``kernel`` on ``stream`` with one by-value struct argument: ``argument`` a filled
    params.ArgumentBuffer, whose first slot points at the struct (the ``kernelParams`` array).
    The caller holds interop.on_device(the kernel's device): the launch goes to the current
    context."""
    _driver().launchKernel(kernel.function, *kernel.grid, kernel.threads, 1, 1, kernel.smem_bytes, stream,
                           ctypes.addressof(argument), 0)
