"""Loading for inference: trainforge checkpoints and Hugging Face directories (sharded,
tied), built on the meta device with no init and materialised by assignment; pickle
formats are refused."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.infer.helpers import model_for
from trainforge.errors import CheckpointError
from trainforge.infer.loading import load_model
from trainforge.model import ModelConfig, build_model
from trainforge.model.hf import to_hf_config_dict, to_hf_state_dict
from trainforge.model.llama import Transformer
from trainforge.train import checkpoint as ckpt


def write_hf_dir(path, model, shards: int = 1):
    cfg = model.cfg
    sd = {k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), cfg).items()}
    if cfg.tie_embeddings:
        del sd["lm_head.weight"]  # as save_pretrained writes a tied model
    path.mkdir()
    keys = sorted(sd)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k] for k in keys[i::shards]}, str(path / name))
        weight_map.update({k: name for k in keys[i::shards]})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({**to_hf_config_dict(cfg), "eos_token_id": 2}))
    return path


def test_trainforge_checkpoint_loads_without_init(trained_run, monkeypatch):
    ck = ckpt.resolve_checkpoint(trained_run)
    meta = ckpt.read_meta(ck)
    ref = Transformer(ModelConfig(**meta["model_config"]))
    ckpt.load_model_weights(ck, ref)

    def no_init(*a, **k):
        raise AssertionError("weights were initialised before loading")
    monkeypatch.setattr(Transformer, "init_weights", no_init)
    loaded = load_model(trained_run)
    model = loaded.model
    assert loaded.source == "trainforge" and loaded.tokenizer is not None and len(loaded.eos_ids) == 1
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    x = torch.randint(0, model.cfg.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=0, rtol=0)
    assert load_model(trained_run, dtype="bfloat16").model.layers["0"].attention.wq.weight.dtype == torch.bfloat16


def test_a_load_for_a_kv_pool_keeps_rope_rows_for_the_pool_only(trained_run):
    """``kv_slots``: no sequence in the caller's pool reaches a later position, so the tables stop
    there (``_materialise``); the model's outputs on those positions are the full load's."""
    full = load_model(trained_run).model
    cut = load_model(trained_run, kv_slots=lambda cfg: 24).model
    assert full.rope_cos.shape[0] == full.cfg.max_seq_len > 24 and cut.rope_cos.shape[0] == 24
    x = torch.randint(0, full.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(cut(x), full(x), atol=0, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_directory_loads_and_matches_transformers(tmp_path, tied):
    if tied:
        cfg = ModelConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128,
                          max_seq_len=64, tie_embeddings=True)
        model = build_model(cfg, seed=1)
    else:
        model = model_for("gqa4")
    path = write_hf_dir(tmp_path / "hf", model, shards=2)
    loaded = load_model(path)
    assert loaded.source == "huggingface" and loaded.eos_ids == (2,) and loaded.tokenizer is None
    ours = loaded.model
    if tied:
        assert ours.output.weight is ours.tok_embeddings.weight
    hf = transformers.LlamaForCausalLM.from_pretrained(str(path)).eval()
    x = torch.randint(0, model.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(input_ids=x).logits, atol=1e-5, rtol=1e-5)


def test_pickle_formats_are_refused(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(to_hf_config_dict(model_for("gqa2").cfg)))
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle formats are not loaded"):
        load_model(d)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "missing")
