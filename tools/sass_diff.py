"""Compare the SASS of every kernel instantiation between two versions of the sources; no GPU.

    git archive main cuda_src cuflash | tar -x -C /tmp/main
    PYTHONPATH=. python tools/sass_diff.py /tmp/main [--jobs 2] [--limit N] [--family sm80]

The old tree is a checkout root holding ``cuda_src/`` and ``cuflash/_core/dispatch.py`` (or, older,
``cuflash/dispatch.py``); the new one is this checkout unless ``--new-root`` names another (the
sources must not change during a run). Each tree's own ``dispatch.all_kernels`` lists its
instantiations (sm80's compiled for sm_80, sm90's for sm_90a, with the options cuflash compiles
with), paired by position: the lists enumerate the same switches in the same order, so a kernel
that changes its template arguments or its name still meets its counterpart. Each cubin's code
(``nvdisasm -c -hex``: the instructions and their control bits; pip's nvidia-cuda-nvdisasm has it)
is compared with addresses dropped and mangled symbol names replaced by a placeholder, together
with the ptxas register, stack and spill report. Results are kept under ``--cache`` keyed by the
tree's sources and the name expression, so the old tree compiles once and an unchanged kernel of
the new tree is not compiled again. Prints one line per kernel that differs and a verdict; exits 1
if any differs. All 497 kernels take about 40-50 minutes per tree on 2 cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
ARCHES = {"sm80": "sm_80", "sm90": "sm_90a"}
_LIST_KERNELS = """
import json, sys
sys.path.insert(0, sys.argv[1])
try:
    from cuflash._core import dispatch
except ImportError:  # a tree from before the internals moved under cuflash/_core
    from cuflash import dispatch
print(json.dumps([[c.source, c.name_expression] for c in dispatch.all_kernels(sys.argv[2])]))
"""


def tree_kernels(root: Path, family: str) -> list[tuple[str, str]]:
    """(source, name expression) of every instantiation that ``root``'s dispatch.py lists."""
    out = subprocess.run([sys.executable, "-c", _LIST_KERNELS, str(root), family],
                         check=True, capture_output=True, text=True).stdout
    return [tuple(pair) for pair in json.loads(out)]


def tree_fingerprint(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted((root / "cuda_src").rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def normalised_sass(cubin: bytes, nvdisasm: str) -> list[str]:
    """Code sections of ``cubin``, one line per instruction with its control bits, without
    addresses, symbol names replaced."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([nvdisasm, "-c", "-hex", file.name], check=True, capture_output=True,
                              text=True).stdout
    lines = []
    for line in text.splitlines():
        line = " ".join(re.sub(r"_Z\w+", "<symbol>", re.sub(r"/\*[0-9a-f]{4}\*/", "", line)).split())
        if line and not line.startswith("//") and (not line.startswith(".") or line.startswith(".sectioninfo")):
            lines.append(line)
    return lines


def ptxas_report(log: str) -> list[str]:
    """The ptxas lines on registers, shared memory, stack and spills."""
    return [re.sub(r"_Z\w+", "<symbol>", line.strip()) for line in log.splitlines()
            if re.search(r"Used \d+ registers|spill|stack frame", line)]


def compile_sass(root: str, source: str, expression: str, arch: str, cache_file: str, nvdisasm: str) -> None:
    """Compile one instantiation of ``root``'s sources and store its SASS and ptxas report."""
    sys.path.insert(0, str(CHECKOUT))
    from cuflash._core import nvrtc

    options = ["-std=c++17", f"-arch={arch}", f"-I{Path(root) / 'cuda_src'}", "-lineinfo", "-Xptxas=-v"]
    program = nvrtc.compile_program(f'#include "{source}"\n', "cuflash_kernel.cu", options, [expression])
    Path(cache_file).write_text(json.dumps({"sass": normalised_sass(program.cubin, nvdisasm),
                                            "resources": ptxas_report(program.log)}))


def cache_file(cache: Path, fingerprint: str, source: str, expression: str, arch: str) -> Path:
    key = hashlib.sha256(json.dumps([fingerprint, source, expression, arch]).encode()).hexdigest()[:32]
    return cache / f"{key}.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old_root", type=Path, help="checkout root of the old version (cuda_src/, cuflash/)")
    parser.add_argument("--new-root", type=Path, default=CHECKOUT, help="of the new version (default: this checkout)")
    parser.add_argument("--family", choices=sorted(ARCHES), action="append", help="default: both")
    parser.add_argument("--limit", type=int, help="only the first N kernels of each family")
    parser.add_argument("--jobs", type=int, default=2, help="parallel NVRTC processes (default 2)")
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm",
                        help="the CUDA toolkit's nvdisasm (pip: nvidia-cuda-nvdisasm)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "cuflash-sass")
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    roots = (args.old_root.resolve(), args.new_root.resolve())
    prints = [tree_fingerprint(root) for root in roots]

    pairs, jobs = [], {}
    for family in args.family or sorted(ARCHES):
        arch = ARCHES[family]
        old, new = (tree_kernels(root, family)[:args.limit] for root in roots)
        if len(old) != len(new):
            print(f"{family}: {len(old)} kernels in the old tree, {len(new)} in the new one; cannot pair them")
            return 1
        for kernel_pair in zip(old, new):
            files = [cache_file(args.cache, fp, *kernel, arch) for fp, kernel in zip(prints, kernel_pair)]
            for root, kernel, file in zip(roots, kernel_pair, files):
                if not file.is_file():
                    jobs[file] = (str(root), *kernel, arch, str(file), args.nvdisasm)
            pairs.append((kernel_pair, files))

    print(f"{len(pairs)} kernel pairs, {len(jobs)} compiles", flush=True)
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        for future in concurrent.futures.as_completed([pool.submit(compile_sass, *job) for job in jobs.values()]):
            future.result()

    differing = 0
    for (old_kernel, new_kernel), (old_file, new_file) in pairs:
        old, new = (json.loads(file.read_text()) for file in (old_file, new_file))
        if old != new:
            differing += 1
            changed = sum(a != b for a, b in zip(old["sass"], new["sass"])) + abs(len(old["sass"]) - len(new["sass"]))
            print(f"DIFFERS {new_kernel[1]}: {len(old['sass'])} -> {len(new['sass'])} instructions, "
                  f"{changed} lines differ; resources {old['resources']} -> {new['resources']}")
    print(f"{len(pairs) - differing} of {len(pairs)} kernels identical SASS, {differing} differ")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
