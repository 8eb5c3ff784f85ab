"""The table of known metrics: record key -> Prometheus name, type, unit, level, help.

Everything the trainer (or the monitor) puts into a metrics record is looked up here.
A key with a spec becomes a typed, documented metric; a numeric key without one is
still exported, as ``trainforge_record_value{key="..."}`` (so a branch that adds a
record key never breaks monitoring), until someone adds a row here. Adding a metric
is one ``MetricSpec`` line; ``docs/metrics.md`` is generated from this table
(``python -m trainforge.monitor.catalog > docs/metrics.md``; a test checks it).

Value shapes a record may hold under a key:

- a number: one sample (labels: ``rank`` plus the spec's fixed labels);
- a dict ``{label value: number}``: one sample per item, the key filling
  ``spec.labels[0]`` (e.g. ``grad_norm_group = {"layers.0": 0.3}`` -> ``group="layers.0"``);
- a list of numbers: one sample per index (``stage_compute_s`` -> ``stage="0"``); a list of
  lists fills two labels (``moe_load[layer][expert]`` -> ``moe_layer="0", expert="3"``);
- ``precision``-style ``{group: dtype name}``: ``encode="dtype_bytes"`` turns the dtype
  into a ``dtype`` label and its width in bytes into the value (promtool wants base
  units: bytes, not bits; ``scale`` converts other bit counts the same way).

How a record value updates the metric (``update``):

- ``set``: gauges; the latest record wins.
- ``cumulative``: counters whose record value is already a running total (``tokens``);
  a smaller value (resume from an earlier checkpoint, rollback) is a counter reset,
  as Prometheus' ``rate()`` expects.
- ``window``: counters whose record value is an amount per logging window; every
  record of one window carries the same amount, so it is added once per window.
- ``observe``: histograms; one observation per record that carries the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]
Level = Literal["system", "framework", "model"]
Update = Literal["set", "cumulative", "window", "observe"]

PREFIX = "trainforge_"
UNKNOWN_NAME = "trainforge_record_value"
# Step and checkpoint times span CPU toy runs (ms) to large jobs (minutes).
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   300.0, 900.0)
# One decode step: ~0.1 ms (a small model on a GPU) to ~1 s (a large one on a CPU).
TOKEN_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                         0.25, 0.5, 1.0, 2.5)
DTYPE_BYTES = {"fp64": 8, "float64": 8, "fp32": 4, "float32": 4, "tf32": 4, "bf16": 2, "bfloat16": 2,
               "fp16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class MetricSpec:
    key: str  # record key; a regex when ``pattern`` (its named groups become labels)
    name: str  # Prometheus name; counters end in _total
    kind: Kind
    unit: str
    level: Level
    help: str  # what it is and how it is measured (the docs table's last column)
    labels: tuple[str, ...] = ()  # labels filled from dict keys / list indices / the pattern
    const_labels: tuple[tuple[str, str], ...] = ()  # fixed labels, e.g. the parallel axis
    when: str = "always"  # when the value exists
    pattern: bool = False
    update: Update | None = None  # default: gauge set, histogram observe, counter cumulative
    encode: Literal["number", "dtype_bytes"] = "number"
    scale: float = 1.0  # registry value = record value x scale (record bits -> exported bytes)
    buckets: tuple[float, ...] = SECONDS_BUCKETS

    @property
    def how_updated(self) -> Update:
        if self.update is not None:
            return self.update
        return {"gauge": "set", "histogram": "observe", "counter": "cumulative"}[self.kind]

    @property
    def label_names(self) -> tuple[str, ...]:
        extra = ("dtype",) if self.encode == "dtype_bytes" else ()
        return ("rank", *(k for k, _ in self.const_labels), *self.labels, *extra)


def _s(key, name, kind, unit, level, help, **kw) -> MetricSpec:
    return MetricSpec(key, PREFIX + name, kind, unit, level, help, **kw)


CUDA = "CUDA device"
NVML = "CUDA device and nvidia-ml-py (the `gpu` extra)"
SAMPLED = "steps sampled every monitor.interval_steps"
SERVE = "trainforge serve"
MOE = "MoE model (model.n_routed_experts > 0)"
SPEC = "trainforge serve --speculative"
MTP = "model.mtp_depth > 0"
ENERGY = "an energy counter: NVML (CUDA, nvidia-ml-py) or readable RAPL powercap zones (usually root, bare metal)"

CATALOG: tuple[MetricSpec, ...] = (
    # -- system ------------------------------------------------------------------------
    _s("cpu_util", "process_cpu_utilization_ratio", "gauge", "ratio", "system",
       "CPU time this process used over the logging window / (wall time x logical CPUs), from os.times"),
    _s("cpu_seconds", "process_cpu_seconds_total", "counter", "seconds", "system",
       "user + system CPU seconds of this process since it started (os.times)"),
    _s("host_cpu_util", "host_cpu_utilization_ratio", "gauge", "ratio", "system",
       "busy share of all CPUs of the machine over the logging window, any process (/proc/stat)", when="Linux"),
    _s("rss_bytes", "process_resident_memory_bytes", "gauge", "bytes", "system",
       "resident set size of this process at the logging interval (/proc/self/statm)"),
    _s("peak_memory_bytes", "peak_memory_bytes", "gauge", "bytes", "system",
       "CUDA allocator peak, or peak RSS on CPU; maximum over ranks (trainer, all-reduce MAX)"),
    _s("gpu_util", "gpu_utilization_ratio", "gauge", "ratio", "system",
       "share of the last sample period in which a kernel ran on this rank's GPU (NVML via "
       "torch.cuda.utilization)", when=NVML),
    _s("gpu_memory_allocated_bytes", "gpu_memory_allocated_bytes", "gauge", "bytes", "system",
       "bytes held by tensors in the CUDA caching allocator (torch.cuda.memory_allocated)", when=CUDA),
    _s("gpu_memory_reserved_bytes", "gpu_memory_reserved_bytes", "gauge", "bytes", "system",
       "bytes the CUDA caching allocator reserved from the driver (torch.cuda.memory_reserved)", when=CUDA),
    _s("pcie_bytes_per_s", "host_device_copy_bytes_per_second", "gauge", "bytes/s", "system",
       "PCIe traffic of this rank's GPU, direction h2d (host to device) or d2h, NVML throughput counters "
       "(a 20 ms sample at the logging interval)", labels=("direction",), when=NVML),
    # energy and memory bandwidth (energy.py): absent where no counter is readable, never 0
    _s("power_w", "power_watts", "gauge", "watts", "system",
       "mean power over the time since the previous logging window per domain: gpu (this rank's GPU, NVML energy "
       "counter, else its power reading), package / dram / core / uncore / psys (RAPL /sys/class/powercap, the whole "
       "machine, local rank 0 only)", labels=("domain",), when=ENERGY),
    _s("energy_j", "energy_joules_total", "counter", "joules", "system",
       "energy per domain since the monitor started (the trainer built it), from the same counters (RAPL wrap-around at "
       "max_energy_range_uj handled)", labels=("domain",), update="window", when=ENERGY),
    _s("energy_per_token_j", "energy_per_token_joules", "gauge", "joules/token", "system",
       "a domain's energy between two logging windows (validation, checkpoints included) / the job's tokens "
       "trained in between; sum over ranks for the job's", labels=("domain",), when=ENERGY + ", from the 2nd window"),
    _s("memory_bandwidth_bytes_per_s", "memory_bandwidth_bytes_per_second", "gauge", "bytes/s", "system",
       "achieved DRAM / HBM bandwidth over the logging window; the source label says how: nvml_gpm (GPU DRAM "
       "counters, Hopper+), nvml_busy_x_peak (memory-busy share x peak: an upper bound), perf_uncore (CPU memory "
       "controllers' CAS counters, the whole machine, local rank 0), step_bytes_estimate (a model of the bytes one "
       "step reads and writes x steps/s: a lower bound, not a counter)", labels=("source",),
       when="always (step_bytes_estimate); NVML sources: " + NVML + "; perf_uncore: Intel uncore_imc PMUs readable"),
    _s("memory_bandwidth_peak_bytes_per_s", "memory_bandwidth_peak_bytes_per_second", "gauge", "bytes/s", "system",
       "theoretical memory bandwidth of this rank's GPU: NVML bus width / 8 x max memory clock x 2", when=NVML),
    _s("step_bytes_estimate", "step_memory_traffic_estimate_bytes", "gauge", "bytes", "system",
       "modelled bytes one training step reads and writes on this rank: weights twice, saved activations "
       "(trainer's memory accounting) twice, gradients, optimizer parameters and state (monitor/step_bytes.py)"),
    _s("data_wait_s", "data_wait_seconds", "gauge", "seconds", "system",
       "per step: from the end of the previous optimizer step (or of the logging, validation or "
       "checkpoint record written since) to the first forward: batch fetch, host-to-device copy issue, "
       "callbacks (hooks)"),
    _s("io_read_bytes", "io_read_bytes_total", "counter", "bytes", "system",
       "bytes this process read: tier=storage from block devices (disk, not page cache), tier=syscall "
       "through read() calls of any kind (/proc/self/io read_bytes, rchar); memory-mapped shards count "
       "under storage only when they miss the page cache", labels=("tier",), when="Linux"),
    _s("data_io_wait_frac", "data_wait_ratio", "gauge", "ratio", "system",
       "share of the window the training loop waited for the data loader", when="always (the data loader's own clock)"),
    _s(r"data_hit_rate_(?P<tier>[a-z]+)", "data_cache_hit_ratio", "gauge", "ratio", "system",
       "share of shard reads served by each cache tier in the window", pattern=True, labels=("tier",),
       when="data.cache.dir set"),
    _s(r"data_bytes_(?P<tier>[a-z]+)", "data_cache_read_bytes_total", "counter", "bytes", "system",
       "bytes read per cache tier (memory, disk, source)", pattern=True, labels=("tier",), update="window",
       when="data.cache.dir set"),
    _s("data_prefetch_depth", "data_prefetch_depth", "gauge", "batches", "system",
       "mean number of batches ready ahead of the loop in the window", when="data.cache.dir set"),
    _s("data_corrupt_refetched", "data_corrupt_refetched_total", "counter", "shards", "system",
       "shards that failed an integrity check and were fetched again", update="window",
       when="data.cache.dir set"),
    _s("data_quarantined", "data_quarantined_total", "counter", "shards", "system",
       "shards quarantined after repeated integrity failures", update="window", when="data.cache.dir set"),
    # -- framework ---------------------------------------------------------------------
    _s("step", "step", "gauge", "steps", "framework", "optimizer steps completed (the record's step)"),
    _s("step_s", "step_seconds", "histogram", "seconds", "framework",
       "per step: first forward to the end of the last optimizer step, plus the data wait before it "
       "(forward/optimizer hooks; host clock on CPU, CUDA events on GPU)"),
    _s("forward_s", "forward_seconds", "gauge", "seconds", "framework",
       "per step: time inside the model's forward, summed over micro-batches and stages (forward hooks)"),
    _s("backward_s", "backward_seconds", "gauge", "seconds", "framework",
       "per step: first forward to the optimizer, minus forward time: backward, loss, gradient "
       "clipping, later micro-batches' data"),
    _s("optimizer_s", "optimizer_seconds", "gauge", "seconds", "framework",
       "per step: optimizer.step of all model parts (optimizer step hooks)"),
    _s("collective_s", "collective_seconds", "gauge", "seconds", "framework",
       "per step: comm_share x step time (0 for a single process: it has no collectives)"),
    _s("comm_share", "communication_ratio", "gauge", "ratio", "framework",
       "time in gloo/NCCL collectives / step time on one profiled step per window (torch.profiler), mean "
       "over ranks; 0 for a single process"),
    _s("bubble_fraction", "pipeline_bubble_ratio", "gauge", "ratio", "framework",
       "pipeline idle time / step time, mean over stages (0 without pipeline parallelism)",
       const_labels=(("axis", "pp"),)),
    _s("stage_compute_s", "pipeline_stage_compute_seconds", "gauge", "seconds", "framework",
       "compute seconds per pipeline stage in the last step, mean over the ranks holding it",
       labels=("stage",), const_labels=(("axis", "pp"),), when="pipeline parallelism"),
    _s("tokens", "tokens_total", "counter", "tokens", "framework",
       "tokens trained on so far, all data-parallel ranks (step x tokens per step)"),
    _s("tokens_per_s", "tokens_per_second", "gauge", "tokens/s", "framework",
       "training throughput over the logging window, whole job (wall clock, device synchronised)"),
    _s("mfu", "mfu_ratio", "gauge", "ratio", "framework",
       "model FLOPs utilisation: achieved FLOP/s / mfu_peak_flops, at most 1 (train/mfu.py)"),
    _s("mfu_peak_flops", "mfu_peak_flops_per_second", "gauge", "FLOP/s", "framework",
       "the job's peak MFU is measured against: per device x devices; a published dense figure for known "
       "CUDA devices, else the best of short matmul probes, raised when a logging window beats it (the "
       "record's mfu_peak_source says which)"),
    _s("wire_bytes_per_step", "wire_bytes_per_step", "gauge", "bytes", "framework",
       "gradient bytes this rank sent per step on the data-parallel replicate axis (compression hooks; 0 for "
       "a single process)", const_labels=(("axis", "dp_replicate"),),
       when="gradient compression, or a single process"),
    _s("wire_ratio_vs_fp32", "wire_fp32_ratio", "gauge", "ratio", "framework",
       "bytes sent / bytes of an fp32 ring all-reduce of the same gradients",
       const_labels=(("axis", "dp_replicate"),), when="gradient compression"),
    _s("compression_bits", "compression_value_bytes", "gauge", "bytes", "framework",
       "bytes per gradient value each bucket used last (the record's bits / 8)", labels=("bucket",), scale=1 / 8,
       const_labels=(("axis", "dp_replicate"),), when="gradient compression"),
    _s("checkpoint_save_s", "checkpoint_save_seconds", "histogram", "seconds", "framework",
       "wall time of one checkpoint save, all ranks (Trainer.save)"),
    _s("top_ops", "operator_self_seconds", "gauge", "seconds", "framework",
       "self time of the most expensive operators in one profiled step (torch.profiler: CPU self time from "
       "its raw events, equal to key_averages; on CUDA key_averages' device self time)", labels=("op",),
       when="monitor.profile_every > 0"),
    _s("optimizer_skipped_steps", "optimizer_skipped_steps_total", "counter", "steps", "framework",
       "training steps on which no optimizer step ran since this process started (loss-scale overflow, "
       "bad-step skip), counted by optimizer step hooks"),
    _s("monitor_s", "monitor_seconds_total", "counter", "seconds", "framework",
       "host seconds this process spent in monitoring (its hooks, record enrichment, registry, sinks; "
       "not the profiler's slowdown of a profiled step), measured around each of them"),
    _s("parallel_degree", "parallel_degree", "gauge", "ranks", "framework",
       "size of each parallel axis of the layout (pp, dp_replicate, dp_shard, tp)", labels=("axis",)),
    # -- framework: inference server (trainforge serve) -------------------------------------
    _s("infer_running", "inference_running_requests", "gauge", "requests", "framework",
       "requests in the engine's decode batch (read at scrape time)", when=SERVE),
    _s("infer_waiting", "inference_waiting_requests", "gauge", "requests", "framework",
       "requests in the engine's bounded queue, waiting for a batch row", when=SERVE),
    _s("kv_blocks_used", "kv_cache_blocks_used", "gauge", "blocks", "framework",
       "KV-cache pool blocks holding tokens (paged cache, infer/kv_pool.py)", when=SERVE),
    _s("kv_blocks_reserved", "kv_cache_blocks_reserved", "gauge", "blocks", "framework",
       "KV-cache blocks used plus those promised to running requests (reserved at admission for prompt + "
       "max_tokens)", when=SERVE),
    _s("kv_blocks_capacity", "kv_cache_blocks_capacity", "gauge", "blocks", "framework",
       "usable blocks in the KV-cache pool (allocated once per engine)", when=SERVE),
    _s("kv_block_utilisation", "kv_cache_block_utilization_ratio", "gauge", "ratio", "framework",
       "KV-cache blocks used / usable blocks", when=SERVE),
    _s("kv_slot_utilisation", "kv_cache_slot_utilization_ratio", "gauge", "ratio", "framework",
       "tokens stored / token slots of the used blocks (what partly filled last blocks waste)", when=SERVE),
    _s("infer_prompt_tokens", "inference_prompt_tokens_total", "counter", "tokens", "framework",
       "prompt tokens prefilled by the engine", when=SERVE),
    _s("infer_generated_tokens", "inference_generated_tokens_total", "counter", "tokens", "framework",
       "tokens generated by the engine", when=SERVE),
    _s("infer_decode_steps", "inference_decode_steps_total", "counter", "steps", "framework",
       "batched decode steps the engine ran", when=SERVE),
    _s("infer_rejected", "inference_requests_rejected_total", "counter", "requests", "framework",
       "requests refused because the engine's queue was full", when=SERVE),
    _s("infer_finished", "inference_requests_finished_total", "counter", "requests", "framework",
       "finished requests by reason: stop (stop token or string), length (max_tokens), abort (client "
       "disconnect), error (the engine failed the request)", labels=("reason",), when=SERVE),
    _s("ttft_s", "inference_time_to_first_token_seconds", "histogram", "seconds", "framework",
       "per request: submit to the engine until its first token is sampled (queueing and prefill included)",
       when=SERVE),
    _s("request_s", "inference_request_seconds", "histogram", "seconds", "framework",
       "per request: submit until its last token", when=SERVE),
    _s("tpot_s", "inference_time_per_output_token_seconds", "histogram", "seconds", "framework",
       "per request of 2+ tokens: (last token - first token) / (tokens - 1), the decode pace a client sees "
       "(vLLM's TPOT)", when=SERVE, buckets=TOKEN_SECONDS_BUCKETS),
    _s("spec_drafted_tokens", "speculative_drafted_tokens_total", "counter", "tokens", "framework",
       "tokens proposed by the drafter (num_speculative_tokens per running request per step)", when=SPEC),
    _s("spec_accepted_tokens", "speculative_accepted_tokens_total", "counter", "tokens", "framework",
       "drafted tokens the target accepted (speculative_sampling.accept)", when=SPEC),
    _s("spec_acceptance_rate", "speculative_acceptance_ratio", "gauge", "ratio", "framework",
       "share of a request's speculative steps in which draft number position + 1 was accepted (position 0 = the "
       "first draft), since the engine started", labels=("position",), when=SPEC),
    _s("spec_mean_accepted_length", "speculative_mean_accepted_length", "gauge", "tokens", "framework",
       "tokens emitted per request per verification forward (accepted drafts + the target's own token), since "
       "the engine started", when=SPEC),
    _s(r"http_requests (?P<path>\S+) (?P<status>\d+)", "http_requests_total", "counter", "requests", "framework",
       "HTTP requests by path (unknown paths as 'other') and status, API-key refusals included", pattern=True,
       labels=("path", "status"), when=SERVE),
    # -- model -------------------------------------------------------------------------
    _s("loss", "loss", "gauge", "nats", "model", "training loss of the step, mean over data-parallel ranks"),
    _s("val_loss", "validation_loss", "gauge", "nats", "model",
       "mean loss over the fixed validation set (every training.val_interval steps)"),
    _s("lr", "learning_rate", "gauge", "1", "model", "learning rate of the step (first parameter group)"),
    _s("grad_norm", "gradient_norm", "gauge", "1", "model",
       "global L2 norm of all gradients before clipping, all ranks' shards"),
    _s("grad_norm_group", "gradient_group_norm", "gauge", "1", "model",
       "L2 norm of one layer group's gradients after clipping (what the optimizer applies; optimizer "
       "pre-step hook)", labels=("group",), when=SAMPLED),
    _s("param_norm", "parameter_norm", "gauge", "1", "model", "L2 norm of all parameters after the step",
       when=SAMPLED),
    _s("param_norm_group", "parameter_group_norm", "gauge", "1", "model",
       "L2 norm of one layer group's parameters after the step", labels=("group",), when=SAMPLED),
    _s("update_ratio", "update_weight_ratio", "gauge", "ratio", "model",
       "||w_after - w_before|| / ||w_before|| over all parameters for one optimizer step (a parameter copy "
       "taken in the pre-step hook)", when=SAMPLED),
    _s("update_ratio_group", "update_weight_group_ratio", "gauge", "ratio", "model",
       "the update/weight ratio per layer group", labels=("group",), when=SAMPLED),
    _s("act_mean", "activation_mean", "gauge", "1", "model",
       "mean of each transformer block's output (forward hooks on the sampled step, mean over micro-batches)",
       labels=("block",), when="monitor.activation_stats"),
    _s("act_std", "activation_std", "gauge", "1", "model", "standard deviation of each block's output",
       labels=("block",), when="monitor.activation_stats"),
    _s("act_max", "activation_abs_max", "gauge", "1", "model", "largest |value| of each block's output",
       labels=("block",), when="monitor.activation_stats"),
    _s("skipped_steps", "skipped_steps_total", "counter", "steps", "model",
       "steps skipped by the loss scaler (fp16 overflow) or the bad-step policy, as the trainer counts them",
       when="fp16 loss scaling or bad_steps.enabled"),
    _s("loss_scale", "loss_scale", "gauge", "1", "model",
       "factor the loss is multiplied by before backward; 1 without loss scaling"),
    _s("precision", "precision_value_bytes", "gauge", "bytes", "model",
       "compute precision of each module group (label dtype; value its width in bytes): the parameters' "
       "dtype unless a precision policy reports otherwise", labels=("group",), encode="dtype_bytes"),
    _s(r"mem_(?P<category>[a-z_]+)_(?P<dtype>[a-z]+[0-9][a-z0-9]*)_bytes", "memory_bytes", "gauge", "bytes",
       "model", "bytes of parameters, gradients, optimizer state and saved activations per dtype",
       pattern=True, labels=("category", "dtype"), when="rank 0, last step of each logging window"),
    _s("mem_tracked_bytes", "memory_tracked_bytes", "gauge", "bytes", "model",
       "sum of the per-dtype memory categories", when="rank 0, last step of each logging window"),
    _s("rollbacks", "rollbacks_total", "counter", "rollbacks", "model",
       "rollbacks to an earlier checkpoint by the bad-step policy", when="bad_steps.enabled"),
    _s("lr_multiplier", "learning_rate_multiplier", "gauge", "1", "model",
       "adaptive LR multiplier applied on top of the schedule", when="adaptive_lr.enabled (on its events)"),
    _s("weight_decay", "weight_decay", "gauge", "1", "model",
       "decoupled weight decay the step's update applied to the matrices (optimizer.weight_decay_schedule; norms "
       "and biases are not decayed)", when="optimizer.weight_decay_schedule = linear or cosine"),
    _s("seq_len", "sequence_length_tokens", "gauge", "tokens", "model",
       "tokens per sequence the step trained at (its batch: batch_size x training.seq_len / seq_len sequences; "
       "same tokens per step)", when="training.seq_len_schedule = linear or auto"),
    _s("predicted_final_loss", "predicted_final_loss", "gauge", "nats", "model",
       "learning-curve prediction of the final validation loss", when="early_stop.mode = predict"),
    _s("predicted_final_loss_std", "predicted_final_loss_std", "gauge", "nats", "model",
       "spread of that prediction (bootstrap)", when="early_stop.mode = predict"),
    # -- model: multi-token prediction (train/mtp_loss.py) ------------------------------------------
    _s("mtp_loss", "mtp_loss", "gauge", "nats", "model",
       "multi-token prediction cross-entropy of the step, mean over depths and data-parallel ranks (the "
       "record's loss is main + mtp_loss_weight x this)", when=MTP),
    _s(r"mtp_loss_(?P<depth>[0-9]+)", "mtp_depth_loss", "gauge", "nats", "model",
       "cross-entropy of MTP depth k (predicting the token k + 1 places beyond the next) of the step, mean over "
       "data-parallel ranks", pattern=True, labels=("depth",), when=MTP),
    _s("mtp_loss_weight", "mtp_loss_weight", "gauge", "1", "model",
       "lambda weighting the step's mean MTP loss (training.mtp_loss_weight, then "
       "training.mtp_loss_weight_final)", when=MTP),
    _s("val_mtp_loss", "validation_mtp_loss", "gauge", "nats", "model",
       "MTP cross-entropy over the fixed validation set, mean over depths (val_loss stays the main model's)",
       when=MTP),
    _s(r"val_mtp_loss_(?P<depth>[0-9]+)", "validation_mtp_depth_loss", "gauge", "nats", "model",
       "MTP cross-entropy of depth k over the fixed validation set", pattern=True, labels=("depth",), when=MTP),
    # -- model: mixture of experts (train/moe_balance.py; moe_layer i is block n_dense_layers + i, MTP blocks
    # last) ----
    _s("moe_maxvio_batch", "moe_maxvio_batch_ratio", "gauge", "ratio", "model",
       "MaxVio_batch = (max - mean) / mean of the tokens routed per expert in one step's global batch, mean over "
       "MoE layers and the window's steps", when=MOE),
    _s("moe_maxvio_batch_layers", "moe_layer_maxvio_batch_ratio", "gauge", "ratio", "model",
       "MaxVio_batch of one MoE layer, mean over the window's steps", labels=("moe_layer",), when=MOE),
    _s("moe_maxvio_global", "moe_maxvio_global_ratio", "gauge", "ratio", "model",
       "MaxVio over the whole fixed validation set (loads counted in its forwards, all ranks), mean over MoE "
       "layers; at every evaluation", when=MOE),
    _s("moe_maxvio_global_layers", "moe_layer_maxvio_global_ratio", "gauge", "ratio", "model",
       "MaxVio over the validation set of one MoE layer", labels=("moe_layer",), when=MOE),
    _s("moe_load", "moe_expert_load_tokens", "gauge", "tokens", "model",
       "tokens routed to each expert per step (top-k choices, all data-parallel ranks), mean over the window",
       labels=("moe_layer", "expert"), when=MOE),
    _s("moe_bias_spread", "moe_router_bias_spread", "gauge", "1", "model",
       "max - min of a MoE layer's expert_bias (loss-free balancing; 0 while model.bias_update_rate = 0)",
       labels=("moe_layer",), when=MOE),
    _s("moe_aux_loss", "moe_aux_loss", "gauge", "1", "model",
       "auxiliary balance losses (alpha x sum f_i P_i, batch- and sequence-wise) summed over MoE layers, mean "
       "over micro-batches, ranks and the window's steps", when="MoE model with an aux loss alpha > 0"),
)

# Keys the monitor adds whose values come from clocks and OS counters (or count from this
# process's start), so two runs of the same training differ in them: tests that compare
# records of an interrupted+resumed run with an uninterrupted one leave them out.
MEASURED_KEYS = frozenset({"step_s", "forward_s", "backward_s", "optimizer_s", "data_wait_s", "collective_s",
                           "cpu_util", "cpu_seconds", "host_cpu_util", "rss_bytes", "io_read_bytes", "gpu_util",
                           "gpu_memory_allocated_bytes", "gpu_memory_reserved_bytes", "pcie_bytes_per_s", "top_ops",
                           "monitor_s", "optimizer_skipped_steps", "mfu_peak_flops", "mfu_peak_source",
                           "time_unix_s", "power_w", "energy_j", "energy_per_token_j",
                           "memory_bandwidth_bytes_per_s", "step_bytes_estimate"})

# Record keys that are bookkeeping, not measurements.
# mfu_peak_source: a short text ("published: NVIDIA H200 bf16 dense"), not a number;
# time_unix_s: the wall clock of a record (Prometheus stamps its own samples).
IGNORED_KEYS = frozenset({"checkpoint", "decided_at_step", "predicted_stop_step", "mem_peak_bytes",
                          "mfu_peak_source", "time_unix_s"})

_EXACT = {s.key: s for s in CATALOG if not s.pattern}
_PATTERNS = [(re.compile(s.key + "$"), s) for s in CATALOG if s.pattern]


def lookup(key: str) -> tuple[MetricSpec | None, dict[str, str]]:
    """The spec for a record key and the labels its pattern captured; (None, {}) if unknown."""
    spec = _EXACT.get(key)
    if spec is not None:
        return spec, {}
    for regex, spec in _PATTERNS:
        m = regex.match(key)
        if m:
            return spec, m.groupdict()
    return None, {}


def markdown_table() -> str:
    """The docs table (docs/metrics.md), one row per metric."""
    lines = ["# trainforge metrics", "",
             "Generated from `src/trainforge/monitor/catalog.py` by "
             "`python -m trainforge.monitor.catalog > docs/metrics.md`; do not edit by hand.", "",
             "Every metric carries a `rank` label (the global rank that exported it). A record key not in this",
             f"table is still exported, as `{UNKNOWN_NAME}{{key=\"...\"}}`.", ""]
    for level in ("system", "framework", "model"):
        lines += [f"## {level}", "", "| name | type | unit | level | labels | record key | when | how measured |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in CATALOG:
            if s.level != level:
                continue
            const = dict(s.const_labels)
            labels = ", ".join(f"`{n}={const[n]}`" if n in const else f"`{n}`" for n in s.label_names)
            key = f"`{s.key}` (pattern)" if s.pattern else f"`{s.key}`"
            cells = [f"`{s.name}`", s.kind, s.unit, s.level, labels, key, s.when, s.help.replace("|", "\\|")]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table(), end="")
