"""Hourglass against dense (issue 22): training speed, memory and loss, the ``auto`` length
schedule, and batch-1 decode, for an hourglass flavor and the dense flavor of about its size.

    OMP_NUM_THREADS=1 python -m bench.hourglass                 # hourglass-tiny vs tiny
    OMP_NUM_THREADS=1 python -m bench.hourglass --quick         # smoke run
    OMP_NUM_THREADS=1 python -m bench.hourglass --pair small    # hourglass-small vs small (slow)

On a 2-core machine at one thread the default is ~17 minutes of work in 7 locked jobs of 2-3
minutes (6 training rounds, then decode), ``--quick`` ~1 minute; waiting for the lock comes on top.
Do not wrap the command in ``flock --lock``: it takes the lock per job itself, and a job waiting
for a lock its own parent holds never starts (``--lock ''`` runs unlocked).

Training: three arms through the real trainer on the built-in corpus, with the same steps,
seed, batch and tokens per step: ``dense`` (the pair's dense flavor, fixed length),
``hourglass`` (the hourglass flavor, fixed length) and ``hourglass-auto`` (the hourglass flavor,
``training.seq_len_schedule = auto``). They run by ``bench/seq_len_schedule.py``'s machinery:
segments of ``--segment`` steps continued by exact resume, round k = segment k of every arm
(order rotating) as one job under ``flock --lock``, so a change of machine load falls on every
arm alike. Read back from each run's ``metrics.jsonl``:

- training tokens/s per round: the tokens of the arm's segment over its training seconds
  (per logging window: tokens / tokens_per_s; validation, checkpoints and process starts
  excluded). The ratios hourglass / dense and hourglass-auto / hourglass are paired within a
  round and summarised over rounds as median, IQR and min-max (``ab_worktree.summarise``);
- peak memory, two figures: the trainer's ``peak_memory_bytes``, which on CPU is the peak RSS
  of the process (``ru_maxrss``: interpreter, torch, corpus and model included, so it moves
  little), max over the arm's segment processes; and the trainer's ``mem_tracked_bytes``
  (parameters, gradients, optimizer state and the activations saved for backward, counted on
  one forward), whose activation part is where shortening saves;
- validation loss (the fixed validation set, at full ``--seq_len``) at equal steps, and at equal
  training wall time: both curves of a comparison against their training seconds, at the
  shorter arm's total (``seq_len_schedule.at_time``).

Decode: one more locked job. The inference engine (``EngineConfig(max_batch_size=1)``) on each
flavor, seeded random weights (speed does not depend on them), prepared as the server does
(``prepare_model``); greedy, EOS ignored, ``--new_tokens`` from a ``--prompt_tokens`` prompt.
Decode tok/s = (n - 1) / (last token - first token) (``engine_speed.decode_tok_s``), one
warm-up, then ``--decode_rounds`` rounds with the order alternating, ratio paired per round.
KV-cache bytes per token: the engine's ``stats()["kv_bytes_per_token"]`` where it reports one,
else ``stats()["kv_pool_bytes"]`` over the pool's token slots; beside it, the figure the
shape implies (every block's keys and values at its stage's width, over its shortening). An
engine build that cannot decode the hourglass flavor (``ConfigError`` at construction) gets
"decode: hourglass not supported by this engine build" and the dense figures only.

A benchmark, not a test: it prints tables, the issue's targets at k = 2 (>= 1.3x training and
decode tokens/s, validation loss within 2% of dense at equal steps, better at equal time) as
met or not, optionally ``--json``, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.ab_worktree import summarise
from bench.seq_len_schedule import arm_args, at_time, read_run, run_round, run_rounds, segment, segment_ends

PAIRS = {"tiny": ("tiny", "hourglass-tiny"), "small": ("small", "hourglass-small")}
ARMS = {"dense": ("dense", "fixed"), "hourglass": ("hourglass", "fixed"), "hourglass-auto": ("hourglass", "auto")}
# (candidate, baseline): the training comparisons, each paired per round.
COMPARISONS = (("hourglass", "dense"), ("hourglass-auto", "hourglass"))
TARGETS = {"train_tok_s_ratio": 1.3, "decode_tok_s_ratio": 1.3, "val_loss_rel_gap": 0.02}

# Per mode and pair: sized so a round (one segment of each of the three arms, with their
# process starts and validations) stays under ~3 minutes of lock on a 2-core machine at one
# thread (tiny ~1,600 tok/s; small ~10x slower). tiny's default is 600 steps (~17 minutes of
# work): at 120 steps the arms' loss gap was smaller than one arm's seed-to-seed spread.
DEFAULTS = {
    ("default", "tiny"): dict(steps=600, segment=100, batch=4, seq_len=256, val_interval=50, val_batches=8,
                              log_interval=10, warmup=30, new_tokens=128, decode_rounds=6),
    ("quick", "tiny"): dict(steps=20, segment=10, batch=4, seq_len=256, val_interval=10, val_batches=2,
                            log_interval=5, warmup=5, new_tokens=32, decode_rounds=2),
    ("default", "small"): dict(steps=40, segment=10, batch=2, seq_len=256, val_interval=10, val_batches=2,
                               log_interval=2, warmup=8, new_tokens=32, decode_rounds=4),
    ("quick", "small"): dict(steps=6, segment=3, batch=2, seq_len=256, val_interval=3, val_batches=1,
                             log_interval=1, warmup=2, new_tokens=8, decode_rounds=1),
}
INTERNAL = ("json", "quick", "report_only", "arm", "until", "run_dir", "round", "decode_job")


def arm_namespace(a: argparse.Namespace, arm: str) -> tuple[argparse.Namespace, str]:
    """The seq_len_schedule arguments of ``arm``: its flavor in ``a``, and its schedule."""
    role, schedule = ARMS[arm]
    flavor = PAIRS[a.pair][0 if role == "dense" else 1]
    return argparse.Namespace(**{**vars(a), "flavor": flavor}), schedule


def prepare_corpus(a: argparse.Namespace) -> None:
    """Prepare the arms' built-in corpus here (in the round's job, before its arms; a no-op
    once cached), so that no arm's process pays it: its peak RSS would carry the tokenizer."""
    from trainforge.config import load_config
    from trainforge.data.prepare import default_data_dir

    ns, schedule = arm_namespace(a, "dense")
    data = load_config(None, arm_args(ns, schedule)).data
    if data.path is None:
        default_data_dir(data.vocab_size, data.cache_dir)


def round_tokens_per_s(clock: dict[int, float], ends: list[int], tokens_per_step: int) -> list[float]:
    """Tokens/s of each round's segment from the cumulative training clock (step -> s)."""
    out, prev = [], 0
    for until in ends:
        out.append((until - prev) * tokens_per_step / max(clock[until] - clock[prev], 1e-12))
        prev = until
    return out


def read_memory(run_dir: Path) -> dict:
    """Max over the run's training records of the trainer's memory figures (module docstring)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]

    def peak(key) -> int | None:
        vals = [key(r) for r in train]
        vals = [v for v in vals if v]
        return max(vals) if vals else None
    return {"peak_rss_bytes": peak(lambda r: r.get("peak_memory_bytes")),
            "tracked_bytes": peak(lambda r: r.get("mem_tracked_bytes")),
            "activation_bytes": peak(lambda r: sum(v for k, v in r.items()
                                                    if k.startswith("mem_activations_") and k.endswith("_bytes")))}


def expected_kv_bytes_per_token(cfg, element_size: int) -> float:
    """KV bytes per generated token the shape implies: each block keeps n_kv_heads keys and
    values of its stage's head dim, once every ``shorten`` tokens (1 for a dense model)."""
    total = 0.0
    for layer in range(cfg.n_layers):
        stage = cfg.layer_stage(layer)
        head_dim = cfg.dim // stage.width_ratio // cfg.n_heads
        total += 2 * cfg.n_kv_heads * head_dim * element_size / stage.shorten
    return total


def engine_kv_bytes_per_token(engine) -> tuple[float, str]:
    """(bytes, where from): the engine's own figure if its stats carry one (an hourglass engine
    has more than one pool), else every pool byte it reports over the main pool's token slots."""
    stats = engine.stats()
    if "kv_bytes_per_token" in stats:
        return float(stats["kv_bytes_per_token"]), "engine.stats()['kv_bytes_per_token']"
    slots = engine.pool.n_blocks * engine.pool.block_size
    return stats["kv_pool_bytes"] / slots, "engine.stats()['kv_pool_bytes'] / pool token slots"


def decode_job(a: argparse.Namespace) -> None:
    """One locked job: batch-1 decode of the pair's two flavors; writes ``out/decode.json``."""
    import torch

    from bench.engine_speed import decode_tok_s
    from trainforge.errors import ConfigError
    from trainforge.infer.engine import Engine, EngineConfig
    from trainforge.infer.prepare import prepare_model
    from trainforge.model import FLAVORS, build_model

    torch.set_num_threads(a.threads)
    engines, result = {}, {}
    with torch.no_grad():
        for role, flavor in zip(("dense", "hourglass"), PAIRS[a.pair]):
            cfg = FLAVORS[flavor]
            entry: dict = {"flavor": flavor, "expected_kv_bytes_per_token": expected_kv_bytes_per_token(cfg, 4)}
            try:
                model = prepare_model(build_model(cfg, seed=0).requires_grad_(False))
                engines[role] = Engine(model, EngineConfig(max_batch_size=1, max_queue=1,
                                                           max_context=a.prompt_tokens + a.new_tokens))
            except ConfigError as e:
                entry["unsupported"] = str(e)
            else:
                entry["kv_bytes_per_token"], entry["kv_source"] = engine_kv_bytes_per_token(engines[role])
            result[role] = entry
        vocab = min(FLAVORS[f].vocab_size for f in PAIRS[a.pair])
        prompt = torch.randint(0, vocab, (a.prompt_tokens,), generator=torch.Generator().manual_seed(a.seed)).tolist()
        for engine in engines.values():
            decode_tok_s(engine, prompt, a.new_tokens)  # warm-up
        roles = list(engines)
        for r in range(a.decode_rounds):
            for role in roles if r % 2 == 0 else roles[::-1]:
                wall, cpu = decode_tok_s(engines[role], prompt, a.new_tokens)
                result[role].setdefault("tok_s", []).append(wall)
                result[role].setdefault("cpu_tok_s", []).append(cpu)
    if len(engines) == 2 and a.decode_rounds:
        result["ratio"] = summarise([h / d for h, d in zip(result["hourglass"]["tok_s"], result["dense"]["tok_s"])])
    (Path(a.out) / "decode.json").write_text(json.dumps(result, indent=1))


def fmt_ratio(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['median']:.3f}x [{s['q1']:.3f}-{s['q3']:.3f}] ({s['min']:.3f}-{s['max']:.3f}, n={s['n']})"


def mib(n) -> str:
    return f"{n / 2**20:.1f}" if n else "-"


def report(a, runs: dict, comparisons: dict, decode: dict | None, loads: list[float], cpu: str) -> dict:
    dense_flavor, hg_flavor = PAIRS[a.pair]
    tokens_per_step = a.batch * a.seq_len
    print(f"\n{hg_flavor} vs {dense_flavor}: {a.steps} steps x {tokens_per_step} tokens (batch {a.batch} x seq_len "
          f"{a.seq_len}), seed {a.seed}, {a.threads} thread(s), {len(segment_ends(a.steps, a.segment))} rounds of "
          f"{a.segment} steps; {cpu}")
    if loads:
        print(f"1-min load average at round starts {min(loads):.2f}-{max(loads):.2f}")
    print(f"\n{'arm':>15} {'flavor':>16} {'params':>7} {'MFLOP/tok':>9} {'lengths':>10} {'val@steps':>9} "
          f"{'train s':>8} {'tok/s':>7} {'RSS MiB':>8} {'tracked':>8} {'acts MiB':>8} {'host cpu':>8}")
    for arm, r in runs.items():
        cpu_use = f"{r['host_cpu_util']:.0%}" if r["host_cpu_util"] is not None else "-"
        lengths = "/".join(map(str, r["lengths"])) or str(a.seq_len)
        print(f"{arm:>15} {r['flavor']:>16} {r['params'] / 1e6:>6.2f}M {r['flops_per_token'] / 1e6:>9.1f} "
              f"{lengths:>10} {r['val'][-1][2]:>9.4f} "
              f"{r['train_s']:>8.1f} {r['tokens_per_s']:>7.0f} {mib(r['peak_rss_bytes']):>8} "
              f"{mib(r['tracked_bytes']):>8} {mib(r['activation_bytes']):>8} {cpu_use:>8}")
    print("(RSS: the trainer's peak_memory_bytes = peak RSS of the segment process, max over segments; tracked: "
          "mem_tracked_bytes = params + grads + optimizer state + saved activations; acts: the saved activations; "
          f"MFLOP/tok: training FLOPs per token at seq_len {a.seq_len}, ModelConfig.flops_per_token)")
    for (cand, base), c in comparisons.items():
        bound = f" (FLOPs per token {base} / {cand}: {c['flops_ratio']:.3f}x)" if c["flops_ratio"] != 1 else ""
        print(f"\n{cand} vs {base}: training tok/s ratio {fmt_ratio(c['tok_s_ratio'])} over rounds{bound}")
        print(f"  val loss @ {a.steps} steps: {c['val_at_steps'][0]:.4f} vs {c['val_at_steps'][1]:.4f} "
              f"({c['val_at_steps_rel']:+.2%}); @ equal training time {c['equal_time_s']:.1f} s: "
              f"{c['val_at_time'][0]:.4f} vs {c['val_at_time'][1]:.4f} ({c['val_at_time_rel']:+.2%})")
        if c.get("changes"):
            print(f"  {cand} length changes (step: seq_len): {', '.join(f'{s}: {n}' for s, n in c['changes'])}")
    targets = {}
    if decode is not None:
        print(f"\ndecode, batch 1, {a.new_tokens} tokens after a {a.prompt_tokens}-token prompt, "
              f"{a.decode_rounds} rounds (median tok/s; KV bytes per token: measured / implied by the shape)")
        for role in ("dense", "hourglass"):
            d = decode[role]
            if "unsupported" in d:
                print(f"  {d['flavor']:>16}: decode: hourglass not supported by this engine build "
                      f"(implied KV {d['expected_kv_bytes_per_token']:.0f} B/token)")
                continue
            tok = summarise(d["tok_s"]) if d.get("tok_s") else None
            print(f"  {d['flavor']:>16}: {tok['median'] if tok else float('nan'):.1f} tok/s "
                  f"[{tok['min'] if tok else 0:.1f}-{tok['max'] if tok else 0:.1f}]; KV {d['kv_bytes_per_token']:.0f} "
                  f"/ {d['expected_kv_bytes_per_token']:.0f} B/token ({d['kv_source']})")
        if "ratio" in decode:
            print(f"  hourglass / dense decode tok/s: {fmt_ratio(decode['ratio'])}")
            targets["decode_tok_s_ratio"] = decode["ratio"]["median"] >= TARGETS["decode_tok_s_ratio"]
    c = comparisons.get(("hourglass", "dense"))
    if c:
        targets["train_tok_s_ratio"] = c["tok_s_ratio"]["median"] >= TARGETS["train_tok_s_ratio"]
        targets["val_loss_within_2pct"] = c["val_at_steps_rel"] <= TARGETS["val_loss_rel_gap"]
        targets["val_loss_better_at_equal_time"] = c["val_at_time_rel"] < 0
    if targets:
        print("\nissue 22 targets (k = 2): " + "; ".join(f"{k} {'met' if v else 'NOT met'}"
                                                         for k, v in targets.items()))
    return targets


def analyse(a: argparse.Namespace, out: Path, arms: list[str], ends: list[int]) -> tuple[dict, dict]:
    """Each arm's run read back from ``out``, and the COMPARISONS between them."""
    from trainforge.config import load_config
    from trainforge.model.config import model_config_from_section

    tokens_per_step = a.batch * a.seq_len
    runs = {}
    for arm in arms:
        ns, schedule = arm_namespace(a, arm)
        r = read_run(out / arm, tokens_per_step)
        # The shape the arm trained: the flavor at the corpus's vocabulary (small's own is 32,000,
        # the built-in corpus's tokenizer 8,192), so params and FLOPs are the run's.
        cfg = load_config(None, arm_args(ns, schedule))
        model = model_config_from_section(cfg.model, cfg.data.vocab_size)
        r.update(read_memory(out / arm), flavor=ns.flavor, schedule=schedule,
                 params=model.num_params(), flops_per_token=model.flops_per_token(a.seq_len),
                 round_tok_s=round_tokens_per_s(r["clock"], ends, tokens_per_step))
        runs[arm] = r
    comparisons = {}
    for cand, base in COMPARISONS:
        if cand not in runs or base not in runs:
            continue
        c, b = runs[cand], runs[base]
        t_eq = min(c["train_s"], b["train_s"])
        at_steps = (c["val"][-1][2], b["val"][-1][2])
        at_t = (at_time(c["val"], t_eq), at_time(b["val"], t_eq))
        comparisons[(cand, base)] = {
            "tok_s_ratio": summarise([x / y for x, y in zip(c["round_tok_s"], b["round_tok_s"])]),
            "val_at_steps": at_steps, "val_at_steps_rel": at_steps[0] / at_steps[1] - 1,
            "equal_time_s": t_eq, "val_at_time": at_t, "val_at_time_rel": at_t[0] / at_t[1] - 1,
            "flops_ratio": b["flops_per_token"] / c["flops_per_token"],
            "changes": c["changes"]}
    return runs, comparisons


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="tiny", choices=list(PAIRS), help="tiny: hourglass-tiny vs tiny; small: ...")
    p.add_argument("--quick", action="store_true", help="a smoke run of about 2 minutes (tiny)")
    for key in ("steps", "segment", "batch", "seq_len", "val_interval", "val_batches", "log_interval", "warmup",
                "new_tokens", "decode_rounds"):
        p.add_argument(f"--{key}", type=int, default=None, help="default: by --pair and --quick (DEFAULTS)")
    p.add_argument("--start", type=int, default=64, help="auto: training.seq_len_start")
    p.add_argument("--ramp", type=int, default=0, help=argparse.SUPPRESS)  # seq_len_schedule's linear arm
    p.add_argument("--window", type=int, default=4, help="auto: plateau window (logging intervals)")
    p.add_argument("--delta", type=float, default=0.01, help="auto: plateau_rel_delta")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt_tokens", type=int, default=16)
    p.add_argument("--arms", default=",".join(ARMS), help="training arms to run; '' = decode only")
    p.add_argument("--out", default="/tmp/bench_hourglass")
    p.add_argument("--lock", default="/tmp/cpu.lock", help="flock file each round runs under; '' = none")
    p.add_argument("--json", default=None)
    p.add_argument("--report_only", action="store_true", help="print an earlier run's --out (same arguments) again")
    p.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one segment
    p.add_argument("--until", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run_dir", help=argparse.SUPPRESS)
    p.add_argument("--round", help=argparse.SUPPRESS)
    p.add_argument("--decode_job", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    for key, value in DEFAULTS[("quick" if a.quick else "default", a.pair)].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.arm:
        ns, schedule = arm_namespace(a, a.arm)
        return segment(ns, arm_args(ns, schedule))
    if a.round:
        prepare_corpus(a)
        return run_round("bench.hourglass", a.round.split(","), Path(a.out))
    if a.decode_job:
        return decode_job(a)
    if a.segment % a.log_interval:
        p.error(f"--segment {a.segment} must be a multiple of --log_interval {a.log_interval} (tokens/s per round "
                "is read at the logging windows a segment ends on)")
    arms = [arm for arm in a.arms.split(",") if arm]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        p.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")

    from bench.train_throughput import cpu_model

    out = Path(a.out)
    passthrough = [f"--{k}={v}" for k, v in vars(a).items() if k not in INTERNAL]
    ends = segment_ends(a.steps, a.segment)
    loads = []
    if not a.report_only:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        loads = run_rounds("bench.hourglass", passthrough, arms, ends, a.lock, a.threads) if arms else []

    runs, comparisons = analyse(a, out, arms, ends)
    if a.decode_rounds and not a.report_only:
        cmd = [sys.executable, "-m", "bench.hourglass", *passthrough, "--decode_job"]
        t0 = time.perf_counter()
        r = subprocess.run(["flock", a.lock, *cmd] if a.lock else cmd, capture_output=True, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
        if r.returncode != 0:
            sys.exit(f"decode job failed:\n{r.stderr[-3000:]}")
        print(f"decode: {time.perf_counter() - t0:.0f} s (waiting for the lock included)", flush=True)
    decode = json.loads((out / "decode.json").read_text()) if (out / "decode.json").exists() else None
    cpu = cpu_model()
    targets = report(a, runs, comparisons, decode, loads, cpu)
    if a.json:
        Path(a.json).write_text(json.dumps({
            "args": vars(a), "cpu": cpu, "load_avg": loads, "runs": runs, "decode": decode, "targets": targets,
            "comparisons": [{"candidate": k[0], "baseline": k[1], **v} for k, v in comparisons.items()]}, indent=1))


if __name__ == "__main__":
    main()
