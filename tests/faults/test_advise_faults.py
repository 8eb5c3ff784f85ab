"""`trainforge advise` only advises: it prints, writes the advised config only when asked
(--output, --apply), never into a run that is still training, and gives no KV-pool advice
from a `generate --stats` line (whose pool is sized for its one request)."""

from __future__ import annotations

import json

from tests.conftest import debug_config
from tests.plan.test_advise import make_run
from trainforge.cli import main
from trainforge.config import load_config


def test_advise_prints_and_writes_nothing_unless_asked(tmp_path, capsys):
    # A planted cause with a change to apply: the micro-batch merge (same global batch).
    run = make_run(tmp_path, {"training": {"batch_size": 1, "seq_len": 64, "grad_accum_steps": 8}}, mfu=0.01)
    before = sorted(p.name for p in run.iterdir())
    assert main(["advise", str(run), "--no_hardware_probe"]) == 0
    out = capsys.readouterr().out
    assert "2 keys would change; nothing written" in out
    assert sorted(p.name for p in run.iterdir()) == before  # no advised.toml, nothing else
    advised = tmp_path / "elsewhere" / "next.toml"
    advised.parent.mkdir()
    assert main(["advise", str(run), "--no_hardware_probe", "--output", str(advised)]) == 0
    assert load_config(advised).training.batch_size == 8
    assert sorted(p.name for p in run.iterdir()) == before


class _AdviseMidRun:
    """Callback: at ``step`` (after a logged window), run `trainforge advise` on the live run."""

    def __init__(self, step: int, argvs: list[list[str]], capsys):
        self.step, self.argvs, self.capsys, self.results = step, argvs, capsys, []

    def on_step_end(self, trainer, step):
        if step != self.step:
            return
        for argv in self.argvs:
            self.capsys.readouterr()
            rc = main(argv)
            self.results.append((rc, self.capsys.readouterr().err))


def test_advise_refuses_to_write_into_a_run_that_is_still_training(tmp_path, small_data, capsys):
    from trainforge.train.trainer import Trainer

    run = tmp_path / "run"
    outside = tmp_path / "outside.toml"
    cb = _AdviseMidRun(4, [["advise", str(run), "--apply", "--no_hardware_probe"],
                           ["advise", str(run), "--output", str(run / "advised.toml"), "--no_hardware_probe"],
                           ["advise", str(run), "--output", str(outside), "--no_hardware_probe"]], capsys)
    cfg = debug_config(small_data, "--training.steps", "6", "--training.log_interval", "2",
                       "--training.val_interval", "0", "--checkpoint.interval", "0")
    t = Trainer(cfg, run, callbacks=[cb], progress=False)
    try:
        t.fit()
        (rc_apply, err_apply), (rc_inside, err_inside), (rc_outside, _) = cb.results
        for rc, err in ((rc_apply, err_apply), (rc_inside, err_inside)):
            lines = err.strip().splitlines()
            assert rc == 2 and len(lines) == 1, err
            assert "still training" in lines[0] and ".train.lock" in lines[0] and str(run) in lines[0]
        assert not (run / "advised.toml").exists() and not (tmp_path / "run-advised").exists()
        assert rc_outside == 0 and outside.is_file()  # reading a live run and writing elsewhere is fine
        from trainforge.storage.locks import run_holder

        assert run_holder(run) is not None  # the trainer holds its marker while it lives
    finally:
        t.close()
    assert run_holder(run) is None  # closed: the marker is released (and dies with a killed process too)


def test_generate_stats_gives_no_kv_pool_advice(tmp_path, capsys):
    """`generate --stats` sizes its pool for its one request: the pool peaks at ~100% on every
    run. That is no evidence for a server's --n_blocks."""
    run = make_run(tmp_path)
    stats = {"submitted": 1, "rejected": 0, "generated_tokens": 64, "decode_s": 0.25, "prefill_tokens": 12,
             "running": 0, "waiting": 0, "peak_batch": 1, "decode_tokens_per_s": 256.0,
             "kv_pool": {"blocks_total": 5, "blocks_used": 0, "blocks_peak": 5, "block_utilisation": 0.0},
             "fusions": {"qkv": 2, "gate_up": 2}, "quant_kernels": {"int8pack": 14}}
    f = tmp_path / "stats.json"
    f.write_text(json.dumps(stats) + "\n")
    assert main(["advise", str(run), "--inference", str(f), "--json", "--no_hardware_probe"]) == 0
    out = json.loads(capsys.readouterr().out)
    flags = {k for s in out["suggestions"] for k in s["changes"]}
    assert "--n_blocks" not in flags and "--max_batch_size" not in flags, out["suggestions"]
    pool = next(c for c in out["checks"] if c["rule"] == "kv-pool-full")
    assert pool["status"] == "not applicable" and "generate --stats" in pool["why"]
