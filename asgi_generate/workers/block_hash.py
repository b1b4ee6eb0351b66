"""Block hashes of token ids: a prompt as a chain of fixed-size blocks.

Both engines find cached KV by the hash of a block's whole prefix: vLLM's
``hash_block_tokens`` (``vllm/v1/core/kv_cache_utils.py``) hashes the
parent block's hash with the block's token ids, SGLang's radix cache pages
(``mem_cache/radix_cache.py``) chain the same way in its KV events. A
namespace (SGLang ``extra_key`` and ``cache_salt``, vLLM ``cache_salt``)
seeds the chain, so no block of one namespace is found from another.

The simulator's prefix cache and the frontend's KV index both chain with
:func:`block_hashes`: 64-bit signed ints from Python's tuple hash of ints,
``hash((parent, *tokens))`` per block, the same in every process
(``PYTHONHASHSEED`` salts only str and bytes), so two frontend replicas
compute the same keys. The keys never leave the process. The chain runs in
C when the accelerator is built (:mod:`asgi_generate.hashes`, CPython's
tuple and int hashes written out), else as that definition in Python.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

from ..hashes import kv_chain

#: The chain's seed without a namespace.
ROOT = 0


def namespace_seed(namespace: tuple[str | None, ...]) -> int:
    """The chain's seed for ``namespace`` (its strings, ``None`` for an
    absent one): :data:`ROOT` when every part is absent, else 8 bytes of
    SHA-256 over the parts, each length-prefixed so that ``("a", "bc")``
    and ``("ab", "c")`` differ."""
    if all(part is None for part in namespace):
        return ROOT
    digest = hashlib.sha256()
    for part in namespace:
        if part is None:
            digest.update(b"\x00")
        else:
            raw = part.encode("utf-8", "surrogatepass")
            digest.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
    return int.from_bytes(digest.digest()[:8], "big", signed=True)


def block_hashes(seed: int, ids: Sequence[int], block: int, parent: int | None = None) -> list[int]:
    """The hashes of the full ``block``-token blocks of ``ids`` (ints, or
    an ``array('I')`` such as a packed prompt's ``u32``), each over its
    parent's hash and its tokens, ``hash((parent, *tokens))``; the first
    block's parent is ``parent`` when given (a chain continued), else
    ``seed`` (a 64-bit signed int, as both are).

    Raises:
        TypeError: ``ids`` neither a sequence nor a buffer of unsigned
            32-bit ints (a sequence's items are hashed as the tuple hash
            would: ints are what the codecs let through).
        OverflowError: ``seed``/``parent`` past 64 bits.
        ValueError: ``block`` below 1.
    """
    return kv_chain(seed if parent is None else parent, ids, block)
