"""One int4 policy: `export --quantize int4` and `quantize --mode int4` group every layer by the
same rule (the requested size where it divides the layer's input dim, else the largest multiple
of 32 below it that does), say so in the same words, and both succeed on the default `tiny`
flavor, whose feed-forward output (in_features 704) 128 does not divide. On main export refused
`tiny` and quantize silently left those layers float."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.faults.conftest import run_cli
from trainforge.infer.loading import load_model
from trainforge.infer.quantize import Int4Linear
from trainforge.infer.quantize.int4 import dequantize_int4, quantize_int4


def _int4_layers(model) -> dict[str, Int4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """The `tiny` flavor's layer shapes (dim 256, ffn 704) in 2 blocks with a small vocab: fast to write."""
    from trainforge.model import FLAVORS, build_model
    from trainforge.train import checkpoint as ckpt

    cfg = dataclasses.replace(FLAVORS["tiny"], n_layers=2, vocab_size=512, max_seq_len=64)
    root = tmp_path_factory.mktemp("int4") / "run"
    ckpt.save_checkpoint(root / "checkpoints", 1, build_model(cfg, seed=0), {}, {}, dataclasses.asdict(cfg), None,
                         keep_last=1)
    return root


def test_tiny_gets_the_same_per_layer_group_sizes_from_quantize_and_export(tiny_run, tmp_path):
    q = run_cli(["quantize", "--checkpoint", str(tiny_run), "--output", str(tmp_path / "q4"), "--mode", "int4"])
    e = run_cli(["export", "--checkpoint", str(tiny_run), "--output", str(tmp_path / "hf4"), "--quantize", "int4"])
    assert q.returncode == 0 and e.returncode == 0, (q.stderr[-2000:], e.stderr[-2000:])
    said = [[ln for ln in r.stdout.splitlines() if ln.startswith("int4:")] for r in (q, e)]
    assert said[0] == said[1] == ["int4: group_size 128 does not divide in_features 704 of layers.0.feed_forward.w2, "
                                  "layers.1.feed_forward.w2: group_size 64"], (q.stdout, e.stdout)
    quantized, exported = (_int4_layers(load_model(tmp_path / d).model) for d in ("q4", "hf4"))
    groups = {n: m.group_size for n, m in quantized.items()}
    assert groups == {n: m.group_size for n, m in exported.items()}
    assert len(groups) == 15 and {n for n, g in groups.items() if g == 64} == {f"layers.{i}.feed_forward.w2"
                                                                              for i in range(2)}
    assert all(g == 128 for n, g in groups.items() if not n.endswith("w2"))
    # The same codes: both commands put every layer on the same grid.
    assert all(torch.equal(m.dequantize(), exported[n].dequantize()) for n, m in quantized.items())
    # The exported config names the fallback layers in a config group of their own.
    qc = json.loads((tmp_path / "hf4" / "config.json").read_text())["quantization_config"]
    sizes = {g["weights"]["group_size"]: g["targets"] for g in qc["config_groups"].values()}
    assert sizes == {128: ["Linear"], 64: [f"model.layers.{i}.mlp.down_proj" for i in range(2)]}


def test_the_fallback_layer_matches_its_dequantised_reference(tiny_run, tmp_path):
    """Parity at the chosen group: the grid holds every weight within half a step, and each
    kernel the layer can run gives the dequantised reference's output."""
    w = load_model(tiny_run).model.layers["0"].feed_forward.w2.weight.detach()  # (256, 704)
    packed, scales, zeros = quantize_int4(w, 64)
    deq = dequantize_int4(packed, scales, zeros)
    assert ((deq - w).abs() <= scales.repeat_interleave(64, dim=1) / 2 + 1e-6).all()
    x = torch.randn(3, 704)
    ref = x @ deq.T
    for kernel, tol in (("reference", 1e-6), ("int4pack_cpu", 0.01), ("blocks", 0.02)):
        m = Int4Linear.quantize(w, kernel=kernel, group_size=64)
        used = m.pack(kernel)
        if used != kernel:
            continue  # not available here (blocks needs the C++ kernels): the reference ran instead
        torch.testing.assert_close(m(x), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_compressed_tensors_reads_the_per_layer_groups(tiny_run, tmp_path):
    """compressed-tensors (what vLLM and transformers use) decompresses a fallback layer of the
    export, with the scheme its config group gives, to trainforge's dequantised weights."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    from trainforge.infer.hf_export import export

    r = export(tiny_run, tmp_path / "hf4", quantize="int4")
    qc = QuantizationConfig.model_validate(json.loads((r.path / "config.json").read_text())["quantization_config"])
    prefix = "model.layers.1.mlp.down_proj"
    (scheme,) = [s for s in qc.config_groups.values() if prefix in s.targets]
    with safe_open(str(r.path / "model.safetensors"), framework="pt") as f:
        mine = {k.rsplit(".", 1)[1]: f.get_tensor(k) for k in f.keys() if k.rsplit(".", 1)[0] == prefix}
    dense = BaseCompressor.get_value_from_registry(qc.format).decompress(mine, scheme)["weight"]
    assert scheme.weights.group_size == 64
    assert torch.equal(dense, _int4_layers(load_model(r.path).model)["layers.1.feed_forward.w2"].dequantize())


@pytest.mark.parametrize("flavor", ["debug", "moe-debug"])
def test_flavors_with_no_common_group_size_go_through_both_commands(flavor, tmp_path, capsys):
    """debug's 176-wide feed-forward output has no multiple of 32 dividing it (float in both), its
    64-wide layers take one group per row; moe-debug adds routed experts (export: one size dividing
    both their dims, the HF layout having no padding; quantize pads the hidden dim)."""
    from trainforge.cli import main
    from trainforge.infer.quantize import Int4Experts
    from trainforge.model import FLAVORS, build_model
    from trainforge.train import checkpoint as ckpt

    cfg = dataclasses.replace(FLAVORS[flavor], max_seq_len=64)
    ckpt.save_checkpoint(tmp_path / "run" / "checkpoints", 1, build_model(cfg, seed=0), {}, {},
                         dataclasses.asdict(cfg), None, keep_last=1)
    said = []
    for argv in (["quantize", "--output", str(tmp_path / "q4"), "--mode", "int4"],
                 ["export", "--output", str(tmp_path / "hf4"), "--quantize", "int4"]):
        assert main([*argv, "--checkpoint", str(tmp_path / "run")]) == 0
        said.append([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("int4:")])
    assert "int4: group_size 128 does not divide in_features 176 of layers.0.feed_forward.w2" in said[0][-1]
    assert said[0][-1] == said[1][-1] and said[0][-1].endswith("float (no multiple of 32 below it divides it)")
    x = torch.randint(0, cfg.vocab_size, (1, 8))
    models = [load_model(tmp_path / d).model for d in ("q4", "hf4")]
    quantized, exported = (_int4_layers(m) for m in models)
    assert {n: m.group_size for n, m in quantized.items()} == {n: m.group_size for n, m in exported.items()}
    assert "layers.0.feed_forward.w2" not in quantized and quantized["layers.0.attention.wq"].group_size == 64
    if flavor == "debug":
        assert said[0] == said[1]
        with torch.no_grad():
            torch.testing.assert_close(models[0](x), models[1](x), rtol=0, atol=0)
    else:
        experts = [{n: m.kw["group_size"] for n, m in model.named_modules() if isinstance(m, Int4Experts)}
                   for model in models]
        assert set(experts[0].values()) == {64} and set(experts[1].values()) == {32}
        assert any("in_features 64 and 32 of layers.1.feed_forward.experts" in ln for ln in said[1])
