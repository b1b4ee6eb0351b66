"""A P/D pair's SGLang answer joined as the aggregated engine answers it:
the decode leg's ``meta_info`` completed with what only the prefill leg
computed (its prompt logprobs, its prefix-cache report, the prompt's
routed-expert rows, :mod:`.experts`). For one request and for each entry
of a batch alike.
"""

from __future__ import annotations

from asgi_generate.sdk import RequestError

from . import experts

#: ``meta_info`` fields only the prefill leg computed (prompt logprobs).
PREFILL_LOGPROBS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
#: The prefill leg's prefix-cache report, the client's (the leg that
#: computed the prompt; a decode counts what it received as it may).
PREFILL_CACHE = ("cached_tokens", "cached_tokens_details")


def join_prefill(pre: dict, meta: dict, logprobs: bool) -> bool:
    """Put the prefill leg's ``meta_info`` ``pre`` into the decode leg's
    ``meta``: its prompt logprobs before the decode's (when ``logprobs``:
    every cumulative chunk, an incremental stream's first) and its
    prefix-cache report in place of the decode's. Whether ``meta`` changed."""
    joined = False
    if logprobs:
        for key in PREFILL_LOGPROBS:
            got = pre.get(key)
            if type(got) is list:
                own = meta.get(key)
                meta[key] = got + own if type(own) is list else got
                joined = True
    for key in PREFILL_CACHE:
        if key in pre and meta.get(key) != pre[key]:
            meta[key] = pre[key]
            joined = True
    return joined


def join_experts(pre: dict, meta: dict, start: object) -> bool:
    """The decode leg's final ``meta`` with the expert rows by token
    position, the prompt's from the prefill leg's ``pre``, the output's
    from the decode's (:func:`.experts.join`; ``start`` the request's
    ``routed_experts_start_len``), as the aggregated engine answers them;
    an aborted answer gets none of the prefill's. Whether ``meta`` changed.

    Raises:
        RequestError: 502, rows that are not base64 int32, of counts that
            fit neither leg, or of another dtype than the decode leg's.
    """
    rows = pre.get("routed_experts")
    if rows is None or meta["finish_reason"].get("type") == "abort":
        return False
    if pre.get("routed_experts_dtype") != meta.get("routed_experts_dtype"):
        raise RequestError(502, "prefill and decode legs sent routed experts of different dtypes", "engine")
    own = meta.get("routed_experts")
    prompt, tokens = meta.get("prompt_tokens"), meta.get("completion_tokens")
    if type(prompt) is not int or type(tokens) is not int:
        raise RequestError(502, "the decode leg sent routed experts without its token counts", "engine")
    value = experts.join(rows, own, prompt, start if type(start) is int else 0, tokens)
    if own is None and "e2e_latency" in meta:  # where the aggregated engine has it
        rest = {k: meta.pop(k) for k in list(meta)[list(meta).index("e2e_latency"):]}
        meta["routed_experts"] = value
        meta.update(rest)
    else:
        meta["routed_experts"] = value
    return True
