"""Replay block hashes: chained XXH3-64 over fixed-size blocks of token ids.

The scheme is NVIDIA Dynamo's KV-router hashing (``dynamo_kv_router::protocols``
``compute_block_hash_for_seq`` and ``compute_seq_hash_for_block``), so full
blocks hash to the values Dynamo's router and replay tools use:

- block hash: XXH3-64, seed 1337, over the block's token ids as little-endian
  ``u32``;
- sequence hash: the first block's is its block hash; each later one is
  XXH3-64, seed 1337, over ``parent_sequence_hash || block_hash`` as two
  little-endian ``u64``.

Unlike the router, a partial last block is hashed too (over its shorter
bytes), so an input of ``n`` tokens gives ``ceil(n / block_size)`` hashes and
two prompts share a leading hash exactly when they share that whole prefix.
"""

from __future__ import annotations

import array
import sys
from typing import Sequence

from ..hashes import SEED, chain, chain_json  # SEED: the chain's, named here for readers and tests
from ..exceptions import TokenIdOutOfRange
from ..sdk._token_ids import as_u32

_LITTLE = sys.byteorder == "little"


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained sequence hashes of ``token_ids`` in blocks of ``block_size``.

    The chain runs over the packed ids' bytes in place: in C when the
    accelerator is built (:mod:`asgi_generate.hashes`, xxHash's XXH3, without
    the GIL from 64 KiB, 16K ids, on), else in Python over the PyPI
    ``xxhash``, with the same values.

    Args:
        token_ids: the input token ids, each in ``[0, 2**32)``: a list, or an
            ``array('I')`` (a codec's :func:`~asgi_generate.sdk.pack_token_ids`),
            whose bytes are hashed as they are on a little-endian host (no
            per-id conversion, the costly part on a long prompt).
        block_size: tokens per block, at least 1.

    Returns:
        ``ceil(len(token_ids) / block_size)`` unsigned 64-bit integers; ``[]``
        for an empty input.

    Raises:
        TokenIdOutOfRange: a token id is negative or at least ``2**32``.
        TypeError: a token id is not an int.
        ValueError: ``block_size`` is less than 1.
    """
    return chain(_packed(token_ids), block_size)


def block_hashes_json(token_ids: Sequence[int], block_size: int) -> bytes:
    """:func:`block_hashes` as the text ``orjson.dumps`` gives for it (a JSON
    array of decimal integers, no spaces), written in C by the accelerator
    (orjson spends about 45 ns on each integer over 30 bits, more than
    hashing its block), else by orjson.

    Args and Raises: as :func:`block_hashes`.
    """
    if type(token_ids) is array.array and token_ids.typecode == "I" and _LITTLE:
        return chain_json(token_ids, block_size)  # a codec's packed prompt, as is
    return chain_json(_packed(token_ids), block_size)


def _packed(token_ids: Sequence[int]) -> array.array:
    try:
        packed = as_u32(token_ids)
    except OverflowError:
        raise TokenIdOutOfRange("a token id is outside [0, 2**32)") from None
    if not _LITTLE:
        packed = array.array("I", packed)
        packed.byteswap()
    return packed
