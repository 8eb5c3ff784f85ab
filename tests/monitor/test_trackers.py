"""Experiment trackers as sinks of the monitor, offline: a short debug run with
``[monitor] wandb = true`` (W&B offline mode) and ``mlflow = true`` (a sqlite store under
tmp), then resumed for more steps; every metric of metrics.jsonl arrives in both
trackers at its step, in one tracker run, with the config. TensorBoard of the same run:
hparams, and train and validation loss on one chart."""

import json
import struct
import tomllib
from types import SimpleNamespace

import pytest

from conftest import debug_config
from trainforge.config import load_config
from trainforge.errors import ConfigError
from trainforge.monitor.jsonl import read_jsonl
from trainforge.monitor.mlflow_sink import metric_key
from trainforge.monitor.tracker_run import config_params, record_metrics
from trainforge.train.trainer import Trainer

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

FIRST, STEPS = 4, 8


def _fit(cfg, run_dir, resume=False):
    t = Trainer(cfg, run_dir, resume=resume, progress=False)
    try:
        t.fit()
    finally:
        t.close()


@pytest.fixture(scope="module")
def run(small_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trackers")
    run_dir, wandb_dir = tmp / "run", tmp / "wandb"
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    wandb_dir.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)  # MLflow puts a sqlite store's artifacts in ./mlruns
        for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true",
                     "WANDB_CONSOLE": "off"}.items():
            mp.setenv(k, v)
        common = ["--training.log_interval", "2", "--training.val_interval", "2", "--training.threads", "1",
                  "--checkpoint.interval", str(FIRST), "--monitor.interval_steps", "2", "--monitor.tensorboard",
                  "true", "--monitor.wandb", "true", "--monitor.mlflow", "true",
                  "--monitor.mlflow_tracking_uri", uri, "--monitor.mlflow_experiment", "tf-test"]
        _fit(debug_config(small_data, "--training.steps", str(FIRST), *common), run_dir)
        first_ids = json.loads((run_dir / "trackers.json").read_text())
        _fit(debug_config(small_data, "--training.steps", str(STEPS), *common), run_dir, resume=True)
    return SimpleNamespace(run_dir=run_dir, wandb_dir=wandb_dir, uri=uri, first_ids=first_ids,
                           ids=json.loads((run_dir / "trackers.json").read_text()),
                           records=read_jsonl(run_dir / "metrics.jsonl"),
                           params=config_params(run_dir))


def expected(records) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of metrics.jsonl, flattened the way the trackers get it
    (the last record of a step wins, as in a tracker's row for that step)."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        for k, v in record_metrics(r):
            out.setdefault(k, {})[r["step"]] = v
    return out


def test_jsonl_has_the_metrics_a_user_looks_for(run):
    want = expected(run.records)
    assert {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s"} <= set(want)
    assert any(k.startswith("grad_norm_group/") for k in want)  # a nested dict, flattened
    assert sorted(want["loss"]) == list(range(1, STEPS + 1))  # both attempts


# -- W&B ---------------------------------------------------------------------------------

def _wandb_records(path):
    """The protobuf records of a W&B ``.wandb`` file (offline run). W&B 0.31 ships no
    Python reader; the file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of
    chunks (crc32 4 bytes, length 2, type 1: full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


@pytest.fixture(scope="module")
def wandb_run(run):
    files = sorted(run.wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    history: dict[str, dict[int, float]] = {}
    config, run_ids, names = {}, set(), set()
    for f in files:
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_ids.add(rec.run.run_id)
                names.add(rec.run.display_name)
                config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
            elif kind == "history":
                step = rec.history.step.num
                for item in rec.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        history.setdefault(key, {})[step] = json.loads(item.value_json)
    return SimpleNamespace(files=files, history=history, config=config, run_ids=run_ids, names=names)


def test_wandb_gets_every_metric_at_its_step(run, wandb_run):
    assert len(wandb_run.files) == 2  # one per attempt, offline
    want = expected(run.records)
    assert set(wandb_run.history) == set(want)
    for key, by_step in want.items():
        assert wandb_run.history[key] == pytest.approx(by_step, rel=1e-6), key


def test_wandb_resume_continues_one_run_named_after_the_run_dir(run, wandb_run):
    assert wandb_run.run_ids == {run.ids["wandb"]} and run.first_ids["wandb"] == run.ids["wandb"]
    assert wandb_run.names == {"run"}


def test_wandb_gets_the_config(run, wandb_run):
    assert run.params["training.steps"] == STEPS and run.params["model.flavor"] == "debug"
    got = {k: v for k, v in wandb_run.config.items() if k != "_wandb"}
    # the resumed attempt's config (steps = 8) wins over the first's
    assert got == run.params


# -- MLflow ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlflow_run(run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(run.uri)
    return SimpleNamespace(client=client, run=client.get_run(run.ids["mlflow"]))


def test_mlflow_gets_every_metric_at_its_step(run, mlflow_run):
    want = expected(run.records)
    assert set(mlflow_run.run.data.metrics) == {metric_key(k) for k in want}
    for key, by_step in want.items():
        history = mlflow_run.client.get_metric_history(run.ids["mlflow"], metric_key(key))
        assert sorted(m.step for m in history) == sorted(by_step), key  # each step once, none missing
        assert {m.step: m.value for m in history} == pytest.approx(by_step, rel=1e-6), key


def test_mlflow_resume_continues_one_run_with_the_config(run, mlflow_run):
    assert run.first_ids["mlflow"] == run.ids["mlflow"]
    info = mlflow_run.run.info
    assert info.run_name == "run" and info.status == "FINISHED"
    exp = mlflow_run.client.get_experiment_by_name("tf-test")
    assert [r.info.run_id for r in mlflow_run.client.search_runs([exp.experiment_id])] == [run.ids["mlflow"]]
    params = mlflow_run.run.data.params
    # params are immutable in MLflow: the first attempt's (steps = 4); the artifact is the last config
    assert params["training.steps"] == str(FIRST)
    assert set(params) == set(run.params) and params["model.flavor"] == "debug"
    local = mlflow_run.client.download_artifacts(run.ids["mlflow"], "config.toml", str(run.run_dir.parent))
    assert tomllib.loads(open(local).read())["training"]["steps"] == STEPS


def test_a_run_that_crashes_is_failed_in_mlflow_not_finished(small_data, tmp_path, monkeypatch):
    """The CLI's training loop closes the trackers with the outcome: a run ended by an
    exception shows FAILED in MLflow (it showed FINISHED, like a completed run)."""
    from mlflow.tracking import MlflowClient

    from trainforge.train.resume import fit as cli_fit
    from trainforge.train.stop_signals import StopSignals

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)
    cfg = debug_config(small_data, "--training.steps", "4", "--training.threads", "1", "--monitor.mlflow", "true",
                       "--monitor.mlflow_tracking_uri", uri, "--monitor.mlflow_experiment", "tf-crash")

    def crash(self, *a, **kw):
        raise RuntimeError("injected failure in the training step")
    monkeypatch.setattr(Trainer, "fit", crash)
    with pytest.raises(RuntimeError, match="injected"):
        cli_fit(cfg, tmp_path / "run", False, None, StopSignals())
    run_id = json.loads((tmp_path / "run" / "trackers.json").read_text())["mlflow"]
    assert MlflowClient(uri).get_run(run_id).info.status == "FAILED"


# -- TensorBoard -------------------------------------------------------------------------

def test_tensorboard_draws_train_and_val_loss_on_one_chart(run):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer(size_guidance={"scalars": 0})
    mux.AddRunsFromDirectory(str(run.run_dir / "tensorboard"))
    mux.Reload()
    assert set(mux.Runs()) == {".", "val"}
    tag = "model/trainforge_loss"
    train = {e.step: e.value for e in mux.Scalars(".", tag)}
    val = {e.step: e.value for e in mux.Scalars("val", tag)}  # same tag: the same chart
    want = expected(run.records)
    assert train == pytest.approx(want["loss"], rel=1e-6)
    assert val == pytest.approx(want["val_loss"], rel=1e-6)
    assert mux.Scalars("val", tag)[-1].value != mux.Scalars(".", tag)[-1].value


def test_tensorboard_hparams_hold_the_config_and_the_loss_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(run.run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hp = start.session_start_info.hparams
    assert hp["training.lr"].number_value == pytest.approx(run.params["training.lr"])
    assert hp["model.flavor"].string_value == "debug"
    assert set(hp) == set(run.params)
    exp = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in exp.metric_infos} == {"model/trainforge_loss", "model/trainforge_validation_loss"}
    assert "_hparams_/session_end_info" in content


# -- configuration -----------------------------------------------------------------------

def test_missing_tracker_package_fails_at_config_validation(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"monitor\.wandb.*pip install 'trainforge\[wandb\]'"):
        load_config(None, ["--monitor.wandb", "true"])
    load_config(None, ["--monitor.mlflow", "true"])  # the other one is installed


def test_bad_wandb_mode_names_the_key():
    with pytest.raises(ConfigError, match="monitor.wandb_mode"):
        load_config(None, ["--monitor.wandb_mode", "offlin"])


def test_only_rank_0_opens_tracker_runs(tmp_path, monkeypatch):
    """Ranks other than 0 get no metrics.jsonl path from the trainer, and no tracker run."""
    import torch
    from torch import nn

    from trainforge.monitor.monitor import Monitor
    from trainforge.monitor.section import MonitorSection

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    section = MonitorSection(wandb=True, mlflow=True, mlflow_tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
    model = nn.Linear(2, 2)
    dims = SimpleNamespace(world_size=2, pp=1, dp_replicate=2, dp_shard=1, tp=1)
    m = Monitor(section, None, [model], [torch.optim.SGD(model.parameters(), lr=0.1)], torch.device("cpu"), dims,
                SimpleNamespace(rank=1, local_rank=1), step_fn=lambda: 1)
    opened = list(m.trackers)
    m.write({"step": 1, "loss": 1.0})
    m.close()
    assert opened == [] and list(tmp_path.iterdir()) == []


def test_unusable_mlflow_uri_fails_before_training_naming_the_key(small_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = debug_config(small_data, "--monitor.mlflow", "true", "--monitor.mlflow_tracking_uri", "nosuch://x")
    with pytest.raises(ConfigError, match=r"monitor\.mlflow_tracking_uri.*nosuch://x"):
        Trainer(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or read_jsonl(tmp_path / "run" / "metrics.jsonl") == []
