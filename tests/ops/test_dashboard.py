"""The Grafana dashboard in docs/grafana/ names only what /metrics exports:
every panel's query names metrics the frontend registers (a histogram by
its ``_bucket``, a counter by its ``_total``), grouped only by labels those
metrics carry."""

from __future__ import annotations

import json
import pathlib
import re

import prometheus_client

from asgi_generate.ops.metrics import Metrics

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "grafana" / "asgi-generate.json"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported() -> dict[str, set[str]]:
    """Every sample name the frontend's metrics render, with its labels."""
    metrics = Metrics()
    names: dict[str, set[str]] = {}
    for value in vars(metrics).values():
        if isinstance(value, prometheus_client.metrics.MetricWrapperBase):
            for suffix in SUFFIXES[value._type]:
                names[value._name + suffix] = {*value._labelnames, *(("le",) if suffix == "_bucket" else ())}
    return names


def targets() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(panel["title"], t["expr"]) for panel in board["panels"] for t in panel.get("targets", ())]


def test_every_panel_names_an_exported_metric_and_its_labels():
    names = exported()
    found = targets()
    assert len(found) >= 20
    for title, expr in found:
        used = re.findall(r"\basgi_generate_\w+", expr)
        assert used, title
        labels = set()
        for name in used:
            assert name in names, f"{title}: {name} is not exported"
            labels |= names[name]
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            for label in map(str.strip, group.split(",")):
                assert label in labels, f"{title}: {label} is not a label of {used}"


def test_the_dashboard_shows_each_area():
    titles = {panel["title"] for panel in json.loads(DASHBOARD.read_text())["panels"] if panel["type"] == "row"}
    assert titles == {"Traffic", "Latency", "Engines", "Admission", "Sheds"}
    board = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    exprs = " ".join(e for _, e in targets())
    for shown in ("admission_shed_total", "admission_tenant_shed_total", "admission_waiting_requests",
                  "engine_requests", "time_to_first_token_seconds_bucket"):
        assert "asgi_generate_" + shown in exprs
