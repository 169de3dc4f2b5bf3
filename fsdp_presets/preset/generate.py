"""From a request to files on disk: what ``fsdp-presets generate`` and scripts/make_presets.py do
besides parsing flags. The request of generate's flags, all checked at once
(:func:`request_from_args`); decide, render and check the texts (:func:`render_files`), rescale a
generated preset to another GPU count (:func:`rescale_source`, :func:`rescaled_request`), refuse to
replace a file ``generate`` did not write (:func:`check_generated_output`), and write every file
through a temporary file loaded back by accelerate first (:func:`write_files`)::

    profile = load_profile("model_configs/llama-3.1-8b")
    files, preset = render_files(profile, PresetRequest(model=..., gpus=8), output="x.yaml",
                                 baseline_output="x.ddp.yaml", launch=LaunchHints())
    write_files({Path(path): text for path, text in files.items()})
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from fsdp_presets.errors import UsageError
from fsdp_presets.fileio import temporary_sibling
from fsdp_presets.preset.request import PresetRequest, parse_global_batch


def load_profile(source: str, *, trust_remote_code: bool = False):
    """The model's :class:`~fsdp_presets.model.profile.ModelProfile`, from the cache
    (:mod:`fsdp_presets.preset.model_cache`: no torch, no transformers) or built on meta and then
    cached, with transformers' advisory warnings silenced (token ids, deprecated keys: noise for a plan)."""
    from fsdp_presets.preset.model_cache import cached_profile, store_profile

    profile, _ = cached_profile(source, trust_remote_code=trust_remote_code)
    if profile is not None:
        return profile
    from transformers.utils import logging as hf_logging

    from fsdp_presets.model.model_loading import load_config
    from fsdp_presets.model.profile import profile_model

    hf_logging.set_verbosity_error()
    config = load_config(source, trust_remote_code=trust_remote_code)
    profile = profile_model(source, trust_remote_code=trust_remote_code, config=config)
    store_profile(source, profile, config, trust_remote_code=trust_remote_code)
    return profile


# --------------------------------------------------------------------------- rescaling


def rescale_source(path) -> tuple[dict | None, str | None]:
    """``(metadata, problem)`` of a preset to rescale (``generate --from PATH``): the header's
    ``# fsdp-presets:`` metadata of an FSDP preset with its request and global batch, or a
    problem saying why the file cannot be rescaled."""
    from fsdp_presets.fileio import YAML_MAX_BYTES, read_regular_text
    from fsdp_presets.preset.emit import read_metadata

    try:
        old = read_metadata(read_regular_text(path, limit=YAML_MAX_BYTES))
    except (OSError, UnicodeDecodeError) as error:
        return None, f"--from {path}: cannot read it ({error})"
    if old is None or old.get("kind") != "fsdp" or not isinstance(old.get("request"), dict) or \
            not isinstance(old.get("summary"), dict) or \
            not isinstance(old["summary"].get("global_batch"), int) or old["summary"]["global_batch"] < 1:
        return None, (f"--from {path}: no '# fsdp-presets:' line of an FSDP preset in its header; only files "
                      "written by `fsdp-presets generate` can be rescaled")
    return old, None


REQUEST_FLAGS = {
    # generate's argparse dest -> PresetRequest field
    "gpus": "gpus", "nodes": "nodes", "device": "device", "gpu": "gpu", "gpu_memory": "gpu_memory_gib",
    "inter_node_gbps": "inter_node_gbps",
    "host_memory": "host_memory_gib", "precision": "precision", "strategy": "strategy",
    "fsdp_version": "fsdp_version", "state_dict": "state_dict", "activation_checkpointing": "activation_checkpointing",
    "offload": "offload", "seq_len": "seq_len", "global_batch": "global_batch", "micro_batch": "micro_batch",
    "method": "method", "lora_r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
    "lora_target_modules": "lora_target_modules", "tp": "tp", "ep": "ep",
}


def request_from_args(args):
    """``(request, launch, old, baseline_output)`` of ``generate``'s parsed flags: the
    :class:`PresetRequest` (of MODEL, or of the preset ``--from`` rescales, read into ``old``), the
    header's launch hints and the DDP baseline's path (None without ``--baseline``). Every problem
    with the flags together is raised at once (:class:`UsageError`), before the model is read."""
    from fsdp_presets.preset.emit_commands import default_baseline_path

    given = {field: getattr(args, dest) for dest, field in REQUEST_FLAGS.items() if getattr(args, dest) is not None}
    problems, old = generate_problems(model=args.model, output=args.output, from_file=args.from_file, gpus=args.gpus,
                                      baseline=args.baseline, baseline_output=args.baseline_output)
    output = str(args.output)
    baseline_output = (args.baseline_output or default_baseline_path(output)) if args.baseline else None
    if baseline_output is not None and Path(baseline_output).resolve() == Path(output).resolve():
        problems.append(f"--baseline-output {baseline_output} is the same file as -o {output}")
    if problems:
        raise UsageError("; ".join(problems))
    request, launch = generation_request(given, model=args.model, old=old, from_file=args.from_file,
                                         launch_model=args.launch_model, launch_data=args.launch_data)
    return request, launch, old, baseline_output


def generate_problems(*, model: str | None, output: str, from_file: str | None, gpus: int | None,
                      baseline: str | None, baseline_output: str | None) -> tuple[list[str], dict | None]:
    """``(problems, old)``: what is wrong with ``generate``'s flags together (one line each, nothing
    read but ``--from``) and the generated preset ``from_file`` rescales (None without one)."""
    problems = []
    if baseline_output and not baseline:
        problems.append("--baseline-output needs --baseline ddp")
    if Path(output).is_dir():
        problems.append(f"-o {output} is a folder; give the .yaml file to write")
    elif not str(output).endswith((".yaml", ".yml")):
        problems.append(f"-o {output}: give a .yaml file name (accelerate reads YAML configs)")
    old = None
    if from_file:
        if model:
            problems.append("give MODEL or --from PRESET.yaml, not both (the preset names its model)")
        old, problem = rescale_source(from_file)
        if problem:
            problems.append(problem)
    elif not model:
        problems.append("give a MODEL (family name, model folder or config.json), or --from PRESET.yaml")
    if not from_file and gpus is None:
        problems.append("--gpus is required")
    return problems, old


def generation_request(given: dict, *, model: str | None, old: dict | None, from_file: str | None,
                       launch_model: str | None, launch_data: str | None):
    """``(request, launch)``: the :class:`PresetRequest` of the flags ``given`` (``{field: value}``)
    for ``model``, or for the preset ``old`` read from ``from_file`` rescaled, and the
    :class:`~fsdp_presets.preset.emit_commands.LaunchHints` of its header (a rescaled preset keeps
    its own unless new ones are given)."""
    from fsdp_presets.preset.emit_commands import LaunchHints

    if old is None:
        return PresetRequest(model=model, **given), LaunchHints(model=launch_model, data=launch_data)
    stored = stored_launch(old)
    return (rescaled_request(old, given, source=from_file),
            LaunchHints(model=launch_model or stored.get("model"), data=launch_data or stored.get("data")))


def check_rescaled_batch(preset, old: dict | None) -> None:
    """Refuse a rescaled preset (of ``old``) whose global batch is not the old one's."""
    if old is not None and preset.batch.global_samples != old["summary"]["global_batch"]:
        raise UsageError(f"rescaling changed the global batch from {old['summary']['global_batch']} to "
                         f"{preset.batch.global_samples} sequences; pass --global-batch to choose one")


def rescaled_request(old: dict, given: dict, *, source) -> PresetRequest:
    """The request of preset metadata ``old`` re-decided with the flags ``given`` (PresetRequest
    fields): the same GPUs per node when only one of --gpus/--nodes changes, and the old global
    batch kept, which must divide over the new GPU count."""
    try:
        old_request = PresetRequest.from_json(old["request"])
    except TypeError as error:
        raise UsageError(f"--from {source}: its '# fsdp-presets:' line does not hold a request this "
                         f"version reads ({error}); regenerate it from the command in its header") from None
    from fsdp_presets.preset.emit import header_model_path

    old_request = dataclasses.replace(old_request, model=header_model_path(source, old_request.model))
    given = dict(given)
    if "gpus" not in given and "nodes" in given:
        given["gpus"] = old_request.gpus // old_request.nodes * given["nodes"]  # same GPUs per node
    if "gpus" in given and "nodes" not in given and old_request.nodes > 1 and \
            given["gpus"] % old_request.gpus_per_node == 0:
        given["nodes"] = given["gpus"] // old_request.gpus_per_node  # same GPUs per node
    elif "gpus" in given and "nodes" not in given:
        given["nodes"] = 1
    kept = old["summary"]["global_batch"]
    tp = given.get("tp") or old_request.tp  # a TP group's GPUs share one data-parallel rank
    if "global_batch" not in given and "gpus" in given and given["gpus"] % tp == 0 and kept % (given["gpus"] // tp):
        ranks = given["gpus"] // tp
        fitting = [n * tp for n in range(1, 4 * kept + 1) if kept % n == 0 and abs(n - ranks) <= ranks]
        per = "one per GPU" if tp == 1 else f"one per TP group of {tp} GPUs"
        raise UsageError(f"rescaling keeps the global batch of {kept} sequences, which does not divide over "
                         f"{ranks} data-parallel ranks ({per}): use a GPU count "
                         + ("that divides" if tp == 1 else "whose data-parallel ranks divide")
                         + f" {kept} (e.g. {', '.join(str(n) for n in fitting[-3:])}) or pass --global-batch")
    return rescale_request(old_request, old["summary"], **given)


def rescale_request(old: PresetRequest, old_summary: dict, **changes) -> PresetRequest:
    """The request for a new layout that keeps the old preset's global batch (in sequences)."""
    changes = {key: value for key, value in changes.items() if value is not None}
    if "global_batch" not in changes:
        changes["global_batch"] = str(old_summary["global_batch"]) if old.global_batch is None or \
            parse_global_batch(old.global_batch)[1] == "tokens" else old.global_batch
    if "micro_batch" not in changes:
        changes["micro_batch"] = None  # re-decided for the new layout
    if "gpu" in changes and "gpu_memory_gib" not in changes:
        changes["gpu_memory_gib"] = None  # another GPU type: its memory, not the old preset's
    return dataclasses.replace(old, **changes)


def describe_changes(old: dict, new: dict) -> list[str]:
    """``gradient accumulation 4 -> 2``, ``HSDP 2x8 -> FULL_SHARD 8``: what a rescale changed."""
    names = {
        "processes": "processes", "machines": "machines", "sharding": "sharding", "fsdp_version": "FSDP version",
        "precision": "mixed precision", "activation_checkpointing": "activation checkpointing",
        "offload": "CPU offload", "state_dict": "state dict", "seq_len": "sequence length",
        "micro_batch": "micro-batch", "gradient_accumulation": "gradient accumulation",
        "data_parallel_size": "data-parallel size", "global_batch": "global batch (sequences)",
    }

    def text(value) -> str:
        if isinstance(value, bool):
            return "on" if value else "off"
        return str(value)

    lines = []
    for key, label in names.items():
        if key in old and key in new and old[key] != new[key]:
            lines.append(f"{label} {text(old[key])} -> {text(new[key])}")
    return lines


def stored_launch(old: dict) -> dict[str, str]:
    """The launch hints (model, data) a preset's metadata recorded."""
    launch = old.get("launch")
    return {key: value for key, value in (launch if isinstance(launch, dict) else {}).items()
            if isinstance(value, str)}


# --------------------------------------------------------------------------- rendering


def render_files(profile, request, *, output: str, baseline_output: str | None, launch,
                 trust_remote_code: bool = False):
    """``({path: text}, preset)``: decide and render, nothing written (the caller checks the texts
    with :func:`fsdp_presets.check.lint.check_generated` before writing them)."""
    from fsdp_presets.preset.emit import render_ddp_baseline, render_preset

    preset = decide_with_rehearsed_terms(profile, request, trust_remote_code=trust_remote_code)
    files = {output: render_preset(preset, output=output, baseline_output=baseline_output, launch=launch)}
    if baseline_output is not None:
        files[baseline_output] = render_ddp_baseline(preset, output=output, baseline_output=baseline_output,
                                                     launch=launch)
    if preset.parallelism.is_nd:
        from fsdp_presets.preset.emit import mesh_about, metadata_document, render_trainer_config
        from fsdp_presets.preset.emit_distributed import (distributed_config_path, render_distributed_config,
                                                          trainer_config_path)

        files[distributed_config_path(output)] = render_distributed_config(
            preset, config_file=output, about=mesh_about(preset, output),
            metadata=metadata_document(preset, kind="distributed-config", output=output,
                                       baseline_output=baseline_output, launch=launch))
        trainer_output = trainer_config_path(output)
        files[trainer_output] = render_trainer_config(preset, output=output, trainer_output=trainer_output,
                                                      baseline_output=baseline_output, launch=launch)
    return files, preset


def decide_with_rehearsed_terms(profile, request, *, trust_remote_code: bool = False):
    """The preset of ``request``, its memory composed from a short, cached rehearsal of the model's
    own config where one runs (:func:`fsdp_presets.preset.measured_activations.with_rehearsed_terms`;
    decided again with those terms), else estimated from the family constants; its
    ``memory_figures`` says which."""
    from fsdp_presets.preset.measured_activations import rehearsed_mesh_terms, with_rehearsed_terms
    from fsdp_presets.preset.presets import decide

    preset = decide(profile, request)
    shape, note = with_rehearsed_terms(request.model, preset.memory_plan.shape, trust_remote_code=trust_remote_code)
    on_mesh, _ = rehearsed_mesh_terms(request.model, shape, (request.mesh,), trust_remote_code=trust_remote_code)
    if shape.measured is not None or on_mesh:
        preset = decide(profile, request, measured=shape.measured, measured_on_mesh=on_mesh)
    source = preset.row.source
    how = note["how"] if source == note["source"] else f"{preset.row.label} from the family constants"
    return dataclasses.replace(preset, memory_figures=f"{source}; {how}")


# --------------------------------------------------------------------------- writing


def check_outputs(files: dict, *, config_file: str, script_path=None, force: bool = False) -> None:
    """Refuse, before anything is written, texts that carry something that looks like an access
    token, outputs ``generate`` did not write (unless ``force``: :func:`check_generated_output`) and
    a launch script (``script_path``) that is one of the configs or a file fsdp-presets did not write."""
    from fsdp_presets.launching.launchers import carries_token, check_launcher_output

    if any(carries_token(text) for text in files.values()):
        raise UsageError("the generated config would carry a value that looks like an access token (hf_..., sk-...; "
                         "not shown); pass secrets through the environment, never in a flag that is written to "
                         "a file (nothing was written)")
    for path in files:
        check_generated_output(Path(path), force=force)
    if script_path is not None:
        if any(Path(script_path).resolve() == Path(path).resolve() for path in files):
            raise UsageError(f"--launch-output {script_path} is one of the configs this command writes; give "
                             "the script another name (nothing was written)")
        check_launcher_output(script_path, config_file=config_file, force=force)


def generated_lines(preset, *, output: str, baseline_output: str | None, launch_command: list[str],
                    rescaled_from: str | None = None, old_summary: dict | None = None) -> list[str]:
    """What ``generate`` says it wrote: the preset's choices, the baseline, the notes and the launch
    command; for a rescaled preset (``rescaled_from``, its ``old_summary``) what changed first."""
    from fsdp_presets.preset.model_cache import describe_cache

    from fsdp_presets.preset.emit_commands import command_text

    summary = preset.summary()
    lines = []
    if rescaled_from is not None:
        lines.append(f"rescaled {rescaled_from} -> {output}: global batch {summary['global_batch']} sequences kept")
        lines += [f"  {line}" for line in describe_changes(old_summary, summary) or ["nothing changed"]]
    lines.append(f"wrote {output}: {preset.parallelism.label} (FSDP{preset.parallelism.fsdp_version}), "
                 f"{preset.precision.planner_precision}, activation checkpointing "
                 f"{'on' if summary['activation_checkpointing'] else 'off'}, offload "
                 f"{'on' if summary['offload'] else 'off'}, micro-batch {summary['micro_batch']} x "
                 f"{summary['gradient_accumulation']} accumulation x {summary['data_parallel_size']} ranks")
    cache = f" ({describe_cache()})" if preset.memory_figures.startswith("composed") else ""
    lines.append(f"memory figures: {preset.memory_figures}{cache}")  # the header leaves the local folder out
    if baseline_output:
        processes = ("one process per TP group" if preset.parallelism.tp_size > 1 else "same processes")
        lines.append(f"wrote {baseline_output}: DDP baseline ({processes}, precision and batch)")
    lines += [f"note: {note}" for note in preset.notes]
    lines.append("launch: " + command_text(launch_command))
    return lines


def check_generated_output(path, *, force: bool = False) -> None:
    """Refuse to replace an existing file that ``generate`` did not write (its header has no
    ``# fsdp-presets:`` line), unless ``force``: regenerating a generated file is what its header
    says to do, overwriting a hand-written one is not. Nothing is written."""
    from fsdp_presets.preset.emit import METADATA_PREFIX, read_metadata
    from fsdp_presets.preset.emit_distributed import SUFFIX, read_distributed_metadata

    path = Path(path)
    if force or not (path.exists() or path.is_symlink()):
        return
    reader = read_distributed_metadata if path.name.endswith(SUFFIX) else read_metadata
    try:
        ours = path.is_file() and not path.is_symlink() and \
            reader(path.read_text(encoding="utf-8", errors="replace")) is not None
    except OSError:
        ours = False
    if not ours:
        raise UsageError(f"{path} exists and was not written by fsdp-presets generate (no '{METADATA_PREFIX.strip()}' "
                         "line in its header); choose another file, or pass --force to replace it (nothing was written)")


def write_files(files: dict) -> None:
    """Write every file (``{Path: text}``) through a temporary file in its folder, each loaded back
    through accelerate's own loader before it replaces anything (``os.replace`` is atomic): either
    every file is replaced or none is."""
    from fsdp_presets.preset.accelerate_view import AccelerateRejected, accelerate_view
    from fsdp_presets.preset.emit_distributed import SUFFIX, load_distributed_config

    staged = []
    try:
        for path, text in files.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = temporary_sibling(path)
            staged.append((temporary, path))
            temporary.write_text(text, encoding="utf-8")
            if path.name.endswith(SUFFIX):  # transformers' own loader for a DistributedConfig
                try:
                    load_distributed_config(temporary)
                except (ValueError, TypeError) as error:
                    raise RuntimeError(f"transformers rejects the generated {path} (a bug in fsdp-presets): "
                                       f"{error}") from None
                continue
            try:
                accelerate_view(temporary)
            except AccelerateRejected as error:
                raise RuntimeError(f"accelerate rejects the generated {path} (a bug in fsdp-presets): {error}") from None
        for temporary, path in staged:
            os.replace(temporary, path)
        staged = []
    finally:
        for temporary, _ in staged:
            try:
                os.unlink(temporary)
            except FileNotFoundError:
                pass
