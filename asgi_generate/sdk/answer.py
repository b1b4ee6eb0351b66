"""Checks of a worker's answer, for codecs' :meth:`Exchange.feed`.

Each check reads one field of a decoded JSON answer and either returns it or
raises :class:`~asgi_generate.sdk.WorkerAnswerError` naming the field
(by its path in the answer, e.g. ``meta_info.finish_reason.type``), what it
is and what the protocol has there. A missing field reads as ``MISSING``;
``None`` is JSON ``null``. Booleans are never integers (JSON tells them
apart; Python's ``bool`` subclasses ``int``).
"""

from __future__ import annotations

from typing import Any

import orjson

from ._codec import WorkerAnswerError

class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


#: A field the answer does not have (what ``obj.get(key, MISSING)`` gives).
MISSING: Any = _Missing()

_KINDS = {
    type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
    list: "a list", dict: "an object",
}


def kind(value: Any) -> str:
    """``value``'s JSON kind as a message says it (``"a string"``, ``"null"``, ...)."""
    if value is MISSING:
        return "missing"
    return _KINDS.get(type(value), type(value).__name__)


def wrong(field: str, value: Any, expected: str) -> WorkerAnswerError:
    """The error for ``field`` holding ``value`` where the protocol has
    ``expected``: ``<field> is <kind>, expected <expected>``."""
    return WorkerAnswerError(f"{field} is {kind(value)}, expected {expected}")


def parse(payload: bytes, what: str = "the body") -> Any:
    """``payload`` as JSON.

    Raises:
        WorkerAnswerError: it is not JSON (``what`` names it: ``the body``,
            ``a chunk``).
    """
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise WorkerAnswerError(f"{what} is not JSON") from None


def answer_object(payload: bytes, what: str = "the body") -> dict:
    """``payload`` as a JSON object.

    Raises:
        WorkerAnswerError: it is not JSON, or not an object.
    """
    obj = parse(payload, what)
    if type(obj) is not dict:
        raise wrong(what, obj, "an object")
    return obj


def check(obj: dict, key: str, field: str, types: tuple[type, ...], expected: str, optional: bool = True) -> Any:
    """``obj[key]`` when its type is one of ``types`` (exactly: no
    subclasses), else raise; a missing key is ``MISSING`` when ``optional``.
    ``field`` names it in the message, ``expected`` says what it should be.

    Raises:
        WorkerAnswerError: the field is missing (not ``optional``) or of
            another type.
    """
    value = obj.get(key, MISSING)
    if value is MISSING and optional:
        return value
    if type(value) not in types:
        raise wrong(field, value, expected)
    return value


def int_or_none(obj: dict, key: str, field: str) -> int | None:
    """``obj[key]``: an integer, ``null`` or missing (both ``None``).

    Raises:
        WorkerAnswerError: anything else.
    """
    value = obj.get(key)
    if value is not None and type(value) is not int:
        raise wrong(field, value, "an integer")
    return value


def int_list(value: Any, field: str, start: int = 0) -> list[int]:
    """``value``, a list of integers (token ids); ``start`` is the position
    of its first item in ``field`` (a cumulative chunk's new tail), for the
    message.

    Raises:
        WorkerAnswerError: not a list, or an item that is not an integer.
    """
    if type(value) is not list:
        raise wrong(field, value, "a list of integers")
    if all(type(item) is int for item in value):
        return value
    for i, item in enumerate(value):
        if type(item) is not int:
            raise wrong(f"{field}[{start + i}]", item, "an integer")
    return value
