"""The vLLM simulator's lax reader (sim/lax.py) reads every JSON scalar as
pydantic's lax mode does: each value validated by the installed pydantic
(what vLLM's request models run on) and by the simulator, the same value or
the same error type and message."""

from __future__ import annotations

import anyio
import orjson
import pytest
from hypothesis import given, settings, strategies as st

from asgi_generate.sim.app import SimApp
from asgi_generate.sim.lax import LaxError, lax_scalar
from support import asgi_request

pydantic = pytest.importorskip("pydantic", reason="pydantic, the reference the simulator's lax reader follows")

KINDS = {"str": str, "bool": bool, "int": int, "float": float}
ADAPTERS = {kind: pydantic.TypeAdapter(t) for kind, t in KINDS.items()}

EDGES = [
    True, False, 0, 1, 2, -1, 2**63 - 1, 2**63, -2**63, -2**64, 2**70, 0.0, 1.0, 2.0, 1.5, -0.0, 1e300, 9.2e18, 9.3e18,
    "1", "0", "yes", "No", "TRUE", "Y", " true", "true ", "on", "OFF", "", "8", " 8 ", "\t8\n", "8.0", "8.00", "8.",
    "8.5", "1e3", "+3", "-3", "-0", "08", "1_000", "_1", "1__0", "1_0.0", "8.0_0", "0x10", "inf", "-Infinity", "nan",
    "+nan", "3.", ".5", "+.5", "1E3", "1.5e", "1_0.5", "\u0663", "9" * 19, "9" * 4301, None, [], {},
    # pydantic-core's clean_int_str: a '-' after leading zeros is a sign
    "0-0", "0-1", "00_0-12", "+0-1", "0-01", "0-00", "-0-1", "0--1", "0_-1", "0-1_0", "0-1.0", "0__0", "-01",
    # str_as_float drops underscores from the text as given, whitespace and all
    "0_0 ", "1_0 ", " 1_0", "1_0\t", " 1_0.5 ", "1_0.5",
]


def test_a_minus_after_leading_zeros_reads_as_a_sign_as_in_pydantic():
    assert [lax_scalar("int", v) for v in ("0-1", "00_0-12", "+0-1", "0-1.0")] == [-1, -12, -1, -1]
    for refused in ("0-01", "-0-1", "0--1"):
        with pytest.raises(LaxError, match="unable to parse string as an integer"):
            lax_scalar("int", refused)


def _pydantic(kind: str, value) -> tuple:
    try:
        big = type(value) is int and not -2**63 <= value < 2**64  # past orjson's ints: JSON's own digits
        out = ADAPTERS[kind].validate_json(str(value) if big else orjson.dumps(value))
        return "ok", type(out), out
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        return "error", err["type"], err["msg"]


def _sim(kind: str, value) -> tuple:
    try:
        out = lax_scalar(kind, value)
        return "ok", type(out), out
    except LaxError as exc:
        return "error", exc.kind, exc.msg


def _same(kind: str, value) -> None:
    want, got = _pydantic(kind, value), _sim(kind, value)
    if want[0] == got[0] == "ok" and want[1] is float and want[2] != want[2]:  # nan
        assert got[1] is float and got[2] != got[2]
    else:
        assert got == want, (kind, value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", EDGES, ids=lambda v: repr(v)[:24])
def test_edges_read_as_pydantic_reads_them(kind, value):
    _same(kind, value)


_NUMERIC_TEXT = st.text(alphabet="0123456789+-._eEinfatyo \t", max_size=8)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(list(KINDS)),
       value=st.one_of(st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                       _NUMERIC_TEXT, st.text(max_size=4)))
def test_any_scalar_reads_as_pydantic_reads_it(kind, value):
    _same(kind, value)


def test_the_vllm_simulator_serves_what_pydantic_reads():
    # 1.0 is a boolean and "4.00" an integer to pydantic (and so to vLLM).
    body = {"token_ids": [1, 2, 3], "stream": 0.0, "sampling_params": {"max_tokens": "4.00", "ignore_eos": 1.0}}

    async def run():
        return await asgi_request(SimApp("vllm"), "POST", "/inference/v1/generate", orjson.dumps(body))
    status, _, raw = anyio.run(run)
    assert status == 200 and len(orjson.loads(raw)["choices"][0]["token_ids"]) == 4
