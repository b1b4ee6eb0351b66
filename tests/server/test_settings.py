"""Every setting is declared once (asgi_generate/config.py) and every view of
it comes from that declaration: the serve flags, the variables, the settings
table of the configuration reference (docs/configuration.md)."""

from __future__ import annotations

import pathlib

import pytest

from asgi_generate.config import SETTINGS, Settings, settings_table
from asgi_generate.server.cli import _settings, build_parser
from asgi_generate.worker_specs import parse_worker_spec

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_configuration_references_settings_table_is_the_generated_one():
    """After adding or changing a setting, run ``python docs/settings_table.py``:
    it writes the table into the page."""
    text = PAGE.read_text()
    start = text.index("| variable | flag | default | what |")
    end = text.index("\n<!-- end of the generated settings table -->", start)
    assert text[start:end] == settings_table()


#: A list setting's sample value, where its items are not worker specs.
ITEMS = {"kv_events": "http://127.0.0.1:9=tcp://127.0.0.1:5557+tcp://127.0.0.1:5558,http://127.0.0.1:10=tcp://h:1"}


def _changed() -> Settings:
    """Settings in which every setting differs from its default."""
    d, values = Settings(), {}
    for s in SETTINGS.values():
        value = getattr(d, s.name)
        if s.item is not None:
            value = s.parse(ITEMS.get(s.name, "sglang=http://127.0.0.1:9,sglang=http://127.0.0.1:10"), s.env)
        elif s.kind is bool:
            value = not value
        elif s.choices:
            value = s.choices[-1] if value == s.choices[0] else s.choices[0]
        elif s.kind in (int, float):
            value = s.kind(value + 1) if s.le is None else s.kind(s.le)
        else:
            value = f"{value or ''}x"
        values[s.name] = value
    return Settings(**values)


def _flags(settings: Settings) -> list[str]:
    """The serve flags that give ``settings``, from each setting's declaration."""
    argv = []
    for s in SETTINGS.values():
        value = getattr(settings, s.name)
        if s.item is not None:
            for item in value:
                argv += [s.flags[0], s.item_text(item)]
        elif s.kind is bool:
            argv.append(s.flags[0] if value else f"--no-{s.flags[0][2:]}")
        elif value is not None:
            argv += [s.flags[0], s.text(value)]
    return argv


def test_every_setting_has_a_flag_and_a_variable_that_give_it():
    changed = _changed()
    assert all(getattr(changed, name) != getattr(Settings(), name) for name in SETTINGS)
    assert Settings.from_env(changed.to_env()) == changed
    args = build_parser().parse_args(["serve", *_flags(changed)])
    assert _settings(args, Settings()) == changed


def test_the_variables_are_serves_defaults_and_its_flags_win():
    env = Settings.from_env({"ASGI_GENERATE_WORKERS": "sglang=http://127.0.0.1:9",
                             "ASGI_GENERATE_HEALTH_FAILURES": "5", "ASGI_GENERATE_TRACE_STDERR": "1"})
    args = build_parser(env).parse_args(["serve", "--health-failures", "6"])
    got = _settings(args, env)
    assert (got.workers, got.health_failures, got.trace_stderr) == ([("sglang", "http://127.0.0.1:9")], 6, True)
    args = build_parser(env).parse_args(["serve", "--worker", "vllm=http://127.0.0.1:10", "--no-trace-stderr"])
    got = _settings(args, env)
    assert (got.workers, got.trace_stderr) == ([("vllm", "http://127.0.0.1:10")], False)


@pytest.mark.parametrize("spec,error", [
    ("sglang", "worker 'sglang': expected PROTOCOL=http://HOST:PORT"),
    ("tgi=http://h:1", "worker 'tgi=http://h:1': unknown protocol 'tgi' (known: sglang, vllm)"),
    ("sglang=ftp://h:1", "worker 'sglang=ftp://h:1': expected an http(s)://HOST:PORT or dns://NAME:PORT URL"),
    ("sglang=http://h", "worker 'sglang=http://h': expected an http(s)://HOST:PORT or dns://NAME:PORT URL"),
])
def test_bad_worker_specs(spec, error):
    with pytest.raises(ValueError) as exc:
        parse_worker_spec(spec)
    assert str(exc.value) == error


def test_settings_round_trip_through_the_environment():
    s = Settings(workers=[("sglang", "http://127.0.0.1:9"), ("sglang", "http://127.0.0.1:10")],
                 max_body_bytes=1234, inter_token_timeout=7.5, request_timeout=600.0,
                 health_failures=5, skip_broken_codecs=True)
    assert Settings.from_env(s.to_env()) == s
    assert Settings.from_env({}) == Settings()
    # The old name of the inter-token timeout still works; the new one wins.
    assert Settings.from_env({"ASGI_GENERATE_READ_TIMEOUT": "9"}).inter_token_timeout == 9.0
    both = {"ASGI_GENERATE_READ_TIMEOUT": "9", "ASGI_GENERATE_INTER_TOKEN_TIMEOUT": "4"}
    assert Settings.from_env(both).inter_token_timeout == 4.0
    with pytest.raises(ValueError) as exc:
        Settings.from_env({"ASGI_GENERATE_READ_TIMEOUT": "soon"})
    assert str(exc.value) == "ASGI_GENERATE_READ_TIMEOUT='soon' is not a number"
