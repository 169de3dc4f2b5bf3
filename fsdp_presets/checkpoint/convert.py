"""Recipe checkpoint <-> Hugging Face folder, offline, in one process, without a GPU.

**Export** (:func:`export_checkpoint`): the model weights of a checkpoint (DCP shards, a full
``pytorch_model_fsdp.bin`` or a DDP ``model.safetensors``) become a folder that plain
``from_pretrained`` loads: ``config.json`` (with the written dtype), ``generation_config.json``,
the tokenizer files, and safetensors shards with ``model.safetensors.index.json`` when there is
more than one. The config and tokenizer come from the checkpoint's ``model_config/`` (the recipes
save them into every checkpoint), else from the ``model`` recorded in the run's ``run.json``, else
from ``--model``.

How it is written, and what it holds in memory: the output shards are planned from the tensor
shapes alone (``huggingface_hub.split_torch_state_dict_into_shards`` on meta tensors, the helper
``save_pretrained`` uses), tied weights are dropped by transformers' own
``remove_tied_weights_from_state_dict`` (the embedding is written once and the config says it is
tied), then each output shard is read (:mod:`fsdp_presets.checkpoint.files`: DCP reads only the
byte ranges of that shard's tensors), cast, written with ``safetensors`` and freed. Peak memory
is therefore about one output shard (``--max-shard-size``) plus the largest tensor, whatever the
model size. Models whose transformers class renames or fuses weights on load (a "weight
conversion", e.g. some mixture-of-experts models) are instead loaded whole and written by
``save_pretrained``, which reverts the conversion; the report says which path was taken.

**Import** (:func:`import_hf`): a Hugging Face folder (safetensors, or legacy
``pytorch_model.bin`` loaded with ``weights_only=True``) becomes a checkpoint folder of the
``dcp`` layout with model weights only (fp32, as the recipes train), a ``model_config/`` and a
manifest with ``"kind": "imported"``, step 0 and 0 samples: a recipe given ``--resume`` of it
loads the weights at any process count and starts with a fresh optimizer (see
:mod:`fsdp_presets.checkpoint.resume`). The import holds the model once in memory (DCP writes one state
dict in one pass).

**Verify** (:func:`verify_export`, :func:`verify_import`): both sides are loaded into the model
class and run on one fixed batch in fp32; the largest logit difference, relative to the largest
logit, must stay under :data:`VERIFY_TOLERANCE` of the written dtype.

Every input is checked before anything is written (manifest checksums, DCP shard sizes, config
digest, tensor names and shapes), and output goes to a hidden sibling folder that is renamed into
place only when complete, so a failure leaves no output.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from fsdp_presets.checkpoint.layout import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, DCP_MODEL, GENERATION_CONFIG,
                                            HF_CONFIG, MANIFEST, MODEL_CONFIG, SAFETENSORS_INDEX, SAFETENSORS_SHARDS,
                                            WEIGHTS_SUFFIX, run_json_of)
from fsdp_presets.checkpoint.files import (CheckpointFiles, DcpReader, TensorInfo, WeightReader,
                                           find_checkpoint_files, hf_weight_files, model_reader)
from fsdp_presets.errors import UsageError, disk_full_cause, disk_full_message

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# Largest max|logits_a - logits_b| / max|logits_a| that --verify accepts, by written dtype. Both
# sides run in fp32 on the same CPU, so the only difference is each weight rounded to the written
# dtype: at most 2^-p relative (unit round-off; p = 24 significand bits for fp32, 8 for bf16, 11
# for fp16; IEEE 754 / bfloat16 formats). We allow 8 such units, as `compare` allows 8 ulp in
# fp32: fp32 rounds nothing (measured difference 0), and a wrong tensor, a lost tie or a transposed
# weight moves logits by O(1). Measured bf16 exports: see docs/checkpoints.md.
VERIFY_TOLERANCE = {"fp32": 1e-6, "bf16": 8 * 2.0**-8, "fp16": 8 * 2.0**-11}
VERIFY_BATCH = (2, 16)  # sequences x tokens of the fixed batch (random token ids, seed 0)


# ---- what model a checkpoint is of ----
@dataclass(kw_only=True)
class ModelFiles:
    """The config (and tokenizer) that describe a checkpoint's model."""

    folder: Path
    """Folder with config.json (and tokenizer files, generation_config.json)."""
    origin: str
    """Where it was found: the checkpoint's model_config/, the run's run.json, or --model."""
    config: Any
    """The loaded ``PretrainedConfig``."""


def find_model_files(checkpoint: Path, model: str | None) -> ModelFiles:
    """``--model`` when given, else ``CHECKPOINT/model_config``, else the ``model`` that the run
    folder's run.json records."""
    from transformers import AutoConfig

    candidates: list[tuple[Path, str]] = []
    if model is not None:
        candidates.append((Path(model), "--model"))
    else:
        candidates.append((checkpoint / MODEL_CONFIG, f"{MODEL_CONFIG}/ inside the checkpoint"))
        run_json = run_json_of(checkpoint)
        try:
            recorded = json.loads(run_json.read_text()).get("model")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if recorded:
            candidates.append((Path(recorded), f"model in {run_json}"))
    for folder, origin in candidates:
        if (folder / HF_CONFIG).is_file():
            try:
                config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
            except Exception as error:
                raise UsageError(f"{folder / HF_CONFIG}: cannot be read as a model config ({error})") from None
            return ModelFiles(folder=folder, origin=origin, config=config)
        if origin == "--model":
            raise UsageError(f"--model {folder}: no config.json there (give the model folder the run trained)")
    raise UsageError(f"{checkpoint}: no model config found (no {MODEL_CONFIG}/config.json in the checkpoint and "
                     "no run.json naming the model); pass --model MODEL_FOLDER")


def model_class(config):
    """The transformers class named by ``config.architectures`` (the class that was trained),
    else the causal LM auto class."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise UsageError(f"model type {config.model_type!r}: its config names no transformers class "
                         "(architectures) and it has no causal LM class") from None


@dataclass(kw_only=True)
class ExpectedTensors:
    """The tensors a model of this config has, read off the model built on the meta device."""

    all: dict[str, TensorInfo]
    """Every state-dict entry (tied weights under each of their names)."""
    written: list[str]
    """The names written to a Hugging Face folder: tied duplicates removed, as save_pretrained does."""
    conversion: bool
    """True when the class converts weights on load (then save_pretrained must write them)."""


def expected_tensors(config) -> ExpectedTensors:
    import torch
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    with torch.device("meta"):
        model = model_class(config)(config)
    state = model.state_dict()
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    reverted = revert_weight_conversion(model, dict(kept))
    conversion = set(reverted) != set(kept)
    return ExpectedTensors(all={name: TensorInfo(shape=tuple(tensor.shape), dtype=tensor.dtype)
                                for name, tensor in state.items()},
                           written=list(kept), conversion=conversion)


def check_tensors(found: dict[str, TensorInfo], expected: ExpectedTensors, where: Path, model: ModelFiles) -> None:
    """The stored tensors must be the model's: every written name present, nothing unknown, shapes
    equal. All differences in one message."""
    problems = []
    missing = [name for name in expected.written if name not in found]
    unknown = [name for name in found if name not in expected.all]
    shapes = [f"{name} {list(found[name].shape)} (model: {list(expected.all[name].shape)})"
              for name in found if name in expected.all and found[name].shape != expected.all[name].shape]
    for label, names in (("missing", missing), ("not in the model", unknown), ("of another shape", shapes)):
        if names:
            problems.append(f"{len(names)} {label}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}")
    if problems:
        raise UsageError(f"{where} holds the tensors of another model than {model.folder} ({model.origin}): "
                         f"{'; '.join(problems)}; give the checkpoint of this model, or --model of its model")


# ---- output folder, written completely or not at all ----
OutputKind = Literal["export", "import"]


def _made_by(output: Path, kind: OutputKind) -> bool:
    """True when ``output`` looks like what ``kind`` writes, so ``--force`` may replace it: an
    export is a flat Hugging Face folder with config.json and safetensors weights; an import is a
    checkpoint whose manifest says ``"kind": "imported"``."""
    from fsdp_presets.checkpoint.manifest import is_imported

    if not output.is_dir() or output.is_symlink():
        return False
    if kind == "import":
        return is_imported(output)
    entries = list(output.iterdir())
    return (((output / HF_CONFIG).is_file() or (output / ADAPTER_CONFIG).is_file())  # HF or PEFT folder
            and any(entry.suffix == WEIGHTS_SUFFIX for entry in entries)
            and not any(entry.is_dir() or entry.is_symlink() for entry in entries))


def check_output(output: Path, *, kind: OutputKind = "export", force: bool = False,
                 source: Path | None = None) -> None:
    """Refuse an output that exists and is not empty (``--force`` replaces one this command
    wrote, never anything else), and an output inside the ``source`` folder it reads."""
    if source is not None:
        resolved, origin = output.resolve(), source.resolve()
        if resolved == origin or origin in resolved.parents:
            raise UsageError(f"--output {output} is inside {source}, the folder it is made from; choose a folder "
                             "outside it (nothing was written)")
    if output.is_symlink():
        raise UsageError(f"--output {output} is a symbolic link; give a real folder (nothing was written)")
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return
    made = _made_by(output, kind)
    if force and made:
        return
    what = "an export" if kind == "export" else "an imported checkpoint"
    if made:
        raise UsageError(f"--output {output} already holds {what}; pass --force to replace it, or choose a new "
                         "folder (nothing was written)")
    raise UsageError(f"--output {output} exists, is not empty and is not {what} this command wrote; choose a new "
                     f"folder (nothing was written{', and --force replaces only such a folder' if force else ''})")


@contextlib.contextmanager
def staged_folder(output: Path, *, kind: OutputKind = "export", force: bool = False) -> Iterator[Path]:
    """Yield a hidden sibling of ``output`` to write into; put it in place of ``output`` on
    success (the replaced folder, with ``force``, is renamed away first and deleted after), delete
    it on any failure."""
    check_output(output, kind=kind, force=force)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.tmp-{os.getpid()}-{time.time_ns()}")
    staging.mkdir()
    try:
        yield staging
        retired = None
        if output.exists():
            if any(output.iterdir()):
                retired = output.with_name(f".{output.name}.old-{os.getpid()}-{time.time_ns()}")
                os.rename(output, retired)
            else:
                output.rmdir()  # empty, checked above
        os.rename(staging, output)
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        shutil.rmtree(staging, ignore_errors=True)
        cause = disk_full_cause(error)
        if cause is None or isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise UsageError(disk_full_message(cause, f"writing {output}", output.parent,
                                           kept="Nothing was written (the partial folder was removed).")) from None


# ---- export ----
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
    from fsdp_presets.checkpoint.manager import checkpoint_verdict, folder_verdict
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
    tokenizer, generation_config = _tokenizer_and_generation_config(model_files, required=True)
    return _ExportPlan(files=files, reader=reader, model=model_files, expected=expected, tokenizer=tokenizer,
                       generation_config=generation_config)


def _tokenizer_and_generation_config(model_files: ModelFiles, *, required: bool):
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_files.folder, trust_remote_code=False)
    except Exception as error:
        if required:
            raise UsageError(f"{model_files.folder} ({model_files.origin}): no tokenizer can be loaded from it "
                             f"({type(error).__name__}); pass --model with the folder that has the tokenizer") from None
    generation_config = None
    if (model_files.folder / GENERATION_CONFIG).is_file():
        generation_config = GenerationConfig.from_pretrained(model_files.folder)
    elif model_class(model_files.config).can_generate():
        generation_config = GenerationConfig.from_model_config(model_files.config)
    return tokenizer, generation_config


def export_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike, *, dtype: str = "fp32",
                      max_shard_size: str = "5GB", model: str | None = None, verify: bool = False,
                      force: bool = False, log: Callable[[str], None] = print) -> ExportReport:
    """Write the Hugging Face folder ``output`` from a recipe checkpoint (see the module
    docstring). With ``verify``, the written folder is compared with the checkpoint before it is
    put in place; a failed verification leaves no output and returns the report with it."""
    import torch

    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    _check_shard_size(max_shard_size)
    output = Path(output)
    check_output(output, kind="export", force=force, source=Path(checkpoint))
    from fsdp_presets.train import lora

    if lora.is_adapter_checkpoint(checkpoint):
        return _export_adapter(Path(checkpoint), output, dtype=dtype, verify=verify, force=force, log=log)
    plan = plan_export(checkpoint, model=model)
    target = getattr(torch, DTYPES[dtype])
    written = plan.expected.written
    tied = [name for name in plan.expected.all if name not in written]
    log(f"export: {plan.files.model} ({plan.files.layout} layout, {len(written)} tensors"
        f"{f', {len(tied)} tied left out' if tied else ''}) -> {output} as {dtype}; config and tokenizer from "
        f"{plan.model.folder} ({plan.model.origin})")
    report = None
    with staged_folder(output, kind="export", force=force) as staging:
        if plan.expected.conversion:
            shards, total, largest = _export_whole(plan, staging, target, max_shard_size)
        else:
            shards, total, largest = _export_streamed(plan, staging, target, max_shard_size)
        _write_model_files(plan, staging, target)
        report = ExportReport(output=output, layout=plan.files.layout, dtype=dtype, shards=shards, tensors=len(written),
                              bytes=total, tied=tied, streamed=not plan.expected.conversion,
                              largest_shard_bytes=largest, model_files=f"{plan.model.folder} ({plan.model.origin})")
        if verify:
            report.verification = verify_export(plan, staging, dtype)
            if not report.verification.passed:
                raise _VerificationFailed(report)
    return report


def _export_adapter(checkpoint: Path, output: Path, *, dtype: str, verify: bool, force: bool,
                    log: Callable[[str], None]) -> ExportReport:
    """A LoRA checkpoint (trainable weights only) as a PEFT folder: adapter_config.json,
    adapter_model.safetensors and the tokenizer (:func:`fsdp_presets.train.lora.export_checkpoint_adapter`)."""
    from fsdp_presets.train import lora
    from fsdp_presets.checkpoint.manager import checkpoint_verdict

    if verify:
        raise UsageError(f"--verify: {checkpoint} is a LoRA checkpoint, whose export is an adapter; load it with "
                         "peft (PeftModel.from_pretrained(base, HF_DIR)) instead (nothing was written)")
    problem = checkpoint_verdict(checkpoint).problem
    if problem is not None:
        raise UsageError(f"{checkpoint}: {problem} (the checkpoint is damaged or was changed after it was saved; use "
                         "another checkpoint)")
    log(f"export: {checkpoint / lora.ADAPTER_MODEL} (LoRA adapter) -> {output} as a PEFT folder in {dtype}")
    with staged_folder(output, kind="export", force=force) as staging:
        tensors, total = lora.export_checkpoint_adapter(checkpoint, staging, dtype=dtype)
    return ExportReport(output=output, layout="adapter", dtype=dtype, shards=[ADAPTER_WEIGHTS],
                        tensors=tensors, bytes=total, tied=[], streamed=False, largest_shard_bytes=total,
                        model_files=f"{checkpoint / MODEL_CONFIG} (adapter_config.json)")


class _VerificationFailed(Exception):
    def __init__(self, report: ExportReport | "ImportReport") -> None:
        super().__init__("verification failed")
        self.report = report


def export_or_report(*args, **kwargs) -> ExportReport:
    """:func:`export_checkpoint` that returns the report of a failed verification instead of
    raising (nothing is written then)."""
    try:
        return export_checkpoint(*args, **kwargs)
    except _VerificationFailed as failed:
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
    model = _load_model(plan.model.config, plan.reader, plan.expected, plan.files.model)
    model.to(target)
    model.save_pretrained(staging, safe_serialization=True, max_shard_size=max_shard_size)
    shards = sorted(path.name for path in staging.glob(f"*{WEIGHTS_SUFFIX}"))
    total = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    return shards, total, total


def _write_model_files(plan: _ExportPlan, staging: Path, target) -> None:
    import copy

    config = copy.deepcopy(plan.model.config)
    config.dtype = target
    config.save_pretrained(staging)
    if plan.generation_config is not None:
        plan.generation_config.save_pretrained(staging)
    if plan.tokenizer is not None:
        plan.tokenizer.save_pretrained(staging)


def _load_model(config, reader: WeightReader, expected: ExpectedTensors, where: Path):
    """The model class built on CPU in fp32 with every stored tensor loaded (tied weights filled
    through their tie)."""
    import torch

    model = model_class(config)(config).to(torch.float32)
    state = reader.read(list(reader.entries()))
    result = model.load_state_dict(state, strict=False)
    missing = [name for name in result.missing_keys if name in expected.written]
    if missing or result.unexpected_keys:
        raise UsageError(f"{where}: loading into {type(model).__name__} left {missing[:4]} missing and "
                         f"{result.unexpected_keys[:4]} unexpected")
    model.tie_weights()
    return model.eval()


# ---- verify ----
@dataclass(kw_only=True)
class Verification:
    """Logits of both sides on one fixed batch."""

    max_abs_difference: float
    """max |logits_a - logits_b|."""
    max_abs_logit: float
    """max |logits_a| (the scale the difference is measured against)."""
    dtype: str
    """The written dtype whose tolerance applies."""
    tolerance: float
    """Largest accepted relative difference (:data:`VERIFY_TOLERANCE`)."""
    tied: bool | None
    """For a model with tied embeddings: whether the reloaded output embedding is the input
    embedding (None when the model ties nothing)."""

    @property
    def relative(self) -> float:
        return self.max_abs_difference / max(self.max_abs_logit, 1e-30)

    @property
    def passed(self) -> bool:
        return self.relative <= self.tolerance and self.tied is not False

    def summary(self) -> str:
        verdict = "OK" if self.passed else "FAILED"
        tie = "" if self.tied is None else ("; tied embeddings reloaded tied" if self.tied else
                                            "; tied embeddings reloaded UNTIED")
        return (f"verify {verdict}: largest logit difference {self.max_abs_difference:.3g} "
                f"({self.relative:.3g} of the largest logit {self.max_abs_logit:.3g}; {self.dtype} tolerance "
                f"{self.tolerance:.3g}){tie}")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "relative": self.relative, "passed": self.passed}


def fixed_batch(config):
    """``VERIFY_BATCH`` random token ids (seed 0) inside the vocabulary and position table."""
    import torch

    sequences, length = VERIFY_BATCH
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or length
    vocab = getattr(config, "vocab_size", None) or 2
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (sequences, min(length, positions)), generator=generator)


def _logits(model, batch):
    import torch

    with torch.no_grad():
        outputs = model(input_ids=batch)
    values = outputs.logits if getattr(outputs, "logits", None) is not None else outputs[0]
    return values.float()


def _tied(model, config) -> bool | None:
    if not getattr(config, "tie_word_embeddings", False):
        return None
    output_embeddings = model.get_output_embeddings()
    if output_embeddings is None:
        return None
    return output_embeddings.weight is model.get_input_embeddings().weight


def _compare(reference, candidate, dtype: str, tied: bool | None) -> Verification:
    return Verification(max_abs_difference=float((reference - candidate).abs().max()),
                        max_abs_logit=float(reference.abs().max()), dtype=dtype, tolerance=VERIFY_TOLERANCE[dtype],
                        tied=tied)


def _from_pretrained(folder: Path, config):
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return model_class(config).from_pretrained(folder, dtype=torch.float32).eval()


def verify_export(plan: _ExportPlan, folder: Path, dtype: str) -> Verification:
    """Checkpoint weights (fp32) against the exported folder loaded by ``from_pretrained``."""
    batch = fixed_batch(plan.model.config)
    reference = _logits(_load_model(plan.model.config, plan.reader, plan.expected, plan.files.model), batch)
    exported = _from_pretrained(folder, plan.model.config)
    return _compare(reference, _logits(exported, batch), dtype, _tied(exported, plan.model.config))


def verify_import(hf_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> Verification:
    """The Hugging Face folder loaded by ``from_pretrained`` against the imported DCP weights."""
    from transformers import AutoConfig

    hf_dir, checkpoint = Path(hf_dir), Path(checkpoint)
    config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
    batch = fixed_batch(config)
    reference = _logits(_from_pretrained(hf_dir, config), batch)
    imported = _load_model(config, DcpReader(checkpoint / DCP_MODEL), expected_tensors(config), checkpoint / DCP_MODEL)
    return _compare(reference, _logits(imported, batch), "fp32", _tied(imported, config))


# ---- import ----
@dataclass(kw_only=True)
class ImportReport:
    """What an import wrote."""

    output: Path
    """The checkpoint folder."""
    source_files: list[str]
    """Weight files read."""
    tensors: int
    """State-dict entries written (tied weights under each name, as the recipes save them)."""
    bytes: int
    """Bytes of tensor data (fp32)."""
    tokenizer: bool
    """Whether a tokenizer was found and copied into model_config/."""
    verification: Verification | None = None
    """The --verify result, when asked."""
    notes: list[str] = field(default_factory=list)
    """What the user must know (fresh optimizer, step 0)."""


def import_hf(hf_dir: str | os.PathLike, output: str | os.PathLike, *, verify: bool = False,
              force: bool = False, log: Callable[[str], None] = print) -> ImportReport:
    """Write checkpoint ``output`` (DCP, weights only, step 0) from Hugging Face folder ``hf_dir``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from fsdp_presets.checkpoint.files import SafetensorsReader, TorchFileReader
    from fsdp_presets.checkpoint.manifest import IMPORTED_KIND, Manifest
    from fsdp_presets.fileio import config_digest, sha256_file, write_json_atomic

    hf_dir, output = Path(hf_dir), Path(output)
    if not (hf_dir / HF_CONFIG).is_file():
        raise UsageError(f"{hf_dir}: no {HF_CONFIG} (give a Hugging Face model folder)")
    check_output(output, kind="import", force=force, source=hf_dir)
    weight_files = hf_weight_files(hf_dir)
    for file in weight_files:  # open each file before anything else: a damaged one is named here
        SafetensorsReader([file]) if file.suffix == WEIGHTS_SUFFIX else TorchFileReader(file)
    config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
    model_files = ModelFiles(folder=hf_dir, origin="the imported folder", config=config)
    tokenizer, generation_config = _tokenizer_and_generation_config(model_files, required=False)
    hf_logging.disable_progress_bar()
    try:
        model, info = model_class(config).from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
    except Exception as error:
        raise UsageError(f"{hf_dir}: transformers cannot load it ({type(error).__name__}: "
                         f"{str(error).strip().splitlines()[0][:300] if str(error).strip() else ''})") from None
    problems = [f"{label}: {', '.join(map(str, names[:4]))}" for label, names in
                (("missing", info.get("missing_keys") or []), ("unexpected", info.get("unexpected_keys") or []),
                 ("of another shape", info.get("mismatched_keys") or [])) if names]
    if problems:
        raise UsageError(f"{hf_dir}: its weights do not fit {type(model).__name__} ({'; '.join(problems)}); "
                         "nothing was written")
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    log(f"import: {hf_dir} ({', '.join(file.name for file in weight_files)}) -> {output}: "
        f"{len(state)} tensors, fp32, DCP")
    with staged_folder(output, kind="import", force=force) as staging:
        with _quiet_single_process_warning():
            dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(str(staging / DCP_MODEL)), no_dist=True)
        describe = staging / MODEL_CONFIG
        config.save_pretrained(describe)
        if generation_config is not None:
            generation_config.save_pretrained(describe)
        if tokenizer is not None:
            tokenizer.save_pretrained(describe)
        files = {str(path.relative_to(staging)): {"sha256": sha256_file(path), "bytes": path.stat().st_size}
                 for path in sorted(staging.rglob("*")) if path.is_file()}
        manifest = Manifest(step=0, samples_consumed=0, world_size=1, distributed_type="NO", fsdp=None,
                            config_digest=config_digest(config), files=files,
                            versions={"torch": torch.__version__}, created_unix=time.time(), kind=IMPORTED_KIND,
                            source=str(hf_dir.resolve()),
                            contents="model weights only (fp32): no optimizer, scheduler or RNG state; a run resumed "
                                     "from it starts at step 0 with a fresh optimizer")
        write_json_atomic(staging / MANIFEST, asdict(manifest))
        report = ImportReport(output=output, source_files=[file.name for file in weight_files], tensors=len(state),
                              bytes=sum(tensor.numel() * tensor.element_size() for tensor in state.values()),
                              tokenizer=tokenizer is not None,
                              notes=["step 0, 0 samples: a run resumed from it starts training from the beginning "
                                     "of the data with a fresh optimizer and learning-rate schedule",
                                     "loads at any process count (DCP reshards), under FSDP2, FSDP1, DDP or one "
                                     "process: pass it as --resume to a recipe with the same --model config"])
        del model, state
        if verify:
            report.verification = verify_import(hf_dir, staging)
            if not report.verification.passed:
                raise _VerificationFailed(report)
    return report


def import_or_report(*args, **kwargs) -> ImportReport:
    """:func:`import_hf` that returns the report of a failed verification instead of raising."""
    try:
        return import_hf(*args, **kwargs)
    except _VerificationFailed as failed:
        return failed.report


@contextlib.contextmanager
def _quiet_single_process_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield
