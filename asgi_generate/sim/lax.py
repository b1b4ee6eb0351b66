"""JSON scalars read as pydantic's lax mode reads them, for the vLLM simulator.

vLLM validates request bodies with pydantic models in lax mode (``GenerateRequest``
and ``SamplingParams`` under FastAPI; ``pydantic>=2.12`` in the 0.33.0
wheel's requirements), so an engine serves ``"stream": 1`` or
``"max_tokens": "8"`` and refuses ``"max_tokens": 8.5``. The rules are
pydantic-core's (``src/input/input_json.rs``: ``lax_str``, ``lax_bool``,
``lax_int``, ``lax_float``; ``src/input/shared.rs``: ``str_as_bool``,
``int_as_bool``, ``str_as_int``, ``str_as_float``, ``float_as_int``),
a JSON document's values and ``json.loads``'s Python values read alike;
tests/sim/test_sim_lax.py checks them against the installed pydantic.

- ``str``: a string only.
- ``bool``: a bool; a string spelled ``0 f n no off false`` or ``1 t y on
  yes true`` (ASCII case ignored, nothing else around it); an int 0 or 1
  (another 64-bit int: ``bool_parsing``, a larger one: ``bool_type``); a
  float that ``float_as_int`` reads as 0 or 1 (another such float:
  ``bool_parsing``; a fractional, non-finite or out-of-range one:
  ``bool_type``).
- ``int``: a bool (0 or 1); an int; a float with no fraction strictly
  inside the signed 64-bit range; a string of ASCII digits with an optional
  sign, surrounding white space, ``.`` and zeros after it, and single
  underscores between digits; at most 4,300 characters.
- ``float``: a bool, an int, a float; a string as Rust's ``f64::from_str``
  reads it (``inf``, ``infinity`` and ``nan`` in any case, ``.5``, ``5.``,
  exponents), white space around it, single underscores between digits.
"""

from __future__ import annotations

import re
from typing import Any

_TRUE = frozenset(("1", "t", "y", "on", "yes", "true"))
_FALSE = frozenset(("0", "f", "n", "no", "off", "false"))
_I64 = 1 << 63
#: A JSON integer (jiter's ``NumberInt``): a minus, then 0 or digits without a leading 0.
_JSON_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
#: What ends ``strip_leading_zeros``' run of zeros and underscores.
_LEAD = frozenset("0123456789-")
#: Rust's ``f64::from_str``.
_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)", re.IGNORECASE)
#: ``str_as_int``'s length bound (CPython's int-from-string limit).
MAX_INT_DIGITS = 4300


class LaxError(ValueError):
    """pydantic refuses the value: ``kind`` is its error type, ``msg`` its
    message."""

    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind
        self.msg = msg


def _err(kind: str) -> LaxError:
    return LaxError(kind, _MESSAGES[kind])


_MESSAGES = {
    "string_type": "Input should be a valid string",
    "bool_type": "Input should be a valid boolean",
    "bool_parsing": "Input should be a valid boolean, unable to interpret input",
    "int_type": "Input should be a valid integer",
    "int_parsing": "Input should be a valid integer, unable to parse string as an integer",
    "int_from_float": "Input should be a valid integer, got a number with a fractional part",
    "int_parsing_size": "Unable to parse input string as an integer, exceeded maximum size",
    "finite_number": "Input should be a finite number",
    "float_type": "Input should be a valid number",
    "float_parsing": "Input should be a valid number, unable to parse string as a number",
}


def _without_underscores(text: str) -> str | None:
    """``text`` with its underscores dropped when they only separate
    characters (``strip_underscores``), else ``None``."""
    if "_" not in text or text.startswith("_") or text.endswith("_") or "__" in text:
        return None
    return text.replace("_", "")


def _float_as_int(value: float) -> int:
    """``float_as_int``.

    Raises:
        LaxError: ``finite_number``, ``int_from_float`` or ``int_parsing_size``.
    """
    if value != value or value in (float("inf"), float("-inf")):
        raise _err("finite_number")
    if not value.is_integer():
        raise _err("int_from_float")
    if not -_I64 < value < _I64:
        raise _err("int_parsing_size")
    return int(value)


def _str_as_int(text: str) -> int:
    """``str_as_int``: the text as a JSON integer, else as
    :func:`_clean_int_str` leaves it, as a JSON integer.

    Raises:
        LaxError: ``int_parsing_size`` or ``int_parsing``.
    """
    if len(text.strip()) > MAX_INT_DIGITS:
        raise _err("int_parsing_size")
    if _JSON_INT.fullmatch(text):
        return int(text)
    cleaned = _clean_int_str(text)
    if cleaned is not None and _JSON_INT.fullmatch(cleaned):
        return int(cleaned)
    raise _err("int_parsing")


def _clean_int_str(text: str) -> str | None:
    """``clean_int_str``: one sign, leading zeros (and the underscores
    among them), ``.0+`` and separating underscores taken away; ``None``
    when that leaves nothing to read or nothing was cleaned."""
    before = len(text)
    s = text.strip()
    if s.startswith("+"):
        if s[1:].startswith("-"):
            return None
        s = s[1:]
    negative = s.startswith("-")
    if negative:
        s = s[1:]
        if s.startswith(("-", "+")):
            return None
    s = _strip_leading_zeros(s)
    if s is None:
        return None
    dot = s.find(".")
    if dot >= 0 and s[dot + 1:] and not s[dot + 1:].strip("0"):
        s = s[:dot]
    stripped = _without_underscores(s)
    if stripped is None:
        if before == len(s):
            return None
        stripped = s
    return "-" + stripped if negative else stripped


def _strip_leading_zeros(s: str) -> str | None:
    """``strip_leading_zeros``: from the first character after the leading
    zeros and underscores that is a nonzero digit or a ``-`` (kept as it
    is, so ``0-1`` reads as -1 in pydantic too), or from the last zero
    before a ``.``; one character of an all-zero text."""
    if not s or s[0] not in _LEAD:
        return None
    if s[0] != "0":
        return s
    for i in range(1, len(s)):
        c = s[i]
        if c in "0_":
            continue
        if c in _LEAD:
            return s[i:]
        return s[i - 1:] if c == "." else None
    return s[-1:]


def _str_as_float(text: str) -> float:
    """``str_as_float``: the text without its surrounding whitespace as a
    float, else the text as given with its separating underscores dropped
    (pydantic strips no whitespace then: ``"1_0 "`` is refused).

    Raises:
        LaxError: ``float_parsing``.
    """
    for candidate in (text.strip(), _without_underscores(text)):
        if candidate is not None and _FLOAT.fullmatch(candidate):
            return float(candidate)
    raise _err("float_parsing")


def lax_scalar(kind: str, value: Any) -> Any:
    """``value`` (a decoded JSON value) read as ``kind`` (``"str"``,
    ``"bool"``, ``"int"`` or ``"float"``) in pydantic's lax mode.

    Raises:
        LaxError: pydantic refuses it (``string_type``, ``bool_type``,
            ``bool_parsing``, ``int_type``, ``int_parsing``,
            ``int_from_float``, ``int_parsing_size``, ``finite_number``,
            ``float_type``, ``float_parsing``).
    """
    t = type(value)
    if kind == "str":
        if t is str:
            return value
        raise _err("string_type")
    if kind == "bool":
        if t is bool:
            return value
        if t is str:
            low = value.lower() if value.isascii() else value
            if low in _TRUE or low in _FALSE:
                return low in _TRUE
            raise _err("bool_parsing")
        if t is float:
            try:
                value = _float_as_int(value)
            except LaxError:
                raise _err("bool_type") from None
            t = int
        if t is int:
            if value in (0, 1):
                return value == 1
            raise _err("bool_parsing" if -_I64 <= value < _I64 else "bool_type")
        raise _err("bool_type")
    if kind == "int":
        if t is bool or t is int:
            return int(value)
        if t is float:
            return _float_as_int(value)
        if t is str:
            return _str_as_int(value)
        raise _err("int_type")
    if t is bool or t is int or t is float:
        return float(value)
    if t is str:
        return _str_as_float(value)
    raise _err("float_type")
