"""The training loop: gradient accumulation, AdamW, clipping, warmup + decay LR
schedules, periodic validation, throughput and MFU, metrics records, atomic checkpoints
and bit-exact resume. Everything else is a registered component (``component.py``;
the run's list is ``features.py``): compression state, the bad-step guard, adaptive LR,
the precision controller, pipeline re-balancing, early stopping, callbacks. The loop
never names a feature; the checkpoint saves every component by name.

Parallelism (``parallel/apply.py``) and precision (``train/mixed_precision.py`` over
``trainforge.precision``) are applied from outside; what a step does differently per
layout is ``step_layout.py``. Components change the run only through typed requests
(``request(Stop(...))``, ``request(Rollback(...))``; signals too, once all ranks agreed:
``stop_signals.py``): on a stop the loop saves a checkpoint at the current step and
returns, so nothing done is lost.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainforge.compression.hooks import build_compressor
from trainforge.config_base import config_to_toml
from trainforge.data.pipeline import build_loader, open_data
from trainforge.errors import CheckpointError
from trainforge.log import get_logger
from trainforge.model import model_config_from_section
from trainforge.model.config import model_config_from_init
from trainforge.model.preflight import check_writable_dir
from trainforge.monitor import Monitor
from trainforge.monitor.jsonl import JsonlSink
from trainforge.parallel.dims import ParallelDims, dp_rank
from trainforge.parallel.distributed import init_distributed
from trainforge.parallel.tensor_parallel import cross_entropy_loss
from trainforge.plan.lr_scaling import describe_scaling, scaled_lr
from trainforge.storage import locks
from trainforge.storage.atomic import atomic_write_text
from trainforge.storage.output_paths import refuse_overlap
from trainforge.train import checkpoint as ckpt
from trainforge.train import loop_checkpoint
from trainforge.train.build import build_model_stack, check_run, pick_device, seed_everything
from trainforge.train.chunked_loss import chunked_cross_entropy, hidden_states
from trainforge.train.component import Callback, Components, Rollback, Stop, StopKind, Window
from trainforge.train.features import build_components, build_loss
from trainforge.train.init_from import check_tokenizer, load_init_weights, open_init_source
from trainforge.train.lr_schedule import build_scheduler
from trainforge.train.metrics import ConsoleReporter, validation_message
from trainforge.train.mfu import PeakFlops
from trainforge.train.monitor_component import MonitorComponent
from trainforge.train.offload import offload_optimizers, optimizer_device
from trainforge.train.optimizer import build_optimizer
from trainforge.train.run_summary import startup_summary
from trainforge.train.stop_signals import StopSignals
from trainforge.train.step_stats import CommShareProbe, window_resources

if TYPE_CHECKING:  # handed in by the CLI: trainforge.config composes train's sections, so train/ sits below it
    from trainforge.config import Config

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.toml"


class Trainer:
    """Builds data, model, optimizer and schedule from ``cfg`` and trains into ``run_dir``.

    ``resume=True`` continues from the newest complete checkpoint in ``run_dir`` (or the
    one at ``from_step``; later ones are then moved to ``checkpoints/superseded/``); the
    continued run reproduces an uninterrupted one bit for bit (same device and thread
    count). A corrupt newest checkpoint is refused unless ``checkpoint.fallback``.
    ``model.init_from`` starts a fresh run from a directory's weights (``init_from.py``).
    Nothing is written to ``run_dir`` until data, model and checkpoint all loaded."""

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False,
                 callbacks: list[Callback] | None = None, progress: bool = True, from_step: int | None = None):
        self.cfg, self.run_dir = cfg, Path(run_dir)
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
        if not resume and cfg.model.init_from:  # its checkpoints would be pruned or replaced by this run's
            refuse_overlap(self.run_dir, "--run_dir", [("model.init_from", cfg.model.init_from)])
        if not resume and ckpt.list_checkpoints(ckpt_root):
            raise CheckpointError(f"run directory {self.run_dir} already has checkpoints; continue it with "
                                  f"--resume {self.run_dir} (or --resume auto), or pass a new --run_dir")
        # A read-only or immutable run directory fails here, naming it, not at the first save (every rank
        # writes checkpoint shards there, so every rank checks: the same error everywhere).
        check_writable_dir(self.run_dir, "run directory")
        seed_everything(tcfg.seed)

        # model.init_from: shape and tokenizer from that directory (train/init_from.py); weights below.
        init = open_init_source(cfg.model.init_from) if cfg.model.init_from else None
        # Local shards are memory-mapped; a URL or data.cache.dir reads through the tiered cache.
        self.data = open_data(cfg.data, self.dist.rank, self.dist.world_size, log=self.log.warning,
                              tokenizer=init.tokenizer if init is not None else None)
        if init is None:
            self.model_config = model_config_from_section(cfg.model, self.data.vocab_size, tcfg.seq_len)
        else:
            check_tokenizer(init, cfg.data.path, self.data.tokenizer_path, self.log.warning if self.is_main else None)
            self.model_config = model_config_from_init(cfg.model, init.model_config, init.where, init.key_names,
                                                       self.data.vocab_size, tcfg.seq_len)
        # Before anything is allocated and before the first collective, identically on every rank.
        policy, pp_layout = check_run(cfg, self.model_config, self.dims, self.device, self.log if self.is_main else None)
        # Read on every rank (a damaged file fails everywhere, before any collective); a resume loads its own.
        init_weights = load_init_weights(init) if init is not None and not candidates else None
        self.mesh = self.dims.build_mesh(self.device.type)  # the first collective
        # A model with extra training heads brings its own loss (a component too; None: plain cross-entropy).
        self.model_loss = build_loss(tcfg, self.model_config)
        self.compressor = build_compressor(cfg.compression, self.dims,
                                           self.mesh["dp_replicate"].get_group() if self.mesh else None,
                                           self.device, tcfg.seed, log=self.log.info if self.is_main else None,
                                           micro_batches=tcfg.grad_accum_steps)
        stack = build_model_stack(cfg, self.model_config, self.dims, self.mesh, self.device, policy, self.compressor,
                                  pp_layout, lambda inputs, targets: self._loss(inputs, targets),
                                  self.log if self.is_main else None, model_loss=self.model_loss,
                                  init_weights=init_weights)
        del init_weights
        self.mp, self.model, self.model_parts, self.opt_parts = stack.mp, stack.model, stack.model_parts, stack.opt_parts
        self.pipeline, self.pp_predicted, self.layout = stack.pipeline, stack.pp_predicted, stack.layout
        # The peak LR at this run's global batch (optimizer.lr_scaling; training.lr unless a rule is set).
        self.global_batch = tcfg.batch_size * tcfg.grad_accum_steps * self.dims.dp  # sequences per step
        self.peak_lr = scaled_lr(tcfg.lr, cfg.optimizer.lr_scaling, self.global_batch,
                                 cfg.optimizer.lr_reference_batch)
        # One optimizer and schedule per part (identical settings): optimizer state stays keyed by FQN.
        opt_device = optimizer_device(cfg.offload, self.device)
        self.optimizers = [build_optimizer(part, cfg.optimizer, self.peak_lr, opt_device,
                                           distributed=self.dims.world_size > 1, seed=tcfg.seed)
                           for part in self.opt_parts]
        # [offload]: the same groups and settings, with the state and the update on the host.
        self.optimizers = offload_optimizers(self.optimizers, cfg.offload, self.model, self.layout,
                                             tcfg.grad_accum_steps)
        self.schedulers = [build_scheduler(o, *self.schedule_args()) for o in self.optimizers]
        # Callbacks first: their evaluation records merge before the features' (as they always did).
        self.components = Components([*(callbacks or []), *build_components(
            cfg, self.run_dir, self.mp, self.compressor, self.pp_predicted, self.log.warning if self.is_main else None,
            model_config=self.model_config, model_loss=self.model_loss, model_parts=self.model_parts)])
        self.stop: Stop | None = None
        self._rollback_request: Rollback | None = None
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
        # MFU is per device: achieved FLOP/s of the job over (peak of one device x devices), at the
        # compute dtype's peak (a published figure for known GPUs, else the best of short probes).
        self.peak_flops = PeakFlops(self.device, self.dims.world_size, dtype=policy.compute_dtype,
                                    log=self.log.info if self.is_main else None)
        self.comm_probe = CommShareProbe(self.device)
        # Memory per dtype on the next train_step (fit sets it for the last step of each
        # logging window; set it yourself when calling train_step directly).
        self.measure_memory = False
        self.step = 0
        resume_from = None
        if candidates:
            resume_from = ckpt.load_first_valid(candidates, self._load, cfg.checkpoint.fallback,
                                                explicit=from_step is not None, warn=warn)
        # The shards of the first train batch are fetched and verified now (tiered cache: a bad or
        # unreachable shard fails here, before config.toml or metrics.jsonl exist).
        self.train_batches.verify_next()

        # Everything loaded: only now touch the run directory (rank 0 writes shared files).
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # "Training here" for other commands (advise refuses to write into a live run); the
        # kernel drops it when this process ends, however it ends.
        self._run_lock = locks.hold_run(self.run_dir) if self.is_main else None
        if self.is_main:
            atomic_write_text(self.run_dir / CONFIG_FILE, config_to_toml(cfg))
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
        self.components.add(MonitorComponent(self.metrics))  # built last: its probes start with the run
        if self.is_main:
            model_name = f"from {init.path}" if init is not None else cfg.model.flavor
            data_label = str(self.data.path) if cfg.data.path else f"built-in corpus (Python stdlib), {self.data.path}"
            for line in startup_summary(
                    model_name=model_name, params_text=self.model_config.describe_params(),
                    vocab_size=self.data.vocab_size, dims=self.dims, device_type=self.device.type,
                    precision_preset=cfg.precision.policy, precision_text=policy.describe(), data_label=data_label,
                    train_tokens=self.data.num_tokens("train"), tcfg=tcfg, tokens_per_step=self.tokens_per_step,
                    start_step=self.step, peak_text=self.peak_flops.describe(),
                    flops_text=self.model_config.describe_flops(tcfg.seq_len),
                    lr_text=describe_scaling(tcfg.lr, cfg.optimizer.lr_scaling, self.global_batch,
                                             cfg.optimizer.lr_reference_batch)
                    if cfg.optimizer.lr_scaling != "none" else None):
                self.log.info(line)

    # -- control -------------------------------------------------------------------

    def request(self, req: Stop | Rollback) -> None:
        """A component's typed request to the loop. ``Stop``: stop after the current step
        (checkpointing first; the first stop wins). ``Rollback``: reload an earlier
        checkpoint at the end of this step. In a multi-process run every rank must ask
        at the same step (every caller here decides on all-reduced or broadcast values;
        signals go through ``stop_signals``)."""
        if isinstance(req, Rollback):
            self._rollback_request = req
        elif self.stop is None:
            self.stop = req

    def request_stop(self, reason: str, kind: StopKind | str = StopKind.REQUEST) -> None:
        """``request(Stop(reason, kind))``: what callbacks call."""
        self.request(Stop(reason, StopKind(kind)))

    @property
    def stop_reason(self) -> str | None:
        return self.stop.reason if self.stop is not None else None

    @property
    def stop_kind(self) -> StopKind | None:
        return self.stop.kind if self.stop is not None else None

    # -- checkpointing (loop_checkpoint.py) ------------------------------------------------

    def save(self) -> Path:
        """Write a checkpoint (collective when distributed). Single process: full weights
        as safetensors; several: DCP shards that any other layout can load."""
        return loop_checkpoint.save(self)

    def _load(self, path: Path, rollback: bool = False) -> None:
        loop_checkpoint.load(self, path, rollback)

    def _rollback(self, bad_steps: int) -> None:
        """Reload the newest checkpoint from before the last ``bad_steps`` steps (or stop)."""
        loop_checkpoint.rollback(self, bad_steps)

    def schedule_args(self) -> tuple:
        t = self.cfg.training
        return t.lr_schedule, t.warmup_steps, t.steps, t.min_lr_ratio, t.decay_ratio, t.decay_shape

    # -- steps -----------------------------------------------------------------------

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in fp32 (unpipelined layouts). Under TP with loss parallel
        the logits are a vocab-sharded DTensor and this must run (with its backward) in
        ``layout.loss_ctx()``."""
        if self.model_loss is not None:
            return self.model_loss(self.model, self.model_parts[0], inputs, targets)
        chunk = self.cfg.training.loss_chunk_tokens
        if chunk:  # never the whole (B, T, V) logits (train/chunked_loss.py)
            owner = self.model_parts[0]
            return chunked_cross_entropy(hidden_states(self.model, owner, inputs), owner.output, targets, chunk)
        logits = self.model(inputs)  # (B, T, V)
        return cross_entropy_loss(logits, targets)

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
        Returns (mean loss, pre-clip grad norm) as device tensors: no host sync here
        unless a component's ``before_optimizer_step`` reads them (the bad-step guard);
        a step a component rejects changes no weights, optimizer state or LR."""
        tcfg, mp = self.cfg.training, self.mp
        for part in self.model_parts:
            part.train()
        self.components.on_step_start(self)
        # Saved activations are counted on one forward per logging window.
        track = self.measure_memory and self.layout.tracks_activations and not self.cfg.parallel.compile
        total = self.layout.forward_backward(self.train_batches, tcfg.grad_accum_steps, track)
        mp.unscale_(self.optimizers)
        group_norms = mp.group_grad_norms(self.opt_parts, self.layout.global_norm)  # pre-clip, as grad_norm
        grad_norm = self.layout.clip(self.opt_parts, tcfg.grad_clip)
        if self.measure_memory:
            mp.record_memory(self.model_parts, self.optimizers, with_activations=track)
        apply = self.components.before_optimizer_step(self, total, grad_norm)
        for opt, sched in zip(self.optimizers, self.schedulers):
            if apply:
                mp.scaler.step(opt)  # opt.step(), unless an fp16 overflow skips it
            opt.zero_grad(set_to_none=True)
            if apply:
                sched.step()
        if apply:
            self.components.after_optimizer_step(self)
        mp.finish_step(self.step + 1, total, grad_norm, group_norms)
        return total, grad_norm

    def _validation_record(self, val: float) -> dict[str, Any]:
        """The metrics line of a validation at ``self.step``, with what ``on_evaluation``
        hooks (early stopping) add; carries out their (rank 0's) stop request."""
        extra, reason = self.components.on_evaluation(self, self.step, val, self.dims.world_size)
        if reason is not None:
            self.request(Stop(reason, StopKind.EARLY_STOP))
        return {"step": self.step, "time_unix_s": time.time(), "val_loss": val, **extra}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the global validation set (same on every rank)."""
        return self.layout.mean_over_dp(self.layout.evaluate(self.val_set).reshape(1).double()).item()

    # -- loop ----------------------------------------------------------------------------

    def fit(self, signals: StopSignals | None = None) -> dict[str, Any]:
        """Train to ``training.steps`` (or until a stop is requested or a signal). Returns a
        summary. ``signals``: the SIGINT/SIGTERM/SIGHUP handlers the caller installed (the
        CLI does, for the whole command); None installs them for the duration of ``fit``.
        Raises ``NonFiniteLoss`` (nothing saved) when the loss diverges and no [bad_steps]
        policy is on."""
        if signals is not None:
            return self._fit(signals)
        with StopSignals().installed() as own:
            return self._fit(own)

    def _fit(self, signals: StopSignals) -> dict[str, Any]:
        signals.loop_started()  # a signal before this ended the command (nothing to save)
        tcfg, ccfg = self.cfg.training, self.cfg.checkpoint
        reporter = ConsoleReporter(tcfg.steps, self.step, enabled=self.progress and self.is_main)
        summary: dict[str, Any] = {"start_step": self.step}
        try:
            if self.step == 0:
                summary["first_val_loss"] = self._validate(reporter)
            pending: list[tuple[int, float, torch.Tensor, torch.Tensor]] = []
            window_start, window_steps = time.perf_counter(), 0
            last_saved = -1
            while self.step < tcfg.steps and self.stop is None:
                lr = self.optimizer.param_groups[0]["lr"]
                # Profile the last step of each logging window when there are collectives to see.
                profile_now = self.dims.world_size > 1 and (self.step + 1) % tcfg.log_interval == 0
                # Memory per dtype is taken on the step a logging window is likely to end with.
                self.measure_memory = self.is_main and ((self.step + 1) % tcfg.log_interval == 0
                                                       or self.step + 1 == tcfg.steps)
                self._rollback_request = None
                with self.comm_probe.measure(profile_now):
                    loss, grad_norm = self.train_step()
                self.step += 1
                window_steps += 1
                pending.append((self.step, lr, loss, grad_norm))
                rollback = self._rollback_request
                last = self.step == tcfg.steps and rollback is None
                do_val = last or (tcfg.val_interval and self.step % tcfg.val_interval == 0 and rollback is None)
                do_save = last or (ccfg.interval and self.step % ccfg.interval == 0 and rollback is None)
                self.components.on_step_end(self, self.step)
                # Every condition here is the same on every rank (a pending stop too: see
                # request), so all ranks end a window at the same step; a signal is acted
                # on only there (one tiny all-reduce), or every step when alone.
                window_end = (self.step % tcfg.log_interval == 0 or do_val or do_save or rollback is not None
                              or self.stop is not None)
                if window_end or self.dims.world_size == 1:
                    signalled = signals.agreed(self.dims.world_size, self.device)
                    if signalled is not None:
                        self.request(Stop(signalled, StopKind.SIGNAL))
                stopping = self.stop is not None
                if window_end or stopping:
                    summary["final_loss"] = self._log_window(pending, window_steps, window_start, reporter)
                    pending.clear()
                    window_start, window_steps = time.perf_counter(), 0
                else:
                    reporter.advance(self.step)
                self.components.after_step(self, self.step)
                if do_val:
                    summary["final_val_loss"] = self._validate(reporter)
                if do_save or stopping:
                    summary["checkpoint"] = str(self.save())
                    last_saved = self.step
                    window_start = time.perf_counter()  # saving is not training throughput
                if rollback is not None and not stopping:  # a pending stop (signal) wins: it saved the current state
                    self._rollback(rollback.consecutive_bad)
                    window_start = time.perf_counter()
            if self.stop is not None and last_saved != self.step:
                summary["checkpoint"] = str(self.save())
        finally:
            reporter.close()
            self.metrics.flush()
        if self.stop is not None:
            self.log.info(f"stopped at step {self.step}: {self.stop.reason}; resume with --resume {self.run_dir}")
        summary.update(step=self.step, stop_reason=self.stop_reason, run_dir=str(self.run_dir),
                       early_stopped=self.stop_kind is StopKind.EARLY_STOP, stopped_by=self.stop_kind)
        self.components.on_fit_end(self, summary)
        return summary

    def _log_window(self, pending: list, window_steps: int, window_start: float, reporter: ConsoleReporter) -> float:
        """Write the window's training records: the only host sync of the loop, one per
        logging interval. Returns the last step's loss."""
        losses = self.layout.mean_over_dp(torch.stack([p[2] for p in pending])).tolist()
        norms = torch.stack([p[3] for p in pending]).tolist()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - window_start
        now = time.time()
        tps = window_steps * self.tokens_per_step / max(elapsed, 1e-9)
        window = Window([p[0] for p in pending], losses, norms,
                        window_resources(self.device, self.dims.world_size, self.comm_probe))
        window.stats.update(self.train_batches.window_stats())  # this rank's data pipeline: I/O wait, cache tiers
        window.stats.update(self.layout.window_stats())
        self.components.on_log(self, window)
        # FLOPs per token at the lengths the window's steps ran at (training.seq_len_schedule
        # records them): attention's share shrinks with the length, so the full length's
        # count would overstate the MFU of shorter steps.
        lengths = window.per_step.get("seq_len")
        flops_per_token = (sum(map(self.model_config.flops_per_token, lengths)) / len(lengths) if lengths
                           else self.flops_per_token)
        mfu = self.peak_flops.mfu(tps * flops_per_token, step=self.step)  # may raise the peak: record after
        peak = self.peak_flops.record()  # mfu_peak_flops, mfu_peak_source
        for i, ((step, step_lr, _, _), loss_v, norm_v) in enumerate(zip(pending, losses, norms)):
            # time_unix_s: the wall clock at the window's end (the report's --x time axis).
            record = {"step": step, "time_unix_s": now, "loss": loss_v, "lr": step_lr, "grad_norm": norm_v,
                      "tokens": step * self.tokens_per_step, "tokens_per_s": tps, "mfu": mfu, **peak, **window.stats,
                      **{k: v[i] for k, v in window.per_step.items()}}
            self.metrics.write(record)
        reporter.step(self.step, record)
        self.components.after_log(self, window)
        return losses[-1]

    def _validate(self, reporter: ConsoleReporter) -> float:
        val = self.evaluate()
        record = self._validation_record(val)
        self.metrics.write(record)
        reporter.message(validation_message(record))
        return val

    @property
    def inference_model(self) -> torch.nn.Module:
        """The model to sample from after training (single process): the fp32 master copy
        when parameters are stored low, else the trained model."""
        return self.mp.master.module if self.mp.master is not None else self.model

    def close(self, failed: bool = False) -> None:
        """``failed``: training ended by an exception (experiment trackers record it so)."""
        self.train_batches.close()
        self.metrics.close(failed)
        if getattr(self, "_run_lock", None) is not None:
            self._run_lock.close()
            self._run_lock = None

