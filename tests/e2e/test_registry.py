"""The codec registry, through the ``asgi-generate codecs`` and ``serve``
commands, with throwaway codec distributions.

Each throwaway distribution is laid out in a temporary folder the way an
installer leaves one (a module and a ``<name>-<version>.dist-info`` with
``METADATA`` and ``entry_points.txt``) and reaches only the subprocesses
through ``PYTHONPATH``: nothing is installed, and a module fixture checks
that the environment is as it was.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import httpx
import pytest

from asgi_generate.protocols import PROTOCOLS
from support import start_frontend

pytestmark = pytest.mark.e2e

SGLANG = importlib.metadata.distribution("asgi-generate-sglang")
SGLANG_DESC = f"'sglang' (asgi-generate-sglang {SGLANG.version}, asgi_generate_sglang.codec:SGLangCodec)"
HINT = "asgi-generate: start with --skip-broken-codecs to serve without the codecs that failed to load\n"
HEADER = ["NAME", "ROUTES", "WORKER PROTOCOL", "DISTRIBUTION", "VERSION"]


def environment_snapshot() -> tuple:
    """What a fresh interpreter of this venv sees installed, with the codec
    entry points, plus this process's environment and path."""
    script = (
        "import importlib.metadata as m, json; print(json.dumps(["
        "sorted([d.metadata['Name'], d.version, str(d._path)] for d in m.distributions()),"
        "sorted([e.name, e.value] for e in m.entry_points(group='asgi_generate.codecs'))]))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True)
    environ = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's own, per phase
    return out.stdout, environ, list(sys.path)


@pytest.fixture(scope="module", autouse=True)
def environment_untouched():
    before = environment_snapshot()
    yield
    assert environment_snapshot() == before


def make_dist(root: pathlib.Path, name: str, version: str, module: str, source: str, eps: dict[str, str],
              group: str = "asgi_generate.codecs") -> None:
    """Lay out distribution ``name`` ``version`` with module ``module`` and
    entry points ``eps`` (name -> ``module:attr``) of ``group`` in ``root``."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{k} = {v}\n" for k, v in eps.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")


def env_with(path: pathlib.Path) -> dict[str, str]:
    existing = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(path) + (os.pathsep + existing if existing else "")}


def cli(path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """Run ``asgi-generate ARGS`` with ``path`` on ``PYTHONPATH``."""
    return subprocess.run(
        [sys.executable, "-m", "asgi_generate", *args],
        capture_output=True, text=True, timeout=30, env=env_with(path), stdin=subprocess.DEVNULL,
    )


def serve(path: pathlib.Path, sim_url: str, *extra: str) -> subprocess.CompletedProcess:
    """``asgi-generate serve`` that is expected to refuse to start."""
    return cli(path, "serve", "--host", "127.0.0.1", "--port", "0", "--worker", f"sglang={sim_url}",
               "--log-level", "warning", *extra)


def table(stdout: str) -> list[list[str]]:
    return [re.split(r"\s{2,}", line) for line in stdout.splitlines()]


THROWAWAY = """
    from asgi_generate.sdk._codec import Route
    from asgi_generate_sglang import SGLangCodec


    class ThrowawayCodec(SGLangCodec):
        name = "throwaway"
        routes = (Route("POST", "/throwaway/generate"),)
"""


def test_a_codec_installed_from_its_own_distribution_is_discovered_and_served(tmp_path, sims, monkeypatch):
    make_dist(tmp_path, "throwaway-codec", "9.8.7", "throwaway_codec", THROWAWAY,
              {"throwaway": "throwaway_codec:ThrowawayCodec"})
    listed = cli(tmp_path, "codecs")
    assert (listed.returncode, listed.stderr) == (0, "")
    rows = table(listed.stdout)
    assert rows[0] == HEADER
    assert ["throwaway", "POST /throwaway/generate", "sglang", "throwaway-codec", "9.8.7"] in rows
    assert ["sglang", "POST /generate, PUT /generate", "sglang", "asgi-generate-sglang", SGLANG.version] in rows
    assert [row[0] for row in rows[1:]] == sorted(row[0] for row in rows[1:])

    monkeypatch.setenv("PYTHONPATH", env_with(tmp_path)["PYTHONPATH"])
    frontend = start_frontend([f"sglang={sims[0].url}"], extra=["--log-level", "info"])
    try:
        monkeypatch.undo()
        resp = httpx.post(frontend.url + "/throwaway/generate", timeout=30,
                          json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}, "rid": "t-1"})
        assert resp.status_code == 200
        assert (resp.json()["meta_info"]["id"], len(resp.json()["output_ids"])) == ("t-1", 3)
        formats = httpx.get(frontend.url + "/v1/models", timeout=10).json()["formats"]
        assert {"name": "throwaway", "routes": ["POST /throwaway/generate"], "worker_protocol": "sglang",
                "distribution": "throwaway-codec", "version": "9.8.7"} in formats
        logged = "codec throwaway from throwaway-codec 9.8.7: POST /throwaway/generate, on sglang workers"
        assert logged in frontend.log()
    finally:
        frontend.stop()


def test_two_codecs_on_one_route_never_start_together(tmp_path, sims):
    make_dist(tmp_path, "throwaway-clash", "1.0", "throwaway_clash", """
        from asgi_generate.sdk._codec import Route
        from asgi_generate_sglang import SGLangCodec


        class Clash(SGLangCodec):
            name = "clash"
            routes = (Route("POST", "/generate"),)
    """, {"clash": "throwaway_clash:Clash"})
    message = (
        f"asgi-generate: codecs 'clash' (throwaway-clash 1.0, throwaway_clash:Clash) and {SGLANG_DESC} "
        "both serve POST /generate\n"
    )
    listed = cli(tmp_path, "codecs")
    assert (listed.returncode, listed.stderr) == (2, message)
    assert ["clash", "POST /generate", "sglang", "throwaway-clash", "1.0"] in table(listed.stdout)
    for extra in ((), ("--skip-broken-codecs",)):  # a collision is not a broken codec
        refused = serve(tmp_path, sims[0].url, *extra)
        assert (refused.returncode, refused.stdout, refused.stderr) == (2, "", message)


def test_two_codecs_with_one_name_never_start_together(tmp_path, sims):
    make_dist(tmp_path, "throwaway-twin", "2.0", "throwaway_twin", """
        from asgi_generate.sdk._codec import Route
        from asgi_generate_sglang import SGLangCodec


        class Twin(SGLangCodec):
            routes = (Route("POST", "/twin/generate"),)
    """, {"sglang": "throwaway_twin:Twin"})
    message = (
        f"asgi-generate: codecs {SGLANG_DESC} and 'sglang' (throwaway-twin 2.0, throwaway_twin:Twin) "
        "both use the name 'sglang'\n"
    )
    listed = cli(tmp_path, "codecs")
    assert (listed.returncode, listed.stderr) == (2, message)
    refused = serve(tmp_path, sims[0].url)
    assert (refused.returncode, refused.stdout, refused.stderr) == (2, "", message)


BROKEN = "asgi-generate: codec 'broken' (throwaway-broken 0.0.1, throwaway_broken:Broken) failed to load: " \
         "ImportError: throwaway_broken needs libfoo\n"


def test_a_codec_that_fails_to_import_is_named_and_stops_serve_unless_skipped(tmp_path, sims, monkeypatch):
    make_dist(tmp_path, "throwaway-broken", "0.0.1", "throwaway_broken",
              'raise ImportError("throwaway_broken needs libfoo")\n', {"broken": "throwaway_broken:Broken"})
    listed = cli(tmp_path, "codecs")
    assert (listed.returncode, listed.stderr) == (2, BROKEN)
    assert "broken" not in [row[0] for row in table(listed.stdout)]
    assert ["sglang", "POST /generate, PUT /generate", "sglang", "asgi-generate-sglang", SGLANG.version] in table(
        listed.stdout
    )
    refused = serve(tmp_path, sims[0].url)
    assert (refused.returncode, refused.stdout, refused.stderr) == (2, "", BROKEN + HINT)

    monkeypatch.setenv("PYTHONPATH", env_with(tmp_path)["PYTHONPATH"])
    frontend = start_frontend([f"sglang={sims[0].url}"], extra=["--skip-broken-codecs"])
    try:
        monkeypatch.undo()
        skipped = BROKEN.removeprefix("asgi-generate: ").rstrip("\n") + "; skipped (--skip-broken-codecs)"
        assert f"ERROR asgi_generate.sdk._registry: {skipped}" in frontend.log()
        names = [f["name"] for f in httpx.get(frontend.url + "/v1/models", timeout=10).json()["formats"]]
        assert "broken" not in names and "sglang" in names
        resp = httpx.post(frontend.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}},
                          timeout=30)
        assert (resp.status_code, len(resp.json()["output_ids"])) == (200, 2)
    finally:
        frontend.stop()


def test_every_codec_that_declares_itself_wrongly_is_named_with_its_reason(tmp_path):
    make_dist(tmp_path, "throwaway-bad", "3.1", "throwaway_bad", """
        import sys

        from asgi_generate.sdk._codec import Route
        from asgi_generate_sglang import SGLangCodec


        def not_a_codec():
            return 42


        def exits():
            sys.exit(3)


        class Renamed(SGLangCodec):
            name = "othername"
            routes = (Route("POST", "/renamed"),)


        class Grpc(SGLangCodec):
            name = "grpc"
            worker_protocol = "grpc"
            routes = (Route("POST", "/grpc"),)


        class Health(SGLangCodec):
            name = "health"
            routes = (Route("GET", "/health"),)


        class Lower(SGLangCodec):
            name = "lower"
            routes = (Route("post", "/lower"),)


        class Twice(SGLangCodec):
            name = "twice"
            routes = (Route("POST", "/twice"), Route("POST", "/twice"))


        class Routeless(SGLangCodec):
            name = "routeless"
            routes = ()
    """, {
        "missing": "throwaway_bad:Missing",
        "notcodec": "throwaway_bad:not_a_codec",
        "exits": "throwaway_bad:exits",
        "renamed": "throwaway_bad:Renamed",
        "grpc": "throwaway_bad:Grpc",
        "health": "throwaway_bad:Health",
        "lower": "throwaway_bad:Lower",
        "twice": "throwaway_bad:Twice",
        "routeless": "throwaway_bad:Routeless",
    })
    reasons = {
        "exits": "SystemExit: 3",
        "grpc": f"ValueError: unknown worker protocol 'grpc' (known: {', '.join(sorted(PROTOCOLS))})",
        "health": "ValueError: route GET /health: the frontend serves /health itself",
        "lower": "ValueError: route post /lower: the method must be upper-case letters",
        "missing": "AttributeError: module 'throwaway_bad' has no attribute 'Missing'",
        "notcodec": "TypeError: throwaway_bad:not_a_codec gave a int, not an asgi_generate.sdk.Codec",
        "renamed": "ValueError: the codec is named 'othername'; its entry point must carry the same name",
        "routeless": "ValueError: the codec declares no routes",
        "twice": "ValueError: route POST /twice is declared twice",
    }
    targets = {"exits": "exits", "missing": "Missing", "notcodec": "not_a_codec"}
    expected = "".join(
        f"asgi-generate: codec {name!r} (throwaway-bad 3.1, throwaway_bad:{targets.get(name, name.capitalize())}) "
        f"failed to load: {reason}\n"
        for name, reason in sorted(reasons.items())
    )
    listed = cli(tmp_path, "codecs")
    assert (listed.returncode, listed.stderr) == (2, expected)


ENGINES = "asgi_generate.engines"


def test_an_engine_that_fails_to_load_or_is_no_engine_is_named_with_its_reason(tmp_path):
    make_dist(tmp_path, "throwaway-engines", "2.0", "throwaway_engines", """
        from asgi_generate.protocols import WorkerProtocol


        def broken():
            raise RuntimeError("no such engine")


        NOT_ONE = 42
        RENAMED = WorkerProtocol("othername", b"/health", None, b"/abort", dict, "ids")
    """, {"broken": "throwaway_engines:broken", "notone": "throwaway_engines:NOT_ONE",
          "renamed": "throwaway_engines:RENAMED"}, group=ENGINES)
    where = "(throwaway-engines 2.0, throwaway_engines:{})"
    for command in (["codecs"], ["serve", "--host", "127.0.0.1", "--port", "0", "--worker",
                                 "sglang=http://127.0.0.1:9"]):
        done = cli(tmp_path, *command)
        assert done.returncode == 2
        assert done.stdout == ""
        assert done.stderr == (
            f"asgi-generate: engine 'broken' {where.format('broken')} failed to load: RuntimeError: no such engine\n"
            f"asgi-generate: engine 'notone' {where.format('NOT_ONE')} failed to load: TypeError: "
            "throwaway_engines:NOT_ONE gave a int, not an asgi_generate.protocols.WorkerProtocol\n"
            f"asgi-generate: engine 'renamed' {where.format('RENAMED')} failed to load: ValueError: "
            "the engine is named 'othername'; its entry point must carry the same name\n"
        )


def test_two_engines_with_one_name_are_both_named(tmp_path):
    make_dist(tmp_path, "asgi-generate-again", "1.0", "again_engine", """
        from asgi_generate_sglang.engine import ENGINE
    """, {"sglang": "again_engine:ENGINE"}, group=ENGINES)
    sglang = f"'sglang' (asgi-generate-sglang {SGLANG.version}, asgi_generate_sglang.engine:ENGINE)"
    done = cli(tmp_path, "codecs")
    assert done.returncode == 2
    assert done.stderr == ("asgi-generate: engines 'sglang' (asgi-generate-again 1.0, again_engine:ENGINE) and "
                           f"{sglang} both use the name 'sglang'\n")
