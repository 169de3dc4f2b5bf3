"""What ``fsdp-presets check`` reports: every config file checked (:func:`check_configs`), with
the model each one trains (``--model``, else the one a generated preset names in its header),
as text or as JSON."""

from __future__ import annotations

import dataclasses

from fsdp_presets.errors import UsageError
from fsdp_presets.preset.emit import file_metadata, header_model_path


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckedConfigs:
    """The reports of the files one ``check`` read."""

    documents: list[dict]
    """One JSON document per file (:meth:`~fsdp_presets.check.findings.CheckReport.to_json`, the
    model and what accelerate loads)."""
    lines: list[str]
    """The human report of every file."""
    ok: bool
    """No file has an error."""

    def to_json(self) -> dict:
        return {"ok": self.ok, "files": self.documents}

    def text(self) -> str:
        return "\n".join(self.lines)


def rules_lines() -> list[str]:
    """``check --list-rules``: each rule id, its severity and what it finds."""
    from fsdp_presets.check.findings import RULES

    return [f"{rule:34} {severity:8} {what}" for rule, (severity, what) in RULES.items()]


def check_configs(paths, *, context, model: str | None, trust_remote_code: bool = False,
                  prove_wrapping: bool = True, verbose: bool = False) -> CheckedConfigs:
    """Check every file of ``paths`` in ``context`` (its ``model`` is filled in per file: ``model``
    when given, else the one a generated preset names). A ``--method`` other than the one a preset was
    generated for is refused (:class:`~fsdp_presets.errors.UsageError`)."""
    from fsdp_presets.check.lint import check_file, model_facts
    from fsdp_presets.schema import T

    if trust_remote_code:
        import functools

        model_facts = functools.partial(model_facts, trust_remote_code=True)
    explicit = model_facts(model) if model else None
    cache: dict = {}
    documents, failed, lines = [], False, []
    for path in paths:
        refuse_another_method(path, context.method)
        facts, model_note = explicit, None
        if facts is None:
            facts, model_note = model_from_header(path, cache, model_facts)
        report, view = check_file(path, context=dataclasses.replace(context, model=facts),
                                  prove_wrapping=prove_wrapping)
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
        lines += report_lines(report, view, facts, model_note, verbose=verbose)
    return CheckedConfigs(documents=documents, lines=lines, ok=not failed)


def refuse_another_method(path, method) -> None:
    """``--method`` that is not the one a generated preset was decided for: its memory verdicts would
    be of another training (a full fine-tuning preset checked as QLoRA fits, and trains, nothing)."""
    request = file_metadata(path).get("request")
    decided = (request.get("method") or "full") if isinstance(request, dict) else None
    if method and decided and method != decided:
        raise UsageError(f"--method {method} disagrees with {path}, a preset generated for {decided} (its header "
                         f"says so): check it with --method {decided}, or generate a preset for {method} "
                         f"(fsdp-presets generate ... --method {method})")


def model_from_header(path, cache: dict, model_facts):
    """``(facts, note)``: the model a generated preset names in its metadata line, when it can be
    profiled here (``cache``: the models profiled already, by source), and the line that says so."""
    metadata = file_metadata(path)
    source = (metadata.get("request") or {}).get("model")
    if not source:
        return None, "no --model: the class and memory rules were skipped"
    named, source = source, header_model_path(path, source)
    if source not in cache:
        try:
            cache[source] = (model_facts(source), None)
        except UsageError as error:
            cache[source] = (None, f"the header's model {source} could not be loaded ({error}); class and memory "
                                   "rules skipped (pass --model)")
    facts, note = cache[source]
    found = "" if source == named else f" as {named}, a path from the folder it was generated in"
    return facts, note or f"model: {source} (named in the file's header{found})"



def report_lines(report, view, facts, model_note, *, verbose: bool = False) -> list[str]:
    """The lines of one file's report: the verdict, the model, how accelerate loads it, the wrap
    probe, and the findings with their fixes (info findings counted on one line unless ``verbose``)."""
    errors, warnings = len(report.errors), len(report.warnings)
    status = "ok" if report.ok else "FAILED"
    counts = f"{errors} error{'s' if errors != 1 else ''}, {warnings} warning{'s' if warnings != 1 else ''}"
    lines = [f"{report.path}: {status} ({counts})"]
    if model_note:
        lines.append(f"  {model_note}")
    if view is not None:
        lines.append(summary_line(view, facts))
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


def summary_line(view, facts) -> str:
    """How accelerate loads the file: processes, nodes, precision, FSDP version, sharding, wrapping."""
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
