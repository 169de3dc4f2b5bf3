"""``fsdp-presets check CONFIG.yaml [--model MODEL]``: every problem in an accelerate config, at once,
before a launch wastes cluster time.

    fsdp-presets check my_fsdp.yaml --model path/to/model
    fsdp-presets check accelerate_configs/*.yaml          # generated presets name their model
    fsdp-presets check my_fsdp.yaml --json

The file is loaded the way ``accelerate launch`` loads it (and the FSDP plugin built from it), then
checked against accelerate's own key lists, the model and the planner. With a model, accelerate's
own FSDP preparation of it runs under a fake process group (a few seconds, no weights, no GPU:
:mod:`fsdp_presets.check.wrap_probe`), so a crash in ``prepare`` and the real unit list show before a
launch. Each finding has a stable rule id (:data:`fsdp_presets.check.findings.RULES`) and a severity: error (the
launch fails or silently trains something else), warning (a real risk for the stated use), note, info
(accelerate's own defaults and style: counted on one line, shown with --verbose). With ``--script TRAIN.py``
the training script is read statically (:mod:`fsdp_presets.check.script`). Exit status: 0 no errors
(warnings and notes do not fail), 1 errors, 2 bad input.
"""

from __future__ import annotations

import argparse

HELP = "check accelerate FSDP configs: unknown keys, FSDP1/2 mix-ups, wrap classes, HSDP sizes, memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("configs", metavar="CONFIG.yaml", nargs="*", help="accelerate config files")
    add("--model", metavar="MODEL", help="the model the config trains (family, folder or config.json); default: the "
        "model a generated preset names in its header")
    add("--json", action="store_true", help="print the findings as JSON")
    from fsdp_presets import arguments  # the flags every command shares: one type, default and check each
    from fsdp_presets.schema import K

    arguments.add_device(parser, default_help=": the preset's header, else gpu")
    arguments.add_gpu(parser, default_help="the memory of the planner rules when --gpu-memory is not given; "
                      "default: the preset's")
    arguments.add_gpu_memory(parser, default_help=", or the --gpu type's, or the preset's; for the planner rules")
    arguments.add_host_memory(parser, default_help=", or the preset's; for the state-dict, loading and offload rules")
    arguments.add_seq_len(parser, default_help=", or the script's, or the preset's; for the planner rules")
    arguments.add_micro_batch(parser, default_help="the script's, or the preset's, else 1; for the planner rules")
    arguments.add_precision(parser, default_help="; check: the script's bf16/fp16, else the file's mixed_precision")
    arguments.add_savers(parser, with_offload=False, default_text=f"the file's {K.activation_checkpointing}, or the "
                         "script's gradient checkpointing")
    arguments.add_gpus(parser, metavar="N", help_text="processes of the whole job for a file without num_processes "
                       "(what `accelerate launch --num_processes` will pass); without it such a file gets no GPU "
                       "count or memory verdict")
    from fsdp_presets.plan.methods import add_method_arguments

    add_method_arguments(parser, method_help="the training method, for the memory and LoRA "
                         "rules: full, lora or qlora (default: a generated preset's; otherwise unknown, and "
                         "full-fine-tuning memory verdicts are one warning, not errors)")
    add("--script", metavar="TRAIN.py", help="the training script the config launches: read statically (never "
        "imported or run) for the traps a config alone cannot show and for the memory rules' inputs (Trainer/SFTConfig "
        "arguments: bf16, gradient checkpointing, batch, max length, 4-bit loading)")
    add("--verbose", action="store_true", help="also print accelerate's own defaults and style (info findings)")
    add("--no-probe", action="store_true", help="skip running accelerate's FSDP preparation of the model under a "
        "fake process group")
    add("--list-rules", action="store_true", help="list the rule ids and exit")
    arguments.add_trust_remote_code(parser)


def run(args: argparse.Namespace) -> int:
    import json
    import os
    from pathlib import Path

    from fsdp_presets.errors import UsageError

    if args.list_rules:
        from fsdp_presets.check.report import rules_lines

        print("\n".join(rules_lines()))
        return 0
    problems = [] if args.configs else ["give at least one CONFIG.yaml"]
    missing = [path for path in args.configs if not Path(path).exists()]
    if missing:
        problems.append(f"no such file: {', '.join(missing)}")
    from fsdp_presets.fileio import not_regular_problem

    problems += filter(None, map(not_regular_problem, args.configs))  # a FIFO, a device, a folder
    from fsdp_presets.plan.methods import lora_from_args

    try:
        lora = lora_from_args(args)
    except UsageError as error:
        problems.append(str(error))
    if args.gpu:
        from fsdp_presets.plan.gpus import gpu_type

        try:
            gpu_type(args.gpu)
        except UsageError as error:
            problems.append(str(error))
    script = None
    if args.script:
        from fsdp_presets.check.script import read_script

        try:
            script = read_script(args.script)
        except UsageError as error:
            problems.append(str(error))
    if problems:
        raise UsageError("; ".join(problems))

    from fsdp_presets.check.findings import CheckContext
    from fsdp_presets.check.report import check_configs

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    context = CheckContext(device=args.device, gpu=args.gpu, gpu_memory_gib=args.gpu_memory,
                           host_memory_gib=args.host_memory, seq_len=args.seq_len, gpus=args.gpus,
                           method=args.method, lora=lora, micro_batch=args.micro_batch, script=script,
                           precision=None if args.precision in (None, "auto") else args.precision,
                           activation_checkpointing={"on": True, "off": False}.get(args.activation_checkpointing))
    checked = check_configs(args.configs, context=context, model=args.model, trust_remote_code=args.trust_remote_code,
                            prove_wrapping=not args.no_probe, verbose=args.verbose)
    print(json.dumps(checked.to_json(), indent=2) if args.json else checked.text())
    return 0 if checked.ok else 1
