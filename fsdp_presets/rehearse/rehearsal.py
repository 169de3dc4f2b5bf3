"""Rehearse one real FSDP2 training step at full size on the CPU: fake tensors, a fake process
group, torch's FSDP memory tracker, and accelerate's own preparation::

    with fake_accelerate(env, world_size=8) as fake:            # reusable on its own
        model, optimizer = fake.prepare_model(config)           # accelerate's fsdp2_prepare_model
    result = rehearse(config, env, world_size=8, seq_len=4096, micro_batch=1, grad_accum=1)
    result.peak_bytes, result.peak_by_category, result.peak_where

What is real: the model's own architecture (its transformers class built from the config), the
shapes and dtypes of every tensor, accelerate's FSDP2 preparation (``fully_shard`` of the blocks,
the embedding and the tail, mixed-precision policy, activation checkpointing), the causal-LM
recipe's loss (``logits[:, :-1].float()``, summed cross entropy), its ``no_sync`` gradient
accumulation, gradient clipping summed in float64, and AdamW's ``step``/``zero_grad``. Every
allocation is counted by ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` on rank 0
of a process group of ``world_size`` ranks (backend ``fake``: collectives are no-ops that return
tensors of the right shape). Nothing holds data: ``FakeTensorMode`` tensors carry shape, dtype
and device only, so 70B at 64 ranks fits in well under 1 GiB of host RAM.

What it cannot see (it runs CPU kernels on a CPU-only torch build; CUDA cannot be faked there):
the CUDA caching allocator's rounding and fragmentation, the CUDA context, NCCL and cuBLAS
workspaces, and CUDA-only kernels (FlashAttention's workspace; the CPU's fused SDPA stores the
same (b, heads, s) log-sum-exp). The planner keeps a reserve for these
(:data:`fsdp_presets.plan.shapes.DEFAULT_RESERVED_BYTES` and its allocator margin).

For another tool that needs accelerate's real FSDP2 wrapping of a model without weights or GPUs
(e.g. to prove a config's units): :func:`fake_accelerate` and :meth:`FakeAccelerate.prepare_model`
are the public part, usable on their own (one at a time per process; everything is restored on
exit). The step itself runs CPU kernels on fake tensors; AdamW is built with ``foreach=True``
(torch's default for CUDA tensors) so its temporaries are the GPU's.

Three obstacles, measured with torch 2.13 and accelerate 1.16, and how they are handled here:

- the device mesh cannot be built inside ``FakeTensorMode`` (``init_device_mesh`` reads rank
  lists with ``tolist()``): it is built before, and ``fully_shard``'s default mesh is that one;
- DTensor's sharding propagation runs its shape inference in the *outer* fake mode, so the
  tracker would count its full-size placeholder tensors (94 GiB of phantom optimizer state for
  8B): allocations made inside ``ShardingPropagator._propagate_tensor_meta_non_cached`` are not
  counted (:class:`_RehearsalTracker`);
- accelerate matches the optimizer's parameters to the sharded ones by ``data_ptr()``, which is 0
  for every fake tensor (AdamW would keep state for one parameter): fake tensors are matched by
  identity, as accelerate does for meta tensors.

And one shortcut: ``optimizer.step()`` runs AdamW's foreach kernels on each parameter's local shard
(:func:`_on_local_shards`). When every gradient has its parameter's placements, that is exactly what
DTensor's dispatch runs (the same local ops, the same allocations; the moments are the local
tensors a DTensor would wrap), without DTensor's per-element sharding propagation of each foreach
list, which in this torch is quadratic in the number of tensors (a 70B rehearsal on FSDP x TP 8:
25 s of CPU before, 15 s with it).
A step whose gradients are placed otherwise runs through DTensor as written.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from dataclasses import dataclass, field


# Settings a fake run switches off: each moves weights between ranks or devices, not memory on the
# GPU during a step (RAM-efficient loading broadcasts rank 0's weights; module-state sync too);
# offload is off because the CPU host has no separate device to offload from.
FAKE_RUN_OVERRIDES = {
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
    "FSDP_SYNC_MODULE_STATES": "false",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
}
"""Environment a fake preparation overrides (see :func:`fake_accelerate`)."""


# --------------------------------------------------------------------------- fake accelerate


@dataclass(kw_only=True)
class FakeAccelerate:
    """What :func:`fake_accelerate` yields: an ``Accelerator`` on rank 0 of a fake process group,
    and the ``FakeTensorMode`` its model lives in."""

    accelerator: object
    """``accelerate.Accelerator`` built from the launch environment."""
    fake_mode: object
    """The ``torch._subclasses.FakeTensorMode`` every model tensor belongs to."""
    world_size: int
    """Ranks of the fake process group."""

    def build_model(self, config, *, trust_remote_code: bool = False):
        """The model of ``config`` (its transformers class, fp32 parameters) on fake tensors."""
        from fsdp_presets.rehearse.fake_mesh import fake_model

        return fake_model(config, self.fake_mode, trust_remote_code=trust_remote_code)

    def prepare_model(self, config, *, trust_remote_code: bool = False, learning_rate: float = 1e-5,
                      weight_decay: float = 0.0):
        """``(prepared model, AdamW)`` through ``Accelerator.prepare``, as the recipes call it."""
        import torch

        from fsdp_presets.numerics import param_groups

        model = self.build_model(config, trust_remote_code=trust_remote_code)
        with self.fake_mode:
            # foreach=True: what torch.optim picks by default for CUDA tensors (and so in the recipes
            # on GPUs), with its per-group temporaries; on CPU tensors the default is a per-tensor loop.
            optimizer = torch.optim.AdamW(param_groups(model, weight_decay), lr=learning_rate,
                                          betas=(0.9, 0.95), foreach=True)
            model, optimizer = self.accelerator.prepare(model, optimizer)
        return model, optimizer


@contextlib.contextmanager
def fake_accelerate(env: dict[str, str], *, world_size: int):
    """An ``Accelerator`` as rank 0 of ``world_size`` ranks would build it under ``accelerate
    launch``, with a fake process group and a fake-tensor mode for the model: prepare a model of
    any size through accelerate's own FSDP code without weights, GPUs or other processes.

    ``env``: the variables ``accelerate launch`` sets for the training processes (``FSDP_*``,
    ``ACCELERATE_*``, ``PARALLELISM_CONFIG_*``), e.g. ``fsdp_presets.check.lint.accelerate_view(path).env``.
    :data:`FAKE_RUN_OVERRIDES` are applied on top. Everything is restored on exit: the process
    group is destroyed, accelerate's shared state reset and ``os.environ`` put back, so it can be
    used more than once in one process (one at a time).
    """
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_presets.cpu_fsdp import enable_cpu_fsdp
    from fsdp_presets.schema import ACCELERATE_ENV_PREFIXES

    if dist.is_initialized():
        raise RuntimeError("fake_accelerate needs a process without a process group")
    saved_env = dict(os.environ)
    os.environ.update({key: value for key, value in env.items() if key.startswith(ACCELERATE_ENV_PREFIXES)})
    os.environ.update(FAKE_RUN_OVERRIDES)
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    # The fake group exists before accelerate looks: its PartialState then uses it.
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    restore_mesh = _default_mesh_built_outside_fake_mode(world_size)
    restore_ids = _fake_parameters_keep_their_identity()
    try:
        if enable_cpu_fsdp():
            # What enable_cpu_fsdp() sets once per process; restored away by an earlier use.
            os.environ.setdefault("ACCELERATE_USE_CPU", "true")
            os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
        from accelerate import Accelerator

        accelerator = Accelerator()
        yield FakeAccelerate(accelerator=accelerator, fake_mode=FakeTensorMode(allow_non_fake_inputs=True),
                             world_size=world_size)
    finally:
        restore_ids()
        restore_mesh()
        from accelerate.state import AcceleratorState, GradientState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        PartialState._reset_state()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)


def _default_mesh_built_outside_fake_mode(world_size: int):
    """``fully_shard`` builds its default mesh when accelerate passes none (no parallelism
    config), and ``init_device_mesh`` cannot run under FakeTensorMode: build it now, hand that one
    out. Returns the function that restores torch's own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard import _fully_shard as fully_shard_module

    mesh = init_device_mesh("cpu", (world_size,))
    original = fully_shard_module._init_default_mesh
    fully_shard_module._init_default_mesh = lambda *args, **kwargs: mesh

    def restore() -> None:
        fully_shard_module._init_default_mesh = original

    return restore


def _fake_parameters_keep_their_identity():
    """accelerate matches the optimizer's parameters to the sharded ones by ``data_ptr()``
    (``accelerate.utils.modeling._get_parameter_id``), which every fake tensor answers with 0:
    all would map to one parameter and AdamW would keep state for that one only. Fake tensors
    are keyed by identity instead, as accelerate itself does for meta tensors. Returns the
    function that restores accelerate's own."""
    import accelerate.accelerator as accelerator_module
    from torch._subclasses.fake_tensor import FakeTensor

    original = accelerator_module._get_parameter_id

    def parameter_id(param):
        return id(param) if isinstance(param, FakeTensor) else original(param)

    accelerator_module._get_parameter_id = parameter_id

    def restore() -> None:
        accelerator_module._get_parameter_id = original

    return restore


# --------------------------------------------------------------------------- the tracker

_propagating = threading.local()


def _exclude_sharding_propagation():
    """Mark DTensor's shape inference so the tracker skips what it allocates (module notes)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def marked(self, op_schema):
        depth = getattr(_propagating, "depth", 0)
        _propagating.depth = depth + 1
        try:
            return original(self, op_schema)
        finally:
            _propagating.depth = depth

    ShardingPropagator._propagate_tensor_meta_non_cached = marked

    def restore() -> None:
        ShardingPropagator._propagate_tensor_meta_non_cached = original

    return restore


def _tracker_class():
    from copy import deepcopy

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    class _RehearsalTracker(FSDPMemTracker):
        """``FSDPMemTracker`` that does not count DTensor's sharding-propagation placeholders,
        remembers which module and pass were running when the peak was reached, and keeps only
        the rank's peak (not each module's)."""

        peak_where = ""
        root_name = ""
        block_names: tuple[str, ...] = ()
        embedding_name = ""
        moment = ""
        moments: dict[str, tuple[int, dict]] = {}

        def _update_peak_stats(self, peak_state) -> None:
            # torch's version also walks every module tracked so far, on every op, to keep each
            # module's own peak: for an 80-block model most of the rehearsal's time, and nothing
            # here reads those peaks. The rank's peak is updated exactly as torch updates it.
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[_TOTAL_KEY]
                    self._peak_mem_snap[device] = deepcopy(snapshot)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(_propagating, "depth", 0):
                return func(*args, **(kwargs or {}))
            before = dict(self._peak_mem)
            result = super().__torch_dispatch__(func, types, args, kwargs)
            if self._peak_mem != before:
                parents = [name for name in self._mod_tracker.parents if name != "Global"]
                phase = "optimizer step" if self._in_opt else ("backward" if self._mod_tracker.is_bw else "forward")
                self.peak_where = f"{phase}, in {parents[-1] if parents else 'the top level'} ({func})"
            if self.root_name and not self._in_opt:
                self._remember_moment()
            return result

        def _remember_moment(self) -> None:
            """Each moment of backward (:data:`MOMENTS`) where what it holds besides the sharded state
            is highest. Backward goes through them in order; a forward through the input embedding
            starts again (the recomputation under activation checkpointing never runs it)."""
            parents = [name for name in self._mod_tracker.parents if name not in ("Global", self.root_name)]
            in_embedding = bool(self.embedding_name) and any(name.startswith(self.embedding_name) for name in parents)
            if not self._mod_tracker.is_bw:  # forward, or a block's recomputation inside backward
                if in_embedding:
                    self.moment = ""
                if not self.moment:
                    return
            else:
                order = tuple(MOMENTS)
                reached = "embedding" if in_embedding else "block" if any(
                    name.startswith(self.block_names) for name in parents) else "tail" if parents else "loss"
                if not self.moment or order.index(reached) > order.index(self.moment):
                    self.moment = reached
            for snap in self._curr_mem_snap.values():
                held = sum(count for reftype, count in snap.items() if reftype != "Total" and
                           CATEGORIES.get(str(getattr(reftype, "value", reftype))) not in _SHARDED_STATE)
                if held > self.moments.get(self.moment, (-1, None))[0]:
                    self.moments[self.moment] = (held, dict(snap))

    return _RehearsalTracker


# --------------------------------------------------------------------------- the step


CATEGORIES = {
    # FSDPMemTracker reference type -> the category shown (and the planner's field it compares with)
    "Sharded Param": "params",
    "Sharded Grad": "grads",
    "OptState": "optimizer",
    "Activation": "activations",
    "Unsharded Param": "unsharded params",
    "All Gather": "unsharded params",
    "Unsharded Grad": "unsharded grads",
    "Reduce Scatter": "unsharded grads",
    "Temp": "temporaries",
    "Buffer": "temporaries",
    "Inputs": "temporaries",
}
"""How the tracker's categories are shown."""
_SHARDED_STATE = ("params", "grads", "optimizer")

MOMENTS = {
    "loss": "the loss's backward, before any module's (the logits' fp32 loss tensors live)",
    "tail": "the backward of the modules after the blocks (final norm, output head), before any block's",
    "block": "a block's backward (the blocks are the FSDP units that hold modules of their own)",
    "embedding": "the input embedding's backward, the end of backward",
}
"""The moments of backward :attr:`Rehearsal.moments` holds, each where it holds the most besides the
sharded state."""


@dataclass(frozen=True, kw_only=True)
class Rehearsal:
    """What one rank held at its peak during the rehearsed steps."""

    peak_bytes: int
    """Highest total of live tensor bytes on rank 0."""
    peak_by_category: dict[str, int]
    """That peak, split as :data:`CATEGORIES` names."""
    peak_where: str
    """Pass and module when the peak was reached (``backward, in model.lm_head (...)``)."""
    iterations: int
    """Optimizer steps rehearsed."""
    seconds: float
    """Wall time of preparation and steps."""
    units: int = 0
    """FSDP units accelerate built."""
    notes: list[str] = field(default_factory=list)
    moments: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per moment of backward (:data:`MOMENTS`), what rank 0 held where it held the most besides
    its sharded state, split as :attr:`peak_by_category` is."""

    def to_json(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "peak_by_category": dict(self.peak_by_category),
                "peak_where": self.peak_where, "iterations": self.iterations, "seconds": round(self.seconds, 1),
                "fsdp_units": self.units, "notes": list(self.notes)}


def causal_lm_summed_loss(model, input_ids, labels):
    """The causal-LM recipe's loss (``recipes/causal_lm.py::summed_loss``): logits without a KV
    cache, the shifted slice upcast to fp32, summed cross entropy."""
    import torch.nn.functional as F

    logits = model(input_ids=input_ids, use_cache=False).logits
    shifted_logits = logits[:, :-1, :].float()
    shifted_labels = labels[:, 1:]
    return F.cross_entropy(shifted_logits.reshape(-1, shifted_logits.size(-1)), shifted_labels.reshape(-1),
                           ignore_index=-100, reduction="sum")


def _clip_like_training(model, max_norm: float) -> None:
    """:func:`fsdp_presets.numerics.clip_grad_norm`'s tensors (its float64 squares of every local
    gradient, one coefficient applied in place) without the all-reduce and the ``.item()``, which
    fake tensors cannot answer: the memory is the same, the value is not needed."""
    import torch
    from torch.distributed.tensor import DTensor

    from fsdp_presets.numerics import local_square_sums

    sums, gradients = local_square_sums(model)
    total = sum((squares for squares, _ in sums), torch.zeros((), dtype=torch.float64))
    coefficient = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0).to(torch.float32)
    for grad in gradients:
        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(coefficient)


REHEARSED_MICRO_BATCHES = 2
"""Micro-batches rehearsed per optimizer step when more are accumulated. From the second on, each
micro-batch of a step holds what the second holds (gradients accumulated so far have their full
size after the first), so a longer accumulation has the same peak; only the last one differs
(it reduces), and the second of two is the last."""


def rehearse(config, env: dict[str, str], *, world_size: int, seq_len: int, micro_batch: int = 1,
             grad_accum: int = 1, reduce_every_micro_batch: bool = False, iterations: int = 2,
             trust_remote_code: bool = False, mesh_sizes: dict[str, int] | None = None) -> Rehearsal:
    """Rehearse ``iterations`` optimizer steps, the last of ``grad_accum`` micro-batches (at most
    :data:`REHEARSED_MICRO_BATCHES`, which have the same peak) as ``recipes/causal_lm.py`` runs
    them, the ones before it on zero gradients (they create the optimizer state that training holds
    from its second step on), and return rank 0's peak in the last (see the module notes).
    ``reduce_every_micro_batch``: reduce gradients after every micro-batch instead of accumulating
    them unsharded under ``no_sync``.
    ``mesh_sizes``: ``DistributedConfig``'s sizes (``fsdp_size``, ``tp_size``, ``ep_size``,
    ``dp_replicate_size``; :meth:`fsdp_presets.rehearse.mesh.Mesh.sizes`) to shard the model with
    transformers' own code on that mesh
    (:func:`fsdp_presets.rehearse.fake_mesh.fake_transformers_mesh`) instead of accelerate's FSDP2
    preparation; ``env`` then gives the precision and activation checkpointing only."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from fsdp_presets.numerics import gradient_sync

    started = time.perf_counter()
    micro_batches = min(grad_accum, REHEARSED_MICRO_BATCHES)
    restore_propagation = _exclude_sharding_propagation()
    try:
        if mesh_sizes is None:
            preparation = fake_accelerate(env, world_size=world_size)
        else:
            from fsdp_presets.rehearse.fake_mesh import fake_transformers_mesh

            preparation = fake_transformers_mesh(
                mesh_sizes, world_size=world_size,
                mixed_precision=env.get("ACCELERATE_MIXED_PRECISION", "no") in ("bf16", "fp16"))
        with preparation as fake:
            accelerator = getattr(fake, "accelerator", None)
            if accelerator is not None:
                if getattr(accelerator.state.fsdp_plugin, "fsdp_version", None) != 2:
                    raise ValueError("the rehearsal runs FSDP2 configs only")
                model, optimizer = fake.prepare_model(config, trust_remote_code=trust_remote_code)
            else:
                checkpointing = env.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true"
                model, optimizer = fake.prepare_model(config, trust_remote_code=trust_remote_code,
                                                      activation_checkpointing=checkpointing)
            units = sum(1 for module in model.modules() if isinstance(module, FSDPModule))
            vocab = int(config.vocab_size)
            with fake.fake_mode:
                input_ids = torch.randint(0, vocab, (micro_batch, seq_len))
                labels = input_ids.clone()
            tracker = _tracker_class()(model, getattr(optimizer, "optimizer", optimizer))
            tracker.root_name, tracker.moments = type(model).__name__, {}
            embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
            tracker.embedding_name = next((f"{type(model).__name__}.{name}" for name, module in model.named_modules()
                                           if name and module is embedding), "")
            tracker.block_names = tuple(f"{type(model).__name__}.{name}" for name, module in model.named_modules()
                                        if name and isinstance(module, FSDPModule) and next(module.children(), None))
            tracker.track_inputs((input_ids, labels))
            model.train()
            with fake.fake_mode, tracker:
                for iteration in range(iterations):
                    if iteration < iterations - 1:
                        # Earlier iterations only create the optimizer state (the peak is in the
                        # last, which has it): a step on zero gradients creates the same state,
                        # without a forward and a backward of the whole model.
                        _create_optimizer_state(model, optimizer, tracker)
                        continue
                    for index in range(micro_batches):
                        last = index == micro_batches - 1 or reduce_every_micro_batch
                        if accelerator is None:  # transformers' FSDP2: no accelerate to ask
                            model.set_requires_gradient_sync(last)
                            loss = causal_lm_summed_loss(model, input_ids, labels)
                            (loss / (micro_batch * seq_len * grad_accum)).backward()
                        else:
                            with gradient_sync(accelerator, model, last_micro_batch=last):
                                loss = causal_lm_summed_loss(model, input_ids, labels)
                                accelerator.backward(loss / (micro_batch * seq_len * grad_accum))
                        del loss
                    _clip_like_training(model, 1.0)
                    with _on_local_shards(optimizer):
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    # Per-module statistics only (the rank's peak is kept): with a tied head,
                    # transformers' FSDP units are entered from the top level again next step.
                    tracker.reset_mod_stats()
            snapshot = tracker.get_tracker_snapshot("peak")
            device_snapshot = max(snapshot.values(), key=lambda values: values.get("Total", 0))
            by_category = _by_category(device_snapshot)
            peak = int(device_snapshot.get("Total", sum(by_category.values())))
            where = tracker.peak_where
            moments = {moment: _by_category(snap) for moment, (_, snap) in tracker.moments.items()}
            del model, optimizer, tracker
    finally:
        restore_propagation()
    return Rehearsal(peak_bytes=peak, peak_by_category=by_category, peak_where=where, iterations=iterations,
                     seconds=time.perf_counter() - started, units=units, moments=moments)


@contextlib.contextmanager
def _on_local_shards(optimizer):
    """Inside: ``optimizer``'s parameter groups hold each DTensor parameter's local shard, whose
    ``grad`` is the local shard of the parameter's gradient, when every gradient is placed as its
    parameter is (otherwise nothing changes); the optimizer's state is then kept per local shard,
    the same tensors a DTensor state would wrap. Restored on exit."""
    from torch.distributed.tensor import DTensor

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    groups = [group["params"] for group in inner.param_groups]
    shards = [parameter for params in groups for parameter in params if isinstance(parameter, DTensor)]
    if not all(parameter.grad is None or (isinstance(parameter.grad, DTensor)
                                          and parameter.grad.placements == parameter.placements
                                          and parameter.grad.device_mesh == parameter.device_mesh)
               for parameter in shards):
        yield
        return
    for shard in shards:
        shard._local_tensor.grad = None if shard.grad is None else shard.grad._local_tensor
    for group, params in zip(inner.param_groups, groups):
        group["params"] = [parameter._local_tensor if isinstance(parameter, DTensor) else parameter
                           for parameter in params]
    try:
        yield
    finally:
        for group, params in zip(inner.param_groups, groups):
            group["params"] = params
        for shard in shards:
            shard._local_tensor.grad = None


def _create_optimizer_state(model, optimizer, tracker) -> None:
    """One optimizer step on zero gradients (what a training step's first ``optimizer.step()`` creates:
    AdamW's moments and step counters, tracked as optimizer state), then what the tracker saw of it
    forgotten: the rank's peak and the moments are those of the steps that follow, as in training,
    where every later step holds the same state through its forward and backward."""
    import torch

    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    with _on_local_shards(optimizer):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tracker.reset_mod_stats()
    tracker._peak_mem.clear()  # FSDPMemTracker's rank peak (see _RehearsalTracker._update_peak_stats)
    tracker._peak_mem_snap.clear()
    tracker.moments, tracker.moment, tracker.peak_where = {}, "", ""


def _by_category(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot (reference type -> bytes) split as :data:`CATEGORIES` names."""
    by_category: dict[str, int] = {}
    for reftype, count in snapshot.items():
        if reftype == "Total":
            continue
        name = CATEGORIES.get(str(getattr(reftype, "value", reftype)), str(reftype))
        by_category[name] = by_category.get(name, 0) + int(count)
    return by_category


__all__ = ["CATEGORIES", "FAKE_RUN_OVERRIDES", "MOMENTS", "FakeAccelerate", "Rehearsal", "causal_lm_summed_loss",
           "fake_accelerate", "rehearse"]
