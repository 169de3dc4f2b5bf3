"""The background writer's shard files: written past the page cache and hashed as they are written.

DCP's ``FileSystemWriter`` writes each rank's shards as ``__R_N.distcp`` files through its file
system's ``create_stream``. :class:`HashingFileSystem` gives it, for those files, a
:class:`DirectFile`, which

- hashes the bytes on their way to the file (SHA-256, the manifest's digest), so the commit does not
  read the rank's shards back to hash them;
- writes them with ``O_DIRECT`` where the file system takes it: from a page-aligned buffer
  straight to the device, so the write neither fills the page cache (fresh pages the kernel
  must find, zero and later write back, in the kernel's time taken from training) nor evicts the
  training's memory. Where ``O_DIRECT`` is refused (some file systems do) the same bytes go
  through the page cache, as DCP's own writer does.

Every large copy, digest and write runs in a call that releases the GIL: the writer thread runs
at the lowest priority and must not hold the lock training needs while the scheduler leaves it
waiting. The file is complete, truncated to its exact size and fsynced when ``close()`` returns (DCP
calls it inside ``create_stream``); only then is its digest recorded (:attr:`HashingFileSystem.digests`).

Imports torch: import it where the background writer starts, not at start-up.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from fsdp_presets.checkpoint.layout import DCP_RANK_FILE

ALIGNMENT = 4096
"""``O_DIRECT`` writes start at, and are sized in, multiples of this (the page size; every Linux
block device's logical block divides it)."""
CHUNK_BYTES = 8 << 20
"""One write: the aligned buffer's size (a multiple of :data:`ALIGNMENT`)."""


def _address(view: memoryview) -> int:
    """The address of a contiguous byte view's first byte (read-only views too: torch's zip writer
    hands the tensor's own memory over read-only, which ctypes cannot take). numpy is installed
    wherever transformers is (one of its requirements)."""
    import numpy

    return numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data


class DirectFile:
    """A write-only file (DCP's stream for one ``.distcp`` file) that hashes what it writes and
    writes whole aligned chunks with ``O_DIRECT`` where it can."""

    def __init__(self, path: Path):
        self.path = path
        # Through the built-in open, as every other checkpoint writer: a full-disk drill's /dev/full
        # (fsdp_presets.faults) reaches this file too.
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 (closed by close())
        self._buffer = mmap.mmap(-1, CHUNK_BYTES)  # page-aligned
        self._buffer_address = ctypes.addressof(ctypes.c_char.from_buffer(self._buffer))
        self._filled = 0
        self._written = 0
        self._hasher = hashlib.sha256()
        self._direct = _set_direct(self._file.fileno(), True)
        self.closed = False

    # ---- what DCP and torch.save call ----
    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size, done = len(view), 0
        source = _address(view) if size else 0
        while done < size:
            take = min(CHUNK_BYTES - self._filled, size - done)
            ctypes.memmove(self._buffer_address + self._filled, source + done, take)  # releases the GIL
            self._filled += take
            done += take
            if self._filled == CHUNK_BYTES:
                self._drain(CHUNK_BYTES)
        return size

    def tell(self) -> int:
        return self._written + self._filled

    def flush(self) -> None:
        """Through the page cache: write what is buffered, as any file does. With ``O_DIRECT``
        nothing: the bytes reach the file a whole chunk at a time, the rest at :meth:`close`."""
        if not self._direct and self._filled:
            self._drain(self._filled)

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        """Write what is left, cut the file to its exact size and fsync it. Idempotent."""
        if self.closed:
            return
        try:
            tail = self._filled
            if tail:
                self._drain(-(-tail // ALIGNMENT) * ALIGNMENT if self._direct else tail, keep=tail)
                if self._direct:
                    os.ftruncate(self._file.fileno(), self._written)
            os.fsync(self._file.fileno())
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Close without finishing (the write failed; the folder is removed by the caller)."""
        self.closed = True
        self._file.close()
        self._buffer.close()

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()

    @property
    def size(self) -> int:
        return self._written

    # ---- internals ----
    def _drain(self, length: int, *, keep: int | None = None) -> None:
        """Hash the buffer's first ``keep`` (default ``length``) bytes and write its first
        ``length`` bytes (``length`` > ``keep``: the aligned tail, cut by :meth:`close`)."""
        kept = length if keep is None else keep
        with memoryview(self._buffer) as whole:
            self._hasher.update(whole[:kept])  # releases the GIL
            position = 0
            while position < length:
                try:
                    count = self._file.write(whole[position:length])  # releases the GIL
                except OSError as error:
                    if not (self._direct and error.errno == errno.EINVAL):
                        raise
                    # The device wants a larger alignment than ALIGNMENT: the page cache from here on.
                    self._direct = _set_direct(self._file.fileno(), False)
                    length = kept
                    continue
                position += count
        self._written += kept
        self._filled = 0


def _set_direct(descriptor: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for an open file; whether it is on (False where refused)."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return False
    import fcntl

    try:
        flags = fcntl.fcntl(descriptor, fcntl.F_GETFL)
        fcntl.fcntl(descriptor, fcntl.F_SETFL, (flags | direct) if on else (flags & ~direct))
    except OSError:
        return False
    return on


class HashingFileSystem(FileSystem):
    """DCP's local file system, with the ``.distcp`` files written by :class:`DirectFile`."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[Path, tuple[str, int]] = {}
        """``path: (SHA-256, bytes)`` of every shard file written to the end (and fsynced)."""

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        path = Path(path)
        if mode != "wb" or not DCP_RANK_FILE.match(path.name):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = DirectFile(path)
        try:
            yield stream
            stream.close()  # DCP closed it already (after its fsync): a no-op then
        except BaseException:
            stream.abandon()
            raise
        self.digests[path] = (stream.hexdigest(), stream.size)


class HashingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` for one folder, writing through a shared :class:`HashingFileSystem`."""

    def __init__(self, path: Path, file_system: HashingFileSystem) -> None:
        super().__init__(path)
        self.fs = file_system
