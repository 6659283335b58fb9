"""The code runs on the oldest Python that pyproject.toml's requires-python admits (the README's "Python 3.10 to
3.13", 3.10 being Ubuntu 22.04's python3): it uses no syntax, module or member of the standard library newer than
that, as vermin reads every file. `typing.Self` (3.11) in flowformer/stop_signals.py stopped every command at
import on 3.10. And pip refuses Python 3.14, where Hydra's command line fails, with one line.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from helpers.configs import REPO_DIR

CHECKED = ["flowformer", "run.py", "tools", "tests", "docs/measured"]


def oldest_python() -> str:
    """'3.10' from `requires-python = ">=3.10,<3.14"` (read as text: tomllib is 3.11's)."""
    pyproject = (REPO_DIR / "pyproject.toml").read_text(encoding="utf-8")
    return re.search(r'^requires-python = ">=(3\.\d+),', pyproject, re.MULTILINE).group(1)


def test_no_file_needs_a_python_newer_than_requires_python():
    target = oldest_python()
    vermin = [sys.executable, "-c", "import sys; from vermin import main; sys.exit(main())"]
    result = subprocess.run(
        [*vermin, "--no-tips", "--violations", f"-t={target}-", *CHECKED],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"code that needs a Python newer than {target}:\n{result.stdout}{result.stderr}"
    assert f"Minimum required versions: {target}" in result.stdout


def pip_download_for(python: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """pip's answer to installing this package for Python `python` (`pip download` of its metadata: the
    project's pyproject.toml and README beside an empty package, no dependencies)."""
    project = tmp_path / f"project-{python}"
    (project / "flowformer").mkdir(parents=True)
    (project / "flowformer" / "__init__.py").touch()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_DIR / name, project / name)
    command = ["-m", "pip", "download", "--no-deps", "--no-build-isolation", "--python-version", python]
    return subprocess.run(
        [sys.executable, *command, "-d", str(tmp_path / "downloads"), str(project)],
        capture_output=True, text=True, check=False,
    )


def test_pip_refuses_python_3_14_where_hydras_command_line_fails(tmp_path):
    """Hydra's command-line parser fails to build on Python 3.14 (every Hydra release to 1.3.8, the newest here), so
    pip refuses the package there with one line naming both versions, before it installs anything; 3.13 is
    accepted."""
    refused = pip_download_for("3.14", tmp_path)
    assert refused.returncode != 0
    assert "ERROR: Package 'flowformer' requires a different Python: 3.14.0 not in '<3.14,>=3.10'" in refused.stderr
    assert pip_download_for("3.13", tmp_path).returncode == 0
