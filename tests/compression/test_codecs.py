"""Codecs alone: round-trip error bounds per block, sizes, packing, and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainforge.compression.codecs import BlockQuantCodec, NoCodec, TopKCodec, decode, encode, make_codec

BIG = 3.0000000054977558e38  # the float32 nearest 3e38
TINY = 1.0000000031710769e-30  # the float32 nearest 1e-30
FLOATS = st.floats(min_value=-BIG, max_value=BIG, allow_nan=False, allow_infinity=False, width=32)


def vectors(min_size=1, max_size=700):
    """Mixed scales in one vector: zeros, subnormal-ish tiny values, huge values, odd lengths."""
    return st.one_of(
        st.lists(FLOATS, min_size=min_size, max_size=max_size),
        st.lists(st.floats(-TINY, TINY, width=32, allow_subnormal=True), min_size=min_size, max_size=max_size),
        st.lists(st.sampled_from([0.0, -0.0, 1e-38, -BIG, BIG, 1.0, -2.5]), min_size=min_size, max_size=max_size),
    ).map(lambda xs: torch.tensor(xs, dtype=torch.float32))


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-element absmax of its block (the bound's scale)."""
    nb = math.ceil(x.numel() / block)
    xb = torch.nn.functional.pad(x.abs(), (0, nb * block - x.numel())).reshape(nb, block)
    return xb.amax(dim=1).repeat_interleave(block)[: x.numel()]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [8, 64, 256])
@settings(max_examples=60, deadline=None)
@given(x=vectors())
def test_block_quant_error_within_half_a_step_per_block(bits, block, x):
    codec = BlockQuantCodec(bits, block)
    buf = encode(codec, x)
    assert buf.dtype == torch.uint8 and buf.numel() == codec.nbytes(x.numel())
    y = decode(codec, buf, x.numel())
    assert y.shape == x.shape and torch.isfinite(y).all()
    qmax = 2 ** (bits - 1) - 1
    bound = block_absmax(x, block).double() / (2 * qmax)
    err = (x.double() - y.double()).abs()
    # float32 rounding of the scale and of code*scale: a relative slack of a few ulps.
    slack = 4 * torch.finfo(torch.float32).eps * x.double().abs() + 1e-45
    # Documented limit: a block whose scale is subnormal loses precision, and one whose
    # absmax / qmax underflows flushes to zero (|error| <= absmax < qmax x 1.2e-38).
    subnormal = block_absmax(x, block).double() < qmax * torch.finfo(torch.float32).tiny
    bound = torch.where(subnormal, block_absmax(x, block).double(), bound)
    assert (err <= bound * (1 + 1e-5) + slack).all(), float((err - bound).max())
    # Zeros stay exact zeros (sparse embedding gradients must not pick up noise).
    assert (y[x == 0] == 0).all()


@pytest.mark.parametrize("bits", [8, 4])
@settings(max_examples=30, deadline=None)
@given(x=vectors(min_size=16))
def test_stochastic_rounding_error_below_one_step(bits, x):
    codec = BlockQuantCodec(bits, 64, stochastic=True)
    gen = torch.Generator().manual_seed(0)
    y = decode(codec, encode(codec, x, gen), x.numel())
    qmax = 2 ** (bits - 1) - 1
    bound = block_absmax(x, 64).double() / qmax
    subnormal = block_absmax(x, 64).double() < qmax * torch.finfo(torch.float32).tiny
    bound = torch.where(subnormal, block_absmax(x, 64).double(), bound)
    slack = 4 * torch.finfo(torch.float32).eps * x.double().abs() + 1e-45
    assert ((x.double() - y.double()).abs() <= bound * (1 + 1e-5) + slack).all()


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    # A block of 0.3s next to a 1.0: int4 step is 1/7, 0.3 sits at 2.1 steps.
    x = torch.tensor([1.0] + [0.3] * 63)
    nearest = decode(BlockQuantCodec(4, 64), encode(BlockQuantCodec(4, 64), x), 64)
    codec = BlockQuantCodec(4, 64, stochastic=True)
    gen = torch.Generator().manual_seed(1)
    mean = torch.stack([decode(codec, encode(codec, x, gen), 64) for _ in range(2000)]).mean(0)
    assert abs(float(nearest[1]) - 0.3) > 0.01  # rounding to nearest is biased here
    assert abs(float(mean[1:].mean()) - 0.3) < 0.002


def test_int4_packs_two_codes_per_byte():
    codec = BlockQuantCodec(4, 256)
    n = 10_000
    assert codec.nbytes(n) == 4 * 40 + 40 * 256 // 2  # 40 blocks: fp32 scales + half a byte per value
    x = torch.linspace(-7, 7, 15).repeat(20)  # every code value, absmax 7 -> scale 1
    y = decode(codec, encode(codec, x), x.numel())
    torch.testing.assert_close(y, x, rtol=0, atol=1e-6)  # exact codes survive the nibble packing
    assert 8 * codec.nbytes(1 << 20) / (1 << 20) == pytest.approx(4.125)  # the wire cost per value


@pytest.mark.parametrize("codec", [BlockQuantCodec(8, 64), BlockQuantCodec(4, 64), TopKCodec(0.1), NoCodec()])
def test_non_finite_input_is_rejected_with_a_clear_error(codec):
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = torch.ones(100)
        x[37] = bad
        with pytest.raises(ValueError, match="non-finite"):
            encode(codec, x)


def test_non_finite_decodes_as_nan_inside_hooks_not_garbage():
    codec = BlockQuantCodec(4, 8)
    x = torch.arange(24, dtype=torch.float32)
    x[3] = float("inf")
    y = decode(codec, encode(codec, x, allow_nonfinite=True), 24)
    assert torch.isnan(y[:8]).all()  # the whole poisoned block is nan: the trainer sees a bad step
    torch.testing.assert_close(y[8:], x[8:], rtol=0, atol=23 / 14 + 1e-6)


@settings(max_examples=40, deadline=None)
@given(x=vectors(min_size=1, max_size=500), ratio=st.sampled_from([0.01, 0.1, 0.5, 1.0]))
def test_topk_keeps_exactly_the_largest_values(x, ratio):
    codec = TopKCodec(ratio)
    y = decode(codec, encode(codec, x), x.numel())
    k = codec.k(x.numel())
    kept = y != 0
    assert int(kept.sum()) <= k
    torch.testing.assert_close(y[kept], x[kept], rtol=0, atol=0)  # kept values are exact
    if (x != 0).sum() > k:  # nothing dropped is larger than anything kept
        dropped = x[~kept].abs()
        assert float(dropped.max()) <= float(x[kept].abs().min())


def test_topk_plus_int4_quantises_kept_values_and_costs_fewer_bytes():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    plain, quant = TopKCodec(0.05), TopKCodec(0.05, BlockQuantCodec(4, 64))
    assert quant.nbytes(4096) < plain.nbytes(4096) * 0.6
    yp, yq = decode(plain, encode(plain, x), 4096), decode(quant, encode(quant, x), 4096)
    assert torch.equal(yp != 0, yq != 0)  # same positions
    assert 0 < float((yp - yq).abs().max()) <= float(yp.abs().max()) / 14 + 1e-6


def test_rows_encode_independently_and_fixed_size():
    codec = make_codec("int4", block_size=64)
    rows = torch.randn(3, 1000)
    buf = codec.encode_rows(rows)
    assert buf.shape == (3, codec.nbytes(1000)) and codec.nbytes(1000) % 4 == 0
    for i in range(3):
        assert torch.equal(buf[i], encode(codec, rows[i]))


def test_make_codec_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown codec"):
        make_codec("int3")
    with pytest.raises(ValueError, match="block_size"):
        BlockQuantCodec(4, 7)
    assert np.isclose(make_codec("int8", 256).bits, 8)
