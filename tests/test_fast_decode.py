"""The model's inference paths against its plain forward: prefill through a paged cache
gives the training forward's logits exactly; a batched decode step (rows of different
lengths) through the paged cache gives each row's full-sequence logits; and every module's
allocation-free ``decode_calls`` (plain and fused kinds) matches that module's forward and
writes the same keys/values into the pool."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.infer.helpers import model_for
from trainforge.infer.cpu_kernels import load_kernels
from trainforge.infer.cpu_kernels.decode_ops import DecodeKernels
from trainforge.infer.fusion import fuse_model
from trainforge.infer.prepare import prepare_model
from trainforge.model.attention_cache import PagedCache
from trainforge.model.decode_workspace import DecodeWorkspace, RowBlockLinear
from trainforge.model.fast_decode import FastDecoder
from trainforge.model.fused import FusedFeedForward, FusedRMSNorm

ATOL = RTOL = 1e-5
LENGTHS = [5, 13, 1]  # prompt lengths of the three rows


def paged(model, rows: int = 3, context: int = 32) -> PagedCache:
    cfg = model.cfg
    n_slots = (rows + 1) * context  # slot range r+1 for row r; the first is padding
    shape = (cfg.n_layers, cfg.n_kv_heads, n_slots, cfg.head_dim)
    return PagedCache(torch.zeros(shape), torch.zeros(shape), rows, context)


def fill(model, cache: PagedCache, seqs: list[list[int]], S: int = 32) -> None:
    """Prefill each sequence into its own contiguous slot range (row r starts at slot
    (r+1) * S: block 0 is padding) and lay out one decode step of S slots for all rows."""
    B = len(seqs)
    with torch.no_grad():
        for r, seq in enumerate(seqs):
            base = (r + 1) * S
            cache.set_prefill(torch.arange(base, base + len(seq)))
            model(torch.tensor([seq]), torch.arange(len(seq)), cache)
    cache.bias.fill_(float("-inf"))
    for r, seq in enumerate(seqs):
        base, T = (r + 1) * S, len(seq)
        cache.slots[r] = base + T  # the new token's slot
        cache.gather[r * S:(r + 1) * S] = torch.arange(base, base + S)
        cache.bias[r * S:r * S + T + 1] = 0.0


def _kernels(path: str, monkeypatch):
    """None (the torch ops) or the C++ decode ops on instruction path ``path``."""
    if path == "torch":
        return None
    ops = load_kernels()
    if ops is None or not ops.supports(path):
        pytest.skip(f"the C++ kernels did not build or this CPU lacks {path}")
    monkeypatch.setenv("TRAINFORGE_CPU_ISA", path)
    return DecodeKernels(ops)


# kernels: the decode step's rope and paged attention as torch ops, or as the C++ ops on each path.
@pytest.mark.parametrize("kernels", ["torch", "scalar", "avx2"])
@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("shape", ["gqa2", "gqa4", "moe"])
def test_prefill_and_batched_decode_through_the_paged_cache_match_the_full_forward(shape, fuse, kernels,
                                                                                   monkeypatch):
    kernels = _kernels(kernels, monkeypatch)
    model = model_for(shape)
    if fuse:
        fuse_model(model)
    V = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, V, (T + 1,), generator=gen).tolist() for T in LENGTHS]
    prompts, nxt = [s[:-1] for s in seqs], torch.tensor([s[-1] for s in seqs])
    positions = torch.tensor(LENGTHS)
    with torch.no_grad():
        full = [model(torch.tensor([s]))[0] for s in seqs]  # the training forward
        cache = paged(model)
        cache.set_prefill(torch.arange(32, 32 + len(prompts[1])))
        prefill = model(torch.tensor([prompts[1]]), torch.arange(len(prompts[1])), cache)[0]
        if model.cfg.is_moe:  # each expert's GEMM sees fewer rows than in the full forward: rounding differs
            torch.testing.assert_close(prefill, full[1][:-1], atol=ATOL, rtol=RTOL)
        else:
            assert torch.equal(prefill, full[1][:-1])  # same ops as training: bit-identical

        slow_cache, fast_cache = paged(model), paged(model)
        fill(model, slow_cache, prompts)
        fill(model, fast_cache, prompts)
        slow_cache.set_decode(3, 32)
        slow = model(nxt[:, None], positions[:, None], slow_cache)[:, 0]
        tokens, pos = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
        tokens.copy_(nxt)
        pos.copy_(positions)
        fast = FastDecoder(model, fast_cache, tokens, pos, kernels).step(3, 32)
    want = torch.stack([f[-1] for f in full])
    torch.testing.assert_close(slow, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fast, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fast_cache.k, slow_cache.k, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fast_cache.v, slow_cache.v, atol=ATOL, rtol=RTOL)


def test_a_step_bound_once_serves_every_context_length_as_one_cpp_call(monkeypatch):
    """With the C++ kernels the attention reads the context length S from the cache, so the step is
    bound (and compiled into one C++ call program) once for all S; its logits at S = 16 after a
    step at S = 32 equal the plain forward's, and equal bit for bit the same calls run from Python."""
    kernels = _kernels("avx2", monkeypatch)
    model = prepare_model(model_for("gqa2"))  # the engine's model: fused, its linears on the C++ GEMV
    V = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (T,), generator=gen).tolist() for T in LENGTHS]
    nxt, positions = torch.randint(0, V, (3,), generator=gen), torch.tensor(LENGTHS)
    tokens, pos = nxt.clone(), positions.clone()
    with torch.no_grad():
        fast_cache = paged(model)
        fill(model, fast_cache, prompts, S=32)
        dec = FastDecoder(model, fast_cache, tokens, pos, kernels)
        dec.step(3, 32)
        assert len(dec.plan(3, 32)) == 1  # the whole step is one call
        for S in (16, 32):
            slow_cache, fast_cache, loop_cache = paged(model), paged(model), paged(model)
            for c in (slow_cache, fast_cache, loop_cache):
                fill(model, c, prompts, S=S)
            slow_cache.set_decode(3, S)
            slow = model(nxt[:, None], positions[:, None], slow_cache)[:, 0]
            dec.cache.k.copy_(fast_cache.k), dec.cache.v.copy_(fast_cache.v)
            for name in ("slots", "gather", "bias"):
                getattr(dec.cache, name).copy_(getattr(fast_cache, name))
            fast = dec.step(3, S).clone()
            assert dec.plan(3, S) is dec.plan(3, 32)
            loop = FastDecoder(model, loop_cache, tokens, pos, kernels)
            loop_cache.context[0] = S
            for call in loop._bind(3, S):  # the same calls, one by one from Python
                call()
            torch.testing.assert_close(fast, slow, atol=ATOL, rtol=RTOL)
            assert torch.equal(fast, loop.ws.logits[:3])
            assert torch.equal(dec.cache.k, loop_cache.k)


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
def test_each_modules_decode_calls_match_its_forward(fuse):
    model = model_for("gqa4")
    if fuse:
        fuse_model(model)
    block = model.layers["0"]
    assert isinstance(block.ffn_norm, FusedRMSNorm) == fuse
    assert isinstance(block.feed_forward, FusedFeedForward) == fuse
    B, d = 3, model.cfg.dim
    ws = DecodeWorkspace(model, max_rows=4, context_slots=8)
    ws.begin(B, 8)
    x = torch.randn(B, d, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for name, mod in (("norm", block.ffn_norm), ("ffn", block.feed_forward), ("final norm", model.norm)):
            out = torch.full((B, d), float("nan"))
            for call in mod.decode_calls(ws, x, out):
                call()
            torch.testing.assert_close(out, mod(x), atol=ATOL, rtol=RTOL, msg=name)


def test_the_fast_path_is_built_from_the_models_own_parameters():
    """Changing a weight after the decoder is built changes its output (views, not copies)."""
    model = model_for("gqa2")
    cache = paged(model)
    fill(model, cache, [[1, 2, 3]])
    tokens, pos = torch.tensor([4, 0, 0]), torch.tensor([3, 0, 0])
    dec = FastDecoder(model, cache, tokens, pos)
    with torch.no_grad():
        before = dec.step(1, 32).clone()
        cache2 = copy.deepcopy(cache)
        model.layers["1"].feed_forward.w2.weight.mul_(2)
        after = FastDecoder(model, cache2, tokens, pos).step(1, 32)
        again = dec.step(1, 32)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(again, after, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("rows", [1, 7, 64, 65])
def test_row_block_linear_matches_the_linear_it_replaces(rows):
    """The row-block product (2 threads: two blocks of output rows) and the fallback above
    64 rows both equal F.linear; the weight stays shared."""
    lin = torch.nn.Linear(96, 160, bias=False)
    fast = RowBlockLinear.of(lin)
    assert fast.weight is lin.weight
    x = torch.randn(1, rows, 96, generator=torch.Generator().manual_seed(rows))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            torch.testing.assert_close(fast(x), lin(x), atol=1e-6, rtol=1e-6)
    finally:
        torch.set_num_threads(threads)
