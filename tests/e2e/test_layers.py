"""The package's import contracts (``[tool.importlinter]`` in
pyproject.toml): its layers, no import cycle in any package, and a
simulator that does not import the request path,
TYPE_CHECKING imports included."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: import-linter's Python API (``importlinter.cli.lint_imports``), which
#: prints the report and returns the exit status.
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def test_imports_keep_the_layers_and_form_no_cycle():
    # In a child run from the checkout: the package analysed is this tree's.
    run = subprocess.run([sys.executable, "-c", LINT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: 3 kept, 0 broken." in run.stdout
