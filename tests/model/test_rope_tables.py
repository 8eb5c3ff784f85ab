"""The rotary tables (``model/rope.py``): the fp32 angles Hugging Face's Llama forms, their cos /
sin rounded once from fp64; tables cut to a KV pool's size are the full tables' first rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainforge.model.config import ModelConfig
from trainforge.model.rope import model_rope_tables, rope_tables


@pytest.mark.parametrize("head_dim,n,theta", [(64, 2048, 10000.0), (128, 512, 500000.0), (96, 300, 10000.0)])
def test_tables_are_the_fp32_angles_cos_and_sin_rounded_once(head_dim, n, theta):
    cos, sin = rope_tables(head_dim, n, theta)
    assert cos.shape == sin.shape == (n, head_dim) and cos.dtype == torch.float32
    # The recipe spelled out: fp32 exponent 2i/d, theta ** it rounded to fp32, its fp32
    # reciprocal, the fp32 product with the position; cos / sin of that in fp64, rounded once.
    f32 = np.float32
    inv = [f32(1) / f32(float(f32(theta)) ** float(f32(i) / f32(head_dim))) for i in range(0, head_dim, 2)]
    for p, j in [(0, 0), (1, 1), (n - 1, 0), (n - 1, head_dim // 2 - 1), (n // 3, head_dim // 4), (n - 2, 7)]:
        a = float(f32(p) * inv[j])
        for table, f in ((cos, math.cos), (sin, math.sin)):
            want = float(f32(f(a)))
            assert table[p, j] == want and table[p, j + head_dim // 2] == want, (p, j)
    if head_dim & (head_dim - 1) == 0:  # torch's fp32 angles are the same bits: its cos / sin are within 1 ulp
        inv_t = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        angles = torch.outer(torch.arange(n, dtype=torch.int64).float(), inv_t)
        assert torch.equal(inv_t, torch.tensor(inv))
        torch.testing.assert_close(cos, torch.cat((angles, angles), -1).cos(), atol=1.2e-7, rtol=0)
        torch.testing.assert_close(sin, torch.cat((angles, angles), -1).sin(), atol=1.2e-7, rtol=0)


def test_tables_cut_to_a_pool_are_the_first_rows_of_the_full_ones():
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=32, ffn_hidden_dim=128,
                      max_seq_len=256)
    full = model_rope_tables(cfg)
    for positions, rows in ((40, 40), (10_000, 256), (0, 1)):
        cut = model_rope_tables(cfg, positions=positions)
        assert cut[0].shape[0] == rows
        assert torch.equal(cut[0], full[0][:rows]) and torch.equal(cut[1], full[1][:rows])
