"""The README's set-up commands (`make demo`, `make test`) make the virtual environment they install into: the
Makefile's recipe, run by make with stand-ins for the interpreters (a real install takes minutes and gigabytes;
`make install` itself ran once by hand on a venv without pip, docs/reliability.md)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from helpers.configs import REPO_DIR

# A stand-in interpreter: logs its arguments; `-m pip --version` fails where the venv has no pip (NO_PIP beside it).
STAND_IN = """#!/bin/sh
echo "$(basename "$0") $*" >> "{log}"
if [ "$1 $2 $3" = "-m pip --version" ] && [ -e "$(dirname "$0")/NO_PIP" ]; then exit 1; fi
if [ "$1 $2 $3" = "-m venv --clear" ]; then
    rm -rf "$4" && mkdir -p "$4/bin" && cp "$0" "$4/bin/python"
fi
"""


# The environment without the variables a make running the suite passes to the makes it starts (`make test-oldest`
# runs `make test VENV=.venv-oldest`, and its VENV would reach the make each test runs).
OWN_MAKE = {name: value for name, value in os.environ.items() if name not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


def stand_in(path: Path, log: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STAND_IN.format(log=log))
    path.chmod(0o755)
    return path


def run_make(tmp_path: Path, target: str) -> list[str]:
    """`make <target> PYTHON=<stand-in>` in `tmp_path` with the Makefile and pyproject.toml copied there; the
    interpreters' calls, in order (each stand-in logs to tmp_path/calls.log)."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO_DIR / name, tmp_path / name)
    python3 = stand_in(tmp_path / "system" / "python3", tmp_path / "calls.log")
    subprocess.run(["make", target, f"PYTHON={python3}"], cwd=tmp_path, env=OWN_MAKE, check=True, capture_output=True)
    return (tmp_path / "calls.log").read_text().splitlines()


def make_install(tmp_path: Path, *, venv_has_pip: bool) -> list[str]:
    """`make install` with a .venv whose python has pip or not; the interpreters' calls, in order."""
    stand_in(tmp_path / ".venv" / "bin" / "python", tmp_path / "calls.log")
    if not venv_has_pip:
        (tmp_path / ".venv" / "bin" / "NO_PIP").touch()
    calls = run_make(tmp_path, "install")
    assert (tmp_path / ".venv" / ".installed").is_file()
    return calls


def test_a_venv_without_pip_is_made_again_before_the_install(tmp_path):
    """`python3 -m venv` stopped half-way (Debian and Ubuntu without python3-venv) leaves a venv with a python
    and no pip; the next `make demo` failed with "No module named pip" until the folder was deleted by hand."""
    assert make_install(tmp_path, venv_has_pip=False) == [
        "python -m pip --version",
        "python3 -m venv --clear .venv",
        'python -m pip install -q -e .[dev]',
    ]


def test_a_whole_venv_is_installed_into_as_it_is(tmp_path):
    assert make_install(tmp_path, venv_has_pip=True) == ["python -m pip --version", "python -m pip install -q -e .[dev]"]


def test_make_test_oldest_runs_the_suite_on_every_lower_bound_of_pyproject(tmp_path):
    """`make test-oldest`: a venv of its own, pyproject.toml's dependencies installed at the bounds their `>=`
    names (every quoted requirement of the list here, the Makefile's sed line by line there), then the suite as
    `make test` runs it."""
    assert run_make(tmp_path, "test-oldest") == [
        "python3 -m venv --clear .venv-oldest",
        "python -m pip install -q -c .venv-oldest/oldest.txt -e .[dev]",
        'python -m pytest -q -n 2 -m not large_memory',
        "python -m pytest -q -m large_memory",
    ]
    pyproject = (REPO_DIR / "pyproject.toml").read_text()
    listed = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.DOTALL | re.MULTILINE)[1]
    dependencies = re.findall(r'"([^"]+)"', listed)
    bounds = [re.fullmatch(r"([\w.-]+)>=([\d.]+)", requirement) for requirement in dependencies]
    pins = [f"{bound[1]}=={bound[2]}" for bound in bounds if bound]
    assert {"torch==2.6", "lightning==2.5.3"} <= set(pins)
    assert (tmp_path / ".venv-oldest" / "oldest.txt").read_text().splitlines() == pins
