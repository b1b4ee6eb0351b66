"""asgi_generate/exceptions.py is the one module that defines the
frontend's exceptions: no other module defines one, but for the SDK's
(codecs raise and catch them: sdk/_codec.py, sdk/_lax.py) and the
simulator's (it shares no code with the frontend it checks)."""

from __future__ import annotations

import ast
import builtins
import pathlib

import asgi_generate

PACKAGE = pathlib.Path(asgi_generate.__file__).parent
#: Builtin exception and warning classes, by name.
BUILTIN = {name for name, obj in vars(builtins).items() if isinstance(obj, type) and issubclass(obj, BaseException)}


def _defined_outside() -> list[str]:
    """``path: name`` of each class outside exceptions.py, the SDK's codec
    errors and sim/ whose base is a builtin exception or another such class."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ("exceptions.py", "sdk/_codec.py", "sdk/_lax.py") or rel.startswith("sim/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (rel, [ast.unparse(b).split(".")[-1] for b in node.bases])
    from asgi_generate import exceptions

    known = BUILTIN | set(exceptions.__all__)
    found: set[str] = set()
    while True:
        new = {name for name, (_, bases) in classes.items() if name not in found and known & set(bases)}
        if not new:
            break
        found |= new
        known |= new
    return sorted(f"{classes[name][0]}: {name}" for name in found)


def test_the_frontends_exceptions_are_defined_in_one_module():
    assert _defined_outside() == [
        # A warning category: pyproject.toml's filterwarnings names it by this path.
        "request/state.py: IllegalTransition",
    ]


def test_every_exception_of_the_module_is_exported():
    from asgi_generate import exceptions

    defined = {name for name, obj in vars(exceptions).items()
               if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == exceptions.__name__}
    assert sorted(exceptions.__all__) == sorted(defined)
