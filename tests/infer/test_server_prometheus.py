"""End to end for the dashboard's serving row: a real Prometheus (tests/monitor's
fixture) scrapes a live ``trainforge serve`` app every second while requests run; then
every query of the "Serving" row, and the ``run`` / ``rank`` variable queries, return
data. The server listens on a socket bound first and handed to uvicorn, as ``serve``
does. promtool parses every dashboard query and lints the server's exposition. Skipped,
with the reason, when the binaries are not available."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import httpx
import pytest
import uvicorn

from tests.infer.test_server import serving, tiny_model
from tests.monitor.helpers import find_tool, missing_tool_reason, promtool_check
from tests.monitor.test_prometheus_e2e import DASHBOARD, api, has_data, prometheus  # noqa: F401  (fixture)
from trainforge.data.tokenizer import eos_id, load_tokenizer
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.listen import bind_socket
from trainforge.infer.server import ServerConfig, create_app


def test_every_serving_query_returns_data_from_a_live_server(prometheus, small_data):
    base, port = prometheus
    tok = load_tokenizer(small_data / "tokenizer.json")
    engine = Engine(tiny_model(tok.get_vocab_size()), EngineConfig(max_batch_size=2, max_queue=2, max_context=128,
                                                                   block_size=8), tokenizer=tok, eos_ids=(eos_id(tok),))
    sock = bind_socket("127.0.0.1", port)
    srv = uvicorn.Server(uvicorn.Config(create_app(engine, tok, ServerConfig(access_log=False)), log_level="warning"))
    engine.start()
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    start = time.time()
    try:
        url = f"http://127.0.0.1:{port}"

        def scraped() -> float:
            r = api(base, "query", query="sum(trainforge_http_requests_total)")["result"]
            return float(r[0]["value"][1]) if r else 0.0

        with httpx.Client(base_url=url, timeout=30) as http:
            # Three waves of requests with a scrape in between, so rate() and the quantiles see change.
            for wave in range(3):
                body = {"prompt": "def ", "max_tokens": 24, "temperature": 1.0, "seed": wave, "ignore_eos": True}
                results = []
                threads = [threading.Thread(target=lambda: results.append(http.post("/v1/completions", json=body)))
                           for _ in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert [r.status_code for r in results] == [200, 200]
                http.get("/nope")  # a 404, counted under "other"
                seen = scraped()
                deadline = time.monotonic() + 30
                while scraped() <= seen and time.monotonic() < deadline:
                    http.get("/health")
                    time.sleep(0.3)
        time.sleep(2.5)  # two more scrapes of the final state
        window = dict(start=start - 5, end=time.time(), step="1s")
        board = json.loads(DASHBOARD.read_text())
        row = [p for p in board["panels"] if "Needs: trainforge serve" in p.get("description", "")]
        assert len(row) >= 6
        empty = []
        for panel in row:
            for target in panel["targets"]:
                expr = target["expr"].replace("$rank", ".*").replace("$run", ".*")
                if not has_data(api(base, "query_range", query=expr, **window)["result"]):
                    empty.append(f"{panel['title']}: {expr}")
        assert not empty, "serving queries without data:\n" + "\n".join(empty)
        # The variables: run lists the job, rank the server's rank (as Grafana's label_values() asks).
        jobs = api(base, "label/job/values", **{"match[]": '{__name__=~"trainforge_.+"}'})
        ranks = api(base, "label/rank/values", **{"match[]": '{__name__=~"trainforge_.+", job=~"trainforge"}'})
        assert jobs == ["trainforge"] and ranks == ["0"]
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.stop()


def test_every_dashboard_query_parses_with_promtool_and_the_server_exposition_passes(tmp_path, small_data):
    """``promtool check rules`` parses each query (as a recording rule); ``promtool check
    metrics`` lints what the server's /metrics serves after a request."""
    if find_tool("promtool") is None:
        pytest.skip(missing_tool_reason("promtool"))
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"].replace("$rank", ".*").replace("$run", ".*") for p in board["panels"]
             for t in p.get("targets", [])]
    rules = "groups:\n  - name: dashboard\n    rules:\n" + "".join(
        f"      - record: dashboard:query_{i}\n        expr: {json.dumps(e)}\n" for i, e in enumerate(exprs))
    (tmp_path / "rules.yml").write_text(rules)
    r = subprocess.run([str(find_tool("promtool")), "check", "rules", str(tmp_path / "rules.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"{len(exprs)} rules found" in r.stdout, r.stdout + r.stderr
    tok = load_tokenizer(small_data / "tokenizer.json")
    engine = Engine(tiny_model(tok.get_vocab_size()), EngineConfig(max_batch_size=2, max_queue=2, max_context=128,
                                                                   block_size=8), tokenizer=tok, eos_ids=(eos_id(tok),))
    with serving(engine, tok, ServerConfig(access_log=False)) as url:
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30).status_code == 200
        text = httpx.get(url + "/metrics").text
    result = promtool_check(text)
    assert result.returncode == 0, result.stdout + result.stderr
