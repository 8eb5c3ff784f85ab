"""Augmentation: each transform does what it says, the pipeline is deterministic for a
seed (and independent of threads, resume and the number of ranks), bad config names
the key."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from trainforge.config import load_config
from trainforge.data.augment import IGNORE, TRANSFORMS, Augmenter, Context, build_transforms
from trainforge.data.pipeline import build_loader, open_data
from trainforge.errors import ConfigError

EOS, VOCAB = 0, 512


def window(n=65, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.integers(1, 400, n)
    w[[10, 30, 31, 50]] = EOS  # four document ends
    return w


def run(spec, w=None, sample_id=0, step=0, seed=1):
    return Augmenter(spec, seed, 0, VOCAB, EOS, 64)(window() if w is None else w, 0, sample_id, step)


def test_doc_shuffle_permutes_whole_documents():
    w = window()
    x, y = run([{"name": "doc_shuffle"}], w)
    tokens = np.r_[x, y[-1]]
    assert not np.array_equal(tokens, w) and sorted(tokens) == sorted(w)
    pieces = [p.tolist() for p in np.split(w, np.flatnonzero(w == EOS) + 1) if len(p)]  # docs + the tail
    assert any(sum((pieces[i] for i in perm), []) == tokens.tolist()
               for perm in itertools.permutations(range(len(pieces))))
    assert np.array_equal(x[1:], y[:-1])  # still a shifted pair: no padding


def test_span_corruption_moves_spans_behind_sentinels():
    w = window()
    x, y = run([{"name": "span_corruption", "rate": 0.2, "mean_span": 3.0}], w)
    tokens = np.r_[x, y[-1]]
    sentinels = tokens[tokens >= VOCAB - 100]
    assert len(sentinels) >= 4 and sentinels[0] == VOCAB - 1
    assert len(tokens) == len(w)
    # The first sentinel occurs twice: in place of span 0 and again before span 0 at the end.
    first, again = np.flatnonzero(tokens == VOCAB - 1)[:2]
    assert tokens[:first].tolist() == w[:first].tolist()
    assert tokens[again + 1] == w[first]


def test_token_dropout_pads_and_padding_is_not_learned():
    x, y = run([{"name": "token_dropout", "rate": 0.3}])
    n_pad = int((y == IGNORE).sum())
    assert 5 < n_pad < 40 and (y[-n_pad:] == IGNORE).all() and (x[-n_pad + 1:] == EOS).all()
    assert np.array_equal(x[1:64 - n_pad], y[:63 - n_pad])


def test_token_replace_corrupts_inputs_only():
    w = window()
    x, y = run([{"name": "token_replace", "rate": 0.25}], w)
    assert np.array_equal(y, w[1:])
    changed = (x != w[:-1]).mean()
    assert 0.1 < changed < 0.4


def test_curriculum_grows_the_length_from_short_to_full():
    spec = [{"name": "seq_curriculum", "start_len": 16, "ramp_batches": 100, "multiple": 8}]
    lengths = [len(run(spec, step=s)[0]) for s in (0, 30, 50, 100, 500)]
    assert lengths == [16, 24, 40, 64, 64]  # 16 + 48 * s / 100, down to a multiple of 8


def test_probability_and_composition_are_seeded():
    spec = [{"name": "doc_shuffle", "p": 0.5}, {"name": "token_dropout", "p": 0.5, "rate": 0.1},
            {"name": "token_replace", "p": 0.5, "rate": 0.1}]
    outs = [run(spec, sample_id=i) for i in range(40)]
    again = [run(spec, sample_id=i) for i in range(40)]
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(outs, again))
    untouched = sum(np.array_equal(x, window()[:-1]) for x, _ in outs)
    assert 0 < untouched < 20  # p = 0.5 each: some samples pass through, most do not
    other_seed = [run(spec, sample_id=i, seed=2) for i in range(40)]
    assert any(not np.array_equal(a[0], b[0]) for a, b in zip(outs, other_seed))


def test_augmented_loader_is_deterministic_resumable_and_rank_independent(sharded_data):
    spec = ('[{name = "doc_shuffle", p = 0.5}, {name = "span_corruption", p = 0.3}, '
            '{name = "token_replace", p = 0.5, rate = 0.05}, {name = "seq_curriculum", start_len = 16, '
            'ramp_batches = 20}]')
    cfg = load_config(None, ["--data.path", sharded_data.as_uri(), "--data.augment.transforms", spec]).data
    data = open_data(cfg)

    def batches(n, rank=0, world=1, state=None, skip=0):
        loader = build_loader(data, "train", cfg, 64, 8 // world, 3, rank=rank, world_size=world)
        if state:
            loader.load_state_dict(state)
        for _ in range(skip):
            loader.next()
        out = [loader.next() for _ in range(n)]
        st = loader.state_dict()
        loader.close()
        return out, st

    a, _ = batches(30)
    b, _ = batches(30)
    assert all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))
    assert a[0][0].shape == (8, 16) and a[-1][0].shape == (8, 64)  # the curriculum ran
    _, state = batches(0, skip=12)
    resumed, _ = batches(18, state=state)
    assert all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a[12:], resumed))
    halves = [batches(30, rank=r, world=2)[0] for r in range(2)]
    for i in (0, 7, 29):
        assert torch.equal(torch.cat([halves[0][i][0], halves[1][i][0]]), a[i][0])
    plain = load_config(None, ["--data.path", sharded_data.as_uri()]).data
    loader = build_loader(data, "train", plain, 64, 8, 3)
    assert not all(torch.equal(loader.next()[0][:, :16], a[i][0][:, :16]) for i in range(1, 4))
    loader.close()


@pytest.mark.parametrize("spec, needle", [
    ('[{name = "mixup"}]', "transforms[0].name"),
    ('[{name = "token_replace", rate = 1.5}]', "transforms[0].rate"),
    ('[{name = "token_replace", p = 2}]', "transforms[0].p"),
    ('[{name = "token_replace", strength = 1}]', "transforms[0].strength"),
    ('[{name = "seq_curriculum", p = 0.5}]', "transforms[0].p"),
    ('[{name = "token_replace"}, {name = "doc_shuffle"}]', "transforms[1].name"),
    ('"token_replace"', "data.augment.transforms"),
])
def test_bad_augment_config_names_the_key(spec, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, ["--data.augment.transforms", spec])


def test_registry_lets_other_transforms_plug_in():
    assert {"doc_shuffle", "span_corruption", "token_dropout", "token_replace", "seq_curriculum"} <= set(TRANSFORMS)
    (t, p), = build_transforms([{"name": "token_replace", "p": 0.25, "rate": 0.5}])
    assert p == 0.25 and t.rate == 0.5
    ctx = Context(step=0, seq_len=8, vocab_size=VOCAB, eos_id=EOS)
    assert t(np.arange(8), np.arange(8), np.random.default_rng(0), ctx)[1].tolist() == list(range(8))
