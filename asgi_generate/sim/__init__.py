"""The engine simulator: real HTTP worker processes that speak the engines'
native protocols with deterministic output (``asgi-generate sim``)."""
