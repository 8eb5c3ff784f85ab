"""The engine names no model family or decoding mode: those plug in through ``engine_parts.py``
as pool-set members, row-state participants and step kinds, which the engine loops over.
A participant stays aligned with the batch rows as requests join and leave, and a pool
member's reservations gate admission as the KV pool's do."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.infer.helpers import model_for
from trainforge.infer import engine_parts
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.sampling import SamplingParams

INFER = Path(engine_parts.__file__).parent
# The engine and its generic parts; a family's or a mode's own files (hourglass_pools.py,
# speculative_step.py, ...), the user-facing options (engine_config.py) and the one file
# that maps them onto the parts (engine_parts.py) are where those names belong.
GENERIC = ["engine.py", "scheduler.py", "pool_set.py", "row_state.py", "engine_step.py", "output_processor.py",
           "prompt_prefill.py"]
VARIANT = re.compile(r"hourglass|\bmtp|\bmla\b|latent|draft|speculat|\bmoe\b|deepseek|mixture|expert", re.IGNORECASE)


def test_the_engine_and_its_generic_parts_name_no_model_family_or_decoding_mode():
    hits = [f"{name}:{i}: {line.strip()}" for name in GENERIC
            for i, line in enumerate((INFER / name).read_text().splitlines(), 1) if VARIANT.search(line)]
    assert not hits, "name the variant in engine_parts.py or the variant's own file:\n" + "\n".join(hits)


def test_the_name_check_catches_a_variant():
    assert VARIANT.search("if self.drafter is not None:") and VARIANT.search("cfg.is_hourglass")
    assert VARIANT.search("runner.cache.latent") and VARIANT.search("an MTP module")
    assert not VARIANT.search("self.step_kind.run()  # one step for the running rows")


class RowIds:
    """A participant keeping each row's request id, as a model's per-row state would."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.ids = np.full(engine.config.max_batch_size, -1)
        self.moves = 0

    def set_decode(self, seq_ids: list[int], positions: np.ndarray) -> None:
        for r, req in enumerate(self.engine._rows):  # joined rows take their id at their first step
            if self.ids[r] == -1:
                self.ids[r] = req.id
        assert list(self.ids[:len(seq_ids)]) == seq_ids, "the participant's rows drifted from the batch's"

    def move_row(self, src: int, dst: int) -> None:
        self.ids[dst] = self.ids[src]
        self.moves += 1

    def clear_row(self, row: int) -> None:
        self.ids[row] = -1


def test_a_row_state_participant_follows_requests_as_rows_compact():
    engine = Engine(model_for("gqa2"), EngineConfig(max_batch_size=3, block_size=4, max_context=64))
    part = RowIds(engine)
    engine.scheduler.row_states.participants.append(part)
    engine.step_kind.hooks.append(part.set_decode)
    budgets = [12, 3, 7, 2, 9, 5, 4]
    params = [SamplingParams(max_new_tokens=n, temperature=0) for n in budgets]
    reqs = engine.generate([[5 + i, 6, 7] for i in range(len(budgets))], params)
    assert [len(r.output_ids) for r in reqs] == budgets
    assert part.moves > 0  # short requests left before the rows after them: the last row moved in
    assert (part.ids == -1).all() and not engine._rows


class Gate:
    """A pool member with room for ``capacity`` sequences at a time."""

    nbytes = 0

    def __init__(self, capacity: int):
        self.capacity, self.held = capacity, set()

    def can_reserve(self, n_tokens: int) -> bool:
        return len(self.held) < self.capacity

    def add(self, seq_id: int, row: int, reserve_tokens: int, prompt_tokens: int) -> None:
        self.held.add(seq_id)

    def free(self, seq_id: int) -> None:
        self.held.remove(seq_id)

    def bytes_per_token(self) -> float:
        return 0.0


def test_a_pool_members_reservations_gate_admission():
    engine = Engine(model_for("gqa2"), EngineConfig(max_batch_size=4, max_context=64))
    gate = Gate(capacity=2)
    engine.pools.members.append(gate)
    reqs = [engine.submit([3, 4, 5], SamplingParams(max_new_tokens=6, temperature=0)) for _ in range(4)]
    engine.step()
    assert len(engine._rows) == 2 and len(engine._waiting) == 2  # rows were free; the member had no room
    while engine.has_work():
        engine.step()
        assert len(gate.held) <= 2
    assert all(len(r.output_ids) == 6 for r in reqs) and not gate.held


def test_an_unknown_engine_option_is_refused_naming_it():
    with pytest.raises(TypeError, match="'drafer'.*drafter"):
        Engine(model_for("gqa2"), EngineConfig(max_context=32), drafer=object())
