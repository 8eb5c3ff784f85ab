"""Optimizer offload: step time and memory of AdamW on the device, trainforge's offload
(``delay`` 0 and 1) and, under FSDP2, FSDP2's own ``CPUOffloadPolicy`` (``offload.mode = fsdp``).

    python bench/offload.py          # CPU, one process: device, offload, offload-delay1
    python bench/offload.py --fsdp   # CPU, torchrun 2 ranks: fsdp, fsdp-cpu-policy, fsdp-offload
    python bench/offload.py --device cuda --flavor llama-1b --vocab 128256 --precision bf16-mixed \\
        --batch_size 4 --seq_len 2048 --rounds 6 --steps_per_sample 3 --json /tmp/out/offload_gpu.json  # GPU goal

Every configuration is a real ``Trainer`` built in this process (same flavor, seed, data,
batch); they take turns, one sample each per round, in a rotating order: a sample is
``--steps_per_sample`` calls of ``train_step``, then a flush of a delayed update (so a
delay-1 sample pays its last update instead of hiding it in the next configuration's
turn; on CPU the rounds share the cores). Ratio per round = seconds(X) / seconds(baseline,
same round); reported: the median of the paired ratios with the full spread (min, max)
over every round. The first round is warm-up, untimed.

Memory: bytes each configuration keeps on the device between steps and at the step's
peak, counted from its tensors (parameters, gradients, optimizer state, by where each
lives) and, on CUDA, ``torch.cuda.max_memory_allocated`` over a sample in a process of its
own (``--memory_of``). On CPU the host is the device: the split is what a GPU would hold,
not a saving on this machine. Goals (GPU, llama-1b shape): offload step <= 1.10x the
device step with >= 55% less device memory. A benchmark, not a test: prints PASS/FAIL and
exits 0 either way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.train_throughput import cpu_counters, cpu_model, load_note  # noqa: E402
from trainforge.config import load_config  # noqa: E402
from bench.gpu_check import prepare_data  # noqa: E402
from trainforge.train.offload_optimizer import OffloadAdamW  # noqa: E402
from trainforge.train.trainer import Trainer  # noqa: E402

ONE = {"device": [], "offload": ["--offload.optimizer", "true"],
       "offload-delay1": ["--offload.optimizer", "true", "--offload.delay", "1"]}
FSDP = {"fsdp": [], "fsdp-cpu-policy": ["--offload.optimizer", "true", "--offload.mode", "fsdp"],
        "fsdp-offload": ["--offload.optimizer", "true"]}
GOAL_RATIO, GOAL_SAVING = 1.10, 0.55


def data_dir(root: Path, vocab: int) -> Path:
    """Stdlib modules under a 512-token BPE padded with unused tokens to ``vocab`` (so a
    llama-1b-shaped model gets its real 128256-row embedding and output); no download."""
    return prepare_data(root, vocab)


def config(args, data: Path, extra: list[str], fsdp: bool):
    layout = ["--parallel.dp_shard", "-1"] if fsdp else []
    return load_config(None, ["--model.flavor", args.flavor, "--data.path", str(data), "--training.device",
                              args.device, "--training.batch_size", str(args.batch_size), "--training.seq_len",
                              str(args.seq_len), "--training.steps", "100000", "--training.val_batches", "1",
                              "--training.warmup_steps", "10", "--precision.policy", args.precision,
                              "--precision.param_dtype", args.param_dtype, "--checkpoint.interval", "0",
                              "--sample.max_new_tokens", "0", *layout, *extra])


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def sample(t: Trainer, steps: int) -> float:
    sync(t.cfg.training.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        t.train_step()
        t.step += 1
    for o in t.optimizers:
        if isinstance(o, OffloadAdamW):
            o.flush()
    sync(t.cfg.training.device)
    return time.perf_counter() - t0


def tensor_bytes(t: Trainer) -> dict[str, int]:
    """Bytes by where they live: parameters, gradients (at the step's peak) and optimizer state."""
    dev = {"params": 0, "grads": 0, "state": 0}
    host = {"params": 0, "grads": 0, "state": 0}

    def add(kind: str, x: torch.Tensor) -> None:
        local = x.to_local() if hasattr(x, "to_local") else x
        bucket = host if local.device.type == "cpu" and t.device.type != "cpu" else dev
        bucket[kind] += local.numel() * local.element_size()

    for part in t.model_parts:
        for p in part.parameters():
            add("params", p)
            add("grads", p)  # a gradient per parameter at the step's peak, where the parameter is
    for o in t.optimizers:
        if isinstance(o, OffloadAdamW):  # the host buffers: master, moments, gradient copies
            for b in o.buckets:
                host["state"] += 4 * (b.master.numel() * 3 + sum(g.numel() for g in b.grads))
            inner = o._inner
            states = [inner.state[p] for g in inner.param_groups for p in g["params"]] if inner else []
        else:
            states = list(o.state.values())
        for st in states:
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    add("state", v)
    out = {f"device_{k}": v for k, v in dev.items()} | {f"host_{k}": v for k, v in host.items()}
    out["device_total"] = sum(dev.values())
    if t.device.type == "cpu":  # offloaded buffers are host memory on a GPU; here they are all one memory
        out["device_total"] -= out["device_state"] if any(isinstance(o, OffloadAdamW) for o in t.optimizers) else 0
    return out


def memory_of(args, name: str) -> None:
    """One configuration alone (CUDA): peak allocated bytes over a sample, as JSON on stdout."""
    table = FSDP if args.fsdp else ONE
    data = data_dir(Path(args.work), args.vocab)
    t = Trainer(config(args, data, table[name], args.fsdp), tempfile.mkdtemp(dir=args.work), progress=False)
    sample(t, 2)
    torch.cuda.reset_peak_memory_stats()
    sample(t, args.steps_per_sample)
    print(json.dumps({"name": name, "max_allocated": torch.cuda.max_memory_allocated()}))
    t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--param_dtype", default="auto", help="precision.param_dtype (bf16: bf16 weights, fp32 masters)")
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--seq_len", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps_per_sample", type=int, default=5)
    ap.add_argument("--fsdp", action="store_true", help="2 ranks under torchrun (relaunches itself)")
    ap.add_argument("--memory_of", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.work = args.work or tempfile.mkdtemp(prefix="offload_bench_")
    if args.memory_of:
        return memory_of(args, args.memory_of)
    if args.fsdp and "RANK" not in os.environ:
        data_dir(Path(args.work), args.vocab)  # once, before the ranks start
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               *sys.argv[1:], "--work", args.work]
        raise SystemExit(subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    table = FSDP if args.fsdp else ONE
    base = next(iter(table))
    data = data_dir(Path(args.work), args.vocab)
    trainers = {n: Trainer(config(args, data, extra, args.fsdp), Path(args.work) / n, progress=False)
                for n, extra in table.items()}
    main_rank = int(os.environ.get("RANK", "0")) == 0
    names = list(trainers)
    times: dict[str, list[float]] = {n: [] for n in names}
    before, wall0 = cpu_counters(), time.perf_counter()
    for r in range(args.rounds + 1):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate: no configuration always goes first
        got = {n: sample(trainers[n], args.steps_per_sample) for n in order}
        if r:  # round 0 is warm-up
            for n in names:
                times[n].append(got[n] / args.steps_per_sample)
    load = load_note(before, cpu_counters(), time.perf_counter() - wall0)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "load": load,
              "args": {k: v for k, v in vars(args).items() if k not in ("memory_of", "work")},
              "step_s_median": {n: statistics.median(v) for n, v in times.items()}, "ratios": {},
              "memory": {n: tensor_bytes(t) for n, t in trainers.items()}}
    if args.device.startswith("cuda"):
        for t in trainers.values():
            t.close()
        trainers.clear()
        torch.cuda.empty_cache()
        for n in names:  # alone in a process: the others' memory must not count
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--memory_of", n, "--work", args.work],
                                 capture_output=True, text=True)
            line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
            result["memory"][n]["cuda_max_allocated"] = json.loads(line)["max_allocated"] if line else None
    for n in names[1:]:
        ratios = sorted(a / b for a, b in zip(times[n], times[base]))
        result["ratios"][n] = {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1],
                               "rounds": len(ratios)}
    if not main_rank:
        return
    print(f"{result['cpu']}; torch {result['torch']}, {result['threads']} threads; load {load}")
    print(f"{'config':<16} {'step s':>9} {'ratio (median, min-max)':>28} {'device MiB':>11} {'host MiB':>9}")
    for n in names:
        m = result["memory"][n]
        host = sum(v for k, v in m.items() if k.startswith("host_"))
        rt = result["ratios"].get(n)
        rtxt = f"{rt['median']:.3f} ({rt['min']:.3f}-{rt['max']:.3f})" if rt else "1 (baseline)"
        print(f"{n:<16} {result['step_s_median'][n]:>9.4f} {rtxt:>28} {m['device_total'] / 2**20:>11.1f} "
              f"{host / 2**20:>9.1f}")
    if not args.fsdp:
        key = "cuda_max_allocated" if args.device.startswith("cuda") else "device_total"
        dev, off = result["memory"][base].get(key), result["memory"]["offload"].get(key)
        saving = 1 - off / dev if dev and off else None
        ratio = result["ratios"]["offload"]["median"]
        ok = ratio <= GOAL_RATIO and saving is not None and saving >= GOAL_SAVING
        result["goal"] = {"ratio": ratio, "saving": saving, "pass": ok}
        print(f"goal (a GPU goal; on CPU for the record): offload step {ratio:.3f}x (<= {GOAL_RATIO}), device "
              f"memory -{(saving or 0) * 100:.0f}% by {key} (>= {GOAL_SAVING * 100:.0f}%): {'PASS' if ok else 'FAIL'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
