"""``model.init_from``: fine-tune from a Hugging Face Llama directory or a trainforge
checkpoint, then export and load the result in transformers (README "Fine-tune from
published weights"). The HF model is made here (random init, save_pretrained): nothing is
downloaded."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from tests.conftest import DEBUG_TRAIN
from trainforge.config import load_config
from trainforge.data.prepare import PrepareOptions, prepare
from trainforge.errors import CheckpointError, ConfigError
from trainforge.infer.hf_export import export_hf
from trainforge.model.config import FLAVORS
from trainforge.storage.manifest import sha256_file
from trainforge.train import checkpoint as ckpt
from trainforge.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

ATOL = 1e-5  # fp32 parity with transformers (measured max difference ~1e-6)
STEPS = 8
# DEBUG_TRAIN without its flavor: with init_from the shape comes from the directory.
BASE = [a for a in DEBUG_TRAIN if a not in ("--model.flavor", "debug")] + ["--training.threads", "1"]
DEBUG = FLAVORS["debug"]
PADDED_VOCAB = 520  # embedding rows above the tokenizer's 512, as published checkpoints pad them


def _config(data: Path | None, init_from: Path, *extra: str):
    data_args = ["--data.path", str(data)] if data is not None else []
    return load_config(None, [*BASE, *data_args, "--model.init_from", str(init_from), *extra])


def _hf_logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits


def _hf_val_loss(model, val_set) -> float:
    """The trainer's validation loss (mean of per-batch mean cross-entropy) computed by transformers."""
    losses = [F.cross_entropy(_hf_logits(model, x).flatten(0, 1).float(), y.flatten()) for x, y in val_set]
    return torch.stack(losses).mean().item()


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory, small_data) -> tuple[Path, object]:
    """A random LlamaForCausalLM of the debug flavor's shape, saved sharded (index.json), with
    small_data's tokenizer.json (512 tokens) and a padded embedding."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=PADDED_VOCAB, hidden_size=DEBUG.dim, intermediate_size=DEBUG.ffn_hidden_dim,
        num_hidden_layers=DEBUG.n_layers, num_attention_heads=DEBUG.n_heads, num_key_value_heads=DEBUG.n_kv_heads,
        max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(out, max_shard_size="100KB")
    # Same tokenizer, other bytes (compact JSON), as a published file differs from prepare's re-save.
    (out / "tokenizer.json").write_text(json.dumps(json.loads((small_data / "tokenizer.json").read_text())))
    assert sha256_file(out / "tokenizer.json") != sha256_file(small_data / "tokenizer.json")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 1
    return out, model


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, small_data, hf_llama):
    """A run from ``hf_llama``: what the trainer saw at step 0, then the fit's summary."""
    hf_dir, hf_model = hf_llama
    run_dir = tmp_path_factory.mktemp("ft") / "run"
    t = Trainer(_config(small_data, hf_dir, "--training.steps", str(STEPS), "--training.lr", "3e-3"),
                run_dir, progress=False)
    try:
        x = t.val_set[0][0]
        with torch.no_grad():
            step0 = dict(model_config=t.model_config, ours=t.raw_model(x), theirs=_hf_logits(hf_model, x),
                         hf_val_loss=_hf_val_loss(hf_model, t.val_set), opt_state=len(t.optimizer.state),
                         sched_epoch=t.scheduler.last_epoch, step=t.step)
        summary = t.fit()
        final = t.raw_model
    finally:
        t.close()
    return run_dir, step0, summary, final


def test_hf_init_starts_at_the_hf_model(finetuned):
    _, step0, summary, _ = finetuned
    torch.testing.assert_close(step0["ours"], step0["theirs"], atol=ATOL, rtol=0)
    assert summary["first_val_loss"] == pytest.approx(step0["hf_val_loss"], abs=ATOL)
    # Only the weights: a fresh optimizer, schedule and step.
    assert (step0["step"], step0["opt_state"], step0["sched_epoch"]) == (0, 0, 0)


def test_hf_init_shape_is_derived_from_the_directory(finetuned):
    """No shape key and the default flavor (tiny: dim 256, vocab 8192): the directory's shape, padded vocab kept."""
    cfg = finetuned[1]["model_config"]
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden_dim, cfg.vocab_size) == \
        (DEBUG.dim, DEBUG.n_layers, DEBUG.n_heads, DEBUG.n_kv_heads, DEBUG.ffn_hidden_dim, PADDED_VOCAB)
    assert cfg != FLAVORS["tiny"]


def test_fine_tune_lowers_the_loss(finetuned):
    _, _, summary, _ = finetuned
    assert summary["step"] == STEPS
    # A random init at ln(520) ~ 6.25; 8 steps at lr 3e-3 bring it to ~5.81 (measured).
    assert summary["final_val_loss"] < summary["first_val_loss"] - 0.3


def test_export_of_the_fine_tuned_run_loads_in_transformers(finetuned, small_data, tmp_path):
    run_dir, _, _, final = finetuned
    out = export_hf(run_dir, tmp_path / "export")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == PADDED_VOCAB
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(theirs, x), final(x), atol=ATOL, rtol=0)
    # The tokenizer travelled with the weights: the exported one tokenises as the source's.
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(small_data / "tokenizer.json"))
    text = "def f(x):\n    return x + 1\n"
    assert tok(text)["input_ids"] == ref(text)["input_ids"]


def test_init_from_trainforge_checkpoint_takes_weights_only(finetuned, small_data, tmp_path):
    run_dir, _, _, _ = finetuned
    ck = ckpt.list_checkpoints(run_dir / "checkpoints")[-1]
    want = ckpt.load_full_weights(ck, tie_embeddings=False)
    t = Trainer(_config(small_data, run_dir, "--training.steps", "2"), tmp_path / "run", progress=False)
    try:
        got = t.raw_model.state_dict()
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want)
        # The source run ended at step 8 with optimizer moments; none of that comes along.
        assert (t.step, len(t.optimizer.state), t.scheduler.last_epoch) == (0, 0, 0)
        assert t.optimizer.param_groups[0]["lr"] < t.cfg.training.lr  # the warmup starts again
    finally:
        t.close()


def _refused(cfg, run_dir: Path, error: type[Exception], *needles: str) -> str:
    with pytest.raises(error) as info:
        Trainer(cfg, run_dir, progress=False)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, msg
    assert not run_dir.exists()  # refused before the run directory is touched
    return msg


def test_shape_conflict_names_each_key(hf_llama, small_data, tmp_path):
    hf_dir, _ = hf_llama
    _refused(_config(small_data, hf_dir, "--model.dim", "128", "--model.n_layers", "3"), tmp_path / "run",
             ConfigError, "model.dim = 128 but", "'hidden_size' 64", "model.n_layers = 3 but",
             "'num_hidden_layers' 2")
    # An explicit flavor is compared too; the flavor of this shape is accepted.
    _refused(_config(small_data, hf_dir, "--model.flavor", "small"), tmp_path / "run", ConfigError,
             "model.flavor = 'small' has dim = 768 but")
    t = Trainer(_config(small_data, hf_dir, "--model.flavor", "debug"), tmp_path / "ok", progress=False)
    t.close()


def test_shape_conflict_with_a_moe_directory_names_its_config_json_keys(small_data, tmp_path):
    """A Glm4Moe directory's keys, not Llama's: the expert width is 'moe_intermediate_size'."""
    import dataclasses

    from trainforge.infer.hf_export import save_hf_dir
    from trainforge.model.llama import build_model

    cfg = dataclasses.replace(FLAVORS["moe-debug"], max_seq_len=128)
    hf_dir = save_hf_dir(tmp_path / "glm", build_model(cfg, seed=0).state_dict(), cfg,
                         tokenizer_path=small_data / "tokenizer.json")
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "glm4_moe"
    _refused(_config(small_data, hf_dir, "--model.moe_inter_dim", "16", "--model.n_activated_experts", "3"),
             tmp_path / "run", ConfigError, "model.moe_inter_dim = 16 but", "'moe_intermediate_size' 32",
             "model.n_activated_experts = 3 but", "'num_experts_per_tok' 2")


def test_missing_directory_is_refused_at_config_load(tmp_path):
    with pytest.raises(ConfigError, match="model.init_from"):
        _config(None, tmp_path / "nope")


def test_unsupported_family_and_damaged_weights_name_the_file(hf_llama, small_data, tmp_path):
    hf_dir, _ = hf_llama
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(hf_dir, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    _refused(_config(small_data, gpt2), tmp_path / "run", CheckpointError, "model_type", "gpt2", "Llama")

    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    shard = sorted(broken.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    _refused(_config(small_data, broken), tmp_path / "run", CheckpointError, str(shard))


def test_data_with_another_tokenizer_is_refused(hf_llama, tmp_path):
    hf_dir, _ = hf_llama
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    other = prepare([str(stdlib / "textwrap.py"), str(stdlib / "shutil.py")], tmp_path / "other",
                    PrepareOptions(vocab_size=300, val_fraction=0.1), log=lambda *_: None)
    _refused(_config(other, hf_dir), tmp_path / "run", ConfigError, str(other / "tokenizer.json"),
             str(hf_dir / "tokenizer.json"), f"trainforge prepare --tokenizer {hf_dir / 'tokenizer.json'}")


def test_builtin_corpus_is_prepared_with_the_directorys_tokenizer(hf_llama, tmp_path, monkeypatch):
    """data.path unset: the built-in corpus is tokenised with init_from's tokenizer.json (two stdlib
    files stand in for the whole corpus, which takes ~30 s to tokenise)."""
    import trainforge.data.prepare as prep

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    monkeypatch.setattr(prep, "default_corpus_files", lambda: [stdlib / "textwrap.py", stdlib / "shutil.py"])
    hf_dir, _ = hf_llama
    t = Trainer(_config(None, hf_dir, "--data.cache_dir", str(tmp_path / "cache")), tmp_path / "run",
                progress=False)
    try:
        assert Path(t.data.path).parent == tmp_path / "cache" / "data"
        assert t.data.vocab_size == 512  # the directory's tokenizer, not a trained one of data.vocab_size 8192
        text = "import os\nprint(os.sep)\n"
        ids = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(text).ids
        assert Tokenizer.from_file(str(t.data.tokenizer_path)).encode(text).ids == ids
    finally:
        t.close()

    bare = tmp_path / "bare"
    shutil.copytree(hf_dir, bare)
    (bare / "tokenizer.json").unlink()
    _refused(_config(None, bare, "--data.cache_dir", str(tmp_path / "cache")), tmp_path / "run2", ConfigError,
             "has no tokenizer.json", "trainforge prepare --tokenizer")


@pytest.mark.slow
def test_init_from_under_fsdp2_matches_single_process(finetuned, hf_llama, small_data, tmp_path):
    """Two FSDP2 processes start from the same weights (loaded into the full model before it is
    sharded: DDP, TP and PP take the same path) and train as the single-process run did: same
    global batch, same validation losses. One layout only: CI's time budget is spent."""
    from tests.parallel.torchrun import torchrun_env
    from trainforge.monitor.jsonl import read_jsonl

    _, _, summary, _ = finetuned
    hf_dir, _ = hf_llama
    run_dir = tmp_path / "run"
    args = [a for a in BASE if a not in ("--training.batch_size", "8")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "trainforge",
           "train", "--run_dir", str(run_dir), "--data.path", str(small_data), *args, "--training.batch_size", "4",
           "--model.init_from", str(hf_dir), "--training.steps", str(STEPS), "--training.lr", "3e-3",
           "--parallel.dp_shard", "-1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=torchrun_env())
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    vals = {rec["step"]: rec["val_loss"] for rec in read_jsonl(run_dir / "metrics.jsonl") if "val_loss" in rec}
    assert vals[0] == pytest.approx(summary["first_val_loss"], abs=ATOL)
    assert vals[STEPS] == pytest.approx(summary["final_val_loss"], rel=1e-4)  # as tests/parallel's LOSS_RTOL


def test_resume_of_an_init_from_run_continues_its_own_checkpoint(finetuned, small_data, tmp_path):
    """--resume takes the run's checkpoint (step 8, trained weights), not init_from's weights."""
    run_dir, _, _, final = finetuned
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    hf_dir = Path(ckpt.read_meta(ckpt.list_checkpoints(copy / "checkpoints")[-1])["config"]["model"]["init_from"])
    t = Trainer(_config(small_data, hf_dir, "--training.steps", str(STEPS + 1), "--training.lr", "3e-3"), copy,
                resume=True, progress=False)
    try:
        assert t.step == STEPS and len(t.optimizer.state) > 0
        got, want = t.raw_model.state_dict(), final.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        t.close()
