"""A device mesh of more than one dimension, as transformers' ``DistributedConfig`` lays it out::

    mesh = Mesh(tp=8)                                  # FSDP x TP; Mesh(ep=8): FSDP x EP (MoE)
    mesh.sizes(gpus=64, nodes=8, hybrid=False)         # {"fsdp_size": 8, "tp_size": 8, ...}
    mesh.problems(profile, gpus=64, gpus_per_node=8)   # [] or what the model or GPU count refuses

Dense parameters lie on ``(dp_replicate, fsdp, tp)``, routed experts on ``(dp_replicate, efsdp,
ep)`` with ``efsdp = fsdp x tp / ep`` (``transformers.distributed.utils.TransformersDeviceMesh``):
every rank holds ``1 / (fsdp x tp)`` of the dense parameters and ``1 / (efsdp x ep)`` of the experts
(within a replica under HSDP). The ranks of a TP group see the same batch; the data-parallel ranks
are ``dp_replicate x fsdp``. Standard library only (:func:`accelerate_tp_import_problem` imports
transformers when called).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_presets.schema import mesh_label


@dataclass(frozen=True)
class Mesh:
    """The sizes of the dimensions besides data-parallel sharding (1: unused)."""

    tp: int = 1
    """Tensor-parallel ranks (inside a node: each layer's matmuls are split over them)."""
    ep: int = 1
    """Expert-parallel ranks (each owns ``experts / ep`` routed experts whole)."""

    @property
    def is_nd(self) -> bool:
        return self.tp > 1 or self.ep > 1

    def fsdp_size(self, shard_world: int) -> int:
        """FSDP ranks of the dense parameters, for ``shard_world`` ranks sharding one copy."""
        return shard_world // self.tp

    def sizes(self, *, gpus: int, nodes: int = 1, hybrid: bool = False) -> dict[str, int]:
        """``DistributedConfig``'s sizes: one copy per node under HSDP (``hybrid``), else one
        over all GPUs."""
        replicas = nodes if hybrid else 1
        return {"dp_replicate_size": replicas, "fsdp_size": gpus // replicas // self.tp, "tp_size": self.tp,
                "ep_size": self.ep}

    def label(self, *, gpus: int, nodes: int = 1, hybrid: bool = False) -> str:
        """``FSDP 8 x TP 8``, ``HSDP 2 x FSDP 4 x TP 2``, ``FSDP 8 x EP 8`` (:func:`fsdp_presets.schema.mesh_label`)."""
        return mesh_label(self.sizes(gpus=gpus, nodes=nodes, hybrid=hybrid))

    def problems(self, parallel: dict, *, gpus: int, gpus_per_node: int, hybrid: bool = False,
                 nodes: int = 1) -> list[str]:
        """Why this mesh cannot run the model on ``gpus`` (empty when it can): ``parallel`` is the
        profile's ``structure["parallel"]`` (the plans and the sizes they allow)."""
        found = []
        if self.tp > 1:
            if not parallel.get("tp_plan"):
                found.append("the model ships no tensor-parallel plan (base_model_tp_plan)")
            elif self.tp not in parallel.get("tp_sizes", []):
                limits = ", ".join(f"{name} {value}" for name, value in parallel.get("tp_limits", {}).items())
                found.append(f"TP {self.tp} does not divide the model's {limits}")
            if self.tp > gpus_per_node:
                found.append(f"TP {self.tp} spans nodes of {gpus_per_node} GPUs (a TP group belongs inside a node)")
        if self.ep > 1:
            if not parallel.get("ep_plan"):
                found.append("the model ships no expert-parallel plan (base_model_ep_plan)")
            elif self.ep not in parallel.get("ep_sizes", []):
                found.append(f"EP {self.ep} does not divide the model's {parallel.get('ep_limits', {}).get('experts')} "
                             "experts")
            if self.ep % self.tp:
                found.append(f"EP {self.ep} is not a multiple of TP {self.tp}")
        shard_world = gpus // nodes if hybrid else gpus
        if shard_world % self.tp:
            found.append(f"TP {self.tp} does not divide the {shard_world} GPUs that shard one copy")
        elif self.ep > 1 and shard_world % self.ep:
            found.append(f"EP {self.ep} does not divide the {shard_world} GPUs that shard one copy")
        return found

    @staticmethod
    def setting_problems(*, method: str, precision: str | None) -> list[str]:
        """Why a TP/EP mesh is not planned or run for these settings (empty when it is): full
        fine-tuning only (transformers' TP/EP plans shard the base layers peft would wrap), and not
        fp16 (``DistributedConfig`` mixes bf16 parameters with fp32 reductions)."""
        found = []
        if method != "full":
            found.append(f"--method {method} with --tp/--ep: a mesh is planned for full fine-tuning")
        if precision == "fp16":
            found.append("--precision fp16 with --tp/--ep: transformers' DistributedConfig mixes bf16 "
                         "parameters with fp32 reductions; use bf16")
        return found


def accelerate_tp_import_problem() -> str | None:
    """Why accelerate cannot prepare an FSDP2 x TP model with the installed transformers, or None:
    tried, not looked up in a version table."""
    import importlib

    # NOTE: accelerate 1.16's Accelerator.prepare runs `from transformers.integrations.tensor_parallel
    # import ReplicateParallel` for FSDP2 with a TP mesh; the same lookup, made here.
    try:
        module = importlib.import_module("transformers.integrations.tensor_parallel")
    except ImportError as error:
        return str(error)
    if not hasattr(module, "ReplicateParallel"):
        return "cannot import name 'ReplicateParallel' from 'transformers.integrations.tensor_parallel'"
    return None


__all__ = ["Mesh", "accelerate_tp_import_problem"]
