"""The one thing setup.cfg cannot declare: the C extension (the replay block
hash chain, asgi_generate/tracing/_hashchain.c, over the vendored xxhash.h)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "asgi_generate.tracing._hashchain",
            sources=["asgi_generate/tracing/_hashchain.c"],
            include_dirs=["asgi_generate/_vendor/xxhash"],
            depends=["asgi_generate/_vendor/xxhash/xxhash.h"],
        )
    ]
)
