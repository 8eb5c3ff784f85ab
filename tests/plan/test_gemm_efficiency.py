"""The per-GEMM efficiency curve against the published cuBLAS table it was fitted to, the
flash-attention and stack terms as a user of `trainforge plan` sees them, and that a
measured (calibrated) cluster is untouched by any of it. Shapes only: nothing runs a GEMM."""

import dataclasses
import math

import pytest

from trainforge.model.config import FLAVORS
from trainforge.plan import gemm_efficiency as ge
from trainforge.plan.cost_model import estimate
from trainforge.plan.hardware import cluster
from trainforge.plan.spec import Cluster, Layout, LinkTier, Workload

HOPPER = ge.KERNEL_TABLES["hopper"]


def _log_errors():
    for b, m, n, k, tflops in ge.H100_CUBLAS_POINTS:
        predicted = 2 * b * m * n * k / ge.gemm_time_s(HOPPER, m, n, k, b) / 1e12
        yield math.log(predicted / tflops), 2 * b * m * n * k


def test_wave_model_reproduces_the_published_cublas_table():
    errs = list(_log_errors())
    assert len(errs) == 72
    rms = math.sqrt(sum(e * e for e, _ in errs) / len(errs))
    assert rms < 0.11  # the fit: 9.7 %
    # the shapes training runs are made of (>= 30 GFLOP) within 8 %; the worst small one within 30 %
    assert max(abs(e) for e, flops in errs if flops >= 3e10) < 0.08
    assert max(abs(e) for e, _ in errs) < 0.30


def test_shape_factor_falls_for_small_k_short_gemms_and_a_partial_last_wave():
    f = lambda m, n, k: ge.gemm_shape_factor(HOPPER, m, n, k)  # noqa: E731
    assert 0.9 < f(16384, 14336, 4096) <= 1.0  # llama-8b's MLP at 2 x 8192 tokens
    assert f(16384, 8192, 512) < f(16384, 8192, 2048) < f(16384, 8192, 8192)  # k: pipeline fill + epilogue
    assert f(256, 256, 256) < 0.1  # launch-bound
    # 132 SMs: 12 x 11 tiles of 64 x 128 are one wave, 7 x 19 = 133 tiles (as many outputs) two
    assert f(7 * 64, 19 * 128, 8192) < 0.6 * f(12 * 64, 11 * 128, 8192)


def test_flash_attention_kernels_by_stack_interpolate_the_published_points():
    fwd2, bwd2 = ge._attention_fraction(HOPPER, "flash-attention-2", 8192)
    assert fwd2 == pytest.approx(333e12 / 989.4e12) and bwd2 == pytest.approx(318e12 / 989.4e12)
    mid = ge._attention_fraction(HOPPER, "cudnn", 6000)[0]
    assert 518e12 / 989.4e12 < mid < 529e12 / 989.4e12
    assert ge._attention_fraction(HOPPER, "cudnn", 100) == ge._attention_fraction(HOPPER, "cudnn", 512)
    assert ge.STACKS["megatron"].attention_kernel == "cudnn"  # Transformer Engine's fused attention


def _w(stack, flavor="llama-8b", seq=8192, batch=16):
    return Workload(FLAVORS[flavor], seq_len=seq, global_batch=batch, stack=stack)


def test_eager_moves_more_bytes_than_compiled_and_megatron_hides_tp():
    c = cluster("h100", 8)
    eager, compiled = (estimate(_w(s), Layout(dp_shard=8, activation_checkpoint=True), c)
                       for s in ("trainforge", "trainforge-compile"))
    assert eager.breakdown["compute_s"] == pytest.approx(compiled.breakdown["compute_s"])  # same kernels
    assert eager.breakdown["memory_bound_s"] > 2 * compiled.breakdown["memory_bound_s"]
    assert eager.tokens_per_s_per_gpu < compiled.tokens_per_s_per_gpu
    tp_layout = Layout(tp=8)
    plain, meg = (estimate(_w(s, batch=8), tp_layout, c) for s in ("trainforge", "megatron"))
    assert meg.breakdown["tp_comm_s"] < plain.breakdown["tp_comm_s"] / 3
    assert meg.breakdown["compute_s"] < plain.breakdown["compute_s"]  # cuDNN attention beats FlashAttention-2


def test_tp_overlap_is_bounded_by_compute_and_costs_the_comm_sms():
    c = cluster("h100", 8)
    assert ge.tp_exposed_s(1.0, 10.0, c, "trainforge") == 1.0  # eager: no async TP
    st = ge.STACKS["megatron"]
    hidden = 1.0 - st.tp_exposed_share
    assert ge.tp_exposed_s(1.0, 10.0, c, "megatron") == pytest.approx(st.tp_exposed_share + hidden * 16 / 132)
    # only 0.25 s of GEMMs to hide behind: the rest waits
    assert ge.tp_exposed_s(1.0, 0.25, c, "megatron") == pytest.approx(0.75 + 0.25 * 16 / 132)


def _measured(name="measured"):
    link = LinkTier(bandwidth_bytes_per_s=1e9, latency_s=1e-4)
    return Cluster(name=name, n_gpus=4, gpus_per_node=4, peak_flops={"fp32": 1e11}, memory_bytes=16 * 2**30,
                   memory_bandwidth_bytes_per_s=1e10, intra=link, inter=link, matmul_efficiency=0.5)


def test_a_measured_cluster_ignores_the_stack_and_keeps_one_efficiency():
    c = _measured()
    w = Workload(FLAVORS["tiny"], seq_len=128, global_batch=8, precision="fp32")
    ests = [estimate(dataclasses.replace(w, stack=s), Layout(dp_shard=2, tp=2), c) for s in ge.STACKS]
    assert all(e.step_s == ests[0].step_s and e.breakdown == ests[0].breakdown for e in ests)
    # compute = FLOPs / (peak x matmul_efficiency), the calibration's assumption
    from trainforge.plan import memory_model as mm
    table = mm.layer_table(w.model, 128, 4)
    flops = sum(table.flops_per_token) + table.head_flops_per_token
    assert ests[0].breakdown["compute_s"] == pytest.approx(flops * 4 * 128 / 2 / (1e11 * 0.5), rel=1e-9)


def test_unknown_stack_or_kernel_table_names_the_choices():
    with pytest.raises(ValueError, match="trainforge, trainforge-compile, megatron"):
        estimate(_w("deepspeed"), Layout(dp_shard=8), cluster("h100", 8))
    with pytest.raises(ValueError, match="hopper"):
        estimate(_w("trainforge"), Layout(dp_shard=8), dataclasses.replace(cluster("h100", 8), kernel_table="volta"))


def test_gpu_entries_carry_the_kernel_table_and_its_sources():
    assert cluster("h100", 8).kernel_table == cluster("h200", 8).kernel_table == "hopper"
    assert cluster("h100-96g-500w", 8).kernel_table == "hopper"
    assert cluster("a100-80g", 8).kernel_table == ""  # no shape table wired in: one efficiency, as before
    assert {"gemm", "attention"} <= set(HOPPER.sources)
    assert "tensorflow/tensorflow" in HOPPER.sources["gemm"] and "2407.08608" in HOPPER.sources["attention"]


def test_te_overlap_cuts_the_tp_gemms_into_chunks_that_run_slower():
    shapes = ge._block_shapes(FLAVORS["llama-70b"], 0, 4096, 8, 1)
    peak, bw = HOPPER.peak_flops, HOPPER.memory_bandwidth_bytes_per_s
    whole = ge._harmonic_factor(HOPPER, shapes, peak, bw, ge.STACKS["trainforge"], 8)
    chunked = ge._harmonic_factor(HOPPER, shapes, peak, bw, ge.STACKS["megatron"], 8)
    assert 0.7 * whole < chunked < 0.97 * whole  # 512-row chunks, three in flight
    # without tensor parallelism nothing is cut
    one = ge._block_shapes(FLAVORS["llama-70b"], 0, 4096, 1, 1)
    assert ge._harmonic_factor(HOPPER, one, peak, bw, ge.STACKS["megatron"], 1) == pytest.approx(
        ge._harmonic_factor(HOPPER, one, peak, bw, ge.STACKS["trainforge"], 1))
    # ring exchange: the column-parallel forward in tp chunks; pipelined reduce-scatter: 4 splits
    assert ge._splits("col", 8, ge.STACKS["megatron"]) == (8, 1, 1)
    assert ge._splits("row", 8, ge.STACKS["megatron"]) == (4, 8, 1)
