"""Check an accelerate config before a launch wastes cluster time: every problem at once.

Accelerate refuses unknown top-level keys, but it copies every ``fsdp_config`` and
``parallelism_config`` entry onto its launch arguments without looking: a misspelled or stale key
is silently ignored, and a wrong class name fails only once the job holds its GPUs. This module
reports each problem as a :class:`Finding` (stable rule id, severity, message, fix)::

    report = check_file("accelerate_configs/llama-3.1-8b_1x8.yaml", context=CheckContext(model=facts))
    report.errors        # findings that fail the check (exit 1); warnings and notes do not

The yardstick is accelerate 1.16's own behaviour: what accelerate accepts *and applies* is not an
error, even where it is not the newest spelling (``fsdp_reshard_after_forward: FULL_SHARD`` in an
FSDP1 file is what ``accelerate config`` writes); findings on defaults accelerate itself writes are
``info`` (counted on one line, listed with ``check --verbose``); errors are only for what fails or
silently trains something else, warnings for real risks; a fix is always one accelerate accepts; nothing
depends on the checking machine (fp8 says what the training nodes need), and without
``num_processes`` there is no GPU count or memory verdict.

Three layers:

* :func:`lint_config` (pure): the parsed YAML against accelerate's own key lists and value sets
  (read from accelerate itself, so they follow its version), the model (``--model``) and the
  planner.
* :func:`accelerate_view`: the file loaded exactly as ``accelerate launch`` does
  (``load_config_from_file``, its argument merge, ``prepare_multi_gpu_env``) and the
  ``FullyShardedDataParallelPlugin`` and ``ParallelismConfig`` accelerate builds from that
  environment; whatever accelerate raises becomes an ``accelerate-rejects`` finding (unless a rule
  above already names the same problem).
* ``check_file(..., prove_wrapping=True)``: accelerate's FSDP preparation of the model itself
  under a fake process group (:mod:`fsdp_presets.check.wrap_probe`): a crash in ``prepare`` and
  parameters in no unit become findings, and the real unit list is shown.

Rule ids are stable (the docs cite them): see :data:`RULES`.

Where the pieces live: :mod:`~fsdp_presets.check.findings` (rules table, findings, context,
report), :mod:`~fsdp_presets.preset.accelerate_view` (accelerate's key lists, value parsing, its view
of a file), :mod:`~fsdp_presets.check.rules_keys` (keys and values, :func:`lint_config`),
:mod:`~fsdp_presets.check.rules_memory` (layout, LoRA, device and memory),
:mod:`~fsdp_presets.check.script` (``--script``: a static read of the training script and its
rules); this module checks a file. Key names come from :mod:`fsdp_presets.schema`.
"""

from __future__ import annotations

import os

# The checker's pieces, importable from here (the names other code uses).
from fsdp_presets.preset.accelerate_view import AccelerateRejected, AccelerateView, as_whole, accelerate_view
from fsdp_presets.check.findings import CheckContext, CheckReport, Finding, ModelFacts, sorted_findings, finding
from fsdp_presets.check.rules_keys import lint_config
from fsdp_presets.check.rules_memory import memory_figures
from fsdp_presets.schema import FSDP_CONFIG, K, PARALLELISM_CONFIG, PARALLELISM_PREFIX, T, fsdp_where


# --------------------------------------------------------------------------- a file


# accelerate's own refusal -> the rule that already names the same problem (one problem, one finding).
_REJECTION_RULES = (
    ("had unknown keys", "unknown-key"),
    ("'bool' object has no attribute", "yaml-read-as-boolean"),
    ("is not a valid DistributedType", "yaml-read-as-boolean"),
    ("use_parallelism_config", "hsdp-needs-fsdp2"),
    (K.cpu_ram_efficient_loading, "ram-efficient-loading-needs-sync"),
    ("LOCAL_STATE_DICT", "invalid-value"),
    ("invalid truth value", "invalid-value"),
    ("invalid literal for int()", "invalid-value"),
    ("Invalid auto wrap policy", "invalid-value"),
    ("Unknown mixed_precision", "invalid-value"),
    ("not supported with FSDP", "invalid-value"),
    ("KeyError", "invalid-value"),
    (f"requires `{K.version}=2`", "fsdp2-key-under-fsdp1"),
)


def check_file(path: str | os.PathLike, *, context: CheckContext = CheckContext(),
               prove_wrapping: bool = False) -> tuple[CheckReport, AccelerateView | None]:
    """Every finding for the file at ``path``, and accelerate's view of it (None when it refuses).

    ``prove_wrapping``: with a model in ``context``, also run accelerate's FSDP preparation of it
    under a fake process group (:mod:`fsdp_presets.check.wrap_probe`, a few seconds in a subprocess); the
    result is ``view.probe``, its crash or unsharded parameters become findings."""
    import dataclasses

    import yaml

    from fsdp_presets.fileio import YAML_MAX_BYTES, load_yaml_data, read_regular_text
    from fsdp_presets.preset.emit import read_metadata

    report = CheckReport(path=str(path))
    try:
        text = read_regular_text(path, limit=YAML_MAX_BYTES)
    except (OSError, UnicodeDecodeError) as error:
        report.findings.append(finding("yaml-invalid", f"cannot read {path}: {error}", "pass an accelerate config "
                                       "file"))
        return report, None
    try:
        config = load_yaml_data(text)
    except yaml.YAMLError as error:
        report.findings.append(finding("yaml-invalid", f"not valid YAML: {' '.join(str(error).split())}",
                                       "fix the YAML syntax"))
        return report, None
    if context.metadata is None:
        context = dataclasses.replace(context, metadata=read_metadata(text))
    if context.distributed_config is None:
        from fsdp_presets.check.rules_parallel import read_distributed_config

        context = dataclasses.replace(context, distributed_config=read_distributed_config(path))
    report.findings += lint_config(config, context=context)
    view = None
    if isinstance(config, dict):
        given = T.num_processes not in config and config.get(T.distributed_type) in ("FSDP", "MULTI_GPU")
        try:
            view = accelerate_view(path, num_processes=_launch_processes(config, context) if given else None)
            view.processes_in_file = not given
        except AccelerateRejected as error:
            text_of_error = str(error)
            covered = {rule for needle, rule in _REJECTION_RULES if needle in text_of_error}
            if not covered & {item.rule for item in report.errors}:
                report.findings.append(finding("accelerate-rejects", f"accelerate itself rejects the file: {error}",
                                               "fix the problems above; the message is accelerate's own"))
    blocking = [item.rule for item in report.errors if item.rule != "ignored-modules"]
    if prove_wrapping and context.model is not None and blocking and (view is None or view.fsdp_plugin is not None
                                                                       or isinstance(config, dict) and config.get(T.distributed_type) == "FSDP"):
        from fsdp_presets.check.wrap_probe import WrapProbe

        plural = len(set(blocking)) > 1
        reason = f"the error{'s' if plural else ''} above ({', '.join(sorted(set(blocking)))}) stop{'' if plural else 's'} it"
        if view is not None:
            view.probe = WrapProbe(skipped=reason)
        report.findings.append(finding(
            "wrap-probe-skipped", f"accelerate's FSDP preparation of {context.model.source} was not run: {reason}; "
            "the wrapping is not proved", "fix the errors and check again", None))
    if prove_wrapping and view is not None and view.fsdp_plugin is not None and context.model is not None \
            and not blocking:
        report.findings += _probe_findings(view, context, config)
        # one problem, one finding: the probe's is the precise one
        superseded = {"prepare-crashes": "wrap-classes-unset", "params-outside-units": "ignored-modules"}
        drop = {superseded[rule] for rule in report.rules() & set(superseded)}
        report.findings = [item for item in report.findings if item.rule not in drop]
    report.findings = sorted_findings(report.findings)
    report.memory_figures = memory_figures(config, context)
    return report, view


def _launch_processes(config: dict, context: CheckContext) -> int:
    """The ``--num_processes`` a launch of a file without one would pass: --gpus, else the
    parallelism sizes' product, else 2 (what the view then shows is labelled as assumed)."""
    if context.gpus:
        return context.gpus
    parallelism = config.get(PARALLELISM_CONFIG) or {}
    product = 1
    for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
        product *= as_whole(parallelism.get(f"{PARALLELISM_PREFIX}{name}", 1)) or 1
    return product if product > 1 else 2


_PROBES: dict = {}
"""Probe results of this process, by (model, launch environment, processes)."""


def _probe_findings(view: AccelerateView, context: CheckContext, config: dict) -> list[Finding]:
    from fsdp_presets.check.wrap_probe import WrapProbe, probe_wrapping

    model = context.model
    sizes = view.mesh_sizes() or {}
    if (sizes.get("tp_size") or 1) > 1:
        view.probe = WrapProbe(skipped="tensor parallelism: the probe does not build a TP plan")
        return []
    key = (model.source, model.trust_remote_code, tuple(sorted(view.env.items())), view.num_processes)
    if key not in _PROBES:  # files that differ only outside the launch environment share one probe
        _PROBES[key] = probe_wrapping(model.source, view.env, view.num_processes,
                                      trust_remote_code=model.trust_remote_code)
    view.probe = probe = _PROBES[key]
    settings = view.fsdp_settings()
    named = settings["transformer_cls_names_to_wrap"] if "FSDP_TRANSFORMER_CLS_TO_WRAP" in view.env else []
    blocks = ",".join(model.profile.wrap_classes)
    findings = []
    if probe.error:
        if named:
            why, fix = "", (f"wrap the blocks: {K.transformer_layer_cls_to_wrap}: " + blocks
                            if named != list(model.profile.wrap_classes) else
                            "the error is accelerate's/torch's own; `fsdp-presets inspect MODEL` shows the units")
        else:
            declared = sorted(model.profile.structure.get("no_split_modules") or [])
            why = (f" With no {K.transformer_layer_cls_to_wrap}, accelerate wraps the model's _no_split_modules"
                   + (f" ({', '.join(declared)})" if declared else "") + " and then shards the input embedding "
                   "again on its own")
            fix = f"name the block classes: {K.transformer_layer_cls_to_wrap}: {blocks}"
        findings.append(finding(
            "prepare-crashes", f"accelerate's FSDP{settings['fsdp_version']} preparation of {model.profile.architecture} "
            f"({model.source}) raises {probe.error}" + (f" (at {probe.where})" if probe.where else "") + "; every "
            f"rank fails in accelerator.prepare(model).{why}", fix, fsdp_where(K.transformer_layer_cls_to_wrap)))
    elif probe.left_out:
        ignored = (config.get(FSDP_CONFIG) or {}).get(K.ignored_modules)
        findings.append(finding(
            "params-outside-units", f"{len(probe.left_out)} parameters of {model.profile.architecture} are in no FSDP "
            f"unit ({', '.join(probe.left_out[:4])}{', ...' if len(probe.left_out) > 4 else ''}): FSDP neither shards "
            "nor gradient-synchronises them, so each rank updates its own copy and the replicas drift apart"
            + (f" ({K.ignored_modules} {ignored!r} leaves them out)" if ignored else ""),
            f"remove {K.ignored_modules}" if ignored else f"wrap the blocks: {K.transformer_layer_cls_to_wrap}: {blocks}",
            fsdp_where(K.ignored_modules) if ignored else fsdp_where(K.transformer_layer_cls_to_wrap)))
    return findings


def model_facts(source: str, *, trust_remote_code: bool = False) -> ModelFacts:
    """Profile ``source`` and list its module classes (built on the meta device)."""
    from fsdp_presets.model.model_loading import build_meta_model, load_config
    from fsdp_presets.model.profile import profile_module

    model = build_meta_model(load_config(source, trust_remote_code=trust_remote_code),
                             trust_remote_code=trust_remote_code)
    return ModelFacts(source=source, profile=profile_module(model),
                      module_classes=frozenset(type(module).__name__ for module in model.modules()),
                      trust_remote_code=trust_remote_code)


__all__ = ["check_file", "check_generated", "model_facts"]


def check_generated(files: dict, *, device: str) -> None:
    """Raise unless every generated text (``{path: YAML text}``) passes the config rules: a
    generated file that fails them is a bug in fsdp-presets, and is never written."""
    import yaml

    from fsdp_presets.preset.emit_distributed import SUFFIX

    for path, text in files.items():
        if str(path).endswith(SUFFIX):
            continue  # transformers' DistributedConfig, loaded by its own loader before it is written
        errors = [item for item in lint_config(yaml.safe_load(text), context=CheckContext(device=device))
                  if item.severity == "error"]
        if errors:
            raise RuntimeError(f"generated {path} fails its own checks (a bug in fsdp-presets): "
                               + "; ".join(f"{item.rule}: {item.message}" for item in errors))
