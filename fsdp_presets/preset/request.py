"""What the user asks ``fsdp-presets generate`` for: a :class:`PresetRequest`, every field checked
on construction (the cluster by :class:`~fsdp_presets.plan.shapes.Hardware`, each number by the
command line's own check in :mod:`fsdp_presets.plan.limits`), and the global batch as written
(:func:`parse_global_batch`). The decisions it leads to: :mod:`fsdp_presets.preset.presets`.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Literal

from fsdp_presets.plan import limits
from fsdp_presets.plan.limits import DEVICES
from fsdp_presets.errors import UsageError, unknown_name_message
from fsdp_presets.fileio import GiB
from fsdp_presets.plan.shapes import Hardware, OnNodes, mesh_problems

Device = Literal["gpu", "cpu"]
STATE_DICT_CHOICES: tuple[str, ...] = ("sharded", "full")

# The FSDP sharding strategy each ``--strategy`` value names (FSDP1 names; FSDP2 expresses them
# with reshard_after_forward and the HSDP mesh).
STRATEGY_NAMES = {"full": "FULL_SHARD", "grad-op": "SHARD_GRAD_OP", "hybrid": "HYBRID_SHARD", "no-shard": "NO_SHARD"}

DEFAULT_HOST_MEMORY_GIB = {"gpu": 1024.0, "cpu": 16.0}
"""Host RAM of one node. GPU nodes: 8-GPU servers carry 1-2 TiB (NVIDIA DGX H100: 2 TiB; AWS
p4d.24xlarge: 1152 GiB), 1 TiB is the cautious round figure. CPU: a 16 GiB laptop or CI runner."""
CPU_RESERVED_BYTES = GiB // 2
"""Host memory one CPU training process holds besides tensors: the Python interpreter with torch,
transformers and accelerate imported is about 0.4 GiB resident; half a GiB is the round figure."""
DEFAULT_GLOBAL_BATCH_TOKENS = 2**19
"""0.5M tokens per optimizer step when ``--global-batch`` is not given: GPT-3's batch for its
125M-350M models (Brown et al. 2020, arXiv:2005.14165, Table 2.1) and the size of common
fine-tuning batches (128-256 sequences of 2-4K tokens)."""
CPU_DEFAULT_SEQUENCES_PER_PROCESS = 8
"""The default global batch with ``--device cpu``: 8 sequences per process. A CPU run is a demo or a
test, where a step must take seconds; 0.5M tokens would make the largest micro-batch that fits
(thousands of sequences on a tiny model) take minutes per step."""

_BATCH_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*(tok|toks|tokens)?\s*$")
_BINARY = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}

__all__ = [
    "CPU_DEFAULT_SEQUENCES_PER_PROCESS", "CPU_RESERVED_BYTES", "DEFAULT_GLOBAL_BATCH_TOKENS", "DEFAULT_HOST_MEMORY_GIB", "STATE_DICT_CHOICES", "STRATEGY_NAMES", "Device", "PresetRequest", "parse_global_batch"
]


# --------------------------------------------------------------------------- the request


@dataclass(frozen=True, kw_only=True)
class PresetRequest(OnNodes):
    """What the user asked for (``fsdp-presets generate`` flags); None means "decide"."""

    model: str
    """Model source: a registry family, a model folder or a config.json path."""
    gpus: int
    """GPUs in the whole job (``--device cpu``: processes), one process each."""
    nodes: int = 1
    """Machines the GPUs are spread over, the same number on each."""
    device: Device = "gpu"
    """``gpu``, or ``cpu``: a CPU-only host (demos, CI) where FSDP runs over gloo."""
    gpu: str | None = None
    """GPU type (``--gpu``, :data:`~fsdp_presets.plan.gpus.GPU_NAMES`): the step times the choices
    and the header are predicted on, and the memory without ``--gpu-memory``; None: times on
    :data:`~fsdp_presets.plan.gpus.DEFAULT_GPU`, memory ``--gpu-memory`` or 80 GiB."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU in GiB (default: the ``gpu`` type's, else 80); unused with ``--device cpu``."""
    inter_node_gbps: float | None = None
    """One GPU's network to other nodes in Gb/s (``--inter-node-gbps``); None: the GPU type's usual
    cluster, where a choice across nodes must also hold at half of it."""
    host_memory_gib: float | None = None
    """Host RAM of one node in GiB (default 1024 for GPU nodes, 16 for ``--device cpu``, where the
    node's processes share it as their device memory)."""
    precision: str = "auto"
    """``auto`` (bf16 on GPUs, fp32 on CPU), ``bf16``, ``fp16`` or ``fp32``."""
    strategy: str = "auto"
    """``auto``, ``full``, ``grad-op``, ``hybrid`` (several nodes) or ``no-shard`` (FSDP1)."""
    fsdp_version: int = 2
    """2 (``fully_shard``, the default) or 1 (``FullyShardedDataParallel``)."""
    state_dict: str = "sharded"
    """``sharded`` (DCP, one file set per rank) or ``full`` (gathered on rank 0)."""
    activation_checkpointing: str = "auto"
    """``auto`` (only when needed to fit), ``on`` or ``off``."""
    offload: str = "auto"
    """``auto`` (only when nothing fits otherwise), ``on`` or ``off``."""
    seq_len: int | None = None
    """Tokens per sequence (default :data:`~fsdp_presets.plan.limits.DEFAULT_SEQ_LEN`), capped by the model's maximum positions."""
    global_batch: str | None = None
    """Samples (``256``) or tokens (``1M``, ``524288tok``; K/M are binary) per optimizer step."""
    micro_batch: int | None = None
    """Sequences per GPU per forward; None: the largest that fits and divides the rank's share."""
    method: str = "full"
    """``full``, ``lora`` or ``qlora`` (:mod:`fsdp_presets.plan.methods`); the LoRA fields below are
    None for full fine-tuning, and none of them is written to a full-method preset's header."""
    lora_r: int | None = None
    """LoRA rank (default 16)."""
    lora_alpha: float | None = None
    """peft's lora_alpha (default 2 x r)."""
    lora_dropout: float | None = None
    """Dropout on the LoRA path (default 0)."""
    lora_target_modules: str | None = None
    """Comma-separated Linear names or ``all-linear`` (default: every projection of the block)."""
    tp: int = 1
    """Tensor-parallel ranks beside FSDP2 (``--tp``; 1: none), laid out as transformers'
    ``DistributedConfig`` (:class:`~fsdp_presets.rehearse.mesh.Mesh`)."""
    ep: int = 1
    """Expert-parallel ranks (``--ep``; 1: none)."""

    def __post_init__(self) -> None:
        problems = []
        try:
            self.lora_shape  # noqa: B018 - validates the method and the LoRA fields
        except UsageError as error:
            problems.append(str(error))
        if not self.model:
            problems.append("give a MODEL: a family name, a model folder or a config.json")
        # Each value is checked by the command line's own check of its flag (fsdp_presets.plan.limits),
        # the cluster by Hardware: one validation, whichever way a request is made.
        numbers_fine = True
        for name, check in (("gpu_memory_gib", limits.gpu_memory_gib), ("host_memory_gib", limits.host_memory_gib),
                            ("seq_len", limits.seq_len), ("micro_batch", limits.micro_batch),
                            ("tp", limits.tp_size), ("ep", limits.ep_size), ("inter_node_gbps", limits.inter_node_gbps)):
            problem = limits.value_problem(getattr(self, name), check, flag=_flag(name))
            if problem:
                problems.append(problem)
                numbers_fine = numbers_fine and name not in ("gpu_memory_gib", "host_memory_gib", "inter_node_gbps")
        for name, check in (("device", limits.device), ("precision", limits.precision),
                            ("strategy", limits.strategy), ("activation_checkpointing", limits.activation_checkpointing),
                            ("offload", limits.offload)):
            try:
                check(str(getattr(self, name)))
            except UsageError as error:
                problems.append(str(error))
        if self.gpu is not None:
            from fsdp_presets.plan.gpus import gpu_type

            try:
                gpu_type(self.gpu)
            except UsageError as error:
                problems.append(str(error))
                numbers_fine = False
            if self.device == "cpu":
                problems.append(f"--gpu {self.gpu} with --device cpu: a CPU host's speed is measured, not looked up "
                                "(fsdp-presets plan --device cpu); drop --gpu")
        if self.inter_node_gbps is not None and self.device == "cpu":
            problems.append("--inter-node-gbps with --device cpu: a CPU host's processes talk over its own memory; "
                            "drop --inter-node-gbps")
        if self.state_dict not in STATE_DICT_CHOICES:
            problems.append(unknown_name_message("--state-dict value", str(self.state_dict), STATE_DICT_CHOICES))
        if self.fsdp_version not in (1, 2):
            problems.append(f"--fsdp-version must be 1 or 2, got {self.fsdp_version!r}")
        mesh = mesh_problems(self.gpus, self.nodes)
        if mesh or not numbers_fine or self.device not in DEVICES:
            problems += mesh
        else:
            try:
                self.hardware  # noqa: B018 - Hardware checks the cluster (nodes divide GPUs, memory enough)
            except UsageError as error:
                problems.append(str(error))
        if self.global_batch is not None:
            try:
                parse_global_batch(self.global_batch)
            except UsageError as error:
                problems.append(str(error))
        # Combinations that can never work, said before any model is built.
        if mesh:
            raise UsageError("; ".join(problems))
        if self.strategy == "hybrid" and self.nodes == 1:
            problems.append("--strategy hybrid shards inside a node and replicates across nodes: it needs "
                            "--nodes > 1 (on one node use --strategy full)")
        if self.strategy == "hybrid" and self.nodes > 1 and self.gpus == self.nodes:
            problems.append("--strategy hybrid with one GPU per node leaves nothing to shard inside a node "
                            "(accelerate refuses an HSDP mesh of shard size 1): use --strategy full")
        if self.method == "qlora" and self.fsdp_version == 1:
            problems.append("--method qlora needs FSDP2: FSDP1 flattens each unit into one dtype, and the "
                            "bf16-stored 4-bit weights share units with fp32 norms and adapters (the recipes refuse "
                            "--method qlora under FSDP1); drop --fsdp-version 1, or use --method lora")
        if self.strategy == "no-shard" and self.fsdp_version == 2:
            problems.append("--strategy no-shard exists in FSDP1 only (FSDP2 takes reshard_after_forward "
                            "true/false): add --fsdp-version 1, or use the DDP baseline (--baseline ddp)")
        if self.mesh.is_nd:
            if self.fsdp_version != 2:
                problems.append("--tp/--ep shard with FSDP2 (transformers' DistributedConfig): drop --fsdp-version 1")
            if self.strategy in ("grad-op", "no-shard"):
                problems.append(f"--strategy {self.strategy} with --tp/--ep: a mesh is planned with full sharding "
                                "(or hybrid across nodes)")
            problems += self.mesh.setting_problems(method=self.method, precision=self.precision)
        if self.device == "cpu":
            if self.offload == "on":
                problems.append("--offload on with --device cpu: parameters already live in host memory, "
                                "there is nowhere to offload to (torch fails: 'Cannot access accelerator "
                                "device'); use --offload off")
            if self.precision == "fp16":
                problems.append("--precision fp16 with --device cpu: fp16 training needs a GPU's loss "
                                "scaling; use fp32 (default on CPU) or bf16")
            if self.fsdp_version == 1 and self.strategy == "hybrid":
                problems.append("FSDP1 HYBRID_SHARD groups ranks by the GPUs torch sees on a node, which a "
                                "CPU-only host has none of: use --fsdp-version 2 (HSDP through accelerate's "
                                "parallelism_config)")
        if problems:
            raise UsageError("; ".join(problems))

    @property
    def host_bytes(self) -> float:
        """Host RAM of one node (``--host-memory``, else the device's default)."""
        return (self.host_memory_gib or DEFAULT_HOST_MEMORY_GIB[self.device]) * GiB

    @property
    def hardware(self) -> Hardware:
        """The GPUs as the planner sees them; on CPU each process gets its share of the node's RAM."""
        if self.device == "cpu":
            host = self.host_bytes
            per_process = int(host // self.gpus_per_node)
            if per_process <= CPU_RESERVED_BYTES:
                raise UsageError(f"--host-memory {host / GiB:g} GiB over {self.gpus_per_node} processes leaves "
                                 f"{per_process / GiB:.2f} GiB each: too little for a training process (about "
                                 f"{CPU_RESERVED_BYTES / GiB:g} GiB before any tensor); use fewer processes")
            return Hardware(gpus=self.gpus, nodes=self.nodes, gpu_memory_bytes=per_process,
                            reserved_bytes=CPU_RESERVED_BYTES)
        from fsdp_presets.plan.gpus import memory_of

        return Hardware(gpus=self.gpus, nodes=self.nodes, inter_node_gbps=self.inter_node_gbps,
                        gpu_memory_bytes=int(memory_of(self.gpu_memory_gib, self.gpu) * GiB))

    @property
    def gpu_type(self):
        """The :class:`~fsdp_presets.plan.gpus.GpuType` step times are predicted on: ``gpu``, else
        :data:`~fsdp_presets.plan.gpus.DEFAULT_GPU`."""
        from fsdp_presets.plan.gpus import DEFAULT_GPU, gpu_type

        return gpu_type(self.gpu or DEFAULT_GPU)

    @property
    def lora_shape(self):
        """The planner's :class:`~fsdp_presets.plan.shapes.LoraShape`, None for full fine-tuning."""
        from types import SimpleNamespace

        from fsdp_presets.plan.shapes import METHODS
        from fsdp_presets.plan.methods import lora_from_args

        if self.method not in METHODS:
            raise UsageError(unknown_name_message("--method value", str(self.method), METHODS))
        return lora_from_args(SimpleNamespace(method=self.method, lora_r=self.lora_r, lora_alpha=self.lora_alpha,
                                              lora_dropout=self.lora_dropout,
                                              lora_target_modules=self.lora_target_modules))

    @property
    def mesh(self):
        """The TP/EP :class:`~fsdp_presets.rehearse.mesh.Mesh` asked for."""
        from fsdp_presets.rehearse.mesh import Mesh

        return Mesh(tp=self.tp, ep=self.ep)

    def to_json(self) -> dict:
        data = asdict(self)
        if self.method == "full":  # a full fine-tune's header stays as it always was
            for name in ("method", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"):
                data.pop(name)
        if not self.mesh.is_nd:  # nor does one without a mesh
            data.pop("tp")
            data.pop("ep")
        for name in ("gpu", "inter_node_gbps"):  # nor does one without a GPU type or network
            if data[name] is None:
                data.pop(name)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "PresetRequest":
        known = {item.name for item in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsageError(f"preset metadata has unknown request keys {unknown}: it was written by another "
                             "version of fsdp-presets; regenerate it from its command")
        return cls(**data)


def _flag(field_name: str) -> str:
    """``gpu_memory_gib`` -> ``--gpu-memory``: the flag that sets a request field."""
    return "--" + field_name.removesuffix("_gib").replace("_", "-")


def parse_global_batch(text: str) -> tuple[int, str]:
    """``("256")`` -> ``(256, "samples")``; ``"1M"``, ``"524288tok"`` -> ``(1048576|524288, "tokens")``.

    A plain number is sequences; a K/M/G suffix (binary: batch sizes are powers of two, Llama 2's
    "4M tokens" is 1024 x 4096) or a ``tok`` suffix makes it tokens."""
    match = _BATCH_PATTERN.match(str(text))
    if not match:
        raise UsageError(f"--global-batch {text!r}: give sequences (256) or tokens (1M, 512K, 524288tok)")
    from fsdp_presets.plan.limits import MAX_GLOBAL_BATCH

    number, suffix, tokens = match.groups()
    value = float(number) * _BINARY[suffix.lower()]
    unit = "tokens" if suffix or tokens else "samples"
    if not math.isfinite(value) or value > MAX_GLOBAL_BATCH[unit]:
        raise UsageError(f"--global-batch {text!r}: more than {MAX_GLOBAL_BATCH[unit]} {unit} per optimizer step, "
                         "beyond any real training; give sequences (256) or tokens (1M, 512K, 524288tok)")
    if value != int(value) or value < 1:
        raise UsageError(f"--global-batch {text!r} must come to a whole number >= 1")
    if unit == "samples" and "." in number:
        raise UsageError(f"--global-batch {text!r}: a number of sequences must be whole")
    return int(value), unit


