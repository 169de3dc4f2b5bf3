"""``fsdp-presets check CONFIG.yaml [--model MODEL]``: every problem in an accelerate config, at once,
before a launch wastes cluster time.

    fsdp-presets check my_fsdp.yaml --model path/to/model
    fsdp-presets check accelerate_configs/*.yaml          # generated presets name their model
    fsdp-presets check my_fsdp.yaml --json

The file is loaded the way ``accelerate launch`` loads it (and the FSDP plugin built from it), then
checked against accelerate's own key lists, the model and the planner. With a model, accelerate's
own FSDP preparation of it runs under a fake process group (a few seconds, no weights, no GPU:
:mod:`fsdp_presets.check.wrap_probe`), so a crash in ``prepare`` and the real unit list show before a
launch. Each finding has a stable rule id (:data:`fsdp_presets.check.lint.RULES`) and a severity: error (the
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
    arguments.add_gpu_memory(parser, default_help=", or the preset's; for the planner rules")
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
        from fsdp_presets.check.findings import RULES

        for rule, (severity, what) in RULES.items():
            print(f"{rule:34} {severity:8} {what}")
        return 0
    problems = [] if args.configs else ["give at least one CONFIG.yaml"]
    missing = [path for path in args.configs if not Path(path).exists()]
    if missing:
        problems.append(f"no such file: {', '.join(missing)}")
    from fsdp_presets.plan.methods import lora_from_args

    try:
        lora = lora_from_args(args)
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
    from fsdp_presets.check.lint import check_file, model_facts
    from fsdp_presets.schema import T

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.trust_remote_code:
        import functools

        model_facts = functools.partial(model_facts, trust_remote_code=True)
    explicit = model_facts(args.model) if args.model else None
    cache: dict = {}
    documents, failed, lines = [], False, []
    for path in args.configs:
        _refuse_another_method(path, args.method)
        facts, model_note = explicit, None
        if facts is None:
            facts, model_note = _model_from_header(path, cache, model_facts)
        context = CheckContext(model=facts, device=args.device, gpu_memory_gib=args.gpu_memory,
                               host_memory_gib=args.host_memory, seq_len=args.seq_len, gpus=args.gpus,
                               method=args.method, lora=lora, micro_batch=args.micro_batch, script=script,
                               precision=None if args.precision in (None, "auto") else args.precision,
                               activation_checkpointing={"on": True, "off": False}.get(args.activation_checkpointing))
        report, view = check_file(path, context=context, prove_wrapping=not args.no_probe)
        failed = failed or not report.ok
        document = report.to_json()
        document["model"] = facts.source if facts else None
        document["accelerate"] = None if view is None else {
            T.distributed_type: view.distributed_type, T.num_processes: view.num_processes,
            T.num_machines: view.num_machines, T.mixed_precision: view.mixed_precision,
            "fsdp": view.fsdp_settings(), "parallelism": view.parallelism_sizes(),
            "mesh": view.mesh_sizes(), "num_processes_in_file": view.processes_in_file,
            "layout": view.layout_label() or None,
            "wrap_probe": view.probe.to_json() if view.probe is not None else None,
        }
        documents.append(document)
        lines += _human(report, view, facts, model_note, verbose=args.verbose)
    if args.json:
        print(json.dumps({"ok": not failed, "files": documents}, indent=2))
    else:
        print("\n".join(lines))
    return 1 if failed else 0


def _refuse_another_method(path, method) -> None:
    """``--method`` that is not the one a generated preset was decided for: its memory verdicts would
    be of another training (a full fine-tuning preset checked as QLoRA fits, and trains, nothing)."""
    from fsdp_presets.errors import UsageError
    from fsdp_presets.fileio import YAML_MAX_BYTES, read_regular_text
    from fsdp_presets.preset.emit import read_metadata

    try:
        request = (read_metadata(read_regular_text(path, limit=YAML_MAX_BYTES)) or {}).get("request")
    except (OSError, UnicodeDecodeError):
        return
    decided = (request.get("method") or "full") if isinstance(request, dict) else None
    if method and decided and method != decided:
        raise UsageError(f"--method {method} disagrees with {path}, a preset generated for {decided} (its header "
                         f"says so): check it with --method {decided}, or generate a preset for {method} "
                         f"(fsdp-presets generate ... --method {method})")


def _model_from_header(path, cache: dict, model_facts):
    """The model a generated preset names in its metadata line, when it can be profiled here."""

    from fsdp_presets.errors import UsageError
    from fsdp_presets.fileio import YAML_MAX_BYTES, read_regular_text
    from fsdp_presets.preset.emit import read_metadata

    try:
        metadata = read_metadata(read_regular_text(path, limit=YAML_MAX_BYTES)) or {}
    except (OSError, UnicodeDecodeError):
        return None, None
    source = (metadata.get("request") or {}).get("model")
    if not source:
        return None, "no --model: the class and memory rules were skipped"
    if source not in cache:
        try:
            cache[source] = (model_facts(source), None)
        except UsageError as error:
            cache[source] = (None, f"the header's model {source} could not be loaded ({error}); class and memory "
                                   "rules skipped (pass --model)")
    facts, note = cache[source]
    return facts, note or f"model: {source} (named in the file's header)"


def _human(report, view, facts, model_note, *, verbose: bool = False) -> list[str]:
    errors, warnings = len(report.errors), len(report.warnings)
    status = "ok" if report.ok else "FAILED"
    counts = f"{errors} error{'s' if errors != 1 else ''}, {warnings} warning{'s' if warnings != 1 else ''}"
    lines = [f"{report.path}: {status} ({counts})"]
    if model_note:
        lines.append(f"  {model_note}")
    if view is not None:
        lines.append(_summary(view, facts))
        probe = view.probe
        if probe is not None and probe.skipped:
            lines.append(f"  wrapping not proved: {probe.skipped}")
        elif probe is not None and not probe.error:
            lines.append(f"  accelerate's FSDP preparation of the model (fake process group): {probe.unit_summary()}")
    if report.memory_figures:
        lines.append(f"  memory figures: {report.memory_figures}")
    for item in report.findings:
        if item.severity == "info" and not verbose:
            continue
        if item.rule == "wrap-probe-skipped" and view is not None:
            continue  # said on the "wrapping not proved" line above
        where = f" [{item.key}]" if item.key else ""
        lines.append(f"  {item.severity:7} {item.rule}{where}: {item.message}")
        lines.append(f"          fix: {item.fix}")
    if report.infos and not verbose:
        # accelerate's own defaults and style: one short line, not a finding each
        lines.append(f"  ({len(report.infos)} of accelerate's own defaults not shown: " + ", ".join(
            sorted({item.rule for item in report.infos})) + "; --verbose shows them)")
    return lines


def _summary(view, facts) -> str:
    processes = (f"{view.num_processes} processes" if view.processes_in_file else
                 f"num_processes from the launch command (assumed {view.num_processes})")
    text = (f"  accelerate loads it: {view.distributed_type}, {processes} on {view.num_machines} "
            f"node{'s' if view.num_machines != 1 else ''}, mixed precision {view.mixed_precision}")
    settings = view.fsdp_settings()
    if settings:
        if settings["fsdp_version"] == 2:
            sharding = "FULL_SHARD" if settings["reshard_after_forward"] else "SHARD_GRAD_OP"
        else:
            sharding = {"_HYBRID_SHARD_ZERO2": "HYBRID_SHARD_ZERO2"}.get(settings["sharding_strategy"],
                                                                         settings["sharding_strategy"])
        classes = settings["transformer_cls_names_to_wrap"]
        if classes:
            wraps = "wraps " + ",".join(classes)
        elif settings["auto_wrap_policy"] == "transformer_auto_wrap_policy":
            declared = sorted((facts.profile.structure.get("no_split_modules") or []) if facts else [])
            wraps = "wraps the model's _no_split_modules" + (f" ({','.join(declared)})" if declared else "")
        elif settings["auto_wrap_policy"] == "size_based_auto_wrap_policy":
            wraps = "wraps by size"
        else:
            wraps = "no auto-wrap (one unit)"
        text += f"; FSDP{settings['fsdp_version']} {sharding}, {wraps}, {settings['state_dict_type']}"
    layout = view.layout_label()
    if layout:
        text += f"; {layout}"
    return text
