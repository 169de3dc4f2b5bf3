"""Accelerate's own view of a config, for the checker: its key lists and value sets (read from
accelerate itself, so they follow its version), how it parses a value, and
:func:`accelerate_view`: the file loaded exactly as ``accelerate launch`` does, with the
``FullyShardedDataParallelPlugin`` and ``ParallelismConfig`` it builds."""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any

from fsdp_presets.schema import BOOLEAN_FSDP_KEYS, FSDP_PREFIX, K, PARALLELISM_PREFIX, T

# The keys whose values are booleans. fsdp_reshard_after_forward is not one of them: `accelerate config`
# writes FSDP1 strategy names there, and its own rule checks FSDP2's booleans.
STRICT_BOOLEAN_FSDP_KEYS = tuple(name for name in BOOLEAN_FSDP_KEYS if name != K.reshard_after_forward)


# accelerate.utils.str_to_bool's spellings.
_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


# --------------------------------------------------------------------------- accelerate's own lists


def known_top_level_keys() -> frozenset[str]:
    """Keys ``ClusterConfig.from_yaml_file`` accepts (plus the legacy ones its ``process_config``
    converts)."""
    from accelerate.commands.config.config_args import ClusterConfig

    return frozenset(ClusterConfig.__dataclass_fields__) | {"fp16", T.dynamo_backend}


def _launch_dests() -> frozenset[str]:
    from accelerate.commands.launch import launch_command_parser

    return frozenset(action.dest for action in launch_command_parser()._actions)


def known_fsdp_keys() -> frozenset[str]:
    """``fsdp_config`` keys accelerate acts on: its ``accelerate launch --fsdp_*`` arguments, plus
    ``fsdp_ignored_modules`` (read from the config by ``prepare_multi_gpu_env``)."""
    return frozenset(dest for dest in _launch_dests() if dest.startswith(FSDP_PREFIX)) | {K.ignored_modules}


def known_parallelism_keys() -> frozenset[str]:
    return frozenset(dest for dest in _launch_dests() if dest.startswith(PARALLELISM_PREFIX))


def known_enumerations() -> dict[str, tuple[str, ...]]:
    from accelerate.utils.constants import (
        FSDP_AUTO_WRAP_POLICY,
        FSDP_BACKWARD_PREFETCH,
        FSDP_SHARDING_STRATEGY,
        FSDP_STATE_DICT_TYPE,
    )

    return {
        K.auto_wrap_policy: tuple(FSDP_AUTO_WRAP_POLICY),
        K.backward_prefetch: tuple(FSDP_BACKWARD_PREFETCH),
        K.sharding_strategy: tuple(FSDP_SHARDING_STRATEGY),
        K.state_dict_type: tuple(FSDP_STATE_DICT_TYPE),
    }


def known_distributed_types() -> tuple[str, ...]:
    from accelerate.utils import DistributedType

    return tuple(item.value for item in DistributedType)


def known_precisions() -> tuple[str, ...]:
    from accelerate.utils import PrecisionType

    return tuple(PrecisionType.list())


def as_boolean(value: Any) -> bool | None:
    """accelerate's reading of a boolean setting; None when it is not one."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    return None


def as_whole(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


SUGGESTION_CUTOFF = 0.75
"""difflib similarity a known name needs before ``check`` suggests it: near misspellings only
(``fsdp_reshard_after_foward``), never a different option (``fsdp_limit_all_gathers`` is not a
misspelt ``fsdp_min_num_params``: renaming it would put ``true`` into a size threshold)."""


def close_names(name: str, known, limit: int = 3) -> list[str]:
    import difflib

    return difflib.get_close_matches(name, sorted(known), n=limit, cutoff=SUGGESTION_CUTOFF)


def prefetch_key_meant(key, known) -> str | None:
    """The prefetch key (``fsdp_backward_prefetch``, ``fsdp_forward_prefetch``) a misspelt or old one
    stands for (``fsdp_backward_prefetch_policy``, accelerate's name before 1.0), among ``known``."""
    guesses = close_names(str(key), known, limit=1)
    return guesses[0] if guesses and guesses[0] in (K.backward_prefetch, K.forward_prefetch) else None


def did_you_mean(name: str, known) -> str:
    guesses = close_names(name, known)
    return f" (did you mean {' or '.join(repr(g) for g in guesses)}?)" if guesses else ""


def renamed_key(name: str, known, value: Any = None) -> str:
    """``rename it to 'x'`` when a known name is close and takes ``value``, else ``remove it``."""
    guesses = [guess for guess in close_names(name, known, limit=1) if _value_fits(guess, value)]
    return f"rename it to {guesses[0]!r}" if guesses else "remove it"


def _value_fits(key: str, value: Any) -> bool:
    """Whether accelerate would accept ``value`` for ``key`` (so a rename does not break the file)."""
    if value is None:
        return True
    if key in STRICT_BOOLEAN_FSDP_KEYS:
        return as_boolean(value) is not None
    if key == K.min_num_params:
        return as_whole(value) is not None
    if key in known_enumerations():
        return enumeration_name(key, value) is not None
    return True


def plugin_option_defaults() -> dict[str, Any]:
    """``fsdp_<field>`` -> default of every ``FullyShardedDataParallelPlugin`` field: real FSDP options,
    some of which ``accelerate launch`` never reads from a config file (``limit_all_gathers``)."""
    import dataclasses

    from accelerate.utils import FullyShardedDataParallelPlugin

    defaults = {}
    for item in dataclasses.fields(FullyShardedDataParallelPlugin):
        default = item.default if item.default is not dataclasses.MISSING else None
        defaults[item.name if item.name.startswith(FSDP_PREFIX) else f"{FSDP_PREFIX}{item.name}"] = default
    return defaults


def as_strategy_name(value: Any) -> str | None:
    """An FSDP1 sharding strategy as accelerate reads it (name or 1-based index), upper case."""
    from accelerate.utils.constants import FSDP_SHARDING_STRATEGY

    if as_whole(value) is not None and 1 <= as_whole(value) <= len(FSDP_SHARDING_STRATEGY):
        return FSDP_SHARDING_STRATEGY[as_whole(value) - 1]
    text = str(value).upper().lstrip("_")  # torch's enum spells it _HYBRID_SHARD_ZERO2; accelerate takes both
    return text if text in FSDP_SHARDING_STRATEGY else None


def enumeration_name(key: str, value: Any) -> str | None:
    """An ``fsdp_config`` enumeration value as accelerate's plugin reads it, as its upper-case name:
    the name in any case, or (sharding strategy, backward prefetch, state-dict type) torch's 1-based
    enum value, as a number or a string of digits (``fsdp_sharding_strategy: 1`` is FULL_SHARD);
    None when accelerate would refuse it (a YAML boolean included)."""
    if isinstance(value, bool):
        return None
    if key == K.sharding_strategy:
        return as_strategy_name(value)
    allowed = known_enumerations().get(key, ())
    number = as_whole(value)
    indexed = {K.backward_prefetch: 2, K.state_dict_type: 3}.get(key, 0)  # torch's BackwardPrefetch, StateDictType
    if number is not None:
        return allowed[number - 1] if 1 <= number <= indexed else None
    text = str(value).strip().upper()
    return text if text in allowed else None


def canonical_fsdp(fsdp: dict) -> dict:
    """``fsdp_config`` (keys already prefixed) with every value accelerate parses in its canonical
    form: enumeration names, booleans, whole-number version; values it refuses stay as written (the
    ``invalid-value`` rule reports them)."""
    enumerations = known_enumerations()
    canonical = {}
    for key, value in fsdp.items():
        if key in enumerations and value is not None:
            value = enumeration_name(key, value) or value
        elif key in STRICT_BOOLEAN_FSDP_KEYS and as_boolean(value) is not None:
            value = as_boolean(value)
        elif key in (K.version, K.min_num_params) and as_whole(value) is not None:
            value = as_whole(value)
        elif key == K.reshard_after_forward and not isinstance(value, bool):
            value = as_boolean(value) if as_boolean(value) is not None else (as_strategy_name(value) or value)
        canonical[key] = value
    return canonical


# --------------------------------------------------------------------------- accelerate's view


class AccelerateRejected(Exception):
    """Accelerate's own loading of the file raised: the message is accelerate's."""


@dataclass(kw_only=True)
class AccelerateView:
    """What ``accelerate launch`` makes of a config file on this host."""

    distributed_type: str
    """``FSDP``, ``MULTI_GPU``, ...: after accelerate's loader."""
    num_processes: int
    """Processes in the whole job."""
    num_machines: int
    """Nodes."""
    mixed_precision: str
    """``ACCELERATE_MIXED_PRECISION`` the launcher exports."""
    env: dict[str, str]
    """Environment variables the launcher sets for the training processes."""
    fsdp_plugin: Any = None
    """The ``FullyShardedDataParallelPlugin`` built from that environment (FSDP configs)."""
    parallelism: Any = None
    """The ``ParallelismConfig`` built from it (HSDP configs), else None."""
    processes_in_file: bool = True
    """False: the file has no num_processes and ``num_processes`` is the one assumed for the launch."""
    probe: Any = None
    """The :class:`fsdp_presets.check.wrap_probe.WrapProbe` of the model, when ``check`` proved the wrapping."""

    def fsdp_settings(self) -> dict | None:
        """The plugin's settings as plain values (for tests and ``check --json``)."""
        plugin = self.fsdp_plugin
        if plugin is None:
            return None

        def name(value):
            return getattr(value, "name", value) if value is not None else None

        offload = plugin.cpu_offload
        offload_params = getattr(offload, "offload_params", None)
        if offload_params is None:  # FSDP2: an OffloadPolicy; CPUOffloadPolicy means on
            offload_params = type(offload).__name__ == "CPUOffloadPolicy"
        return {
            K.version: plugin.fsdp_version,
            "reshard_after_forward": plugin.reshard_after_forward if plugin.fsdp_version == 2 else None,
            "sharding_strategy": name(plugin.sharding_strategy),
            "state_dict_type": name(plugin.state_dict_type),
            "auto_wrap_policy": getattr(plugin.auto_wrap_policy, "__name__", plugin.auto_wrap_policy),
            "transformer_cls_names_to_wrap": list(plugin.transformer_cls_names_to_wrap or []),
            "activation_checkpointing": bool(plugin.activation_checkpointing),
            "cpu_ram_efficient_loading": bool(plugin.cpu_ram_efficient_loading),
            "offload_params": bool(offload_params),
            "sync_module_states": plugin.sync_module_states,
            "use_orig_params": plugin.use_orig_params,
            "forward_prefetch": plugin.forward_prefetch,
            "backward_prefetch": name(plugin.backward_prefetch),
            "ignored_modules": plugin.ignored_modules,
        }

    def parallelism_sizes(self) -> dict | None:
        if self.parallelism is None:
            return None
        return {"dp_replicate_size": self.parallelism.dp_replicate_size, "dp_shard_size": self.parallelism.dp_shard_size}

    def mesh_sizes(self) -> dict | None:
        """Every dimension of the device mesh: replicate, shard, tensor, context and sequence parallel."""
        if self.parallelism is None:
            return None
        return {**self.parallelism_sizes(), "tp_size": self.parallelism.tp_size, "cp_size": self.parallelism.cp_size,
                "sp_size": getattr(self.parallelism, "sp_size", 1) or 1}

    def layout_label(self) -> str:
        """The parallelism layout in words: ``HSDP 2x4 (replicate 2 x shard 4)``, ``TP 2 x HSDP 2x2 (2x2x2)``,
        ``context parallel 8``, ``hybrid ZeRO-2 (HYBRID_SHARD_ZERO2)``; '' for plain FSDP."""
        settings = self.fsdp_settings() or {}
        if self.parallelism is None:
            return {"HYBRID_SHARD": "hybrid (HYBRID_SHARD: ZeRO-3 inside a node, replicas across nodes)",
                    "_HYBRID_SHARD_ZERO2": "hybrid ZeRO-2 (HYBRID_SHARD_ZERO2: gradients and optimizer state sharded "
                                           "inside a node, replicas across nodes)",
                    }.get(settings.get("sharding_strategy") or "", "")
        sizes = self.mesh_sizes()
        replicate, shard = sizes["dp_replicate_size"], sizes["dp_shard_size"]
        if replicate > 1 and shard > 1:
            data = f"HSDP {replicate}x{shard} (replicate {replicate} x shard {shard})"
        elif replicate > 1:
            data = f"replicate {replicate} (DDP-like, no sharding)"
        elif shard > 1:
            data = f"FSDP over {shard}"
        else:
            data = ""
        parts = [f"TP {sizes['tp_size']}" if sizes["tp_size"] > 1 else "",
                 f"context parallel {sizes['cp_size']}" if sizes["cp_size"] > 1 else "",
                 f"sequence parallel {sizes['sp_size']}" if (sizes["sp_size"] or 1) > 1 else "", data]
        dims = [size for size in (replicate, shard, sizes["tp_size"], sizes["cp_size"], sizes["sp_size"] or 1)
                if size > 1]
        label = " x ".join(part for part in parts if part)
        return label + (f" ({'x'.join(map(str, dims))} = {self.num_processes})" if len(dims) > 2 else "")


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``os.environ`` with ``values`` set, restored exactly afterwards (the plugin reads it)."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _as_on_a_gpu_host():
    """accelerate refuses FSDP1 ``sync_module_states`` when it finds no accelerator; building the
    plugin here only reads the config, so it is built as on the GPU node the config is meant for."""
    import accelerate.utils.dataclasses as accelerate_dataclasses

    original = accelerate_dataclasses.get_torch_accelerator_backend
    if original()[0] is not None:
        yield
        return
    accelerate_dataclasses.get_torch_accelerator_backend = lambda *args, **kwargs: ("cuda", None)
    try:
        yield
    finally:
        accelerate_dataclasses.get_torch_accelerator_backend = original


@contextlib.contextmanager
def _fp8_as_on_the_training_nodes():
    """accelerate's launcher refuses fp8 where neither torchao nor Transformer Engine is installed. That is a
    fact about the checking machine, not the file (the ``fp8-needs-backend`` note says what the training
    nodes need), so the file is loaded as on a node that has one."""
    import accelerate.utils.launch as accelerate_launch

    original = accelerate_launch.is_fp8_available
    accelerate_launch.is_fp8_available = lambda: True
    try:
        yield
    finally:
        accelerate_launch.is_fp8_available = original


def accelerate_view(path: str | os.PathLike, *, num_processes: int | None = None) -> AccelerateView:
    """Load ``path`` as ``accelerate launch --config_file PATH script.py`` does, and build the FSDP
    plugin and parallelism config from the environment it prepares. Raises AccelerateRejected
    with accelerate's message when any of that raises.

    ``num_processes``: what ``accelerate launch --num_processes`` would add (for a file without
    ``num_processes``, which accelerate refuses unless the command line gives it)."""
    import logging

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    accelerate_logger = logging.getLogger("accelerate")
    level = accelerate_logger.level
    accelerate_logger.setLevel(logging.ERROR)  # its launch warnings are for launches, not for a check
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            extra = ["--num_processes", str(num_processes)] if num_processes else []
            args = launch_command_parser().parse_args(["--config_file", str(path), *extra, "train.py"])
            args, defaults, _ = _validate_launch_command(args)
            distributed_type = str(getattr(defaults.distributed_type, "value", defaults.distributed_type))
            env: dict[str, str] = {}
            plugin = parallelism = None
            if args.use_fsdp or args.multi_gpu:
                args.main_process_port = 0  # a free port: the check must not depend on who holds 29500
                with _fp8_as_on_the_training_nodes():
                    prepared = prepare_multi_gpu_env(args)
                env = {key: value for key, value in prepared.items() if os.environ.get(key) != value}
            if args.use_fsdp:
                from accelerate.utils import FullyShardedDataParallelPlugin

                with _environment(env), _as_on_a_gpu_host():
                    plugin = FullyShardedDataParallelPlugin()
                    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true":
                        from accelerate.parallelism_config import ParallelismConfig

                        parallelism = ParallelismConfig()
            num_processes, num_machines = int(args.num_processes or 1), int(args.num_machines or 1)
    except SystemExit as error:  # argparse
        raise AccelerateRejected(f"accelerate's argument parser exited ({error})") from None
    except Exception as error:  # noqa: BLE001 - accelerate raises ValueError, KeyError, RuntimeError, ...
        text = " ".join(str(error).split())
        raise AccelerateRejected(f"{type(error).__name__}: {text}") from None
    finally:
        accelerate_logger.setLevel(level)
    return AccelerateView(
        distributed_type=distributed_type,
        num_processes=num_processes,
        num_machines=num_machines,
        mixed_precision=env.get("ACCELERATE_MIXED_PRECISION", str(args.mixed_precision)),
        env=env,
        fsdp_plugin=plugin,
        parallelism=parallelism,
    )
