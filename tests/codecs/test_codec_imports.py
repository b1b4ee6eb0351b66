"""The codec distributions, codecs and engine descriptions alike, use the
frontend only through the SDK's ``__all__`` (and its one public submodule,
``answer``): nothing else of the frontend, no private SDK module."""

from __future__ import annotations

import ast
import pathlib

import asgi_generate.sdk as sdk

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: What a codec distribution may import of asgi_generate.
PUBLIC = {"asgi_generate.sdk", "asgi_generate.sdk.answer"}


def _frontend_imports(path: pathlib.Path) -> list[tuple[str, str]]:
    """``(module, name)`` of each ``asgi_generate`` import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "asgi_generate":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.startswith("asgi_generate.")]
    return found


def test_codec_distributions_import_only_the_public_seams():
    sources = sorted((ROOT / "codecs").glob("*/asgi_generate_*/*.py")) + sorted(
        (ROOT / "tests" / "data" / "toy_engine").rglob("*.py"))
    assert len(sources) > 20
    outside = [(p.relative_to(ROOT).as_posix(), m, n) for p in sources for m, n in _frontend_imports(p)
               if m not in PUBLIC or (m == "asgi_generate.sdk" and n not in sdk.__all__)]
    assert outside == []


def test_the_sdks_submodules_are_private_but_answer():
    modules = sorted(p.stem for p in pathlib.Path(sdk.__file__).parent.glob("*.py") if p.stem != "__init__")
    assert [m for m in modules if not m.startswith("_")] == ["answer"]
    assert "answer" in sdk.__all__
