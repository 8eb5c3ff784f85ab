"""Hostile Hugging Face directories are one line naming config.json (or the directory) and the
key, never a traceback: a config.json nested past Python's stack, a ``quantization_config`` of
the wrong shape, a query projection that does not fit the heads (main permuted its rotary rows
first: a reshape RuntimeError), values out of range that main loaded (a negative norm epsilon,
an end-of-sequence id outside the vocabulary)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import save_file

from tests.faults.test_hostile_gguf import assert_one_line, bounded as _bounded
from trainforge.infer.loading import load_model
from trainforge.model import FLAVORS, build_model
from trainforge.model import hf_deepseek
from trainforge.model.hf import to_hf_config_dict, to_hf_state_dict


def bounded(fn):
    """A traceback-or-one-line check, not a cost one: generous bounds (a shared 2-core CI machine)."""
    return _bounded(fn, seconds=120, max_mib=1024)


def write_hf(d: Path, sd: dict, config: dict) -> Path:
    d.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    cfg = FLAVORS["debug"]
    return write_hf(tmp_path_factory.mktemp("hf") / "llama", to_hf_state_dict(build_model(cfg, seed=0).state_dict(), cfg),
                    to_hf_config_dict(cfg))


def variant(src: Path, dst: Path, config_text: str | None = None, **changes) -> Path:
    shutil.copytree(src, dst)
    if config_text is None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(changes)
        config_text = json.dumps(cfg)
    (dst / "config.json").write_text(config_text)
    return dst


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000],
                         ids=["array", "object"])
def test_a_deeply_nested_config_json_is_one_line(llama_dir, tmp_path, text):
    d = variant(llama_dir, tmp_path / "m", config_text=text)
    assert_one_line(bounded(lambda: load_model(d)), d / "config.json")


QC = {"quant_method": "compressed-tensors", "format": "int-quantized"}


@pytest.mark.parametrize("qc,needle", [
    ({**QC, "config_groups": ["group_0"]}, "'config_groups' is ['group_0']"),
    ({**QC, "config_groups": {"group_0": "int8"}}, "'config_groups.group_0' is 'int8'"),
    ({**QC, "config_groups": {"group_0": {"weights": [8, "int"]}}}, "'config_groups.group_0'"),
], ids=["groups-list", "group-str", "weights-list"])
def test_a_bad_quantization_config_names_config_json_and_the_key(llama_dir, tmp_path, qc, needle):
    """main called .values() / .get() on them: AttributeError tracebacks."""
    d = variant(llama_dir, tmp_path / "m", quantization_config=qc)
    assert_one_line(bounded(lambda: load_model(d)), d / "config.json", "quantization_config", needle)


@pytest.mark.parametrize("key,value", [("rms_norm_eps", -1.0), ("eos_token_id", 2**40), ("eos_token_id", [2, -1])])
def test_values_out_of_range_are_refused(llama_dir, tmp_path, key, value):
    """main loaded both: NaN activations (a negative epsilon under the square root), an end id no
    token can ever have."""
    d = variant(llama_dir, tmp_path / "m", **{key: value})
    assert_one_line(bounded(lambda: load_model(d)), d, key)


def test_a_deepseek_query_projection_that_does_not_fit_the_heads_is_one_line(tmp_path):
    cfg = dataclasses.replace(FLAVORS["dsv3-debug"], mtp_depth=0)
    sd = hf_deepseek.to_hf_state_dict(build_model(cfg, seed=0).state_dict(), cfg)
    key = "model.layers.0.self_attn.q_b_proj.weight"
    sd[key] = sd[key][:-8]
    d = write_hf(tmp_path / "ds", sd, hf_deepseek.to_hf_config_dict(cfg))
    assert_one_line(bounded(lambda: load_model(d)), d, key, "(88, 32) != expected (96, 32)")


def test_the_untouched_directory_loads(llama_dir):
    assert load_model(llama_dir).model is not None
