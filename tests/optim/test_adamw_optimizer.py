"""``optimizer.implementation = cpu`` (optim/adamw_optimizer.py): the kernel behind torch's AdamW
interface. A user notices the run's weights (the same as torch's fused AdamW within 1e-6 under
the LR schedule and the per-group weight decay), its checkpoints (interchangeable with torch's
AdamW, bf16 moments included) and the config's refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from trainforge.errors import ConfigError
from trainforge.model.config import FLAVORS
from trainforge.model.llama import build_model
from trainforge.optim.cpu_adamw import load_adamw_kernel
from trainforge.train.lr_schedule import build_scheduler
from trainforge.train.optimizer import build_optimizer
from trainforge.train.section import OptimizerSection

pytestmark = pytest.mark.skipif(load_adamw_kernel() is None, reason="the CPU AdamW kernel did not build")


def _model():
    return build_model(FLAVORS["debug"], seed=0)


def _train(opt, model, steps: int, seed: int = 0, sched=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, FLAVORS["debug"].vocab_size, (2, 17), generator=gen)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def test_cpu_implementation_matches_torch_fused_under_the_lr_schedule():
    # Training feeds each step's weights into the next gradient, so rounding differences grow:
    # torch's own foreach and fused AdamW end 9e-6 apart after these 20 steps (1e-6 holds for a
    # fixed gradient sequence: test_cpu_adamw.py). A kernel ignoring the schedule ends ~1e-3 away.
    runs = {}
    for impl in ("fused", "cpu"):
        model = _model()
        opt = build_optimizer(model, OptimizerSection(implementation=impl), 3e-3, torch.device("cpu"))
        sched = build_scheduler(opt, "cosine", 5, 20, 0.1)
        _train(opt, model, 20, sched=sched)
        runs[impl] = model.state_dict()
    for k, v in runs["fused"].items():
        torch.testing.assert_close(runs["cpu"][k], v, rtol=0, atol=3e-5, msg=k)


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_checkpoints_move_between_the_kernel_and_torch(moments):
    # 5 steps with the kernel, its state loaded into torch's AdamW (and back), 5 more steps: the
    # weights match continuing without the switch.
    section = OptimizerSection(implementation="cpu", moments_dtype=moments, moments_rounding="nearest")
    model = _model()
    opt = build_optimizer(model, section, 1e-3, torch.device("cpu"))
    _train(opt, model, 5)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert next(iter(saved_opt["state"].values()))["exp_avg"].dtype == getattr(torch, moments)
    _train(opt, model, 5, seed=1)
    want = model.state_dict()
    for impl, tol in (("fused", 1e-6 if moments == "float32" else 1e-4), ("cpu", 1e-6)):
        other = _model()
        other.load_state_dict(saved_model)
        o = build_optimizer(other, OptimizerSection(implementation=impl, moments_dtype="float32" if impl == "fused"
                                                    else moments, moments_rounding="nearest"),
                            1e-3, torch.device("cpu"))
        o.load_state_dict(copy.deepcopy(saved_opt))  # load_state_dict keeps the tensors it is given
        _train(o, other, 5, seed=1)
        for k, v in want.items():
            torch.testing.assert_close(other.state_dict()[k], v, rtol=0, atol=tol, msg=f"{impl}: {k}")


def test_config_refusals_name_the_key():
    with pytest.raises(ConfigError, match="optimizer.moments_dtype"):
        OptimizerSection(implementation="fused", moments_dtype="bfloat16").validate()
    with pytest.raises(ConfigError, match="optimizer.implementation"):
        build_optimizer(_model(), OptimizerSection(implementation="cpu"), 1e-3, torch.device("cuda"))



def test_a_run_with_bf16_moments_resumes_exactly(small_data, tmp_path):
    # Through the trainer and its checkpoint: 8 steps straight equal 5 steps, an interruption, a
    # resume and 3 more, bit for bit (the rounding bits come from the step, so the resumed part
    # rounds as the straight run did).
    from tests.conftest import StopAt, debug_config
    from trainforge.train.trainer import Trainer

    keys = ["--optimizer.implementation", "cpu", "--optimizer.moments_dtype", "bfloat16", "--training.steps", "8",
            "--training.val_interval", "0", "--training.warmup_steps", "2", "--checkpoint.interval", "4"]

    def run(run_dir, **kw):
        t = Trainer(debug_config(small_data, *keys), run_dir, progress=False, **kw)
        try:
            t.fit()
            return {k: v.clone() for k, v in t.model.state_dict().items()}
        finally:
            t.close()

    straight = run(tmp_path / "a")
    run(tmp_path / "b", callbacks=[StopAt(5)])
    resumed = run(tmp_path / "b", resume=True)
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
