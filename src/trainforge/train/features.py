"""The loop's components for one run, built from the config's sections: the one place
that names the features. A new feature is a ``Component`` in its own file plus one
line here; ``trainer.py`` does not change. Registration order is the order hooks run
(and the order their metrics merge into a record: a later key wins)."""

from __future__ import annotations

from typing import Any

from trainforge.train.component import Component


def build_loss(tcfg: Any, model_config: Any) -> Any:
    """The loss of a model with extra training heads (``model.mtp_depth`` > 0: ``MTPLoss``,
    called as ``loss(model, owner, inputs, targets)``), or None for plain cross-entropy."""
    if not model_config.mtp_depth:
        return None
    from trainforge.train.mtp_loss import MTPLoss

    return MTPLoss(model_config.mtp_depth, tcfg)


def build_components(cfg: Any, run_dir: Any, mp: Any, compressor: Any, pp_predicted: list[float] | None,
                     log: Any, model_config: Any = None, model_loss: Any = None,
                     model_parts: list[Any] | None = None) -> list[Component]:
    """``mp``: the run's ``TrainerPrecision``; ``compressor``: the gradient compressor or
    None; ``pp_predicted``: the pipeline split's planned stage seconds (None unpipelined);
    ``log``: a warning function on rank 0, None elsewhere; ``model_config``: the resolved
    ``ModelConfig`` (``cfg.model`` is only a flavor and overrides); ``model_parts``: the
    modules this rank trains (QAT swaps their linears' forward)."""
    from trainforge.train.mixed_precision import PrecisionComponent

    tcfg, par = cfg.training, cfg.parallel
    out: list[Component] = [PrecisionComponent(mp)]
    if cfg.qat.enabled and model_parts is not None:
        from trainforge.train.qat import QATComponent

        out.append(QATComponent(cfg.qat, model_parts, log=log))
    if tcfg.seq_len_schedule != "fixed":
        from trainforge.train.seq_len_schedule import SeqLenSchedule

        out.append(SeqLenSchedule(tcfg))
    if isinstance(model_loss, Component):
        out.append(model_loss)
    if model_config is not None and model_config.is_moe:
        from trainforge.train.moe_balance import MoEBalance

        out.append(MoEBalance(model_config, tcfg.grad_accum_steps))
    if cfg.offload.optimizer and cfg.offload.mode == "trainforge":
        from trainforge.train.offload import OffloadComponent

        out.append(OffloadComponent(tcfg.grad_clip))
    if compressor is not None:
        from trainforge.train.compression_component import CompressionComponent

        out.append(CompressionComponent(compressor, warn=log))
    if pp_predicted is not None and par.rebalance_threshold:
        from trainforge.train.rebalance import PipelineRebalance

        out.append(PipelineRebalance(pp_predicted, par.rebalance_threshold, par.rebalance_min_steps, tcfg.steps))
    policy = cfg.bad_steps.build()
    if policy is not None:
        from trainforge.train.bad_steps import BadStepGuard

        out.append(BadStepGuard(policy, tcfg.grad_accum_steps))
    else:  # [bad_steps] has its own non-finite policy
        from trainforge.train.stop_signals import FiniteLossCheck

        out.append(FiniteLossCheck(tcfg.lr, run_dir, check_norms=not mp.scaler.enabled))
    if cfg.optimizer.weight_decay_schedule != "constant":
        from trainforge.train.wd_schedule import WeightDecayComponent

        out.append(WeightDecayComponent(cfg.optimizer, tcfg.steps))
    adaptive = cfg.adaptive_lr.build()
    if adaptive is not None:
        from trainforge.train.adaptive_lr import AdaptiveLRComponent

        out.append(AdaptiveLRComponent(adaptive, tcfg.warmup_steps))
    early_stop = cfg.early_stop.build(tcfg.steps)
    if early_stop is not None:
        out.append(early_stop)
    if cfg.ema.enabled and model_parts is not None:
        from trainforge.train.ema import build_ema

        out.append(build_ema(cfg.ema, mp.opt_parts(model_parts), par.pp, log))
    return out

