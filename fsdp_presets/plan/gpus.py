"""GPU types the step-time model knows: peak dense matmul rates, memory bandwidth, the link between
the GPUs of one node, memory, and the network a cluster of them usually has. Standard library only.

    gpu = gpu_type("h100-sxm")          # case-insensitive; an unknown name says the known ones
    gpu.peak_bf16_flops, gpu.hbm_bytes_per_s, gpu.intra_node_bytes_per_s

Every figure is the vendor's datasheet figure *without* structured sparsity (the datasheets print
the sparse figure first, twice the dense one). Sources:

- [A100] NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TFLOPS, HBM2 1,555 GB/s (40GB),
  HBM2e 2,039 GB/s (80GB SXM), NVLink 600 GB/s (both directions together).
- [H100] NVIDIA H100 Tensor Core GPU datasheet (2023): SXM BF16 989 / FP8 1,979 TFLOPS, HBM3
  3.35 TB/s, NVLink 900 GB/s; PCIe BF16 756 / FP8 1,513 TFLOPS, HBM2e 2.0 TB/s, PCIe Gen5 128 GB/s.
- [H200] NVIDIA H200 datasheet (2024): BF16 989 / FP8 1,979 TFLOPS, 141 GB HBM3e at 4.8 TB/s,
  NVLink 900 GB/s.
- [B200] NVIDIA DGX B200 datasheet (2024): 72 PFLOPS FP8 training and 1,440 GB of HBM3e at 64 TB/s
  for 8 GPUs (sparse): per GPU BF16 2,250 / FP8 4,500 TFLOPS dense, 180 GB, 8 TB/s; NVLink 5
  1.8 TB/s.
- [MI300X] AMD Instinct MI300X data sheet (2023): BF16 1,307.4 / FP8 2,614.9 TFLOPS dense, 192 GB
  HBM3 at 5.3 TB/s, 7 Infinity Fabric links of 128 GB/s (896 GB/s peer to peer, both directions).
- [L40S] NVIDIA L40S datasheet (2023): BF16 362 / FP8 733 TFLOPS dense, 48 GB GDDR6 at 864 GB/s,
  PCIe Gen4 x16.
- [L4] NVIDIA L4 datasheet (2023): BF16 121 / FP8 242.5 TFLOPS dense, 24 GB at 300 GB/s, PCIe Gen4.
- [A10] NVIDIA A10 datasheet (2021): BF16 125 TFLOPS dense, 24 GB GDDR6 at 600 GB/s, PCIe Gen4.
  AWS's A10G (G5 instances) is an A10 variant: AWS publishes no tensor rate for it, so the A10's is
  used (an upper bound).
- [Ada] NVIDIA Ada GPU architecture whitepaper (2023), GeForce RTX 4090: BF16 165.2 TFLOPS dense with
  FP32 accumulate (what training uses), FP8 330.3, 24 GB GDDR6X at 1,008 GB/s, PCIe Gen4 x16 and no
  NVLink.
- [DGX] Per-GPU network of the reference clusters: DGX A100, one 200 Gb/s HDR InfiniBand adapter
  per GPU; DGX H100/H200/B200, one 400 Gb/s NDR adapter per GPU (NVIDIA DGX user guides). The
  PCIe cards usually sit in cloud nodes with one 100 Gb/s network shared by the node (12.5 Gb/s a
  GPU where eight share it): give ``--inter-node-gbps`` for yours.

fp32 is the CUDA-core rate (torch leaves TF32 off for matmuls by default): A100 19.5, H100 SXM 67, PCIe
51, B200 75 (HGX B200 datasheet), MI300X 163.4, L40S 91.6, L4 30.3, A10 31.2, RTX 4090 82.6 TFLOPS. The
host link is PCIe: Gen4 x16 for A100 and the PCIe cards, Gen5 x16 for H100/H200/B200/MI300X.

Link figures here are one direction (what a ring collective uses): NVLink's 600/900/1,800 GB/s
are both directions together, so 300/450/900 GB/s; PCIe Gen4 x16 32 GB/s, Gen5 64 GB/s.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from fsdp_presets.errors import UsageError, unknown_name_message

TERA = 1e12
GB = 1e9


@dataclass(frozen=True, kw_only=True)
class GpuType:
    """One GPU model's datasheet figures (dense, no sparsity)."""

    name: str
    """The name ``--gpu`` takes (case-insensitive)."""
    peak_bf16_flops: float
    """Dense bf16/fp16 tensor-core rate, FLOP/s."""
    peak_fp8_flops: float | None
    """Dense fp8 rate, FLOP/s; None where the GPU has no fp8 tensor cores."""
    hbm_bytes_per_s: float
    """Memory bandwidth, bytes/s."""
    peak_fp32_flops: float
    """Dense fp32 rate without TF32 (torch's default for matmuls), FLOP/s."""
    intra_node_bytes_per_s: float
    """One direction of one GPU's link to the others in its node (NVLink, Infinity Fabric, PCIe), bytes/s."""
    host_link_bytes_per_s: float
    """One direction of the GPU's PCIe link to its host (CPU offload's traffic), bytes/s."""
    memory_gib: float
    """Memory of one GPU as the datasheet gives it (GB there; planned as GiB, which is a little more cautious)."""
    inter_node_gbps: float
    """Network of one GPU to other nodes in Gb/s in the reference cluster ([DGX]); ``--inter-node-gbps``."""
    source: str
    """Where the figures come from (a key of the module's source list)."""

    def __post_init__(self) -> None:
        for field_name in ("peak_bf16_flops", "peak_fp32_flops", "hbm_bytes_per_s", "intra_node_bytes_per_s",
                           "host_link_bytes_per_s", "memory_gib", "inter_node_gbps"):
            if not getattr(self, field_name) > 0:
                raise ValueError(f"{self.name}: {field_name} must be positive")


def _gpu(name, bf16_tflops, fp8_tflops, fp32_tflops, hbm_gb_s, link_gb_s, pcie_gb_s, memory, network_gbps,
         source) -> GpuType:
    return GpuType(name=name, peak_bf16_flops=bf16_tflops * TERA,
                   peak_fp8_flops=None if fp8_tflops is None else fp8_tflops * TERA,
                   peak_fp32_flops=fp32_tflops * TERA, hbm_bytes_per_s=hbm_gb_s * GB,
                   intra_node_bytes_per_s=link_gb_s * GB, host_link_bytes_per_s=pcie_gb_s * GB, memory_gib=memory,
                   inter_node_gbps=network_gbps, source=source)


GPU_TYPES: dict[str, GpuType] = {gpu.name.lower(): gpu for gpu in (
    #     name         bf16    fp8     fp32   HBM GB/s  link GB/s  PCIe GB/s  GB   net Gb/s  source
    _gpu("A100-40GB",  312.0,  None,   19.5,  1555.0,   300.0,     32.0,      40,  200.0,    "A100"),
    _gpu("A100-80GB",  312.0,  None,   19.5,  2039.0,   300.0,     32.0,      80,  200.0,    "A100"),
    _gpu("H100-SXM",   989.0,  1979.0, 67.0,  3350.0,   450.0,     64.0,      80,  400.0,    "H100"),
    _gpu("H100-PCIe",  756.0,  1513.0, 51.0,  2000.0,   64.0,      64.0,      80,  100.0,    "H100"),
    _gpu("H200",       989.0,  1979.0, 67.0,  4800.0,   450.0,     64.0,      141, 400.0,    "H200"),
    _gpu("B200",       2250.0, 4500.0, 75.0,  8000.0,   900.0,     64.0,      180, 400.0,    "B200"),
    _gpu("MI300X",     1307.4, 2614.9, 163.4, 5300.0,   448.0,     64.0,      192, 400.0,    "MI300X"),
    _gpu("L40S",       362.0,  733.0,  91.6,  864.0,    32.0,      32.0,      48,  12.5,     "L40S"),
    _gpu("L4",         121.0,  242.5,  30.3,  300.0,    32.0,      32.0,      24,  12.5,     "L4"),
    _gpu("A10G",       125.0,  None,   31.2,  600.0,    32.0,      32.0,      24,  12.5,     "A10"),
    _gpu("RTX4090",    165.2,  330.3,  82.6,  1008.0,   32.0,      32.0,      24,  12.5,     "Ada"),
)}
"""The known GPU types by lower-case name."""

GPU_NAMES: tuple[str, ...] = tuple(gpu.name for gpu in GPU_TYPES.values())
DEFAULT_GPU = "H100-SXM"
"""The GPU type step times are for when none is named (``plan`` without ``--gpu``, a preset's header):
80 GB, ``--gpu-memory``'s default."""


def gpu_type(name: str) -> GpuType:
    """The GPU type called ``name`` (any case); UsageError naming the known ones otherwise."""
    key = str(name).strip().lower()
    if key in GPU_TYPES:
        return GPU_TYPES[key]
    raise UsageError(unknown_name_message("--gpu", str(name), GPU_NAMES)
                     + f" (for a GPU not listed, leave --gpu out and give --gpu-memory: step times are then {DEFAULT_GPU}'s)")


def memory_of(gpu_memory_gib: float | None, gpu: str | None) -> float:
    """GiB of one GPU: ``--gpu-memory`` where given, else the ``--gpu`` type's, else
    :data:`~fsdp_presets.plan.limits.DEFAULT_GPU_MEMORY_GIB` (``plan``, ``generate`` and ``check`` of a
    preset's header alike)."""
    from fsdp_presets.plan.limits import DEFAULT_GPU_MEMORY_GIB

    return gpu_memory_gib or (gpu_type(gpu).memory_gib if gpu else DEFAULT_GPU_MEMORY_GIB)


@dataclass(frozen=True, kw_only=True)
class HostRates:
    """A CPU host measured as the recipes run on it (:mod:`fsdp_presets.preset.host_rates`): the
    "GPU type" of ``plan --device cpu``. One thread per process, every process busy at once."""

    matmul: tuple[tuple[float, float, float], ...]
    """``(tokens, width, FLOP/s)``: an fp32 Linear from ``width`` to ``4 width`` over ``tokens``,
    forward and backward (its three matmuls)."""
    memory_bytes_per_s: float
    """A large in-place add's bytes (two reads, one write) per second."""
    optimizer: tuple[tuple[float, float], ...] = ()
    """``(parameters, seconds per parameter)``: the recipes' optimizer step (the gradients' float64
    norm and torch's AdamW) over that many parameters."""
    collectives: dict = field(default_factory=dict)
    """``{"all_gather" | "reduce_scatter" | "all_reduce": (latency_s, bytes_per_s)}``, gloo between
    the processes, bytes as each rank sends them."""
    overheads: dict = field(default_factory=dict)
    """``{"DDP" | "FULL_SHARD" | "SHARD_GRAD_OP": (step_s, block_s)}``: what a step and each decoder
    block cost beyond their arithmetic and bytes (Python, module calls, autograd, dispatch, the
    collectives' latency, FSDP2's hooks and copies)."""
    processes: int = 2
    """Ranks measured together."""
    cores: int = 2
    """Cores the ranks may run on: with none spare, gloo's copies take their time from the ranks'
    compute (nothing overlaps)."""

    def matmul_flops(self, tokens: float, width: float) -> float:
        """The measured rate nearest ``(tokens, width)``: the grid point of the nearest width at or
        below it and the nearest tokens at or below (the rate grows with both)."""
        widths = sorted({point[1] for point in self.matmul})
        chosen_width = widths[max(0, bisect.bisect_right(widths, width) - 1)]
        row = sorted((point[0], point[2]) for point in self.matmul if point[1] == chosen_width)
        tokens_list = [point[0] for point in row]
        return row[max(0, bisect.bisect_right(tokens_list, tokens) - 1)][1]

    def optimizer_s(self, params: float) -> float:
        """Seconds of the optimizer step over ``params`` parameters: the rate per parameter
        interpolated between the measured sizes in log size (outside them, the nearest), as a step's
        states leave the caches."""
        points = sorted(self.optimizer)
        if params <= points[0][0]:
            return params * points[0][1]
        for (low, low_rate), (high, high_rate) in zip(points, points[1:]):
            if params <= high:
                share = math.log(params / low) / math.log(high / low)
                return params * (low_rate + share * (high_rate - low_rate))
        return params * points[-1][1]

    def collective_s(self, op: str, sent_bytes: float) -> float:
        latency, bandwidth = self.collectives[op]
        return latency + sent_bytes / bandwidth

    def to_json(self) -> dict:
        return {"matmul": [list(point) for point in self.matmul], "memory_bytes_per_s": self.memory_bytes_per_s,
                "optimizer": [list(point) for point in self.optimizer],
                "collectives": {name: list(value) for name, value in self.collectives.items()},
                "overheads": {name: list(value) for name, value in self.overheads.items()},
                "processes": self.processes, "cores": self.cores}

    @classmethod
    def from_json(cls, data: dict) -> "HostRates":
        return cls(matmul=tuple(tuple(float(x) for x in point) for point in data["matmul"]),
                   memory_bytes_per_s=float(data["memory_bytes_per_s"]),
                   optimizer=tuple((float(count), float(seconds)) for count, seconds in data["optimizer"]),
                   collectives={name: (float(value[0]), float(value[1])) for name, value in data["collectives"].items()},
                   overheads={name: (float(value[0]), float(value[1])) for name, value in data["overheads"].items()},
                   processes=int(data["processes"]), cores=int(data["cores"]))

    def overhead(self, strategy: str) -> tuple[float, float]:
        """``(step_s, block_s)`` of ``strategy`` (HYBRID_SHARD as FULL_SHARD, NO_SHARD as DDP)."""
        return self.overheads[{"HYBRID_SHARD": "FULL_SHARD", "NO_SHARD": "DDP"}.get(strategy, strategy)]
