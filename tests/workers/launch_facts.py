"""What a launched rank sees of its process: written to ``FOLDER/rank-N.json``.

    accelerate launch --config_file CONFIG tests/workers/launch_facts.py FOLDER [--fail-rank R --sleep S]

Each rank joins the gloo process group and sums the ranks with an all-reduce, then records its
environment, argv, module name, import path, working directory, streams, signal handlers,
session, thread count and the hash of a str. With ``--fail-rank R`` that rank exits 3 after the all-reduce while the
others sleep S seconds (the launcher must stop them); an atexit handler writes
``FOLDER/atexit-N`` at exit.
"""

import argparse
import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_presets.checkpoint.run_folder import launch_config_file

parser = argparse.ArgumentParser()
parser.add_argument("folder", type=Path)
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--sleep", type=float, default=0.0)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([float(rank)])
dist.all_reduce(total)
atexit.register(lambda: (args.folder / f"atexit-{rank}").write_text(str(os.getpid())))

def command_line(pid: int | str) -> list[str]:
    words = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return [word for word in words if word]


facts = {
    "command_line": command_line("self"),
    "launcher_command_line": command_line(os.getppid()),
    "config_file": launch_config_file(),
    "name": __name__,
    "file": __file__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "pid": os.getpid(),
    "session_leader": os.getsid(0) == os.getpid(),
    "threads": torch.get_num_threads(),
    "all_reduce": total.item(),
    "world_size": dist.get_world_size(),
    "stdout": [type(sys.stdout.buffer).__name__, sys.stdout.write_through, sys.stdout.line_buffering,
               sys.stdout.encoding],
    "stderr": [type(sys.stderr.buffer).__name__, sys.stderr.write_through, sys.stderr.errors],
    "signals": {name: repr(signal.getsignal(getattr(signal, name)))
                for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGPIPE", "SIGCHLD", "SIGQUIT", "SIGUSR1")},
    "main_module_is_script": sys.modules["__main__"].__dict__.get("__file__") == __file__,
    # str hashes are salted per interpreter (PYTHONHASHSEED unset): set and dict iteration over
    # strings may differ between ranks, which a forked rank cannot reproduce.
    "str_hash": hash("fsdp-presets"),
}
(args.folder / f"rank-{rank}.json").write_text(json.dumps(facts))
print(f"rank {rank} of {dist.get_world_size()}: all-reduce {total.item():.0f}", flush=True)
if args.fail_rank is not None:
    if rank == args.fail_rank:
        print(f"rank {rank} fails on purpose", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        sys.exit(3)
    time.sleep(args.sleep)
dist.destroy_process_group()
