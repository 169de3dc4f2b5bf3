"""Bytes each GPU sends per optimizer step, with ring collectives ([NCCL], [ZeRO] Sec. 7: sources
in :mod:`fsdp_presets.plan.planner`).
"""

from __future__ import annotations

from fsdp_presets.plan.model_state import fsdp_units, shard_numel
from fsdp_presets.model.model_profile import ModelProfile
from fsdp_presets.plan.results import CommBytes
from fsdp_presets.plan.shapes import Hardware, TrainingShape


def _ring(op: str, payload_bytes: int, group_size: int) -> int:
    """Bytes one rank sends for a collective over ``group_size`` ranks whose full (unsharded)
    buffer is ``payload_bytes`` [NCCL]: all-gather and reduce-scatter (n-1)/n, all-reduce 2(n-1)/n."""
    if group_size <= 1:
        return 0
    factor = 2 if op == "all_reduce" else 1
    return factor * payload_bytes * (group_size - 1) // group_size


def collectives(parts: list[tuple[str, int, int, bool]]) -> CommBytes:
    """Sum ``(op, payload_bytes, group_size, spans_nodes)`` collectives, split by link. A ring
    over a group that spans nodes crosses the network, and every rank's traffic then moves at
    the slowest link's speed, so all of it is counted as inter-node."""
    totals = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    intra = inter = 0
    for op, payload, group_size, spans_nodes in parts:
        sent = _ring(op, payload, group_size)
        totals[op] += sent
        if spans_nodes:
            inter += sent
        else:
            intra += sent
    return CommBytes(**totals, intra_node=intra, inter_node=inter)


def fsdp_comm(
    profile: ModelProfile, hardware: Hardware, shape: TrainingShape, name: str, fsdp_version: int
) -> CommBytes:
    """Per-step communication of an FSDP strategy.

    [ZeRO] Sec. 7.2.2: stage 3 all-gathers the parameters in forward and again in backward and
    reduce-scatters the gradients (3 x the parameters, 1.5 x DDP's 2 x). Units FSDP keeps
    unsharded after forward (root/tail) are not re-gathered in backward; SHARD_GRAD_OP keeps
    every unit, so it gathers once. Payloads include the padding of each unit to N shards.
    HYBRID_SHARD does this inside a node and all-reduces the gradient shards across nodes."""
    if name == "HYBRID_SHARD":
        shard_size, replicate_size = hardware.gpus_per_node, hardware.nodes
    else:
        shard_size, replicate_size = hardware.gpus, 1
    c = shape.compute_bytes  # all-gather in param_dtype, reduce in reduce_dtype (= param_dtype)
    gathered = reduced = sharded = 0
    for unit in fsdp_units(profile, fsdp_version):
        padded = unit.count * shard_numel(unit.params, shard_size) * shard_size
        regathered = unit.reshards_after_forward and name != "SHARD_GRAD_OP"
        gathered += padded * (2 if regathered else 1)
        reduced += padded
        sharded += unit.count * shard_numel(unit.params, shard_size)
    # The shard group spans nodes unless it is HYBRID_SHARD's node-local one; the replicate
    # group always does (one rank per node).
    shard_spans = hardware.nodes > 1 and name != "HYBRID_SHARD"
    parts = [
        ("all_gather", gathered * c, shard_size, shard_spans),
        ("reduce_scatter", reduced * c, shard_size, shard_spans),
    ]
    if replicate_size > 1:
        parts.append(("all_reduce", sharded * c, replicate_size, True))
    return collectives(parts)


