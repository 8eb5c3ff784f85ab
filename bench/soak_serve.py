"""Soak test of ``trainforge serve``: many concurrent clients for minutes against a real
server process on 127.0.0.1, checking that nothing fails and the server does not grow.

    python -m bench.soak_serve                                   # 16 clients, 180 s, debug model
    python -m bench.soak_serve --clients 32 --duration_s 600 --checkpoint runs/a
    python -m bench.soak_serve --hostile                         # 8 well-behaved clients, 100 s, hostile ones mixed in

``--hostile``: after the warm-up, half the time the well-behaved clients run alone
(baseline), half with hostile clients mixed in (``bench/_soak_hostile.py``: slow headers and
bodies held past ``--read_timeout_s``, ``seed`` 2**64, 200,000-deep JSON, ~1 MiB
``/tokenize``, malformed JSON, hang-ups); the table compares the well-behaved clients'
latency in both halves. The well-behaved clients (and the attackers' admitted hang-ups) fit
``--max_concurrent``, so for them any 429 is an error; a hostile request that gets anything
but its expected answer (a 5xx, a slow client not cut in time) is an error too.

Run from the repository root (``-m`` puts it on the path). Without ``--checkpoint`` the
script prepares a few stdlib modules (vocab 512) and trains the ``debug`` flavor for 30
steps into a temporary directory (about half a minute): the soak is about the server
(admission, streaming, disconnects, memory), not the model's speed.

Clients (asyncio + httpx, one seeded RNG each) loop until the deadline, each request a
random mix: ~45% non-streamed, ~45% streamed (SSE, must end ``data: [DONE]``), ~10%
hang up 50-500 ms after sending a long request (raw socket, so the disconnect is
certain; a hang-up that got a 429 first counts as shed), over ``/v1/completions`` and ``/v1/chat/completions``. A 429 is *shed* load,
counted apart, and the client backs off 50-250 ms. An **error** is anything else: a status
other than 200 / 429, a connection error or timeout, a stream without ``[DONE]``, a 5xx in
the server's own ``/metrics``, or a server that is not idle (no running or waiting
request, no KV block in use) within 10 s of the last client.

Figures: latency p50 / p99 of completed requests (and TTFT of streamed ones), tokens/s
the engine generated over the measured window (``/metrics``, aborted requests included),
shed share, and the server's RSS (``VmRSS`` from ``/proc/PID/status`` every second):
growth = median of the last 5 s against the median of the 5 s after the warm-up. Also the
CPU (``lscpu``: model, CPUs, hypervisor, L3, SIMD flags) and the load average before,
during (max) and after, with the CPU share other processes used. Prints a table and one
JSON line; exits 1 if errors > 0 or RSS growth >= 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import httpx

from bench._soak_hostile import HostileTally, attacker, slow_client
from bench.train_throughput import cpu_counters
from trainforge.monitor.sinks import read_exposition

PROMPTS = ["def parse(", "import os\n", "class Config:", "for i in range(", "# utility functions\n", "return "]
SIMD = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
GROWTH_LIMIT = 0.05


# -- machine --------------------------------------------------------------------------------

def lscpu_summary() -> dict:
    """Model, CPUs, hypervisor, L3 and which SIMD flags the CPU has, from ``lscpu``."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {"model": "unknown (no lscpu)"}
    f = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines())}
    flags = set(f.get("Flags", "").split())
    return {"model": f.get("Model name", "unknown"), "cpus": f.get("CPU(s)"),
            "threads_per_core": f.get("Thread(s) per core"), "hypervisor": f.get("Hypervisor vendor", "none"),
            "l3": f.get("L3 cache"), "simd": [s for s in SIMD if s in flags]}


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m.group(1)) / 1024


# -- checkpoint and server ----------------------------------------------------------------------

def debug_checkpoint(work: Path, steps: int) -> Path:
    """A ``debug``-flavor run directory (checkpoint + tokenizer.json) trained ``steps`` steps."""
    from trainforge.data.prepare import PrepareOptions, prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / n) for n in ("argparse.py", "ast.py", "dataclasses.py", "enum.py", "functools.py",
                                       "inspect.py", "pathlib.py", "random.py", "textwrap.py", "typing.py")]
    data = prepare(files, work / "data", PrepareOptions(vocab_size=512, val_fraction=0.1), log=lambda *_: None)
    run = work / "run"
    cmd = [sys.executable, "-m", "trainforge", "train", "--run_dir", str(run), "--data.path", str(data),
           "--model.flavor", "debug", "--training.steps", str(steps), "--training.batch_size", "8",
           "--training.seq_len", "64", "--training.warmup_steps", "3", "--training.threads", "1",
           "--training.val_interval", "0", "--training.log_interval", str(steps), "--checkpoint.interval", "0",
           "--no_sample"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        raise SystemExit(f"training the debug checkpoint failed (rc {r.returncode}):\n{r.stderr[-2000:]}")
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, log_file, port: int) -> tuple[subprocess.Popen, list[str]]:
    cmd = ["serve", "--checkpoint", str(args.checkpoint), "--host", "127.0.0.1", "--port", str(port),
           "--model_name", "soak", "--max_batch_size", str(args.max_batch_size), "--max_queue",
           str(args.max_queue), "--max_concurrent", str(args.max_concurrent)]
    if args.hostile:
        cmd += ["--read_timeout_s", f"{args.read_timeout_s:g}", "--max_body_bytes", str(args.max_body_bytes)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.server_threads), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "trainforge", *cmd], stdout=log_file, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} while starting; see {log_file.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, cmd
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not answer /health within 120 s; see {log_file.name}")


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as {name{labels}: value}, without the rank label."""
    return read_exposition(httpx.get(url + "/metrics", timeout=10).text)


# -- clients ------------------------------------------------------------------------------------

class Tally:
    def __init__(self):
        self.latency_s: list[float] = []
        self.ttft_s: list[float] = []
        self.counts = {"ok": 0, "shed_429": 0, "hung_up": 0, "errors": 0}
        self.errors: list[str] = []

    def error(self, what: str) -> None:
        self.counts["errors"] += 1
        if len(self.errors) < 10:
            self.errors.append(what[:300])

    @classmethod
    def merged(cls, tallies: list["Tally"]) -> "Tally":
        out = cls()
        for t in tallies:
            out.latency_s += t.latency_s
            out.ttft_s += t.ttft_s
            out.errors += t.errors[:10 - len(out.errors)]
            for k, v in t.counts.items():
                out.counts[k] += v
        return out


def request_body(rng: random.Random, chat: bool, max_tokens: int, stream: bool) -> tuple[str, dict]:
    body = {"max_tokens": max_tokens, "stream": stream, "temperature": 0.8, "seed": rng.randrange(1 << 30),
            "ignore_eos": rng.random() < 0.5}
    if chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
    return "/v1/completions", {**body, "prompt": rng.choice(PROMPTS)}


async def plain(http: httpx.AsyncClient, path: str, body: dict, tally: Tally) -> int:
    t0 = time.perf_counter()
    r = await http.post(path, json=body)
    if r.status_code == 200:
        answer = r.json()
        # No tokens is an answer only when the first one was end-of-text (``ignore_eos`` is off half the time).
        if answer["usage"]["completion_tokens"] < 1 and answer["choices"][0]["finish_reason"] != "stop":
            tally.error(f"{path}: 200 with no tokens: {r.text}")
        else:
            tally.counts["ok"] += 1
            tally.latency_s.append(time.perf_counter() - t0)
    return r.status_code


async def streamed(http: httpx.AsyncClient, path: str, body: dict, tally: Tally) -> int:
    t0 = time.perf_counter()
    first, last = None, ""
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code
        async for line in r.aiter_lines():
            if line:
                first = first or time.perf_counter()
                last = line
    if last != "data: [DONE]":
        tally.error(f"{path}: stream ended without [DONE] (last line {last!r})")
    else:
        tally.counts["ok"] += 1
        tally.latency_s.append(time.perf_counter() - t0)
        tally.ttft_s.append(first - t0)
    return 200


async def hang_up(port: int, path: str, body: dict, delay_s: float) -> bool:
    """Send the request on a raw connection and close it after ``delay_s``. Returns False if
    a 429 came back first (shed, nothing to abort), else True."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    try:  # a 429 is immediate; an admitted request sends nothing (not streamed) or a 200 line
        status = await asyncio.wait_for(reader.readline(), delay_s)
    except asyncio.TimeoutError:
        status = b""
    if status and b" 429 " not in status:
        await asyncio.sleep(delay_s)  # streamed: hang up mid-stream, not at its first line
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return b" 429 " not in status


async def client(i: int, url: str, port: int, deadline: float, tally_now: Callable[[], Tally], max_tokens: int,
                 hostile: bool = False) -> None:
    """One well-behaved client until ``deadline``; ``tally_now()`` is where each outcome goes
    (the phase it happens in). With ``hostile``, hang-ups are the hostile clients' and a 429 is
    an error (the run is sized so that the well-behaved clients always fit)."""
    rng = random.Random(i)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while time.monotonic() < deadline:
            tally = tally_now()
            u = rng.random()
            chat = rng.random() < 0.25
            if u < 0.10 and not hostile:
                path, body = request_body(rng, chat, 4 * max_tokens, rng.random() < 0.5)
                admitted = await hang_up(port, path, body, rng.uniform(0.05, 0.5))
                tally.counts["hung_up" if admitted else "shed_429"] += 1
                continue
            path, body = request_body(rng, chat, rng.randint(8, max_tokens), u < 0.55)
            try:
                status = await (streamed if body["stream"] else plain)(http, path, body, tally)
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                tally.error(f"{path} stream={body['stream']}: {type(e).__name__}: {e}")
                continue
            if status == 429 and hostile:
                tally.error(f"{path} stream={body['stream']}: 429 although the well-behaved clients fit")
            elif status == 429:
                tally.counts["shed_429"] += 1
                await asyncio.sleep(rng.uniform(0.05, 0.25))
            elif status != 200:
                tally.error(f"{path} stream={body['stream']}: status {status}")


async def sample(pid: int, t_start: float, deadline: float, rss: list, load: list) -> None:
    while time.monotonic() < deadline:
        rss.append((time.monotonic() - t_start, rss_mib(pid)))
        load.append(os.getloadavg()[0])
        await asyncio.sleep(1.0)


async def soak(args, url: str, port: int, pid: int, phases: dict[str, Tally], hostile: HostileTally) -> dict:
    """Run the clients for ``duration_s``. Plain: one phase, "all". ``--hostile``: "warm-up"
    (``warmup_s``), then "baseline" and "hostile" (half of the rest each, the hostile clients
    only in the second), so both latencies come from the same server in the same run."""
    t_start = time.monotonic()
    deadline = t_start + args.duration_s
    t_hostile = t_start + args.warmup_s + (args.duration_s - args.warmup_s) / 2

    def tally_now() -> Tally:
        if not args.hostile:
            return phases["all"]
        now = time.monotonic()
        return phases["warm-up" if now < t_start + args.warmup_s else "baseline" if now < t_hostile else "hostile"]

    async def hostile_clients() -> None:
        await asyncio.sleep(t_hostile - time.monotonic())
        mid.update(await asyncio.to_thread(metrics, url), cpu=cpu_counters(), server_s=proc_cpu_s(pid))
        await asyncio.gather(*(slow_client(j, port, deadline, hostile, args.read_timeout_s)
                               for j in range(args.slow_clients)),
                             *(attacker(j, url, port, deadline, hostile, args.max_body_bytes)
                               for j in range(args.attackers)))

    rss: list[tuple[float, float]] = []
    load: list[float] = []
    mid: dict = {}  # --hostile: /metrics and CPU counters when the hostile half starts
    tasks = [asyncio.create_task(client(i, url, port, deadline, tally_now, args.max_tokens, args.hostile))
             for i in range(args.clients)]
    tasks.append(asyncio.create_task(sample(pid, t_start, deadline, rss, load)))
    if args.hostile:
        tasks.append(asyncio.create_task(hostile_clients()))
    await asyncio.sleep(args.warmup_s)
    m_warm = await asyncio.to_thread(metrics, url)
    c_warm, s_warm = cpu_counters(), proc_cpu_s(pid)
    t_warm = time.monotonic()
    n_warm = len(tally_now().latency_s)
    await asyncio.gather(*tasks)
    m_end = await asyncio.to_thread(metrics, url)
    window_s = time.monotonic() - t_warm
    return {"rss": rss, "load": load, "m_warm": m_warm, "m_end": m_end, "window_s": window_s, "n_warm": n_warm,
            "m_mid": mid, "c_warm": c_warm, "s_warm": s_warm, "c_end": cpu_counters(), "s_end": proc_cpu_s(pid)}


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) >= 2 else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=None, help="concurrent well-behaved clients (16; --hostile: 8)")
    p.add_argument("--duration_s", type=float, default=None, help="how long the clients run (180; --hostile: 100)")
    p.add_argument("--warmup_s", type=float, default=None,
                   help="RSS and tokens/s are measured after this (30; --hostile: 10)")
    p.add_argument("--hostile", action="store_true",
                   help="after the warm-up, half the time well-behaved clients alone (baseline), then with hostile "
                        "ones mixed in (bench/_soak_hostile.py); the well-behaved clients fit --max_concurrent, "
                        "so a 429 for them is an error too")
    p.add_argument("--slow_clients", type=int, default=None,
                   help="--hostile: slow-header / slow-body connections held at once (default max_concurrent + 2)")
    p.add_argument("--attackers", type=int, default=6, help="--hostile: clients sending the other attacks")
    p.add_argument("--read_timeout_s", type=float, default=5.0, help="--hostile: the server's --read_timeout_s")
    p.add_argument("--max_body_bytes", type=int, default=1 << 20, help="--hostile: the server's --max_body_bytes")
    p.add_argument("--checkpoint", default=None, help="checkpoint / run directory to serve (default: train a "
                                                      "debug one, about 30 s)")
    p.add_argument("--max_batch_size", type=int, default=8)
    p.add_argument("--max_queue", type=int, default=8)
    p.add_argument("--max_concurrent", type=int, default=None,
                   help="below --clients, so some load is shed (429) (12; --hostile: 16, above --clients + "
                        "--attackers, so nothing is shed)")
    p.add_argument("--max_tokens", type=int, default=96, help="largest max_tokens of a completed request "
                                                              "(hang-ups ask for 4x)")
    p.add_argument("--server_threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args()
    for name, plain, hostile in (("clients", 16, 8), ("duration_s", 180.0, 100.0), ("warmup_s", 30.0, 10.0),
                                 ("max_concurrent", 12, 16)):
        if getattr(args, name) is None:
            setattr(args, name, hostile if args.hostile else plain)
    if args.slow_clients is None:
        args.slow_clients = args.max_concurrent + 2  # more than every place: on a server that counted them, all 429
    if args.hostile and args.clients + args.attackers > args.max_concurrent:
        p.error("--hostile: --clients + --attackers (whose hang-ups are admitted) must fit --max_concurrent: a "
                "well-behaved 429 counts as an error")
    if not 5 <= args.warmup_s + 5 < args.duration_s:
        p.error("--duration_s must exceed --warmup_s + 5 (the RSS windows are 5 s)")

    work = Path(tempfile.mkdtemp(prefix="trainforge-soak-"))
    cpu, load_before = lscpu_summary(), os.getloadavg()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    args.trained = None
    if args.checkpoint is None:
        t0 = time.perf_counter()
        args.checkpoint = args.trained = debug_checkpoint(work, 30)
        print(f"trained a debug checkpoint in {time.perf_counter() - t0:.0f} s: {args.checkpoint}", flush=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = work / "server.log"
    phases = {name: Tally() for name in (("warm-up", "baseline", "hostile") if args.hostile else ("all",))}
    hostile = HostileTally()
    with open(log_path, "w") as log_file:
        proc, cmd = start_server(args, log_file, port)
        print(f"server pid {proc.pid} on {url}; {args.clients} clients for {args.duration_s:.0f} s "
              f"(warm-up {args.warmup_s:.0f} s)", flush=True)
        c0, s0 = cpu_counters(), proc_cpu_s(proc.pid)
        t0 = time.monotonic()
        try:
            run = asyncio.run(soak(args, url, port, proc.pid, phases, hostile))
            tally = Tally.merged(list(phases.values()))
            wall_s = time.monotonic() - t0
            c1, s1 = cpu_counters(), proc_cpu_s(proc.pid)
            idle_deadline = time.monotonic() + 10
            while True:
                m = metrics(url)
                if (m["trainforge_inference_running_requests"] == m["trainforge_inference_waiting_requests"] == 0
                        and m["trainforge_kv_cache_blocks_used"] == 0):
                    break
                if time.monotonic() > idle_deadline:
                    tally.error(f"server not idle 10 s after the last client: {m}")
                    break
                time.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    server_5xx = sum(v for k, v in m.items() if k.startswith("trainforge_http_requests_total") and 'status="5' in k)
    if server_5xx:
        tally.error(f"the server's /metrics counts {server_5xx:.0f} responses with status 5xx")
    log_text = log_path.read_text(errors="replace")
    if "Traceback" in log_text:
        tally.error("the server log holds a traceback: " + log_text[log_text.index("Traceback"):][:300])

    def median_between(lo: float, hi: float) -> float:
        return statistics.median(v for t, v in run["rss"] if lo <= t <= hi)

    # --hostile: from 10 s into the hostile half (its bodies and tokenizer buffers are working set, not growth).
    rss_from = args.warmup_s + (args.duration_s - args.warmup_s) / 2 + 10 if args.hostile else args.warmup_s
    rss_warm = median_between(rss_from, rss_from + 5)
    rss_end = median_between(args.duration_s - 5, args.duration_s)
    growth = (rss_end - rss_warm) / rss_warm
    mw, me = run["m_warm"], run["m_end"]
    tokens = me["trainforge_inference_generated_tokens_total"] - mw["trainforge_inference_generated_tokens_total"]
    aborted = me['trainforge_inference_requests_finished_total{reason="abort"}']
    c = tally.counts
    requests = sum(c.values())
    others_s = (c1["busy_s"] - c0["busy_s"]) - (c1["self_s"] - c0["self_s"]) - (s1 - s0)
    result = {
        "bench": "soak_serve", "date": date, "cpu": cpu, "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_max_during": round(max(run["load"]), 2), "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        "other_processes_share": round(max(0.0, others_s) / (wall_s * (os.cpu_count() or 1)), 3),
        "server_cpu_share": round((s1 - s0) / (wall_s * (os.cpu_count() or 1)), 3),
        "command": "trainforge " + " ".join(cmd if args.trained is None else cmd[:2] + ["DEBUG_RUN"] + cmd[3:]),
        "checkpoint": "debug flavor, trained 30 steps here" if args.trained else str(args.checkpoint),
        "clients": args.clients,
        "duration_s": args.duration_s, "warmup_s": args.warmup_s, **c, "requests": requests,
        "shed_share": round(c["shed_429"] / requests, 4) if requests else 0.0,
        "aborted_by_engine": int(aborted),
        "latency_p50_s": round(pct(tally.latency_s, 50), 4), "latency_p99_s": round(pct(tally.latency_s, 99), 4),
        "ttft_p50_s": round(pct(tally.ttft_s, 50), 4), "ttft_p99_s": round(pct(tally.ttft_s, 99), 4),
        "tokens_per_s": round(tokens / run["window_s"], 1),
        "rss_mib_start": round(run["rss"][0][1], 1), "rss_mib_after_warmup": round(rss_warm, 1),
        "rss_mib_end": round(rss_end, 1), "rss_mib_max": round(max(v for _, v in run["rss"]), 1),
        "rss_growth": round(growth, 4), "error_samples": tally.errors,
    }
    ok = c["errors"] == 0 and growth < GROWTH_LIMIT
    hung_up = c["hung_up"] + hostile.outcomes["hang_up"].get("hung_up", 0)
    rows_hostile = []
    if args.hostile:
        phase_s = (args.duration_s - args.warmup_s) / 2
        result["phases"] = {}
        mid, n_cpu = run["m_mid"], os.cpu_count() or 1
        bounds = {"baseline": (run["m_warm"], run["c_warm"], run["s_warm"], mid, mid["cpu"], mid["server_s"]),
                  "hostile": (mid, mid["cpu"], mid["server_s"], run["m_end"], run["c_end"], run["s_end"])}
        for name in ("baseline", "hostile"):
            t = phases[name]
            m0, c0_, s0_, m1, c1_, s1_ = bounds[name]
            key = "trainforge_inference_generated_tokens_total"
            share = {"tokens_per_s": round((m1[key] - m0[key]) / phase_s, 1),
                     "server_cpu_share": round((s1_ - s0_) / (phase_s * n_cpu), 3),
                     "bench_cpu_share": round((c1_["self_s"] - c0_["self_s"]) / (phase_s * n_cpu), 3)}
            result["phases"][name] = {"seconds": phase_s, **t.counts, **share,
                                      "latency_p50_s": round(pct(t.latency_s, 50), 4),
                                      "latency_p99_s": round(pct(t.latency_s, 99), 4),
                                      "ttft_p50_s": round(pct(t.ttft_s, 50), 4),
                                      "ttft_p99_s": round(pct(t.ttft_s, 99), 4)}
            rows_hostile.append((f"{name}: completed / errors / 429", f"{t.counts['ok']} / {t.counts['errors']} / "
                                                                     f"{t.counts['shed_429']}"))
            r = result["phases"][name]
            rows_hostile.append((f"{name}: latency p50 / p99, TTFT p50 / p99",
                                 f"{r['latency_p50_s'] * 1e3:.0f} / {r['latency_p99_s'] * 1e3:.0f} ms, "
                                 f"{r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p99_s'] * 1e3:.0f} ms"))
            rows_hostile.append((f"{name}: tokens/s; CPU share server / bench", f"{r['tokens_per_s']:.0f}; "
                                 f"{r['server_cpu_share']:.0%} / {r['bench_cpu_share']:.0%}"))
        result["hostile"] = h = {"slow_clients": args.slow_clients, "attackers": args.attackers,
                                 "read_timeout_s": args.read_timeout_s, **hostile.summary()}
        sent = {k: sum(v.values()) for k, v in h["outcomes"].items()}
        rows_hostile.append(("hostile requests sent", ", ".join(f"{k} {n}" for k, n in sent.items())))
        rows_hostile.append(("hostile: unexpected answers (target 0)", f"{h['unexpected']}"))
        rows_hostile.append(("slow clients cut after (max)", f"{h['slow_cut_s_max']} s (read_timeout_s "
                                                             f"{args.read_timeout_s:g})"))
        ok = ok and h["unexpected"] == 0
    result["pass"] = ok
    rows = [("requests", f"{requests} ({c['ok']} completed, {c['hung_up']} hung up, {c['shed_429']} shed)"),
            ("errors (target 0)", f"{c['errors']}"),
            ("shed share (429)", f"{result['shed_share']:.1%}"),
            ("admitted hang-ups / aborted in the engine", f"{hung_up} / {result['aborted_by_engine']}"),
            ("latency p50 / p99", f"{result['latency_p50_s'] * 1e3:.0f} / {result['latency_p99_s'] * 1e3:.0f} ms"),
            ("TTFT p50 / p99 (streamed)", f"{result['ttft_p50_s'] * 1e3:.0f} / {result['ttft_p99_s'] * 1e3:.0f} ms"),
            ("tokens/s (engine, after warm-up)", f"{result['tokens_per_s']:.0f}"),
            ("server RSS start / warm / end / max", f"{result['rss_mib_start']:.0f} / {rss_warm:.0f} / "
                                                    f"{rss_end:.0f} / {result['rss_mib_max']:.0f} MiB"),
            ("RSS growth over the hostile half, from +10 s (< 5%)" if args.hostile else
             "RSS growth after warm-up (< 5%)", f"{growth:+.2%}"),
            ("load average before / max / after", f"{load_before[0]:.2f} / {result['loadavg_max_during']:.2f} / "
                                                  f"{result['loadavg_after'][0]:.2f}"),
            ("other processes' CPU share", f"{result['other_processes_share']:.0%}"), *rows_hostile]
    print(f"\nCPU: {cpu.get('model')}, {cpu.get('cpus')} CPUs, hypervisor {cpu.get('hypervisor')}, "
          f"L3 {cpu.get('l3')}, SIMD {' '.join(cpu.get('simd', []))}")
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    for e in tally.errors + hostile.unexpected:
        print(f"  error: {e}")
    print(f"{'PASS' if ok else 'FAIL'}")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
