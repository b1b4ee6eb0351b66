"""The load generator: wrk (C, one thread, keep-alive connections) driven by
a generated Lua script that POSTs one fixed SGLang body and checks every
response it gets.

For each response the script checks the status, and either the unary body
(``completion_tokens`` and the final ``output_ids``) or the SSE stream: one
``data:`` event per token with ``completion_tokens`` 1, 2, ... n in order,
nothing after ``data: [DONE]``, and the last event's cumulative
``output_ids`` equal to the expected answer. Responses that fail a check are
counted (with the first reason) and not counted as events.
"""

from __future__ import annotations

import json
import pathlib
import resource
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable

from _procs import Child

_LUA = r"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
%(close)s
wrk.body = [==[%(body)s]==]
local stream = %(stream)s
local want_tokens = %(tokens)d
local want_ids = "%(ids)s"
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  ok, bad, events, first_bad = 0, 0, 0, ""
end

local function reject(why)
  bad = bad + 1
  if first_bad == "" then first_bad = why end
end

local function final_ids(body, init)
  local ids = body:match('"output_ids":%%[([^%%]]*)%%]', init)
  return ids and (ids:gsub("%%s", ""))
end

function response(status, headers, body)
  if status ~= 200 then return reject("HTTP status " .. status) end
  if not stream then
    if tonumber(body:match('"completion_tokens":(%%d+)')) ~= want_tokens then
      return reject("unary completion_tokens")
    end
    if final_ids(body, 1) ~= want_ids then return reject("unary output_ids differ") end
    ok = ok + 1
    return
  end
  -- Plain finds hop from event to event (a pattern scan of the whole
  -- cumulative stream would cost wrk more CPU than the hop it measures).
  local n, pos, last, finished = 0, 1, nil, false
  while true do
    local _, e = body:find("data: ", pos, true)
    if not e then break end
    if body:sub(e + 1, e + 6) == "[DONE]" then
      if body:sub(e + 7) ~= "\n\n" then return reject("data after [DONE]") end
      finished = true
      break
    end
    n = n + 1
    local _, ce = body:find('"completion_tokens":', e, true)
    if not ce or tonumber(body:match("^%%d+", ce + 1)) ~= n then
      return reject("event " .. n .. " lost or out of order")
    end
    last, pos = e, ce
  end
  if not finished then return reject("no [DONE]") end
  if n ~= want_tokens then return reject(n .. " events, want " .. want_tokens) end
  if final_ids(body, last) ~= want_ids then return reject("final output_ids differ") end
  ok = ok + 1
  events = events + n
end

function done(summary, latency, requests)
  local good, nbad, nevents, why = 0, 0, 0, ""
  for _, t in ipairs(threads) do
    good = good + t:get("ok")
    nbad = nbad + t:get("bad")
    nevents = nevents + t:get("events")
    if why == "" then why = t:get("first_bad") end
  end
  local e = summary.errors
  io.write(string.format(
    'BENCH_RESULT {"requests":%%d,"duration_us":%%d,"ok":%%d,"bad":%%d,"events":%%d,' ..
    '"errors":%%d,"p50_us":%%d,"p99_us":%%d,"first_bad":"%%s"}\n',
    summary.requests, summary.duration, good, nbad, nevents,
    e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(99), (why:gsub('"', "'"))))
end
"""


@dataclass
class LoadResult:
    """One wrk run: counts, latency percentiles and CPU seconds used.

    ``ok``/``bad`` are responses that passed/failed the script's checks;
    ``errors`` are wrk's socket errors, timeouts and non-2xx/3xx statuses.
    ``cpu`` maps a process label to the CPU seconds it used during the run.
    """

    requests: int
    seconds: float
    ok: int
    bad: int
    events: int
    errors: int
    p50_ms: float
    p99_ms: float
    first_bad: str
    cpu: dict[str, float]

    @property
    def rps(self) -> float:
        """Completed requests per second."""
        return self.requests / self.seconds

    @property
    def eps(self) -> float:
        """Checked SSE events per second."""
        return self.events / self.seconds

    def busy(self, label: str) -> float:
        """Fraction of one core that process ``label`` used."""
        return self.cpu[label] / self.seconds

    def others_busy(self) -> float:
        """Cores' worth of CPU that other processes took from the pinned
        cores during the run (the ``"cores"`` meter less ours)."""
        ours = sum(v for k, v in self.cpu.items() if k != "cores")
        return max(0.0, self.cpu["cores"] - ours) / self.seconds

    def cpu_ms_per_request(self, label: str) -> float:
        """CPU milliseconds process ``label`` spent per completed request."""
        return 1000.0 * self.cpu[label] / max(self.requests, 1)


#: How to get wrk; the benchmark installs nothing outside its own venvs.
WRK_INSTALL = "Debian/Ubuntu: sudo apt-get install -y wrk; macOS: brew install wrk"


def wrk_path() -> str | None:
    """The wrk executable, if installed."""
    return shutil.which("wrk")


def write_script(path: pathlib.Path, body: bytes, stream: bool, tokens: int, final_ids: list[int],
                 close: bool = False) -> None:
    """Write the Lua script that sends ``body`` and checks each answer
    against ``tokens`` output tokens ending with ``final_ids``; with
    ``close`` every request asks ``Connection: close`` (wrk then connects
    anew for the next: one connection per request)."""
    text = body.decode()
    if "]==]" in text:
        raise ValueError("body cannot be embedded in a Lua long string")
    path.write_text(
        _LUA
        % {
            "body": text,
            "stream": "true" if stream else "false",
            "close": 'wrk.headers["Connection"] = "close"' if close else "",
            "tokens": tokens,
            "ids": ",".join(map(str, final_ids)),
        }
    )


def paced_script(script: pathlib.Path, connections: int, rate: float) -> pathlib.Path:
    """A copy of the wrk ``script`` (beside it, named by its wait) whose
    ``connections`` each wait before every request so that together they
    send about ``rate`` requests/s (less by each answer's latency): wrk's
    ``delay()``, ``connections / rate`` seconds, at least 1 ms."""
    wait_ms = max(1, round(connections * 1000 / rate))
    path = script.with_name(f"{script.stem}-paced-{wait_ms}ms.lua")
    path.write_text(script.read_text() + f"\nfunction delay()\n  return {wait_ms}\nend\n")
    return path


def run_wrk(
    wrk: str,
    script: pathlib.Path,
    port: int,
    connections: int,
    seconds: int,
    cpus: set[int] | None,
    log_dir: pathlib.Path,
    meters: dict[str, Callable[[], float]],
) -> LoadResult:
    """Run wrk against ``127.0.0.1:port/generate`` for ``seconds`` seconds.

    ``meters`` maps a label to a function returning that process's CPU
    seconds so far; the result holds each one's use during the run, plus
    wrk's own under the label ``"wrk"``.

    Raises:
        RuntimeError: wrk failed or printed no result.
    """
    argv = [
        wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "30s",
        "-s", str(script), f"http://127.0.0.1:{port}/generate",
    ]
    before = {label: meter() for label, meter in meters.items()}
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = Child("wrk", argv, cpus, log_dir)
    try:
        child.proc.wait(seconds + 60)
    finally:
        child.stop()
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {label: meter() - before[label] for label, meter in meters.items()}
    cpu["wrk"] = (children_after.ru_utime - children_before.ru_utime) + (
        children_after.ru_stime - children_before.ru_stime
    )
    output = child.log_path.read_text(errors="replace")
    lines = [line for line in output.splitlines() if line.startswith("BENCH_RESULT ")]
    if child.proc.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({child.proc.returncode}):\n{output[-3000:]}")
    r = json.loads(lines[-1].split(" ", 1)[1])
    return LoadResult(
        requests=r["requests"],
        seconds=r["duration_us"] / 1e6,
        ok=r["ok"],
        bad=r["bad"],
        events=r["events"],
        errors=r["errors"],
        p50_ms=r["p50_us"] / 1000.0,
        p99_ms=r["p99_us"] / 1000.0,
        first_bad=r["first_bad"],
        cpu=cpu,
    )
