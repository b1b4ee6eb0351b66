"""The one thing setup.cfg cannot declare: the hash chains' optional C
accelerator, asgi_generate/hashes/_native.c (the replay block hash chain over
the vendored xxhash.h, the KV index's block keys and mask loops, the kv-aware
policy's cost loop and rendezvous hash).

``optional=True``: where it does not build (no C compiler, no Python
headers), setuptools warns and the install goes on without it; the package
then hashes in pure Python (asgi_generate/hashes/_python.py, the same
values) and ``asgi-generate check`` and ``/stats`` say which path is in use.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "asgi_generate.hashes._native",
            sources=["asgi_generate/hashes/_native.c"],
            include_dirs=["asgi_generate/_vendor/xxhash"],
            depends=["asgi_generate/_vendor/xxhash/xxhash.h"],
            optional=True,
        ),
    ]
)
