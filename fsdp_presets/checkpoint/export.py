"""``fsdp-presets export``: a recipe checkpoint as a Hugging Face folder (see
:mod:`fsdp_presets.checkpoint` for what is written and how)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fsdp_presets.checkpoint.adapter import export_checkpoint_adapter, is_adapter_checkpoint
from fsdp_presets.checkpoint.export_files import finish_export_folder
from fsdp_presets.checkpoint.files import (CheckpointFiles, TensorInfo, WeightReader, find_checkpoint_files,
                                           model_reader)
from fsdp_presets.checkpoint.hf_model import (DTYPES, ExpectedTensors, ModelFiles, Verification, VerificationFailed,
                                              check_tensors, expected_tensors, find_model_files, from_pretrained_fp32,
                                              load_model, refuse_oversized_model_files,
                                              tokenizer_and_generation_config, verify_models)
from fsdp_presets.checkpoint.layout import (ADAPTER_MODEL, ADAPTER_WEIGHTS, HF_CONFIG, MANIFEST, MODEL_CONFIG, SAFETENSORS_INDEX,
                                            SAFETENSORS_SHARDS, WEIGHTS_SUFFIX)
from fsdp_presets.checkpoint.outputs import check_output, staged_output
from fsdp_presets.errors import UsageError

@dataclass(kw_only=True)
class ExportReport:
    """What an export wrote."""

    output: Path
    """The Hugging Face folder."""
    layout: str
    """Checkpoint layout read (dcp, full, ddp)."""
    dtype: str
    """Written dtype (fp32, bf16, fp16)."""
    shards: list[str]
    """Safetensors files written."""
    tensors: int
    """Tensors written (tied weights once)."""
    bytes: int
    """Bytes of tensor data written."""
    tied: list[str]
    """Names left out because they are tied to a written tensor."""
    streamed: bool
    """True when shards were read and written one at a time (False: whole model via save_pretrained)."""
    largest_shard_bytes: int
    """The most tensor bytes held at once while writing (about the peak memory of the copy)."""
    model_files: str
    """Where config and tokenizer came from."""
    verification: "Verification | None" = None
    """The --verify result, when asked."""


@dataclass(kw_only=True)
class _ExportPlan:
    files: CheckpointFiles
    reader: WeightReader
    model: ModelFiles
    expected: ExpectedTensors
    tokenizer: Any
    generation_config: Any


def plan_export(checkpoint: str | os.PathLike, *, model: str | None = None) -> _ExportPlan:
    """Every check of an export, before anything is written."""
    from fsdp_presets.checkpoint.verify import checkpoint_verdict, folder_verdict
    from fsdp_presets.fileio import config_digest
    from fsdp_presets.checkpoint.manifest import read_manifest_json

    checkpoint = Path(checkpoint)
    files = find_checkpoint_files(checkpoint)
    manifest = read_manifest_json(checkpoint)
    # The recipes' verdict, before anything of the folder is parsed: checksums, no link and no
    # path out of it, and every pickle data only. Without a manifest, the last two still hold.
    if (checkpoint / MANIFEST).exists() or (checkpoint / MANIFEST).is_symlink():
        problem = checkpoint_verdict(checkpoint).problem
    else:
        problem = folder_verdict(checkpoint).problem
    if problem is not None:
        raise UsageError(f"{checkpoint}: {problem} (the checkpoint is damaged or was changed after it was "
                         "saved; use another checkpoint)")
    model_files = find_model_files(checkpoint, model)
    recorded = (manifest or {}).get("config_digest")
    if recorded and recorded != config_digest(model_files.config):
        raise UsageError(f"{checkpoint} is a checkpoint of another model: the config digest in its {MANIFEST} "
                         f"differs from {model_files.folder / HF_CONFIG} ({model_files.origin}); give --model "
                         "the model folder the run trained")
    reader = model_reader(files)
    expected = expected_tensors(model_files.config)
    check_tensors(reader.entries(), expected, files.model, model_files)
    tokenizer, generation_config = tokenizer_and_generation_config(model_files, required=False)
    return _ExportPlan(files=files, reader=reader, model=model_files, expected=expected, tokenizer=tokenizer,
                       generation_config=generation_config)


def export_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike, *, dtype: str = "fp32",
                      max_shard_size: str = "5GB", model: str | None = None, verify: bool = False,
                      force: bool = False, keep_code_references: bool = False,
                      log: Callable[[str], None] = print) -> ExportReport:
    """Write the Hugging Face folder ``output`` from a recipe checkpoint (see the module
    docstring). With ``verify``, the written folder is compared with the checkpoint before it is
    put in place; a failed verification leaves no output and returns the report with it. Code
    references (``auto_map``) are dropped unless ``keep_code_references``
    (:mod:`fsdp_presets.checkpoint.export_files`)."""
    import torch

    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    _check_shard_size(max_shard_size)
    output = Path(output)
    check_output(output, kind="export", force=force, source=Path(checkpoint))
    if is_adapter_checkpoint(checkpoint):
        return _export_adapter(Path(checkpoint), output, dtype=dtype, verify=verify, force=force,
                               keep_code_references=keep_code_references, log=log)
    plan = plan_export(checkpoint, model=model)
    target = getattr(torch, DTYPES[dtype])
    written = plan.expected.written
    tied = [name for name in plan.expected.all if name not in written]
    log(f"export: {plan.files.model} ({plan.files.layout} layout, {len(written)} tensors"
        f"{f', {len(tied)} tied left out' if tied else ''}) -> {output} as {dtype}; config "
        f"{'and tokenizer ' if plan.tokenizer is not None else ''}from {plan.model.folder} ({plan.model.origin})"
        f"{'' if plan.tokenizer is not None else '; no tokenizer there, so the folder holds none (weights need none)'}")
    report = None
    with staged_output(output, kind="export", force=force) as staging:
        if plan.expected.conversion:
            shards, total, largest = _export_whole(plan, staging, target, max_shard_size)
        else:
            shards, total, largest = _export_streamed(plan, staging, target, max_shard_size)
        _write_model_files(plan, staging, target)
        finish_export_folder(staging, keep_code_references=keep_code_references, log=log)
        # A weight conversion writes transformers' on-disk names (Mixtral: each fused expert tensor as
        # one per expert): the count of what the folder holds, not of the checkpoint's tensors.
        report = ExportReport(output=output, layout=plan.files.layout, dtype=dtype, shards=shards,
                              tensors=_written_tensors(staging) if plan.expected.conversion else len(written),
                              bytes=total, tied=tied, streamed=not plan.expected.conversion,
                              largest_shard_bytes=largest, model_files=f"{plan.model.folder} ({plan.model.origin})")
        if verify:
            report.verification = verify_export(plan, staging, dtype)
            if not report.verification.passed:
                raise VerificationFailed(report)
    return report


def _export_adapter(checkpoint: Path, output: Path, *, dtype: str, verify: bool, force: bool,
                    keep_code_references: bool, log: Callable[[str], None]) -> ExportReport:
    """A LoRA checkpoint (trainable weights only) as a PEFT folder: adapter_config.json,
    adapter_model.safetensors and the tokenizer (:func:`fsdp_presets.checkpoint.adapter.export_checkpoint_adapter`)."""
    from fsdp_presets.checkpoint.verify import checkpoint_verdict

    if verify:
        raise UsageError(f"--verify: {checkpoint} is a LoRA checkpoint, whose export is an adapter; load it with "
                         "peft (PeftModel.from_pretrained(base, HF_DIR)) instead (nothing was written)")
    problem = checkpoint_verdict(checkpoint).problem
    if problem is not None:
        raise UsageError(f"{checkpoint}: {problem} (the checkpoint is damaged or was changed after it was saved; use "
                         "another checkpoint)")
    refuse_oversized_model_files(checkpoint / MODEL_CONFIG)
    log(f"export: {checkpoint / ADAPTER_MODEL} (LoRA adapter) -> {output} as a PEFT folder in {dtype}")
    with staged_output(output, kind="export", force=force) as staging:
        tensors, total = export_checkpoint_adapter(checkpoint, staging, dtype=dtype, log=log)
        finish_export_folder(staging, keep_code_references=keep_code_references, log=log)
    return ExportReport(output=output, layout="adapter", dtype=dtype, shards=[ADAPTER_WEIGHTS],
                        tensors=tensors, bytes=total, tied=[], streamed=False, largest_shard_bytes=total,
                        model_files=f"{checkpoint / MODEL_CONFIG} (adapter_config.json)")



def export_or_report(*args, **kwargs) -> ExportReport:
    """:func:`export_checkpoint` that returns the report of a failed verification instead of
    raising (nothing is written then)."""
    try:
        return export_checkpoint(*args, **kwargs)
    except VerificationFailed as failed:
        return failed.report


def _check_shard_size(text: str) -> None:
    """``--max-shard-size`` as huggingface_hub parses it (``5GB``, ``500MB``, ``2GiB``), above 0."""
    import re

    from huggingface_hub import split_torch_state_dict_into_shards

    try:
        split_torch_state_dict_into_shards({}, max_shard_size=text)  # parses the size, splits nothing
        number = re.match(r"\s*([0-9]*\.?[0-9]+)", text)
        positive = number is not None and float(number.group(1)) > 0
    except ValueError:
        positive = False
    if not positive:
        raise UsageError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 100KB (units KB, MB, GB, TB)")


def _export_streamed(plan: _ExportPlan, staging: Path, target, max_shard_size: str) -> tuple[list[str], int, int]:
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    entries = plan.reader.entries()

    def written_dtype(info: TensorInfo):
        return target if info.dtype.is_floating_point else info.dtype

    layout = {name: torch.empty(entries[name].shape, dtype=written_dtype(entries[name]), device="meta")
              for name in plan.expected.written}
    split = split_torch_state_dict_into_shards(layout, filename_pattern=SAFETENSORS_SHARDS,
                                               max_shard_size=max_shard_size)
    total = largest = 0
    for filename, names in split.filename_to_tensors.items():
        shard = {name: (tensor.to(target) if tensor.is_floating_point() else tensor).contiguous()
                 for name, tensor in plan.reader.read(names).items()}
        shard_bytes = sum(tensor.numel() * tensor.element_size() for tensor in shard.values())
        save_file(shard, str(staging / filename), metadata={"format": "pt"})
        total += shard_bytes
        largest = max(largest, shard_bytes)
        del shard
    if split.is_sharded:
        parameters = sum(entries[name].numel for name in plan.expected.written)
        index = {"metadata": {"total_parameters": parameters, **split.metadata}, "weight_map": split.tensor_to_filename}
        (staging / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return list(split.filename_to_tensors), total, largest


def _export_whole(plan: _ExportPlan, staging: Path, target, max_shard_size: str) -> tuple[list[str], int, int]:
    model = load_model(plan.model.config, plan.reader, plan.expected, plan.files.model)
    model.to(target)
    model.save_pretrained(staging, safe_serialization=True, max_shard_size=max_shard_size)
    shards = sorted(path.name for path in staging.glob(f"*{WEIGHTS_SUFFIX}"))
    total = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    return shards, total, total


def _written_tensors(folder: Path) -> int:
    """How many tensors the safetensors files of ``folder`` hold (read from their headers)."""
    from safetensors import safe_open

    count = 0
    for path in folder.glob(f"*{WEIGHTS_SUFFIX}"):
        with safe_open(path, "pt") as handle:
            count += len(handle.keys())
    return count


def _write_model_files(plan: _ExportPlan, staging: Path, target) -> None:
    import copy

    config = copy.deepcopy(plan.model.config)
    config.dtype = target
    config.save_pretrained(staging)
    if plan.generation_config is not None:
        plan.generation_config.save_pretrained(staging)
    if plan.tokenizer is not None:
        plan.tokenizer.save_pretrained(staging)



def verify_export(plan: _ExportPlan, folder: Path, dtype: str) -> Verification:
    """Checkpoint weights (fp32) against the exported folder loaded by ``from_pretrained``."""
    reference = load_model(plan.model.config, plan.reader, plan.expected, plan.files.model)
    return verify_models(plan.model.config, reference, from_pretrained_fp32(folder, plan.model.config), dtype)

