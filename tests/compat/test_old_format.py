"""Files written by an older trainforge still load: a run directory (resumed to the
uninterrupted run's losses), its checkpoint's weights, and int8 / int4 quantised directories.

``v1/`` was written by ``make_v1_fixture.py`` run with trainforge at b0bc904 (main before the
one-forward / components redesign): a 3-step debug run stopped at its step-3 checkpoint, the
same run's uninterrupted losses to step 6, the last-position logits and 24 greedy tokens of
each model, and the per-tensor sums of the checkpoint's weights. Never regenerate it with
newer code: it stands for what users already have on disk.

Tolerances: resumed losses and logits agree to float rounding (1e-5 / 1e-4; on the machine
that wrote them they are bit-identical); greedy tokens are compared exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.loading import load_model
from trainforge.infer.prepare import prepare_model
from trainforge.infer.sampling import SamplingParams

V1 = Path(__file__).parent / "v1"
EXPECTED = json.loads((V1 / "expected.json").read_text())
PROMPT = list(range(5, 17))


@pytest.mark.parametrize("name,sub", [("float", "run"), ("int8", "int8"), ("int4", "int4")])
def test_old_model_directories_load_and_generate_the_same(name, sub):
    loaded = load_model(V1 / sub)
    with torch.no_grad():
        logits = loaded.model(torch.tensor([PROMPT]))[0, -1]
    torch.testing.assert_close(logits, torch.tensor(EXPECTED[name]["last_logits"]), rtol=0, atol=1e-4)
    # The old engine fused the model it was given; prepare_model does that now.
    engine = Engine(prepare_model(loaded.model), EngineConfig(max_batch_size=2, max_context=64), loaded.tokenizer,
                    loaded.eos_ids)
    req = engine.generate([PROMPT], SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert req.output_ids == EXPECTED[name]["greedy_tokens"]


def test_old_checkpoint_weights_load_unchanged():
    loaded = load_model(V1 / "run" / "checkpoints" / "step_0000003")
    sd = loaded.model.state_dict()
    sums = EXPECTED["weight_sums"]
    assert set(sums) <= set(sd)
    for key, want in sums.items():
        assert sd[key].double().sum().item() == pytest.approx(want, rel=1e-12, abs=1e-12), key


@pytest.mark.slow
def test_old_run_directory_resumes_to_the_uninterrupted_losses(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(V1 / "run", run)
    shutil.copytree(V1 / "data", tmp_path / "data")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "trainforge", "train", "--resume", str(run),
                           "--data.path", str(tmp_path / "data"), "--training.steps", "6", "--no_sample"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r and "val_loss" not in r}
    want = EXPECTED["reference_losses"]
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    got = torch.tensor([losses[s] for s in range(1, 7)], dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor([want[str(s)] for s in range(1, 7)], dtype=torch.float64),
                               rtol=0, atol=1e-5)
