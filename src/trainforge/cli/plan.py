"""``trainforge plan``: parallel layouts of a model on a cluster, ranked by predicted step time
(``plan/planner.py``; the table and JSON are ``plan/render.py``'s)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainforge.cli.options import Command
from trainforge.config_base import _f
from trainforge.errors import ConfigError
from trainforge.model.config import FLAVORS

DESCRIPTION = ("Rank parallel layouts of a model on a cluster by predicted step time (the cost model of "
               "plan/cost_model.py; shapes only, no weights are built).")
Flavor = Literal[tuple(sorted(FLAVORS))]  # type: ignore[valid-type]


@dataclass
class PlanOptions:
    model: Flavor | None = _f(None, "model flavor", required=True, metavar="FLAVOR")
    gpus: int | None = _f(None, "number of GPUs", required=True)
    gpu: str | None = _f(None, "h100, h200, h800, a100-80g, mi300x, or measured (a probe of this machine, where "
                               "available) (default h100)")
    machine: Literal["measured"] | None = _f(None, "measured: this machine, probed (= --gpu measured; --gpus "
                                                   "processes of one thread)")
    seq_len: int = _f(4096, "tokens per sequence")
    global_batch: int | None = _f(None, "sequences per optimizer step (default 2 x --gpus)")
    precision: str = _f("bf16-mixed", "[precision] policy, or fp8: bf16-mixed with the blocks' linear GEMMs at "
                                      "the board's FP8 peak (planning only: the trainer has no FP8 policy)")
    compression: str = _f("none", "[compression] codec on dp_replicate")
    compile: bool = _f(False, "predict for parallel.compile = true (torch.compile fuses the blocks' elementwise "
                              "ops; written into --output)")
    calibrate: bool = _f(False, "with --gpu measured: calibrate the probed machine to this model by short "
                                "one-process runs of it (plan/calibration.py: ~3 min for tiny; fp32, models that "
                                "train here in seconds)")
    lr: float | None = _f(None, "peak learning rate (at --lr_reference_batch under --lr_scaling): written into "
                                "--output as training.lr with its batch-size rule, and the LR at --global_batch "
                                "is printed")
    lr_scaling: Literal["none", "linear", "sqrt"] = _f("none", "with --lr: optimizer.lr_scaling of --output (the "
                                                               "LR follows the global batch: linear or sqrt)")
    lr_reference_batch: int = _f(0, "with --lr_scaling linear or sqrt: the global batch (sequences) --lr was "
                                    "tuned at")
    top: int = _f(10, "layouts to show")
    json: bool = _f(False, "print the ranked layouts as JSON instead of a table")
    output: str | None = _f(None, "write the best layout as a TOML config that trainforge train --config reads",
                            metavar="FILE")


SECTIONS = {"plan": PlanOptions}
COMMAND = Command("plan", DESCRIPTION, SECTIONS)


def run(argv: list[str]) -> int:
    parsed = COMMAND.parse(argv)
    if parsed is None:
        return 0
    a = parsed.section(PlanOptions)
    import dataclasses
    import json

    from trainforge.config import load_config
    from trainforge.plan.planner import config_toml, plan
    from trainforge.plan.render import check_fp8, plan_cluster, plan_json, print_plan
    from trainforge.plan.spec import Workload

    if a.gpus < 1 or a.seq_len < 1 or a.top < 1:
        raise ConfigError("--gpus, --seq_len and --top must be >= 1")
    if a.machine and a.gpu not in (None, a.machine):
        raise ConfigError(f"--machine {a.machine} and --gpu {a.gpu} name two clusters: give one of them")
    gpu = a.machine or a.gpu or "h100"
    if a.calibrate and gpu != "measured":
        raise ConfigError(f"--calibrate measures this machine: use it with --gpu measured, not --gpu {gpu}")
    if a.calibrate and a.precision != "fp32":
        raise ConfigError(f"--calibrate runs the model in fp32: add --precision fp32 (not {a.precision})")
    if a.precision == "fp8":
        check_fp8(gpu, a.output)
    cluster = plan_cluster(gpu, a.gpus)
    batch = a.global_batch if a.global_batch is not None else 2 * a.gpus
    if batch < 1:
        raise ConfigError(f"--global_batch {batch}: must be >= 1")
    lr = _lr_recipe(a)
    base = FLAVORS[a.model]
    cfg = dataclasses.replace(base, max_seq_len=max(base.max_seq_len, a.seq_len))
    workload = Workload(cfg, seq_len=a.seq_len, global_batch=batch, precision=a.precision,
                        compression=a.compression, flavor=a.model,
                        stack="trainforge-compile" if a.compile else "trainforge")
    if a.calibrate:
        from trainforge.plan.calibration import calibrate

        cluster = calibrate(cluster, workload)
    try:
        ranked = plan(workload, cluster)
    except ValueError as e:  # an unknown precision policy or codec
        raise ConfigError(str(e)) from None
    shown = ranked[:a.top]
    if a.json:
        print(json.dumps(plan_json(shown, workload, cluster, a.gpus), indent=1))
    else:
        print_plan(shown, cluster, workload, len(ranked))
    if lr is not None and not a.json:
        print(lr.describe(batch))
    if a.output:
        best = ranked[0] if ranked else None
        if best is None or not best.feasible:
            raise ConfigError(f"--output {a.output}: no layout fits ({best.why if best else 'none found'}); "
                              "try more GPUs, a shorter --seq_len or a smaller --global_batch")
        out = Path(a.output)
        out.write_text(config_toml(workload, best, header=(
            f"trainforge plan --model {a.model} --gpus {a.gpus} --gpu {cluster.name} --seq_len {a.seq_len} "
            f"--global_batch {batch}{' --compile' if a.compile else ''}\npredicted {best.step_s:.3f} s/step, "
            f"{best.tokens_per_s_per_gpu:.0f} tokens/s/GPU, "
            f"MFU {best.mfu:.1%}, {best.memory_bytes_per_gpu / 2**30:.1f} GiB/GPU"
            + (f"\n{lr.describe(batch)}" if lr is not None else "")), lr=lr))
        load_config(out)  # what train --config will do: fails here, not at launch, if a key is wrong
        if not a.json:
            print(f"best layout written to {out} (trainforge train --config {out}; add data.path and steps)")
    return 0


def _lr_recipe(a: PlanOptions):
    """--lr, --lr_scaling, --lr_reference_batch as a ``plan.lr_scaling.LRRecipe`` (None without --lr)."""
    from trainforge.plan.lr_scaling import LRRecipe

    if a.lr is None:
        if a.lr_scaling != "none" or a.lr_reference_batch:
            raise ConfigError("--lr_scaling and --lr_reference_batch scale a learning rate: give it with --lr")
        return None
    if not a.lr > 0:
        raise ConfigError(f"--lr {a.lr}: must be > 0")
    if a.lr_scaling != "none" and a.lr_reference_batch < 1:
        raise ConfigError(f"--lr_scaling {a.lr_scaling} needs --lr_reference_batch: the global batch "
                          "(sequences) --lr was tuned at, >= 1")
    return LRRecipe(a.lr, a.lr_scaling, a.lr_reference_batch)
