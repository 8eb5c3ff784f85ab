"""Parity of the Q8_0 / Q4_0 C++ block kernels with plain PyTorch, on every ISA path."""

import warnings

import pytest
import torch

from trainforge.infer.cpu_kernels import build, formats

ISAS = ["scalar", "avx2", "avx512"]
# Bounds vs the unquantised fp32 matmul: Q4_0 on Gaussian weights lands near 10%, so 15%.
FORMATS = {
    "q8_0": (formats.quantize_q8_0, formats.dequantize_q8_0, 0.01),
    "q4_0": (formats.quantize_q4_0, formats.dequantize_q4_0, 0.15),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", list(FORMATS))
# m: every row-tile size (tiles of 4 rows, tails of 1-3) and a prefill-sized batch.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 40])
@pytest.mark.parametrize("k", [32, 64, 256])
def test_block_linear_matches_reference(ops, monkeypatch, isa, fmt, m, k):
    if not ops.supports(isa):
        pytest.skip(f"this CPU lacks {isa}")
    monkeypatch.setenv("TRAINFORGE_CPU_ISA", isa)
    assert ops.isa() == isa
    quant, dequant, fp32_bound = FORMATS[fmt]
    gen = torch.Generator().manual_seed(m * 1000 + k)
    w = torch.randn(37, k, generator=gen)  # 37 rows: four full groups of 8 and a padded one of 5
    x = torch.randn(m, k, generator=gen)
    qs, d = quant(w)
    pw, ps = formats.pack_x8(qs, d)
    out = getattr(ops, f"{fmt}_linear")(x, pw, ps, 37)
    # Same integers as the kernel: only the fp32 summation order differs.
    exact = formats.quantize_activations(x) @ dequant(qs, d).T
    assert out.shape == (m, 37)
    assert _rel(out, exact) < 1e-5
    assert _rel(out, x @ w.T) < fp32_bound
    into = torch.full((m, 37), float("nan"))
    getattr(ops, f"{fmt}_linear_into")(x, pw, ps, into)
    assert torch.equal(into, out)
    # The prefetch hint (residency.py) moves cache lines, never results.
    kept = ops.keeps_weights_cached()
    try:
        ops.set_keep_weights_cached(not kept)
        assert torch.equal(getattr(ops, f"{fmt}_linear")(x, pw, ps, 37), out)
    finally:
        ops.set_keep_weights_cached(kept)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_pack_x8_moves_bytes_into_groups_of_8_rows(fmt):
    qs, d = FORMATS[fmt][0](torch.randn(11, 64))
    pw, ps = formats.pack_x8(qs, d)
    bpb = qs.shape[1] // 2  # bytes per block (2 blocks of 32)
    assert pw.shape == (2, 2 * 8 * bpb) and ps.shape == (2, 16)
    # row 9 = group 1, lane 1; its block 1, bytes 4..7 = chunk 1 of that block
    chunk = pw[1, 1 * 8 * bpb + 1 * 32 + 1 * 4:][:4]
    assert torch.equal(chunk, qs[9, bpb + 4:bpb + 8])
    assert ps[1, 1 * 8 + 1] == d[9, 1]
    assert torch.all(pw[1].view(2, -1, 8, 4)[:, :, 3:] == 0)  # rows 11..15: zero padding


def test_block_linear_rejects_unpacked_weights(ops):
    qs, d = formats.quantize_q8_0(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match="pack_x8"):
        ops.q8_0_linear(torch.randn(1, 64), qs, d, 16)


def test_q4_0_packs_in_llama_cpp_order():
    # Block of 32 with -8 at element 0 sets d = 1 (largest magnitude -8 -> d = -8 / -8).
    w = torch.zeros(1, 32)
    w[0, 0] = -8.0
    w[0, 1] = 3.0  # element 1: low nibble of byte 1
    w[0, 16] = 5.0  # element 16: high nibble of byte 0
    w[0, 31] = -2.0  # element 31: high nibble of byte 15
    qs, d = formats.quantize_q4_0(w)
    assert d.item() == 1.0
    assert qs.shape == (1, 16)
    assert qs[0, 0].item() == (0 + 8 - 8) | ((5 + 8) << 4)  # q = value / d + 8 ... d = 1
    assert qs[0, 1].item() == (3 + 8) | (8 << 4)
    assert qs[0, 15].item() == 8 | ((-2 + 8) << 4)
    assert torch.equal(formats.dequantize_q4_0(qs, d), w)


def test_q8_0_scale_is_absmax_over_127():
    w = torch.linspace(-2.54, 1.0, 32).reshape(1, 32)
    qs, d = formats.quantize_q8_0(w)
    assert d.dtype == torch.float16
    assert d.item() == pytest.approx(2.54 / 127, rel=1e-3)
    assert qs[0, 0].item() == -127


def test_unsupported_forced_isa_warns_and_returns_none(ops, monkeypatch):
    if ops.supports("avx512"):
        monkeypatch.setenv("TRAINFORGE_CPU_ISA", "avx9000")  # rejected by name instead
    else:
        monkeypatch.setenv("TRAINFORGE_CPU_ISA", "avx512")
    build._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match="falls back to today's kernels"):
        assert build.load_kernels() is None


def test_failed_build_returns_none_without_a_warning_per_call(monkeypatch):
    # build() reported the failure (once per cache: tests/faults/test_kernel_build.py); callers
    # of load_kernels, one per layer, add nothing.
    monkeypatch.setattr(build, "_build", lambda: "no C++ compiler: c++ is not on PATH")
    build._warn_once.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build.load_kernels() is None
        assert build.load_kernels() is None


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 3, 8, 9])  # 9: above the GEMV limit, the at::matmul path
# (130, 32): more than one 64-row chunk, so split across threads when there are two.
@pytest.mark.parametrize("n,k", [(37, 64), (8, 100), (5, 7), (130, 32)])  # row, K tails
@pytest.mark.parametrize("prefetch", ["0", "1"])  # both forms of the M = 1 loops (isa.h, stream_prefetch)
def test_f32_linear_matches_f_linear(ops, monkeypatch, isa, m, n, k, prefetch):
    if not ops.supports(isa):
        pytest.skip(f"this CPU lacks {isa}")
    monkeypatch.setenv("TRAINFORGE_CPU_ISA", isa)
    monkeypatch.setenv("TRAINFORGE_CPU_PREFETCH", prefetch)
    gen = torch.Generator().manual_seed(m * 100 + n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    # Only the fp32 summation order differs from F.linear: 1e-5 relative covers K <= 100.
    out = ops.f32_linear(x, w)
    assert _rel(out, torch.nn.functional.linear(x, w)) < 1e-5
    into = torch.full((m, n), float("nan"))
    ops.f32_linear_into(x, w, into)
    assert torch.equal(into, out)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 3, 4, 9, 32, 63])  # whole 4-row tiles and 1-3 rows left
# Weight rows that fill no whole tile (6 on AVX-512, 3 on AVX2), K tails, and 200 x 768: more
# than one thread's share (grain of 8 tiles) with the next tile's prefetch running.
@pytest.mark.parametrize("n,k", [(37, 64), (8, 100), (5, 7), (200, 768)])
def test_small_gemm_matches_f_linear(ops, monkeypatch, isa, m, n, k):
    """The batched decode step's fp32 GEMM (small_gemm.cpp) against F.linear, into strided rows
    as the decode workspace hands it (the activations and the output are views of wider rows)."""
    if not ops.supports(isa):
        pytest.skip(f"this CPU lacks {isa}")
    monkeypatch.setenv("TRAINFORGE_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k + 5, generator=gen)[:, 2:k + 2]
    out = torch.full((m, n + 3), float("nan"))
    ops.f32_gemm_into(x, w, out[:, 1:n + 1])
    want = torch.nn.functional.linear(x, w)
    # Only the fp32 summation order differs: 1e-5 relative plus 1e-5 * sqrt(K) absolute (the
    # products are N(0, 1), their sums' spread sqrt(K)).
    assert torch.allclose(out[:, 1:n + 1], want, rtol=1e-5, atol=1e-5 * k ** 0.5)
    assert out[:, 0].isnan().all() and out[:, n + 1:].isnan().all()  # nothing outside the view written


@pytest.mark.parametrize("isa", ISAS)
# D 64 / 128: the grouped kernel's 4-vector output chunks (two of them at 128); 24: a multiple of 8
# only (the AVX2 group kernel on an AVX-512 path); 12: the per-head kernel. G = H / Hkv 1 or 3.
@pytest.mark.parametrize("D", [12, 24, 64, 128])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2)])
def test_paged_attention_matches_sdpa_over_the_gathered_slots(ops, monkeypatch, isa, D, H, Hkv):
    if not ops.supports(isa):
        pytest.skip(f"this CPU lacks {isa}")
    monkeypatch.setenv("TRAINFORGE_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(D * 10 + H)
    B, S, n_slots, valid = 2, 40, 96, [40, 7]  # row 1 attends to 7 of its 40 slots (the rest masked)
    q, k, v = torch.randn(B, H * D, generator=gen), torch.randn(B, Hkv * D, generator=gen), \
        torch.randn(B, Hkv * D, generator=gen)
    kp, vp = torch.randn(Hkv, n_slots, D, generator=gen), torch.randn(Hkv, n_slots, D, generator=gen)
    gather = torch.stack([torch.randperm(n_slots - 2, generator=gen)[:S] + 2 for _ in range(B)])  # slots 2..
    slots = torch.tensor([0, 1])  # the new keys / values land in slots 0 and 1, each row's last valid slot
    gather[0, valid[0] - 1], gather[1, valid[1] - 1] = 0, 1
    bias = torch.full((B, S), float("-inf"))
    for b, n in enumerate(valid):
        bias[b, :n] = 0.0
    want_kp, want_vp = kp.clone(), vp.clone()
    want_kp[:, slots] = k.view(B, Hkv, D).transpose(0, 1)
    want_vp[:, slots] = v.view(B, Hkv, D).transpose(0, 1)
    kg = want_kp[:, gather].permute(1, 0, 2, 3)  # (B, Hkv, S, D)
    vg = want_vp[:, gather].permute(1, 0, 2, 3)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.view(B, H, 1, D), kg, vg, attn_mask=bias.view(B, 1, 1, S), enable_gqa=True).reshape(B, H * D)
    out = torch.full((B, H * D), float("nan"))
    ops.paged_attention_into(q, k, v, kp, vp, slots, gather.reshape(-1), bias.reshape(-1), torch.tensor([S]),
                             D ** -0.5, out)
    assert torch.equal(kp, want_kp) and torch.equal(vp, want_vp)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)  # fp32 summation order only


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "f32"])
def test_ops_have_shape_functions_for_compile(ops, fmt):
    # opcheck runs the op under fake tensors (what torch.compile traces with) and checks the
    # registration against the real kernel's output shape and dtype.
    w = torch.randn(45, 64)
    args = (w,) if fmt == "f32" else (*formats.pack_x8(*FORMATS[fmt][0](w)), 45)
    x = torch.randn(3, 64)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(getattr(ops, f"{fmt}_linear"), (x, *args), test_utils=checks)
    torch.library.opcheck(getattr(ops, f"{fmt}_linear_into"), (x, *args[:2], torch.empty(3, 45)),
                          test_utils=checks)


def test_gemv_linear_moves_a_mapped_weight_to_the_arena_and_keeps_it_tied(ops):
    """A weight that is a view at a 16-byte offset (as numpy copies and file maps give) is moved
    into the weight arena, cache-line aligned; a module sharing the Parameter (a tied output)
    still shares it, and the product is unchanged."""
    from trainforge.infer.cpu_linear import GemvLinear
    from trainforge.infer.weight_arena import ALIGN

    base = torch.randn(64 * 48 + 4)
    lin = torch.nn.Linear(48, 64, bias=False)
    lin.weight = torch.nn.Parameter(base[4:].view(64, 48), requires_grad=False)
    assert lin.weight.data_ptr() % ALIGN  # the case under test: unaligned
    emb = torch.nn.Embedding(64, 48)
    emb.weight = lin.weight
    want = torch.nn.functional.linear(torch.ones(1, 48), base[4:].view(64, 48))
    gemv = GemvLinear.of(lin, ops)
    assert gemv.weight.data_ptr() % ALIGN == 0
    assert emb.weight is gemv.weight
    assert torch.equal(gemv(torch.ones(1, 48)), ops.f32_linear(torch.ones(1, 48), base[4:].view(64, 48)))
    assert _rel(gemv(torch.ones(1, 48)), want) < 1e-5


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn+small_gemm", "mkl+bmm"])
# GEMV; small GEMM (9-48) and oneDNN (49-64), or the bmm; prompt GEMM (oneDNN or MKL)
@pytest.mark.parametrize("rows", [1, 8, 9, 48, 49, 64, 65, 300])
def test_gemv_linear_matches_f_linear_on_every_row_count_path(ops, monkeypatch, rows, onednn):
    from trainforge.infer import cpu_linear

    if onednn and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(cpu_linear, "onednn_prompt_gemm", lambda: onednn)
    monkeypatch.setattr(cpu_linear, "amd_small_rows", lambda: onednn)  # 9-64 rows: small GEMM + oneDNN, or the bmm
    gen = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(96, 130, bias=False)
    lin.weight = torch.nn.Parameter(torch.randn(130, 96, generator=gen), requires_grad=False)
    x = torch.randn(1, rows, 96, generator=gen)
    want = torch.nn.functional.linear(x, lin.weight.detach().clone())
    gemv = cpu_linear.GemvLinear.of(lin, ops)
    with torch.no_grad():
        got = gemv(x)
    assert got.shape == want.shape
    assert _rel(got, want) < 1e-5  # fp32 summation order only
    if rows <= 64:  # the decode step's bound form of the same rows (f32_linear_into, f32_gemm_into, oneDNN)
        out = torch.full((rows, 130), float("nan"))
        gemv.bind_into(x[0], out)()
        assert _rel(out, want[0]) < 1e-5


def test_a_cached_build_loads_without_cpp_extension(ops):
    # A decode process that finds its kernels built loads the .so itself: cpp_extension would
    # import setuptools (+4.4 MiB RSS) and start `ninja --version` and `c++ -dumpversion`.
    import subprocess
    import sys

    code = ("import sys; from trainforge.infer.cpu_kernels import build; "
            "assert build.load_kernels() is not None; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch.utils.cpp_extension', 'setuptools'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_cut_short_build_is_not_loaded(tmp_path):
    lib = tmp_path / "trainforge_cpu_kernels.so"
    assert not build._load_built(lib)  # absent: cpp_extension.load builds it
    lib.write_bytes(b"\x7fELF cut short")
    assert not build._load_built(lib)  # does not load: left to cpp_extension.load


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 40])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_int4_groups_run_on_the_q4_kernel_with_a_zero_per_group(ops, monkeypatch, isa, m, group_size):
    """quantize.int4's asymmetric groups ((q - 8 - z) * s) on the C++ kernel: the same integers
    as its own dequantisation times the int8 activations (fp32 summation order only), on every
    instruction path, 37 rows (a padded group of 8), every row-tile size."""
    from trainforge.infer.quantize.int4 import dequantize_int4, quantize_int4

    if not ops.supports(isa):
        pytest.skip(f"this CPU lacks {isa}")
    monkeypatch.setenv("TRAINFORGE_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(m * 1000 + group_size)
    k = 512
    w = torch.randn(37, k, generator=gen) + 0.5  # off-centre groups: zero points away from 8
    x = torch.randn(m, k, generator=gen)
    packed, scales, zeros = quantize_int4(w, group_size)
    assert zeros.abs().max() > 0
    pw, ps, pz = formats.pack_int4_x8(packed, scales, zeros)
    out = ops.int4_linear(x, pw, ps, pz, group_size, 37)
    exact = formats.quantize_activations(x) @ dequantize_int4(packed, scales, zeros).T
    assert out.shape == (m, 37)
    assert _rel(out, exact) < 1e-5
    assert _rel(out, x @ w.T) < 0.15
    into = torch.full((m, 37), float("nan"))
    ops.int4_linear_into(x, pw, ps, pz, group_size, into)
    assert torch.equal(into, out)


def test_int4_codes_keep_their_values_in_q4_0_blocks():
    from trainforge.infer.quantize.int4 import quantize_int4, unpack_int4

    packed, _, _ = quantize_int4(torch.randn(3, 64), 32)
    codes = formats.int4_codes_as_q4_0(packed)
    q = unpack_int4(packed)
    block = codes[:, 32 // 2:].int()  # the second 32-value block
    assert torch.equal(block & 15, q[:, 32:48]) and torch.equal(block >> 4, q[:, 48:64])
    with pytest.raises(ValueError, match="int8 zero points"):
        formats.pack_int4_x8(packed, torch.ones(3, 2), torch.zeros(3, 2))  # a pre-2026-12 fp32 zero


def test_int4_linear_takes_the_block_kernel_and_binds_its_out_form(ops):
    from trainforge.infer.quantize.int4 import Int4Linear

    w = torch.randn(40, 256)
    mod = Int4Linear.quantize(w, group_size=64)
    want = formats.quantize_activations(x := torch.randn(3, 256)) @ mod.dequantize().T
    assert mod.pack() == "blocks"  # the CPU default (common.PREFERENCE)
    torch.testing.assert_close(mod(x), want, atol=1e-4, rtol=1e-4)
    out = torch.full((3, 40), float("nan"))
    call = mod.bind_into(x, out)
    assert call.func is ops.int4_linear_into.default  # the decode step calls the op with no Python frame
    call()
    assert torch.equal(out, mod(x))
    legacy = Int4Linear.from_stored({"weight": torch.zeros(16, 32, dtype=torch.uint8), "scales": torch.ones(16, 1),
                                     "zeros": torch.zeros(16, 1)}, 64, 16, group_size=64)
    assert "fp32 zero" in legacy.supports("blocks")
    assert legacy.pack() == "int4pack_cpu"  # the next kernel in the CPU's order, not the slow reference


def test_int4_op_has_shape_functions_for_compile(ops):
    from trainforge.infer.quantize.int4 import quantize_int4

    pw, ps, pz = formats.pack_int4_x8(*quantize_int4(torch.randn(45, 64), 32))
    x, checks = torch.randn(3, 64), ("test_schema", "test_faketensor")
    torch.library.opcheck(ops.int4_linear, (x, pw, ps, pz, 32, 45), test_utils=checks)
    torch.library.opcheck(ops.int4_linear_into, (x, pw, ps, pz, 32, torch.empty(3, 45)), test_utils=checks)
