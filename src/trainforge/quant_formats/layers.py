"""Which layers a quantised model holds quantised, and what their stored tensors are called.

Shared by QAT (which fake-quantises exactly these layers), the offline transform and the
engine's module swap (``infer/quantize/``), and the readers of quantised directories
(``loading/``), so the layers trained against a grid are the ones served on it.
"""

from __future__ import annotations

from torch import nn

from trainforge.model.mla import MLA
from trainforge.model.moe import GroupedExperts, routers


def linear_names(model: nn.Module) -> list[str]:
    """Qualified names of the model's ``nn.Linear`` modules, MoE routers' gates and latent
    attention's ``wkv_b`` left out: the absorbed decode (``model/mla.py``) reads ``wkv_b`` as
    two per-head matrices folded into the query and the output, never applies it as a linear
    to a token, so a quantised kernel has nothing to run and a float copy would be needed
    anyway (it is ~0.15% of DeepSeek-V3's weights)."""
    gates = {f"{name}.gate" for name, _ in routers(model)}
    gates |= {f"{name}.wkv_b" for name, m in model.named_modules() if isinstance(m, MLA)}
    return [name for name, m in model.named_modules() if type(m) is nn.Linear and name not in gates]


def expert_names(model: nn.Module) -> list[str]:
    """Qualified names of the model's routed experts (``GroupedExperts``)."""
    return [name for name, m in model.named_modules() if isinstance(m, GroupedExperts)]


def expert_buffer_name(projection: str, stored: str) -> str:
    """The buffer of a quantised experts module holding ``stored`` (weight, scales, zeros) of
    ``projection`` (w1, w2, w3): ``w1`` for the codes, ``w1_scales`` for the rest."""
    return projection if stored == "weight" else f"{projection}_{stored}"
