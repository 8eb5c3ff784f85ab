"""Quantisation-aware training: the fake quantiser is the export grid bit for bit, a QAT
checkpoint is served on the grid it trained for, resume across ``qat.start_step`` is
exact, and bad settings are refused naming the key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import StopAt, debug_config
from trainforge.infer.session import load_for_engine as _load_for_engine
from trainforge.errors import ConfigError, TrainforgeError
from trainforge.infer.quantize import Int4Linear, Int8Linear, linear_names
from trainforge.infer.quantize.int4 import dequantize_int4, quantize_int4
from trainforge.infer.quantize.int8 import dequantize_int8, quantize_int8
from trainforge.infer.loading import load_model
from trainforge.infer.quantize.qat_meta import qat_scheme_of, resolve_quantize
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train import checkpoint as ckpt
from trainforge.train.qat import FakeQuant, QATComponent, apply_qat, check_qat, qat_active, remove_qat
from trainforge.train.trainer import Trainer

# QAT from step 4 of 8: the first four steps are plain, the last four fake-quantised. Group 32
# leaves the debug flavor's w2 (in_features 176) float, as `trainforge quantize` does.
QAT = ["--training.steps", "8", "--qat.scheme", "int4", "--qat.group_size", "32", "--qat.start_step", "4"]
# The loaded model's reference kernel computes x @ W^T with the same W as the fake-quantised
# F.linear; measured equal (0.0) here, the bound leaves room for another BLAS's summation order.
# The float model's logits differ from the quantised ones by ~6e-2 (max |logit| ~0.65).
LOGITS_ATOL = 1e-5


def grid(w: torch.Tensor, scheme: str, group_size: int) -> torch.Tensor:
    return dequantize_int8(*quantize_int8(w)) if scheme == "int8" else dequantize_int4(*quantize_int4(w, group_size))


def run(cfg, run_dir, resume=False, callbacks=None) -> Trainer:
    t = Trainer(cfg, run_dir, resume=resume, callbacks=callbacks, progress=False)
    try:
        t.fit()
    finally:
        t.close()
    return t


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_fake_quant_forward_is_the_export_grid_and_its_gradient_passes_straight_through(scheme):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    x = torch.randn(5, 64)
    names, skipped = apply_qat(lin, scheme, 16)
    assert names == [""] and skipped == {} and qat_active(lin)
    assert list(lin.state_dict()) == ["weight", "bias"]  # no renamed parameters
    wq = grid(lin.weight.detach(), scheme, 16)
    assert not torch.equal(wq, lin.weight)  # the grid really rounds
    y = lin(x)
    assert torch.equal(y, F.linear(x, wq, lin.bias))  # bit for bit
    gy = torch.randn_like(y)
    y.backward(gy)
    # Straight through: the weight gets the gradient the quantised weight would get.
    wq_leaf = wq.clone().requires_grad_()
    F.linear(x, wq_leaf, lin.bias).backward(gy)
    assert torch.equal(lin.weight.grad, wq_leaf.grad)
    remove_qat(lin)
    assert not qat_active(lin) and torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_fake_quant_autograd_function_alone():
    w = torch.randn(8, 32, requires_grad=True)
    out = FakeQuant.apply(w, "int4", 32)
    assert torch.equal(out, dequantize_int4(*quantize_int4(w, 32)))
    out.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_qat_checkpoint_is_served_on_its_grid_bit_for_bit(tmp_path, small_data):
    run_dir = tmp_path / "run"
    t = run(debug_config(small_data, *QAT, "--checkpoint.interval", "4"), run_dir)
    model = t.raw_model
    assert qat_active(model)
    assert qat_scheme_of(run_dir) == {"mode": "int4", "group_size": 32, "start_step": 4, "qat_steps": 4}
    # The step-4 checkpoint was saved before the first QAT step: its weights never saw the grid.
    assert qat_scheme_of(run_dir / "checkpoints" / "step_0000004") is None

    args = SimpleNamespace(checkpoint=str(run_dir), device="cpu", dtype="float32", quantize="auto", group_size=None,
                           quant_kernel="reference", no_fuse=True)
    loaded = _load_for_engine(args)
    names = linear_names(model)
    quantised = [n for n in names if isinstance(loaded.model.get_submodule(n), Int4Linear)]
    skipped = [n for n in names if n not in quantised]
    assert skipped == [f"layers.{i}.feed_forward.w2" for i in range(2)]
    assert all(type(loaded.model.get_submodule(n)) is nn.Linear for n in skipped)
    for n in quantised:  # what the training forward multiplied by == what the served model stands for
        trained = FakeQuant.apply(model.get_submodule(n).weight.detach(), "int4", 32)
        assert torch.equal(loaded.model.get_submodule(n).dequantize(), trained), n
    for n in skipped:
        assert torch.equal(loaded.model.get_submodule(n).weight, model.get_submodule(n).weight.detach()), n

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    model.eval()
    with torch.no_grad():
        want, got = model(ids), loaded.model(ids)
    torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0)
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())  # the same greedy token

    # An explicit other grid is refused; none serves the float weights.
    for quantize, group in (("int8", None), ("int4", 64)):
        with pytest.raises(TrainforgeError, match="trained with QAT for int4 group_size 32"):
            _load_for_engine(SimpleNamespace(**{**vars(args), "quantize": quantize, "group_size": group}))
    plain = _load_for_engine(SimpleNamespace(**{**vars(args), "quantize": "none"}))
    assert not any(isinstance(m, (Int4Linear, Int8Linear)) for m in plain.model.modules())

    # `trainforge export` picks the trained grid too: the compressed-tensors directory holds
    # exactly the fake-quantised training weights, and the layers QAT kept float stay float.
    from trainforge.cli import main as cli_main

    assert cli_main(["export", "--checkpoint", str(run_dir), "--output", str(tmp_path / "hf")]) == 0
    exported = load_model(tmp_path / "hf").model
    for n in quantised:
        trained = FakeQuant.apply(model.get_submodule(n).weight.detach(), "int4", 32)
        assert torch.equal(exported.get_submodule(n).dequantize(), trained), n
    assert all(type(exported.get_submodule(n)) is nn.Linear for n in skipped)


def test_resume_across_start_step_is_bit_identical(tmp_path, small_data):
    """Interrupted before start_step (3) and again after it (6): the resumed run switches
    fake quantisation on at the same step and matches the uninterrupted one exactly."""
    extra = [*QAT, "--checkpoint.interval", "3", "--training.val_interval", "3"]
    run(debug_config(small_data, *extra), tmp_path / "a")
    assert run(debug_config(small_data, *extra), tmp_path / "b", callbacks=[StopAt(3)]).step == 3
    assert run(debug_config(small_data, *extra), tmp_path / "b", resume=True, callbacks=[StopAt(6)]).step == 6
    run(debug_config(small_data, *extra), tmp_path / "b", resume=True)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # exact, every step
    vals = lambda d: [(r["step"], r["val_loss"]) for r in read_jsonl(d / "metrics.jsonl") if "val_loss" in r]  # noqa
    assert vals(tmp_path / "a") == vals(tmp_path / "b")
    a = ckpt.load_full_weights(tmp_path / "a" / "checkpoints" / "step_0000008", False)
    b = ckpt.load_full_weights(tmp_path / "b" / "checkpoints" / "step_0000008", False)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # QAT changes nothing before start_step and every step after it.
    plain = losses(run(debug_config(small_data, "--training.steps", "8", "--training.val_interval", "3"),
                       tmp_path / "plain").run_dir)
    qat = losses(tmp_path / "a")
    assert qat[:4] == plain[:4]
    assert all(q != p for q, p in zip(qat[4:], plain[4:]))


def test_config_errors_name_the_key(small_data):
    for extra, key in [(["--qat.scheme", "int3"], "qat.scheme"),
                       (["--qat.scheme", "int4", "--qat.group_size", "33"], "qat.group_size"),
                       (["--qat.scheme", "int4", "--qat.start_step", "-1"], "qat.start_step"),
                       (["--qat.scheme", "int8", "--qat.start_step", "300"], "qat.start_step"),  # = training.steps
                       (["--qat.scheme", "int4", "--qat.activations", "int8"], "qat.activations")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            debug_config(small_data, *extra)
    debug_config(small_data, "--qat.scheme", "int4", "--qat.start_step", "299")  # the last step alone: fine
    qcfg = debug_config(small_data, "--qat.scheme", "int4").qat
    dense = SimpleNamespace(is_moe=False)
    for dims, match in [(SimpleNamespace(tp=2, pp=1), "parallel.tp"), (SimpleNamespace(tp=1, pp=2), "parallel.pp")]:
        with pytest.raises(ConfigError, match=match):
            check_qat(qcfg, dims, dense)
    with pytest.raises(ConfigError, match="parallel.compile"):
        check_qat(qcfg, SimpleNamespace(tp=1, pp=1), dense, compile=True)
    with pytest.raises(ConfigError, match="MoE"):
        check_qat(qcfg, SimpleNamespace(tp=1, pp=1), SimpleNamespace(is_moe=True))
    check_qat(qcfg, SimpleNamespace(tp=1, pp=1), dense)


def test_int4_layers_the_group_does_not_divide_are_listed_and_stay_float():
    from trainforge.model import FLAVORS, build_model

    model = build_model(FLAVORS["debug"], seed=0)
    warnings: list[str] = []
    qcfg = SimpleNamespace(scheme="int4", group_size=32, start_step=5, activations="none")
    comp = QATComponent(qcfg, [model], log=warnings.append)
    assert not comp.active and not qat_active(model)  # start_step 5: off at step 0
    assert len(warnings) == 1 and "layers.0.feed_forward.w2: in_features 176" in warnings[0]
    comp._sync(5)
    assert comp.active and "forward" in vars(model.layers["0"].feed_forward.w1)
    assert "forward" not in vars(model.layers["0"].feed_forward.w2)  # skipped: its plain forward
    comp._sync(4)  # a rollback to before start_step switches it off again
    assert not qat_active(model)


def test_resolve_quantize_prefers_the_recorded_grid():
    rec = {"mode": "int4", "group_size": 32, "start_step": 4, "qat_steps": 4}
    assert resolve_quantize("auto", None, rec) == ("int4", 32, None)
    assert resolve_quantize("int4", 32, rec) == ("int4", 32, None)
    assert resolve_quantize("auto", None, None) == ("none", 128, None)
    assert resolve_quantize("int8", None, None) == ("int8", 128, None)
    mode, _, note = resolve_quantize("none", None, rec)
    assert mode == "none" and "float weights of a QAT run" in note
    with pytest.raises(ValueError, match="--quantize int4 --group_size 32"):
        resolve_quantize("int4", 128, rec)
    assert resolve_quantize("int8", None, {"mode": "int8", "start_step": 0, "qat_steps": 3}) == ("int8", 128, None)


def test_int8_activation_fake_quant_is_the_served_int8_kernel():
    """W8A8 QAT: the training forward (weights on the int8 grid, inputs quantised as fbgemm's
    dynamic linear does) equals the served Int8Linear on its default CPU kernel; without the
    activation part it would not (the check can fail); the gradient reaches the weight."""
    from trainforge.train.qat import fake_quantize_activations

    torch.manual_seed(0)
    lin = nn.Linear(128, 64, bias=False)
    x = torch.randn(5, 128) * 3
    served = Int8Linear.quantize(lin.weight.detach(), kernel="fbgemm")
    served.pack("fbgemm")
    assert served.kernel_name == "fbgemm"
    apply_qat(lin, "int8", activations="int8")
    y = lin(x)
    want = served(x)
    assert (y - want).abs().max() < 1e-4 * want.abs().max()
    remove_qat(lin)
    apply_qat(lin, "int8")
    assert (lin(x) - want).abs().max() > 100 * (y - want).abs().max()  # weights-only differs: the check bites
    remove_qat(lin)
    apply_qat(lin, "int8", activations="int8")
    lin(x).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    xq = fake_quantize_activations(x)
    assert xq.unique().numel() <= 128  # 7 bits
