"""SGLang batches and parallel samples (``n`` > 1), as the simulator serves them.

Follows SGLang ``managers/io_struct.py`` (``GenerateReqInput.
normalize_batch_and_arguments``: ``_determine_batch_size``,
``_handle_parallel_sampling``, ``_normalize_rid``,
``_validate_rid_uniqueness``, ``__getitem__``) and
``managers/tokenizer_manager.py`` (``_handle_batch_request``):

- A list ``text``, a list of lists ``input_ids``, or ``n`` > 1 makes a batch
  (a single prompt with ``n`` > 1 becomes a batch of one).
- ``rid``: a string becomes ``rid_0``, ``rid_1``, ... per entry; a list must
  have the batch's length and unique ids; none: a uuid per entry.
- ``n`` > 1 (the same ``n`` in every ``sampling_params``): each prompt runs
  ``n`` times, prompt-major (entry ``i * n + s`` is sample ``s`` of prompt
  ``i``), each sample under a fresh uuid rid (``regenerate_rid``), so the
  client's rids are never the samples' (SGLang also first runs each prompt
  once with ``max_new_tokens`` 0 to cache it, so every sample hits; the
  simulator skips that run: its first sample computes the prompt and
  caches it, the others hit).
- Per-item fields given as a list of the batch's length (``return_logprob``,
  ``top_logprobs_num``, ``sampling_params``, ...) are the item's.
- P/D (``_normalize_bootstrap_params``): ``bootstrap_host``/``bootstrap_port``
  given once hold for every entry; a ``bootstrap_room`` given once becomes
  ``room + i`` for entry ``i``; a list is the batch's, one per prompt, and
  with ``n`` > 1 every sample of a prompt gets that prompt's room (SGLang's
  samples copy their prompt's request), so a prefill server refuses the
  second sample's room as already in use.
- Unary: one JSON list of the entries' answers, in entry order; a refused
  entry (an abort with an error status) makes the whole answer that error.
  SSE: the entries' chunks as they come, each with ``"index"`` (the entry's
  position) added, then one ``data: [DONE]``.

Sampling: entries with the same prompt are the model's parallel samples 0,
1, 2, ... in entry order (:meth:`~asgi_generate.sim.model.Model.sampled`), as
a sampling engine gives a prompt sent twice two draws; a batch of distinct
prompts answers exactly as the prompts sent one by one.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Protocol

import anyio
import orjson

from .framing import SSE_HEADERS, Receive, Send, send_unary, sse_event
from .disagg import PrefillRooms
from .engine import DuplicateRequestId, Job, SimEngine
from .sglang_checks import SGLangError, value_error

DONE = b"data: [DONE]\n\n"
#: Top-level fields SGLang reads per batch item when given as a list.
PER_ITEM = (
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_hidden_states",
    "lora_path", "custom_logit_processor", "extra_key", "cache_salt", "image_data", "video_data", "audio_data",
    "return_routed_experts",
)
#: The P/D fields SGLang expands per entry.
BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def _n(obj: dict) -> object:
    sp = obj.get("sampling_params")
    if isinstance(sp, dict):
        return sp.get("n", 1)
    if isinstance(sp, list) and sp and isinstance(sp[0], dict):
        return sp[0].get("n", 1)
    return 1


def is_batch(obj: dict) -> bool:
    """Whether the ``/generate`` object is a batch or asks for ``n`` > 1."""
    text, ids = obj.get("text"), obj.get("input_ids")
    if isinstance(text, list):
        return True
    if text is None and isinstance(ids, list) and ids and isinstance(ids[0], list):
        return True
    n = _n(obj)
    return type(n) is int and n > 1


def entries(obj: dict) -> list[dict]:
    """The single requests a batch object runs as, in entry order.

    Raises:
        SGLangError: SGLang's ``ValueError`` for the batch's shape.
    """
    text, ids = obj.get("text"), obj.get("input_ids")
    key = "text" if text is not None else "input_ids"
    inputs = obj[key]
    single = not isinstance(inputs, list) or (key == "input_ids" and not isinstance(inputs[0], list))
    size = 1 if single else len(inputs)
    sp = obj.get("sampling_params")
    n = _n(obj)
    if isinstance(sp, list) and any(isinstance(p, dict) and p.get("n", 1) != n for p in sp):
        raise value_error("The parallel_sample_num should be the same for all samples in sample params.")
    if type(n) is not int or n < 1:
        raise value_error(f"n must be at least 1, got {n}.")
    if single:
        inputs = [inputs]
    num = size * n
    rid = obj.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(num)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(num)]
    elif isinstance(rid, list):
        if len(rid) != size:
            raise value_error("The specified rids length mismatch with the batch_size for batch processing.")
        rids = rid
    else:
        raise value_error("The rid should be a string or a list of strings.")
    if isinstance(rid, list) and len(set(rid)) != len(rid):
        dups = [r for r, c in Counter(rid).items() if c > 1]
        raise value_error(f"Duplicate request IDs detected within the request: {dups}")
    items = []
    for i in range(size):
        item = dict(obj)
        item[key] = inputs[i]
        item["rid"] = rids[i]
        if isinstance(sp, list):
            if i >= len(sp):
                raise value_error("The length of sampling_params should be equal to the batch size.")
            item["sampling_params"] = sp[i]
        for name in PER_ITEM:
            value = obj.get(name)
            if isinstance(value, list) and len(value) == size and (name != "token_ids_logprob" or
                                                                    isinstance(value[0], list)):
                item[name] = value[i]
        items.append(item)
    _bootstrap(obj, items, n)
    if n == 1:
        return items
    out = []
    for item in items:
        for _ in range(n):
            sample = dict(item, rid=uuid.uuid4().hex)
            sample["sampling_params"] = {**(item.get("sampling_params") or {}), "n": 1}
            out.append(sample)
    return out


def _bootstrap(obj: dict, items: list[dict], n: int) -> None:
    """Give each prompt's item its bootstrap fields, as SGLang expands them
    (see the module docstring).

    Raises:
        SGLangError: a list shorter than the batch.
    """
    num = len(items) * n
    for name in BOOTSTRAP:
        value = obj.get(name)
        if value is None:
            continue
        if isinstance(value, list):
            if len(value) < len(items):
                raise value_error(f"{name} has {len(value)} values for a batch of {len(items)}.")
            per = value
        elif name == "bootstrap_room" and type(value) is int:
            per = [value + i for i in range(num)]
        else:
            per = [value] * num
        for item, v in zip(items, per):
            item[name] = v


class BatchHost(Protocol):
    """What serving a batch needs of the SGLang simulator
    (:class:`~asgi_generate.sim.sglang.SGLangProtocol`, which serves the
    entries one by one)."""

    engine: SimEngine
    #: The P/D role's KV hand-over; ``None`` on an aggregated server.
    disagg: object | None
    #: Seconds before a vanished client's requests are aborted.
    disconnect_abort_s: float

    def parse(self, obj: dict) -> tuple[Job, dict]:
        """One entry's job and answer options, or :class:`SGLangError`."""

    async def refuse(self, exc: SGLangError, stream: bool, send: Send) -> None:
        """Answer a request refused before generating."""

    async def run_job(self, job: Job, opts: dict, send: Send, done: list[bool]) -> None:
        """Generate one entry's answer into ``send``; ``done[0]`` once whole."""


class _Entry:
    """Catches one entry's ASGI messages from ``SGLangProtocol.run_job``: stream
    chunks go on to the client with their ``index``, a unary answer is kept."""

    def __init__(self, index: int, send: Send, lock: anyio.Lock, stream: bool) -> None:
        self.index = index
        self.send = send
        self.lock = lock
        self.stream = stream
        self.status = 200
        self.body = b""

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            return
        body = message.get("body", b"")
        if not self.stream:
            self.body += body
            return
        if body.endswith(DONE):
            body = body[: -len(DONE)]
        out = []
        for block in body.split(b"\n\n"):
            if block.startswith(b"data: "):
                chunk = orjson.loads(block[6:])
                chunk["index"] = self.index
                out.append(sse_event(orjson.dumps(chunk)))
        if out:
            async with self.lock:
                await self.send({"type": "http.response.body", "body": b"".join(out), "more_body": True})


async def serve_batch(proto: BatchHost, obj: dict, receive: Receive, send: Send) -> None:
    """Serve one batch (or ``n`` > 1) ``/generate`` object; see the module docstring."""
    stream = obj.get("stream") is True
    engine = proto.engine
    jobs: list[tuple[Job, dict]] = []
    rooms = proto.disagg if isinstance(proto.disagg, PrefillRooms) else None
    try:
        parsed = [proto.parse(entry) for entry in entries(obj)]
        seen: Counter = Counter()
        for job, opts in parsed:
            prompt = tuple(job.input_ids)
            job.sample = seen[prompt]
            seen[prompt] += 1
            opts["room"] = None
            if rooms is not None:
                try:
                    opts["room"] = rooms.claim(opts["pd"][2])
                except ValueError as exc:
                    raise value_error(str(exc)) from None
            jobs.append((job, opts))  # before submit: its room is released whatever happens
            engine.submit(job)
    except (SGLangError, DuplicateRequestId) as exc:
        for job, opts in jobs:
            engine.finish(job)  # a job never submitted is not running: nothing
            if opts["room"] is not None:
                rooms.release(opts["pd"][2], opts["room"])
        if isinstance(exc, DuplicateRequestId):
            exc = value_error(f"Duplicate request ID: {exc}")
        await proto.refuse(exc, stream, send)
        return
    engine.batch_requests += 1
    engine.batch_items += len(jobs)
    lock = anyio.Lock()
    sinks = [_Entry(i, send, lock, stream) for i in range(len(jobs))]
    dones = [[False] for _ in jobs]
    if stream:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_disconnect, proto, receive, jobs, dones)
            async with anyio.create_task_group() as runs:
                for (job, opts), sink, done in zip(jobs, sinks, dones):
                    runs.start_soon(proto.run_job, job, opts, sink, done)
            tg.cancel_scope.cancel()
    finally:
        for job, opts in jobs:
            engine.finish(job)
            if opts["room"] is not None:
                rooms.release(opts["pd"][2], opts["room"])
    if stream:
        await send({"type": "http.response.body", "body": DONE, "more_body": False})
        return
    failed = next((s for s in sinks if s.status != 200), None)
    if failed is not None:
        await send_unary(send, failed.status, failed.body)
    else:
        await send_unary(send, 200, b"[" + b",".join(s.body for s in sinks) + b"]")


async def _watch_disconnect(proto: BatchHost, receive: Receive, jobs: list, dones: list) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    if all(done[0] for done in dones):  # the end of a finished exchange
        return
    proto.engine.disconnects += 1
    # SGLang aborts a vanished client's requests after a short delay.
    await anyio.sleep(proto.disconnect_abort_s)
    for job, _ in jobs:
        proto.engine.abandon(job)
