"""``fsdp-presets launcher CONFIG --launcher slurm|torchrun|accelerate --command "SCRIPT ARGS"``: the launch
script of a multi-node job for an accelerate config (see :mod:`fsdp_presets.launching.launchers`).

    fsdp-presets launcher accelerate_configs/llama_hsdp.yaml --launcher slurm --time 24:00:00 \\
        --command "recipes/causal_lm.py --model runs/models/llama --data data/kjv_sft/train.jsonl --output-dir runs/x"
    sbatch accelerate_configs/llama_hsdp.slurm.sh

The options and the writing are :mod:`fsdp_presets.launching.options`, shared with
``generate ... --launcher slurm``.
"""

from __future__ import annotations

import argparse

NAME = "launcher"
HELP = "write the SLURM, torchrun or per-node accelerate launch script of a (multi-node) accelerate config"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fsdp_presets.launching.options import add_launch_arguments

    parser.add_argument("config", help="the accelerate config (e.g. the HSDP preset of fsdp-presets generate)")
    add_launch_arguments(parser, with_output=False)
    parser.add_argument("-o", "--output", dest="launch_output", metavar="FILE",
                        help="where to write the script (default: CONFIG_STEM.LAUNCHER.sh next to the config); "
                        "an existing file is replaced only when fsdp-presets wrote it")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing output file that fsdp-presets did not write")
    parser.set_defaults(launcher="slurm")


def run(args: argparse.Namespace) -> int:
    from fsdp_presets.launching.options import write_from_args
    from fsdp_presets.launching.quoting import shell_word

    path = write_from_args(args, args.config)
    hint = (f"sbatch {shell_word(str(path))}" if args.launcher == "slurm"
            else f"MAIN_PROCESS_IP=<address of node 0> bash {shell_word(str(path))} NODE_RANK")
    print(f"wrote {path}\nrun: {hint}")
    return 0
