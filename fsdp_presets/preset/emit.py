"""A :class:`~fsdp_presets.preset.presets.Preset` said to accelerate: its config dict, in accelerate's own
schema (what ``accelerate config`` writes), and the YAML text with a self-describing header::

    text = render_preset(preset, output="accelerate_configs/llama_1x8.yaml")
    ddp_text = render_ddp_baseline(preset, output=..., baseline_output="accelerate_configs/llama_1x8.ddp.yaml")

The header says what the file is, the exact command that generated it, the exact command that
launches it, the planner's numbers behind its choices and the reasons. Accelerate refuses unknown
top-level keys (``ClusterConfig.from_yaml_file``), so the one machine-readable line that
rescaling reads back (``# fsdp-presets: {...}``) is a comment. Pure: text in, text out.

Every key and its order come from the table in :mod:`fsdp_presets.schema`;
:func:`written_config` builds any other config (tests, scripts) through the same table; the
commands the header names come from :mod:`fsdp_presets.preset.emit_commands`.
"""

from __future__ import annotations

import json
import operator
import textwrap
from pathlib import Path

import yaml

from fsdp_presets.fileio import GiB, format_bytes, format_count
from fsdp_presets.flags import DISTRIBUTED_CONFIG
from fsdp_presets.preset.emit_commands import SHELL_VARIABLES, LaunchHints, generate_words, launch_words, number_text
from fsdp_presets.preset.choices import Preset
from fsdp_presets.launching.quoting import comment_text, is_one_line, shell_word
from fsdp_presets.schema import (
    T,
    FSDP_CONFIG,
    FSDP_KEYS,
    PARALLELISM_CONFIG,
    PARALLELISM_KEYS,
    PARALLELISM_PREFIX,
    PEFT_WRAP_POLICY,
    SHARDING_SECTIONS,
    TOP_LEVEL_KEYS,
    ConfigKey,
    K,
    fsdp_key,
)

METADATA_PREFIX = "# fsdp-presets: "
"""Start of the comment line holding the request (JSON) that generated a file."""
METADATA_FORMAT = 1
"""Version of that line's content; bumped when its meaning changes."""
_WIDTH = 100


# --------------------------------------------------------------------------- config dicts


def accelerate_config(preset: Preset) -> dict:
    """The accelerate config of ``preset`` (FSDP), keys in the order ``accelerate config`` writes:
    every key of :data:`~fsdp_presets.schema.FSDP_KEYS` written for its FSDP version, with the
    Preset field or the constant (and the reason) the table names."""
    parallelism = preset.parallelism
    config = _machine_keys(preset, "FSDP")
    config[FSDP_CONFIG] = {key.name: _emitted_value(key, preset) for key in FSDP_KEYS
                           if parallelism.fsdp_version in key.emitted_for}
    if parallelism.hsdp and parallelism.fsdp_version == 2:
        config[PARALLELISM_CONFIG] = {key.name: _emitted_value(key, preset) for key in PARALLELISM_KEYS
                                      if key.preset}
    if parallelism.tp_size > 1 and accelerate_runs_tp():
        # accelerate's own FSDP2 x TP: data-parallel sharding over the ranks left beside TP
        sizes = {"dp_replicate_size": parallelism.replicate_size,
                 "dp_shard_size": parallelism.shard_size // parallelism.tp_size, "tp_size": parallelism.tp_size}
        config[PARALLELISM_CONFIG] = {f"{PARALLELISM_PREFIX}{name}": value for name, value in sizes.items()}
    return config


def accelerate_runs_tp() -> bool:
    """Whether the installed accelerate/transformers pair can prepare an FSDP2 x TP model (tried:
    :func:`fsdp_presets.rehearse.mesh.accelerate_tp_import_problem`)."""
    from fsdp_presets.rehearse.mesh import accelerate_tp_import_problem

    return accelerate_tp_import_problem() is None


def _emitted_value(key: ConfigKey, preset: Preset):
    if key.preset is None:
        return key.emitted
    value = operator.attrgetter(key.preset)(preset)
    return ",".join(value) if isinstance(value, (tuple, list)) else value


def ddp_config(preset: Preset) -> dict:
    """The matching DDP baseline: same processes, machines and mixed precision, no sharding; a TP/EP
    preset's: one process per data-parallel rank (a TP group's micro-batches on one process)."""
    return machine_keys(distributed_type="MULTI_GPU", num_processes=baseline_processes(preset),
                        num_machines=preset.parallelism.num_machines, mixed_precision=preset.precision.mixed_precision)


def baseline_processes(preset: Preset) -> int:
    """Processes of the DDP baseline: the preset's data-parallel ranks, which see the same samples."""
    return preset.parallelism.num_processes // preset.parallelism.tp_size


def ddp_baseline_of(config: dict) -> dict:
    """The DDP baseline of any accelerate config: its machine and precision keys, no sharding
    section (:data:`~fsdp_presets.schema.SHARDING_SECTIONS`), ``distributed_type: MULTI_GPU``."""
    baseline = {key: value for key, value in config.items() if key not in SHARDING_SECTIONS}
    baseline[T.distributed_type] = "MULTI_GPU"  # DDP; on a CPU-only host it runs as MULTI_CPU over gloo
    return baseline


def _machine_keys(preset: Preset, distributed_type: str) -> dict:
    return machine_keys(distributed_type=distributed_type, num_processes=preset.parallelism.num_processes,
                        num_machines=preset.parallelism.num_machines,
                        mixed_precision=preset.precision.mixed_precision)


def machine_keys(*, distributed_type: str, num_processes: int, num_machines: int = 1,
                 mixed_precision: str = "no") -> dict:
    """The top-level keys every written config holds, in the order ``accelerate config`` writes them."""
    # NOTE: `use_cpu: false` also for --device cpu presets (the table's reason for use_cpu).
    given = {T.distributed_type: distributed_type, T.num_processes: num_processes, T.num_machines: num_machines,
             T.mixed_precision: mixed_precision}
    return {key.name: given.get(key.name, key.emitted) for key in TOP_LEVEL_KEYS if key.emitted_for}


def written_config(*, distributed_type: str = "FSDP", num_processes: int, num_machines: int = 1,
                   mixed_precision: str = "no", fsdp: dict | None = None, parallelism: dict | None = None) -> dict:
    """An accelerate config from settings (the tests' and scripts' writer): ``fsdp`` and
    ``parallelism`` entries by short name (``version``, ``dp_shard_size``) or full name, written in the
    table's order; an unknown name raises ValueError (a typo must not write a key accelerate ignores)."""
    config = machine_keys(distributed_type=distributed_type, num_processes=num_processes,
                          num_machines=num_machines, mixed_precision=mixed_precision)
    if distributed_type == "FSDP" and fsdp is not None:
        named = {fsdp_key(name).name: value for name, value in fsdp.items()}
        config[FSDP_CONFIG] = {key.name: named[key.name] for key in FSDP_KEYS if key.name in named}
    if parallelism:
        known = {key.short: key.name for key in PARALLELISM_KEYS}
        unknown = [name for name in parallelism if name.removeprefix(PARALLELISM_PREFIX) not in known]
        if unknown:
            raise ValueError(f"unknown {PARALLELISM_CONFIG} keys {unknown}; known: {', '.join(known)}")
        config[PARALLELISM_CONFIG] = {known[name.removeprefix(PARALLELISM_PREFIX)]: value
                                      for name, value in parallelism.items()}
    return config


def emitted_constants(version: int) -> dict:
    """The constant ``fsdp_config`` settings the emitter writes for FSDP``version`` (short names)."""
    return {key.short: key.emitted for key in FSDP_KEYS
            if key.preset is None and version in key.emitted_for}


def config_yaml(config: dict) -> str:
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def _method_lines(preset: Preset) -> list[str]:
    """Header lines for LoRA/QLoRA: the method, the adapter and the base's storage, none of which
    accelerate YAML holds (the recipe flags of the launch command carry them)."""
    lora = preset.request.lora_shape
    if lora is None:
        return []
    from fsdp_presets.plan.lora_memory import adapter_params, base_storage_bytes, default_target_modules

    shape = preset.memory_plan.shape
    targets = ",".join(lora.target_modules) if lora.target_modules else ",".join(
        default_target_modules(preset.profile))
    base = ("bitsandbytes 4-bit nf4 (transformers BitsAndBytesConfig load_in_4bit, bnb_4bit_quant_type nf4, "
            "bnb_4bit_quant_storage bfloat16 so that FSDP shards it, no double quantization)"
            if lora.method == "qlora" else "frozen in its storage dtype")
    text = (f"method: {lora.method}, r {lora.r}, alpha {number_text(lora.lora_alpha)}, dropout {number_text(lora.dropout)}, "
            f"target modules {targets}: {format_count(adapter_params(preset.profile, shape), compact=True)} trainable parameters "
            f"(fp32 with fp32 gradients and AdamW state); base {base}, "
            f"{format_bytes(base_storage_bytes(preset.profile, shape))} stored. FSDP"
            f"{preset.parallelism.fsdp_version}: " + (
                "TRANSFORMER_BASED_WRAP on the decoder layer (accelerate's FSDP2 ignores peft's wrap policy); "
                "model and optimizer prepared together" if preset.parallelism.fsdp_version == 2 else
                f"{K.use_orig_params} true, and the recipe sets peft's {PEFT_WRAP_POLICY} on the plugin and "
                "builds the optimizer after preparing the model") +
            ". Checkpoints hold the adapter and its optimizer state only (the base is reloaded from --model).")
    return ["#"] + _wrapped(text, first="# ", rest="#   ")


def _shell_lines(words: list[str], indent: str = "#   ") -> list[str]:
    """A long command wrapped with backslashes, each line a comment. Every word is quoted for
    the shell on one line (``$NAME`` words are the script's variables, left for the shell)."""
    lines, current = [], indent
    for word in (word if word in SHELL_VARIABLES else shell_word(word) for word in words):
        if len(current) + len(word) + 1 > _WIDTH - 2 and current.strip("# "):
            lines.append(current + " \\")
            current = "#       "
        current += ("" if current.endswith(" ") else " ") + word
    lines.append(current)
    return lines


def _wrapped(text: str, *, first: str = "#   - ", rest: str = "#     ") -> list[str]:
    return textwrap.wrap(comment_text(text), width=_WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False, break_long_words=False)


# --------------------------------------------------------------------------- headers


def _what_it_is(preset: Preset) -> str:
    request, parallelism, profile = preset.request, preset.parallelism, preset.profile
    unit = "CPU processes" if request.device == "cpu" else "GPUs"
    layout = (f"{parallelism.num_machines} nodes x {request.gpus_per_node} {unit}" if parallelism.num_machines > 1
              else f"{parallelism.num_processes} {unit}")
    return (f"Accelerate FSDP{parallelism.fsdp_version} config: {profile.architecture} "
            f"({format_count(profile.total_params, compact=True)} parameters, from {comment_text(request.model)}) on {layout}")


def _settings_line(preset: Preset) -> str:
    precision = {"no": "fp32"}.get(preset.precision.mixed_precision, preset.precision.mixed_precision)
    return (f"{preset.parallelism.label}, {precision}, activation checkpointing "
            f"{'on' if preset.savers.activation_checkpointing else 'off'}, offload "
            f"{'on' if preset.savers.offload else 'off'}, {preset.state_dict.state_dict_type}, micro-batch "
            f"{preset.batch.micro_batch} x {preset.batch.accumulation} accumulation")


def _hardware_line(preset: Preset) -> str:
    hardware, shape = preset.memory_plan.hardware, preset.memory_plan.shape
    request = preset.request
    if request.device == "cpu":
        memory = (f"{request.host_bytes / GiB:g} GiB host RAM per node shared by "
                  f"{request.gpus_per_node} processes ({format_bytes(hardware.usable_bytes)} usable each)")
    else:
        memory = (f"{hardware.gpu_memory_bytes / GiB:g} GiB {request.gpu_type.name + ' ' if request.gpu else ''}GPUs "
                  f"({format_bytes(hardware.usable_bytes)} usable: {format_bytes(hardware.reserved_bytes)} reserved for "
                  f"the CUDA context and libraries), {request.host_bytes / GiB:g} "
                  "GiB host RAM per node"
                  + (f", {request.inter_node_gbps:g} Gb/s per GPU between nodes" if request.inter_node_gbps else ""))
    return (f"{memory}; sequence {shape.seq_len}, micro-batch {shape.micro_batch}, {shape.precision}, "
            f"{shape.optimizer}, activation checkpointing {'on' if shape.activation_checkpointing else 'off'}, "
            f"offload {'on' if shape.offload else 'off'}")


def _device_word(preset: Preset) -> str:
    return "process" if preset.request.device == "cpu" else "GPU"


def _table_unit(preset: Preset) -> tuple[str, int]:
    """GiB for real models, MiB or KiB for tiny debug ones (so the table never reads 0.00)."""
    from fsdp_presets.fileio import byte_unit

    return byte_unit(max(row.per_gpu.total for row in preset.memory_plan.strategies))


def _planner_table(preset: Preset, *, mark: str) -> list[str]:
    headers = ["strategy", "states", "activ", "buffers", "total", "fits", "max mb", "comm", "inter-node"]
    _, size = _table_unit(preset)

    def _gib(count: int) -> str:
        return f"{count / size:.2f}"

    rows = []
    for row in preset.memory_plan.strategies:
        chosen = row.label == mark
        states = row.per_gpu.params + row.per_gpu.grads + row.per_gpu.optimizer
        rows.append([
            ("* " if chosen else "  ") + row.label, _gib(states), _gib(row.per_gpu.activations),
            _gib(row.per_gpu.buffers), _gib(row.per_gpu.total), "yes" if row.fits else "no",
            str(row.max_micro_batch), _gib(row.comm.total), _gib(row.comm.inter_node),
        ])
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        return "#   " + "  ".join(cell.ljust(width) if index == 0 else cell.rjust(width)
                                   for index, (cell, width) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers)] + [line(row) for row in rows]


def predicted_time(preset: Preset, *, baseline: bool = False):
    """This preset's step time on its request's GPU type (``--gpu``, else
    :data:`~fsdp_presets.plan.gpus.DEFAULT_GPU`; :mod:`fsdp_presets.plan.step_time`), or with
    ``baseline`` its DDP baseline's (the DDP row at the same micro-batch and accumulation). None for a
    CPU preset (``plan --device cpu`` measures the host), and for a baseline that does not fit or
    that runs one process per TP group (not a row of this plan)."""
    from fsdp_presets.plan.step_time import predicted_on

    if preset.request.device == "cpu":
        return None
    row = preset.row
    if baseline:
        row = preset.memory_plan.get("DDP")
        if preset.parallelism.is_nd or not row.fits:
            return None
    return predicted_on(preset.request.gpu_type.name, preset.profile, preset.memory_plan, row)


def _predicted_lines(preset: Preset, *, baseline: bool = False, indent: str = "#   ") -> list[str]:
    time = predicted_time(preset, baseline=baseline)
    if time is None:
        return []
    other = ("" if preset.request.gpu else " (for other GPUs: generate ... --gpu NAME)")
    return _wrapped(f"{'Predicted' if baseline else 'predicted'} on {preset.request.gpu_type.name}: "
                    f"{time.step_s:.3g} s per optimizer step, "
                    f"{time.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {time.mfu:.0%}, "
                    f"{time.exposed_comm_fraction:.0%} waiting on communication{other}; compare shows a run's "
                    "measured tokens/s against this",
                    first=indent, rest=indent)


def _metadata(preset: Preset, *, kind: str, output: str, baseline_output: str | None, launch: LaunchHints) -> str:
    document = metadata_document(preset, kind=kind, output=output, baseline_output=baseline_output, launch=launch)
    return METADATA_PREFIX + json.dumps(document, sort_keys=True, separators=(",", ":"))


def metadata_document(preset: Preset, *, kind: str, output: str, baseline_output: str | None,
                      launch: LaunchHints) -> dict:
    """What a generated file's metadata line holds: the request, launch hints, outputs, summary and
    the predicted step."""
    time = predicted_time(preset, baseline=kind == "ddp-baseline")
    return {
        "format": METADATA_FORMAT,
        "kind": kind,
        "request": preset.request.to_json(),
        "launch": launch.to_json(),
        "outputs": {"config": output, "baseline": baseline_output},
        "summary": {**preset.summary(), **({"processes": baseline_processes(preset)}
                                           if kind == "ddp-baseline" and preset.parallelism.is_nd else {})},
        "predicted": None if time is None else {"gpu": preset.request.gpu_type.name,
                                                "step_time_s": round(time.step_s, 6),
                                                "tokens_per_s_per_gpu": round(time.tokens_per_s_per_gpu, 1),
                                                "mfu": round(time.mfu, 4)},
    }


def render_preset(preset: Preset, *, output: str, baseline_output: str | None = None,
                  launch: LaunchHints = LaunchHints()) -> str:
    """The FSDP config file: header, then accelerate's keys."""
    command = generate_words(preset.request, output=output, baseline_output=baseline_output, launch=launch)
    lines = [
        f"# {_what_it_is(preset)}",
        f"# {_settings_line(preset)}",
        "#",
        "# Generated; regenerate rather than edit (the same command rewrites this file):",
        *_shell_lines(command),
        "#",
        *(_mesh_launch_lines(preset, output, launch) if preset.parallelism.is_nd else [
            "# Launch" + (" (on every node; NODE_RANK 0..N-1, MAIN_PROCESS_IP the address of node 0;"
                          " `--launcher slurm|torchrun|accelerate` writes this as a script)"
                          if preset.parallelism.num_machines > 1 else "") + ":",
            *_shell_lines(launch_words(preset, config_file=output, launch=launch))]),
        *_method_lines(preset),
    ]
    if baseline_output:
        lines.append(f"# DDP baseline for the convergence check: {comment_text(baseline_output)}")
    lines += [
        "#",
        f"# Planner, per {_device_word(preset)} in {_table_unit(preset)[0]}; comm = {_table_unit(preset)[0]} each "
        f"{_device_word(preset)} sends per optimizer step; * = this preset:",
        *_wrapped(_hardware_line(preset), first="#   ", rest="#   "),
        *_planner_table(preset, mark=preset.row.label),
        *_wrapped(f"memory figures: {preset.memory_figures}", first="#   ", rest="#   "),
        *_predicted_lines(preset),
        *_rehearsed_lines(preset, output),
        "#",
        "# Decisions:",
    ]
    for topic, reason in preset.decisions():
        lines += _wrapped(f"{topic}: {reason}")
    lines += ["#", "# Embeddings, norms, output head:"]
    for part in preset.wrap.model_parts:
        lines += _wrapped(part)
    if preset.notes:
        lines += ["#", "# Notes:"]
        for note in preset.notes:
            lines += _wrapped(note)
    lines += ["#", _metadata(preset, kind="fsdp", output=output, baseline_output=baseline_output, launch=launch)]
    return _assemble(lines, accelerate_config(preset))


def mesh_about(preset: Preset, output: str) -> list[str]:
    """What a TP/EP preset is and how it is used, in sentences (the YAML's header and the JSON's
    ``about``)."""
    from fsdp_presets.preset.emit_distributed import distributed_config_path, trainer_config_path

    parallelism = preset.parallelism
    json_path = distributed_config_path(output)
    pair = ("the installed accelerate/transformers pair prepares FSDP2 x TP itself, so this config carries "
            "the mesh too (parallelism_config)" if parallelism.tp_size > 1 and accelerate_runs_tp() else
            "accelerate's own path does not carry this mesh here (" + (
                "accelerate has no expert parallelism" if parallelism.tp_size == 1 else
                "the installed pair cannot prepare FSDP2 x TP; fsdp-presets check rule tp-pair-cannot-run") + ")")
    sizes = parallelism.distributed_config()
    recipes = (f"The recipes load the model with it ({DISTRIBUTED_CONFIG.name} {json_path}, as launched above)"
               if sizes["dp_replicate_size"] * sizes["fsdp_size"] > 1 else
               f"The recipes refuse this mesh: it has no data-parallel ranks (fsdp_size 1), transformers applies no "
               f"FSDP and accelerate's FSDP2 would wrap the TP model again (--gpus {2 * parallelism.num_processes} "
               f"keeps {parallelism.tp_size}-way TP with FSDP 2)")
    return [
        f"{parallelism.label}: the model is sharded by transformers' DistributedConfig, whose arguments are "
        f"{json_path} ({', '.join(f'{key}={value}' for key, value in sizes.items())}); "
        f"{pair}.",
        f"{recipes}; a Trainer "
        f"script loads it as transformers does (the Trainer takes a model so sharded without wrapping it again): "
        f"config = DistributedConfig.from_dict(json.load(open('{json_path}'))); model = "
        f"AutoModelForCausalLM.from_pretrained(MODEL, distributed_config=config).",
        f"A Trainer script launches with {trainer_config_path(output)} (DDP type, all "
        f"{parallelism.num_processes} processes of the mesh: the Trainer prepares its optimizer alone, which "
        f"accelerate refuses under FSDP); it checkpoints such a model with save_only_model=True, as transformers "
        f"asks, and FSDPPresetsCallback saves and resumes its whole state (model and optimizer shards, scheduler, "
        f"RNG).",
        "Hold the run to its DDP baseline (fsdp-presets converge): tensor parallelism has counted the loss "
        "tp_size times without an error (transformers issues 45994, 39674).",
    ]


def _mesh_launch_lines(preset: Preset, output: str, launch: LaunchHints) -> list[str]:
    lines = ["# Launch:", *_shell_lines(launch_words(preset, config_file=output, launch=launch)), "#", "# Mesh:"]
    for sentence in mesh_about(preset, output):
        lines += _wrapped(sentence)
    return lines


def _rehearsed_lines(preset: Preset, output: str) -> list[str]:
    """What a rehearsal of this very preset measured (shipped presets: fsdp_presets.preset.rehearsed_presets)."""
    from fsdp_presets.preset.rehearsed_presets import missing_rehearsal, recorded_rehearsal

    record = recorded_rehearsal(output, preset.summary())
    if record is None:
        why = missing_rehearsal(output)
        return ["#"] + _wrapped(f"not rehearsed: {why}", first="# ", rest="#   ") if why else []
    gib = GiB
    gpu_gib = preset.memory_plan.hardware.gpu_memory_bytes / gib
    text = (f"rehearsed peak per GPU: {record['peak_bytes'] / gib:.1f} GiB of {gpu_gib:g} GiB ({record['where']}; "
            f"the planner says {record['planner_bytes'] / gib:.1f} GiB): {record['command']}")
    if record.get("same_as"):
        text += f" (the same per-GPU step as {record['same_as']})"
    lines = ["#"] + _wrapped(text, first="# ", rest="#   ")
    if record.get("change"):
        lines += _wrapped(f"changed: {record['change']}", first="# ", rest="#   ")
    return lines


def _companion_file(preset: Preset, *, about: str, kind: str, output: str, baseline_output: str | None,
                    launch: LaunchHints, launch_title: str, launch_line: list[str], notes: list[str],
                    config: dict) -> str:
    """A file generated beside the FSDP config (the DDP baseline, the Trainer config): what it is,
    the command that generated both, how to launch it, ``notes``, its metadata, then ``config``."""
    command = generate_words(preset.request, output=output, baseline_output=baseline_output, launch=launch)
    lines = [
        *_wrapped(about, first="# ", rest="# "),
        "#",
        "# Generated with its FSDP config by:",
        *_shell_lines(command),
        "#",
        f"# {launch_title}:",
        *_shell_lines(launch_line),
        *notes,
        "#",
        _metadata(preset, kind=kind, output=output, baseline_output=baseline_output, launch=launch),
    ]
    return _assemble(lines, config)


def render_ddp_baseline(preset: Preset, *, output: str, baseline_output: str,
                        launch: LaunchHints = LaunchHints()) -> str:
    """The DDP baseline file matching ``preset`` (same processes, machines, precision, batch)."""
    ddp = preset.memory_plan.get("DDP")
    fit = (f"fits: {format_bytes(ddp.per_gpu.total)} per GPU, up to micro-batch {ddp.max_micro_batch}" if ddp.fits
           else f"does not fit here: {format_bytes(ddp.per_gpu.total)} per GPU of "
                f"{format_bytes(preset.memory_plan.hardware.usable_bytes)} usable; run the comparison at a scale where "
                "it does (fewer layers, a smaller sibling model, or --device cpu)")
    nodes = preset.parallelism.num_machines
    about = (f"DDP baseline of {output}: {baseline_processes(preset)} processes on {nodes} "
             f"node{'s' if nodes > 1 else ''}"
             f"{' (one per TP group: the same micro-batches)' if preset.parallelism.tp_size > 1 else ''}, "
             f"mixed precision {preset.precision.mixed_precision}, the same global batch. Every process holds a full "
             "replica and all-reduces full gradients (no sharding): the reference that FSDP must match step by step "
             "(scripts/convergence_check.py, fsdp-presets compare).")
    return _companion_file(
        preset, about=about, kind="ddp-baseline", output=output, baseline_output=baseline_output, launch=launch,
        launch_title="Launch with the FSDP config's recipe flags (the same samples in the same order)",
        launch_line=launch_words(preset, config_file=baseline_output, launch=launch, baseline=True),
        notes=[*_method_lines(preset), "#",
               *_wrapped(f"Planner: DDP at micro-batch {preset.batch.micro_batch} {fit}.", first="# ", rest="# "),
               *_predicted_lines(preset, baseline=True, indent="# ")],
        config=ddp_config(preset))


def trainer_config(preset: Preset) -> dict:
    """A TP/EP preset's config for a ``transformers.Trainer`` script: the FSDP config's machine keys,
    every process of the mesh, ``distributed_type: MULTI_GPU`` (transformers shards the model; the
    Trainer registers it with accelerate as it is)."""
    return _machine_keys(preset, "MULTI_GPU")


def render_trainer_config(preset: Preset, *, output: str, trainer_output: str, baseline_output: str | None = None,
                          launch: LaunchHints = LaunchHints()) -> str:
    """The ``NAME.trainer.yaml`` of a TP/EP preset (:func:`trainer_config`), with its header."""
    from fsdp_presets.preset.emit_distributed import distributed_config_path

    parallelism = preset.parallelism
    about = (f"Trainer config of {output}: {parallelism.label} on {parallelism.num_processes} processes, "
             f"mixed precision {preset.precision.mixed_precision}, for a transformers.Trainer (or TRL) script "
             f"that loads the model with {distributed_config_path(output)}. transformers shards the model at "
             "load time and the Trainer registers it with accelerate as it is, then prepares its optimizer "
             "alone: accelerate allows that under a multi-device type and refuses it under FSDP (\"an "
             "optimizer must be passed together with its model\"), so this file is DDP type with every process "
             "of the mesh (on a CPU-only host fsdp_presets.enable_cpu_fsdp() runs it over gloo). The Trainer "
             "checkpoints such a model only with save_only_model=True; FSDPPresetsCallback then saves and "
             "resumes its whole state (model and optimizer shards as DCP, scheduler, RNG).")
    return _companion_file(
        preset, about=about, kind="trainer", output=output, baseline_output=baseline_output, launch=launch,
        launch_title="Launch (a Trainer script with fsdp_presets.FSDPPresetsCallback: the recipe below, or your own)",
        launch_line=launch_words(preset, config_file=output, launch=launch, trainer_config=trainer_output),
        notes=[], config=trainer_config(preset))


def _assemble(header: list[str], config: dict) -> str:
    """Header comment lines, then the config through the YAML emitter. Refuses (a bug, never a
    file) a header line that is not one comment line, or a text that does not load back as
    exactly ``config``: no value can add a key or end a comment."""
    broken = [line for line in header if not (line.startswith("#") and is_one_line(line))]
    text = "\n".join(header) + "\n" + config_yaml(config)
    if broken or yaml.safe_load(text) != config:
        raise RuntimeError(f"generated header is not plain comment lines (a bug in fsdp-presets): {broken[:1]}")
    return text


def file_metadata(path) -> dict:
    """The ``# fsdp-presets: {...}`` document of the generated file at ``path``, read as a bounded
    regular file; ``{}`` when it has none or cannot be read (its reader reports that itself)."""
    from fsdp_presets.fileio import YAML_MAX_BYTES, read_regular_text

    try:
        return read_metadata(read_regular_text(path, limit=YAML_MAX_BYTES)) or {}
    except (OSError, UnicodeDecodeError, ValueError):
        return {}


def read_metadata(text: str) -> dict | None:
    """The ``# fsdp-presets: {...}`` document of a generated file, None when there is none."""
    for line in text.splitlines():
        if line.startswith(METADATA_PREFIX):
            try:
                document = json.loads(line[len(METADATA_PREFIX):])
            except json.JSONDecodeError:
                return None
            return document if isinstance(document, dict) else None
        if line and not line.startswith("#"):
            break  # the header is over
    return None


def header_model_path(config, source: str) -> str:
    """The model a preset's header names, as a path from here: ``source`` itself when it exists from
    the working folder (or is not a path: a family name), else the first folder above ``config`` that holds it
    (``generate`` writes the model as given, relative to where it ran: the repository's presets
    name ``model_configs/...`` from the repository's root)."""
    given = Path(source)
    if given.is_absolute() or given.exists():
        return source
    for folder in Path(config).resolve().parents:
        if (folder / given).exists():
            return str(folder / given)
    return source


__all__ = [
    "METADATA_PREFIX", "accelerate_config", "accelerate_runs_tp", "config_yaml", "ddp_baseline_of", "ddp_config",
    "baseline_processes", "emitted_constants", "file_metadata", "header_model_path", "machine_keys", "mesh_about",
    "metadata_document", "read_metadata", "render_ddp_baseline", "render_preset", "render_trainer_config",
    "trainer_config", "written_config"
]
