"""``[sample]``: the text sample generated after training (``trainforge train``)."""

from __future__ import annotations

from dataclasses import dataclass

from trainforge.config_base import _f, _require


@dataclass
class SampleSection:
    prompt: str = _f("def ", "prompt for the sample printed after training")
    max_new_tokens: int = _f(64, "tokens to sample after training; 0 = no sample")
    temperature: float = _f(0.8, "sampling temperature; 0 = greedy")
    top_k: int = _f(50, "keep the k most likely tokens; 0 = off")

    def validate(self) -> None:
        _require(self.max_new_tokens >= 0, "sample.max_new_tokens", self.max_new_tokens, "an integer >= 0")
        _require(self.temperature >= 0, "sample.temperature", self.temperature, "a number >= 0")
        _require(self.top_k >= 0, "sample.top_k", self.top_k, "an integer >= 0")
