"""Block hashes as each engine computes and publishes them.

The simulator's prefix cache finds blocks by these hashes and its KV events
(:mod:`asgi_generate.sim.kv_events`) publish them, so a subscriber sees the
numbers the engine would send. A subscriber can only use them as names (of
the block a ``BlockRemoved`` or a child's ``parent_block_hash`` refers to):
both engines hash with a seed and a layout of their own, and the token ids
each ``BlockStored`` carries are what a KV index keys blocks by.

vLLM 0.33 (``vllm/v1/core/kv_cache_utils.py``): ``hash_block_tokens`` hashes
``(parent_block_hash, tuple(token_ids), extra_keys)`` with the
``--prefix-caching-hash-algo`` function, by default ``sha256``
(``vllm/utils/hashing.py``: SHA-256 of ``pickle.dumps(obj,
protocol=pickle.HIGHEST_PROTOCOL)``); the first block's parent is
``NONE_HASH``, the hash of the seed string ``init_none_hash`` resolves
(``PYTHONHASHSEED`` when set, else ``"vllm-none-hash"`` for SHA-256);
``generate_block_hash_extra_keys`` puts ``("cache_salt", salt)`` into the
first block's extra keys only. Events carry
``maybe_convert_block_hash``'s int: the digest read big-endian, masked to its
low 64 bits (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default).

SGLang 0.5.23 (``sglang/srt/mem_cache/``): a page's hash is SHA-256 over the
previous page's digest (none for the first) and the page's token ids as
little-endian u32 (``cpp_utils/hash_binding.cpp`` ``hash_page``); a request
with a ``cache_salt`` starts its event chain from
``SHA-256(b"sglang-cache-salt-v1\\0" + salt)`` (``utils.py``
``compute_node_event_hash_values``), and an ``extra_key`` that names no LoRA
adapter changes no published hash (``events.py``
``KVCacheEventRecorder._namespace_seed``). Events carry
``hash_str_to_int64``'s int: the digest's first 8 bytes, signed. The radix
tree itself keeps ``extra_key`` namespaces apart (``RadixKey``), so the
simulator's cache keys such a block by ``(extra_key, hash)``.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from array import array
from dataclasses import dataclass
from typing import Hashable, Sequence

_U64 = (1 << 64) - 1
#: vLLM's ``DEFAULT_NONE_HASH_SEED`` (``kv_cache_utils.py``).
VLLM_NONE_HASH_SEED = "vllm-none-hash"
#: SGLang's salt chain tag (``compute_node_event_hash_values``).
SGLANG_SALT_TAG = b"sglang-cache-salt-v1\0"


@dataclass(frozen=True, slots=True)
class Chain:
    """The cache keys of the first ``tokens`` tokens of a sequence (full
    blocks only), and ``tail``, the last block's digest (``None`` before the
    first block), from which the chain goes on."""

    keys: list[Hashable]
    tail: bytes | None
    tokens: int


EMPTY = Chain([], None, 0)


def _vllm_sha256(obj: object) -> bytes:
    """vLLM's ``sha256`` (``vllm/utils/hashing.py``)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


class VLLMBlockHashes:
    """vLLM's block hashes (the default ``sha256`` algorithm).

    The seed is read once, at construction, as vLLM's ``init_none_hash``
    reads it at engine start: ``PYTHONHASHSEED`` when set, else
    :data:`VLLM_NONE_HASH_SEED`.
    """

    def __init__(self) -> None:
        self.none_hash = _vllm_sha256(os.environ.get("PYTHONHASHSEED", VLLM_NONE_HASH_SEED))

    def extend(self, chain: Chain, ids: Sequence[int], block: int, namespace: tuple[str | None, ...]) -> Chain:
        """``chain`` (of a prefix of ``ids``) carried over every full
        ``block``-token block of ``ids`` for a job of ``namespace``
        (``(cache_salt,)``): each block hashed with its parent's digest
        (``hash_block_tokens``), the first with ``("cache_salt", salt)`` in
        its extra keys (``generate_block_hash_extra_keys``; no salt for
        ``None`` or ``""``); its key the digest's low 64 bits, unsigned."""
        salt = namespace[-1] if namespace else None
        parent = chain.tail or self.none_hash
        keys = list(chain.keys)
        end = len(ids) // block * block
        for start in range(chain.tokens, end, block):
            extra = (("cache_salt", salt),) if start == 0 and salt else None
            parent = _vllm_sha256((parent, tuple(ids[start : start + block]), extra))
            keys.append(int.from_bytes(parent, "big") & _U64)
        return Chain(keys, parent if keys else None, max(end, chain.tokens))

    def keys(self, ids: Sequence[int], block: int, namespace: tuple[str | None, ...]) -> list[Hashable]:
        """The cache keys of the full blocks of ``ids`` (:meth:`extend` from
        the start): the published ints."""
        return self.extend(EMPTY, ids, block, namespace).keys

    @staticmethod
    def published(key: Hashable) -> int:
        """The ``block_hashes`` entry of a cache key: an unsigned 64-bit int."""
        return key  # type: ignore[return-value]


class SGLangPageHashes:
    """SGLang's page hashes, as its KV events publish them."""

    @staticmethod
    def extend(chain: Chain, ids: Sequence[int], page: int, namespace: tuple[str | None, ...]) -> Chain:
        """``chain`` (of a prefix of ``ids``) carried over every full
        ``page``-token page of ``ids`` for a job of ``namespace``
        (``(extra_key, cache_salt)``, ``None`` for an absent one): each page
        SHA-256 over the previous digest and its ids as little-endian u32
        (``hash_page``), a ``cache_salt`` seeding the chain; its key the
        digest's first 8 bytes, signed, paired with the ``extra_key`` when
        there is one (the radix tree keeps it apart; its events do not).

        Raises:
            OverflowError: a token id outside u32 (SGLang's ``checked_u32``
                refuses it too).
        """
        extra_key, salt = namespace if namespace else (None, None)
        prior = chain.tail
        if prior is None:
            prior = b"" if salt is None else hashlib.sha256(SGLANG_SALT_TAG + salt.encode("utf-8")).digest()
        end = len(ids) // page * page
        words = array("I", ids[chain.tokens : end])
        if sys.byteorder != "little":
            words.byteswap()
        raw, step, sha256 = memoryview(words.tobytes()), 4 * page, hashlib.sha256
        keys = list(chain.keys)
        for start in range(0, len(raw), step):
            prior = sha256(prior + raw[start : start + step]).digest()
            key = int.from_bytes(prior[:8], "big", signed=True)
            keys.append(key if extra_key is None else (extra_key, key))
        return Chain(keys, prior if keys else None, max(end, chain.tokens))

    def keys(self, ids: Sequence[int], page: int, namespace: tuple[str | None, ...]) -> list[Hashable]:
        """The cache keys of the full pages of ``ids`` (:meth:`extend` from
        the start)."""
        return self.extend(EMPTY, ids, page, namespace).keys

    @staticmethod
    def published(key: Hashable) -> int:
        """The ``block_hashes`` entry of a cache key: a signed 64-bit int."""
        return key[1] if isinstance(key, tuple) else key  # type: ignore[return-value,index]


BlockHasher = VLLMBlockHashes | SGLangPageHashes


def block_hasher(protocol: str) -> BlockHasher:
    """The hasher of the engine ``protocol`` (``"vllm"`` or ``"sglang"``)."""
    return VLLMBlockHashes() if protocol == "vllm" else SGLangPageHashes()
