import subprocess
import sys

import torch

from trainforge.cli import main
from trainforge.data.tokenizer import load_tokenizer
from trainforge.infer.generate import SamplingParams, generate
from trainforge.model import FLAVORS, build_model


def test_cached_greedy_generation_matches_uncached_argmax_loop():
    model = build_model(FLAVORS["debug"], seed=0).eval()
    prompt = [5, 17, 300, 42]
    got = generate(model, prompt, SamplingParams(max_new_tokens=20, temperature=0)).output_ids
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt):]


def test_generate_leaves_a_training_model_as_it_was():
    """The sample printed after training runs on the live model: no module swapped, mode kept."""
    model = build_model(FLAVORS["debug"], seed=0).train()
    before = {n: type(m) for n, m in model.named_modules()}
    a = generate(model, [1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0.8, seed=4)).output_ids
    assert model.training and {n: type(m) for n, m in model.named_modules()} == before
    assert generate(model, [1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0.8, seed=4)).output_ids == a


def test_generate_inside_the_trainers_autocast_runs_in_the_models_dtype():
    """The sample after a bf16-mixed run is drawn inside the trainer's autocast: the engine
    must still compute in fp32 (the parameters' dtype) and give the fp32 tokens."""
    model = build_model(FLAVORS["debug"], seed=0).eval()
    params = SamplingParams(max_new_tokens=12, temperature=0)
    want = generate(model, [5, 6, 7], params).output_ids
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert generate(model, [5, 6, 7], params).output_ids == want


def test_cli_train_then_generate(tmp_path, small_data, capsys):
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "trainforge", "train", "--run_dir", str(run_dir),
                        "--data.path", str(small_data), "--model.flavor", "debug", "--training.steps", "30",
                        "--training.batch_size", "8", "--training.seq_len", "64", "--sample.max_new_tokens", "16",
                        "--sample.prompt", "def "],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "sample:\ndef " in r.stdout and "checkpoint:" in r.stdout
    assert (run_dir / "config.toml").is_file() and (run_dir / "checkpoints" / "step_0000030").is_dir()

    args = ["generate", "--checkpoint", str(run_dir), "--max_new_tokens", "12"]
    out = subprocess.run([sys.executable, "-m", "trainforge", *args, "--prompt", "import os\n", "--temperature", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    greedy = out.stdout
    assert greedy.startswith("import os\n") and len(greedy) > len("import os\n")

    def cli(*argv) -> tuple[int, str, str]:
        """The same CLI in this process (``trainforge.cli.main``): no interpreter and torch
        start-up per call; the subprocess call above covers ``python -m trainforge``."""
        capsys.readouterr()
        try:
            rc = main(list(argv))
        except SystemExit as e:  # argparse errors
            rc = e.code
        got = capsys.readouterr()
        return rc, got.out, got.err

    def gen(*extra, prompt=("--prompt", "import os\n")):
        rc, out, err = cli(*args, *prompt, *extra)
        assert rc == 0, err
        return out

    assert gen("--temperature", "0") == greedy
    assert gen("--temperature", "1.0", "--seed", "3") == gen("--temperature", "1.0", "--seed", "3")
    # Token ids in and out: the same greedy continuation as the text run.
    tok = load_tokenizer(run_dir / "checkpoints" / "step_0000030" / "tokenizer.json")
    prompt_ids = ",".join(map(str, tok.encode("import os\n").ids))
    ids = gen("--temperature", "0", "--print_ids", "--ignore_eos", prompt=("--prompt_ids", prompt_ids))
    new_ids = [int(t) for t in ids.strip().split(",")]
    assert len(new_ids) == 12 and greedy.startswith(tok.decode(tok.encode("import os\n").ids + new_ids[:3]))
    rc, _, err = cli("generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x")
    assert rc == 2 and "does not exist" in err
    rc, _, err = cli("generate", "--checkpoint", str(run_dir), "--prompt", "x", "--top_p", "0")
    assert rc == 2 and "top_p" in err
