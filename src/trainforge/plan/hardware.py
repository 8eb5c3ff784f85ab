"""The shipped GPU table: what the cost model assumes a device and its links can do,
every number with its source.

    cluster("h100", 64)          # -> Cluster: 8 nodes of 8 H100 SXM, NVLink inside, 8x400G IB between

Units are SI (TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 B/s); memory sizes are what the device
reports (GiB). Peaks are dense (no 2:4 sparsity: the datasheets' headline figures are
twice these). Link bandwidths are per GPU and one direction, the way NCCL's bus
bandwidth counts them; ``link_efficiency`` scales the datasheet figure to what a large
collective reaches (nccl-tests bus bandwidth on 8x A100 SXM, 230-250 GB/s of NVLink 3's
300 GB/s, is 0.8; an assumption carried over to the other links). Latencies are
assumptions (a few microseconds per NCCL step over NVLink / xGMI, about twice that over
InfiniBand), not datasheet figures: they only matter for small messages.

``matmul_efficiency`` is the fraction of the dense bf16 peak a large, well-shaped GEMM
reaches. ``kernel_table`` (H100/H200: "hopper") names the per-kernel figures of
``gemm_efficiency``: each GEMM's shape factor multiplies that efficiency, attention runs at
the training stack's flash-attention speed. A100 and MI300X have no table wired in: one
efficiency for every FLOP. ``VARIANTS``: boards of published runs that differ from the table
entry (torchtitan's 500 W HBM2e H100); ``--gpu`` accepts them too. Every board a published
row of ``published.py`` ran on is here (h100, h100-96g-500w, h800).

``fp8``: the dense FP8 tensor peak (Hopper, MI300X); A100 has none, and ``plan --precision
fp8`` refuses it by name (``has_fp8``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trainforge.plan.spec import Cluster, LinkTier

GiB = 2**30
TFLOPS = 1e12
GBps = 1e9

_H100_DATASHEET = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200_DATASHEET = "https://www.nvidia.com/en-us/data-center/h200/"
# The H800 (SXM5) is the H100 SXM5's GH100 with NVLink cut to 400 GB/s (from 900) and FP64
# cut: its datasheet's tensor peaks (FP8 3,958, BF16/FP16 1,979, TF32 989 TFLOP/s with
# sparsity; FP32 67), 80 GB HBM3 and 3.35 TB/s are the H100 SXM5's.
_H800_DATASHEET = ("NVIDIA H800 Tensor Core GPU datasheet, H800 SXM5 column (FP8 3,958 / BF16 1,979 TFLOP/s with "
                   "sparsity, 80 GB HBM3, 3.35 TB/s, NVLink 400 GB/s): https://www.nvidia.cn/data-center/h800/")
_DEEPSEEK_V3 = ("DeepSeek-V3 Technical Report (arXiv 2412.19437) section 3.1: 2048 H800, 8 per node on "
                "NVLink/NVSwitch, IB between nodes, 'NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times "
                "that of IB (50 GB/s)'")
_A100_DATASHEET = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                   "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_MI300X_DATASHEET = ("https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
                     "amd-instinct-mi300x-data-sheet.pdf")
_NCCL_TESTS = ("nccl-tests all_reduce_perf bus bandwidth references (8x H100 SXM 460-480 GB/s with NVLS, 8x A100 "
               "SXM 230-250 GB/s): https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests")
_SEMIANALYSIS = ("SemiAnalysis, 'MI300X vs H100 vs H200 Benchmark Part 1: Training' (2024-12), GEMM section: "
                 "https://semianalysis.com/2024/12/22/mi300x-vs-h100-vs-h200-benchmark-part-1-training/")
_NDR = ("8x ConnectX-7 NDR 400 Gb/s per 8-GPU node (DGX H100 / HGX H100 / H200 reference design) = 50 GB/s per GPU: "
        "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html")
_LATENCY = "assumption: a few microseconds per NCCL step (intra-node), about twice that across InfiniBand"


@dataclass(frozen=True)
class GPUSpec:
    """One device kind. ``intra_bandwidth_bytes_per_s``: NVLink / xGMI, per GPU, one
    direction, datasheet; ``inter_bandwidth_bytes_per_s``: the node's NIC share of one GPU
    (one direction). ``sources``: field -> where the number comes from."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    intra_bandwidth_bytes_per_s: float
    intra_latency_s: float
    inter_bandwidth_bytes_per_s: float
    inter_latency_s: float
    matmul_efficiency: float
    link_efficiency: float = 0.8
    gpus_per_node: int = 8
    sources: dict[str, str] = field(default_factory=dict)
    kernel_table: str = ""  # gemm_efficiency.KERNEL_TABLES key: GEMM shape curve, attention kernels, stacks


def _hopper(name: str, memory_gib: float, hbm_tb_s: float, datasheet: str, nvlink_gb_s: float = 900,
            inter_source: str = _NDR) -> GPUSpec:
    # H100 SXM, H200 SXM and H800 SXM are the same GH100 die and clocks: same peaks; NVLink 4 at
    # 900 GB/s bidirectional (H800: 400).
    return GPUSpec(
        name=name,
        peak_flops={"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS,
                    "tf32": 494.7 * TFLOPS, "fp32": 66.9 * TFLOPS},
        memory_bytes=memory_gib * GiB, memory_bandwidth_bytes_per_s=hbm_tb_s * 1e12,
        intra_bandwidth_bytes_per_s=nvlink_gb_s / 2 * GBps, intra_latency_s=5e-6,
        inter_bandwidth_bytes_per_s=50 * GBps, inter_latency_s=10e-6,
        matmul_efficiency=0.72, kernel_table="hopper",
        sources={"peak_flops": f"{datasheet} (dense = half the sparse figures; tf32/fp32 dense as listed)",
                 "memory_bytes": datasheet, "memory_bandwidth_bytes_per_s": datasheet,
                 "intra_bandwidth_bytes_per_s": f"{datasheet}: NVLink 4, {nvlink_gb_s:.0f} GB/s bidirectional = "
                                                f"{nvlink_gb_s / 2:.0f} GB/s each way",
                 "inter_bandwidth_bytes_per_s": inter_source, "intra_latency_s": _LATENCY, "inter_latency_s": _LATENCY,
                 "link_efficiency": _NCCL_TESTS, "gpus_per_node": f"HGX / DGX 8-GPU baseboard: {_NDR}",
                 "matmul_efficiency": f"{_SEMIANALYSIS}: large bf16 GEMMs reach roughly 0.7 of the dense peak on "
                                      "H100/H200 (0.72 taken)"})


GPUS: dict[str, GPUSpec] = {
    # H100 SXM5 80 GB HBM3 (the PCIe and NVL boards have lower clocks and links).
    "h100": _hopper("h100", 80, 3.35, _H100_DATASHEET),
    # H200 SXM 141 GB HBM3e, 4.8 TB/s; nvidia-smi reports ~140 GiB.
    "h200": _hopper("h200", 140, 4.8, _H200_DATASHEET),
    # H800 SXM5 80 GB HBM3 (DeepSeek-V3's board): H100 peaks and memory, NVLink 400 GB/s
    # bidirectional (200 each way; DeepSeek measured 160 achievable); IB 50 GB/s per GPU as H100's.
    "h800": _hopper("h800", 80, 3.35, _H800_DATASHEET, nvlink_gb_s=400,
                    inter_source=f"{_DEEPSEEK_V3}; = 8x NDR 400 Gb/s per node as {_NDR}"),
    # A100 SXM4 80 GB HBM2e; DGX A100 has 8x 200 Gb/s HDR InfiniBand (25 GB/s per GPU).
    "a100-80g": GPUSpec(
        name="a100-80g",
        peak_flops={"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS},
        memory_bytes=80 * GiB, memory_bandwidth_bytes_per_s=2.039e12,
        intra_bandwidth_bytes_per_s=300 * GBps, intra_latency_s=5e-6,
        inter_bandwidth_bytes_per_s=25 * GBps, inter_latency_s=10e-6,
        matmul_efficiency=0.8,
        sources={"peak_flops": f"{_A100_DATASHEET} (dense; no fp8 on Ampere)", "memory_bytes": _A100_DATASHEET,
                 "memory_bandwidth_bytes_per_s": f"{_A100_DATASHEET}: 2,039 GB/s (SXM 80 GB)",
                 "intra_bandwidth_bytes_per_s": f"{_A100_DATASHEET}: NVLink 3, 600 GB/s = 300 GB/s each way",
                 "inter_bandwidth_bytes_per_s": "DGX A100: 8x Mellanox ConnectX-6 HDR 200 Gb/s per node = 25 GB/s "
                                                "per GPU: https://docs.nvidia.com/dgx/dgxa100-user-guide/"
                                                "introduction-to-dgxa100.html",
                 "intra_latency_s": _LATENCY, "inter_latency_s": _LATENCY, "link_efficiency": _NCCL_TESTS,
                 "gpus_per_node": "DGX A100 / HGX A100 8-GPU baseboard",
                 "matmul_efficiency": "assumption: ~250 of 312 TFLOP/s for large bf16 cuBLAS GEMMs"}),
    # MI300X OAM 192 GB HBM3: 7 xGMI links of 64 GB/s each way to the other 7 GPUs.
    "mi300x": GPUSpec(
        name="mi300x",
        peak_flops={"bf16": 1307.4 * TFLOPS, "fp16": 1307.4 * TFLOPS, "fp8": 2614.9 * TFLOPS,
                    "tf32": 653.7 * TFLOPS, "fp32": 163.4 * TFLOPS},
        memory_bytes=192 * GiB, memory_bandwidth_bytes_per_s=5.3e12,
        intra_bandwidth_bytes_per_s=448 * GBps, intra_latency_s=5e-6,
        inter_bandwidth_bytes_per_s=50 * GBps, inter_latency_s=10e-6,
        matmul_efficiency=0.47,
        sources={"peak_flops": f"{_MI300X_DATASHEET} (dense matrix peaks; fp32 = matrix fp32)",
                 "memory_bytes": _MI300X_DATASHEET, "memory_bandwidth_bytes_per_s": _MI300X_DATASHEET,
                 "intra_bandwidth_bytes_per_s": f"{_MI300X_DATASHEET}: 7 Infinity Fabric links x 128 GB/s "
                                                "bidirectional = 448 GB/s each way (peer-to-peer, fully connected)",
                 "inter_bandwidth_bytes_per_s": "assumption: 8x 400 Gb/s NICs per node as the H100 reference design",
                 "intra_latency_s": _LATENCY, "inter_latency_s": _LATENCY, "link_efficiency": _NCCL_TESTS,
                 "gpus_per_node": f"{_MI300X_DATASHEET}: 8 GPUs per platform (fully connected xGMI)",
                 "matmul_efficiency": f"{_SEMIANALYSIS}: MI300X bf16 GEMMs reach a little under half the dense "
                                      "peak (0.47 taken)"}),
}


_TORCHTITAN_HW = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 820504e): 'H100 GPUs with "
                  "96GB HBM2e ... at 500 W power limit ... the actual peak TFLOPs number is between SXM and NVL'")
# Published runs on other boards of a table GPU (bench/plan_validation.py's rows); --gpu accepts them too.
VARIANTS: dict[str, GPUSpec] = {
    # Meta's Grand Teton H100: 96 GB HBM2e, 500 W. Peaks: the midpoint of SXM (989.4) and NVL (835.5 dense
    # bf16) as the source puts it; HBM2e: 6 stacks at the H100 PCIe's rate (2.0 TB/s over 5 stacks).
    "h100-96g-500w": dataclasses.replace(
        GPUS["h100"], name="h100-96g-500w",
        peak_flops={k: v * (989.4 + 835.5) / 2 / 989.4 for k, v in GPUS["h100"].peak_flops.items()},
        memory_bytes=95 * GiB, memory_bandwidth_bytes_per_s=2.4e12,
        sources={**GPUS["h100"].sources,
                 "peak_flops": f"{_TORCHTITAN_HW}: the SXM/NVL midpoint, 912 dense bf16 TFLOP/s (NVL: 1,671 sparse "
                               f"= 835.5 dense, {_H100_DATASHEET})",
                 "memory_bytes": f"{_TORCHTITAN_HW} (95 GiB usable, assumption)",
                 "memory_bandwidth_bytes_per_s": "assumption: 6 HBM2e stacks at the H100 PCIe's 2.0 TB/s per 5 "
                                                 f"stacks = 2.4 TB/s ({_H100_DATASHEET})"}),
}


def has_fp8(peak_flops: dict[str, float]) -> bool:
    """Whether a board (its ``peak_flops``) has FP8 tensor cores to price ``--precision fp8`` with."""
    return bool(peak_flops.get("fp8"))


def cluster(gpu: str, n_gpus: int) -> Cluster:
    """``n_gpus`` of ``gpu`` (a ``GPUS`` key), ``gpus_per_node`` per node. ValueError
    naming the known GPUs for an unknown name, or for n_gpus < 1."""
    key = gpu.lower()
    if key not in GPUS and key not in VARIANTS:
        raise ValueError(f"unknown GPU {gpu!r}: choose one of {', '.join(sorted(GPUS))} (or 'measured' for a "
                         f"probe of this machine; boards of published runs: {', '.join(sorted(VARIANTS))})")
    if n_gpus < 1:
        raise ValueError(f"--gpus {n_gpus}: need at least 1 GPU")
    s = GPUS[key] if key in GPUS else VARIANTS[key]
    eff = s.link_efficiency
    intra = LinkTier(s.intra_bandwidth_bytes_per_s * eff, s.intra_latency_s,
                     f"{s.sources['intra_bandwidth_bytes_per_s']} x link_efficiency {eff}")
    inter = LinkTier(s.inter_bandwidth_bytes_per_s * eff, s.inter_latency_s,
                     f"{s.sources['inter_bandwidth_bytes_per_s']} x link_efficiency {eff}")
    return Cluster(name=s.name, n_gpus=n_gpus, gpus_per_node=min(s.gpus_per_node, n_gpus),
                   peak_flops=dict(s.peak_flops), memory_bytes=s.memory_bytes,
                   memory_bandwidth_bytes_per_s=s.memory_bandwidth_bytes_per_s, intra=intra, inter=inter,
                   sources=dict(s.sources), matmul_efficiency=s.matmul_efficiency, kernel_table=s.kernel_table)
