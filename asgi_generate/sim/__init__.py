"""The engine simulator: real HTTP worker processes that speak the engines'
native protocols with deterministic output (``asgi-generate sim``).

It is the tests' oracle, so it imports nothing of the frontend it judges
(an import-linter contract in pyproject.toml): its HTTP framing
(:mod:`.framing`), block hashes (:mod:`.block_hash`), lax reading of JSON
values (:mod:`.lax`) and record of vLLM versions (:mod:`.versions`) are its
own, written from the engines' released sources; only the bundled tokenizer
data (``asgi_generate.assets``) is shared."""
