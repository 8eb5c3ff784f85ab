import subprocess
import sys

import pytest
import torch

from trainforge.infer.generate import SamplingOptions, generate, sample_next
from trainforge.model import FLAVORS, build_model


def test_cached_greedy_generation_matches_uncached_argmax_loop():
    model = build_model(FLAVORS["debug"], seed=0).eval()
    prompt = [5, 17, 300, 42]
    got = generate(model, prompt, SamplingOptions(max_new_tokens=20, temperature=0))
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt):]


def test_sampling_is_seeded_and_filters_work():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    draw = lambda **kw: [int(sample_next(logits, SamplingOptions(**kw), torch.Generator().manual_seed(s)))
                         for s in range(200)]
    assert draw(temperature=1.0) == draw(temperature=1.0)
    assert len(set(draw(temperature=1.0))) >= 4  # plain sampling explores
    assert set(draw(temperature=1.0, top_k=2)) == {0, 1}
    assert set(draw(temperature=1.0, top_p=0.01)) == {0}  # only the top token survives
    p = logits.softmax(-1)[0]
    assert set(draw(temperature=1.0, top_p=float(p[0] + p[1]) - 1e-4)) == {0, 1}
    assert set(draw(temperature=0)) == {0}


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_new_tokens": -1}])
def test_bad_sampling_options_are_rejected(kw):
    with pytest.raises(ValueError):
        SamplingOptions(**kw).validate()


def test_cli_train_then_generate(tmp_path, small_data):
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "trainforge", "train", "--run_dir", str(run_dir),
                        "--data.path", str(small_data), "--model.flavor", "debug", "--training.steps", "30",
                        "--training.batch_size", "8", "--training.seq_len", "64", "--sample.max_new_tokens", "16",
                        "--sample.prompt", "def "],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "sample:\ndef " in r.stdout and "checkpoint:" in r.stdout
    assert (run_dir / "config.toml").is_file() and (run_dir / "checkpoints" / "step_0000030").is_dir()

    def gen(*extra):
        out = subprocess.run([sys.executable, "-m", "trainforge", "generate", "--checkpoint", str(run_dir),
                              "--prompt", "import os\n", "--max_new_tokens", "12", *extra],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    greedy = gen("--temperature", "0")
    assert greedy.startswith("import os\n") and len(greedy) > len("import os\n")
    assert gen("--temperature", "0") == greedy
    assert gen("--temperature", "1.0", "--seed", "3") == gen("--temperature", "1.0", "--seed", "3")
    bad = subprocess.run([sys.executable, "-m", "trainforge", "generate", "--checkpoint", str(tmp_path / "none"),
                          "--prompt", "x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
