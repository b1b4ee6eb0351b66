"""asgi-generate: a protocol-level ASGI frontend for LLM engines' native
generate APIs (README.md says what it serves and how to run it; docs/ says
how each part works)."""

__version__ = "0.1.0"
