"""The request package's shape: its parts are composed, not inherited.

The attempt loop owns an answer writer and is given a batch strategy; no
module of ``asgi_generate/request/`` subclasses a class another of its
modules defines (overriding a base's privates across files is what this
keeps out).
"""

from __future__ import annotations

import ast
import dataclasses
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


#: What codecs read of an attempt: the SDK's public record holds these and no more.
CODEC_FIELDS = {"engine_id", "role", "worker_id", "worker_info", "pair", "resumes", "entries", "entry_ids",
                "backoff_ms", "fields"}


def test_the_sdk_attempt_holds_what_codecs_read_and_the_leg_record_the_handlers_bookkeeping():
    from asgi_generate.tracing.state import LegRecord
    from asgi_generate.sdk._codec import Attempt

    codecs = pathlib.Path(__file__).resolve().parents[2] / "codecs"
    read = set()
    for path in codecs.glob("*/asgi_generate_*/**/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "attempt":
                read.add(node.attr)
    assert {"engine_id", "role", "pair", "resumes"} <= read <= CODEC_FIELDS
    assert {f.name for f in dataclasses.fields(Attempt)} == CODEC_FIELDS
    assert {f.name for f in dataclasses.fields(LegRecord)} - CODEC_FIELDS == {
        "worker", "live", "outcome", "abort_acked", "tokens", "span_id", "t_sent", "t_ended", "unfinished",
        "entry_acked", "usage", "versions"}
