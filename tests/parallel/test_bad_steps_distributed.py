"""Bad steps and early stopping with 2 ranks under torchrun (gloo, DDP): a non-finite loss
on one rank makes every rank skip (or stop) together with the weights unchanged,
repeated bad steps roll back to the checkpoint from before them, and an early-stopping
decision is rank 0's on every rank. One launch runs all four scenarios
(``workers/bad_steps_worker.py``)."""

from __future__ import annotations

import json

import pytest

from tests.parallel.torchrun import WORKERS, run_torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory, small_data):
    out = tmp_path_factory.mktemp("bad_steps")
    run_torchrun(WORKERS / "bad_steps_worker.py", 2, str(small_data), str(out), timeout_s=300)
    load = lambda name, r: json.loads((out / f"{name}_rank{r}.json").read_text())  # noqa: E731
    return {name: [load(name, 0), load(name, 1)] for name in ("skip", "stop", "rollback", "early")}


@pytest.mark.slow
def test_nan_on_one_rank_is_skipped_by_all_ranks_weights_unchanged(results):
    r0, r1 = results["skip"]
    for r in (r0, r1):
        w = r["weights"]
        assert w["4"] == w["3"] and w["5"] != w["4"]  # step 4 skipped, step 5 applied
        assert r["sched"]["4"] == r["sched"]["3"] and r["sched_final"] == 5  # LR not advanced at step 4
        assert r["summary"]["step"] == 6 and r["summary"]["bad_steps"]["skipped"] == 1
    assert r0["weights"] == r1["weights"] and r0["final"] == r1["final"]  # replicas never diverged
    (rec,) = [m for m in r0["metrics"] if "bad_step" in m]
    assert rec["step"] == 4 and rec["bad_step"] == "skip" and rec["step_loss"] is None
    assert len(rec["samples"]) == 8  # the global batch: 4 sequences x 2 ranks


@pytest.mark.slow
def test_nan_on_one_rank_with_on_nonfinite_stop_stops_all_ranks(results):
    r0, r1 = results["stop"]
    for r in (r0, r1):
        assert r["summary"]["step"] == 3 and "non-finite" in r["summary"]["stop_reason"]
        assert not r["summary"]["early_stopped"]
        assert r["weights"]["3"] == r["weights"]["2"] == r["final"]  # the checkpoint holds the last good weights
    ckpts = [m["checkpoint"] for m in r0["metrics"] if "checkpoint" in m]
    assert ckpts and ckpts[-1].endswith("step_0000003")


@pytest.mark.slow
def test_repeated_bad_steps_roll_back_to_the_checkpoint_before_them(results):
    for r in results["rollback"]:
        back = r["after_rollback"]
        # Bad steps 4 and 5: the checkpoint at 4 was saved inside the bad run, so the
        # rollback goes to step 2, with the data moved past the 5 batches already read.
        assert back["step"] == 2 and back["weights"] == r["weights"]["2"]
        assert back["data"]["position"] == 5
        assert r["summary"]["step"] == 8 and r["summary"]["stop_reason"] is None
        assert r["summary"]["bad_steps"]["rollbacks"] == 1
    r0, r1 = results["rollback"]
    assert r0["final"] == r1["final"]
    events = [(m["step"], m.get("bad_step") or "rolled back") for m in r0["metrics"]
              if "bad_step" in m or "rolled_back_from_step" in m]
    assert events == [(4, "skip"), (5, "rollback"), (2, "rolled back")]


@pytest.mark.slow
def test_early_stop_decision_is_rank_0s_on_every_rank(results):
    for r in results["early"]:
        assert r["summary"]["step"] == 8 and r["summary"]["early_stopped"]
        assert "patience" in r["summary"]["stop_reason"]
