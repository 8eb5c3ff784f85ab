"""The planner ranks what the cost model prices, and `trainforge plan` shows it: a table,
valid JSON, and a TOML config that `trainforge train --config` loads with the batch
semantics the trainer uses. Shapes only: nothing here builds a model."""

import json

import pytest

from trainforge.cli import main
from trainforge.config import load_config
from trainforge.model.config import FLAVORS
from trainforge.plan.hardware import cluster
from trainforge.plan.planner import config_toml, enumerate_layouts, plan
from trainforge.plan.spec import Workload


def test_enumerated_layouts_use_every_gpu_and_split_the_batch_evenly():
    w = Workload(FLAVORS["small"], seq_len=256, global_batch=16)
    layouts = list(enumerate_layouts(w, 8))
    assert layouts and all(lay.n_gpus == 8 for lay in layouts)
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8} and {lay.pp for lay in layouts} == {1, 2, 4, 8}
    for lay in layouts:
        assert (16 // lay.dp) % lay.grad_accum_steps == 0
        assert ((16 // lay.dp) // lay.grad_accum_steps) % lay.microbatches == 0


def test_a_model_that_fits_one_gpu_is_best_trained_data_parallel():
    ranked = plan(Workload(FLAVORS["small"], seq_len=1024, global_batch=64, flavor="small"), cluster("h100", 8))
    feasible = [e.feasible for e in ranked]
    assert feasible[0] and feasible == sorted(feasible, reverse=True)  # feasible first
    steps = [e.step_s for e in ranked if e.feasible]
    assert steps == sorted(steps)
    best = ranked[0].layout
    assert (best.tp, best.pp, best.dp) == (1, 1, 8)


def test_a_model_too_large_for_the_cluster_comes_back_infeasible_with_reasons():
    ranked = plan(Workload(FLAVORS["llama-405b"], seq_len=8192, global_batch=16), cluster("h100", 8), top=5)
    assert ranked and not any(e.feasible for e in ranked)
    assert all(e.why for e in ranked) and "GiB per GPU" in ranked[0].why


def test_cli_prints_a_table(capsys):
    rc = main(["plan", "--model", "small", "--gpus", "8", "--gpu", "h100", "--seq_len", "1024", "--top", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    for words in ("small on 8 x h100", "tokens/s/GPU", "MFU", "bubble", "dp_shard="):
        assert words in out


def test_cli_json_is_valid_and_ranked(capsys):
    rc = main(["plan", "--model", "llama-8b", "--gpus", "16", "--gpu", "a100-80g", "--seq_len", "4096",
               "--global_batch", "32", "--top", "4", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["gpu"] == "a100-80g" and len(doc["layouts"]) == 4
    steps = [row["step_s"] for row in doc["layouts"]]
    assert all(row["feasible"] for row in doc["layouts"]) and steps == sorted(steps)
    assert {"dp_shard", "tp", "pp", "microbatches", "pp_schedule"} <= doc["layouts"][0]["layout"].keys()


def test_cli_output_is_a_config_train_loads_with_the_trainers_batch_semantics(tmp_path, capsys):
    out = tmp_path / "best.toml"
    rc = main(["plan", "--model", "llama-8b", "--gpus", "8", "--gpu", "h100", "--seq_len", "8192",
               "--global_batch", "64", "--output", str(out)])
    assert rc == 0 and out.is_file()
    cfg = load_config(out)
    par, tr = cfg.parallel, cfg.training
    dp = par.dp_replicate * par.dp_shard
    assert cfg.model.flavor == "llama-8b" and tr.seq_len == 8192
    assert par.dp_replicate * par.dp_shard * par.tp * par.pp == 8
    assert tr.batch_size * dp * tr.grad_accum_steps == 64  # tokens_per_step = batch_size x seq x accum x dp
    assert cfg.precision.policy == "bf16-mixed"


def test_cli_compile_predicts_the_fused_stack_and_writes_parallel_compile(tmp_path, capsys):
    argv = ["plan", "--model", "llama-8b", "--gpus", "8", "--gpu", "h100", "--seq_len", "8192",
            "--global_batch", "64", "--top", "1", "--json"]
    assert main(argv) == 0
    eager = json.loads(capsys.readouterr().out)
    out = tmp_path / "best.toml"
    assert main(argv + ["--compile", "--output", str(out)]) == 0
    fused = json.loads(capsys.readouterr().out)
    assert (eager["stack"], fused["stack"]) == ("trainforge", "trainforge-compile")
    # compile fuses the elementwise kernels: the same layout is predicted faster, and the
    # config written is the one the prediction assumed
    assert fused["layouts"][0]["step_s"] < eager["layouts"][0]["step_s"]
    assert load_config(out).parallel.compile is True


def test_config_toml_of_a_pipeline_layout_loads(tmp_path):
    w = Workload(FLAVORS["llama-8b"], seq_len=2048, global_batch=32, flavor="llama-8b", compression="int8")
    est = next(e for e in plan(w, cluster("h100", 16)) if e.layout.pp > 1 and e.feasible)
    path = tmp_path / "pp.toml"
    path.write_text(config_toml(w, est, header="pipeline"))
    cfg = load_config(path)
    assert cfg.parallel.pp == est.layout.pp and cfg.parallel.microbatches == est.layout.microbatches
    assert cfg.training.batch_size % cfg.parallel.microbatches == 0 and cfg.compression.codec == "int8"


@pytest.mark.parametrize("argv,words", [(["--gpu", "v100"], "h100"), (["--precision", "int3"], "bf16-mixed")])
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, words):
    rc = main(["plan", "--model", "small", "--gpus", "8", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err


@pytest.mark.parametrize("argv,words", [(["--gpu", "h100", "--calibrate"], "--gpu measured"),
                                        (["--gpu", "measured", "--calibrate"], "--precision fp32"),
                                        (["--machine", "measured", "--calibrate"], "--precision fp32"),
                                        (["--machine", "measured", "--gpu", "h100"], "two clusters")])
def test_cli_calibrate_names_what_it_needs(capsys, argv, words):
    rc = main(["plan", "--model", "tiny", "--gpus", "2", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err


def test_cli_calibrate_plans_on_the_calibrated_machine(monkeypatch, capsys):
    """--gpu measured --calibrate: the probed cluster, calibrated to the model (here with
    stand-in measurements), is what the layouts are priced on."""
    from tests.plan.test_calibration import _samples
    from tests.plan.test_probe import _profile
    from trainforge.plan import calibration, probe

    monkeypatch.setattr(probe, "measured_cluster", lambda n: probe.cluster_from_profile(_profile(n=n)))
    asked = []

    def fake_samples(workload, batch_sizes=None, n_procs=()):
        asked.append((workload.flavor, tuple(n_procs)))
        return _samples()
    monkeypatch.setattr(calibration, "measure_samples", fake_samples)
    rc = main(["plan", "--model", "debug", "--gpus", "2", "--machine", "measured", "--calibrate", "--precision", "fp32",
               "--seq_len", "32", "--global_batch", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and asked == [("debug", (2,))]
    plain = plan(Workload(FLAVORS["debug"], seq_len=32, global_batch=8, precision="fp32", flavor="debug"),
                 probe.cluster_from_profile(_profile(n=2)))
    # the calibration's overheads and efficiency slow every layout down against the bare probe
    assert min(r["step_s"] for r in out["layouts"]) > min(e.step_s for e in plain if e.feasible)


def test_render_is_callable_without_the_cli():
    """plan/render.py: an infeasible layout's infinite time and memory are JSON null (not Infinity,
    which json.loads of other languages refuses), and the label names the degrees above 1."""
    from trainforge.plan.render import estimate_json, layout_label, plan_json

    work = Workload(FLAVORS["llama-405b"], seq_len=8192, global_batch=16, flavor="llama-405b")
    ranked = plan(work, cluster("h100", 8), top=3)
    doc = plan_json(ranked, work, cluster("h100", 8), 8)
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc  # no NaN / Infinity anywhere
    bad = estimate_json(ranked[0])
    assert not bad["feasible"] and bad["why"] and bad["step_s"] is None
    assert "dp_shard=" in layout_label(ranked[0].layout)
    assert doc["model"] == "llama-405b" and doc["gpus"] == 8 and len(doc["layouts"]) == 3


def test_output_carries_the_lr_rule_so_every_layout_of_the_batch_trains_at_one_lr(tmp_path, capsys):
    out = tmp_path / "best.toml"
    rc = main(["plan", "--model", "small", "--gpus", "8", "--global_batch", "64", "--seq_len", "1024", "--top", "1",
               "--lr", "3e-4", "--lr_scaling", "sqrt", "--lr_reference_batch", "16", "--output", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and "sqrt(global batch 64 sequences / reference 16) = x2: peak lr 3e-4 -> 6e-4" in printed
    cfg = load_config(out)
    assert (cfg.training.lr, cfg.optimizer.lr_scaling, cfg.optimizer.lr_reference_batch) == (3e-4, "sqrt", 16)
    assert "peak lr 3e-4 -> 6e-4" in out.read_text().splitlines()[2]  # said in the header too
    rc = main(["plan", "--model", "small", "--gpus", "8", "--lr_scaling", "linear"])
    assert rc == 2 and "--lr" in capsys.readouterr().err
