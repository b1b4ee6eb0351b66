"""asgi-generate: a protocol-level ASGI frontend for LLM engines' native
generate APIs (see DESIGN.md in the project's shared folder and README.md)."""

__version__ = "0.1.0"
