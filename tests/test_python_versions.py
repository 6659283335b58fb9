"""The code runs on the oldest Python that pyproject.toml's requires-python admits (the README's "Python >= 3.10",
Ubuntu 22.04's python3): it uses no syntax, module or member of the standard library newer than that, as vermin
reads every file. `typing.Self` (3.11) in flowformer/stop_signals.py stopped every command at import on 3.10.
"""

from __future__ import annotations

import re
import subprocess
import sys

from helpers.configs import REPO_DIR

CHECKED = ["flowformer", "run.py", "tools", "tests", "docs/measured"]


def oldest_python() -> str:
    """'3.10' from `requires-python = ">=3.10"` (read as text: tomllib is 3.11's)."""
    pyproject = (REPO_DIR / "pyproject.toml").read_text(encoding="utf-8")
    return re.search(r'^requires-python = ">=(3\.\d+)"$', pyproject, re.MULTILINE).group(1)


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
