"""The hash chains in pure Python, over the PyPI ``xxhash``: the path taken
when the C accelerator (``_native.c``) is not built. Every function gives
what its C twin gives, value for value, and raises the same errors for bad
values (tests/hashes/test_hash_paths.py compares the two on random input).
"""

from __future__ import annotations

import operator
import struct
import sys
from typing import Any, Sequence

import orjson
from xxhash import xxh3_64_intdigest

#: The replay chain's XXH3 seed (Dynamo's KV router's; _native.c's SEED).
SEED = 1337
_PAIR = struct.Struct("<QQ")
_INT64 = range(-(2**63), 2**63)


def _bytes_of(data: Any) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise BufferError("data is not C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def chain(data: Any, block_size: int) -> list[int]:
    """The chained replay block hashes of packed token ids.

    Args:
        data: a contiguous buffer of little-endian ``u32`` token ids.
        block_size: tokens per block, at least 1.

    Returns:
        ``ceil(len(data) / 4 / block_size)`` ints in ``[0, 2**64)``: block
        ``i``'s sequence hash (XXH3-64, seed :data:`SEED`, of its bytes; from
        block 1 on, of the parent's sequence hash and that hash as two
        little-endian ``u64``).

    Raises:
        ValueError: ``block_size`` below 1, or ``len(data)`` not a multiple of 4.
        TypeError: ``data`` not a buffer, ``block_size`` not an int.
        BufferError: ``data`` not contiguous.
    """
    step = operator.index(block_size)
    if step > sys.maxsize:
        raise OverflowError("block_size does not fit a C ssize_t")
    if step < 1:
        raise ValueError(f"block_size must be at least 1, not {step}")
    view = _bytes_of(data)
    if len(view) % 4:
        raise ValueError(f"{len(view)} bytes are not whole u32 token ids")
    step = step * 4
    out = [xxh3_64_intdigest(view[start : start + step], SEED) for start in range(0, len(view), step)]
    pack = _PAIR.pack
    for i in range(1, len(out)):
        out[i] = xxh3_64_intdigest(pack(out[i - 1], out[i]), SEED)
    return out


def chain_json(data: Any, block_size: int) -> bytes:
    """:func:`chain` as the ASCII bytes of a JSON array of decimal integers,
    no spaces (``b'[]'`` for no data). Same arguments and errors."""
    return orjson.dumps(chain(data, block_size))


def kv_chain(start: int, ids: Any, block: int) -> list[int]:
    """The chained KV block keys of the full ``block``-token blocks of ``ids``:
    each ``hash((parent, *tokens))``, the first block's parent ``start``.

    Args:
        start: a 64-bit signed int.
        ids: a sequence of ints, or a buffer of unsigned 32-bit ints
            (format ``I``, such as ``array('I')``).
        block: tokens per block, at least 1.

    Raises:
        TypeError: ``ids`` neither; ``start`` or ``block`` not an int.
        OverflowError: ``start`` past 64 bits.
        ValueError: ``block`` below 1.
    """
    start = operator.index(start)
    if start not in _INT64:
        raise OverflowError("start does not fit a 64-bit signed int")
    block = operator.index(block)
    if block < 1:
        raise ValueError("block must be at least 1")
    if isinstance(ids, (list, tuple)):
        items: Sequence[int] = ids
    elif not isinstance(ids, bytes) and _is_buffer(ids):
        view = memoryview(ids)
        if view.itemsize != 4 or view.format not in ("I", "=I", "<I"):
            raise TypeError("ids buffer must be of unsigned 32-bit ints ('I')")
        items = view.cast("B").cast("I").tolist()  # flat, as the C loop reads it
    else:
        try:
            items = list(ids)
        except TypeError:
            raise TypeError("ids must be a sequence of ints or a buffer of 'I'") from None
    out = []
    parent = start
    if block == 1:  # SGLang's page size: a block a token
        for token in items:
            parent = hash((parent, token))
            out.append(parent)
        return out
    for base in range(0, len(items) - block + 1, block):
        parent = hash((parent, *items[base : base + block]))
        out.append(parent)
    return out


def _is_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


def expire(keys: list, predicted: dict, until: float) -> None:
    """Delete from ``predicted`` each of ``keys`` whose value still equals
    ``until``: a key predicted again since expires with that later one."""
    for key in keys:
        if not predicted:
            return
        value = predicted.get(key)
        if value is not None and (value is until or value == until):
            del predicted[key]


def mask_walk(keys: list, held: dict, active: int, predicted: list) -> tuple[list[int], list[int]]:
    """One walk down ``keys`` for every worker of the mask ``active`` at once:
    ``held`` maps a key to a worker mask, ``predicted`` is a list of
    ``(slot, dict)`` pairs (worker ``slot``'s predicted keys). Returns 64
    overlaps (worker ``i``'s count of leading keys held or predicted) and 64
    predicted-only counts; bits outside ``active`` give 0."""
    guessing = {slot: d for slot, d in predicted if d}
    overlap, guessed = [0] * 64, [0] * 64
    alive = active
    i = 0
    for i, key in enumerate(keys):
        if not alive:
            break
        lack = alive & ~held.get(key, 0)
        probe = lack
        while probe:
            low = probe & -probe
            probe ^= low
            slot = low.bit_length() - 1
            d = guessing.get(slot)
            if d is not None and key in d:
                lack &= ~low
                guessed[slot] += 1
        while lack:
            low = lack & -lack
            lack ^= low
            overlap[low.bit_length() - 1] = i
            alive &= ~low
    else:
        i = len(keys)
    while alive:
        low = alive & -alive
        alive ^= low
        overlap[low.bit_length() - 1] = i
    return overlap, guessed


def mask_set(keys: Any, masks: dict, bit: int) -> int:
    """Set ``bit`` in the mask of each of ``keys`` in ``masks``, adding absent
    keys; the count of masks that lacked it."""
    added = 0
    for key in keys:
        m = masks.get(key, 0)
        if not m & bit:
            masks[key] = m | bit
            added += 1
    return added


def mask_drop(masks: dict, bit: int) -> int:
    """Clear ``bit`` in every mask of ``masks``, deleting the keys whose mask
    falls to 0; the count of masks that had it."""
    had = [key for key, m in masks.items() if m & bit]
    for key in had:
        rest = masks[key] & ~bit
        if rest:
            masks[key] = rest
        else:
            del masks[key]
    return len(had)


def mask_remove(hashes: Sequence, keys: dict, masks: dict, bit: int) -> int:
    """For each of ``hashes`` (engine block hashes) that ``keys`` holds, pop it
    and clear ``bit`` in its block key's mask in ``masks`` (a mask falling to
    0 deletes its key); the count of masks that had ``bit``."""
    cleared = 0
    for h in hashes:
        if not keys:
            break
        key = keys.pop(h, None)
        if key is None:
            continue
        m = masks.get(key, 0)
        if m & bit:
            cleared += 1
            if m == bit:
                del masks[key]
            else:
                masks[key] = m & ~bit
    return cleared


def mask_missing(keys: list, masks: dict, bit: int, start: int = 0) -> list:
    """The ``keys`` from index ``start`` on whose mask in ``masks`` lacks
    ``bit``, in order."""
    if start < 0:
        raise ValueError("start must be at least 0")
    return [key for key in keys[start:] if not masks.get(key, 0) & bit]


def rendezvous(urls: list, tail: bytes) -> list[int]:
    """The indexes in ``urls`` (a non-empty list of bytes), in order, of
    those whose ``xxh3_64_intdigest(tail, seed=xxh3_64_intdigest(url))``
    is the highest."""
    if not isinstance(urls, list) or not isinstance(tail, bytes) or not urls:
        raise TypeError("rendezvous(urls: non-empty list of bytes, tail: bytes)")
    weights = [xxh3_64_intdigest(tail, seed=xxh3_64_intdigest(url)) for url in urls]
    high = max(weights)
    return [i for i, w in enumerate(weights) if w == high]


def kv_lowest(prompt: int, weights: tuple, blocks: list, guessed: list, pending: list, count: list, sizes: list,
              outstanding: list, per_request: list, others: list, extra: list | None) -> list[int]:
    """kv-aware's scoring: for each worker ``i``, ``requests = outstanding
    * per_request + others`` and ``cost = ow * (prompt - blocks * sizes)
    + qw * ((pending - guessed) * sizes) + lw * requests`` (``+ extra[i]``
    unless ``None``); the indexes, in order, of the workers tied at the
    lowest ``(cost, (count + pending) * sizes, requests)``."""
    columns = [blocks, guessed, pending, count, sizes, outstanding, per_request, others]
    if not all(isinstance(c, list) and len(c) == len(blocks) for c in columns + ([extra] if extra is not None else [])):
        raise TypeError("kv_lowest: lists of one length")
    if not blocks:
        raise ValueError("kv_lowest: no workers")
    ow, qw, lw = weights
    keys = []
    for i, (b, g, p, c, s, o, r, t) in enumerate(zip(*columns)):
        requests = o * r + t
        cost = ow * (prompt - b * s) + qw * ((p - g) * s) + lw * requests
        if extra is not None:
            cost += extra[i]
        keys.append((cost, (c + p) * s, requests))
    low = min(keys)
    return [i for i, k in enumerate(keys) if k == low]
