"""The codec guide (docs/writing-a-codec.md) builds a package that works.

The guide's own code blocks titled with a path (``title="PATH"``) are
written out as a package in a temporary folder, with the
``<name>-<version>.dist-info`` an installer would make from the guide's
``pyproject.toml`` (name, version and its ``asgi_generate.codecs`` entry
points), and reach the frontend process through ``PYTHONPATH``: nothing is
installed. The frontend then serves the guide's codec, so the guide cannot
drift from the codec API.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import httpx
import orjson
import pytest

from asgi_generate.sdk._codec import RequestError
from asgi_generate_sglang import SGLangCodec
from support import post, sse, start_frontend

GUIDE = pathlib.Path(__file__).parents[2] / "docs" / "writing-a-codec.md"
BLOCK = re.compile(r'^```(\w+)(?: title="(\S+)")?\n(.*?)^```$', re.S | re.M)


def guide_blocks() -> list[tuple[str, str | None, str]]:
    """``(language, file or None, text)`` of every fenced block in the guide."""
    return [(m[1], m[2], m[3]) for m in BLOCK.finditer(GUIDE.read_text())]


def build_package(root: pathlib.Path) -> dict:
    """Write the guide's files under ``root`` plus the dist-info its
    pyproject describes; return the parsed pyproject."""
    files = {path: text for _, path, text in guide_blocks() if path}
    assert set(files) == {"pyproject.toml", "asgi_generate_ids/__init__.py", "asgi_generate_ids/codec.py"}
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    project = tomllib.loads(files["pyproject.toml"])["project"]
    info = root / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items())
        for group, eps in project["entry-points"].items()))
    return project


def test_every_python_block_of_the_guide_compiles():
    blocks = [(path, text) for lang, path, text in guide_blocks() if lang == "python"]
    assert len(blocks) >= 3
    for path, text in blocks:
        compile(text, path or "<guide>", "exec")


@pytest.fixture(scope="module")
def ids_frontend(tmp_path_factory, sims):
    root = tmp_path_factory.mktemp("asgi-generate-ids")
    project = build_package(root)
    assert project["entry-points"] == {"asgi_generate.codecs": {"ids": "asgi_generate_ids.codec:IdsCodec"}}
    listed = subprocess.run([sys.executable, "-m", "asgi_generate", "codecs"], capture_output=True, text=True,
                            timeout=30, env={**os.environ, "PYTHONPATH": str(root)})
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^ids\s+POST /ids/generate\s+sglang\s+asgi-generate-ids\s+0\.1\.0$", listed.stdout, re.M)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(root))
        frontend = start_frontend([f"sglang={s.url}" for s in sims])
    yield frontend
    frontend.stop()


REQUEST = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}


@pytest.mark.e2e
def test_the_guide_codec_answers_unary_with_the_engines_token_ids(ids_frontend):
    direct = post(ids_frontend.url, REQUEST).json()
    resp = post(ids_frontend.url, REQUEST, path="/ids/generate")
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/json"
    assert resp.json() == {"output_ids": direct["output_ids"], "finish_reason": "length"}
    assert len(direct["output_ids"]) == 5


@pytest.mark.e2e
def test_the_guide_codec_streams_one_event_per_engine_event(ids_frontend):
    direct = post(ids_frontend.url, REQUEST).json()
    status, events = sse(ids_frontend.url, {**REQUEST, "stream": True}, path="/ids/generate")
    assert status == 200 and events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert [c["token_ids"] for c in chunks] == [[t] for t in direct["output_ids"]]
    assert [c["finish_reason"] for c in chunks] == [None] * 4 + ["length"]


@pytest.mark.e2e
def test_the_guide_codec_refuses_in_its_own_error_shape(ids_frontend):
    body = {"sampling_params": {"max_new_tokens": 5}}  # no input
    with pytest.raises(RequestError) as refused:
        SGLangCodec().decode(orjson.dumps(body), {b"content-type": b"application/json"})
    resp = post(ids_frontend.url, body, path="/ids/generate")
    assert resp.status_code == refused.value.status
    assert resp.json() == {"error": {"message": refused.value.message, "code": refused.value.status}}
    assert httpx.get(ids_frontend.url + "/ids/generate", timeout=10).status_code == 405
