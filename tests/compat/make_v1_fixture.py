"""Writes tests/compat/v1/: artefacts written by trainforge main at b0bc904 (before issue 16)."""
import json, subprocess, sys, sysconfig, os, shutil
from pathlib import Path
import torch
from safetensors.torch import load_file
out = Path(sys.argv[1]); out.mkdir(parents=True)
stdlib = Path(sysconfig.get_paths()["stdlib"])
src = out / "corpus"; src.mkdir()
for n in ("textwrap.py", "shlex.py", "glob.py"):
    shutil.copy(stdlib / n, src / n)
tf = ["/work/main/.venv/bin/trainforge"]
env = dict(os.environ, OMP_NUM_THREADS="1")
subprocess.run(tf + ["prepare", "--input", str(src), "--output", str(out / "data"), "--vocab_size", "320"], check=True, env=env)
shutil.rmtree(src)
common = ["--model.flavor", "debug", "--model.ffn_hidden_dim", "64", "--model.dim", "32", "--training.batch_size", "4",
          "--training.seq_len", "32", "--training.log_interval", "1", "--training.warmup_steps", "2",
          "--training.val_batches", "2", "--training.val_interval", "3", "--training.threads", "1",
          "--sample.max_new_tokens", "0", "--data.path", str(out / "data")]
# Uninterrupted reference: 6 steps, losses recorded.
subprocess.run(tf + ["train", *common, "--training.steps", "6", "--checkpoint.interval", "3",
                     "--checkpoint.keep_last", "1", "--run_dir", str(out / "ref")], check=True, env=env)
# The run directory kept: stopped after step 3 (steps=3, one checkpoint).
subprocess.run(tf + ["train", *common, "--training.steps", "3", "--checkpoint.interval", "3",
                     "--run_dir", str(out / "run")], check=True, env=env)
ref = [json.loads(l) for l in (out / "ref" / "metrics.jsonl").read_text().splitlines()]
losses = {r["step"]: r["loss"] for r in ref if "loss" in r and "val_loss" not in r}
shutil.rmtree(out / "ref")
ck = sorted((out / "run" / "checkpoints").glob("step_*"))[-1]
for mode, extra in (("int8", []), ("int4", ["--group_size", "32"])):
    subprocess.run(tf + ["quantize", "--checkpoint", str(ck), "--output", str(out / mode), "--mode", mode, *extra],
                   check=True, env=env)
print(sorted(p.name for p in ck.iterdir()))
# Expected values, computed by the old code.
from trainforge.infer.loading import load_model
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.sampling import SamplingParams
expected = {"written_by": "trainforge b0bc904 (main before issue 16)", "checkpoint_step": 3,
            "reference_losses": {str(k): v for k, v in sorted(losses.items())}}
prompt = list(range(5, 17))
tokens_in = torch.tensor([prompt])
for name, path in (("float", out / "run"), ("int8", out / "int8"), ("int4", out / "int4")):
    lm = load_model(path)
    with torch.no_grad():
        logits = lm.model(tokens_in)[0, -1]
    eng = Engine(lm.model, EngineConfig(max_batch_size=2, max_context=64), lm.tokenizer, lm.eos_ids)
    req = eng.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))[0]
    expected[name] = {"last_logits": logits.tolist(), "greedy_tokens": req.output_ids}
sd = load_file(str(ck / "model.safetensors"))
expected["weight_sums"] = {k: float(v.double().sum()) for k, v in sorted(sd.items())}
(out / "expected.json").write_text(json.dumps(expected, indent=1))
