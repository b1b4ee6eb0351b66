"""JSON scalars read as pydantic v2's lax mode reads them.

vLLM validates its request bodies with pydantic models in lax mode, so a
client may send ``"stream": 1`` or ``"max_tokens": "8"`` and be served. The
vLLM codec (which must not refuse what the engine accepts) and the vLLM
simulator (which must refuse exactly what the engine refuses) share these
rules. Source: pydantic's conversion table (docs "Conversion Table", lax
column, JSON input) as implemented by ``pydantic-core``'s ``input_json.rs``.
"""

from __future__ import annotations

from typing import Any

_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE = frozenset(("0", "off", "f", "false", "n", "no"))


class LaxError(ValueError):
    """The value cannot be read as the kind: ``kind`` and ``msg`` are
    pydantic's error type and message."""

    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind
        self.msg = msg


def lax_scalar(kind: str, value: Any) -> Any:
    """``value`` (a decoded JSON value) read as ``kind`` (``"str"``,
    ``"bool"``, ``"int"`` or ``"float"``), as pydantic's lax mode reads it.

    Raises:
        LaxError: pydantic would refuse it (``string_type``, ``bool_parsing``,
            ``bool_type``, ``int_from_float``, ``int_parsing``, ``int_type``,
            ``float_parsing``, ``float_type``).
    """
    t = type(value)
    if kind == "str":
        if t is str:
            return value
        raise LaxError("string_type", "Input should be a valid string")
    if kind == "bool":
        if t is bool:
            return value
        if t is int and value in (0, 1):
            return bool(value)
        if t is str and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        if t in (str, int, float):
            raise LaxError("bool_parsing", "Input should be a valid boolean, unable to interpret input")
        raise LaxError("bool_type", "Input should be a valid boolean")
    if kind == "int":
        if t in (int, bool):
            return int(value)
        if t is float:
            if value.is_integer():
                return int(value)
            raise LaxError("int_from_float", "Input should be a valid integer, got a number with a fractional part")
        if t is str:
            try:
                return int(value.strip())
            except ValueError:
                raise LaxError("int_parsing", "Input should be a valid integer, unable to parse string as an integer") from None
        raise LaxError("int_type", "Input should be a valid integer")
    if t in (int, float, bool):
        return float(value)
    if t is str:
        try:
            return float(value)
        except ValueError:
            raise LaxError("float_parsing", "Input should be a valid number, unable to parse string as a number") from None
    raise LaxError("float_type", "Input should be a valid number")
