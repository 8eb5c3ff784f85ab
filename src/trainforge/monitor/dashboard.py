"""The Grafana dashboard, generated from code with grafana-foundation-sdk (pinned in
the ``dev`` extra), plus the provisioning files that load it.

    python -m trainforge.monitor.dashboard deploy   # rewrites the shipped files under deploy/

One row per level (system, framework, model) and one for ``trainforge serve``. Every
query uses only metrics from ``catalog.py`` and two variables: ``run``, the Prometheus
``job`` label (give each run or server its own ``job_name`` in prometheus.yml to tell
them apart: a label Prometheus adds to every series it scrapes, so no exporter change),
and ``rank``. ``tests/monitor/test_prometheus_e2e.py`` runs every training query against
a real Prometheus scraping a real run, ``tests/infer/test_server_prometheus.py`` every
serving query against one scraping a live server. Panels whose description says "Needs:
CUDA" have no data on a CPU run, those saying "Needs: a MoE model" none for a dense model,
those saying "Needs: trainforge serve" none for a training run (and the other rows none
for a server), those saying "Needs: an energy counter" none where neither NVML nor a
readable RAPL powercap zone exists (most virtual machines).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

UID = "trainforge-training"
DATASOURCE_UID = "prometheus"  # the provisioned data source (deploy/grafana/provisioning/datasources)
R = '{job=~"$run",rank=~"$rank"}'
CUDA_NOTE = "Needs: CUDA"
MOE_NOTE = "Needs: a MoE model"
SERVE_NOTE = "Needs: trainforge serve"
ENERGY_NOTE = "Needs: an energy counter (NVML on CUDA, or RAPL powercap readable by the run: bare metal, usually root)"
LEVELS = ("system", "framework", "model", "serving")
ROW_TITLES = {"serving": "Serving (trainforge serve)"}


@dataclass(frozen=True)
class PanelSpec:
    level: str
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""
    kind: str = "timeseries"  # or "bargauge"


def q(metric: str, legend: str) -> tuple[str, str]:
    return f"{metric}{R}", legend


def quantile(p: float, histogram: str, by: str = "") -> str:
    """p-quantile over the last minute of a catalog histogram, summed over ranks/instances."""
    return f"histogram_quantile({p}, sum by (le{by}) (rate({histogram}_bucket{R}[1m])))"


def per_s(counter: str, by: str) -> str:
    return f"sum by ({by}) (rate({counter}{R}[1m]))"


PANELS: tuple[PanelSpec, ...] = (
    # -- system -------------------------------------------------------------------------
    PanelSpec("system", "CPU utilisation", "percentunit",
              (q("trainforge_process_cpu_utilization_ratio", "process, rank {{rank}}"),
               q("trainforge_host_cpu_utilization_ratio", "whole machine, rank {{rank}}'s host")),
              "Share of all CPUs: this process (os.times) and every process (/proc/stat)."),
    PanelSpec("system", "Process memory", "bytes",
              (q("trainforge_process_resident_memory_bytes", "RSS rank {{rank}}"),
               q("trainforge_peak_memory_bytes", "peak (max over ranks)"))),
    PanelSpec("system", "GPU utilisation", "percentunit",
              (q("trainforge_gpu_utilization_ratio", "rank {{rank}}"),), f"NVML. {CUDA_NOTE}"),
    PanelSpec("system", "GPU memory", "bytes",
              (q("trainforge_gpu_memory_allocated_bytes", "allocated rank {{rank}}"),
               q("trainforge_gpu_memory_reserved_bytes", "reserved rank {{rank}}")),
              f"CUDA caching allocator. {CUDA_NOTE}"),
    PanelSpec("system", "Host <-> device copies", "Bps",
              (q("trainforge_host_device_copy_bytes_per_second", "{{direction}} rank {{rank}}"),),
              f"PCIe throughput from NVML. {CUDA_NOTE}"),
    PanelSpec("system", "Power", "watt",
              (q("trainforge_power_watts", "{{domain}} rank {{rank}}"),),
              "Mean power since the previous logging window: gpu per rank (NVML), package / dram / core (RAPL, "
              f"the whole machine, from each node's local rank 0). {ENERGY_NOTE}"),
    PanelSpec("system", "Energy per token", "joule",
              (("sum by (domain) (trainforge_energy_per_token_joules" + R + ")", "{{domain}}, all ranks"),),
              "Energy between two logging windows (validation and checkpoints included) / tokens trained in "
              f"between, summed over ranks: the job's joules per token. {ENERGY_NOTE}"),
    PanelSpec("system", "Memory bandwidth", "Bps",
              (q("trainforge_memory_bandwidth_bytes_per_second", "{{source}} rank {{rank}}"),),
              "Achieved DRAM / HBM bandwidth per logging window. source: nvml_gpm = GPU DRAM counters; "
              "nvml_busy_x_peak = memory-busy share x peak, an upper bound; perf_uncore = CPU memory controllers' "
              "counters; step_bytes_estimate = modelled bytes "
              "per step x steps/s, a lower bound, not a counter."),
    PanelSpec("system", "Data-loader wait", "s",
              (q("trainforge_data_wait_seconds", "rank {{rank}}"),),
              "Per step: end of the previous optimizer step to the first forward."),
    PanelSpec("system", "Data-loader wait share", "percentunit",
              (q("trainforge_data_wait_ratio", "rank {{rank}}"),),
              "Share of the logging window the loop waited for the data loader (data pipeline's own clock)."),
    PanelSpec("system", "Cache hit ratio per tier", "percentunit",
              (q("trainforge_data_cache_hit_ratio", "{{tier}} rank {{rank}}"),), "Needs: data.cache.dir"),
    PanelSpec("system", "Bytes read per cache tier", "Bps",
              (("rate(trainforge_data_cache_read_bytes_total" + R + "[1m])", "{{tier}} rank {{rank}}"),),
              "Needs: data.cache.dir"),
    PanelSpec("system", "Bytes read", "Bps",
              (("rate(trainforge_io_read_bytes_total" + R + "[1m])", "{{tier}} rank {{rank}}"),),
              "storage: from block devices; syscall: all read() calls, page cache included."),
    # -- framework ----------------------------------------------------------------------
    PanelSpec("framework", "Step time", "s",
              (("histogram_quantile(0.5, sum by (le, rank) (rate(trainforge_step_seconds_bucket" + R + "[1m])))",
                "p50 rank {{rank}}"),
               ("histogram_quantile(0.95, sum by (le, rank) (rate(trainforge_step_seconds_bucket" + R + "[1m])))",
                "p95 rank {{rank}}"),
               ("rate(trainforge_step_seconds_sum" + R + "[1m]) / rate(trainforge_step_seconds_count" + R + "[1m])",
                "mean rank {{rank}}"))),
    PanelSpec("framework", "Step phases", "s",
              (q("trainforge_forward_seconds", "forward rank {{rank}}"),
               q("trainforge_backward_seconds", "backward rank {{rank}}"),
               q("trainforge_optimizer_seconds", "optimizer rank {{rank}}"),
               q("trainforge_collective_seconds", "collectives rank {{rank}}"),
               q("trainforge_data_wait_seconds", "data wait rank {{rank}}")),
              "Per step, from forward and optimizer hooks; collectives = communication share x step time."),
    PanelSpec("framework", "Communication share and pipeline bubble", "percentunit",
              (q("trainforge_communication_ratio", "in collectives rank {{rank}}"),
               q("trainforge_pipeline_bubble_ratio", "pipeline bubble rank {{rank}}"))),
    PanelSpec("framework", "Throughput", "short",
              (q("trainforge_tokens_per_second", "tokens/s (window) rank {{rank}}"),
               ("rate(trainforge_tokens_total" + R + "[1m])", "tokens/s (1m rate) rank {{rank}}"))),
    PanelSpec("framework", "MFU", "percentunit", (q("trainforge_mfu_ratio", "rank {{rank}}"),),
              "Against the measured dense matmul peak of the device."),
    PanelSpec("framework", "Gradient bytes on the wire", "bytes",
              (q("trainforge_wire_bytes_per_step", "per step, rank {{rank}}"),),
              "Bytes this rank sent per step on the dp_replicate axis (gradient compression)."),
    PanelSpec("framework", "Checkpoint save time", "s",
              (("trainforge_checkpoint_save_seconds_sum" + R + " / trainforge_checkpoint_save_seconds_count" + R,
                "mean rank {{rank}}"),
               ("trainforge_checkpoint_save_seconds_count" + R, "saves rank {{rank}}"))),
    PanelSpec("framework", "Monitoring cost", "percentunit",
              (("rate(trainforge_monitor_seconds_total" + R + "[1m])", "rank {{rank}}"),),
              "Share of wall time spent in the monitor's hooks and write path (not the profiler's slowdown)."),
    PanelSpec("framework", "Top operators (profiled step)", "s",
              (("topk(10, trainforge_operator_self_seconds" + R + ")", "{{op}} rank {{rank}}"),),
              "Self time per operator in the latest profiled step (monitor.profile_every).", kind="bargauge"),
    # -- model --------------------------------------------------------------------------
    PanelSpec("model", "Loss", "short",
              (q("trainforge_loss", "train rank {{rank}}"), q("trainforge_validation_loss", "validation rank {{rank}}"))),
    PanelSpec("model", "Learning rate", "short", (q("trainforge_learning_rate", "rank {{rank}}"),)),
    PanelSpec("model", "Gradient norm", "short",
              (q("trainforge_gradient_norm", "global, before clipping"),
               q("trainforge_gradient_group_norm", "{{group}} (after clipping)"))),
    PanelSpec("model", "Parameter norm", "short",
              (q("trainforge_parameter_norm", "all parameters"), q("trainforge_parameter_group_norm", "{{group}}"))),
    PanelSpec("model", "Update / weight ratio", "short",
              (q("trainforge_update_weight_ratio", "all parameters"),
               q("trainforge_update_weight_group_ratio", "{{group}}")),
              "||w_after - w_before|| / ||w_before|| on sampled steps; ~1e-3 is typical for AdamW."),
    PanelSpec("model", "Activations per block", "short",
              (q("trainforge_activation_std", "std {{block}}"), q("trainforge_activation_abs_max", "max |x| {{block}}"),
               q("trainforge_activation_mean", "mean {{block}}")),
              "Transformer block outputs on sampled steps (monitor.activation_stats)."),
    PanelSpec("model", "Skipped steps", "short",
              (q("trainforge_optimizer_skipped_steps_total", "no optimizer step, rank {{rank}}"),
               q("trainforge_skipped_steps_total", "skipped by the trainer, rank {{rank}}"),
               q("trainforge_rollbacks_total", "rollbacks, rank {{rank}}")),
              "No optimizer step ran (monitor's count); the trainer's count needs a loss scaler (fp16) or "
              "bad_steps.enabled, rollbacks need bad_steps.enabled."),
    PanelSpec("model", "Loss scale", "short", (q("trainforge_loss_scale", "rank {{rank}}"),),
              "1 without loss scaling."),
    PanelSpec("model", "Memory per dtype", "bytes",
              (q("trainforge_memory_bytes", "{{category}} {{dtype}}"),),
              "Parameters, gradients, optimizer state and saved activations (rank 0, last step of a window)."),
    PanelSpec("model", "Precision per module group", "bytes",
              (q("trainforge_precision_value_bytes", "{{group}} {{dtype}}"),), "Bytes per value of the compute dtype."),
    PanelSpec("model", "MoE load balance (MaxVio)", "short",
              (q("trainforge_moe_maxvio_batch_ratio", "batch, mean over layers"),
               q("trainforge_moe_maxvio_global_ratio", "validation set, mean over layers"),
               q("trainforge_moe_layer_maxvio_batch_ratio", "batch, MoE layer {{moe_layer}}")),
              "(max - mean) / mean of the tokens per expert: 0 is perfectly balanced. Batch: per step's global "
              f"batch; validation: over the fixed validation set. {MOE_NOTE}"),
    PanelSpec("model", "MoE expert load", "short",
              (q("trainforge_moe_expert_load_tokens", "MoE layer {{moe_layer}} expert {{expert}}"),),
              f"Tokens routed to each expert per step, all data-parallel ranks. {MOE_NOTE}"),
    PanelSpec("model", "MoE router bias spread", "short",
              (q("trainforge_moe_router_bias_spread", "MoE layer {{moe_layer}}"),
               q("trainforge_moe_aux_loss", "auxiliary balance loss")),
              "max - min of each layer's selection bias (loss-free balancing); the auxiliary loss needs an "
              f"alpha > 0. {MOE_NOTE}"),
    # -- serving (the server's /metrics: engine state at scrape time, request histograms) -----
    PanelSpec("serving", "Requests per second by status", "reqps",
              ((per_s("trainforge_http_requests_total", "job, status"), "{{status}} {{job}}"),
               (per_s("trainforge_http_requests_total", "job, path"), "{{path}} {{job}}")),
              f"HTTP requests answered, by status code and by path (unknown paths count as 'other'). {SERVE_NOTE}"),
    PanelSpec("serving", "Request latency", "s",
              ((quantile(0.5, "trainforge_inference_request_seconds", ", job"), "p50 {{job}}"),
               (quantile(0.95, "trainforge_inference_request_seconds", ", job"), "p95 {{job}}"),
               (quantile(0.99, "trainforge_inference_request_seconds", ", job"), "p99 {{job}}")),
              f"Submission to last token, per finished completion (each of n choices counts). {SERVE_NOTE}"),
    PanelSpec("serving", "Time to first token", "s",
              ((quantile(0.5, "trainforge_inference_time_to_first_token_seconds", ", job"), "p50 {{job}}"),
               (quantile(0.95, "trainforge_inference_time_to_first_token_seconds", ", job"), "p95 {{job}}")),
              f"Submission to the first sampled token: queueing plus prefill. {SERVE_NOTE}"),
    PanelSpec("serving", "Time per output token", "s",
              ((quantile(0.5, "trainforge_inference_time_per_output_token_seconds", ", job"), "p50 {{job}}"),
               (quantile(0.95, "trainforge_inference_time_per_output_token_seconds", ", job"), "p95 {{job}}")),
              f"After the first token: (last - first token time) / (tokens - 1), per request of 2+ tokens; the "
              f"decode pace a streaming client sees. {SERVE_NOTE}"),
    PanelSpec("serving", "Tokens per second", "short",
              ((per_s("trainforge_inference_generated_tokens_total", "job"), "generated {{job}}"),
               (per_s("trainforge_inference_prompt_tokens_total", "job"), "prompt (prefilled) {{job}}")),
              SERVE_NOTE),
    PanelSpec("serving", "Queue depth", "short",
              (q("trainforge_inference_running_requests", "running (batch rows) {{job}}"),
               q("trainforge_inference_waiting_requests", "waiting {{job}}"),
               (per_s("trainforge_inference_requests_rejected_total", "job") + " * 60", "refused per minute {{job}}")),
              f"Requests in the batch and in the engine's queue, read at scrape time. {SERVE_NOTE}"),
    PanelSpec("serving", "KV pool", "percentunit",
              (q("trainforge_kv_cache_block_utilization_ratio", "blocks in use {{job}}"),
               q("trainforge_kv_cache_slot_utilization_ratio", "token slots written {{job}}")),
              f"Share of the paged KV pool's blocks held by running requests, and of their slots written. "
              f"{SERVE_NOTE}"),
    PanelSpec("serving", "Finished requests by reason", "reqps",
              ((per_s("trainforge_inference_requests_finished_total", "job, reason"), "{{reason}} {{job}}"),),
              f"stop (end-of-text or a stop string), length (max_tokens), abort (client gone), error (the engine "
              f"failed the request). {SERVE_NOTE}"),
)


def build_dashboard() -> dict:
    """The dashboard as Grafana JSON (a plain dict)."""
    from grafana_foundation_sdk.builders import bargauge, dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    # run: the Prometheus job (one job_name per run or server); rank: the ranks of the chosen runs.
    run = (dashboard.QueryVariable("run").label("run (Prometheus job)").datasource(ds)
           .query('label_values({__name__=~"trainforge_.+"}, job)').refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
           .multi(True).include_all(True).all_value(".*"))
    rank = (dashboard.QueryVariable("rank").label("rank").datasource(ds)
            .query('label_values({__name__=~"trainforge_.+", job=~"$run"}, rank)')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True).all_value(".*"))
    source = dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
    board = (dashboard.Dashboard("trainforge training").uid(UID).tags(["trainforge", "training", "serving"])
             .refresh("10s").time("now-1h", "now").timezone("browser").with_variable(source).with_variable(run)
             .with_variable(rank))
    for level in LEVELS:
        board = board.with_row(dashboard.Row(ROW_TITLES.get(level, f"{level.capitalize()} metrics")))
        for spec in (p for p in PANELS if p.level == level):
            panel = (bargauge.Panel() if spec.kind == "bargauge" else timeseries.Panel())
            panel = panel.title(spec.title).unit(spec.unit).datasource(ds).height(8).span(8)
            if spec.description:
                panel = panel.description(spec.description)
            for i, (expr, legend) in enumerate(spec.targets):
                panel = panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend)
                                          .ref_id(chr(ord("A") + i)).datasource(ds))
            board = board.with_panel(panel)
    out = _drop_nulls(json.loads(json.dumps(board.build(), cls=JSONEncoder)))
    for i, panel in enumerate(out["panels"], start=1):
        panel["id"] = i  # the SDK leaves every id at 0; Grafana keys panel links and edits by id
    return out


def _drop_nulls(obj):
    """The SDK writes unset fields as null (e.g. ``"options": null``); Grafana expects them absent."""
    if isinstance(obj, dict):
        return {k: _drop_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_nulls(v) for v in obj]
    return obj


PROVISION_DASHBOARDS = """\
# Grafana dashboard provisioning: copy to /etc/grafana/provisioning/dashboards/ and the
# dashboard JSON to the path below.
apiVersion: 1
providers:
  - name: trainforge
    folder: trainforge
    type: file
    allowUiUpdates: true
    options:
      path: /var/lib/grafana/dashboards/trainforge
"""

PROVISION_DATASOURCE = f"""\
# Grafana data source provisioning: copy to /etc/grafana/provisioning/datasources/.
apiVersion: 1
datasources:
  - name: Prometheus
    uid: {DATASOURCE_UID}
    type: prometheus
    access: proxy
    url: http://127.0.0.1:9090
    isDefault: true
    jsonData:
      timeInterval: 5s
"""

PROMETHEUS_CONFIG = """\
# Prometheus scrape config for trainforge runs with --monitor.prometheus_port 9400.
# Each process serves prometheus_port + LOCAL_RANK on its own node: list one target
# per local rank and node (here: 2 nodes x 8 processes would be 16 targets).
# The dashboard's "run" variable is the job label: give each run (or server) its own job_name.
global:
  scrape_interval: 5s
scrape_configs:
  - job_name: trainforge
    static_configs:
      - targets: ["127.0.0.1:9400"]  # add 127.0.0.1:9401 ... for more processes per node
  # trainforge serve's /metrics is on its own port; with --api_key, Prometheus sends the key.
  - job_name: trainforge-serve
    static_configs:
      - targets: ["127.0.0.1:8000"]
    # authorization:
    #   credentials: KEY
"""


def files() -> dict[str, str]:
    """Relative path -> content of everything under deploy/grafana and deploy/prometheus."""
    return {"grafana/dashboards/trainforge.json": json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n",
            "grafana/provisioning/dashboards/trainforge.yaml": PROVISION_DASHBOARDS,
            "grafana/provisioning/datasources/prometheus.yaml": PROVISION_DATASOURCE,
            "prometheus/prometheus.yml": PROMETHEUS_CONFIG}


def write(root: Path) -> list[Path]:
    out = []
    for rel, text in files().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        out.append(path)
    return out


if __name__ == "__main__":
    for p in write(Path(sys.argv[1] if len(sys.argv) > 1 else "deploy")):
        print(p)
