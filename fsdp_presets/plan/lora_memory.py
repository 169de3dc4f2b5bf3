"""What LoRA and QLoRA cost per GPU: a frozen (4-bit) base, fp32 adapters, their gradients and
optimizer state, the adapter path's activations and communication. The adapter itself is
:class:`~fsdp_presets.plan.shapes.LoraShape`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp_presets.plan.activations import (activation_bytes, activation_bytes_per_layer, logits_bytes,
                                           mlp_width)
from fsdp_presets.plan.communication import collectives
from fsdp_presets.plan.model_state import ACCUMULATED_GRAD_BYTES, fsdp_units, shard_numel
from fsdp_presets.model.model_profile import ModelProfile
from fsdp_presets.plan.results import CommBytes, ModelStateBytes, PerGpuBytes
from fsdp_presets.plan.shapes import (OPTIMIZER_STATE_BYTES, STORED_PARAM_BYTES, Hardware, LoraShape,
                                      TrainingShape)

# --------------------------------------------------------------------------- LoRA and QLoRA
#
# Sources:
# - [LoRA] Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685:
#   a frozen W plus B @ A with A (r x in) and B (out x r): r x (in + out) trainable parameters per
#   adapted Linear (Sec. 4.1).
# - [QLoRA] Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs",
#   arXiv:2305.14314, Sec. 2-3: NF4 weights (4 bits), one fp32 absmax per 64-weight block
#   (32/64 = 0.5 bits per parameter); double quantization stores those constants in 8 bits with
#   one fp32 constant per 256 of them: 8/64 + 32/(64 x 256) = 0.127 bits per parameter.
# - [bitsandbytes] ``bitsandbytes.nn.Linear4bit`` / ``Params4bit`` (0.50) and transformers'
#   ``BitsAndBytesConfig``: every ``nn.Linear`` but the output head is quantized, its packed
#   weight (two 4-bit values per byte) held in ``bnb_4bit_quant_storage`` (bfloat16 here, so FSDP
#   shards it like any bf16 tensor; uint8 storage is left replicated by accelerate), dequantized
#   one Linear at a time for compute.
# - [accelerate] ``fsdp2_prepare_model`` (1.16) upcasts to fp32 only parameters that require
#   gradients: the frozen base keeps its storage dtype, the adapters become fp32 masters.

NF4_BYTES_PER_PARAM = 0.5
"""4-bit NF4 weights, two per byte [QLoRA]."""

QUANT_CONSTANT_BITS = {False: 32 / 64, True: 8 / 64 + 32 / (64 * 256)}
"""Bits per quantized parameter of quantization constants, without / with double quantization
[QLoRA] Sec. 3: an fp32 absmax per 64 weights (0.5), or 8-bit absmax plus an fp32 constant per 256
of them (0.127). The recipes' ``BitsAndBytesConfig`` keeps double quantization off."""


@dataclass(frozen=True, kw_only=True)
class BlockLinear:
    name: str
    in_features: int
    out_features: int
    bias: bool = False


def block_linears(profile: ModelProfile, cls: str) -> list[BlockLinear]:
    """The Linear layers of one block of class ``cls``, read off the profile; for a profile
    without them (older JSON), the Llama-style projections from the dims."""
    known = (profile.structure.get("block_linears") or {}).get(cls)
    if known is not None:
        return [BlockLinear(name=n, in_features=i, out_features=o, bias=bool(b)) for n, i, o, b in known]
    d = profile.dims
    if not (d.hidden_size and d.num_attention_heads):
        return []
    head = d.hidden_size // d.num_attention_heads
    q, kv = d.num_attention_heads * head, d.num_key_value_heads * head
    return [BlockLinear(name="q_proj", in_features=d.hidden_size, out_features=q),
            BlockLinear(name="k_proj", in_features=d.hidden_size, out_features=kv),
            BlockLinear(name="v_proj", in_features=d.hidden_size, out_features=kv),
            BlockLinear(name="o_proj", in_features=q, out_features=d.hidden_size),
            BlockLinear(name="gate_proj", in_features=d.hidden_size, out_features=d.intermediate_size),
            BlockLinear(name="up_proj", in_features=d.hidden_size, out_features=d.intermediate_size),
            BlockLinear(name="down_proj", in_features=d.intermediate_size, out_features=d.hidden_size)]


def default_target_modules(profile: ModelProfile) -> list[str]:
    """The attention and MLP projections of the family's block: every Linear name in it."""
    names: list[str] = []
    for unit in profile.units:
        for linear in block_linears(profile, unit.cls):
            if linear.name not in names:
                names.append(linear.name)
    return names


def targeted_linears(profile: ModelProfile, lora: LoraShape, cls: str) -> list[BlockLinear]:
    """The Linear layers of one block that get an adapter (peft matches the last name component)."""
    linears = block_linears(profile, cls)
    targets = lora.target_modules
    if targets is None or "all-linear" in targets:
        return linears
    return [linear for linear in linears if linear.name in targets]


def unknown_target_modules(profile: ModelProfile, lora: LoraShape) -> list[str]:
    """Requested target names that no block of the model has (peft would raise)."""
    if lora.target_modules is None or "all-linear" in lora.target_modules:
        return []
    present = set(default_target_modules(profile))
    return [name for name in lora.target_modules if name not in present]


@dataclass(frozen=True, kw_only=True)
class LoraUnit:
    """One FSDP unit under LoRA: its frozen base bytes as stored and its adapter parameters."""

    name: str
    count: int
    base_bytes: int
    """Frozen weights of one unit in storage (bf16, or packed 4-bit plus constants)."""
    adapter_params: int
    """Trainable LoRA parameters in one unit: r x (in + out) per adapted Linear [LoRA]."""
    reshards_after_forward: bool = True
    largest_dequantized: int = 0
    """QLoRA: elements of the widest Linear weight, dequantized for compute one at a time."""


_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def base_bytes_per_param(shape: TrainingShape) -> int:
    """The frozen base's storage: the dtype it was loaded in when known (PEFT's LoRA example loads
    it in fp32 under bf16 mixed precision); else LoRA in the compute dtype, and QLoRA in bf16, its
    quant storage dtype, whatever mixed_precision says (transformers' Trainer sets FSDP's mixed
    precision to the storage dtype: ``update_fsdp_plugin_peft``)."""
    lora = shape.lora
    if lora is not None and lora.base_dtype:
        return _DTYPE_BYTES[lora.base_dtype]
    if lora is not None and lora.method == "qlora":
        return 2
    return shape.compute_bytes


def _quantized_bytes(params: int, lora: LoraShape) -> int:
    """The packed 4-bit weights: what FSDP shards (a float tensor in the quant storage dtype)."""
    return math.ceil(params * NF4_BYTES_PER_PARAM)


def quant_constant_bytes(profile: ModelProfile, lora: LoraShape) -> int:
    """QLoRA's quantization constants (absmax, and the double-quantization state) of the whole
    model. They live in bitsandbytes' ``quant_state``, an attribute of each ``Params4bit``, not an
    FSDP parameter: every rank holds all of them on its GPU, unsharded and never offloaded
    (bitsandbytes restores them from the module after FSDP flattens the weight:
    ``fix_4bit_weight_quant_state_from_module``)."""
    if lora is None or lora.method != "qlora":
        return 0
    quantized = 0
    for unit in profile.units:
        linears = block_linears(profile, unit.cls)
        quantized += unit.count * min(sum(linear.in_features * linear.out_features for linear in linears),
                                      unit.params_each)
    return math.ceil(quantized * QUANT_CONSTANT_BITS[lora.double_quant] / 8)


def lora_units(profile: ModelProfile, shape: TrainingShape, fsdp_version: int | None) -> list[LoraUnit]:
    """The FSDP units (as :func:`fsdp_units`) with LoRA's bytes; for DDP (``None``) the FSDP2 split."""
    lora = shape.lora
    base = base_bytes_per_param(shape)
    units = []
    for unit in fsdp_units(profile, fsdp_version or 2):
        block = next((u for u in profile.units if u.cls == unit.name and u.params_each == unit.params), None)
        if block is None:  # root, tail, embedding: never adapted, never quantized (the head is skipped)
            units.append(LoraUnit(name=unit.name, count=unit.count, base_bytes=unit.params * base, adapter_params=0,
                                  reshards_after_forward=unit.reshards_after_forward))
            continue
        linears = block_linears(profile, unit.name)
        adapters = sum(lora.r * (linear.in_features + linear.out_features)
                       for linear in targeted_linears(profile, lora, unit.name))
        if lora.method == "qlora":
            quantized = min(sum(linear.in_features * linear.out_features for linear in linears), unit.params)
            base_bytes = _quantized_bytes(quantized, lora) + (unit.params - quantized) * base
            widest = max((linear.in_features * linear.out_features for linear in linears), default=0)
        else:
            base_bytes, widest = unit.params * base, 0
        units.append(LoraUnit(name=unit.name, count=unit.count, base_bytes=base_bytes, adapter_params=adapters,
                              reshards_after_forward=unit.reshards_after_forward, largest_dequantized=widest))
    return units


def adapter_params(profile: ModelProfile, shape: TrainingShape) -> int:
    """Trainable parameters of the whole adapter."""
    return sum(unit.count * unit.adapter_params for unit in lora_units(profile, shape, 2))


def base_storage_bytes(profile: ModelProfile, shape: TrainingShape) -> int:
    """The whole frozen base as stored (bf16, or 4-bit packed plus constants)."""
    return sum(unit.count * unit.base_bytes for unit in lora_units(profile, shape, 2)) + \
        quant_constant_bytes(profile, shape.lora)


def lora_model_state_bytes(profile: ModelProfile, shape: TrainingShape, shard_world_size: int,
                           fsdp_version: int | None) -> ModelStateBytes:
    """Per rank: the frozen base in storage plus fp32 adapter masters (``params``), fp32 adapter
    gradients and optimizer state. Frozen weights have neither gradients nor optimizer state."""
    units = lora_units(profile, shape, fsdp_version)
    n = shard_world_size if fsdp_version is not None else 1
    base = sum(unit.count * shard_numel(unit.base_bytes, n) for unit in units)
    adapters = sum(unit.count * shard_numel(unit.adapter_params, n) for unit in units)
    return ModelStateBytes(params=base + adapters * STORED_PARAM_BYTES, grads=adapters * STORED_PARAM_BYTES,
                           optimizer=adapters * OPTIMIZER_STATE_BYTES[shape.optimizer])


def adapter_activation_bytes_per_layer(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int:
    """What the adapter path adds to one block's saved activations: per adapted Linear and token,
    A's r-wide output and the scaled B output's input (2 x r values); with dropout, the dropped
    copy of the input and its mask (in x (c + 1) bytes). The base Linear's input is the same tensor
    the adapter reads, saved once. Without dropout this is under 1% of the block."""
    lora, c = shape.lora, shape.compute_bytes
    tokens = shape.seq_len * micro_batch
    per_token = 0
    for unit in profile.units[:1]:
        for linear in targeted_linears(profile, lora, unit.cls):
            per_token += 2 * lora.r * c + (linear.in_features * (c + 1) if lora.dropout > 0 else 0)
    return tokens * per_token


def lora_activation_bytes(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int:
    """Activations under LoRA: the full fine-tune's (backward through frozen layers still needs
    every block's saved tensors to reach the adapters below) plus the adapter path in every block
    when blocks are not checkpointed (under checkpointing each block keeps only its input)."""
    extra = 0 if shape.activation_checkpointing else \
        profile.dims.num_layers * adapter_activation_bytes_per_layer(profile, shape, micro_batch)
    return activation_bytes(profile, shape, micro_batch) + extra


def lora_peak(profile: ModelProfile, shape: TrainingShape, name: str, fsdp_version: int | None,
               state: ModelStateBytes, micro_batch: int) -> PerGpuBytes:
    """:func:`_peak` for LoRA/QLoRA: the same two moments, with units gathered in their storage
    bytes (frozen base as stored, adapters cast to the compute dtype), unsharded gradients of the
    adapters only, and (QLoRA) one Linear's dequantized weight in compute."""
    c = shape.compute_bytes
    units = lora_units(profile, shape, fsdp_version)
    activations = lora_activation_bytes(profile, shape, micro_batch)
    adapters = sum(unit.count * unit.adapter_params for unit in units)
    # One Linear's weight dequantized for compute (inside a block), and every quantization constant
    # (replicated, on the GPU through the whole step, offload or not: at the loss as in a block).
    constants = quant_constant_bytes(profile, shape.lora)
    dequantized = max((unit.largest_dequantized for unit in units), default=0) * c + constants
    accumulated = 0
    if shape.grad_accum > 1 and not shape.reduce_every_micro_batch and fsdp_version is not None:
        accumulated = adapters * (STORED_PARAM_BYTES if c == 4 else ACCUMULATED_GRAD_BYTES[fsdp_version])
    if name == "DDP":
        # Buckets for the trainable gradients only; the adapters' compute copies under autocast.
        buffers = adapters * STORED_PARAM_BYTES + (adapters * c if shape.mixed else 0) + dequantized
        return PerGpuBytes(params=state.params, grads=state.grads, optimizer=state.optimizer,
                           activations=activations, buffers=buffers)
    if name == "NO_SHARD":
        buffers = (adapters * c if shape.mixed else 0) + dequantized + accumulated
        return PerGpuBytes(params=state.params, grads=state.grads, optimizer=state.optimizer,
                           activations=activations, buffers=buffers)

    def gathered(unit: LoraUnit) -> int:
        return unit.base_bytes + unit.adapter_params * c

    resharded = sorted((unit for unit in units if unit.reshards_after_forward for _ in range(min(unit.count, 2))),
                       key=gathered, reverse=True)
    kept = sum(unit.count * gathered(unit) for unit in units if not unit.reshards_after_forward)
    if name == "SHARD_GRAD_OP":
        at_loss = in_block = sum(unit.count * gathered(unit) for unit in units)
    else:
        at_loss, in_block = kept, kept + sum(gathered(unit) for unit in resharded[:2])
    largest_adapter = resharded[0].adapter_params if resharded else 0
    grads = state.grads if shape.grad_accum > 1 and shape.reduce_every_micro_batch else 0
    peak_at_loss = PerGpuBytes(params=state.params, grads=grads, optimizer=state.optimizer, activations=activations,
                               buffers=at_loss + accumulated + constants)
    recomputed = 0
    if shape.activation_checkpointing:
        recomputed = activation_bytes_per_layer(profile, shape, micro_batch) + \
            adapter_activation_bytes_per_layer(profile, shape, micro_batch)
    block_temporaries = 2 * shape.seq_len * micro_batch * mlp_width(profile) * c
    peak_in_block = PerGpuBytes(
        params=state.params, grads=grads or state.grads, optimizer=state.optimizer,
        activations=activations - logits_bytes(profile, shape, micro_batch) + recomputed + block_temporaries,
        buffers=in_block + largest_adapter * c + dequantized + accumulated)
    return max(peak_at_loss, peak_in_block, key=lambda peak: peak.total)


def lora_comm(profile: ModelProfile, hardware: Hardware, shape: TrainingShape, name: str,
              fsdp_version: int | None) -> CommBytes:
    """Per-step communication under LoRA: FSDP all-gathers every unit as stored (the frozen base
    too) and reduces only the adapters' gradients; DDP all-reduces the adapters' fp32 gradients."""
    c = shape.compute_bytes
    if name in ("DDP", "NO_SHARD"):
        per = STORED_PARAM_BYTES if name == "DDP" else c
        return collectives([("all_reduce", adapter_params(profile, shape) * per, hardware.gpus, hardware.nodes > 1)])
    if name == "HYBRID_SHARD":
        shard_size, replicate_size = hardware.gpus_per_node, hardware.nodes
    else:
        shard_size, replicate_size = hardware.gpus, 1
    gathered = reduced = sharded = 0
    for unit in lora_units(profile, shape, fsdp_version):
        payload = unit.count * shard_numel(unit.base_bytes + unit.adapter_params * c, shard_size) * shard_size
        regathered = unit.reshards_after_forward and name != "SHARD_GRAD_OP"
        gathered += payload * (2 if regathered else 1)
        reduced += unit.count * shard_numel(unit.adapter_params, shard_size) * shard_size * c
        sharded += unit.count * shard_numel(unit.adapter_params, shard_size) * c
    shard_spans = hardware.nodes > 1 and name != "HYBRID_SHARD"
    parts = [("all_gather", gathered, shard_size, shard_spans), ("reduce_scatter", reduced, shard_size, shard_spans)]
    if replicate_size > 1:
        parts.append(("all_reduce", sharded, replicate_size, True))
    return collectives(parts)
