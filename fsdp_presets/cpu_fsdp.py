"""Real FSDP (and DDP) over gloo on a host without an accelerator, through accelerate's own paths.

A training script calls :func:`enable_cpu_fsdp` once, before it builds its ``Accelerator``::

    import fsdp_presets
    fsdp_presets.enable_cpu_fsdp()
    accelerator = Accelerator()

and is launched exactly as on a GPU cluster::

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_demo.yaml recipes/causal_lm.py ...

On a host with an accelerator the call does nothing. On a CPU-only host, unpatched accelerate
gives each launched process ``DistributedType.NO`` (N independent rank-0 trainings), because it
switches FSDP on only inside its GPU-family branch. The patches below are the smallest set that
makes ``prepare``, ``save_state``/``load_state``, ``get_state_dict`` and ``save_model`` take
accelerate's real FSDP paths on CPU, and lets a Trainer take a model transformers sharded over a TP
mesh under a DDP-type launch, as on GPUs. Each patch says what accelerate/torch does and why.

Set ``FSDP_PRESETS_CPU_PATCHES_OFF=name[,name]`` to switch single patches off: the tests use it to
show that each fix is needed (the run fails or diverges without it).

Both :func:`enable_cpu_fsdp` and :func:`check_launch` also register the exit handler of
:mod:`fsdp_presets.clean_exit`, so a script that never calls ``end_training`` still exits 0.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import torch

from fsdp_presets import clean_exit, environment

# Patch names (for FSDP_PRESETS_CPU_PATCHES_OFF and the tests).
FULL_STATE_DICT_OFFLOAD = "full-state-dict-offload"
FSDP1_OPTIMIZER_RESUME = "fsdp1-optimizer-resume"
SYNC_MODULE_STATES = "sync-module-states"
GLOO_PAIR_COLLECTIVES = "gloo-pair-collectives"
PARALLELISM_MULTI_CPU = "parallelism-config-multi-cpu"
PATCH_NAMES = (FULL_STATE_DICT_OFFLOAD, FSDP1_OPTIMIZER_RESUME, SYNC_MODULE_STATES, GLOO_PAIR_COLLECTIVES,
               PARALLELISM_MULTI_CPU, clean_exit.CLEAN_EXIT)
"""Every name ``FSDP_PRESETS_CPU_PATCHES_OFF`` understands (another one is refused at a recipe's start)."""
PATCHES_OFF_ENV = environment.CPU_PATCHES_OFF.name

# NOTE: accelerate builds a GradScaler only when the device is not the CPU, so on a CPU host fp16
# has no loss scaling (small gradients underflow to zero, an overflow is not skipped), and DDP
# ignores fp16 altogether (no autocast on CPU: it trains in fp32). FSDP still computes in fp16
# through its mixed-precision policy, so an FSDP fp16 run here differs from DDP "fp16".
FP16_ON_CPU = ("mixed_precision fp16 on a CPU host: FSDP computes in fp16 but accelerate creates no gradient "
               "scaler on CPU (no loss scaling, no overflow skipping) and DDP would train in fp32; use bf16 "
               "(mixed_precision: bf16) for CPU runs, fp16 only on GPUs")

# The accelerate release whose internals the patches below were written against and tested with
# (AcceleratorState.__init__'s signature, FullyShardedDataParallelPlugin.__post_init__'s accelerator
# lookup, accelerate.accelerator.load_fsdp_optimizer). Another minor version is refused: its
# internals may differ silently (a patch that no longer applies leaves N independent trainings).
TESTED_ACCELERATE = (1, 16)
UNTESTED_ACCELERATE_OK = environment.UNTESTED_ACCELERATE.name
"""Set to 1 to try the CPU mode on another accelerate minor version at your own risk."""

_enabled = False


class CpuFsdpError(RuntimeError):
    """A setting that cannot work on a CPU-only host, with what to do instead."""


def check_accelerate_version(version: str | None = None) -> None:
    """Refuse an accelerate version whose internals the CPU mode was not written for; with
    ``FSDP_PRESETS_UNTESTED_ACCELERATE=1`` only the internals it patches must exist."""
    import accelerate

    version = version or accelerate.__version__
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(character for character in part if character.isdigit()) if part else ""
        parts.append(int(digits) if digits else -1)
    tested = ".".join(map(str, TESTED_ACCELERATE))
    if tuple(parts) != TESTED_ACCELERATE and os.environ.get(UNTESTED_ACCELERATE_OK) != "1":
        raise CpuFsdpError(
            f"fsdp_presets.enable_cpu_fsdp() was written for accelerate {tested}.x and this is "
            f"accelerate {version}; its CPU patches rely on accelerate internals that change between "
            f'releases. Install the tested version: pip install "accelerate>={tested},<{TESTED_ACCELERATE[0]}.'
            f'{TESTED_ACCELERATE[1] + 1}" (or set {UNTESTED_ACCELERATE_OK}=1 to try this one at your own risk)'
        )
    missing = [name for name, present in _patched_internals() if not present]
    if missing:
        raise CpuFsdpError(
            f"accelerate {version} / torch {torch.__version__} lack internals the CPU mode patches "
            f"({', '.join(missing)}); install accelerate {tested}.x and torch 2.13"
        )


def _patched_internals() -> list[tuple[str, bool]]:
    """``(name, present)`` for every accelerate/torch internal a patch below replaces or calls."""
    import inspect

    import accelerate.accelerator as accelerate_accelerator
    import accelerate.utils.dataclasses as accelerate_dataclasses
    import torch.distributed.checkpoint.state_dict as dcp_state_dict
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as fsdp2_collectives
    import torch.distributed.fsdp._init_utils as fsdp_init_utils
    from accelerate.accelerator import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState, PartialState

    state_parameters = list(inspect.signature(AcceleratorState.__init__).parameters)[1:6]
    return [
        ("AcceleratorState.__init__(mixed_precision, cpu, dynamo_plugin, deepspeed_plugin, fsdp_plugin)",
         state_parameters == ["mixed_precision", "cpu", "dynamo_plugin", "deepspeed_plugin", "fsdp_plugin"]),
        ("PartialState._shared_state", isinstance(getattr(PartialState, "_shared_state", None), dict)),
        ("accelerate.utils.dataclasses.get_torch_accelerator_backend",
         hasattr(accelerate_dataclasses, "get_torch_accelerator_backend")),
        ("accelerate.accelerator.load_fsdp_optimizer", hasattr(accelerate_accelerator, "load_fsdp_optimizer")),
        ("torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states",
         hasattr(fsdp_init_utils, "_check_module_states_for_sync_module_states")),
        ("torch.distributed.checkpoint.state_dict._init_optim_state", hasattr(dcp_state_dict, "_init_optim_state")),
        ("torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultAllGather/DefaultReduceScatter",
         all(hasattr(fsdp2_collectives, name) for name in ("DefaultAllGather", "DefaultReduceScatter"))),
        ("accelerate.ParallelismConfig._validate_accelerator, Accelerator.multi_device",
         hasattr(ParallelismConfig, "_validate_accelerator") and isinstance(Accelerator.__dict__.get("multi_device"),
                                                                              property)),
    ]


def accelerator_available() -> bool:
    """True when torch sees a CUDA/XPU/MPS/... device (then the CPU mode stays off)."""
    from accelerate.utils import get_torch_accelerator_backend

    device_type, _ = get_torch_accelerator_backend()
    return device_type is not None


def cpu_fsdp_enabled() -> bool:
    """Whether :func:`enable_cpu_fsdp` switched the CPU mode on in this process."""
    return _enabled


def _patch_off(name: str) -> bool:
    return name in {item.strip() for item in os.environ.get(PATCHES_OFF_ENV, "").split(",")}


def enable_cpu_fsdp() -> bool:
    """Switch accelerate to real FSDP/DDP over gloo when this host has no accelerator.

    Call before constructing ``Accelerator()``. Returns True when the CPU mode is on (now or
    already), False on a host with an accelerator, where nothing is changed.
    """
    global _enabled
    if _enabled:
        return True
    if accelerator_available():
        return False
    check_accelerate_version()
    # NOTE: accelerate's MULTI_CPU branch is the one that starts a gloo process group from the
    # torchrun environment that `accelerate launch` sets for FSDP and MULTI_GPU configs; without
    # this the processes see no backend and train alone (DistributedType.NO).
    os.environ["ACCELERATE_USE_CPU"] = "true"
    # NOTE: accelerate's MULTI_CPU device is `cpu:0`; FSDP1 then fails with "Inconsistent compute
    # device" because torch reports plain `cpu` for the parameters. A fixed device avoids it.
    os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
    _patch_accelerator_state()
    _patch_fsdp_plugin_post_init()
    _patch_sync_module_states_check()
    _patch_fsdp1_state_dict_offload()
    _patch_fsdp1_optimizer_load()
    _patch_fsdp2_pair_collectives()
    _patch_parallelism_config_multi_cpu()
    clean_exit.install()
    _enabled = True
    return True


def _patch_accelerator_state() -> None:
    """accelerate's ``AcceleratorState.__init__`` sets ``DistributedType.FSDP`` only when the
    process group runs on a GPU-family device; on CPU it stays ``MULTI_CPU`` and ``prepare`` would
    wrap the model in DDP. We switch to FSDP when an FSDP plugin was given, exactly as accelerate
    does for GPUs, and write the value into ``PartialState._shared_state`` too: every later
    ``AcceleratorState()`` (e.g. inside ``AcceleratedOptimizer``) re-reads it from there."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "_fsdp_presets_patch", False):
        return

    @functools.wraps(original)
    def __init__(self, mixed_precision=None, cpu=False, dynamo_plugin=None, deepspeed_plugin=None,
                 fsdp_plugin=None, *args, **kwargs):
        original(self, mixed_precision, cpu, dynamo_plugin, deepspeed_plugin, fsdp_plugin, *args, **kwargs)
        if fsdp_plugin is None or self.distributed_type != DistributedType.MULTI_CPU:
            return
        _refuse_settings_cpu_cannot_run(fsdp_plugin)
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision == "fp16":
            warnings.warn(FP16_ON_CPU, stacklevel=2)
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    __init__._fsdp_presets_patch = True
    AcceleratorState.__init__ = __init__


def _refuse_settings_cpu_cannot_run(fsdp_plugin) -> None:
    """Parameter offload moves parameters to CPU between uses: on a CPU host there is nowhere to
    offload to, and torch fails deep inside ``fully_shard`` ("Cannot access accelerator device")."""
    offload = fsdp_plugin.cpu_offload
    offload_params = getattr(offload, "offload_params", None)
    if offload_params is None:  # FSDP2: a CPUOffloadPolicy instance means offload is on
        from torch.distributed.fsdp import CPUOffloadPolicy

        offload_params = isinstance(offload, CPUOffloadPolicy)
    if offload_params:
        raise CpuFsdpError(
            "fsdp_offload_params: true cannot run on a host without an accelerator (parameters "
            "already live in CPU memory); set `fsdp_offload_params: false` in the accelerate config "
            "for CPU runs, or generate a CPU preset with `fsdp-presets generate ... --offload off`"
        )


def _patch_fsdp_plugin_post_init() -> None:
    """``FullyShardedDataParallelPlugin.__post_init__`` raises for FSDP1 ``sync_module_states`` (on
    by default in ``accelerate launch``, forced by RAM-efficient loading) when no accelerator
    exists, because NCCL cannot broadcast CPU tensors. gloo can. We let it take its accelerator
    branch and then point ``param_init_fn`` (which materialises meta modules on ranks > 0 before
    rank 0's weights are broadcast) at the CPU."""
    import accelerate.utils.dataclasses as accelerate_dataclasses

    plugin_class = accelerate_dataclasses.FullyShardedDataParallelPlugin
    original = plugin_class.__post_init__
    if getattr(original, "_fsdp_presets_patch", False):
        return

    @functools.wraps(original)
    def __post_init__(self):
        if _patch_off(SYNC_MODULE_STATES):
            return original(self)
        lookup = accelerate_dataclasses.get_torch_accelerator_backend
        accelerate_dataclasses.get_torch_accelerator_backend = lambda: ("meta", None)
        try:
            original(self)
        finally:
            accelerate_dataclasses.get_torch_accelerator_backend = lookup
        if self.sync_module_states:
            cpu = torch.device("cpu")
            self.param_init_fn = lambda module: module.to_empty(device=cpu, recurse=False)

    __post_init__._fsdp_presets_patch = True
    plugin_class.__post_init__ = __post_init__


def _patch_sync_module_states_check() -> None:
    """torch FSDP1 refuses ``sync_module_states=True`` for CPU tensors only because NCCL cannot
    broadcast them; over gloo the same broadcast from rank 0 works, so the CPU check is dropped
    and torch's own ``_sync_module_params_and_buffers`` does the work."""
    import torch.distributed.fsdp._init_utils as fsdp_init_utils

    original = fsdp_init_utils._check_module_states_for_sync_module_states
    if getattr(original, "_fsdp_presets_patch", False) or _patch_off(SYNC_MODULE_STATES):
        return

    def _check_module_states_for_sync_module_states(module_states):
        if torch.distributed.get_backend() == "gloo":
            return None
        return original(module_states)

    _check_module_states_for_sync_module_states._fsdp_presets_patch = True
    fsdp_init_utils._check_module_states_for_sync_module_states = _check_module_states_for_sync_module_states


def _patch_fsdp1_state_dict_offload() -> None:
    """accelerate asks FSDP1 for full state dicts with ``offload_to_cpu=True``. For modules that
    already live on CPU, torch's "offload" is a no-op copy that frees storage still referenced by
    the flat parameter (segfault on rank 0 in ``get_state_dict``/``save_model``) and aliases
    optimizer-state buffers (``exp_avg`` saved equal to ``exp_avg_sq``). Every accelerate path goes
    through ``FSDP.set_state_dict_type``, so the configs are copied there with offload off."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    original = FSDP.set_state_dict_type
    if getattr(original, "_fsdp_presets_patch", False) or _patch_off(FULL_STATE_DICT_OFFLOAD):
        return

    def without_offload(config):
        if config is not None and getattr(config, "offload_to_cpu", False):
            return dataclasses.replace(config, offload_to_cpu=False)
        return config

    @functools.wraps(original)
    def set_state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
        return original(module, state_dict_type, without_offload(state_dict_config),
                        without_offload(optim_state_dict_config))

    set_state_dict_type._fsdp_presets_patch = True
    FSDP.set_state_dict_type = staticmethod(set_state_dict_type)


def _patch_fsdp1_optimizer_load() -> None:
    """accelerate's ``load_fsdp_optimizer`` builds the DCP load template of an FSDP1 sharded
    optimizer state from the live optimizer. Before the first step that optimizer has no state,
    so DCP loads nothing into it and the resumed run restarts Adam's moments from zero (it matches
    for one step, then diverges). torch's own ``_init_optim_state`` (a zero-gradient step at lr 0,
    the same thing DCP's ``get_optimizer_state_dict`` does) creates the state first."""
    import accelerate.accelerator as accelerate_accelerator
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    original = accelerate_accelerator.load_fsdp_optimizer
    if getattr(original, "_fsdp_presets_patch", False) or _patch_off(FSDP1_OPTIMIZER_RESUME):
        return

    @functools.wraps(original)
    def load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, input_dir, *args, **kwargs):
        if fsdp_plugin.fsdp_version == 1:
            from accelerate.optimizer import AcceleratedOptimizer

            inner = optimizer
            while isinstance(inner, AcceleratedOptimizer):
                inner = inner.optimizer
            _init_optim_state(inner)
        return original(fsdp_plugin, accelerator, optimizer, model, input_dir, *args, **kwargs)

    load_fsdp_optimizer._fsdp_presets_patch = True
    accelerate_accelerator.load_fsdp_optimizer = load_fsdp_optimizer


class _PairWork(torch.distributed.Work):
    """One handle for the send and the receive of a pair exchange (FSDP2 waits on one handle)."""

    def __init__(self, works) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            work.wait()
        return True


def is_gloo_pair(group) -> bool:
    import torch.distributed as dist

    return group is not None and group.size() == 2 and dist.get_backend(group) == "gloo"


def _exchange(send: torch.Tensor, receive: torch.Tensor, group) -> list:
    """Send ``send`` to the other rank of a 2-rank group and receive its tensor into ``receive``."""
    import torch.distributed as dist

    peer = 1 - group.rank()
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, group=group, group_peer=peer),
                                   dist.P2POp(dist.irecv, receive, group=group, group_peer=peer)])


def pair_all_gather(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """All-gather over 2 gloo ranks as one exchange: each rank sends its shard and receives the
    other's. gloo's own all-gather takes about twice as long for the same bytes (14M fp32: 250 vs
    580 ms wall, 40 vs 90 ms CPU, measured on this 2-core host); the result is a copy either way."""
    rank, count = group.rank(), shard.numel()
    mine, theirs = output.narrow(0, rank * count, count), output.narrow(0, (1 - rank) * count, count)
    if mine.data_ptr() != shard.data_ptr():  # FSDP2 gathers in place: its shard already sits there
        mine.copy_(shard)
    work = _PairWork(_exchange(shard, theirs, group))
    if async_op:
        return work
    work.wait()
    return None


def pair_reduce_scatter(output: torch.Tensor, full: torch.Tensor, group, op) -> None:
    """Reduce-scatter (sum or mean) over 2 gloo ranks as one exchange: each rank sends the half
    the other rank keeps and adds the half it receives to its own. gloo runs FSDP2's reduce-scatter
    as an all-reduce of the whole buffer (twice the bytes: 28M fp32, 220-410 vs 540-780 ms wall).
    Two addends sum to the same float in either order, and a mean halves each addend first, as
    DDP does (divide by the world size, then all-reduce a sum), so gradients stay bitwise DDP's."""
    import torch.distributed as dist

    rank, count = group.rank(), output.numel()
    mine, theirs = full.narrow(0, rank * count, count), full.narrow(0, (1 - rank) * count, count)
    received = torch.empty_like(output)
    for work in _exchange(theirs, received, group):
        work.wait()
    if op == dist.ReduceOp.AVG:
        torch.mul(mine, 0.5, out=output)
        received.mul_(0.5)
        output.add_(received)
    else:
        torch.add(mine, received, out=output)


def _patch_fsdp2_pair_collectives() -> None:
    """FSDP2's all-gather and reduce-scatter on a 2-rank gloo group run as one send/receive pair
    each (:func:`pair_all_gather`, :func:`pair_reduce_scatter`); other groups, other reduce
    operations (pre-multiplied sums) and other backends keep torch's collectives."""
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

    if _patch_off(GLOO_PAIR_COLLECTIVES):
        return
    all_gather = collectives.DefaultAllGather.__call__
    if not getattr(all_gather, "_fsdp_presets_patch", False):
        @functools.wraps(all_gather)
        def gather(self, output_tensor, input_tensor, group, async_op=False):
            if is_gloo_pair(group) and output_tensor.numel() == 2 * input_tensor.numel():
                return pair_all_gather(output_tensor, input_tensor, group, async_op=async_op)
            return all_gather(self, output_tensor, input_tensor, group, async_op=async_op)

        gather._fsdp_presets_patch = True
        collectives.DefaultAllGather.__call__ = gather
    reduce_scatter = collectives.DefaultReduceScatter.__call__
    if not getattr(reduce_scatter, "_fsdp_presets_patch", False):
        @functools.wraps(reduce_scatter)
        def scatter(self, output_tensor, input_tensor, group, op, async_op=False):
            if (is_gloo_pair(group) and not async_op and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
                    and input_tensor.numel() == 2 * output_tensor.numel()):
                return pair_reduce_scatter(output_tensor, input_tensor, group, op)
            return reduce_scatter(self, output_tensor, input_tensor, group, op, async_op=async_op)

        scatter._fsdp_presets_patch = True
        collectives.DefaultReduceScatter.__call__ = scatter


class _MultiDeviceView:
    """An ``Accelerator`` as :func:`_patch_parallelism_config_multi_cpu` shows it to accelerate's
    check: every attribute its own, ``multi_device`` True."""

    multi_device = True

    def __init__(self, accelerator) -> None:
        self._accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def _patch_parallelism_config_multi_cpu() -> None:
    """accelerate's ``ParallelismConfig._validate_accelerator`` accepts a mesh of more than one
    dimension under FSDP2 or a multi-device type (``Accelerator.multi_device``: MULTI_GPU, MULTI_XPU,
    ...), and refuses ``MULTI_CPU``, which that list leaves out ("ParallelismConfig is only compatible
    DistributedType.FSDP (version 2) or DistributedType.Multi{Device} ..."). transformers' Trainer
    builds a ``ParallelismConfig(tp_size, dp_shard_size)`` for a model it sharded at load time (TP), so
    a Trainer script launched under a DDP-type config fails on CPU where the same launch runs on GPUs.
    Over gloo, ``MULTI_CPU`` is the CPU's multi-device type: the device mesh is built on ``cpu`` and
    the model owns its placement and reductions, so the check runs as it does for ``MULTI_GPU``, with
    ``multi_device`` true (:class:`_MultiDeviceView`); ``multi_device`` itself is left alone, as
    accelerate's DDP wrapping, even-batch joins and checkpoint loading read it too."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    original = ParallelismConfig._validate_accelerator
    if getattr(original, "_fsdp_presets_patch", False) or _patch_off(PARALLELISM_MULTI_CPU):
        return

    @functools.wraps(original)
    def _validate_accelerator(self, accelerator):
        if accelerator.distributed_type == DistributedType.MULTI_CPU and accelerator.use_distributed:
            accelerator = _MultiDeviceView(accelerator)
        return original(self, accelerator)

    _validate_accelerator._fsdp_presets_patch = True
    ParallelismConfig._validate_accelerator = _validate_accelerator


def fsdp_launch() -> bool:
    """Whether ``accelerate launch`` ran this process under an FSDP config (its ``ACCELERATE_USE_FSDP``)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def check_launch(accelerator) -> None:
    """Refuse a launch that would silently train N independent copies.

    ``accelerate launch`` with N processes sets ``WORLD_SIZE=N`` for every process. If the
    ``Accelerator`` then reports fewer processes, each process is training alone (the CPU-only
    host case when :func:`enable_cpu_fsdp` was not called); an FSDP config that did not produce
    ``DistributedType.FSDP`` is the same mistake one level down.
    """
    from accelerate.utils import DistributedType

    clean_exit.install(accelerator)  # the group goes down in order at exit, end_training or not
    launched_world_size = int(os.environ.get("WORLD_SIZE", "1"))
    problems = []
    if launched_world_size > 1 and accelerator.num_processes != launched_world_size:
        problems.append(
            f"`accelerate launch` started {launched_world_size} processes but each one trains alone "
            f"(accelerate sees {accelerator.num_processes} process, distributed type "
            f"{accelerator.distributed_type.value})"
        )
    if fsdp_launch() and accelerator.distributed_type != DistributedType.FSDP:
        problems.append(
            f"the accelerate config asks for FSDP but accelerate runs {accelerator.distributed_type.value}"
        )
    if problems:
        fix = (
            "call fsdp_presets.enable_cpu_fsdp() before Accelerator() so FSDP runs on this CPU-only host"
            if not accelerator_available()
            else "check the accelerate config and the launch command"
        )
        raise CpuFsdpError("; ".join(problems) + f". Fix: {fix}.")
