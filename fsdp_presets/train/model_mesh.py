"""A run whose model transformers shards at load time over a mesh of more than one dimension
(FSDP2 x TP, FSDP2 x EP): ``--distributed-config NAME.distributed.json``, the file
``fsdp-presets generate --tp N`` / ``--ep N`` writes beside its accelerate config::

    accelerate launch --config_file NAME.yaml recipes/causal_lm.py --distributed-config NAME.distributed.json ...

- **The launch**: the accelerate config is FSDP2 (the one ``generate`` wrote) and its processes are
  the mesh's ranks (``dp_replicate_size x fsdp_size x tp_size``); anything else is refused at start.
- **The model**: ``from_pretrained(..., distributed_config=...)`` shards it by the model's own TP or
  EP plan, then FSDP2 by its FSDP plan (transformers' ``maybe_distribute_model``).
  ``accelerator.prepare`` then registers it without wrapping it again (:func:`prepare_sharded`), so
  saves, loads (DCP of 2-D DTensors, resharded on load to another mesh) and the export take
  accelerate's FSDP2 paths like any other run.
- **The data**: the ranks of one TP group compute on the same micro-batches. transformers lays the
  ranks out as ``(dp_replicate, fsdp, tp)`` with TP innermost, so a rank's data-parallel index is
  ``rank // tp_size``; sums over the run (loss, token counts, evaluation) count each sample once
  (:meth:`ModelMesh.data_share`). EP ranks each have their own data (the experts' all-to-all
  exchanges tokens between them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdp_presets.errors import UsageError
from fsdp_presets.flags import DISTRIBUTED_CONFIG


@dataclass(frozen=True, kw_only=True)
class ModelMesh:
    """The mesh one process trains on, from a ``.distributed.json`` file."""

    config: Any
    """transformers' ``DistributedConfig``, as its own loader read the file."""
    path: str | None
    """The file (None: the model's own ``config.distributed_config``, a Trainer script's)."""
    rank: int
    """This process's rank."""

    @property
    def tp_size(self) -> int:
        return int(self.config.tp_size)

    @property
    def ep_size(self) -> int:
        return int(self.config.ep_size)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each see their own samples (``dp_replicate_size x fsdp_size``)."""
        return int(self.config.dp_size)

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel index (TP ranks of one group share it)."""
        return self.rank // self.tp_size

    @property
    def counts_data(self) -> bool:
        """Whether this rank's samples count in a sum over the run: the first rank of each TP group."""
        return self.rank % self.tp_size == 0

    def settings(self) -> dict[str, Any]:
        """What run.json and the checkpoint manifests record of the mesh."""
        config = self.config
        return {"file": self.path, "dp_replicate_size": int(config.dp_replicate_size),
                "fsdp_size": int(config.fsdp_size), "tp_size": self.tp_size, "ep_size": self.ep_size}

    def label(self) -> str:
        """``FSDP 2 x TP 2``, as ``plan`` and ``generate`` name it."""
        from fsdp_presets.schema import mesh_label

        return mesh_label(self.settings())

    def data_share(self, tensor):
        """``tensor`` where this rank's samples count in a sum over the run, zeros on the other
        ranks of its TP group (which computed the same numbers from the same samples): an
        ``accelerator.reduce(..., "sum")`` of the result counts each sample once."""
        return tensor if self.counts_data else tensor * 0


def load_model_mesh(path: str, *, rank: int, world_size: int, lora: dict[str, Any] | None = None) -> ModelMesh:
    """The mesh of ``path`` (through transformers' own loader) for process ``rank`` of ``world_size``:
    as many processes as the mesh has ranks, data-parallel ranks, no pipeline stages, every weight
    trained (``lora``: the run's LoRA/QLoRA settings, refused). :class:`UsageError` otherwise."""
    from fsdp_presets.preset.emit_distributed import load_distributed_config, recipes_refuse

    if lora is not None:
        raise UsageError(f"--method {lora['method']} with {DISTRIBUTED_CONFIG.name}: transformers' TP/EP plans shard the "
                         "base layers peft would wrap; train LoRA/QLoRA with FSDP alone (a preset without --tp/--ep)")

    try:
        config = load_distributed_config(path)
    except FileNotFoundError:
        raise UsageError(f"{DISTRIBUTED_CONFIG.name} {path}: no such file; give the NAME.distributed.json "
                         "`fsdp-presets generate --tp N` or `--ep N` wrote") from None
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(f"{DISTRIBUTED_CONFIG.name} {path} is not a DistributedConfig transformers takes ({error}); "
                         "regenerate it with `fsdp-presets generate MODEL --tp N` or `--ep N`") from None
    ranks = int(config.dp_replicate_size) * int(config.fsdp_size) * int(config.tp_size)
    if ranks != world_size:
        raise UsageError(f"{path} lays out {ranks} ranks (dp_replicate_size {config.dp_replicate_size} x fsdp_size "
                         f"{config.fsdp_size} x tp_size {config.tp_size}), launched {world_size} processes: launch "
                         f"{ranks}, or regenerate it for {world_size} (fsdp-presets generate MODEL --gpus N --tp T)")
    problem = recipes_refuse(config)
    if problem is not None:
        fix = "" if int(config.dp_size) != 1 else (
            f": use at least 2 FSDP ranks (fsdp-presets generate MODEL --gpus {2 * world_size} --tp {config.tp_size}), "
            f"or FSDP alone on these {world_size} processes (a preset without --tp)")
        raise UsageError(f"{path}: {problem}{fix}")
    return ModelMesh(config=config, path=str(path), rank=rank)


def check_mesh_launch(accelerator, mesh: ModelMesh) -> None:
    """A mesh transformers shards trains under FSDP2 (the accelerate config ``generate`` wrote beside
    the file): :class:`UsageError` for any other launch."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if accelerator.distributed_type.value != "FSDP" or int(getattr(plugin, "fsdp_version", 1)) != 2:
        raise UsageError(f"{DISTRIBUTED_CONFIG.name} {mesh.path} needs an FSDP2 launch (the accelerate config "
                         f"`fsdp-presets generate` wrote beside it), launched {accelerator.distributed_type.value}"
                         f"{'' if plugin is None else f' version {plugin.fsdp_version}'}: launch with that config")


def trainer_launch_problem(accelerator, model, config_file: str | None) -> str | None:
    """A ``transformers.Trainer`` given a model transformers sharded at load time takes it as it is and
    prepares its optimizer alone, which accelerate refuses under FSDP ("an optimizer must be passed
    together with its model", accelerate 1.16, transformers 5.25): such a run launches under a DDP-type
    config with every rank of the mesh (``NAME.trainer.yaml``). None for any other model or launch."""
    from fsdp_presets.preset.emit_distributed import distributed_config_path, trainer_config_path

    mesh = mesh_of(model, accelerator.process_index)
    if mesh is None:
        planned = _trainer_config_mesh(config_file)
        if planned is None:
            return None
        config = distributed_config_path(planned["config"])
        return (f"{config_file} launches the Trainer on {planned['sharding']}, but the model was loaded without that "
                f"mesh: every process would hold the whole model (DDP); load it as the config's header says: "
                f"config = DistributedConfig.from_dict(json.load(open('{config}'))); model = "
                "AutoModelForCausalLM.from_pretrained(MODEL, distributed_config=config)")
    if accelerator.distributed_type.value != "FSDP":
        return None
    trainer_config = trainer_config_path(config_file) if config_file else "NAME.trainer.yaml"
    return (f"a model transformers sharded at load time ({mesh.label()}) under an FSDP launch: transformers' Trainer "
            "takes it as it is and prepares its optimizer alone, which accelerate refuses under FSDP; launch it with "
            f"the DDP-type config of all {accelerator.num_processes} processes, {trainer_config} (`fsdp-presets "
            "generate --tp N` / `--ep N` writes it beside NAME.yaml), or train it with recipes/causal_lm.py "
            "--distributed-config under the FSDP config")


def _trainer_config_mesh(config_file: str | None) -> dict | None:
    """``{"sharding", "config"}`` of a NAME.trainer.yaml ``generate --tp/--ep`` wrote (the mesh it
    launches the Trainer on, and its FSDP config), None for any other file."""
    from fsdp_presets.preset.emit import file_metadata

    if not config_file:
        return None
    metadata = file_metadata(config_file)
    summary, outputs = metadata.get("summary"), metadata.get("outputs")
    if metadata.get("kind") != "trainer" or not isinstance(summary, dict) or not isinstance(outputs, dict) \
            or not isinstance(outputs.get("config"), str):
        return None
    return {"sharding": summary.get("sharding"), "config": outputs["config"]}


def sum_over_samples(accelerator, tensor, mesh: ModelMesh | None):
    """The sum of ``tensor`` over the ranks, each sample counted once (the ranks of a TP group computed
    it from the same samples; :meth:`ModelMesh.data_share`). Collective."""
    return accelerator.reduce(mesh.data_share(tensor) if mesh is not None else tensor, reduction="sum")


def prepare_sharded(accelerator, model) -> None:
    """Let ``accelerator.prepare`` register a model transformers already sharded without wrapping it
    again: accelerate's FSDP2 preparation looks the accelerate config's block class up by name
    first ("Could not find the transformer layer class"), which a model ``fully_shard`` has renamed
    (``FSDPLlamaDecoderLayer``) no longer has, and then leaves an ``FSDPModule`` as it is. Activation
    checkpointing, which accelerate applies only while it wraps, is switched on here."""
    plugin = accelerator.state.fsdp_plugin
    plugin.auto_wrap_policy = None
    if plugin.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def initialize_new_weights_as_unsharded(model, loading: dict, rng_state) -> None:
    """Give the weights a model folder lacks (a new classification head: ``loading``'s missing and
    mismatched keys) the values a load without the mesh gives them. transformers initialises them
    on the mesh with DTensor's random numbers, which split one stream over the shards: other values
    than the same seed gives without the mesh, so a run on the mesh could not be held to its DDP
    baseline. Here each module owning such a weight is initialised as ``initialize_weights`` does
    after a plain load (``_init_weights`` on whole tensors, module by module, from ``rng_state``,
    the generator's state before the load), then each rank keeps its shard. Collective."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    names = set(loading.get("missing_keys") or ()) | {entry[0] if isinstance(entry, tuple) else entry
                                                     for entry in loading.get("mismatched_keys") or ()}
    if not names:
        return
    torch.set_rng_state(rng_state)
    for prefix, module in model.named_modules():
        own = {name: param for name, param in module.named_parameters(recurse=False)
               if (f"{prefix}.{name}" if prefix else name) in names}
        if not own:
            continue
        for name, param in own.items():  # whole tensors in place of the shards while it is initialised
            module._parameters[name] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype))
        try:
            model._init_weights(module)
            values = {name: module._parameters[name].detach() for name in own}
        finally:
            module._parameters.update(own)
        with torch.no_grad():
            for name, param in own.items():
                if isinstance(param, DTensor):
                    whole = DTensor.from_local(values[name].to(param.device), param.device_mesh,
                                               [Replicate()] * param.device_mesh.ndim, run_check=False)
                    param.to_local().copy_(whole.redistribute(param.device_mesh, param.placements).to_local())
                else:
                    param.copy_(values[name])


def mesh_of(model, rank: int) -> ModelMesh | None:
    """The mesh of a model transformers sharded at load time (a Trainer script's own
    ``from_pretrained(distributed_config=...)``), None for any other model."""
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if not is_sharded_by_transformers(model) or config is None:
        return None
    return ModelMesh(config=config, path=None, rank=rank)


def mesh_settings(model) -> dict[str, Any] | None:
    """:meth:`ModelMesh.settings` of :func:`mesh_of` (run.json, manifests), None without a mesh."""
    mesh = mesh_of(model, 0)
    return mesh.settings() if mesh is not None else None


def is_sharded_by_transformers(model) -> bool:
    """Whether ``from_pretrained(distributed_config=...)`` sharded ``model`` at load time."""
    return bool(getattr(model, "is_distributed_loading_by_transformers", False))


__all__ = ["ModelMesh", "check_mesh_launch", "initialize_new_weights_as_unsharded",
           "is_sharded_by_transformers", "load_model_mesh", "mesh_of", "mesh_settings", "prepare_sharded",
           "sum_over_samples", "trainer_launch_problem"]
