"""Local training data through ``datasets``: loading, column checks, tokenization, packing and
prompt masking for the recipes.

Formats by file suffix: ``.jsonl``/``.json`` (one object per line), ``.csv``, ``.parquet``, and
anything else as plain text (one sample per line). Causal LM data has ``prompt`` and ``response``
columns (supervised fine-tuning: the prompt's tokens get label -100, so only the response is
learned), a ``messages`` column (chat: rendered with the model's chat template, only the assistant
turns learned; :mod:`fsdp_presets.train.chat_data`) or a ``text`` column (continued pre-training:
every token is learned). Classification data has ``text`` and ``label`` columns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fsdp_presets.errors import UsageError, note
from fsdp_presets.train.chat_data import MESSAGES, check_chat_data, rendering_template, tokenize_conversation

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
    if builder != "parquet":
        _check_utf8(path, flag)
    datasets.disable_progress_bars()
    try:
        records = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as error:  # datasets raises many types for unparsable files
        raise UsageError(f"{flag} {path}: cannot be read as {builder} ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from None
    if len(records) == 0:
        raise UsageError(f"{flag} {path} holds no records")
    return records


def _check_utf8(path: Path, flag: str) -> None:
    """Text formats must be UTF-8 (what ``datasets`` reads them as): name the first bad line and
    byte instead of the reader's "An error occurred while generating the dataset"."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                position = offset + error.start
                line += chunk[:error.start].count(b"\n")
                raise UsageError(f"{flag} {path} is not UTF-8 text: byte 0x{chunk[error.start]:02x} at offset "
                                 f"{position} (line {line}) cannot be decoded; convert the file to UTF-8, e.g. "
                                 f"iconv -f latin1 -t utf-8 {path} > utf8{path.suffix}") from None
            line += chunk.count(b"\n")
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise UsageError(f"{flag} {path} is not UTF-8 text: it ends inside a multi-byte character; convert the "
                         "file to UTF-8 (e.g. with iconv) or restore its end") from None


def _require_string_columns(records, columns: tuple[str, ...], flag: str, path, need: str) -> None:
    missing = [column for column in columns if column not in records.column_names]
    if missing:
        raise UsageError(f"{flag} {path} has columns {records.column_names}, missing {missing}; {need}")
    for column in columns:
        dtype = getattr(records.features[column], "dtype", None)
        if dtype != "string":
            raise UsageError(f"{flag} {path}: column {column!r} holds {dtype or records.features[column]}, "
                             "expected text")
        absent = [index for index, value in enumerate(records[column]) if value is None]
        if absent:  # a record without the key, or with null: the tokenizer would fail on it with a TypeError
            raise UsageError(f"{flag} {path}: {len(absent)} of {len(records)} records have no {column!r} (absent or "
                             f"null; the first is record {absent[0] + 1}); give every record its {column!r}, or leave "
                             "those records out")


# ---- causal language modelling ----
def causal_lm_columns(records, flag: str, path) -> tuple[str, ...]:
    """``("prompt", "response")``, ``("messages",)`` or ``("text",)``, whichever the data has."""
    names = records.column_names
    if MESSAGES in names and not {"prompt", "response"} & set(names):
        return (MESSAGES,)  # its conversations: chat_data.check_chat_data
    columns = ("prompt", "response") if "prompt" in names or "response" in names else ("text",)
    _require_string_columns(records, columns, flag, path, "causal LM data needs `prompt` and `response` columns, "
                            f"a `{MESSAGES}` column (chat), or a `text` column")
    return columns


def tokenize_causal_lm(records, tokenizer, columns: tuple[str, ...], template: str | None = None):
    """``input_ids`` and ``labels`` per record: prompt tokens masked (label -100), then the
    response (or the whole text) and the end-of-sequence token; chat: the conversation as
    ``template`` renders it (:func:`~fsdp_presets.train.chat_data.rendering_template`), only the
    assistant turns learned (their end markers are the template's)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        if columns == (MESSAGES,):
            ids, labels = [], []
            for messages in batch[MESSAGES]:
                tokens, learned = tokenize_conversation(tokenizer, messages, template)
                ids.append(tokens)
                labels.append([token if keep else IGNORE_INDEX for token, keep in zip(tokens, learned)])
            return {"input_ids": ids, "labels": labels}
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


def drop_unlearnable(tokenized, seq_len: int, name: str):
    """Unpacked samples are cut to ``seq_len`` tokens: keep those with at least one learned token
    left (a prompt that alone fills ``seq_len`` leaves none: such a sample would add nothing but a
    loss of 0), say how many were dropped and how many cut, and refuse when none is left."""
    learnable, cut, longest_prompt = [], 0, 0
    for ids, labels in zip(tokenized["input_ids"], tokenized["labels"]):
        # The first token is never a target (each position predicts the next one).
        learnable.append(any(label != IGNORE_INDEX for label in labels[1:seq_len]))
        cut += len(ids) > seq_len
        longest_prompt = max(longest_prompt, next((i for i, label in enumerate(labels) if label != IGNORE_INDEX),
                                                  len(labels)))
    dropped = learnable.count(False)
    if dropped == len(learnable):
        raise UsageError(f"{name}: with --no-packing every sample is cut to --seq-len {seq_len} tokens and the prompt "
                         f"of every sample fills them (nothing of any response would be learned, every loss 0); "
                         f"give --seq-len {longest_prompt + 1} or more (the longest prompt is {longest_prompt} tokens), shorter "
                         "prompts, or drop --no-packing")
    if dropped or cut:
        note(f"{name}: --no-packing cuts samples to --seq-len {seq_len} tokens: {cut} of {len(learnable)} were cut "
             f"(their ends are not learned), {dropped} of them dropped (the prompt alone fills --seq-len, nothing "
             "would be learned); a larger --seq-len keeps them")
    return tokenized.select([index for index, keep in enumerate(learnable) if keep]) if dropped else tokenized


def _first(records, count: int):
    """The first ``count`` records (all when ``count`` is 0)."""
    return records.select(range(min(count, len(records)))) if count else records


def causal_lm_splits(*, data: str, eval_data: str | None, eval_fraction: float, tokenizer, seq_len: int,
                     packing: bool, seed: int, max_eval_samples: int = 0, started_on: str | None = None):
    """``(train, eval)`` datasets of ``input_ids``/``labels`` (+ ``attention_mask`` unpacked);
    ``started_on``: the run's first day (``YYYY-MM-DD``), the date a chat template that writes
    today's renders."""
    records = load_records(data, "--data")
    columns = causal_lm_columns(records, "--data", data)
    template = None
    if columns == (MESSAGES,):
        check_chat_data(records, tokenizer, "--data", data)
        template = rendering_template(tokenizer, started_on)
    if eval_data is not None:
        eval_records = load_records(eval_data, "--eval-data")
        if causal_lm_columns(eval_records, "--eval-data", eval_data) != columns:
            raise UsageError(f"--eval-data {eval_data} has other columns than --data {data}")
        if columns == (MESSAGES,):
            check_chat_data(eval_records, tokenizer, "--eval-data", eval_data)
    else:
        if len(records) < 2:
            raise UsageError(f"--data {data} holds {len(records)} record; give at least 2 or an --eval-data file")
        split = records.train_test_split(test_size=eval_fraction, seed=seed)
        records, eval_records = split["train"], split["test"]
    eval_records = _first(eval_records, max_eval_samples)
    splits = []
    for name, part in (("--data", records), ("--eval-data" if eval_data else "held-out data", eval_records)):
        tokenized = tokenize_causal_lm(part, tokenizer, columns, template)
        if packing:
            shaped = pack(tokenized, seq_len)
        else:
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            shaped = pad_each(drop_unlearnable(tokenized, seq_len, name), seq_len, pad_id)
        if len(shaped) == 0:
            raise UsageError(f"{name}: too little text for one block of --seq-len {seq_len} tokens "
                             "(add data or lower --seq-len)")
        splits.append(shaped)
    return splits[0], splits[1]


# ---- sequence classification ----
def classification_splits(*, data: str, eval_data: str | None, eval_fraction: float, tokenizer,
                          seq_len: int, seed: int, max_eval_samples: int = 0,
                          head_labels: list[str] | None = None) -> tuple[Any, Any, list[str]]:
    """``(train, eval, label_names)``: ``input_ids``, ``attention_mask`` (padded to ``seq_len``)
    and integer ``labels``; label names are the sorted distinct values of the training labels, or
    ``head_labels`` (the model's trained head, see :func:`fit_head`)."""
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
    if head_labels is not None:
        label_names = fit_head(label_names, head_labels, data)
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
    dtype = getattr(records.features["label"], "dtype", None)
    if dtype not in _LABEL_DTYPES:  # a list or an object would become a class named by its repr
        raise UsageError(f"{flag} {path}: column 'label' holds {dtype or records.features['label']}, not class names "
                         "or whole numbers; give every record's label as text, or every one as a whole number")
    labels = records["label"]
    unlabelled = sum(label is None or (isinstance(label, str) and not label.strip()) for label in labels)
    if unlabelled:  # str(None) would make "None" a class of its own (a new head would learn it)
        raise UsageError(f"{flag} {path}: {unlabelled} of {len(records)} records have no label (null or blank); give "
                         "every record a label, or leave those records out")
    fractional = next((label for label in labels if isinstance(label, float) and not label.is_integer()), None)
    if fractional is not None:  # regression scores: each distinct value would become a class
        raise UsageError(f"{flag} {path}: label {fractional} is not a whole number; classification needs class "
                         "names or whole numbers (scores to regress on are not classes)")


_LABEL_DTYPES = ("string", "large_string", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "bool", "float16", "float32", "float64", "null")
"""Label column types a classification head can be numbered from (floats only when whole: see above)."""


def fit_head(data_labels: list[str], head_labels: list[str], data) -> list[str]:
    """The label numbering to train a model that already has a classification head with: the
    head's own when the data's labels are among its named labels (a label the data lacks stays
    in the head), the data's sorted labels when the head's names are placeholders (``LABEL_0``...)
    of the same count. Any other fit is refused: the head's outputs would not match the labels."""
    placeholders = head_labels == [f"LABEL_{index}" for index in range(len(head_labels))]
    unknown = [name for name in data_labels if name not in head_labels]
    if placeholders and len(data_labels) == len(head_labels):
        return data_labels
    if not placeholders and not unknown:
        missing = [name for name in head_labels if name not in data_labels]
        if missing:
            note(f"labels {missing} of the model's classification head never occur in --data {data}; they stay "
                 "in the head, untrained by this data")
        return head_labels
    fewer_more = "fewer" if len(data_labels) < len(head_labels) else "more" if len(data_labels) > len(
        head_labels) else "other"
    raise UsageError(f"--data {data} has {fewer_more} labels than the model's classification head: {len(data_labels)} "
                     f"({', '.join(data_labels[:8])}{', ...' if len(data_labels) > 8 else ''}) against "
                     f"{len(head_labels)} outputs ({', '.join(head_labels[:8])}"
                     f"{', ...' if len(head_labels) > 8 else ''}); give data with the head's labels, or pass "
                     f"--new-head to train a head for the data's {len(data_labels)} labels in place of the model's")
