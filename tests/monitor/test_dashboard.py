"""The shipped Grafana files are what the generator writes, and every dashboard query
uses only metrics the catalog defines (the e2e test runs them against Prometheus)."""

import json
import re

import pytest

from trainforge.monitor.catalog import CATALOG

from .helpers import REPO

DEPLOY = REPO / "deploy"


def test_shipped_files_are_generated_from_code():
    pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk (dev extra) not installed")
    from trainforge.monitor.dashboard import files

    for rel, text in files().items():
        assert (DEPLOY / rel).read_text() == text, f"regenerate: python -m trainforge.monitor.dashboard deploy ({rel})"


def test_every_query_uses_catalog_metrics_and_every_level_has_a_row():
    board = json.loads((DEPLOY / "grafana" / "dashboards" / "trainforge.json").read_text())
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["System metrics", "Framework metrics", "Model metrics", "Serving (trainforge serve)"]
    known = {s.name for s in CATALOG}
    known |= {s.name + suffix for s in CATALOG if s.kind == "histogram" for suffix in ("_bucket", "_sum", "_count")}
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len(panels) >= 20 and len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            names = set(re.findall(r"trainforge_[a-z0-9_]+", t["expr"]))
            assert names and names <= known, (p["title"], names - known)
            assert '{job=~"$run",rank=~"$rank"}' in t["expr"]  # every query filters by run and rank
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "run", "rank"}
