"""Generated sections of a markdown document, between HTML-comment markers, so that several
scripts can each rewrite their own part of one file (``docs/benchmarks.md``: the CPU benchmark,
the fault campaign, the GPU benchmark) without touching the others'::

    <!-- fault-campaign:start -->
    ...written by scripts/fault_campaign.py...
    <!-- fault-campaign:end -->
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of section ``name``."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def wrap(name: str, body: str) -> str:
    """``body`` between the markers of section ``name`` (ends with a newline)."""
    start, end = markers(name)
    return f"{start}\n{body.strip()}\n{end}\n"


def find(document: str, name: str) -> str | None:
    """Section ``name`` of ``document``, markers included, or None when it has none."""
    start, end = markers(name)
    if start not in document or end not in document.split(start, 1)[1]:
        return None
    return start + document.split(start, 1)[1].split(end, 1)[0] + end + "\n"


def names(document: str) -> list[str]:
    """The names of the sections ``document`` holds, in order."""
    return [name for name in re.findall(r"^<!-- (\S+):start -->$", document, flags=re.M) if find(document, name)]


def replace(document: str, name: str, section: str) -> str:
    """``document`` with section ``name`` replaced by ``section`` (appended when absent)."""
    start, end = markers(name)
    if find(document, name) is None:
        return document.rstrip("\n") + "\n\n" + section
    head, rest = document.split(start, 1)
    tail = rest.split(end, 1)[1].lstrip("\n")
    return head + section + ("\n" + tail if tail else "")


def replace_in_file(path: str | os.PathLike, name: str, section: str, *, title: str = "# Benchmarks") -> Path:
    """Rewrite section ``name`` of the file at ``path`` (created with ``title`` when missing)."""
    path = Path(path)
    document = path.read_text() if path.is_file() else title + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(replace(document, name, section))
    return path
