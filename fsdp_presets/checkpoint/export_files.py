"""What an export folder may hold: only the files ``export`` wrote, each from parsed data.

A checkpoint comes from elsewhere, and its ``model_config/`` may hold an attacker's
``tokenization_evil.py`` and an ``auto_map`` naming it (transformers imports that file for whoever
loads the folder with ``trust_remote_code=True``). An export writes its config, tokenizer and
adapter config through the libraries' own serializers (never a copy of a file), and then
:func:`finish_export_folder`:

- drops the code references of every JSON file it wrote (:data:`CODE_REFERENCE_KEYS`: ``auto_map``,
  ``custom_pipelines``, PEFT's ``auto_mapping``) unless the user asks to keep them, and says so;
- removes any Python file (an export never writes one);
- records the files it wrote in :data:`~fsdp_presets.checkpoint.layout.EXPORT_RECORD`, which is
  what lets ``--force`` replace the folder later (:func:`is_export_folder`), and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from fsdp_presets.checkpoint.layout import EXPORT_RECORD
from fsdp_presets.fileio import CONFIG_MAX_BYTES, MODEL_FILE_MAX_BYTES, read_regular_text, write_json_atomic

CODE_REFERENCE_KEYS = ("auto_map", "custom_pipelines", "auto_mapping")
"""Keys of a Hugging Face JSON file that name Python code to import (transformers' ``auto_map``
and ``custom_pipelines``, PEFT's ``auto_mapping``)."""
WRITTEN_BY = "fsdp-presets export"


def finish_export_folder(folder: Path, *, keep_code_references: bool, log: Callable[[str], None]) -> None:
    """Make the staged export ``folder`` hold only data (see the module docstring) and record its files."""
    for path in sorted(folder.glob("*.py")):
        path.unlink()
        log(f"export: left out {path.name}: an export holds no code")
    if not keep_code_references:
        for path in sorted(folder.glob("*.json")):  # every one: a large file may carry the key as well
            document = json.loads(read_regular_text(path, limit=MODEL_FILE_MAX_BYTES))
            dropped = [key for key in CODE_REFERENCE_KEYS if isinstance(document, dict) and key in document]
            if dropped:
                for key in dropped:
                    del document[key]
                write_json_atomic(path, document)
                log(f"export: dropped {', '.join(dropped)} from {path.name}: it names Python code, which an "
                    "export does not carry (--keep-code-references keeps it)")
    files = sorted(path.name for path in folder.iterdir())
    write_json_atomic(folder / EXPORT_RECORD, {"written_by": WRITTEN_BY, "files": files})


def is_export_folder(folder: Path) -> bool:
    """True when ``folder`` holds an :data:`EXPORT_RECORD` of an export and only the files it lists
    (plain files, no folder or link): what ``export --force`` may replace."""
    record = folder / EXPORT_RECORD
    try:
        document = json.loads(read_regular_text(record, limit=CONFIG_MAX_BYTES))
        listed = set(document["files"]) | {EXPORT_RECORD}
        if document.get("written_by") != WRITTEN_BY:
            return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    entries = list(folder.iterdir())
    return all(entry.name in listed and entry.is_file() and not entry.is_symlink() for entry in entries)
