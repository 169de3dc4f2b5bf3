"""How accelerate cuts a model into FSDP units, and the parameters, gradients and optimizer state
each rank keeps between steps ([ZeRO] Sec. 3.1, [FSDP], [FSDP2], [accelerate]: sources in
:mod:`fsdp_presets.plan.planner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp_presets.model.model_profile import ModelProfile
from fsdp_presets.plan.results import ModelStateBytes
from fsdp_presets.plan.shapes import OPTIMIZER_STATE_BYTES, STORED_PARAM_BYTES, TrainingShape

@dataclass(frozen=True, kw_only=True)
class ShardUnit:
    """One FSDP unit: a group of parameters all-gathered and reduce-scattered together."""

    name: str
    """Block class name, ``embedding``, ``root`` (FSDP1) or ``tail`` (FSDP2)."""
    params: int
    """Parameters in one such unit."""
    count: int = 1
    """How many identical units."""
    reshards_after_forward: bool = True
    """False for units FSDP keeps unsharded from forward through backward whatever the strategy
    (the root: [FSDP] and [FSDP2]; accelerate's FSDP2 tail: [accelerate])."""


def input_embedding_params(profile: ModelProfile) -> int:
    """Parameters of the input token embedding when it is not tied to the head (else 0).

    Read from the profile's ``role: input`` embedding; a profile without roles falls back to
    vocab x hidden, bounded by the root."""
    if profile.tied_embeddings:
        return 0
    inputs = [entry.get("params", 0) for entry in profile.embeddings if entry.get("role") == "input"]
    if inputs:
        return min(sum(inputs), profile.root_params)
    return min(profile.dims.vocab_size * profile.dims.hidden_size, profile.root_params)


def fsdp_units(profile: ModelProfile, fsdp_version: int) -> list[ShardUnit]:
    """How accelerate wraps ``profile`` into FSDP units.

    FSDP1 (``transformer_based_wrap``): one flat parameter per block, and the root unit with
    everything else, which FSDP1 does not free after forward ([FSDP]: "the root's parameters
    are not freed after forward since they are needed immediately in backward").
    FSDP2 [accelerate]: each block; the untied input embedding as its own unit; a
    ``[final_norm, lm_head]`` tail (with the embedding when tied) and the root's leftovers, both
    kept unsharded after forward (``reshard_after_forward=False`` for the tail; torch's default
    for the root)."""
    if fsdp_version not in (1, 2):
        raise ValueError(f"fsdp_version must be 1 or 2, got {fsdp_version}")
    units = [ShardUnit(name=unit.cls, params=unit.params_each, count=unit.count) for unit in profile.units]
    if fsdp_version == 1:
        if profile.root_params:
            units.append(ShardUnit(name="root", params=profile.root_params, reshards_after_forward=False))
        return units
    embedding = input_embedding_params(profile)
    if embedding:
        units.append(ShardUnit(name="embedding", params=embedding))
    if profile.root_params - embedding:
        units.append(ShardUnit(name="tail", params=profile.root_params - embedding, reshards_after_forward=False))
    return units


def shard_numel(params: int, shard_world_size: int) -> int:
    """Elements of one unit a rank holds: ``ceil(params / N)``.

    FSDP1 pads each flat parameter to a multiple of N, so every rank holds exactly this [FSDP].
    FSDP2 pads each *parameter*'s dim 0 to a multiple of N ([FSDP2]: rank 0 holds
    ``ceil(dim0 / N)`` rows of each), which :func:`fsdp2_shard_numel` computes from shapes;
    from a unit's total alone this is exact when every dim 0 divides by N (the usual case:
    widths are multiples of 64) and otherwise short by under one row per parameter."""
    return -(-params // shard_world_size)


def fsdp2_shard_numel(shapes: list[tuple[int, ...]], shard_world_size: int) -> int:
    """Elements the largest rank (rank 0) holds of FSDP2-sharded parameters of these shapes:
    ``ceil(dim0 / N)`` rows of each [FSDP2]. Later ranks hold fewer rows when dim 0 is uneven
    (``torch.chunk`` semantics; their shards are padded in storage up to the same size)."""
    total = 0
    for shape in shapes:
        if not shape:  # a 0-d parameter counts as one row
            shape = (1,)
        rows = -(-shape[0] // shard_world_size)
        total += rows * math.prod(shape[1:])
    return total


def fused_expert_params(profile: ModelProfile) -> int:
    """Parameters of one block's experts when transformers stores them fused, one 3-D tensor per
    projection with the experts on dim 0 (Mixtral in transformers 5: gate, up and down, each
    experts x hidden x intermediate); 0 for a dense model."""
    dims = profile.dims
    return dims.num_experts * 3 * dims.hidden_size * dims.intermediate_size if dims.num_experts else 0


def _fused_experts_in(profile: ModelProfile, unit: "ShardUnit", fsdp_version: int) -> int:
    """Parameters of ``unit`` in fused expert tensors that FSDP2 shards on the expert dim (0: none)."""
    experts = fused_expert_params(profile)
    if fsdp_version != 2 or not experts or unit.name in ("embedding", "tail", "root") or experts > unit.params:
        return 0
    return experts


def _unit_shard_numel(profile: ModelProfile, unit: "ShardUnit", shard_world_size: int, fsdp_version: int,
                      expert_shard_world_size: int | None = None) -> int:
    """Elements of ``unit`` the largest rank (rank 0) holds. FSDP2 shards every parameter on
    dim 0 [FSDP2]: a fused expert tensor has only ``experts`` rows, so over more ranks than
    experts rank 0 holds a whole expert of each (1/8 of Mixtral's experts at 16 or 32 GPUs, not
    1/16 or 1/32; rehearsed: 21.2 GiB of fp32 parameters on rank 0 at 32 GPUs).
    ``expert_shard_world_size``: the ranks the experts are sharded over when not the same
    (expert parallelism shards them over ``efsdp``; default ``shard_world_size``)."""
    experts = _fused_experts_in(profile, unit, fsdp_version)
    if not experts:
        return shard_numel(unit.params, shard_world_size)
    count = profile.dims.num_experts
    rows = -(-count // (expert_shard_world_size or shard_world_size))
    return rows * (experts // count) + shard_numel(unit.params - experts, shard_world_size)


def gathered_params(profile: ModelProfile, unit: "ShardUnit", fsdp_version: int, expert_shard_world_size: int) -> int:
    """Elements of ``unit`` once all-gathered (and of its gradient before the reduce-scatter): its
    parameters, with a fused expert tensor padded on dim 0 to a multiple of the ranks sharding it
    [FSDP2] (8 experts over 64 ranks gather as 64 rows: rehearsed, a 4-block Mixtral-8x7B at 64
    GPUs holds 42 GiB of gathered parameters, 8 times its two blocks)."""
    experts = _fused_experts_in(profile, unit, fsdp_version)
    if not experts:
        return unit.params
    count = profile.dims.num_experts
    rows = -(-count // expert_shard_world_size) * expert_shard_world_size
    return unit.params - experts + rows * (experts // count)


def model_state_bytes(
    profile: ModelProfile, shape: TrainingShape, shard_world_size: int, fsdp_version: int | None = 2,
    expert_shard_world_size: int | None = None,
) -> ModelStateBytes:
    """Per-rank parameters, gradients and optimizer state of full fine-tuning with model states
    sharded over ``shard_world_size`` ranks (1: replicated, as DDP and NO_SHARD); LoRA's are
    :func:`fsdp_presets.plan.lora_memory.lora_model_state_bytes`, which builds on the units here.

    The [ZeRO] Sec. 3.1 accounting with the stored-fp32 convention of this module: 4 + 4 + K'
    bytes per parameter (K' = optimizer state, 8 for Adam), divided by the shard world size
    (ZeRO stage 3 = FSDP FULL_SHARD, Sec. 5.3). ``expert_shard_world_size``: the ranks sharding
    fused experts where not ``shard_world_size`` (expert parallelism's ``efsdp``)."""
    if shard_world_size < 1:
        raise ValueError(f"shard_world_size must be at least 1, got {shard_world_size}")
    if shard_world_size == 1 or fsdp_version is None:
        numel = profile.total_params if shard_world_size == 1 else shard_numel(profile.total_params, shard_world_size)
    else:
        numel = sum(unit.count * _unit_shard_numel(profile, unit, shard_world_size, fsdp_version,
                                                   expert_shard_world_size)
                    for unit in fsdp_units(profile, fsdp_version))
    return ModelStateBytes(
        params=numel * STORED_PARAM_BYTES,
        grads=numel * STORED_PARAM_BYTES,
        optimizer=numel * OPTIMIZER_STATE_BYTES[shape.optimizer],
    )


def zero_model_state_bytes(total_params: int, stage: int, world_size: int, k: int = 12) -> float:
    """[ZeRO] Sec. 5 / Fig. 1 model-state bytes per GPU, fp16 mixed precision with a K-byte
    optimizer (K = 12 for mixed-precision Adam): stage 0 (DDP) (2+2+K)P, stage 1 (P_os)
    (2+2)P + KP/N, stage 2 (P_os+g) 2P + (2+K)P/N, stage 3 (P_os+g+p) (2+2+K)P/N.

    Kept for comparison with the paper: FSDP stores fp32 parameters and gradients (see module
    notes), which gives the same totals for stages 0 and 3 and 2P/N more than stage 2 for
    SHARD_GRAD_OP (its sharded gradients are fp32, not fp16)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    n = world_size
    psi = total_params
    return {
        0: (2 + 2 + k) * psi,
        1: (2 + 2) * psi + k * psi / n,
        2: 2 * psi + (2 + k) * psi / n,
        3: (2 + 2 + k) * psi / n,
    }[stage]


ACCUMULATED_GRAD_BYTES = {1: STORED_PARAM_BYTES, 2: 2}
"""Bytes per parameter of the unsharded gradients FSDP accumulates under ``no_sync``, by FSDP
version, with 16-bit compute. FSDP2 keeps every parameter's unsharded gradient in the compute
dtype until the micro-batch that reduces (measured: +14.96 GiB per GPU for 8B at 8 GPUs, with
or without activation checkpointing); FSDP1 accumulates them in the parameter dtype (fp32; not
rehearsed). In fp32 both are 4."""

