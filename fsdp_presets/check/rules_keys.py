"""The checker's rules on keys and values: top-level keys, ``fsdp_config`` keys for the file's FSDP
version, ``parallelism_config`` sizes and the wrap classes; :func:`lint_config` runs every rule."""

from __future__ import annotations

from typing import Any

from fsdp_presets.plan.limits import MAX_GPUS
from fsdp_presets.preset.accelerate_view import (
    STRICT_BOOLEAN_FSDP_KEYS,
    as_boolean,
    as_strategy_name,
    as_whole,
    canonical_fsdp,
    close_names,
    did_you_mean,
    enumeration_name,
    known_distributed_types,
    known_enumerations,
    known_fsdp_keys,
    known_parallelism_keys,
    known_precisions,
    known_top_level_keys,
    plugin_option_defaults,
    prefetch_key_meant,
    renamed_key,
)
from fsdp_presets.check.findings import FULL_FINETUNE_RULES, CheckContext, Finding, sorted_findings, finding
from fsdp_presets.check.rules_memory import device_and_memory_rules, layout_rules, lora_rules
from fsdp_presets.check.rules_parallel import distributed_config_rules, parallel_rules
from fsdp_presets.schema import (
    T,
    BY_NAME,
    FSDP1_ONLY_KEYS,
    FSDP2_ONLY_KEYS,
    FSDP_CONFIG,
    FSDP_PREFIX,
    PARALLELISM_CONFIG,
    PARALLELISM_PREFIX,
    K,
    P,
    fsdp_key_name,
    fsdp_where,
)


def lint_config(config: Any, *, context: CheckContext = CheckContext()) -> list[Finding]:
    """Every problem the rules find in a parsed accelerate config (``yaml.safe_load`` output)."""
    if not isinstance(config, dict):
        return [finding("yaml-invalid", f"the file holds {type(config).__name__}, not a mapping of settings",
                        "write accelerate's keys (`accelerate config` or `fsdp-presets generate`)")]
    findings: list[Finding] = []
    findings += _top_level(config)
    distributed_type = str(config.get(T.distributed_type, ""))
    fsdp = config.get(FSDP_CONFIG) or {}
    parallelism = config.get(PARALLELISM_CONFIG) or {}
    if not isinstance(fsdp, dict):
        findings.append(finding("invalid-value", f"{FSDP_CONFIG} must be a mapping, got {type(fsdp).__name__}",
                                f"indent the fsdp_* keys under {FSDP_CONFIG}:", FSDP_CONFIG))
        fsdp = {}
    if not isinstance(parallelism, dict):
        findings.append(finding("invalid-value", f"{PARALLELISM_CONFIG} must be a mapping",
                                f"indent the parallelism_config_* keys under {PARALLELISM_CONFIG}:", PARALLELISM_CONFIG))
        parallelism = {}
    # accelerate adds the prefix to fsdp_config keys that lack it (launch.py: "fsdp_" + key).
    written = {fsdp_key_name(key): value for key, value in fsdp.items()}
    findings += _read_as_boolean(config, written)
    # Every rule below reads values as accelerate parses them (FULL_SHARD, 1 and "full_shard" alike).
    fsdp = canonical_fsdp(written)
    if as_boolean(config.get(T.debug, False)):
        findings.append(finding(
            "debug-mode", f"{T.debug}: true turns on accelerate's debug mode (ACCELERATE_DEBUG_MODE): every gather, "
            "broadcast and reduce first checks the tensors' shapes on all ranks with collectives of its own, every "
            "step, which slows training", f"set {T.debug}: false (keep it for a short run that hunts a shape mismatch)",
            T.debug))
    processes, machines = as_whole(config.get(T.num_processes, 1)), as_whole(config.get(T.num_machines, 1))
    for key, count in ((T.num_processes, processes), (T.num_machines, machines)):
        if count is not None and count > MAX_GPUS:  # the bound `launcher` and `plan --gpus` apply
            findings.append(finding("invalid-value", f"{key} {count} is more than {MAX_GPUS}, beyond any cluster",
                                    f"set {key} to the job's real count", key))
    processes, machines = (None if count is not None and count > MAX_GPUS else count for count in (processes, machines))
    if T.num_processes not in config and str(config.get(T.distributed_type, "")) == "FSDP":
        processes = context.gpus
        findings.append(finding(
            "num-processes-unset", f"no {T.num_processes}: the file is meant for `accelerate launch --num_processes N`"
            + (f"; checked for --gpus {context.gpus}" if context.gpus else "; no GPU count or memory verdict"),
            "pass --num_processes (all GPUs of all nodes) to accelerate launch"
            + ("" if context.gpus else ", and --gpus N to `fsdp-presets check` for the memory rules"),
            T.num_processes))
    layout_ok = processes is not None and machines is not None and processes >= 1 and machines >= 1
    if layout_ok and processes % machines:
        findings.append(finding(
            "machines-do-not-divide",
            f"num_processes {processes} is not a multiple of num_machines {machines}: accelerate starts "
            f"num_processes // num_machines = {processes // machines} processes per node, "
            f"{processes // machines * machines} in all",
            f"set num_processes to a multiple of {machines} (e.g. {max(1, processes // machines) * machines})",
            T.num_processes))
    if distributed_type != "FSDP":
        if fsdp:
            findings.append(finding("fsdp-config-ignored", f"distributed_type is {distributed_type or 'unset'}: "
                                    f"{FSDP_CONFIG} is ignored", f"set {T.distributed_type}: FSDP, or drop {FSDP_CONFIG}",
                                    FSDP_CONFIG))
        return sorted_findings(findings)

    version = as_whole(fsdp.get(K.version))
    if K.version not in fsdp:
        findings.append(finding("fsdp-version-missing", f"no {K.version}: `accelerate launch` runs FSDP1 "
                                "(FullyShardedDataParallel), its default", f"nothing to do for FSDP1 ({K.version}: 1 "
                                "says so); FSDP2 also needs the FSDP1 keys rewritten (docs/configuration.md)",
                                FSDP_CONFIG))
        version = 1
    elif version not in (1, 2):
        findings.append(finding("invalid-value", f"{K.version} {fsdp[K.version]!r} is not 1 or 2",
                                f"set {K.version}: 2", fsdp_where(K.version)))
        version = None
    findings += _fsdp_keys(written, version)
    findings += _parallelism(parallelism, version, processes if layout_ok else None, machines if layout_ok else None)
    findings += parallel_rules(parallelism if isinstance(parallelism, dict) else {}, context)
    findings += distributed_config_rules(context, processes if layout_ok else None)
    findings += _wrapping(fsdp, context)
    findings += layout_rules(config, fsdp, parallelism, version, context, processes if layout_ok else None,
                        machines if layout_ok else None)
    if str(config.get(T.mixed_precision, "")).lower() == "fp8":
        backend = str((config.get(T.fp8_config) or {}).get("backend", "AO")).upper()
        package = {"TE": "Transformer Engine", "MSAMP": "MS-AMP", "MS-AMP": "MS-AMP"}.get(backend, "torchao")
        findings.append(finding(
            "fp8-needs-backend", f"mixed_precision fp8 needs {package} installed on the training nodes at launch "
            "(accelerate refuses fp8 where it finds neither torchao nor Transformer Engine)",
            f"install {package} in the training environment", T.mixed_precision))
    if fsdp.get(K.ignored_modules):
        findings.append(finding(
            "ignored-modules", f"{K.ignored_modules} is set ({fsdp[K.ignored_modules]!r}): FSDP neither "
            "shards nor gradient-synchronises ignored parameters, so each rank updates its own copy and the "
            "replicas drift apart", f"remove {K.ignored_modules}; keep embeddings and heads in FSDP units (the "
            "root or tail unit holds them)", fsdp_where(K.ignored_modules)))
    ram_efficient = as_boolean(fsdp.get(K.cpu_ram_efficient_loading, True))
    sync = as_boolean(fsdp.get(K.sync_module_states, True))
    if ram_efficient and sync is False:
        findings.append(finding(
            "ram-efficient-loading-needs-sync", f"{K.cpu_ram_efficient_loading} is true but "
            f"{K.sync_module_states} is false: accelerate launch refuses this (ranks other than 0 start with empty "
            "weights that only the sync fills)", f"set {K.sync_module_states}: true (or remove it)",
            fsdp_where(K.sync_module_states)))
    findings += lora_rules(fsdp, version, context)
    if context.script is not None:
        from fsdp_presets.check.script import script_rules

        findings += script_rules(fsdp, version, context)
    memory = device_and_memory_rules(config, fsdp, parallelism, version, context,
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
    return sorted_findings(findings)


# Settings accelerate reads as names: a bare YAML 1.1 no/off/yes/on becomes a boolean there.
_NAMED_TOP_LEVEL = (T.mixed_precision, T.distributed_type, T.dynamo_backend, T.compute_environment, T.rdzv_backend)
_CRASHES = {T.mixed_precision: "accelerate launch crashes on it (AttributeError: 'bool' object has no attribute "
                               "'lower')",
            T.distributed_type: "accelerate's loader refuses it (not a DistributedType)"}


def _read_as_boolean(config: dict, fsdp: dict) -> list[Finding]:
    """A value YAML turned into a boolean where accelerate wants a name: name that cause."""
    findings = []
    named = [(key, key, config[key]) for key in _NAMED_TOP_LEVEL if key in config] + [
        (key, fsdp_where(key), fsdp[key]) for key in (K.sharding_strategy, K.backward_prefetch, K.state_dict_type,
                                                      K.auto_wrap_policy, K.transformer_layer_cls_to_wrap)
        if key in fsdp]
    for key, where, value in named:
        if isinstance(value, bool):
            word = "no (or off/false)" if value is False else "yes (or on/true)"
            meant = {T.mixed_precision: "'no'", T.distributed_type: "'NO'"}.get(key, "the name, quoted")
            findings.append(finding(
                "yaml-read-as-boolean", f"{key}: YAML 1.1 reads a bare {word} as the boolean {value}, not a name"
                + (f": {_CRASHES[key]}" if key in _CRASHES else ": accelerate does not apply it as you meant"),
                f"quote it: {key}: {meant}", where))
    return findings


def _unknown_key(rule: str, section: str, key, known, consequence: str, where: str, value=None) -> Finding:
    """A key accelerate does not know in ``section``: its closest known name, what accelerate does
    with it, and rename it (when a close name takes its value) or remove it."""
    return finding(rule, f"unknown {section} key {key!r}{did_you_mean(str(key), known)}: {consequence}",
                   renamed_key(str(key), known, value), where)


def _top_level(config: dict) -> list[Finding]:
    known = known_top_level_keys()
    findings = [_unknown_key("unknown-key", "top-level", key, known, "accelerate refuses the whole file "
                             "('had unknown keys')", str(key)) for key in config if key not in known]
    distributed_types = known_distributed_types()
    if T.distributed_type not in config:
        findings.append(finding("invalid-value", "no distributed_type (accelerate requires one)",
                                f"add {T.distributed_type}: FSDP", T.distributed_type))
    elif str(config[T.distributed_type]) not in distributed_types and not isinstance(config[T.distributed_type], bool):
        findings.append(finding(
            "invalid-value", f"{T.distributed_type} {config[T.distributed_type]!r} is not one of accelerate's"
            f"{did_you_mean(str(config[T.distributed_type]), distributed_types)}",
            f"use one of {', '.join(distributed_types)}", T.distributed_type))
    precision = config.get(T.mixed_precision, "no")
    if str(precision).lower() not in known_precisions() and not isinstance(precision, bool):
        findings.append(finding("invalid-value", f"mixed_precision {precision!r} is not one of {known_precisions()}",
                                "use bf16, fp16 or 'no' (quoted: a bare no is YAML false)", T.mixed_precision))
    for key in (T.num_processes, T.num_machines):
        if key in config and (as_whole(config[key]) is None or as_whole(config[key]) < 1):
            findings.append(finding("invalid-value", f"{key} {config[key]!r} must be a whole number >= 1",
                                    f"set {key} to a count", key))
    rank, machines = as_whole(config.get(T.machine_rank, 0)), as_whole(config.get(T.num_machines, 1))
    if rank is None or (machines and not 0 <= rank < machines):
        findings.append(finding("invalid-value", f"{T.machine_rank} {config.get(T.machine_rank)!r} must be 0 .. "
                                f"{T.num_machines} - 1", f"set {T.machine_rank}: 0 in the file; pass --machine_rank on each "
                                "node's launch command", T.machine_rank))
    return findings


def _fsdp_keys(fsdp: dict, version: int | None) -> list[Finding]:
    findings = []
    known = known_fsdp_keys()
    plugin_options = plugin_option_defaults()
    enumerations = known_enumerations()
    for key, value in fsdp.items():
        where = f"{FSDP_CONFIG}.{key}"
        if key not in known and key in plugin_options:
            default = plugin_options[key]
            if default is not None and as_boolean(value) == default:
                findings.append(finding(
                    "ignored-default", f"{key}: {value!r} is a real FSDP option that `accelerate launch` does not read "
                    f"from a config file; its default ({default}) applies anyway", "nothing to do (or remove it)",
                    where))
            else:
                findings.append(finding(
                    "key-not-applied", f"{key} {value!r} is a real FSDP option, but `accelerate launch` does not "
                    "read it from a config file, so it is not applied" + (f" (the default {default!r} is)" if
                                                                           default is not None else ""),
                    f"set it in the training script: FullyShardedDataParallelPlugin({key.removeprefix(FSDP_PREFIX)}=...) "
                    "passed to Accelerator(fsdp_plugin=...), or remove it", where))
            continue
        twin = next((guess for guess in close_names(str(key), known, limit=1) if guess in fsdp), None)
        if key not in known and twin is not None:
            same = canonical_fsdp({twin: value}).get(twin) == canonical_fsdp({twin: fsdp[twin]}).get(twin)
            if same:
                findings.append(finding(
                    "stale-key-beside-new", f"{key} is a name accelerate ignores; {twin} is also set, to the same "
                    "value, so nothing is lost", f"delete {key} (renaming it would write {twin} twice)", where))
            else:
                findings.append(finding(
                    "unknown-fsdp-key", f"unknown {FSDP_CONFIG} key {key!r} (did you mean {twin!r}?): accelerate "
                    f"ignores it silently and applies {twin}: {fsdp[twin]!r}, not {value!r}",
                    f"delete {key} and set {twin}: {value!r} if that is what you meant (renaming it would write "
                    f"{twin} twice)", where))
            continue
        if key not in known and twin is None and prefetch_key_meant(key, known):
            findings.append(_prefetch_not_applied(key, value, prefetch_key_meant(key, known), where, version))
            continue
        if key not in known:
            findings.append(_unknown_key("unknown-fsdp-key", FSDP_CONFIG, key, known, "accelerate ignores it "
                                         "silently, so the setting you meant is not applied", where, value))
            continue
        if key in enumerations and value is not None and not isinstance(value, bool):
            allowed = enumerations[key]
            text = str(value).upper()
            if enumeration_name(key, value) is None:  # accelerate also takes torch's 1-based enum values
                findings.append(finding("invalid-value", f"{key} {value!r} is not one of {', '.join(allowed)}"
                                        f"{did_you_mean(text, allowed)}", f"use one of {', '.join(allowed)}", where))
        if key in STRICT_BOOLEAN_FSDP_KEYS and as_boolean(value) is None:
            findings.append(finding("invalid-value", f"{key} {value!r} is not true or false", "write true or false",
                                    where))
        if key == K.min_num_params and as_whole(value) is None:
            findings.append(finding("invalid-value", f"{key} {value!r} is not a whole number",
                                    "write a parameter count", where))
        if key == K.reshard_after_forward and version == 2 and as_boolean(value) is None:
            findings.append(finding("invalid-value", f"{K.reshard_after_forward} {value!r}: FSDP2 takes true "
                                    "(FULL_SHARD) or false (SHARD_GRAD_OP)", "write true or false", where))
        if version == 2 and key in FSDP1_ONLY_KEYS:
            findings += _fsdp1_key_under_fsdp2(fsdp, key, value, where)
        if version == 1 and key in FSDP2_ONLY_KEYS:
            findings += _fsdp2_key_under_fsdp1(fsdp, key, value, where)
    if version == 2 and str(fsdp.get(K.state_dict_type, "")).upper() == "LOCAL_STATE_DICT":
        findings.append(finding("invalid-value", "LOCAL_STATE_DICT does not exist in FSDP2 (accelerate raises)",
                                "use SHARDED_STATE_DICT", fsdp_where(K.state_dict_type)))
    return findings


_PREFETCH_DEFAULTS = {K.backward_prefetch: "NO_PREFETCH", K.forward_prefetch: False}
"""What accelerate 1.16's FSDP1 plugin applies when the prefetch keys are absent."""


def _prefetch_not_applied(key, value, twin: str, where: str, version) -> Finding:
    """Prefetching changes speed, never what is trained: a prefetch key accelerate does not read is
    a warning, and nothing to do when it asks for what applies anyway."""
    asked = canonical_fsdp({twin: value}).get(twin)
    if version == 2:
        return finding("ignored-default", f"{key}: {value!r} is not read by accelerate, and FSDP2 has no such setting "
                       "(it prefetches on its own)", "nothing to do (or remove it)", where)
    if asked == _PREFETCH_DEFAULTS[twin]:
        return finding("ignored-default", f"{key}: {value!r} is not read by accelerate (the key is {twin}); what "
                       f"applies without it is the same ({_PREFETCH_DEFAULTS[twin]})", "nothing to do (or remove it)",
                       where)
    return finding("prefetch-key-not-applied", f"{key} is not a key accelerate reads (its name is {twin}): the "
                   f"prefetch it asks for ({value}) is not applied, so FSDP runs with {_PREFETCH_DEFAULTS[twin]}: "
                   "slower overlap of communication and compute, the same training",
                   f"rename it to {twin!r}", where)


def _fsdp1_key_under_fsdp2(fsdp: dict, key: str, value: Any, where: str) -> list[Finding]:
    """An FSDP1-only key in an FSDP2 config: an error when it asks for something FSDP2 does not do."""
    effect = BY_NAME[key].fsdp2_ignores
    if key == K.sharding_strategy:
        reshard = as_boolean(fsdp.get(K.reshard_after_forward, True))
        applied = "FULL_SHARD" if reshard is not False else "SHARD_GRAD_OP"
        if as_strategy_name(value) == applied:
            return [finding("ignored-default", f"{key}: {value} is an FSDP1 setting that FSDP2 ignores; "
                            f"{K.reshard_after_forward} gives the same ({applied})", "remove it", where)]
        return [finding("fsdp1-key-under-fsdp2", f"{key} {value} is an FSDP1 setting in an FSDP2 config: {effect}, "
                        f"so this config runs {applied}, not {value}",
                        f"remove it and set {K.reshard_after_forward} (true: FULL_SHARD, false: SHARD_GRAD_OP; "
                        f"hybrid: {P.dp_replicate_size})", where)]
    behaves_like = BY_NAME[key].fsdp2_behaves_like
    moot = behaves_like is None or (str(value).upper() == behaves_like if isinstance(behaves_like, str)
                                    else as_boolean(value) == behaves_like)
    if moot:
        return [finding("ignored-default", f"{key}: {value} is an FSDP1 setting that FSDP2 ignores ({effect}); "
                        "it asks for nothing FSDP2 does not do", "remove it", where)]
    return [finding("fsdp1-key-under-fsdp2", f"{key} {value} is an FSDP1 setting in an FSDP2 config: {effect}",
                    "remove it" + (f", or set {K.version}: 1 to keep it" if key == K.forward_prefetch else ""),
                    where)]


def _fsdp2_key_under_fsdp1(fsdp: dict, key: str, value: Any, where: str) -> list[Finding]:
    """An FSDP2-only key in an FSDP1 config. ``accelerate config`` itself writes the FSDP1 sharding
    strategy as ``fsdp_reshard_after_forward: FULL_SHARD``; accelerate 1.16's launcher then always
    passes ``fsdp_sharding_strategy`` (default FULL_SHARD), which the FSDP1 plugin applies instead.
    So the key matters only when it asks for another strategy than the one applied."""
    if key == K.activation_checkpointing_offload:
        return [finding("fsdp2-key-under-fsdp1", f"{key} is an FSDP2 setting in an FSDP1 config: accelerate refuses "
                        "it with FSDP1", f"remove it, or set {K.version}: 2", where)]
    applied = as_strategy_name(fsdp.get(K.sharding_strategy, "FULL_SHARD")) or "FULL_SHARD"
    asked = as_strategy_name(value)
    flag = as_boolean(value)
    if asked is None and flag is not None:
        asked = "FULL_SHARD" if flag else "SHARD_GRAD_OP"
    if asked == applied:
        return [finding("ignored-default", f"{key}: {value} (as `accelerate config` writes FSDP1 configs) is not read "
                        f"by accelerate's FSDP1 plugin; {K.sharding_strategy} {applied} applies, which is the same",
                        f"nothing to do (or write {K.sharding_strategy}: " + applied + " instead)", where)]
    fix = f"set {K.sharding_strategy}: {asked}" if asked else f"remove it (FSDP1 shards as {K.sharding_strategy} says)"
    if flag is not None:
        fix += f" (or {K.version}: 2, which takes true/false here)"
    return [finding("fsdp2-key-under-fsdp1", f"{key} {value} is not applied under FSDP1: accelerate launch always "
                    f"passes {K.sharding_strategy}, so the plugin runs {applied}" + (f", not {asked}" if asked else ""),
                    fix, where)]


def _parallelism(parallelism: dict, version: int | None, processes: int | None, machines: int | None) -> list[Finding]:
    if not parallelism:
        return []
    known = known_parallelism_keys()
    findings = [_unknown_key("unknown-parallelism-key", PARALLELISM_CONFIG, key, known,
                             "accelerate ignores it silently", f"{PARALLELISM_CONFIG}.{key}")
                for key in parallelism if key not in known]
    if version == 1:
        findings.append(finding("hsdp-needs-fsdp2", f"{PARALLELISM_CONFIG} with {K.version} 1: accelerate requires "
                                f"FSDP2 for it ('You cannot use --use_parallelism_config without ... {K.version}=2'); "
                                "with the version taken from a config file, accelerate 1.16's launcher does not catch "
                                "it (it compares the string '1' with the number 1)",
                                f"set {K.version}: 2, or drop {PARALLELISM_CONFIG} and use {K.sharding_strategy}: "
                                "HYBRID_SHARD", PARALLELISM_CONFIG))
    sizes = {}
    for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
        key = f"{PARALLELISM_PREFIX}{name}"
        value = parallelism.get(key, 1)
        number = as_whole(value)
        if number is None or number < 1:
            findings.append(finding("invalid-value", f"{key} {value!r} must be a whole number >= 1",
                                    "write a size", f"{PARALLELISM_CONFIG}.{key}"))
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
            f"num_machines {machines}, shard = GPUs per node {processes // max(machines, 1)})", PARALLELISM_CONFIG))
    per_node = processes // machines if machines and processes % machines == 0 else None
    shard = sizes["dp_shard_size"] * sizes["tp_size"] * sizes["cp_size"] * sizes["sp_size"]
    if per_node and machines > 1 and (shard > per_node or per_node % shard):
        findings.append(finding(
            "hsdp-shard-spans-nodes", f"HSDP shard groups of {sizes['dp_shard_size']} GPUs do not fit the "
            f"{per_node} GPUs of one node (num_processes {processes} / num_machines {machines}): parameter "
            "all-gathers cross the network every step, which HSDP exists to avoid",
            f"shard inside a node: {P.dp_shard_size}: {per_node}, {P.dp_replicate_size}: "
            f"{machines}", f"{PARALLELISM_CONFIG}.{P.dp_shard_size}"))
    return findings


def _wrap_names(fsdp: dict) -> tuple[list[str] | None, list[Finding]]:
    value = fsdp.get(K.transformer_layer_cls_to_wrap)
    where = fsdp_where(K.transformer_layer_cls_to_wrap)
    if value is None:
        return None, []
    if not isinstance(value, str):
        return None, [finding("wrap-class-format", f"{K.transformer_layer_cls_to_wrap} is a "
                              f"{type(value).__name__} ({value!r}): accelerate passes str(value) on, so no class "
                              "would match", "write one string, names separated by commas: "
                              "LlamaDecoderLayer,LlamaMLP", where)]
    names = value.split(",")  # accelerate splits on "," and does not strip
    findings = []
    if any(name != name.strip() or not name for name in names):
        findings.append(finding("wrap-class-format", f"{K.transformer_layer_cls_to_wrap} {value!r} has spaces or "
                                "empty names: accelerate splits on ',' without stripping, so ' X' matches no class",
                                f"write {','.join(n.strip() for n in names if n.strip())}", where))
    return [name.strip() for name in names if name.strip()], findings


def _wrapping(fsdp: dict, context: CheckContext) -> list[Finding]:
    findings = []
    policy = str(fsdp.get(K.auto_wrap_policy) or "NO_WRAP").upper()
    names, format_findings = _wrap_names(fsdp)
    findings += format_findings
    model = context.model
    if policy == "NO_WRAP":
        findings.append(finding("no-wrap-policy", "no auto-wrap policy: FSDP makes the whole model one unit, "
                                "all-gathered whole for every forward and backward (no memory saved over DDP at the "
                                "peak)", f"set {K.auto_wrap_policy}: TRANSFORMER_BASED_WRAP and the block classes",
                                fsdp_where(K.auto_wrap_policy)))
    if policy == "TRANSFORMER_BASED_WRAP" and not names and not format_findings:
        declared = list(model.profile.structure.get("no_split_modules") or []) if model else []
        missing = model.profile.missing_no_split if model else []
        if model and missing:
            present = [name for name in declared if name not in missing]
            findings.append(finding(
                "no-split-modules-missing", f"no {K.transformer_layer_cls_to_wrap}, so accelerate takes the "
                f"model's _no_split_modules ({', '.join(declared)}), which names {', '.join(missing)} that "
                f"{model.profile.architecture} does not contain: older accelerate versions raise 'Could not find "
                "the transformer layer class', newer ones skip the name" + (
                    " and wrap nothing" if not present else f" and wrap {', '.join(present)} only"),
                f"set {K.transformer_layer_cls_to_wrap}: {','.join(model.profile.wrap_classes)}",
                fsdp_where(K.transformer_layer_cls_to_wrap)))
        else:
            hint = (f": {', '.join(declared)}" if declared else "")
            findings.append(finding(
                "wrap-classes-unset", f"TRANSFORMER_BASED_WRAP without {K.transformer_layer_cls_to_wrap}: accelerate "
                f"wraps the classes the model's _no_split_modules declares{hint}; what gets wrapped then depends on "
                "the model code, not on this file", "name the block classes explicitly" + (
                    f": {','.join(model.profile.wrap_classes)}" if model else " (`fsdp-presets inspect MODEL`)"),
                fsdp_where(K.transformer_layer_cls_to_wrap)))
    if names and model:
        for name in names:
            if name not in model.module_classes:
                findings.append(finding(
                    "wrap-class-not-in-model", f"wrap class {name!r} does not exist in {model.profile.architecture} "
                    f"({model.source}){did_you_mean(name, model.module_classes)}: accelerate raises 'Could not find "
                    "the transformer layer class' once the job has started",
                    f"use the model's blocks: {','.join(model.profile.wrap_classes)}",
                    fsdp_where(K.transformer_layer_cls_to_wrap)))
            elif name not in model.profile.wrap_classes:
                findings.append(finding(
                    "wrap-class-not-a-block", f"wrap class {name!r} is in the model but is not one of its blocks "
                    f"({', '.join(model.profile.wrap_classes)}): FSDP units that do not follow the blocks gather "
                    "more often or hold more than one block at a time", f"wrap the blocks: "
                    f"{','.join(model.profile.wrap_classes)}", fsdp_where(K.transformer_layer_cls_to_wrap)))
    return findings
