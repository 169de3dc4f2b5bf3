"""What ``fsdp-presets check`` reports and what its rules read: the rule table (:data:`RULES`), a
:class:`Finding`, the :class:`CheckContext` besides the file, and a file's :class:`CheckReport`."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from fsdp_presets.plan.limits import DEFAULT_GPU_MEMORY_GIB
from fsdp_presets.errors import UsageError
from fsdp_presets.preset.request import DEFAULT_HOST_MEMORY_GIB
from fsdp_presets.model.model_profile import ModelProfile
from fsdp_presets.schema import FSDP_CONFIG, PARALLELISM_CONFIG, K, T


Severity = Literal["error", "warning", "note", "info"]

RULES = MappingProxyType({
    # rule id: (severity, what it catches)
    "yaml-invalid": ("error", "the file is not YAML, or not a mapping of accelerate settings"),
    "accelerate-rejects": ("error", "accelerate's own loader, launcher or FSDP plugin raises on the file"),
    "unknown-key": ("error", "a top-level key accelerate does not know (accelerate refuses the whole file)"),
    "unknown-fsdp-key": ("error", f"an {FSDP_CONFIG} key accelerate does not know (silently ignored)"),
    "unknown-parallelism-key": ("error", f"a {PARALLELISM_CONFIG} key accelerate does not know (silently ignored)"),
    "invalid-value": ("error", "a value accelerate does not accept (enumerations, booleans, counts)"),
    "fsdp-version-missing": ("info", f"no {K.version}: accelerate launch runs FSDP1 (its default)"),
    "fsdp1-key-under-fsdp2": ("error", "an FSDP1-only key in an FSDP2 config: ignored (or refused)"),
    "fsdp2-key-under-fsdp1": ("error", "an FSDP2-only key in an FSDP1 config: ignored (or refused)"),
    "hsdp-needs-fsdp2": ("error", f"{PARALLELISM_CONFIG} with FSDP1: accelerate requires FSDP2 for it"),
    "hsdp-size-mismatch": ("error", "HSDP replicate x shard sizes do not multiply to num_processes"),
    "hsdp-shard-spans-nodes": ("warning", "the HSDP shard size does not fit the GPUs of one node"),
    "machines-do-not-divide": ("error", "num_processes is not a multiple of num_machines"),
    "no-wrap-policy": ("warning", "FSDP without an auto-wrap policy: the whole model is one unit"),
    "wrap-classes-unset": ("info", "TRANSFORMER_BASED_WRAP without classes: accelerate wraps the model's "
                                   "_no_split_modules"),
    "no-split-modules-missing": ("error", "classes left to _no_split_modules include some the model lacks"),
    "wrap-class-format": ("error", f"{K.transformer_layer_cls_to_wrap} is not a comma-separated string of names"),
    "wrap-class-not-in-model": ("error", "a wrap class that does not exist in the model (--model)"),
    "wrap-class-not-a-block": ("warning", "a wrap class that is in the model but is not one of its blocks"),
    "ignored-modules": ("error", f"{K.ignored_modules} set: those parameters are not gradient-synchronised"),
    "ram-efficient-loading-needs-sync": ("error", f"RAM-efficient loading with {K.sync_module_states} false "
                                                  "(accelerate launch refuses it)"),
    "ram-efficient-loading-off": ("error", "every process loads the full model: more than the node's host RAM"),
    "full-state-dict-host-memory": ("error", "FULL_STATE_DICT gathers more than rank 0's host RAM"),
    "offload-host-memory": ("error", "the offloaded model states of a node exceed its host RAM"),
    "offload-on-cpu": ("error", "CPU offload in a config for a CPU-only host"),
    "fp32-does-not-fit": ("warning", "fp32 does not fit the GPUs (bf16 would)"),
    "does-not-fit": ("warning", "the planner finds the config does not fit the GPUs at micro-batch 1"),
    "fp16-on-bf16-model": ("warning", "fp16 mixed precision on a model trained in bf16"),
    "fsdp-config-ignored": ("warning", f"{FSDP_CONFIG} in a config whose distributed_type is not FSDP"),
    "ignored-default": ("info", "a key accelerate accepts but does not apply, set to what applies anyway"),
    "key-not-applied": ("warning", "a real FSDP option accelerate launch does not pass on from a config file"),
    "num-processes-unset": ("info", f"no {T.num_processes}: the launch command gives it (no GPU count or memory verdict)"),
    "fp8-needs-backend": ("note", "fp8 needs torchao or Transformer Engine installed on the training nodes"),
    "memory-assumes-full-finetune": ("note", "memory verdicts that hold for full fine-tuning; the method is "
                                                "not known (pass --method full)"),
    "prepare-crashes": ("error", "accelerate's FSDP preparation of the model (--model) raises"),
    "params-outside-units": ("error", "parameters of the model that no FSDP unit shards"),
    "num-processes-vs-header": ("error", "num_processes or num_machines edited away from the generated "
                                         "header's batch arithmetic"),
    "fsdp-single-process": ("warning", "FSDP on one process: nothing is sharded"),
    "fixed-main-process-ip": ("warning", "a fixed private main_process_ip in a multi-machine config"),
    "full-shard-across-nodes": ("warning", "sharding across nodes without a hybrid layout (HSDP keeps "
                                           "all-gathers inside a node)"),
    "lora-fsdp1-flat-params": ("warning", f"LoRA under FSDP1 with {K.use_orig_params} false: flat parameters mix "
                                          "frozen and trainable weights"),
    "qlora-fsdp1": ("warning", "QLoRA under FSDP1: the 4-bit base is flattened (only bf16 quant storage and peft's "
                               "wrap policy work)"),
    "qlora-full-state-dict": ("warning", "QLoRA with FULL_STATE_DICT: accelerate's load_state fails on the 4-bit "
                                         "quantization-state keys"),
    "yaml-read-as-boolean": ("error", "a bare YAML no/off/yes/on read as a boolean where accelerate wants a name "
                                      f"({T.mixed_precision}: no crashes accelerate launch)"),
    "stale-key-beside-new": ("note", "an old key name accelerate ignores, next to the key that replaced it"),
    "debug-mode": ("warning", f"{T.debug}: true: accelerate checks every collective's shapes with extra collectives"),
    "lora-fsdp1-orig-params": ("warning", f"LoRA/QLoRA under FSDP1 with {K.use_orig_params} true: gradients are "
                                          "allocated for the whole flat parameter, frozen base included"),
    "fits-only-if": ("warning", "the memory verdict turns on inputs the config does not hold (sequence, batch, "
                                "checkpointing, precision): fits only if they are as stated"),
    "wrap-probe-skipped": ("note", "accelerate's FSDP preparation of the model did not run (errors above stop it)"),
    "trainer-save-model-sharded": ("error", "a Trainer script calls save_model under SHARDED_STATE_DICT without "
                                            "FSDPPresetsCallback: no weights are written (--script)"),
    "double-activation-checkpointing": ("error", f"gradient checkpointing in the script and {K.activation_checkpointing} "
                                                 "in the config: transformers' Trainer refuses both (--script)"),
    "model-moved-before-prepare": ("warning", "model.to(...)/.cuda() before accelerator.prepare: every rank holds "
                                              "the whole model before FSDP shards it (--script)"),
    "trust-remote-code": ("note", "trust_remote_code=True: the model repository's own code runs on every rank "
                                  "(--script)"),
    "prefetch-key-not-applied": ("warning", "a misspelt or old prefetch key (fsdp_backward_prefetch_policy): the "
                                            "prefetch asked for is not applied (slower, the same training)"),
    "async-save-host-memory": ("error", "the launch's --async-save stages more than a node's host RAM (the "
                                        "generated header's launch line)"),
    "tp-pair-cannot-run": ("error", "tensor parallelism through accelerate with a transformers whose tensor-parallel "
                                    "module lacks what accelerate's prepare imports"),
    "tp-size-vs-model": ("error", "a TP size that does not divide the model's heads, key/value heads, MLP width or "
                                  "(split head) vocabulary"),
    "tp-no-plan": ("error", "tensor parallelism for a model whose transformers class ships no TP plan"),
    "tp-loss-reduction": ("note", "tensor parallelism: a loss counted tp_size times trains silently; hold the run "
                                  "to DDP"),
    "cp-masks": ("warning", "context parallelism drops attention masks: sliding windows and packing break silently"),
    "distributed-config-under-fsdp": ("error", "a model sharded by transformers' DistributedConfig under an FSDP "
                                               "config: prepare wraps it again, or refuses a Trainer's optimizer "
                                               "(--script)"),
    "ep-ram-efficient-loading": ("error", "expert parallelism with RAM-efficient loading: every rank gets rank 0's "
                                          "experts (--script)"),
    "ep-no-plan": ("error", "expert parallelism for a model whose transformers class ships no EP plan (--script, or "
                            "the NAME.distributed.json beside the config)"),
    "ep-size-vs-model": ("error", "an EP size that does not divide the model's experts (--script, or the "
                                  "NAME.distributed.json beside the config)"),
    "distributed-config-mesh": ("note", "the NAME.distributed.json beside the config: transformers shards the model "
                                        "over its mesh, and the memory rules plan that mesh"),
    "distributed-config-invalid": ("error", "the NAME.distributed.json beside the config is not a DistributedConfig "
                                            "the recipes load"),
    "distributed-config-vs-processes": ("error", "the NAME.distributed.json beside the config lays out another "
                                                 "number of ranks than the config launches"),
    "backward-prefetch-off": ("warning", "FSDP1 without backward prefetch (accelerate's default) or with "
                                         "BACKWARD_POST: backward all-gathers wait, the step is predicted slower "
                                         "(--model)"),
})
"""Every rule: id -> (severity, what it catches). Ids never change meaning; new rules get new ids."""

@dataclass(frozen=True, kw_only=True)
class Finding:
    """One problem in a config."""

    rule: str
    """Stable rule id, a key of :data:`RULES`."""
    severity: Severity
    """``error``: the launch fails or silently trains something else (exit 1); ``warning``: a real risk
    for the stated use; ``note``: worth knowing, not a problem; ``info``: accelerate's own default or
    style (printed only with ``check --verbose``, otherwise counted on one line)."""
    message: str
    """What is wrong, with the values involved."""
    fix: str
    """What to change."""
    key: str | None = None
    """Where: ``fsdp_config.fsdp_version``, ``num_processes``; None for the whole file."""

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown rule id {self.rule!r}")
        if self.severity not in ("error", "warning", "note", "info"):
            raise ValueError(f"severity must be error, warning, note or info, got {self.severity!r}")

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
    gpu: str | None = None
    """GPU type (``--gpu``), whose memory the planner rules take without ``gpu_memory_gib``; None:
    the file's metadata's."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU, for the planner rules; None: ``gpu``'s, else the file's metadata, else 80."""
    host_memory_gib: float | None = None
    """Host RAM of one node (rank 0's node), for the state-dict, loading and offload rules; None:
    the file's metadata, else 1024 (8-GPU nodes carry 1-2 TiB)."""
    seq_len: int | None = None
    """Sequence length for the planner rules; None: the file's metadata, else
    :data:`~fsdp_presets.plan.limits.DEFAULT_SEQ_LEN`."""
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
    """The adapter's :class:`~fsdp_presets.plan.shapes.LoraShape` for ``lora``/``qlora`` (default: the
    file's metadata, else r 16 on every projection of the block)."""
    micro_batch: int | None = None
    """Sequences per GPU per forward (``--micro-batch``); None: the script's, the header's, else unknown."""
    activation_checkpointing: bool | None = None
    """``--activation-checkpointing``; None: the file's key, or the script's gradient checkpointing."""
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    """``--precision``; None: the script's bf16/fp16 flags, else the file's mixed_precision."""
    script: Any = None
    """The :class:`~fsdp_presets.check.script.ScriptFacts` of ``--script TRAIN.py``, when given."""
    distributed_config: dict | None = None
    """The ``NAME.distributed.json`` beside the file (``generate --tp/--ep`` writes it; the recipes load
    the model over its mesh), as :func:`fsdp_presets.check.rules_parallel.read_distributed_config`
    reads it; None: there is none."""

    def __post_init__(self) -> None:
        if self.device not in (None, "gpu", "cpu"):
            raise ValueError(f"device must be gpu or cpu, got {self.device!r}")
        if any(value is not None and not value > 0 for value in (self.gpu_memory_gib, self.host_memory_gib)):
            raise ValueError("memory sizes must be positive")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError("micro_batch must be >= 1")
        if self.precision not in (None, "fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.gpus is not None and self.gpus < 1:
            raise ValueError("gpus must be >= 1")
        if self.method not in (None, "full", "lora", "qlora"):
            raise ValueError(f"method must be full, lora, qlora or None, got {self.method!r}")

    def _from_request(self, name: str):
        return ((self.metadata or {}).get("request") or {}).get(name)

    @property
    def gpu_gib(self) -> float:
        from fsdp_presets.plan.gpus import memory_of

        try:
            if self.gpu_memory_gib or self.gpu:
                return memory_of(self.gpu_memory_gib, self.gpu)
            return memory_of(self._from_request("gpu_memory_gib"), self._from_request("gpu"))
        except UsageError:  # a header's unknown GPU type: the default, as for a hand-written config
            return DEFAULT_GPU_MEMORY_GIB

    @property
    def gpu_type(self):
        """The :class:`~fsdp_presets.plan.gpus.GpuType` step times are predicted on: ``--gpu``, else the
        file's metadata's, else :data:`~fsdp_presets.plan.gpus.DEFAULT_GPU`."""
        from fsdp_presets.plan.gpus import DEFAULT_GPU, gpu_type

        try:
            return gpu_type(self.gpu or self._from_request("gpu") or DEFAULT_GPU)
        except UsageError:  # a header's unknown GPU type: the default, as for its memory
            return gpu_type(DEFAULT_GPU)

    @property
    def training_method(self) -> str | None:
        """``full``, ``lora`` or ``qlora`` when known (``--method`` or a generated preset's header), else None."""
        if self.method:
            return self.method
        if self.script is not None and self.script.method:
            return self.script.method
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
    memory_figures: str | None = None
    """How the memory rules' figures were obtained (composed from a rehearsal of the model, or
    estimated, and from what); None where no memory rule ran."""

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
    def infos(self) -> list[Finding]:
        return [item for item in self.findings if item.severity == "info"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def rules(self) -> set[str]:
        return {item.rule for item in self.findings}

    def to_json(self) -> dict:
        return {"path": self.path, "ok": self.ok, "errors": len(self.errors), "warnings": len(self.warnings),
                "notes": len(self.notes), "infos": len(self.infos), "memory_figures": self.memory_figures,
                "findings": [item.to_json() for item in self.findings]}


FULL_FINETUNE_RULES = frozenset({"full-state-dict-host-memory", "offload-host-memory", "async-save-host-memory",
                                 "fp32-does-not-fit",
                                 "does-not-fit", "fits-only-if"})
"""Memory rules that count gradients and optimizer state for every parameter."""


def sorted_findings(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda item: ("error", "warning", "note", "info").index(item.severity))
