"""vLLM's native ``/inference/v1/generate`` format as an asgi-generate codec."""

from .codec import VLLMCodec

__all__ = ["VLLMCodec"]
