"""SGLang's native ``/generate`` format, zstd-compressed, as an asgi-generate
codec (entry point ``zstd`` in the ``asgi_generate.codecs`` group)."""

from .client import decode_body, decode_event, encode_request
from .codec import ZstdCodec

__all__ = ["ZstdCodec", "decode_body", "decode_event", "encode_request"]
