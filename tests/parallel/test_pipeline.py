"""Pipeline parallelism: stage splitting, config validation, and PP=2 parity of every
schedule against single-process training (gloo on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

from tests.parallel.torchrun import WORKERS, run_torchrun
from tests.parallel.workers.pp_parity import CFG as CFG_PARITY
from trainforge.errors import ConfigError
from trainforge.model.config import ModelConfig
from trainforge.model.llama import build_model
from trainforge.parallel.pipeline import (
    SCHEDULES,
    PipelineStepStats,
    build_pipeline,
    check_pipeline_config,
    cross_entropy_loss,
    even_boundaries,
    split_model,
    stage_ids_for_rank,
)

CFG = ModelConfig(dim=32, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden_dim=64, max_seq_len=16)
# Stages per rank and the (global) stage indices each of 2 ranks owns, by schedule.
LAYOUT_PP2 = {
    "gpipe": [[0], [1]],
    "1f1b": [[0], [1]],
    "interleaved-1f1b": [[0, 2], [1, 3]],
    "zbv": [[0, 3], [1, 2]],
    "dualpipev": [[0, 3], [1, 2]],
}


def _all_stages(model, pp_size: int, schedule: str, boundaries=None) -> dict[int, torch.nn.Module]:
    """Stage index -> module, collected over every rank."""
    out = {}
    for rank in range(pp_size):
        mods = split_model(model, rank, pp_size, boundaries, schedule)
        n = len(mods) * pp_size
        out.update(zip(stage_ids_for_rank(rank, pp_size, schedule, n), mods))
    return out


# ---------------------------------------------------------------- splitting


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_split_keeps_fqns_and_covers_the_model_once(schedule):
    model = build_model(CFG, seed=0)
    stages = _all_stages(model, 2, schedule)
    assert sorted(stages) == list(range(len(stages)))
    owned = [s for r in LAYOUT_PP2[schedule] for s in r]
    assert sorted(owned) == sorted(stages)
    keys = [k for m in stages.values() for k in m.state_dict()]
    assert len(keys) == len(set(keys)), "a parameter lives on two stages"
    assert set(keys) == set(model.state_dict())
    first, last = stages[0], stages[len(stages) - 1]
    assert first.tok_embeddings is not None and first.norm is None and first.output is None
    assert last.output is not None and last.norm is not None and last.tok_embeddings is None
    for s, m in stages.items():
        if 0 < s < len(stages) - 1:
            assert m.tok_embeddings is None and m.norm is None and m.output is None


def test_split_stage_layers_follow_boundaries_and_fqns():
    model = build_model(CFG, seed=0)
    (s0,) = split_model(model, 0, 2, [0, 4], "1f1b")
    (s1,) = split_model(model, 1, 2, [0, 4], "1f1b")
    assert list(s0.layers.keys()) == ["0", "1", "2", "3"] and list(s1.layers.keys()) == ["4", "5"]
    assert "layers.5.attention.wq.weight" in s1.state_dict()
    assert "layers.5.attention.wq.weight" not in s0.state_dict()
    # V layout on 4 ranks with 8 stages: rank 1 holds stages 1 and 6.
    cfg8 = ModelConfig(**{**CFG.__dict__, "n_layers": 8})
    a, b = split_model(build_model(cfg8, seed=0), 1, 4, None, "zbv")
    assert list(a.layers.keys()) == ["1"] and list(b.layers.keys()) == ["6"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stages_chained_reproduce_the_full_model(schedule):
    """Running every stage in order on one process equals the unsplit forward."""
    model = build_model(CFG, seed=0)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    stages = _all_stages(model, 2, schedule)
    h = tokens
    for s in sorted(stages):
        h = stages[s](h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)


def test_split_copies_do_not_alias_or_mutate_the_model():
    model = build_model(CFG, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (s0,) = split_model(model, 0, 2, None, "gpipe")
    with torch.no_grad():
        s0.layers["0"].attention.wq.weight.add_(1.0)
    assert len(model.layers) == CFG.n_layers and model.output is not None
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_split_of_meta_model_allocates_nothing():
    model = build_model(CFG, device="meta")
    (s1,) = split_model(model, 1, 2, None, "1f1b")
    assert all(p.is_meta for p in s1.parameters())


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_rank_to_stage_layout_matches_torch(schedule, pp):
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    style = "v" if schedule in ("zbv", "dualpipev") else "loop"
    torch_map = generate_rank_to_stage_mapping(pp, pp * v, style=style)
    for rank in range(pp):
        assert stage_ids_for_rank(rank, pp, schedule, pp * v) == torch_map[rank]


def test_even_boundaries():
    assert even_boundaries(8, 2) == [0, 4]
    assert even_boundaries(10, 4) == [0, 3, 6, 8]
    assert even_boundaries(4, 4) == [0, 1, 2, 3]


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, key", [
    (dict(schedule="pipedream"), "parallel.pp_schedule"),
    (dict(pp_size=8), "parallel.pp"),                                   # 8 stages, 6 layers
    (dict(schedule="zbv", pp_size=4), "parallel.pp_schedule"),          # 8 virtual stages, 6 layers
    (dict(schedule="interleaved-1f1b", pp_size=4), "parallel.pp_schedule"),
    (dict(schedule="1f1b", pp_size=2, microbatches=1), "parallel.microbatches"),
    (dict(schedule="dualpipev", pp_size=2, microbatches=2), "parallel.microbatches"),  # needs >= 4 stages
    (dict(schedule="interleaved-1f1b", pp_size=2, microbatches=5), "parallel.microbatches"),
    (dict(schedule="gpipe", pp_size=2, microbatches=3, batch_size=8), "parallel.microbatches"),
    (dict(boundaries=[0, 7]), "parallel.pp_split"),
    (dict(boundaries=[0, 2, 4]), "parallel.pp_split"),
    (dict(boundaries=[1, 3]), "parallel.pp_split"),
    (dict(schedule="interleaved-1f1b", boundaries=[0, 3]), "parallel.pp_split"),   # 1 stage per rank
    (dict(schedule="interleaved-1f1b", boundaries=[0, 1, 2, 3, 4]), "parallel.pp_split"),
    (dict(tie_embeddings=True), "model.tie_embeddings"),
])
def test_bad_layouts_name_the_setting(kwargs, key):
    args = dict(n_layers=CFG.n_layers, pp_size=2, schedule="1f1b", microbatches=4)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_pipeline_config(**args)


def test_valid_layouts_pass():
    assert check_pipeline_config(6, 2, "1f1b", 2, batch_size=8) == 2
    assert check_pipeline_config(6, 2, "zbv", 1) == 4                # torch's ZBV runs any count
    assert check_pipeline_config(6, 2, "dualpipev", 4, batch_size=8) == 4
    assert check_pipeline_config(6, 2, "interleaved-1f1b", 4, boundaries=[0, 1, 2, 3, 4, 5]) == 6


def test_build_pipeline_validates_before_any_collective():
    """No process group exists here: each error must come from validation, not from torch."""
    assert not dist.is_initialized()
    model = build_model(CFG, seed=0)
    stages = split_model(model, 0, 2, None, "1f1b")
    bad = [
        (dict(schedule="zero-bubble"), "parallel.pp_schedule"),
        (dict(microbatches=1), "parallel.microbatches"),
        (dict(microbatches=4, batch_size=6), "parallel.microbatches"),
        (dict(schedule="zbv"), "parallel.pp_schedule"),  # 1 stage module for a 2-per-rank schedule
    ]
    for override, key in bad:
        args = dict(stage_modules=stages, pp_mesh_or_group=None, pp_rank=0, pp_size=2, schedule="1f1b",
                    microbatches=4, loss_fn=cross_entropy_loss, device="cpu")
        args.update(override)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            build_pipeline(**args)
    with pytest.raises(ConfigError, match=r"parallel\.pp_schedule"):
        split_model(model, 0, 2, None, "zero-bubble")


def test_bubble_fraction_arithmetic():
    assert PipelineStepStats(step_s=2.0, compute_s=1.5, stage_compute_s={0: 1.5}).bubble_fraction == 0.25
    assert PipelineStepStats(step_s=0.0, compute_s=0.0, stage_compute_s={}).bubble_fraction == 0.0


# ---------------------------------------------------------------- multi-process parity

LOSS_RTOL = 1e-4
# Gradients of the first step: same math, different summation order (microbatch
# means, then divided by the count).
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
# Weights after 5 AdamW steps at lr 3e-3: Adam divides by sqrt(v), so components whose
# gradient is near zero amplify rounding differences; 5e-5 is 1/60 of one step's
# largest update, far below what a missing or doubled gradient contribution moves.
WEIGHT_TOL = dict(rtol=1e-3, atol=5e-5)


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp") / "parity.pt"
    run_torchrun(WORKERS / "pp_parity.py", 2, "--out", str(out), "--steps", "5", timeout_s=240)
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_matches_single_process(parity, schedule):
    ref, got = parity["reference"], parity["schedules"][schedule]
    assert got["stage_ids"] == LAYOUT_PP2[schedule]
    assert len(got["losses"]) == len(ref["losses"]) == 5
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
    assert got["duplicated"] == []
    assert set(got["grads"]) == {k for k, _ in build_model(CFG_PARITY, device="meta").named_parameters()}
    for k, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][k], g, **GRAD_TOL, msg=lambda m, k=k: f"grad {k}: {m}")
    assert set(got["state"]) == set(ref["state"])
    for k, w in ref["state"].items():
        torch.testing.assert_close(got["state"][k], w, **WEIGHT_TOL, msg=lambda m, k=k: f"weight {k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_reports_step_timings(parity, schedule):
    for rank_stats in parity["schedules"][schedule]["stats"]:
        assert 0 < rank_stats["compute_s"] < rank_stats["step_s"]
        assert 0.0 <= rank_stats["bubble_fraction"] < 1.0
        assert all(t > 0 for t in rank_stats["stage_compute_s"].values())

