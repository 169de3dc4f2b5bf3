"""The Hugging Face side of export and import: which model a checkpoint is of (config and
tokenizer), the tensors a model of that config has, loading weights into its class, and the
``--verify`` comparison of two models' logits on one fixed batch."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fsdp_presets.checkpoint.files import TensorInfo, WeightReader
from fsdp_presets.checkpoint.layout import GENERATION_CONFIG, HF_CONFIG, MODEL_CONFIG, run_json_of
from fsdp_presets.checkpoint.run_folder import RunInfo, run_info_of
from fsdp_presets.errors import UsageError

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


READ_WHOLE_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
"""Files of a model folder that transformers' config, generation-config and tokenizer loaders read
whole into memory (configs, ``tokenizer.json``, vocabularies and merges, chat templates,
sentencepiece and tiktoken models). Weights are read by their own bounded readers."""


def refuse_oversized_model_files(folder: Path) -> None:
    """Refuse, before transformers reads any of them, a model folder whose ``config.json`` holds more
    than :data:`~fsdp_presets.fileio.CONFIG_MAX_BYTES` or whose other :data:`READ_WHOLE_SUFFIXES`
    files hold more than :data:`~fsdp_presets.fileio.MODEL_FILE_MAX_BYTES` (a sparse 20 GB
    ``tokenizer.json`` takes a few bytes on disk and all of memory once read)."""
    from fsdp_presets.fileio import CONFIG_MAX_BYTES, MODEL_FILE_MAX_BYTES, format_bytes

    for directory, _, names in os.walk(folder):
        for name in sorted(names):
            path = Path(directory) / name
            if path.suffix not in READ_WHOLE_SUFFIXES or not path.is_file():
                continue
            limit = CONFIG_MAX_BYTES if path == folder / HF_CONFIG else MODEL_FILE_MAX_BYTES
            size = path.stat().st_size
            if size > limit:
                raise UsageError(f"{path} holds {format_bytes(size)}, more than the {format_bytes(limit)} a model "
                                 "folder's text files may hold; nothing was written")


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
        recorded = (run_info_of(checkpoint) or RunInfo()).model
        if recorded:
            candidates.append((Path(recorded), f"model in {run_json}"))
    for folder, origin in candidates:
        if (folder / HF_CONFIG).is_file():
            refuse_oversized_model_files(folder)
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


def tokenizer_and_generation_config(model_files: ModelFiles, *, required: bool):
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


def load_model(config, reader: WeightReader, expected: ExpectedTensors, where: Path):
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


def from_pretrained_fp32(folder: Path, config):
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return model_class(config).from_pretrained(folder, dtype=torch.float32, use_kernels=False).eval()


def report_json(report) -> dict[str, Any]:
    """An export or import report as JSON: every field (the output folder as text), the
    verification's JSON, and ``written`` (False when a failed verification left no output)."""
    verification = report.verification
    payload = {key: (str(value) if key == "output" else value) for key, value in vars(report).items()
               if key != "verification"}
    payload["verification"] = verification.to_json() if verification else None
    payload["written"] = verification is None or verification.passed
    return payload


def verify_models(config, reference, candidate, dtype: str) -> Verification:
    """``reference`` and ``candidate`` (models of ``config``) on :func:`fixed_batch`; ``tied`` is
    the candidate's."""
    batch = fixed_batch(config)
    return _compare(_logits(reference, batch), _logits(candidate, batch), dtype, _tied(candidate, config))


class VerificationFailed(Exception):
    def __init__(self, report: Any) -> None:
        super().__init__("verification failed")
        self.report = report

