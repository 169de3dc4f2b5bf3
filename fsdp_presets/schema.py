"""The accelerate config keys this project writes, reads and checks: one table, used both ways.

Every accelerate key name, top-level ones included, lives here and nowhere else: the emitter (:mod:`fsdp_presets.preset.emit`)
writes a :class:`~fsdp_presets.preset.presets.Preset` through :data:`FSDP_KEYS`, the checker
(:mod:`fsdp_presets.check.lint`) reads a file through it, and the tests' and scripts' config
writers build their YAML through the emitter. Code names a key by its short name::

    from fsdp_presets.schema import K, T, FSDP_CONFIG
    if config.get(T.distributed_type) == "FSDP": ...
    fsdp = config.get(FSDP_CONFIG) or {}
    if fsdp.get(K.sync_module_states) is False: ...
    f"set {K.sync_module_states}: true"            # the key as the user writes it

Defaults are accelerate 1.16's own, as ``accelerate launch --config_file`` applies them: the
launcher's argument defaults (``accelerate/commands/launch.py``, ``--fsdp_*``) become the
environment that ``FullyShardedDataParallelPlugin.__post_init__``
(``accelerate/utils/dataclasses.py``) reads; a key the launcher leaves unset falls back to the
plugin's own default (``fsdp_state_dict_type``: FULL_STATE_DICT for FSDP1, SHARDED_STATE_DICT for
FSDP2). ``tests/test_schema.py`` builds the plugin from an empty ``fsdp_config`` and compares.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType, SimpleNamespace
from typing import Any, Literal

FSDP_PREFIX = "fsdp_"
"""accelerate prefixes an ``fsdp_config`` key that lacks it (``version`` -> ``fsdp_version``)."""
PARALLELISM_PREFIX = "parallelism_config_"
ACCELERATE_ENV_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")
"""Environment variables through which ``accelerate launch`` passes a config to its processes."""
"""Prefix of every ``parallelism_config`` key."""

ValueType = Literal["bool", "int", "str", "enum", "mapping"]


@dataclass(frozen=True, kw_only=True)
class ConfigKey:
    """One key of an accelerate config file."""

    name: str
    """The key as written in the YAML (``fsdp_sync_module_states``)."""
    section: Literal["top", "fsdp", "parallelism"]
    """``top``: a top-level key; ``fsdp``: under ``fsdp_config``; ``parallelism``: under ``parallelism_config``."""
    type: ValueType
    """What accelerate takes: ``bool`` (its ``str_to_bool`` spellings), ``int``, ``str``, ``enum`` (one
    of accelerate's constant lists), ``mapping`` (a section)."""
    fsdp1: bool = True
    """The FSDP1 plugin applies it."""
    fsdp2: bool = True
    """The FSDP2 plugin applies it."""
    fsdp1_default: Any = None
    """What applies under FSDP1 when the key is missing (accelerate 1.16; None: nothing / not applied)."""
    fsdp2_default: Any = None
    """What applies under FSDP2 when the key is missing."""
    counterpart: str | None = None
    """The key the other FSDP version uses for the same setting (sharding strategy <-> reshard)."""
    plugin_field: str | None = None
    """The ``FullyShardedDataParallelPlugin`` attribute it sets."""
    preset: str | None = None
    """The :class:`~fsdp_presets.preset.presets.Preset` attribute path emitted as its value."""
    emitted: Any = None
    """A constant the emitter writes (where ``preset`` is None and ``emitted_for`` names versions)."""
    emitted_for: tuple[int, ...] = ()
    """FSDP versions whose emitted file holds the key (top-level keys: ``(1, 2)`` when written)."""
    why: str = ""
    """Why the project writes what it writes (the source of the emitted choice)."""
    fsdp2_behaves_like: Any = None
    """FSDP1-only keys: the value FSDP2 behaves like anyway (None: every value is moot under FSDP2)."""
    fsdp2_ignores: str = ""
    """FSDP1-only keys: what FSDP2 does instead (the checker's message)."""

    @property
    def short(self) -> str:
        """The name without its section prefix (``sync_module_states``; top-level keys: the name)."""
        prefix = {"fsdp": FSDP_PREFIX, "parallelism": PARALLELISM_PREFIX}.get(self.section, "")
        return self.name.removeprefix(prefix)

    def default(self, version: int) -> Any:
        """What applies when the key is missing in an FSDP``version`` config."""
        return self.fsdp2_default if version == 2 else self.fsdp1_default

    def valid_for(self, version: int) -> bool:
        return self.fsdp2 if version == 2 else self.fsdp1


def _fsdp(name: str, type: ValueType, **kwargs) -> ConfigKey:
    if not name.startswith(FSDP_PREFIX):
        raise ValueError(f"an fsdp_config key starts with {FSDP_PREFIX!r}: {name!r}")
    return ConfigKey(name=name, section="fsdp", type=type, **kwargs)


def _top(name: str, type: ValueType, **kwargs) -> ConfigKey:
    return ConfigKey(name=name, section="top", type=type, **kwargs)


# NOTE: the order of FSDP_KEYS is the order the emitter writes (that of `accelerate config`).
FSDP_KEYS: tuple[ConfigKey, ...] = (
    _fsdp("fsdp_version", "int", fsdp1_default=1, fsdp2_default=2, plugin_field="fsdp_version",
          preset="parallelism.fsdp_version", emitted_for=(1, 2),
          why="missing means FSDP1 (the launcher's --fsdp_version default is 1)"),
    _fsdp("fsdp_auto_wrap_policy", "enum", plugin_field="auto_wrap_policy", emitted="TRANSFORMER_BASED_WRAP",
          emitted_for=(1, 2), why="one FSDP unit per transformer block (missing: the whole model is one unit)"),
    _fsdp("fsdp_transformer_layer_cls_to_wrap", "str", plugin_field="transformer_cls_names_to_wrap",
          preset="wrap.classes", emitted_for=(1, 2),
          why="comma-separated class names; accelerate splits on ',' without stripping"),
    _fsdp("fsdp_reshard_after_forward", "bool", fsdp1=False, fsdp2_default=True, counterpart="fsdp_sharding_strategy",
          plugin_field="reshard_after_forward", preset="parallelism.reshard_after_forward", emitted_for=(2,),
          why="FSDP2's sharding: true is FULL_SHARD, false SHARD_GRAD_OP (`accelerate config` also writes an "
              "FSDP1 strategy name here, which the FSDP1 plugin does not read)"),
    _fsdp("fsdp_sharding_strategy", "enum", fsdp2=False, fsdp1_default="FULL_SHARD",
          counterpart="fsdp_reshard_after_forward", plugin_field="sharding_strategy", preset="parallelism.strategy",
          emitted_for=(1,), why="FSDP1's sharding (name or 1-based index)",
          fsdp2_ignores="FSDP2 ignores it and shards as fsdp_reshard_after_forward says (true: FULL_SHARD, "
                        "false: SHARD_GRAD_OP; HSDP via parallelism_config)"),
    _fsdp("fsdp_backward_prefetch", "enum", fsdp2=False, plugin_field="backward_prefetch", emitted="BACKWARD_PRE",
          emitted_for=(1,), fsdp2_behaves_like="BACKWARD_PRE",
          why="prefetch the next unit's all-gather during the current unit's backward (torch's default, "
              "BACKWARD_PRE): overlaps communication with compute",
          fsdp2_ignores="FSDP2 ignores it (it always prefetches the next unit in backward)"),
    _fsdp("fsdp_forward_prefetch", "bool", fsdp2=False, fsdp1_default=False, plugin_field="forward_prefetch",
          emitted=False, emitted_for=(1,), fsdp2_behaves_like=False,
          fsdp2_ignores="FSDP2 ignores it (accelerate has no forward prefetch for FSDP2)"),
    _fsdp("fsdp_use_orig_params", "bool", fsdp2=False, fsdp1_default=True, plugin_field="use_orig_params",
          emitted=True, emitted_for=(1,),
          why="original parameters stay visible: per-parameter optimizer groups (no weight decay on norms, "
              "biases, embeddings) and torch.compile need them",
          fsdp2_ignores="FSDP2 always uses the original parameters"),
    _fsdp("fsdp_sync_module_states", "bool", fsdp2=False, fsdp1_default=True, plugin_field="sync_module_states",
          emitted=True, emitted_for=(1,),
          why="broadcast rank 0's weights at wrap time; RAM-efficient loading depends on it",
          fsdp2_ignores="FSDP2 has no module-state sync (RAM-efficient loading broadcasts rank 0's weights "
                        "instead)"),
    _fsdp("fsdp_state_dict_type", "enum", fsdp1_default="FULL_STATE_DICT", fsdp2_default="SHARDED_STATE_DICT",
          plugin_field="state_dict_type", preset="state_dict.state_dict_type", emitted_for=(1, 2)),
    _fsdp("fsdp_cpu_ram_efficient_loading", "bool", fsdp1_default=True, fsdp2_default=True,
          plugin_field="cpu_ram_efficient_loading", preset="state_dict.cpu_ram_efficient_loading",
          emitted_for=(1, 2)),
    _fsdp("fsdp_offload_params", "bool", fsdp1_default=False, fsdp2_default=False, plugin_field="cpu_offload",
          preset="savers.offload", emitted_for=(1, 2)),
    _fsdp("fsdp_activation_checkpointing", "bool", fsdp1_default=False, fsdp2_default=False,
          plugin_field="activation_checkpointing", preset="savers.activation_checkpointing", emitted_for=(1, 2)),
    _fsdp("fsdp_activation_checkpointing_offload", "bool", fsdp1=False, fsdp2_default=False,
          plugin_field="activation_checkpointing_offload"),
    _fsdp("fsdp_min_num_params", "int", fsdp1_default=100_000_000, fsdp2_default=100_000_000,
          plugin_field="min_num_params", why="read only with SIZE_BASED_WRAP"),
    _fsdp("fsdp_ignored_modules", "str", plugin_field="ignored_modules",
          why="a regex of module names FSDP leaves out: neither sharded nor gradient-synchronised"),
)
"""The ``fsdp_config`` keys, in the order the emitter writes them."""

PARALLELISM_KEYS: tuple[ConfigKey, ...] = tuple(
    ConfigKey(name=name, section="parallelism", type="int", fsdp1=False, fsdp1_default=1,
              fsdp2_default=1, preset=preset, emitted_for=(2,) if preset else ())
    for name, preset in (("parallelism_config_dp_replicate_size", "parallelism.replicate_size"),
                         ("parallelism_config_dp_shard_size", "parallelism.shard_size"),
                         ("parallelism_config_tp_size", None), ("parallelism_config_cp_size", None),
                         ("parallelism_config_sp_size", None)))
"""The ``parallelism_config`` keys (the device mesh; FSDP2 only), written for HSDP presets."""

# NOTE: the order of TOP_LEVEL_KEYS's written keys is the order the emitter writes.
TOP_LEVEL_KEYS: tuple[ConfigKey, ...] = (
    _top("compute_environment", "enum", emitted="LOCAL_MACHINE", emitted_for=(1, 2)),
    _top("distributed_type", "enum", why="FSDP for a preset, MULTI_GPU for its DDP baseline", emitted_for=(1, 2)),
    _top("num_processes", "int", preset="parallelism.num_processes", emitted_for=(1, 2),
         why="all processes of all nodes; missing: the launch command gives it"),
    _top("num_machines", "int", fsdp1_default=1, fsdp2_default=1, preset="parallelism.num_machines",
         emitted_for=(1, 2)),
    _top("machine_rank", "int", fsdp1_default=0, fsdp2_default=0, emitted=0, emitted_for=(1, 2),
         why="each node's launch command passes its own --machine_rank"),
    _top("mixed_precision", "enum", fsdp1_default="no", fsdp2_default="no", preset="precision.mixed_precision",
         emitted_for=(1, 2)),
    _top("rdzv_backend", "str", fsdp1_default="static", fsdp2_default="static", emitted="static",
         emitted_for=(1, 2)),
    _top("same_network", "bool", fsdp1_default=False, fsdp2_default=False, emitted=True, emitted_for=(1, 2)),
    _top("use_cpu", "bool", fsdp1_default=False, fsdp2_default=False, emitted=False, emitted_for=(1, 2),
         why="false also for --device cpu presets: `use_cpu: true` makes accelerate launch plain MULTI_CPU "
             "processes without FSDP; fsdp_presets.enable_cpu_fsdp() runs the same config as real FSDP over gloo"),
    _top("main_process_ip", "str", why="checked: a fixed private address breaks other clusters"),
    _top("main_process_port", "int"),
    _top("debug", "bool", fsdp1_default=False, fsdp2_default=False, why="checked: it slows every collective"),
    _top("dynamo_backend", "enum", fsdp1_default="no", fsdp2_default="no"),
    _top("downcast_bf16", "str", fsdp1_default="no", fsdp2_default="no"),
    _top("enable_cpu_affinity", "bool", fsdp1_default=False, fsdp2_default=False),
    _top("gpu_ids", "str"),
    _top("main_training_function", "str", fsdp1_default="main", fsdp2_default="main"),
    _top("tpu_env", "str"),
    _top("tpu_use_cluster", "bool", fsdp1_default=False, fsdp2_default=False),
    _top("tpu_use_sudo", "bool", fsdp1_default=False, fsdp2_default=False),
    _top("fp8_config", "mapping", why="read for its backend (fp8 needs torchao or Transformer Engine)"),
    _top("fsdp_config", "mapping", why="the FSDP_KEYS section"),
    _top("parallelism_config", "mapping", fsdp1=False, why="the PARALLELISM_KEYS section (HSDP)"),
    _top("deepspeed_config", "mapping", why="another engine's section (a DDP baseline drops it)"),
    _top("megatron_lm_config", "mapping", why="another engine's section (a DDP baseline drops it)"),
)
"""The top-level keys this project writes or reads (accelerate's ``ClusterConfig`` fields)."""

FSDP_CONFIG = "fsdp_config"
"""Top-level key of the FSDP section."""
PARALLELISM_CONFIG = "parallelism_config"
"""Top-level key of the device-mesh section."""
PEFT_WRAP_POLICY = "fsdp_auto_wrap_policy"
"""peft's wrap-policy function (``peft.utils.other.fsdp_auto_wrap_policy``), which shares the key's
name: FSDP1 LoRA sets it on the plugin in place of accelerate's policy."""
SHARDING_SECTIONS = (FSDP_CONFIG, PARALLELISM_CONFIG, "deepspeed_config", "megatron_lm_config")
"""Top-level sections that make a config sharded: a DDP baseline keeps everything else."""

BY_NAME = MappingProxyType({key.name: key for key in TOP_LEVEL_KEYS + FSDP_KEYS + PARALLELISM_KEYS})
"""Every key of the table by its YAML name."""
FSDP_BY_SHORT = MappingProxyType({key.short: key for key in FSDP_KEYS})
"""The ``fsdp_config`` keys by their short name (``sync_module_states``)."""

T = SimpleNamespace(**{key.name: key.name for key in TOP_LEVEL_KEYS})
"""The top-level key names: ``T.num_processes == "num_processes"``, ``T.fsdp_config``."""
K = SimpleNamespace(**{key.short: key.name for key in FSDP_KEYS})
"""The ``fsdp_config`` key names by short name: ``K.sync_module_states == "fsdp_sync_module_states"``."""
P = SimpleNamespace(**{key.short: key.name for key in PARALLELISM_KEYS})
"""The ``parallelism_config`` key names by short name: ``P.dp_shard_size``."""

FSDP1_ONLY_KEYS = tuple(key.name for key in FSDP_KEYS if key.fsdp1 and not key.fsdp2)
FSDP2_ONLY_KEYS = tuple(key.name for key in FSDP_KEYS if key.fsdp2 and not key.fsdp1)
BOOLEAN_FSDP_KEYS = tuple(key.name for key in FSDP_KEYS if key.type == "bool")
INTEGER_FSDP_KEYS = tuple(key.name for key in FSDP_KEYS if key.type == "int")


def fsdp_key_name(key: Any) -> str:
    """``key`` as accelerate reads it under ``fsdp_config`` (it adds the prefix a key lacks)."""
    return key if str(key).startswith("fsdp") else f"{FSDP_PREFIX}{key}"


def fsdp_key(name: str) -> ConfigKey:
    """The table's ``fsdp_config`` key for a short or full name; ValueError naming the close ones."""
    found = FSDP_BY_SHORT.get(str(name).removeprefix(FSDP_PREFIX))
    if found is None:
        import difflib

        guesses = difflib.get_close_matches(str(name), list(FSDP_BY_SHORT), n=3)
        hint = f"; did you mean {' or '.join(guesses)}?" if guesses else ""
        raise ValueError(f"unknown fsdp_config key {name!r}{hint} known: {', '.join(FSDP_BY_SHORT)}")
    return found


def fsdp_where(name: str) -> str:
    """Where a finding points: ``fsdp_config.<name>``."""
    return f"{FSDP_CONFIG}.{name}"


def default(name: str, version: int) -> Any:
    """accelerate 1.16's value of key ``name`` when it is missing from an FSDP``version`` config."""
    return BY_NAME[name].default(version)


# ---- transformers' DistributedConfig: the sizes of a TP/EP mesh (NAME.distributed.json, run.json, manifests) ----
MESH_SIZE_KEYS = ("dp_replicate_size", "fsdp_size", "tp_size", "ep_size")
"""The mesh sizes transformers' ``DistributedConfig`` takes, as this project records them."""


def mesh_label(sizes: dict[str, Any]) -> str:
    """``FSDP 8 x TP 8``, ``HSDP 2 x FSDP 4 x TP 2``, ``FSDP 8 x EP 8``: a mesh as ``plan``,
    ``generate`` and ``inspect-checkpoint`` name it (a missing size counts as 1)."""
    size = {key: int(sizes.get(key) or 1) for key in MESH_SIZE_KEYS}
    parts = [f"HSDP {size['dp_replicate_size']}"] if size["dp_replicate_size"] > 1 else []
    parts.append(f"FSDP {size['fsdp_size']}")
    parts += [f"{name} {size[key]}" for name, key in (("TP", "tp_size"), ("EP", "ep_size")) if size[key] > 1]
    return " x ".join(parts)


__all__ = [
    "BOOLEAN_FSDP_KEYS",
    "BY_NAME",
    "ConfigKey",
    "FSDP1_ONLY_KEYS",
    "FSDP2_ONLY_KEYS",
    "FSDP_BY_SHORT",
    "FSDP_CONFIG",
    "FSDP_KEYS",
    "FSDP_PREFIX",
    "INTEGER_FSDP_KEYS",
    "K",
    "MESH_SIZE_KEYS",
    "P",
    "PEFT_WRAP_POLICY",
    "PARALLELISM_CONFIG",
    "PARALLELISM_KEYS",
    "PARALLELISM_PREFIX",
    "SHARDING_SECTIONS",
    "T",
    "TOP_LEVEL_KEYS",
    "default",
    "fsdp_key",
    "fsdp_key_name",
    "fsdp_where",
    "mesh_label",
]
