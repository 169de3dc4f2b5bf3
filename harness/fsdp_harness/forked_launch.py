"""``accelerate launch`` for the test suite without paying for imports in every process.

A launch of a tiny model costs a few seconds of CPU per process, almost all of it importing
torch, transformers, accelerate and datasets; the training steps themselves take a fraction of a
second. Here a server process imports those once. For each launch it forks a launcher that runs
``accelerate launch`` itself (``accelerate.commands.launch.main`` with the same arguments, so
accelerate reads the config file and computes the ranks' environment, and torchrun's elastic agent
starts, watches, stops and reports the ranks, with the exit status a real launch has). One step
differs: where torchrun would exec ``python -u SCRIPT ARGS`` for a rank, the rank is forked (by a
helper the launcher forked before it started any thread; the launcher adopts the rank as its
child) and runs SCRIPT as ``__main__`` (runpy), with the argv, environment, working directory,
session and output streams that torchrun gave it, the signal dispositions and atexit list of a new
interpreter, unbuffered standard streams, and ``python -u SCRIPT ARGS`` as its command line. The
ranks are separate processes that form a real gloo process group and write real checkpoints.

What a fork shares that an exec would not, so what only real launches check:

- modules imported before the fork see the environment of the server, so a server serves only
  launches whose import-time variables (``HF_*``, ``TORCH*``, ``OMP_*``, ``PYTHON*``, ...) match
  its own; another set of values gets another server;
- the hash seed of ``str`` (every rank iterates a ``set`` of names in the same order);
- what was imported before the fork is frozen out of the garbage collector (``gc.freeze``), so
  that a rank's collections neither scan it nor copy its memory pages;
- the launcher is the server's child, not the caller's, so a test that signals the launcher it
  started, or finds the ranks among its children (to kill one), runs a real launch.

``run_launch`` and ``run_launch_logged`` (:mod:`fsdp_harness.launch`) launch this way when
``FSDP_HARNESS_FORKED_LAUNCH=1`` is set; the test suite sets it (``tests/conftest.py``). Its
process control tests and the demo run real launches, and ``tests/test_forked_launch.py``
compares what the ranks of both kinds of launch see.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

FORKED_LAUNCH = "FSDP_HARNESS_FORKED_LAUNCH"
"""Set to 1 to make :func:`fsdp_harness.launch.run_launch` launch through a fork server."""

PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.run", "torch.distributed.fsdp",
    "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
    "accelerate", "accelerate.commands.launch", "accelerate.utils",
    "transformers", "transformers.models.llama.modeling_llama", "transformers.models.bert.modeling_bert",
    "transformers.models.qwen3.modeling_qwen3", "transformers.models.mistral.modeling_mistral",
    "transformers.models.auto.modeling_auto", "transformers.optimization",
    "datasets", "safetensors.torch", "yaml", "numpy", "peft",
    "transformers.trainer", "trl", "fsdp_presets.train.trainer_callback",
    "matplotlib", "matplotlib.pyplot",
    "fsdp_presets", "fsdp_presets.cpu_fsdp", "fsdp_presets.train.loop", "fsdp_presets.train.data",
    "fsdp_presets.train.plots", "fsdp_presets.train.model_setup", "fsdp_presets.checkpoint.manager",
    "fsdp_presets.train.final_model",
)
"""What the server imports before it forks anything (a name that does not import is skipped)."""

IMPORT_TIME_PREFIXES = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_",
                        "MKL_", "KMP_", "CUDA", "NCCL", "GLOO", "TOKENIZERS", "MPL", "XDG_", "HOME",
                        "LD_", "ACCELERATE", "DATASETS", "TQDM", "NUMPY", "OPENBLAS", "PATH", "TMPDIR",
                        "LANG", "LC_")
"""Variables that modules read when they are imported: a server only serves launches with its own
values of these."""

_PADDING = "-" * 65536
"""The server's last argument: room for the launchers' command lines (see :func:`_set_command_line`)."""

TERMINATE_GRACE_S = 30
"""After a timeout, how long the launcher has to stop its ranks after SIGTERM before SIGKILL."""


def import_time_environment(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` that modules read at import (what a server and a launch must share)."""
    return tuple(sorted((key, value) for key, value in env.items() if key.startswith(IMPORT_TIME_PREFIXES)))


# ---------------------------------------------------------------- in the forked processes


def _exit_status(code) -> int:
    """The exit status ``sys.exit(code)`` gives an interpreter."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_as_interpreter(main) -> int:
    """Run ``main()`` and end the way the interpreter ends a program: the exit status of
    ``SystemExit``, a traceback and 1 for an uncaught error, death by SIGINT after an uncaught
    ``KeyboardInterrupt``; atexit handlers run and the streams are flushed in every case."""
    interrupted = False
    try:
        main()
        status = 0
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        status, interrupted = 130, True
    except BaseException:  # noqa: BLE001 (an uncaught error of the program: print it as Python does)
        sys.excepthook(*sys.exc_info())
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return status


def _unbuffered_streams() -> None:
    """Standard streams on fds 0-2 as ``python -u`` has them (the encoding the interpreter chose)."""
    encoding, errors = sys.__stdout__.encoding, sys.__stdout__.errors
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=encoding,
                                                 errors=sys.__stdin__.errors)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=encoding,
                                                   errors=errors, write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=encoding,
                                                   errors="backslashreplace", write_through=True)


_UNSETTABLE = {signal.SIGKILL, signal.SIGSTOP}
_PYTHON_IGNORES = {getattr(signal, name) for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, name)}
"""Signals a starting interpreter ignores, and so the ones ``subprocess.Popen(restore_signals=True)``
returns to their default before exec."""


def ignored_signals(*, restore_signals: bool = True) -> list[int]:
    """The signals this process ignores that a program it starts with ``subprocess`` would still
    ignore (exec keeps an ignored signal ignored; it returns every handled one to its default)."""
    kept = set(signal.valid_signals()) - _UNSETTABLE - (_PYTHON_IGNORES if restore_signals else set())
    return sorted(int(number) for number in kept if signal.getsignal(number) is signal.SIG_IGN)


def _signals_after_exec(ignored: list[int]) -> None:
    """Signal dispositions as exec and an interpreter's start leave them: the ``ignored`` signals
    stay ignored, every other is at its default, then Python ignores SIGPIPE and SIGXFSZ and turns
    SIGINT into KeyboardInterrupt (unless SIGINT was ignored)."""
    for number in set(signal.valid_signals()) - _UNSETTABLE:
        try:
            signal.signal(number, signal.SIG_IGN if number in ignored else signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # signals the C library keeps for itself
    for number in _PYTHON_IGNORES:
        signal.signal(number, signal.SIG_IGN)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _set_command_line(words: list[str]) -> None:
    """Show ``words`` as this process's command line (``/proc/PID/cmdline``, ``ps``) by writing
    them over the memory of the original arguments, padded with NULs (what setproctitle does).
    The server starts with a long padding argument, so the launcher's words fit; a program that
    reads its launcher's command line (``accelerate launch --config_file ...``) reads these."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of stat
    data = b"\0".join(os.fsencode(word) for word in words) + b"\0"
    if len(data) > end - start:
        raise RuntimeError(f"a command line of {len(data)} bytes does not fit in {end - start}")
    ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)


def _fresh_process(env: dict[str, str], cwd: str | None, ignored: list[int]) -> None:
    """Make a forked child look like a newly started interpreter to the program it runs."""
    _signals_after_exec(ignored)
    atexit._clear()
    import logging

    atexit.register(logging.shutdown)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    _unbuffered_streams()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # a new interpreter draws a new seed; a fork would copy the server's


def _python_script(args) -> tuple[str, list[str]] | None:
    """``(script, its arguments)`` of ``python -u SCRIPT ARGS``, the rank command torchrun runs."""
    args = [os.fsdecode(arg) for arg in args]
    if len(args) >= 3 and args[0] == sys.executable and args[1] == "-u" and args[2].endswith(".py"):
        return args[2], args[3:]
    return None


def _run_rank(request: dict, descriptors: list[int]) -> None:
    """In a rank: become ``python -u SCRIPT ARGS`` started by torchrun, run it, exit (never returns)."""
    status = 1
    try:
        if request["new_session"]:
            os.setsid()
        for descriptor, target in zip(descriptors, request["targets"]):
            os.dup2(descriptor, target)
        _fresh_process(request["env"], request["cwd"], request["ignored_signals"])
        _set_command_line(request["args"])
        script = request["script"]
        sys.argv = [script, *request["script_args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        status = _run_as_interpreter(lambda: runpy.run_path(script, run_name="__main__"))
    finally:
        os._exit(status)


def _zygote(channel: socket.socket) -> None:
    """Fork the ranks a launcher asks for (never returns; ends when the launcher closes its side).

    The launcher cannot fork them itself: by then torchrun runs a TCPStore server thread in it, and
    a fork can copy a C library lock that thread holds (glibc's resolver lock, taken when the store
    names a connecting peer) into a rank that then waits on it forever. The zygote is forked from
    the launcher before any thread starts, so it has only one. Each rank is forked through a middle
    process that exits at once: the rank is then adopted by the launcher (a child subreaper), whose
    torchrun agent waits on it, signals its session and reads its exit status as its own child's."""
    channel_fd = channel.fileno()
    while True:
        try:
            message, descriptors, _, _ = socket.recv_fds(channel, 1 << 20, 3)
        except OSError:
            break
        if not message:
            break  # the launcher ended
        request = json.loads(message)
        read_end, write_end = os.pipe()
        middle = os.fork()
        if middle == 0:
            middle = os.getpid()
            rank = os.fork()
            if rank == 0:
                os.close(read_end)
                os.close(write_end)
                os.close(channel_fd)
                # NOTE: the rank starts its program only once the launcher has adopted it: until the
                # middle process has exited, getppid() names the middle (a zombie, whose command line
                # reads empty), not the launcher a real rank sees as its parent.
                while os.getppid() == middle:
                    time.sleep(0.001)
                _run_rank(request, descriptors)
            os.write(write_end, str(rank).encode())
            os._exit(0)
        os.close(write_end)
        rank = int(os.read(read_end, 64))
        os.close(read_end)
        os.waitpid(middle, 0)  # after this the rank's parent is the launcher
        for descriptor in descriptors:
            os.close(descriptor)
        channel.send(json.dumps({"pid": rank}).encode())
    os._exit(0)


_zygote_channel: socket.socket | None = None
"""In a launcher: its side of the channel to its zygote."""


def _start_zygote() -> None:
    """Make this (still single-threaded) launcher a child subreaper and fork its zygote."""
    global _zygote_channel
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.fork() == 0:
        ours.close()
        gc.freeze()
        _zygote(theirs)
    theirs.close()
    _zygote_channel = ours


_PR_SET_CHILD_SUBREAPER = 36


class ForkedRank(subprocess.Popen):
    """``subprocess.Popen`` that forks ``python -u SCRIPT ARGS`` (through the launcher's zygote)
    instead of executing it; any other command is executed as usual."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, *rest):
        command = None if (shell or executable or preexec_fn or uid is not None or gid is not None
                           or _zygote_channel is None) else _python_script(args)
        if command is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                          startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                          c2pwrite, errread, errwrite, restore_signals, gid, gids, uid,
                                          umask, start_new_session, *rest)
        script, script_args = command
        streams = [(source, target) for source, target in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))
                   if source != -1]
        request = {
            "args": [os.fsdecode(arg) for arg in args], "script": script, "script_args": script_args,
            "env": {os.fsdecode(key): os.fsdecode(value) for key, value in (env or os.environ).items()},
            "cwd": os.fsdecode(cwd) if cwd else None, "new_session": bool(start_new_session),
            "ignored_signals": ignored_signals(restore_signals=restore_signals),
            "targets": [target for _, target in streams],
        }
        socket.send_fds(_zygote_channel, [json.dumps(request).encode()], [source for source, _ in streams])
        self.pid = json.loads(_zygote_channel.recv(4096))["pid"]
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _launcher(request: dict) -> None:
    """The forked launcher: ``accelerate launch ARGS`` with its ranks forked (never returns)."""
    status = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        opened = {}
        for path, target in ((request["stdout"], 1), (request["stderr"], 2)):
            if path not in opened:  # both streams to one file share one descriptor, as 2>&1 does
                opened[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(opened[path], target)
        for descriptor in opened.values():
            os.close(descriptor)
        _fresh_process(request["env"], request["cwd"], request["ignored_signals"])
        _start_zygote()
        from accelerate.commands import launch
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

        subprocess_handler.Popen = ForkedRank
        _set_command_line([sys.executable, "-m", "accelerate.commands.launch", *request["argv"]])
        sys.argv = [launch.__file__, *request["argv"]]
        sys.path[0] = request["cwd"] or os.getcwd()
        status = _run_as_interpreter(launch.main)
    finally:
        os._exit(status)


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve() -> None:
    """The server: import :data:`PRELOAD`, then read one launch request per line from standard input
    and answer ``{"pid": ...}`` when its launcher started and ``{"returncode": ...}`` when it ended."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.freeze()  # what is imported now stays: no collection scans it (or copies its pages) in a fork
    if threading.active_count() != 1:
        raise RuntimeError(f"importing {PRELOAD} started threads: {threading.enumerate()}; "
                           "forking from this process is unsafe")
    _send({"ready": os.getpid()})
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _launcher(request)
        _send({"pid": pid})
        _, wait_status = os.waitpid(pid, 0)
        _send({"returncode": os.waitstatus_to_exitcode(wait_status)})


# ---------------------------------------------------------------- in the process that launches


class ForkServer:
    """A running server (one per import-time environment; see :func:`launch`)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.key = import_time_environment(env)
        self._log = tempfile.NamedTemporaryFile(prefix="fork-server-", suffix=".log", delete=False)
        self.process = subprocess.Popen([sys.executable, "-m", "fsdp_harness.forked_launch", _PADDING],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                        env=env, bufsize=0)
        self._buffer = b""
        self._read(deadline=time.monotonic() + 600)

    def _read(self, deadline: float | None) -> dict | None:
        """The server's next message, or None when the deadline passes first."""
        stream = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([stream], [], [], wait)
            if not ready:
                return None
            chunk = os.read(stream, 65536)
            if not chunk:
                self._log.flush()
                raise RuntimeError(f"the fork server exited ({self.process.wait()}): "
                                   f"{Path(self._log.name).read_text()[-4000:]}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], *, env: dict[str, str], cwd, timeout: float | None, stdout: Path,
            stderr: Path) -> tuple[int, bool]:
        """``accelerate launch ARGV`` forked, its streams appended to ``stdout`` and ``stderr`` (one
        file may take both): ``(returncode, timed_out)``; after a timeout the launcher gets SIGTERM
        (torchrun's agent then stops its ranks), and SIGKILL if it has not ended in 30 s."""
        request = {"argv": list(map(str, argv)), "env": env, "cwd": str(cwd) if cwd else os.getcwd(),
                   "stdout": str(stdout), "stderr": str(stderr), "ignored_signals": ignored_signals()}
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        pid = self._read(deadline=None)["pid"]
        ended = self._read(None if timeout is None else time.monotonic() + timeout)
        timed_out = ended is None
        if timed_out:
            os.kill(pid, signal.SIGTERM)
            ended = self._read(deadline=time.monotonic() + TERMINATE_GRACE_S)
            if ended is None:
                os.kill(pid, signal.SIGKILL)
                ended = self._read(deadline=None)
        return ended["returncode"], timed_out

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


_idle: list[ForkServer] = []  # servers with no launch running, most recently used last
_idle_lock = threading.Lock()
_MAX_IDLE = 2


@contextlib.contextmanager
def _server(env: dict[str, str]):
    """An idle server started with ``env``'s import-time variables (a new one when none is idle:
    a server runs one launch at a time, so two nodes launched at once get two servers)."""
    key = import_time_environment(env)
    with _idle_lock:
        server = next((server for server in reversed(_idle)
                       if server.key == key and server.process.poll() is None), None)
        if server is not None:
            _idle.remove(server)
    server = server or ForkServer(env)
    try:
        yield server
    except BaseException:
        server.close()  # stopped in the middle of a launch: its state is unknown
        raise
    with _idle_lock:
        _idle.append(server)
        while len(_idle) > _MAX_IDLE:
            _idle.pop(0).close()


@atexit.register
def _close_servers() -> None:
    with _idle_lock:
        while _idle:
            _idle.pop().close()


def available() -> bool:
    """Whether this platform can fork launches (POSIX fork)."""
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def _arguments(command: list[str]) -> list[str]:
    prefix = [sys.executable, "-m", "accelerate.commands.launch"]
    if list(map(str, command[:3])) != prefix:
        raise ValueError(f"not an accelerate launch command line of this interpreter: {command}")
    return list(map(str, command[3:]))


def run(command: list[str], *, env: dict[str, str], cwd=None, timeout: float | None = None
        ) -> tuple[int, str, str]:
    """Run an ``accelerate launch`` command line (``python -m accelerate.commands.launch ARGS``, as
    :func:`fsdp_harness.launch.launch_command` writes it) forked from a server with ``env``'s
    import-time variables: ``(returncode, stdout, stderr)``; raises ``subprocess.TimeoutExpired``
    as ``subprocess.run`` does, after the launcher has stopped its ranks."""
    arguments = _arguments(command)
    with tempfile.TemporaryDirectory(prefix="forked-launch-") as folder:
        stdout, stderr = Path(folder, "stdout"), Path(folder, "stderr")
        with _server(env) as server:
            returncode, timed_out = server.run(arguments, env=env, cwd=cwd, timeout=timeout,
                                               stdout=stdout, stderr=stderr)
        read = lambda path: path.read_text(errors="replace") if path.exists() else ""  # noqa: E731
        output, errors = read(stdout), read(stderr)
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=output, stderr=errors)
    return returncode, output, errors


def run_logged(command: list[str], log: Path, *, env: dict[str, str], cwd=None,
               timeout: float | None = None) -> int:
    """:func:`run` with both streams appended to ``log``: the exit status."""
    with _server(env) as server:
        returncode, timed_out = server.run(_arguments(command), env=env, cwd=cwd, timeout=timeout,
                                           stdout=Path(log), stderr=Path(log))
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout)
    return returncode


if __name__ == "__main__":
    serve()
