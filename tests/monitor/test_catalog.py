"""The metric table: enough metrics on every level, names Prometheus accepts
(promtool), and docs/metrics.md generated from it."""

import re

import pytest

from trainforge.monitor.catalog import CATALOG, UNKNOWN_NAME, lookup, markdown_table
from trainforge.monitor.registry import Registry
from trainforge.monitor.sinks import RegistryCollector

from .helpers import REPO, find_tool, missing_tool_reason, promtool_check


def test_at_least_24_metrics_on_three_levels_with_units_and_help():
    names = [s.name for s in CATALOG]
    assert len(set(names)) == len(names) >= 24
    for level in ("system", "framework", "model"):
        assert sum(s.level == level for s in CATALOG) >= 8, level
    for s in CATALOG:
        assert re.fullmatch(r"trainforge_[a-z0-9_]+", s.name), s.name
        assert s.help and s.unit, s.name
        assert s.name.endswith("_total") == (s.kind == "counter"), s.name
        if s.unit == "seconds":
            assert s.name.endswith(("_seconds", "_seconds_total")), s.name
        if s.unit == "bytes":
            assert "_bytes" in s.name, s.name


def test_keys_of_other_features_map_to_typed_metrics():
    # Keys the precision, data-pipeline and training-control branches put into records.
    for key, name, labels in [("mem_optimizer_state_fp32_bytes", "trainforge_memory_bytes",
                               {"category": "optimizer_state", "dtype": "fp32"}),
                              ("data_bytes_disk", "trainforge_data_cache_read_bytes_total", {"tier": "disk"}),
                              ("data_hit_rate_memory", "trainforge_data_cache_hit_ratio", {"tier": "memory"}),
                              ("loss_scale", "trainforge_loss_scale", {}),
                              ("skipped_steps", "trainforge_skipped_steps_total", {})]:
        spec, captured = lookup(key)
        assert spec is not None and spec.name == name and captured == labels, key
    assert lookup("something_new") == (None, {})


def test_docs_table_is_generated_from_the_catalog():
    assert (REPO / "docs" / "metrics.md").read_text() == markdown_table(), \
        "regenerate: python -m trainforge.monitor.catalog > docs/metrics.md"
    for s in CATALOG:
        assert f"`{s.name}`" in markdown_table()


def exposition_of_every_metric() -> str:
    """Feed every catalog entry one plausible value and render the registry."""
    from prometheus_client import CollectorRegistry, generate_latest

    reg = Registry(rank=0)
    record = {"some_new_key": 1.5}
    for s in CATALOG:
        # One example key per pattern spec: a new pattern without one fails here by name.
        examples = {"data_hit_rate_(?P<tier>[a-z]+)": "data_hit_rate_memory", "data_bytes_(?P<tier>[a-z]+)": "data_bytes_disk",
                    r"http_requests (?P<path>\S+) (?P<status>\d+)": "http_requests /v1/completions 200",
                    r"mem_(?P<category>[a-z_]+)_(?P<dtype>[a-z]+[0-9][a-z0-9]*)_bytes": "mem_params_bf16_bytes",
                    r"mtp_loss_(?P<depth>[0-9]+)": "mtp_loss_1", r"val_mtp_loss_(?P<depth>[0-9]+)": "val_mtp_loss_1"}
        key = examples[s.key] if s.pattern else s.key
        if s.encode == "dtype_bytes":
            record[key] = {"layers.0": "bf16"}
        elif s.labels and not s.pattern:
            record[key] = {"a": 1.0}
        else:
            record[key] = 1.0
    reg.ingest(record, window=1)
    assert {f.name for f in reg.families()} == {s.name for s in CATALOG} | {UNKNOWN_NAME}
    cr = CollectorRegistry(auto_describe=False)
    cr.register(RegistryCollector(reg))
    return generate_latest(cr).decode()


def test_exposition_of_every_metric_passes_promtool():
    if find_tool("promtool") is None:
        pytest.skip(missing_tool_reason("promtool"))
    text = exposition_of_every_metric()
    result = promtool_check(text)
    assert result.returncode == 0, result.stdout + result.stderr
