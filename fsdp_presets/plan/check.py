"""Check an accelerate config before a launch wastes cluster time: every problem at once.

Accelerate refuses unknown top-level keys, but it copies every ``fsdp_config`` and
``parallelism_config`` entry onto its launch arguments without looking: a misspelled or stale key
is silently ignored, and a wrong class name fails only once the job holds its GPUs. This module
reports each problem as a :class:`Finding` (stable rule id, severity, message, fix)::

    report = check_file("accelerate_configs/llama-3.1-8b_1x8.yaml", context=CheckContext(model=facts))
    report.errors        # findings that fail the check (exit 1); warnings and notes do not

The yardstick is accelerate 1.16's own behaviour: what accelerate accepts *and applies* is not an
error, even where it is not the newest spelling (``fsdp_reshard_after_forward: FULL_SHARD`` in an
FSDP1 file is what ``accelerate config`` writes); findings on defaults accelerate itself writes are
notes (severity ``note``, printed as one line); a fix is always one accelerate accepts; nothing
depends on the checking machine (fp8 says what the training nodes need), and without
``num_processes`` there is no GPU count or memory verdict.

Three layers:

* :func:`lint_config` (pure): the parsed YAML against accelerate's own key lists and value sets
  (read from accelerate itself, so they follow its version), the model (``--model``) and the
  planner.
* :func:`accelerate_view`: the file loaded exactly as ``accelerate launch`` does
  (``load_config_from_file``, its argument merge, ``prepare_multi_gpu_env``) and the
  ``FullyShardedDataParallelPlugin`` and ``ParallelismConfig`` accelerate builds from that
  environment; whatever accelerate raises becomes an ``accelerate-rejects`` finding (unless a rule
  above already names the same problem).
* ``check_file(..., prove_wrapping=True)``: accelerate's FSDP preparation of the model itself
  under a fake process group (:mod:`fsdp_presets.plan.wrap_probe`): a crash in ``prepare`` and
  parameters in no unit become findings, and the real unit list is shown.

Rule ids are stable (the docs cite them): see :data:`RULES`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from fsdp_presets.errors import closest_names
from fsdp_presets.plan.planner import GiB, Hardware, TrainingShape, plan
from fsdp_presets.plan.presets import DEFAULT_GPU_MEMORY_GIB, DEFAULT_HOST_MEMORY_GIB, full_state_dict_host_bytes
from fsdp_presets.plan.profile import ModelProfile

Severity = Literal["error", "warning", "note"]

RULES = MappingProxyType({
    # rule id: (severity, what it catches)
    "yaml-invalid": ("error", "the file is not YAML, or not a mapping of accelerate settings"),
    "accelerate-rejects": ("error", "accelerate's own loader, launcher or FSDP plugin raises on the file"),
    "unknown-key": ("error", "a top-level key accelerate does not know (accelerate refuses the whole file)"),
    "unknown-fsdp-key": ("error", "an fsdp_config key accelerate does not know (silently ignored)"),
    "unknown-parallelism-key": ("error", "a parallelism_config key accelerate does not know (silently ignored)"),
    "invalid-value": ("error", "a value accelerate does not accept (enumerations, booleans, counts)"),
    "fsdp-version-missing": ("note", "no fsdp_version: accelerate launch runs FSDP1 (its default)"),
    "fsdp1-key-under-fsdp2": ("error", "an FSDP1-only key in an FSDP2 config: ignored (or refused)"),
    "fsdp2-key-under-fsdp1": ("error", "an FSDP2-only key in an FSDP1 config: ignored (or refused)"),
    "hsdp-needs-fsdp2": ("error", "parallelism_config with FSDP1: accelerate requires FSDP2 for it"),
    "hsdp-size-mismatch": ("error", "HSDP replicate x shard sizes do not multiply to num_processes"),
    "hsdp-shard-spans-nodes": ("error", "the HSDP shard size does not fit the GPUs of one node"),
    "machines-do-not-divide": ("error", "num_processes is not a multiple of num_machines"),
    "no-wrap-policy": ("warning", "FSDP without an auto-wrap policy: the whole model is one unit"),
    "wrap-classes-unset": ("note", "TRANSFORMER_BASED_WRAP without classes: accelerate wraps the model's "
                                   "_no_split_modules"),
    "no-split-modules-missing": ("error", "classes left to _no_split_modules include some the model lacks"),
    "wrap-class-format": ("error", "fsdp_transformer_layer_cls_to_wrap is not a comma-separated string of names"),
    "wrap-class-not-in-model": ("error", "a wrap class that does not exist in the model (--model)"),
    "wrap-class-not-a-block": ("warning", "a wrap class that is in the model but is not one of its blocks"),
    "ignored-modules": ("error", "fsdp_ignored_modules set: those parameters are not gradient-synchronised"),
    "ram-efficient-loading-needs-sync": ("error", "RAM-efficient loading with fsdp_sync_module_states false "
                                                  "(accelerate launch refuses it)"),
    "ram-efficient-loading-off": ("error", "every process loads the full model: more than the node's host RAM"),
    "full-state-dict-host-memory": ("error", "FULL_STATE_DICT gathers more than rank 0's host RAM"),
    "offload-host-memory": ("error", "the offloaded model states of a node exceed its host RAM"),
    "offload-on-cpu": ("error", "CPU offload in a config for a CPU-only host"),
    "fp32-does-not-fit": ("warning", "fp32 does not fit the GPUs (bf16 would)"),
    "does-not-fit": ("warning", "the planner finds the config does not fit the GPUs at micro-batch 1"),
    "fp16-on-bf16-model": ("warning", "fp16 mixed precision on a model trained in bf16"),
    "fsdp-config-ignored": ("warning", "fsdp_config in a config whose distributed_type is not FSDP"),
    "ignored-default": ("note", "a key accelerate accepts but does not apply, set to what applies anyway"),
    "key-not-applied": ("warning", "a real FSDP option accelerate launch does not pass on from a config file"),
    "num-processes-unset": ("note", "no num_processes: the launch command gives it (no GPU count or memory verdict)"),
    "fp8-needs-backend": ("note", "fp8 needs torchao or Transformer Engine installed on the training nodes"),
    "memory-assumes-full-finetune": ("warning", "memory verdicts that hold for full fine-tuning; the method is "
                                                "not known (pass --method full)"),
    "prepare-crashes": ("error", "accelerate's FSDP preparation of the model (--model) raises"),
    "params-outside-units": ("error", "parameters of the model that no FSDP unit shards"),
    "num-processes-vs-header": ("error", "num_processes or num_machines edited away from the generated "
                                         "header's batch arithmetic"),
    "fsdp-single-process": ("warning", "FSDP on one process: nothing is sharded"),
    "fixed-main-process-ip": ("warning", "a fixed private main_process_ip in a multi-machine config"),
    "full-shard-across-nodes": ("warning", "sharding across nodes without a hybrid layout (HSDP keeps "
                                           "all-gathers inside a node)"),
    "lora-fsdp1-flat-params": ("warning", "LoRA under FSDP1 with fsdp_use_orig_params false: flat parameters mix "
                                          "frozen and trainable weights"),
    "qlora-fsdp1": ("warning", "QLoRA under FSDP1: the 4-bit base is flattened (only bf16 quant storage and peft's "
                               "wrap policy work)"),
    "qlora-full-state-dict": ("warning", "QLoRA with FULL_STATE_DICT: accelerate's load_state fails on the 4-bit "
                                         "quantization-state keys"),
})
"""Every rule: id -> (severity, what it catches). Ids never change meaning; new rules get new ids."""

FSDP1_ONLY_KEYS = ("fsdp_sharding_strategy", "fsdp_backward_prefetch", "fsdp_forward_prefetch",
                   "fsdp_use_orig_params", "fsdp_sync_module_states")
FSDP2_ONLY_KEYS = ("fsdp_reshard_after_forward", "fsdp_activation_checkpointing_offload")
_BOOLEAN_FSDP_KEYS = ("fsdp_offload_params", "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states",
                      "fsdp_use_orig_params", "fsdp_forward_prefetch", "fsdp_activation_checkpointing",
                      "fsdp_activation_checkpointing_offload")
# accelerate.utils.str_to_bool's spellings.
_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One problem in a config."""

    rule: str
    """Stable rule id, a key of :data:`RULES`."""
    severity: Severity
    """``error`` fails the check; ``warning`` does not; ``note``: accelerate's own default applies (the
    command prints all notes of a file on one line)."""
    message: str
    """What is wrong, with the values involved."""
    fix: str
    """What to change."""
    key: str | None = None
    """Where: ``fsdp_config.fsdp_version``, ``num_processes``; None for the whole file."""

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown rule id {self.rule!r}")
        if self.severity not in ("error", "warning", "note"):
            raise ValueError(f"severity must be error, warning or note, got {self.severity!r}")

    def to_json(self) -> dict:
        return {"rule": self.rule, "severity": self.severity, "key": self.key, "message": self.message,
                "fix": self.fix}


def finding(rule: str, message: str, fix: str, key: str | None = None) -> Finding:
    """A finding with the rule's own severity."""
    return Finding(rule=rule, severity=RULES[rule][0], message=message, fix=fix, key=key)


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What the checker knows about the model the config will train (``--model``)."""

    source: str
    """What the user named (family, folder, config.json)."""
    profile: ModelProfile
    """The model's FSDP anatomy."""
    module_classes: frozenset[str]
    """Class names of every module in the built model (for "did you mean")."""
    trust_remote_code: bool = False
    """The model was built with its own code (``auto_map``); the wrap probe builds it the same way."""


@dataclass(frozen=True, kw_only=True)
class CheckContext:
    """Everything besides the file that the rules read."""

    model: ModelFacts | None = None
    """The model, when ``--model`` was given (enables the class and memory rules)."""
    device: Literal["gpu", "cpu"] | None = None
    """``cpu`` for a CPU-only host; None: the file's fsdp-presets metadata, else ``gpu``."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU, for the planner rules; None: the file's metadata, else 80."""
    host_memory_gib: float | None = None
    """Host RAM of one node (rank 0's node), for the state-dict, loading and offload rules; None:
    the file's metadata, else 1024 (8-GPU nodes carry 1-2 TiB)."""
    seq_len: int | None = None
    """Sequence length for the planner rules; None: the file's metadata, else 2048."""
    metadata: dict | None = None
    """The file's ``# fsdp-presets:`` document, when it has one."""
    gpus: int | None = None
    """Processes in the whole job when the file has no ``num_processes`` (``accelerate launch
    --num_processes``); None: no GPU count or memory verdict for such a file."""
    method: Literal["full", "lora", "qlora"] | None = None
    """The training method: ``full`` makes the memory rules (which count gradients and AdamW state for
    every parameter) errors, ``lora``/``qlora`` plan them for an adapter over a frozen (4-bit) base and
    add the LoRA rules; None: the file's metadata says, else unknown (one warning instead)."""
    lora: Any = None
    """The adapter's :class:`~fsdp_presets.plan.planner.LoraShape` for ``lora``/``qlora`` (default: the
    file's metadata, else r 16 on every projection of the block)."""

    def __post_init__(self) -> None:
        if self.device not in (None, "gpu", "cpu"):
            raise ValueError(f"device must be gpu or cpu, got {self.device!r}")
        if any(value is not None and not value > 0 for value in (self.gpu_memory_gib, self.host_memory_gib)):
            raise ValueError("memory sizes must be positive")
        if self.gpus is not None and self.gpus < 1:
            raise ValueError("gpus must be >= 1")
        if self.method not in (None, "full", "lora", "qlora"):
            raise ValueError(f"method must be full, lora, qlora or None, got {self.method!r}")

    def _from_request(self, name: str):
        return ((self.metadata or {}).get("request") or {}).get(name)

    @property
    def gpu_gib(self) -> float:
        return self.gpu_memory_gib or self._from_request("gpu_memory_gib") or DEFAULT_GPU_MEMORY_GIB

    @property
    def training_method(self) -> str | None:
        """``full``, ``lora`` or ``qlora`` when known (``--method`` or a generated preset's header), else None."""
        if self.method:
            return self.method
        if self.metadata and self.metadata.get("kind") == "fsdp":
            return (self.metadata.get("request") or {}).get("method") or "full"
        return None

    @property
    def host_gib(self) -> float:
        device = self.device or self._from_request("device") or "gpu"
        return self.host_memory_gib or self._from_request("host_memory_gib") or DEFAULT_HOST_MEMORY_GIB[device]


@dataclass(kw_only=True)
class CheckReport:
    """The findings of one file."""

    path: str
    """The file checked."""
    findings: list[Finding] = field(default_factory=list)
    """Every problem found, errors first."""

    @property
    def errors(self) -> list[Finding]:
        return [item for item in self.findings if item.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [item for item in self.findings if item.severity == "warning"]

    @property
    def notes(self) -> list[Finding]:
        return [item for item in self.findings if item.severity == "note"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def rules(self) -> set[str]:
        return {item.rule for item in self.findings}

    def to_json(self) -> dict:
        return {"path": self.path, "ok": self.ok, "errors": len(self.errors), "warnings": len(self.warnings),
                "notes": len(self.notes), "findings": [item.to_json() for item in self.findings]}


# --------------------------------------------------------------------------- accelerate's own lists


def known_top_level_keys() -> frozenset[str]:
    """Keys ``ClusterConfig.from_yaml_file`` accepts (plus the legacy ones its ``process_config``
    converts)."""
    from accelerate.commands.config.config_args import ClusterConfig

    return frozenset(ClusterConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}


def _launch_dests() -> frozenset[str]:
    from accelerate.commands.launch import launch_command_parser

    return frozenset(action.dest for action in launch_command_parser()._actions)


def known_fsdp_keys() -> frozenset[str]:
    """``fsdp_config`` keys accelerate acts on: its ``accelerate launch --fsdp_*`` arguments, plus
    ``fsdp_ignored_modules`` (read from the config by ``prepare_multi_gpu_env``)."""
    return frozenset(dest for dest in _launch_dests() if dest.startswith("fsdp_")) | {"fsdp_ignored_modules"}


def known_parallelism_keys() -> frozenset[str]:
    return frozenset(dest for dest in _launch_dests() if dest.startswith("parallelism_config_"))


def _enumerations() -> dict[str, tuple[str, ...]]:
    from accelerate.utils.constants import (
        FSDP_AUTO_WRAP_POLICY,
        FSDP_BACKWARD_PREFETCH,
        FSDP_SHARDING_STRATEGY,
        FSDP_STATE_DICT_TYPE,
    )

    return {
        "fsdp_auto_wrap_policy": tuple(FSDP_AUTO_WRAP_POLICY),
        "fsdp_backward_prefetch": tuple(FSDP_BACKWARD_PREFETCH),
        "fsdp_sharding_strategy": tuple(FSDP_SHARDING_STRATEGY),
        "fsdp_state_dict_type": tuple(FSDP_STATE_DICT_TYPE),
    }


def _distributed_types() -> tuple[str, ...]:
    from accelerate.utils import DistributedType

    return tuple(item.value for item in DistributedType)


def _precisions() -> tuple[str, ...]:
    from accelerate.utils import PrecisionType

    return tuple(PrecisionType.list())


# --------------------------------------------------------------------------- the pure rules


def _boolean(value: Any) -> bool | None:
    """accelerate's reading of a boolean setting; None when it is not one."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    return None


def _whole(value: Any) -> int | None:
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


def _close(name: str, known, limit: int = 3) -> list[str]:
    import difflib

    return difflib.get_close_matches(name, sorted(known), n=limit, cutoff=SUGGESTION_CUTOFF)


def _did_you_mean(name: str, known) -> str:
    guesses = _close(name, known)
    return f" (did you mean {' or '.join(repr(g) for g in guesses)}?)" if guesses else ""


def _rename(name: str, known, value: Any = None) -> str:
    """``rename it to 'x'`` when a known name is close and takes ``value``, else ``remove it``."""
    guesses = [guess for guess in _close(name, known, limit=1) if _value_fits(guess, value)]
    return f"rename it to {guesses[0]!r}" if guesses else "remove it"


def _value_fits(key: str, value: Any) -> bool:
    """Whether accelerate would accept ``value`` for ``key`` (so a rename does not break the file)."""
    if value is None:
        return True
    if key in _BOOLEAN_FSDP_KEYS:
        return _boolean(value) is not None
    if key == "fsdp_min_num_params":
        return _whole(value) is not None
    allowed = _enumerations().get(key)
    if allowed is not None:
        return str(value).upper() in allowed
    return True


def plugin_option_defaults() -> dict[str, Any]:
    """``fsdp_<field>`` -> default of every ``FullyShardedDataParallelPlugin`` field: real FSDP options,
    some of which ``accelerate launch`` never reads from a config file (``limit_all_gathers``)."""
    import dataclasses

    from accelerate.utils import FullyShardedDataParallelPlugin

    defaults = {}
    for item in dataclasses.fields(FullyShardedDataParallelPlugin):
        default = item.default if item.default is not dataclasses.MISSING else None
        defaults[item.name if item.name.startswith("fsdp_") else f"fsdp_{item.name}"] = default
    return defaults


def lint_config(config: Any, *, context: CheckContext = CheckContext()) -> list[Finding]:
    """Every problem the rules find in a parsed accelerate config (``yaml.safe_load`` output)."""
    if not isinstance(config, dict):
        return [finding("yaml-invalid", f"the file holds {type(config).__name__}, not a mapping of settings",
                        "write accelerate's keys (`accelerate config` or `fsdp-presets generate`)")]
    findings: list[Finding] = []
    findings += _top_level(config)
    distributed_type = str(config.get("distributed_type", ""))
    fsdp = config.get("fsdp_config") or {}
    parallelism = config.get("parallelism_config") or {}
    if not isinstance(fsdp, dict):
        findings.append(finding("invalid-value", f"fsdp_config must be a mapping, got {type(fsdp).__name__}",
                                "indent the fsdp_* keys under fsdp_config:", "fsdp_config"))
        fsdp = {}
    if not isinstance(parallelism, dict):
        findings.append(finding("invalid-value", "parallelism_config must be a mapping",
                                "indent the parallelism_config_* keys under parallelism_config:", "parallelism_config"))
        parallelism = {}
    # accelerate adds the prefix to fsdp_config keys that lack it (launch.py: "fsdp_" + key).
    fsdp = {(key if str(key).startswith("fsdp") else f"fsdp_{key}"): value for key, value in fsdp.items()}
    processes, machines = _whole(config.get("num_processes", 1)), _whole(config.get("num_machines", 1))
    if "num_processes" not in config and str(config.get("distributed_type", "")) == "FSDP":
        processes = context.gpus
        findings.append(finding(
            "num-processes-unset", "no num_processes: the file is meant for `accelerate launch --num_processes N`"
            + (f"; checked for --gpus {context.gpus}" if context.gpus else "; no GPU count or memory verdict"),
            "pass --num_processes (all GPUs of all nodes) to accelerate launch"
            + ("" if context.gpus else ", and --gpus N to `fsdp-presets check` for the memory rules"),
            "num_processes"))
    layout_ok = processes is not None and machines is not None and processes >= 1 and machines >= 1
    if layout_ok and processes % machines:
        findings.append(finding(
            "machines-do-not-divide",
            f"num_processes {processes} is not a multiple of num_machines {machines}: accelerate starts "
            f"num_processes // num_machines = {processes // machines} processes per node, "
            f"{processes // machines * machines} in all",
            f"set num_processes to a multiple of {machines} (e.g. {max(1, processes // machines) * machines})",
            "num_processes"))
    if distributed_type != "FSDP":
        if fsdp:
            findings.append(finding("fsdp-config-ignored", f"distributed_type is {distributed_type or 'unset'}: "
                                    "fsdp_config is ignored", "set distributed_type: FSDP, or drop fsdp_config",
                                    "fsdp_config"))
        return _sorted(findings)

    version = _whole(fsdp.get("fsdp_version"))
    if "fsdp_version" not in fsdp:
        findings.append(finding("fsdp-version-missing", "no fsdp_version: `accelerate launch` runs FSDP1 "
                                "(FullyShardedDataParallel), its default", "nothing to do for FSDP1 (fsdp_version: 1 "
                                "says so); FSDP2 also needs the FSDP1 keys rewritten (docs/configuration.md)",
                                "fsdp_config"))
        version = 1
    elif version not in (1, 2):
        findings.append(finding("invalid-value", f"fsdp_version {fsdp['fsdp_version']!r} is not 1 or 2",
                                "set fsdp_version: 2", "fsdp_config.fsdp_version"))
        version = None
    findings += _fsdp_keys(fsdp, version)
    findings += _parallelism(parallelism, version, processes if layout_ok else None, machines if layout_ok else None)
    findings += _wrapping(fsdp, context)
    findings += _layout(config, fsdp, parallelism, version, context, processes if layout_ok else None,
                        machines if layout_ok else None)
    if str(config.get("mixed_precision", "")).lower() == "fp8":
        backend = str((config.get("fp8_config") or {}).get("backend", "AO")).upper()
        package = {"TE": "Transformer Engine", "MSAMP": "MS-AMP", "MS-AMP": "MS-AMP"}.get(backend, "torchao")
        findings.append(finding(
            "fp8-needs-backend", f"mixed_precision fp8 needs {package} installed on the training nodes at launch "
            "(accelerate refuses fp8 where it finds neither torchao nor Transformer Engine)",
            f"install {package} in the training environment", "mixed_precision"))
    if fsdp.get("fsdp_ignored_modules"):
        findings.append(finding(
            "ignored-modules", f"fsdp_ignored_modules is set ({fsdp['fsdp_ignored_modules']!r}): FSDP neither "
            "shards nor gradient-synchronises ignored parameters, so each rank updates its own copy and the "
            "replicas drift apart", "remove fsdp_ignored_modules; keep embeddings and heads in FSDP units (the "
            "root or tail unit holds them)", "fsdp_config.fsdp_ignored_modules"))
    ram_efficient = _boolean(fsdp.get("fsdp_cpu_ram_efficient_loading", True))
    sync = _boolean(fsdp.get("fsdp_sync_module_states", True))
    if ram_efficient and sync is False:
        findings.append(finding(
            "ram-efficient-loading-needs-sync", "fsdp_cpu_ram_efficient_loading is true but "
            "fsdp_sync_module_states is false: accelerate launch refuses this (ranks other than 0 start with empty "
            "weights that only the sync fills)", "set fsdp_sync_module_states: true (or remove it)",
            "fsdp_config.fsdp_sync_module_states"))
    findings += _lora_rules(fsdp, version, context)
    memory = _device_and_memory(config, fsdp, parallelism, version, context,
                                processes if layout_ok else None, machines if layout_ok else None)
    full_finetune_only = [item for item in memory if item.rule in FULL_FINETUNE_RULES]
    if full_finetune_only and context.training_method is None:
        # The file does not say how it trains: LoRA/QLoRA keep gradients and optimizer state for a
        # small fraction of the parameters, so these verdicts would be wrong errors for them.
        memory = [item for item in memory if item.rule not in FULL_FINETUNE_RULES]
        memory.append(finding(
            "memory-assumes-full-finetune", "the memory rules assume full fine-tuning (gradients and AdamW state for "
            "every parameter), and this file does not say how it trains. If it is full fine-tuning: " + "; ".join(
                f"{item.rule}: {item.message} (fix: {item.fix})" for item in full_finetune_only),
            "pass --method full to check it as full fine-tuning; for LoRA/QLoRA these verdicts do not apply",
            full_finetune_only[0].key))
    findings += memory
    return _sorted(findings)


def lora_shape(context: CheckContext):
    """The :class:`~fsdp_presets.plan.planner.LoraShape` the memory rules plan with, None for full."""
    from fsdp_presets.plan.planner import LoraShape

    method = context.training_method
    if method not in ("lora", "qlora"):
        return None
    if context.lora is not None:
        return context.lora
    recorded = (context.metadata or {}).get("request") or {}
    if recorded.get("method") != method:  # --method given for a file whose header says otherwise
        return LoraShape(method=method)
    try:
        targets = recorded.get("lora_target_modules")
        return LoraShape(method=method, r=int(recorded.get("lora_r") or 16), alpha=recorded.get("lora_alpha"),
                         dropout=float(recorded.get("lora_dropout") or 0.0),
                         target_modules=tuple(name.strip() for name in targets.split(",")) if targets else None)
    except Exception:  # noqa: BLE001 - a header edited by hand: plan the default adapter
        return LoraShape(method=method)


def _lora_rules(fsdp: dict, version, context: CheckContext) -> list[Finding]:
    """The LoRA/QLoRA failures a config file and the method reveal (docs/troubleshooting.md)."""
    method = context.training_method
    if method not in ("lora", "qlora"):
        return []
    findings = []
    if version == 1 and _boolean(fsdp.get("fsdp_use_orig_params", True)) is False:
        findings.append(finding(
            "lora-fsdp1-flat-params", f"{method} under FSDP1 with fsdp_use_orig_params: false: each flat parameter "
            "must hold weights of one requires_grad, so with the layer wrapping of this file FSDP1 raises 'Must "
            "flatten tensors with uniform requires_grad' unless the training script replaces the wrap policy with "
            "peft's fsdp_auto_wrap_policy (transformers' Trainer and trl do; a plain accelerate script does not)",
            "set fsdp_version: 2 (fsdp-presets generate --method " + method + "), or fsdp_use_orig_params: true "
            "and peft's fsdp_auto_wrap_policy(model) on the plugin before prepare, with the optimizer built after "
            "preparing the model", "fsdp_config.fsdp_use_orig_params"))
    if method == "qlora" and version == 1:
        findings.append(finding(
            "qlora-fsdp1", "QLoRA under FSDP1: FSDP1 flattens each unit into one tensor of one dtype, which works "
            "only when the whole unit shares it: bnb_4bit_quant_storage=bfloat16 with norms and adapters in bf16 "
            "too and peft's wrap policy (fp32 norms or adapters: 'Must flatten tensors with uniform dtype'; uint8 "
            "storage: 'Cannot flatten integer dtype tensors'; torchao NF4: 'aten.view(NF4Tensor)' not implemented; "
            "this project's recipes refuse --load-in-4bit under FSDP1); the adapter export under FSDP1 needs the "
            "trainable weights gathered with torch's get_model_state_dict (peft's own save writes zero tensors)",
            "set fsdp_version: 2 with TRANSFORMER_BASED_WRAP on the decoder layer (fsdp-presets generate --method "
            "qlora); keep bnb_4bit_quant_storage=bfloat16", "fsdp_config.fsdp_version"))
    state_dict = str(fsdp.get("fsdp_state_dict_type", "SHARDED_STATE_DICT" if version == 2 else
                              "FULL_STATE_DICT")).upper()
    if method == "qlora" and state_dict == "FULL_STATE_DICT":
        findings.append(finding(
            "qlora-full-state-dict", "QLoRA with FULL_STATE_DICT" + (" (accelerate's FSDP1 default)" if
            "fsdp_state_dict_type" not in fsdp else "") + ": accelerate's save_state gathers the frozen 4-bit base "
            "onto rank 0 at every save, and load_state fails on its quantization-state keys (absmax, quant_map), so "
            "the run cannot resume from it", "set fsdp_state_dict_type: SHARDED_STATE_DICT and resume from "
            "trainable-only (adapter + optimizer) checkpoints, as the recipes' --lora-r/--load-in-4bit do",
            "fsdp_config.fsdp_state_dict_type"))
    return findings


FULL_FINETUNE_RULES = frozenset({"full-state-dict-host-memory", "offload-host-memory", "fp32-does-not-fit",
                                 "does-not-fit"})
"""Memory rules that count gradients and optimizer state for every parameter."""


_PRIVATE_PREFIXES = ("10.", "192.168.", "127.", "169.254.") + tuple(f"172.{n}." for n in range(16, 32))


def _layout(config, fsdp, parallelism, version, context, processes, machines) -> list[Finding]:
    """Rules on the process layout: one process, nodes, rendezvous address, the header's arithmetic."""
    findings = []
    if processes == 1 and machines == 1:
        findings.append(finding(
            "fsdp-single-process", "distributed_type FSDP with num_processes 1: one process shards nothing (every "
            "unit holds the whole model) and pays FSDP's gathers for it",
            "set num_processes to the number of GPUs; for one GPU use distributed_type: 'NO'", "num_processes"))
    if machines and machines > 1:
        address = str(config.get("main_process_ip") or "")
        if address.startswith(_PRIVATE_PREFIXES) or address == "localhost":
            findings.append(finding(
                "fixed-main-process-ip", f"main_process_ip {address} is fixed in a config for {machines} machines: "
                "it is the address of one node of one cluster (private or loopback), so on other machines every node "
                "waits at rendezvous for a host that is not there", "remove main_process_ip from the file and pass "
                "--main_process_ip $MASTER_ADDR (the first node of the job) on each node's accelerate launch command",
                "main_process_ip"))
        replicate = _whole((parallelism or {}).get("parallelism_config_dp_replicate_size", 1)) or 1
        strategy = _strategy_name(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")) if version == 1 else None
        # (FSDP1 with a replicate size asks for HSDP too: hsdp-needs-fsdp2 reports that one)
        hybrid = replicate > 1 if version in (1, 2) and parallelism else strategy in ("HYBRID_SHARD",
                                                                                   "HYBRID_SHARD_ZERO2")
        hybrid = hybrid or strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
        # A deliberate choice when HSDP does not fit one node's GPUs (the planner says so with a model).
        if version in (1, 2) and not hybrid and strategy != "NO_SHARD" and processes and \
                _hybrid_fits(config, fsdp, context, processes, machines) is not False:
            per_node = processes // machines
            fix = (f"shard inside a node, replicate across nodes (HSDP): parallelism_config: "
                   f"parallelism_config_dp_replicate_size: {machines}, parallelism_config_dp_shard_size: {per_node}"
                   if version == 2 else "fsdp_sharding_strategy: HYBRID_SHARD (ZeRO-3 inside a node, replicas "
                   "across nodes)")
            findings.append(finding(
                "full-shard-across-nodes", f"FSDP shards over all {processes} processes of {machines} nodes: every "
                "unit's all-gather and reduce-scatter crosses the network each step (usually several times slower "
                "than inside a node)", fix + "; keep full sharding only when the model does not fit one node's GPUs",
                "parallelism_config" if version == 2 else "fsdp_config.fsdp_sharding_strategy"))
    summary = (context.metadata or {}).get("summary") or {}
    header_processes, header_machines = summary.get("processes"), summary.get("machines")
    if context.metadata and context.metadata.get("kind") == "fsdp" and header_processes and "num_processes" in config:
        file_processes, file_machines = _whole(config.get("num_processes")), _whole(config.get("num_machines", 1))
        if (file_processes, file_machines) != (header_processes, header_machines or 1) and file_processes:
            dp = summary.get("data_parallel_size") or header_processes
            micro, accumulation = summary.get("micro_batch"), summary.get("gradient_accumulation")
            new_dp = file_processes * dp // header_processes
            arithmetic = (f"global batch {summary.get('global_batch')} = micro-batch {micro} x {accumulation} "
                          f"accumulation x {dp} data-parallel processes" if micro and accumulation else
                          f"{header_processes} processes")
            effect = (f"; with num_processes {file_processes} one optimizer step takes {micro * accumulation * new_dp} "
                      "sequences, and the header's plan (memory, learning-rate schedule) no longer describes this file"
                      if micro and accumulation else "")
            command = "the header's `fsdp-presets generate` command with --gpus " + str(file_processes) + (
                f" --nodes {file_machines}" if file_machines and file_machines > 1 else "")
            findings.append(finding(
                "num-processes-vs-header", f"num_processes {file_processes} / num_machines {file_machines} were edited "
                f"away from the generated header ({header_processes} processes on {header_machines or 1} node(s): "
                f"{arithmetic}){effect}", f"regenerate for the new GPU count ({command}), or set num_processes back "
                f"to {header_processes}", "num_processes"))
    return findings


def _sorted(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda item: ("error", "warning", "note").index(item.severity))


def _top_level(config: dict) -> list[Finding]:
    findings = []
    known = known_top_level_keys()
    for key in config:
        if key not in known:
            findings.append(finding(
                "unknown-key", f"unknown top-level key {key!r}{_did_you_mean(str(key), known)}: accelerate refuses "
                "the whole file ('had unknown keys')", _rename(str(key), known), str(key)))
    distributed_types = _distributed_types()
    if "distributed_type" not in config:
        findings.append(finding("invalid-value", "no distributed_type (accelerate requires one)",
                                "add distributed_type: FSDP", "distributed_type"))
    elif str(config["distributed_type"]) not in distributed_types:
        findings.append(finding(
            "invalid-value", f"distributed_type {config['distributed_type']!r} is not one of accelerate's"
            f"{_did_you_mean(str(config['distributed_type']), distributed_types)}",
            f"use one of {', '.join(distributed_types)}", "distributed_type"))
    precision = config.get("mixed_precision", "no")
    if str(precision).lower() not in _precisions() and precision is not False:
        findings.append(finding("invalid-value", f"mixed_precision {precision!r} is not one of {_precisions()}",
                                "use bf16, fp16 or 'no' (quoted: a bare no is YAML false)", "mixed_precision"))
    for key in ("num_processes", "num_machines"):
        if key in config and (_whole(config[key]) is None or _whole(config[key]) < 1):
            findings.append(finding("invalid-value", f"{key} {config[key]!r} must be a whole number >= 1",
                                    f"set {key} to a count", key))
    rank, machines = _whole(config.get("machine_rank", 0)), _whole(config.get("num_machines", 1))
    if rank is None or (machines and not 0 <= rank < machines):
        findings.append(finding("invalid-value", f"machine_rank {config.get('machine_rank')!r} must be 0 .. "
                                f"num_machines - 1", "set machine_rank: 0 in the file; pass --machine_rank on each "
                                "node's launch command", "machine_rank"))
    return findings


# FSDP1-only keys under FSDP2: accelerate's FSDP2 plugin never reads them. Each maps to the value that
# FSDP2 behaves like anyway (None: no value is harmless), so a stale key that asks for nothing
# different is a note, not an error.
_FSDP2_BEHAVES_LIKE = {
    "fsdp_backward_prefetch": "BACKWARD_PRE",  # FSDP2 always prefetches the next unit in backward
    "fsdp_forward_prefetch": False,
    "fsdp_use_orig_params": None,  # FSDP2 always uses the original parameters: either value is moot
    "fsdp_sync_module_states": None,  # RAM-efficient loading broadcasts rank 0's weights instead
}
_FSDP2_IGNORES = {
    "fsdp_sharding_strategy": "FSDP2 ignores it and shards as fsdp_reshard_after_forward says (true: FULL_SHARD, "
                              "false: SHARD_GRAD_OP; HSDP via parallelism_config)",
    "fsdp_backward_prefetch": "FSDP2 ignores it (it always prefetches the next unit in backward)",
    "fsdp_forward_prefetch": "FSDP2 ignores it (accelerate has no forward prefetch for FSDP2)",
    "fsdp_use_orig_params": "FSDP2 always uses the original parameters",
    "fsdp_sync_module_states": "FSDP2 has no module-state sync (RAM-efficient loading broadcasts rank 0's weights "
                               "instead)",
}


def _strategy_name(value: Any) -> str | None:
    """An FSDP1 sharding strategy as accelerate reads it (name or 1-based index), upper case."""
    from accelerate.utils.constants import FSDP_SHARDING_STRATEGY

    if _whole(value) is not None and 1 <= _whole(value) <= len(FSDP_SHARDING_STRATEGY):
        return FSDP_SHARDING_STRATEGY[_whole(value) - 1]
    text = str(value).upper().lstrip("_")  # torch's enum spells it _HYBRID_SHARD_ZERO2; accelerate takes both
    return text if text in FSDP_SHARDING_STRATEGY else None


def _fsdp_keys(fsdp: dict, version: int | None) -> list[Finding]:
    findings = []
    known = known_fsdp_keys()
    plugin_options = plugin_option_defaults()
    enumerations = _enumerations()
    for key, value in fsdp.items():
        where = f"fsdp_config.{key}"
        if key not in known and key in plugin_options:
            default = plugin_options[key]
            if default is not None and _boolean(value) == default:
                findings.append(finding(
                    "ignored-default", f"{key}: {value!r} is a real FSDP option that `accelerate launch` does not read "
                    f"from a config file; its default ({default}) applies anyway", "nothing to do (or remove it)",
                    where))
            else:
                findings.append(finding(
                    "key-not-applied", f"{key} {value!r} is a real FSDP option, but `accelerate launch` does not "
                    "read it from a config file, so it is not applied" + (f" (the default {default!r} is)" if
                                                                           default is not None else ""),
                    f"set it in the training script: FullyShardedDataParallelPlugin({key.removeprefix('fsdp_')}=...) "
                    "passed to Accelerator(fsdp_plugin=...), or remove it", where))
            continue
        if key not in known:
            findings.append(finding(
                "unknown-fsdp-key", f"unknown fsdp_config key {key!r}{_did_you_mean(key, known)}: accelerate "
                "ignores it silently, so the setting you meant is not applied", _rename(key, known, value), where))
            continue
        if key in enumerations and value is not None:
            allowed = enumerations[key]
            text = str(value).upper()
            if key == "fsdp_sharding_strategy" and _strategy_name(value):
                pass  # accelerate also takes the 1-based index and torch's enum names
            elif text not in allowed:
                findings.append(finding("invalid-value", f"{key} {value!r} is not one of {', '.join(allowed)}"
                                        f"{_did_you_mean(text, allowed)}", f"use one of {', '.join(allowed)}", where))
        if key in _BOOLEAN_FSDP_KEYS and _boolean(value) is None:
            findings.append(finding("invalid-value", f"{key} {value!r} is not true or false", "write true or false",
                                    where))
        if key == "fsdp_min_num_params" and _whole(value) is None:
            findings.append(finding("invalid-value", f"{key} {value!r} is not a whole number",
                                    "write a parameter count", where))
        if key == "fsdp_reshard_after_forward" and version == 2 and _boolean(value) is None:
            findings.append(finding("invalid-value", f"fsdp_reshard_after_forward {value!r}: FSDP2 takes true "
                                    "(FULL_SHARD) or false (SHARD_GRAD_OP)", "write true or false", where))
        if version == 2 and key in FSDP1_ONLY_KEYS:
            findings += _fsdp1_key_under_fsdp2(fsdp, key, value, where)
        if version == 1 and key in FSDP2_ONLY_KEYS:
            findings += _fsdp2_key_under_fsdp1(fsdp, key, value, where)
    if version == 2 and str(fsdp.get("fsdp_state_dict_type", "")).upper() == "LOCAL_STATE_DICT":
        findings.append(finding("invalid-value", "LOCAL_STATE_DICT does not exist in FSDP2 (accelerate raises)",
                                "use SHARDED_STATE_DICT", "fsdp_config.fsdp_state_dict_type"))
    return findings


def _fsdp1_key_under_fsdp2(fsdp: dict, key: str, value: Any, where: str) -> list[Finding]:
    """An FSDP1-only key in an FSDP2 config: an error when it asks for something FSDP2 does not do."""
    effect = _FSDP2_IGNORES[key]
    if key == "fsdp_sharding_strategy":
        reshard = _boolean(fsdp.get("fsdp_reshard_after_forward", True))
        applied = "FULL_SHARD" if reshard is not False else "SHARD_GRAD_OP"
        if _strategy_name(value) == applied:
            return [finding("ignored-default", f"{key}: {value} is an FSDP1 setting that FSDP2 ignores; "
                            f"fsdp_reshard_after_forward gives the same ({applied})", "remove it", where)]
        return [finding("fsdp1-key-under-fsdp2", f"{key} {value} is an FSDP1 setting in an FSDP2 config: {effect}, "
                        f"so this config runs {applied}, not {value}",
                        "remove it and set fsdp_reshard_after_forward (true: FULL_SHARD, false: SHARD_GRAD_OP; "
                        "hybrid: parallelism_config_dp_replicate_size)", where)]
    behaves_like = _FSDP2_BEHAVES_LIKE[key]
    moot = behaves_like is None or (str(value).upper() == behaves_like if isinstance(behaves_like, str)
                                    else _boolean(value) == behaves_like)
    if moot:
        return [finding("ignored-default", f"{key}: {value} is an FSDP1 setting that FSDP2 ignores ({effect}); "
                        "it asks for nothing FSDP2 does not do", "remove it", where)]
    return [finding("fsdp1-key-under-fsdp2", f"{key} {value} is an FSDP1 setting in an FSDP2 config: {effect}",
                    "remove it" + (", or set fsdp_version: 1 to keep it" if key == "fsdp_forward_prefetch" else ""),
                    where)]


def _fsdp2_key_under_fsdp1(fsdp: dict, key: str, value: Any, where: str) -> list[Finding]:
    """An FSDP2-only key in an FSDP1 config. ``accelerate config`` itself writes the FSDP1 sharding
    strategy as ``fsdp_reshard_after_forward: FULL_SHARD``; accelerate 1.16's launcher then always
    passes ``fsdp_sharding_strategy`` (default FULL_SHARD), which the FSDP1 plugin applies instead.
    So the key matters only when it asks for another strategy than the one applied."""
    if key == "fsdp_activation_checkpointing_offload":
        return [finding("fsdp2-key-under-fsdp1", f"{key} is an FSDP2 setting in an FSDP1 config: accelerate refuses "
                        "it with FSDP1", "remove it, or set fsdp_version: 2", where)]
    applied = _strategy_name(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")) or "FULL_SHARD"
    asked = _strategy_name(value)
    flag = _boolean(value)
    if asked is None and flag is not None:
        asked = "FULL_SHARD" if flag else "SHARD_GRAD_OP"
    if asked == applied:
        return [finding("ignored-default", f"{key}: {value} (as `accelerate config` writes FSDP1 configs) is not read "
                        f"by accelerate's FSDP1 plugin; fsdp_sharding_strategy {applied} applies, which is the same",
                        "nothing to do (or write fsdp_sharding_strategy: " + applied + " instead)", where)]
    fix = f"set fsdp_sharding_strategy: {asked}" if asked else "remove it (FSDP1 shards as fsdp_sharding_strategy says)"
    if flag is not None:
        fix += " (or fsdp_version: 2, which takes true/false here)"
    return [finding("fsdp2-key-under-fsdp1", f"{key} {value} is not applied under FSDP1: accelerate launch always "
                    f"passes fsdp_sharding_strategy, so the plugin runs {applied}" + (f", not {asked}" if asked else ""),
                    fix, where)]


def _parallelism(parallelism: dict, version: int | None, processes: int | None, machines: int | None) -> list[Finding]:
    if not parallelism:
        return []
    findings = []
    known = known_parallelism_keys()
    for key in parallelism:
        if key not in known:
            findings.append(finding(
                "unknown-parallelism-key", f"unknown parallelism_config key {key!r}{_did_you_mean(str(key), known)}: "
                "accelerate ignores it silently", _rename(str(key), known), f"parallelism_config.{key}"))
    if version == 1:
        findings.append(finding("hsdp-needs-fsdp2", "parallelism_config with fsdp_version 1: accelerate requires "
                                "FSDP2 for it ('You cannot use --use_parallelism_config without ... fsdp_version=2'); "
                                "with the version taken from a config file, accelerate 1.16's launcher does not catch "
                                "it (it compares the string '1' with the number 1)",
                                "set fsdp_version: 2, or drop parallelism_config and use fsdp_sharding_strategy: "
                                "HYBRID_SHARD", "parallelism_config"))
    sizes = {}
    for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
        key = f"parallelism_config_{name}"
        value = parallelism.get(key, 1)
        number = _whole(value)
        if number is None or number < 1:
            findings.append(finding("invalid-value", f"{key} {value!r} must be a whole number >= 1",
                                    "write a size", f"parallelism_config.{key}"))
            return findings
        sizes[name] = number
    if processes is None:
        return findings
    product = sizes["dp_replicate_size"] * sizes["dp_shard_size"] * sizes["tp_size"] * sizes["cp_size"] * sizes["sp_size"]
    if product != processes:
        findings.append(finding(
            "hsdp-size-mismatch", f"parallelism sizes multiply to {product} (replicate {sizes['dp_replicate_size']} x "
            f"shard {sizes['dp_shard_size']}" + ("" if product == sizes['dp_replicate_size'] * sizes['dp_shard_size']
                                                 else " x tp/cp/sp") + f") but num_processes is {processes}: "
            "accelerate refuses the mesh at start-up", f"make replicate x shard = {processes} (HSDP: replicate = "
            f"num_machines {machines}, shard = GPUs per node {processes // max(machines, 1)})", "parallelism_config"))
    per_node = processes // machines if machines and processes % machines == 0 else None
    shard = sizes["dp_shard_size"] * sizes["tp_size"] * sizes["cp_size"] * sizes["sp_size"]
    if per_node and machines > 1 and (shard > per_node or per_node % shard):
        findings.append(finding(
            "hsdp-shard-spans-nodes", f"HSDP shard groups of {sizes['dp_shard_size']} GPUs do not fit the "
            f"{per_node} GPUs of one node (num_processes {processes} / num_machines {machines}): parameter "
            "all-gathers cross the network every step, which HSDP exists to avoid",
            f"shard inside a node: parallelism_config_dp_shard_size: {per_node}, parallelism_config_dp_replicate_size: "
            f"{machines}", "parallelism_config.parallelism_config_dp_shard_size"))
    return findings


def _wrap_names(fsdp: dict) -> tuple[list[str] | None, list[Finding]]:
    value = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    where = "fsdp_config.fsdp_transformer_layer_cls_to_wrap"
    if value is None:
        return None, []
    if not isinstance(value, str):
        return None, [finding("wrap-class-format", f"fsdp_transformer_layer_cls_to_wrap is a "
                              f"{type(value).__name__} ({value!r}): accelerate passes str(value) on, so no class "
                              "would match", "write one string, names separated by commas: "
                              "LlamaDecoderLayer,LlamaMLP", where)]
    names = value.split(",")  # accelerate splits on "," and does not strip
    findings = []
    if any(name != name.strip() or not name for name in names):
        findings.append(finding("wrap-class-format", f"fsdp_transformer_layer_cls_to_wrap {value!r} has spaces or "
                                "empty names: accelerate splits on ',' without stripping, so ' X' matches no class",
                                f"write {','.join(n.strip() for n in names if n.strip())}", where))
    return [name.strip() for name in names if name.strip()], findings


def _wrapping(fsdp: dict, context: CheckContext) -> list[Finding]:
    findings = []
    policy = str(fsdp.get("fsdp_auto_wrap_policy") or "NO_WRAP").upper()
    names, format_findings = _wrap_names(fsdp)
    findings += format_findings
    model = context.model
    if policy == "NO_WRAP":
        findings.append(finding("no-wrap-policy", "no auto-wrap policy: FSDP makes the whole model one unit, "
                                "all-gathered whole for every forward and backward (no memory saved over DDP at the "
                                "peak)", "set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP and the block classes",
                                "fsdp_config.fsdp_auto_wrap_policy"))
    if policy == "TRANSFORMER_BASED_WRAP" and not names and not format_findings:
        declared = list(model.profile.structure.get("no_split_modules") or []) if model else []
        missing = model.profile.missing_no_split if model else []
        if model and missing:
            present = [name for name in declared if name not in missing]
            findings.append(finding(
                "no-split-modules-missing", f"no fsdp_transformer_layer_cls_to_wrap, so accelerate takes the "
                f"model's _no_split_modules ({', '.join(declared)}), which names {', '.join(missing)} that "
                f"{model.profile.architecture} does not contain: older accelerate versions raise 'Could not find "
                "the transformer layer class', newer ones skip the name" + (
                    " and wrap nothing" if not present else f" and wrap {', '.join(present)} only"),
                f"set fsdp_transformer_layer_cls_to_wrap: {','.join(model.profile.wrap_classes)}",
                "fsdp_config.fsdp_transformer_layer_cls_to_wrap"))
        else:
            hint = (f": {', '.join(declared)}" if declared else "")
            findings.append(finding(
                "wrap-classes-unset", "TRANSFORMER_BASED_WRAP without fsdp_transformer_layer_cls_to_wrap: accelerate "
                f"wraps the classes the model's _no_split_modules declares{hint}; what gets wrapped then depends on "
                "the model code, not on this file", "name the block classes explicitly" + (
                    f": {','.join(model.profile.wrap_classes)}" if model else " (`fsdp-presets inspect MODEL`)"),
                "fsdp_config.fsdp_transformer_layer_cls_to_wrap"))
    if names and model:
        for name in names:
            if name not in model.module_classes:
                findings.append(finding(
                    "wrap-class-not-in-model", f"wrap class {name!r} does not exist in {model.profile.architecture} "
                    f"({model.source}){_did_you_mean(name, model.module_classes)}: accelerate raises 'Could not find "
                    "the transformer layer class' once the job has started",
                    f"use the model's blocks: {','.join(model.profile.wrap_classes)}",
                    "fsdp_config.fsdp_transformer_layer_cls_to_wrap"))
            elif name not in model.profile.wrap_classes:
                findings.append(finding(
                    "wrap-class-not-a-block", f"wrap class {name!r} is in the model but is not one of its blocks "
                    f"({', '.join(model.profile.wrap_classes)}): FSDP units that do not follow the blocks gather "
                    "more often or hold more than one block at a time", f"wrap the blocks: "
                    f"{','.join(model.profile.wrap_classes)}", "fsdp_config.fsdp_transformer_layer_cls_to_wrap"))
    return findings


def _device(config: dict, context: CheckContext) -> str:
    if context.device:
        return context.device
    request = (context.metadata or {}).get("request") or {}
    return "cpu" if request.get("device") == "cpu" else "gpu"


def _device_and_memory(config, fsdp, parallelism, version, context, processes, machines) -> list[Finding]:
    findings = []
    device = _device(config, context)
    offload = _boolean(fsdp.get("fsdp_offload_params", False))
    if device == "cpu" and offload:
        findings.append(finding("offload-on-cpu", "fsdp_offload_params: true in a config for a CPU-only host: "
                                "parameters already live in host memory and torch fails ('Cannot access accelerator "
                                "device')", "set fsdp_offload_params: false", "fsdp_config.fsdp_offload_params"))
    model = context.model
    if model is None or processes is None or not machines or processes % machines:
        return findings
    profile = model.profile
    host = context.host_gib * GiB
    per_node = processes // machines
    # accelerate's default: FULL_STATE_DICT for FSDP1, SHARDED_STATE_DICT for FSDP2
    state_dict = str(fsdp.get("fsdp_state_dict_type", "SHARDED_STATE_DICT" if version == 2 else
                              "FULL_STATE_DICT")).upper()
    full_bytes = full_state_dict_host_bytes(profile)
    lora = lora_shape(context)
    if lora is not None:
        from fsdp_presets.plan.planner import adapter_params, base_storage_bytes

        lora_training = _training_shape(config, fsdp, context)
        full_bytes = base_storage_bytes(profile, lora_training) + 12 * adapter_params(profile, lora_training)
    if state_dict == "FULL_STATE_DICT" and full_bytes > host:
        findings.append(finding(
            "full-state-dict-host-memory", f"FULL_STATE_DICT gathers the whole model and optimizer state on rank 0 "
            f"at every save: about {full_bytes / GiB:.0f} GiB for "
            f"{profile.total_params / 1e9:.2f}B parameters (fp32 weights + Adam moments), more than "
            f"--host-memory {context.host_gib:g} GiB" + (" (it is also accelerate's default when the key is "
                                                                 "missing)" if "fsdp_state_dict_type" not in fsdp
                                                                 else ""),
            "set fsdp_state_dict_type: SHARDED_STATE_DICT (export full weights afterwards with accelerate "
            "merge-weights)", "fsdp_config.fsdp_state_dict_type"))
    if device == "gpu" and _boolean(fsdp.get("fsdp_cpu_ram_efficient_loading", True)) is False:
        weight_bytes = 4 if profile.structure.get("config_dtype") in (None, "float32") else 2
        need = per_node * profile.total_params * weight_bytes
        if need > host:
            findings.append(finding(
                "ram-efficient-loading-off", f"fsdp_cpu_ram_efficient_loading: false makes each of a node's {per_node} "
                f"processes load the full pretrained model into host RAM: about {need / GiB:.0f} GiB, more than "
                f"--host-memory {context.host_gib:g} GiB", "set fsdp_cpu_ram_efficient_loading: true (only "
                "rank 0 reads the weights)", "fsdp_config.fsdp_cpu_ram_efficient_loading"))
    if device != "gpu":
        return findings

    # The planner's view of this config on GPUs of --gpu-memory.
    strategy, hardware = _planner_strategy(fsdp, parallelism, version, processes, machines, context)
    if strategy is None:
        return findings
    shape = _training_shape(config, fsdp, context)
    seq_len, precision = shape.seq_len, shape.precision
    name, fsdp_version = strategy
    row = plan(profile, hardware, shape).get(name, fsdp_version)
    if offload and row.model_state.total * per_node > host:
        findings.append(finding(
            "offload-host-memory", f"fsdp_offload_params: true keeps {row.model_state.total / GiB:.1f} GiB of model "
            f"states per rank in host RAM, {row.model_state.total * per_node / GiB:.0f} GiB for a node's {per_node} "
            f"processes: more than --host-memory {context.host_gib:g} GiB",
            "shard over more GPUs (more nodes), or use nodes with more RAM", "fsdp_config.fsdp_offload_params"))
    if not row.fits:
        where = f"{row.label} on {processes} GPUs of {context.gpu_gib:g} GiB, sequence {seq_len}"
        lower = plan(profile, hardware, shape.replace(precision="bf16")).get(name, fsdp_version)
        if precision == "fp32" and lower.fits:
            findings.append(finding(
                "fp32-does-not-fit", f"mixed_precision 'no' (fp32): {where} needs {row.per_gpu.total / GiB:.1f} GiB "
                f"per GPU of {hardware.usable_bytes / GiB:.1f} usable at micro-batch 1; bf16 needs "
                f"{lower.per_gpu.total / GiB:.1f}", "set mixed_precision: bf16", "mixed_precision"))
        else:
            findings.append(finding(
                "does-not-fit", f"{where} needs {row.per_gpu.total / GiB:.1f} GiB per GPU of "
                f"{hardware.usable_bytes / GiB:.1f} usable at micro-batch 1",
                "`fsdp-presets plan` / `fsdp-presets generate` for what fits (activation checkpointing, offload, "
                "more GPUs)", None))
    if precision == "fp16" and profile.structure.get("config_dtype") == "bfloat16":
        findings.append(finding(
            "fp16-on-bf16-model", f"mixed_precision fp16 on {profile.architecture}, trained in bf16: bf16 weights and "
            "activations can exceed fp16's range (max 65504) and overflow", "set mixed_precision: bf16",
            "mixed_precision"))
    return findings


def _training_shape(config, fsdp, context) -> TrainingShape:
    """Micro-batch 1 at the sequence length and precision of the file (header, --seq-len)."""
    profile = context.model.profile
    metadata_request = (context.metadata or {}).get("request") or {}
    summary = (context.metadata or {}).get("summary") or {}
    seq_len = context.seq_len or summary.get("seq_len") or metadata_request.get("seq_len") or 2048
    if profile.dims.max_position_embeddings:
        seq_len = min(seq_len, profile.dims.max_position_embeddings)
    precision = {"no": "fp32", "fp8": "bf16"}.get(str(config.get("mixed_precision", "no")).lower(),
                                                  str(config.get("mixed_precision", "no")).lower())
    if precision not in ("bf16", "fp16", "fp32"):
        precision = "fp32"
    return TrainingShape(seq_len=seq_len, micro_batch=1, precision=precision,
                         activation_checkpointing=bool(_boolean(fsdp.get("fsdp_activation_checkpointing", False))),
                         offload=bool(_boolean(fsdp.get("fsdp_offload_params", False))), lora=lora_shape(context))


def _hybrid_fits(config, fsdp, context, processes, machines) -> bool | None:
    """Whether the planner finds HSDP (shard inside a node) fits; None without a model."""
    if context.model is None:
        return None
    try:
        hardware = Hardware(gpus=processes, nodes=machines, gpu_memory_bytes=int(context.gpu_gib * GiB))
        return plan(context.model.profile, hardware, _training_shape(config, fsdp, context)).get(
            "HYBRID_SHARD", 2).fits
    except Exception:  # noqa: BLE001 - a layout the other rules report
        return None


def _planner_strategy(fsdp, parallelism, version, processes, machines, context):
    """(strategy name, fsdp version) and Hardware for the planner, or (None, None)."""
    if version not in (1, 2):
        return None, None
    try:
        hardware = Hardware(gpus=processes, nodes=machines, gpu_memory_bytes=int(context.gpu_gib * GiB))
    except Exception:  # noqa: BLE001 - a layout the other rules already report
        return None, None
    if version == 2:
        replicate = _whole((parallelism or {}).get("parallelism_config_dp_replicate_size", 1)) or 1
        if replicate > 1 and machines > 1:
            return ("HYBRID_SHARD", 2), hardware
        reshard = _boolean(fsdp.get("fsdp_reshard_after_forward", True))
        return (("FULL_SHARD" if reshard is not False else "SHARD_GRAD_OP"), 2), hardware
    strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
    if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "HYBRID_SHARD_ZERO2"):
        return (("HYBRID_SHARD", 1), hardware) if machines > 1 else (("FULL_SHARD", 1), hardware)
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        return (strategy, 1), hardware
    return None, None


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
    """The :class:`fsdp_presets.plan.wrap_probe.WrapProbe` of the model, when ``check`` proved the wrapping."""

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
            "fsdp_version": plugin.fsdp_version,
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


# --------------------------------------------------------------------------- a file


# accelerate's own refusal -> the rule that already names the same problem (one problem, one finding).
_REJECTION_RULES = (
    ("had unknown keys", "unknown-key"),
    ("use_parallelism_config", "hsdp-needs-fsdp2"),
    ("fsdp_cpu_ram_efficient_loading", "ram-efficient-loading-needs-sync"),
    ("LOCAL_STATE_DICT", "invalid-value"),
    ("invalid truth value", "invalid-value"),
    ("invalid literal for int()", "invalid-value"),
    ("Invalid auto wrap policy", "invalid-value"),
    ("Unknown mixed_precision", "invalid-value"),
    ("not supported with FSDP", "invalid-value"),
    ("KeyError", "invalid-value"),
    ("requires `fsdp_version=2`", "fsdp2-key-under-fsdp1"),
)


def check_file(path: str | os.PathLike, *, context: CheckContext = CheckContext(),
               prove_wrapping: bool = False) -> tuple[CheckReport, AccelerateView | None]:
    """Every finding for the file at ``path``, and accelerate's view of it (None when it refuses).

    ``prove_wrapping``: with a model in ``context``, also run accelerate's FSDP preparation of it
    under a fake process group (:mod:`fsdp_presets.plan.wrap_probe`, a few seconds in a subprocess); the
    result is ``view.probe``, its crash or unsharded parameters become findings."""
    import dataclasses

    import yaml

    from fsdp_presets.plan.emit import read_metadata

    report = CheckReport(path=str(path))
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        report.findings.append(finding("yaml-invalid", f"cannot read {path}: {error}", "pass an accelerate config "
                                       "file"))
        return report, None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        report.findings.append(finding("yaml-invalid", f"not valid YAML: {' '.join(str(error).split())}",
                                       "fix the YAML syntax"))
        return report, None
    if context.metadata is None:
        context = dataclasses.replace(context, metadata=read_metadata(text))
    report.findings += lint_config(config, context=context)
    view = None
    if isinstance(config, dict):
        given = "num_processes" not in config and config.get("distributed_type") in ("FSDP", "MULTI_GPU")
        try:
            view = accelerate_view(path, num_processes=_launch_processes(config, context) if given else None)
            view.processes_in_file = not given
        except AccelerateRejected as error:
            text_of_error = str(error)
            covered = {rule for needle, rule in _REJECTION_RULES if needle in text_of_error}
            if not covered & {item.rule for item in report.errors}:
                report.findings.append(finding("accelerate-rejects", f"accelerate itself rejects the file: {error}",
                                               "fix the problems above; the message is accelerate's own"))
    if prove_wrapping and view is not None and view.fsdp_plugin is not None and context.model is not None \
            and not [item for item in report.errors if item.rule != "ignored-modules"]:
        report.findings += _probe_findings(view, context, config)
        # one problem, one finding: the probe's is the precise one
        superseded = {"prepare-crashes": "wrap-classes-unset", "params-outside-units": "ignored-modules"}
        drop = {superseded[rule] for rule in report.rules() & set(superseded)}
        report.findings = [item for item in report.findings if item.rule not in drop]
    report.findings = _sorted(report.findings)
    return report, view


def _launch_processes(config: dict, context: CheckContext) -> int:
    """The ``--num_processes`` a launch of a file without one would pass: --gpus, else the
    parallelism sizes' product, else 2 (what the view then shows is labelled as assumed)."""
    if context.gpus:
        return context.gpus
    parallelism = config.get("parallelism_config") or {}
    product = 1
    for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
        product *= _whole(parallelism.get(f"parallelism_config_{name}", 1)) or 1
    return product if product > 1 else 2


_PROBES: dict = {}
"""Probe results of this process, by (model, launch environment, processes)."""


def _probe_findings(view: AccelerateView, context: CheckContext, config: dict) -> list[Finding]:
    from fsdp_presets.plan.wrap_probe import WrapProbe, probe_wrapping

    model = context.model
    sizes = view.mesh_sizes() or {}
    if (sizes.get("tp_size") or 1) > 1:
        view.probe = WrapProbe(skipped="tensor parallelism: the probe does not build a TP plan")
        return []
    key = (model.source, model.trust_remote_code, tuple(sorted(view.env.items())), view.num_processes)
    if key not in _PROBES:  # files that differ only outside the launch environment share one probe
        _PROBES[key] = probe_wrapping(model.source, view.env, view.num_processes,
                                      trust_remote_code=model.trust_remote_code)
    view.probe = probe = _PROBES[key]
    settings = view.fsdp_settings()
    named = settings["transformer_cls_names_to_wrap"] if "FSDP_TRANSFORMER_CLS_TO_WRAP" in view.env else []
    blocks = ",".join(model.profile.wrap_classes)
    findings = []
    if probe.error:
        if named:
            why, fix = "", ("wrap the blocks: fsdp_transformer_layer_cls_to_wrap: " + blocks
                            if named != list(model.profile.wrap_classes) else
                            "the error is accelerate's/torch's own; `fsdp-presets inspect MODEL` shows the units")
        else:
            declared = sorted(model.profile.structure.get("no_split_modules") or [])
            why = (" With no fsdp_transformer_layer_cls_to_wrap, accelerate wraps the model's _no_split_modules"
                   + (f" ({', '.join(declared)})" if declared else "") + " and then shards the input embedding "
                   "again on its own")
            fix = f"name the block classes: fsdp_transformer_layer_cls_to_wrap: {blocks}"
        findings.append(finding(
            "prepare-crashes", f"accelerate's FSDP{settings['fsdp_version']} preparation of {model.profile.architecture} "
            f"({model.source}) raises {probe.error}" + (f" (at {probe.where})" if probe.where else "") + "; every "
            f"rank fails in accelerator.prepare(model).{why}", fix, "fsdp_config.fsdp_transformer_layer_cls_to_wrap"))
    elif probe.left_out:
        ignored = (config.get("fsdp_config") or {}).get("fsdp_ignored_modules")
        findings.append(finding(
            "params-outside-units", f"{len(probe.left_out)} parameters of {model.profile.architecture} are in no FSDP "
            f"unit ({', '.join(probe.left_out[:4])}{', ...' if len(probe.left_out) > 4 else ''}): FSDP neither shards "
            "nor gradient-synchronises them, so each rank updates its own copy and the replicas drift apart"
            + (f" (fsdp_ignored_modules {ignored!r} leaves them out)" if ignored else ""),
            "remove fsdp_ignored_modules" if ignored else f"wrap the blocks: fsdp_transformer_layer_cls_to_wrap: {blocks}",
            "fsdp_config.fsdp_ignored_modules" if ignored else "fsdp_config.fsdp_transformer_layer_cls_to_wrap"))
    return findings


def model_facts(source: str, *, trust_remote_code: bool = False) -> ModelFacts:
    """Profile ``source`` and list its module classes (built on the meta device)."""
    from fsdp_presets.plan.profile import build_meta_model, load_config, profile_module

    model = build_meta_model(load_config(source, trust_remote_code=trust_remote_code),
                             trust_remote_code=trust_remote_code)
    return ModelFacts(source=source, profile=profile_module(model),
                      module_classes=frozenset(type(module).__name__ for module in model.modules()),
                      trust_remote_code=trust_remote_code)


__all__ = [
    "AccelerateRejected",
    "AccelerateView",
    "CheckContext",
    "CheckReport",
    "Finding",
    "ModelFacts",
    "RULES",
    "accelerate_view",
    "check_file",
    "lint_config",
    "model_facts",
]
