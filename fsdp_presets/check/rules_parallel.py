"""Rules for a config with a second dimension (``parallelism_config_tp_size`` or ``_cp_size`` above 1):
what the model allows, what the installed accelerate/transformers pair can run, and the silent
failures users meet there. Each finding is one line with what to change.

- ``tp-pair-cannot-run``: accelerate 1.16's ``prepare`` of an FSDP2 x TP model imports
  ``ReplicateParallel`` from ``transformers.integrations.tensor_parallel``; tried here, not looked up
  in a version table (transformers 5.25 has no such name: ``prepare`` raises ImportError).
- ``tp-size-vs-model``: the TP size must divide the attention heads and the key/value heads
  (transformers issue 48307: more TP ranks than key/value heads loads, then fails mid-forward), the
  MLP width where the plan splits it, the vocabulary where the head is split by columns.
- ``tp-no-plan``: the model's transformers class ships no tensor-parallel plan.
- ``tp-loss-reduction``: tensor parallelism has counted the loss ``tp_size`` times (transformers issues
  45994 and 39674): hold the run to its DDP baseline with ``fsdp-presets converge``.
- ``cp-masks``: context parallelism with a sliding-window model: accelerate drops attention masks
  (accelerate issue 4177), so sliding-window layers train with full causal attention; with packing,
  documents see each other (TRL issue 6843); it needs SDPA and sequences divisible by 2 x cp_size.
"""

from __future__ import annotations

from fsdp_presets.check.findings import CheckContext, Finding, finding
from fsdp_presets.schema import PARALLELISM_CONFIG, PARALLELISM_PREFIX


def _size(parallelism: dict, name: str) -> int:
    value = parallelism.get(f"{PARALLELISM_PREFIX}{name}", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def parallel_rules(parallelism: dict, context: CheckContext) -> list[Finding]:
    """The findings for ``parallelism``'s TP and CP sizes (a model's own limits with ``--model``)."""
    tp, cp = _size(parallelism, "tp_size"), _size(parallelism, "cp_size")
    findings: list[Finding] = []
    where = f"{PARALLELISM_CONFIG}.{PARALLELISM_PREFIX}tp_size"
    if tp > 1:
        from fsdp_presets.rehearse.mesh import accelerate_tp_import_problem  # tried at each check

        problem = accelerate_tp_import_problem()
        if problem:
            findings.append(finding(
                "tp-pair-cannot-run", f"tensor parallelism {tp} through accelerate cannot run with the installed "
                f"transformers: accelerate's prepare fails ({problem})",
                "train the mesh through transformers' own DistributedConfig (from_pretrained(..., "
                "distributed_config=...)), or install an accelerate/transformers pair whose prepare imports", where))
        findings.append(finding(
            "tp-loss-reduction", f"tensor parallelism {tp}: a loss counted {tp} times, or a rank that skips its "
            "all-reduce, trains without an error (transformers issues 45994, 39674)",
            "hold the run to its DDP baseline: fsdp-presets converge (docs/convergence.md)", where))
    findings += mesh_rules(tp=tp, ep=1, context=context, where=where)
    if cp > 1:
        findings.append(finding(
            "cp-masks", f"context parallelism {cp}: accelerate drops attention masks (accelerate issue 4177), so "
            "sliding-window layers train with full causal attention and packed documents see each other "
            "(TRL issue 6843); it needs SDPA and sequences divisible by 2 x cp_size",
            "use it only for full-causal models without packing, sequences a multiple of "
            f"{2 * cp}, attn_implementation sdpa", f"{PARALLELISM_CONFIG}.{PARALLELISM_PREFIX}cp_size"))
    return findings


def mesh_rules(*, tp: int, ep: int, context: CheckContext, where: str | None) -> list[Finding]:
    """What the model (``--model``) allows of a TP/EP mesh: a plan to shard by, and sizes that divide
    its heads, key/value heads, MLP width, vocabulary and experts (transformers' own TP/EP)."""
    if context.model is None or (tp <= 1 and ep <= 1):
        return []
    parallel = context.model.profile.structure.get("parallel") or {}
    name = context.model.profile.architecture
    findings: list[Finding] = []
    if tp > 1 and not parallel.get("tp_plan"):
        findings.append(finding("tp-no-plan", f"{name} ships no tensor-parallel plan in transformers: tensor "
                                f"parallelism {tp} cannot shard it", "use FSDP/HSDP only (tp_size 1)", where))
    elif tp > 1 and tp not in parallel.get("tp_sizes", []):
        limits = parallel.get("tp_limits") or {}
        failing = ", ".join(f"{value} {label}" for label, value in limits.items() if value % tp)
        allowed = ", ".join(str(size) for size in parallel.get("tp_sizes", []) if size <= 64)
        findings.append(finding(
            "tp-size-vs-model", f"tensor parallelism {tp} does not divide {name}'s {failing}: it loads, then fails "
            "mid-forward (transformers issue 48307)", f"use a TP size of {allowed}", where))
    if ep > 1 and not parallel.get("ep_plan"):
        findings.append(finding("ep-no-plan", f"{name} ships no expert-parallel plan in transformers"
                                + (" (not a mixture-of-experts model)" if not context.model.profile.is_moe else "")
                                + f": expert parallelism {ep} cannot shard it", "use ep_size 1", where))
    elif ep > 1 and ep not in parallel.get("ep_sizes", []):
        experts = (parallel.get("ep_limits") or {}).get("experts")
        allowed = ", ".join(str(size) for size in parallel.get("ep_sizes", []) if size > 1)
        findings.append(finding(
            "ep-size-vs-model", f"expert parallelism {ep} does not divide {name}'s {experts} experts: the ranks "
            "cannot own whole experts", f"use an EP size of {allowed}", where))
    return findings


def read_distributed_config(config_path) -> dict | None:
    """The ``NAME.distributed.json`` beside the accelerate config at ``config_path`` (what ``generate
    --tp/--ep`` writes and the recipes load the model over), read as data: ``{"path", "sizes"}``, or
    ``{"path", "problem"}`` when the recipes would refuse it; None when there is none."""
    import json
    from pathlib import Path

    from fsdp_presets.fileio import CONFIG_MAX_BYTES, read_regular_text
    from fsdp_presets.preset.emit_distributed import distributed_config_path, load_distributed_config, recipes_refuse
    from fsdp_presets.schema import MESH_SIZE_KEYS

    path = Path(distributed_config_path(str(config_path)))
    if not (path.exists() or path.is_symlink()):
        return None
    try:
        document = json.loads(read_regular_text(path, limit=CONFIG_MAX_BYTES))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return {"path": str(path), "problem": f"it cannot be read as JSON ({' '.join(str(error).split())})"}
    if not isinstance(document, dict):
        return {"path": str(path), "problem": f"it holds {type(document).__name__}, not DistributedConfig's sizes"}
    sizes = {key: document.get(key, 1) for key in MESH_SIZE_KEYS}
    bad = {key: value for key, value in sizes.items()
           if isinstance(value, bool) or not isinstance(value, int) or value < 1}
    if bad:
        return {"path": str(path), "problem": f"sizes that are not whole numbers of at least 1: {bad}"}
    try:
        config = load_distributed_config(path)  # transformers' own loader, as the recipes read it
    except (OSError, ValueError, TypeError) as error:
        return {"path": str(path), "problem": f"transformers' DistributedConfig does not take it ({error})"}
    problem = recipes_refuse(config)
    if problem is not None:
        return {"path": str(path), "problem": problem}
    return {"path": str(path), "sizes": sizes}


def distributed_config_rules(context: CheckContext, processes: int | None) -> list[Finding]:
    """The findings for the ``NAME.distributed.json`` beside the config (``context.distributed_config``):
    one the recipes refuse, a mesh of another number of ranks than ``processes``, TP/EP sizes the model
    (``--model``) does not allow, and, when it is sound, a note naming the mesh the memory rules plan."""
    from pathlib import Path

    from fsdp_presets.schema import mesh_label

    document = context.distributed_config
    if document is None:
        return []
    name = Path(document["path"]).name
    regenerate = "regenerate both files with `fsdp-presets generate MODEL --gpus N --tp T` (or --ep E)"
    if "problem" in document:
        return [finding("distributed-config-invalid", f"{document['problem']}: the recipes refuse it at start",
                        regenerate, name)]
    sizes = document["sizes"]
    ranks = sizes["dp_replicate_size"] * sizes["fsdp_size"] * sizes["tp_size"]
    findings = mesh_rules(tp=sizes["tp_size"], ep=sizes["ep_size"], context=context, where=name)
    if processes is not None and ranks != processes:
        findings.append(finding(
            "distributed-config-vs-processes", f"the mesh lays out {ranks} ranks ({mesh_label(sizes)}) and the config "
            f"launches {processes} processes: the recipes refuse the launch at start", regenerate, name))
    elif not findings:
        findings.append(finding(
            "distributed-config-mesh", f"transformers shards the model over {mesh_label(sizes)} (the recipes' "
            "--distributed-config); the memory figures are that mesh's",
            f"launch the recipes with --distributed-config {document['path']} (the generated launch line does)", name))
    return findings
