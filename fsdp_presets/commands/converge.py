"""``fsdp-presets converge --model M --data D --config FSDP.yaml``: train a recipe under an FSDP
config and under its DDP baseline, then compare them step by step (:mod:`fsdp_presets.compare.converge`).

Exit 0 when the runs agree, 1 when they diverge, 2 on bad input or a launch that failed.
"""

from __future__ import annotations

import argparse

HELP = "train a recipe under an FSDP config and its DDP baseline, then compare them: exit 0 agree, 1 diverge"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fsdp_presets import arguments, flags
    from fsdp_presets.plan import limits
    from fsdp_presets.compare.converge import DEFAULT_MAX_STEPS, DEFAULT_RECIPE, DEFAULT_SEED, DEFAULT_TIMEOUT_S

    parser.epilog = "Arguments after `--` go to the recipe in both runs."
    add = parser.add_argument
    add("--model", required=True, help="model folder (or config) the recipe fine-tunes")
    add("--data", required=True, help="training data file the recipe reads")
    add("--config", required=True, help="accelerate config of the candidate (FSDP)")
    add("--baseline", help="accelerate config of the baseline (default: DDP derived from --config)")
    add("--baseline-run", help="an existing baseline run folder to compare against (no baseline launch)")
    add("--output-dir", default="runs/convergence", help="where both runs, the report and the plot go")
    add("--recipe", default=DEFAULT_RECIPE, help=f"training script (default {DEFAULT_RECIPE})")
    flags.add(parser, flags.MAX_STEPS, type=int, default=DEFAULT_MAX_STEPS,
              help=f"optimizer steps per run (default {DEFAULT_MAX_STEPS})")
    flags.add(parser, flags.SEED, type=int, default=DEFAULT_SEED, help=f"seed of both runs (default {DEFAULT_SEED})")
    arguments.add_micro_batch(parser, default_help="the recipe's")
    arguments.add_grad_accum(parser)
    flags.add(parser, flags.LEARNING_RATE, type=float, help="learning rate of both runs (recipe default if unset)")
    flags.add(parser, flags.SEQ_LEN, type=limits.seq_len, help="sequence length (recipe default if unset)")
    add("--resume-at", type=int, metavar="K",
        help="stop the candidate after its checkpoint of step K and resume it in a second launch")
    arguments.add_tolerance(parser)
    add("--candidate-args", default="", metavar="ARGS",
        help="extra recipe arguments for the candidate only (one shell-quoted string)")
    add("--baseline-args", default="", metavar="ARGS",
        help="extra recipe arguments for the baseline only (one shell-quoted string)")
    add("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds allowed per launch (default 3600)")
    flags.add(parser, flags.DISTRIBUTED_CONFIG, help_suffix=" for the candidate (default: the one generate wrote "
              "beside --config, if any; its DDP baseline then runs one process per TP group)")
    add("recipe_args", nargs="*", help=argparse.SUPPRESS)


def request_from(args: argparse.Namespace):
    """The :class:`~fsdp_presets.compare.converge.ConvergeRequest` the parsed flags make."""
    import shlex

    from fsdp_presets.compare.converge import ConvergeRequest, Training

    training = Training(model=args.model, data=args.data, recipe=args.recipe, max_steps=args.max_steps, seed=args.seed,
                        micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                        learning_rate=args.learning_rate, seq_len=args.seq_len, recipe_args=list(args.recipe_args))
    return ConvergeRequest(training=training, config=args.config, baseline=args.baseline,
                           baseline_run=args.baseline_run, output_dir=args.output_dir, resume_at=args.resume_at,
                           tolerance=args.tolerance, candidate_args=shlex.split(args.candidate_args),
                           baseline_args=shlex.split(args.baseline_args), timeout=args.timeout,
                           distributed_config=args.distributed_config)


def run(args: argparse.Namespace) -> int:
    from fsdp_presets.compare.converge import converge, result_lines

    comparison = converge(request_from(args))
    print("\n".join(result_lines(comparison, args.output_dir)))
    return 0 if comparison.agrees else 1
