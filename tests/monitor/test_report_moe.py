"""The run report of a MoE model: MaxVio and one expert-load plot per MoE layer, drawn
from the records' ``moe_load`` tables; dense runs get none of them."""

from trainforge.monitor.jsonl import JsonlSink
from trainforge.monitor.report import _expert_loads, build_plots, load_runs, write_report


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


def write_run(path, records):
    sink = JsonlSink(path / "metrics.jsonl")
    for r in records:
        sink.write(r)
    sink.close()
    return path


def test_report_has_moe_plots_only_for_moe_runs(tmp_path):
    moe = write_run(tmp_path / "moe", moe_records())
    titles = [p.title for p in build_plots(load_runs([moe]))[0]]
    assert titles[-3:] == ["MoE load balance (MaxVio)", "Expert load, MoE layer 0", "Expert load, MoE layer 1"]
    dense = write_run(tmp_path / "dense", [{k: v for k, v in r.items() if not k.startswith("moe")}
                                           for r in moe_records()])
    assert not [p.title for p in build_plots(load_runs([dense]))[0] if "MoE" in p.title or "Expert" in p.title]
    page = write_report(moe).read_text()
    assert "alt='Expert load, MoE layer 1' src='data:image/png;base64," in page


def test_expert_loads_of_several_runs_get_a_plot_per_run(tmp_path):
    a, b = write_run(tmp_path / "a", moe_records()), write_run(tmp_path / "b", moe_records())
    plots = {p.title: p for p in build_plots(load_runs([a, b]))[0]}
    assert {"Expert load, MoE layer 1: a", "Expert load, MoE layer 1: b"} <= set(plots)
    layer = plots["Expert load, MoE layer 0: b"]
    assert layer.labels(2) == ["expert 0", "expert 1", "expert 2"]  # the title names the run
    assert plots["MoE load balance (MaxVio)"].labels(2) == [
        "a: batch, mean over layers", "a: validation set, mean over layers",
        "b: batch, mean over layers", "b: validation set, mean over layers"]
