"""``fsdp-presets generate MODEL --gpus N -o FILE.yaml``: an Accelerate FSDP config for this model
on this cluster, with a header saying why, and optionally its DDP baseline.

    fsdp-presets generate model_configs/llama-3.1-8b --gpus 8 -o accelerate_configs/llama_1x8.yaml
    fsdp-presets generate model_configs/llama-3.1-8b --gpus 16 --nodes 2 --seq-len 4096 \\
        --global-batch 1M --baseline ddp -o accelerate_configs/llama_2x8.yaml
    fsdp-presets generate --from accelerate_configs/llama_2x8.yaml --gpus 8 -o llama_1x8.yaml   # rescale
    fsdp-presets generate llama --device cpu --gpus 2 --seq-len 64 -o cpu.yaml                  # CPU host

Every ``auto`` choice comes from the planner (see :mod:`fsdp_presets.plan.presets`). Rescaling
(``--from``) re-decides for the new GPU count keeping the global batch and prints what changed.
Files are written only after everything is decided and the text has been loaded back through
accelerate's own config loader; each is written to a temporary file and moved into place, so an
existing file is never half-overwritten.
"""

from __future__ import annotations

import argparse

HELP = "generate an Accelerate FSDP config (and its DDP baseline) for a model and a GPU count"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fsdp_presets import arguments

    add = parser.add_argument
    add("model", metavar="MODEL", nargs="?", help="a family name, a local model folder, or a config.json path")
    add("-o", "--output", required=True, metavar="FILE.yaml",
        help="the accelerate config to write; an existing file is replaced only when fsdp-presets generate wrote it")
    add("--force", action="store_true",
        help="replace existing output files (config, baseline, launch script) that fsdp-presets did not write")
    add("--from", dest="from_file", metavar="PRESET.yaml",
        help="rescale a generated preset: keep its model, choices and global batch, re-decide for --gpus/--nodes")
    add("--gpus", type=arguments.gpu_count, help="GPUs in the whole job (with --device cpu: processes)")
    add("--nodes", type=arguments.node_count, help="machines the GPUs are spread over, the same number on each (default 1)")
    add("--device", choices=("gpu", "cpu"), help="gpu (default) or cpu: a CPU-only host (demos, CI; fp32, no offload)")
    add("--gpu-memory", type=arguments.gpu_memory_gib, metavar="GiB", help="memory of one GPU in GiB (default 80)")
    add("--host-memory", type=arguments.host_memory_gib, metavar="GiB",
        help="host RAM of one node in GiB (default 1024; --device cpu: 16, shared by the node's processes)")
    add("--precision", choices=("auto", "bf16", "fp16", "fp32"), help="mixed precision (default auto: bf16 on GPUs)")
    add("--strategy", choices=("auto", "full", "grad-op", "hybrid", "no-shard"),
        help="sharding (default auto: FULL_SHARD on one node, HYBRID_SHARD across nodes when it fits)")
    add("--fsdp-version", type=int, choices=(1, 2), help="FSDP version (default 2)")
    add("--state-dict", choices=("sharded", "full"), help="checkpoint format (default sharded: DCP)")
    add("--activation-checkpointing", choices=("auto", "on", "off"), help="default auto: only when needed to fit")
    add("--offload", choices=("auto", "on", "off"), help="CPU offload (default auto: only when nothing fits otherwise)")
    add("--seq-len", type=arguments.seq_len, help="tokens per sequence (default 2048, capped by the model's positions)")
    add("--global-batch", metavar="SAMPLES|TOKENS",
        help="per optimizer step: sequences (256) or tokens (1M, 512K, 524288tok); default 0.5M tokens")
    add("--micro-batch", type=arguments.micro_batch, help="sequences per GPU per step (default: the largest that fits and divides)")
    add("--baseline", choices=("ddp",), help="also write the matching DDP config (default next to -o: NAME.ddp.yaml)")
    add("--baseline-output", metavar="FILE.yaml", help="where --baseline ddp writes (default NAME.ddp.yaml)")
    add("--launch-model", metavar="DIR", help="model folder the header's launch command names (default MODEL_DIR)")
    add("--launch-data", metavar="FILE", help="data file the header's launch command names (default DATA.jsonl)")
    add("--trust-remote-code", action="store_true",
        help="allow a config that names its own Python code (auto_map) to run that code")
    from fsdp_presets.plan.methods import add_method_arguments

    add_method_arguments(parser, method_default=None, method_help=(
        "full fine-tuning (default), lora or qlora: the planner counts a frozen (4-bit) base and fp32 adapters, "
        "the header and launch command carry the adapter and quantization settings"))
    from fsdp_presets.commands.launcher import add_launch_arguments

    add_launch_arguments(parser, with_mesh=False)  # --launcher slurm|torchrun|accelerate: a launch script too


_REQUEST_FLAGS = {
    # argparse dest -> PresetRequest field
    "gpus": "gpus", "nodes": "nodes", "device": "device", "gpu_memory": "gpu_memory_gib",
    "host_memory": "host_memory_gib", "precision": "precision", "strategy": "strategy",
    "fsdp_version": "fsdp_version", "state_dict": "state_dict", "activation_checkpointing": "activation_checkpointing",
    "offload": "offload", "seq_len": "seq_len", "global_batch": "global_batch", "micro_batch": "micro_batch",
    "method": "method", "lora_r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
    "lora_target_modules": "lora_target_modules",
}


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fsdp_presets.plan.emit import LaunchHints, command_text, default_baseline_path, launch_words, read_metadata
    from fsdp_presets.errors import UsageError
    from fsdp_presets.plan.presets import PresetRequest, describe_changes, rescale_request

    given = {field: getattr(args, dest) for dest, field in _REQUEST_FLAGS.items() if getattr(args, dest) is not None}
    problems = []
    if args.baseline_output and not args.baseline:
        problems.append("--baseline-output needs --baseline ddp")
    if Path(args.output).is_dir():
        problems.append(f"-o {args.output} is a folder; give the .yaml file to write")
    elif not str(args.output).endswith((".yaml", ".yml")):
        problems.append(f"-o {args.output}: give a .yaml file name (accelerate reads YAML configs)")
    old = None
    if args.from_file:
        if args.model:
            problems.append("give MODEL or --from PRESET.yaml, not both (the preset names its model)")
        try:
            old = read_metadata(Path(args.from_file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as error:
            problems.append(f"--from {args.from_file}: cannot read it ({error})")
        else:
            if old is None or old.get("kind") != "fsdp" or not isinstance(old.get("request"), dict) or \
                    not isinstance(old.get("summary"), dict) or \
                    not isinstance(old["summary"].get("global_batch"), int) or old["summary"]["global_batch"] < 1:
                problems.append(f"--from {args.from_file}: no '# fsdp-presets:' line of an FSDP preset in its header; "
                                "only files written by `fsdp-presets generate` can be rescaled")
                old = None
    elif not args.model:
        problems.append("give a MODEL (family name, model folder or config.json), or --from PRESET.yaml")
    if not args.from_file and args.gpus is None:
        problems.append("--gpus is required")
    if problems:
        raise UsageError("; ".join(problems))

    if old is not None:
        try:
            old_request = PresetRequest.from_json(old["request"])
        except TypeError as error:
            raise UsageError(f"--from {args.from_file}: its '# fsdp-presets:' line does not hold a request this "
                             f"version reads ({error}); regenerate it from the command in its header") from None
        if "gpus" not in given and "nodes" in given:
            given["gpus"] = old_request.gpus // old_request.nodes * given["nodes"]  # same GPUs per node
        if "gpus" in given and "nodes" not in given and old_request.nodes > 1 and \
                given["gpus"] % old_request.gpus_per_node == 0:
            given["nodes"] = given["gpus"] // old_request.gpus_per_node  # same GPUs per node
        elif "gpus" in given and "nodes" not in given:
            given["nodes"] = 1
        kept = old["summary"]["global_batch"]
        if "global_batch" not in given and "gpus" in given and kept % given["gpus"]:
            fitting = [n for n in range(1, 4 * kept + 1) if kept % n == 0 and abs(n - given["gpus"]) <= given["gpus"]]
            raise UsageError(f"rescaling keeps the global batch of {kept} sequences, which does not divide over "
                             f"{given['gpus']} data-parallel ranks (one per GPU): use a GPU count that divides "
                             f"{kept} (e.g. {', '.join(str(n) for n in fitting[-3:])}) or pass --global-batch")
        request = rescale_request(old_request, old["summary"], **given)
        stored = {key: value for key, value in (old.get("launch") if isinstance(old.get("launch"), dict) else {}).items()
                  if isinstance(value, str)}
        launch = LaunchHints(model=args.launch_model or stored.get("model"), data=args.launch_data or stored.get("data"))
    else:
        request = PresetRequest(model=args.model, **given)
        launch = LaunchHints(model=args.launch_model, data=args.launch_data)

    output = str(args.output)
    baseline_output = (args.baseline_output or default_baseline_path(output)) if args.baseline else None
    if baseline_output is not None and Path(baseline_output).resolve() == Path(output).resolve():
        raise UsageError(f"--baseline-output {baseline_output} is the same file as -o {output}")

    profile = load_profile(request.model, trust_remote_code=args.trust_remote_code)
    files, preset = render_files(profile, request, output=output, baseline_output=baseline_output, launch=launch)
    if old is not None and preset.batch.global_samples != old["summary"]["global_batch"]:
        raise UsageError(f"rescaling changed the global batch from {old['summary']['global_batch']} to "
                         f"{preset.batch.global_samples} sequences; pass --global-batch to choose one")
    # The launch script is checked (flags, secrets, where it goes) before any file is written.
    import yaml

    from fsdp_presets.commands.launcher import job_from_args, launcher_path, write_from_args
    from fsdp_presets.plan.launchers import check_launcher_output

    launch_command = launch_words(preset, config_file=output, launch=launch)
    job = job_from_args(args, output, nodes=request.nodes, gpus_per_node=request.gpus_per_node,
                        default_command=launch_command, config=yaml.safe_load(files[output]))
    from fsdp_presets.plan.launchers import carries_token

    if any(carries_token(text) for text in files.values()):
        raise UsageError("the generated config would carry a value that looks like an access token (hf_..., sk-...; "
                         "not shown); pass secrets through the environment, never in a flag that is written to "
                         "a file (nothing was written)")
    for path in files:
        check_generated_output(Path(path), force=args.force)
    if job is not None:
        script_path = launcher_path(args, output)
        if any(script_path.resolve() == Path(path).resolve() for path in files):
            raise UsageError(f"--launch-output {script_path} is one of the configs this command writes; give "
                             "the script another name (nothing was written)")
        check_launcher_output(script_path, config_file=output, force=args.force)
    write_files({Path(path): text for path, text in files.items()})

    summary = preset.summary()
    if old is not None:
        print(f"rescaled {args.from_file} -> {output}: global batch {summary['global_batch']} sequences kept")
        for line in describe_changes(old["summary"], summary) or ["nothing changed"]:
            print(f"  {line}")
    print(f"wrote {output}: {preset.parallelism.label} (FSDP{preset.parallelism.fsdp_version}), "
          f"{summary['precision']}, activation checkpointing {'on' if summary['activation_checkpointing'] else 'off'}"
          f", offload {'on' if summary['offload'] else 'off'}, micro-batch {summary['micro_batch']} x "
          f"{summary['gradient_accumulation']} accumulation x {summary['data_parallel_size']} ranks")
    if baseline_output:
        print(f"wrote {baseline_output}: DDP baseline (same processes, precision and batch)")
    for note in preset.notes:
        print(f"note: {note}")
    print("launch: " + command_text(launch_command))
    script = write_from_args(args, output, job=job)
    if script is not None:
        print(f"wrote {script}: {args.launcher} launch script of {output}")
    return 0


def load_profile(source: str, *, trust_remote_code: bool = False):
    """The model's profile, with transformers' advisory warnings silenced."""
    from transformers.utils import logging as hf_logging

    from fsdp_presets.plan.profile import profile_model

    hf_logging.set_verbosity_error()
    return profile_model(source, trust_remote_code=trust_remote_code)


def check_generated_output(path, *, force: bool = False) -> None:
    """Refuse to replace an existing file that ``generate`` did not write (its header has no
    ``# fsdp-presets:`` line), unless ``force``: regenerating a generated file is what its header
    says to do, overwriting a hand-written one is not. Nothing is written."""
    from fsdp_presets.plan.emit import METADATA_PREFIX, read_metadata
    from fsdp_presets.errors import UsageError

    if force or not (path.exists() or path.is_symlink()):
        return
    try:
        ours = path.is_file() and not path.is_symlink() and \
            read_metadata(path.read_text(encoding="utf-8", errors="replace")) is not None
    except OSError:
        ours = False
    if not ours:
        raise UsageError(f"{path} exists and was not written by fsdp-presets generate (no '{METADATA_PREFIX.strip()}' "
                         "line in its header); choose another file, or pass --force to replace it (nothing was written)")


def render_files(profile, request, *, output: str, baseline_output: str | None, launch):
    """``({path: text}, preset)``: decide and render, nothing written. The texts are checked with
    the config rules first: a generated file that fails them is a bug, never written."""
    import yaml

    from fsdp_presets.plan.emit import render_ddp_baseline, render_preset
    from fsdp_presets.plan.check import CheckContext, lint_config
    from fsdp_presets.plan.presets import decide

    preset = decide(profile, request)
    files = {output: render_preset(preset, output=output, baseline_output=baseline_output, launch=launch)}
    if baseline_output is not None:
        files[baseline_output] = render_ddp_baseline(preset, output=output, baseline_output=baseline_output,
                                                     launch=launch)
    for path, text in files.items():
        errors = [item for item in lint_config(yaml.safe_load(text), context=CheckContext(device=request.device))
                  if item.severity == "error"]
        if errors:
            raise RuntimeError(f"generated {path} fails its own checks (a bug in fsdp-presets): "
                               + "; ".join(f"{item.rule}: {item.message}" for item in errors))
    return files, preset


def _file_mode(path) -> int:
    """The existing file's mode, else what the umask gives a new file (mkstemp makes 0600)."""
    import os

    if path.exists():
        return path.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_files(files: dict) -> None:
    """Write every file through a temporary file in its folder, each loaded back through
    accelerate's own loader before it replaces anything (``os.replace`` is atomic)."""
    import os
    import tempfile

    from fsdp_presets.plan.check import AccelerateRejected, accelerate_view

    staged = []
    try:
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            staged.append((temporary, path))
            os.chmod(temporary, _file_mode(path))
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(text)
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
