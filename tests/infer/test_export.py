"""``trainforge export``: a checkpoint as a Hugging Face directory that transformers loads
offline with the same logits and tokenisation, in any dtype, sharded above a size; int8/int4
linear weights in the compressed-tensors format, which the ``compressed_tensors`` package
decompresses to exactly trainforge's dequantised weights and which ``generate`` loads back
as the same quantised model; every bad argument refused before anything is written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from trainforge.errors import CheckpointError
from trainforge.infer.hf_export import export
from trainforge.infer.loading import load_model
from trainforge.infer.quantize import QuantLinear, quantize_model
from trainforge.quant_formats import compressed_tensors as ctf
from trainforge.infer.quantize.int4 import dequantize_int4, quantize_int4
from trainforge.infer.quantize.int8 import dequantize_int8, quantize_int8
from trainforge.model.hf import key_map

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
TEXT = "The quick brown fox, said she, jumps over 12 lazy dogs.\nNew line\tand tab."


def _quant_layers(model) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


@pytest.fixture(scope="module")
def exports(trained_run, tmp_path_factory):
    """The trained debug run exported float (fp32, and bf16 in shards of ~100 KB), int8 and int4 (group 32)."""
    root = tmp_path_factory.mktemp("export")
    return {"fp32": export(trained_run, root / "fp32"),
            "bf16": export(trained_run, root / "bf16", dtype="bf16", max_shard_bytes=100_000),
            "int8": export(trained_run, root / "int8", quantize="int8"),
            "int4": export(trained_run, root / "int4", quantize="int4", group_size=32)}


def test_float_export_loads_in_transformers_with_same_logits_and_tokens(trained_run, exports):
    d = exports["fp32"].path
    assert {p.name for p in d.iterdir()} >= {"config.json", "generation_config.json", "model.safetensors",
                                             "tokenizer.json", "tokenizer_config.json"}
    ours = load_model(trained_run)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)  # transformers 5 calls it TokenizersBackend
    ids = ours.tokenizer.encode(TEXT).ids
    assert tok(TEXT)["input_ids"] == ids and tok.decode(ids) == ours.tokenizer.decode(ids)
    assert tok.eos_token_id == ours.eos_ids[0] == theirs.generation_config.eos_token_id
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours.model(x), atol=1e-5, rtol=0)


def test_bf16_shards_have_an_index_and_load_in_both(trained_run, exports):
    r = exports["bf16"]
    index = json.loads((r.path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in r.path.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    with safe_open(str(r.path / shards[0]), framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    fp32 = load_model(trained_run).model.state_dict()
    back = load_model(r.path, dtype="bfloat16").model.state_dict()
    assert all(torch.equal(back[k], v.to(torch.bfloat16)) for k, v in fp32.items() if v.is_floating_point())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(r.path, dtype=torch.bfloat16).eval()
    x = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        ours = load_model(r.path, dtype="bfloat16").model(x).float()
        torch.testing.assert_close(theirs(x).logits.float(), ours, atol=0.1, rtol=0.02)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_compressed_tensors_decompresses_to_exactly_our_dequantised_weights(trained_run, exports, mode):
    r = exports[mode]
    config = json.loads((r.path / "config.json").read_text())["quantization_config"]
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(config)
    (scheme,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    ours = _quant_layers(load_model(r.path).model)
    hf_to_ours = {v[: -len(".weight")]: k[: -len(".weight")] for k, v in key_map(load_model(trained_run).model.cfg)
                  .items()}
    tensors = {}
    with safe_open(str(r.path / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    prefixes = ctf.ct_prefixes(list(tensors))
    assert len(prefixes) == len(ours) == 15 and set(r.ignored) == set() and "lm_head" in prefixes
    for prefix in prefixes:
        mine = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == prefix}
        dense = compressor.decompress(mine, scheme)["weight"]
        assert torch.equal(dense, ours[hf_to_ours[prefix]].dequantize()), prefix
    # And the grid is trainforge quantize's: the in-memory quantisation of the float checkpoint.
    reference = load_model(trained_run).model
    quantize_model(reference, mode, 32, pack=False)
    assert all(torch.equal(m.dequantize(), ours[n].dequantize()) for n, m in _quant_layers(reference).items())


def test_packing_matches_the_compressed_tensors_compressor_word_for_word():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    w = torch.randn(24, 64)
    packed, scales, zeros = quantize_int4(w, 32)
    out = ctf.to_ct("int4", {"weight": packed, "scales": scales, "zeros": zeros})
    codes = ctf._unpack_nibbles(out["weight_packed"], 64) - 8
    assert torch.equal(out["weight_packed"], pack_to_int32(codes.to(torch.int8), 4))
    assert torch.equal(out["weight_zero_point"], pack_to_int32(zeros, 4, packed_dim=0))
    assert all(torch.equal(a, b) for a, b in zip(ctf.from_ct("int4", out, "t").values(), (packed, scales, zeros)))
    # The grid: every value within half a step, zero exactly representable (padding adds nothing).
    deq = dequantize_int4(packed, scales, zeros)
    step = scales.repeat_interleave(32, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(dequantize_int4(*quantize_int4(torch.zeros(16, 32), 32)), torch.zeros(16, 32))
    q8, s8 = quantize_int8(w)
    assert torch.equal(ctf.from_ct("int8", ctf.to_ct("int8", {"weight": q8, "scales": s8}), "t")["scales"], s8)
    assert torch.equal(dequantize_int8(q8, s8), q8.float() * s8[:, None])


def test_pre_2026_12_float_zeros_still_dequantise_the_old_way():
    packed = torch.randint(0, 256, (16, 16), dtype=torch.uint8)
    scales, zeros = torch.rand(16, 1) + 0.1, torch.randn(16, 1)
    q = torch.stack((packed >> 4, packed & 15), -1).reshape(16, 32).float()
    assert torch.equal(dequantize_int4(packed, scales, zeros), (q - 8) * scales + zeros)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantised_export_loads_back_and_generates(exports, mode):
    loaded = load_model(exports[mode].path)
    assert loaded.quantization["mode"] == mode and loaded.quantization["format"] == "compressed-tensors"
    out = subprocess.run([sys.executable, "-m", "trainforge", "generate", "--checkpoint", str(exports[mode].path),
                          "--prompt", "The", "--max_new_tokens", "8", "--temperature", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("The") and len(out.stdout.strip()) > len("The")


def test_int8_export_loads_in_transformers(exports):
    """transformers + compressed-tensors decompress the int8 export on CPU: its logits equal
    trainforge's model on the dequantised weights (the reference kernel, weight-only)."""
    loaded = load_model(exports["int8"].path)
    for m in _quant_layers(loaded.model).values():
        m.pack("reference")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exports["int8"].path).eval()
    x = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, loaded.model(x), atol=1e-4, rtol=0)


def test_bad_arguments_are_refused_before_anything_is_written(trained_run, tmp_path):
    out = tmp_path / "out"
    for kw, match in [({"dtype": "fp8"}, "--dtype 'fp8'"), ({"quantize": "int3"}, "--quantize 'int3'"),
                      ({"quantize": "int4", "group_size": 3}, "--group_size 3")]:
        with pytest.raises(CheckpointError, match=match):
            export(trained_run, out, **kw)
        assert not out.exists() and not list(tmp_path.glob(".*"))
    with pytest.raises(CheckpointError):
        export(tmp_path / "missing", out)
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="--force"):
        export(trained_run, out)
    assert (out / "keep.txt").read_text() == "mine"
    export(trained_run, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("flavor", ["moe-debug", "dsv3-debug"])
def test_quantised_moe_and_latent_attention_exports_are_trainforge_quantize(tmp_path, flavor):
    """Routed experts (per-expert HF Linears) and latent attention (rope rows interleaved
    in the HF layout) export quantised; loading the directory gives exactly `trainforge
    quantize`'s model, and compressed-tensors decompresses the HF-ordered rows to the same
    numbers as our rows permuted."""
    import dataclasses

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    from tests.infer.helpers import sharpen
    from trainforge.infer.quantize import QuantExperts
    from trainforge.model import FLAVORS, build_model
    from trainforge.train import checkpoint as ckpt

    cfg = dataclasses.replace(FLAVORS[flavor], max_seq_len=64)
    ck = ckpt.save_checkpoint(tmp_path / "checkpoints", 1, sharpen(build_model(cfg, seed=0)).eval(), {}, {},
                              dataclasses.asdict(cfg), None, keep_last=1)
    r = export(ck, tmp_path / "hf", quantize="int4", group_size=16)
    loaded = load_model(r.path)
    reference = load_model(ck).model
    quantize_model(reference, "int4", 16, pack=False)
    kinds = (QuantLinear, QuantExperts)
    ours = {n: m for n, m in loaded.model.named_modules() if isinstance(m, kinds)}
    theirs = {n: m for n, m in reference.named_modules() if isinstance(m, kinds)}
    assert set(ours) == set(theirs) and loaded.quantization["experts"]
    for n, m in ours.items():
        a, b = m.dequantize(), theirs[n].dequantize()
        assert all(torch.equal(x, y) for x, y in zip(*((a, b) if isinstance(a, tuple) else ((a,), (b,))))), n
    x = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded.model(x), reference(x))
    qc = QuantizationConfig.model_validate(json.loads((r.path / "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    with safe_open(str(r.path / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    prefix = "model.layers.1.mlp.experts.3.down_proj"
    mine = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == prefix}
    dense = BaseCompressor.get_value_from_registry(qc.format).decompress(mine, scheme)["weight"]
    assert torch.equal(dense, ours["layers.1.feed_forward.experts"].dequantize()[1][3])


def test_a_damaged_checkpoint_writes_nothing(trained_run, tmp_path):
    """The sha256 check runs beside the conversion; a mismatch still commits nothing."""
    import shutil

    from trainforge.storage.checkpoint_format import CorruptCheckpointError

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    for weights in run.glob("checkpoints/*/model.safetensors"):
        raw = bytearray(weights.read_bytes())
        raw[-3] ^= 0xFF  # inside the last tensor's bytes: the header still parses
        weights.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="sha256"):
        export(run, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
