"""The SGLang simulator's abort finishes, as SGLang 0.5.23 words them:
a running request's ``FINISH_ABORT()`` (``"Aborted"``), a waiting one's
``"Abort in waiting queue"`` (``Scheduler.abort_request``,
``TokenizerManager._handle_abort_req``), whether ``/abort_request`` or
``/pause_generation`` in ``abort`` mode ends it. In process: the ASGI app
driven as a client would."""

from __future__ import annotations

import anyio
import orjson
import pytest

from asgi_generate.sim.app import SimApp
from asgi_generate.sim.capacity_flags import capacity_config
from support import asgi_json, asgi_request, sampled

BACKENDS = pytest.mark.parametrize("backend", ["asyncio", "trio"])
RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
WAITING = {"type": "abort", "message": "Abort in waiting queue"}


async def _until(predicate, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


def _body(first: int, rid: str) -> bytes:
    return orjson.dumps({"input_ids": [first] * 4, "rid": rid,
                         "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}})


async def _abort_two(app: SimApp, how: tuple[str, dict]) -> dict[str, dict]:
    """One request running (it has tokens), one waiting behind it (one
    seat): abort both with ``how`` (path, body); their answers by rid."""
    answers: dict[str, dict] = {}

    async def one(first: int, rid: str) -> None:
        status, _, raw = await asgi_request(app, "POST", "/generate", _body(first, rid))
        assert status == 200
        answers[rid] = orjson.loads(raw)

    cap = app.engine.capacity
    async with anyio.create_task_group() as tg:
        tg.start_soon(one, 10, "run")
        await _until(lambda: cap.sequences() == (1, 0) and cap.running[0].generated >= 3)
        tg.start_soon(one, 11, "wait")
        await _until(lambda: cap.sequences() == (1, 1))
        path, body = how
        status, _, _ = await asgi_request(app, "POST", path, orjson.dumps(body))
        assert status == 200
    return answers


@BACKENDS
@pytest.mark.parametrize("how", [("/pause_generation", {"mode": "abort"}), ("/abort_request", {"abort_all": True})])
def test_abort_words_a_running_and_a_waiting_request_as_sglang(backend, how):
    cap = capacity_config("sglang", 1, max_running_requests=1, step_ms=2.0)
    app = SimApp("sglang", capacity=cap, cache_tokens=0)
    answers = anyio.run(_abort_two, app, how, backend=backend)
    run, wait = answers["run"], answers["wait"]
    assert run["meta_info"]["finish_reason"] == RUNNING
    assert wait["meta_info"]["finish_reason"] == WAITING
    # The running one's tokens so far are its greedy continuation; the waiting one has none.
    n = len(run["output_ids"])
    assert n >= 3 and run["output_ids"] == sampled([10] * 4, 0, n, ignore_eos=True)
    assert wait["output_ids"] == [] and wait["meta_info"]["completion_tokens"] == 0
    # The waiting one is answered by the tokenizer manager alone (_handle_abort_req):
    # no prompt or cache counts; the running one's come from the scheduler's output.
    assert sorted(wait["meta_info"]) == ["completion_tokens", "e2e_latency", "finish_reason", "id", "weight_version"]
    assert (run["meta_info"]["prompt_tokens"], run["meta_info"]["cached_tokens"]) == (4, 0)


@BACKENDS
def test_pause_in_abort_mode_of_a_decoding_request_without_capacity(backend):
    app = SimApp("sglang", itl_ms=5.0, cache_tokens=0)

    async def run() -> dict:
        out: dict = {}

        async def one() -> None:
            status, _, raw = await asgi_request(app, "POST", "/generate", _body(10, "solo"))
            out["answer"] = (status, orjson.loads(raw))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            await _until(lambda: "solo" in app.engine.running and app.engine.running["solo"].generated >= 2)
            assert await asgi_json(app, "POST", "/pause_generation", {"mode": "abort"}) == {
                "message": "Generation paused successfully.", "status": "ok"}
        await asgi_json(app, "POST", "/continue_generation", {})
        return out["answer"]

    status, answer = anyio.run(run, backend=backend)
    assert status == 200 and answer["meta_info"]["finish_reason"] == RUNNING


@BACKENDS
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_an_aborted_running_request_gets_its_forward_pass_token_on_sglang_only(backend, protocol):
    # SGLang: abort_request sets to_finish, the next batch result appends the token of the
    # forward pass, then update_finish_state finishes it with the abort; vLLM frees it at once.
    cap = capacity_config(protocol, 16, step_ms=2.0, **({"max_running_requests": 4} if protocol == "sglang"
                                                       else {"max_num_seqs": 4}))
    app = SimApp(protocol, capacity=cap, cache_tokens=0)
    prompt = [10] * 4
    if protocol == "sglang":
        path, body = "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    else:
        path, body = "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {"max_tokens": 300,
                                                                                        "ignore_eos": True}}
    out: dict = {}

    async def one() -> None:
        status, _, raw = await asgi_request(app, "POST", path, orjson.dumps(body))
        out["answer"] = (status, orjson.loads(raw))

    async def run() -> None:
        capacity = app.engine.capacity
        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            await _until(lambda: capacity.running and capacity.running[0].generated >= 3)
            out["granted"] = capacity.running[0].generated
            app.engine.abort(None, abort_all=True)  # at once: no step between the count and the abort

    anyio.run(run, backend=backend)
    status, answer = out["answer"]
    n = out["granted"] + (1 if protocol == "sglang" else 0)
    ids = answer["output_ids"] if protocol == "sglang" else answer["choices"][0]["token_ids"]
    assert status == 200 and ids == sampled(prompt, 0, n, ignore_eos=True)
    if protocol == "sglang":
        assert answer["meta_info"]["finish_reason"] == RUNNING and answer["meta_info"]["completion_tokens"] == n
    else:
        assert answer["choices"][0]["finish_reason"] == "abort"
