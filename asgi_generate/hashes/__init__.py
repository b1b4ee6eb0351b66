"""The hash chains the replay records and the KV index are keyed by, in C
when the optional accelerator is built, else in pure Python: the same
values either way.

- the replay chain (:func:`chain`, :func:`chain_json`): XXH3-64 over blocks
  of packed ``u32`` token ids, chained (tracing/hashing.py says the scheme);
- the KV index's block keys (:func:`kv_chain`: ``hash((parent, *tokens))``
  per full block) and its mask loops (:func:`mask_walk`, :func:`mask_set`,
  :func:`mask_drop`, :func:`mask_remove`, :func:`mask_missing`,
  :func:`expire`; workers/kv_index.py says what they are for);
- the ``kv-aware`` policy's per-worker loops: its costs and their ties
  (:func:`kv_lowest`) and its rendezvous tie-break (:func:`rendezvous`,
  XXH3; workers/policies/kv_aware.py says what they are for).

:data:`ACCELERATED` says which path is in use: ``asgi_generate.hashes._native``
(``_native.c``, which ``pip install`` builds when a C compiler is there) or
:mod:`._python` (over the PyPI ``xxhash``). ``asgi-generate check`` and
``/stats`` report it as ``hash_accelerator``.
"""

from __future__ import annotations

from ._python import SEED

try:
    from . import _native as _impl
except ImportError:  # built without a C compiler (setup.py's optional extension)
    from . import _python as _impl

#: Whether the C accelerator is in use.
ACCELERATED: bool = _impl.__name__.endswith("._native")

chain = _impl.chain
chain_json = _impl.chain_json
kv_chain = _impl.kv_chain
expire = _impl.expire
mask_walk = _impl.mask_walk
mask_set = _impl.mask_set
mask_drop = _impl.mask_drop
mask_remove = _impl.mask_remove
mask_missing = _impl.mask_missing
rendezvous = _impl.rendezvous
kv_lowest = _impl.kv_lowest

__all__ = ["ACCELERATED", "SEED", "chain", "chain_json", "kv_chain", "expire", "mask_walk", "mask_set", "mask_drop",
           "mask_remove", "mask_missing", "rendezvous", "kv_lowest"]
