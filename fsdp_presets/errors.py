"""What the user is told: errors that mean "the user asked for something that cannot be done" (the
CLI prints them as one line and exits with status 2, never with a traceback), and notes from the
first process of a launch (:func:`note`)."""


class UsageError(Exception):
    """Bad input: the message names the problem and, where there is one, the fix."""


def closest_names(name: str, known: list[str] | tuple[str, ...], limit: int = 3) -> list[str]:
    """The known names closest to ``name``, best first (for "did you mean ...?")."""
    import difflib

    return difflib.get_close_matches(name, list(known), n=limit, cutoff=0.5)


def unknown_name_message(kind: str, name: str, known: list[str] | tuple[str, ...]) -> str:
    """``unknown family 'lama'; did you mean 'llama'? known: ...``"""
    guesses = closest_names(name, known)
    hint = f"; did you mean {' or '.join(repr(g) for g in guesses)}?" if guesses else ""
    return f"unknown {kind} {name!r}{hint} known: {', '.join(sorted(known))}"


def note(message: str, *, stream=None) -> None:
    """``note: MESSAGE`` for the user, from the first process of a launch only (``RANK`` 0, or no
    launcher), on ``stream`` (standard output unless given)."""
    import os
    import sys

    if os.environ.get("RANK", "0") == "0":
        print(f"note: {message}", file=stream or sys.stdout, flush=True)


# NOTE: torchrun stops every rank as soon as one exits non-zero, so a rank that leaves first can cut
# the main process off before it prints the message; the others leave this long after it.
COLLECTIVE_EXIT_DELAY_S = 2.0


def raise_on_every_rank(accelerator, message: str | BaseException | None, *,
                        error: type[Exception] | None = None, printed_elsewhere: bool = False) -> None:
    """The one way a run stops on every rank together: raise ``error`` (:class:`UsageError` unless
    given, e.g. :class:`Finding`) with ``message`` (already the same on every rank), or ``message``
    itself when it is an exception, when it is not None: at once on the main process, which prints
    it, :data:`COLLECTIVE_EXIT_DELAY_S` later on the others (on every rank with
    ``printed_elsewhere``: another rank prints it)."""
    if not isinstance(message, BaseException) and not message:  # None, "" or False: nothing to raise
        return
    if printed_elsewhere or not accelerator.is_main_process:
        import time

        time.sleep(COLLECTIVE_EXIT_DELAY_S)
    if isinstance(message, BaseException):
        raise message
    raise (error or UsageError)(message)


class Finding(Exception):
    """Something found about the run itself (the loss diverged, the disk is full): the recipes
    print it as one line and exit with status 1."""


def rank_local(error: Exception, *, print_here: bool) -> Exception:
    """Mark ``error`` as this rank's own: the recipes print it on this rank when ``print_here``
    (a problem only this rank has), and not at all when it is false (a rank that stops because
    another one reported a problem). Unmarked errors are printed by the main process only."""
    error.print_on_this_rank = print_here
    return error


# ---- disk full ----
# ENOSPC, EDQUOT, and the two other ways a file system refuses a write: EFBIG (a file past the
# process's `ulimit -f` or the file system's largest file) and EROFS (Linux errno numbers).
_DISK_FULL_ERRNOS = (28, 122, 27, 30)
_DISK_FULL_TEXT = ("No space left on device", "os error 28", "StorageFull", "Disk quota exceeded",
                   "File too large", "os error 27", "code: 27", "FileTooLarge",
                   "Read-only file system", "os error 30", "code: 30", "ReadOnlyFilesystem")
# torch.save to a path (accelerate's optimizer.bin, scheduler.bin, random states, DCP's shards)
# writes through its own C++ stream, which reports a full disk as a failed position check ("[enforce
# fail at inline_container.cc] unexpected pos 576 vs 534"), never as ENOSPC or EFBIG: read as a full
# disk only when the file system written to has (almost) no space left, and as a file past the size
# limit only when this process has one (ulimit -f) and a file written there has reached it.
_TORCH_WRITER_TEXT = ("unexpected pos", "PytorchStreamWriter failed", "basic_ios::clear")
_NEARLY_FULL_BYTES = 1 << 20


def _nearly_full(where) -> bool:
    import shutil
    from pathlib import Path

    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free < _NEARLY_FULL_BYTES
    except OSError:
        return False


def _file_size_limited(where) -> OSError | None:
    """An EFBIG when this process has a file-size limit (``ulimit -f``), naming the file under
    ``where`` that reached it if it is still there (another rank may have removed the folder
    already), or None when there is no limit."""
    import errno
    import resource
    from pathlib import Path

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        at_limit = next((path for path in Path(where).rglob("*") if path.is_file() and path.stat().st_size >= limit),
                        None)
    except OSError:
        at_limit = None
    return OSError(errno.EFBIG, "File too large", str(at_limit) if at_limit else None)


def disk_full_cause(error: BaseException | None, where=None) -> BaseException | None:
    """The ENOSPC (or EDQUOT, EFBIG, EROFS) error behind ``error``, or None: found through ``__cause__`` and
    ``__context__``, DCP's ``CheckpointException`` (the failures of every rank) and the messages of
    writers that do not raise ``OSError`` (safetensors: ``IoError(... code: 28, kind: StorageFull``;
    torch.save's stream, when the file system of ``where`` is full)."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_FULL_ERRNOS:
            return current
        if any(text in str(current) for text in _DISK_FULL_TEXT) and not str(current).startswith("CheckpointException"):
            return current
        if where is not None and any(text in str(current) for text in _TORCH_WRITER_TEXT):
            if _nearly_full(where):
                return current
            at_limit = _file_size_limited(where)
            if at_limit is not None:
                return at_limit
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):  # torch.distributed.checkpoint.api.CheckpointException
            for wrapped in failures.values():
                pending.append(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
        pending += [current.__cause__, current.__context__]
    return None


def refused_write_class(message: str) -> type[Exception]:
    """The error class of a write the file system refused, from its :func:`disk_full_message`: a
    read-only target or a file-size limit is a setting to change before running again
    (:class:`UsageError`, exit 2, as a bad flag is); a full disk or quota is what the run met on the
    way (:class:`Finding`, exit 1)."""
    return UsageError if message.startswith(("file too large (EFBIG)", "read-only file system (EROFS)")) else Finding


def disk_full_message(cause: BaseException, what: str, where, *, kept: str = "", smaller_files: str = "") -> str:
    """One line: the disk is full, while doing ``what`` in ``where``, what was kept, and the fix
    (``smaller_files``: how the command that wrote can write smaller files, for EFBIG)."""
    path = getattr(cause, "filename", None)
    written = f" (writing {path})" if path else ""
    text = str(cause)
    if getattr(cause, "errno", None) == 27 or any(part in text for part in _DISK_FULL_TEXT[4:8]):
        return (f"file too large (EFBIG) while {what} in {where}{written}: a file passed the size limit of this "
                f"process (ulimit -f) or of that file system. {kept + ' ' if kept else ''}Raise the limit (ulimit -f "
                f"unlimited){', ' + smaller_files if smaller_files else ''}, or write to another file system, then run "
                "the same command again")
    if getattr(cause, "errno", None) == 30 or any(part in text for part in _DISK_FULL_TEXT[8:]):
        return (f"read-only file system (EROFS) while {what} in {where}{written}. {kept + ' ' if kept else ''}Give "
                "an output folder on a writable file system, then run the same command again")
    return (f"disk full (ENOSPC) while {what} in {where}{written}: no space left on that file system. "
            f"{kept + ' ' if kept else ''}Free space there (delete old runs or checkpoints, lower --keep-last) "
            "or give an --output-dir on a larger disk, then run the same command again")
