"""A P/D pair's vLLM answer joined as the aggregated engine answers it: what
the prefill leg answered (:class:`Prefilled`), the prefill leg's body
(:data:`PREFILL_KV`, :data:`PREFILL_DROPS`), and the decode leg's answer
completed with what only the prefill computed (prompt logprobs, its
prefix-cache report, the prompt positions' routed-expert rows,
:mod:`.experts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asgi_generate.sdk import RequestError

from . import experts

#: A P/D prefill leg's ``kv_transfer_params``, as vLLM's P/D proxies send it
#: (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``,
#: ``send_request_to_service``).
PREFILL_KV = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
#: What a P/D prefill leg leaves out of the client's sampling parameters: its
#: stop criteria (with EOS ignored, its one token always reaches the length
#: cap, the only finish every KV connector hands off: ``MoRIIOConnector.
#: request_finished`` in ``kv_connector/v1/moriio/moriio_connector.py`` takes
#: nothing else) and ``min_tokens`` (the proxies' too). The decode leg keeps
#: them and ends the answer.
PREFILL_DROPS = ("stop", "stop_token_ids", "min_tokens")


@dataclass(slots=True)
class Prefilled:
    """A P/D pair's prefill answer, as its decode leg needs it (kept in the
    pair's ``from_prefill``).

    Attributes:
        kv: its ``kv_transfer_params`` (the decode leg's body carries them).
        prompt_logprobs: its ``prompt_logprobs``.
        experts: each choice's ``routed_experts`` by choice index (the
            prompt positions' rows).
        details: its ``usage.prompt_tokens_details`` (the prefix-cache hit
            of the leg that computed the prompt), ``None`` when it had none.
    """

    kv: Any
    prompt_logprobs: Any = None
    experts: dict[Any, Any] = field(default_factory=dict)
    details: Any = None


def join_details(usage: dict, details: Any, exclude_none: bool) -> None:
    """Make a decode leg's ``usage.prompt_tokens_details`` the prefill
    leg's ``details`` (the leg that computed the prompt; a consumer counts
    the prompt it loaded as cached before vLLM 0.32), as vLLM renders
    them: in a unary answer as the (unary) prefill answer holds it, null
    fields and a null object included; in a stream's closing usage chunk
    (``exclude_none``) without its null fields, and left out when null."""
    if details is None and exclude_none:
        usage.pop("prompt_tokens_details", None)
    elif exclude_none and type(details) is dict:
        usage["prompt_tokens_details"] = {k: v for k, v in details.items() if v is not None}
    else:
        usage["prompt_tokens_details"] = details


def join_unary(pre: Prefilled, obj: dict, choices: list, prompt: int | None) -> bool:
    """A decode leg's unary answer completed from its prefill leg: the
    prompt logprobs where only the prefill computed them (both legs'
    must agree), its ``prompt_tokens_details``, each choice's
    routed-expert rows joined. Returns whether ``obj`` changed.

    Raises:
        RequestError: 502, the legs' prompt logprobs differ, or their
            expert rows cannot be joined (see :func:`join_experts`).
    """
    own = obj.get("prompt_logprobs")
    changed = False
    if pre.prompt_logprobs is not None and own is None:
        obj["prompt_logprobs"] = pre.prompt_logprobs
        changed = True
    elif pre.prompt_logprobs is not None and own != pre.prompt_logprobs:
        raise RequestError(502, "the prefill and decode legs answered different prompt_logprobs", "engine")
    usage = obj.get("usage")
    if type(usage) is dict and usage.get("prompt_tokens_details") != pre.details:
        join_details(usage, pre.details, exclude_none=False)
        changed = True
    for choice in choices:
        rows = choice.get("routed_experts")
        joined = join_experts(pre, choice.get("index", 0), rows, len(choice["token_ids"]),
                              choice.get("finish_reason") or "stop", prompt)
        if joined is not rows:
            choice["routed_experts"] = joined
            changed = True
    return changed

def join_experts(pre: Prefilled, index: Any, own: Any, tokens: int, finish: str, prompt: int | None) -> Any:
    """A decode leg's final ``routed_experts`` for a choice of ``tokens``
    output tokens, as the aggregated engine gives it, by token
    position: the prefill leg's rows (the ``P`` prompt positions, a
    resumed pair's re-fed output included) then the decode leg's of its
    ``tokens - 1`` output positions, whether it answered those alone or
    every position (vLLM 0.27's decode: its prompt rows are KV slots the
    transfer filled, which no forward pass wrote); the prefill leg's
    alone for exactly one token (the decode leg ran no model step);
    ``None`` for an aborted answer. Without rows from the prefill leg,
    the decode leg's when it answered all ``P + tokens - 1``. ``prompt`` is
    ``P`` when the request's token ids are known, else the prefill's row
    count stands for it.

    Raises:
        RequestError: 502, rows that are not base64 ``.npy``, over the
            bounds, of different dtypes or trailing shapes, or of a
            count that fits neither leg (see :mod:`.experts`).
    """
    rows = pre.experts.get(index)
    if finish == "abort" or (rows is None and own is None):
        return None
    if rows is None:
        whole = prompt is not None and experts.parse(own).shape[0] == prompt + tokens - 1
        return own if whole else None
    head = experts.parse(rows)
    prompt = head.shape[0] if prompt is None else prompt
    if head.shape[0] != prompt:
        raise RequestError(
            502, f"the prefill leg sent {head.shape[0]} routed-expert rows for a prompt of {prompt} tokens", "engine"
        )
    if own is None and tokens == 1:
        return rows
    tail = experts.parse(own) if own is not None else None
    count = tail.shape[0] if tail is not None else 0
    if count not in (tokens - 1, prompt + tokens - 1):
        raise RequestError(
            502, f"the decode leg sent {count} routed-expert rows for {tokens} output tokens", "engine"
        )
    return experts.join(head, experts.last(tail, tokens - 1))
