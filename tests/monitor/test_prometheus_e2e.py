"""End to end: a real Prometheus (Debian's 2.42, unpacked by `make prometheus`) scrapes
a real training run every second on 127.0.0.1; then its HTTP API must return the loss
series and data for every query of the shipped Grafana dashboard. Skipped, with the
reason, when the binary is not available."""

import importlib.util
import json
import math
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import torch

from conftest import debug_config
from trainforge.monitor.rapl import find_zones
from trainforge.monitor.sinks import free_port
from trainforge.train.trainer import Trainer

from .helpers import FULL_MONITOR, REPO, find_tool, missing_tool_reason

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "trainforge.json"
STEPS = 60


def api(base: str, path: str, **params) -> dict:
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def has_data(result: list) -> bool:
    return any(not math.isnan(float(v)) for series in result for _, v in series["values"])


@pytest.fixture
def prometheus(tmp_path):
    binary = find_tool("prometheus")
    if binary is None:
        pytest.skip(missing_tool_reason("prometheus"))
    exporter_port, web_port = free_port(), free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: trainforge\n    scrape_timeout: 1s\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{exporter_port}']\n")
    proc = subprocess.Popen([str(binary), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web_port}",
                             "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{web_port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"prometheus did not become ready: {proc.stderr.read()}")
        time.sleep(0.2)
    yield base, exporter_port
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


class WaitForScrape:
    """At steps 20 and 40, wait until Prometheus has scraped a record of the last logging
    window, so that however fast the machine, the run is scraped while its values change
    (rate() and histogram_quantile() need two different scrapes)."""

    def __init__(self, base: str):
        self.base = base

    def on_step_end(self, trainer, step):
        if step not in (20, 40):
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            result = api(self.base, "query", query="trainforge_step")["result"]
            if result and float(result[0]["value"][1]) >= step - 2:
                return
            time.sleep(0.2)


def test_prometheus_scrapes_a_run_and_every_dashboard_query_returns_data(prometheus, small_data, tmp_path):
    base, port = prometheus
    cfg = debug_config(small_data, "--training.steps", str(STEPS), "--training.log_interval", "2",
                       "--checkpoint.interval", "30", "--training.val_interval", "20", *FULL_MONITOR,
                       "--monitor.prometheus_port", str(port),
                       # features whose metrics have dashboard panels: the tiered shard cache, the bad-step guard
                       "--data.cache.dir", str(tmp_path / "cache"), "--bad_steps.enabled", "true")
    start = time.time()
    trainer = Trainer(cfg, tmp_path / "run", progress=False, callbacks=[WaitForScrape(base)])
    try:
        trainer.fit()
        # The exporter stays up (trainer not closed) until Prometheus has the final step.
        deadline = time.monotonic() + 30
        while True:
            result = api(base, "query", query="trainforge_step")["result"]
            if result and float(result[0]["value"][1]) == STEPS:
                break
            assert time.monotonic() < deadline, f"prometheus never scraped the final step: {result}"
            time.sleep(0.5)
        end = time.time()
        window = dict(start=start - 5, end=end, step="1s")
        loss = api(base, "query_range", query='trainforge_loss{job="trainforge",rank="0"}', **window)["result"]
        assert len(loss) == 1 and len({v for _, v in loss[0]["values"]}) >= 2, loss  # scraped while it changed

        dashboard = json.loads(DASHBOARD.read_text())
        empty, exempt, checked = [], [], 0
        # RAPL readable here, or NVML on a GPU
        energy_counter = bool(find_zones()) or (torch.cuda.is_available() and importlib.util.find_spec("pynvml"))
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$rank", ".*").replace("$run", ".*")
                if "Needs: CUDA" in panel.get("description", "") and not torch.cuda.is_available():
                    exempt.append(panel["title"])
                    continue
                if "Needs: an energy counter" in panel.get("description", "") and not energy_counter:
                    exempt.append(panel["title"])
                    continue
                if "Needs: a MoE model" in panel.get("description", ""):  # this run trains the dense debug model
                    exempt.append(panel["title"])
                    continue
                if "Needs: trainforge serve" in panel.get("description", ""):  # tests/infer/test_server_prometheus.py
                    exempt.append(panel["title"])
                    continue
                checked += 1
                if not has_data(api(base, "query_range", query=expr, **window)["result"]):
                    empty.append(f"{panel['title']}: {expr}")
        print(f"checked {checked} dashboard queries; CUDA-only, MoE, serving and (without a counter) energy panels "
              "not checkable on this dense CPU "
              "training run (serving: tests/infer/test_server_prometheus.py): "
              f"{sorted(set(exempt))}")
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
        assert checked >= 35
    finally:
        trainer.close()
