"""How a preset saves and loads: the state-dict type, RAM-efficient loading and ``--async-save``,
each with its reason (:func:`fsdp_presets.preset.presets.decide` calls them)."""

from __future__ import annotations

from dataclasses import replace

from fsdp_presets.errors import UsageError
from fsdp_presets.fileio import GiB, format_bytes
from fsdp_presets.model.model_profile import ModelProfile
from fsdp_presets.plan.results import MemoryPlan, StrategyPlan
from fsdp_presets.plan.save_cost import staging_fit
from fsdp_presets.preset.choices import StateDictChoice
from fsdp_presets.preset.request import PresetRequest

__all__ = ["full_state_dict_host_bytes", "state_dict_choice", "with_async_save"]


def state_dict_choice(profile: ModelProfile, request: PresetRequest, notes: list[str]) -> StateDictChoice:
    """SHARDED_STATE_DICT (or FULL_STATE_DICT as asked, when rank 0's host holds it) and RAM-efficient
    loading (GPUs, no expert parallelism), each with its reason."""
    ram_efficient = request.device == "gpu" and request.ep == 1
    if request.ep > 1:
        loading = (f"RAM-efficient loading off: under expert parallelism {request.ep} rank 0's broadcast would give "
                   "every rank rank 0's experts, silently (transformers issue 45662); each rank reads its own")
    elif ram_efficient:
        loading = ("RAM-efficient loading on: only rank 0 reads the pretrained weights into host RAM, the other "
                   "ranks start on the meta device and receive their shards (otherwise each of a node's "
                   f"{request.gpus_per_node} processes loads a full copy: "
                   f"{format_bytes(request.gpus_per_node * profile.total_params * 2, digits=0)} of bf16 weights)")
    else:
        loading = ("RAM-efficient loading off: a CPU preset runs small demo models, where each process loading its "
                   "own copy costs little and every rank starts from the same weights by construction")
    if request.state_dict == "full":
        need = full_state_dict_host_bytes(profile)
        host = request.host_bytes
        if need > host:
            raise UsageError(f"--state-dict full gathers the whole model and optimizer state on rank 0: about "
                             f"{format_bytes(need, digits=0)} of host RAM, more than --host-memory {host / GiB:g}; use "
                             "--state-dict sharded (export full weights afterwards with accelerate merge-weights)")
        reason = (f"FULL_STATE_DICT as asked: rank 0 gathers the full model and optimizer state into host RAM at every "
                  f"save (about {format_bytes(need)}) and loading needs the same world size layout; {loading}")
        return StateDictChoice(state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=ram_efficient,
                               reason=reason)
    reason = ("SHARDED_STATE_DICT: each rank writes its own shards with torch.distributed.checkpoint (DCP), nothing is "
              "gathered on one rank, and DCP reshards on load, so a run resumes on another GPU count; export full "
              f"Hugging Face weights afterwards (accelerate merge-weights); {loading}")
    return StateDictChoice(state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=ram_efficient,
                           reason=reason)


def with_async_save(choice: StateDictChoice, request: PresetRequest, memory_plan: MemoryPlan,
                    row: StrategyPlan, notes: list[str]) -> StateDictChoice:
    """``choice`` with ``--async-save`` in the launch line where the recipe takes it (FSDP2,
    SHARDED_STATE_DICT, every weight trained: :func:`fsdp_presets.checkpoint.async_save.async_save_problem`)
    and its staging copy fits a node's host memory beside what training keeps there
    (:func:`fsdp_presets.plan.save_cost.staging_fit`); the reason says which, with the numbers."""
    if row.fsdp_version != 2:
        why = "it writes through DCP's asynchronous save, which the recipes take with FSDP2 only"
    elif choice.state_dict_type != "SHARDED_STATE_DICT":
        why = "it writes each rank's shards (SHARDED_STATE_DICT), not a gathered full state dict"
    elif request.lora_shape is not None:
        why = "a LoRA/QLoRA run saves only its adapter, small and quick to write"
    elif request.device == "cpu":
        why = ("on a CPU-only host the background write shares the cores that train: the steps it overlaps "
               "slow down by about as much as the save would have blocked (docs/benchmarks.md); add the flag to "
               "try it")
    else:
        staging = staging_fit(row, memory_plan.hardware, memory_plan.shape, host_bytes=request.host_bytes)
        if staging.fits:
            return replace(choice, async_save=True, reason=(
                f"{choice.reason}; --async-save in the launch line: a save stops training only while each process "
                f"copies its shards into host memory, then writes in the background ({staging.describe()})"))
        why = (f"its staging copy does not fit --host-memory {request.host_bytes / GiB:g} GiB (give your nodes' "
               f"RAM if they have more): {staging.describe()}")
        notes.append(f"--async-save left out of the launch line: {why}")
    return replace(choice, reason=f"{choice.reason}; --async-save off: {why}")


def full_state_dict_host_bytes(profile: ModelProfile) -> int:
    """Rank-0 host RAM a FULL_STATE_DICT save gathers: fp32 parameters (4 bytes) and Adam's two
    fp32 moments (8 bytes) of the whole model (accelerate gathers model and optimizer state dicts
    on rank 0 with ``offload_to_cpu`` / ``rank0_only``)."""
    return profile.total_params * (4 + 8)
