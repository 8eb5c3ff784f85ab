"""CPU decode and prompt processing against llama.cpp, both engines reading the same GGUF files
(issue 24).

    python -m bench.cpu_decode_peer                   # 3 rounds, 1 and 2 threads: ~7 min on 2 cores
    python -m bench.cpu_decode_peer --quick           # 1 round, 2 threads: ~2 min
    python -m bench.cpu_decode_peer --json out.json   [--work DIR] [--build] [--rss_large]

Run from the repository root. The peer is llama.cpp as ``bench/_llama_cpp.py`` builds it; when it
is absent the bench prints how to build it and exits 1 (``--build`` builds it, minutes). Measured
sections hold ``--lock`` (/tmp/cpu.lock, flock) one round at a time, so do not wrap this script in
flock.

Files, made once into ``--work`` (default ``~/.cache/trainforge/cpu_decode_peer``) and reused:
``bench/inference.py``'s 90m model (``SIZES["90m"]``, 88.1M parameters, random weights, seed 0)
with a byte-level BPE of 8192 trained here on Python stdlib sources, written as a Hugging Face
directory (what ``trainforge export`` writes), converted by llama.cpp's own
``convert_hf_to_gguf.py`` to ``m-f32.gguf``, then ``llama-quantize --pure`` to ``m-q8_0.gguf``
and ``m-q4_0.gguf``. Ours loads the same files (``--checkpoint m-X.gguf``).

The tests, as llama-bench defines them, each sample a fresh process:

- **pp**: prompt processing of 512 tokens, tok/s. llama.cpp: ``llama-bench -p 512 -n 0 -r 1 -t T
  -o jsonl`` (``avg_ts``; llama-bench warms up first). Ours: ``trainforge generate --checkpoint
  m-X.gguf --prompt_ids <512 random ids> --max_new_tokens 2 --temperature 0 --ignore_eos --stats``,
  prompt_tokens / prefill_s.
- **tg**: 128 tokens decoded one at a time from an empty context. llama.cpp: ``-p 0 -n 128``.
  Ours: a 1-token prompt and ``--max_new_tokens 129`` (the prompt's forward samples the first
  token, then 128 decode steps), decode_steps / decode_s.

Ours runs with ``OMP_NUM_THREADS=T``: it sizes torch's intra-op pool, which the C++ kernels'
``at::parallel_for`` use (``generate`` sets no thread count of its own). Each process's CPU time /
wall time is recorded (the whole process, its single-threaded start included), so a thread
count that was not respected shows: at T = 1 it stays at 1.00.

A round runs, for each T and each file, pp then tg, llama.cpp and ours back to back, the order
of the two swapped every round. Before a round the bench takes the lock and waits (at most
``--quiet_wait_s``) until other processes use under ``--quiet_share`` of the CPUs over 2 s
(/proc/stat); that share and the 1-min load are reported before and after each round. Ratios are
ours / llama.cpp, paired within a round; the summary is the median over rounds with the min-max.

Memory: peak RSS of every process (GNU time's %M). The issue's bound, for our tg process:
(peak RSS - a bare ``python -c "import torch"`` process's peak RSS) / (the file's tensor bytes +
our KV pool bytes, from ``--stats``) <= 1.3. ``--rss_large`` checks the same bound once more on a
287M-parameter model (``large_config``; files made once into ``--work``/large, ours only).

Greedy agreement, after the rounds, at the largest T: ``llama-completion`` greedy on a short text
prompt (``-ctk f32 -ctv f32 -fa off --temp 0 -n 128 --ignore-eos -no-cnv``), writing the prompt's and
the generated token ids to a session file (``--prompt-cache --prompt-cache-all``); ours greedy from
those same prompt ids. Reported: the generated tokens equal before the first difference, on the f32
file (the issue's claim: all 128) and on the q8_0 file (no bound). Flash attention is off because
llama.cpp's CPU flash attention (its default, ``auto``) rounds through fp16 even with an f32 cache:
on the f32 file its logits were up to 4.4e-3 from an fp64 forward of the same weights (logits up
to 2.8), 1.1e-6 with it off; ours were 2.0e-6 (docs/benchmarks-archive.md, 2026-12-04). The f32 comparison is
run once more with ``-fa auto``, for the record, and for both the bench counts at how many of
llama.cpp's positions an fp64 forward of the same weights, fed llama.cpp's tokens, picks
llama.cpp's token (``exact_picks``). The speed tests keep llama.cpp's defaults.

``--isa avx2`` runs both engines as an AVX2-only CPU (Zen 3, Haswell to Comet Lake) would, on an
AVX-512 machine: llama.cpp from its ``avx2`` build (``bench/_llama_cpp.py``: no AVX-512, no AVX-VNNI,
no AMX), ours with ``ISA_ENV["avx2"]``: our kernels' AVX2 path, torch's AVX2 kernels, and oneDNN
and MKL held to AVX2. Instruction set only: the memory system and caches stay this machine's.

A benchmark, not a test: it prints the targets' PASS / FAIL and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from bench._llama_cpp import LLAMA_CPP_PYTHON_VERSION, LlamaCpp, build, build_hint, cache_root, convert_hf, \
    quantize_gguf
from bench.advise import locked
from bench.train_throughput import cpu_counters, others_share

PRECISIONS = ("f32", "q8_0", "q4_0")
TESTS = ("pp", "tg")
TARGETS = {"pp": 1.0, "tg": 1.0, "rss_bound": 1.3}
STDLIB_SOURCES = ("argparse.py", "ast.py", "dataclasses.py", "inspect.py", "typing.py", "pathlib.py")
AGREEMENT_PROMPT = ("def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description=__doc__)\n"
                    "    parser.add_argument('--verbose', action='store_true', help='say more')\n")
SESSION_MAGIC = 0x6767736E  # llama.h LLAMA_SESSION_MAGIC ('ggsn')
MIB = 2**20
# What holds every layer of our process to one instruction set: our C++ kernels
# (infer/cpu_kernels), ATen's dispatched kernels (and cpu_linear's oneDNN choice, which reads
# ATen's capability), oneDNN's JIT and MKL's GEMMs.
ISA_ENV = {"native": {},
           "avx2": {"TRAINFORGE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           # llama.cpp's AVX-512 build without AMX (_llama_cpp.py); ours on its AVX-512 paths, oneDNN without AMX.
           "avx512": {"TRAINFORGE_CPU_ISA": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}}
GNU_TIME = "/usr/bin/time"


@dataclass
class Proc:
    """One finished process: its output and what GNU time said of it."""

    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    peak_rss: int  # bytes


def run_process(cmd: list[str], env: dict[str, str] | None = None) -> Proc:
    """Run ``cmd`` to its end under GNU time, which reports its peak RSS and CPU time. Not
    ``wait4`` from here: Linux carries a process's RSS high-water mark across ``exec``, so a child
    forked from this process (torch imported, hundreds of MB) would report at least this process's
    RSS (measured: a bare ``import torch`` read 601 MiB from a 600 MB parent, 219 MiB under time).
    Output goes through files, so a chatty child never blocks."""
    if not Path(GNU_TIME).is_file():
        raise RuntimeError(f"{GNU_TIME} is missing: install GNU time (apt-get install time) to measure peak RSS")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.NamedTemporaryFile("r") as usage:
        t0 = time.perf_counter()
        rc = subprocess.run([GNU_TIME, "-f", "%M %U %S", "-o", usage.name, *cmd], stdout=out, stderr=err,
                            stdin=subprocess.DEVNULL, env=env).returncode
        wall_s = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        report = usage.read()
    if rc:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {rc}:\n{stderr[-3000:]}")
    rss_kib, user_s, sys_s = report.split()
    return Proc(stdout, stderr, wall_s, float(user_s) + float(sys_s), int(rss_kib) * 1024)


# -- parsing the two engines' reports ---------------------------------------------------------

def parse_llama_bench(jsonl: str) -> dict:
    """The one test of a ``llama-bench -o jsonl`` run: its test ("pp" / "tg"), tok/s, build."""
    rows = [json.loads(line) for line in jsonl.splitlines() if line.startswith("{")]
    if len(rows) != 1:
        raise ValueError(f"expected one llama-bench result line, got {len(rows)}:\n{jsonl[-1000:]}")
    r = rows[0]
    if (r["n_prompt"] > 0) == (r["n_gen"] > 0):
        raise ValueError(f"llama-bench ran n_prompt={r['n_prompt']} n_gen={r['n_gen']}: not a pp or a tg test")
    return {"test": "pp" if r["n_prompt"] else "tg", "tok_s": float(r["avg_ts"]), "n_threads": int(r["n_threads"]),
            "build": f"{r['build_commit']} (build {r['build_number']})", "cpu_info": r.get("cpu_info", "")}


def parse_stats(stderr: str) -> dict:
    """``trainforge generate --stats``'s JSON: the last stderr line that is an object."""
    for line in reversed(stderr.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no --stats JSON in trainforge generate's stderr:\n{stderr[-1000:]}")


def ours_tok_s(stats: dict, test: str) -> float:
    """pp: prompt tokens / prefill seconds; tg: decode steps / decode seconds."""
    if test == "pp":
        return stats["prompt_tokens"] / stats["prefill_s"]
    return stats["decode_steps"] / stats["decode_s"]


def session_ids(path: Path) -> list[int]:
    """The token ids a llama.cpp session file starts with (``llama_state_save_file``: u32 magic,
    u32 version, u32 count, int32 ids, then the context's state)."""
    data = path.read_bytes()
    magic, _version, n = struct.unpack_from("<III", data)
    if magic != SESSION_MAGIC:
        raise ValueError(f"{path} is not a llama.cpp session file (magic {magic:#x})")
    return list(struct.unpack_from(f"<{n}i", data, 12))


def agreed_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens are equal before the first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def paired(llama: list[float], ours: list[float]) -> dict:
    """Medians over rounds of both sides and of the per-round ratio ours / llama.cpp, with the
    ratio's min-max (with 3 rounds a p10-p90 would be the min-max anyway)."""
    ratios = [o / l for o, l in zip(ours, llama, strict=True)]
    return {"llama_cpp": statistics.median(llama), "ours": statistics.median(ours),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


# -- the machine --------------------------------------------------------------------------

def cpu_summary() -> dict:
    """``lscpu``'s model name and the SIMD flags the kernels of both engines choose paths by."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    flags = sorted(f for f in fields.get("Flags", "").split()
                   if f.startswith(("avx2", "avx512", "fma", "f16c")) or "vnni" in f)
    return {"model": fields.get("Model name", "unknown"), "cpus": fields.get("CPU(s)"), "flags": flags}


def machine_now(window_s: float = 2.0) -> dict:
    """The 1-min load and the share of the CPUs other processes used over the next ``window_s``
    (this process sleeps meanwhile)."""
    c0 = cpu_counters()
    time.sleep(window_s)
    share = others_share(c0, cpu_counters(), window_s)
    return {"load_1min": round(os.getloadavg()[0], 2), "others_share": round(share, 3)}


def wait_quiet(max_wait_s: float, share: float) -> dict:
    """Wait until other processes use under ``share`` of the CPUs, at most ``max_wait_s``."""
    t0 = time.perf_counter()
    while True:
        now = machine_now()
        waited = time.perf_counter() - t0
        if now["others_share"] < share or waited >= max_wait_s:
            return {**now, "waited_s": round(waited, 1), "quiet": now["others_share"] < share}


def git_rev() -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return f"{rev or 'unknown'}{' (uncommitted changes)' if dirty else ''}"


# -- the files ----------------------------------------------------------------------------

def prepare(work: Path, peer: LlamaCpp, cfg=None) -> dict[str, Path]:
    """The three GGUF files in ``work`` of the model ``cfg`` (default the 90m one), made by the
    steps still missing (each written under a temporary name, then renamed, so an interrupted
    run leaves nothing half-made)."""
    files = {p: work / f"m-{p}.gguf" for p in PRECISIONS}
    work.mkdir(parents=True, exist_ok=True)
    if not files["f32"].is_file():
        hf = work / "hf"
        if not (hf / "config.json").is_file():
            _write_hf_dir(work, hf, cfg)
        tmp = work / "m-f32.gguf.tmp"
        convert_hf(peer, hf, tmp).rename(files["f32"])
    for kind in PRECISIONS[1:]:
        if not files[kind].is_file():
            tmp = work / f"m-{kind}.gguf.tmp"
            quantize_gguf(peer, files["f32"], tmp, kind).rename(files[kind])
    return files


def large_config():
    """The memory check's model (``--rss_large``): the 90m model's vocabulary and tokenizer,
    dim 1024 and 24 layers, 287.4M parameters, so the weights are 3.3x the 90m model's and the
    process's fixed memory (imports, kernels, tokenizer, workspace) weighs less in the bound."""
    import dataclasses

    from bench.inference import SIZES

    return dataclasses.replace(SIZES["90m"], dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, ffn_hidden_dim=2816)


def _write_hf_dir(work: Path, hf: Path, cfg=None) -> None:
    from bench.inference import SIZES
    from trainforge.data.tokenizer import EOS_TOKEN, train_tokenizer
    from trainforge.infer.hf_export import save_hf_dir
    from trainforge.model import build_model

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = train_tokenizer([(stdlib / name).read_text() for name in STDLIB_SOURCES], 8192)
    tok_path = work / "tokenizer.json"
    tok.save(str(tok_path))
    model = build_model(cfg or SIZES["90m"], seed=0)
    shutil.rmtree(hf, ignore_errors=True)
    save_hf_dir(hf, model.state_dict(), model.cfg, tok_path, eos_ids=(tok.token_to_id(EOS_TOKEN),))


def tensor_bytes(path: Path) -> int:
    """Bytes of every tensor in a GGUF file: the weights both engines hold."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def vocab_size(path: Path) -> int:
    from gguf import GGUFReader

    return int(next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight").shape[-1])


# -- one sample of each engine ------------------------------------------------------------

@dataclass
class Sample:
    tok_s: float
    peak_rss: int
    cpu_per_wall: float
    kv_pool_bytes: int = 0  # ours only


def llama_sample(peer: LlamaCpp, gguf: Path, threads: int, test: str, tokens: int) -> tuple[Sample, dict]:
    p, n = (tokens, 0) if test == "pp" else (0, tokens)
    proc = run_process([str(peer.tool("llama-bench")), "-m", str(gguf), "-p", str(p), "-n", str(n), "-r", "1",
                        "-t", str(threads), "-o", "jsonl"], env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    r = parse_llama_bench(proc.stdout)
    if r["test"] != test or r["n_threads"] != threads:
        raise RuntimeError(f"llama-bench ran {r['test']} at {r['n_threads']} threads, asked {test} at {threads}")
    return Sample(r["tok_s"], proc.peak_rss, proc.cpu_s / proc.wall_s), r


def ours_cmd(gguf: Path, prompt: list[int], new_tokens: int, *, stats: bool) -> list[str]:
    return [sys.executable, "-m", "trainforge", "generate", "--checkpoint", str(gguf),
            "--prompt_ids", ",".join(map(str, prompt)), "--max_new_tokens", str(new_tokens), "--temperature", "0",
            "--ignore_eos", "--print_ids", *(["--stats"] if stats else [])]


def ours_sample(gguf: Path, threads: int, test: str, tokens: int, prompt: list[int]) -> Sample:
    ids, new = (prompt[:tokens], 2) if test == "pp" else (prompt[:1], tokens + 1)
    proc = run_process(ours_cmd(gguf, ids, new, stats=True), env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    stats = parse_stats(proc.stderr)
    return Sample(ours_tok_s(stats, test), proc.peak_rss, proc.cpu_s / proc.wall_s, int(stats["kv_pool_bytes"]))


def agreement(peer: LlamaCpp, gguf: Path, threads: int, tokens: int, work: Path, flash_attn: str = "off") -> dict:
    """Greedy tokens of llama.cpp (f32 KV cache, ``-fa flash_attn``) and ours on the same prompt ids and
    file; for the f32 file also how many of llama.cpp's tokens an fp64 forward picks (``exact_picks``)."""
    session = work / f"session-{gguf.stem}.bin"
    session.unlink(missing_ok=True)  # an existing one would be resumed, not regenerated
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    run_process([str(peer.tool("llama-completion")), "-m", str(gguf), "-p", AGREEMENT_PROMPT, "-n", str(tokens),
                 "--temp", "0", "--ignore-eos", "-ctk", "f32", "-ctv", "f32", "-fa", flash_attn, "-t", str(threads),
                 "-no-cnv", "--no-display-prompt", "--no-warmup", "--prompt-cache", str(session),
                 "--prompt-cache-all"], env=env)
    ids = session_ids(session)
    prompt, theirs = ids[:-tokens], ids[-tokens:]
    ours = [int(t) for t in run_process(ours_cmd(gguf, prompt, tokens, stats=False), env=env).stdout.split(",")]
    return {"prompt_tokens": len(prompt), "generated": tokens, "flash_attn": flash_attn,
            "equal_before_first_difference": agreed_prefix(theirs, ours),
            "equal_positions": sum(a == b for a, b in zip(theirs, ours)), "llama_cpp_ids": theirs, "ours_ids": ours,
            "llama_cpp_exact_picks": exact_picks(gguf, prompt, theirs) if gguf.stem.endswith("f32") else None}


def exact_picks(gguf: Path, prompt: list[int], theirs: list[int]) -> int:
    """At how many of llama.cpp's generated positions the file's weights in fp64 (our model's plain
    forward, fed llama.cpp's own tokens) pick llama.cpp's token: which side of a near-tie the exact
    result is on, when the two greedy runs part."""
    import torch

    from trainforge.infer.loading import load_model

    model = load_model(str(gguf), "cpu").model.eval().double()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + theirs[:-1]]))[0, len(prompt) - 1:]
    return int((logits.argmax(-1) == torch.tensor(theirs)).sum())


# -- the run ------------------------------------------------------------------------------

def run_rounds(peer: LlamaCpp, files: dict[str, Path], args) -> tuple[dict, list[dict], list[int], set[str]]:
    """``samples[(T, precision, test)] = {"llama_cpp": [Sample], "ours": [Sample]}`` over rounds,
    the load around each round, bare-torch peak RSS per round, the llama.cpp build ids seen."""
    rng, vocab = random.Random(0), vocab_size(files["f32"])
    prompt = [rng.randrange(1, vocab) for _ in range(args.pp_tokens)]
    samples = {(t, p, test): {"llama_cpp": [], "ours": []} for t in args.threads for p in PRECISIONS for test in TESTS}
    loads, bare, builds = [], [], set()
    for r in range(args.rounds):
        with locked(args.lock):
            before = wait_quiet(args.quiet_wait_s, args.quiet_share)
            t0 = time.perf_counter()
            bare.append(run_process([sys.executable, "-c", "import torch"]).peak_rss)
            for threads in args.threads:
                for prec in PRECISIONS:
                    for test in TESTS:
                        tokens = args.pp_tokens if test == "pp" else args.tg_tokens
                        cell = samples[(threads, prec, test)]
                        for side in (("llama_cpp", "ours") if r % 2 == 0 else ("ours", "llama_cpp")):
                            if side == "llama_cpp":
                                s, info = llama_sample(peer, files[prec], threads, test, tokens)
                                builds.add(info["build"])
                            else:
                                s = ours_sample(files[prec], threads, test, tokens, prompt)
                            cell[side].append(s)
                        print(f"round {r + 1} T={threads} {prec:>4} {test}: llama.cpp "
                              f"{cell['llama_cpp'][-1].tok_s:7.1f}  ours {cell['ours'][-1].tok_s:7.1f} tok/s",
                              flush=True)
            wall = time.perf_counter() - t0
            after = machine_now()
        loads.append({"round": r + 1, "before": before, "after": after, "wall_s": round(wall, 1)})
        print(f"round {r + 1}: {wall:.0f} s; before: load {before['load_1min']}, others {before['others_share']:.0%} "
              f"(waited {before['waited_s']} s); after: load {after['load_1min']}, others {after['others_share']:.0%}",
              flush=True)
    return samples, loads, bare, builds


def summarise(samples: dict, bare: list[int], weights: dict[str, int]) -> list[dict]:
    bare_rss = statistics.median(bare)
    rows = []
    for (threads, prec, test), cell in samples.items():
        l, o = cell["llama_cpp"], cell["ours"]
        rows.append({"threads": threads, "precision": prec, "test": test,
                     **paired([s.tok_s for s in l], [s.tok_s for s in o]),
                     "llama_cpp_peak_rss_mib": max(s.peak_rss for s in l) / MIB,
                     "ours_peak_rss_mib": max(s.peak_rss for s in o) / MIB,
                     "ours_cpu_per_wall": statistics.median(s.cpu_per_wall for s in o),
                     "llama_cpp_cpu_per_wall": statistics.median(s.cpu_per_wall for s in l),
                     "weight_bytes": weights[prec], "kv_pool_bytes": max(s.kv_pool_bytes for s in o),
                     "rss_bound": max((s.peak_rss - bare_rss) / (weights[prec] + s.kv_pool_bytes) for s in o),
                     "llama_cpp_samples": [asdict(s) for s in l], "ours_samples": [asdict(s) for s in o]})
    return rows


def report(rows: list[dict], bare: list[int], agree: dict, header: dict) -> None:
    print(f"\n{header['date']}  {header['cpu']['model']} ({header['cpu']['cpus']} CPUs)  flags "
          f"{' '.join(header['cpu']['flags'])}\ntorch {header['torch']}  trainforge {header['git_rev']} "
          f"(kernels {header['ours_kernel_isa']}, ATen {header['aten_capability']})  isa {header['isa']}  "
          f"llama.cpp {', '.join(header['llama_cpp_build'])} (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION})  "
          f"rounds {header['rounds']}  bare `import torch` peak RSS {statistics.median(bare) / MIB:.0f} MiB")
    print("tok/s are medians over rounds; ratio = ours / llama.cpp paired per round, median (min-max); "
          "RSS = peak over rounds, tg process; bound = (ours RSS - bare) / (file tensor bytes + KV pool)")
    by = {(r["threads"], r["precision"], r["test"]): r for r in rows}
    print(f"{'T':>2} {'file':>5} | {'pp llama':>9} {'ours':>7} {'ratio':>17} | {'tg llama':>9} {'ours':>7} "
          f"{'ratio':>17} | {'RSS MiB llama / ours':>20} {'bound':>5} {'ours cpu/wall':>13}")
    for threads, prec in dict.fromkeys((r["threads"], r["precision"]) for r in rows):
        pp, tg = by[(threads, prec, "pp")], by[(threads, prec, "tg")]
        cells = [f"{c['llama_cpp']:9.1f} {c['ours']:7.1f} {c['ratio']:5.2f} ({c['ratio_min']:.2f}-{c['ratio_max']:.2f})"
                 for c in (pp, tg)]
        print(f"{threads:>2} {prec:>5} | {cells[0]} | {cells[1]} | {tg['llama_cpp_peak_rss_mib']:9.0f} / "
              f"{tg['ours_peak_rss_mib']:<8.0f} {tg['rss_bound']:5.2f} {tg['ours_cpu_per_wall']:13.2f}")
    for name, a in agree.items():
        exact = "" if a.get("llama_cpp_exact_picks") is None else \
            f"; llama.cpp's token is the fp64 forward's pick at {a['llama_cpp_exact_picks']} of {a['generated']}"
        print(f"greedy agreement, {name} file, f32 KV cache, flash attention {a.get('flash_attn', 'off')}: "
              f"{a['equal_before_first_difference']} of {a['generated']} generated tokens equal before the first "
              f"difference ({a['equal_positions']} positions equal; prompt {a['prompt_tokens']} tokens){exact}")
    for test in TESTS:
        worst = min((r for r in rows if r["test"] == test), key=lambda r: r["ratio"])
        ok = worst["ratio"] >= TARGETS[test]
        print(f"target {test} >= {TARGETS[test]}x llama.cpp at every precision and T: {'PASS' if ok else 'FAIL'} "
              f"(lowest {worst['ratio']:.2f}, {worst['precision']} T={worst['threads']})")
    worst = max((r for r in rows if r["test"] == "tg"), key=lambda r: r["rss_bound"])
    print(f"target (RSS - bare) <= {TARGETS['rss_bound']}x (weights + KV pool): "
          f"{'PASS' if worst['rss_bound'] <= TARGETS['rss_bound'] else 'FAIL'} "
          f"(highest {worst['rss_bound']:.2f}, {worst['precision']} T={worst['threads']})")
    if "f32" in agree:
        a = agree["f32"]
        print(f"target greedy f32 equal for all {a['generated']}: "
              f"{'PASS' if a['equal_before_first_difference'] == a['generated'] else 'FAIL'}")


def large_rss(peer: LlamaCpp, work: Path, threads: int, tokens: int, lock: str) -> list[dict]:
    """The RSS bound of our tg process on ``large_config``'s three files (one sample each at
    ``threads``; speed is not compared here)."""
    with locked(lock):
        files = prepare(work, peer, large_config())
        bare = statistics.median(run_process([sys.executable, "-c", "import torch"]).peak_rss for _ in range(3))
        rows = []
        for prec, f in files.items():
            s = ours_sample(f, threads, "tg", tokens, [1])
            w = tensor_bytes(f)
            rows.append({"precision": prec, "weights_mib": w / MIB, "kv_pool_mib": s.kv_pool_bytes / MIB,
                         "ours_peak_rss_mib": s.peak_rss / MIB, "bare_torch_peak_rss_mib": bare / MIB,
                         "rss_bound": (s.peak_rss - bare) / (w + s.kv_pool_bytes), "tok_s": s.tok_s})
    print(f"\nmemory on the {large_config().num_params() / 1e6:.1f}M-parameter model (--rss_large, T={threads}, "
          f"tg{tokens}, ours only):")
    for r in rows:
        print(f"  {r['precision']:>5}: peak RSS {r['ours_peak_rss_mib']:.0f} MiB, weights {r['weights_mib']:.1f} + KV "
              f"{r['kv_pool_mib']:.1f} MiB, bound {r['rss_bound']:.2f} "
              f"({'PASS' if r['rss_bound'] <= TARGETS['rss_bound'] else 'FAIL'}), {r['tok_s']:.1f} tok/s")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_decode_peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round at 2 threads (~2 min)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--pp_tokens", type=int, default=512, help="prompt length of the pp test")
    p.add_argument("--tg_tokens", type=int, default=128, help="decoded tokens of the tg test")
    p.add_argument("--agree_tokens", type=int, default=128, help="greedy tokens compared (0: skip the comparison)")
    p.add_argument("--work", type=Path, default=cache_root().parent.parent / "cpu_decode_peer",
                   help="where the model and GGUF files are made once and reused")
    p.add_argument("--build", action="store_true", help="build llama.cpp if it is absent (minutes)")
    p.add_argument("--lock", default="/tmp/cpu.lock", help="flock held through each round ('' for none)")
    p.add_argument("--quiet_share", type=float, default=0.15,
                   help="a round starts once other processes use under this share of the CPUs")
    p.add_argument("--quiet_wait_s", type=float, default=60.0, help="longest wait for that before a round")
    p.add_argument("--json", type=Path, default=None, help="also write every sample here")
    p.add_argument("--rss_large", action="store_true",
                   help="also check the memory bound on a 287M-parameter model (its files made once, ~2 min)")
    p.add_argument("--isa", choices=sorted(ISA_ENV), default="native",
                   help="native: each engine's best path on this CPU; avx2: both as an AVX2-only CPU runs them; "
                        "avx512: both on AVX-512 without AMX")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.threads = 1, [2]
    os.environ.update(ISA_ENV[a.isa])  # every process below inherits it, this one's kernels too
    peer = LlamaCpp(cache_root(), a.isa)
    if not peer.is_built():
        if not a.build:
            print(build_hint(isa=a.isa), file=sys.stderr)
            return 1
        with locked(a.lock):
            peer = build(isa=a.isa)
    with locked(a.lock):
        files = prepare(a.work, peer)
    weights = {prec: tensor_bytes(f) for prec, f in files.items()}
    print("files: " + ", ".join(f"{f} ({weights[prec] / MIB:.1f} MiB of tensors)" for prec, f in files.items()),
          flush=True)
    samples, loads, bare, builds = run_rounds(peer, files, a)
    agree = {}
    if a.agree_tokens:
        with locked(a.lock):
            agree = {prec: agreement(peer, files[prec], max(a.threads), a.agree_tokens, a.work)
                     for prec in ("f32", "q8_0")}
            # llama.cpp's default flash attention, for the record (module docstring: it rounds through fp16).
            agree["f32 (llama.cpp -fa auto)"] = agreement(peer, files["f32"], max(a.threads), a.agree_tokens, a.work,
                                                          flash_attn="auto")
    import torch

    from trainforge.infer.cpu_kernels.build import load_kernels

    ops = load_kernels()  # the instruction path our block kernels took on this CPU
    header = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_summary(),
              "torch": torch.__version__, "git_rev": git_rev(), "llama_cpp_build": sorted(builds), "isa": a.isa,
              "aten_capability": torch.backends.cpu.get_cpu_capability(),
              "ours_kernel_isa": ops.isa() if ops is not None else "none (fallback kernels)",
              "rounds": a.rounds, "threads": a.threads, "pp_tokens": a.pp_tokens, "tg_tokens": a.tg_tokens}
    rows = summarise(samples, bare, weights)
    report(rows, bare, agree, header)
    for r in loads:
        print(f"load round {r['round']}: before {r['before']['load_1min']} (others {r['before']['others_share']:.0%}, "
              f"waited {r['before']['waited_s']} s), after {r['after']['load_1min']} "
              f"(others {r['after']['others_share']:.0%})")
    large = large_rss(peer, a.work / "large", max(a.threads), a.tg_tokens, a.lock) if a.rss_large else None
    if a.json:
        a.json.write_text(json.dumps({"machine": header, "loads": loads, "bare_torch_peak_rss": bare,
                                      "rows": rows, "agreement": agree, "rss_large": large}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
