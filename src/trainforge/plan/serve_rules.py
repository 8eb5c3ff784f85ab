"""The advisor's serving rules: ``trainforge serve`` / ``generate`` flags from inference
measurements (``run_evidence.ServeEvidence``). Same contract as ``advice_rules``: a
suggestion only past a named threshold, with its evidence and predicted gain (else a
``Check`` saying why not); changes are command-line flags (``scope = "serve"``), not
training config keys.

Rules about a server's load (the KV pool's size, batch rows) read serving evidence only: a
scrape of ``trainforge serve``'s /metrics (``ServeEvidence.server_load``). ``generate
--stats`` runs one request in a pool sized for exactly that request, so its pool is always
nearly full and proves nothing about a server's."""

from __future__ import annotations

from collections.abc import Callable

from trainforge.plan.advice_rules import MIN_SPEEDUP
from trainforge.plan.advice_types import Check, Evidence, Suggestion, no_gain, not_applicable, not_measured, passed
from trainforge.plan.run_evidence import ServeEvidence

# KV pool blocks in use at the peak above 90% of the pool: the next longer request waits
# for blocks (admission reserves prompt + max_tokens up front), whatever batch rows are free.
KV_FULL = 0.90
# Requests queued while the KV pool peaked below 70%: batch rows, not memory, are short.
KV_ROOM = 0.70
# A pool whose peak stayed under 25% holds 4x the memory the load needed.
KV_OVERSIZED = 0.25
# Quantised variants must agree with fp32's greedy tokens this often (teacher-forced) to be
# advised: the bar bench/inference.py and the test suite hold int8 / int4 to.
AGREEMENT_MIN = 0.95
# int8 weights against fp32 decode when no bench measurement is given: 2.4x on the
# memory-bound 90m model (docs/benchmarks-archive.md "Inference": 152.5 vs 62.3 tok/s); small models whose
# weights fit the cache gain less (tiny 1.5x).
INT8_DECODE_SPEEDUP = 2.4
# Speculative decoding that emits under 1.3 tokens per verification forward costs more in
# drafting than it saves (each step runs the drafter k times and verifies k + 1 positions).
SPEC_MIN_ACCEPTED = 1.3
# Quantised layers on these kernels dequantise the weight on every call ("reference", the
# fallback of infer/quantize/common.py; "unpacked": no kernel chosen): a packed kernel is faster.
SLOW_KERNELS = ("unpacked", "reference")

ServeRule = Callable[[ServeEvidence], "Suggestion | Check"]


def _not_server_load(ev: ServeEvidence) -> Check | None:
    """Why ``ev`` says nothing about a server's KV pool or batch rows, or None when it does."""
    if ev.server_load:
        return None
    what = {"engine-stats": "`generate --stats` (one request in a pool sized for it)",
            "bench-inference": "bench/inference.py output (no server pool)"}.get(ev.kind, ev.kind)
    return not_applicable(f"{ev.source} is {what}: give a /metrics scrape of `trainforge serve` under load")


def kv_pool_full(ev: ServeEvidence) -> Suggestion | Check:
    if (why := _not_server_load(ev)) is not None:
        return why
    share = ev.kv_peak_share
    rejected = ev.rejected or 0
    if share is None:
        return not_measured("KV blocks peak / pool", KV_FULL, "no KV pool figures in the scrape")
    if share < KV_FULL and not rejected:
        return passed("KV blocks peak / pool", share, KV_FULL)
    blocks = int(ev.blocks_total or 0)
    evidence = [Evidence("KV blocks peak / pool", share, KV_FULL)]
    if rejected:
        evidence.append(Evidence("rejected requests", rejected, 0))
    return Suggestion("serve-kv-pool", f"a larger KV pool: --n_blocks {2 * blocks}",
                      f"the KV pool peaked at {share:.0%} of its {blocks} blocks"
                      + (f"; {rejected:.0f} requests were refused" if rejected else ""),
                      evidence, {"--n_blocks": 2 * blocks}, None,
                      "admission waits for blocks no longer; memory: 2x the pool's bytes", scope="serve",
                      needed=True)


def batch_rows(ev: ServeEvidence) -> Suggestion | Check:
    if (why := _not_server_load(ev)) is not None:
        return why
    share = ev.kv_peak_share
    if ev.waiting is None or share is None:
        return not_measured("waiting requests", 0, "no waiting-request or KV pool figures in the scrape")
    if not ev.waiting:
        return passed("waiting requests", ev.waiting, 0)
    if share >= KV_ROOM:
        return no_gain("waiting requests", ev.waiting, 0, f"the KV pool is at {share:.0%} (>= {KV_ROOM:.0%}): "
                       "memory, not batch rows, is short")
    rows = int(ev.peak_batch or ev.running or 0)
    if rows < 1:
        return not_measured("waiting requests", 0, "no running-request count to double")
    return Suggestion("serve-batch", f"more batch rows: --max_batch_size {2 * rows}",
                      f"{ev.waiting:.0f} requests waited while the KV pool peaked at {share:.0%}: rows ran out "
                      "before memory", [Evidence("waiting requests", ev.waiting, 0),
                                        Evidence("KV blocks peak / pool", share, KV_ROOM, "<")],
                      {"--max_batch_size": 2 * rows}, 2.0,
                      "upper bound: decode reads the weights once per step for the whole batch, so tokens/s "
                      "grows with rows until compute-bound (bench/inference.py: x4.6 at 32 rows vs 1)",
                      scope="serve")


def kv_pool_oversized(ev: ServeEvidence) -> Suggestion | Check:
    if (why := _not_server_load(ev)) is not None:
        return why
    if ev.blocks_peak is None:  # a scrape is one instant, not the peak: no shrinking on it
        return not_measured("KV blocks peak / pool", KV_OVERSIZED, "a scrape holds the pool's use at one instant, "
                            "not its peak", "<")
    share = ev.kv_peak_share
    if share is None or share >= KV_OVERSIZED or ev.waiting or ev.rejected:
        return passed("KV blocks peak / pool", share if share is not None else 1.0, KV_OVERSIZED, "<")
    blocks = int(ev.blocks_total or 0)
    new = max(1, int(blocks * share * 2))
    return Suggestion("serve-kv-smaller", f"a smaller KV pool: --n_blocks {new}",
                      f"the KV pool peaked at {share:.0%} of {blocks} blocks",
                      [Evidence("KV blocks peak / pool", share, KV_OVERSIZED, "<")], {"--n_blocks": new}, None,
                      "frees memory (2x the measured peak kept); no speed change", scope="serve")


def quantize(ev: ServeEvidence) -> Suggestion | Check:
    if ev.quant_kernels is None:
        return not_measured("quantised layers", 1, "the file does not say which kernels the layers ran on", "<")
    if ev.quant_kernels:
        return passed("quantised layers", sum(ev.quant_kernels.values()), 1, "<")
    if ev.variants:
        base = ev.variants.get("fp32", {}).get("decode_tok_s")
        measured = {name: v for name, v in ev.variants.items() if name in ("int8", "int4") and base}
        ok = [(v["decode_tok_s"] / base, name, v["agreement"]) for name, v in measured.items()
              if v.get("agreement", 0) >= AGREEMENT_MIN]
        if ok:
            speedup, mode, agree = max(ok)
            if speedup < MIN_SPEEDUP:
                return no_gain(f"{mode} / fp32 decode tok/s", speedup, MIN_SPEEDUP, "not faster here", "<")
            return Suggestion("serve-quantize", f"quantised weights: --quantize {mode}",
                              f"fp32 weights; {mode} decoded {speedup:.2f}x faster with {agree:.1%} greedy agreement "
                              "on a trained checkpoint",
                              [Evidence(f"{mode} / fp32 decode tok/s", speedup, MIN_SPEEDUP),
                               Evidence(f"{mode} greedy agreement", agree, AGREEMENT_MIN)], {"--quantize": mode},
                              speedup, "measured by bench/inference.py on this machine", scope="serve")
        int8 = measured.get("int8")
        if int8 is None or "agreement" in int8 or int8["decode_tok_s"] / base < MIN_SPEEDUP:
            # int8 unmeasured, below the agreement bar on a trained model, or not faster
            return no_gain("greedy agreement with fp32 (trained checkpoint)", 0.0, AGREEMENT_MIN,
                           "no quantised mode measured faster at the agreement bar", "<")
        # Speed measured, agreement not (no --agreement_checkpoint): int8, the mode that keeps
        # agreement best, with the check to run named.
        speedup = int8["decode_tok_s"] / base
        return Suggestion("serve-quantize", "quantised weights: --quantize int8",
                          f"fp32 weights; int8 decoded {speedup:.2f}x faster (agreement not measured on a trained "
                          "checkpoint)", [Evidence("int8 / fp32 decode tok/s", speedup, MIN_SPEEDUP)],
                          {"--quantize": "int8"}, speedup,
                          "measured by bench/inference.py on this machine; check agreement with its "
                          "--agreement_checkpoint", scope="serve")
    return Suggestion("serve-quantize", "quantised weights: --quantize int8",
                      "fp32 weights: decode reads 4 bytes per weight per token",
                      [Evidence("quantised layers", 0, 1, "<")], {"--quantize": "int8"}, INT8_DECODE_SPEEDUP,
                      "4x fewer weight bytes per token; 2.4x measured on a memory-bound 90M model (less when the "
                      "weights fit the cache); check agreement with bench/inference.py --agreement_checkpoint",
                      scope="serve")


def fusion(ev: ServeEvidence) -> Suggestion | Check:
    if ev.kind != "engine-stats" or ev.fusions is None:
        return not_measured("fused layers", 1, "only `generate --stats` records the engine's fusions", "<")
    if ev.fusions:
        return passed("fused layers", sum(v for v in ev.fusions.values() if isinstance(v, (int, float))), 1, "<")
    return Suggestion("serve-fusion", "fuse QKV, gate+up and add+RMSNorm: drop --no_fuse",
                      "no fused layers in the engine: each decode step dispatches ~26% more operators",
                      [Evidence("fused layers", 0, 1, "<")], {"--no_fuse": False}, 1.05,
                      "26% fewer operators per decode step (bench/inference.py); gain is the dispatch share",
                      scope="serve")


def kernel_choice(ev: ServeEvidence) -> Suggestion | Check:
    if not ev.quant_kernels:
        return not_applicable("no quantised layers")
    slow = {k: n for k, n in ev.quant_kernels.items() if k.split(" ")[0] in SLOW_KERNELS}
    if not slow:
        return passed("layers on the reference kernel", 0, 0)
    names = ", ".join(f"{k} x{n}" for k, n in slow.items())
    return Suggestion("serve-kernel", "a measured quantised kernel: --quant_kernel measure",
                      f"quantised layers dequantise their weights on every call ({names})",
                      [Evidence("layers on the reference kernel", sum(slow.values()), 0)],
                      {"--quant_kernel": "measure"}, None,
                      "times the packed kernels for this device once (cached) and uses the fastest", scope="serve")


def speculative(ev: ServeEvidence) -> Suggestion | Check:
    acc = ev.spec_mean_accepted_length
    if acc is None or not ev.spec_drafted:
        return not_applicable("no speculative decoding measured")
    if acc >= SPEC_MIN_ACCEPTED:
        return passed("mean accepted length", acc, SPEC_MIN_ACCEPTED, "<")
    return Suggestion("serve-speculative", "speculation does not pay here: drop --speculative",
                      f"{acc:.2f} tokens per verification forward", [Evidence("mean accepted length", acc,
                                                                              SPEC_MIN_ACCEPTED, "<")],
                      {"--speculative": None}, None, "the drafter's k forwards per step are saved", scope="serve")


SERVE_RULES: tuple[ServeRule, ...] = (kv_pool_full, batch_rows, kv_pool_oversized, quantize, fusion, kernel_choice,
                                      speculative)
