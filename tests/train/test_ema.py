"""The weight average ([ema]): equal to one computed offline from the weights of every step,
resumed exactly, chosen by --weights ema in generate / export, refused plainly where absent."""

import pytest
import torch
from safetensors.torch import load_file

from conftest import StopAt, debug_config, train_to
from trainforge.errors import CheckpointError, ConfigError
from trainforge.infer.loading import load_model
from trainforge.loading.ema_weights import read_ema_weights
from trainforge.monitor.jsonl import read_jsonl
from trainforge.train.trainer import Trainer

DECAY = 0.8  # large steps of the average, so an update missed or taken twice shows


class SaveWeights:
    """Keeps a copy of the trained weights after every step (``run`` adds the first step's)."""

    def __init__(self):
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, trainer, step):
        self.steps.append({k: v.detach().clone() for k, v in trainer.raw_model.named_parameters()})


def run(cfg, run_dir, resume=False, callbacks=()):
    t = Trainer(cfg, run_dir, resume=resume, callbacks=list(callbacks), progress=False)
    try:
        for c in callbacks:
            if isinstance(c, SaveWeights):
                c.steps.append({k: v.detach().clone() for k, v in t.raw_model.named_parameters()})
        return t.fit()
    finally:
        t.close()


def ema_cfg(data, *extra):
    return debug_config(data, "--training.steps", "12", "--checkpoint.interval", "6", "--training.val_interval", "0",
                        "--ema.enabled", "--ema.decay", str(DECAY), *extra)


def saved_ema(run_dir, step):
    return read_ema_weights(run_dir / "checkpoints" / f"step_{step:07d}")


CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("interval,on_cpu,device", [(1, True, "cpu"), (3, True, "cpu"), (2, False, "cpu"),
                                                    pytest.param(1, True, "cuda", marks=CUDA),
                                                    pytest.param(2, False, "cuda", marks=CUDA)])
def test_ema_equals_the_average_of_the_weights_saved_at_each_step(tmp_path, small_data, interval, on_cpu, device):
    """On CUDA with on_cpu: the side-stream snapshot and the host thread (the next optimizer
    step must wait for the copy, or the average would hold a later step's weights)."""
    saver = SaveWeights()
    cfg = ema_cfg(small_data, "--ema.interval", str(interval), "--training.device", device,
                  *([] if on_cpu else ["--no-ema.on_cpu"]))
    run(cfg, tmp_path / "r", callbacks=[saver])
    assert len(saver.steps) == 13  # step 0 and 12 steps
    ema = saved_ema(tmp_path / "r", 12)
    for name in saver.steps[0]:
        ref = saver.steps[0][name].double().cpu()
        for step in range(interval, 13, interval):
            ref = DECAY * ref + (1 - DECAY) * saver.steps[step][name].double().cpu()
        torch.testing.assert_close(ema[name].double(), ref, rtol=0, atol=1e-6)
    # and it is not simply the final weights
    final = load_file(tmp_path / "r" / "checkpoints" / "step_0000012" / "model.safetensors")
    assert max((final[k] - ema[k]).abs().max().item() for k in final) > 1e-3


def test_resumed_ema_equals_the_uninterrupted_runs(tmp_path, small_data):
    train_to(ema_cfg(small_data), tmp_path / "a")
    part = run(ema_cfg(small_data), tmp_path / "b", callbacks=[StopAt(4)])
    assert part["step"] == 4
    run(ema_cfg(small_data), tmp_path / "b", resume=True)
    a, b = saved_ema(tmp_path / "a", 12), saved_ema(tmp_path / "b", 12)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_without_ema_resumes_with_ema_starting_at_its_weights(tmp_path, small_data):
    base = ["--training.steps", "12", "--checkpoint.interval", "6", "--training.val_interval", "0"]
    run(debug_config(small_data, *base), tmp_path / "r", callbacks=[StopAt(6)])
    assert "ema" not in torch.load(tmp_path / "r" / "checkpoints" / "step_0000006" / "train_state.pt",
                                   weights_only=True)
    run(ema_cfg(small_data), tmp_path / "r", resume=True)
    assert saved_ema(tmp_path / "r", 12)  # it averaged from step 6 on
    losses = [r["loss"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 12


def test_weights_ema_loads_the_average_and_final_the_weights(tmp_path, small_data):
    train_to(ema_cfg(small_data), tmp_path / "r")
    ck = tmp_path / "r" / "checkpoints" / "step_0000012"
    ema, final = saved_ema(tmp_path / "r", 12), load_file(ck / "model.safetensors")
    got_ema = load_model(tmp_path / "r", weights="ema").model.state_dict()
    got_final = load_model(tmp_path / "r").model.state_dict()
    for k, v in final.items():
        assert torch.equal(got_final[k], v) and torch.equal(got_ema[k], ema[k]), k


def test_weights_ema_without_an_average_is_refused_naming_the_fix(tmp_path, small_data):
    run(debug_config(small_data, "--training.steps", "2", "--training.val_interval", "0"), tmp_path / "r")
    with pytest.raises(CheckpointError, match=r"holds no weight average.*--weights final"):
        load_model(tmp_path / "r", weights="ema")


def test_cli_generate_and_export_take_weights_ema(tmp_path, small_data, capsys):
    from trainforge.cli import main

    train_to(ema_cfg(small_data), tmp_path / "r")
    args = ["generate", str(tmp_path / "r"), "--prompt_ids", "1,2,3", "--print_ids", "--temperature", "0",
            "--max_new_tokens", "8"]
    assert main(args + ["--weights", "ema"]) == 0
    assert main(args) == 0
    ema_ids, final_ids = capsys.readouterr().out.split()
    assert len(ema_ids.split(",")) == 8 and ema_ids != final_ids  # greedy: a different model speaks differently
    assert main(["export", str(tmp_path / "r"), "--output", str(tmp_path / "hf"), "--weights", "ema"]) == 0
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    torch.testing.assert_close(hf["model.norm.weight"], saved_ema(tmp_path / "r", 12)["norm.weight"], rtol=0, atol=0)


def test_bad_ema_settings_are_refused_naming_the_key(small_data):
    with pytest.raises(ConfigError, match=r"ema\.decay"):
        debug_config(small_data, "--ema.decay", "1.0")
    with pytest.raises(ConfigError, match=r"ema\.interval"):
        debug_config(small_data, "--ema.interval", "0")


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_weights_ema_on_a_hugging_face_directory_or_gguf_file_is_refused(tmp_path, kind):
    path = tmp_path / "model.gguf"
    if kind == "hf":
        path = tmp_path / "hf"
        path.mkdir()
        (path / "config.json").write_text("{}")
    else:
        path.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"--weights ema: .* only a trainforge checkpoint"):
        load_model(path, weights="ema")
