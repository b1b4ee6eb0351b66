"""The one thing setup.cfg cannot declare: the C extensions (the replay block
hash chain, asgi_generate/tracing/_hashchain.c, over the vendored xxhash.h;
the KV index's block hashes and prefix walk, asgi_generate/workers/_blockhash.c)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "asgi_generate.tracing._hashchain",
            sources=["asgi_generate/tracing/_hashchain.c"],
            include_dirs=["asgi_generate/_vendor/xxhash"],
            depends=["asgi_generate/_vendor/xxhash/xxhash.h"],
        ),
        Extension("asgi_generate.workers._blockhash", sources=["asgi_generate/workers/_blockhash.c"]),
    ]
)
