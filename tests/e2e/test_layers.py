"""The package's import contracts (``[tool.importlinter]`` in
pyproject.toml): its layers, no import cycle in any package, a simulator
that imports nothing of the frontend, and a frontend that imports the
simulator only in the CLI that starts it, TYPE_CHECKING imports included."""

from __future__ import annotations

import pathlib
import pkgutil
import subprocess
import sys
import tomllib

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
    assert "Contracts: 4 kept, 0 broken." in run.stdout


def test_the_simulator_contracts_name_every_module_of_the_frontend():
    # A top-level module added to the package is one the simulator may not
    # import and that may not import the simulator, until a contract says so.
    import asgi_generate

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = {c["name"]: c for c in config["contracts"]}
    frontend = {f"asgi_generate.{m.name}" for m in pkgutil.iter_modules(asgi_generate.__path__)} - {
        "asgi_generate.sim", "asgi_generate.assets"}
    codecs = {"asgi_generate_sglang", "asgi_generate_vllm", "asgi_generate_zstd"}
    oracle = contracts["the simulator imports nothing of the frontend it judges"]
    assert (oracle["source_modules"], set(oracle["forbidden_modules"])) == (["asgi_generate.sim"], frontend | codecs)
    starts = contracts["the frontend imports the simulator only in the CLI that starts it"]
    assert set(starts["source_modules"]) == frontend | {"asgi_generate.assets"}
    assert (starts["forbidden_modules"], starts["ignore_imports"]) == (
        ["asgi_generate.sim"], ["asgi_generate.server.cli -> asgi_generate.sim.**"])
