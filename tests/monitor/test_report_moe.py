"""The run report of a MoE model: MaxVio and one expert-load plot per MoE layer, drawn
from the records' ``moe_load`` tables; dense runs get none of them."""

from trainforge.monitor.jsonl import JsonlSink
from trainforge.monitor.report import _expert_loads, build_plots, write_report


def moe_records():
    train = [{"step": s, "loss": 5.0 - s / 10, "moe_maxvio_batch": 1.0 / s, "moe_maxvio_batch_layers": [1.0 / s] * 2,
              "moe_load": [[10.0 + s, 20.0 - s, 10.0], [15.0, 15.0, 10.0]]} for s in (1, 2, 3)]
    return [{"step": 0, "val_loss": 5.5, "moe_maxvio_global": 0.5}, *train,
            {"step": 3, "val_loss": 4.5, "moe_maxvio_global": 0.25}]


def test_expert_loads_are_one_line_per_expert_per_layer():
    layers = _expert_loads(moe_records()[1:4])
    assert len(layers) == 2 and [label for label, _, _ in layers[0]] == ["expert 0", "expert 1", "expert 2"]
    assert layers[0][1][1:] == ([1, 2, 3], [19.0, 18.0, 17.0])
    assert layers[1][2][1:] == ([1, 2, 3], [10.0, 10.0, 10.0])


def test_report_has_moe_plots_only_for_moe_runs(tmp_path):
    titles = [t for t, png, _ in build_plots(moe_records()) if png is not None]
    assert titles[-3:] == ["MoE load balance (MaxVio)", "Expert load, MoE layer 0", "Expert load, MoE layer 1"]
    dense = [{k: v for k, v in r.items() if not k.startswith("moe")} for r in moe_records()]
    assert not [t for t, _, _ in build_plots(dense) if "MoE" in t or "Expert" in t]
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for r in moe_records():
        sink.write(r)
    sink.close()
    page = write_report(tmp_path).read_text()
    assert "alt='Expert load, MoE layer 1' src='data:image/png;base64," in page
