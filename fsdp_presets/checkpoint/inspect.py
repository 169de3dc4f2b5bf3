"""What ``fsdp-presets inspect-checkpoint`` reports: a checkpoint's position in training, how it was
sharded, what each rank's files hold, whether its files are intact, and where it can resume.

Where a checkpoint can resume (checked by tests/test_reshard_resume.py):

- ``dcp`` (FSDP ``SHARDED_STATE_DICT``): at any process count, by a run with the same FSDP
  version and ``SHARDED_STATE_DICT``: DCP gives every rank its new shard of every tensor.
- ``full`` (FSDP ``FULL_STATE_DICT``): at any process count with ``FULL_STATE_DICT``: the files
  hold whole tensors.
- ``ddp``: at any process count under DDP (or one process): whole tensors.
- imported (``fsdp-presets import``): at any process count and under any of these, from step 0.

The run stays the same training only if the global batch stays the same: ``N`` data-parallel ranks
need ``micro_batch_size x gradient_accumulation_steps = global_batch / N`` (the recipes adjust the
accumulation on resume, :func:`fsdp_presets.checkpoint.resume.keep_global_batch`). On ``N`` processes
a checkpoint of a TP/EP mesh (``model_mesh``, a model transformers sharded at load time) resumes on the
same TP and EP sizes, ``N / tp_size`` data-parallel ranks (a TP group shares its samples) where ``N``
is whole EP groups, or as FSDP2 alone, ``N`` of them; the answer gives both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fsdp_presets.checkpoint.files import CheckpointFiles, RankFile, find_checkpoint_files, rank_files
from fsdp_presets.errors import UsageError
from fsdp_presets.fileio import printable
from fsdp_presets.flags import GRAD_ACCUM, MICRO_BATCH
from fsdp_presets.schema import mesh_label


@dataclass(kw_only=True)
class ResumeAnswer:
    """Whether a checkpoint resumes at a process count, and how."""

    gpus: int
    """The process count asked about."""
    possible: bool
    """True when it resumes there as the same training."""
    reason: str
    """Why, and with which settings."""
    gradient_accumulation_steps: int | None = None
    """Accumulation that keeps the global batch at the recorded micro-batch size (None: unknown
    or not needed)."""


@dataclass(kw_only=True)
class CheckpointSummary:
    """Everything inspect-checkpoint shows."""

    checkpoint: str
    """The folder."""
    kind: str
    """The manifest's kind (:mod:`fsdp_presets.checkpoint.manifest`): ``training``, ``adapter`` (LoRA,
    trainable weights only) or ``imported``; ``training`` without a manifest."""
    layout: str
    """``dcp``, ``full``, ``ddp`` or ``adapter`` (see :mod:`fsdp_presets.checkpoint.files`)."""
    step: int | None
    """Optimizer steps done (None without a manifest)."""
    samples_consumed: int | None
    """Data position."""
    global_batch_samples: int | None
    """Samples per optimizer step of the run, when known."""
    micro_batch_size: int | None
    """The run's micro-batch size, from its run.json, when known."""
    world_size: int | None
    """Processes that saved it."""
    strategy: str
    """How the model was sharded, in words."""
    fsdp: dict[str, Any] | None
    """The manifest's FSDP settings."""
    config_digest: str | None
    """Model config digest recorded in the manifest."""
    integrity: dict[str, Any]
    """``{"ok", "checked_files", "problem", "refused"}``: the verdict of
    :func:`fsdp_presets.checkpoint.verify.checkpoint_verdict` (``refused``: a file could run code)."""
    files: list[RankFile]
    """Data files: path, rank, tensors, bytes."""
    resume: list[ResumeAnswer] = field(default_factory=list)
    """Answers for the asked process counts."""
    model_mesh: dict[str, Any] | None = None
    """The manifest's TP/EP mesh (a model transformers sharded at load time), None without one."""

    def per_rank(self) -> dict[str, dict[str, int]]:
        totals: dict[str, dict[str, int]] = {}
        for item in self.files:
            key = "shared" if item.rank is None else str(item.rank)
            entry = totals.setdefault(key, {"files": 0, "tensors": 0, "bytes": 0})
            entry["files"] += 1
            entry["tensors"] += item.tensors
            entry["bytes"] += item.bytes
        return totals

    def to_json(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["per_rank"] = self.per_rank()
        return payload


def strategy_words(distributed_type: str | None, fsdp: dict[str, Any] | None, layout: str,
                   model_mesh: dict[str, Any] | None = None) -> str:
    if model_mesh:
        launch = (strategy_words(distributed_type, fsdp, layout) if fsdp else
                  f"a {distributed_type} launch (a Trainer's)" if distributed_type else "")
        return (f"{mesh_label(model_mesh)}, sharded by transformers at load time (DistributedConfig)"
                + (f" under {launch}" if launch else ""))
    if fsdp:
        version = fsdp.get("version")
        details = []
        sharding = fsdp.get("reshard_after_forward")
        if sharding is not None:
            details.append(f"reshard_after_forward={sharding}" if version == 2 else str(sharding))
        mesh = fsdp.get("hsdp_mesh")
        if mesh:
            details.append(f"HSDP {mesh.get('dp_replicate_size')}x{mesh.get('dp_shard_size')}")
        shown = f" ({', '.join(details)})" if details else ""
        return f"FSDP{version}{shown}, {fsdp.get('state_dict_type')}"
    if distributed_type in ("MULTI_CPU", "MULTI_GPU"):
        return f"DDP ({distributed_type})"
    if distributed_type == "NO":
        return "one process" if layout != "dcp" else "written by one process (DCP)"
    return {"dcp": "FSDP, SHARDED_STATE_DICT (DCP)", "full": "FSDP, FULL_STATE_DICT", "ddp": "DDP or one process",
            "adapter": "a LoRA run (DCP of the trainable weights)"}[layout]


def resume_answer(summary: CheckpointSummary, gpus: int) -> ResumeAnswer:
    """Can this checkpoint continue as the same training on ``gpus`` processes?"""
    if gpus < 1:
        raise UsageError(f"--gpus {gpus}: give a process count >= 1")
    if summary.integrity.get("ok") is False:
        return ResumeAnswer(gpus=gpus, possible=False,
                            reason=f"the checkpoint is damaged ({summary.integrity['problem']}); a recipe skips it")
    if summary.integrity.get("ok") is None:
        return ResumeAnswer(gpus=gpus, possible=False,
                            reason="no manifest.json, so nothing vouches for the files; a recipe resumes only from a "
                                   "committed checkpoint (one with a manifest)")
    if summary.kind == "imported":
        return ResumeAnswer(gpus=gpus, possible=True,
                            reason="imported weights: any process count, FSDP2, FSDP1, DDP or one process; "
                                   "starts at step 0 with a fresh optimizer")
    how = {"dcp": f"DCP reshards to {gpus} process(es); use the same FSDP version with SHARDED_STATE_DICT",
           "full": f"full tensors load on {gpus} process(es); use FSDP with FULL_STATE_DICT",
           "ddp": f"full tensors load on {gpus} process(es); use DDP (or one process)",
           "adapter": f"DCP reshards the LoRA adapter to {gpus} process(es) under FSDP2, FSDP1 or DDP; relaunch "
                      "with the same --lora-* flags (the base reloads from --model)"}[summary.layout]
    if summary.global_batch_samples is None:
        return ResumeAnswer(gpus=gpus, possible=True,
                            reason=f"{how}; the global batch is not recorded, keep micro-batch x accumulation x "
                                   "data-parallel ranks as it was")
    recorded = summary.model_mesh or {}
    tp, ep = (int(recorded.get(key) or 1) for key in ("tp_size", "ep_size"))
    if tp == 1 and ep == 1:
        answer = _keeping_the_batch(summary, gpus, data_ranks=gpus, ranks="processes")
        return answer if not answer.possible else dataclasses.replace(answer, reason=f"{how}; {answer.reason}")
    # A TP/EP mesh: on the same TP and EP sizes (a TP group shares its samples; EP ranks each have
    # their own), or as FSDP2 alone.
    alone = _keeping_the_batch(summary, gpus, data_ranks=gpus, ranks="data-parallel ranks")
    label = mesh_label({"fsdp_size": gpus // tp or 1, "tp_size": tp, "ep_size": ep})
    if tp > 1 and (gpus % tp or gpus // tp < 2):
        mesh = ResumeAnswer(gpus=gpus, possible=False, reason=f"{gpus} processes do not make 2 or more data-parallel "
                                                              f"ranks of {tp}-process TP groups")
    elif gpus % ep:
        mesh = ResumeAnswer(gpus=gpus, possible=False, reason=f"{gpus} processes are not whole EP groups of {ep} "
                                                              f"(each holds 1/{ep} of the experts)")
    else:
        mesh = _keeping_the_batch(summary, gpus, data_ranks=gpus // tp, ranks="data-parallel ranks")
    chosen = mesh if mesh.possible else alone
    return ResumeAnswer(gpus=gpus, possible=chosen.possible,
                        gradient_accumulation_steps=chosen.gradient_accumulation_steps,
                        reason=f"{how}; on {label}: {mesh.reason}; as FSDP2 alone: {alone.reason}")


def _keeping_the_batch(summary: CheckpointSummary, gpus: int, *, data_ranks: int, ranks: str) -> ResumeAnswer:
    """Whether the recorded global batch splits over ``data_ranks`` data-parallel ranks (called
    ``ranks``) at the run's micro-batch size (or the largest that divides), and with which accumulation."""
    batch = summary.global_batch_samples
    if batch % data_ranks:
        return ResumeAnswer(gpus=gpus, possible=False,
                            reason=f"the global batch of {batch} samples does not split over {data_ranks} {ranks}, "
                                   "so every later step would take other samples; choose a process count that "
                                   f"divides {batch}")
    per_rank = batch // data_ranks
    micro = summary.micro_batch_size
    if micro is None or per_rank % micro:
        micro = math.gcd(per_rank, micro or per_rank)
    accumulation = per_rank // micro
    return ResumeAnswer(gpus=gpus, possible=True, gradient_accumulation_steps=accumulation,
                        reason=f"the global batch of {batch} samples stays with {MICRO_BATCH.name} {micro} "
                               f"{GRAD_ACCUM.name} {accumulation}" + ("" if ranks == "processes" else
                                                                      f" over {data_ranks} {ranks}")
                               + " (the recipes set the accumulation themselves)")


def summarize_checkpoint(folder: str | Path, gpus: list[int] | None = None) -> CheckpointSummary:
    """Read a checkpoint's manifest, files and DCP metadata (no tensor data) and give the verdict
    the recipes give (:func:`fsdp_presets.checkpoint.verify.checkpoint_verdict`): checksums, a closed
    folder, and every pickle read as data only. Nothing of the folder is run or followed."""
    from fsdp_presets.checkpoint.layout import MANIFEST
    from fsdp_presets.checkpoint.manifest import recorded_global_batch
    from fsdp_presets.checkpoint.run_folder import run_info_of
    from fsdp_presets.checkpoint.verify import checkpoint_verdict, folder_verdict

    folder = Path(folder)
    has_manifest = (folder / MANIFEST).exists() or (folder / MANIFEST).is_symlink()
    # With a manifest, a missing .metadata is damage to report (exit 1), not a wrong folder (exit 2).
    files: CheckpointFiles = find_checkpoint_files(folder, require_metadata=not has_manifest)
    verdict = checkpoint_verdict(folder) if has_manifest else folder_verdict(folder)
    manifest = verdict.manifest
    integrity = {"ok": verdict.ok, "checked_files": len(manifest.files) if manifest else 0,
                 "problem": verdict.problem, "refused": verdict.unsafe}
    if verdict.ok and not has_manifest:
        integrity.update(ok=None, problem="no manifest.json: an unfinished save, or not written by a recipe; nothing "
                                          "to check the files against")
    data_files: list[RankFile] = []
    try:  # reads .metadata through the allow-list too: a refused one lists no files
        data_files = rank_files(files)
    except UsageError as error:
        if integrity["ok"] is not False:
            integrity = {**integrity, "ok": False, "problem": str(error)}
    step = manifest.step if manifest else None
    samples = manifest.samples_consumed if manifest else None
    batch = recorded_global_batch(folder, step=step, samples_consumed=samples) if step else None
    recorded = run_info_of(folder)
    micro = recorded.micro_batch_size if recorded and type(recorded.micro_batch_size) is int else None
    summary = CheckpointSummary(
        checkpoint=str(folder), kind=manifest.kind if manifest else "training",
        layout=files.layout, step=step, samples_consumed=samples, global_batch_samples=batch, micro_batch_size=micro,
        world_size=manifest.world_size if manifest else None,
        strategy=strategy_words(manifest.distributed_type if manifest else None, manifest.fsdp if manifest else None,
                                files.layout, manifest.model_mesh if manifest else None),
        fsdp=manifest.fsdp if manifest else None, config_digest=manifest.config_digest if manifest else None,
        integrity=integrity, files=data_files, model_mesh=manifest.model_mesh if manifest else None)
    summary.resume = [resume_answer(summary, count) for count in (gpus or [])]
    return summary


def summary_lines(summary: CheckpointSummary) -> list[str]:
    """The human-readable report."""
    lines = [f"checkpoint {summary.checkpoint}"]
    if summary.kind == "imported":
        lines.append("  kind        imported Hugging Face weights (no optimizer state: a resumed run starts at step 0)")
    elif summary.kind == "trainer":
        lines.append("  kind        transformers Trainer checkpoint (committed by fsdp_presets.FSDPPresetsCallback; "
                     "resume it with trainer.train(resume_from_checkpoint=...))")
    elif summary.kind == "adapter":
        lines.append("  kind        LoRA adapter (trainable weights and their optimizer state; the base reloads from "
                     "--model)")
    if summary.step is not None:
        batch = f"; global batch {summary.global_batch_samples}" if summary.global_batch_samples else ""
        lines.append(f"  position    step {summary.step}, {summary.samples_consumed} samples consumed{batch}")
    saved_by = f"{summary.world_size} process(es), " if summary.world_size else ""
    lines.append(f"  saved by    {saved_by}{summary.strategy}; layout {summary.layout}")
    if summary.config_digest:
        lines.append(f"  model       config digest {summary.config_digest[:16]}")
    state = {True: "OK", False: "DAMAGED", None: "NOT CHECKED"}[summary.integrity["ok"]]
    if summary.integrity.get("refused"):
        state = "REFUSED"  # a file could run code: it was not loaded
    detail = (f"{summary.integrity['checked_files']} files match their SHA-256 and size in manifest.json"
              if summary.integrity["ok"] else summary.integrity["problem"])
    lines.append(f"  integrity   {state}: {detail}")
    if summary.files:
        lines.append("  files")
        width = max(len(item.path) for item in summary.files)
        for item in summary.files:
            rank = f"rank {item.rank}" if item.rank is not None else "shared"
            lines.append(f"    {item.path:<{width}}  {rank:<8} {item.tensors:>6} tensors {item.bytes:>14,} bytes")
        lines.append("  per rank")
        for rank, totals in summary.per_rank().items():
            label = f"rank {rank}" if rank != "shared" else "shared"
            lines.append(f"    {label:<8} {totals['files']} files, {totals['tensors']} tensors, {totals['bytes']:,} bytes")
    for answer in summary.resume:
        lines.append(f"  resume at {answer.gpus} GPU(s): {'yes' if answer.possible else 'no'}: {answer.reason}")
    return [printable(line) for line in lines]  # names come from the checkpoint: none may redraw the terminal
