"""What a second dimension changes in a plan: tensor parallelism (TP) inside a node and expert
parallelism (EP) for mixture-of-experts models, beside FSDP2 (and HSDP), as transformers'
``DistributedConfig`` lays them out (:mod:`fsdp_presets.rehearse.mesh`). Pure arithmetic::

    sliced = sliced_profile(profile, Mesh(tp=8))     # what one rank of a TP group holds and computes
    terms = estimated_mesh_terms(profile, shape, Mesh(tp=8))
    tensor_parallel_comm(profile, shape, Mesh(tp=8), micro_batches=4)   # bytes per GPU per step

- Model state: every rank holds ``1 / (fsdp x tp)`` of the dense parameters and ``1 / (efsdp x
  ep)`` of the experts: over the same ranks as FSDP alone, the same bytes.
- What FSDP gathers and what a rank computes is one TP rank's slice (:func:`sliced_profile`): what
  the model's TP plan covers (its projections, the vocabulary-split embedding and head) divided by
  ``tp``, a rank's ``experts / ep`` whole; norms, routers and experts the plan leaves out stay whole.
- Activations: measured by rehearsing the model on the mesh
  (:func:`fsdp_presets.preset.measured_activations.rehearsed_mesh_terms`); without a rehearsal,
  a share of a block's saved activations stays whole on every TP rank (:data:`WHOLE_SHARE`, after
  [Korthikanti] Eq. 2, no sequence parallel) and the rest divides by ``tp``; the logits are
  gathered whole (transformers' ``colwise_gather_output`` head).
- Communication ([Megatron] Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3): two all-reduces of
  ``s x b x h`` per block in forward and two in backward (two more where checkpointing recomputes
  the forward), on NVLink; the vocabulary-split embedding's all-reduce and the head's all-gather
  of the logits. EP: the routed tokens' all-to-all out and back, in forward and backward.
"""

from __future__ import annotations

import dataclasses

from fsdp_presets.errors import UsageError
from fsdp_presets.model.model_profile import ModelDims, ModelProfile, Unit
from fsdp_presets.plan.activations import block_activations
from fsdp_presets.plan.communication import collectives
from fsdp_presets.plan.results import CommBytes
from fsdp_presets.plan.shapes import Hardware
from fsdp_presets.rehearse.mesh import Mesh

WHOLE_SHARE = 0.31
"""Of a block's saved activations, the share TP leaves whole on every rank (no sequence parallel).
[Korthikanti] Eq. 2 gives 10 of 34 ``sbh`` (0.29) for a GPT layer; rehearsed, Llama-3.1-70B as
FSDP 8 x TP 8 at 2048 tokens (bf16) saves 21.4 ``sbh`` per block where FSDP alone saves 54: 16.7
of them whole (0.31), the rest divided by 8."""


def _expert_params_each(profile: ModelProfile) -> int:
    moe = profile.structure.get("moe") or {}
    layers = moe.get("moe_layers") or 0
    return moe.get("routed_expert_params", 0) // layers if layers else 0


def sliced_profile(profile: ModelProfile, mesh: Mesh) -> ModelProfile:
    """``profile`` as one rank of ``mesh`` sees it: of each block, the parameters the model's TP plan
    covers divided by ``tp`` (``structure["parallel"]["tp_block_params"]``; norms, routers and experts
    the plan leaves out stay whole), its routed experts by ``ep`` under expert parallelism (which
    takes them out of the TP plan); the vocabulary-split embedding and head by ``tp``; heads,
    key/value heads, the MLP width (where the plan splits the MLP) and the experts likewise."""
    t, e = mesh.tp, mesh.ep
    parallel = profile.structure.get("parallel") or {}
    experts_each = _expert_params_each(profile)
    tp_each = parallel.get("tp_block_params", 0) // max(profile.num_blocks, 1) if t > 1 else 0
    experts_split_by_tp = False
    units = []
    for unit in profile.units:
        experts = experts_each if unit.params_each >= experts_each > 0 else 0
        routed = experts if e > 1 else 0  # EP rules take the experts out of the TP plan
        covered = min(tp_each, unit.params_each - routed)
        experts_split_by_tp |= bool(experts) and e == 1 and covered > unit.params_each - experts
        units.append(Unit(cls=unit.cls, count=unit.count,
                          params_each=unit.params_each - covered - routed + -(-covered // t) + -(-routed // e)))
    covered_root = min(parallel.get("tp_root_params", 0), profile.root_params) if t > 1 else 0
    root = profile.root_params - covered_root + -(-covered_root // t)
    dims = profile.dims
    mlp_split = "MLP width" in (parallel.get("tp_limits") or {}) and not (e > 1 and dims.num_experts)
    sliced_dims = dataclasses.replace(
        dims, num_attention_heads=max(1, dims.num_attention_heads // t),
        num_key_value_heads=max(1, dims.num_key_value_heads // t),
        intermediate_size=max(1, dims.intermediate_size // (t if mlp_split else 1)),
        num_experts=dims.num_experts // e if dims.num_experts else 0,
        num_experts_per_token=min(dims.num_experts_per_token, dims.num_experts // e) if dims.num_experts else 0)
    structure = dict(profile.structure)
    moe = structure.get("moe")
    if moe:
        divisor = e if e > 1 else (t if experts_split_by_tp else 1)
        structure["moe"] = {**moe, "routed_expert_params": moe["routed_expert_params"] // divisor,
                            "num_experts": max(1, moe["num_experts"] // e)}
    share = root / profile.root_params if profile.root_params else 1.0
    embeddings = [{**entry, "params": int(int(entry.get("params", 0)) * share)} for entry in profile.embeddings]
    return ModelProfile(model_type=profile.model_type, architecture=profile.architecture,
                        total_params=sum(unit.count * unit.params_each for unit in units) + root, units=units,
                        wrap_classes=list(profile.wrap_classes), embeddings=embeddings,
                        norm_classes=list(profile.norm_classes), output_head=profile.output_head,
                        tied_embeddings=profile.tied_embeddings, dims=ModelDims(**dataclasses.asdict(sliced_dims)),
                        structure=structure)


def estimated_mesh_terms(profile: ModelProfile, shape, mesh: Mesh):
    """Activation terms for ``mesh`` without a rehearsal on it: the model's (or its family's) terms
    with the share of a block's saved activations TP divides divided by ``tp`` (module notes);
    the moments only a rehearsal measures are left out, so the planner composes them."""
    base = block_activations(profile, shape)
    t = mesh.tp
    share = WHOLE_SHARE + (1 - WHOLE_SHARE) / t
    return type(base)(saved=base.saved * share, checkpointed=base.checkpointed, outside=base.outside,
                      logits=base.logits, attention_scores=base.attention_scores / t,
                      measured=f"estimated for {mesh_text(mesh)}: a block's saved activations x {share:.2f} "
                               f"(a share kept whole on every TP rank) of {base.measured.split(':')[0]}",
                      rehearsed_seq_len=shape.seq_len, rehearsed_precision=shape.precision)


def mesh_text(mesh: Mesh) -> str:
    return " x ".join(part for part in (f"TP {mesh.tp}" if mesh.tp > 1 else "",
                                        f"EP {mesh.ep}" if mesh.ep > 1 else "") if part)


def tensor_parallel_comm(profile: ModelProfile, shape, mesh: Mesh, micro_batches: int) -> CommBytes:
    """Bytes one GPU sends per optimizer step for ``mesh``'s TP and EP collectives (module notes),
    all inside a node."""
    dims = profile.dims
    c = shape.compute_bytes
    tokens = shape.seq_len * shape.micro_batch
    parts = []
    if mesh.tp > 1:
        per_block = 4 + (2 if shape.activation_checkpointing else 0)
        activation = tokens * dims.hidden_size * c
        parts.append(("all_reduce", activation * (per_block * dims.num_layers + 1) * micro_batches, mesh.tp, False))
        parts.append(("all_gather", tokens * dims.vocab_size * c * micro_batches, mesh.tp, False))
    if mesh.ep > 1 and dims.num_experts:
        moe_layers = (profile.structure.get("moe") or {}).get("moe_layers", dims.num_layers)
        routed = tokens * dims.num_experts_per_token * dims.hidden_size * c // mesh.tp
        exchanges = 4 + (2 if shape.activation_checkpointing else 0)
        # an all-to-all sends (n-1)/n of its buffer, as an all-gather does
        parts.append(("all_gather", routed * exchanges * moe_layers * micro_batches, mesh.ep, False))
    return collectives(parts)


def collectives_per_step(profile: ModelProfile, shape, mesh: Mesh, micro_batches: int) -> int:
    """How many TP/EP collectives one step runs (each pays a ring's latency)."""
    count = 0
    if mesh.tp > 1:
        count += ((4 + (2 if shape.activation_checkpointing else 0)) * profile.dims.num_layers + 2) * micro_batches
    if mesh.ep > 1:
        moe_layers = (profile.structure.get("moe") or {}).get("moe_layers", profile.dims.num_layers)
        count += (4 + (2 if shape.activation_checkpointing else 0)) * moe_layers * micro_batches
    return count


def meshes_for(profile: ModelProfile, hardware: Hardware, shape, *, tp: int | None = None,
               ep: int | None = None) -> tuple[Mesh, ...]:
    """The TP/EP meshes a plan considers: the one asked (``--tp``/``--ep``, refused with why where
    the model or the GPUs cannot run it), or else each TP size of 2, 4 and 8 the model allows inside a
    node, and for a mixture-of-experts model each EP size the model and the GPUs allow up to a node;
    none for a ``shape`` a mesh is not planned for (LoRA/QLoRA, fp16: :meth:`Mesh.setting_problems`)."""
    parallel = profile.structure.get("parallel") or {}
    refused = Mesh.setting_problems(method=shape.method, precision=shape.precision)
    if refused and (tp or ep):
        raise UsageError("; ".join(refused))
    if refused:
        return ()
    if tp or ep:
        mesh = Mesh(tp=tp or 1, ep=ep or 1)
        problems = mesh.problems(parallel, gpus=hardware.gpus, gpus_per_node=hardware.gpus_per_node)
        if problems:
            raise UsageError(f"{mesh.label(gpus=hardware.gpus) if not hardware.gpus % (tp or 1) else 'the mesh'}: "
                             f"{'; '.join(problems)} (`fsdp-presets inspect MODEL` lists the sizes the model allows)")
        return (mesh,) if mesh.is_nd else ()
    meshes = [Mesh(tp=size) for size in parallel.get("tp_sizes", []) if size in (2, 4, 8)]
    meshes += [Mesh(ep=size) for size in parallel.get("ep_sizes", []) if 1 < size <= 8]
    return tuple(mesh for mesh in meshes
                 if not mesh.problems(parallel, gpus=hardware.gpus, gpus_per_node=hardware.gpus_per_node)
                 and hardware.gpus > max(mesh.tp, 1))


__all__ = ["collectives_per_step", "estimated_mesh_terms", "mesh_text", "meshes_for", "sliced_profile",
           "tensor_parallel_comm"]
