"""The one cache of bound decode steps ("plans") that every fast decoder keeps.

A fast decode step (``fast_decode.py``, ``hourglass_decode.py``) is a list of no-argument
calls bound to workspace views for one step shape. Binding costs ~1-5 ms (and compiling the
calls into a C++ call program as much again), so each decoder binds a shape once and replays
it. What a plan is valid for depends on whether a binding read a context length: the C++
attention reads S from the cache's ``context`` tensor at run time, so its plans serve every S
and are kept under the shape alone (rebinding every block of tokens cost ~0.3 ms a step);
torch's attention is bound for one S, so its plans are kept under the shape and the S.
"""

from __future__ import annotations

from typing import Callable

Calls = list[Callable[[], None]]


class PlanCache:
    """Plans per step shape, oldest evicted past ``max_plans``. ``compile``: a function that
    turns a list of calls into an equivalent faster list (the C++ kernels' ``compile``), or
    None to keep them as bound."""

    def __init__(self, max_plans: int, compile: Callable[[Calls], Calls] | None = None):
        self.max_plans, self.compile = max_plans, compile
        self._plans: dict[tuple, Calls] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key: tuple, contexts: tuple, bind: Callable[[], tuple[Calls, bool]]) -> Calls:
        """The plan of shape ``key`` at context lengths ``contexts``: kept under ``key`` when its
        binding read no context length, else under ``key + contexts``. On a miss ``bind()``
        returns (calls, whether any binding read a context length), which are compiled and kept.
        The caller reports the read itself (a workspace's own flag is reset by each ``begin``, so
        a later binding on the same workspace would hide an earlier read)."""
        calls = self._plans.get(key) or self._plans.get(key + contexts)
        if calls is None:
            if len(self._plans) >= self.max_plans:
                self._plans.pop(next(iter(self._plans)))
            calls, read = bind()
            if self.compile is not None:
                calls = self.compile(calls)
            self._plans[key + contexts if read else key] = calls
        return calls
