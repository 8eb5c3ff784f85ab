"""A real (debug-size) training run with full monitoring: what the records carry,
that every sink holds the registry's values, where the endpoint listens, the
Pushgateway push at the end, and the run report."""

import http.server
import re
import socket
import threading
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import debug_config
from trainforge.cli import main as cli_main
from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.monitor.rapl import find_zones
from trainforge.monitor.sinks import free_port
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train.trainer import Trainer

from .helpers import FULL_MONITOR, find_tool, missing_tool_reason, non_loopback_ipv4, promtool_check

STEPS = 12


class _Pushgateway(http.server.BaseHTTPRequestHandler):
    received: list = []

    def do_PUT(self):
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        self.received.append((self.path, body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def run(small_data, tmp_path_factory):
    gateway = http.server.HTTPServer(("127.0.0.1", 0), _Pushgateway)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    port = free_port()
    run_dir = tmp_path_factory.mktemp("monitored") / "run"
    cfg = debug_config(small_data, "--training.steps", str(STEPS), "--training.log_interval", "4",
                       "--checkpoint.interval", "6", "--training.val_interval", "6", *FULL_MONITOR,
                       "--monitor.tensorboard", "true", "--monitor.prometheus_port", str(port),
                       "--monitor.pushgateway_url", f"http://127.0.0.1:{gateway.server_address[1]}")
    trainer = Trainer(cfg, run_dir, progress=False)
    try:
        trainer.fit()
        monitor = trainer.metrics
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        bound = monitor.prometheus.address
        other_ip = non_loopback_ipv4()
        refused = None
        if other_ip is not None:
            with socket.socket() as s:
                s.settimeout(5)
                refused = s.connect_ex((other_ip, port)) != 0
    finally:
        trainer.close()
    gateway.shutdown()
    return SimpleNamespace(run_dir=run_dir, port=port, registry=monitor.registry, scrape=scrape, bound=bound,
                           other_ip=other_ip, refused=refused, pushed=list(_Pushgateway.received),
                           records=read_jsonl(run_dir / "metrics.jsonl"))


def test_records_carry_step_timings_model_stats_and_system_metrics(run):
    train = [r for r in run.records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert r["data_wait_s"] >= 0 and r["step_s"] > 0 and r["forward_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] >= 0
        assert r["data_wait_s"] + r["forward_s"] + r["backward_s"] + r["optimizer_s"] == pytest.approx(r["step_s"])
        assert r["rss_bytes"] > 0 and r["cpu_seconds"] > 0
        assert r["comm_share"] == 0.0 and r["bubble_fraction"] == 0.0 and r["loss_scale"] == 1.0
        # the estimate always, labelled as one; energy only where this machine exposes a readable counter
        assert set(r["memory_bandwidth_bytes_per_s"]) == {"step_bytes_estimate"} and r["step_bytes_estimate"] > 0
        assert ("power_w" in r) == bool(find_zones()), "energy keys without a counter (or a counter unread)"
    sampled = [r for r in train if "grad_norm_group" in r]
    assert [r["step"] for r in sampled] == [3, 6, 9, 12]  # monitor.interval_steps = 3
    for r in sampled:
        groups = set(r["grad_norm_group"])
        assert {"tok_embeddings", "layers.0", "layers.1", "output"} <= groups
        assert set(r["act_std"]) == {"layers.0", "layers.1"} and all(v > 0 for v in r["act_std"].values())
        assert 0 < r["update_ratio"] < 1 and r["param_norm"] > 0
        # after clipping (grad_clip 1.0): the groups' norms combine to at most the clipped global norm
        assert sum(v ** 2 for v in r["grad_norm_group"].values()) ** 0.5 <= min(r["grad_norm"], 1.0) * 1.001
    profiled = [r for r in train if "top_ops" in r]
    # profile_every = 4: step 4, step 8; step 12 is also sampled and moves on past the run's end
    assert [r["step"] for r in profiled] == [4, 8]
    assert any(op.startswith("aten::") for op in profiled[0]["top_ops"]) and len(profiled[0]["top_ops"]) <= 10
    assert sum("checkpoint_save_s" in r for r in run.records) == 2
    assert sum("val_loss" in r for r in run.records) == 3


def test_prometheus_scrape_holds_the_registry_values(run):
    scraped = {}
    for fam in text_string_to_metric_families(run.scrape):
        for s in fam.samples:
            scraped[(s.name, tuple(sorted(s.labels.items())))] = s.value
    compared = 0
    for fam in run.registry.families():
        for labels, v in fam.values.items():
            name = fam.name
            assert scraped[(name, tuple(sorted(labels)))] == pytest.approx(v, rel=1e-12), name
            compared += 1
        for labels, h in fam.hists.items():
            assert scraped[(fam.name + "_count", tuple(sorted(labels)))] == h.count
            assert scraped[(fam.name + "_sum", tuple(sorted(labels)))] == pytest.approx(h.sum)
            compared += 1
    assert compared >= 40


def test_jsonl_holds_the_registry_values(run):
    from trainforge.monitor.catalog import CATALOG

    last = [r for r in run.records if "loss" in r][-1]
    checked = 0
    for spec in CATALOG:
        if spec.kind == "histogram" or spec.pattern or spec.labels or spec.key not in last:
            continue
        if spec.key in ("val_loss",):
            continue
        assert run.registry.value(spec.name, **dict(spec.const_labels)) == pytest.approx(last[spec.key]), spec.key
        checked += 1
    vals = [r["val_loss"] for r in run.records if "val_loss" in r]
    assert run.registry.value("trainforge_validation_loss") == vals[-1]
    saves = [r["checkpoint_save_s"] for r in run.records if "checkpoint_save_s" in r]
    h = run.registry.histogram("trainforge_checkpoint_save_seconds")
    assert h.count == len(saves) and h.sum == pytest.approx(sum(saves))
    steps = [r["step_s"] for r in run.records if "step_s" in r]
    h = run.registry.histogram("trainforge_step_seconds")
    assert h.count == len(steps) and h.sum == pytest.approx(sum(steps))
    assert checked >= 20


def test_tensorboard_holds_the_registry_values(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run.run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for fam in run.registry.families():
        level = fam.spec.level if fam.spec else "other"
        for labels, v in fam.values.items():
            rest = ",".join(f"{k}={x}" for k, x in labels if k != "rank")
            tag = f"{level}/{fam.name}" + (f"/{rest}" if rest else "")
            assert tag in tags, tag
            assert acc.Scalars(tag)[-1].value == pytest.approx(v, rel=1e-6), tag  # TB stores float32
        for labels, h in fam.hists.items():
            events = acc.Scalars(f"{level}/{fam.name}")
            assert len(events) == h.count and sum(e.value for e in events) == pytest.approx(h.sum, rel=1e-5)


def test_endpoint_listens_on_loopback_only(run):
    assert run.bound == ("127.0.0.1", run.port)
    if run.other_ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    assert run.refused, f"metrics endpoint answered on {run.other_ip}:{run.port}"


def test_final_metrics_are_pushed_to_the_pushgateway(run):
    assert len(run.pushed) == 1
    path, body = run.pushed[0]
    assert path == "/metrics/job/trainforge/rank/0"
    assert f'trainforge_step{{rank="0"}} {float(STEPS)}' in body and "trainforge_validation_loss" in body


def test_report_embeds_the_plots_in_one_html_file(run, capsys):
    assert cli_main(["report", str(run.run_dir)]) == 0
    page = (run.run_dir / "report.html").read_text()
    energy = ["Power", "Energy per token"] if find_zones() else []  # absent without a readable counter
    titles = ["Loss", "Learning rate", "Throughput", "MFU", "Memory", *energy, "Memory bandwidth", "Gradient norm",
              "Gradient norm per layer group", "Step phases"]
    assert re.findall(r"<img alt='([^']+)'", page) == titles
    assert page.count("src='data:image/png;base64,") == len(titles)
    if not energy:
        assert "Power (not recorded)" in page and "Energy per token (not recorded)" in page
    assert not re.search(r"(src|href)=['\"]?(https?:|//)", page)  # self-contained (the config table may show URLs)
    assert "Communication share (all zero)" in page  # a single process: left out, named at the bottom
    assert cli_main(["report", str(run.run_dir / "nope")]) == 2
    assert "run/nope does not exist" in capsys.readouterr().err


def test_monitor_off_keeps_the_trainer_records_unchanged(small_data, tmp_path):
    cfg = debug_config(small_data, "--training.steps", "4", "--monitor.enabled", "false")
    t = Trainer(cfg, tmp_path / "run", progress=False)
    try:
        t.fit()
    finally:
        t.close()
    train = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "peak_memory_bytes"} <= set(train[0])
    ours = {"step_s", "forward_s", "backward_s", "optimizer_s", "data_wait_s", "cpu_util", "rss_bytes", "monitor_s",
            "grad_norm_group", "param_norm", "update_ratio", "optimizer_skipped_steps", "parallel_degree"}
    assert not ours & {k for r in train for k in r}


def test_bad_monitor_config_names_the_key(small_data, tmp_path):
    with pytest.raises(ConfigError, match="monitor.prometheus_port"):
        load_config(None, ["--monitor.prometheus_port", "70000"])
    with pytest.raises(ConfigError, match="monitor.pushgateway_url"):
        load_config(None, ["--monitor.pushgateway_url", "127.0.0.1:9091"])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = debug_config(small_data, "--monitor.prometheus_port", str(busy.getsockname()[1]))
        with pytest.raises(ConfigError, match="monitor.prometheus_port.*cannot listen"):
            Trainer(cfg, tmp_path / "run", progress=False)


def test_scrape_of_the_run_passes_promtool(run):
    if find_tool("promtool") is None:
        pytest.skip(missing_tool_reason("promtool"))
    result = promtool_check(run.scrape)
    assert result.returncode == 0, result.stdout + result.stderr
