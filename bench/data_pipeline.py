"""Data pipeline: a plain ``torch.utils.data.DataLoader`` reading from a slow source
against trainforge's cached + prefetching loader (``data/pipeline.py``: the object the
trainer uses), both reading the same prepared shards from the same throttled server.

    python bench/data_pipeline.py                     # HDD-like source, 3 repeats, ~3 min on 2 cores
    python bench/data_pipeline.py --profile network   # object-store-like: 25 ms first byte, 50 MB/s, parallel
    python bench/data_pipeline.py --json out.json     # also keep every sample
    python bench/data_pipeline.py --flavor debug --phases train --train_steps 60 --trainer_steps 0
                                                      # fast steps: the loader's speed shows in the I/O wait

The slow tier is a local HTTP server in this process (Range requests supported):
``hdd`` = one request at a time (one spindle), 8 ms per request + 150 MB/s;
``network`` = concurrent requests, 25 ms + 50 MB/s each.

A  plain: a map-style ``Dataset`` whose ``__getitem__`` reads one window (seq_len + 1
   tokens) with an HTTP Range request (urllib), ``DataLoader(batch_size, shuffle=True,
   num_workers=2, persistent_workers=True, drop_last=True)``: what a PyTorch user
   writes for a remote token store.
B  trainforge: ``open_data`` + ``build_loader`` with ``data.path`` = the server's URL,
   a disk tier in a fresh temporary directory (cold at the start of every sample),
   ``data.cache.memory_mb`` 64, ``prefetch_depth`` 8, ``fetch_workers`` 4.

Every sample runs in its own subprocess (clean peak-memory numbers, no shared page or
import state), A and B alternating (A B, B A, A B ...). Two phases per sample:

* load: iterate two full epochs without training; epoch-2 loading throughput is
  tokens/s of the second pass (the first is dominated by the source for both).
* train: the tiny model (AdamW, batch 8 x 256 tokens, 2 torch threads) for
  ``--train_steps`` steps from a cold start; I/O wait fraction = time blocked in
  "next batch" / loop time (also reported without the first step, which holds the
  DataLoader's worker start-up and the cache's first fetches).

Last, ``trainforge train`` itself (tiny, ``--trainer_steps``) trains from the same URL
once, and the ``data_*`` metrics of its metrics.jsonl are printed (I/O wait fraction per
logging window after the first, which also holds start-up and the first fetches).

Memory: peak RSS of the sample's process and of its largest child (the DataLoader
workers), and for B the cache's memory-tier peak and disk-tier bytes. Headlines are
medians over repeats; the goals are I/O wait < 5% with B and an epoch-2 throughput
ratio B/A >= 5.8x. A benchmark, not a test: it prints PASS/FAIL and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import http.server
import json
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

PROFILES = {"hdd": {"latency_ms": 8.0, "bandwidth_mbs": 150.0, "serial": True},
            "network": {"latency_ms": 25.0, "bandwidth_mbs": 50.0, "serial": False}}
SEQ, BATCH, SEED = 256, 8, 1234


# -- the slow tier ------------------------------------------------------------------------------

def start_server(root: Path, latency_s: float, bandwidth_bps: float, serial: bool) -> tuple[str, object]:
    files = {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}
    spindle = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _body(self) -> tuple[int, bytes, dict] | None:
            data = files.get(unquote(urlparse(self.path).path).lstrip("/"))
            if data is None:
                self.send_error(404)
                return None
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                start, end = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
                return 206, data[start:end + 1], {"Content-Range": f"bytes {start}-{end}/{len(data)}"}
            return 200, data, {}

        def _send(self, with_body: bool) -> None:
            got = self._body()
            if got is None:
                return
            status, body, extra = got
            cost = latency_s + len(body) / bandwidth_bps
            if serial:
                with spindle:  # one head: requests queue up
                    time.sleep(cost)
            else:
                time.sleep(cost)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Accept-Ranges", "bytes")
            for k, v in extra.items():
                self.send_header(k, v)
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def do_GET(self) -> None:
            self._send(True)

        def do_HEAD(self) -> None:
            self._send(False)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def prepare_data(out: Path, tokens: int, shard_tokens: int) -> Path:
    """A subset of the Python standard library (sorted file names, ~4 bytes per token)."""
    from trainforge.data.prepare import PrepareOptions, prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for p in sorted(stdlib.glob("*.py")):
        files.append(str(p))
        total += p.stat().st_size
        if total >= tokens * 4:
            break
    return prepare(files, out, PrepareOptions(vocab_size=8192, shard_tokens=shard_tokens), log=lambda *_: None)


# -- the two loaders (run inside a sample's subprocess) ------------------------------------------

class RangeWindows:
    """Map-style dataset: window i = one HTTP Range request (module level: picklable for
    any DataLoader start method)."""

    def __init__(self, url: str, manifest: dict):
        from trainforge.data.sampler import window_index

        self.url, self.files = url, [e["file"] for e in manifest["splits"]["train"]]
        self.windows = window_index([e["tokens"] for e in manifest["splits"]["train"]], SEQ)
        self.dtype = manifest["dtype"]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int):
        from urllib.request import Request, urlopen

        import numpy as np
        import torch

        dtype = np.dtype(self.dtype).newbyteorder("<")
        shard, offset = self.windows[i]
        a = int(offset) * dtype.itemsize
        req = Request(f"{self.url}/{self.files[shard]}",
                      headers={"Range": f"bytes={a}-{a + (SEQ + 1) * dtype.itemsize - 1}"})
        with urlopen(req, timeout=60) as r:
            raw = r.read()
        return torch.from_numpy(np.frombuffer(raw, dtype=dtype).astype(np.int64))  # (T+1,)


class PlainEpochs:
    """``next()`` like trainforge's loader over a DataLoader; a new epoch when one runs out."""

    def __init__(self, dl):
        self.dl, self.batches_per_epoch, self.it = dl, len(dl), iter(dl)

    def close(self) -> None:
        # Join the worker processes, so RUSAGE_CHILDREN includes their peak RSS.
        del self.it
        self.dl = None
        gc.collect()

    def next(self):
        try:
            rows = next(self.it)
        except StopIteration:
            self.it = iter(self.dl)
            rows = next(self.it)
        return rows[:, :-1], rows[:, 1:]  # (B, T)


def plain_loader(url: str, manifest: dict, workers: int):
    import torch

    dl = torch.utils.data.DataLoader(RangeWindows(url, manifest), batch_size=BATCH, shuffle=True,
                                     num_workers=workers, persistent_workers=workers > 0, drop_last=True,
                                     generator=torch.Generator().manual_seed(SEED))
    return PlainEpochs(dl), None


def trainforge_loader(url: str, cache_dir: str):
    from trainforge.config import load_config
    from trainforge.data.pipeline import build_loader, open_data

    dcfg = load_config(None, ["--data.path", url, "--data.cache.dir", cache_dir, "--data.cache.memory_mb", "64",
                              "--data.prefetch_depth", "8", "--data.fetch_workers", "4"]).data
    data = open_data(dcfg, log=lambda m: print(m, file=sys.stderr))
    loader = build_loader(data, "train", dcfg, SEQ, BATCH, SEED)

    def cache_stats() -> dict:
        return {"cache_memory_peak_mb": round(data.cache.memory.peak / 2**20, 2),
                "cache_disk_mb": round(data.cache.disk.used / 2**20, 2)}
    return loader, cache_stats


def sample(args) -> dict:
    import torch

    torch.set_num_threads(2)
    manifest = json.loads((Path(args.data) / "manifest.json").read_text())
    with tempfile.TemporaryDirectory() as cache_dir:
        if args.arm == "plain":
            loader, extra = plain_loader(args.url, manifest, args.workers)
        else:
            loader, extra = trainforge_loader(args.url, cache_dir)
        out: dict = {"arm": args.arm, "phase": args.phase}
        if args.phase == "load":
            for epoch in (1, 2):
                t0 = time.perf_counter()
                for _ in range(loader.batches_per_epoch):
                    loader.next()
                dt = time.perf_counter() - t0
                out[f"epoch{epoch}_s"] = round(dt, 3)
                out[f"epoch{epoch}_tokens_per_s"] = loader.batches_per_epoch * BATCH * SEQ / dt
        else:
            from trainforge.config import ModelSection
            from trainforge.model import build_model, model_config_from_section

            mcfg = model_config_from_section(ModelSection(flavor=args.flavor), manifest["vocab_size"], SEQ)
            model = build_model(mcfg, "cpu", seed=SEED)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            waits, steps = [], []
            for _ in range(args.train_steps):
                t0 = time.perf_counter()
                x, y = loader.next()
                t1 = time.perf_counter()
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                waits.append(t1 - t0)
                steps.append(time.perf_counter() - t0)
            loss.item()
            out.update(io_wait_frac=sum(waits) / sum(steps), io_wait_frac_steady=sum(waits[1:]) / sum(steps[1:]),
                       step_s=statistics.median(steps[1:]))
        out.update(extra() if extra else {})
        if hasattr(loader, "close"):
            loader.close()
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["workers_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return out


# -- driver ---------------------------------------------------------------------------------------

def run_sample(arm: str, phase: str, url: str, data: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--_sample", "--arm", arm, "--phase", phase, "--url", url, "--data", str(data),
           "--train_steps", str(args.train_steps), "--workers", str(args.workers), "--flavor", args.flavor]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"sample {arm}/{phase} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def trainer_check(url: str, steps: int) -> dict:
    """``trainforge train`` itself on the slow URL: the data_* metrics it logs."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "trainforge", "train", "--run_dir", f"{tmp}/run", "--data.path", url,
               "--data.cache.dir", f"{tmp}/cache", "--model.flavor", "tiny", "--training.steps", str(steps),
               "--training.batch_size", str(BATCH), "--training.seq_len", str(SEQ), "--training.log_interval", "2",
               "--training.val_interval", "0", "--training.val_batches", "1", "--training.threads", "2",
               "--sample.max_new_tokens", "0"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise SystemExit(f"trainforge train failed:\n{r.stderr[-3000:]}")
        records = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
    # The records of one logging window share its data_* values: keep the window's last.
    rows = [rec for rec in records if "data_io_wait_frac" in rec and rec["step"] % 2 == 0]
    return {"windows": len(rows), "io_wait_frac_after_first_window": statistics.median(
                r["data_io_wait_frac"] for r in rows[1:]) if len(rows) > 1 else float("nan"),
            "first_window": {k: v for k, v in rows[0].items() if k.startswith("data_")},
            "last_window": {k: v for k, v in rows[-1].items() if k.startswith("data_")}}


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="hdd")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train_steps", type=int, default=6,
                   help="tiny-model steps per train sample (a step takes seconds on 2 CPU cores)")
    p.add_argument("--tokens", type=int, default=400_000, help="approximate size of the training set")
    p.add_argument("--shard_tokens", type=int, default=32_768)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes of the plain loader")
    p.add_argument("--flavor", default="tiny", help="model of the train samples (debug: fast steps, so the "
                                                   "loader's speed shows in the I/O wait)")
    p.add_argument("--phases", default="load,train", help="comma-separated: load, train")
    p.add_argument("--trainer_steps", type=int, default=10,
                   help="also run `trainforge train` (tiny) this many steps on the slow URL; 0 = skip")
    p.add_argument("--json", default=None)
    p.add_argument("--_sample", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", choices=["plain", "trainforge"])
    p.add_argument("--phase", choices=["load", "train"])
    p.add_argument("--url")
    p.add_argument("--data")
    args = p.parse_args()
    if args._sample:
        print(json.dumps(sample(args)))
        return

    prof = PROFILES[args.profile]
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_data(Path(tmp) / "data", args.tokens, args.shard_tokens)
        manifest = json.loads((data / "manifest.json").read_text())
        n_train = sum(e["tokens"] for e in manifest["splits"]["train"])
        url, server = start_server(data, prof["latency_ms"] / 1e3, prof["bandwidth_mbs"] * 1e6, prof["serial"])
        print(f"source: {args.profile} ({prof['latency_ms']} ms/request, {prof['bandwidth_mbs']} MB/s, "
              f"{'serial' if prof['serial'] else 'concurrent'}); {n_train:,} train tokens in "
              f"{len(manifest['splits']['train'])} shards; batch {BATCH} x {SEQ}; {os.cpu_count()} CPUs; "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        results: dict[str, list[dict]] = {"plain": [], "trainforge": []}
        for i in range(args.repeats):
            order = ["plain", "trainforge"] if i % 2 == 0 else ["trainforge", "plain"]
            for phase in args.phases.split(","):
                for arm in order:
                    r = run_sample(arm, phase, url, data, args)
                    r["repeat"] = i
                    results[arm].append(r)
                    print(f"  repeat {i} {arm:10s} {phase}: " + ", ".join(
                        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                        if k not in ("arm", "phase", "repeat")), flush=True)
        check = trainer_check(url, args.trainer_steps) if args.trainer_steps else None
        server.shutdown()

    load = {a: [r for r in rs if r["phase"] == "load"] for a, rs in results.items()}
    train = {a: [r for r in rs if r["phase"] == "train"] for a, rs in results.items()}
    ratios = [b["epoch2_tokens_per_s"] / a["epoch2_tokens_per_s"] for a, b in zip(load["plain"], load["trainforge"])]
    ratio = statistics.median(ratios) if ratios else float("nan")
    wait_b = med(train["trainforge"], "io_wait_frac") if train["trainforge"] else float("nan")
    print(f"\nmedians over {args.repeats} repeats ({time.perf_counter() - t_start:.0f} s):")
    print(f"{'':28s}{'plain DataLoader':>18s}{'trainforge':>14s}")
    rows = [("epoch-1 load tokens/s", "epoch1_tokens_per_s", load, "{:,.0f}"),
            ("epoch-2 load tokens/s", "epoch2_tokens_per_s", load, "{:,.0f}"),
            ("train I/O wait fraction", "io_wait_frac", train, "{:.2%}"),
            ("  without the first step", "io_wait_frac_steady", train, "{:.2%}"),
            ("train step s (median)", "step_s", train, "{:.3f}"),
            ("peak RSS MB, load", "rss_mb", load, "{:.0f}"),
            ("peak RSS MB, train", "rss_mb", train, "{:.0f}"),
            ("largest worker RSS MB, train", "workers_rss_mb", train, "{:.0f}")]
    for label, key, src, fmt in rows:
        if not src["plain"]:
            continue
        print(f"{label:28s}{fmt.format(med(src['plain'], key)):>18s}{fmt.format(med(src['trainforge'], key)):>14s}")
    cache_rows = load["trainforge"] or train["trainforge"]
    print(f"{'cache memory tier peak MB':28s}{'-':>18s}{med(cache_rows, 'cache_memory_peak_mb'):>14.2f}")
    print(f"{'cache disk tier MB':28s}{'-':>18s}{med(cache_rows, 'cache_disk_mb'):>14.2f}")
    if ratios:
        print(f"\nepoch-2 loading throughput ratio (trainforge / plain): median {ratio:.1f}x (per repeat "
              f"{', '.join(f'{r:.1f}' for r in ratios)}): {'PASS' if ratio >= 5.8 else 'FAIL'} (goal >= 5.8x)")
    if train["trainforge"]:
        print(f"trainforge I/O wait fraction while training: median {wait_b:.2%}: "
              f"{'PASS' if wait_b < 0.05 else 'FAIL'} (goal < 5%)")
    if check is not None:
        print(f"\n`trainforge train` on the same source, {args.trainer_steps} steps: data_io_wait_frac median "
              f"{check['io_wait_frac_after_first_window']:.2%} over logging windows 2..{check['windows']}; "
              f"first window {check['first_window']}; last window {check['last_window']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": args.profile, "args": vars(args), "results": results,
                                               "epoch2_ratio": ratios, "trainer_check": check}, indent=2))


if __name__ == "__main__":
    main()
