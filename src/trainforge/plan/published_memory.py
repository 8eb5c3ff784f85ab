"""DeepSpeed's memory estimators for model states (parameters, gradients, optimizer), written
out from their documentation, to compare with our estimate's ``params_bytes + grads_bytes +
optimizer_bytes`` on the same inputs (issue 21: "compare memory predictions with llm-analysis
or DeepSpeed's estimators on the same inputs where they apply").

Source: deepspeedai/DeepSpeed ``docs/code-docs/source/memory.rst`` (commit 0cca539) and
``deepspeed/runtime/zero/stage3.py`` ``estimate_zero3_model_states_mem_needs``. Hand-written
because installing DeepSpeed pulls its CUDA build machinery, and llm-analysis 0.2.2 pins
``transformers<5`` and ``huggingface-hub<0.15`` (this project runs transformers 5): the
formulas are short and documented, and ``DOC_CASES`` checks them against the documented output.
``LLM_ANALYSIS`` keeps llm-analysis's figures for the same cases, from one run outside this venv.

ZeRO-3 (all-cold, no offload), bytes per GPU::

    4 * largest_layer_params + 18 * params / total_gpus

(18 bytes per parameter: fp16 parameter 2 + fp32 master 4 + fp32 gradient 4 + Adam 8; the
largest layer gathered: fp16 parameters 2 + fp16 gradients 2). ZeRO-2 (no offload)::

    4 * params + 16 * params / total_gpus

Where it applies to us: ZeRO-3 is FSDP (``dp_shard = total_gpus``); under bf16-mixed our
FSDP2 keeps fp32 parameters sharded and casts per layer, so it has no separate half-precision
copy: 16 bytes per parameter sharded against DeepSpeed's 18.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainforge.model.config import ModelConfig

GIB = float(1 << 30)
SOURCE = ("https://github.com/deepspeedai/DeepSpeed/blob/0cca5393114258967cbfe25e24356e43e81cc9e4/"
          "docs/code-docs/source/memory.rst")


def zero3_gpu_bytes(total_params: float, largest_layer_params: float, total_gpus: int,
                    offload_param: bool = False, offload_optimizer: bool = False) -> float:
    """``estimate_zero3_model_states_mem_needs``'s GPU figure (per GPU, bytes)."""
    largest = 4 * largest_layer_params
    if offload_optimizer and offload_param:
        return largest
    if offload_optimizer:
        return largest + int(2 * total_params / total_gpus)
    return largest + int(18 * total_params / total_gpus)


def zero2_gpu_bytes(total_params: float, total_gpus: int, offload_optimizer: bool = False) -> float:
    """``estimate_zero2_model_states_mem_needs``'s GPU figure (per GPU, bytes)."""
    if offload_optimizer:
        return 2 * total_params
    return 4 * total_params + int(16 * total_params / total_gpus)


@dataclass(frozen=True)
class DocCase:
    """One example printed in memory.rst: inputs and the documented per-GPU GB (GiB, 2 decimals)."""

    name: str
    stage: int
    total_params: float
    largest_layer_params: float
    total_gpus: int
    offload_param: bool
    offload_optimizer: bool
    documented_gb: float

    def computed_gb(self) -> float:
        if self.stage == 3:
            b = zero3_gpu_bytes(self.total_params, self.largest_layer_params, self.total_gpus,
                                self.offload_param, self.offload_optimizer)
        else:
            b = zero2_gpu_bytes(self.total_params, self.total_gpus, self.offload_optimizer)
        return b / GIB


# estimate_zero{2,3}_model_states_mem_needs_all_cold(total_params=2851e6, largest_layer_params=32e6,
# num_gpus_per_node=8, num_nodes=1), "per GPU" column of the documented output.
DOC_CASES: tuple[DocCase, ...] = (
    DocCase("t5-3b zero3, no offload", 3, 2851e6, 32e6, 8, False, False, 6.09),
    DocCase("t5-3b zero3, offload optimizer", 3, 2851e6, 32e6, 8, False, True, 0.78),
    DocCase("t5-3b zero3, offload param+optimizer", 3, 2851e6, 32e6, 8, True, True, 0.12),
    DocCase("t5-3b zero2, no offload", 2, 2851e6, 0, 8, False, False, 15.93),
    DocCase("t5-3b zero2, offload optimizer", 2, 2851e6, 0, 8, False, True, 5.31),
)


def largest_layer_params(model: ModelConfig) -> int:
    """DeepSpeed's ``largest_layer_params``: the most parameters one module holds directly
    (for a Llama shape the embedding or output projection, vocab x dim, else one FFN matrix)."""
    d = model.dim
    return max(model.vocab_size * d, d * model.ffn_hidden_dim, d * model.n_heads * model.head_dim)


@dataclass(frozen=True)
class MemoryComparison:
    """Our model-state bytes per GPU (params + grads + optimizer from the estimate's
    breakdown) against DeepSpeed ZeRO-3's formula, FSDP over ``n_gpus``, bf16-mixed."""

    flavor: str
    n_gpus: int
    ours_bytes: float
    ours_gathered_bytes: float  # the estimate's unsharded_bytes: FSDP's gathered blocks (DeepSpeed's 4 x largest layer)
    params: float  # our parameter count (ModelConfig.num_params)
    deepspeed_bytes: float
    deepspeed_sharded_bytes: float  # the 18 * params / gpus part alone, without the gathered layer
    llm_analysis_bytes: float | None = None  # weight + gradient + optimizer, LLM_ANALYSIS
    llm_analysis_params: float | None = None  # the parameter count llm-analysis used

    @property
    def ratio(self) -> float:
        return self.ours_bytes / self.deepspeed_bytes


MEMORY_CASES: tuple[tuple[str, int], ...] = (("llama-8b", 8), ("llama-70b", 64), ("llama-405b", 512))

# llm-analysis 0.2.2 (pip download llm-analysis --no-deps; run outside this project's venv pins with a stub
# for its `fire` import, 2026-12-02): LLMAnalysis(ModelConfig(hidden_dim, num_layers, n_head, vocab 128256,
# num_key_value_heads=8, ffn_embed_dim, expansion_ratio=ffn/dim), gpu "h100-sxm-80gb", dtype "w16a16e16",
# ParallelismConfig(dp_size=GPUs)).training(batch_size_per_gpu=1, seq_len=8192, ds_zero=DSZeRO.STAGE_3,
# mlp_gated_linear_units=True, activation_recomputation=FULL). Its figures per GPU, bytes:
# (num_params_total, weight, gradient, optimizer_state). It counts 18 B/param sharded like DeepSpeed (bf16
# weight 2, fp32 gradient 4, fp32 master + Adam 12) but its parameter count has a two-matrix MLP even with
# gated linear units and one (tied) embedding, so it counts 5.63B parameters for Llama 3 8B (8.03B).
LLM_ANALYSIS: dict[tuple[str, int], tuple[float, float, float, float]] = {
    ("llama-8b", 8): (5625876480.0, 1406469120.0, 2812938240.0, 8438814720.0),
    ("llama-70b", 64): (50712551424.0, 1584767232.0, 3169534464.0, 9508603392.0),
    ("llama-405b", 512): (293827723264.0, 1147764544.0, 2295529088.0, 6886587264.0),
}


def compare_memory(estimate, cluster, cases: tuple[tuple[str, int], ...] = MEMORY_CASES,
                   seq_len: int = 8192) -> list[MemoryComparison]:
    """``estimate``/``cluster``: ``cost_model.estimate`` and ``hardware.cluster`` (or fakes).
    One sequence per GPU; activations are not compared (DeepSpeed's estimator has none)."""
    from trainforge.model.config import FLAVORS
    from trainforge.plan.spec import Layout, Workload

    out = []
    for flavor, n in cases:
        model = FLAVORS[flavor]
        est = estimate(Workload(model=model, seq_len=seq_len, global_batch=n, precision="bf16-mixed", flavor=flavor),
                       Layout(dp_shard=n), cluster("h100", n))
        ours = sum(est.breakdown.get(k, 0.0) for k in ("params_bytes", "grads_bytes", "optimizer_bytes"))
        p = model.num_params()
        la = LLM_ANALYSIS.get((flavor, n))
        out.append(MemoryComparison(flavor=flavor, n_gpus=n, ours_bytes=ours, params=p,
                                    ours_gathered_bytes=est.breakdown.get("unsharded_bytes", 0.0),
                                    deepspeed_bytes=zero3_gpu_bytes(p, largest_layer_params(model), n),
                                    deepspeed_sharded_bytes=18 * p / n,
                                    llm_analysis_bytes=sum(la[1:]) if la else None,
                                    llm_analysis_params=la[0] if la else None))
    return out
