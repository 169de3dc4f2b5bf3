"""What ``nvidia-smi`` shows for a planned step: the tensors at the peak (the planner's per-GPU
figure), what torch's CUDA caching allocator holds beyond them, and the CUDA context.

The caching allocator (torch's ``CUDACachingAllocator``, expandable segments off, its
default) keeps every freed block for later requests instead of giving it back to the driver, and
takes a new segment only for a request that no cached block can serve; only a request that would
fail makes it release its cache and retry, so what it holds stays within the GPU while the tensors
fit. ``nvidia-smi`` shows those segments (``torch.cuda.memory_reserved()``) plus the CUDA context.
What the allocator holds beyond the tensors at the peak is counted in two parts:

- *Blocks of another stream.* A block belongs to the stream that allocated it and only that
  stream reuses it (``c10/cuda/CUDACachingAllocator.h``: each segment records its stream;
  ``record_stream`` makes another stream's use delay the free, not share the block). FSDP allocates
  on streams of its own:

  - the gradient shards. FSDP2 casts a unit's reduced gradient to the parameter dtype on its
    reduce-scatter stream (``_fully_shard/_fsdp_collectives.py::foreach_reduce``: "The RS output
    is allocated in the RS stream and used in the default stream (for optimizer)"), FSDP1 on its
    post-backward stream (``fsdp/_runtime_utils.py::_reduce_grad``). ``zero_grad(set_to_none=True)``
    frees them into that stream's pool, which the next step's activations cannot use: where the
    peak comes while they are freed (at the loss), their bytes are held beyond the tensors.
  - FSDP2's all-gather buffers (``foreach_all_gather``: allocated on the copy-in stream, copied
    out into the unsharded parameters on the default stream): two units' worth, the unit gathered
    and the one prefetched (the largest unit and a block).
  - FSDP1's pre-unshard stream (``fsdp/_flat_param.py::pre_unshard``): under offload, each unit's
    shard copied to the GPU before its all-gather; under parameter mixed precision, its
    low-precision shard (``_mp_shard``). Two units' worth (the largest unit and a block): the rate
    limiter lets two all-gathers run ahead of compute.

- *Fragmentation of the default stream*: measured, not derived.
  :data:`SINGLE_STREAM_FRAGMENTATION` is what one stream's caching holds beyond the tensors at
  the peak in a run with no other stream.

Checked against every published and measured figure the project has (``tests/test_memory_anchors.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_presets.fileio import GiB, format_bytes
from fsdp_presets.plan.lora_memory import base_bytes_per_param, lora_units
from fsdp_presets.plan.model_state import fsdp_units, shard_numel
from fsdp_presets.plan.shapes import DEFAULT_RESERVED_BYTES, STORED_PARAM_BYTES

SINGLE_STREAM_FRAGMENTATION = (36.73 - 35.44) / 35.44
"""Share of the peak tensors one stream's caching holds beyond them: measured on one H200 with no
FSDP and no side stream (docs/benchmarks.md, section ``gpu-bench``: TinyLlama-1.1B's shape, bf16,
AdamW, sequence 2048, micro-batch 4): 36.73 GiB reserved for 35.44 GiB allocated at the peak, 3.6%."""

CONTEXT_BYTES = DEFAULT_RESERVED_BYTES
"""The CUDA context, cuBLAS workspaces and NCCL buffers, outside the allocator (1 GiB)."""


@dataclass(frozen=True, kw_only=True)
class AllocatorReserve:
    """Bytes the caching allocator holds beyond the tensors at a row's peak."""

    other_streams: int
    """Cached blocks of FSDP's own streams that the peak's tensors cannot use."""
    fragmentation: int
    """The default stream's cached blocks beyond its tensors (:data:`SINGLE_STREAM_FRAGMENTATION`)."""

    @property
    def total(self) -> int:
        return self.other_streams + self.fragmentation


@dataclass(frozen=True, kw_only=True)
class UnitBytes:
    """One FSDP unit as the allocator sees it."""

    count: int
    gathered: int
    """Its unsharded parameters in the compute dtype: what an all-gather fills."""
    shard_stored: int
    """One rank's shard as stored (what offload copies to the GPU before the all-gather)."""
    shard_low_precision: int
    """One rank's shard cast for compute under parameter mixed precision (0 without it)."""


def allocator_reserve(units: list[UnitBytes], *, fsdp_version: int | None, name: str, offloaded: bool,
                      state_grads_on_gpu: int, peak_grads: int, peak_total: int) -> AllocatorReserve:
    """What the allocator holds beyond ``peak_total`` bytes of tensors (see the module notes)."""
    other = 0
    if fsdp_version is not None and name != "DDP":
        other += max(0, state_grads_on_gpu - peak_grads)  # gradient shards freed into FSDP's own pool
        if fsdp_version == 2:
            other += _gathered_and_prefetched([(unit.count, unit.gathered) for unit in units])
        elif name != "NO_SHARD":
            other += _gathered_and_prefetched([(unit.count, (unit.shard_stored if offloaded else 0)
                                                + unit.shard_low_precision) for unit in units])
    return AllocatorReserve(other_streams=other, fragmentation=round(SINGLE_STREAM_FRAGMENTATION * peak_total))


def _gathered_and_prefetched(units: list[tuple[int, int]]) -> int:
    """The largest unit and the one in flight beside it: a block (a unit that repeats), since the
    units that occur once (embedding, tail, root) sit at the ends of the stack, each next to a block."""
    largest = max((size for _, size in units), default=0)
    block = max((size for count, size in units if count > 1), default=0)
    return largest + block


def nvidia_smi_bytes(peak_total: int, reserve: AllocatorReserve, gpu_memory_bytes: int) -> int:
    """What ``nvidia-smi`` shows at the peak: tensors, the allocator's reserve and the context; no
    more than the GPU when the tensors and the context fit it (the allocator frees its cache and
    retries rather than fail), else the whole need."""
    shown = peak_total + reserve.total + CONTEXT_BYTES
    if peak_total + CONTEXT_BYTES <= gpu_memory_bytes:
        return min(shown, gpu_memory_bytes)
    return shown


def tensors_and_shown(strategy) -> str:
    """``29.1 GiB of tensors per GPU (~31.2 GiB as nvidia-smi shows it)`` for a planned row."""
    return (f"{strategy.per_gpu.total / GiB:.1f} GiB of tensors per GPU "
            f"(~{format_bytes(strategy.nvidia_smi)} as nvidia-smi shows it)")


def unit_bytes(profile, shape, fsdp_version: int | None, shard_world_size: int) -> list[UnitBytes]:
    """The FSDP units of ``profile`` under ``shape`` (LoRA: frozen base as stored, fp32 adapters)."""
    c = shape.compute_bytes
    if shape.lora is not None:
        base = base_bytes_per_param(shape)
        return [UnitBytes(count=unit.count, gathered=unit.base_bytes + unit.adapter_params * c,
                          shard_stored=shard_numel(unit.base_bytes, shard_world_size)
                          + shard_numel(unit.adapter_params, shard_world_size) * STORED_PARAM_BYTES,
                          shard_low_precision=(shard_numel(unit.base_bytes, shard_world_size) * c // base
                                               if base != c else 0)
                          + shard_numel(unit.adapter_params, shard_world_size) * c if shape.mixed else 0)
                for unit in lora_units(profile, shape, fsdp_version)]
    return [UnitBytes(count=unit.count, gathered=unit.params * c,
                      shard_stored=shard_numel(unit.params, shard_world_size) * STORED_PARAM_BYTES,
                      shard_low_precision=shard_numel(unit.params, shard_world_size) * c if shape.mixed else 0)
            for unit in fsdp_units(profile, fsdp_version or 2)]
