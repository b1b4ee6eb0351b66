"""The hash chains' two paths, the C accelerator (hashes/_native.c) and
pure Python (hashes/_python.py), give the same values, errors and dict
effects on random input: replay hashes are written into trace records and
KV keys are shared by every worker's index, so which path an install has
must not show. Runs where the accelerator is built."""

from __future__ import annotations

import array
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_generate import hashes
from asgi_generate.hashes import _python

try:
    from asgi_generate.hashes import _native
except ImportError:
    _native = None

pytestmark = pytest.mark.skipif(_native is None, reason="the C accelerator is not built")

u32s = st.lists(st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**32 - 1])), max_size=400)
int64s = st.one_of(st.integers(-(2**63), 2**63 - 1),
                   st.sampled_from([0, 1, -1, -2, 2**61 - 2, 2**61 - 1, 2**61, -(2**61 - 1), -(2**61), 2**63 - 1,
                                    -(2**63)]))
KEYS = st.integers(0, 15)


def test_the_package_uses_the_accelerator_when_it_is_built():
    assert hashes.ACCELERATED is True
    assert hashes.chain is _native.chain and hashes.kv_chain is _native.kv_chain


@settings(max_examples=300, deadline=None)
@given(ids=u32s, bs=st.integers(1, 130))
def test_replay_chains_are_equal(ids, bs):
    """Blocks over 60 tokens take XXH3's long-input path, shorter ones its
    short paths; the last block may be partial."""
    data = struct.pack(f"<{len(ids)}I", *ids)
    packed = array.array("I", ids)
    assert _python.chain(data, bs) == _native.chain(data, bs)
    assert _python.chain(packed, bs) == _native.chain(packed, bs)
    assert _python.chain_json(packed, bs) == _native.chain_json(packed, bs)


def test_a_long_prompts_replay_chain_is_equal():
    ids = [(i * 2654435761) % 2**32 for i in range(20000)]  # past the C loop's GIL release
    packed = array.array("I", ids)
    for bs in (1, 16, 64, 1000):
        assert _python.chain_json(packed, bs) == _native.chain_json(packed, bs)


@settings(max_examples=300, deadline=None)
@given(ids=u32s, block=st.sampled_from([1, 2, 3, 16, 64]), start=int64s)
def test_kv_chains_are_equal(ids, block, start):
    want = _native.kv_chain(start, ids, block)
    assert len(want) == len(ids) // block
    assert _python.kv_chain(start, ids, block) == want
    assert _python.kv_chain(start, array.array("I", ids), block) == want
    assert _python.kv_chain(start, tuple(ids), block) == want


def test_kv_chains_read_any_buffer_of_u32_alike():
    """A buffer is read flat, whatever its shape; one of big-endian u32 is refused."""
    numpy = pytest.importorskip("numpy")
    grid = numpy.arange(4096, 4096 + 24, dtype=numpy.uint32).reshape(4, 6)
    assert _python.kv_chain(5, grid, 4) == _native.kv_chain(5, grid, 4) == _native.kv_chain(5, grid.ravel().tolist(), 4)
    for impl in (_native, _python):
        with pytest.raises(TypeError, match=r"^ids buffer must be of unsigned 32-bit ints \('I'\)$"):
            impl.kv_chain(0, grid.astype(">u4"), 4)


@pytest.mark.parametrize("args,error", [
    ((0, [1], 0), ValueError),
    ((0, array.array("H", [1]), 1), TypeError),
    ((0, 5, 1), TypeError),
    ((2**63, [1], 1), OverflowError),
    ((-(2**63) - 1, [1], 1), OverflowError),
    ((0.0, [1], 1), TypeError),
    ((0, [1], 1.0), TypeError),
])
def test_kv_chains_refuse_alike(args, error):
    for impl in (_native, _python):
        with pytest.raises(error):
            impl.kv_chain(*args)


@pytest.mark.parametrize("args,error,message", [
    ((b"12345", 4), ValueError, "5 bytes are not whole u32 token ids"),
    ((b"1234", -3), ValueError, "block_size must be at least 1, not -3"),
    (([1], 0), ValueError, "block_size must be at least 1, not 0"),
    (([1, 2, 3], 4), TypeError, None),
    ((b"1234", 4.0), TypeError, None),
    ((b"1234", 2**63), OverflowError, None),
    ((memoryview(b"12345678" * 2)[::2], 1), BufferError, None),
])
def test_replay_chains_refuse_alike(args, error, message):
    for impl in (_native, _python):
        for fn in (impl.chain, impl.chain_json):
            with pytest.raises(error) as raised:
                fn(*args)
            if message is not None:
                assert str(raised.value) == message


index_ops = st.lists(st.one_of(
    st.tuples(st.just("set"), st.lists(KEYS, max_size=8), st.integers(0, 5)),
    st.tuples(st.just("drop"), st.integers(0, 5)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 20), max_size=8), st.integers(0, 5)),
    st.tuples(st.just("missing"), st.lists(KEYS, max_size=8), st.integers(0, 5), st.integers(0, 9)),
    st.tuples(st.just("walk"), st.lists(KEYS, max_size=12), st.integers(0, 63),
              st.lists(st.tuples(st.integers(0, 5), st.sets(KEYS)), max_size=4)),
    st.tuples(st.just("expire"), st.lists(KEYS, max_size=8), st.sampled_from([1.0, 2.0])),
), max_size=25)


@settings(max_examples=300, deadline=None)
@given(ops=index_ops)
def test_the_index_loops_are_equal(ops):
    """The same random run of mask and expiry calls on two copies of an
    index: equal results and equal dicts after every call."""
    state = {impl: ({}, {h: h % 16 for h in range(21)}, {k: float(k % 3) for k in range(16)})
             for impl in (_native, _python)}
    for op in ops:
        results = []
        for impl, (masks, engine, predicted) in state.items():
            kind = op[0]
            if kind == "set":
                got = impl.mask_set(op[1], masks, 1 << op[2])
            elif kind == "drop":
                got = impl.mask_drop(masks, 1 << op[1])
            elif kind == "remove":
                got = impl.mask_remove(op[1], engine, masks, 1 << op[2])
            elif kind == "missing":
                got = impl.mask_missing(op[1], masks, 1 << op[2], op[3])
            elif kind == "walk":
                pairs = [(slot, dict.fromkeys(keys, 1.0)) for slot, keys in dict(op[3]).items()]
                got = impl.mask_walk(op[1], masks, op[2], pairs)
            else:
                got = impl.expire(op[1], predicted, op[2])
            results.append((got, dict(masks), dict(engine), dict(predicted)))
        assert results[0] == results[1], op


@settings(max_examples=300, deadline=None)
@given(urls=st.lists(st.binary(max_size=300), min_size=1, max_size=6), tail=st.binary(max_size=300),
       repeat=st.booleans())
def test_rendezvous_hashes_are_equal_and_are_xxhashs(urls, tail, repeat):
    """The C path's weights are the PyPI xxhash's, XXH3-64 of the tail
    seeded by the URL's, over every length XXH3 treats apart (0, 1-3,
    4-8, 9-16, 17-128, 129-240, longer); equal URLs tie."""
    if repeat:
        urls = urls + urls[:1]
    weights = [xxhash.xxh3_64_intdigest(tail, seed=xxhash.xxh3_64_intdigest(u)) for u in urls]
    want = [i for i, w in enumerate(weights) if w == max(weights)]
    assert _native.rendezvous(urls, tail) == _python.rendezvous(urls, tail) == want


def test_rendezvous_refuses_alike():
    for impl in (_native, _python):
        for args in (([], b""), ([b"a"], "t"), ("a", b"")):
            with pytest.raises(TypeError):
                impl.rendezvous(*args)


counts = st.integers(0, 40)


@settings(max_examples=500, deadline=None)
@given(rows=st.lists(st.tuples(counts, counts, counts, counts, st.sampled_from([1, 2, 16]), st.integers(0, 9),
                               st.sampled_from([1, 1.0, 2, 1.6, 8 + 0.2 * (1 - 8)]), st.integers(0, 9),
                               st.sampled_from([0.0, 0.05 * 9216, 1.5, 100.0])), min_size=1, max_size=12),
       prompt=st.integers(0, 200), weights=st.tuples(*[st.sampled_from([0.0, 1, 1.25, 0.1, 128.0, 3])] * 3),
       with_extra=st.booleans())
def test_kv_lowest_is_equal(rows, prompt, weights, with_extra):
    """Equal ties on the three keys (costs rounded as Python rounds them,
    int and float weights and samples per request alike)."""
    blocks, guessed, pending, count, sizes, outstanding, per_request, others, extra = map(list, zip(*rows))
    guessed = [min(g, p) for g, p in zip(guessed, pending)]
    args = (prompt, weights, blocks, guessed, pending, count, sizes, outstanding, per_request, others,
            extra if with_extra else None)
    assert _native.kv_lowest(*args) == _python.kv_lowest(*args)


def test_kv_lowest_refuses_alike():
    one = [1]
    for impl in (_native, _python):
        with pytest.raises(TypeError):
            impl.kv_lowest(0, (1.0, 0.0, 1.0), one, one, one, one, one, one, one, [1, 2], None)
        with pytest.raises(ValueError):
            impl.kv_lowest(0, (1.0, 0.0, 1.0), [], [], [], [], [], [], [], [], None)
