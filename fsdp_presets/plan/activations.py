"""Activations at the peak of a training step: what one family's blocks keep for backward, as
rehearsed, and the logits' loss tensors ([Korthikanti]: sources in :mod:`fsdp_presets.plan.planner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

from fsdp_presets.model.model_profile import ModelProfile
from fsdp_presets.plan.shapes import TrainingShape

@dataclass(frozen=True, kw_only=True)
class BlockActivations:
    """What one family's blocks keep for backward, in bytes per token and per hidden unit with
    16-bit compute, measured by rehearsing a real training step (:mod:`fsdp_presets.rehearse.rehearsal`).
    Bytes of one block = coefficient x sequence x micro-batch x hidden size."""

    saved: float
    """One block without activation checkpointing."""
    checkpointed: float
    """One block under activation checkpointing (its input, and what the checkpoint keeps)."""
    outside: float
    """Outside the blocks (embedding output, final norm), once per model."""
    logits: float = 12
    """Bytes per logit element (sequence x micro-batch x vocabulary) at the loss's backward: see
    :data:`LOGITS_BYTES_AT_PEAK`; more where the model transforms its logits (Gemma 2's final
    soft-capping keeps its own copies)."""
    attention_scores: float = 0
    """Bytes per attention score (heads x sequence^2 x micro-batch) one block stores: non-zero for
    families whose attention is eager in transformers (Gemma 2's soft-capping), 0 for SDPA."""
    measured: str
    """The rehearsals that produced the numbers, and what they measured."""
    rehearsed_seq_len: int | None = None
    """Set for a model's own terms (:mod:`fsdp_presets.preset.measured_activations`): the sequence
    length they were rehearsed at (the block coefficient holds that length's attention terms)."""
    rehearsed_precision: str | None = None
    """With :attr:`rehearsed_seq_len`: the precision rehearsed."""
    in_block: float | None = None
    """Rehearsed, where a model peaks inside a block's backward (mixture-of-experts): bytes per
    token and hidden unit held there besides the other blocks' saved activations (that block's own
    activations and backward temporaries, what lives outside the blocks); None: not measured."""
    in_block_checkpointed: float | None = None
    """:attr:`in_block` under activation checkpointing (the block's recomputed activations
    included); None: not measured."""
    tail: float | None = None
    """Rehearsed: in the backward of the modules after the blocks (final norm, output head), bytes
    per token and hidden unit held besides the blocks' saved activations (the logits' loss tensors
    are freed by then); None: not measured (the planner then has no such moment)."""
    fixed_at_loss: int = 0
    """Rehearsed: bytes at the loss's backward that no micro-batch changes (besides the terms above)."""
    outside_checkpointed: float | None = None
    """Rehearsed: :attr:`outside` under activation checkpointing, measured apart, because without
    checkpointing :attr:`outside` also holds what the blocks unlike the repeated one save beyond it
    (DeepSeek's dense first layer saves less than a mixture-of-experts block), a difference a
    checkpointed block, which keeps only its input, does not have. May be negative (only its sum
    with :attr:`logits` is measured). None: :attr:`outside`."""
    fixed_at_loss_checkpointed: int = 0
    """With :attr:`outside_checkpointed`: :attr:`fixed_at_loss` under activation checkpointing."""
    fixed_in_block: int = 0
    """Rehearsed, with :attr:`in_block`: bytes in a block's backward that no micro-batch changes (an
    output head tied to the embedding keeps its gradient until the embedding's backward)."""
    fixed_in_block_checkpointed: int = 0
    """:attr:`fixed_in_block` under activation checkpointing."""
    fixed_in_tail: int = 0
    """Rehearsed, with :attr:`tail`: the same in the tail's backward."""
    tail_checkpointed: float | None = None
    """Rehearsed: :attr:`tail` under activation checkpointing (see :attr:`outside_checkpointed`);
    None: :attr:`tail`."""
    fixed_in_tail_checkpointed: int = 0
    """With :attr:`tail_checkpointed`: :attr:`fixed_in_tail` under activation checkpointing."""
    end: float | None = None
    """Rehearsed: at the end of backward (the input embedding's), bytes per token and hidden unit
    held besides the sharded state; None: not measured."""
    fixed_at_end: int = 0
    """With :attr:`end`: the bytes then that no micro-batch changes, gathered parameters and unsharded
    gradients included (an output head tied to the embedding: its gradient and the embedding's)."""
    tail_unsharded_params: int = 0
    """With :attr:`tail`: bytes of unsharded parameters then (the tail kept gathered, and its
    all-gather's copy), which no GPU count or micro-batch changes."""
    tail_unsharded_grads: int = 0
    """With :attr:`tail`: bytes of unsharded gradients then (the output head's, before its
    reduce-scatter)."""


_REHEARSED = "fsdp-presets rehearse model_configs/{model} --gpus 8 --seq-len {seq} (FULL_SHARD, bf16, micro-batch 1) "

BLOCK_ACTIVATIONS = MappingProxyType({
    # SwiGLU MLP (gate, up, their product and the SiLU: 8 bytes per intermediate unit), fp32
    # RMSNorm upcasts, rotary q/k copies: about 25.5 x h + 8 x intermediate per token and layer.
    "llama": BlockActivations(
        saved=54.03, checkpointed=2.0, outside=8.13,
        measured=_REHEARSED.format(model="llama-3.1-8b", seq=4096) + "with 32 and 2 layers: activations 29.10 and "
        "3.77 GiB at the loss's backward (25.33 GiB / 30 layers = 54.03 x s x h); under activation checkpointing "
        "3.10 and 2.16 GiB (2.0: each block keeps its bf16 input)"),
    "mistral": BlockActivations(
        saved=54.03, checkpointed=2.0, outside=8.13,
        measured=_REHEARSED.format(model="mistral-7b-v0.3", seq=4096) + "with 4 and 2 layers: activations 4.00 and "
        "2.32 GiB (Llama's block); checkpointed as Llama's (its own peak then moves into a block's backward)"),
    "qwen2": BlockActivations(
        saved=68.6, checkpointed=2.0, outside=8.14,
        measured=_REHEARSED.format(model="qwen2.5-7b", seq=4096) + "with 4 and 2 layers: activations 6.18 and "
        "4.31 GiB (a 5.3 x h MLP); under activation checkpointing 2.56 and 2.50 GiB"),
    "phi3": BlockActivations(
        saved=54.04, checkpointed=2.0, outside=8.13,
        measured=_REHEARSED.format(model="phi-3-mini-4k", seq=4096) + "with 4 and 2 layers: activations 3.12 and "
        "1.85 GiB; under activation checkpointing 0.69 and 0.65 GiB"),
    "gemma2": BlockActivations(
        saved=77.16, checkpointed=2.0, outside=8.13, logits=14.03, attention_scores=8.0,
        measured=_REHEARSED.format(model="gemma-2-9b", seq="4096 and 2048") + "with 4 and 2 layers: activations "
        "18.22 and 12.11 GiB at 4096, 7.11 and 5.05 GiB at 2048; per layer 77.16 x s x h plus 8 bytes per "
        "attention score (eager attention: soft-capping), the final logit soft-capping 2.03 bytes per logit "
        "more; under activation checkpointing 6.17 and 6.12 GiB at 4096"),
    "mixtral": BlockActivations(
        saved=90.0, checkpointed=2.0, outside=8.13,
        measured=_REHEARSED.format(model="mixtral-8x7b", seq=4096) + "with all 32 layers: peak 119.93 GiB in the "
        "last block's backward, activations and temporaries 45.84 GiB (the expert MLPs' routed copies); fitted to "
        "that run. Truncated models (2 and 4 layers) measure less per layer: expert routing under fake tensors is "
        "not data-dependent, so this is an estimate for other sizes"),
})
"""Per Hugging Face ``model_type``: measured by ``fsdp-presets rehearse`` (FSDP2 FULL_SHARD,
bf16, seq 4096, micro-batch 1) at two layer counts of the family's shipped config
(``model_configs/``): the difference per layer is ``saved``/``checkpointed``, the rest after the
logits is ``outside``. A family not listed uses the largest measured figures (cautious)."""

LOGITS_BYTES_AT_PEAK = 12
"""Bytes per logit element (sequence x micro-batch x vocabulary) at the peak, the backward of the
loss: the fp32 log-softmax that ``cross_entropy`` saved (4) and the two fp32 gradients its
backward computes from it (8). Measured: 8B at 8 GPUs, seq 4096: 1.96 GiB saved + 3.91 GiB of
temporaries for 525M logits. (The bf16 logits and their fp32 copy are freed by then.)"""


def rehearsed_terms(profile: ModelProfile, shape: TrainingShape | None) -> BlockActivations | None:
    """``shape.measured`` where it applies to this shape: the same sequence length and precision,
    fused attention, full fine-tuning."""
    measured = getattr(shape, "measured", None)
    if (measured is None or shape.lora is not None or shape.attention != "fused"
            or measured.rehearsed_seq_len != shape.seq_len or measured.rehearsed_precision != shape.precision):
        return None
    return measured


def activation_source(profile: ModelProfile, shape: TrainingShape) -> str:
    """How the activation terms of ``shape`` are obtained: ``composed from a rehearsal`` of this
    model, or ``estimated`` from the family constants (:data:`BLOCK_ACTIVATIONS`)."""
    if rehearsed_terms(profile, shape) is not None:
        return "composed from a rehearsal"
    return "estimated"


def block_activations(profile: ModelProfile, shape: TrainingShape | None = None) -> BlockActivations:
    """The model's own rehearsed terms for ``shape`` (:func:`rehearsed_terms`), else the
    family's measured :class:`BlockActivations`, else the largest measured ones."""
    own = rehearsed_terms(profile, shape)
    if own is not None:
        return own
    known = BLOCK_ACTIVATIONS.get(profile.model_type)
    if known is not None:
        return known
    return BlockActivations(
        saved=max(entry.saved for entry in BLOCK_ACTIVATIONS.values()),
        checkpointed=max(entry.checkpointed for entry in BLOCK_ACTIVATIONS.values()),
        outside=max(entry.outside for entry in BLOCK_ACTIVATIONS.values()),
        logits=LOGITS_BYTES_AT_PEAK,
        measured=f"no measurement for model_type {profile.model_type!r}: the largest of "
        f"{', '.join(sorted(BLOCK_ACTIVATIONS))}",
    )


def _tokens_hidden(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> float:
    """``s x b x h``, scaled by the compute width (fp32 activations are twice 16-bit ones)."""
    return shape.seq_len * micro_batch * profile.dims.hidden_size * shape.compute_bytes / 2


def activation_bytes_per_layer(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int:
    """One block's saved activations, without checkpointing: the family's measured coefficient
    (:data:`BLOCK_ACTIVATIONS`) x ``sbh``. With eager attention add the ``5as/h`` of
    [Korthikanti] Eq. 1 (the s x s scores, softmax and dropout mask), which fused attention
    (FlashAttention, Dao et al. 2022; PyTorch SDPA, as rehearsed) never stores.

    [Korthikanti] Eq. 1 gives 34 for a GPT layer (4h GELU MLP); a Llama block measures ~54
    (SwiGLU's three 3.5h-wide tensors, the fp32 upcast inside RMSNorm, rotary embeddings)."""
    s, a, h = shape.seq_len, profile.dims.num_attention_heads, profile.dims.hidden_size
    family = block_activations(profile, shape)
    coefficient = family.saved + (5 * a * s / h if shape.attention == "eager" and not family.attention_scores else 0)
    scores = family.attention_scores * a * s * s * micro_batch * shape.compute_bytes / 2
    return math.ceil(_tokens_hidden(profile, shape, micro_batch) * coefficient + scores)


def logits_bytes(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int:
    """Logits and the loss's fp32 tensors at the peak (:data:`LOGITS_BYTES_AT_PEAK` per element)."""
    per_element = block_activations(profile, shape).logits
    return math.ceil(shape.seq_len * micro_batch * profile.dims.vocab_size * per_element)


def activation_bytes(profile: ModelProfile, shape: TrainingShape, micro_batch: int | None = None) -> int:
    """Activations at the peak, the start of backward (the loss's backward): every block's saved
    activations (checkpointed blocks keep less, :class:`BlockActivations`), what is saved outside
    the blocks, and the logits with the loss's fp32 tensors.

    Under activation checkpointing the peak is still there: recomputing one block later in
    backward needs less than the logits' loss tensors free by then (measured for 8B and 70B)."""
    b = shape.micro_batch if micro_batch is None else micro_batch
    family = block_activations(profile, shape)
    per_block = family.checkpointed if shape.activation_checkpointing else family.saved
    tokens_hidden = _tokens_hidden(profile, shape, b)
    blocks = profile.dims.num_layers * (
        math.ceil(tokens_hidden * per_block) if shape.activation_checkpointing
        else activation_bytes_per_layer(profile, shape, b))
    outside, fixed = family.outside, family.fixed_at_loss
    if shape.activation_checkpointing and family.outside_checkpointed is not None:
        outside, fixed = family.outside_checkpointed, family.fixed_at_loss_checkpointed
    return max(0, blocks + math.ceil(tokens_hidden * outside) + logits_bytes(profile, shape, b) + fixed)



def in_block_activation_bytes(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int | None:
    """Activations and temporaries inside a block's backward, where rehearsed
    (:attr:`BlockActivations.in_block`): the other blocks' saved activations plus what that block
    holds. None where not measured (the planner then adds its estimate of the block's temporaries)."""
    family = block_activations(profile, shape)
    own = family.in_block_checkpointed if shape.activation_checkpointing else family.in_block
    if family.in_block is None or own is None:
        return None
    tokens_hidden = _tokens_hidden(profile, shape, micro_batch)
    return max(0, max(0, profile.dims.num_layers - 1) * saved_per_block(profile, shape, micro_batch)
               + math.ceil(tokens_hidden * own)
               + (family.fixed_in_block_checkpointed if shape.activation_checkpointing else family.fixed_in_block))


def last_block_activation_bytes(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int | None:
    """Activations and temporaries in the backward of the last blocks backward reaches, where
    rehearsed (:attr:`BlockActivations.in_block`): what that block holds (its recomputation under
    activation checkpointing, its backward's temporaries), no other block's saved activations left.
    Late in backward, beside nearly every gradient shard (rehearsed: DeepSeek-V2-Lite at 8 GPUs,
    micro-batch 2 under checkpointing, peaks there). None where not measured."""
    family = block_activations(profile, shape)
    own = family.in_block_checkpointed if shape.activation_checkpointing else family.in_block
    if family.in_block is None or own is None:
        return None
    return max(0, math.ceil(_tokens_hidden(profile, shape, micro_batch) * own)
               + (family.fixed_in_block_checkpointed if shape.activation_checkpointing else family.fixed_in_block))


def tail_activation_bytes(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int | None:
    """Activations and temporaries in the backward of the tail (final norm, output head), where
    rehearsed (:attr:`BlockActivations.tail`): every block's saved activations and what the
    rehearsal held besides them. None where not measured."""
    family = block_activations(profile, shape)
    if family.tail is None:
        return None
    tail, fixed = family.tail, family.fixed_in_tail
    if shape.activation_checkpointing and family.tail_checkpointed is not None:
        tail, fixed = family.tail_checkpointed, family.fixed_in_tail_checkpointed
    return max(0, profile.dims.num_layers * saved_per_block(profile, shape, micro_batch)
               + math.ceil(_tokens_hidden(profile, shape, micro_batch) * tail) + fixed)


def saved_per_block(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int:
    """One block's saved activations, checkpointed or not."""
    if shape.activation_checkpointing:
        return math.ceil(_tokens_hidden(profile, shape, micro_batch) * block_activations(profile, shape).checkpointed)
    return activation_bytes_per_layer(profile, shape, micro_batch)


def mlp_width(profile: ModelProfile) -> int:
    """Widest MLP tensor per token: the intermediate size, times the experts each token visits."""
    return profile.dims.intermediate_size * max(1, profile.dims.num_experts_per_token)


def end_bytes(profile: ModelProfile, shape: TrainingShape, micro_batch: int) -> int | None:
    """What the end of backward holds besides the sharded state, where rehearsed
    (:attr:`BlockActivations.end`); None where not measured."""
    family = block_activations(profile, shape)
    if family.end is None:
        return None
    return max(0, math.ceil(_tokens_hidden(profile, shape, micro_batch) * family.end) + family.fixed_at_end)
