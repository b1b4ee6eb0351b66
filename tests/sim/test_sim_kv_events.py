"""The simulator's KV cache events: the ZMQ wire each engine version sends
(multipart topic, 8-byte big-endian sequence number, msgpack EventBatch),
BlockStored/BlockRemoved/AllBlocksCleared at the engine's block size, the
replay ROUTER socket, discovery routes, /sim/stats and the gap fault hook.
In process: the app driven directly, a real SUB socket on loopback."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq", reason="pyzmq (a dependency since KV events: pip install -e .)")

import anyio
import msgspec
import orjson
import zmq

from asgi_generate.sim.app import SimApp
from asgi_generate.sim.block_hash import SGLangPageHashes, VLLMBlockHashes
from asgi_generate.sim.kv_events import END_SEQ, KVEventsConfig
from support import asgi_json

# vLLM binds only a wildcard endpoint (tcp://*:0: a free port, on loopback
# in the simulator); SGLang binds a concrete one when told to.
VLLM_CONFIG = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "topic": "kv"}'
SGLANG_CONFIG = '{"publisher": "zmq", "bind": true, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}'


class Subscriber:
    """A SUB socket on the app's publisher; ``take(n)`` gets n messages.
    Without an app it binds a free loopback port (``endpoint``) for a
    publisher that connects; set ``app`` once it is made."""

    def __init__(self, app: SimApp | None, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        if app is None:
            self.sub.bind("tcp://127.0.0.1:*")
            self.endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sub.connect(app.engine.events.endpoint)
        self.app = app

    def settle(self) -> None:
        """Wait until the subscription reached the publisher (PUB drops
        everything before it): publish probes until one arrives."""
        pub = self.app.engine.events
        for _ in range(200):
            pub.publish([{"type": "probe"}])
            if self.sub.poll(20):
                while self.sub.poll(20):
                    self.sub.recv_multipart()
                return
        raise AssertionError("the subscription never reached the publisher")

    def take(self, n: int) -> list[tuple[bytes, int, list]]:
        out = []
        for _ in range(n):
            assert self.sub.poll(2000), "no event within 2 s"
            topic, seq, payload = self.sub.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        assert not self.sub.poll(50)
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _run(app: SimApp, *calls: tuple) -> list[dict]:
    async def go() -> list[dict]:
        return [await asgi_json(app, *c) for c in calls]
    return anyio.run(go)


def test_config_is_each_engines_own():
    assert KVEventsConfig.parse("vllm", '{"enable_kv_cache_events": false}') is None
    assert KVEventsConfig.parse("vllm", '{"enable_kv_cache_events": true}') == KVEventsConfig(
        "tcp://*:5557", None, 10_000, 100_000, 100_000, "", bind=True)
    assert KVEventsConfig.parse("vllm", '{"enable_kv_cache_events": true, "publisher": "null"}') is None
    assert KVEventsConfig.parse("vllm", '{"publisher": "zmq"}') is None  # not enabled: vLLM's null publisher
    assert KVEventsConfig.parse("sglang", '{"topic": "x"}') is None  # SGLang's publisher defaults to null
    assert KVEventsConfig.parse("sglang", '{"publisher": "zmq", "bind": true}').buffer_steps == 10_000
    with pytest.raises(ValueError, match="^--kv-events-config: vllm takes no bind$"):  # extra="forbid"
        KVEventsConfig.parse("vllm", '{"enable_kv_cache_events": true, "bind": true}')
    # SGLang's pydantic model ignores keys it does not know.
    assert KVEventsConfig.parse("sglang", '{"publisher": "zmq", "enable_kv_cache_events": false}') == KVEventsConfig()
    with pytest.raises(ValueError, match="^--kv-events-config: Unknown event publisher 'kafka'$"):
        KVEventsConfig.parse("sglang", '{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="^--kv-events-config: publisher must be 'null' or 'zmq', got 'kafka'$"):
        KVEventsConfig.parse("vllm", '{"enable_kv_cache_events": true, "publisher": "kafka"}')


def test_config_values_are_read_as_the_engines_pydantic_reads_them():
    """Lax values are taken (a numeric string or integral float for an int,
    "yes"/1 for a bool), others refused; the engines' start-up refusals
    (a negative replay buffer or high-water mark) come at parse."""
    lax = KVEventsConfig.parse("vllm", '{"enable_kv_cache_events": "yes", "buffer_steps": "5", "hwm": 7.0, '
                                       '"max_queue_size": 0, "topic": "t"}')
    assert (lax.buffer_steps, lax.hwm, lax.max_queue_size, lax.topic) == (5, 7, 0, "t")
    assert KVEventsConfig.parse("sglang", '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:9", "bind": 1}').bind
    # pydantic's own rules (sim/lax.py): "8.00" is an int, a boolean spelled with spaces is not one.
    assert KVEventsConfig.parse("vllm", '{"enable_kv_cache_events": true, "buffer_steps": "8.00"}').buffer_steps == 8
    with pytest.raises(ValueError) as exc:
        KVEventsConfig.parse("vllm", '{"enable_kv_cache_events": " true"}')
    assert str(exc.value) == "--kv-events-config: enable_kv_cache_events must be a bool, got ' true'"
    for protocol, on in (("vllm", '"enable_kv_cache_events": true'), ("sglang", '"publisher": "zmq"')):
        for text, message in (('"topic": 5', "topic must be a str, got 5"),
                              ('"hwm": 1.5', "hwm must be an int, got 1.5"),
                              ('"buffer_steps": -1', "buffer_steps -1: maxlen must be non-negative"),
                              ('"hwm": -1', "hwm -1: Invalid argument")):
            with pytest.raises(ValueError) as exc:
                KVEventsConfig.parse(protocol, "{" + on + ", " + text + "}")
            assert str(exc.value) == "--kv-events-config: " + message
    with pytest.raises(ValueError) as exc:
        KVEventsConfig.parse("sglang", '{"publisher": "zmq", "bind": "maybe"}')
    assert str(exc.value) == "--kv-events-config: bind must be a bool, got 'maybe'"
    with pytest.raises(ValueError) as exc:
        KVEventsConfig.parse("sglang", '{"publisher": "zmq", "format": "dynamo"}')
    assert str(exc.value) == "--kv-events-config: the simulator does not play format 'dynamo'"
    with pytest.raises(ValueError) as exc:
        KVEventsConfig.parse("sglang", '{"publisher": "zmq", "format": "x"}')
    assert str(exc.value) == "--kv-events-config: format must be 'default' or 'dynamo', got 'x'"


@pytest.mark.parametrize("protocol, endpoint, bind, binds", [
    ("vllm", "tcp://*:5557", None, True), ("vllm", "tcp://[::]:5557", None, True),
    ("vllm", "ipc:///tmp/kv", None, True), ("vllm", "inproc://kv", None, True),
    ("vllm", "tcp://127.0.0.1:5557", None, False), ("vllm", "tcp://0.0.0.0:5557", None, False),
    ("vllm", "tcp://node-1:5557", None, False),
    ("sglang", "tcp://*:5557", None, True), ("sglang", "tcp://0.0.0.0:5557", None, True),
    ("sglang", "ipc:///tmp/kv", None, True), ("sglang", "tcp://127.0.0.1:5557", None, False),
    ("sglang", "tcp://127.0.0.1:5557", True, True), ("sglang", "tcp://*:5557", False, False),
])
def test_which_endpoints_each_engine_binds(protocol, endpoint, bind, binds):
    on = '"enable_kv_cache_events": true' if protocol == "vllm" else '"publisher": "zmq"'
    extra = "" if bind is None else f', "bind": {"true" if bind else "false"}'
    config = KVEventsConfig.parse(protocol, "{" + on + f', "endpoint": "{endpoint}"' + extra + "}")
    assert config.bind is binds


def _connecting(protocol: str, sub: "Subscriber", replay: str) -> SimApp:
    """A simulator whose PUB socket connects to ``sub``'s bound SUB."""
    on = '"enable_kv_cache_events": true' if protocol == "vllm" else '"publisher": "zmq"'
    config = "{" + on + f', "endpoint": "{sub.endpoint}", "replay_endpoint": "{replay}"' + "}"
    return SimApp(protocol, kv_events_config=config)


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_concrete_host_is_connected_to(protocol):
    """``tcp://127.0.0.1:PORT`` (SGLang without ``bind``): the publisher
    connects there, so a SUB socket bound there receives its events; the
    discovery routes report the endpoint as configured."""
    sub = Subscriber(None)
    app = _connecting(protocol, sub, "tcp://*:0")
    sub.app = app
    try:
        events = app.engine.events
        assert events.config.bind is False and events.endpoint == sub.endpoint
        sub.settle()
        if protocol == "vllm":
            _run(app, ("POST", "/inference/v1/generate", {"token_ids": list(range(100, 116)),
                                                          "sampling_params": {"max_tokens": 1}}))
        else:
            _run(app, ("POST", "/generate", {"input_ids": [7, 8, 9],
                                             "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}}))
        taken = sub.take(1 if protocol == "vllm" else 2)
        assert taken[0][2][1][0]["type"] == "BlockStored"
        port = int(sub.endpoint.rpartition(":")[2])
        if protocol == "vllm":
            sources, = _run(app, ("GET", "/kv_event_sources"))
            assert sources["0"]["endpoint"] == sub.endpoint
            assert sources["0"]["replay_endpoint"] == events.replay_endpoint
        else:
            info, = _run(app, ("GET", "/server_info"))
            assert info["kv_events"] == {"publisher": "zmq", "endpoint_host": "127.0.0.1", "endpoint_port_base": port,
                                         "topic": "", "block_size": 1, "dp_size": 1,
                                         "replay_endpoint_port_base": int(events.replay_endpoint.rpartition(":")[2])}
    finally:
        sub.close()
        app.engine.events.close()


@pytest.mark.parametrize("protocol, config", [
    ("vllm", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}'),
    ("sglang", '{"publisher": "zmq", "endpoint": "tcp://*:0"}'),
    ("sglang", '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "bind": true}'),
])
def test_a_wildcard_endpoint_or_sglang_bind_true_is_bound(protocol, config):
    app = SimApp(protocol, kv_events_config=config)
    sub = Subscriber(app)
    try:
        assert app.engine.events.config.bind is True
        assert app.engine.events.endpoint.startswith("tcp://127.0.0.1:")
        sub.settle()
        app.engine.events.publish([{"type": "AllBlocksCleared"}])
        (_, _, batch), = sub.take(1)
        assert batch[1] == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close()
        app.engine.events.close()


def test_sglang_told_not_to_bind_a_wildcard_fails_at_start():
    with pytest.raises(ValueError) as exc:
        SimApp("sglang", kv_events_config='{"publisher": "zmq", "endpoint": "tcp://*:5557", "bind": false}')
    assert str(exc.value).startswith("--kv-events-config: cannot connect to tcp://*:5557: Invalid argument")


def test_vllm_reports_a_replay_port_of_0_on_a_concrete_host_as_given():
    """vLLM's ``_bind`` resolves only ``tcp://*:0``: a replay socket bound
    at ``tcp://127.0.0.1:0`` gets some port, and ``/kv_event_sources``
    says ``:0``, as vLLM does."""
    app = SimApp("vllm", kv_events_config='{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", '
                                          '"replay_endpoint": "tcp://127.0.0.1:0"}')
    try:
        sources, = _run(app, ("GET", "/kv_event_sources"))
        assert sources["0"]["replay_endpoint"] == "tcp://127.0.0.1:0"
        assert sources["0"]["endpoint"].startswith("tcp://127.0.0.1:") and not sources["0"]["endpoint"].endswith(":0")
    finally:
        app.engine.events.close()


@pytest.mark.parametrize("config", [
    '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0"}',  # connects to port 0: nothing to advertise
    '{"publisher": "zmq", "endpoint": "inproc://kv"}',
])
def test_sglang_advertises_no_publisher_off_a_tcp_port(config):
    """``parse_advertisable_tcp``: ``/server_info`` ``kv_events`` is null
    unless the endpoint is ``tcp://`` with a port from 1 to 65535."""
    app = SimApp("sglang", kv_events_config=config)
    try:
        info, = _run(app, ("GET", "/server_info"))
        assert info["kv_events"] is None
    finally:
        app.engine.events.close()


def test_vllm_events_blocks_removal_clear_and_discovery():
    app = SimApp("vllm", cache_tokens=48, kv_events_config=VLLM_CONFIG)
    sub = Subscriber(app, b"kv")
    try:
        sub.settle()
        probes = app.engine.events.events
        prompt = list(range(100, 140))  # 2 full blocks of 16 and 8 tokens over
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1}, "cache_salt": "s"}
        _run(app, ("POST", "/inference/v1/generate", body))
        (topic, seq, batch), = sub.take(1)  # the prompt's blocks; its output adds no full block
        assert topic == b"kv" and len(batch) == 3 and batch[2] == 0
        stored, = batch[1]
        assert stored["type"] == "BlockStored" and stored["block_size"] == 16
        assert stored["token_ids"] == prompt[:32] and stored["parent_block_hash"] is None
        assert len(stored["block_hashes"]) == 2 and all(0 <= h < 2**64 for h in stored["block_hashes"])
        # vLLM's own hashes (tests/sim/test_sim_block_hash.py: its sha256 chain, the salt in block 0).
        assert stored["block_hashes"] == VLLMBlockHashes().keys(prompt, 16, ("s",))
        assert stored["extra_keys"] == [["s"], None] and stored["medium"] == "GPU"
        other = {"token_ids": list(range(500, 540)), "sampling_params": {"max_tokens": 1}}
        _run(app, ("POST", "/inference/v1/generate", other))
        (_, seq2, batch2), = sub.take(1)
        assert seq2 == seq + 1
        assert [e["type"] for e in batch2[1]] == ["BlockStored", "BlockRemoved"]
        assert batch2[1][1]["block_hashes"] == [stored["block_hashes"][1]]  # the tail first, LRU
        _run(app, ("POST", "/reset_prefix_cache", {}))
        (_, _, batch3), = sub.take(1)
        assert batch3[1] == [{"type": "AllBlocksCleared"}]
        sources, st = _run(app, ("GET", "/kv_event_sources"), ("GET", "/sim/stats"))
        assert sources["0"]["endpoint"] == app.engine.events.endpoint and sources["0"]["topic"] == "kv"
        assert sources["0"]["replay_endpoint"].startswith("tcp://127.0.0.1:")
        assert st["kv_events"]["events"] - probes == 4 and st["kv_events"]["replays"] == 0
    finally:
        sub.close()
        app.engine.events.close()


@pytest.mark.parametrize("version, maps", [(None, True), ("0.5.20", True), ("0.5.18", False)])
def test_sglang_events_per_version_encoding(version, maps):
    app = SimApp("sglang", engine_version=version, kv_events_config=SGLANG_CONFIG)
    sub = Subscriber(app)
    try:
        sub.settle()
        body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 1, "ignore_eos": True},
                "cache_salt": "s"}
        _run(app, ("POST", "/generate", body))
        (_, _, prompt), (_, _, finished) = sub.take(2)  # the prompt at prefill, the output at the end
        stored = prompt[1][0]
        if maps:
            assert stored == {"type": "BlockStored", "block_hashes": stored["block_hashes"], "parent_block_hash": None,
                              "token_ids": [7, 8, 9], "block_size": 1, "lora_id": None, "medium": "GPU",
                              "cache_salt": "s"}
            assert finished[1][0]["parent_block_hash"] == stored["block_hashes"][-1]
            assert stored["block_hashes"] == SGLangPageHashes().keys([7, 8, 9], 1, (None, "s"))
        else:
            assert stored == ["BlockStored", stored[1], None, [7, 8, 9], 1, None, "GPU", {"cache_salt": "s"}]
        info, = _run(app, ("GET", "/server_info"))
        assert info["kv_events"]["endpoint_host"] == "127.0.0.1" and info["kv_events"]["block_size"] == 1
        assert info["page_size"] == 1 and "replay_endpoint_port_base" in info["kv_events"]
    finally:
        sub.close()
        app.engine.events.close()


def test_a_dropped_range_is_a_gap_that_replay_fills():
    app = SimApp("vllm", kv_events_config=VLLM_CONFIG)
    sub = Subscriber(app, b"kv")
    ctx = zmq.Context()
    try:
        sub.settle()
        first = app.engine.events.stats()["next_seq"]
        _run(app, ("POST", "/sim/kv_events", {"drop": [first + 1, first + 3]}))
        for i in range(4):
            _run(app, ("POST", "/inference/v1/generate",
                       {"token_ids": list(range(1000 + 40 * i, 1040 + 40 * i)), "sampling_params": {"max_tokens": 1}}))
        seqs = [seq for _, seq, _ in sub.take(2)]
        assert seqs == [first, first + 3]  # first+1 and first+2 never came
        req = ctx.socket(zmq.DEALER)
        req.connect(app.engine.events.replay_endpoint)
        req.send_multipart((b"", (first + 1).to_bytes(8, "big")))
        got = []
        while True:
            assert req.poll(2000)
            _, topic, seq, payload = req.recv_multipart()
            if seq == END_SEQ:
                break
            got.append(int.from_bytes(seq, "big"))
        assert got == [first + 1, first + 2, first + 3]
        st, = _run(app, ("GET", "/sim/stats"))
        assert st["kv_events"]["dropped"] == 2 and st["kv_events"]["replays"] == 1
    finally:
        ctx.destroy(linger=0)
        sub.close()
        app.engine.events.close()


@pytest.mark.parametrize("protocol, config, message", [
    ("sglang", '{"publisher": "kafka"}', "--kv-events-config: Unknown event publisher 'kafka'"),
    ("vllm", '{"enable_kv_cache_events": true, "buffer_steps": -1}',
     "--kv-events-config: buffer_steps -1: maxlen must be non-negative"),
    ("sglang", '{"publisher": "zmq", "endpoint": "tcp://*:5557", "bind": false}',
     "--kv-events-config: cannot connect to tcp://*:5557: Invalid argument (addr='tcp://*:5557')"),
])
def test_sim_refuses_at_start_what_the_engine_refuses(capsys, protocol, config, message):
    from asgi_generate.server.cli import main

    assert main(["sim", "--protocol", protocol, "--kv-events-config", config, "--port", "0"]) == 2
    assert capsys.readouterr().err == f"asgi-generate sim: {message}\n"
