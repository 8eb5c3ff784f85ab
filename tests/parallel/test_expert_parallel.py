"""Expert parallelism (``parallel.ep``) through the real CLI under torchrun (gloo, CPU):
MoE training with the experts split over ranks matches single-process training at the
same global batch and seed, alone (FSDP2, or DDP until gradient compression starts), with
edp > 1 (expert gradients summed over the ranks holding the same experts) and under
pipeline stages; its sharded checkpoints load at ep 1 and in one process; bad layouts
are refused."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from tests.parallel.test_data_parallel import LOSS_RTOL, WEIGHT_ATOL, assert_same_losses, losses, weights
from tests.parallel.torchrun import WORKERS, completed_run, resumed, run_torchrun, run_train_many
from trainforge.errors import ConfigError
from trainforge.model import FLAVORS
from trainforge.parallel.dims import ParallelDims
from trainforge.parallel.section import ParallelSection
from trainforge.train import dist_checkpoint as dckpt

GLOBAL_BATCH = 8
COMMON = ["--model.flavor", "moe-debug", "--training.seq_len", "32", "--training.steps", "6",
          "--training.warmup_steps", "2", "--training.log_interval", "1", "--training.val_interval", "3",
          "--training.val_batches", "2", "--checkpoint.interval", "3", "--checkpoint.keep_last", "5",
          "--sample.max_new_tokens", "0", "--training.threads", "1"]


def biases(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in w.items() if k.endswith("router.expert_bias")}


def assert_biases_moved(w: dict[str, torch.Tensor]) -> None:
    """The loss-free balance (train/moe_balance.py, merged separately) moves every MoE
    layer's selection bias. Until that component exists this check is an expected failure
    (after every other assertion of the test has run); once it exists it is strict."""
    moved = all(b.abs().sum() > 0 for b in biases(w).values())
    if importlib.util.find_spec("trainforge.train.moe_balance") is None:
        pytest.xfail("train/moe_balance.py (the bias update) is not on this branch: router biases stay 0")
    assert moved, {k: b.tolist() for k, b in biases(w).items()}


def assert_same_training(run_dir, ref_dir, steps=range(1, 7), final: int = 6) -> dict[str, torch.Tensor]:
    """Losses (train and validation) within LOSS_RTOL, final weights within WEIGHT_ATOL,
    router biases identical to single-process. Returns the final weights."""
    assert_same_losses(run_dir, ref_dir, steps)
    name = f"step_{final:07d}"
    a, b = weights(run_dir / "checkpoints" / name), weights(ref_dir / "checkpoints" / name)
    assert a.keys() == b.keys() and biases(b)
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=WEIGHT_ATOL, rtol=0, msg=k)
    for k in biases(b):  # the selection bias decides routing: it must be the same, not close
        assert torch.equal(a[k], b[k]), (k, a[k], b[k])
    return a


EP_INT8 = ["--parallel.ep", "2", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",
           "--compression.codec", "int8", "--compression.warmup_steps", "3"]
EP_LAYOUTS = {  # (batch per rank, layout) on 4 processes
    "ep2-fsdp4": (2, ["--parallel.dp_shard", "4"]),  # edp 2: expert grads summed over two ranks each
    "ep2-fsdp2-pp2": (4, ["--parallel.pp", "2", "--parallel.dp_shard", "2", "--parallel.pp_split", "0,2"]),
}


# Where the ep 2 run's step-3 checkpoint resumes: ep 1 (FSDP2 over every rank), by process count.
EP1 = ["--parallel.ep", "1", "--parallel.dp_replicate", "1", "--parallel.dp_shard", "-1"]


def fresh_args(run_dir, data, batch: int, *extra: str) -> list[str]:
    return ["--run_dir", str(run_dir), "--data.path", str(data), *COMMON, "--training.batch_size", str(batch), *extra]


@pytest.fixture(scope="module")
def runs2(tmp_path_factory, small_data):
    """The 2-process runs in ONE torchrun launch (tests/parallel/workers/cli_many.py): ep 2
    (FSDP2 over dp_shard 2 for the non-expert parameters), ep 2 under int8-compressed DDP,
    and the ep 2 run's step-3 checkpoint resumed at ep 1; then the single-process runs in one
    process: the reference and that checkpoint resumed in one process. Returns (root: run
    directories by name, name -> CompletedProcess)."""
    root = tmp_path_factory.mktemp("ep_runs2")
    done = run_train_many(2, {"ep2": fresh_args(root / "ep2", small_data, 4, "--parallel.ep", "2"),
                              "ep-int8": fresh_args(root / "ep-int8", small_data, 4, *EP_INT8),
                              "resume2": resumed(root / "ep2", root / "resume2", 3, "--training.batch_size", "4",
                                                 *EP1)})
    done |= run_train_many(1, {"reference": fresh_args(root / "reference", small_data, GLOBAL_BATCH),
                               "resume1": resumed(root / "ep2", root / "resume1", 3, "--training.batch_size", "8",
                                                  *EP1)})
    return root, done


@pytest.fixture(scope="module")
def reference(runs2):
    return completed_run(*runs2, "reference")


@pytest.fixture(scope="module")
def ep2_run(runs2):
    root, done = runs2
    assert done["ep2"].returncode == 0
    assert "layout: FSDP2 over 2 ranks, EP 2" in done["ep2"].stderr
    return root / "ep2"


@pytest.fixture(scope="module")
def runs4(tmp_path_factory, small_data):
    """The 4-process layouts of test_ep_layouts_match_single_process in ONE launch."""
    root = tmp_path_factory.mktemp("ep_runs4")
    return root, run_train_many(4, {n: fresh_args(root / n, small_data, b, "--parallel.ep", "2", *layout)
                                    for n, (b, layout) in EP_LAYOUTS.items()})


@pytest.mark.slow
def test_dispatch_matches_local_experts():
    """Outputs, input gradients and expert gradients of one MoE layer with its experts on
    two ranks equal the single-device layer's, also when one rank receives no token."""
    run_torchrun(WORKERS / "ep_dispatch.py", 2)


@pytest.mark.slow
def test_ep2_matches_single_process(reference, ep2_run):
    w = assert_same_training(ep2_run, reference)
    assert (ep2_run / "checkpoints" / "step_0000006" / dckpt.SHARDED_DIR).is_dir()
    assert_biases_moved(w)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(EP_LAYOUTS))
def test_ep_layouts_match_single_process(runs4, reference, case):
    root, done = runs4
    assert done[case].returncode == 0
    assert_biases_moved(assert_same_training(root / case, reference))


@pytest.mark.slow
def test_ep_checkpoint_resumes_at_other_layouts(runs2, reference, ep2_run):
    """The ep 2 run's step-3 sharded checkpoint resumes at ep 1 (FSDP2 over 2 processes)
    and in one process (the ``runs2`` fixture); both continue with the reference's losses
    and weights."""
    root, done = runs2
    for name in ("resume2", "resume1"):
        assert done[name].returncode == 0, done[name].stderr[-3000:]
        assert "step_0000003" in done[name].stderr  # it resumed, from step 3
        assert_same_training(root / name, reference)


@pytest.mark.parametrize("kw, world, needle", [
    ({"dp_replicate": 1, "dp_shard": -1, "ep": 3}, 4, "'parallel.ep' = 3 must divide the data-parallel degree"),
    ({"dp_replicate": 1, "dp_shard": 1, "tp": 2, "ep": 2}, 2, "'parallel.ep' = 2 must divide"),
    ({"dp_replicate": 1, "dp_shard": -1, "ep": 0}, 2, "'parallel.ep' = 0: must be >= 1"),
    ({"dp_replicate": 1, "dp_shard": -1, "ep": 2, "compile": True}, 2, "'parallel.compile' = true"),
])
def test_ep_not_fitting_the_mesh_is_refused(kw, world, needle):
    section = SimpleNamespace(**{"tp": 1, "pp": 1, **kw})
    with pytest.raises(ConfigError, match=needle):
        ParallelDims.resolve(section, world)


def test_ep_not_fitting_the_model_is_refused():
    dims = ParallelDims.resolve(SimpleNamespace(dp_replicate=1, dp_shard=-1, tp=1, pp=1, ep=2), 2)
    with pytest.raises(ConfigError, match="'parallel.ep' = 2 needs a mixture-of-experts model"):
        dims.check_model(FLAVORS["debug"])
    dims = ParallelDims.resolve(SimpleNamespace(dp_replicate=1, dp_shard=-1, tp=1, pp=1, ep=3), 3)
    with pytest.raises(ConfigError, match=r"'parallel.ep' = 3 must divide model.n_routed_experts = 8"):
        dims.check_model(FLAVORS["moe-debug"])
    dims = ParallelDims.resolve(SimpleNamespace(dp_replicate=1, dp_shard=1, tp=2, pp=1, ep=1), 2)
    with pytest.raises(ConfigError, match="'parallel.tp' = 2: tensor parallelism of mixture-of-experts"):
        dims.check_model(FLAVORS["moe-debug"])
    dims = ParallelDims.resolve(SimpleNamespace(dp_replicate=2, dp_shard=2, tp=1, pp=1, ep=4), 4)
    dims.check_model(FLAVORS["moe-debug"])
    assert (dims.ep, dims.edp) == (4, 1)
    with pytest.raises(ConfigError, match="parallel.ep"):
        ParallelSection(ep=0).validate()


@pytest.mark.slow
def test_ep_composes_with_gradient_compression(runs2, reference):
    """ep 2 with DDP for the non-expert parameters, whose gradients are int8-compressed
    from step 4 on (the expert gradients are reduced apart, in full precision): the same
    training as the reference until compression starts (losses and step-3 weights: the
    DDP parity case), close after."""
    root, done = runs2
    run_dir = root / "ep-int8"
    assert done["ep-int8"].returncode == 0
    got, want = losses(run_dir), losses(reference)
    assert sorted(got) == list(range(1, 7))
    for s in got:
        rtol = LOSS_RTOL if s <= 4 else 1e-3
        assert abs(got[s] - want[s]) <= rtol * want[s], (s, got[s], want[s])
    assert got[6] != want[6]  # compression did change something
    a, b = (weights(d / "checkpoints" / "step_0000003") for d in (run_dir, reference))
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=WEIGHT_ATOL, rtol=0, msg=k)
