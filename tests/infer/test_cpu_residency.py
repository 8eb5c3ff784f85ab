"""The block kernels' prefetch hint: weights that fit the CPU's last-level cache are kept there
between decode steps, larger ones stream past it (cpu_kernels/residency.py)."""

import pytest
import torch

from trainforge.infer.cpu_kernels import residency
from trainforge.infer.prepare import prepare_model
from trainforge.infer.quantize import quantize_model

from .helpers import model_for


def _cache_index(root, i, kind, level, size):
    d = root / f"index{i}"
    d.mkdir()
    for name, value in (("type", kind), ("level", level), ("size", size)):
        (d / name).write_text(f"{value}\n")


def test_last_level_cache_is_the_highest_data_or_unified_level(tmp_path):
    _cache_index(tmp_path, 0, "Data", 1, "48K")
    _cache_index(tmp_path, 1, "Instruction", 1, "32K")
    _cache_index(tmp_path, 2, "Unified", 2, "2048K")
    assert residency.last_level_cache_bytes(tmp_path) == 2 << 20
    _cache_index(tmp_path, 3, "Unified", 3, "307200K")
    assert residency.last_level_cache_bytes(tmp_path) == 300 << 20
    (tmp_path / "index3" / "size").write_text("garbled\n")  # an unreadable level is skipped
    assert residency.last_level_cache_bytes(tmp_path) == 2 << 20
    assert residency.last_level_cache_bytes(tmp_path / "absent") is None


def test_policy_keeps_weights_the_cache_holds_and_obeys_the_override(monkeypatch):
    monkeypatch.delenv(residency.ENV, raising=False)
    assert residency.keep_weights_cached(200, 200)
    assert not residency.keep_weights_cached(201, 200)
    assert not residency.keep_weights_cached(1, None)  # unknown cache: stream, as before
    monkeypatch.setenv(residency.ENV, "keep")
    assert residency.keep_weights_cached(10**12, 200)
    monkeypatch.setenv(residency.ENV, "stream")
    assert not residency.keep_weights_cached(1, 200)
    monkeypatch.setenv(residency.ENV, "yes")
    with pytest.raises(ValueError, match=residency.ENV):
        residency.keep_weights_cached(1, 200)


@pytest.fixture
def hint(ops, monkeypatch):
    """The kernels' process-wide hint, restored after the test; no other live model counted."""
    monkeypatch.delenv(residency.ENV, raising=False)
    monkeypatch.setattr(residency, "_models", type(residency._models)())
    kept = ops.keeps_weights_cached()
    yield ops
    ops.set_keep_weights_cached(kept)


def test_step_bytes_counts_packed_block_weights(hint):
    fp32 = model_for("gqa4")
    floats = sum(t.nbytes for t in (*fp32.parameters(), *fp32.buffers()))  # the rope tables too
    assert residency.step_bytes(fp32) == floats
    sizes = {}
    for mode in ("q8_0", "q4_0"):
        m = model_for("gqa4")
        quantize_model(m, mode, kernel="blocks")
        linears = [b for n, b in m.named_buffers() if n.startswith("layers.") and n.endswith(".weight")]
        assert linears and all(b.numel() == 0 for b in linears)  # the kernels hold the codes now
        sizes[mode] = residency.step_bytes(m)
    assert sizes["q4_0"] < sizes["q8_0"] < floats


def test_prepare_model_sets_the_hint_from_every_live_models_weights(hint, monkeypatch):
    def q4_model():
        m = model_for("gqa4")
        quantize_model(m, "q4_0", kernel="blocks", pack=False)
        return m

    first = q4_model()
    size = residency.step_bytes(prepare_model(q4_model()))  # one packed model's bytes
    monkeypatch.setattr(residency, "_models", type(residency._models)())
    monkeypatch.setattr(residency, "last_level_cache_bytes", lambda: int(1.5 * size))
    prepare_model(first)  # 1 model in 1.5 of its size: it fits, kept
    assert hint.keeps_weights_cached()
    second = prepare_model(q4_model())  # 2 models do not fit: streamed
    assert not hint.keeps_weights_cached()
    del second
    residency.apply(first)  # the second one is gone: kept again
    assert hint.keeps_weights_cached()
