"""Output folders of ``export`` and ``import``: refused when they hold anything this command did not
write, written under a hidden sibling name and renamed into place only when complete."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Literal

from fsdp_presets.checkpoint.layout import EXPORT_RECORD, retired_sibling, staging_sibling
from fsdp_presets.errors import UsageError, disk_full_cause, disk_full_message
from fsdp_presets import fileio

OutputKind = Literal["export", "import"]


def _made_by(output: Path, kind: OutputKind) -> bool:
    """True when ``output`` is what ``kind`` writes, so ``--force`` may replace it: an export is a
    folder with the export's record of its files and only those (a model folder that merely looks
    like one is not); an import is a checkpoint whose manifest says ``"kind": "imported"``."""
    from fsdp_presets.checkpoint.export_files import is_export_folder
    from fsdp_presets.checkpoint.manifest import is_imported

    if not output.is_dir() or output.is_symlink():
        return False
    if kind == "import":
        return is_imported(output)
    return is_export_folder(output)


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
    mark = f"no {EXPORT_RECORD} listing its files" if kind == "export" else "its manifest is not an import's"
    raise UsageError(f"--output {output} exists, is not empty and was not written by fsdp-presets {kind} ({mark}); "
                     f"choose a new folder (nothing was written{', and --force replaces only such a folder' if force else ''})")


@contextlib.contextmanager
def staged_output(output: Path, *, kind: OutputKind = "export", force: bool = False) -> Iterator[Path]:
    """Yield a hidden sibling of ``output`` to write into; put it in place of ``output`` on
    success (the replaced folder, with ``force``, is renamed away first and deleted after), delete
    it on any failure; a full disk is one :class:`UsageError` naming the folder."""
    check_output(output, kind=kind, force=force)
    try:
        with fileio.staged_folder(output, staging=staging_sibling(output),
                            retired=lambda: retired_sibling(output)) as staging:
            yield staging
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        cause = disk_full_cause(error)
        if cause is None or isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise UsageError(disk_full_message(cause, f"writing {output}", output.parent,
                                           kept="Nothing was written (the partial folder was removed).",
                                           smaller_files="lower --max-shard-size" if kind == "export" else "")) from None
