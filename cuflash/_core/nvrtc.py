"""NVRTC through ctypes: source -> cubin for one architecture, with lowered template names.

CuPy's own compiler entry points ask the driver for the current device, so they fail on a machine
without a GPU; NVRTC itself needs none. Going to the library directly lets the compile check run
in CI and gives the full cubin and the ptxas report (``-Xptxas=-v``) in the program log.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

__all__ = ["CompileError", "CompiledProgram", "NvrtcNotFound", "compile_program", "supported_archs", "unavailable",
           "version", "version_text"]


class CompileError(RuntimeError):
    """NVRTC rejected a program; the message carries its log."""


class NvrtcNotFound(RuntimeError):
    """NVRTC's library cannot be loaded: cuflash was installed without its cuda12 or cuda13 extra."""


@dataclass(frozen=True)
class CompiledProgram:
    cubin: bytes
    lowered_names: dict[str, str]  # name expression -> mangled symbol
    log: str


_INSTALL = "install cuflash with its cuda13 (or cuda12) extra: pip install 'cuflash[cuda13]'"


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib  # a dependency of CuPy 14
    except ImportError as error:
        raise NvrtcNotFound(f"NVRTC cannot be located, cuda-pathfinder is not importable ({error}); {_INSTALL}") \
            from error
    try:
        path = load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception as error:  # cuda.pathfinder's DynamicLibNotFoundError and the like
        raise NvrtcNotFound(f"NVRTC's library was not found ({type(error).__name__}: {error}); {_INSTALL}") from error
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def unavailable() -> str | None:
    """None where NVRTC's library loads; otherwise why not, in words."""
    try:
        _library()
    except NvrtcNotFound as error:
        return str(error)
    return None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CompileError(f"{what}: {_library().nvrtcGetErrorString(status).decode()}")


def version() -> tuple[int, int]:
    """NVRTC's (major, minor) version."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def version_text() -> str:
    """NVRTC's version as ``major.minor``."""
    return ".".join(map(str, version()))


@functools.lru_cache(maxsize=None)
def supported_archs() -> tuple[int, ...]:
    """The real architectures this NVRTC compiles for, as numbers: 80 for ``sm_80``, ..."""
    lib = _library()
    count = ctypes.c_int()
    _check(lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * count.value)()
    _check(lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return tuple(archs)


def _read(getter_size, getter, prog: ctypes.c_void_p) -> bytes:
    size = ctypes.c_size_t()
    _check(getter_size(prog, ctypes.byref(size)), getter_size.__name__)
    buf = ctypes.create_string_buffer(size.value)
    _check(getter(prog, buf), getter.__name__)
    return buf.raw


def compile_program(
    source: str, name: str, options: list[str], name_expressions: list[str]
) -> CompiledProgram:
    """Compile ``source`` to a cubin; ``options`` must name a real architecture (``-arch=sm_XX``).

    Raises
    ------
    CompileError
        With NVRTC's log when compilation fails.
    """
    lib = _library()
    prog = ctypes.c_void_p()
    _check(
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        for expr in name_expressions:
            _check(lib.nvrtcAddNameExpression(prog, expr.encode()), "nvrtcAddNameExpression")
        argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), argv)
        log = _read(lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog, prog)
        log = log.rstrip(b"\0").decode(errors="replace")
        if status != 0:
            raise CompileError(f"NVRTC failed to compile {name} ({' '.join(options)}):\n{log}")
        cubin = _read(lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN, prog)
        lowered = {}
        for expr in name_expressions:
            out = ctypes.c_char_p()
            _check(lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)), "nvrtcGetLoweredName")
            lowered[expr] = out.value.decode()
        return CompiledProgram(cubin, lowered, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
