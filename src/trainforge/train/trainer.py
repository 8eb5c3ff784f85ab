"""The training loop: gradient accumulation, AdamW, clipping, warmup + decay LR
schedules, periodic validation, throughput and MFU, JSONL metrics, atomic checkpoints
and bit-exact resume. Training control (adaptive LR, early stopping, bad-step
handling; ``control.py``) is off unless configured.

Parallelism (``parallel/apply.py``), precision (``train/mixed_precision.py`` over
``trainforge.precision``) and compression plug in from outside; the loop stays the
same. The only way anything outside the loop stops training is ``request_stop``
(callbacks use it; signals too, once all ranks agreed: ``stop_signals.py``): the loop
then saves a checkpoint at the current step and returns, so nothing done is lost.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainforge.compression.hooks import build_compressor, check_compression
from trainforge.config_base import config_to_dict, config_to_toml
from trainforge.data.pipeline import build_loader, open_data
from trainforge.errors import CheckpointError, ConfigError
from trainforge.log import get_logger
from trainforge.model import build_model, model_config_from_section
from trainforge.model.preflight import check_training, check_writable_dir
from trainforge.monitor import Monitor
from trainforge.parallel.apply import build_pipeline_parts, check_pipeline_layout, parallelize_module_stack
from trainforge.parallel.data_parallel import data_parallel_kind
from trainforge.parallel.dims import ParallelDims, dp_rank
from trainforge.parallel.distributed import init_distributed
from trainforge.parallel.tensor_parallel import cross_entropy_loss, loss_context
from trainforge.precision.casting import apply_precision
from trainforge.precision.policy import build_policy
from trainforge.train import checkpoint as ckpt
from trainforge.train import control
from trainforge.train import dist_checkpoint as dckpt
from trainforge.train.bad_steps import StepAction
from trainforge.train.chunked_loss import check_chunked_loss, chunked_cross_entropy, hidden_states
from trainforge.train.lr_schedule import build_scheduler, warmup_decay
from trainforge.train.metrics import ConsoleReporter, JsonlSink
from trainforge.train.mfu import matmul_peak_flops
from trainforge.train.mixed_precision import TrainerPrecision, check_precision_layout, compile_note
from trainforge.train.optimizer import build_optimizer
from trainforge.train.stop_signals import StopSignals, check_finite
from trainforge.train.step_stats import CommShareProbe, peak_memory_bytes

if TYPE_CHECKING:  # handed in by the CLI: trainforge.config composes train's sections, so train/ sits below it
    from trainforge.config import Config

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.toml"
COMPRESSION_DIR = "compression"


class _NullSink:
    """Metrics sink of non-zero ranks: rank 0 writes the run's files."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Callback(Protocol):
    """Observes named training events; may only influence training via ``trainer.request_stop``.

    Events: ``on_step_end(trainer, step)`` after every step; optionally
    ``on_evaluation(trainer, step, val_loss) -> dict | None`` after every validation
    (step 0 included), whose returned record is merged into the ``val_loss`` metrics
    line. A stop requested in ``on_evaluation`` is rank 0's decision on every rank.
    A callback with ``state_dict``/``load_state_dict`` is checkpointed under its
    ``state_key`` (default: its class name)."""

    def on_step_end(self, trainer: "Trainer", step: int) -> None: ...


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"config key 'training.device' = {name!r}: CUDA is not available here; use auto or cpu")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Builds data, model, optimizer and schedule from ``cfg`` and trains into ``run_dir``.

    ``resume=True`` continues from the newest complete checkpoint in ``run_dir`` (or the
    one at ``from_step``; later ones are then moved to ``checkpoints/superseded/``); the
    continued run reproduces an uninterrupted one bit for bit (same device and thread
    count). A corrupt newest checkpoint is refused unless ``checkpoint.fallback``.
    Nothing is written to ``run_dir`` until data, model and checkpoint all loaded."""

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False,
                 callbacks: list[Callback] | None = None, progress: bool = True, from_step: int | None = None):
        self.cfg, self.run_dir, self.callbacks = cfg, Path(run_dir), list(callbacks or [])
        self.log = get_logger()
        self.progress = progress
        tcfg = cfg.training
        self.device = pick_device(tcfg.device)
        if tcfg.threads:
            torch.set_num_threads(tcfg.threads)
        self.dist = init_distributed(self.device.type, timeout_s=cfg.distributed.timeout_s)
        if self.device.type == "cuda" and self.dist.world_size > 1:
            self.device = torch.device("cuda", self.dist.local_rank)
        self.is_main = self.dist.is_main
        # Layout errors surface here, before any collective, identically on every rank.
        self.dims = ParallelDims.resolve(cfg.parallel, self.dist.world_size)
        ckpt_root = self.run_dir / "checkpoints"
        # Decided from meta.json files alone, so every rank picks the same list (nothing of
        # this job writes there before the first collective); corrupt ones are found on load.
        warn = self.log.warning if self.is_main else (lambda msg: None)
        candidates = ckpt.resume_candidates(self.run_dir, from_step, warn) if resume else []
        if not resume and ckpt.list_checkpoints(ckpt_root):
            raise CheckpointError(f"run directory {self.run_dir} already has checkpoints; continue it with "
                                  f"--resume {self.run_dir} (or --resume auto), or pass a new --run_dir")
        # A read-only or immutable run directory fails here, naming it, not at the first save (every rank
        # writes checkpoint shards there, so every rank checks: the same error everywhere).
        check_writable_dir(self.run_dir, "run directory")
        seed_everything(tcfg.seed)

        # Local shards are memory-mapped; a URL or data.cache.dir reads through the tiered cache.
        self.data = open_data(cfg.data, self.dist.rank, self.dist.world_size, log=self.log.warning)
        self.model_config = model_config_from_section(cfg.model, self.data.vocab_size, tcfg.seq_len)
        # Before anything is allocated: refuse, naming the key, a run this machine cannot hold.
        check_training(self.model_config, cfg.model.flavor, tcfg.batch_size, tcfg.seq_len, self.device,
                       state_shards=self.dims.dp_shard * self.dims.tp * self.dims.pp, layer_shards=self.dims.pp,
                       tp=self.dims.tp, activation_checkpointing=cfg.parallel.activation_checkpointing == "full",
                       loss_chunk_tokens=tcfg.loss_chunk_tokens)
        self.dims.check_model(self.model_config)
        pp_layout = None
        if self.dims.pp > 1:
            pp_layout = check_pipeline_layout(self.model_config, self.dims, cfg.parallel, tcfg.batch_size)
        check_chunked_loss(tcfg.loss_chunk_tokens, self.dims)
        warning = check_compression(cfg.compression, self.dims, data_parallel_kind(self.dims))
        if warning and self.is_main:
            self.log.warning(warning)
        # Resolved identically on every rank (a hardware probe, agreed by one all-reduce
        # unless compute is fp32), so a refused combination fails everywhere before the mesh.
        policy = build_policy(cfg.precision, self.device, log=self.log if self.is_main else None)
        note = check_precision_layout(policy, self.dims, data_parallel_kind(self.dims))
        if note and self.is_main:
            self.log.info(f"precision: {note}")
        self.mesh = self.dims.build_mesh(self.device.type)  # the first collective
        self.compressor = build_compressor(cfg.compression, self.dims,
                                           self.mesh["dp_replicate"].get_group() if self.mesh else None,
                                           self.device, tcfg.seed, log=self.log.info if self.is_main else None)
        # Every rank builds the full model from the same seed, then keeps its part:
        # sharded/split results equal the single-process model's.
        full_model = build_model(self.model_config, self.device, seed=tcfg.seed)
        # Precision first (parallel/apply.py's step 0): casts, fp32 master copy, autocast rule wrappers.
        sharded = data_parallel_kind(self.dims) in ("fsdp", "hsdp")
        runtime = apply_precision(full_model, policy, sharded=sharded)
        note = compile_note(runtime) if cfg.parallel.compile else None
        if note and self.is_main:
            self.log.info(f"precision: {note}")
        self.mp = TrainerPrecision(cfg.precision, policy, runtime, self.device, sharded=sharded,
                                   log=self.log if self.is_main else None,
                                   pp_group=self.mesh["pp"].get_group() if self.dims.pp > 1 else None)
        self.pipeline = None
        self.pp_predicted: list[float] | None = None
        if self.dims.pp > 1:
            # Each rank keeps its pipeline stages ("model parts"), FQNs unchanged.
            self.pipeline, self.model_parts, self.pp_predicted = build_pipeline_parts(
                full_model, self.mesh, self.dims, cfg.parallel, self.device, tcfg.batch_size, tcfg.seq_len,
                pp_layout, self._pipeline_loss, log=self.log.info if self.is_main else None,
                compressor=self.compressor, precision=policy)
            self.model = None
            runtime.rebind(torch.nn.ModuleList(self.model_parts))  # the stages are copies; free the whole model
        else:
            self.model = parallelize_module_stack(full_model, self.mesh, self.dims, cfg.parallel, self.device,
                                                  self.compressor, precision=policy)
            self.model_parts = [getattr(self.model, "module", self.model)]  # DDP wraps; state dicts use raw FQNs
        del full_model
        # What the optimizers step, clipping measures and checkpoints hold: the fp32 master
        # copy when parameters are stored low (same FQNs), else the model parts.
        self.opt_parts = self.mp.opt_parts(self.model_parts)
        # One optimizer and schedule per part (identical settings): optimizer state stays keyed by FQN.
        self.optimizers = [build_optimizer(part, cfg.optimizer, tcfg.lr, self.device,
                                           distributed=self.dims.world_size > 1) for part in self.opt_parts]
        self.schedulers = [build_scheduler(o, *self._schedule_args()) for o in self.optimizers]
        # Training control; each None (absent) unless its section enables it.
        self.adaptive_lr = cfg.adaptive_lr.build()
        self.bad_steps = cfg.bad_steps.build()
        self._step_decision = None  # the bad-step policy's verdict on the latest step
        early_stop = cfg.early_stop.build(tcfg.steps)
        if early_stop is not None:
            self.callbacks.append(early_stop)
        self.early_stopped = False
        # Train batches are assembled (and on CUDA staged to the device) ahead of use, in the
        # deterministic order of data/sampler.py; the loader's position goes into checkpoints.
        self.train_batches = build_loader(self.data, "train", cfg.data, tcfg.seq_len, tcfg.batch_size, tcfg.seed,
                                          rank=dp_rank(self.mesh), world_size=self.dims.dp, device=self.device)
        val_stream = build_loader(self.data, "val", cfg.data, tcfg.seq_len, tcfg.batch_size, tcfg.seed,
                                  rank=dp_rank(self.mesh), world_size=self.dims.dp, train=False)
        # A fixed validation set (the first global batches, in order; each data-parallel rank
        # holds its slice), so val_loss is comparable across steps and across layouts.
        self.val_set = [val_stream.next() for _ in range(min(tcfg.val_batches, val_stream.batches_per_epoch))]
        self.tokens_per_step = tcfg.batch_size * tcfg.seq_len * tcfg.grad_accum_steps * self.dims.dp
        self.flops_per_token = self.model_config.flops_per_token(tcfg.seq_len)
        # MFU is per device: achieved FLOP/s of the job over (peak of one device x devices).
        self.peak_flops = matmul_peak_flops(self.device) * self.dims.world_size
        self.comm_probe = CommShareProbe(self.device)
        # Memory per dtype on the next train_step (fit sets it for the last step of each
        # logging window; set it yourself when calling train_step directly).
        self.measure_memory = False
        self.step = 0
        self._last_balance_step = 0
        self.stop_reason: str | None = None
        resume_from = None
        if candidates:
            resume_from = ckpt.load_first_valid(candidates, self._load, cfg.checkpoint.fallback,
                                                explicit=from_step is not None, warn=warn)
        # The shards of the first train batch are fetched and verified now (tiered cache: a bad or
        # unreachable shard fails here, before config.toml or metrics.jsonl exist).
        self.train_batches.verify_next()

        # Everything loaded: only now touch the run directory (rank 0 writes shared files).
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            (self.run_dir / CONFIG_FILE).write_text(config_to_toml(cfg))
            if resume_from is not None:
                # One timeline: checkpoints after the one loaded (--from_step, fallback) move aside.
                aside = ckpt.set_aside_newer(ckpt_root, self.step, self.run_dir / METRICS_FILE)
                if aside is not None:
                    self.log.warning(f"resumed from step {self.step}: the later checkpoints and a copy of "
                                     f"{METRICS_FILE} moved to {aside}")
                JsonlSink.truncate_after(self.run_dir / METRICS_FILE, self.step)
            else:  # a fresh start replaces the records of an attempt that never checkpointed
                JsonlSink.truncate_after(self.run_dir / METRICS_FILE, -1)
        # Every record goes through the monitor: JSONL on rank 0, registry, Prometheus/TensorBoard.
        self.metrics = Monitor(cfg.monitor, self.run_dir / METRICS_FILE if self.is_main else None, self.model_parts,
                               self.optimizers, self.device, self.dims, self.dist, step_fn=lambda: self.step,
                               opt_parts=self.opt_parts)
        n_params = self.model_config.num_params()
        self.log.info(f"model {cfg.model.flavor}: {n_params / 1e6:.2f}M parameters, vocab {self.data.vocab_size}; "
                      f"data {self.data.path} ({self.data.num_tokens('train'):,} train tokens); device {self.device}; "
                      f"layout {self.dims} ({data_parallel_kind(self.dims)})")

    # -- control -------------------------------------------------------------------

    stop_kind: str | None = None  # who asked for the stop: request, signal, bad_steps, early_stop

    def request_stop(self, reason: str, kind: str = "request") -> None:
        """Ask the loop to stop after the current step (it checkpoints first). In a
        multi-process run every rank must ask at the same step (all callers here decide
        on all-reduced or broadcast values; signals go through ``stop_signals``)."""
        if self.stop_reason is None:
            self.stop_reason, self.stop_kind = reason, kind

    # -- checkpointing -----------------------------------------------------------------

    def _train_state(self) -> dict[str, Any]:
        state = {"step": self.step, "scheduler": self.schedulers[0].state_dict(),
                 "data": self.train_batches.state_dict(), "rng": ckpt.capture_rng_state(),
                 **control.control_state(self.adaptive_lr, self.bad_steps, self.callbacks)}
        precision = self.mp.state_dict()  # loss scaler, dynamic controller; None for fp32 runs
        if precision is not None:
            state["precision"] = precision
        return state

    def save(self) -> Path:
        """Write a checkpoint (collective when distributed). Single process: full weights
        as safetensors; several: DCP shards that any other layout can load."""
        t0 = time.perf_counter()
        root = self.run_dir / "checkpoints"
        args = (config_to_dict(self.cfg), dataclasses.asdict(self.model_config), self.data.tokenizer_path,
                self.cfg.checkpoint.keep_last)
        self.mp.resolve_pending(self._mean_over_dp)  # collective: every rank, before rank 0 writes
        if self.dims.world_size == 1:
            state = self._train_state()
            state["optimizer"] = dckpt.model_and_optim_state(self.opt_parts, self.optimizers)["optim"]
            path = ckpt.save_checkpoint(root, self.step, self.opt_parts[0], state, *args)
        else:
            tmp = ckpt.begin_checkpoint(root, self.step) if self.is_main else root / f".{ckpt.step_dir_name(self.step)}.tmp"
            dist.barrier()
            dckpt.save_sharded(tmp, self.opt_parts, self.optimizers)
            (tmp / "rng").mkdir(exist_ok=True)
            torch.save(ckpt.capture_rng_state(), tmp / "rng" / f"rank_{self.dist.rank:05d}.pt")
            if self.compressor is not None:  # residuals differ per rank
                (tmp / COMPRESSION_DIR).mkdir(exist_ok=True)
                torch.save(self.compressor.state_dict(), tmp / COMPRESSION_DIR / f"rank_{self.dist.rank:05d}.pt")
            dist.barrier()
            path = root / ckpt.step_dir_name(self.step)
            if self.is_main:
                state = self._train_state()
                del state["rng"]  # per rank, under rng/
                path = ckpt.finalize_checkpoint(root, tmp, self.step, state, *args)
            dist.barrier()
        self.metrics.write({"step": self.step, "checkpoint": str(path),
                            "checkpoint_save_s": round(time.perf_counter() - t0, 4)})
        return path

    def _load(self, path: Path, rollback: bool = False) -> None:
        """Restore the checkpoint at ``path``. ``rollback``: keep the live data position
        (so the batches since the checkpoint are not replayed) and bad-step policy."""
        meta = ckpt.read_meta(path)
        ckpt.check_model_compatible(meta, self.model_config, path)
        tok_digest = meta["files"].get(ckpt.TOKENIZER_FILE)
        if tok_digest is not None and tok_digest != self.data.manifest["tokenizer"]["sha256"]:
            raise CheckpointError(f"checkpoint {path} was trained with another tokenizer than {self.data.path}; "
                                  "resume with the same data.path")
        state = ckpt.load_train_state(path, self.device)
        try:
            if (path / dckpt.SHARDED_DIR).is_dir():
                dckpt.load_sharded(path, self.opt_parts, self.optimizers)
            else:
                weights = ckpt.load_full_weights(path, self.model_config.tie_embeddings)
                dckpt.load_full(self.opt_parts, self.optimizers, weights, state["optimizer"])
            if self.mp.master is not None:
                self.mp.master.master_to_model()
            for sched in self.schedulers:
                sched.load_state_dict(state["scheduler"])
            self.mp.load_state_dict(state.get("precision"))
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: model/optimizer/scheduler/precision state does not fit this run "
                                  f"({e})") from None
        control.load_control_state(state, self.adaptive_lr, None if rollback else self.bad_steps, self.callbacks)
        self._keep_configured_schedule()
        if self.adaptive_lr is not None:
            for opt, sched in zip(self.optimizers, self.schedulers):
                self.adaptive_lr.apply(opt, sched)
        if not rollback:
            self.train_batches.load_state_dict(state["data"])
        rng_file = path / "rng" / f"rank_{self.dist.rank:05d}.pt"
        if "rng" in state:
            ckpt.restore_rng_state(state["rng"])
        elif rng_file.is_file():  # same rank existed when saved; other layouts keep the seeded state
            ckpt.restore_rng_state(ckpt.load_tensor_file(rng_file), rng_file)
        self._load_compression(path)
        self.step = int(state["step"])
        self._last_balance_step = self.step
        self.log.info(f"{'rolled back to' if rollback else 'resumed from'} {path} at step {self.step}")

    def _load_compression(self, path: Path) -> None:
        """Error-feedback residuals, bit widths and warm-up count of this rank, if saved."""
        if self.compressor is None:
            return
        f = path / COMPRESSION_DIR / f"rank_{self.dist.rank:05d}.pt"
        if not f.is_file():
            if self.is_main:
                self.log.warning(f"{path} has no compression state for this layout: error-feedback residuals "
                                 "start at zero and the warm-up restarts")
            return
        try:
            warning = self.compressor.load_state_dict(ckpt.load_tensor_file(f, self.device))
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{f}: compression state does not load ({e}); delete the compression/ "
                                  "folder of that checkpoint to start residuals afresh") from None
        if warning and self.is_main:
            self.log.warning(warning)

    def _keep_configured_schedule(self) -> None:
        """A resumed scheduler carries the schedule it was saved with. When the user
        changed it on resume (e.g. ``--training.steps`` to extend a run, or a new
        ``--training.lr``), follow the config from the current step on, and say so."""
        tcfg = self.cfg.training
        want = warmup_decay(*self._schedule_args())
        have = self.schedulers[0].lr_lambdas[0]
        if vars(have) == vars(want) and self.schedulers[0].base_lrs[0] == tcfg.lr:
            return
        self.log.info(f"LR schedule changed on resume: {vars(have)} lr {self.schedulers[0].base_lrs[0]} -> "
                      f"{vars(want)} lr {tcfg.lr}")
        for sched, opt in zip(self.schedulers, self.optimizers):
            sched.lr_lambdas = [want] * len(opt.param_groups)  # every group (decay, no-decay)
            sched.base_lrs = [tcfg.lr] * len(opt.param_groups)
            for group in opt.param_groups:
                group["initial_lr"] = tcfg.lr
                group["lr"] = tcfg.lr * want(sched.last_epoch)
            sched._last_lr = [g["lr"] for g in opt.param_groups]
            if self.adaptive_lr is not None:
                self.adaptive_lr.apply(opt, sched)

    def _schedule_args(self) -> tuple:
        t = self.cfg.training
        return t.lr_schedule, t.warmup_steps, t.steps, t.min_lr_ratio, t.decay_ratio, t.decay_shape

    # -- steps -----------------------------------------------------------------------

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in fp32. Under TP with loss parallel the logits are a
        vocab-sharded DTensor and this must run (with its backward) in ``_loss_ctx``."""
        chunk = self.cfg.training.loss_chunk_tokens
        if chunk:  # never the whole (B, T, V) logits (train/chunked_loss.py)
            owner = self.model_parts[0]
            return chunked_cross_entropy(hidden_states(self.model, owner, inputs), owner.output, targets, chunk)
        logits = self.model(inputs)  # (B, T, V)
        return cross_entropy_loss(logits, targets)

    def _loss_ctx(self):
        return loss_context(self.dims.tp > 1 and self.cfg.parallel.loss_parallel)

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Each microbatch's mean, scaled so accumulated micro-batches sum to the mean; the
        # schedule runs backward on what this returns, so fp16 loss scaling goes here.
        return self.mp.scaler.scale(cross_entropy_loss(logits, targets) / self.cfg.training.grad_accum_steps)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optimizers[0]

    @property
    def scheduler(self):
        return self.schedulers[0]

    @property
    def raw_model(self) -> torch.nn.Module:
        """The single-device model (single-process and non-pipelined runs)."""
        return self.model_parts[0]

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over ``grad_accum_steps`` micro-batches.
        Returns (mean loss, pre-clip grad norm) as device tensors: no host sync here,
        unless the bad-step guard is on (see ``control.py``); its verdict on this step
        is then in ``self._step_decision``, and a step it rejects changes no weights,
        optimizer state or LR."""
        tcfg = self.cfg.training
        for part in self.model_parts:
            part.train()
        data_before = (self.train_batches.epoch, self.train_batches.position)
        total = torch.zeros((), device=self.device)
        mp = self.mp
        # Saved activations are counted on one forward per logging window (not through a
        # pipeline schedule, whose tracking would hold every microbatch's activations).
        track = self.measure_memory and self.pipeline is None and not self.cfg.parallel.compile
        for micro in range(tcfg.grad_accum_steps):
            inputs, targets = self.train_batches.next()
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with self._loss_ctx():
                if self.pipeline is not None:
                    # The schedule runs forward and backward; the loss exists on the last stage only.
                    with mp.autocast():
                        loss = self.pipeline.step(inputs, targets)
                    if loss is not None:
                        total += mp.unscale_loss(loss)
                    continue
                with mp.autocast(track_activations=track and micro == 0):
                    loss = self._loss(inputs, targets) / tcfg.grad_accum_steps
                mp.scaler.scale(loss).backward()
            total += loss.detach()
        mp.unscale_(self.optimizers)
        group_norms = mp.group_grad_norms(self.opt_parts, self._global_norm)  # pre-clip, as grad_norm
        grad_norm = self._clip_gradients(tcfg.grad_clip)
        if self.measure_memory:
            mp.record_memory(self.model_parts, self.optimizers, with_activations=track)
        if self.bad_steps is not None:
            self._judge_step(total, grad_norm, data_before)
        apply = control.applies_update(self._step_decision)
        for opt, sched in zip(self.optimizers, self.schedulers):
            if apply:
                mp.scaler.step(opt)  # opt.step(), unless an fp16 overflow skips it
            opt.zero_grad(set_to_none=True)
            if apply:
                sched.step()
                if self.adaptive_lr is not None:
                    self.adaptive_lr.apply(opt, sched)
        mp.finish_step(self.step + 1, total, grad_norm, group_norms)
        if self.compressor is not None:
            self.compressor.end_step()
        return total, grad_norm

    def _judge_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, data_before: tuple[int, int]) -> None:
        """Feed the policy this step's global values (identical on every rank) and keep its
        verdict; a non-OK verdict is written to the metrics with the step's sample ids."""
        loss_v, norm_v = control.step_health(loss, grad_norm, self.dims.world_size, self.dims.dp, self.dims.tp)
        decision = self.bad_steps.observe(self.step + 1, loss_v, norm_v)
        self._step_decision = decision
        if decision.action is not StepAction.OK:
            batches = control.step_batches(*data_before, self.cfg.training.grad_accum_steps,
                                           self.train_batches.batches_per_epoch)
            self.metrics.write(control.bad_step_record(decision, loss_v, norm_v, batches, self.train_batches))
            if self.is_main:
                self.log.warning(f"bad step {decision.step}: {decision.action.value}: {decision.reason}")
            if decision.action is StepAction.STOP:
                self.request_stop(decision.reason, kind="bad_steps")

    def _rollback(self, bad_steps: int) -> None:
        """Reload the newest checkpoint from before the last ``bad_steps`` steps, keeping the
        data position (the batches in between are not replayed) and the bad-step policy.
        Stops the run when there is no such checkpoint. Collective when distributed."""
        first_bad = self.step - bad_steps + 1
        found = [p for p in ckpt.list_checkpoints(self.run_dir / "checkpoints")
                 if ckpt.checkpoint_step(p) < first_bad]
        if not found:
            self.request_stop(f"{bad_steps} bad steps in a row and no checkpoint from before step {first_bad} "
                              "to roll back to", kind="bad_steps")
            return
        from_step = self.step
        self._load(found[-1], rollback=True)
        if self.is_main:  # the abandoned timeline's checkpoints: --resume continues the rolled-back run
            for newer in ckpt.list_checkpoints(self.run_dir / "checkpoints"):
                if ckpt.checkpoint_step(newer) > self.step:
                    ckpt.remove_checkpoint(newer)  # renamed first: a kill never leaves half of one
        self.metrics.write({"step": self.step, "rolled_back_from_step": from_step, "rolled_back_to": str(found[-1]),
                            "data": self.train_batches.state_dict()})

    def _validation_record(self, val: float) -> dict[str, Any]:
        """The metrics line of a validation at ``self.step``, with what evaluation
        callbacks (early stopping) add; carries out their (rank 0's) stop request."""
        extra, reason = control.run_evaluation_callbacks(self, self.callbacks, self.step, val,
                                                         self.dims.world_size)
        if reason is not None:
            self.early_stopped = self.early_stopped or self.stop_reason is None
            self.request_stop(reason, kind="early_stop")
        return {"step": self.step, "val_loss": val, **extra}

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over all ranks' shards, then clip (0 = measure only).
        On the parameters the optimizers step (the fp32 master copy when there is one)."""
        params = [p for part in self.opt_parts for p in part.parameters()]
        norm = self._global_norm([p.grad for p in params if p.grad is not None])
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    def _global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm of ``grads`` over every rank's shards and pipeline stages (collective)."""
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(norm, DTensor):  # sharded grads: per-shard partial norms -> the full norm
            norm = norm.full_tensor()
        if self.dims.pp > 1:  # each pipeline rank holds different layers: combine squared norms
            sq = norm.pow(2)
            dist.all_reduce(sq, group=self.mesh["pp"].get_group())
            norm = sq.sqrt()
        return norm

    def _mean_over_dp(self, values: torch.Tensor) -> torch.Tensor:
        """Average per-rank values over the data-parallel ranks (after summing over pipeline
        stages, where only the last holds a loss). Logging and validation only."""
        if self.mesh is None or (self.dims.dp == 1 and self.dims.pp == 1):
            return values
        values = values.clone()
        if self.dims.pp > 1:  # the loss lives on the last stage; others hold zeros
            dist.all_reduce(values, group=self.mesh["pp"].get_group())
        dist.all_reduce(values, group=self.mesh.dp.get_group())  # gloo has no AVG
        return values / self.dims.dp

    def _evaluate_pipeline(self) -> torch.Tensor:
        """Forward-only pass through the stages over the validation set; the mean loss is
        shared from the last stage to every rank."""
        from trainforge.parallel.pipeline import forward_only_loss

        tcfg, par = self.cfg.training, self.cfg.parallel
        seq = tcfg.seq_len // self.dims.tp if self.dims.tp > 1 and par.sequence_parallel else tcfg.seq_len
        act_shape = (tcfg.batch_size, seq, self.model_config.dim)
        for part in self.model_parts:
            part.eval()
        total = torch.zeros((), dtype=torch.float64)
        with self._loss_ctx(), self.mp.autocast():
            for x, y in self.val_set:
                loss = forward_only_loss(self.pipeline, x, y, self.mesh["pp"].get_group(),
                                         self.mesh.local_rank("pp"), self.dims.pp, act_shape, cross_entropy_loss,
                                         act_dtype=self.mp.stage_activation_dtype)
                if loss is not None:
                    total += loss.double().cpu()
        for part in self.model_parts:
            part.train()
        return total / len(self.val_set)  # zero except on the last stage; _mean_over_dp sums over pp

    def _window_stats(self) -> dict[str, Any]:
        """Peak memory (max over ranks) and, when distributed, the communication share."""
        peak = torch.tensor([peak_memory_bytes(self.device)], dtype=torch.int64)
        stats: dict[str, Any] = {}
        if self.dims.world_size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            if self.comm_probe.last_share is not None:
                share = torch.tensor([self.comm_probe.last_share], dtype=torch.float64)
                dist.all_reduce(share)  # mean over ranks
                stats["comm_share"] = share.item() / self.dims.world_size
        stats["peak_memory_bytes"] = int(peak.item())
        stats.update(self.mp.window_metrics())  # precision per group, loss scale, memory per dtype
        stats.update(self.train_batches.window_stats())  # this rank's data pipeline: I/O wait, cache tiers
        if self.compressor is not None:
            stats.update(self.compressor.window_stats())
        if self.pipeline is not None:
            last = self.pipeline.last_step_stats()
            bubble = torch.tensor([last.bubble_fraction], dtype=torch.float64)
            dist.all_reduce(bubble, group=self.mesh["pp"].get_group())  # mean over stages
            stats["bubble_fraction"] = bubble.item() / self.dims.pp
            # Per-stage compute seconds, averaged over the dp x tp ranks holding each stage:
            # identical on every rank, so the re-balance decision is too.
            n_stages = len(self.pipeline.stages) * self.dims.pp
            times = torch.zeros(n_stages, dtype=torch.float64)
            for sid, t in last.stage_compute_s.items():
                times[sid] = t
            dist.all_reduce(times)
            stage_s = (times / (self.dims.world_size // self.dims.pp)).tolist()
            stats["stage_compute_s"] = stage_s
            self._maybe_rebalance(stage_s)
        return stats

    def _maybe_rebalance(self, stage_s: list[float]) -> None:
        """Ask to stop for a re-split when measured stage times drifted from the plan."""
        par = self.cfg.parallel
        if not par.rebalance_threshold or self.pp_predicted is None:
            return
        if self.step - self._last_balance_step < par.rebalance_min_steps or self.step >= self.cfg.training.steps:
            return
        from trainforge.parallel.stage_balance import should_rebalance

        if should_rebalance(stage_s, par.rebalance_threshold, self.pp_predicted):
            ms = [round(1e3 * t, 1) for t in stage_s]
            planned = [round(1e3 * t, 2) for t in self.pp_predicted]
            self.request_stop(f"rebalance: measured stage ms {ms} drifted more than "
                              f"{par.rebalance_threshold:.0%} from the plan {planned}")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the global validation set (same on every rank)."""
        if self.pipeline is not None:
            local = self._evaluate_pipeline()
        else:
            self.model.eval()
            with self._loss_ctx(), self.mp.autocast():
                losses = [self._loss(x.to(self.device), y.to(self.device)) for x, y in self.val_set]
            self.model.train()
            local = torch.stack(losses).mean()
        return self._mean_over_dp(local.reshape(1).double()).item()

    # -- loop ----------------------------------------------------------------------------

    def fit(self, signals: StopSignals | None = None) -> dict[str, Any]:
        """Train to ``training.steps`` (or until ``request_stop`` or a signal). Returns a summary.
        ``signals``: the SIGINT/SIGTERM/SIGHUP handlers the caller installed (the CLI does,
        for the whole command); None installs them for the duration of ``fit``. Raises
        ``NonFiniteLoss`` (nothing saved) when the loss diverges and no [bad_steps] policy is on."""
        if signals is not None:
            return self._fit(signals)
        with StopSignals().installed() as own:
            return self._fit(own)

    def _fit(self, signals: StopSignals) -> dict[str, Any]:
        tcfg, ccfg = self.cfg.training, self.cfg.checkpoint
        reporter = ConsoleReporter(tcfg.steps, self.step, enabled=self.progress and self.is_main)
        summary: dict[str, Any] = {"start_step": self.step}
        try:
            if self.step == 0:
                val = self.evaluate()
                summary["first_val_loss"] = val
                record = self._validation_record(val)
                self.metrics.write(record)
                reporter.message(_validation_message(record))
            pending: list[tuple[int, float, torch.Tensor, torch.Tensor]] = []
            window_start, window_steps = time.perf_counter(), 0
            last_saved = -1
            while self.step < tcfg.steps and self.stop_reason is None:
                lr = self.optimizer.param_groups[0]["lr"]
                # Profile the last step of each logging window when there are collectives to see.
                profile_now = self.dims.world_size > 1 and (self.step + 1) % tcfg.log_interval == 0
                # Memory per dtype is taken on the step a logging window is likely to end with.
                self.measure_memory = self.is_main and ((self.step + 1) % tcfg.log_interval == 0
                                                       or self.step + 1 == tcfg.steps)
                with self.comm_probe.measure(profile_now):
                    loss, grad_norm = self.train_step()
                self.step += 1
                window_steps += 1
                pending.append((self.step, lr, loss, grad_norm))
                decision = self._step_decision
                rollback = decision is not None and decision.action is StepAction.ROLLBACK
                last = self.step == tcfg.steps and not rollback
                do_val = last or (tcfg.val_interval and self.step % tcfg.val_interval == 0 and not rollback)
                do_save = last or (ccfg.interval and self.step % ccfg.interval == 0 and not rollback)
                for cb in self.callbacks:
                    cb.on_step_end(self, self.step)
                # Every condition here is the same on every rank (a pending stop_reason too:
                # see request_stop), so all ranks end a window at the same step; a signal is
                # acted on only there (one tiny all-reduce), or every step when alone.
                window_end = (self.step % tcfg.log_interval == 0 or do_val or do_save or rollback
                              or self.stop_reason is not None)
                if window_end or self.dims.world_size == 1:
                    signalled = signals.agreed(self.dims.world_size, self.device)
                    if signalled is not None:
                        self.request_stop(signalled, kind="signal")
                stopping = self.stop_reason is not None
                if window_end or stopping:
                    # The only host sync of the loop: one per logging interval.
                    losses = self._mean_over_dp(torch.stack([p[2] for p in pending])).tolist()
                    norms = torch.stack([p[3] for p in pending]).tolist()
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    elapsed = time.perf_counter() - window_start
                    tps = window_steps * self.tokens_per_step / max(elapsed, 1e-9)
                    mfu = tps * self.flops_per_token / self.peak_flops
                    extra = self._window_stats()
                    if self.bad_steps is not None:
                        extra.update(skipped_steps=self.bad_steps.counts["skipped"],
                                     rollbacks=self.bad_steps.rollbacks)
                    if self.adaptive_lr is not None:
                        self._adapt_lr(pending[0][0], losses)
                    for (step, step_lr, _, _), loss_v, norm_v in zip(pending, losses, norms):
                        record = {"step": step, "loss": loss_v, "lr": step_lr, "grad_norm": norm_v,
                                  "tokens": step * self.tokens_per_step, "tokens_per_s": tps, "mfu": mfu, **extra}
                        self.metrics.write(record)
                    reporter.step(self.step, record)
                    summary["final_loss"] = losses[-1]
                    if self.bad_steps is None:  # [bad_steps] has its own non-finite policy
                        # Identical on every rank (all-reduced losses, global norms); an fp16
                        # loss scaler skips inf-gradient steps itself.
                        check_finite([p[0] for p in pending], losses,
                                     None if self.mp.scaler.enabled else norms, tcfg.lr, self.run_dir)
                    pending.clear()
                    window_start, window_steps = time.perf_counter(), 0
                else:
                    reporter.advance(self.step)
                if self.mp.controller is not None and self.step % self.mp.interval_steps == 0:
                    self._observe_precision()  # after the records of the steps it read
                if do_val:
                    val = self.evaluate()
                    summary["final_val_loss"] = val
                    record = self._validation_record(val)
                    self.metrics.write(record)
                    reporter.message(_validation_message(record))
                if do_save or stopping:
                    summary["checkpoint"] = str(self.save())
                    last_saved = self.step
                    window_start = time.perf_counter()  # saving is not training throughput
                if rollback and not stopping:  # a pending stop (signal) wins: it saved the current state
                    self._rollback(decision.consecutive_bad)
                    window_start = time.perf_counter()
            if self.stop_reason is not None and last_saved != self.step:
                summary["checkpoint"] = str(self.save())
        finally:
            reporter.close()
            self.metrics.flush()
        if self.stop_reason is not None:
            self.log.info(f"stopped at step {self.step}: {self.stop_reason}; resume with --resume {self.run_dir}")
        summary.update(step=self.step, stop_reason=self.stop_reason, run_dir=str(self.run_dir),
                       early_stopped=self.early_stopped, stopped_by=self.stop_kind)
        if self.bad_steps is not None:
            summary["bad_steps"] = {**self.bad_steps.counts, "rollbacks": self.bad_steps.rollbacks}
        return summary

    def _observe_precision(self) -> None:
        """Dynamic precision: the controller sees the buffered steps (one host sync);
        its switches apply from the next step and each is a metrics record with its reason."""
        for sw in self.mp.observe(self._mean_over_dp):
            self.metrics.write({"step": self.step, "precision_switch": f"{sw.group} {sw.old} -> {sw.new}",
                                "group": sw.group, "from": sw.old, "to": sw.new, "reason": sw.reason,
                                "decided_at_step": sw.step})

    @property
    def inference_model(self) -> torch.nn.Module:
        """The model to sample from after training (single process): the fp32 master copy
        when parameters are stored low, else the trained model."""
        return self.mp.master.module if self.mp.master is not None else self.model

    def _adapt_lr(self, first_step: int, losses: list[float]) -> None:
        """Feed the adaptive LR one logging window's mean training loss (after warmup;
        the same host values on every rank) and apply a changed multiplier at once."""
        finite = [x for x in losses if math.isfinite(x)]
        if first_step <= self.cfg.training.warmup_steps or not finite:
            return
        before = self.adaptive_lr.multiplier
        self.adaptive_lr.observe(sum(finite) / len(finite))
        if self.adaptive_lr.multiplier != before:
            for opt, sched in zip(self.optimizers, self.schedulers):
                self.adaptive_lr.apply(opt, sched)
            self.metrics.write({"step": self.step, "lr_multiplier": self.adaptive_lr.multiplier,
                                "lr_event": self.adaptive_lr.last_event})
            if self.is_main:
                self.log.info(f"step {self.step}: adaptive LR {self.adaptive_lr.last_event}: multiplier "
                              f"{before:.3g} -> {self.adaptive_lr.multiplier:.3g}")

    def close(self) -> None:
        self.train_batches.close()
        self.metrics.close()


def _validation_message(record: dict[str, Any]) -> str:
    text = f"step {record['step']} val_loss {record['val_loss']:.4f}"
    if record.get("predicted_final_loss") is not None:
        text += (f" (predicted final {record['predicted_final_loss']:.4f} +- {record['predicted_final_loss_std']:.4f}"
                 f", improvement below min_delta from step {record['predicted_stop_step']})")
    return text
