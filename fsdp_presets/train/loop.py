"""Small helpers shared by the recipes: common flags, the data position, weight-decay groups,
gradient synchronisation during accumulation, and the exit path for bad input.

The data position is one number, the count of training samples consumed by all ranks together.
Global sample ``p`` is sample ``permutation(epoch = p // N)[p % N]`` of a dataset of ``N``
samples, where each epoch's permutation is seeded by ``(seed, epoch)``. An optimizer step takes
the next ``micro_batch * grad_accum * data_parallel_size`` samples; rank
``r`` takes its slice of each micro-step. Resuming is arithmetic on that number, so it survives a
change of GPU count, and RNG state (dropout) is restored by ``accelerator.load_state``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
from pathlib import Path
from typing import Any, Callable

from fsdp_presets import flags
from fsdp_presets.errors import UsageError
from fsdp_presets.plan import limits
from fsdp_presets.train import signals

RECIPE_SEQ_LEN = 128
"""Tokens per sample the recipes train on when ``--seq-len`` is not given: the CPU demo's length
(accelerate_configs/cpu_fsdp2_demo.yaml is planned for it)."""
RECIPE_MICRO_BATCH = 2
"""Sequences per rank per forward pass when ``--micro-batch`` is not given."""

LR_SCHEDULES = ("cosine", "linear", "constant_with_warmup")  # --lr-scheduler


# ---- flags ----
def recipe_argument_parser(description: str) -> argparse.ArgumentParser:
    """The flags every recipe shares: the settings of a training request spelled as
    ``fsdp-presets`` spells them (:mod:`fsdp_presets.flags`), the rest Hugging Face style."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    flags.add(parser, flags.MODEL, required=True)
    flags.add(parser, flags.DATA, required=True)
    add("--eval-data", help="evaluation data in the same format (default: hold out --eval-fraction)")
    add("--eval-fraction", type=float, default=0.05, help="share of --data held out when no --eval-data")
    add("--max-eval-samples", type=int, default=0, help="evaluate on the first N evaluation records (0: all)")
    flags.add(parser, flags.OUTPUT_DIR, required=True)
    flags.add(parser, flags.MAX_STEPS, type=int, default=100)
    flags.add(parser, flags.MICRO_BATCH, type=limits.micro_batch, default=RECIPE_MICRO_BATCH,
              help_suffix=f" (default {RECIPE_MICRO_BATCH})")
    flags.add(parser, flags.GRAD_ACCUM, type=limits.grad_accum, default=flags.DEFAULT_GRAD_ACCUM,
              help_suffix=f" (default {flags.DEFAULT_GRAD_ACCUM})")
    flags.add(parser, flags.REDUCE_EVERY_MICRO_BATCH, action="store_true")
    flags.add(parser, flags.LEARNING_RATE, type=float, default=5e-5)
    add("--weight-decay", type=float, default=0.0, help="AdamW weight decay (never on norms, biases, embeddings)")
    add("--warmup-steps", type=int, default=0, help="linear warm-up steps")
    add("--lr-scheduler", default="cosine", choices=LR_SCHEDULES,
        help="learning-rate schedule after warm-up")
    add("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off, norm still logged)")
    flags.add(parser, flags.SEQ_LEN, type=limits.seq_len, default=RECIPE_SEQ_LEN,
              help_suffix=f" (default {RECIPE_SEQ_LEN})")
    add("--eval-every", type=int, default=0, help="evaluate every N steps (0: only before and after)")
    flags.add(parser, flags.SAVE_EVERY, type=int, default=0)
    add("--keep-last", type=int, default=2, help="committed checkpoints to keep")
    flags.add(parser, flags.ASYNC_SAVE, action="store_true")
    flags.add(parser, flags.RESUME, default="auto")
    flags.add(parser, flags.SEED, type=int, default=42)
    add("--preempt-signals", default=signals.DEFAULT_SIGNALS,
        help="signals that save the step reached and stop the run (exit 75; docs/runbook.md), comma-separated, "
        "or none")
    flags.add(parser, flags.DISTRIBUTED_CONFIG)
    add("--fsdp-reduce-dtype", choices=("fp32", "bf16"),
        help="dtype FSDP reduces gradients in (default: accelerate's, which follows "
        "mixed_precision; no accelerate config key sets it)")
    from fsdp_presets.train import lora

    lora.add_arguments(parser)  # LoRA/QLoRA: --method, --lora-r/-alpha/-dropout/-target-modules, --export-merged
    return parser


def check_common_args(args: argparse.Namespace) -> None:
    """Range checks of the shared flags and the input paths; all problems raised at once."""
    problems = []
    for name, value in sorted(vars(args).items()):  # NaN passes every comparison, inf most of them
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"--{name.replace('_', '-')} {value} is not a finite number; give a number such as "
                            f"{_EXAMPLE_VALUES.get(name, '1.0')}")
    if problems:
        raise UsageError("; ".join(problems))
    if args.max_steps < 1:  # --micro-batch, --grad-accum and --seq-len: limits' checks, while parsing
        problems.append("--max-steps must be >= 1")
    for name in ("max_eval_samples", "warmup_steps", "eval_every", "save_every", "max_grad_norm", "weight_decay"):
        if getattr(args, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0")
    if args.keep_last < 1:
        problems.append("--keep-last must be >= 1")
    try:
        signals.parse_signals(args.preempt_signals)
    except UsageError as error:
        problems.append(str(error))
    if args.learning_rate <= 0:
        problems.append("--learning-rate must be > 0")
    if not 0 <= args.seed < 2**32:  # numpy's and torch's seeding accept 0 .. 2**32 - 1
        problems.append(f"--seed {args.seed} is out of range; give a whole number from 0 to {2**32 - 1}")
    if not 0 < args.eval_fraction < 1:
        problems.append("--eval-fraction must be between 0 and 1")
    model = Path(args.model)
    if not model.is_dir():
        problems.append(f"--model {model}: no such folder (give a local model folder with config.json)")
    elif not (model / "config.json").is_file():
        problems.append(f"--model {model}: no config.json in it (is this a Hugging Face model folder?)")
    for flag, value in (("--data", args.data), ("--eval-data", args.eval_data)):
        if value is not None and not Path(value).is_file():
            problems.append(f"{flag} {value}: no such file")
    if problems:
        raise UsageError("; ".join(problems))


_EXAMPLE_VALUES = {"learning_rate": "5e-5", "eval_fraction": "0.05", "max_grad_norm": "1.0", "weight_decay": "0.0"}


def load_model_config(model: str) -> Any:
    """The model's transformers config, read without running code from the model folder. A folder
    whose config names its own code (``auto_map``, a ``model_type`` transformers does not know) is
    refused in one line: the recipes never pass ``trust_remote_code=True``."""
    from transformers import AutoConfig

    from fsdp_presets.fileio import CONFIG_MAX_BYTES, read_regular_bytes

    try:
        if (Path(model) / "config.json").exists():  # a FIFO or /dev/zero there would hang transformers' read
            read_regular_bytes(Path(model) / "config.json", limit=CONFIG_MAX_BYTES)
        return AutoConfig.from_pretrained(model, trust_remote_code=False)
    except OSError as error:  # unreadable, truncated or not JSON (a link to another file)
        raise UsageError(f"--model {model}: {' '.join(str(error).split())[:300]}; give a model folder with a "
                         "complete config.json") from None
    except ValueError as error:
        if not any(text in str(error) for text in ("trust_remote_code", "model_type", "model type")):
            raise
        raise UsageError(f"--model {model}: its config needs code from the model folder or an architecture this "
                         "transformers does not know, and the recipes never run code from a model folder. Use a "
                         "model of an architecture transformers ships (see `fsdp-presets inspect`), or adapt a "
                         "copy of the recipe to your reviewed model code") from None


def check_seq_len(seq_len: int, config: Any) -> None:
    """``--seq-len`` must fit the model's position table."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise UsageError(f"--seq-len {seq_len} is beyond the model's {limit} positions "
                         f"(max_position_embeddings); use --seq-len {limit} or less")


def set_fsdp_reduce_dtype(accelerator, name: str) -> None:
    """``--fsdp-reduce-dtype``: keep the FSDP mixed-precision policy, change only the dtype
    gradients are reduced in."""
    import dataclasses

    import torch

    plugin = accelerator.state.fsdp_plugin
    if accelerator.distributed_type.value != "FSDP" or plugin is None:
        raise UsageError("--fsdp-reduce-dtype needs an FSDP accelerate config")
    if plugin.fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy as Policy
    else:
        from torch.distributed.fsdp import MixedPrecision as Policy
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
    plugin.mixed_precision_policy = dataclasses.replace(plugin.mixed_precision_policy or Policy(), reduce_dtype=dtype)


# ---- data position ----
class SampleStream:
    """The endless, seeded, epoch-by-epoch shuffled order of a dataset's sample indices."""

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise UsageError("the training data holds no sample")
        self.num_samples = num_samples
        self.seed = seed
        self._permutations: dict[int, list[int]] = {}

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._permutations:
            import torch

            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._permutations = {epoch: torch.randperm(self.num_samples, generator=generator).tolist()}
        return self._permutations[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices of global samples ``start .. start + count - 1``."""
        return [self._permutation(p // self.num_samples)[p % self.num_samples] for p in range(start, start + count)]


def rank_micro_batches(stream: SampleStream, *, samples_consumed: int, micro_batch_size: int,
                       accumulation_steps: int, rank: int, data_parallel_size: int) -> list[list[int]]:
    """This rank's micro-batches (dataset indices) for the optimizer step that starts at global
    sample ``samples_consumed``: micro-step ``m`` covers the next ``micro * dp`` samples, rank ``r``
    takes the ``r``-th slice of them."""
    per_micro_step = micro_batch_size * data_parallel_size
    batches = []
    for micro_step in range(accumulation_steps):
        start = samples_consumed + micro_step * per_micro_step + rank * micro_batch_size
        batches.append(stream.indices(start, micro_batch_size))
    return batches


def eval_micro_batches(num_samples: int, *, micro_batch_size: int, rank: int,
                       data_parallel_size: int) -> list[list[tuple[int, bool]]]:
    """This rank's evaluation micro-batches as ``(index, counts)`` pairs. Every rank gets the same
    number of batches of the same size (FSDP ranks must run the same collectives); a slot past the
    end repeats sample 0 with ``counts=False`` and is left out of the metrics."""
    per_round = micro_batch_size * data_parallel_size
    rounds = -(-num_samples // per_round)
    batches = []
    for round_index in range(rounds):
        start = round_index * per_round + rank * micro_batch_size
        batches.append([(position, True) if position < num_samples else (0, False)
                        for position in range(start, start + micro_batch_size)])
    return batches


def collate(dataset, indices: list[int], columns: tuple[str, ...], device) -> dict:
    """Rows ``indices`` of a tokenized ``datasets.Dataset`` as a dict of tensors on ``device``
    (the accelerator's: labels and masks meet the model's outputs there)."""
    import torch

    rows = dataset[indices]
    return {column: torch.tensor(rows[column], device=device) for column in columns}


# ---- process ----
def main_process_print(accelerator) -> Callable[[str], None]:
    """``print`` on the main process, flushed; nothing elsewhere."""
    def emit(message: str) -> None:
        if accelerator.is_main_process:
            print(message, flush=True)

    return emit


def finish(accelerator) -> None:
    """End the run cleanly: collect garbage before the process group is destroyed (gloo can abort
    at exit with "terminate called without an active exception" when the group goes while tensors
    it references live). The caller deletes its model and optimizer first."""
    gc.collect()
    accelerator.end_training()


def run_recipe(main: Callable[[], None]) -> int:
    """Run a recipe's ``main`` and turn the ways it stops into one line on stderr and the exit
    status of :data:`fsdp_presets.train.signals.EXIT_STATUSES`: bad input 2 (:class:`UsageError`; a
    read-only or size-limited output too), a finding about the run 1 (:class:`Finding`: it
    diverged, the disk is full), Ctrl-C 130, a preemption signal 75. The main process prints what
    every rank shares; an error marked :func:`fsdp_presets.errors.rank_local` is printed by the rank
    it concerns."""
    from fsdp_presets.errors import Finding, disk_full_cause, disk_full_message, refused_write_class

    signals.install()  # Ctrl-C: one line and 130 before training, a save at a step's end during it
    try:
        main()
        return 0
    except (UsageError, Finding, signals.Interrupted, signals.Preempted) as error:
        return signals.report(error)
    except KeyboardInterrupt:
        return signals.report(signals.Interrupted("interrupted (Ctrl-C) before training started: nothing was "
                                                  "trained or half-written; run the same command again to start"))
    except OSError as error:  # a full disk anywhere else (metrics, run.json, plots): no traceback either
        cause = disk_full_cause(error)
        if cause is None:
            raise
        message = disk_full_message(cause, "writing the run's files", "the run folder")
        return signals.report(refused_write_class(message)(message))
    except RuntimeError as error:  # gloo's DistBackendError: another rank left (it printed why), e.g. rank 0
        if not any(text in str(error) for text in _PEER_LEFT_TEXT):  # stopping in main_process_first on bad data
            raise
        from fsdp_presets.errors import rank_local

        return signals.report(rank_local(Finding(f"rank {os.environ.get('RANK', '?')} stopped: another process of "
                                                 "the job left first (its message says why)"), print_here=True))


_PEER_LEFT_TEXT = ("Connection closed by peer", "Connection reset by peer")


def lr_scheduler(name: str, optimizer, *, num_warmup_steps: int, num_training_steps: int):
    """The learning-rate schedule of ``--lr-scheduler``: linear warm-up from 0, then cosine (half a
    cycle to 0), linear (to 0) or constant.

    The same multipliers, float for float, as ``transformers.get_scheduler`` with these names
    (tests/test_recipe_machinery.py compares every step). Built on ``torch.optim.lr_scheduler.LambdaLR``
    here because importing ``transformers.optimization`` imports peft and bitsandbytes when they
    are installed: 3-4 s of CPU in every process of every launch.
    """
    if name not in LR_SCHEDULES:
        raise UsageError(f"--lr-scheduler {name!r} is not one of {', '.join(LR_SCHEDULES)}")
    import functools

    from torch.optim.lr_scheduler import LambdaLR

    class Schedule(LambdaLR):
        def load_state_dict(self, state_dict):
            """The saved step, at this schedule's rate there: a checkpoint holds the rate its own
            schedule set for the next step (in the optimizer's groups, loaded first), which a run
            resumed with another --max-steps would otherwise take for one step (the same float
            when the schedule is unchanged: ``LambdaLR.get_lr``'s product)."""
            super().load_state_dict(state_dict)
            rates = [base * rate(self.last_epoch) for base, rate in zip(self.base_lrs, self.lr_lambdas)]
            for group, value in zip(self.optimizer.param_groups, rates):
                group["lr"] = value
            self._last_lr = rates

    multiplier = functools.partial(_lr_multiplier, name, warmup=num_warmup_steps, total=num_training_steps)
    return Schedule(optimizer, multiplier)


def _lr_multiplier(name: str, step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if name == "constant_with_warmup":
        return 1.0
    if name == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
