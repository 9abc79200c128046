"""The ahead-of-time compile check: kernel instantiations compiled with NVRTC for one architecture
(no GPU needed), in parallel processes, and a verdict on what ptxas spilled to local memory.

The sm80 kernels are tuned at their register ceiling: 255 per thread, or 128 for the head_dim 64
backward, which runs two CTAs per SM (dispatch.SM80_BWD_TILES says why that pays). There ptxas
keeps a few values in local memory, and dispatch.py's tiles are the fastest found, those spills
included. SPILL_ALLOWANCE bounds them per kernel and head-dim bucket; a kernel that spills more, or
one outside the table that spills at all (the sm90 family, whose warpgroups' register split must
hold everything, but for one backward kernel the table names), is a problem. So is a kernel whose
wgmma ptxas serialised (a product issued under a branch that its wait is not in, for one): it
compiles and runs correctly, several times slower.

The allowances hold for the NVRTC they were measured with (ALLOWANCE_NVRTC). Another release's
ptxas allocates registers differently, and the extras take any NVRTC of their CUDA major version
(torch's CUDA wheels pin an older one), so under another NVRTC the spills beyond the allowances are
notes, not problems: those kernels run correctly, and their speed is what was measured only under
ALLOWANCE_NVRTC.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import re
from dataclasses import dataclass

from cuflash._core import dispatch, kernels, nvrtc

__all__ = ["ALLOWANCE_NVRTC", "OWN_V_SPILL_ALLOWANCE", "SERIALIZED_NOTE", "SPILL_ALLOWANCE", "Outcome", "check_arch",
           "compile_all", "families", "own_v_dim", "representative_kernel", "representative_kernels", "spill_allowance",
           "verdict"]

# The NVRTC (major, minor) the allowances below were measured with.
ALLOWANCE_NVRTC = (13, 5)
# Bytes of spill stores plus loads that an instantiation of (kernel template, head-dim bucket) may
# have, over every dtype, mask, softcap and dQ order: the most ALLOWANCE_NVRTC spilled for sm_80 or
# sm_90a, rounded up to 64 bytes (its sm_90 code stays within these too).
SPILL_ALLOWANCE = {
    # d64: the e4m3 window kernel with softcap compiled for sm_90 (a Hopper device's fallback where
    # no tensor map fits) spills 140 B with ALiBi's and the sinks' reads.
    ("cuflash::flash_fwd_sm80", 64): 160,
    ("cuflash::flash_fwd_sm80", 96): 192,
    ("cuflash::flash_fwd_sm80", 128): 128,
    ("cuflash::flash_bwd_sm80", 64): 512,
    ("cuflash::flash_bwd_sm80", 96): 128,
    ("cuflash::flash_bwd_sm80", 128): 256,
    ("cuflash::flash_bwd_sm80", 192): 128,
    ("cuflash::flash_bwd_sm80", 256): 832,
    # The (192, 128) backward's step (two query halves on a ring of half stages, dQ's panels chosen
    # by step parity): every spill-free arrangement tried was slower (docs/kernels.md).
    ("cuflash::sm90::flash_bwd_sm90", 192): 320,
}
# The sm80 backward kernels for a v head dim of its own (dispatch.backward_kernels' own_v_dim) where
# they spill more than the table above allows, measured as it was.
OWN_V_SPILL_ALLOWANCE = {
    # d64's window kernel reads ALiBi and draws dropout's mask: 576 B.
    ("cuflash::flash_bwd_sm80", 64): 640,
    ("cuflash::flash_bwd_sm80", 96): 128,
    ("cuflash::flash_bwd_sm80", 192): 320,
}


def check_arch(arch: str) -> str:
    """``arch`` if it names a target of compute capability 8.0 or newer that this NVRTC compiles
    for (``sm_80``, ``sm_86``, ``sm_90``, ``sm_90a``, ...); ValueError naming it otherwise."""
    match = re.fullmatch(r"sm_(\d+)(a?)", arch) if isinstance(arch, str) else None
    known = [a for a in nvrtc.supported_archs() if a >= 80]
    if match is None or int(match[1]) not in known or (match[2] and int(match[1]) < 90):
        names = ", ".join(f"sm_{a}" for a in known)
        raise ValueError(f"arch: expected one of {names} (or sm_90a and newer with the 'a' suffix), "
                         f"the targets of compute capability 8.0 or newer that NVRTC "
                         f"{nvrtc.version_text()} compiles for; got {arch!r}")
    return arch


def families(arch: str) -> tuple[str, ...]:
    """The kernel families compiled for ``arch``: sm80's everywhere, sm90's (wgmma, setmaxnreg)
    only for sm_90a."""
    return ("sm80", "sm90") if arch == "sm_90a" else ("sm80",)


def representative_kernel() -> dispatch.KernelChoice:
    """The one compile ``python -m cuflash`` runs without a GPU: the sm80 forward kernel most calls
    take (head_dim 128, bfloat16, causal)."""
    return dispatch.forward_kernel("sm80", 128, "causal", "bfloat16")


def representative_kernels(family: str) -> list[dispatch.KernelChoice]:
    """A few instantiations of ``family`` that between them reach every kernel source and template
    switch: the smallest and largest head dims, both dtypes, each mask, softcap, each dQ order,
    sm80's two-CTA backward tile, FP8 inputs into either output type (sm80's d96 the closest to
    its spill allowance; sm90's d64 with three consumers at 152 registers), and the KV cache
    kernels (the forward over a cache at d64 with softcap, at its allowance under NVRTC 13.0),
    merge_states, and MLA decoding's transposed kernel for few query rows."""
    if family == "sm80":
        return [
            dispatch.forward_kernel("sm80", 64, "none", "float16"),
            representative_kernel(),
            dispatch.forward_kernel("sm80", 256, "window", "bfloat16", softcap=True),
            dispatch.forward_kernel("sm80", 96, "causal", "float8_e4m3fn", out_dtype="float16"),
            dispatch.forward_kernel("sm80", 256, "window", "float8_e4m3fn", softcap=True, out_dtype="bfloat16"),
            *dispatch.backward_kernels("sm80", 64, "causal", "float16", dq_order="walk"),
            dispatch.backward_kernels("sm80", 256, "window", "bfloat16", softcap=True)[1],
            *dispatch.kvcache_kernels("bfloat16", 256),
            *dispatch.kvcache_kernels("float16", 64, "float8_e4m3fn"),
            dispatch.combine_kernel("float16"),
            dispatch.merge_kernel("bfloat16"),
            dispatch.kvcache_prefill_kernel("bfloat16", 64, dispatch.Mask("window", -1, -1, 30.0)),
            dispatch.mla_kernel("sm80", "bfloat16", "float8_e4m3fn"),
        ]
    return [
        dispatch.forward_kernel("sm90", 64, "causal", "float16", short=True),
        dispatch.forward_kernel("sm90", 128, "none", "bfloat16"),
        dispatch.forward_kernel("sm90", 256, "window", "bfloat16", softcap=True),
        dispatch.forward_kernel("sm90", 64, "causal", "float8_e4m3fn", out_dtype="float16"),
        dispatch.forward_kernel("sm90", 256, "window", "float8_e4m3fn", softcap=True, out_dtype="bfloat16"),
        dispatch.backward_kernels("sm90", 64, "causal", "float16", dq_order="walk")[1],
        dispatch.backward_kernels("sm90", 128, "window", "bfloat16", softcap=True, dq_order="turns")[1],
        dispatch.mla_kernel("sm90", "float16", "float8_e4m3fn"),
        dispatch.mla_kernel("sm90", "bfloat16", "bfloat16", tma=True, narrow_rows=16),
    ]


@dataclass(frozen=True)
class Outcome:
    """One instantiation compiled: the kernel, or NVRTC's error message."""

    choice: dispatch.KernelChoice
    compiled: kernels.CompiledKernel | None
    error: str | None = None

    @property
    def spill_bytes(self) -> int:
        resources = self.compiled.resources()
        return resources["spill_stores"] + resources["spill_loads"]

    @property
    def wgmma_serialized(self) -> bool:
        """Whether ptxas serialised the kernel's wgmma, each waiting for the one before (its
        "Potential Performance Loss" notes C7510-C7520: a product issued under a branch its wait
        is not in, accumulators read or moved while in flight, too few registers)."""
        return SERIALIZED_NOTE in self.compiled.log


def _compile(choice: dispatch.KernelChoice, arch: str) -> Outcome:
    try:
        return Outcome(choice, kernels.compile_kernel(choice, arch, use_cache=False))
    except nvrtc.CompileError as error:
        return Outcome(choice, None, str(error))


def compile_all(choices: list[dispatch.KernelChoice], arch: str, jobs: int | None = None) -> list[Outcome]:
    """Compile every one of ``choices`` for ``arch`` (no disk cache) in ``jobs`` processes (default:
    one per CPU this process may use; none for a single kernel); the outcomes in the order of
    ``choices``. The processes are spawned, so a script that calls this needs the usual
    ``if __name__ == "__main__":`` guard."""
    jobs = min(jobs or len(os.sched_getaffinity(0)), len(choices))
    if jobs <= 1:
        return [_compile(choice, arch) for choice in choices]
    # spawn, not fork: the caller may run threads (torch's, a BLAS pool), and a child forked from a
    # multi-threaded process can deadlock on a lock one of them held.
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_compile, choices, [arch] * len(choices)))


def own_v_dim(choice: dispatch.KernelChoice) -> bool:
    """Whether ``choice`` is an sm80 backward kernel for a v head dim of its own (its OWN_V_DIM, the
    eleventh template argument, true)."""
    template, _, arguments = choice.name_expression.partition("<")
    return template == "cuflash::flash_bwd_sm80" and arguments.split(", ")[10] == "true"


def spill_allowance(choice: dispatch.KernelChoice) -> int:
    """The spill bytes ``choice`` may have (SPILL_ALLOWANCE, or OWN_V_SPILL_ALLOWANCE where it names
    the kernel; 0 for a kernel in neither)."""
    template, _, arguments = choice.name_expression.partition("<")
    bucket = arguments.split(",")[0]
    if not bucket.isdigit():
        return 0
    key = (template, int(bucket))
    if own_v_dim(choice) and key in OWN_V_SPILL_ALLOWANCE:
        return OWN_V_SPILL_ALLOWANCE[key]
    return SPILL_ALLOWANCE.get(key, 0)


# ptxas's note when it serialises a kernel's wgmma (Outcome.wgmma_serialized).
SERIALIZED_NOTE = "wgmma.mma_async instructions are serialized"


def verdict(outcomes: list[Outcome], arch: str,
            nvrtc_version: tuple[int, int]) -> tuple[list[str], list[str], str]:
    """(one line per problem: a failed compile, serialised wgmma, and under ALLOWANCE_NVRTC a
    spill over its allowance; one line per note: under ``nvrtc_version``, any other NVRTC, a spill
    over its allowance; the one-line verdict, which names both NVRTC versions where they differ)."""
    problems = [f"FAILED {o.choice.name_expression}\n{o.error}" for o in outcomes if o.compiled is None]
    compiled = [o for o in outcomes if o.compiled is not None]
    over = [o for o in compiled if o.spill_bytes > spill_allowance(o.choice)]
    spills = [f"SPILLS {o.choice.name_expression}: {o.spill_bytes} B, allowed {spill_allowance(o.choice)} B"
              for o in over]
    judged = tuple(nvrtc_version) == ALLOWANCE_NVRTC
    problems, notes = (problems + spills, []) if judged else (problems, [f"note: {line}" for line in spills])
    serialized = [o for o in compiled if o.wgmma_serialized]
    problems += [f"SERIALIZED {o.choice.name_expression}: ptxas serialised its wgmma" for o in serialized]
    spilling = sum(1 for o in compiled if o.spill_bytes)
    summary = f"{arch}: {len(compiled)} of {len(outcomes)} kernels compiled; {spilling} spill"
    if judged:
        summary += f", {spilling - len(over)} of them within the sm80 register-ceiling allowance"
        too_much = f"{len(over)} spill too much, "
    else:
        measured, this = (".".join(map(str, v)) for v in (ALLOWANCE_NVRTC, nvrtc_version))
        summary += (f"; spills not judged: the allowances were measured with NVRTC {measured}, this is NVRTC {this} "
                    f"({len(over)} beyond them, noted above: they run correctly, at a speed measured only under "
                    f"{measured}); to judge spills, run this under NVRTC {measured}")
        too_much = ""
    if problems:
        return problems, notes, (f"{summary}; PROBLEM: {len(outcomes) - len(compiled)} failed, {too_much}"
                                 f"{len(serialized)} serialise their wgmma")
    return problems, notes, f"{summary}; ok"
