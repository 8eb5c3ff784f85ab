"""GPU check: what the planner's GPU table assumes and what users ask first, in one run.

    python bench/gpu_check.py --json /tmp/out/gpu.json          # on a GPU: ~6-8 minutes
    python bench/gpu_check.py --reduced --json /tmp/gpu.json    # tiny sizes (automatic on CPU)

Parts, each with a time budget (``BUDGETS_S``; a part or shape that would overrun it is
recorded as skipped, with the reason, and the check goes on):

- ``matmul``: dense matmul TFLOP/s, best of N timed with CUDA events, at large square and
  llama-1b-shaped rectangular shapes, in bf16, fp16, tf32, fp32 and fp8 (``torch._scaled_mm``,
  tensor-wise scales, fast accumulation; sm >= 89 only), against the published dense peak.
- ``bandwidth``: HBM bytes/s of a large copy (read + write), a STREAM triad (two reads, one
  write) and a read-only sum, against the published figure.
- ``train``: the Trainer's own tokens/s and MFU (from RUN/metrics.jsonl) for ``llama-1b``,
  bf16-mixed, one rank, eager and with ``parallel.compile``. No download: the data is a few
  stdlib modules tokenised with a 512-token BPE padded with unused added tokens to llama-1b's
  128256, so the embedding and output layer have the real shape (the trainer takes the model's
  vocabulary from the data). At world size 1 the trainer applies no data parallelism
  (``data_parallel_kind`` is "none"), so this is the plain one-GPU step; recorded as such.
- ``decode``: the inference engine's greedy decode tokens/s at batch 1 and 32 (``llama-1b``,
  bf16, random weights) against the bandwidth bound: every weight read once per step plus
  each row's KV cache, at the measured copy bandwidth.
- ``tests``: ``pytest -m cuda`` (the suite's CUDA-only tests) in a subprocess: the counts.

Published figures come from ``trainforge.plan.hardware`` when it is there (the planner's GPU
table), else from ``train/mfu.py``'s table (FLOP/s only). Prints a table and one JSON
(``--json``); exits 1 when a part failed, 0 when every part ran or was skipped with a reason.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
# Cheap parts first, the compiled run last: a part the whole-check limit cannot fit is skipped.
PARTS = ("matmul", "bandwidth", "decode", "tests", "train", "train_fsdp2", "train_compile")
# Seconds per part on a GPU: 445 s in all, plus ~10 s of torch import, inside 8 minutes.
BUDGETS_S = {"matmul": 40, "bandwidth": 10, "decode": 45, "tests": 60, "train": 75, "train_fsdp2": 75,
             "train_compile": 140}
REDUCED_BUDGETS_S = {"matmul": 10, "bandwidth": 5, "decode": 20, "tests": 60, "train": 60, "train_fsdp2": 60,
                     "train_compile": 120}
# (M, K, N): square, then llama-1b's feed-forward at 8192 tokens (up and down projections).
MATMUL_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 16384), (8192, 2048, 8192),
                 (8192, 8192, 2048)]
REDUCED_MATMUL_SHAPES = [(256, 256, 256), (384, 256, 512)]
MATMUL_DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp8")
# The small data set of tests/conftest.py: prepares in seconds, no download.
DATA_FILES = ("argparse.py", "ast.py", "dataclasses.py", "enum.py", "functools.py", "inspect.py", "json/encoder.py",
              "json/decoder.py", "pathlib.py", "random.py", "shutil.py", "textwrap.py", "typing.py")


def now_utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# -- timing and published figures ---------------------------------------------------------------

def best_seconds(fn: Callable[[], Any], device, reps: int) -> float:
    """Shortest of ``reps`` calls after one warm-up; CUDA events on a GPU (no host sync
    latency in the figure), the wall clock on CPU."""
    import torch

    fn()
    best = math.inf
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def table_key(device_name: str) -> str | None:
    """The ``trainforge plan --gpu`` name of a device (h100, h200, a100-80g, mi300x), if any.
    The table holds the SXM / OAM parts: a PCIe or NVL board (lower clocks) has no entry."""
    if re.search(r"PCIe|NVL", device_name, re.IGNORECASE):
        return None
    for pattern, key in ((r"H200", "h200"), (r"H100", "h100"), (r"A100.*80", "a100-80g"), (r"MI300X", "mi300x")):
        if re.search(pattern, device_name, re.IGNORECASE):
            return key
    return None


def planner_entry(device_name: str) -> Any | None:
    """The planner's table entry for this device (a ``plan.spec.Cluster`` of one GPU from
    ``plan.hardware.cluster``), or None when the table does not list it or is absent.
    Imported lazily: the check must run on a checkout without the planner."""
    key = table_key(device_name)
    if key is None:
        return None
    try:
        from trainforge.plan.hardware import cluster  # type: ignore[import-not-found]
    except ImportError:
        return None
    return cluster(key, 1)


def published_flops(device_name: str, dtype: str) -> tuple[float, str] | None:
    entry = planner_entry(device_name)
    if entry is not None and entry.peak_flops.get(dtype):
        return float(entry.peak_flops[dtype]), f"plan.hardware {table_key(device_name)} {dtype}"
    import torch

    from trainforge.train.mfu import published_peak

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}
    if dtype not in torch_dtype:
        return None
    return published_peak(device_name, torch_dtype[dtype], tf32=dtype == "tf32")


def published_bandwidth(device_name: str) -> tuple[float, str] | None:
    entry = planner_entry(device_name)
    if entry is None or not entry.memory_bandwidth_bytes_per_s:
        return None
    return float(entry.memory_bandwidth_bytes_per_s), f"plan.hardware {table_key(device_name)}"


def device_info(device) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"type": device.type, "torch": torch.__version__}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_bytes=p.total_memory,
                    multiprocessors=p.multi_processor_count, cuda=torch.version.cuda)
    else:
        info.update(name=f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)")
    return info


# -- the parts ----------------------------------------------------------------------------------

class Budget:
    """A part's deadline: ``left()`` seconds remain; ``over()`` once it is spent."""

    def __init__(self, seconds: float):
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def over(self) -> bool:
        return self.left() <= 0


def _matmul_fn(dtype: str, m: int, k: int, n: int, device) -> Callable[[], Any]:
    """A zero-argument matmul of (m, k) @ (k, n) in ``dtype``; raises ``NotImplementedError``
    with the reason where the device cannot run it."""
    import torch

    if dtype == "fp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            raise NotImplementedError("fp8 matmul needs CUDA sm >= 89 (torch._scaled_mm)")
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # (k, n) column-major, as cuBLASLt wants
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)
    if dtype == "tf32" and device.type != "cuda":
        raise NotImplementedError("tf32 is a CUDA tensor-core mode")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}[dtype]
    a = torch.randn(m, k, device=device, dtype=torch_dtype)
    b = torch.randn(k, n, device=device, dtype=torch_dtype)
    out = torch.empty(m, n, device=device, dtype=torch_dtype)
    return lambda: torch.matmul(a, b, out=out)


def part_matmul(device, reduced: bool, budget: Budget) -> dict[str, Any]:
    import torch

    shapes = REDUCED_MATMUL_SHAPES if reduced else MATMUL_SHAPES
    reps = 3 if reduced else 10
    name = device_info(device)["name"]
    rows: list[dict[str, Any]] = []
    best: dict[str, dict[str, Any]] = {}
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for dtype in MATMUL_DTYPES:
            # fp32 means IEEE fp32 here; tf32 is its own row.
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
            for m, k, n in shapes:
                row: dict[str, Any] = {"dtype": dtype, "shape": [m, k, n]}
                if budget.over():
                    rows.append({**row, "skipped": "part budget spent"})
                    continue
                try:
                    fn = _matmul_fn(dtype, m, k, n, device)
                    s = best_seconds(fn, device, reps)
                except (NotImplementedError, RuntimeError, TypeError, ValueError) as e:  # unsupported here, or
                    # a torch whose private _scaled_mm takes other arguments: a reason, not a failed part
                    rows.append({**row, "skipped": str(e).splitlines()[0][:200]})
                    break  # the same reason holds at every shape
                finally:
                    fn = None  # free the operands before the next shape
                row["tflops"] = 2 * m * k * n / s / 1e12
                rows.append(row)
                if row["tflops"] > best.get(dtype, {}).get("tflops", 0):
                    best[dtype] = {"tflops": row["tflops"], "shape": [m, k, n]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    for dtype, b in best.items():
        pub = published_flops(name, dtype)
        if pub is not None:
            b.update(published_tflops=pub[0] / 1e12, share_of_published=b["tflops"] * 1e12 / pub[0], source=pub[1])
    entry = planner_entry(name)
    out: dict[str, Any] = {"rows": rows, "best": best, "reps": reps}
    if entry is not None:  # the cost model multiplies every peak by this: is it what a large GEMM reaches here?
        out["planner_matmul_efficiency"] = entry.matmul_efficiency
    return out


def part_bandwidth(device, reduced: bool, budget: Budget) -> dict[str, Any]:
    import torch

    n_bytes = (16 if reduced else 2048) * 2**20  # per buffer: 2 GiB, far beyond any L2
    a = torch.ones(n_bytes // 4, device=device)
    b, c = torch.empty_like(a), torch.full_like(a, 2.0)
    reps = 3 if reduced else 10
    kernels = {  # name -> (call, bytes moved per call)
        "copy": (lambda: b.copy_(a), 2 * n_bytes),
        "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3 * n_bytes),
        "read": (lambda: a.sum(), n_bytes),
    }
    out: dict[str, Any] = {"buffer_bytes": n_bytes, "reps": reps}
    for name, (fn, moved) in kernels.items():
        if budget.over():
            out[name] = {"skipped": "part budget spent"}
            continue
        out[name] = {"bytes_per_s": moved / best_seconds(fn, device, reps)}
    pub = published_bandwidth(device_info(device)["name"]) if device.type == "cuda" else None
    if pub is not None:
        out["published_bytes_per_s"], out["source"] = pub
        for name in kernels:
            if "bytes_per_s" in out[name]:
                out[name]["share_of_published"] = out[name]["bytes_per_s"] / pub[0]
    return out


def prepare_data(work: Path, vocab_size: int) -> Path:
    """A prepared data directory of a dozen stdlib modules whose tokenizer has ``vocab_size``
    entries: a 512-token BPE plus unused added tokens (so the model gets the flavor's real
    embedding and output shapes without downloading a tokenizer)."""
    from trainforge.data.prepare import PrepareOptions, prepare
    from trainforge.data.tokenizer import load_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / f) for f in DATA_FILES]
    base = work / "data-v512"
    if not (base / "manifest.json").exists():
        prepare(files, base, PrepareOptions(vocab_size=512, val_fraction=0.1), log=lambda *_: None)
    if vocab_size <= 512:
        return base
    out = work / f"data-v{vocab_size}"
    if not (out / "manifest.json").exists():
        tok = load_tokenizer(base / "tokenizer.json")
        tok.add_tokens([f"<|gpucheck_unused_{i}|>" for i in range(vocab_size - tok.get_vocab_size())])
        tok.save(str(work / f"tokenizer-v{vocab_size}.json"))
        opts = PrepareOptions(tokenizer=str(work / f"tokenizer-v{vocab_size}.json"), val_fraction=0.1)
        prepare(files, out, opts, log=lambda *_: None)
    return out


def train_argv(reduced: bool, data: Path, compile: bool) -> list[str]:
    if reduced:  # two measured windows of one step after a warm-up window
        shape = ["--model.flavor", "debug", "--training.batch_size", "4", "--training.seq_len", "64",
                 "--training.steps", "3", "--training.log_interval", "1"]
    else:  # 8 steps of 4 x 2048 tokens, logged every 2: the first window warms up (and compiles)
        shape = ["--model.flavor", "llama-1b", "--training.batch_size", "4", "--training.seq_len", "2048",
                 "--training.steps", "8", "--training.log_interval", "2"]
    return [*shape, "--data.path", str(data), "--precision.policy", "bf16-mixed", "--parallel.dp_shard", "1",
            "--parallel.compile", "true" if compile else "false", "--training.warmup_steps", "1",
            "--training.val_interval", "0", "--training.val_batches", "1", "--checkpoint.interval", "0",
            "--monitor.interval_steps", "0", "--sample.max_new_tokens", "0"]


def force_fsdp2_on_one_rank() -> None:
    """Make a one-process Trainer shard with FSDP2 over a 1-rank mesh, as one rank of a
    ``dp_shard`` job does (per-block all-gather and reduce-scatter, FSDP2's mixed-precision
    casts), instead of the plain step it runs at world size 1. For this check only: it
    rebinds ``data_parallel_kind`` where the trainer's modules imported it and lets
    ``ParallelDims.build_mesh`` build a mesh of size 1 (no TP, PP or EP here). The process
    group itself is the one ``init_distributed`` makes from the torchrun variables the
    parent sets (RANK=0, WORLD_SIZE=1)."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainforge.parallel import data_parallel, dims
    from trainforge.train import build, chunked_loss, run_summary

    original_kind, original_mesh = data_parallel.data_parallel_kind, dims.ParallelDims.build_mesh

    def kind(d) -> str:
        return "fsdp" if d.world_size == 1 else original_kind(d)

    def build_mesh(self, device_type: str):
        if self.world_size != 1:
            return original_mesh(self, device_type)
        world = init_device_mesh(device_type, (1, 1, 1, 1), mesh_dim_names=dims.AXES)
        return dims.ParallelMesh(world, world["dp_replicate", "dp_shard"]._flatten("dp"))

    for module in (data_parallel, build, chunked_loss, run_summary):
        module.data_parallel_kind = kind
    dims.ParallelDims.build_mesh = build_mesh


def train_child(spec: str) -> int:
    """In a fresh process: the Trainer on ``argv``, without its end-of-run checkpoint
    (llama-1b's weights and AdamW state are ~15 GB of disk and tens of seconds that measure
    the disk, not the step). Writes child.json beside metrics.jsonl."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from trainforge.config import load_config
    from trainforge.parallel.distributed import destroy_distributed
    from trainforge.train.trainer import Trainer

    args = json.loads(spec)
    run_dir = Path(args["run_dir"])
    if args["fsdp2"]:
        force_fsdp2_on_one_rank()
    from trainforge.parallel import data_parallel  # after the rebinding above

    trainer = Trainer(load_config(None, args["argv"]), run_dir, progress=False)
    trainer.save = lambda *a, **k: run_dir  # type: ignore[method-assign]
    try:
        trainer.fit()
    finally:
        trainer.close()
    fsdp_units = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
    info = {"data_parallel": data_parallel.data_parallel_kind(trainer.dims), "fsdp_units": fsdp_units,
            "params": trainer.model_config.num_params(), "vocab_size": trainer.model_config.vocab_size,
            "tokens_per_step": trainer.tokens_per_step}
    if trainer.device.type == "cuda":
        info["peak_memory_bytes"] = torch.cuda.max_memory_allocated(trainer.device)
    destroy_distributed()
    (run_dir / "child.json").write_text(json.dumps(info))
    return 0


def run_child(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> tuple[int, str, str] | None:
    """Run ``cmd`` in its own process group; (returncode, stdout, stderr), or None when it
    outlived ``timeout_s`` (then the whole group is killed: torch.compile's worker processes too)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return proc.returncode, out, err


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_train(device, reduced: bool, budget: Budget, work: Path, compile: bool, fsdp2: bool) -> dict[str, Any]:
    data = prepare_data(work, 512 if reduced else 128256)
    run_dir = work / f"run-{'fsdp2' if fsdp2 else 'plain'}-{'compile' if compile else 'eager'}"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = train_argv(reduced, data, compile) + ["--training.device", device.type]
    spec = json.dumps({"argv": argv, "run_dir": str(run_dir), "fsdp2": fsdp2})
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if fsdp2:  # a one-process torchrun job: init_distributed makes the process group
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    done = run_child([sys.executable, __file__, "--_train_child", spec], budget.left(), env)
    if done is None:
        return {"skip_reason": f"did not finish inside its {budget.seconds:.0f} s budget (killed)"}
    if done[0] != 0:
        raise RuntimeError(f"trainer exited {done[0]}: {(done[2] or done[1]).strip()[-1500:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # Every record of a logging window carries its figures and end time: one entry per window.
    windows = {(r["time_unix_s"], r["tokens_per_s"]): r for r in records if "tokens_per_s" in r}
    ordered = sorted(windows.values(), key=lambda r: r["step"])
    measured = ordered[1:] or ordered  # the first window holds the warm-up (and the compile)
    out = json.loads((run_dir / "child.json").read_text())
    out.update(tokens_per_s=statistics.median(r["tokens_per_s"] for r in measured),
               mfu=statistics.median(r["mfu"] for r in measured), mfu_peak_source=measured[-1].get("mfu_peak_source"),
               first_window_tokens_per_s=ordered[0]["tokens_per_s"], windows=len(ordered),
               final_loss=ordered[-1]["loss"], argv=train_argv(reduced, Path("DATA"), compile))
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def kv_bytes_per_position(cfg, element_bytes: int) -> int:
    """Bytes of K and V one cached position holds over all layers."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * element_bytes


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: every parameter once, but of an untied
    embedding only the rows looked up (one per row; counted as one)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.nbytes
    emb = model.tok_embeddings.weight
    tied = model.output is not None and model.output.weight.data_ptr() == emb.data_ptr()
    total = sum(seen.values())
    return total if tied else total - emb.nbytes + emb[0].nbytes


def part_decode(device, reduced: bool, budget: Budget, bandwidth: float | None) -> dict[str, Any]:
    import torch

    from trainforge.infer.engine import Engine, EngineConfig
    from trainforge.infer.prepare import prepare_model
    from trainforge.infer.sampling import SamplingParams
    from trainforge.model import FLAVORS, build_model

    cfg = FLAVORS["debug" if reduced else "llama-1b"]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_model(cfg, device=device, seed=0).to(dtype).eval().requires_grad_(False)
    prepare_model(model)
    prompt_len, short, long = (16, 4, 36) if reduced else (32, 16, 144)
    if bandwidth is None:  # the bandwidth part was not run: a short copy here
        a = torch.ones((16 if reduced else 1024) * 2**18, device=device)
        b = torch.empty_like(a)
        bandwidth = 2 * a.nbytes / best_seconds(lambda: b.copy_(a), device, 5)
    w_bytes = weight_bytes_per_step(model)
    kv_pos = kv_bytes_per_position(cfg, torch.finfo(dtype).bits // 8)
    out: dict[str, Any] = {"flavor": "debug" if reduced else "llama-1b", "dtype": str(dtype).removeprefix("torch."),
                           "weight_bytes_per_step": w_bytes, "kv_bytes_per_position": kv_pos,
                           "bandwidth_bytes_per_s": bandwidth, "prompt_tokens": prompt_len}
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 32):
        if budget.over():
            out[f"batch_{batch}"] = {"skipped": "part budget spent"}
            continue
        engine = Engine(model, EngineConfig(max_batch_size=batch, max_queue=batch, max_context=prompt_len + long))
        prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]

        def run(n: int) -> float:
            t0 = time.perf_counter()
            reqs = engine.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
            assert all(len(r.output_ids) == n for r in reqs)
            return time.perf_counter() - t0

        run(short)  # warm-up: allocator, kernels
        # The difference of a long and a short generation is decode alone: prefill, admission
        # and the final host read cancel. Best of 3 each: a busy machine only ever adds time.
        seconds = min(run(long) for _ in range(3)) - min(run(short) for _ in range(3))
        if seconds <= 0:
            raise RuntimeError(f"decode timing: {long} tokens took no longer than {short}; the machine is too noisy")
        tok_s = batch * (long - short) / seconds
        mean_context = prompt_len + (short + long) / 2
        bound = batch * bandwidth / (w_bytes + batch * mean_context * kv_pos)
        out[f"batch_{batch}"] = {"tokens_per_s": tok_s, "bound_tokens_per_s": bound, "share_of_bound": tok_s / bound,
                                 "new_tokens": [short, long]}
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def cuda_test_files() -> list[str]:
    """Test files that mark a test (or themselves) ``cuda``: found by text, so a new one is
    picked up without a list to keep, and pytest collects only these (seconds, not the suite)."""
    mark = re.compile(r"mark\.cuda\b")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if mark.search(p.read_text()))


def part_tests(budget: Budget) -> dict[str, Any]:
    files = cuda_test_files()
    if not files:
        return {"skip_reason": "no test is marked cuda"}
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *files]
    done = run_child(cmd, budget.left())
    if done is None:
        return {"skip_reason": f"pytest did not finish inside its {budget.seconds:.0f} s budget (killed)"}
    returncode, stdout, stderr = done
    tail = (stdout + stderr).strip().splitlines()[-15:]
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors", "deselected")}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail[-1] if tail else ""):
        counts["errors" if word.startswith("error") else word] = int(n)
    out = {"command": " ".join(["pytest", *cmd[3:]]), "returncode": returncode, **counts, "files": files}
    if returncode not in (0, 5):  # 5: nothing collected
        out["tail"] = tail
    return out


# -- running and reporting ----------------------------------------------------------------------

def run_parts(args, device, reduced: bool, work: Path) -> dict[str, dict[str, Any]]:
    budgets = REDUCED_BUDGETS_S if reduced else BUDGETS_S
    wanted = args.parts.split(",") if args.parts else list(PARTS)
    if not args.compile and reduced:
        wanted = [p for p in wanted if p != "train_compile"]
    deadline = time.monotonic() + args.budget_s
    sections: dict[str, dict[str, Any]] = {}
    for part in PARTS:
        if part not in wanted:
            why = ("reduced mode: torch.compile costs tens of seconds on CPU (--compile to include)"
                   if part == "train_compile" else "not in --parts")
            sections[part] = {"status": "skipped", "reason": why}
            continue
        left = deadline - time.monotonic()
        if left < budgets[part] / 3:
            sections[part] = {"status": "skipped",
                              "reason": f"{left:.0f} s left of --budget_s, part needs ~{budgets[part]} s"}
            continue
        budget = Budget(min(budgets[part], left))
        t0 = time.monotonic()
        print(f"gpu_check: {part} (budget {budget.seconds:.0f} s)", file=sys.stderr, flush=True)
        try:
            if part == "matmul":
                result = part_matmul(device, reduced, budget)
            elif part == "bandwidth":
                result = part_bandwidth(device, reduced, budget)
            elif part.startswith("train"):
                # train: the plain one-GPU step; train_fsdp2: FSDP2 on one rank; train_compile: that, compiled.
                result = part_train(device, reduced, budget, work, compile=part == "train_compile",
                                    fsdp2=part != "train")
            elif part == "decode":
                bw = sections.get("bandwidth", {}).get("copy", {}).get("bytes_per_s")
                result = part_decode(device, reduced, budget, bw)
            else:
                result = part_tests(budget)
            status = "skipped" if "skip_reason" in result else "ok"
            if part == "tests" and status == "ok" and (result["failed"] or result["errors"]
                                                       or result["returncode"] not in (0, 5)):
                status, result["error"] = "failed", f"pytest exited {result['returncode']}: {result['tail'][-1]}"
            if status == "skipped":
                result["reason"] = result.pop("skip_reason")
        except Exception as e:  # one broken part must not hide the others' figures
            status, result = "failed", {"error": f"{type(e).__name__}: {e}"[:2000]}
        sections[part] = {"status": status, "budget_s": budget.seconds, "wall_s": time.monotonic() - t0, **result}
    return sections


def summary_rows(sections: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(part, what, measured, against published/bound) for the table."""
    rows: list[tuple[str, str, str, str]] = []

    def pct(x: float | None) -> str:
        return "" if x is None else f"{100 * x:.0f}%"

    for part, sec in sections.items():
        if sec["status"] != "ok":
            rows.append((part, sec["status"], "", sec.get("reason") or sec.get("error", "")[:100]))
            continue
        if part == "matmul":
            for dt, b in sec["best"].items():
                ref = ""
                if "published_tflops" in b:
                    ref = f"{pct(b['share_of_published'])} of {b['published_tflops']:.0f}"
                if dt == "bf16" and "planner_matmul_efficiency" in sec:
                    ref += f" (planner assumes {pct(sec['planner_matmul_efficiency'])})"
                rows.append((part, f"{dt} best {'x'.join(map(str, b['shape']))}", f"{b['tflops']:.1f} TFLOP/s", ref))
            for dt in dict.fromkeys(r["dtype"] for r in sec["rows"] if r["dtype"] not in sec["best"]):
                why = next(r["skipped"] for r in sec["rows"] if r["dtype"] == dt)
                rows.append((part, f"{dt} skipped", "", why))
        elif part == "bandwidth":
            for k in ("copy", "triad", "read"):
                if "bytes_per_s" in sec[k]:
                    rows.append((part, k, f"{sec[k]['bytes_per_s'] / 1e9:.0f} GB/s",
                                 pct(sec[k].get("share_of_published"))))
        elif part.startswith("train"):
            rows.append((part, f"{sec['params'] / 1e6:.1f}M params, dp {sec['data_parallel']}",
                         f"{sec['tokens_per_s']:,.0f} tok/s", f"MFU {pct(sec['mfu'])}"))
        elif part == "decode":
            for b in (1, 32):
                s = sec[f"batch_{b}"]
                if "tokens_per_s" in s:
                    rows.append((part, f"{sec['flavor']} batch {b}", f"{s['tokens_per_s']:,.0f} tok/s",
                                 f"{pct(s['share_of_bound'])} of bound {s['bound_tokens_per_s']:,.0f}"))
        elif part == "tests":
            rows.append((part, "pytest -m cuda", f"{sec['passed']} passed, {sec['failed']} failed",
                         f"{sec['skipped']} skipped, {sec['errors']} errors"))
    return rows


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"gpu_check ({report['mode']}): {report['device']['name']}, {report['date']}")
    for col in ("part", "what", "measured", "vs published / bound"):
        table.add_column(col)
    for row in summary_rows(report["sections"]):
        table.add_row(*map(str, row))
    Console(stderr=True, width=max(120, shutil.get_terminal_size().columns)).print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help="write the report here (it is also printed)")
    p.add_argument("--reduced", action="store_true", help="tiny sizes on CPU (automatic without CUDA)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda[:N]")
    p.add_argument("--parts", default="", help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--budget_s", type=float, default=460.0, help="whole-check time limit, seconds")
    p.add_argument("--compile", action="store_true", help="reduced mode: include the compiled training run")
    p.add_argument("--work_dir", help="scratch directory (default: a temporary one, removed)")
    p.add_argument("--_train_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._train_child:
        return train_child(args._train_child)
    start = time.monotonic()
    import torch

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    reduced = args.reduced or device.type != "cuda"
    unknown = set(filter(None, args.parts.split(","))) - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; choose from {','.join(PARTS)}")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        sections = run_parts(args, device, reduced, work)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    report = {"schema": 1, "mode": "reduced" if reduced else "full", "date": now_utc(), "device": device_info(device),
              "planner_table": planner_entry(device_info(device)["name"]) is not None,
              "wall_s": time.monotonic() - start, "sections": sections}
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    print_table(report)
    return 1 if any(s["status"] == "failed" for s in sections.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
