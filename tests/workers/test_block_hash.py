"""The KV index's block hashes (the path in use: hashes/_native.c when it is
built, else hashes/_python.py) against their Python definition, and the
index's expiry; tests/hashes/test_hash_paths.py compares the two paths."""

from __future__ import annotations

import array
import random

import pytest

from asgi_generate.hashes import expire
from asgi_generate.workers.block_hash import ROOT, block_hashes, namespace_seed


def reference_block_hashes(seed: int, ids: list[int], block: int, parent: int | None = None) -> list[int]:
    """The chain's definition in Python: a tuple hash per full block over
    its parent's hash and its tokens (the C loop writes CPython's tuple and
    int hashes out)."""
    out = []
    h = seed if parent is None else parent
    for start in range(0, len(ids) - block + 1, block):
        h = hash((h, *ids[start : start + block]))
        out.append(h)
    return out


def test_pinned_values():
    """Python's tuple hash of ints, chained: the same in every process and
    release of this frontend (and the simulator's prefix cache)."""
    assert block_hashes(ROOT, [1, 2, 3], 1) == [-1950498447580522560, -6807366614615034570, 5726672480290447960]
    assert block_hashes(-5, [1, 2, 3, 4], 2) == [-8586902969311765015, 5513230170648188038]
    assert block_hashes(ROOT, [1, 2, 3], 1) == [hash((0, 1)), hash((hash((0, 1)), 2)),
                                                hash((hash((hash((0, 1)), 2)), 3))]


def test_the_c_chain_is_the_python_chain():
    """Random prompts, block sizes, seeds (the int hash's edges: -1, the
    modulus 2**61 - 1 and past it, the 64-bit extremes) and parents; ids
    as a list and as a packed ``array('I')``; a partial last block is
    not hashed."""
    rng = random.Random(7)
    edges = [0, 1, -1, -2, 2**61 - 2, 2**61 - 1, 2**61, -(2**61 - 1), -(2**61), 2**63 - 1, -(2**63),
             namespace_seed(("salt",))]
    for trial in range(400):
        ids = [rng.choice([0, 1, 2**32 - 1, rng.randrange(2**32)]) for _ in range(rng.randrange(0, 200))]
        block = rng.choice([1, 2, 3, 16, 64])
        seed = rng.choice(edges + [rng.randrange(-(2**63), 2**63)])
        parent = rng.choice([None, rng.randrange(-(2**63), 2**63)])
        expected = reference_block_hashes(seed, ids, block, parent)
        assert len(expected) == len(ids) // block
        assert block_hashes(seed, ids, block, parent) == expected, trial
        assert block_hashes(seed, array.array("I", ids), block, parent) == expected, trial


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        block_hashes(ROOT, [1], 0)
    with pytest.raises(TypeError):
        block_hashes(ROOT, array.array("H", [1]), 1)
    with pytest.raises(TypeError):
        block_hashes(ROOT, 5, 1)
    with pytest.raises(OverflowError):
        block_hashes(2**64, [1], 1)


def test_expire():
    """``expire`` deletes only the keys still at the given expiry."""
    predicted = {1: 5.0, 2: 7.0, 3: 5.0}
    expire([1, 2, 3, 4], predicted, 5.0)
    assert predicted == {2: 7.0}
