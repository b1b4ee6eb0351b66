"""SGLang batches and ``n`` > 1 on ``/generate``: checks, worker bodies and
the client's answer.

Wire format: SGLang ``managers/io_struct.py`` (``GenerateReqInput.
normalize_batch_and_arguments``, ``_normalize_rid``,
``_validate_rid_uniqueness``, ``_handle_parallel_sampling``) and
``managers/tokenizer_manager.py`` (``_handle_batch_request``). A list
``text``, a list of lists ``input_ids`` or ``n`` > 1 makes a batch. Its items
are SGLang's entries in answer order: prompt ``i`` for ``n`` = 1; sample
``s`` of prompt ``i`` at ``i * n + s`` (prompt-major) for ``n`` > 1. The
client knows entry ``j`` by ``rid_j`` (a string ``rid``) or ``rid[j]`` (a
list, of the batch's length, unique); SGLang runs ``n`` > 1 samples under
fresh uuids the client never chose, and so does the frontend (its minted
ids).

The frontend names every entry itself: each leg sends the entries it carries
as one SGLang batch (always in batch shape) with ``rid`` the list of ids
minted for them, so each entry is aborted by its own id, samples included
(SGLang's own sample uuids could not be). ``n`` > 1 is sent expanded (each
prompt repeated ``n`` times with ``n`` 1), which is what SGLang's tokenizer
manager does with it; per-item fields given as a list follow their item.
A leg carrying the whole ``n`` = 1 batch sends the client's body with only
``rid`` replaced.

On a P/D pair both legs carry the same entries, with the pair's bootstrap
host and port and ``bootstrap_room`` a list of one room per entry in body
order (SGLang's ``_normalize_bootstrap_params`` takes a list as given when
``n`` is 1, which the expanded body always is; a scalar would become
``room + i``, and a list with ``n`` > 1 would repeat its rooms for every
sample). The prefill leg's answer is kept per entry in the pair
(``Pair.from_prefill``) and joined into that entry's decode answer as for
one request (:mod:`.join`).

The answer is the engine's: unary, the JSON list of the entries' objects in
entry order (legs joined in order); SSE, each chunk as the engine sent it
with ``meta_info.id`` the client's id for the entry and ``index`` its place
in the client's batch, then ``data: [DONE]``. Where the client gave no
``rid`` (or for samples) the id shown is the minted one, standing in for
SGLang's uuid.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import orjson

from asgi_generate.sdk import (
    Attempt, BatchItem, EngineError, Event, Exchange, GenerateRequest, RequestError, WorkerRequest, dump_body,
    LEG_DONE, engine_error_page,
)

from asgi_generate.sdk import WorkerAnswerError
from asgi_generate.sdk.answer import MISSING, check, parse, wrong

from .answer import check_error, chunk_meta
from .join import join_experts, join_prefill
from .request import MULTIMODAL, check_prompt_length, error_body

#: Top-level fields SGLang reads per batch item when given as a list.
PER_ITEM = (
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_hidden_states",
    "lora_path", "custom_logit_processor", "extra_key", "cache_salt", "image_data", "video_data", "audio_data",
    "return_routed_experts",
)


def is_batch(obj: dict) -> bool:
    """Whether an SGLang ``/generate`` object is a batch or asks for ``n`` > 1."""
    text, ids = obj.get("text"), obj.get("input_ids")
    if type(text) is list:
        return True
    if text is None and type(ids) is list and ids and type(ids[0]) is list:
        return True
    n = _n(obj.get("sampling_params"))
    return type(n) is int and n > 1


def _n(sp: Any) -> Any:
    if type(sp) is dict:
        return sp.get("n", 1)
    if type(sp) is list and sp and type(sp[0]) is dict:
        return sp[0].get("n", 1)
    return 1


def decode_batch(
    obj: dict, refuse: Callable[[str], RequestError], schema: Callable[[str], RequestError], limit: int
) -> list[BatchItem]:
    """The items of a batch object, checked as SGLang checks them.

    Args:
        obj: the request object.
        refuse: makes SGLang's ``ValueError`` answer for a message.
        schema: makes SGLang's schema-error answer for a message.
        limit: the items (prompts times ``n``) one request may carry
            (``--max-request-items``; SGLang itself sets none).

    Raises:
        RequestError: SGLang's answer for a bad batch; the same ``ValueError``
            answer for one past ``limit``, before any item is made.
    """
    key = "text" if obj.get("text") is not None else "input_ids"
    inputs = obj.get(key)
    if inputs is None:
        raise refuse("Either text, input_ids or input_embeds should be provided.")
    single = type(inputs) is not list or (key == "input_ids" and inputs and type(inputs[0]) is not list)
    prompts = [inputs] if single else inputs
    if not prompts:
        raise refuse(f"{key} cannot be empty.")
    for prompt in prompts:
        if key == "text" and type(prompt) is not str:
            raise schema(f"text: Input should be a valid string, got {type(prompt).__name__}")
        if key == "input_ids":
            if type(prompt) is not list or not all(type(t) is int for t in prompt):
                raise schema("input_ids: Input should be a valid list of integers")
            if not prompt:
                raise refuse("input_ids cannot be empty.")
            if min(prompt) < 0:
                raise refuse(f"input_ids: token id {min(prompt)} is negative.")
    size = len(prompts)
    sp = obj.get("sampling_params")
    n = _n(sp)
    if type(sp) is list:
        if not all(type(p) is dict for p in sp):
            raise schema("sampling_params: Input should be a valid dictionary")
        if any(p.get("n", 1) != n for p in sp):
            raise refuse("The parallel_sample_num should be the same for all samples in sample params.")
        if len(sp) < size:
            raise refuse("The length of sampling_params should be equal to the batch size.")
    if type(n) is not int:
        raise schema(f"sampling_params.n: Input should be a valid integer, got {type(n).__name__}")
    if n < 1:
        raise refuse(f"n must be at least 1, got {n}.")
    if size * n > limit:
        raise refuse(f"The request carries {size * n} items ({size} prompts x n {n}), more than the {limit} "
                     "this server allows per request (--max-request-items).")
    for p in sp if type(sp) is list else [sp or {}]:
        max_new = p.get("max_new_tokens", 128)
        if max_new is not None and type(max_new) is not int:
            raise schema("sampling_params.max_new_tokens: Input should be a valid integer")
        if type(max_new) is int and max_new < 0:
            raise refuse(f"max_new_tokens must be at least 0, got {max_new}.")
    rid = obj.get("rid")
    if type(rid) is list:
        if not all(type(r) is str for r in rid):
            raise schema("rid: Input should be a valid list of strings")
        if len(rid) != size:
            raise refuse("The specified rids length mismatch with the batch_size for batch processing.")
        dups = [r for r, c in Counter(rid).items() if c > 1]
        if dups:
            raise refuse(f"Duplicate request IDs detected within the request: {dups}")
    excluded = "text" if key == "text" else None
    if any(obj.get(k) is not None for k in MULTIMODAL):
        excluded = "multimodal"
    groups: dict[Any, int] = {}
    items = []
    for i, prompt in enumerate(prompts):
        group = groups.setdefault(orjson.dumps(prompt), len(groups))
        for s in range(n):
            j = i * n + s
            if n > 1:
                public = None  # SGLang runs samples under fresh uuids
            elif type(rid) is str:
                public = f"{rid}_{j}"
            else:
                public = rid[i] if type(rid) is list else None
            ids = prompt if excluded is None else None
            items.append(BatchItem(public, ids, excluded, group))
    return items


class SGLangBatchExchange(Exchange):
    """One SGLang batch request's state across its legs.

    Args:
        request: the decoded request (``items`` set).
    """

    #: The handler mints an id per item (``Attempt.entry_ids``).
    names_entries = True

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.obj: dict = request.native
        items = request.items
        self.n = len(items) // _prompt_count(self.obj)
        #: Per item: output ids seen (cumulative streams), its last object.
        self.seen = [0] * len(items)
        self.answers: list[Any] = [None] * len(items)
        self.finished: set[int] = set()
        #: Client bytes per event not yet rendered (legs run at once may feed
        #: between an event and its rendering).
        self.outs: dict[int, bytes] = {}
        self.incremental: dict[int, bool] = {}
        #: P/D: the entries whose decode answer already carries the prefill's prompt logprobs.
        self.joined: set[int] = set()

    def resume_refusal(self) -> str | None:
        """Batches are not resumed mid-answer."""
        return "a batch is not resumed"

    def worker_request(self, attempt: Attempt) -> WorkerRequest:
        """The body for the entries ``attempt`` carries, each under its
        minted id (``attempt.entry_ids``); see the module docstring.

        Raises:
            RequestError: an entry's token prompt does not fit the worker's
                context length: SGLang's own 400 for the batch, before any
                engine sees it.
        """
        entries = attempt.entries
        obj = self.obj
        info = attempt.worker_info
        if not info.get("allow_auto_truncate"):
            for j in entries:
                check_prompt_length(self.request.items[j].input_ids, info.get("max_model_len"), self.request.stream)
        if self.n == 1 and entries == list(range(len(self.request.items))) and _is_list_batch(obj):
            body = dict(obj)
        else:
            body = self._entries_body(entries)
        body["rid"] = [attempt.entry_ids[j] for j in entries]
        if attempt.pair is not None:
            body.update(attempt.pair.fields)
        stream = self.request.stream
        self.incremental[id(attempt)] = stream and bool(attempt.worker_info.get("incremental_streaming_output"))
        return WorkerRequest(b"/generate", dump_body(body), stream=stream)

    def _entries_body(self, entries: list[int]) -> dict:
        obj, n = self.obj, self.n
        key = "text" if obj.get("text") is not None else "input_ids"
        prompts = obj[key] if _is_list_batch(obj) else [obj[key]]
        size = len(prompts)
        body = dict(obj)
        body[key] = [prompts[j // n] for j in entries]
        sp = obj.get("sampling_params")
        if type(sp) is list or n > 1:
            per = sp if type(sp) is list else [sp or {}] * size
            body["sampling_params"] = [{**per[j // n], "n": 1} if n > 1 else per[j // n] for j in entries]
        for name in PER_ITEM:
            value = obj.get(name)
            if type(value) is list and len(value) == size and (name != "token_ids_logprob" or type(value[0]) is list):
                body[name] = [value[j // n] for j in entries]
        return body

    def _public(self, j: int, attempt: Attempt) -> str:
        public = self.request.items[j].public_id
        return public if public is not None else attempt.entry_ids[j]

    def feed(self, attempt: Attempt, payload: bytes) -> Event:
        """A unary leg's JSON list (one object per carried entry) or one
        SSE chunk of one entry (its ``index`` the place in the leg's body).

        Raises:
            WorkerAnswerError: the payload is not what SGLang sends
                (:mod:`.answer`): a unary leg's list of one object per
                carried entry, a stream's chunk of one entry with its
                ``index``, or an error object.
            RequestError: 502, a P/D entry cannot be joined.
        """
        stream = self.request.stream
        got = parse(payload, "the chunk" if stream else "the body")
        if type(got) is dict and "meta_info" not in got and "error" in got:
            check_error(got, "")
            err = got["error"]
            event = Event([], error=EngineError(err.get("code", 400), err["message"]))
            self.outs[id(event)] = orjson.dumps({"error": err})
            return event
        entries = attempt.entries
        if not stream:
            if type(got) is not list:
                raise wrong("the body", got, "a list of one answer per entry")
            if len(got) != len(entries):
                raise WorkerAnswerError(f"the body is a list of {len(got)}, expected {len(entries)} answers")
            pairs = list(zip(entries, got))
        else:
            if type(got) is not dict:
                raise wrong("the chunk", got, "an object")
            k = check(got, "index", "index", (int,), "an integer", optional=False)
            if not 0 <= k < len(entries):
                raise WorkerAnswerError(f"index is {k}, expected an entry of the leg's {len(entries)}")
            pairs = [(entries[k], got)]
        prefill = attempt.role == "prefill"
        incremental = self.incremental.get(id(attempt), False)
        for k, (j, chunk) in enumerate(pairs):
            at = "" if stream else f"[{k}]."
            if type(chunk) is not dict:
                raise wrong(at[:-1], chunk, "an object")
            # A cumulative chunk repeats the entry's last one (see SGLangExchange.feed).
            cumulative = stream and not (prefill or incremental)
            seen = self.seen[j] if cumulative else 0
            if chunk_meta(chunk, at, seen, inputs=not cumulative or seen == 0) is None:
                raise wrong(f"{at}meta_info", MISSING, "an object")
        if prefill:
            return _prefill_event(attempt, pairs)
        pre = attempt.pair.from_prefill if attempt.pair is not None and attempt.role == "decode" else None
        subs = []
        for j, chunk in pairs:
            meta = chunk["meta_info"]
            if pre is not None:
                if j not in pre:
                    raise RequestError(502, f"the prefill leg answered nothing for entry {j}", "engine")
                self._join(j, pre[j], meta, incremental)
            meta["id"] = self._public(j, attempt)
            if "index" in chunk:
                chunk["index"] = j
            ids = chunk.get("output_ids") or []
            new = ids if incremental else ids[self.seen[j] :]
            self.seen[j] += len(new)
            self.answers[j] = chunk
            finish = meta.get("finish_reason")
            is_dict = type(finish) is dict
            kind = finish.get("type") if is_dict else None
            if kind is not None:
                self.finished.add(j)
            subs.append((j, Event(
                new, kind, matched=finish.get("matched") if is_dict else None,
                prompt_tokens=meta.get("prompt_tokens"), completion_tokens=meta.get("completion_tokens"),
                cached_tokens=meta.get("cached_tokens"),
            )))
        done = len(self.finished) == len(self.answers)
        event = Event([t for _, e in subs for t in e.token_ids], subs[-1][1].finish_reason if done else None,
                      entries=subs)
        if type(got) is dict:
            self.outs[id(event)] = orjson.dumps(got)
        return event

    def _join(self, j: int, pre: dict, meta: dict, incremental: bool) -> None:
        """Entry ``j``'s decode ``meta`` joined with its prefill's ``pre``
        (:mod:`.join`): prompt logprobs in every cumulative chunk, an
        incremental stream's first; expert rows at its finish."""
        join_prefill(pre, meta, not incremental or j not in self.joined)
        self.joined.add(j)
        if type(meta.get("finish_reason")) is dict:
            join_experts(pre, meta, self.request.native.get("routed_experts_start_len"))

    def end_of_stream(self, attempt: Attempt) -> Event | None:
        """A leg whose entries all finished while other legs still run:
        :data:`~asgi_generate.sdk.LEG_DONE`; ``None`` when one of its
        entries never finished (the answer was cut short)."""
        if not all(j in self.finished for j in attempt.entries):
            return None
        return Event([], LEG_DONE, entries=[])

    def client_event(self, event: Event) -> bytes | None:
        """The chunk, its id and index the client's."""
        return self.outs.pop(id(event), None)

    def unary_body(self) -> tuple[int, bytes]:
        """The entries' objects as one JSON list, in entry order."""
        if any(a is None for a in self.answers):
            raise RequestError(502, "worker ended the response without output", "engine")
        return 200, orjson.dumps(self.answers)

    def worker_error(self, status: int, body: bytes) -> tuple[int, bytes]:
        """SGLang workers answer in this format's shapes: pass through."""
        return engine_error_page(status, body, error_body)


def _prefill_event(attempt: Attempt, pairs: list[tuple[int, dict]]) -> Event:
    """A P/D prefill leg's answer for the entries of ``pairs``: each
    entry's ``meta_info`` kept in the pair (``Pair.from_prefill``, by
    entry) for the decode leg to join; the leg's event finishes once every
    entry it carries has (an entry's abort is the leg's error)."""
    kept = attempt.pair.from_prefill
    if kept is None:
        kept = attempt.pair.from_prefill = {}
    for j, chunk in pairs:
        meta = chunk["meta_info"]
        finish = meta.get("finish_reason")
        kind = finish.get("type") if type(finish) is dict else None
        if kind == "abort":
            status = finish.get("status_code")
            return Event([], error=EngineError(
                status if type(status) is int and 400 <= status <= 599 else 500, finish.get("message") or ""))
        if kind is not None:
            kept[j] = meta
    done = all(j in kept for j in attempt.entries)
    return Event([], "length" if done else None)


def _is_list_batch(obj: dict) -> bool:
    text = obj.get("text")
    if text is not None:
        return type(text) is list
    ids = obj.get("input_ids")
    return type(ids) is list and bool(ids) and type(ids[0]) is list


def _prompt_count(obj: dict) -> int:
    key = "text" if obj.get("text") is not None else "input_ids"
    return len(obj[key]) if _is_list_batch(obj) else 1
