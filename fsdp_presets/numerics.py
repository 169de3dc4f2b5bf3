"""The numerics of an optimizer step that training and the rehearsal share: AdamW's weight-decay
groups, the float64 gradient norm that keeps DDP, FSDP1 and FSDP2 clipping bit for bit alike, and
when gradients are reduced during accumulation.

Owned here, not in :mod:`fsdp_presets.train`, because :mod:`fsdp_presets.rehearse.rehearsal` rehearses
the same step and the plan package never imports the training package. Recipes and
:mod:`fsdp_presets.train` import the names from here.
"""

from __future__ import annotations

import contextlib
from typing import Any


def param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on weight matrices, none on norms, biases and embeddings (decaying them
    pulls scales and token vectors towards zero for no regularisation benefit; the usual practice
    of GPT-2/nanoGPT, torchtune and the Hugging Face Trainer)."""
    import torch

    no_decay: set[int] = set()
    for module in model.modules():
        is_norm = "norm" in type(module).__name__.lower()
        if isinstance(module, torch.nn.Embedding) or is_norm:
            no_decay.update(id(param) for param in module.parameters(recurse=False))
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            no_decay.add(id(param))
    decay, plain, seen = [], [], set()
    for param in model.parameters():  # a tied weight appears once
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (plain if id(param) in no_decay else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def scalar(value) -> float:
    """A tensor, DTensor (FSDP2's gradient norm) or number as a plain float."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value.item() if hasattr(value, "item") else value)


NORM_SLICE = 2**21
"""Gradient elements squared in float64 at a time by :func:`local_square_sums` (16 MiB)."""


def local_square_sums(model, fsdp1_groups: list = ()) -> tuple[list[tuple[Any, list]], list]:
    """The float64 sum of squares of every local gradient (a shard or a whole tensor), one sum per
    set of process groups holding the other shards of those gradients (a 0-dim tensor on the
    gradients' device, summed in the same order wherever it lives), and the gradients:
    ``([(sum, groups), ...], gradients)``. A float32 square is exact in float64, so the sums of two
    layouts of the same gradients differ by ~1e-16 relative (see :func:`clip_grad_norm`).
    ``fsdp1_groups``: the groups FSDP1's flat parameters are sharded over (none for DDP/FSDP2)."""
    import torch
    from torch.distributed.tensor import DTensor

    # key: (mesh or None, sharded mesh dims) -> [float64 sum of squares, process groups to reduce over]
    sums: dict = {("fsdp1",): [torch.zeros((), dtype=torch.float64), list(fsdp1_groups)]} if fsdp1_groups else {}
    gradients = []
    for param in model.parameters():  # a tied weight appears once
        grad = param.grad
        if grad is None:
            continue
        gradients.append(grad)
        if isinstance(grad, DTensor):
            # Sharded along a mesh dimension: neither replicated nor a pending sum. NOTE: FSDP2 over a TP
            # mesh shards on the TP dimension's dim 0 again as _StridedShard, whose is_shard() is False
            # (torch 2.13): read as replicated, the norm would leave out the other FSDP ranks' shards.
            shard_dims = tuple(dim for dim, placement in enumerate(grad.placements)
                               if not placement.is_replicate() and not placement.is_partial())
            key = (id(grad.device_mesh), shard_dims)
            groups = [grad.device_mesh.get_group(dim) for dim in shard_dims]
            local = grad.to_local()
        else:
            key, groups, local = (("fsdp1",), list(fsdp1_groups), grad) if fsdp1_groups else ((None,), [], grad)
        entry = sums.setdefault(key, [torch.zeros((), dtype=torch.float64), groups])
        # In slices: one float64 slice lives at a time (not a float64 copy of an 8B model's whole
        # embedding gradient and its square), and on CPU it stays below glibc's mmap threshold. The sum
        # stays on the gradients' device (a 0-dim CPU zero plus a GPU scalar is a GPU scalar): the host
        # waits once, for the total, not once per slice (an 8B model's shard on 8 GPUs has 500 slices).
        for piece in local.detach().reshape(-1).split(NORM_SLICE):
            wide = piece.to(torch.float64)
            entry[0] = entry[0] + torch.dot(wide, wide)
    return [(squares, groups) for squares, groups in sums.values()], gradients


EXACT_NORM_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP")
"""accelerate's distributed types whose gradient norm :func:`clip_grad_norm` computes itself."""


def clip_grad_norm(accelerator, model, max_norm: float) -> float:
    """Clip the gradients of a prepared model to ``max_norm`` (0: only measure) and return their
    global L2 norm, the same number, bit for bit, under DDP, FSDP1 and FSDP2.

    accelerate's ``clip_grad_norm_`` sums the squares in fp32 in an order that depends on the
    sharding (FSDP: per shard, then across ranks; DDP: per whole tensor), so the norms differ in
    the last bits, the clip coefficients too, and a clipped FSDP run drifts away from its DDP twin.
    Here every local gradient (a shard or a whole tensor) is squared and summed in float64 (a
    float32 or bfloat16 square is exact in float64), the sums are all-reduced over the ranks that
    hold the other shards, and the root is rounded to float32: the float64 totals of two layouts
    differ by ~1e-16 relative, far below float32's 6e-8 step, so the float32 norm, the coefficient
    ``max_norm / (norm + 1e-6)`` (torch's formula) and the clipped gradients are equal everywhere.
    For bfloat16 gradients (TRL trains QLoRA adapters in bfloat16) accelerate's norm, computed in
    the gradients' own dtype, differs between layouts by a whole bfloat16 step (2^-8 relative).
    Other distributed types (DeepSpeed, XLA) fall back to accelerate's own clipping.
    """
    import math

    import torch
    import torch.distributed as dist

    if accelerator.distributed_type.value not in EXACT_NORM_TYPES:
        return scalar(accelerator.clip_grad_norm_(model.parameters(), max_norm or float("inf")))
    accelerator.unscale_gradients()  # fp16: the loss scale comes off before measuring (accelerate does too)
    fsdp1_groups: list = []
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    if isinstance(model, FullyShardedDataParallel) and model.sharding_strategy != ShardingStrategy.NO_SHARD:
        fsdp1_groups = [model.process_group]  # flat parameters are sharded over this group
    sums, gradients = local_square_sums(model, fsdp1_groups)
    total = 0.0
    for squares, groups in sums:
        for group in groups:
            if dist.get_world_size(group) > 1:
                reduced = squares.to(accelerator.device)
                dist.all_reduce(reduced, group=group)
                squares = reduced.cpu()
        total += squares.item()
    norm = float(torch.tensor(math.sqrt(total), dtype=torch.float32))
    if max_norm and math.isfinite(max_norm):
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1.0 or not math.isfinite(norm):
            for grad in gradients:
                grad.mul_(coefficient)
    return norm


def gradient_sync(accelerator, model, *, last_micro_batch: bool, reduce_every_micro_batch: bool = False):
    """Reduce gradients only on the last micro-batch of an optimizer step (accelerate's
    ``no_sync``: DDP skips its all-reduce, FSDP2 its reduce-scatter, until then), or on every
    micro-batch with ``reduce_every_micro_batch``: under ``no_sync`` FSDP keeps an unsharded
    gradient of every parameter between micro-batches (a whole model's worth per GPU), which a
    large model cannot afford; reducing each time keeps only the shards, for more traffic."""
    if last_micro_batch or reduce_every_micro_batch:
        return contextlib.nullcontext()
    return accelerator.no_sync(model)
