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
    arguments.add_gpu(parser, default_help="default: step times predicted on H100-SXM, --gpu-memory for the memory")
    arguments.add_gpu_memory(parser, default_help=", or the --gpu type's")
    arguments.add_inter_node_gbps(parser, extra_help="; without it a choice across nodes must also hold at half "
                                  "of that")
    arguments.add_host_memory(parser, default_help="; --device cpu: 16, shared by the node's processes")
    arguments.add_precision(parser, default_help=", fp32 with --device cpu")
    arguments.add_strategy(parser)
    add("--fsdp-version", type=int, choices=(1, 2), help="FSDP version (default 2)")
    add("--state-dict", choices=("sharded", "full"), help="checkpoint format (default sharded: DCP)")
    arguments.add_savers(parser, default_text="auto: offload only when nothing fits without it; activation "
                         "checkpointing when needed to fit or, on GPUs, when predicted faster")
    arguments.add_seq_len(parser)
    add("--global-batch", metavar="SAMPLES|TOKENS",
        help="per optimizer step: sequences (256) or tokens (1M, 512K, 524288tok); default 0.5M tokens (--device cpu: 8 sequences per process)")
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
    from fsdp_presets.launching.options import add_launch_arguments

    add_launch_arguments(parser, with_mesh=False)  # --launcher slurm|torchrun|accelerate: a launch script too
    arguments.add_mesh(parser, default_text="1: FSDP alone; with either, NAME.distributed.json is written beside "
                       "-o: transformers' DistributedConfig of the mesh")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fsdp_presets.preset.emit_commands import launch_words
    from fsdp_presets.preset.generate import (check_outputs, check_rescaled_batch, generated_lines, load_profile,
                                              render_files, request_from_args, write_files)

    request, launch, old, baseline_output = request_from_args(args)
    output = str(args.output)
    profile = load_profile(request.model, trust_remote_code=args.trust_remote_code)
    files, preset = render_files(profile, request, output=output, baseline_output=baseline_output, launch=launch,
                                 trust_remote_code=args.trust_remote_code)
    from fsdp_presets.check.lint import check_generated

    check_generated(files, device=request.device)
    check_rescaled_batch(preset, old)
    # The launch script is checked (flags, secrets, where it goes) before any file is written.
    import yaml

    from fsdp_presets.launching.options import job_from_args, launcher_path, write_from_args

    launch_command = launch_words(preset, config_file=output, launch=launch)
    job = job_from_args(args, output, nodes=request.nodes, gpus_per_node=request.gpus_per_node,
                        default_command=launch_command, config=yaml.safe_load(files[output]))
    check_outputs(files, config_file=output, script_path=launcher_path(args, output) if job is not None else None,
                  force=args.force)
    write_files({Path(path): text for path, text in files.items()})
    print("\n".join(generated_lines(preset, output=output, baseline_output=baseline_output,
                                    launch_command=launch_command, rescaled_from=args.from_file if old is not None else None,
                                    old_summary=old["summary"] if old is not None else None)))
    from fsdp_presets.preset.emit_distributed import SUFFIX

    for path in files:
        if path.endswith(SUFFIX):
            print(f"wrote {path}: transformers' DistributedConfig of the mesh (load it with "
                  "DistributedConfig.from_dict)")
        elif path not in (output, baseline_output):
            print(f"wrote {path}: the config a Trainer script launches with on the mesh (DDP type, "
                  f"{preset.parallelism.num_processes} processes)")
    script = write_from_args(args, output, job=job)
    if script is not None:
        print(f"wrote {script}: {args.launcher} launch script of {output}")
    return 0
