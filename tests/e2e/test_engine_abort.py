"""An answer the engine cut short by its own abort (a pause without hold:
SGLang ``/pause_generation`` ``mode: abort``, vLLM ``/pause?mode=abort``)
reaches the client as the engine sent it and is recorded ``engine_abort``,
not ``ok``: a GRPO loop that keeps ``status == "ok"`` drops the truncated
sample. Both engines, unary and SSE, both worker classes."""

from __future__ import annotations

import threading

import orjson
import pytest

from support import Traced, post, sse, start_sim, stats, wait_until

pytestmark = pytest.mark.e2e

N = 2000
GENERATE = {"sglang": "/generate", "vllm": "/inference/v1/generate"}
MESSAGE = "the engine aborted the request (finish_reason abort): its output is truncated"


@pytest.fixture(scope="module")
def sims():
    procs = {"sglang": start_sim(itl_ms=10), "vllm": start_sim("vllm", itl_ms=10)}
    yield procs
    for p in procs.values():
        p.stop()


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def fe(request, sims, tmp_path_factory):
    traced = Traced(tmp_path_factory, [arg for p, s in sims.items() for arg in ("--worker", f"{p}={s.url}")],
                    request.param)
    yield traced
    traced.stop()


def _body(engine: str, rid: str, stream: bool) -> dict:
    if engine == "sglang":
        return {"rid": rid, "input_ids": [1, 2, 3], "stream": stream,
                "sampling_params": {"max_new_tokens": N, "ignore_eos": True}}
    return {"request_id": rid, "token_ids": [1, 2, 3], "stream": stream,
            "sampling_params": {"max_tokens": N, "ignore_eos": True}}


def _finish(engine: str, stream: bool, got) -> tuple[object, int]:
    """The answer's finish reason and output token count."""
    if stream:
        objs = [orjson.loads(c) for c in got[1] if c != b"[DONE]"]
    else:
        objs = [got.json()]
    if engine == "sglang":
        return objs[-1]["meta_info"]["finish_reason"]["type"], len(objs[-1]["output_ids"])
    ids, finish = [], None
    for o in objs:
        for ch in o.get("choices", []):
            ids += ch.get("token_ids") or []
            finish = ch.get("finish_reason") or finish
    return finish, len(ids)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_pause_without_hold_ends_the_answer_as_engine_abort(sims, fe, engine, stream):
    sim = sims[engine]
    rid = f"cut-{engine}-{stream}"
    out: dict = {}

    def run() -> None:
        body = _body(engine, rid, stream)
        out["got"] = sse(fe.url, body, GENERATE[engine]) if stream else post(fe.url, body, GENERATE[engine])

    thread = threading.Thread(target=run)
    thread.start()
    try:
        # Mid-generation: some tokens out, far from the last.
        wait_until(lambda: [n >= 5 for n in stats(sim)["running_output_tokens"].values()] == [True], timeout=30)
        pause, resume = (("/pause_generation", "/continue_generation") if engine == "sglang"
                         else ("/pause?mode=abort", "/resume"))
        assert post(fe.url, {"mode": "abort"} if engine == "sglang" else {}, pause).status_code == 200
        thread.join(30)
        assert post(fe.url, {}, resume).status_code == 200
    finally:
        thread.join(30)
    got = out["got"]
    assert (got[0] if stream else got.status_code) == 200
    finish, tokens = _finish(engine, stream, got)
    assert finish == "abort" and 0 < tokens < N
    (rec,) = [r for r in fe.take() if r.get("public_id") == rid]
    assert (rec["status"], rec["http_status"], rec["error"], rec["output_tokens"], rec["finish"]) == (
        "engine_abort", 200, {"type": "engine_abort", "message": MESSAGE}, tokens,
        {"finish_reason": "abort", "backend_finish_reason": "abort"})
