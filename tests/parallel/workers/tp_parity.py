"""Tensor-parallel parity worker, run by tests/parallel/test_tensor_parallel.py under torchrun.

Every rank builds the same single-device reference model (same seed) and a TP copy of it,
then for each case trains both for a few AdamW steps on identical batches, recording the
largest loss / gradient / weight differences (sharded tensors gathered with
``full_tensor()``). Also checks pipeline-stage-shaped models (embedding or output absent)
and the sequence-length check. Writes ``<out_dir>/rank<r>.json``; any failure raises, so
torchrun exits non-zero.

usage: torchrun --nproc_per_node=2 tp_parity.py OUT_DIR
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode

from trainforge.model import FLAVORS, build_model
from trainforge.parallel.distributed import destroy_distributed, init_distributed
from trainforge.parallel.partial_grads import PartialGradReducer
from trainforge.parallel.tensor_parallel import apply_tensor_parallel, cross_entropy_loss, loss_context
from trainforge.train.mtp_loss import MTPLoss
from trainforge.train.section import TrainingSection

BATCH, SEQ, STEPS = 2, 16, 3
# Dense latent attention (model/mla.py) on the debug shapes: low-rank or full-rank query.
MLA = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
CASES = {  # name -> (sequence_parallel, loss_parallel, tie_embeddings, model overrides)
    "sp-lp": (True, True, False, {}),
    "sp-nolp": (True, False, False, {}),
    "nosp-lp": (False, True, False, {}),
    "nosp-nolp": (False, False, False, {}),
    "sp-lp-tied": (True, True, True, {}),
    "mla-sp-lp": (True, True, False, MLA),
    "mla-nosp-nolp": (False, False, False, MLA),
    "mla-fullq-sp-lp": (True, True, False, {**MLA, "q_lora_rank": 0}),
    # Multi-token prediction (model/mtp.py) trained with its real loss (train/mtp_loss.py):
    # depth 1 has SEQ - 1 = 15 positions, which tp = 2 does not divide; depth 2 has 14.
    "mtp-sp-lp": (True, True, False, {"mtp_depth": 2}),
    "mtp-sp-nolp": (True, False, False, {"mtp_depth": 2}),
    "mtp-nosp-lp": (False, True, False, {"mtp_depth": 2}),
    "mtp-sp-lp-tied": (True, True, True, {"mtp_depth": 1}),
    "mla-mtp-sp-lp": (True, True, False, {**MLA, "mtp_depth": 1}),
}
# The trainer's grad finisher for TP (parallel/partial_grads.py) on top: the norm weights'
# Partial gradients summed once, before clipping; name -> the CASES entry it runs.
REDUCED = {"sp-lp-reduced": "sp-lp", "mtp-sp-lp-reduced": "mtp-sp-lp"}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_abs_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    got = full(got).detach()
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got - want.detach()).abs().max().item()


def batches(vocab: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        seq = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def run_case(mesh, sp: bool, lp: bool, tied: bool, overrides: dict, reduce_partials: bool = False) -> dict:
    cfg = dataclasses.replace(FLAVORS["debug"], tie_embeddings=tied, **overrides)
    ref = build_model(cfg, seed=0)
    model = copy.deepcopy(ref)
    apply_tensor_parallel(model, mesh, sequence_parallel=sp, loss_parallel=lp)

    # The model really is split: each rank holds half the query heads and half the vocab.
    attention = model.layers["0"].attention
    if cfg.is_mla:
        wq = (attention.wq if cfg.q_lora_rank == 0 else attention.wq_b).weight
        head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        kv = attention.wkv_b.weight
        assert kv.to_local().shape[0] == cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) // 2
        assert attention.wkv_a.weight.placements[0].is_replicate()  # the shared rotary key: whole on every rank
    else:
        wq, head = attention.wq.weight, cfg.head_dim
    assert isinstance(wq, DTensor) and wq.to_local().shape[0] == cfg.n_heads * head // 2
    assert model.output.weight.to_local().shape[0] == cfg.vocab_size // 2
    for module in model.mtp.values():  # the MTP blocks are split like the main ones
        assert module.block.feed_forward.w1.weight.to_local().shape[0] == cfg.ffn_hidden_dim // 2
        assert module.proj.weight.to_local().shape[1] == cfg.dim  # of 2 dim: row-parallel
    if tied:
        assert model.output.weight is model.tok_embeddings.weight, "tie lost"
    # All DTensors, none plain: foreach ops (clip_grad_norm_, the optimizers) reject a mix.
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not plain, f"parameters left as plain tensors: {plain}"
    ref_params = dict(ref.named_parameters())
    tp_params = dict(model.named_parameters())
    assert ref_params.keys() == tp_params.keys(), (ref_params.keys() ^ tp_params.keys())

    # eps=1e-5, not the default 1e-8: Adam's step is lr * g / (|g| + eps), so on an element
    # whose gradient is near zero a rounding-level gradient difference is amplified by up to
    # lr / eps. Measured: g = 1.7e-9 vs 2.0e-9 gave a 2.1e-5 weight difference with eps=1e-8;
    # g = 1.26e-7 vs 1.31e-7 gave 3.6e-6 with eps=1e-6. A real TP fault (a missing reduction,
    # a wrong shard) moves gradients by ~1e-3 and weights by ~lr, far beyond either tolerance.
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1)
    opt_tp = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1)
    loss_rel, grad_max, worst_grad, norm_rel = 0.0, 0.0, "", 0.0
    losses = []
    reducer = PartialGradReducer(list(model.parameters())) if reduce_partials else None
    partial_grads, reducer_collectives, optimizer_collectives = [], [], []
    # An MTP model trains with main + lambda x mean over depths; its depth losses take the
    # same loss-parallel cross-entropy as the main one.
    mtp_loss = MTPLoss(cfg.mtp_depth, TrainingSection()) if cfg.mtp_depth else None
    for inputs, targets in batches(cfg.vocab_size, STEPS):
        loss_ref = mtp_loss(ref, ref, inputs, targets) if mtp_loss else cross_entropy_loss(ref(inputs), targets)
        loss_ref.backward()
        with loss_context(lp):
            logits, depth_logits = model(inputs, mtp=True) if mtp_loss else (model(inputs), [])
            for k, lg in enumerate([logits, *depth_logits]):
                if lp:
                    assert isinstance(lg, DTensor) and lg.placements == (Shard(2),), lg
                else:
                    assert not isinstance(lg, DTensor) and lg.shape == (BATCH, SEQ - k, cfg.vocab_size), lg.shape
            loss = mtp_loss(model, model, inputs, targets) if mtp_loss else cross_entropy_loss(logits, targets)
            assert not isinstance(loss, DTensor) and loss.dim() == 0
            loss.backward()
        partial_grads.append(sum(any(pl.is_partial() for pl in p.grad.placements) for p in model.parameters()))
        if reducer is not None:
            reducer_collectives.append(reducer())
        losses.append((loss.item(), loss_ref.item()))
        loss_rel = max(loss_rel, abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
        for name, p in ref_params.items():
            g = tp_params[name].grad
            assert g is not None, f"no gradient for {name}"
            d = max_abs_diff(g, p.grad)
            if d >= grad_max:
                grad_max, worst_grad = d, name
        # As the trainer does: foreach clipping, active here (the norm is ~2).
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, foreach=True)
        norm = full(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True))
        norm_rel = max(norm_rel, abs(norm.item() - norm_ref.item()) / norm_ref.item())
        opt_ref.step()
        with CommDebugMode() as comm:  # what the optimizer step communicates (Partial gradients re-reduced)
            opt_tp.step()
        optimizer_collectives.append(comm.get_total_counts())
        opt_ref.zero_grad()
        opt_tp.zero_grad()
    weight_max = max(max_abs_diff(tp_params[n], p) for n, p in ref_params.items())
    # The weights moved by much more than the tolerance, so matching them means something.
    moved = max((p - build_model(cfg, seed=0).get_parameter(n)).abs().max().item() for n, p in ref_params.items())
    return {"loss_rel": loss_rel, "grad_max": grad_max, "worst_grad": worst_grad, "grad_norm_rel": norm_rel,
            "weight_max": weight_max, "weight_moved": moved, "losses": losses, "partial_grads": partial_grads,
            "reducer_collectives": reducer_collectives, "optimizer_collectives": optimizer_collectives}


def run_stages(mesh) -> dict:
    """First stage (no norm/output) and last stage (no embedding) under SP + loss parallel:
    activations cross the stage boundary as the local sequence shard (B, T/tp, dim)."""
    cfg = FLAVORS["debug"]
    rank, tp = mesh.get_local_rank(), mesh.size()
    ref = build_model(cfg, seed=0)
    first_ref, last_ref = copy.deepcopy(ref), copy.deepcopy(ref)
    first_ref.norm = first_ref.output = None
    del first_ref.layers["1"]
    last_ref.tok_embeddings = None
    del last_ref.layers["0"]
    first, last = copy.deepcopy(first_ref), copy.deepcopy(last_ref)
    apply_tensor_parallel(first, mesh, sequence_parallel=True, loss_parallel=True)
    apply_tensor_parallel(last, mesh, sequence_parallel=True, loss_parallel=True)

    (inputs, targets), = batches(cfg.vocab_size, 1)
    rows = slice(rank * SEQ // tp, (rank + 1) * SEQ // tp)
    hidden_ref = first_ref(inputs)  # (B, T, dim)
    hidden = first(inputs)  # (B, T/tp, dim): this rank's sequence shard
    assert not isinstance(hidden, DTensor) and hidden.shape == (BATCH, SEQ // tp, cfg.dim), hidden.shape
    hidden_max = max_abs_diff(hidden, hidden_ref[:, rows])

    stage_in_ref = hidden_ref.detach().requires_grad_()
    loss_ref = cross_entropy_loss(last_ref(stage_in_ref), targets)
    loss_ref.backward()
    stage_in = hidden.detach().requires_grad_()
    with loss_context(True):
        loss = cross_entropy_loss(last(stage_in), targets)
        loss.backward()
    grad_max = max(max_abs_diff(p.grad, q.grad) for p, q in zip(last.parameters(), last_ref.parameters()))
    # The gradient sent back to the first stage is this rank's shard of the full one.
    input_grad_max = max_abs_diff(stage_in.grad, stage_in_ref.grad[:, rows])
    return {"hidden_max": hidden_max, "loss_rel": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()),
            "grad_max": max(grad_max, input_grad_max)}


def check_seq_len(mesh) -> str:
    model = build_model(FLAVORS["debug"], seed=0)
    apply_tensor_parallel(model, mesh, sequence_parallel=True, loss_parallel=False)
    try:
        model(torch.zeros(BATCH, SEQ - 1, dtype=torch.long))
    except ValueError as e:
        return str(e)
    raise AssertionError("an odd sequence length under SP with tp=2 was accepted")


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    info = init_distributed("cpu")
    mesh = init_device_mesh("cpu", (info.world_size,), mesh_dim_names=("tp",))
    result = {name: run_case(mesh, *case) for name, case in CASES.items()}
    result.update({name: run_case(mesh, *CASES[base], reduce_partials=True) for name, base in REDUCED.items()})
    result["stages"] = run_stages(mesh)
    result["seq_len_error"] = check_seq_len(mesh)
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result, indent=1))
    # Not in a `finally`: after a failure the barrier would wait on peers torchrun is killing.
    destroy_distributed()


if __name__ == "__main__":
    main()
