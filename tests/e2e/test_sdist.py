"""The source distribution holds what the C accelerator is built from, on the
setuptools this environment has (the build-system's floor allows 65.5, which
leaves an Extension's ``depends`` out: MANIFEST.in names them)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

import asgi_generate

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).parents[2]


def test_the_sdist_holds_the_accelerators_sources(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for path in ROOT.iterdir():  # setup.py, setup.cfg, pyproject.toml, MANIFEST.in, README.md, ...
        if path.is_file():
            shutil.copy(path, src / path.name)
    shutil.copytree(ROOT / "asgi_generate", src / "asgi_generate",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist", "-d",
                    str(tmp_path / "dist")], cwd=src, capture_output=True, check=True, timeout=120)
    top = f"asgi-generate-{asgi_generate.__version__}"
    with tarfile.open(tmp_path / "dist" / f"{top}.tar.gz") as sdist:
        names = set(sdist.getnames())
    for path in ("asgi_generate/_vendor/xxhash/xxhash.h", "asgi_generate/_vendor/xxhash/LICENSE", "setup.py",
                 "MANIFEST.in", "asgi_generate/hashes/_native.c", "asgi_generate/hashes/_python.py"):
        assert f"{top}/{path}" in names, path
