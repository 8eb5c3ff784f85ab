"""[precision]: presets resolve, overrides win, bad values name their key."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from trainforge.config import _coerce
from trainforge.errors import ConfigError
from trainforge.precision.section import PRESETS, PrecisionSection, parse_groups


def test_presets_and_overrides_resolve():
    assert PrecisionSection().resolved_dtypes()["compute_dtype"] == "fp32"
    mixed = PrecisionSection(policy="bf16-mixed").resolved_dtypes()
    assert (mixed["param_dtype"], mixed["compute_dtype"]) == ("fp32", "bf16")
    pure = PrecisionSection(policy="bf16-mixed", param_dtype="bf16", reduce_dtype="bf16").resolved_dtypes()
    assert pure == {"param_dtype": "bf16", "compute_dtype": "bf16", "reduce_dtype": "bf16",
                    "optimizer_state_dtype": "fp32"}
    for name in PRESETS:
        PrecisionSection(policy=name).validate()


@pytest.mark.parametrize("changes, key", [
    ({"policy": "bf16"}, "precision.policy"),
    ({"compute_dtype": "int8"}, "precision.compute_dtype"),
    ({"policy": "bf16-mixed", "param_dtype": "fp16"}, "precision.param_dtype"),
    ({"optimizer_state_dtype": "bf16"}, "precision.optimizer_state_dtype"),
    ({"policy": "bf16-mixed", "activation_dtype": "fp16"}, "precision.activation_dtype"),
    ({"fp32_modules": "RMSNorm,,*norm"}, "precision.fp32_modules"),
    ({"dynamic_groups": "attn:layers.*.attention"}, "precision.dynamic_groups"),
    ({"policy": "dynamic", "dynamic_groups": "attn=layers.*.attention"}, "precision.dynamic_groups"),
    ({"policy": "dynamic", "dynamic_groups": "model:layers.*"}, "precision.dynamic_groups"),
    ({"policy": "dynamic", "param_dtype": "bf16"}, "precision.param_dtype"),
    ({"policy": "dynamic", "compute_dtype": "fp16", "dynamic_floor": "bf16"}, "precision.dynamic_floor"),
    ({"loss_scale_init": 0.0}, "precision.loss_scale_init"),
    ({"loss_scale_growth_steps": 0}, "precision.loss_scale_growth_steps"),
    ({"dynamic_loss_spike_ratio": 1.0}, "precision.dynamic_loss_spike_ratio"),
    ({"dynamic_grad_spike_ratio": float("nan")}, "precision.dynamic_grad_spike_ratio"),
    ({"dynamic_max_overflows": 100}, "precision.dynamic_max_overflows"),
    ({"dynamic_max_underflow_fraction": 1.0}, "precision.dynamic_max_underflow_fraction"),
    ({"dynamic_calm_steps": 0}, "precision.dynamic_calm_steps"),
    ({"dynamic_min_dwell_steps": -1}, "precision.dynamic_min_dwell_steps"),
])
def test_bad_values_name_the_key(changes, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        PrecisionSection(**changes).validate()


def test_groups_parse():
    assert parse_groups("attn:layers.*.attention, ffn:layers.*.feed_forward|output") == (
        ("attn", ("layers.*.attention",)), ("ffn", ("layers.*.feed_forward", "output")))
    PrecisionSection(policy="dynamic", dynamic_groups="attn:layers.*.attention").validate()


def test_every_key_loads_through_the_config_loader():
    """Each field's type is one the TOML/CLI loader understands (no lists), so the
    section plugs into ``Config`` and ``--precision.key value`` works."""
    hints = typing.get_type_hints(PrecisionSection)
    cli = {"policy": "fp16-mixed", "param_dtype": "bf16", "force": "true", "loss_scale_init": "1024",
           "loss_scale_growth_steps": "10", "fp32_modules": "RMSNorm", "dynamic_floor": "fp16"}
    for f in dataclasses.fields(PrecisionSection):
        raw = cli.get(f.name, str(f.default).lower() if isinstance(f.default, bool) else str(f.default))
        value = _coerce(f"precision.{f.name}", raw, hints[f.name], from_cli=True)
        assert type(value) is type(f.default), f.name
        assert f.metadata.get("help"), f"precision.{f.name} has no help text"
    with pytest.raises(ConfigError, match="precision.policy"):
        _coerce("precision.policy", "bf17-mixed", hints["policy"], from_cli=True)
