"""How records update typed metrics: gauges, running-total and per-window counters,
histograms, labels from dicts, lists and key patterns, unknown keys."""

import math

from trainforge.monitor.registry import Registry


def test_gauges_take_the_latest_value_and_running_totals_reset_on_resume():
    reg = Registry(rank=3)
    reg.ingest({"step": 1, "loss": 5.0, "tokens": 100})
    reg.ingest({"step": 2, "loss": 4.0, "tokens": 200})
    assert reg.value("trainforge_loss") == 4.0
    assert reg.value("trainforge_tokens_total") == 200
    reg.ingest({"step": 1, "loss": 5.0, "tokens": 100})  # resumed from an earlier checkpoint
    assert reg.value("trainforge_tokens_total") == 100
    assert reg.value("trainforge_loss", rank="3") == 5.0


def test_window_amounts_are_added_once_per_window():
    reg = Registry()
    for window, steps in ((10, (9, 10)), (20, (19, 20))):
        for step in steps:  # every record of a window repeats the window's amount
            reg.ingest({"step": step, "loss": 1.0, "data_bytes_disk": 1000, "data_quarantined": 1}, window=window)
    assert reg.value("trainforge_data_cache_read_bytes_total", tier="disk") == 2000
    assert reg.value("trainforge_data_quarantined_total") == 2


def test_histogram_counts_observations_into_le_buckets():
    reg = Registry()
    for s in (0.02, 0.02, 0.3, 7.0):
        reg.ingest({"step": 1, "checkpoint_save_s": s})
    h = reg.histogram("trainforge_checkpoint_save_seconds")
    assert h.count == 4 and math.isclose(h.sum, 7.34)
    cum = dict(h.cumulative())
    assert cum["0.025"] == 2 and cum["0.5"] == 3 and cum["10.0"] == 4 and cum["+Inf"] == 4


def test_labels_from_dicts_lists_patterns_and_dtype_names():
    reg = Registry()
    reg.ingest({"grad_norm_group": {"layers.0": 0.5, "output": 1.5}, "stage_compute_s": [0.1, 0.2],
                "mem_params_bf16_bytes": 2048, "precision": {"layers.0": "bf16", "output": "fp32"},
                "compression_bits": {"0": 4.125}, "bubble_fraction": 0.25})
    assert reg.value("trainforge_gradient_group_norm", group="output") == 1.5
    assert reg.value("trainforge_pipeline_stage_compute_seconds", axis="pp", stage="1") == 0.2
    assert reg.value("trainforge_memory_bytes", category="params", dtype="bf16") == 2048
    assert reg.value("trainforge_precision_value_bytes", group="layers.0", dtype="bf16") == 2
    assert reg.value("trainforge_compression_value_bytes", axis="dp_replicate", bucket="0") == 4.125 / 8
    assert reg.value("trainforge_pipeline_bubble_ratio", axis="pp") == 0.25


def test_unknown_numeric_keys_are_exported_and_other_values_ignored():
    reg = Registry()
    changed = reg.ingest({"step": 4, "brand_new_metric": 2.5, "nested_new": {"a": 1}, "checkpoint": "/x/y",
                          "precision_switch": "blocks fp32 -> bf16", "val_loss": None})
    assert reg.value("trainforge_record_value", key="brand_new_metric") == 2.5
    assert reg.value("trainforge_record_value", key="nested_new.a") == 1
    assert {s.name for s in changed} == {"trainforge_step", "trainforge_record_value"}
    assert reg.value("trainforge_validation_loss") is None


def test_operator_self_times_from_raw_events_equal_key_averages():
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainforge.monitor.probes import cpu_self_us

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            model(torch.randn(32, 64)).sum().backward()
    mine = cpu_self_us(prof)
    ref = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    assert set(mine) == set(ref)
    for key, us in ref.items():
        assert abs(mine[key] - us) <= 1e-3 * max(us, 1.0) + 1e-3, key


def test_moe_routing_records_become_per_layer_and_per_expert_gauges():
    reg = Registry()
    reg.ingest({"step": 3, "moe_maxvio_batch": 0.5, "moe_maxvio_batch_layers": [0.25, 0.75],
                "moe_load": [[30.0, 10.0], [20.0, 20.0]], "moe_bias_spread": [0.002, 0.0]})
    reg.ingest({"step": 3, "val_loss": 4.0, "moe_maxvio_global": 0.125, "moe_maxvio_global_layers": [0.0, 0.25]})
    assert reg.value("trainforge_moe_maxvio_batch_ratio") == 0.5
    assert reg.value("trainforge_moe_layer_maxvio_batch_ratio", moe_layer="1") == 0.75
    assert reg.value("trainforge_moe_expert_load_tokens", moe_layer="0", expert="1") == 10.0
    assert reg.value("trainforge_moe_expert_load_tokens", moe_layer="1", expert="0") == 20.0
    assert reg.value("trainforge_moe_router_bias_spread", moe_layer="0") == 0.002
    assert reg.value("trainforge_moe_maxvio_global_ratio") == 0.125
    assert reg.value("trainforge_moe_layer_maxvio_global_ratio", moe_layer="1") == 0.25
