"""Local training data through ``datasets``: loading, column checks, tokenization, packing and
prompt masking for the recipes.

Formats by file suffix: ``.jsonl``/``.json`` (one object per line), ``.csv``, ``.parquet``, and
anything else as plain text (one sample per line). Causal LM data has ``prompt`` and ``response``
columns (supervised fine-tuning: the prompt's tokens get label -100, so only the response is
learned) or a ``text`` column (continued pre-training: every token is learned). Classification
data has ``text`` and ``label`` columns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fsdp_presets.errors import UsageError

IGNORE_INDEX = -100  # labels with this value are left out of the loss (torch cross_entropy default)
_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_MAP_BATCH = 1000  # rows per tokenization batch; packing leftovers carry across batches


def load_records(path: str | os.PathLike, flag: str = "--data"):
    """Load one local file as a ``datasets.Dataset`` (no cache files next to the data)."""
    import datasets

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{flag} {path}: no such file")
    if path.stat().st_size == 0:
        raise UsageError(f"{flag} {path} is empty")
    builder = _BUILDERS.get(path.suffix.lower(), "text")
    datasets.disable_progress_bars()
    try:
        records = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as error:  # datasets raises many types for unparsable files
        raise UsageError(f"{flag} {path}: cannot be read as {builder} ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from None
    if len(records) == 0:
        raise UsageError(f"{flag} {path} holds no records")
    return records


def _require_string_columns(records, columns: tuple[str, ...], flag: str, path, need: str) -> None:
    missing = [column for column in columns if column not in records.column_names]
    if missing:
        raise UsageError(f"{flag} {path} has columns {records.column_names}, missing {missing}; {need}")
    for column in columns:
        dtype = getattr(records.features[column], "dtype", None)
        if dtype != "string":
            raise UsageError(f"{flag} {path}: column {column!r} holds {dtype or records.features[column]}, "
                             "expected text")


# ---- causal language modelling ----
def causal_lm_columns(records, flag: str, path) -> tuple[str, ...]:
    """``("prompt", "response")`` or ``("text",)``, whichever the data has."""
    names = records.column_names
    columns = ("prompt", "response") if "prompt" in names or "response" in names else ("text",)
    _require_string_columns(records, columns, flag, path,
                            "causal LM data needs `prompt` and `response` columns, or a `text` column")
    return columns


def tokenize_causal_lm(records, tokenizer, columns: tuple[str, ...]):
    """``input_ids`` and ``labels`` per record: prompt tokens masked (label -100), then the
    response (or the whole text) and the end-of-sequence token."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        if columns == ("text",):
            texts = tokenizer(batch["text"])["input_ids"]
            ids = [text + eos for text in texts]
            return {"input_ids": ids, "labels": [list(row) for row in ids]}
        prompts = tokenizer(batch["prompt"])["input_ids"]  # special tokens (BOS) as the tokenizer adds them
        responses = tokenizer(batch["response"], add_special_tokens=False)["input_ids"]
        ids, labels = [], []
        for prompt, response in zip(prompts, responses):
            ids.append(prompt + response + eos)
            labels.append([IGNORE_INDEX] * len(prompt) + response + eos)
        return {"input_ids": ids, "labels": labels}

    return records.map(tokenize, batched=True, batch_size=_MAP_BATCH, remove_columns=records.column_names,
                       keep_in_memory=True)


def pack(tokenized, seq_len: int):
    """Concatenate the samples and cut the stream into blocks of ``seq_len`` tokens (the leftover
    shorter than a block is dropped). Attention crosses sample boundaries inside a block, the
    usual trade of simple packing for no padding."""
    def pack_batch(batch: dict[str, list]) -> dict[str, list]:
        ids = [token for row in batch["input_ids"] for token in row]
        labels = [token for row in batch["labels"] for token in row]
        blocks = len(ids) // seq_len
        return {"input_ids": [ids[i * seq_len:(i + 1) * seq_len] for i in range(blocks)],
                "labels": [labels[i * seq_len:(i + 1) * seq_len] for i in range(blocks)]}

    # NOTE: one batch holds the whole dataset so that no leftover is dropped between batches; the
    # recipes' data is tokenized in memory anyway.
    return tokenized.map(pack_batch, batched=True, batch_size=None, keep_in_memory=True)


def pad_each(tokenized, seq_len: int, pad_token_id: int):
    """One sample per row, truncated or right-padded to ``seq_len`` (padding is masked)."""
    def pad_batch(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "attention_mask": []}
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            ids, labels = ids[:seq_len], labels[:seq_len]
            padding = seq_len - len(ids)
            out["input_ids"].append(ids + [pad_token_id] * padding)
            out["labels"].append(labels + [IGNORE_INDEX] * padding)
            out["attention_mask"].append([1] * len(ids) + [0] * padding)
        return out

    return tokenized.map(pad_batch, batched=True, batch_size=_MAP_BATCH, keep_in_memory=True)


def _first(records, count: int):
    """The first ``count`` records (all when ``count`` is 0)."""
    return records.select(range(min(count, len(records)))) if count else records


def causal_lm_splits(*, data: str, eval_data: str | None, eval_fraction: float, tokenizer, seq_len: int,
                     packing: bool, seed: int, max_eval_samples: int = 0):
    """``(train, eval)`` datasets of ``input_ids``/``labels`` (+ ``attention_mask`` unpacked)."""
    records = load_records(data, "--data")
    columns = causal_lm_columns(records, "--data", data)
    if eval_data is not None:
        eval_records = load_records(eval_data, "--eval-data")
        if causal_lm_columns(eval_records, "--eval-data", eval_data) != columns:
            raise UsageError(f"--eval-data {eval_data} has other columns than --data {data}")
    else:
        if len(records) < 2:
            raise UsageError(f"--data {data} holds {len(records)} record; give at least 2 or an --eval-data file")
        split = records.train_test_split(test_size=eval_fraction, seed=seed)
        records, eval_records = split["train"], split["test"]
    eval_records = _first(eval_records, max_eval_samples)
    splits = []
    for name, part in (("--data", records), ("--eval-data" if eval_data else "held-out data", eval_records)):
        tokenized = tokenize_causal_lm(part, tokenizer, columns)
        if packing:
            shaped = pack(tokenized, seq_len)
        else:
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            shaped = pad_each(tokenized, seq_len, pad_id)
        if len(shaped) == 0:
            raise UsageError(f"{name}: too little text for one block of --seq-len {seq_len} tokens "
                             "(add data or lower --seq-len)")
        splits.append(shaped)
    return splits[0], splits[1]


# ---- sequence classification ----
def classification_splits(*, data: str, eval_data: str | None, eval_fraction: float, tokenizer,
                          seq_len: int, seed: int, max_eval_samples: int = 0) -> tuple[Any, Any, list[str]]:
    """``(train, eval, label_names)``: ``input_ids``, ``attention_mask`` (padded to ``seq_len``)
    and integer ``labels``; label names are the sorted distinct values of the training labels."""
    records = load_records(data, "--data")
    _check_classification_columns(records, "--data", data)
    if eval_data is not None:
        eval_records = load_records(eval_data, "--eval-data")
        _check_classification_columns(eval_records, "--eval-data", eval_data)
    else:
        split = records.train_test_split(test_size=eval_fraction, seed=seed)
        records, eval_records = split["train"], split["test"]
    eval_records = _first(eval_records, max_eval_samples)
    label_names = sorted({str(label) for label in records["label"]})
    if len(label_names) < 2:
        raise UsageError(f"--data {data} has {len(label_names)} distinct label; classification needs at least 2")
    unknown = sorted({str(label) for label in eval_records["label"]} - set(label_names))
    if unknown:
        raise UsageError(f"evaluation labels {unknown} never occur in --data {data}")
    label_ids = {name: index for index, name in enumerate(label_names)}

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(batch["text"], truncation=True, max_length=seq_len, padding="max_length")
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"],
                "labels": [label_ids[str(label)] for label in batch["label"]]}

    splits = [part.map(tokenize, batched=True, batch_size=_MAP_BATCH, remove_columns=part.column_names,
                       keep_in_memory=True) for part in (records, eval_records)]
    return splits[0], splits[1], label_names


def _check_classification_columns(records, flag: str, path) -> None:
    missing = [column for column in ("text", "label") if column not in records.column_names]
    if missing:
        raise UsageError(f"{flag} {path} has columns {records.column_names}, missing {missing}; "
                         "classification data needs `text` and `label` columns")
    _require_string_columns(records, ("text",), flag, path, "")
