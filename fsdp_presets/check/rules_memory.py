"""The checker's rules on the process layout, LoRA/QLoRA, the device and memory (the planner's
view of the file on the GPUs and host RAM it is meant for)."""

from __future__ import annotations

import functools

from fsdp_presets.plan.limits import DEFAULT_SEQ_LEN
from fsdp_presets.fileio import GiB, format_bytes, format_count
from fsdp_presets.preset.accelerate_view import (as_boolean, as_strategy_name, as_whole, enumeration_name,
                                                  known_fsdp_keys, prefetch_key_meant)
from fsdp_presets.check.findings import CheckContext, Finding, finding
from fsdp_presets.plan.shapes import Hardware, TrainingShape
from fsdp_presets.plan.planner import plan
from fsdp_presets.plan.allocator import tensors_and_shown
from fsdp_presets.plan.save_cost import staging_fit
from fsdp_presets.preset.checkpoint_choice import full_state_dict_host_bytes
from fsdp_presets.schema import FSDP_CONFIG, K, P, PARALLELISM_CONFIG, PEFT_WRAP_POLICY, T, fsdp_where


def lora_shape(context: CheckContext):
    """The :class:`~fsdp_presets.plan.shapes.LoraShape` the memory rules plan with, None for full."""
    from fsdp_presets.plan.shapes import LoraShape

    method = context.training_method
    if method not in ("lora", "qlora"):
        return None
    if context.lora is not None:
        return context.lora
    script = context.script
    if script is not None and script.method:  # what the training script loads: dtype, double quantization
        return LoraShape(method=method, base_dtype=script.model_dtype, double_quant=script.double_quant)
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


def lora_rules(fsdp: dict, version, context: CheckContext) -> list[Finding]:
    """The LoRA/QLoRA failures a config file and the method reveal (docs/troubleshooting.md)."""
    method = context.training_method
    if method not in ("lora", "qlora"):
        return []
    findings = []
    # transformers' Trainer (and every TRL trainer) replaces the wrap policy with peft's
    # fsdp_auto_wrap_policy before prepare (update_fsdp_plugin_peft): adapters become units of their own.
    trainer = context.script is not None and context.script.trainer_line is not None
    orig_params = as_boolean(fsdp.get(K.use_orig_params, True))  # accelerate launch's default: true
    if version == 1 and orig_params is True and not trainer:
        extra = ""
        if context.model is not None:
            total = context.model.profile.total_params
            # the flat parameter's dtype: bf16 weights, or (QLoRA) 4-bit values packed in bf16
            extra = (f" (up to {format_bytes(int(total * (0.5 if method == 'qlora' else 2)), digits=0)} of gradients "
                     f"for {format_count(total, compact=True)} frozen parameters, divided by the processes sharding "
                     "them)")
        findings.append(finding(
            "lora-fsdp1-orig-params", f"{method} under FSDP1 with {K.use_orig_params}: true" + (
                "" if K.use_orig_params in fsdp else " (accelerate launch's default)") + ": the decoder-layer "
            "units mix the frozen base and the trainable adapters in one flat parameter, and FSDP1 then allocates "
            f"gradients for the whole flat parameter, frozen weights included{extra}; torch's FSDP documentation "
            "advises against mixing them for this reason", f"set {K.version}: 2 (fsdp-presets generate --method "
            f"{method}); under FSDP1, a Trainer/TRL script avoids it (it wraps the adapters as units of their own: "
            f"pass --script to say so), a plain accelerate loop needs peft's {PEFT_WRAP_POLICY}(model) on the "
            "plugin before prepare", fsdp_where(K.use_orig_params)))
    if version == 1 and orig_params is False and not trainer:
        findings.append(finding(
            "lora-fsdp1-flat-params", f"{method} under FSDP1 with {K.use_orig_params}: false: each flat parameter "
            "must hold weights of one requires_grad, so with the layer wrapping of this file FSDP1 raises 'Must "
            "flatten tensors with uniform requires_grad' unless the training script replaces the wrap policy with "
            f"peft's {PEFT_WRAP_POLICY} (transformers' Trainer and trl do; a plain accelerate script does not)",
            f"set {K.version}: 2 (fsdp-presets generate --method " + method + f"), or {K.use_orig_params}: true "
            f"and peft's {PEFT_WRAP_POLICY}(model) on the plugin before prepare, with the optimizer built after "
            "preparing the model", fsdp_where(K.use_orig_params)))
    # PEFT's documented FSDP1 QLoRA path: a Trainer (peft's wrap policy, mixed precision set to the
    # storage dtype) over a base stored in a float dtype.
    float_storage = context.script is not None and (context.script.quant_storage or "").startswith(
        ("bfloat16", "float16", "float32"))
    if method == "qlora" and version == 1 and not (trainer and float_storage):
        findings.append(finding(
            "qlora-fsdp1", "QLoRA under FSDP1: FSDP1 flattens each unit into one tensor of one dtype, which works "
            "only when the whole unit shares it: bnb_4bit_quant_storage=bfloat16 with norms and adapters in bf16 "
            "too and peft's wrap policy (fp32 norms or adapters: 'Must flatten tensors with uniform dtype'; uint8 "
            "storage: 'Cannot flatten integer dtype tensors'; torchao NF4: 'aten.view(NF4Tensor)' not implemented; "
            "this project's recipes refuse --method qlora under FSDP1); the adapter export under FSDP1 needs the "
            "trainable weights gathered with torch's get_model_state_dict (peft's own save writes zero tensors)",
            f"set {K.version}: 2 with TRANSFORMER_BASED_WRAP on the decoder layer (fsdp-presets generate --method "
            "qlora); keep bnb_4bit_quant_storage=bfloat16", fsdp_where(K.version)))
    state_dict = str(fsdp.get(K.state_dict_type, "SHARDED_STATE_DICT" if version == 2 else
                              "FULL_STATE_DICT")).upper()
    # A Trainer saves a peft model through save_model (the adapter) and needs FULL_STATE_DICT for it:
    # LLaMA-Factory and PEFT's QLoRA examples choose it on purpose. Only an accelerate loop that
    # checkpoints with save_state/load_state meets the quantization-state keys.
    if method == "qlora" and state_dict == "FULL_STATE_DICT" and not trainer:
        findings.append(finding(
            "qlora-full-state-dict", "QLoRA with FULL_STATE_DICT" + (" (accelerate's FSDP1 default)" if
            K.state_dict_type not in fsdp else "") + ": in a training loop that checkpoints with accelerate's "
            "save_state, each save gathers the frozen 4-bit base onto rank 0, and load_state fails on its "
            "quantization-state keys (absmax, quant_map), so the run cannot resume from it. A Trainer/TRL script "
            "is not affected (it saves the adapter through save_model, which needs FULL_STATE_DICT): pass --script "
            "to say which", f"for an accelerate loop: set {K.state_dict_type}: SHARDED_STATE_DICT and resume from "
            "trainable-only (adapter + optimizer) checkpoints, as the recipes' --method lora|qlora do; for a "
            "Trainer/TRL script keep FULL_STATE_DICT", fsdp_where(K.state_dict_type)))
    return findings


_PRIVATE_PREFIXES = ("10.", "192.168.", "127.", "169.254.") + tuple(f"172.{n}." for n in range(16, 32))


def layout_rules(config, fsdp, parallelism, version, context, processes, machines) -> list[Finding]:
    """Rules on the process layout: one process, nodes, rendezvous address, the header's arithmetic."""
    findings = []
    if processes == 1 and machines == 1:
        findings.append(finding(
            "fsdp-single-process", "distributed_type FSDP with num_processes 1: one process shards nothing (every "
            "unit holds the whole model) and pays FSDP's gathers for it",
            f"set {T.num_processes} to the number of GPUs; for one GPU use {T.distributed_type}: 'NO'", T.num_processes))
    if machines and machines > 1:
        address = str(config.get(T.main_process_ip) or "")
        if address.startswith(_PRIVATE_PREFIXES) or address == "localhost":
            findings.append(finding(
                "fixed-main-process-ip", f"main_process_ip {address} is fixed in a config for {machines} machines: "
                "it is the address of one node of one cluster (private or loopback), so on other machines every node "
                "waits at rendezvous for a host that is not there", "remove main_process_ip from the file and pass "
                "--main_process_ip $MASTER_ADDR (the first node of the job) on each node's accelerate launch command",
                T.main_process_ip))
        replicate = as_whole((parallelism or {}).get(P.dp_replicate_size, 1)) or 1
        strategy = as_strategy_name(fsdp.get(K.sharding_strategy, "FULL_SHARD")) if version == 1 else None
        # (FSDP1 with a replicate size asks for HSDP too: hsdp-needs-fsdp2 reports that one)
        hybrid = replicate > 1 if version in (1, 2) and parallelism else strategy in ("HYBRID_SHARD",
                                                                                   "HYBRID_SHARD_ZERO2")
        hybrid = hybrid or strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
        # A deliberate choice when HSDP does not fit one node's GPUs (the planner says so with a model),
        # or under CPU offload, where every step moves each GPU's shards over PCIe: sharding over every
        # node's GPUs halves that per node added (generate chooses it when predicted faster).
        offloading = as_boolean(fsdp.get(K.offload_params, False))
        if version in (1, 2) and not hybrid and strategy != "NO_SHARD" and processes and not offloading and \
                _hybrid_fits(config, fsdp, context, processes, machines) is not False:
            per_node = processes // machines
            fix = (f"shard inside a node, replicate across nodes (HSDP): {PARALLELISM_CONFIG}: "
                   f"{P.dp_replicate_size}: {machines}, {P.dp_shard_size}: {per_node}"
                   if version == 2 else f"{K.sharding_strategy}: HYBRID_SHARD (ZeRO-3 inside a node, replicas "
                   "across nodes)")
            findings.append(finding(
                "full-shard-across-nodes", f"FSDP shards over all {processes} processes of {machines} nodes: every "
                "unit's all-gather and reduce-scatter crosses the network each step (usually several times slower "
                "than inside a node)", fix + "; keep full sharding only when the model does not fit one node's GPUs",
                PARALLELISM_CONFIG if version == 2 else fsdp_where(K.sharding_strategy)))
    summary = (context.metadata or {}).get("summary") or {}
    header_processes, header_machines = summary.get("processes"), summary.get("machines")
    if context.metadata and context.metadata.get("kind") == "fsdp" and header_processes and T.num_processes in config:
        file_processes, file_machines = as_whole(config.get(T.num_processes)), as_whole(config.get(T.num_machines, 1))
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
                f"to {header_processes}", T.num_processes))
    return findings


def _device(config: dict, context: CheckContext) -> str:
    if context.device:
        return context.device
    request = (context.metadata or {}).get("request") or {}
    return "cpu" if request.get("device") == "cpu" else "gpu"


def device_and_memory_rules(config, fsdp, parallelism, version, context, processes, machines) -> list[Finding]:
    findings = []
    device = _device(config, context)
    offload = as_boolean(fsdp.get(K.offload_params, False))
    if device == "cpu" and offload:
        findings.append(finding("offload-on-cpu", f"{K.offload_params}: true in a config for a CPU-only host: "
                                "parameters already live in host memory and torch fails ('Cannot access accelerator "
                                "device')", f"set {K.offload_params}: false", fsdp_where(K.offload_params)))
    model = context.model
    if model is None or processes is None or not machines or processes % machines:
        return findings
    profile = model.profile
    host = context.host_gib * GiB
    per_node = processes // machines
    # accelerate's default: FULL_STATE_DICT for FSDP1, SHARDED_STATE_DICT for FSDP2
    state_dict = str(fsdp.get(K.state_dict_type, "SHARDED_STATE_DICT" if version == 2 else
                              "FULL_STATE_DICT")).upper()
    full_bytes = full_state_dict_host_bytes(profile)
    lora = lora_shape(context)
    if lora is not None:
        from fsdp_presets.plan.lora_memory import adapter_params, base_storage_bytes

        lora_training = _training_shape(config, fsdp, context)
        full_bytes = base_storage_bytes(profile, lora_training) + 12 * adapter_params(profile, lora_training)
    if state_dict == "FULL_STATE_DICT" and full_bytes > host:
        findings.append(finding(
            "full-state-dict-host-memory", f"FULL_STATE_DICT gathers the whole model and optimizer state on rank 0 "
            f"at every save: about {format_bytes(full_bytes, digits=0)} for "
            f"{format_count(profile.total_params, compact=True)} parameters (fp32 weights + Adam moments), more than "
            f"--host-memory {context.host_gib:g} GiB" + (" (it is also accelerate's default when the key is "
                                                                 "missing)" if K.state_dict_type not in fsdp
                                                                 else ""),
            f"set {K.state_dict_type}: SHARDED_STATE_DICT (export full weights afterwards with `fsdp-presets export` "
            "or accelerate merge-weights; a Trainer/TRL script then needs callbacks=[fsdp_presets.FSDPPresetsCallback()], "
            "or its save_model writes no weights)", fsdp_where(K.state_dict_type)))
    if device == "gpu" and as_boolean(fsdp.get(K.cpu_ram_efficient_loading, True)) is False:
        weight_bytes = 4 if profile.structure.get("config_dtype") in (None, "float32") else 2
        need = per_node * profile.total_params * weight_bytes
        if need > host:
            findings.append(finding(
                "ram-efficient-loading-off", f"{K.cpu_ram_efficient_loading}: false makes each of a node's {per_node} "
                f"processes load the full pretrained model into host RAM: about {format_bytes(need, digits=0)}, more than "
                f"--host-memory {context.host_gib:g} GiB", f"set {K.cpu_ram_efficient_loading}: true (only "
                "rank 0 reads the weights)", fsdp_where(K.cpu_ram_efficient_loading)))
    if device != "gpu":
        return findings

    # The planner's view of this config on GPUs of --gpu-memory.
    strategy, hardware = _planner_strategy(fsdp, parallelism, version, processes, machines, context)
    if strategy is None:
        return findings
    shape, stated, unknown = _training_inputs(config, fsdp, context)
    precision = shape.precision
    name, fsdp_version = strategy
    mesh = _mesh_of(context)

    def planned(at: TrainingShape):
        """The config's row at ``at``: on the mesh of the NAME.distributed.json beside it, if any."""
        if mesh is None:
            return plan(profile, hardware, at).get(name, fsdp_version)
        return next((row for row in plan(profile, hardware, at, (mesh,)).strategies if row.is_nd and row.name == name
                     and (row.tp_size, row.ep_size) == (mesh.tp, mesh.ep)), None)

    row = planned(shape)
    if row is None:  # a mesh these GPUs or the model refuse: distributed_config_rules says why
        return findings
    if offload and row.model_state.total * per_node > host:
        findings.append(finding(
            "offload-host-memory", f"{K.offload_params}: true keeps {format_bytes(row.model_state.total)} of model "
            f"states per rank in host RAM, {format_bytes(row.model_state.total * per_node, digits=0)} for a node's {per_node} "
            f"processes: more than --host-memory {context.host_gib:g} GiB",
            "shard over more GPUs (more nodes), or use nodes with more RAM", fsdp_where(K.offload_params)))
    if version == 1 and mesh is None:
        findings += _backward_prefetch_rules(fsdp, context, profile, hardware, shape, row)
    if ((context.metadata or {}).get("summary") or {}).get("async_save"):
        # the generated header's launch line passes --async-save: its staging copy beside what training
        # keeps in host memory (the offloaded states) must fit the node's RAM
        staging = staging_fit(row, hardware, shape, host_bytes=host)
        if not staging.fits:
            findings.append(finding(
                "async-save-host-memory", f"the launch line's --async-save copies every rank's shards into host "
                f"memory at each save: {staging.describe()}, more than --host-memory {context.host_gib:g} GiB",
                "drop --async-save from the launch line (each save then stops training until it is written), or "
                "regenerate the preset with your nodes' RAM (--host-memory GiB)", None))
    if not row.fits:
        where = f"{row.label} on {processes} GPUs of {context.gpu_gib:g} GiB"
        assumed = f"assuming {', '.join(stated)}"
        usable = hardware.usable_bytes / GiB
        # What the unknown inputs could be at best: the script may checkpoint activations and
        # train in bf16 (transformers' Trainer: gradient_checkpointing=True, bf16=True).
        best = shape.replace(**{key: value for key, (value, _) in unknown.items()})
        lower = planned(best) if unknown else None
        if lower is not None and lower.fits:
            # the fewest conditions that make it fit: one input alone where one is enough
            singles = [(words, planned(shape.replace(**{key: value}))) for key, (value, words) in unknown.items()]
            enough = [(words, alone) for words, alone in singles if alone.fits] or [
                (" and ".join(words for _, words in unknown.values()), lower)]
            conditions = ", or if ".join(f"{words} ({alone.per_gpu.total / GiB:.1f} GiB per GPU)"
                                         for words, alone in enough)
            findings.append(finding(
                "fits-only-if", f"{where} fits only if {conditions}, of {usable:.1f} usable; as the config alone says "
                f"it needs {tensors_and_shown(row)} ({assumed})",
                f"make sure the training script does so, or say what it does: --script TRAIN.py, "
                f"{', '.join(_FLAG_OF[key] for key in unknown)}", None))
        elif precision == "fp32" and "precision" not in unknown and planned(shape.replace(precision="bf16")).fits:
            bf16 = planned(shape.replace(precision="bf16"))
            findings.append(finding(
                "fp32-does-not-fit", f"fp32: {where} needs {tensors_and_shown(row)} of "
                f"{usable:.1f} usable ({assumed}); bf16 needs {bf16.per_gpu.total / GiB:.1f}",
                f"set {T.mixed_precision}: bf16 (or bf16=True in the Trainer's arguments)", T.mixed_precision))
        else:
            findings.append(finding(
                "does-not-fit", f"{where} needs {tensors_and_shown(lower or row)} of {usable:.1f} "
                f"usable ({', '.join(_stated(best, context)) if lower is not None else assumed})",
                "`fsdp-presets plan` / `fsdp-presets generate` for what fits (activation checkpointing, offload, "
                "more GPUs)", None))
    if precision == "fp16" and profile.structure.get("config_dtype") == "bfloat16":
        findings.append(finding(
            "fp16-on-bf16-model", f"mixed_precision fp16 on {profile.architecture}, trained in bf16: bf16 weights and "
            "activations can exceed fp16's range (max 65504) and overflow", f"set {T.mixed_precision}: bf16",
            T.mixed_precision))
    return findings


def _backward_prefetch_rules(fsdp, context: CheckContext, profile, hardware, shape, row) -> list[Finding]:
    """FSDP1 with a backward prefetch other than BACKWARD_PRE (accelerate applies NO_PREFETCH when the key
    is missing): the step the planner predicts on the config's GPU type, against BACKWARD_PRE's."""
    import dataclasses

    from fsdp_presets.plan.step_time import clearly_faster, step_time

    written = fsdp.get(K.backward_prefetch)
    applied = "NO_PREFETCH" if written is None else enumeration_name(K.backward_prefetch, written)
    if applied in (None, "BACKWARD_PRE"):  # a value accelerate refuses: the invalid-value rule says so
        return []
    known = known_fsdp_keys()
    if written is None and any(prefetch_key_meant(key, known) == K.backward_prefetch
                               for key in fsdp if key not in known):
        return []  # the key under an old name: prefetch-key-not-applied says so, with the rename

    gpu = context.gpu_type
    timed = dataclasses.replace(hardware, gpu=gpu)
    asked = step_time(profile, timed, shape.replace(backward_prefetch=applied), row).step_s
    prefetched = step_time(profile, timed, shape.replace(backward_prefetch="BACKWARD_PRE"), row).step_s
    if not clearly_faster(prefetched, asked):
        return []
    how = ("after the previous unit's reduce-scatter, so neither overlaps any computation" if applied == "NO_PREFETCH"
           else "only after the previous unit's gradients are computed, so it overlaps no computation")
    return [finding(
        "backward-prefetch-off", f"{K.backward_prefetch} {applied}"
        + (" (accelerate's default: the key is missing)" if written is None else "")
        + f": FSDP1 starts each unit's backward all-gather {how}: predicted {asked:.3g} s per optimizer step on "
        f"{gpu.name} against {prefetched:.3g} s with BACKWARD_PRE ({asked / prefetched - 1:.0%} slower; "
        f"{', '.join(_stated(shape, context))})",
        f"set {K.backward_prefetch}: BACKWARD_PRE (one more unit's parameters held during backward), or use FSDP2 "
        f"({K.version}: 2), which prefetches on its own", fsdp_where(K.backward_prefetch))]


_FLAG_OF = {"activation_checkpointing": "--activation-checkpointing on|off", "precision": "--precision bf16|fp32",
            "seq_len": "--seq-len N", "micro_batch": "--micro-batch N"}


def _training_inputs(config, fsdp, context):
    """The training shape the memory rules plan with, the assumptions in words, and the inputs
    that are not known: ``{field: (its most favourable value, "the condition in words")}``.

    Each input comes from where it lives: the command's flags, then ``--script`` (Trainer/SFTConfig
    arguments), then the file (its keys, a generated preset's header). Unknown: activation
    checkpointing and bf16 when the file leaves them to the script and no script or flag says;
    the sequence length and micro-batch when nothing says (2048 and 1 are assumed, and stated)."""
    profile = context.model.profile
    script = context.script
    request = (context.metadata or {}).get("request") or {}
    summary = (context.metadata or {}).get("summary") or {}
    unknown = {}
    # what neither the flags, the script's literals nor a generated header say is decided elsewhere:
    # by the script (none given), or by its command line (a script that parses its arguments)
    open_ended = (script is None or script.parses_arguments) and not context.metadata
    seq_len = context.seq_len or (script.seq_len if script else None) or summary.get("seq_len") or \
        request.get("seq_len")
    if not seq_len:
        seq_len = DEFAULT_SEQ_LEN
    if profile.dims.max_position_embeddings:
        seq_len = min(seq_len, profile.dims.max_position_embeddings)
    micro_batch = context.micro_batch or (script.micro_batch if script else None) or summary.get("micro_batch") or 1
    checkpointing = context.activation_checkpointing
    if checkpointing is None:
        checkpointing = bool(as_boolean(fsdp.get(K.activation_checkpointing, False))) or bool(
            script and script.gradient_checkpointing_line)
        if not checkpointing and open_ended:
            unknown["activation_checkpointing"] = (True, "the script turns on gradient checkpointing")
    written = config.get(T.mixed_precision, "no")
    precision = context.precision or (script.precision if script and script.precision else None)
    if precision is None:
        precision = {"fp8": "bf16", "bf16": "bf16", "fp16": "fp16"}.get(str(written).lower(), "fp32")
        if precision == "fp32" and open_ended:
            unknown["precision"] = ("bf16", "it trains in bf16 (bf16=True in the Trainer's arguments)")
    lora = lora_shape(context)
    if lora is not None and lora.method == "qlora" and context.precision is None:
        # transformers' Trainer sets FSDP's mixed precision to the 4-bit base's storage dtype
        # (update_fsdp_plugin_peft): a bf16-stored base computes in bf16 whatever mixed_precision says.
        precision = "fp16" if precision == "fp16" else "bf16"
        unknown.pop("precision", None)
    shape = TrainingShape(seq_len=seq_len, micro_batch=micro_batch, precision=precision,
                          activation_checkpointing=checkpointing,
                          offload=bool(as_boolean(fsdp.get(K.offload_params, False))), lora=lora)
    if lora is None:
        shape = shape.replace(measured=_own_terms(context.model.source, seq_len, precision)[0])
    return shape, _stated(shape, context), unknown


@functools.lru_cache(maxsize=16)
def _own_terms(source: str, seq_len: int, precision: str):
    """``(terms or None, note)``: the model's activation terms from a short, cached rehearsal of its
    config (:func:`fsdp_presets.preset.measured_activations.with_rehearsed_terms`)."""
    from fsdp_presets.preset.measured_activations import with_rehearsed_terms

    shape, note = with_rehearsed_terms(source, TrainingShape(seq_len=seq_len, precision=precision))
    return shape.measured, note


def memory_figures(config, context: CheckContext) -> str | None:
    """How the memory rules' figures for ``config`` are obtained: ``composed from a rehearsal`` of
    the model (FSDP2) or ``estimated``, and from what; None where they do not run (no model, not
    a GPU config)."""
    if context.model is None or not isinstance(config, dict) or _device(config, context) != "gpu":
        return None
    fsdp = config.get(FSDP_CONFIG) if isinstance(config.get(FSDP_CONFIG), dict) else {}
    shape = _training_inputs(config, fsdp, context)[0]
    if shape.lora is not None:
        return "estimated; LoRA/QLoRA terms from the family constants (rehearsals run full fine-tuning only)"
    _, note = _own_terms(context.model.source, shape.seq_len, shape.precision)
    cache = f" ({note['cache']})" if note.get("cache") else ""
    return f"{note['source']}; {note['how']}{cache}"


def _mesh_of(context: CheckContext):
    """The TP/EP :class:`~fsdp_presets.rehearse.mesh.Mesh` of the NAME.distributed.json beside the
    config, or None (none there, FSDP alone, or one the recipes refuse)."""
    from fsdp_presets.rehearse.mesh import Mesh

    sizes = (context.distributed_config or {}).get("sizes")
    if not sizes or (sizes["tp_size"] == 1 and sizes["ep_size"] == 1):
        return None
    return Mesh(tp=sizes["tp_size"], ep=sizes["ep_size"])


def _stated(shape, context) -> list[str]:
    """The shape's inputs in words, for a verdict's message."""
    words = [f"sequence {shape.seq_len}", f"micro-batch {shape.micro_batch}", shape.precision,
             "activation checkpointing" if shape.activation_checkpointing else "no activation checkpointing"]
    if shape.offload:
        words.append("CPU offload")
    if shape.lora is not None:
        words.append(f"{shape.lora.method} r {shape.lora.r}")
    return words


def _training_shape(config, fsdp, context) -> TrainingShape:
    """The training shape of :func:`_training_inputs` alone."""
    return _training_inputs(config, fsdp, context)[0]


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
        replicate = as_whole((parallelism or {}).get(P.dp_replicate_size, 1)) or 1
        if replicate > 1 and machines > 1:
            return ("HYBRID_SHARD", 2), hardware
        reshard = as_boolean(fsdp.get(K.reshard_after_forward, True))
        return (("FULL_SHARD" if reshard is not False else "SHARD_GRAD_OP"), 2), hardware
    strategy = str(fsdp.get(K.sharding_strategy, "FULL_SHARD")).upper()
    if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "HYBRID_SHARD_ZERO2"):
        return (("HYBRID_SHARD", 1), hardware) if machines > 1 else (("FULL_SHARD", 1), hardware)
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        return (strategy, 1), hardware
    return None, None
