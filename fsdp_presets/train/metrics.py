"""``metrics.jsonl``: one JSON object per optimizer step (``kind: train``), per evaluation
(``kind: eval``), per committed checkpoint save (``kind: save``) and, when a run stopped on a preemption
signal, one ``kind: preempted`` line, written by the main process and flushed line by line so that a killed run
loses at most the line being written.

On resume the lines after the resumed checkpoint's step are dropped (the file is rewritten
atomically) and then written again by the resumed run, so the file of a resumed run reads like
that of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fsdp_presets.fileio import write_text_atomic


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All complete lines of a metrics file (a last line cut short by a kill is skipped)."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def throughput_at_end(path: str | os.PathLike, processes: int) -> str | None:
    """``throughput: ...``, the line a recipe or a Trainer run ends with: the tokens/s per process of
    the run whose metrics file is ``path`` against its preset's prediction (where ``generate`` wrote
    the launch's config: GPU presets), as ``compare`` prints it for a run record
    (:func:`fsdp_presets.compare.throughput.throughput_line`); None without steps enough to measure."""
    from fsdp_presets.checkpoint.run_folder import launch_config_file
    from fsdp_presets.preset.emit import file_metadata
    from fsdp_presets.throughput import throughput_text

    config = launch_config_file()
    series = {line["step"]: line["tokens_per_s"] for line in read_metrics(path) if line.get("kind") == "train"}
    return throughput_text("throughput:", series, processes, file_metadata(config).get("predicted") if config else None)


def device_memory_peaks(device) -> dict[str, int]:
    """This process's peak CUDA memory so far on ``device`` (``max_memory_allocated``: tensors;
    ``max_memory_reserved``: what the caching allocator holds, the part ``nvidia-smi`` shows less
    the CUDA context); empty on any other device."""
    if device.type != "cuda":
        return {}
    import torch  # only here: readers of metrics files need no torch

    return {"max_memory_allocated": torch.cuda.max_memory_allocated(device),
            "max_memory_reserved": torch.cuda.max_memory_reserved(device)}


def train_losses(path: str | os.PathLike) -> dict[int, float]:
    """``{step: loss}`` of the train lines."""
    return {record["step"]: record["loss"] for record in read_metrics(path) if record.get("kind") == "train"}


class MetricsLog:
    """Appends metric lines; on the non-main processes every call does nothing."""

    def __init__(self, path: str | os.PathLike, *, enabled: bool, keep_through_step: int) -> None:
        """Open the log of a run that (re)starts after ``keep_through_step`` optimizer steps:
        lines for later steps are dropped; a fresh start (0) keeps only the step-0 evaluation
        lines, which the run writes again, so it drops them too."""
        self.path = Path(path)
        self.enabled = enabled
        if not enabled:
            return
        kept = [record for record in read_metrics(self.path)
                if keep_through_step > 0 and record["step"] <= keep_through_step]
        write_text_atomic(self.path, "".join(json.dumps(record) + "\n" for record in kept))

    def _append(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()

    def log_train(self, *, step: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float,
                  step_time_s: float, samples_seen: int, memory: dict[str, int] | None = None,
                  **values: float) -> None:
        """One optimizer step (``step`` is 1-based); ``memory``: :func:`device_memory_peaks` of
        the main process, on a GPU. Extra values: ``router_aux_loss`` (a mixture of experts'
        load-balancing loss, when its config asks the model for it)."""
        self._append({"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                      "tokens_per_s": tokens_per_s, "step_time_s": step_time_s,
                      "samples_seen": samples_seen, **(memory or {}), **values})

    def log_preempted(self, *, step: int, signal: str | None, checkpoint: str | None) -> None:
        """The run stopped on a preemption signal after ``step`` optimizer steps, ``checkpoint``
        holding that step (None: nothing to save, no step trained since the last one)."""
        self._append({"kind": "preempted", "step": step, "signal": signal, "checkpoint": checkpoint})

    def log_eval(self, *, step: int, eval_loss: float, **values: float) -> None:
        """One evaluation after ``step`` optimizer steps (0: before training). Extra values:
        ``perplexity`` (causal LM), ``accuracy`` (classification), ``token_accuracy``."""
        self._append({"kind": "eval", "step": step, "eval_loss": eval_loss, **values})

    def log_save(self, *, step: int, async_: bool, blocked_s: float, total_s: float, bytes: int) -> None:
        """One committed checkpoint of step ``step``: ``async`` (written in the background),
        ``blocked_s`` (training time rank 0 lost to it), ``total_s`` (until committed), ``bytes``."""
        self._append({"kind": "save", "step": step, "async": async_, "blocked_s": blocked_s, "total_s": total_s,
                      "bytes": bytes})
