"""What to tell accelerate for one model and one cluster: a :class:`Preset`, each decision with
its reason. Pure: a :class:`~fsdp_presets.plan.profile.ModelProfile` and a :class:`PresetRequest` in,
a ``Preset`` out (``emit.py`` turns it into YAML; only the CLI touches files)::

    profile = profile_model("model_configs/llama-3.1-8b")
    preset = decide(profile, PresetRequest(model="model_configs/llama-3.1-8b", gpus=16, nodes=2))
    preset.parallelism.label            # "HSDP 2x8"
    preset.batch.micro_batch, preset.batch.accumulation

How ``auto`` decides (the planner, :mod:`fsdp_presets.plan.planner`, costs every option):

* strategy: one node: FULL_SHARD (ZeRO-3: the most memory left for activations, hence the largest
  micro-batch; SHARD_GRAD_OP saves one all-gather per step but keeps every block gathered from
  its forward to its backward, ask for it with ``--strategy grad-op``). Several nodes:
  HYBRID_SHARD (shard inside a node, replicate across nodes: parameter all-gathers never leave
  the node) when it fits, else FULL_SHARD across every GPU.
* activation checkpointing only when the strategy does not fit without it; CPU offload only when
  nothing fits otherwise (and the node's host memory holds the offloaded states).
* micro-batch: the largest that fits and divides each rank's share of the global batch; gradient
  accumulation makes up the rest, so micro x accumulation x data-parallel size = global batch.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Literal

from fsdp_presets.errors import UsageError, unknown_name_message
from fsdp_presets.plan.planner import GiB, Hardware, MemoryPlan, StrategyPlan, TrainingShape, plan
from fsdp_presets.plan.profile import ModelProfile
from fsdp_presets.plan.schema import K

Device = Literal["gpu", "cpu"]
DEVICES: tuple[str, ...] = ("gpu", "cpu")
PRECISION_CHOICES: tuple[str, ...] = ("auto", "bf16", "fp16", "fp32")
STRATEGY_CHOICES: tuple[str, ...] = ("auto", "full", "grad-op", "hybrid", "no-shard")
STATE_DICT_CHOICES: tuple[str, ...] = ("sharded", "full")
SWITCH_CHOICES: tuple[str, ...] = ("auto", "on", "off")

# The FSDP sharding strategy each ``--strategy`` value names (FSDP1 names; FSDP2 expresses them
# with reshard_after_forward and the HSDP mesh).
STRATEGY_NAMES = {"full": "FULL_SHARD", "grad-op": "SHARD_GRAD_OP", "hybrid": "HYBRID_SHARD", "no-shard": "NO_SHARD"}

DEFAULT_GPU_MEMORY_GIB = 80.0
"""A100 80GB / H100 SXM, the common training GPU (the planner's convention: ``80 * GiB``)."""
DEFAULT_HOST_MEMORY_GIB = {"gpu": 1024.0, "cpu": 16.0}
"""Host RAM of one node. GPU nodes: 8-GPU servers carry 1-2 TiB (NVIDIA DGX H100: 2 TiB; AWS
p4d.24xlarge: 1152 GiB), 1 TiB is the cautious round figure. CPU: a 16 GiB laptop or CI runner."""
CPU_RESERVED_BYTES = GiB // 2
"""Host memory one CPU training process holds besides tensors: the Python interpreter with torch,
transformers and accelerate imported is about 0.4 GiB resident; half a GiB is the round figure."""
DEFAULT_SEQ_LEN = 2048
"""Tokens per sequence when ``--seq-len`` is not given (capped by the model's positions)."""
DEFAULT_GLOBAL_BATCH_TOKENS = 2**19
"""0.5M tokens per optimizer step when ``--global-batch`` is not given: GPT-3's batch for its
125M-350M models (Brown et al. 2020, arXiv:2005.14165, Table 2.1) and the size of common
fine-tuning batches (128-256 sequences of 2-4K tokens)."""

_BATCH_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*(tok|toks|tokens)?\s*$")
_BINARY = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


# --------------------------------------------------------------------------- units for people


def count_text(count: float) -> str:
    """``8.03B``, ``218.1M``, ``26.8K``: a parameter count at a glance."""
    for size, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(count) >= size:
            return f"{count / size:.{1 if size == 10**6 else 2}f}{suffix}"
    return f"{count:.0f}"


def bytes_text(count: float) -> str:
    """``16.4 GiB``, ``27.6 MiB``: GPU memory is sold and reported in binary units."""
    for size, suffix in ((GiB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(count) >= size:
            return f"{count / size:.1f} {suffix}"
    return f"{count:.0f} B"


# --------------------------------------------------------------------------- the request


@dataclass(frozen=True, kw_only=True)
class PresetRequest:
    """What the user asked for (``fsdp-presets generate`` flags); None means "decide"."""

    model: str
    """Model source: a registry family, a model folder or a config.json path."""
    gpus: int
    """GPUs in the whole job (``--device cpu``: processes), one process each."""
    nodes: int = 1
    """Machines the GPUs are spread over, the same number on each."""
    device: Device = "gpu"
    """``gpu``, or ``cpu``: a CPU-only host (demos, CI) where FSDP runs over gloo."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU in GiB (default 80); unused with ``--device cpu``."""
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
    """Tokens per sequence (default 2048), capped by the model's maximum positions."""
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

    def __post_init__(self) -> None:
        problems = []
        try:
            self.lora_shape  # noqa: B018 - validates the method and the LoRA fields
        except UsageError as error:
            problems.append(str(error))
        if not self.model:
            problems.append("give a MODEL: a family name, a model folder or a config.json")
        from fsdp_presets import arguments as limits  # the command line's bounds, for every caller

        for name, most in (("gpus", limits.MAX_GPUS), ("nodes", limits.MAX_NODES)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                problems.append(f"--{name} must be a whole number from 1 to {most}, got {value!r}")
        if (isinstance(self.gpus, int) and isinstance(self.nodes, int) and self.gpus >= 1 and self.nodes >= 1
                and self.gpus % self.nodes):
            problems.append(
                f"--nodes {self.nodes} does not divide --gpus {self.gpus}: every node must hold the "
                f"same number of GPUs (e.g. --gpus {self.nodes * max(1, self.gpus // self.nodes)})"
            )
        for name, known in (("device", DEVICES), ("precision", PRECISION_CHOICES), ("strategy", STRATEGY_CHOICES),
                            ("state_dict", STATE_DICT_CHOICES), ("activation_checkpointing", SWITCH_CHOICES),
                            ("offload", SWITCH_CHOICES)):
            if getattr(self, name) not in known:
                problems.append(unknown_name_message(f"--{name.replace('_', '-')} value", str(getattr(self, name)),
                                                     known))
        if self.fsdp_version not in (1, 2):
            problems.append(f"--fsdp-version must be 1 or 2, got {self.fsdp_version!r}")
        for name, most in (("gpu_memory_gib", limits.MAX_GPU_MEMORY_GIB), ("host_memory_gib", limits.MAX_HOST_MEMORY_GIB)):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and 0 < value <= most):
                problems.append(f"--{name.removesuffix('_gib').replace('_', '-')} must be a positive number of "
                                f"GiB up to {most:g}, got {value!r}")
        for name, most in (("seq_len", limits.MAX_SEQ_LEN), ("micro_batch", limits.MAX_MICRO_BATCH)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most):
                problems.append(f"--{name.replace('_', '-')} must be a whole number from 1 to {most}, got {value!r}")
        if self.global_batch is not None:
            try:
                parse_global_batch(self.global_batch)
            except UsageError as error:
                problems.append(str(error))
        # Combinations that can never work, said before any model is built.
        if self.strategy == "hybrid" and self.nodes == 1:
            problems.append("--strategy hybrid shards inside a node and replicates across nodes: it needs "
                            "--nodes > 1 (on one node use --strategy full)")
        if self.strategy == "hybrid" and self.nodes > 1 and self.gpus == self.nodes:
            problems.append("--strategy hybrid with one GPU per node leaves nothing to shard inside a node "
                            "(accelerate refuses an HSDP mesh of shard size 1): use --strategy full")
        if self.method == "qlora" and self.fsdp_version == 1:
            problems.append("--method qlora needs FSDP2: FSDP1 flattens each unit into one dtype, and the "
                            "bf16-stored 4-bit weights share units with fp32 norms and adapters (the recipes refuse "
                            "--load-in-4bit under FSDP1); drop --fsdp-version 1, or use --method lora")
        if self.strategy == "no-shard" and self.fsdp_version == 2:
            problems.append("--strategy no-shard exists in FSDP1 only (FSDP2 takes reshard_after_forward "
                            "true/false): add --fsdp-version 1, or use the DDP baseline (--baseline ddp)")
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
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def lora_shape(self):
        """The planner's :class:`~fsdp_presets.plan.planner.LoraShape`, None for full fine-tuning."""
        from types import SimpleNamespace

        from fsdp_presets.plan.methods import METHODS, lora_from_args

        if self.method not in METHODS:
            raise UsageError(unknown_name_message("--method value", str(self.method), METHODS))
        return lora_from_args(SimpleNamespace(method=self.method, lora_r=self.lora_r, lora_alpha=self.lora_alpha,
                                              lora_dropout=self.lora_dropout,
                                              lora_target_modules=self.lora_target_modules))

    def to_json(self) -> dict:
        data = asdict(self)
        if self.method == "full":  # a full fine-tune's header stays as it always was
            for name in ("method", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"):
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


def parse_global_batch(text: str) -> tuple[int, str]:
    """``("256")`` -> ``(256, "samples")``; ``"1M"``, ``"524288tok"`` -> ``(1048576|524288, "tokens")``.

    A plain number is sequences; a K/M/G suffix (binary: batch sizes are powers of two, Llama 2's
    "4M tokens" is 1024 x 4096) or a ``tok`` suffix makes it tokens."""
    match = _BATCH_PATTERN.match(str(text))
    if not match:
        raise UsageError(f"--global-batch {text!r}: give sequences (256) or tokens (1M, 512K, 524288tok)")
    from fsdp_presets.arguments import MAX_GLOBAL_BATCH

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


# --------------------------------------------------------------------------- the preset


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """Processes and how the model states are split over them."""

    num_processes: int
    """Processes in the whole job, one per GPU (accelerate ``num_processes``)."""
    num_machines: int
    """Nodes (accelerate ``num_machines``)."""
    strategy: str
    """FSDP sharding strategy: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD."""
    fsdp_version: int
    """1 or 2."""
    replicate_size: int
    """Copies of the sharded model states (HSDP: nodes; 1 otherwise; NO_SHARD: every process)."""
    shard_size: int
    """Processes one copy is sharded over (HSDP: the GPUs of a node)."""
    reason: str
    """Why this strategy."""

    def __post_init__(self) -> None:
        if self.replicate_size * self.shard_size != self.num_processes:
            raise ValueError(f"replicate {self.replicate_size} x shard {self.shard_size} != processes "
                             f"{self.num_processes}")

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2: free each block's gathered parameters after its forward (FULL_SHARD, HSDP) or keep
        them until its backward (SHARD_GRAD_OP)."""
        return self.strategy != "SHARD_GRAD_OP"

    @property
    def hsdp(self) -> bool:
        return self.strategy == "HYBRID_SHARD"

    @property
    def label(self) -> str:
        """``HSDP 2x8``, ``FULL_SHARD 8``: what changes when a preset is rescaled."""
        if self.hsdp:
            return f"HSDP {self.replicate_size}x{self.shard_size}"
        return f"{self.strategy} {self.num_processes}"


@dataclass(frozen=True, kw_only=True)
class PrecisionChoice:
    """Accelerate ``mixed_precision``."""

    mixed_precision: Literal["bf16", "fp16", "no"]
    """``bf16``/``fp16``: compute in that dtype, fp32 master weights; ``no``: fp32."""
    reason: str
    """Why."""

    @property
    def planner_precision(self) -> str:
        return "fp32" if self.mixed_precision == "no" else self.mixed_precision


@dataclass(frozen=True, kw_only=True)
class MemorySavers:
    """Activation checkpointing and CPU offload."""

    activation_checkpointing: bool
    """Recompute each block's activations in backward."""
    offload: bool
    """FSDP CPU offload of parameters, gradients and optimizer state."""
    reason: str
    """Why each is on or off."""


@dataclass(frozen=True, kw_only=True)
class StateDictChoice:
    """How checkpoints are written and how the model is first loaded."""

    state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
    """Accelerate ``fsdp_state_dict_type``."""
    cpu_ram_efficient_loading: bool
    """Only rank 0 reads the pretrained weights; the others receive their shards."""
    reason: str
    """Why."""


@dataclass(frozen=True, kw_only=True)
class WrapChoice:
    """Which modules become FSDP units, and how the rest of the model is handled."""

    classes: tuple[str, ...]
    """``fsdp_transformer_layer_cls_to_wrap``: the model's block classes."""
    reason: str
    """Why these classes."""
    model_parts: tuple[str, ...]
    """How embeddings, norms, the output head and tied weights are handled, and why."""


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """How the global batch is split: micro x accumulation x data-parallel size."""

    seq_len: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per GPU per forward/backward (recipe ``--micro-batch-size``)."""
    accumulation: int
    """Micro-batches per optimizer step (recipe ``--gradient-accumulation-steps``)."""
    data_parallel_size: int
    """Ranks that each see different data (every process: FSDP and HSDP are data parallel)."""
    reason: str
    """Why this split."""
    reduce_every_micro_batch: bool = False
    """Gradients reduced after every micro-batch (recipe ``--reduce-every-micro-batch``) instead of
    accumulated unsharded under ``no_sync``, which would hold a whole model's gradients per GPU."""

    def __post_init__(self) -> None:
        if min(self.seq_len, self.micro_batch, self.accumulation, self.data_parallel_size) < 1:
            raise ValueError(f"invalid batch split {self}")

    @property
    def global_samples(self) -> int:
        return self.micro_batch * self.accumulation * self.data_parallel_size

    @property
    def global_tokens(self) -> int:
        return self.global_samples * self.seq_len


@dataclass(frozen=True, kw_only=True)
class Preset:
    """Every decision for one model on one cluster, with the planner's numbers behind it."""

    request: PresetRequest
    """What was asked."""
    profile: ModelProfile
    """The model, as FSDP sees it."""
    parallelism: Parallelism
    """Processes, nodes, sharding."""
    precision: PrecisionChoice
    """Mixed precision."""
    savers: MemorySavers
    """Activation checkpointing and offload."""
    state_dict: StateDictChoice
    """Checkpoint format and loading."""
    wrap: WrapChoice
    """FSDP units."""
    batch: BatchPlan
    """Global batch split."""
    memory_plan: MemoryPlan
    """The planner's table at the chosen micro-batch, precision and savers."""
    row: StrategyPlan
    """The planner's row of the chosen strategy."""
    notes: tuple[str, ...] = ()
    """Adjustments made to the request (capped sequence length, rounded batch) and warnings."""

    @property
    def device(self) -> str:
        return self.request.device

    def decisions(self) -> list[tuple[str, str]]:
        """``(topic, reason)`` in the order the header lists them."""
        return [
            ("strategy", self.parallelism.reason),
            ("precision", self.precision.reason),
            ("memory savers", self.savers.reason),
            ("checkpoints", self.state_dict.reason),
            ("wrapping", self.wrap.reason),
            ("batch", self.batch.reason),
        ]

    def summary(self) -> dict:
        """The settings a rescale compares (kept in the file's metadata line)."""
        return {
            "processes": self.parallelism.num_processes,
            "machines": self.parallelism.num_machines,
            "sharding": self.parallelism.label,
            "fsdp_version": self.parallelism.fsdp_version,
            "precision": self.precision.mixed_precision,
            "activation_checkpointing": self.savers.activation_checkpointing,
            "offload": self.savers.offload,
            "state_dict": self.state_dict.state_dict_type,
            "seq_len": self.batch.seq_len,
            "micro_batch": self.batch.micro_batch,
            "gradient_accumulation": self.batch.accumulation,
            "reduce_every_micro_batch": self.batch.reduce_every_micro_batch,
            "data_parallel_size": self.batch.data_parallel_size,
            "global_batch": self.batch.global_samples,
        }


# --------------------------------------------------------------------------- deciding


def decide(profile: ModelProfile, request: PresetRequest) -> Preset:
    """The preset for ``profile`` on the layout of ``request``; UsageError when it cannot be made."""
    notes: list[str] = []
    seq_len = _seq_len(profile, request, notes)
    hardware = _hardware(request)
    precision = _precision(profile, request, notes)
    data_parallel = request.gpus
    global_samples = _global_samples(request, seq_len, data_parallel, notes)
    per_rank = global_samples // data_parallel

    candidates = _strategy_candidates(request)
    checkpointing = {"on": [True], "off": [False], "auto": [False, True]}[request.activation_checkpointing]
    offloading = [False] if request.device == "cpu" else {"on": [True], "off": [False], "auto": [False, True]}[
        request.offload]
    needed_micro = request.micro_batch or 1
    lora = request.lora_shape
    if lora is not None:
        from fsdp_presets.plan.planner import default_target_modules, unknown_target_modules

        unknown = unknown_target_modules(profile, lora)
        if unknown or not default_target_modules(profile):
            raise UsageError(f"--lora-target-modules: {', '.join(unknown) or 'no Linear layer'} not in "
                             f"{profile.architecture}'s block; its Linear layers are "
                             f"{','.join(default_target_modules(profile)) or 'none'} (or give all-linear)")
    if request.micro_batch and per_rank % request.micro_batch:
        raise UsageError(
            f"--micro-batch {request.micro_batch} does not divide each rank's share of the global batch "
            f"({global_samples} sequences / {data_parallel} ranks = {per_rank}); use one of "
            f"{', '.join(str(d) for d in _divisors(per_rank))}"
        )

    # Accumulating (more than one micro-batch per rank): under no_sync FSDP holds a whole model's
    # unsharded gradients between micro-batches; reducing every micro-batch avoids that for more
    # traffic, and is tried only when no_sync does not fit with any memory saver.
    accumulating = per_rank > needed_micro
    reductions = [False, True] if accumulating else [False]
    found = None
    host_short: list[str] = []
    for offload in offloading:
        for name in candidates:
            for reduce_every in reductions:
                for ac in checkpointing:
                    shape = TrainingShape(lora=request.lora_shape, seq_len=seq_len, micro_batch=needed_micro,
                                          precision=precision.planner_precision, activation_checkpointing=ac,
                                          offload=offload, grad_accum=2 if accumulating else 1,
                                          reduce_every_micro_batch=reduce_every)
                    row = plan(profile, hardware, shape).get(name, request.fsdp_version)
                    if row.max_micro_batch < needed_micro:
                        continue
                    if offload and not _host_holds_offload(row, request):
                        host_short.append(_host_message(row, request))
                        continue
                    found = (name, ac, offload, reduce_every, row)
                    break
                if found:
                    break
            if found:
                break
        if found:
            break
    if found is None:
        raise UsageError(_nothing_fits(profile, request, hardware, seq_len, precision, candidates, checkpointing,
                                       offloading, needed_micro, host_short))
    name, ac, offload, reduce_every, row = found

    micro = request.micro_batch or max(d for d in _divisors(per_rank) if d <= row.max_micro_batch)
    accumulation = per_rank // micro
    reduce_every = reduce_every and accumulation > 1
    final_shape = TrainingShape(lora=request.lora_shape, seq_len=seq_len, micro_batch=micro, precision=precision.planner_precision,
                                activation_checkpointing=ac, offload=offload, grad_accum=accumulation,
                                reduce_every_micro_batch=reduce_every)
    memory_plan = plan(profile, hardware, final_shape)
    row = memory_plan.get(name, request.fsdp_version)

    parallelism = _parallelism(request, name, row, memory_plan)
    savers = MemorySavers(activation_checkpointing=ac, offload=offload,
                          reason=_savers_reason(request, profile, hardware, row, ac, offload, seq_len, precision,
                                                 shape=final_shape))
    state_dict = _state_dict(profile, request, notes)
    wrap = _wrap(profile, request)
    batch = BatchPlan(
        seq_len=seq_len, micro_batch=micro, accumulation=accumulation, data_parallel_size=data_parallel,
        reason=_batch_reason(request, row, micro, accumulation, data_parallel, global_samples, seq_len)
        + _accumulation_reason(profile, hardware, final_shape, name, request.fsdp_version),
        reduce_every_micro_batch=reduce_every,
    )
    if precision.mixed_precision == "fp16" and profile.structure.get("config_dtype") == "bfloat16":
        notes.append("fp16 on a model trained in bf16: bf16 weights can exceed fp16's range (max 65504); "
                     "prefer --precision bf16")
    return Preset(request=request, profile=profile, parallelism=parallelism, precision=precision, savers=savers,
                  state_dict=state_dict, wrap=wrap, batch=batch, memory_plan=memory_plan, row=row, notes=tuple(notes))


def _seq_len(profile: ModelProfile, request: PresetRequest, notes: list[str]) -> int:
    limit = profile.dims.max_position_embeddings
    wanted = request.seq_len or DEFAULT_SEQ_LEN
    if limit and wanted > limit:
        notes.append(f"sequence length {wanted} capped to {limit}, the model's maximum positions "
                     "(max_position_embeddings)")
        return limit
    return wanted


def _hardware(request: PresetRequest) -> Hardware:
    """GPUs as the planner sees them; on CPU each process gets its share of the node's RAM."""
    if request.device == "cpu":
        host = (request.host_memory_gib or DEFAULT_HOST_MEMORY_GIB["cpu"]) * GiB
        per_process = int(host // request.gpus_per_node)
        if per_process <= CPU_RESERVED_BYTES:
            raise UsageError(f"--host-memory {host / GiB:g} GiB over {request.gpus_per_node} processes leaves "
                             f"{per_process / GiB:.2f} GiB each: too little for a training process (about "
                             f"{CPU_RESERVED_BYTES / GiB:g} GiB before any tensor); use fewer processes")
        return Hardware(gpus=request.gpus, nodes=request.nodes, gpu_memory_bytes=per_process,
                        reserved_bytes=CPU_RESERVED_BYTES)
    memory = request.gpu_memory_gib or DEFAULT_GPU_MEMORY_GIB
    return Hardware(gpus=request.gpus, nodes=request.nodes, gpu_memory_bytes=int(memory * GiB))


def _precision(profile: ModelProfile, request: PresetRequest, notes: list[str]) -> PrecisionChoice:
    trained = profile.structure.get("config_dtype")
    trained_text = f" (its config says {trained})" if trained else ""
    if request.precision == "auto":
        if request.device == "cpu":
            return PrecisionChoice(mixed_precision="no", reason=(
                "fp32 (auto on CPU): exact and simple for demos and CI; CPU bf16 autocast is slower than fp32 "
                "on most CPUs"))
        return PrecisionChoice(mixed_precision="bf16", reason=(
            f"bf16 mixed precision (auto on GPUs): compute and communication in bf16, fp32 master weights and "
            f"optimizer state; bf16 keeps fp32's exponent range, so no loss scaling is needed{trained_text}"))
    if request.precision == "fp32":
        return PrecisionChoice(mixed_precision="no", reason=(
            "fp32 as asked: twice the activation and communication bytes of bf16 (the planner counts them)"))
    if request.precision == "fp16":
        return PrecisionChoice(mixed_precision="fp16", reason=(
            f"fp16 mixed precision as asked: needs loss scaling (accelerate adds a gradient scaler){trained_text}"))
    return PrecisionChoice(mixed_precision="bf16", reason=(
        f"bf16 mixed precision as asked: fp32 master weights and optimizer state{trained_text}"))


def _global_samples(request: PresetRequest, seq_len: int, data_parallel: int, notes: list[str]) -> int:
    if request.global_batch is None:
        value, unit = DEFAULT_GLOBAL_BATCH_TOKENS, "tokens"
    else:
        value, unit = parse_global_batch(request.global_batch)
    if unit == "samples":
        if value % data_parallel:
            lower, upper = (value // data_parallel) * data_parallel, -(-value // data_parallel) * data_parallel
            options = " or ".join(str(v) for v in (lower, upper) if v > 0)
            raise UsageError(f"--global-batch {value} sequences does not divide over {data_parallel} data-parallel "
                             f"ranks (one per GPU): use {options}")
        return value
    sequences = value // seq_len
    samples = (sequences // data_parallel) * data_parallel
    if samples < 1:
        raise UsageError(f"--global-batch {value} tokens is less than one sequence of {seq_len} tokens per "
                         f"data-parallel rank ({data_parallel} ranks): give at least {seq_len * data_parallel} tokens")
    if samples * seq_len != value:
        source = "the default 0.5M" if request.global_batch is None else str(request.global_batch)
        notes.append(f"global batch {source} tokens = {value / seq_len:g} sequences of {seq_len}: rounded down to "
                     f"{samples}, a multiple of the {data_parallel} data-parallel ranks")
    return samples


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def _strategy_candidates(request: PresetRequest) -> list[str]:
    if request.strategy != "auto":
        return [STRATEGY_NAMES[request.strategy]]
    # NOTE: with one GPU per node an HSDP mesh would be N x 1, which accelerate refuses ("no
    # dimension for FSDP to shard across"): sharding across all nodes is the only FSDP choice.
    if request.nodes > 1 and request.gpus_per_node > 1:
        return ["HYBRID_SHARD", "FULL_SHARD"]
    return ["FULL_SHARD"]


def _host_bytes(request: PresetRequest) -> float:
    return (request.host_memory_gib or DEFAULT_HOST_MEMORY_GIB[request.device]) * GiB


def _host_holds_offload(row: StrategyPlan, request: PresetRequest) -> bool:
    """Offloaded model states of every rank of a node must fit the node's host RAM."""
    return row.model_state.total * request.gpus_per_node <= _host_bytes(request)


def _host_message(row: StrategyPlan, request: PresetRequest) -> str:
    need = row.model_state.total * request.gpus_per_node / GiB
    return (f"{row.label} with offload needs {need:.0f} GiB of host RAM per node for the offloaded states, more than "
            f"--host-memory {_host_bytes(request) / GiB:g}")


def _layout(request: PresetRequest) -> str:
    unit = "processes" if request.device == "cpu" else "GPUs"
    if request.nodes > 1:
        return f"{request.nodes} nodes x {request.gpus_per_node} {unit}"
    return f"{request.gpus} {unit}"


def _nothing_fits(profile, request, hardware, seq_len, precision, candidates, checkpointing, offloading,
                  needed_micro, host_short) -> str:
    widest = TrainingShape(lora=request.lora_shape, seq_len=seq_len, micro_batch=needed_micro, precision=precision.planner_precision,
                           activation_checkpointing=checkpointing[-1], offload=offloading[-1])
    memory_plan = plan(profile, hardware, widest)
    tried = " or ".join(f"{name} (FSDP{request.fsdp_version})" for name in candidates)
    savers = [text for flag, text in ((checkpointing[-1], "activation checkpointing"), (offloading[-1], "offload"))
              if flag]
    with_savers = f" even with {' and '.join(savers)}" if savers else ""
    memory = (f"{hardware.gpu_memory_bytes / GiB:g} GiB each" if request.device == "cpu"
              else f"{hardware.gpu_memory_bytes / GiB:g} GiB")
    message = (f"{profile.architecture} ({count_text(profile.total_params)} parameters) does not fit {_layout(request)} "
               f"of {memory} with {tried}{with_savers} at micro-batch {needed_micro}, sequence {seq_len}")
    rows = [memory_plan.get(name, request.fsdp_version) for name in candidates]
    smallest = min(rows, key=lambda r: r.per_gpu.total)
    if host_short:
        message += f": {host_short[0]} (give your nodes' RAM with --host-memory GiB if they have more)"
    else:
        message += (f": {smallest.label} needs {smallest.per_gpu.total / GiB:.1f} GiB per GPU of "
                    f"{hardware.usable_bytes / GiB:.1f} usable")
    fitting_other = memory_plan.recommended
    if request.strategy != "auto" and fitting_other is not None and fitting_other.name != "DDP":
        message += f"; {fitting_other.label} would fit (--strategy {_flag_for(fitting_other.name)})"
    suggestions = memory_plan.suggestions or plan(
        profile, hardware, TrainingShape(lora=request.lora_shape, seq_len=seq_len, micro_batch=needed_micro,
                                         precision=precision.planner_precision,
                                         activation_checkpointing=True, offload=request.device != "cpu")).suggestions
    if suggestions:
        message += "; the planner suggests: " + "; ".join(suggestions)
    return message


def _flag_for(strategy: str) -> str:
    return {value: key for key, value in STRATEGY_NAMES.items()}[strategy]


def _parallelism(request: PresetRequest, name: str, row: StrategyPlan, memory_plan: MemoryPlan) -> Parallelism:
    if name == "HYBRID_SHARD":
        replicate, shard = request.nodes, request.gpus_per_node
    elif name == "NO_SHARD":
        replicate, shard = request.gpus, 1
    else:
        replicate, shard = 1, request.gpus
    comm = f"{bytes_text(row.comm.total)} sent per GPU per step"
    if row.comm.inter_node:
        comm += f", {bytes_text(row.comm.inter_node)} of it across nodes"
    if request.strategy != "auto":
        reason = f"{row.label} as asked (--strategy {request.strategy}): {comm}"
    elif name == "HYBRID_SHARD":
        full = memory_plan.get("FULL_SHARD", request.fsdp_version)
        reason = (f"HYBRID_SHARD (HSDP {replicate}x{shard}): each node holds one sharded copy of the model states "
                  f"and parameter all-gathers stay inside the node; only gradient shards are all-reduced across "
                  f"nodes ({comm}; FULL_SHARD over all {request.gpus} GPUs would send "
                  f"{bytes_text(full.comm.inter_node)} across nodes)")
    elif request.nodes > 1:
        hybrid = memory_plan.get("HYBRID_SHARD", request.fsdp_version)
        reason = (f"FULL_SHARD across all {request.gpus} GPUs: HYBRID_SHARD does not fit, even with the memory savers "
                  f"allowed (it shards over one node's {request.gpus_per_node} GPUs only: "
                  f"{bytes_text(hybrid.model_state.total)} of model states per GPU against "
                  f"{bytes_text(row.model_state.total)} here); {comm}")
    else:
        grad_op = memory_plan.get("SHARD_GRAD_OP", request.fsdp_version)
        reason = (f"FULL_SHARD over {request.gpus} {'processes' if request.device == 'cpu' else 'GPUs'} (ZeRO-3): "
                  f"parameters, gradients and optimizer state sharded, each block gathered only while it computes, "
                  f"which leaves the most memory for activations ({comm}). SHARD_GRAD_OP would send "
                  f"{bytes_text(grad_op.comm.total)} but keep every block gathered from forward to backward "
                  f"({bytes_text(grad_op.per_gpu.total)} vs {bytes_text(row.per_gpu.total)} per GPU here; "
                  "--strategy grad-op)")
    if request.fsdp_version == 1:
        reason += ". FSDP1 as asked (--fsdp-version 1)"
    return Parallelism(num_processes=request.gpus, num_machines=request.nodes, strategy=name,
                       fsdp_version=request.fsdp_version, replicate_size=replicate, shard_size=shard, reason=reason)


def _savers_reason(request, profile, hardware, row, ac, offload, seq_len, precision, shape=None) -> str:
    parts = []
    if request.activation_checkpointing == "auto":
        if ac:
            plain = TrainingShape(lora=request.lora_shape, seq_len=seq_len, micro_batch=1, precision=precision.planner_precision, offload=offload)
            if shape is not None:  # the same accumulation, without checkpointing
                plain = shape.replace(micro_batch=1, activation_checkpointing=False)
            without = plan(profile, hardware, plain).get(row.name, row.fsdp_version)
            parts.append(f"activation checkpointing on (auto): without it {row.label} needs "
                         f"{bytes_text(without.per_gpu.total)} per GPU at micro-batch 1 of "
                         f"{bytes_text(hardware.usable_bytes)} usable; recomputing each block in backward costs about "
                         "a third more compute")
        else:
            parts.append("activation checkpointing off (auto): not needed to fit, so no recomputation")
    else:
        parts.append(f"activation checkpointing {'on' if ac else 'off'} as asked")
    if ac:
        parts.append("the training forward must pass use_cache=False: accelerate re-runs each block in backward "
                     "(checkpoint_wrapper) and a KV cache would be appended to twice")
    if request.device == "cpu":
        parts.append("offload off: on a CPU-only host parameters already live in host memory")
    elif request.offload == "auto":
        if offload:
            need = row.model_state.total * request.gpus_per_node / GiB
            parts.append(f"CPU offload on (auto): nothing fits on the GPUs otherwise; parameters, gradients and "
                         f"optimizer state live in host RAM ({bytes_text(row.model_state.total)} per rank, "
                         f"{need:.0f} GiB per node) and every step moves them over PCIe (slow)")
        else:
            parts.append("CPU offload off (auto): the model states fit on the GPUs")
    else:
        parts.append(f"CPU offload {'on' if offload else 'off'} as asked")
    return "; ".join(parts)


def _state_dict(profile: ModelProfile, request: PresetRequest, notes: list[str]) -> StateDictChoice:
    ram_efficient = request.device == "gpu"
    if ram_efficient:
        loading = ("RAM-efficient loading on: only rank 0 reads the pretrained weights into host RAM, the other "
                   "ranks start on the meta device and receive their shards (otherwise each of a node's "
                   f"{request.gpus_per_node} processes loads a full copy: "
                   f"{request.gpus_per_node * profile.total_params * 2 / GiB:.0f} GiB of bf16 weights)")
    else:
        loading = ("RAM-efficient loading off: a CPU preset runs small demo models, where each process loading its "
                   "own copy costs little and every rank starts from the same weights by construction")
    if request.state_dict == "full":
        need = full_state_dict_host_bytes(profile)
        host = _host_bytes(request)
        if need > host:
            raise UsageError(f"--state-dict full gathers the whole model and optimizer state on rank 0: about "
                             f"{need / GiB:.0f} GiB of host RAM, more than --host-memory {host / GiB:g}; use "
                             "--state-dict sharded (export full weights afterwards with accelerate merge-weights)")
        reason = (f"FULL_STATE_DICT as asked: rank 0 gathers the full model and optimizer state into host RAM at every "
                  f"save (about {need / GiB:.1f} GiB) and loading needs the same world size layout; {loading}")
        return StateDictChoice(state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=ram_efficient,
                               reason=reason)
    reason = ("SHARDED_STATE_DICT: each rank writes its own shards with torch.distributed.checkpoint (DCP), nothing is "
              "gathered on one rank, and DCP reshards on load, so a run resumes on another GPU count; export full "
              f"Hugging Face weights afterwards (accelerate merge-weights); {loading}")
    return StateDictChoice(state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=ram_efficient,
                           reason=reason)


def full_state_dict_host_bytes(profile: ModelProfile) -> int:
    """Rank-0 host RAM a FULL_STATE_DICT save gathers: fp32 parameters (4 bytes) and Adam's two
    fp32 moments (8 bytes) of the whole model (accelerate gathers model and optimizer state dicts
    on rank 0 with ``offload_to_cpu`` / ``rank0_only``)."""
    return profile.total_params * (4 + 8)


def _wrap(profile: ModelProfile, request: PresetRequest) -> WrapChoice:
    if not profile.wrap_classes:
        raise UsageError(f"{profile.architecture} has no repeated blocks to wrap: FSDP would shard the whole model as "
                         "one unit (gathered whole every step), which saves nothing over DDP; "
                         "`fsdp-presets inspect` shows its structure")
    blocks = ", ".join(f"{unit.count} x {unit.cls} ({count_text(unit.params_each)} each)" for unit in profile.units)
    no_split = profile.structure.get("no_split_modules") or []
    reason = (f"TRANSFORMER_BASED_WRAP with the model's blocks, read off the built model: {blocks}; each block is "
              "one FSDP unit, gathered just before it computes")
    missing = profile.missing_no_split
    if missing:
        reason += (f". Named explicitly because _no_split_modules lists {', '.join(missing)}, which this model does "
                   "not contain (left to _no_split_modules, some accelerate versions raise 'Could not find the "
                   "transformer layer class')")
    elif no_split and sorted(no_split) != sorted(profile.wrap_classes):
        reason += f" (the model's _no_split_modules: {', '.join(no_split)})"
    return WrapChoice(classes=tuple(profile.wrap_classes), reason=reason, model_parts=tuple(_model_parts(profile, request)))


def _model_parts(profile: ModelProfile, request: PresetRequest) -> list[str]:
    """How the parameters outside the blocks are handled, and why (the header explains these)."""
    parts = []
    embeddings = ", ".join(f"{entry['name']} ({count_text(entry['params'])})" for entry in profile.embeddings) or "none"
    head = profile.output_head or "none"
    root = count_text(profile.root_params)
    if request.fsdp_version == 2:
        if profile.tied_embeddings:
            parts.append(f"embeddings {embeddings} and the output head {head} share one weight (tied): accelerate "
                         "puts the input embedding, the final norm and the head into one tail unit, so the shared "
                         "parameter lives in exactly one FSDP unit and stays tied after sharding")
        else:
            parts.append(f"input embedding {embeddings}: its own FSDP unit (accelerate shards it apart from the "
                         f"blocks); the final norm and the output head {head} form a tail unit that stays gathered "
                         "from forward to backward (reshard_after_forward false for it: re-gathering it at the "
                         "start of backward could not be hidden)")
        parts.append(f"{root} parameters live outside the blocks in all; what the units above do not take stays in "
                     "the root unit, which FSDP2 keeps gathered after forward")
    else:
        tie = " (the tied embedding/head weight is one parameter of it)" if profile.tied_embeddings else ""
        parts.append(f"embeddings {embeddings}, the final norm and the output head {head}: FSDP1's root unit "
                     f"({root} parameters){tie}, kept gathered after forward because backward needs it first")
    norms = ", ".join(profile.norm_classes) or "none"
    rms = [name for name in profile.norm_classes if "rms" in name.lower() or name == "T5LayerNorm"]
    if request.device == "cpu" and request.precision in ("auto", "fp32"):
        parts.append(f"norms ({norms}) stay inside their blocks' units and compute in fp32 like everything else")
    else:
        upcast = (f"; {', '.join(rms)} upcast{'s' if len(rms) == 1 else ''} to fp32 internally (Hugging Face RMSNorm implementations compute the "
                  "variance in fp32)" if rms else "")
        parts.append(f"norms ({norms}) stay inside their blocks' units (the final norm in the tail/root unit); under "
                     "FSDP mixed precision their weights are gathered in the compute dtype like every parameter and "
                     f"the fp32 master copy is what the optimizer updates{upcast}")
    parts.append("weight decay: recipes/causal_lm.py excludes norms, biases and embeddings (fsdp_presets.train.loop."
                 "param_groups)" + (f"; FSDP1 needs {K.use_orig_params}: true for such per-parameter groups (set)"
                                    if request.fsdp_version == 1 else ""))
    parts.append(f"no ignored modules ({K.ignored_modules} unset): FSDP leaves ignored parameters out of gradient "
                 "synchronisation, so they would drift apart between ranks")
    return parts


def _accumulation_reason(profile, hardware, shape, name, fsdp_version) -> str:
    """Why gradients are accumulated under no_sync or reduced every micro-batch, with the
    planner's (rehearsal-checked) numbers."""
    if shape.grad_accum == 1:
        return ""
    no_sync = plan(profile, hardware, shape.replace(reduce_every_micro_batch=False)).get(name, fsdp_version)
    held = no_sync.per_gpu.buffers - plan(profile, hardware, shape.replace(grad_accum=1)).get(name, fsdp_version).per_gpu.buffers
    if not shape.reduce_every_micro_batch:
        return (f"; accumulated under no_sync: reduced once per optimizer step, while each GPU holds "
                f"{bytes_text(held)} of unsharded gradients between micro-batches")
    return (f"; gradients reduced after every micro-batch (recipe --reduce-every-micro-batch): accumulating "
            f"them under no_sync would hold {bytes_text(held)} of unsharded gradients per GPU "
            f"({bytes_text(no_sync.per_gpu.total)} in all, over {bytes_text(hardware.usable_bytes)} usable)")


def _batch_reason(request, row, micro, accumulation, data_parallel, global_samples, seq_len) -> str:
    tokens = global_samples * seq_len
    if request.micro_batch:
        how = f"micro-batch {micro} as asked (up to {row.max_micro_batch} fits)"
    else:
        how = (f"micro-batch {micro}: the largest that fits ({row.max_micro_batch} fits) and divides each rank's "
               f"{global_samples // data_parallel} sequences")
    batch_source = "default 0.5M tokens" if request.global_batch is None else f"--global-batch {request.global_batch}"
    return (f"{micro} x {accumulation} accumulation x {data_parallel} data-parallel ranks = {global_samples} sequences "
            f"= {tokens:,} tokens per optimizer step ({batch_source}); {how}")


# --------------------------------------------------------------------------- rescaling


def rescale_request(old: PresetRequest, old_summary: dict, **changes) -> PresetRequest:
    """The request for a new layout that keeps the old preset's global batch (in sequences)."""
    changes = {key: value for key, value in changes.items() if value is not None}
    if "global_batch" not in changes:
        changes["global_batch"] = str(old_summary["global_batch"]) if old.global_batch is None or \
            parse_global_batch(old.global_batch)[1] == "tokens" else old.global_batch
    if "micro_batch" not in changes:
        changes["micro_batch"] = None  # re-decided for the new layout
    return replace(old, **changes)


def describe_changes(old: dict, new: dict) -> list[str]:
    """``gradient accumulation 4 -> 2``, ``HSDP 2x8 -> FULL_SHARD 8``: what a rescale changed."""
    names = {
        "processes": "processes", "machines": "machines", "sharding": "sharding", "fsdp_version": "FSDP version",
        "precision": "mixed precision", "activation_checkpointing": "activation checkpointing",
        "offload": "CPU offload", "state_dict": "state dict", "seq_len": "sequence length",
        "micro_batch": "micro-batch", "gradient_accumulation": "gradient accumulation",
        "data_parallel_size": "data-parallel size", "global_batch": "global batch (sequences)",
    }

    def text(value) -> str:
        if isinstance(value, bool):
            return "on" if value else "off"
        return str(value)

    lines = []
    for key, label in names.items():
        if key in old and key in new and old[key] != new[key]:
            lines.append(f"{label} {text(old[key])} -> {text(new[key])}")
    return lines


__all__ = [
    "BatchPlan",
    "MemorySavers",
    "Parallelism",
    "Preset",
    "PresetRequest",
    "PrecisionChoice",
    "StateDictChoice",
    "WrapChoice",
    "decide",
    "describe_changes",
    "full_state_dict_host_bytes",
    "parse_global_batch",
    "rescale_request",
]
