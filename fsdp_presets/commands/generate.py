"""``fsdp-presets generate MODEL --gpus N -o FILE.yaml``: an Accelerate FSDP config for this model
on this cluster, with a header saying why, and optionally its DDP baseline.

    fsdp-presets generate model_configs/llama-3.1-8b --gpus 8 -o accelerate_configs/llama_1x8.yaml
    fsdp-presets generate model_configs/llama-3.1-8b --gpus 16 --nodes 2 --seq-len 4096 \\
        --global-batch 1M --baseline ddp -o accelerate_configs/llama_2x8.yaml
    fsdp-presets generate --from accelerate_configs/llama_2x8.yaml --gpus 8 -o llama_1x8.yaml   # rescale
    fsdp-presets generate llama --device cpu --gpus 2 --seq-len 64 -o cpu.yaml                  # CPU host

Every ``auto`` choice comes from the planner (see :mod:`fsdp_presets.preset.presets`). Rescaling
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
    arguments.add_model(parser, optional=True)
    add("-o", "--output", required=True, metavar="FILE.yaml",
        help="the accelerate config to write; an existing file is replaced only when fsdp-presets generate wrote it")
    add("--force", action="store_true",
        help="replace existing output files (config, baseline, launch script) that fsdp-presets did not write")
    add("--from", dest="from_file", metavar="PRESET.yaml",
        help="rescale a generated preset: keep its model, choices and global batch, re-decide for --gpus/--nodes")
    arguments.add_gpus(parser, help_text="GPUs in the whole job (with --device cpu: processes; required with a MODEL)")
    arguments.add_nodes(parser)
    arguments.add_device(parser)
    arguments.add_gpu_memory(parser)
    arguments.add_host_memory(parser, default_help="; --device cpu: 16, shared by the node's processes")
    arguments.add_precision(parser, default_help=", fp32 with --device cpu")
    arguments.add_strategy(parser)
    add("--fsdp-version", type=int, choices=(1, 2), help="FSDP version (default 2)")
    add("--state-dict", choices=("sharded", "full"), help="checkpoint format (default sharded: DCP)")
    arguments.add_savers(parser)
    arguments.add_seq_len(parser)
    add("--global-batch", metavar="SAMPLES|TOKENS",
        help="per optimizer step: sequences (256) or tokens (1M, 512K, 524288tok); default 0.5M tokens")
    arguments.add_micro_batch(parser, default_help="the largest that fits and divides")
    add("--baseline", choices=("ddp",), help="also write the matching DDP config (default next to -o: NAME.ddp.yaml)")
    add("--baseline-output", metavar="FILE.yaml", help="where --baseline ddp writes (default NAME.ddp.yaml)")
    add("--launch-model", metavar="DIR", help="model folder the header's launch command names (default MODEL_DIR)")
    add("--launch-data", metavar="FILE", help="data file the header's launch command names (default DATA.jsonl)")
    arguments.add_trust_remote_code(parser)
    from fsdp_presets.plan.methods import add_method_arguments

    add_method_arguments(parser, method_help=(
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

    from fsdp_presets.errors import UsageError
    from fsdp_presets.preset.emit_commands import LaunchHints
    from fsdp_presets.preset.generate import rescale_source, rescaled_request, stored_launch
    from fsdp_presets.preset.request import PresetRequest

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
        old, problem = rescale_source(args.from_file)
        if problem:
            problems.append(problem)
    elif not args.model:
        problems.append("give a MODEL (family name, model folder or config.json), or --from PRESET.yaml")
    if not args.from_file and args.gpus is None:
        problems.append("--gpus is required")
    if problems:
        raise UsageError("; ".join(problems))

    if old is not None:
        request = rescaled_request(old, given, source=args.from_file)
        stored = stored_launch(old)
        launch = LaunchHints(model=args.launch_model or stored.get("model"), data=args.launch_data or stored.get("data"))
    else:
        request = PresetRequest(model=args.model, **given)
        launch = LaunchHints(model=args.launch_model, data=args.launch_data)

    from fsdp_presets.preset.emit_commands import command_text, default_baseline_path, launch_words
    from fsdp_presets.preset.generate import (check_generated_output, describe_changes, load_profile, render_files,
                                              write_files)

    output = str(args.output)
    baseline_output = (args.baseline_output or default_baseline_path(output)) if args.baseline else None
    if baseline_output is not None and Path(baseline_output).resolve() == Path(output).resolve():
        raise UsageError(f"--baseline-output {baseline_output} is the same file as -o {output}")

    profile = load_profile(request.model, trust_remote_code=args.trust_remote_code)
    files, preset = render_files(profile, request, output=output, baseline_output=baseline_output, launch=launch,
                                 trust_remote_code=args.trust_remote_code)
    from fsdp_presets.check.lint import check_generated

    check_generated(files, device=request.device)
    if old is not None and preset.batch.global_samples != old["summary"]["global_batch"]:
        raise UsageError(f"rescaling changed the global batch from {old['summary']['global_batch']} to "
                         f"{preset.batch.global_samples} sequences; pass --global-batch to choose one")
    # The launch script is checked (flags, secrets, where it goes) before any file is written.
    import yaml

    from fsdp_presets.commands.launcher import job_from_args, launcher_path, write_from_args
    from fsdp_presets.preset.launchers import check_launcher_output

    launch_command = launch_words(preset, config_file=output, launch=launch)
    job = job_from_args(args, output, nodes=request.nodes, gpus_per_node=request.gpus_per_node,
                        default_command=launch_command, config=yaml.safe_load(files[output]))
    from fsdp_presets.preset.launchers import carries_token

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
    print(f"memory figures: {preset.memory_figures}")
    if baseline_output:
        print(f"wrote {baseline_output}: DDP baseline (same processes, precision and batch)")
    for note in preset.notes:
        print(f"note: {note}")
    print("launch: " + command_text(launch_command))
    script = write_from_args(args, output, job=job)
    if script is not None:
        print(f"wrote {script}: {args.launcher} launch script of {output}")
    return 0
