"""The simulator's admin routes, as the engines answer them.

SGLang (``python/sglang/srt/entrypoints/http_server.py``):

- ``GET``/``POST /flush_cache``: 200 with SGLang's ``Cache flushed.`` text,
  or the same text with 400 while requests are running or waiting (the
  scheduler's ``flush_cache`` refuses then); a flush empties the prefix
  cache.
- ``POST /pause_generation`` ``{"mode": "abort"|"retract"|"in_place"}``
  (``PauseGenerationReqInput``, default ``abort``): holds scheduling; ``abort``
  also aborts everything running. ``POST /continue_generation`` lets it go
  on. Both answer ``{"message": ..., "status": "ok"}``.
- ``GET``/``POST /release_memory_occupation``, ``/resume_memory_occupation``:
  200 ``null`` (the handlers return nothing).

vLLM dev routes (``vllm/entrypoints/serve/dev/``; ``rlhf/api_router.py``,
``sleep/``, ``cache/``):

- ``POST /reset_prefix_cache`` (empties the prefix cache),
  ``POST /sleep?level=N``, ``POST /wake_up``: 200 with an empty body; a sleeping server refuses generation with 503
  until woken (the message is the simulator's own).
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``.
- ``POST /pause?mode=abort|wait|keep``: ``{"status": "paused"}``, holding
  scheduling (``abort``, the default, also aborts everything running;
  ``wait`` first lets running requests finish); in ``abort`` and ``wait``
  modes new generate requests are refused with 503 until ``/resume``
  (``rl/online/api_router.py`` ``pause_generation``), in ``keep`` they wait;
  ``POST /resume``: ``{"status": "resumed"}``; ``GET /is_paused``:
  ``{"is_paused": bool}``.

The weight routes are :mod:`asgi_generate.sim.weights`'s.

Every call is counted in ``/sim/stats`` ``admin_calls`` (path to count).
"""

from __future__ import annotations

from urllib.parse import parse_qs

import anyio
import orjson

from .framing import Send, send_unary
from .engine import SimEngine
from .weights import SimWeights

FLUSHED = (
    b"Cache flushed.\nPlease check backend logs for more details. "
    b"(When there are running or waiting requests, the operation will not be performed.)\n"
)
SGLANG_PAUSE_MODES = ("abort", "retract", "in_place")
VLLM_PAUSE_MODES = ("abort", "wait", "keep")
SGLANG_ROUTES = {
    "/flush_cache": ("GET", "POST"),
    "/pause_generation": ("POST",),
    "/continue_generation": ("POST",),
    "/release_memory_occupation": ("GET", "POST"),
    "/resume_memory_occupation": ("GET", "POST"),
}
VLLM_ROUTES = {
    "/reset_prefix_cache": ("POST",),
    "/sleep": ("POST",),
    "/wake_up": ("POST",),
    "/is_sleeping": ("GET",),
    "/pause": ("POST",),
    "/resume": ("POST",),
    "/is_paused": ("GET",),
}


class SimAdmin:
    """Admin state of one simulator: pause, sleep, weights, counters.

    Args:
        engine: the engine whose scheduling a pause holds.
        protocol: ``sglang`` or ``vllm``: which routes it serves.
        weights: its weight routes' state.
    """

    def __init__(self, engine: SimEngine, protocol: str, weights: SimWeights) -> None:
        self.engine = engine
        self.routes = VLLM_ROUTES if protocol == "vllm" else SGLANG_ROUTES
        self.weights = weights
        self.calls: dict[str, int] = {}
        self.sleeping = False
        #: vLLM paused in ``abort`` or ``wait`` mode: new requests are refused.
        self.refusing = False

    def serves(self, method: str, path: str) -> bool:
        """Whether ``(method, path)`` is one of its admin or weight routes."""
        return method in self.routes.get(path, ()) or self.weights.serves(method, path)

    async def serve(self, path: str, query: bytes, body: bytes, send: Send) -> None:
        """Answer one admin call (a route :meth:`serves`)."""
        self.calls[path] = self.calls.get(path, 0) + 1
        args = {k: v[-1] for k, v in parse_qs(query.decode("latin-1")).items()}
        try:
            obj = orjson.loads(body) if body.strip() else {}
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            await send_unary(send, 400, orjson.dumps({"error": {"message": "the body is not a JSON object"}}))
            return
        if path == "/pause" and args.get("mode") == "wait":
            self.refusing = True
            while self.engine.running:  # vLLM's "wait": in-flight requests finish first
                await anyio.sleep(0.01)
        if path in self.weights.routes:
            status, answer = await self.weights.answer(path, args, obj)
        else:
            status, answer = getattr(self, "_" + path.strip("/"))(args, obj)
        if isinstance(answer, bytes):
            await send_unary(send, status, answer, b"text/plain; charset=utf-8")
        else:
            await send_unary(send, status, orjson.dumps(answer) if answer is not None or status == 200 else b"")

    # -- SGLang ---------------------------------------------------------------

    def _flush_cache(self, args: dict, obj: dict) -> tuple[int, bytes]:
        if self.engine.running:
            return 400, FLUSHED
        self.engine.flush_cache()
        return 200, FLUSHED

    def _pause_generation(self, args: dict, obj: dict) -> tuple[int, dict]:
        mode = obj.get("mode", "abort")
        if mode not in SGLANG_PAUSE_MODES:
            return 400, {"error": {"message": f"mode must be one of {', '.join(SGLANG_PAUSE_MODES)}"}}
        self._hold(mode == "abort")
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue_generation(self, args: dict, obj: dict) -> tuple[int, dict]:
        self.engine.release()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _release_memory_occupation(self, args: dict, obj: dict) -> tuple[int, None]:
        return 200, None

    def _resume_memory_occupation(self, args: dict, obj: dict) -> tuple[int, None]:
        return 200, None

    # -- vLLM -----------------------------------------------------------------

    def _reset_prefix_cache(self, args: dict, obj: dict) -> tuple[int, bytes]:
        self.engine.flush_cache()
        return 200, b""

    def _sleep(self, args: dict, obj: dict) -> tuple[int, bytes]:
        self.sleeping = True
        return 200, b""

    def _wake_up(self, args: dict, obj: dict) -> tuple[int, bytes]:
        self.sleeping = False
        return 200, b""

    def _is_sleeping(self, args: dict, obj: dict) -> tuple[int, dict]:
        return 200, {"is_sleeping": self.sleeping}

    def _pause(self, args: dict, obj: dict) -> tuple[int, dict]:
        mode = args.get("mode", "abort")
        if mode not in VLLM_PAUSE_MODES:
            return 400, {"error": f"Invalid pause mode {mode!r}"}
        self._hold(mode == "abort")
        self.refusing = mode != "keep"
        return 200, {"status": "paused"}

    def _resume(self, args: dict, obj: dict) -> tuple[int, dict]:
        self.refusing = False
        self.engine.release()
        return 200, {"status": "resumed"}

    def _is_paused(self, args: dict, obj: dict) -> tuple[int, dict]:
        return 200, {"is_paused": self.engine.held}

    def _hold(self, abort: bool) -> None:
        self.engine.hold()
        if abort:
            self.engine.abort_all()
