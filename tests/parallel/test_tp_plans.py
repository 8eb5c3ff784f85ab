"""The families' tensor-parallel plans (model/*_tp.py, found through model/tp_plans.py) are data
the applier (parallel/tensor_parallel.py) understands: every style and hook a plan of any family
names is one it applies, every plan entry names a module the family has, and the plan modules
import nothing. Checked on one process, so a misspelt style fails here rather than inside a
multi-process parity run."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import trainforge.model
from trainforge.model.config import FLAVORS
from trainforge.model.llama import Transformer
from trainforge.parallel import tensor_parallel as tp

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
FAMILIES = {
    "dense": {},
    "latent attention": dict(q_lora_rank=32, **MLA),
    "latent attention, no query low rank": dict(q_lora_rank=0, **MLA),
    "multi-token prediction": dict(mtp_depth=2),
    "hourglass": dict(n_layers=5, hourglass="1@1 1@2 1@4/2 1@2 1@1"),
}


def _model(kw) -> Transformer:
    with torch.device("meta"):
        return Transformer(dataclasses.replace(FLAVORS["debug"], **kw))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_plan_names_styles_hooks_and_modules_the_applier_knows(family):
    model = _model(FAMILIES[family])
    plans = tp._collect_plans(model)
    assert plans and plans[0][0] == ""  # the model's own plan comes first
    applied = set()
    for path, module, plan in plans:
        assert set(plan) <= {"styles", "sequence", "whole_sequence_layers", "hooks", "reads_trunk_output",
                             "trunk_output", "output_after_layer"}, f"{path}: unknown plan keys"
        for name, style in plan.get("styles", {}).items():
            for sp in (True, False):
                tp._style(style, sp, loss_parallel=True)  # raises on a style the applier lacks
            applied |= {f"{path}.{t}".strip(".") for t in tp._targets(module, name)}
        for name, hook, _ in plan.get("hooks", ()):
            assert hook in ("gather_sequence_arg", "shard_sequence_output", "gather_whole_inputs"), hook
    # Every linear and norm of the family is split or replicated by some plan: none is left a
    # plain tensor beside DTensors (foreach ops reject the mix).
    leaves = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) or n.endswith("norm")}
    assert leaves <= applied, f"{family}: no plan covers {sorted(leaves - applied)}"


def test_the_hourglass_plan_runs_the_shortened_blocks_on_the_whole_sequence():
    model = _model(FAMILIES["hourglass"])
    # Stages 1@1 1@2 1@4/2 1@2 1@1: blocks 1, 2 and 3 are shortened; 0 and 4 run at the full rate.
    assert tp._whole_sequence_paths(model, tp._collect_plans(model)) == {"layers.1", "layers.2", "layers.3"}
    mtp = _model(FAMILIES["multi-token prediction"])
    assert tp._whole_sequence_paths(mtp, tp._collect_plans(mtp)) == {"mtp.0", "mtp.1"}
    assert tp._trunk_output_module(mtp, tp._collect_plans(mtp)) is mtp.layers["1"]


def test_an_unknown_style_is_refused_naming_the_vocabulary():
    with pytest.raises(ValueError, match=r"'diagonal' is not one .*\(model/llama_tp.py lists them\)"):
        tp._style("diagonal", True, True)


def test_plan_modules_import_nothing():
    """Pure data at the bottom of model/'s layers: a plan module imports nothing (but
    ``__future__``), so any layer of the model can be given a plan."""
    model_dir = Path(trainforge.model.__file__).parent
    plan_files = sorted(model_dir.glob("*_tp.py"))
    assert {p.name for p in plan_files} >= {"llama_tp.py", "mla_tp.py", "mtp_tp.py", "hourglass_tp.py"}
    for p in plan_files:
        imports = [n for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert all(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in imports), p.name


def _layout(tp: int):
    from types import SimpleNamespace

    from trainforge.parallel.dims import ParallelDims
    return ParallelDims.resolve(SimpleNamespace(dp_replicate=1, dp_shard=1, tp=tp, pp=1), tp)


def test_the_sizes_parallel_tp_must_divide_are_the_ones_the_familys_plan_splits():
    """debug has 4 query heads and 2 KV heads: the dense plan splits both, so tp = 4 is refused naming
    the KV heads; latent attention has no KV heads to split, so the same sizes fit."""
    from trainforge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'parallel.tp' = 4 must divide model.n_kv_heads = 2 \(each rank holds"):
        _layout(4).check_model(FLAVORS["debug"])
    _layout(4).check_model(dataclasses.replace(FLAVORS["debug"], q_lora_rank=32, **MLA))


def test_an_hourglass_plan_also_splits_its_narrower_stages_feed_forward():
    """ffn_hidden_dim 176 splits 16 ways, but the width-ratio-2 stages' 88 does not."""
    from trainforge.errors import ConfigError

    wide = dict(n_heads=16, n_kv_heads=16, dim=256)
    _layout(16).check_model(dataclasses.replace(FLAVORS["debug"], **wide))
    with pytest.raises(ConfigError, match=r"must divide the feed-forward width of the model.hourglass stages at width_ratio 2, "
                                         r"model.ffn_hidden_dim / 2 = 88"):
        _layout(16).check_model(dataclasses.replace(FLAVORS["debug"], **wide, **FAMILIES["hourglass"]))
