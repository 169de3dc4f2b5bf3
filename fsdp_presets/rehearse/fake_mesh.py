"""A model on fake tensors, and the same model sharded over a fake FSDP x TP (x EP) mesh by
transformers' own code, for the rehearsal (:mod:`fsdp_presets.rehearse.rehearsal`)::

    with fake_transformers_mesh({"fsdp_size": 8, "tp_size": 8, "ep_size": 1, "dp_replicate_size": 1},
                                world_size=64, mixed_precision=True) as fake:
        model, optimizer = fake.prepare_model(config)
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass


def fake_model(config, fake_mode, *, trust_remote_code: bool = False, untied: bool = False):
    """The model of ``config`` (its transformers class, fp32 parameters) on fake tensors of
    ``fake_mode``; ``untied``: tied tensors get one each (as ``from_pretrained`` builds a model
    before it loads the weights and ties them)."""
    from fsdp_presets.model.model_loading import build_meta_model

    import torch

    meta = build_meta_model(config, trust_remote_code=trust_remote_code)
    # Fake CPU tensors of the same shapes (allocating them costs nothing), put in place one by
    # one: Module.to_empty cannot swap a meta tensor for a fake one. Tied tensors stay tied.
    replaced: dict[int, torch.Tensor] = {}
    with fake_mode:
        for module in meta.modules():
            for kind in ("_parameters", "_buffers"):
                tensors = getattr(module, kind)
                for name, tensor in list(tensors.items()):
                    if tensor is None:
                        continue
                    if id(tensor) not in replaced or untied:
                        dtype = torch.float32 if tensor.is_floating_point() and kind == "_parameters" else tensor.dtype
                        fake = torch.empty(tensor.shape, dtype=dtype, device="cpu")
                        if kind == "_parameters":
                            fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
                        replaced[id(tensor)] = fake
                    tensors[name] = replaced[id(tensor)]
    return meta


@dataclass(kw_only=True)
class FakeMesh:
    """What :func:`fake_transformers_mesh` yields: transformers' ``DistributedConfig`` and device
    meshes on rank 0 of a fake process group, and the ``FakeTensorMode`` the model lives in."""

    distributed_config: object
    """``transformers.DistributedConfig`` of the mesh's sizes."""
    mesh_manager: object
    """transformers' dense and expert meshes (``TransformersDeviceMesh``)."""
    fake_mode: object
    world_size: int

    def prepare_model(self, config, *, trust_remote_code: bool = False, activation_checkpointing: bool = False,
                      learning_rate: float = 1e-5, weight_decay: float = 0.0):
        """``(model, AdamW)``: the model sharded by transformers' own code for its
        ``DistributedConfig`` (``maybe_distribute_model``: TP, EP, then FSDP2 by the model's
        ``_fsdp_plan``), as ``from_pretrained(..., distributed_config=...)`` shards it before loading
        weights."""
        import torch

        from fsdp_presets.numerics import param_groups

        model = fake_model(config, self.fake_mode, trust_remote_code=trust_remote_code, untied=True)
        if activation_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        # Outside the fake mode: fully_shard concatenates the TP and FSDP meshes, which reads rank
        # lists (tolist); the parameters are fake tensors already, so what it allocates is fake.
        model = type(model).maybe_distribute_model(model, self.distributed_config, self.mesh_manager)
        model.tie_weights()  # as from_pretrained does once the weights are loaded
        with self.fake_mode:
            optimizer = torch.optim.AdamW(param_groups(model, weight_decay), lr=learning_rate, betas=(0.9, 0.95),
                                          foreach=True)
        return model, optimizer


@contextlib.contextmanager
def fake_transformers_mesh(sizes: dict[str, int], *, world_size: int, mixed_precision: bool):
    """transformers' ``DistributedConfig(**sizes)`` and its meshes as rank 0 of ``world_size``
    ranks would build them, over a fake process group: shard a model of any size over FSDP x TP
    (x EP) through transformers' own code without weights, GPUs or other processes. Routed
    tokens are spread evenly over the expert-parallel ranks (:func:`_balanced_expert_dispatch`):
    a fake tensor holds no router scores to route by. Restored on exit."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh

    if dist.is_initialized():
        raise RuntimeError("fake_transformers_mesh needs a process without a process group")
    saved_env = dict(os.environ)
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    restore_dispatch = _balanced_expert_dispatch()
    try:
        distributed_config = DistributedConfig(**sizes, fsdp_mixed_precision=mixed_precision)
        _, mesh_manager = initialize_distributed_mesh(distributed_config)
        yield FakeMesh(distributed_config=distributed_config, mesh_manager=mesh_manager,
                       fake_mode=FakeTensorMode(allow_non_fake_inputs=True), world_size=world_size)
    finally:
        restore_dispatch()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)


def _balanced_expert_dispatch():
    """transformers' all-to-all expert dispatch reads how many tokens go to each rank back to the
    host (``tolist``), which a fake tensor cannot answer. For the rehearsal every rank sends and
    receives an even share of its (token, expert) pairs, the experts an even share of what arrives:
    the tensors of the real exchange (sorted tokens, received rows, their expert ids and weights),
    sized for balanced routing. The combine step is transformers' own. Returns the restorer."""
    import torch
    from transformers.distributed import expert_parallel

    original = expert_parallel.AllToAllEP._dispatch_tokens

    def even(total: int, parts: int) -> list[int]:
        return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]

    def dispatch(self, hidden_states, top_k_index, top_k_weights):
        num_tokens = hidden_states.size(0)
        if self.tp_mesh.size() > 1:  # this rank's slice of the batch its TP group shares
            rows = -(-num_tokens // self.tp_mesh.size())
            hidden_states, top_k_index, top_k_weights = (t[:rows] for t in (hidden_states, top_k_index, top_k_weights))
        ep_size, top_k = self.ep_mesh.size(), top_k_index.size(-1)
        order = torch.argsort(top_k_index.reshape(-1))
        send_tokens = hidden_states[order // top_k]
        sizes = even(order.numel(), ep_size)
        received = expert_parallel.all_to_all_single_autograd(send_tokens, sizes, sizes, self.ep_mesh.get_group())
        expert_ids = torch.cat([torch.full((count,), expert, dtype=torch.long, device=hidden_states.device)
                                for expert, count in enumerate(even(sum(sizes), self.num_local_experts))])
        weights = torch.ones((sum(sizes), 1), dtype=received.dtype, device=received.device)
        state = expert_parallel._AllToAllState(top_k_weights, order, sizes, sizes, num_tokens)
        return received, expert_ids.unsqueeze(-1), weights, state

    expert_parallel.AllToAllEP._dispatch_tokens = dispatch

    def restore() -> None:
        expert_parallel.AllToAllEP._dispatch_tokens = original

    return restore


__all__ = ["FakeMesh", "fake_model", "fake_transformers_mesh"]
