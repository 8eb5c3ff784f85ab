"""The preflight (model/preflight.py): shape validation naming the user's key, and the memory
estimate that refuses a run no machine could hold while letting the usual runs through.
In-process and fast; the CLI paths are in tests/faults/test_bad_input.py."""

from __future__ import annotations

import dataclasses
import os

import pytest

from trainforge.config import load_config
from trainforge.errors import CheckpointError, ConfigError
from trainforge.model import FLAVORS, build_model, model_config_from_section
from trainforge.model.hf import model_config_from_hf, to_hf_config_dict
from trainforge.model.preflight import (GiB, MAX_POSITIONS, available_bytes, check_inference, check_training,
                                        check_writable_dir, rotary_bytes, training_estimate)

DEBUG = dataclasses.replace(FLAVORS["debug"], max_seq_len=64)


@pytest.mark.parametrize("override, key", [
    ({"n_heads": 0}, "model.n_heads"),
    ({"n_kv_heads": 0}, "model.n_kv_heads"),
    ({"dim": 0}, "model.dim"),
    ({"n_layers": 0}, "model.n_layers"),
    ({"n_heads": 3}, "model.dim"),  # 64 % 3
    ({"n_kv_heads": 3}, "model.n_heads"),  # 4 % 3
])
def test_train_shape_errors_name_the_model_key(override, key):
    section = load_config(None, ["--model.flavor", "debug"]).model
    section = dataclasses.replace(section, **override)  # bypass the section's own > 0 check
    with pytest.raises(ConfigError, match=f"'{key}'"):
        model_config_from_section(section, 512, 64)


@pytest.mark.parametrize("key, value", [("num_attention_heads", 0), ("num_key_value_heads", 0),
                                        ("hidden_size", 0), ("vocab_size", -1), ("num_hidden_layers", "2"),
                                        ("max_position_embeddings", 10**12)])
def test_hf_shape_errors_name_the_config_json_key(key, value):
    d = {**to_hf_config_dict(DEBUG), key: value}
    d.pop("head_dim")  # checked against hidden_size / heads only after the shape is valid
    with pytest.raises(CheckpointError, match=f"config.json key '{key}' = {value!r}"):
        model_config_from_hf(d)


def test_huge_positions_message_sizes_the_rotary_tables():
    d = {**to_hf_config_dict(DEBUG), "max_position_embeddings": MAX_POSITIONS + 1}
    with pytest.raises(CheckpointError, match=r"rotary tables alone would need ~472.0 GiB"):  # 14 B x 2^31 x 16
        model_config_from_hf(d)


def test_estimate_terms_follow_the_documented_formulas():
    cfg = DEBUG
    est = training_estimate(cfg, batch_size=8, seq_len=64)
    assert est.parts["rotary tables"] == rotary_bytes(cfg.head_dim, 64) == 14 * 64 * 16 + 12 * 64
    assert est.parts["weights + grads + AdamW"] == 16 * cfg.num_params()
    per_token = 4 * cfg.n_layers * (20 * cfg.dim + 6 * cfg.ffn_hidden_dim)
    assert est.parts["activations"] == 8 * 64 * per_token
    assert est.parts["logits"] == 12 * 8 * 64 * cfg.vocab_size
    # Linear in batch x seq_len; cut by checkpointing, tp, a loss chunk and pipeline stages.
    assert training_estimate(cfg, 16, 64).parts["activations"] == 2 * est.parts["activations"]
    assert training_estimate(cfg, 8, 64, activation_checkpointing=True).parts["activations"] < \
        est.parts["activations"]
    assert training_estimate(cfg, 8, 64, tp=2).parts["activations"] == est.parts["activations"] // 2
    assert training_estimate(cfg, 8, 64, loss_chunk_tokens=64).parts["logits"] == est.parts["logits"] // 8
    assert training_estimate(cfg, 8, 64, layer_shards=2).parts["activations"] == est.parts["activations"] // 2
    # Sharded state, but never below the full fp32 model every rank builds first.
    assert training_estimate(cfg, 8, 64, state_shards=2).parts["weights + grads + AdamW"] == 8 * cfg.num_params()
    assert training_estimate(cfg, 8, 64, state_shards=64).parts["weights + grads + AdamW"] == 4 * cfg.num_params()


def test_impossible_seq_len_is_refused_naming_key_and_estimate():
    cfg = dataclasses.replace(DEBUG, max_seq_len=100_000_000)
    with pytest.raises(ConfigError) as e:
        check_training(cfg, "debug", 8, 100_000_000, "cpu", available=(64 * GiB, "test"))
    msg = str(e.value)
    assert msg.startswith("training.seq_len = 100000000: the run needs ~"), msg
    for part in ("TiB", "rotary tables", "activations", "64.0 GiB available", "lower training.seq_len"):
        assert part in msg, msg
    assert "\n" not in msg


def test_usual_runs_pass_on_this_machine():
    # make run (tiny at its defaults) and the tests' debug runs fit on any machine that runs the suite.
    tiny = dataclasses.replace(FLAVORS["tiny"], max_seq_len=2048)
    est = check_training(tiny, "tiny", 8, 256, "cpu")
    assert est.total < 2 * GiB
    check_training(DEBUG, "debug", 8, 64, "cpu")


def test_a_model_too_large_for_memory_blames_the_flavor():
    with pytest.raises(ConfigError, match=r"^model.flavor = 'llama-8b' \(8,030M parameters\).*smaller model.flavor"):
        check_training(FLAVORS["llama-8b"], "llama-8b", 1, 128, "cpu", available=(16 * GiB, "test"))


def test_big_flavors_still_build_on_meta():
    # The preflight guards real allocations only: the planner's meta builds are untouched.
    for name in ("llama-8b",):  # 16 x 8B bytes of training state: far more than any CPU host here
        model = build_model(FLAVORS[name], device="meta")
        assert next(model.parameters()).is_meta


def test_inference_blames_the_kv_pool_or_the_positions():
    cfg = dataclasses.replace(FLAVORS["llama-1b"], max_seq_len=131072)
    # 8 full 128k contexts of fp16 KV: 32 GiB.
    with pytest.raises(CheckpointError, match=r"^hf: a KV pool of 1048576 token slots.*--max_context"):
        check_inference(cfg, "cpu", 2, 8 * 131072, 2, positions_key="config.json key 'max_position_embeddings'",
                        where="hf", available=(20 * GiB, "test"), error=CheckpointError)
    huge = dataclasses.replace(cfg, max_seq_len=2**30)
    with pytest.raises(CheckpointError, match=r"^hf: config.json key 'max_position_embeddings' = 1073741824"):
        check_inference(huge, "cpu", 2, 0, 2, positions_key="config.json key 'max_position_embeddings'",
                        where="hf", available=(64 * GiB, "test"), error=CheckpointError)
    # Quantised weights count at their own width.
    q = check_inference(cfg, "cpu", 4, 0, 4, positions_key="k", where="w", quantized_bytes=1.0, available=None)
    f = check_inference(cfg, "cpu", 4, 0, 4, positions_key="k", where="w", available=None)
    assert q.parts["weights"] < f.parts["weights"] / 2


def test_available_memory_is_probed():
    got = available_bytes("cpu")
    assert got is not None and 0 < got[0] <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert available_bytes("meta") is None  # nothing to refuse on the meta device


def test_writable_probe_leaves_nothing(tmp_path):
    check_writable_dir(tmp_path / "new" / "run", "run directory")  # probes tmp_path, creates nothing
    assert list(tmp_path.iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="run directory .*file/run is not writable"):
        check_writable_dir(blocker / "run", "run directory")
