"""Loading the installed codecs, with none installed (the registry through
the CLI, with throwaway codec distributions: tests/e2e/test_registry.py)."""

from __future__ import annotations

import pytest


def test_no_codec_to_serve_is_refused(monkeypatch):
    from asgi_generate.exceptions import CodecLoadError
    from asgi_generate.sdk import _registry as registry
    from asgi_generate.protocols import PROTOCOLS

    # Codecs and engines are found by one lister (protocols.plugin_entry_points).
    monkeypatch.setattr("asgi_generate.protocols.entry_points", lambda group: [])
    with pytest.raises(CodecLoadError) as exc:
        registry.load_codecs(protocols=PROTOCOLS)
    assert str(exc.value) == "no codec to serve: none is installed in the entry point group asgi_generate.codecs"
