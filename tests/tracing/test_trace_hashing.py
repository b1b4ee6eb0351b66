"""The replay block hash chain (Dynamo's KV-router scheme, partial last
block included): both of the package's paths (the C accelerator,
``hashes/_native.c``, when it is built, and ``hashes/_python.py``) against
``by_hand``, the chain written out in Python from its definition."""

from __future__ import annotations

import array
import math
import pathlib
import struct
import subprocess
import sys

import orjson
import pytest
import xxhash
from asgi_generate_sglang.codec import SGLangCodec
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_generate.sdk._codec import Attempt
from asgi_generate.sdk._token_ids import pack_token_ids
from asgi_generate.hashes import _python
from asgi_generate.exceptions import TokenIdOutOfRange
from asgi_generate.tracing.hashing import SEED, block_hashes, block_hashes_json

try:
    from asgi_generate.hashes import _native
except ImportError:  # installed without a C compiler: the pure-Python path alone
    _native = None

#: The chain's implementations this install has.
PATHS = [pytest.param(_python, id="python")] + ([pytest.param(_native, id="c")] if _native else [])
native_only = pytest.mark.skipif(_native is None, reason="the C accelerator is not built")
NOGIL_BYTES = _native.NOGIL_BYTES if _native else 65536

token_ids = st.lists(st.integers(0, 2**32 - 1), max_size=300)
# Over 60 tokens (240 bytes) a block takes XXH3's long-input path, where the C
# loop uses a secret derived once from the seed.
block_sizes = st.integers(1, 130)


def by_hand(ids: list[int], bs: int) -> list[int]:
    """The chain written out from its definition."""
    out = []
    for i in range(0, len(ids), bs):
        chunk = ids[i : i + bs]
        h = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(chunk)}I", *chunk), seed=SEED)
        out.append(h if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], h), seed=SEED))
    return out


def test_known_values():
    assert block_hashes([1, 2, 3], 2) == [10773075109927122010, 17466410656762125515]
    assert block_hashes([1, 2, 3], 2) == by_hand([1, 2, 3], 2)
    # The first block's hash is its plain XXH3-64 with seed 1337, as in Dynamo.
    assert block_hashes([1, 2], 2) == [xxhash.xxh3_64_intdigest(struct.pack("<2I", 1, 2), seed=1337)]


def test_empty_input():
    assert block_hashes([], 64) == []


def test_shared_prefix_gives_equal_leading_hashes():
    common = list(range(100, 228))  # two full blocks of 64
    a = block_hashes(common + [1, 2, 3], 64)
    b = block_hashes(common + [1, 2, 4], 64)
    assert len(a) == len(b) == 3
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_divergence_propagates_down_the_chain():
    a = block_hashes([5] * 64 + [6] * 64 + [7] * 64, 64)
    b = block_hashes([5] * 63 + [0] + [6] * 64 + [7] * 64, 64)
    assert [x != y for x, y in zip(a, b)] == [True, True, True]


def test_same_block_at_another_position_hashes_differently():
    block = list(range(7, 71))
    twice = block_hashes(block + block, 64)
    assert twice[0] != twice[1]
    shifted = block_hashes(list(range(500, 564)) + block, 64)
    assert shifted[1] != twice[0]
    assert shifted[1] != twice[1]


def test_partial_last_block_is_counted():
    assert len(block_hashes(list(range(64)), 64)) == 1
    full = block_hashes(list(range(65)), 64)
    assert len(full) == 2
    changed = block_hashes(list(range(64)) + [999], 64)
    assert full[0] == changed[0]
    assert full[1] != changed[1]
    assert len(block_hashes([1], 64)) == 1


def test_out_of_range_ids_and_bad_block_size():
    with pytest.raises(TokenIdOutOfRange):
        block_hashes([1, 2**32], 4)
    with pytest.raises(TokenIdOutOfRange):
        block_hashes([-1], 4)
    with pytest.raises(ValueError, match="block_size must be at least 1, not 0"):
        block_hashes([1], 0)
    with pytest.raises(TypeError):
        block_hashes([1, "2"], 4)
    with pytest.raises(TokenIdOutOfRange):
        block_hashes_json([1, 2**32], 4)
    with pytest.raises(ValueError, match="block_size must be at least 1, not 0"):
        block_hashes_json([1], 0)


@settings(max_examples=200, deadline=None)
@given(token_ids, block_sizes)
def test_matches_the_definition_and_counts_ceil(ids, bs):
    hashes = block_hashes(ids, bs)
    assert hashes == by_hand(ids, bs)
    assert len(hashes) == math.ceil(len(ids) / bs)
    assert all(0 <= h < 2**64 for h in hashes)


@settings(max_examples=200, deadline=None)
@given(token_ids, token_ids, block_sizes)
def test_full_blocks_of_a_shared_prefix_hash_equal(prefix, tail, bs):
    full = len(prefix) // bs
    assert block_hashes(prefix + tail, bs)[:full] == block_hashes(prefix, bs)[:full]


# docs/traces.md documents these; a faster hashing path must keep them.
KNOWN_PROMPT = list(range(200))
KNOWN_HASHES = [3480597578098033343, 2575318956255022795, 15087857196529367026, 16370012624106061344]


def test_known_prompt_hashes_to_the_documented_values():
    readme = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "traces.md").read_text()
    assert "`0, 1, ..., 199` at block size 64" in readme
    assert all(f"`{h}`" in readme for h in KNOWN_HASHES)
    assert block_hashes(KNOWN_PROMPT, 64) == KNOWN_HASHES
    assert block_hashes(array.array("I", KNOWN_PROMPT), 64) == KNOWN_HASHES
    assert by_hand(KNOWN_PROMPT, 64) == KNOWN_HASHES


def test_the_codecs_packed_prompt_hashes_as_the_list():
    request = SGLangCodec().decode(orjson.dumps({"input_ids": KNOWN_PROMPT}), {})
    assert request.input_ids == KNOWN_PROMPT
    assert request.input_ids_packed == pack_token_ids(KNOWN_PROMPT)
    assert type(request.input_ids_packed.u32) is array.array
    assert request.input_ids_packed.u32.tolist() == KNOWN_PROMPT
    assert block_hashes(request.input_ids_packed.u32, 64) == KNOWN_HASHES


elements = st.one_of(st.integers(-(2**70), 2**70), st.integers(0, 2**32 - 1), st.booleans(), st.floats(), st.none(),
                     st.text(max_size=3), st.lists(st.integers(0, 9), max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.lists(elements, max_size=40))
def test_pack_token_ids_packs_exactly_the_in_range_int_lists(ids):
    valid = all(type(t) is int and 0 <= t < 2**32 for t in ids)
    packed = pack_token_ids(ids)
    if not valid:
        assert packed is None
    else:
        assert packed is not None
        assert packed.u32.typecode == "I" and packed.u32.tolist() == ids
        assert packed.u32.tobytes() == struct.pack(f"<{len(ids)}I", *ids)
        assert packed.json == orjson.dumps(ids)


def test_the_engine_gets_the_same_body_bytes_from_the_packed_prompt():
    body = {"input_ids": KNOWN_PROMPT, "sampling_params": {"max_new_tokens": 3}}
    exchange = SGLangCodec().exchange(SGLangCodec().decode(orjson.dumps(body), {}), "e" * 32)
    sent = exchange.worker_request(Attempt("e" * 32)).body
    assert sent == orjson.dumps({**body, "rid": "e" * 32})


@pytest.mark.parametrize("impl", PATHS)
@settings(max_examples=200, deadline=None)
@given(ids=token_ids, bs=block_sizes)
def test_the_c_loop_reads_any_buffer_of_little_endian_u32(impl, ids, bs):
    chain, chain_json = impl.chain, impl.chain_json
    data = struct.pack(f"<{len(ids)}I", *ids)
    expected = by_hand(ids, bs)
    assert chain(data, bs) == expected
    assert chain(bytearray(data), bs) == expected
    assert chain(memoryview(data), bs) == expected
    assert chain_json(data, bs) == orjson.dumps(expected)
    assert block_hashes_json(ids, bs) == orjson.dumps(expected)


@native_only
@pytest.mark.parametrize("loop", _native.loops() if _native else [])
@settings(max_examples=100, deadline=None)
@given(ids=token_ids, bs=block_sizes)
def test_every_xxh3_loop_gives_the_definitions_hashes(loop, ids, bs):
    chain, chain_json, use_loop = _native.chain, _native.chain_json, _native.use_loop
    before = use_loop(loop)
    try:
        assert chain(array.array("I", ids), bs) == by_hand(ids, bs)
        assert chain_json(array.array("I", ids), bs) == orjson.dumps(by_hand(ids, bs))
    finally:
        use_loop(before)


@native_only
def test_loops_are_named_best_first_and_unknown_ones_refused():
    loops, use_loop = _native.loops, _native.use_loop
    assert loops()[-1] == "baseline"
    assert set(loops()) <= {"avx2", "baseline"}
    with pytest.raises(ValueError, match="no XXH3 loop 'sse9'"):
        use_loop("sse9")
    assert use_loop(loops()[0]) == loops()[0]  # the best one is in use


@pytest.mark.parametrize("impl", PATHS)
def test_the_json_text_of_short_hashes(impl):
    chain_json = impl.chain_json
    # One-token blocks whose hashes have 16 down to 11 digits (found by search):
    # below 10**16 the digits take the general path.
    ids = [1202, 8774, 282082, 5879261, 15660530, 44994277]
    hashes = [by_hand([i], 1)[0] for i in ids]
    assert [len(str(h)) for h in hashes] == [16, 15, 14, 13, 12, 11]
    for i, h in zip(ids, hashes):
        assert chain_json(array.array("I", [i]), 1) == b"[%d]" % h


@pytest.mark.parametrize("impl", PATHS)
def test_the_json_text_of_extreme_hashes(impl):
    chain_json = impl.chain_json
    # These 3,000 one-token blocks hash to values of 16 to 20 digits.
    assert chain_json(b"", 4) == b"[]"
    ids = list(range(3000))
    hashes = by_hand(ids, 1)
    assert {len(str(h)) for h in hashes} == {16, 17, 18, 19, 20}
    assert chain_json(array.array("I", ids), 1) == orjson.dumps(hashes)


@pytest.mark.parametrize("tokens", [NOGIL_BYTES // 4 - 1, NOGIL_BYTES // 4, NOGIL_BYTES // 4 + 100])
def test_long_prompts_hash_the_same_without_the_gil(tokens):
    # From NOGIL_BYTES (16K ids) on the loop runs with the GIL released.
    ids = [(i * 2654435761) % 2**32 for i in range(tokens)]
    packed = array.array("I", ids)
    assert NOGIL_BYTES == 65536
    assert block_hashes(packed, 64) == by_hand(ids, 64)
    assert block_hashes(packed, 1000) == by_hand(ids, 1000)
    assert block_hashes_json(packed, 64) == orjson.dumps(by_hand(ids, 64))
    assert len(block_hashes(packed, 64)) == math.ceil(tokens / 64)


@pytest.mark.parametrize("impl", PATHS)
def test_a_huge_block_size_is_one_block(impl):
    chain = impl.chain
    assert chain(struct.pack("<3I", 1, 2, 3), 2**62) == by_hand([1, 2, 3], 3)
    assert chain(b"", 2**62) == []


@pytest.mark.parametrize("impl", PATHS)
def test_the_c_loop_refuses_what_is_not_packed_u32(impl):
    chain, chain_json = impl.chain, impl.chain_json
    with pytest.raises(ValueError, match="^5 bytes are not whole u32 token ids$"):
        chain(b"12345", 4)
    with pytest.raises(ValueError, match="^block_size must be at least 1, not -3$"):
        chain(b"1234", -3)
    with pytest.raises(TypeError):
        chain([1, 2, 3], 4)
    with pytest.raises(TypeError):
        chain(b"1234", 4.0)
    with pytest.raises(ValueError, match="^6 bytes are not whole u32 token ids$"):
        chain_json(b"123456", 4)
    with pytest.raises(BufferError):
        chain(memoryview(b"12345678" * 2)[::2], 1)  # not contiguous


@native_only
def test_the_c_loop_names_its_arguments_count():
    with pytest.raises(TypeError, match="^chain\\(\\) takes 2 arguments \\(1 given\\)$"):
        _native.chain(b"1234")
    with pytest.raises(TypeError, match="^chain_json\\(\\) takes 2 arguments \\(3 given\\)$"):
        _native.chain_json(b"1234", 1, 2)


@pytest.mark.e2e
def test_without_the_accelerator_the_chain_is_the_same():
    """An install without a C compiler (the module never built) hashes in
    pure Python, to the documented values."""
    code = ("import sys\nsys.modules['asgi_generate.hashes._native'] = None  # as if never built\n"
            "from asgi_generate import hashes\nfrom asgi_generate.tracing.hashing import block_hashes, "
            "block_hashes_json\nprint(hashes.ACCELERATED, block_hashes(%r, 64) == %r, "
            "block_hashes_json(%r, 64).decode())\n" % (KNOWN_PROMPT, KNOWN_HASHES, KNOWN_PROMPT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True).stdout
    assert out == f"False True {orjson.dumps(KNOWN_HASHES).decode()}\n"
