"""Streamed-text decoding: the old full re-decode against incremental ``DecodeStream``.

    python bench/detokenize.py --json out.json

What the engine thread spends turning one request's sampled tokens into streamed text,
one token per update (CPU engine: ``sync_interval_steps`` = 1), at 256 / 1024 / 2048
output tokens. A is the old ``Request.add_tokens`` (``tokenizer.decode(all output ids)``
at every update, O(n^2) over a request), B the current one (``DecodeStream``, O(n)).
Both stream the same text (checked). Runs are paired and interleaved (A B, B A, ...) in
one process, so a load change on a shared machine hits both sides of a pair; the figure
is the median of the per-pair ratios A / B with its min-max spread. The tokenizer is a
byte-level BPE (vocab 8192) trained here on Python stdlib sources, the ids the encoding
of those sources (no download). About a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path

from bench.soak_serve import lscpu_summary
from trainforge.data.tokenizer import train_tokenizer
from trainforge.infer.request import Request
from trainforge.infer.sampling import SamplingParams

SOURCES = ("argparse.py", "ast.py", "dataclasses.py", "inspect.py", "typing.py", "pathlib.py")


def old_stream(tok, ids: list[int]) -> str:
    """The pre-DecodeStream ``add_tokens`` text path (no stop strings): re-decode everything,
    hold back a trailing U+FFFD."""
    out, emitted = [], 0
    for i in range(1, len(ids) + 1):
        text = tok.decode(ids[:i])
        safe = len(text) if i == len(ids) else len(text.rstrip("\ufffd"))
        safe = max(safe, emitted)
        out.append(text[emitted:safe])
        emitted = safe
    return "".join(out)


def new_stream(tok, ids: list[int]) -> str:
    req = Request(0, [1], SamplingParams(max_new_tokens=len(ids), ignore_eos=True))
    return "".join(req.add_tokens([t], (), tok)[1] for t in ids)


def timed(fn, tok, ids) -> tuple[float, str]:
    t0 = time.perf_counter()
    text = fn(tok, ids)
    return time.perf_counter() - t0, text


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="256,1024,2048")
    p.add_argument("--pairs", default="15,9,5", help="paired runs per size")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / n).read_text() for n in SOURCES]
    tok = train_tokenizer(texts, 8192)
    corpus = tok.encode("".join(texts)).ids
    result = {"cpu": lscpu_summary(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "sizes": {}}
    for n, pairs in zip(map(int, a.sizes.split(",")), map(int, a.pairs.split(","))):
        ids = corpus[:n]
        want = tok.decode(ids)
        old_s, new_s, ratios = [], [], []
        for i in range(pairs + 1):  # pair 0 is a warm-up
            order = (old_stream, new_stream) if i % 2 == 0 else (new_stream, old_stream)
            runs = {fn: timed(fn, tok, ids) for fn in order}
            assert runs[old_stream][1] == runs[new_stream][1] == want, "the two paths stream different text"
            if i:
                old_s.append(runs[old_stream][0])
                new_s.append(runs[new_stream][0])
                ratios.append(old_s[-1] / new_s[-1])
        row = {"old_ms": round(statistics.median(old_s) * 1e3, 2), "new_ms": round(statistics.median(new_s) * 1e3, 3),
               "ratio_median": round(statistics.median(ratios), 1), "ratio_min": round(min(ratios), 1),
               "ratio_max": round(max(ratios), 1), "pairs": pairs}
        result["sizes"][n] = row
        print(f"{n:5d} tokens: full re-decode {row['old_ms']:8.2f} ms, DecodeStream {row['new_ms']:7.3f} ms per "
              f"request; ratio median {row['ratio_median']}x (min {row['ratio_min']}, max {row['ratio_max']}, "
              f"{pairs} pairs)", flush=True)
    print(json.dumps(result["cpu"]))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
