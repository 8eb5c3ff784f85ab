"""Loss-free load balancing of MoE models (train/moe_balance.py): what a user notices is
the routing getting more even, the per-expert bias moving by exactly gamma the way the
counted loads say, the auxiliary losses' gradient being that of the loss they define,
resume reproducing an uninterrupted run (bias included), and the routing metrics in
metrics.jsonl. moe-debug, seq 32: each Trainer here runs in a few seconds."""

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import StopAt
from tests.control.test_trainer_control import records, run
from trainforge.cli import main as cli_main
from trainforge.config import load_config
from trainforge.model.config import FLAVORS
from trainforge.model.moe import MoE, Router, routers
from trainforge.train import dist_checkpoint as dckpt
from trainforge.train.component import Component, Window
from trainforge.train.moe_balance import MoEBalance, max_violation
from trainforge.train.trainer import Trainer

BATCH, SEQ, K = 4, 32, FLAVORS["moe-debug"].n_activated_experts
MOE = ["--model.flavor", "moe-debug", "--training.batch_size", str(BATCH), "--training.seq_len", str(SEQ),
       "--training.log_interval", "3", "--training.warmup_steps", "2", "--training.val_batches", "2",
       "--training.threads", "1", "--sample.max_new_tokens", "0"]


def moe_config(data, *extra):
    return load_config(None, [*MOE, "--data.path", str(data), *extra])


class RouterSpy(Component):
    """Registered as a callback, so its hooks run before the balance component's: it sees
    each micro-batch's router input, the counted loads and the bias before the update."""

    name = "router_spy"

    def __init__(self):
        self.inputs: dict[str, list[torch.Tensor]] = {}
        self.loads: dict[str, torch.Tensor] = {}
        self.bias_before: dict[str, torch.Tensor] = {}
        self._hooked = False

    def on_step_start(self, loop):
        if not self._hooked:
            for fqn, r in routers(loop.raw_model):
                r.register_forward_hook(lambda m, args, out, fqn=fqn: self.inputs[fqn].append(args[0].detach()))
            self._hooked = True
        self.inputs = {fqn: [] for fqn, _ in routers(loop.raw_model)}

    def after_optimizer_step(self, loop):
        for fqn, r in routers(loop.raw_model):
            self.loads[fqn] = r.load.clone()
            self.bias_before[fqn] = r.expert_bias.clone()


def hand_count(xs: list[torch.Tensor], gate: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens per expert from the router's rule written out: top-k of sigmoid(x W^T) + bias."""
    counts = torch.zeros(gate.shape[0])
    for x in xs:
        idx = (F.linear(x.float(), gate).sigmoid() + bias).topk(k, dim=-1).indices
        for e in idx.flatten().tolist():
            counts[e] += 1
    return counts


def test_bias_moves_by_exactly_gamma_against_the_hand_counted_load(small_data, tmp_path):
    gamma = 0.01
    cfg = moe_config(small_data, "--model.bias_update_rate", str(gamma), "--training.grad_accum_steps", "2")
    spy = RouterSpy()
    t = Trainer(cfg, tmp_path / "run", callbacks=[spy], progress=False)
    try:
        for _ in range(3):
            at_start = {fqn: (r.gate.weight.detach().clone(), r.expert_bias.clone()) for fqn, r in routers(t.raw_model)}
            t.train_step()
            t.step += 1
            for fqn, r in routers(t.raw_model):
                assert len(spy.inputs[fqn]) == 2  # both micro-batches counted
                load = hand_count(spy.inputs[fqn], *at_start[fqn], k=K)
                torch.testing.assert_close(spy.loads[fqn], load, rtol=0, atol=0)
                assert load.sum() == 2 * BATCH * SEQ * K
                moved = r.expert_bias - spy.bias_before[fqn]
                over, under = load > load.mean(), load < load.mean()
                assert over.any() and under.any()
                torch.testing.assert_close(moved[over], torch.full_like(moved[over], -gamma), rtol=0, atol=1e-8)
                torch.testing.assert_close(moved[under], torch.full_like(moved[under], gamma), rtol=0, atol=1e-8)
                torch.testing.assert_close(moved[load == load.mean()], torch.zeros_like(moved[load == load.mean()]))
    finally:
        t.close()


class RejectStep(Component):
    name = "reject_step"

    def __init__(self, step):
        self.step = step

    def before_optimizer_step(self, loop, loss, grad_norm):
        return loop.step + 1 != self.step


def test_a_rejected_step_moves_no_bias_and_leaves_no_load_behind(small_data, tmp_path):
    cfg = moe_config(small_data, "--model.bias_update_rate", "0.01")
    spy = RouterSpy()
    t = Trainer(cfg, tmp_path / "run", callbacks=[spy, RejectStep(2)], progress=False)
    try:
        biases = []
        for _ in range(3):
            t.train_step()
            t.step += 1
            biases.append({fqn: r.expert_bias.clone() for fqn, r in routers(t.raw_model)})
        for fqn, load in spy.loads.items():  # step 3's counts: its own tokens only
            assert load.sum() == BATCH * SEQ * K, fqn
            torch.testing.assert_close(biases[1][fqn], biases[0][fqn], rtol=0, atol=0)  # step 2 rejected
            assert not torch.equal(biases[2][fqn], biases[1][fqn])
    finally:
        t.close()


def test_selection_uses_the_bias_but_the_combine_weights_do_not():
    torch.manual_seed(0)
    cfg = FLAVORS["moe-debug"]
    moe = MoE(cfg).eval()
    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        nn.init.normal_(w, std=0.1)
    x = torch.randn(4, 16, cfg.dim)
    flat = x.view(-1, cfg.dim)
    scores = torch.sigmoid(flat @ moe.router.gate.weight.T)  # (N, E), no bias
    moe.router.expert_bias[3] = 10.0  # expert 3 wins every token's selection
    with torch.no_grad():
        out = moe(x).view(-1, cfg.dim)
        weights, idx = moe.router(flat, 16)
    assert (idx == 3).any(-1).all() and not (scores.topk(2).indices == 3).any(-1).all()
    want_w = scores.gather(1, idx)
    want_w = want_w / want_w.sum(-1, keepdim=True) * cfg.route_scale  # unbiased scores, normalised (sigmoid)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    # The block's output combines the chosen experts with those unbiased weights.
    e = moe.experts
    want = moe.shared_experts(flat).detach().clone()
    for n in range(flat.shape[0]):
        for j, ex in enumerate(idx[n].tolist()):
            h = F.silu(e.w1[ex] @ flat[n]) * (e.w3[ex] @ flat[n])
            want[n] += want_w[n, j] * (e.w2[ex] @ h).detach()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def _toy(gamma: float, steps: int) -> tuple[float, float]:
    """A router whose tokens lean towards a few experts, balanced by the component alone.
    Returns MaxVio of the first and the last step."""
    torch.manual_seed(0)
    cfg = FLAVORS["moe-debug"]
    root = nn.Module()
    root.layers = nn.ModuleDict({"1": nn.Module()})
    root.layers["1"].feed_forward = MoE(cfg)
    x = torch.randn(BATCH * SEQ, cfg.dim) + 2.0 * torch.randn(cfg.dim)  # a shared offset: skewed scores
    bal = MoEBalance(dataclasses.replace(cfg, bias_update_rate=gamma), grad_accum_steps=1)
    loop = SimpleNamespace(model_parts=[root], opt_parts=[root], device=torch.device("cpu"),
                           mp=SimpleNamespace(scaler=SimpleNamespace(enabled=False)),
                           layout=SimpleNamespace(loss_splits=1))
    router = root.layers["1"].feed_forward.router
    first = last = None
    for _ in range(steps):
        bal.on_step_start(loop)
        router(x, SEQ)
        last = float(max_violation(router.load.view(1, -1)))
        first = last if first is None else first
        bal.after_optimizer_step(loop)
    return first, last


def test_loss_free_bias_evens_out_a_skewed_router():
    start, end = _toy(gamma=1e-2, steps=200)
    fixed_start, fixed_end = _toy(gamma=0.0, steps=200)
    assert start == fixed_start == fixed_end > 1.0  # gamma 0: counted, never moved
    assert end < 0.25 * start, (start, end)


BF16_MASTER = ["--precision.policy", "bf16-mixed", "--precision.force", "true", "--precision.param_dtype", "bf16"]


@pytest.mark.parametrize("precision", [[], BF16_MASTER], ids=["fp32", "bf16-params-fp32-master"])
def test_resume_reproduces_the_uninterrupted_run_bias_included(small_data, tmp_path, precision):
    # bf16 parameters: the optimizer steps an fp32 mirror, which is what checkpoints hold.
    args = ["--model.bias_update_rate", "0.01", "--training.steps", "6", "--checkpoint.interval", "3",
            "--training.val_interval", "3", "--training.log_interval", "1", *precision]
    _, straight = run(moe_config(small_data, *args), tmp_path / "a")
    run(moe_config(small_data, *args), tmp_path / "b", callbacks=[StopAt(3)])
    _, resumed = run(moe_config(small_data, *args), tmp_path / "b", resume=True)
    assert [r["loss"] for r in records(tmp_path / "a", "loss")] == [r["loss"] for r in records(tmp_path / "b", "loss")]
    for (fqn, a), (_, b) in zip(routers(straight.raw_model), routers(resumed.raw_model)):
        assert a.expert_bias.abs().max() > 0, fqn
        torch.testing.assert_close(a.expert_bias, b.expert_bias, rtol=0, atol=0)
    if precision:
        assert resumed.mp.master is not None
        for (_, a), (_, m) in zip(routers(resumed.raw_model), routers(resumed.mp.master.module)):
            torch.testing.assert_close(a.expert_bias, m.expert_bias, rtol=0, atol=0)
    # The metrics of the records both runs wrote agree as well.
    keys = ("moe_maxvio_batch", "moe_load", "moe_bias_spread")
    assert [[r[k] for k in keys] for r in records(tmp_path / "a", "loss")] == \
        [[r[k] for k in keys] for r in records(tmp_path / "b", "loss")]


def test_expert_bias_survives_a_sharded_checkpoint(tmp_path):
    torch.manual_seed(0)
    cfg = FLAVORS["moe-debug"]
    from trainforge.model.llama import Transformer

    saved, loaded = Transformer(cfg), Transformer(cfg)
    for _, r in routers(saved):
        r.expert_bias.copy_(torch.randn(cfg.n_routed_experts))
    dckpt.save_sharded(tmp_path, [saved], [torch.optim.AdamW(saved.parameters())])
    dckpt.load_sharded(tmp_path, [loaded], None)
    for (fqn, a), (_, b) in zip(routers(saved), routers(loaded)):
        torch.testing.assert_close(a.expert_bias, b.expert_bias, rtol=0, atol=0, msg=fqn)


def test_metrics_carry_routing_load_and_maxvio(small_data, tmp_path):
    cfg = moe_config(small_data, "--training.steps", "6", "--training.val_interval", "3")
    run(cfg, tmp_path / "run")
    train = records(tmp_path / "run", "loss")
    n_moe = FLAVORS["moe-debug"].n_moe_layers
    assert len(train) == 6
    for r in train:
        assert r["moe_maxvio_batch"] >= 0 and len(r["moe_maxvio_batch_layers"]) == n_moe
        assert r["moe_maxvio_batch"] == pytest.approx(sum(r["moe_maxvio_batch_layers"]) / n_moe)
        assert len(r["moe_load"]) == n_moe
        for layer in r["moe_load"]:
            assert len(layer) == FLAVORS["moe-debug"].n_routed_experts
            assert sum(layer) == pytest.approx(BATCH * SEQ * K)  # tokens x k per layer per step
        assert all(s >= 0 for s in r["moe_bias_spread"]) and "moe_aux_loss" not in r
    assert train[-1]["moe_bias_spread"][0] > 0  # moe-debug's gamma is 1e-3: the bias moved
    val = records(tmp_path / "run", "val_loss")
    assert [r["step"] for r in val] == [0, 3, 6]
    for r in val:
        assert r["moe_maxvio_global"] >= 0 and len(r["moe_maxvio_global_layers"]) == n_moe
    # The run report plots MaxVio and each MoE layer's expert loads.
    assert cli_main(["report", str(tmp_path / "run")]) == 0
    page = (tmp_path / "run" / "report.html").read_text()
    for title in ["MoE load balance (MaxVio)", *(f"Expert load, MoE layer {i}" for i in range(n_moe))]:
        assert f"alt='{title}' src='data:image/png;base64," in page, title


class GateGrads(Component):
    """Captures the micro-batches and, before the update, the router gates' gradients."""

    name = "gate_grads"

    def __init__(self):
        self.batches, self.grads, self.model = [], {}, None

    def on_step_start(self, loop):
        self.model = copy.deepcopy(loop.raw_model)
        next_batch = type(loop.layout).next_batch

        def record(batches):
            batch = next_batch(loop.layout, batches)
            self.batches.append(batch)
            return batch
        loop.layout.next_batch = record

    def before_optimizer_step(self, loop, loss, grad_norm):
        self.grads = {fqn: r.gate.weight.grad.clone() for fqn, r in routers(loop.raw_model)}
        return True


def test_aux_loss_gradient_is_that_of_the_explicit_loss_averaged_over_micro_batches(small_data, tmp_path):
    alpha = 0.05
    cfg = moe_config(small_data, "--model.aux_loss_alpha", str(alpha), "--model.seq_aux_loss_alpha", str(alpha),
                     "--training.grad_accum_steps", "2", "--training.grad_clip", "0")
    spy = GateGrads()
    t = Trainer(cfg, tmp_path / "run", callbacks=[spy], progress=False)
    try:
        t.train_step()
        logged = t.components["moe_balance"].on_log(t, Window([1], [0.0], [0.0]))
    finally:
        t.close()
    ref = spy.model.train()
    live = {}  # each router's auxiliary loss with its graph (the block keeps only the value)
    for fqn, r in routers(ref):
        r.aux_grad_scale = 0.0  # the explicit term below carries the auxiliary loss instead
        r.register_forward_hook(lambda m, args, out, fqn=fqn: live.__setitem__(fqn, m.aux_loss))

    aux_losses = []

    def gate_grads(with_aux: bool) -> dict[str, torch.Tensor]:
        ref.zero_grad()
        for inputs, targets in spy.batches:
            logits = ref(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            aux = sum(live.values())
            aux_losses.append(float(aux))
            if with_aux:
                loss = loss + aux
            (loss / len(spy.batches)).backward()
        return {fqn: r.gate.weight.grad.clone() for fqn, r in routers(ref)}

    want, ce_only = gate_grads(True), gate_grads(False)
    # The logged auxiliary loss: summed over MoE layers, mean over the step's micro-batches.
    assert logged["moe_aux_loss"] == pytest.approx(sum(aux_losses[:2]) / 2, rel=1e-5)
    assert len(spy.batches) == 2
    for fqn, g in spy.grads.items():
        # fp32 throughout; the two sums differ only in order: 1e-5 relative.
        torch.testing.assert_close(g, want[fqn], rtol=1e-5, atol=1e-7, msg=fqn)
        assert (want[fqn] - ce_only[fqn]).norm() > 100 * 1e-5 * want[fqn].norm(), fqn  # the aux term shows


def test_aux_loss_gradient_under_fp16_loss_scaling(small_data, tmp_path):
    """fp16: the main loss is multiplied by the loss scale (65536) before backward, so the
    auxiliary gradient must be too, or unscaling shrinks it 65536-fold. alpha = 1 makes it
    most of the gate's gradient. fp16 compute (the router runs in fp32 by the precision rule)
    against the fp32 reference: measured 3e-4 of the norm, bound 1%."""
    cfg = moe_config(small_data, "--model.aux_loss_alpha", "1.0", "--model.seq_aux_loss_alpha", "1.0",
                     "--training.grad_accum_steps", "2", "--training.grad_clip", "0",
                     "--precision.policy", "fp16-mixed", "--precision.force", "true")
    spy = GateGrads()
    t = Trainer(cfg, tmp_path / "run", callbacks=[spy], progress=False)
    try:
        assert t.mp.scaler.enabled and t.mp.scaler.get_scale() > 1
        t.train_step()
    finally:
        t.close()
    ref = spy.model.train()
    live = {}
    for fqn, r in routers(ref):
        r.aux_grad_scale = 0.0
        r.register_forward_hook(lambda m, args, out, fqn=fqn: live.__setitem__(fqn, m.aux_loss))

    def gate_grads(with_aux: bool) -> dict[str, torch.Tensor]:
        ref.zero_grad()
        for inputs, targets in spy.batches:
            loss = F.cross_entropy(ref(inputs).float().flatten(0, 1), targets.flatten())
            ((loss + sum(live.values()) * with_aux) / len(spy.batches)).backward()
        return {fqn: r.gate.weight.grad.clone() for fqn, r in routers(ref)}

    want, ce_only = gate_grads(True), gate_grads(False)
    for fqn, g in spy.grads.items():
        assert (want[fqn] - ce_only[fqn]).norm() > 0.5 * want[fqn].norm(), fqn  # the aux term dominates
        assert (g - want[fqn]).norm() < 0.01 * want[fqn].norm(), (fqn, float((g - want[fqn]).norm() / want[fqn].norm()))


def test_moe_training_loss_goes_down(small_data, tmp_path):
    cfg = moe_config(small_data, "--training.steps", "30", "--training.val_interval", "30",
                     "--training.log_interval", "5", "--training.warmup_steps", "5")
    summary, _ = run(cfg, tmp_path / "run")
    losses = [r["loss"] for r in records(tmp_path / "run", "loss")]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    assert summary["final_val_loss"] < summary["first_val_loss"] - 0.3


def test_resume_may_change_the_balancing_but_not_the_experts(tmp_path):
    """A checkpoint's shape check: the balancing coefficients are training settings (a run
    may resume with another gamma), the expert count is the weights' shape (refused, named);
    a checkpoint written before the MoE fields existed compares them as their defaults."""
    import dataclasses

    from trainforge.errors import CheckpointError
    from trainforge.model.config import FLAVORS
    from trainforge.train.checkpoint import check_model_compatible

    cfg = FLAVORS["moe-debug"]
    meta = {"model_config": dataclasses.asdict(cfg)}
    check_model_compatible(meta, dataclasses.replace(cfg, bias_update_rate=1e-2, seq_aux_loss_alpha=1e-4), tmp_path)
    with pytest.raises(CheckpointError, match="n_routed_experts: checkpoint 8 vs run 16"):
        check_model_compatible(meta, dataclasses.replace(cfg, n_routed_experts=16), tmp_path)
    dense = FLAVORS["debug"]
    old = {"model_config": {k: v for k, v in dataclasses.asdict(dense).items() if k == "tie_embeddings"
                            or k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim",
                                     "norm_eps", "rope_theta", "max_seq_len")}}
    check_model_compatible(old, dense, tmp_path)
