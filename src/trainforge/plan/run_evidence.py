"""What a finished (or stopped) run measured, read into typed evidence for the advisor.

    ev = read_run(Path("runs/x"))          # config.toml + metrics.jsonl
    ev.median("step_s"), ev.stage_compute_s, ev.tokens_per_s
    serve = read_inference(Path("stats.json"))   # generate --stats JSON, /metrics scrape, bench JSON

A run directory holds the resolved ``config.toml`` and one JSON record per step
(``docs/metrics.md`` names every key). Steady state is what matters for advice: the first
logging window holds warm-up (allocator growth, DDP's bucket rebuild, a pipeline's shape
inference), so it is dropped whenever a later window exists; per-step times are medians
over the rest (robust to one slow step on a shared machine), windowed rates (tokens/s,
MFU) the median over windows. Inference measurements come in three shapes and are read
into one ``ServeEvidence``.

Errors name the file and the fix (``TrainforgeError``: one line, exit 2)."""

from __future__ import annotations

import json
import math
import re
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainforge.errors import TrainforgeError
from trainforge.monitor.jsonl import is_number as _num


@dataclass
class RunEvidence:
    """The run's config (the dict of its ``config.toml``) and its steady-state measurements.

    ``records``: the training records (those with ``loss``) after the first logging window;
    ``windows``: one record per logging window (same set), for windowed rates."""

    run_dir: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    windows: list[dict[str, Any]]
    last: dict[str, Any] = field(default_factory=dict)  # the newest training record, all keys

    def section(self, name: str) -> dict[str, Any]:
        return self.config.get(name, {}) or {}

    def cfg(self, dotted: str, default: Any = None) -> Any:
        """``cfg("parallel.pp")``: a config value, ``default`` where the file leaves it out."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def median(self, key: str) -> float | None:
        """Median over steady-state steps of a numeric per-step key; None if never recorded."""
        vals = [r[key] for r in self.records if _num(r.get(key))]
        return statistics.median(vals) if vals else None

    def window_median(self, key: str) -> float | None:
        vals = [r[key] for r in self.windows if _num(r.get(key))]
        return statistics.median(vals) if vals else None

    def max(self, key: str) -> float | None:
        vals = [r[key] for r in self.records if _num(r.get(key))]
        return max(vals) if vals else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.window_median("tokens_per_s")

    @property
    def device(self) -> str:
        """"cuda" when the run recorded CUDA allocator figures, else "cpu"."""
        return "cuda" if any("gpu_memory_reserved_bytes" in r for r in self.records[-3:]) else "cpu"

    @property
    def world_size(self) -> int:
        deg = self.last.get("parallel_degree")
        if isinstance(deg, dict) and deg:
            return math.prod(int(v) for v in deg.values() if _num(v))
        return 1

    def degree(self, axis: str) -> int:
        deg = self.last.get("parallel_degree")
        if isinstance(deg, dict) and _num(deg.get(axis)):
            return int(deg[axis])
        v = self.cfg(f"parallel.{axis}", 1)
        return int(v) if _num(v) and v > 0 else 1

    @property
    def stage_compute_s(self) -> list[float] | None:
        """Median per-stage compute seconds (virtual stages included), or None without a pipeline."""
        rows = [r["stage_compute_s"] for r in self.windows if isinstance(r.get("stage_compute_s"), list)
                and r["stage_compute_s"] and all(_num(v) for v in r["stage_compute_s"])]
        if not rows or len({len(r) for r in rows}) != 1:
            return None
        return [statistics.median(col) for col in zip(*rows)]

    @property
    def monitor_share(self) -> float | None:
        """Share of wall time spent in the monitor's own code (``monitor_s`` is a counter)."""
        pts = [(r["time_unix_s"], r["monitor_s"]) for r in self.windows
               if _num(r.get("time_unix_s")) and _num(r.get("monitor_s"))]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return max(0.0, (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]))

    @property
    def wall_per_step_s(self) -> float | None:
        """Wall seconds per optimizer step as tokens/s measures it: tokens per step / tokens/s
        (``tokens`` is step x tokens per step)."""
        tps = self.tokens_per_s
        r = self.last
        if not tps or not _num(r.get("tokens")) or not r.get("step"):
            return None
        return r["tokens"] / r["step"] / tps

    @property
    def top_ops(self) -> dict[str, float]:
        for r in reversed(self.records):
            if isinstance(r.get("top_ops"), dict):
                return {k: float(v) for k, v in r["top_ops"].items() if _num(v)}
        return {}

    @property
    def profiled_steps(self) -> int:
        return sum(isinstance(r.get("top_ops"), dict) for r in self.records)


def read_run(run_dir: str | Path) -> RunEvidence:
    """Read ``run_dir``'s config.toml and metrics.jsonl. Raises TrainforgeError naming what
    is missing: no directory, no config, no training record."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise TrainforgeError(f"run directory {run_dir} does not exist; give a directory `trainforge train` wrote")
    cfg_file = run_dir / "config.toml"
    if not cfg_file.is_file():
        raise TrainforgeError(f"{run_dir}: no config.toml there; is it a trainforge run directory?")
    try:
        config = tomllib.loads(cfg_file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TrainforgeError(f"{cfg_file} is not valid TOML ({' '.join(str(e).split())}); "
                              "restore the file `trainforge train` wrote") from None
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise TrainforgeError(f"{run_dir}: no metrics.jsonl there; run `trainforge train` into it first")
    recs: list[dict[str, Any]] = []
    for line in metrics.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash mid-write
        if isinstance(r, dict) and "loss" in r and _num(r.get("step")):
            recs.append(r)
    if not recs:
        raise TrainforgeError(f"{metrics} has no training record (a line with 'loss'); the run logged nothing "
                              "to advise on: train for at least one logging interval")
    # A resumed run appends: keep the newest record per step.
    by_step = {r["step"]: r for r in recs}
    recs = [by_step[s] for s in sorted(by_step)]
    # One record per window: the window's records share time_unix_s and tokens_per_s.
    windows: list[list[dict[str, Any]]] = []
    for r in recs:
        key = (r.get("time_unix_s"), r.get("tokens_per_s"))
        if windows and (windows[-1][0].get("time_unix_s"), windows[-1][0].get("tokens_per_s")) == key:
            windows[-1].append(r)
        else:
            windows.append([r])
    steady = windows[1:] if len(windows) > 1 else windows
    return RunEvidence(run_dir, config, [r for w in steady for r in w], [w[-1] for w in steady], recs[-1])


# ------------------------------------------------------------------------ inference


@dataclass
class ServeEvidence:
    """Inference measurements, whatever file they came from. None = not measured.

    ``engine``: the serving knobs the measurement ran with, where the source says
    (``max_batch_size``...); ``variants``: bench/inference.py's per-variant decode tok/s and
    greedy agreement with fp32 on a trained checkpoint where measured
    (``{"int8": {"decode_tok_s": 310.0, "agreement": 0.97}}``)."""

    source: str
    kind: str  # "engine-stats" (generate --stats), "prometheus" (serve's /metrics), "bench-inference"
    decode_tokens_per_s: float | None = None
    blocks_total: float | None = None
    blocks_peak: float | None = None
    blocks_used: float | None = None
    waiting: float | None = None
    rejected: float | None = None
    peak_batch: float | None = None
    running: float | None = None
    quant_kernels: dict[str, int] | None = None
    fusions: dict[str, int] | None = None
    spec_mean_accepted_length: float | None = None
    spec_drafted: float | None = None
    variants: dict[str, dict[str, float]] = field(default_factory=dict)
    batching_ratio: dict[int, float] = field(default_factory=dict)

    @property
    def server_load(self) -> bool:
        """Whether this measures a server's load (a scrape of ``trainforge serve``'s /metrics).
        ``generate --stats`` (``engine-stats``) runs one request with a KV pool and one batch
        row sized for exactly it; bench/inference.py has no pool: neither says how big a
        server's pool or batch should be."""
        return self.kind == "prometheus"

    @property
    def kv_peak_share(self) -> float | None:
        peak = self.blocks_peak if self.blocks_peak is not None else self.blocks_used
        if peak is None or not self.blocks_total:
            return None
        return peak / self.blocks_total


def read_inference(path: str | Path) -> ServeEvidence:
    """Read one inference measurement file: ``trainforge generate --stats`` JSON (one
    object, ``engine.stats()``), bench/inference.py ``--json`` output, or a Prometheus
    text scrape of ``trainforge serve``'s /metrics. TrainforgeError when it is none of these."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise TrainforgeError(f"--inference {path}: cannot be read ({why}); give a `trainforge generate --stats` "
                              "JSON file, a bench/inference.py --json file or a /metrics scrape") from None
    if text.lstrip().startswith("{") or any(ln.lstrip().startswith("{") for ln in text.splitlines()):
        try:
            data = json.loads(_last_json_object(text))
        except json.JSONDecodeError as e:
            raise TrainforgeError(f"--inference {path}: not valid JSON ({e.msg} at line {e.lineno}); give the "
                                  "line `trainforge generate --stats` prints to stderr") from None
        if "results" in data and "machine" in data:
            return _from_bench(str(path), data)
        if "decode_tokens_per_s" in data or "kv_pool" in data:
            return _from_stats(str(path), data)
        raise TrainforgeError(f"--inference {path}: a JSON object with neither 'kv_pool' (generate --stats) nor "
                              "'results' (bench/inference.py --json); give one of those")
    if re.search(r"^trainforge_\w+", text, re.M):
        return _from_prometheus(str(path), text)
    raise TrainforgeError(f"--inference {path}: neither JSON nor a Prometheus scrape of trainforge serve "
                          "(no trainforge_* sample); save `curl HOST:PORT/metrics` or the --stats line")


def _last_json_object(text: str) -> str:
    """generate --stats writes one JSON line to stderr; a saved stderr may hold log lines
    before it. The JSON is the whole text, or its last line that is an object."""
    try:
        json.loads(text)
        return text
    except json.JSONDecodeError:
        lines = [ln for ln in text.splitlines() if ln.strip().startswith("{")]
        return lines[-1] if lines else text


def _f(v: Any) -> float | None:
    return float(v) if _num(v) else None


def _from_stats(source: str, d: dict[str, Any]) -> ServeEvidence:
    pool = d.get("kv_pool") if isinstance(d.get("kv_pool"), dict) else {}
    return ServeEvidence(source, "engine-stats", decode_tokens_per_s=_f(d.get("decode_tokens_per_s")),
                         blocks_total=_f(pool.get("blocks_total")), blocks_peak=_f(pool.get("blocks_peak")),
                         blocks_used=_f(pool.get("blocks_used")), waiting=_f(d.get("waiting")),
                         rejected=_f(d.get("rejected")), peak_batch=_f(d.get("peak_batch")),
                         running=_f(d.get("running")),
                         quant_kernels=d.get("quant_kernels") if isinstance(d.get("quant_kernels"), dict) else None,
                         fusions=d.get("fusions") if isinstance(d.get("fusions"), dict) else None,
                         spec_mean_accepted_length=_f(d.get("spec_mean_accepted_length")),
                         spec_drafted=_f(d.get("spec_drafted_tokens")))


_PROM = {  # Prometheus sample name -> ServeEvidence field (docs/metrics.md)
    "trainforge_kv_cache_blocks_capacity": "blocks_total",
    "trainforge_kv_cache_blocks_used": "blocks_used",
    "trainforge_inference_waiting_requests": "waiting",
    "trainforge_inference_running_requests": "running",
    "trainforge_inference_requests_rejected_total": "rejected",
    "trainforge_speculative_mean_accepted_length": "spec_mean_accepted_length",
    "trainforge_speculative_drafted_tokens_total": "spec_drafted",
}


def _from_prometheus(source: str, text: str) -> ServeEvidence:
    from prometheus_client.parser import text_string_to_metric_families

    ev = ServeEvidence(source, "prometheus")
    gen = dec = None
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                name = s.name
                if name in _PROM:
                    setattr(ev, _PROM[name], (getattr(ev, _PROM[name]) or 0.0) + float(s.value))
                elif name == "trainforge_inference_generated_tokens_total":
                    gen = (gen or 0.0) + float(s.value)
                elif name == "trainforge_inference_decode_steps_total":
                    dec = (dec or 0.0) + float(s.value)
    except ValueError as e:
        raise TrainforgeError(f"--inference {source}: not a valid Prometheus text scrape ({e})") from None
    if gen and dec:
        ev.peak_batch = gen / dec  # tokens per decode step: the mean batch (no peak in a scrape)
    return ev


def _from_bench(source: str, d: dict[str, Any]) -> ServeEvidence:
    """bench/inference.py --json: the first size's variants (decode tok/s median) and, where the
    bench was given ``--agreement_checkpoint``, each quantised mode's greedy agreement on that
    trained checkpoint. The variants' own agreement was measured on random weights, whose
    near-uniform logits flip under any perturbation (int8 68.8% there, 98.8% trained): a proxy
    the bench does not judge, so it is not evidence here either."""
    results = d.get("results") or {}
    if not isinstance(results, dict) or not results:
        raise TrainforgeError(f"--inference {source}: bench/inference.py JSON without results")
    size = next(iter(results.values()))
    trained = d.get("trained_agreement") if isinstance(d.get("trained_agreement"), dict) else {}
    ev = ServeEvidence(source, "bench-inference")
    for name, v in (size.get("variants") or {}).items():
        tok = v.get("decode_tok_s")
        med = tok.get("median") if isinstance(tok, dict) else tok
        if _num(med):
            row = {"decode_tok_s": float(med)}
            agree = trained.get(name)
            if isinstance(agree, dict) and _num(agree.get("teacher_forced")):
                row["agreement"] = float(agree["teacher_forced"])
            ev.variants[name] = row
    for n, b in (size.get("batching") or {}).items():
        r = b.get("ratio") if isinstance(b, dict) else None
        r = r.get("median") if isinstance(r, dict) else r
        if _num(r):
            ev.batching_ratio[int(n)] = float(r)
    if "fp32" in ev.variants:
        ev.decode_tokens_per_s = ev.variants["fp32"]["decode_tok_s"]
        ev.quant_kernels = {}
    return ev
