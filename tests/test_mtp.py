"""Multi-token prediction (model/mtp.py, train/mtp_loss.py): the loss equals a hand
computation from the model's own modules, gradients reach the MTP modules and the shared
embedding, lambda follows its schedule, a CLI run records the per-depth losses with
val_loss the main model's, resume is exact, a checkpoint keeps the MTP weights and
generates like its main model, bad settings are refused naming the key, and data
parallelism (DDP, FSDP2 with expert parallelism) and pipeline parallelism (the MTP modules
on the last stage, alone and with FSDP2) match one process."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import DEBUG_TRAIN, StopAt, debug_config
from trainforge.cli import main as cli_main
from trainforge.config import ParallelSection, load_config
from trainforge.errors import ConfigError
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.loading import load_model
from trainforge.infer.sampling import SamplingParams
from trainforge.model import FLAVORS, Transformer, build_model
from trainforge.model.pipeline_plans import split_backward_refusal
from trainforge.monitor.jsonl import read_jsonl
from trainforge.parallel.dims import ParallelDims
from trainforge.parallel.pipeline import check_pipeline_config, split_model
from trainforge.train import checkpoint as ckpt
from trainforge.train.mtp_loss import MTPLoss, check_mtp_layout, mtp_weight_at
from trainforge.train.section import TrainingSection
from trainforge.train.trainer import Trainer

RUN = ["--model.mtp_depth", "2", "--training.steps", "10", "--checkpoint.interval", "5",
       "--training.val_interval", "5", "--training.mtp_loss_weight_final", "0.1",
       "--training.mtp_loss_weight_switch_step", "5"]


def mtp_config(flavor: str, depth: int = 2):
    return dataclasses.replace(FLAVORS[flavor], mtp_depth=depth)


def hand_mtp_losses(model: Transformer, full: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The DeepSeek-V3 §2.2 equations written out from the model's modules: full (B, T+1)."""
    x = full[:, :-1]
    T = x.shape[1]
    h = model.tok_embeddings(x)
    for layer in model.layers.values():
        h = layer(h, model.rope_cos[:T], model.rope_sin[:T])
    main = F.cross_entropy(model.output(model.norm(h)).flatten(0, 1), full[:, 1:].flatten())
    out = []
    for k in range(1, model.cfg.mtp_depth + 1):
        m, n = model.mtp[str(k - 1)], T - k
        inp = torch.cat([m.enorm(model.tok_embeddings(x[:, k:])), m.hnorm(h[:, :n])], dim=-1)
        h = m.block(m.proj(inp), model.rope_cos[:n], model.rope_sin[:n])
        logits = model.output(m.norm(h))  # position t predicts token t + k + 1
        out.append(F.cross_entropy(logits.flatten(0, 1), full[:, k + 1:].flatten()))
    return main, out


def training_section(**kw) -> TrainingSection:
    s = TrainingSection(**kw)
    s.validate()
    return s


@pytest.mark.parametrize("flavor", ["debug", "moe-debug"])
@pytest.mark.parametrize("chunk", [0, 7])
def test_mtp_loss_equals_the_hand_computation(flavor, chunk):
    """Plain and chunked head: the per-depth losses within 1e-5 relative of the hand
    computation, the training loss = main + 0.3 x mean, evaluation returns the main loss."""
    torch.manual_seed(0)
    model = build_model(mtp_config(flavor), seed=0)
    assert isinstance(model.mtp["1"].block.feed_forward, torch.nn.Module)
    if flavor == "moe-debug":  # DeepSeek-V3: the MTP block of a MoE model is a MoE block
        assert type(model.mtp["1"].block.feed_forward).__name__ == "MoE"
    full = torch.randint(0, model.cfg.vocab_size, (3, 18))
    x, y = full[:, :-1], full[:, 1:]
    want_main, want = hand_mtp_losses(model, full)
    loss_fn = MTPLoss(2, training_section(loss_chunk_tokens=chunk))
    main, per_depth = loss_fn.losses(model, model, x, y)
    torch.testing.assert_close(main, want_main, rtol=1e-5, atol=0)
    torch.testing.assert_close(per_depth, torch.stack(want), rtol=1e-5, atol=0)
    total = loss_fn(model, model, x, y)
    torch.testing.assert_close(total, want_main + 0.3 * (want[0] + want[1]) / 2, rtol=1e-5, atol=0)
    model.eval()
    torch.testing.assert_close(loss_fn(model, model, x, y), want_main, rtol=1e-5, atol=0)
    # model(tokens) is unchanged by the MTP modules; mtp=True returns the same main logits.
    logits, depth_logits = model(x, mtp=True)
    assert torch.equal(logits, model(x)) and [t.shape[1] for t in depth_logits] == [16, 15]


def test_mtp_step_drafts_what_the_training_forward_predicts():
    """The drafting API (``return_hidden``, ``mtp_step``) on aligned inputs gives the
    training forward's per-depth logits, without and with an attention cache."""
    from trainforge.model.attention_cache import StaticCache

    model = build_model(mtp_config("debug"), seed=0).eval()
    x = torch.randint(0, model.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        logits, (want1, want2) = model(x, mtp=True)
        main, h0 = model(x, return_hidden=True)
        assert torch.equal(main, logits) and h0.shape == (2, 12, model.cfg.dim)
        got1, h1 = model.mtp_step(1, h0[:, :11], x[:, 1:])
        got2, _ = model.mtp_step(2, h1[:, :10], x[:, 2:])
        torch.testing.assert_close(got1, want1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-5)
        cache = StaticCache(model.cfg.n_layers + 2, 2, model.cfg.n_kv_heads, 32, model.cfg.head_dim)
        _, h0c = model(x, cache.advance(12), cache, return_hidden=True)
        got1c, _ = model.mtp_step(1, h0c[:, :11], x[:, 1:], torch.arange(11), cache)
        torch.testing.assert_close(got1c, want1, rtol=1e-5, atol=1e-5)


def test_gradients_reach_the_mtp_modules_and_the_shared_embedding_and_head():
    model = build_model(mtp_config("debug"), seed=0)
    full = torch.randint(0, model.cfg.vocab_size, (2, 12))
    _, per_depth = MTPLoss(2, training_section()).losses(model, model, full[:, :-1], full[:, 1:])
    per_depth.mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name in ("tok_embeddings.weight", "output.weight", "layers.0.attention.wq.weight", "mtp.0.proj.weight",
                 "mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.1.block.feed_forward.w1.weight", "mtp.1.norm.weight"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    assert grads["norm.weight"] is None  # the main model's final norm is not on the MTP path
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(full[:, :-1]).flatten(0, 1), full[:, 1:].flatten()).backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("mtp."))


def test_param_counts_include_the_mtp_modules_once():
    for flavor in ("debug", "moe-debug"):
        cfg = mtp_config(flavor)
        model = build_model(cfg, "meta")
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
        assert cfg.num_params(mtp=False) == FLAVORS[flavor].num_params()
        assert "in MTP)" in cfg.describe_params()


def test_lambda_follows_its_schedule():
    assert [mtp_weight_at(s, 0.3, 0.1, 3) for s in (1, 3, 4, 100)] == [0.3, 0.3, 0.1, 0.1]
    assert mtp_weight_at(10**6, 0.3, None, 0) == 0.3
    loss = MTPLoss(1, training_section(mtp_loss_weight=0.5, mtp_loss_weight_final=0.2,
                                       mtp_loss_weight_switch_step=2))
    weights = []
    for step in range(4):
        loss.on_step_start(type("Loop", (), {"step": step})())
        weights.append(loss.current_weight)
    assert weights == [0.5, 0.5, 0.2, 0.2]


@pytest.fixture(scope="module")
def mtp_run(tmp_path_factory, small_data):
    run_dir = tmp_path_factory.mktemp("mtp") / "run"
    assert cli_main(["train", "--run_dir", str(run_dir), *DEBUG_TRAIN, "--data.path", str(small_data), *RUN]) == 0
    return run_dir


def test_cli_run_records_mtp_losses_and_val_loss_is_the_main_loss(mtp_run, small_data, tmp_path):
    records = list(read_jsonl(mtp_run / "metrics.jsonl"))
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 11))
    for r in train:
        assert math.isclose(r["mtp_loss"], (r["mtp_loss_1"] + r["mtp_loss_2"]) / 2, rel_tol=1e-6)
        assert r["mtp_loss_weight"] == (0.3 if r["step"] <= 5 else 0.1)
        assert 0 < r["mtp_loss_2"] < 2 * math.log(512)
    vals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in vals] == [0, 5, 10] and all("val_mtp_loss_2" in r for r in vals)
    # The main weights start as a model without MTP does (same seed): val_loss equals its validation loss.
    plain = Trainer(debug_config(small_data, "--training.steps", "10"), tmp_path / "plain", progress=False)
    try:
        assert plain.evaluate() == vals[0]["val_loss"]
    finally:
        plain.close()
    weights = ckpt.load_full_weights(mtp_run / "checkpoints" / "step_0000010", tie_embeddings=False)
    assert {"mtp.0.proj.weight", "mtp.1.block.attention.wq.weight", "mtp.1.norm.weight"} <= weights.keys()


def test_resume_with_mtp_is_exact(mtp_run, small_data, tmp_path):
    def run(resume=False, callbacks=None):
        t = Trainer(debug_config(small_data, *RUN), tmp_path / "b", resume=resume, callbacks=callbacks,
                    progress=False)
        try:
            return t.fit()
        finally:
            t.close()

    assert run(callbacks=[StopAt(7)])["step"] == 7
    run(resume=True)
    keys = ("step", "loss", "val_loss", "mtp_loss_1", "mtp_loss_2", "val_mtp_loss")
    pick = lambda d: [{k: r[k] for k in keys if k in r} for r in read_jsonl(d / "metrics.jsonl")  # noqa: E731
                      if "loss" in r or "val_loss" in r]
    assert pick(tmp_path / "b") == pick(mtp_run)  # exact floats
    a = ckpt.load_full_weights(mtp_run / "checkpoints" / "step_0000010", tie_embeddings=False)
    b = ckpt.load_full_weights(tmp_path / "b" / "checkpoints" / "step_0000010", tie_embeddings=False)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_activation_checkpointing_with_mtp_matches_plain_training(mtp_run, small_data, tmp_path):
    t = Trainer(debug_config(small_data, *RUN, "--parallel.activation_checkpointing", "full"), tmp_path / "ac",
                progress=False)
    try:
        assert type(t.raw_model.mtp["1"].block).__name__ == "CheckpointWrapper"
        t.fit()
    finally:
        t.close()
    pick = lambda d: {r["step"]: (r["loss"], r["mtp_loss_2"]) for r in read_jsonl(d / "metrics.jsonl")  # noqa
                      if "loss" in r}
    a, b = pick(mtp_run), pick(tmp_path / "ac")
    assert a.keys() == b.keys() and all(math.isclose(x, y, rel_tol=1e-6) for s in a for x, y in zip(a[s], b[s]))
    wa = ckpt.load_full_weights(mtp_run / "checkpoints" / "step_0000010", tie_embeddings=False)
    wb = ckpt.load_full_weights(tmp_path / "ac" / "checkpoints" / "step_0000010", tie_embeddings=False)
    assert wa.keys() == wb.keys()  # same FQNs with and without the wrapper
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0)


def test_mtp_checkpoint_generates_exactly_as_its_main_model(mtp_run):
    loaded = load_model(mtp_run).model
    assert loaded.cfg.mtp_depth == 2 and "mtp.1.proj.weight" in loaded.state_dict()
    main_only = Transformer(dataclasses.replace(loaded.cfg, mtp_depth=0))
    main_only.load_state_dict({k: v for k, v in loaded.state_dict().items() if not k.startswith("mtp.")})
    main_only.eval().requires_grad_(False)
    prompts = [[5, 17, 300, 42], list(range(1, 30))]
    greedy = SamplingParams(max_new_tokens=16, temperature=0)
    out = [[r.output_ids for r in Engine(m, EngineConfig(max_batch_size=2, block_size=8, max_context=64))
            .generate(prompts, greedy)] for m in (loaded, main_only)]
    assert out[0] == out[1]


def test_bad_mtp_settings_are_refused_naming_the_key(small_data):
    with pytest.raises(ConfigError, match="model.mtp_depth"):
        load_config(None, ["--model.mtp_depth", "-1"])
    with pytest.raises(ConfigError, match="mtp_loss_weight_switch_step"):
        load_config(None, ["--training.mtp_loss_weight_final", "0.1"])
    with pytest.raises(ConfigError, match="training.mtp_loss_weight"):
        load_config(None, ["--training.mtp_loss_weight", "-0.3"])
    one = ParallelDims.resolve(ParallelSection(), 1)
    with pytest.raises(ConfigError, match="model.mtp_depth = 0"):
        check_mtp_layout(training_section(mtp_loss_weight=0.3), FLAVORS["debug"], one)
    with pytest.raises(ConfigError, match="training.seq_len"):
        check_mtp_layout(training_section(seq_len=2), mtp_config("debug", 2), one)
    # Tensor parallelism trains dense MTP models (tests/parallel/test_mtp_tensor_parallel.py);
    # a MoE config's MTP block is refused under TP with the rest of the MoE blocks.
    tp2 = ParallelDims.resolve(ParallelSection(tp=2, dp_shard=1), 2)
    check_mtp_layout(training_section(), mtp_config("debug", 2), tp2)
    with pytest.raises(ConfigError, match="'parallel.tp' = 2: tensor parallelism of mixture-of-experts"):
        tp2.check_model(mtp_config("moe-debug", 1))
    tp2pp2 = ParallelDims.resolve(ParallelSection(tp=2, pp=2, dp_shard=1), 4)
    with pytest.raises(ConfigError, match="parallel.tp = 2 and parallel.pp = 2"):
        check_mtp_layout(training_section(), mtp_config("debug", 1), tp2pp2)
    pp2 = ParallelDims.resolve(ParallelSection(pp=2, dp_shard=1), 2)
    check_mtp_layout(training_section(), mtp_config("debug", 2), pp2)  # the MTP modules run on the last stage
    # torch's split backward cannot run two depths sharing the embedding (pipeline.py); one depth runs.
    for schedule in ("zbv", "dualpipev"):
        with pytest.raises(ConfigError, match="parallel.pp_schedule"):
            check_pipeline_config(4, 2, schedule, 4, tie_embeddings=False,
                                  split_backward_refusal=split_backward_refusal(mtp_config("debug", 2)))
        check_pipeline_config(4, 2, schedule, 4, split_backward_refusal=split_backward_refusal(mtp_config("debug", 1)))


def _pipeline_stages(cfg, schedule: str = "1f1b"):
    """The full model and the stage modules of 2 pipeline ranks (rank 0's, then rank 1's)."""
    model = build_model(cfg, seed=0)
    return model, [m for rank in range(2) for m in split_model(model, rank, 2, None, schedule)]


def test_last_pipeline_stage_holds_the_mtp_modules_and_an_embedding_copy():
    cfg = dataclasses.replace(mtp_config("debug"), n_layers=4)
    _, stages = _pipeline_stages(cfg)
    names = [{n for n, _ in s.named_parameters()} for s in stages]
    assert "tok_embeddings.weight" in names[0] and "tok_embeddings.weight" in names[1]  # same FQN
    assert not any(n.startswith("mtp.") for n in names[0]) and {"mtp.1.proj.weight", "output.weight"} <= names[1]
    assert torch.equal(stages[0].tok_embeddings.weight, stages[1].tok_embeddings.weight)
    # V schedule (one depth: check_pipeline_config): rank 0's stages 0 and 3, then rank 1's 1 and 2
    _, v = _pipeline_stages(dataclasses.replace(cfg, mtp_depth=1), "zbv")
    assert [len(s.mtp) for s in v] == [0, 1, 0, 0] and v[0].layers.keys() == {"0"} and v[1].layers.keys() == {"3"}


@pytest.mark.parametrize("flavor", ["debug", "moe-debug"])
def test_last_stage_loss_from_the_targets_equals_the_unpipelined_loss(flavor):
    """The last stage rebuilds the input tokens from the targets (tokens_from_targets):
    its MTP loss and every gradient equal the unpipelined model's."""
    cfg = dataclasses.replace(mtp_config(flavor), n_layers=4)
    model, (first, last) = _pipeline_stages(cfg)
    full = torch.randint(0, cfg.vocab_size, (3, 18))
    x, y = full[:, :-1], full[:, 1:]
    want = MTPLoss(2, training_section())
    want_total = want(model, model, x, y)
    got = MTPLoss(2, training_section())
    got.bind_stage(last, 1)
    h = first(x)  # (B, T, dim) hidden states
    logits, h_last = last(h, return_hidden=True)
    got_total = got.stage_loss((logits, h_last), y)
    torch.testing.assert_close(got_total, want_total, rtol=1e-6, atol=0)
    torch.testing.assert_close(got._step_losses[-1], want._step_losses[-1], rtol=1e-6, atol=0)
    want_total.backward()
    got_total.backward()
    ref = dict(model.named_parameters())
    for stage in (first, last):
        for name, p in stage.named_parameters():
            if name != "tok_embeddings.weight":
                torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    # the embedding's gradient is the sum of its two copies' (what shared_embedding.py forms)
    torch.testing.assert_close(first.tok_embeddings.weight.grad + last.tok_embeddings.weight.grad,
                               ref["tok_embeddings.weight"].grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("flavor", ["debug", "moe-debug"])
def test_split_backward_of_the_last_stage_with_one_mtp_depth_equals_the_full_backward(flavor):
    """zbv / dualpipev run the last stage's backward as torch's input and weight passes:
    with one MTP depth they give every parameter the full backward's gradient."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    cfg = dataclasses.replace(mtp_config(flavor, 1), n_layers=4)
    _, stages = _pipeline_stages(cfg, "zbv")
    last = stages[1]  # rank 0's second stage module is the pipeline's last stage
    loss_fn = MTPLoss(1, training_section())
    loss_fn.bind_stage(last, 1)
    torch.manual_seed(0)
    h = torch.randn(2, 16, cfg.dim, requires_grad=True)
    y = torch.randint(0, cfg.vocab_size, (2, 16))

    def grads(split: bool) -> dict[str, torch.Tensor]:
        last.zero_grad(set_to_none=True)
        loss = loss_fn.stage_loss(last(h, return_hidden=True), y)
        if split:
            _, groups = stage_backward_input([loss], None, [h], last.parameters())
            stage_backward_weight(last.parameters(), groups)
        else:
            loss.backward()
        return {n: p.grad.clone() for n, p in last.named_parameters()}

    want, got = grads(False), grads(True)
    assert got.keys() == want.keys() and "tok_embeddings.weight" in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


MTP_DP = ["--model.flavor", "moe-debug", "--model.mtp_depth", "2"]
MTP_DP_LAYOUTS = {"ddp2": ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1"],
                  "fsdp2-ep2": ["--parallel.dp_shard", "-1", "--parallel.ep", "2"]}  # plain FSDP2 also passes


@pytest.fixture(scope="module")
def mtp_runs(tmp_path_factory, small_data):
    """The 2-process runs in ONE torchrun launch (tests/parallel/workers/cli_many.py: one
    after another through the real CLI): both data-parallel layouts, then the pp2 run with
    each rank saving its embedding copies at the end; then, in one plain process, the
    single-process reference and the pp2 run's step-3 checkpoint resumed at pp 1. Returns
    (root: run directories by name, name -> CompletedProcess)."""
    from tests.parallel.test_data_parallel import COMMON, GLOBAL_BATCH
    from tests.parallel.torchrun import Prepared, resumed, run_train_many
    from tests.parallel.workers.pp_embedding_copies import save_embeddings_at_close

    root = tmp_path_factory.mktemp("mtp_runs")
    runs = {name: ["--run_dir", str(root / name), "--data.path", str(small_data), *COMMON,
                   "--training.batch_size", str(GLOBAL_BATCH // 2), *MTP_DP, *layout]
            for name, layout in MTP_DP_LAYOUTS.items()}
    # Last: the embedding patch holds for the rest of the launch.
    runs["pp2"] = Prepared(["--run_dir", str(root / "pp2"), "--data.path", str(small_data), *COMMON,
                            *pipelined_mtp_args(2)], save_embeddings_at_close, every_rank=True)
    done = run_train_many(2, runs)
    done |= run_train_many(1, {
        "reference": ["--run_dir", str(root / "reference"), "--data.path", str(small_data), *COMMON,
                      "--training.batch_size", str(GLOBAL_BATCH), *MTP_DP],
        "pp2-at-1": resumed(root / "pp2", root / "pp2-at-1", 3, "--parallel.pp", "1", "--parallel.dp_shard", "1")})
    return root, done


@pytest.fixture(scope="module")
def mtp_reference(mtp_runs):
    from tests.parallel.torchrun import completed_run

    return completed_run(*mtp_runs, "reference")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(MTP_DP_LAYOUTS))  # CI time: plain FSDP2 not repeated
def test_data_parallel_mtp_matches_single_process(mtp_runs, mtp_reference, layout):
    """A MoE model with 2 MTP depths on 2 processes (gloo) against 1 at the same global
    batch: losses within 1e-4 over 6 steps, the MTP losses too, every weight within 1e-5
    (with expert parallelism the MTP block's experts are split like the others)."""
    from tests.parallel.test_data_parallel import assert_same_training

    root, done = mtp_runs
    assert done[layout].returncode == 0
    got = root / layout
    assert_same_training(got, mtp_reference)
    assert_same_records(got, mtp_reference, ("mtp_loss_2",))


def assert_same_records(run_dir, ref_dir, keys: tuple[str, ...]) -> None:
    """Each of ``keys`` in every record holding it (6 steps, or validations) within the
    parity tests' 1e-4 relative of the reference run's."""
    from tests.parallel.test_data_parallel import LOSS_RTOL

    for key in keys:
        pick = lambda d: [r[key] for r in read_jsonl(d / "metrics.jsonl") if key in r]  # noqa: E731
        got, want = pick(run_dir), pick(ref_dir)
        assert len(got) == (3 if key.startswith("val_") else 6), key
        torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0, msg=key)


PP_MTP_KEYS = ("mtp_loss_1", "mtp_loss_2", "grad_norm", "val_loss", "val_mtp_loss_1")


def pipelined_mtp_args(nproc: int) -> list[str]:
    """The MTP model on 2 pipeline stages (1F1B, 2 microbatches) x nproc / 2 FSDP2 ranks, at
    the reference's global batch."""
    from tests.parallel.test_data_parallel import GLOBAL_BATCH

    return ["--training.batch_size", str(GLOBAL_BATCH * 2 // nproc), *MTP_DP, "--parallel.pp", "2",
            "--parallel.pp_schedule", "1f1b", "--parallel.microbatches", "2", "--parallel.dp_shard", str(nproc // 2),
            "--checkpoint.keep_last", "5"]


def pipelined_mtp_run(run_dir, small_data, nproc: int):
    """``trainforge train`` with ``pipelined_mtp_args(nproc)``; each rank saves its embedding
    copies at the end (workers/pp_embedding_copies.py)."""
    from tests.parallel.test_data_parallel import run, train_cmd
    from tests.parallel.torchrun import WORKERS, with_worker

    cmd = train_cmd(nproc, run_dir, small_data, *pipelined_mtp_args(nproc))
    run(with_worker(cmd, WORKERS / "pp_embedding_copies.py"))
    return run_dir


@pytest.fixture(scope="module")
def mtp_pp2(mtp_runs):
    root, done = mtp_runs
    assert done["pp2"].returncode == 0, done["pp2"].stderr[-3000:]
    return root / "pp2"


def assert_pipelined_mtp_matches(run_dir, ref_dir, nproc: int) -> None:
    from tests.parallel.test_data_parallel import assert_same_training

    assert_same_training(run_dir, ref_dir)
    assert_same_records(run_dir, ref_dir, PP_MTP_KEYS)
    # The first and the last stage's embedding copies got the same updates: identical bits.
    copies = [t for r in range(nproc) for t in torch.load(run_dir / f"embedding_rank{r}.pt")]
    assert len(copies) == nproc and all(torch.equal(c, copies[0]) for c in copies)


@pytest.mark.slow
def test_pipelined_mtp_matches_single_process(mtp_pp2, mtp_reference):
    """pp2 (1F1B), the MTP modules on the last stage: losses, the MTP losses, grad_norm
    (the embedding counted once) and val_loss within 1e-4 of one process over 6 steps,
    every weight within 1e-5; the two embedding copies identical."""
    assert_pipelined_mtp_matches(mtp_pp2, mtp_reference, 2)


@pytest.mark.slow
def test_pipelined_mtp_with_fsdp2_matches_single_process(tmp_path, small_data, mtp_reference):
    """pp2 x FSDP2 over 2 (4 processes): the embedding copies' gradients are summed shard by shard."""
    assert_pipelined_mtp_matches(pipelined_mtp_run(tmp_path / "run", small_data, 4), mtp_reference, 4)


@pytest.mark.slow
def test_pipelined_mtp_checkpoint_resumes_in_one_process(mtp_runs, mtp_pp2, mtp_reference):
    """The pp2 run's step-3 checkpoint (DCP; the embedding under one FQN on both pipeline
    ranks) resumes at pp1 and continues as the single-process run."""
    from tests.parallel.test_data_parallel import assert_same_training

    root, done = mtp_runs
    assert done["pp2-at-1"].returncode == 0, done["pp2-at-1"].stderr[-3000:]
    resumed = root / "pp2-at-1"
    assert "step_0000003" in done["pp2-at-1"].stderr  # it resumed, from step 3
    assert_same_training(resumed, mtp_reference)
    assert_same_records(resumed, mtp_reference, PP_MTP_KEYS)