"""``trainforge report RUN [RUN...]``: runs overlaid (one legend entry per run), the config
diff, TensorBoard-style smoothing, the training-time axis, empty and all-zero plots left
out, tokens/s and MFU on their own axes, the MFU peak in the header, one-line errors.
Runs are hand-written metrics.jsonl + config.toml files: a few records each."""

import json
import re

import matplotlib.axes
import pytest

from trainforge.cli import main as cli_main
from trainforge.errors import TrainforgeError
from trainforge.monitor.report import COMPARE_FILE, build_plots, load_runs, write_report
from trainforge.monitor.report_config import config_diff, flatten_config
from trainforge.monitor.report_plots import RAW_ALPHA, ema, render

CONFIG = """[model]
flavor = "debug"

[training]
steps = 4
lr = {lr}
seed = 1

[data.cache]
memory_mb = 1024
"""


def train_records(tokens_per_s=1000.0, comm_share=0.0, **extra):
    """Four steps of 100 tokens each: at 1000 tokens/s one step is 0.1 s."""
    return [{"step": s, "loss": 5.0 - s / 4 + (0.3 if s % 2 else 0.0), "lr": 1e-3 * s, "grad_norm": 1.0 / s,
             "tokens": 100 * s, "tokens_per_s": tokens_per_s, "mfu": 0.25, "step_s": 0.5,
             "comm_share": comm_share, "bubble_fraction": 0.0, **extra} for s in (1, 2, 3, 4)]


def write_run(path, records, config=None):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (path / "config.toml").write_text(config)
    return path


def two_runs(tmp_path):
    val = [{"step": 0, "val_loss": 5.5}, {"step": 4, "val_loss": 4.5}]
    a = write_run(tmp_path / "a", [val[0], *train_records(), val[1]], CONFIG.format(lr=0.001))
    b = write_run(tmp_path / "b", [val[0], *train_records(tokens_per_s=500.0), val[1]],
                  CONFIG.format(lr=0.003) + '\n[qat]\nscheme = "int4"\n')
    return a, b


def test_two_runs_are_overlaid_in_one_page_with_their_config_diff(tmp_path):
    a, b = two_runs(tmp_path)
    runs = load_runs([a, b])
    plots, _ = build_plots(runs)
    assert [p.title for p in plots] == ["Loss", "Learning rate", "Throughput", "MFU", "Gradient norm", "Step phases"]
    for plot in plots:  # every plot overlays both runs, each named in the legend
        labels = plot.labels(2)
        assert any(lb.startswith("a") for lb in labels) and any(lb.startswith("b") for lb in labels), plot.title
    assert plots[0].labels(2) == ["a: train", "a: validation", "b: train", "b: validation"]
    assert plots[1].labels(2) == ["a", "b"]

    page = write_report([a, b]).read_text()
    assert (a / COMPARE_FILE).is_file()  # several runs, no --out: beside the first run
    assert page.count("<img") == len(plots)
    diff = page[page.index("<table class='config diff'>"):]
    diff = diff[:diff.index("</table>")]
    assert re.findall(r"<tr><th>([^<]+)</th>", diff) == ["training.lr", "qat.scheme"]
    assert "<td>0.001</td><td>0.003</td>" in diff
    assert "<td class='unset'>(unset)</td><td>&quot;int4&quot;</td>" in diff
    assert "Config: 2 keys differ" in page


def test_config_is_flattened_and_only_differing_keys_are_listed():
    flat = flatten_config({"training": {"lr": 0.001, "steps": 4}, "data": {"cache": {"memory_mb": 1024}},
                           "aug": {"transforms": [{"name": "x", "p": 0.5}]}, "model": {"flavor": "1"}})
    assert flat == {"training.lr": "0.001", "training.steps": "4", "data.cache.memory_mb": "1024",
                    "aug.transforms": '[{"name": "x", "p": 0.5}]', "model.flavor": '"1"'}
    same = {"training.lr": "0.001", "training.steps": "4"}
    assert config_diff([same, dict(same)]) == []
    assert config_diff([same, {**same, "training.steps": "8"}, same]) == [("training.steps", ["4", "8", "4"])]
    assert config_diff([same, None]) == []  # a run without config.toml adds no row


def test_one_run_shows_the_whole_config_escaped(tmp_path):
    run = write_run(tmp_path / "r", train_records(), CONFIG.format(lr=0.001) + '\n[sample]\nprompt = "<b>&"\n')
    page = write_report(run).read_text()
    assert (run / "report.html").is_file()
    assert "<details><summary>config.toml (6 keys)</summary>" in page
    assert "<th>sample.prompt</th><td>&quot;&lt;b&gt;&amp;&quot;</td>" in page and "<b>&" not in page


def test_equal_directory_names_are_told_apart(tmp_path):
    x = write_run(tmp_path / "x" / "run", train_records())
    y = write_run(tmp_path / "y" / "run", train_records())
    assert [r.name for r in load_runs([x, y])] == ["x/run", "y/run"]
    assert [r.name for r in load_runs([x, x])] == ["run", "run #2"]


def test_ema_is_tensorboards_debiased_average():
    # weight 0.5: last = 0.5, 1.25, 2.125; debiased by 1 - 0.5**n = 0.5, 0.75, 0.875
    assert ema([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    assert ema([4.0, float("nan"), 4.0], 0.9)[1] != ema([4.0, float("nan"), 4.0], 0.9)[1]  # nan passes through
    assert ema([4.0, float("nan"), 4.0], 0.9)[2] == pytest.approx(4.0)  # and does not enter the average
    assert ema([3.0, 1.0], 0.0) == [3.0, 1.0]
    with pytest.raises(ValueError):
        ema([1.0], 1.0)


def drawn(monkeypatch, plot, names, smooth):
    """The (ys, alpha) of every line ``render`` hands to matplotlib."""
    calls, plot_fn = [], matplotlib.axes.Axes.plot

    def spy(self, xs, ys, *args, **kw):
        calls.append((list(ys), kw.get("alpha")))
        return plot_fn(self, xs, ys, *args, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    render(plot, names, "step", smooth)
    return calls


def test_smoothing_draws_the_ema_over_the_faint_raw_line(tmp_path, monkeypatch):
    a, b = two_runs(tmp_path)
    plots, _ = build_plots(load_runs([a, b]))
    loss, lr = plots[0], plots[1]
    raw = loss.lines[0].ys
    assert drawn(monkeypatch, loss, ["a", "b"], 0.0)[0] == (raw, None)
    smoothed = drawn(monkeypatch, loss, ["a", "b"], 0.8)
    assert smoothed[0] == (raw, RAW_ALPHA) and smoothed[1] == (pytest.approx(ema(raw, 0.8)), None)
    assert smoothed[1][0] != pytest.approx(raw)
    assert smoothed[2] == (loss.lines[1].ys, None)  # validation loss: sparse, never smoothed
    assert all(alpha is None for _, alpha in drawn(monkeypatch, lr, ["a", "b"], 0.8))  # nor the schedule
    page = write_report([a, b], tmp_path / "s.html", smooth=0.8).read_text()
    assert "smoothed: EMA weight 0.8" in page


def test_time_axis_is_training_seconds_since_the_first_step(tmp_path):
    a, b = two_runs(tmp_path)  # 100 tokens per step at 1000 and 500 tokens/s
    plots, _ = build_plots(load_runs([a, b]), x="time")
    loss = {(ln.run, ln.series): ln.xs for ln in plots[0].lines}
    assert loss["a", "train"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert loss["b", "train"] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert loss["a", "validation"] == pytest.approx([0.0, 0.4])  # before the first step, after the last
    # without tokens_per_s the monitor's step_s is summed
    c = write_run(tmp_path / "c", [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in train_records()])
    plots, _ = build_plots(load_runs([c]), x="time")
    assert plots[0].lines[0].xs == pytest.approx([0.5, 1.0, 1.5, 2.0])
    page = write_report(a, tmp_path / "t.html", x="time").read_text()
    assert "x: wall-clock time in seconds since the first step (runs without time_unix_s: rebuilt" in page
    slow = write_run(tmp_path / "slow", train_records(tokens_per_s=0.1))  # 1000 s a step: minutes
    assert "x: wall-clock time in minutes" in write_report(slow, x="time").read_text()
    # The trainer's clock wins: a pause (a resumed run) shows; the first point keeps its own window.
    clocked = [{**r, "time_unix_s": 1e9 + t} for r, t in zip(train_records(), (0.1, 0.2, 5.3, 5.4))]
    d = write_run(tmp_path / "d", clocked)
    assert build_plots(load_runs([d]), x="time")[0][0].lines[0].xs == pytest.approx([0.1, 0.2, 5.3, 5.4])
    assert "rebuilt" not in write_report(d, x="time").read_text()
    fresh = write_run(tmp_path / "fresh", [{"step": 0, "val_loss": 5.5}])  # killed before its first logged step
    assert build_plots(load_runs([fresh]), x="time")[0][0].lines[0].xs == [0.0]
    bare = write_run(tmp_path / "bare", [{"step": s, "loss": 1.0} for s in (1, 2)])
    with pytest.raises(TrainforgeError, match="bare/metrics.jsonl has neither time_unix_s nor tokens_per_s"):
        build_plots(load_runs([bare]), x="time")


def test_empty_and_all_zero_plots_are_left_out_and_listed(tmp_path):
    a = write_run(tmp_path / "a", train_records())  # single process: comm share and bubble are 0
    page = write_report(a).read_text()
    assert "Memory" not in re.findall(r"alt='([^']+)'", page) and "alt='Communication share'" not in page
    assert "not recorded or all zero in this run: " in page
    assert "Memory (not recorded)" in page and "Communication share (all zero)" in page
    assert "(not recorded)</figcaption>" not in page  # no placeholder figures any more
    b = write_run(tmp_path / "b", train_records(comm_share=0.2))
    plots, left_out = build_plots(load_runs([a, b]))
    comm = next(p for p in plots if p.title == "Communication share")
    assert [(ln.run, ln.series) for ln in comm.lines] == [("b", "in collectives")]
    assert "Communication share: in collectives, a (all zero)" in left_out
    assert "Communication share: pipeline bubble, b (all zero)" in left_out


def test_tokens_per_s_and_mfu_have_their_own_plots(tmp_path):
    a, b = two_runs(tmp_path)
    plots = {p.title: p for p in build_plots(load_runs([a, b]))[0]}
    assert plots["Throughput"].ylabel == "tokens/s" and plots["MFU"].ylabel == "MFU %"
    assert [ln.ys for ln in plots["Throughput"].lines] == [[1000.0] * 4, [500.0] * 4]
    assert [ln.ys for ln in plots["MFU"].lines] == [[25.0] * 4, [25.0] * 4]


def test_header_shows_the_mfu_peak_and_its_source_when_recorded(tmp_path):
    recs = train_records()
    recs[1].update(mfu_peak_flops=2.0e12, mfu_peak_source="measured best of 5 probes")
    recs[3].update(mfu_peak_flops=3.5e12, mfu_peak_source="measured best of 5 probes, re-probed at step 4")
    a = write_run(tmp_path / "a", recs)
    b = write_run(tmp_path / "b", train_records())
    page = write_report([a, b], tmp_path / "out.html").read_text()
    assert "<tr><th>MFU peak</th><td>3.5 TFLOP/s</td><td>-</td></tr>" in page
    assert "<tr><th>MFU peak source</th><td>measured best of 5 probes, re-probed at step 4</td><td>-</td>" in page
    assert "MFU peak" not in write_report(b).read_text()


def test_cli_takes_several_runs_and_fails_in_one_line(tmp_path, capsys):
    a, b = two_runs(tmp_path)
    out = tmp_path / "cmp.html"
    assert cli_main(["report", str(a), str(b), "--out", str(out), "--smooth", "0.6", "--x", "time"]) == 0
    assert capsys.readouterr().out == f"report: {out}\n" and out.read_text().count("<img") == 6
    for args, message in (([str(a), str(tmp_path / "nope")], f"run directory {tmp_path / 'nope'} does not exist"),
                          ([str(tmp_path)], f"{tmp_path / 'metrics.jsonl'} does not exist"),
                          ([str(a), "--smooth", "1.5"], "--smooth 1.5: the EMA weight must be in [0, 1)")):
        assert cli_main(["report", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    (b / "config.toml").write_text("[training\n")
    assert cli_main(["report", str(b)]) == 2
    assert f"{b / 'config.toml'} is not valid TOML" in capsys.readouterr().err


def test_power_energy_and_bandwidth_are_plotted_per_domain_or_said_to_be_absent(tmp_path):
    measured = write_run(tmp_path / "gpu", train_records(
        power_w={"gpu": 300.0, "package": 90.0}, energy_per_token_j={"gpu": 0.3, "package": 0.09},
        memory_bandwidth_bytes_per_s={"nvml_gpm": 2.0e12, "step_bytes_estimate": 1.5e12}))
    plots = {p.title: p for p in build_plots(load_runs([measured]))[0]}
    assert [(ln.series, ln.ys) for ln in plots["Energy per token"].lines] == [("gpu", [0.3] * 4), ("package", [0.09] * 4)]
    assert [(ln.series, ln.ys[0]) for ln in plots["Memory bandwidth"].lines] == [
        ("nvml_gpm", pytest.approx(2000.0)), ("step_bytes_estimate", pytest.approx(1500.0))]
    page = write_report(measured).read_text()
    assert "<tr><th>energy per token (median)</th><td>gpu 0.3 J, package 0.09 J</td></tr>" in page
    assert "nvml_gpm 2e+03 GB/s, step_bytes_estimate 1.5e+03 GB/s" in page
    # a machine without counters: no plot with zeros, and the header says why
    bare = write_run(tmp_path / "vm", train_records(memory_bandwidth_bytes_per_s={"step_bytes_estimate": 1e9}))
    plots, left_out = build_plots(load_runs([bare]))
    assert "Power (not recorded)" in left_out and "Energy per token (not recorded)" in left_out
    assert "Memory bandwidth" in {p.title for p in plots}
    assert "not recorded (no energy counter readable: NVML or RAPL powercap)" in write_report(bare).read_text()
    # metrics.jsonl is rank 0's: with several ranks its energy is a share of the job's, and says so
    ranks = write_run(tmp_path / "ddp", train_records(energy_per_token_j={"gpu": 0.3},
                                                       parallel_degree={"pp": 1, "dp_replicate": 4, "dp_shard": 2, "tp": 1}))
    assert "<th>energy per token (median, rank 0 of 8)</th><td>gpu 0.3 J</td>" in write_report(ranks).read_text()
