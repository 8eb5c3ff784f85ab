"""The hourglass model (model/hourglass.py, model/hourglass_spec.py): causality for every
tested spec, parameter and FLOP counts, the [model] keys and their errors, MTP on an
hourglass trunk, the pipeline cut, and the refusal of caches other than the hourglass's
(decoding: tests/infer/test_hourglass_decode.py). Tiny shapes: seconds on CPU."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.conftest import debug_config, train_to
from trainforge.config import config_to_toml, load_config
from trainforge.errors import ConfigError
from trainforge.model import hourglass as hg
from trainforge.model.config import FLAVORS, ModelConfig, model_config_from_section
from trainforge.model.llama import build_model
from trainforge.monitor.jsonl import read_jsonl

DEBUG = FLAVORS["debug"]  # dim 64, 4 heads (head dim 16), 2 kv heads, ffn 176

# (spec, pool): one shortening at k = 2 and k = 3, narrower and not, both pools, an empty outer
# stage, and nested specs (k = 2 then 3; 2 then 2 with an empty intermediate stage).
SPECS = [
    ("1@1 2@2 1@1", "mean"),
    ("1@1 2@2/2 1@1", "linear"),
    ("1@1 1@3/2 2@1", "mean"),
    ("2@1 1@3 1@1", "linear"),
    ("0@1 2@2/2 1@1", "mean"),
    ("1@1 1@2 1@6/2 1@2 1@1", "mean"),
    ("1@1 1@2 1@6/2 1@2 1@1", "linear"),
    ("1@1 0@2 2@4/2 0@2 1@1", "linear"),
]


def hourglass_config(spec: str, pool: str = "mean", **kw) -> ModelConfig:
    n = sum(int(part.split("@")[0]) for part in spec.split())
    return dataclasses.replace(DEBUG, n_layers=n, hourglass=spec, hourglass_pool=pool, **kw)


def earliest_changed(model, tokens: torch.Tensor, t: int) -> torch.Tensor:
    """Per position, the largest logit change when token t is replaced."""
    other = tokens.clone()
    other[:, t] = (other[:, t] + 1 + torch.randint(0, 500, (1,))) % DEBUG.vocab_size
    with torch.no_grad():
        return (model(tokens) - model(other)).abs().amax(dim=(0, 2))  # (T,)


@pytest.mark.parametrize("T", [12, 13])  # 13: divisible by neither 2, 3, 4 nor 6
@pytest.mark.parametrize("spec, pool", SPECS)
def test_changing_a_token_never_changes_earlier_logits(spec, pool, T):
    torch.manual_seed(0)
    model = build_model(hourglass_config(spec, pool), seed=1)
    tokens = torch.randint(0, DEBUG.vocab_size, (2, T))
    for t in range(T):
        change = earliest_changed(model, tokens, t)
        if t:  # a leak moves a logit by > 1e-4 (the control below); identical inputs give ~0
            assert change[:t].max().item() < 1e-6, (spec, pool, t, change[:t])
        assert change[t:].max().item() > 1e-4, (spec, pool, t)  # the token does reach the logits


def test_the_causality_check_catches_a_missing_shift(monkeypatch):
    """Control: pooling the k positions without the k-1 shift leaks later tokens into earlier
    positions, and the check above sees it."""
    def unshifted(self, x):
        B, T, d = x.shape
        n = -(-T // self.k)
        x = torch.nn.functional.pad(x, (0, 0, 0, n * self.k - T))
        h = x.reshape(B, n, self.k, d).mean(dim=2)
        return self.proj(h) if self.proj is not None else h

    monkeypatch.setattr(hg.Shortening, "forward", unshifted)
    torch.manual_seed(0)
    model = build_model(hourglass_config("1@1 2@2 1@1"), seed=1)
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 8))
    assert earliest_changed(model, tokens, 5)[4].item() > 1e-4  # position 4 saw token 5


def test_shortening_and_upsampling_follow_the_paper():
    """Shift by k-1 then mean of k; upsampling repeats k times and adds the residual."""
    x = torch.arange(1.0, 8.0).view(1, 7, 1)  # positions 0..6 hold 1..7
    short = hg.Shortening(3, 1, 1, "mean")(x)
    # groups after the shift: [0, 0, 1], [2, 3, 4], [5, 6, 7]
    torch.testing.assert_close(short.flatten(), torch.tensor([1 / 3, 3.0, 6.0]))
    up = hg.Upsampling(3, 1, 1)(short, torch.zeros(1, 7, 1))
    torch.testing.assert_close(up.flatten(), torch.tensor([1 / 3] * 3 + [3.0] * 3 + [6.0]))


def test_shortened_blocks_run_at_their_width_and_rate():
    cfg = hourglass_config("1@1 1@2 1@6/2 1@2 1@1")
    model = build_model(cfg, seed=0)
    seen = {}
    for name, block in model.layers.items():
        block.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, tuple(out.shape)))
    model(torch.randint(0, 512, (2, 13)))
    # 13 tokens -> ceil(13/2) = 7 -> ceil(7/3) = 3 at width 64/2
    assert seen == {"0": (2, 13, 64), "1": (2, 7, 64), "2": (2, 3, 32), "3": (2, 7, 64), "4": (2, 13, 64)}


# -- counts --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, pool", SPECS)
def test_parameter_count_matches_the_built_model(spec, pool):
    cfg = hourglass_config(spec, pool)
    model = build_model(cfg, device="meta")
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


@pytest.mark.parametrize("flavor, dense", [("hourglass-tiny", "tiny"), ("hourglass-small", "small")])
def test_flavors_have_about_the_dense_parameters_and_fewer_flops(flavor, dense):
    hg_cfg, d_cfg = FLAVORS[flavor], FLAVORS[dense]
    model = build_model(hg_cfg, device="meta")
    assert sum(p.numel() for p in model.parameters()) == hg_cfg.num_params()
    assert abs(hg_cfg.num_params() / d_cfg.num_params() - 1) < 0.10
    assert hg_cfg.flops_per_token(1024) < 0.85 * d_cfg.flops_per_token(1024)


def test_flops_are_counted_per_stage():
    """A block at shortening k is a dense block over T/k positions, counted 1/k per token;
    the parts add up to flops_per_token; a dense config is unchanged."""
    cfg = hourglass_config("1@1 2@2 1@1")
    dense = dataclasses.replace(DEBUG, n_layers=4)
    T = 64
    assert cfg.block_flops_per_token(1, T) == pytest.approx(dense.block_flops_per_token(1, T // 2) / 2)
    assert cfg.block_flops_per_token(0, T) == pytest.approx(dense.block_flops_per_token(0, T))
    parts = cfg.hourglass_flops_per_token(T)
    assert sum(parts.values()) == pytest.approx(cfg.flops_per_token(T))
    assert cfg.flops_per_token(T) < dense.flops_per_token(T)
    per_block = sum(dense.block_flops_per_token(i, T) for i in range(4))
    head = dense.flops_per_token(T) - per_block
    assert head == pytest.approx(6.0 * (DEBUG.vocab_size * DEBUG.dim + DEBUG.dim))
    narrow = hourglass_config("1@1 2@2/2 1@1", "linear")
    # width 32: the pool (2·64 -> 32) and the up-projection (32 -> 64) run once per shortened position
    parts = narrow.hourglass_flops_per_token(T)
    assert parts["shorten to 1/2"] == pytest.approx(6.0 * 2 * 64 * 32 / 2)
    assert parts["upsample to 1/1"] == pytest.approx(6.0 * 32 * 64 / 2)
    assert "stage 1: 2@2/2" in narrow.describe_flops(T)


def test_the_config_survives_a_checkpoints_json():
    cfg = FLAVORS["hourglass-small"]
    back = ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert back == cfg and hash(back) == hash(cfg)


# -- the [model] keys ----------------------------------------------------------------------

def resolve(*overrides: str) -> ModelConfig:
    cfg = load_config(None, list(overrides))
    return model_config_from_section(cfg.model, vocab_size=512)


def test_the_spec_is_a_toml_list_of_tables(tmp_path):
    toml = tmp_path / "hg.toml"
    toml.write_text('[model]\nflavor = "debug"\nn_layers = 5\nhourglass_pool = "linear"\nhourglass = [\n'
                    '  {blocks = 1}, {blocks = 1, shorten = 2}, {blocks = 1, shorten = 6, width_ratio = 2},\n'
                    '  {blocks = 1, shorten = 2}, {blocks = 1},\n]\n')
    cfg = load_config(toml)
    mc = model_config_from_section(cfg.model, vocab_size=512)
    assert (mc.hourglass, mc.hourglass_pool) == ("1@1 1@2 1@6/2 1@2 1@1", "linear")
    same = resolve("--model.flavor", "debug", "--model.n_layers", "5", "--model.hourglass_pool", "linear",
                   "--model.hourglass", "[{blocks=1}, {blocks=1, shorten=2}, {blocks=1, shorten=6, width_ratio=2}, "
                                        "{blocks=1, shorten=2}, {blocks=1}]")
    assert same == mc
    saved = tmp_path / "config.toml"  # the run's resolved config, which --resume reads back
    saved.write_text(config_to_toml(cfg))
    assert load_config(saved).model == cfg.model
    assert resolve("--model.flavor", "hourglass-tiny", "--model.hourglass", "[]").hourglass == ""
    # The command line also takes the compact text the flavors and the model summary print.
    assert resolve("--model.flavor", "debug", "--model.n_layers", "5", "--model.hourglass_pool", "linear",
                   "--model.hourglass", "1@1 1@2 1@6/2 1@2 1@1") == mc


@pytest.mark.parametrize("tables, words", [
    ("[{blocks=1}, {blocks=4, shorten=2}, {blocks=1}]", ["model.n_layers = 2", "add up to 2", "model.n_layers = 6"]),
    ("[{blocks=1}, {blocks=0, shorten=2}, {blocks=1}]", ["middle stage", "blocks >= 1"]),
    ("[{blocks=1}, {blocks=1, shorten=1}, {blocks=0}]", ["k >= 2"]),
    ("[{blocks=1}, {blocks=1, shorten=2}, {blocks=0, shorten=2}]", ["full rate"]),
    ("[{blocks=1}, {blocks=1, shorten=3, width_ratio=3}, {blocks=0}]", ["width_ratio 3", "model.n_heads = 4"]),
    ("[{blocks=1}, {blocks=1, shorten=2, width_ratio=16}, {blocks=0}]", ["even head dim"]),
    ("[{blocks=0}, {blocks=0, shorten=2}, {blocks=1, shorten=4}, {blocks=1, shorten=3}, {blocks=0}]",
     ["must mirror"]),
    ("[{blocks=1}, {blocks=1}]", ["odd number >= 3"]),
    ("[{blocks=1}, {blocks=1, k=2}, {blocks=0}]", ["model.hourglass[1]", "unknown keys ['k']"]),
    ("[{blocks=1}, {shorten=2}, {blocks=1}]", ["model.hourglass[1]", "no 'blocks'"]),
    ("[{blocks=1}, {blocks=1, shorten=true}, {blocks=0}]", ["model.hourglass[1].shorten"]),
    ("{blocks=1}", ["model.hourglass", "list of tables"]),
    ("2@1 4@x 2@1", ["model.hourglass", "'4@x' is not BLOCKS@SHORTEN", "list of tables"]),
    ("[2@1]", ["model.hourglass", "not a TOML list", "'2@1 4@2 2@1'"]),
])
def test_a_bad_spec_names_the_key_and_the_fix(tables, words):
    with pytest.raises(ConfigError) as e:
        resolve("--model.flavor", "debug", "--model.hourglass", tables)
    assert "model.hourglass" in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_hourglass_refuses_experts_and_latent_attention():
    with pytest.raises(ConfigError, match="dense model with standard attention"):
        resolve("--model.flavor", "moe-debug", "--model.hourglass", "[{blocks=1}, {blocks=1, shorten=2}, {blocks=1}]")
    with pytest.raises(ConfigError, match="model.hourglass_pool"):
        resolve("--model.flavor", "hourglass-tiny", "--model.hourglass_pool", "max")


def test_train_help_lists_the_keys(capsys):
    from trainforge.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--model.hourglass TOML hourglass stages in the order they run" in out
    assert "a TOML list of tables; default: none" in out
    assert "--model.hourglass_pool CHOICE" in out and "one of: mean, linear, none" in out
    assert "hourglass-tiny" in out


# -- heads, training, pipeline, inference ----------------------------------------------------

def test_mtp_heads_share_the_trunk_embedding_and_output():
    cfg = hourglass_config("1@1 2@2/2 1@1", mtp_depth=1)
    model = build_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    tokens = torch.randint(0, 512, (2, 11))
    logits, (depth1,) = model(tokens, mtp=True)
    assert logits.shape == (2, 11, 512) and depth1.shape == (2, 10, 512)
    torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)  # the MTP heads leave the trunk's alone
    (logits.sum() + depth1.sum()).backward()
    assert model.tok_embeddings.weight.grad is not None and model.mtp["0"].proj.weight.grad is not None
    assert model.hourglass.shorten["0"].proj.weight.grad.abs().sum() > 0


def test_training_an_hourglass_with_mtp_lowers_the_loss(tmp_path, small_data):
    """Through the real trainer (MTP loss component included). Measured over seeds 0-2
    (2026-12-02): val_loss 6.25 -> 5.35..5.44, the training loss (main + weighted MTP) down
    1.0..1.2 from its first 3 steps to its last 5, mtp_loss_1 down 0.8..0.9; the bounds are
    half the smallest of those drops."""
    cfg = debug_config(small_data, "--model.n_layers", "4", "--model.mtp_depth", "1", "--model.hourglass_pool",
                       "linear", "--model.hourglass", "[{blocks=1}, {blocks=2, shorten=2, width_ratio=2}, {blocks=1}]",
                       "--training.steps", "30", "--training.seq_len", "32", "--training.lr", "3e-3",
                       "--training.val_interval", "30")
    run = train_to(cfg, tmp_path / "run")
    records = read_jsonl(run / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(steps) == 30 and len(val) == 2

    def mean(key, rows):
        return sum(r[key] for r in rows) / len(rows)

    assert val[-1] < val[0] - 0.4, val
    assert mean("loss", steps[-5:]) < mean("loss", steps[:3]) - 0.5
    assert mean("mtp_loss_1", steps[-5:]) < mean("mtp_loss_1", steps[:3]) - 0.4


@pytest.mark.parametrize("starts, ok", [([0, 1], True), ([0, 5], True), ([0, 1, 5], True), ([0, 2], False),
                                        ([0, 1, 4], False)])
def test_pipeline_stages_hold_shortenings_whole(starts, ok):
    """Stages cut outside the shortened spans run the same math in sequence; a cut inside one
    is a ConfigError naming the keys."""
    from trainforge.parallel.pipeline import split_model

    cfg = hourglass_config("1@1 1@2 2@4/2 1@2 1@1")  # level spans: blocks [1, 5) and [2, 4)
    model = build_model(cfg, seed=0)
    if not ok:
        with pytest.raises(ConfigError) as e:
            split_model(model, 0, len(starts), starts, "gpipe")
        assert all(k in str(e.value) for k in ("parallel.pp_split", "parallel.pp", "model.hourglass", "only at 0 and [1, 5]"))
        return
    stages = [split_model(model, r, len(starts), starts, "gpipe")[0] for r in range(len(starts))]
    owned = [set(s.hourglass.shorten.keys()) for s in stages]
    assert set().union(*owned) == {"0", "1"} and sum(map(len, owned)) == 2  # each level on one stage
    tokens = torch.randint(0, 512, (2, 9))
    h = tokens
    with torch.no_grad():
        for s in stages:
            h = s(h)
        torch.testing.assert_close(h, model(tokens), rtol=1e-6, atol=1e-6)


def test_auto_pipeline_split_is_refused_for_an_hourglass():
    from trainforge.parallel.apply import check_pipeline_layout
    from trainforge.parallel.dims import ParallelDims

    cfg = load_config(None, ["--parallel.pp", "2"]).parallel
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=1, tp=1, world_size=2)
    with pytest.raises(ConfigError, match="parallel.pp_split.*model.hourglass"):
        check_pipeline_layout(FLAVORS["hourglass-tiny"], dims, cfg, batch_size=8)
    cfg.pp_split = "even"  # even: [0, 4], inside the span [1, 7)
    with pytest.raises(ConfigError, match="start stages only at 0 and \\[1, 7\\]"):
        check_pipeline_layout(FLAVORS["hourglass-tiny"], dims, cfg, batch_size=8)
    cfg.pp_split = "0,7"
    assert check_pipeline_layout(FLAVORS["hourglass-tiny"], dims, cfg, batch_size=8)[0] == 2


def test_a_cache_other_than_the_hourglass_cache_is_refused():
    from trainforge.model.attention_cache import StaticCache

    model = build_model(hourglass_config("1@1 2@2 1@1"), seed=0).eval()
    cache = StaticCache.for_model(model, batch_size=1, max_seq_len=16)  # a plain decode loop's cache
    with pytest.raises(ConfigError, match="model.hourglass.*HourglassCache.*not a StaticCache"):
        model(torch.tensor([[1, 2, 3]]), cache.advance(3), cache)


def test_trainforge_train_runs_hourglass_tiny(tmp_path, small_data):
    """The CLI end to end: the startup summary names the spec and FLOPs per stage, the
    post-training sample is decoded by the engine, and the checkpoint's model config (the
    spec's text through meta.json) is the one a resume accepts."""
    import subprocess
    import sys

    from trainforge.train import checkpoint as ckpt

    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "trainforge", "train", "--model.flavor", "hourglass-tiny",
                        "--training.steps", "2", "--data.path", str(small_data), "--run_dir", str(run_dir),
                        "--training.batch_size", "2", "--training.seq_len", "33", "--training.log_interval", "1",
                        "--training.val_interval", "2", "--training.val_batches", "1", "--training.threads", "1"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "hourglass 1@1 6@2 1@1, mean pool" in log and "stage 1: 6@2" in log, log[-3000:]
    assert "sample:" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
    assert [rec["step"] for rec in read_jsonl(run_dir / "metrics.jsonl") if "loss" in rec] == [1, 2]
    ck = run_dir / "checkpoints" / "step_0000002"
    meta = ckpt.read_meta(ck)
    cfg = dataclasses.replace(FLAVORS["hourglass-tiny"], vocab_size=512)
    assert ModelConfig(**meta["model_config"]) == cfg
    ckpt.check_model_compatible(meta, cfg, ck)  # what --resume runs


def test_hugging_face_export_refuses_an_hourglass(tmp_path):
    from trainforge.infer.hf_export import save_hf_dir

    model = build_model(hourglass_config("1@1 2@2/2 1@1"), seed=0)
    with pytest.raises(ConfigError, match="no Hugging Face layout"):
        save_hf_dir(tmp_path / "hf", model.state_dict(), model.cfg)
    assert not (tmp_path / "hf").exists()


def test_activation_checkpointing_keeps_the_math():
    from trainforge.parallel.activation_checkpoint import apply_activation_checkpointing

    cfg = hourglass_config("1@1 1@2 1@6/2 1@2 1@1", "linear")
    plain, wrapped = build_model(cfg, seed=0), build_model(cfg, seed=0)
    apply_activation_checkpointing(wrapped, "full")
    tokens = torch.randint(0, 512, (2, 13))
    for m in (plain, wrapped):
        m(tokens).square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
