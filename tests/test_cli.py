"""python -m cuflash's command line on a CPU machine: --version, and help texts a user can read
(plain text: no reST markup, no source paths)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import cuflash
from cuflash.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
# reST literals, and paths of the package's own sources.
MARKUP = re.compile(r"`")
SOURCE_PATH = re.compile(r"\b(cuflash|cuda_src|tools|tests)/|[\w/]+\.(py|cu|cuh)\b")


def help_text(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_version_prints_the_package_version(capsys):
    assert help_text(capsys, ["--version"]).strip() == f"cuflash {cuflash.__version__}"


def test_version_through_python_dash_m():
    result = subprocess.run([sys.executable, "-m", "cuflash", "--version"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert result.returncode == 0, result.stderr
    assert cuflash.__version__ in result.stdout


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["compile-check", "--help"]],
                         ids=["main", "bench", "compile-check"])
def test_help_is_plain_text(capsys, argv):
    text = help_text(capsys, argv)
    assert not MARKUP.search(text), f"markup in {' '.join(argv)}: {MARKUP.search(text)[0]!r}"
    assert not SOURCE_PATH.search(text), f"a source path in {' '.join(argv)}: {SOURCE_PATH.search(text)[0]!r}"
    assert "examples:" in text


def test_main_help_names_the_commands_and_the_bench_modes(capsys):
    text = help_text(capsys, ["--help"])
    for words in ("compile-check", "bench", "--version", "--mode decode", "--mode mla", "--mode ring", "--mode bias",
                  "--dtype e4m3", "--memory", "--front-end"):
        assert words in text, words
