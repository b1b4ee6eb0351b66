"""The request package's shape: its parts are composed, not inherited.

The attempt loop owns an answer writer and is given a batch strategy; no
module of ``asgi_generate/request/`` subclasses a class another of its
modules defines (overriding a base's privates across files is what this
keeps out).
"""

from __future__ import annotations

import importlib
import inspect
import pathlib

import asgi_generate.request

PACKAGE = pathlib.Path(asgi_generate.request.__file__).parent


def test_no_request_module_subclasses_a_class_of_another_request_module():
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        name = f"asgi_generate.request.{path.stem}"
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != name:
                continue
            for base in cls.__mro__[1:]:
                if base.__module__.startswith("asgi_generate.request.") and base.__module__ != name:
                    found.append(f"{cls.__qualname__} ({path.name}) < {base.__qualname__} ({base.__module__})")
    assert found == []
