"""Routed-expert rows of an SGLang P/D pair, joined by token position.

Wire format: ``meta_info.routed_experts`` is the base64 of a finished
request's int32 rows, ``[rows, num_layers, topk]`` flattened, one row per
forwarded position (``TokenizerManager`` in ``managers/tokenizer_manager.py``;
rows from ``BatchResultProcessor._maybe_collect_routed_experts`` in
``managers/scheduler_components/batch_result_processor.py``: positions
``[routed_experts_start_len, seqlen - 1)`` of the engine's own capture
buffers). A prefill engine answers the prompt's positions ``[s, P)``; a decode
engine, which received the prompt's KV and never forwarded it, answers
``[s, P + N - 1)`` of its own buffers (SGLang 0.5.23: its prompt rows are
whatever those slots held), or, an engine that keeps only what it computed,
the output positions ``[max(s, P), P + N - 1)``. The aggregated engine's
answer is the prompt rows from the prefill leg and the output rows from the
decode leg, ``P - s + N - 1`` rows; anything else fails the request (502),
never a partial or padded blob.
"""

from __future__ import annotations

import base64
import binascii

from asgi_generate.sdk import RequestError

#: Bytes per expert id (int32).
ITEM = 4


def _bad(why: str) -> RequestError:
    return RequestError(502, f"a P/D leg sent routed experts that {why}", "engine")


def rows_bytes(value: object) -> bytes:
    """Raw int32 rows of a ``routed_experts`` value (base64).

    Raises:
        RequestError: 502, not base64 of whole int32 values.
    """
    try:
        raw = base64.b64decode(value, validate=True) if type(value) is str else None
    except binascii.Error:
        raw = None
    if raw is None or len(raw) % ITEM:
        raise _bad("are not base64 int32 rows")
    return raw


def join(pre: object, own: object, prompt: int, start: int, tokens: int) -> str:
    """The aggregated answer's ``routed_experts`` of a pair whose prefill leg
    answered ``pre`` and whose decode leg answered ``own`` (``None``: no
    rows) for a prompt of ``prompt`` tokens, ``routed_experts_start_len``
    ``start`` and ``tokens`` output tokens (the decode's
    ``completion_tokens``, its first token the prefill's).

    Raises:
        RequestError: 502, rows that are not base64 int32, or counts that
            fit neither leg (the row width is the prefill's bytes over its
            ``prompt - start`` rows).
    """
    start = min(max(start, 0), prompt)
    head = rows_bytes(pre)
    tail = rows_bytes(own) if own is not None else b""
    outputs = max(tokens - 1, 0)
    if prompt == start:  # the prefill computed no row: the decode's are all
        if own is None and outputs:
            raise _bad(f"leave out the rows of {outputs} output positions")
        return base64.b64encode(tail).decode("ascii")
    width, extra = divmod(len(head), prompt - start)
    if extra or not width or width % ITEM:
        raise _bad(f"come to {len(head)} bytes from the prefill leg for {prompt - start} prompt positions")
    count, extra = divmod(len(tail), width)
    if extra or count not in (outputs, prompt - start + outputs):
        raise _bad(f"come to {count} rows from the decode leg for {outputs} output positions "
                   f"after a prompt of {prompt} from {start}")
    rest = tail[len(tail) - outputs * width:] if outputs else b""
    return base64.b64encode(head + rest).decode("ascii")
