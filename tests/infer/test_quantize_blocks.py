"""The 32-value block modes (q8_0 / q4_0) as quantised linears: every kernel (the C++ ops,
dequantise-once, reference) agrees with the dequantised reference; a packed layer holds its
codes once (no fp32 copy); layers fuse; the engine decodes like the training forward on the
same weights; routed experts stay float with the reason; without the C++ ops the layer
falls back to a float kernel with one warning; ``trainforge quantize --mode q8_0`` writes a
file that ``generate`` loads and decodes as ``--quantize q8_0`` does in memory."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from tests.infer.helpers import argmax_loop, model_for
from trainforge.infer.cpu_kernels import build
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.prepare import prepare_model
from trainforge.infer.quantize import Q4_0Linear, Q8_0Linear, quantize_model
from trainforge.infer.quantize import blocks as blocks_mod
from trainforge.infer.sampling import SamplingParams

# Relative error of y = x W^T against the product with the dequantised weight: the C++ ops
# quantise activations to int8 per 32-block (~0.4% of a block's absmax per value).
KERNEL_RTOL = {"blocks": 0.01, "dequant": 1e-5, "reference": 1e-6}
CLASSES = {"q8_0": Q8_0Linear, "q4_0": Q4_0Linear}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def kernels():
    if build.load_kernels() is None:
        pytest.skip("the C++ block kernels did not build here (the warning says why)")


@pytest.mark.parametrize("mode", list(CLASSES))
def test_every_kernel_matches_the_dequantised_reference(kernels, mode):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 96, generator=gen)
    x = torch.randn(5, 96, generator=gen)
    ref = x @ CLASSES[mode].quantize(w).dequantize().t()
    for name, tol in KERNEL_RTOL.items():
        layer = CLASSES[mode].quantize(w, kernel=name)
        assert layer.pack() == name
        assert rel(layer(x), ref) < tol, name
    # The quantised weight itself: q8_0 within 1% of w, q4_0 within 12% (4 bits, Gaussian values).
    assert rel(ref, x @ w.t()) < (0.01 if mode == "q8_0" else 0.12)


@pytest.mark.parametrize("mode, bytes_per_value", [("q8_0", 1 + 2 / 32), ("q4_0", 0.5 + 2 / 32)])
def test_packed_layer_holds_its_codes_once(kernels, mode, bytes_per_value):
    layer = CLASSES[mode].quantize(torch.randn(64, 256))
    assert layer.pack() == "blocks"
    assert layer.weight_bytes == 64 * 256 * bytes_per_value
    # The kernel reads the stored tensors in place: nothing float of weight size is left anywhere.
    assert all(b.numel() == 0 for b in layer.buffers())


def test_block_modes_fuse_and_the_engine_decodes_like_the_training_forward(kernels):
    for mode in CLASSES:
        reference = model_for("gqa4")
        quantize_model(reference, mode)
        plain = argmax_loop(reference, [1, 2, 3], 12)  # the model's own forward on the quantised weights
        outs = []
        for fuse in (False, True):
            model = model_for("gqa4")
            info = quantize_model(model, mode, pack=False)
            assert len(info["layers"]) == 3 * 7 + 1 and not info["skipped"]
            engine = Engine(prepare_model(model, fuse=fuse), EngineConfig(max_batch_size=2, max_context=64))
            assert engine.kernels == {"blocks": 13 if fuse else 22}
            out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12, temperature=0))[0].output_ids
            assert out == plain, (mode, fuse)
            outs.append(out)
        assert outs[0] == outs[1]


def test_auto_kernel_is_probed_once_per_kind_of_layer_not_per_layer(kernels, monkeypatch):
    """pack_quantized resolves "auto" once per layer class (choose_kernel's probe builds and runs a
    small layer); the probe layer is zeros in the stored form, so no quantiser op runs."""
    from trainforge.infer.quantize import common

    probes = []
    real = common.kernel_works
    monkeypatch.setattr(common, "kernel_works", lambda cls, name, *a, **kw: probes.append((cls, name))
                        or real(cls, name, *a, **kw))
    model = model_for("gqa4")
    info = quantize_model(model, "q8_0", pack=False)
    monkeypatch.setattr(Q8_0Linear, "QUANTIZE", staticmethod(lambda w: pytest.fail("the probe ran the quantiser")))
    assert prepare_model(model, fuse=True) is model
    assert probes == [(Q8_0Linear, "blocks")]
    assert len(info["layers"]) > 1 and all(m.kernel_name == "blocks" for m in model.modules()
                                           if isinstance(m, Q8_0Linear))
    layer = Q4_0Linear.probe_layer(torch.device("cpu"))
    assert layer.pack("blocks") == "blocks" and layer(torch.ones(2, 256)).abs().max() == 0


def test_routed_experts_stay_float_under_a_block_mode(kernels):
    model = model_for("moe")
    info = quantize_model(model, "q8_0")
    assert info["experts"] == [] and info["layers"]
    experts = {n for n, _ in model.named_modules() if n.endswith(".experts")}
    assert experts and all("stay float under q8_0" in info["skipped"][n] for n in experts)
    # A dense FFN of hidden 176 cannot block its down projection: skipped, with the reason.
    assert info["skipped"]["layers.0.feed_forward.w2"] == "in_features 176 is not a multiple of 32"


def test_without_the_cpp_ops_the_layer_falls_back_to_a_float_kernel(monkeypatch):
    monkeypatch.setattr(blocks_mod, "load_kernels", lambda: None)
    w, x = torch.randn(32, 64), torch.randn(2, 64)
    layer = Q4_0Linear.quantize(w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is load_kernels' own (once per process), not per layer
        assert layer.pack() == "dequant"
    assert rel(layer(x), x @ Q4_0Linear.quantize(w).dequantize().t()) < 1e-5


@pytest.mark.parametrize("kernel", ["dequant", "reference", "c++ unavailable"])
@pytest.mark.parametrize("threads", [1, 2])  # 2: the dequantised weight's row-block split (decode_workspace.LinearInto)
@pytest.mark.parametrize("m", [1, 3])
def test_the_decode_steps_out_form_runs_on_every_fallback_kernel(monkeypatch, kernel, threads, m):
    # The decode step writes each linear through forward_into / bind_into; on a float kernel
    # (chosen, or the one left where the C++ ops do not build) that form must reach it and give
    # the dequantised weight's product (fp32 sums in another order: 1e-5).
    if kernel == "c++ unavailable":
        monkeypatch.setattr(blocks_mod, "load_kernels", lambda: None)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _out_forms_match(kernel, m)
    finally:
        torch.set_num_threads(before)


def _out_forms_match(kernel: str, m: int) -> None:
    w, x = torch.randn(32, 64), torch.randn(m, 64)
    for cls in (Q8_0Linear, Q4_0Linear):
        layer = cls.quantize(w, kernel="auto" if kernel == "c++ unavailable" else kernel)
        want = x @ layer.dequantize().t()
        assert rel(layer(x), want) < 1e-5
        out = torch.empty(m, 32)
        layer.forward_into(x, out)
        assert rel(out, want) < 1e-5
        out.zero_()
        layer.bind_into(x, out)()
        assert rel(out, want) < 1e-5
        strided = torch.empty(32, m).t()  # a non-contiguous out takes the copying form
        layer.bind_into(x, strided)()
        assert rel(strided, want) < 1e-5


def tf(*args, timeout=240) -> str:
    r = subprocess.run([sys.executable, "-m", "trainforge", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_offline_q8_0_file_decodes_like_quantising_at_load(kernels, trained_run, tmp_path):
    out = tf("quantize", "--checkpoint", str(trained_run), "--output", str(tmp_path / "q8"), "--mode", "q8_0")
    assert "quantised 15 linear layers to q8_0" in out
    common = ("--prompt_ids", "5,6,7", "--print_ids", "--temperature", "0", "--max_new_tokens", "12", "--ignore_eos")
    offline = tf("generate", "--checkpoint", str(tmp_path / "q8"), *common)
    at_load = tf("generate", "--checkpoint", str(trained_run), "--quantize", "q8_0", *common)
    assert offline == at_load and len(offline.strip().split(",")) == 12
