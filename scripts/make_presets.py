"""Regenerate the checked-in presets in accelerate_configs/ (tests/test_presets.py compares).

    python scripts/make_presets.py                       # rewrite accelerate_configs/
    python scripts/make_presets.py --output-dir /tmp/x   # write elsewhere (headers still say accelerate_configs/)

Each file is exactly what its header's ``fsdp-presets generate`` command writes when run from the
repository root. The list below is the whole catalogue: popular families at 1 x 8, 2 x 8 (HSDP)
and 4 x 8 GPUs of 80 GiB with their DDP baselines, and the CPU demo pair the recipes' docs use.
Model shapes come from model_configs/ (sources in model_configs/README.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_presets.train.loop import RECIPE_SEQ_LEN

REPO = Path(__file__).resolve().parent.parent

CONFIG_FOLDER = "accelerate_configs"
"""Where the files live, as the headers name them (relative to the repository root)."""
SHAPES = ((8, 1), (16, 2), (32, 4))
"""(GPUs, nodes): one 8-GPU node, two (HSDP), four."""
GPU_FAMILIES = {
    # name (file prefix): extra request settings
    "llama-3.1-8b": {},
    "mistral-7b-v0.3": {},
    "qwen2.5-7b": {},
    "gemma-2-9b": {},
    "phi-3-mini-4k": {},
    "mixtral-8x7b": {},
    # 70B on one node needs CPU offload: its offloaded states (1051 GiB) need a 2 TiB node such as
    # an NVIDIA DGX H100, more than the 1 TiB default.
    "llama-3.1-70b": {"host_memory_gib": 2048.0},
}
TRAINING = {"seq_len": 4096, "global_batch": "1M"}
"""4096-token sequences, 1M tokens (256 sequences) per optimizer step: one batch for every shape,
so rescaling between the shipped files keeps the training the same."""


@dataclass(frozen=True, kw_only=True)
class PresetFile:
    """One generated FSDP config (and its DDP baseline)."""

    name: str
    """File name in accelerate_configs/."""
    model: str
    """Model source, relative to the repository root."""
    request: dict
    """PresetRequest settings besides the model."""
    baseline: str
    """File name of the DDP baseline."""
    launch: dict = field(default_factory=dict)
    """LaunchHints for the header's launch command."""


def catalogue() -> list[PresetFile]:
    files = []
    for family, extra in GPU_FAMILIES.items():
        for gpus, nodes in SHAPES:
            name = f"{family}_{nodes}x{gpus // nodes}"
            request = {"gpus": gpus, **({"nodes": nodes} if nodes > 1 else {}), **extra, **TRAINING}
            files.append(PresetFile(name=f"{name}.yaml", model=f"model_configs/{family}", request=request,
                                    baseline=f"{name}.ddp.yaml"))
    # The CPU demo: SmolLM2-135M (a Llama) on 2 processes in fp32, the recipe's default batch
    # split (micro-batch 2, no accumulation) and sequence length.
    files.append(PresetFile(
        name="cpu_fsdp2_demo.yaml", model="model_configs/smollm2-135m",
        request={"gpus": 2, "device": "cpu", "seq_len": RECIPE_SEQ_LEN, "global_batch": "4"},
        baseline="cpu_ddp_demo.yaml",
        launch={"model": "runs/models/smollm2-135m-instruct", "data": "data/kjv_sft/train.jsonl"},
    ))
    return files


def render_all() -> dict[str, str]:
    """``{file name: text}`` for the whole catalogue (nothing written)."""
    from fsdp_presets.check.lint import check_generated
    from fsdp_presets.preset.emit_commands import LaunchHints
    from fsdp_presets.preset.generate import load_profile, render_files
    from fsdp_presets.preset.request import PresetRequest

    cwd = os.getcwd()
    os.chdir(REPO)  # model sources are relative to the repository root, as in the headers
    try:
        profiles: dict = {}
        texts: dict[str, str] = {}
        for preset_file in catalogue():
            if preset_file.model not in profiles:
                profiles[preset_file.model] = load_profile(preset_file.model)
            request = PresetRequest(model=preset_file.model, **preset_file.request)
            rendered, _ = render_files(
                profiles[preset_file.model], request, output=f"{CONFIG_FOLDER}/{preset_file.name}",
                baseline_output=f"{CONFIG_FOLDER}/{preset_file.baseline}", launch=LaunchHints(**preset_file.launch))
            check_generated(rendered, device=request.device)
            texts.update({Path(path).name: text for path, text in rendered.items()})
        return texts
    finally:
        os.chdir(cwd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=str(REPO / CONFIG_FOLDER), help="where to write (default accelerate_configs/)")
    args = parser.parse_args(argv)
    from fsdp_presets.preset.generate import write_files

    output = Path(args.output_dir)
    texts = render_all()
    write_files({output / name: text for name, text in texts.items()})
    stale = sorted(path.name for path in output.glob("*.yaml") if path.name not in texts)
    print(f"wrote {len(texts)} files to {output}")
    if stale:
        print(f"not in the catalogue (remove them or add them to scripts/make_presets.py): {', '.join(stale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
