"""SGLang's native ``/generate`` format as an asgi-generate codec."""

from .codec import SGLangCodec

__all__ = ["SGLangCodec"]
