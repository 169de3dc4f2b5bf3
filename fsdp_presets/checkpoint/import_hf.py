"""``fsdp-presets import``: a Hugging Face folder as a checkpoint the recipes resume from (see
:mod:`fsdp_presets.checkpoint`)."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from fsdp_presets.checkpoint.files import DcpReader, hf_weight_files
from fsdp_presets.checkpoint.hf_model import (ModelFiles, Verification, VerificationFailed, expected_tensors,
                                              from_pretrained_fp32, load_model, model_class,
                                              refuse_oversized_model_files, tokenizer_and_generation_config,
                                              verify_models)
from fsdp_presets.checkpoint.layout import DCP_MODEL, HF_CONFIG, MANIFEST, MODEL_CONFIG, WEIGHTS_SUFFIX
from fsdp_presets.checkpoint.outputs import check_output, staged_output
from fsdp_presets.errors import UsageError


def verify_import(hf_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> Verification:
    """The Hugging Face folder loaded by ``from_pretrained`` against the imported DCP weights."""
    from transformers import AutoConfig

    hf_dir, checkpoint = Path(hf_dir), Path(checkpoint)
    config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
    reference = from_pretrained_fp32(hf_dir, config)
    imported = load_model(config, DcpReader(checkpoint / DCP_MODEL), expected_tensors(config), checkpoint / DCP_MODEL)
    return verify_models(config, reference, imported, "fp32")


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
    from fsdp_presets.fileio import config_digest, printable, sha256_file, write_json_atomic

    hf_dir, output = Path(hf_dir), Path(output)
    refuse_links_out(hf_dir)  # first: a config.json linked to /dev/zero is named as the link it is
    if not (hf_dir / HF_CONFIG).is_file():
        raise UsageError(f"{hf_dir}: no {HF_CONFIG} (give a Hugging Face model folder)")
    refuse_oversized_model_files(hf_dir)
    check_output(output, kind="import", force=force, source=hf_dir)
    weight_files = hf_weight_files(hf_dir)
    for file in weight_files:  # open each file before anything else: a damaged one is named here
        SafetensorsReader([file]) if file.suffix == WEIGHTS_SUFFIX else TorchFileReader(file)
    try:
        config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
    except Exception as error:  # truncated JSON, an unknown model_type, a value of the wrong type
        raise UsageError(f"{hf_dir / HF_CONFIG}: cannot be read as a model config ({type(error).__name__}: "
                         f"{' '.join(str(error).split())[:300]}); nothing was written") from None
    model_files = ModelFiles(folder=hf_dir, origin="the imported folder", config=config)
    tokenizer, generation_config = tokenizer_and_generation_config(model_files, required=False)
    hf_logging.disable_progress_bar()
    try:
        model, info = model_class(config).from_pretrained(hf_dir, dtype=torch.float32, use_kernels=False,
                                                          output_loading_info=True)
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
    log(f"import: {hf_dir} ({', '.join(printable(file.name) for file in weight_files)}) -> {output}: "
        f"{len(state)} tensors, fp32, DCP")
    with staged_output(output, kind="import", force=force) as staging:
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
                raise VerificationFailed(report)
    return report


def refuse_links_out(hf_dir: Path) -> None:
    """Refuse a model folder with a symbolic link that resolves outside it, or an entry that is not
    a regular file or folder (a FIFO, a device): import reads every file it finds, and what it
    reads reaches the checkpoint and the next export. Links inside the folder are fine, and so are
    those of a Hugging Face cache (``models--ORG--NAME/snapshots/REV/x`` -> ``../../blobs/HASH``
    of the same cache)."""
    import stat

    root = hf_dir.resolve()
    allowed = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        allowed.append(root.parent.parent / "blobs")
    for directory, folders, names in os.walk(hf_dir):
        for name in folders + names:
            path = Path(directory) / name
            target = path.resolve()
            if path.is_symlink() and not any(target == base or base in target.parents for base in allowed):
                raise UsageError(f"{path} is a symbolic link to {target}, outside {hf_dir}; import reads only files "
                                 "of the model folder (copy the file in, or drop the link); nothing was written")
            try:
                mode = os.stat(path).st_mode
            except OSError as error:
                raise UsageError(f"{path}: cannot be read ({error.strerror}); nothing was written") from None
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise UsageError(f"{path} is not a regular file; a model folder holds only files and folders "
                                 "(nothing was written)")


def import_or_report(*args, **kwargs) -> ImportReport:
    """:func:`import_hf` that returns the report of a failed verification instead of raising."""
    try:
        return import_hf(*args, **kwargs)
    except VerificationFailed as failed:
        return failed.report


@contextlib.contextmanager
def _quiet_single_process_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield
