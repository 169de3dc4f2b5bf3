"""Data position, weight-decay groups, data loading/masking/packing, run-folder checks and the launch
against the preset header."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_presets.numerics import param_groups
from fsdp_presets.train import loop
from fsdp_presets.train.data import IGNORE_INDEX, causal_lm_splits, classification_splits
from fsdp_presets.errors import UsageError
from fsdp_presets.checkpoint.run_folder import RunInfo, check_output_dir
from recipe_helpers import tiny_bert, tiny_llama

REPO = Path(__file__).resolve().parents[1]


def global_order(stream, *, steps, micro, accumulation, dp, start=0):
    """The samples each optimizer step trains on, in (micro-step, rank) order, over all ranks."""
    order, consumed = [], start
    for _ in range(steps):
        step = []
        per_rank = [loop.rank_micro_batches(stream, samples_consumed=consumed, micro_batch_size=micro,
                                                accumulation_steps=accumulation, rank=rank,
                                                data_parallel_size=dp) for rank in range(dp)]
        for micro_step in range(accumulation):
            for rank in range(dp):
                step += per_rank[rank][micro_step]
        order.append(step)
        consumed += micro * accumulation * dp
    return order


def test_data_position_is_the_same_for_every_split_of_the_global_batch():
    stream = loop.SampleStream(37, seed=5)
    one_rank = global_order(stream, steps=12, micro=8, accumulation=1, dp=1)
    for micro, accumulation, dp in ((4, 1, 2), (2, 2, 2), (1, 2, 4), (2, 4, 1)):
        assert global_order(stream, steps=12, micro=micro, accumulation=accumulation, dp=dp) == one_rank
    # each epoch is a permutation: 37 samples x 2 epochs, every sample exactly twice in the first 74
    flat = [index for step in one_rank for index in step]
    assert sorted(flat[:74]) == sorted(list(range(37)) * 2)
    assert flat[:37] != list(range(37))  # shuffled
    # resuming at a sample count continues the same stream, whatever the new split
    resumed = global_order(stream, steps=6, micro=2, accumulation=1, dp=4, start=6 * 8)
    assert resumed == one_rank[6:]
    assert loop.SampleStream(37, seed=6).indices(0, 37) != stream.indices(0, 37)


def test_eval_batches_cover_each_sample_once_with_equal_batches_on_every_rank():
    for samples, micro, dp in ((10, 2, 2), (7, 3, 2), (1, 4, 3)):
        per_rank = [loop.eval_micro_batches(samples, micro_batch_size=micro, rank=rank, data_parallel_size=dp)
                    for rank in range(dp)]
        assert len({len(batches) for batches in per_rank}) == 1
        assert all(len(batch) == micro for batches in per_rank for batch in batches)
        counted = sorted(index for batches in per_rank for batch in batches for index, counts in batch if counts)
        assert counted == list(range(samples))


def test_weight_decay_skips_norms_biases_and_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model = AutoModelForCausalLM.from_pretrained(tiny_llama(tmp_path / "llama", tied=True))
    decay, plain = param_groups(model, 0.1)
    names = {id(param): name for name, param in model.named_parameters()}
    plain_names = {names[id(param)] for param in plain["params"]}
    decay_names = {names[id(param)] for param in decay["params"]}
    assert decay["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert "model.embed_tokens.weight" in plain_names  # tied with lm_head: listed once
    assert len(plain["params"]) + len(decay["params"]) == len(list(model.parameters()))
    assert all("norm" in name or "embed" in name for name in plain_names)
    assert all(name.endswith(".weight") and "norm" not in name for name in decay_names)
    assert "model.layers.0.self_attn.q_proj.weight" in decay_names
    bert = AutoModelForSequenceClassification.from_pretrained(tiny_bert(tmp_path / "bert"))
    decay, plain = param_groups(bert, 0.1)
    names = {id(param): name for name, param in bert.named_parameters()}
    plain_names = {names[id(param)] for param in plain["params"]}
    assert {"bert.embeddings.word_embeddings.weight", "bert.embeddings.LayerNorm.weight",
            "classifier.bias", "bert.encoder.layer.0.attention.self.query.bias"} <= plain_names
    assert "classifier.weight" in {names[id(param)] for param in decay["params"]}


def test_the_float64_norm_waits_on_the_device_once_per_step_not_once_per_slice(monkeypatch):
    """Every step's norm is summed slice by slice; moving each slice's square to the host would make
    a GPU wait (and idle) once per slice. Counted with a torch function mode: no ``.cpu()`` and no
    ``.item()`` inside, and the sum is the float64 sum of squares."""
    import torch
    from torch.overrides import TorchFunctionMode

    from fsdp_presets import numerics

    monkeypatch.setattr(numerics, "NORM_SLICE", 7)  # 13 slices of the weight, 2 of the bias
    layer = torch.nn.Linear(10, 9)
    for param in layer.parameters():
        param.grad = torch.randn_like(param)

    class HostWaits(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("cpu", "item", "tolist", "__float__", "numpy"):
                self.calls.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with HostWaits() as mode:
        (squares, groups), = numerics.local_square_sums(layer)[0]
    assert mode.calls == [] and groups == []
    expected = sum(torch.dot(p.grad.double().flatten(), p.grad.double().flatten()) for p in layer.parameters())
    assert squares.dtype == torch.float64 and float(squares) == pytest.approx(float(expected), rel=1e-15)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama(tmp_path_factory.mktemp("tok") / "llama"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_router_loss_asked_for_without_its_weight_is_refused_with_the_fix():
    from types import SimpleNamespace

    from fsdp_presets.train.model_setup import router_balance_weight

    def model(**config):
        return SimpleNamespace(config=SimpleNamespace(**config))

    assert router_balance_weight(model(output_router_logits=False, router_aux_loss_coef=0.01)) is None
    assert router_balance_weight(model(output_router_logits=True, router_aux_loss_coef=0.01)) == 0.01
    with pytest.raises(UsageError, match="router_aux_loss_coef in its config.json, or output_router_logits: false"):
        router_balance_weight(model(output_router_logits=True))


def test_prompt_tokens_are_masked_and_samples_packed(tmp_path, tokenizer):
    rows = [{"prompt": "which part : and god said", "response": " law"}] * 6
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    train, held_out = causal_lm_splits(data=data, eval_data=data, eval_fraction=0.1, tokenizer=tokenizer,
                                       seq_len=8, packing=True, seed=0)
    prompt = tokenizer("which part : and god said")["input_ids"]
    response = tokenizer(" law", add_special_tokens=False)["input_ids"]
    sample = prompt + response + [tokenizer.eos_token_id]
    stream_ids = [token for row in train["input_ids"] for token in row]
    stream_labels = [token for row in train["labels"] for token in row]
    assert all(len(row) == 8 for row in train["input_ids"]) and len(train) == len(sample) * 6 // 8
    assert stream_ids == (sample * 6)[:len(stream_ids)]
    expected = [IGNORE_INDEX] * len(prompt) + response + [tokenizer.eos_token_id]
    assert stream_labels == (expected * 6)[:len(stream_labels)]
    unpacked, _ = causal_lm_splits(data=data, eval_data=data, eval_fraction=0.1, tokenizer=tokenizer,
                                   seq_len=16, packing=False, seed=0)
    assert unpacked[0]["labels"] == expected + [IGNORE_INDEX] * (16 - len(sample))
    assert unpacked[0]["attention_mask"] == [1] * len(sample) + [0] * (16 - len(sample))


# A ChatML template (SmolLM2's and Qwen's framing) with a default system turn, as instruct models ship.
CHATML = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nbe brief<|im_end|>\n{% endif %}"
          "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [{"role": "user", "content": "who said it"}, {"role": "assistant", "content": "and god said"},
                {"role": "user", "content": "and then"}, {"role": "assistant", "content": "let there be light"}]


@pytest.fixture
def chat_tokenizer(tokenizer):
    chat = copy.deepcopy(tokenizer)
    chat.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chat.chat_template = CHATML
    return chat


def test_chat_data_learns_the_assistant_turns_only(tmp_path, chat_tokenizer):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 4)
    train, _ = causal_lm_splits(data=data, eval_data=data, eval_fraction=0.1, tokenizer=chat_tokenizer, seq_len=64,
                                packing=False, seed=0)
    ids, labels, mask = train[0]["input_ids"], train[0]["labels"], train[0]["attention_mask"]
    rendered = chat_tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert ids[:sum(mask)] == rendered  # the whole conversation as its template renders it
    learned = [(position, token) for position, token in enumerate(labels) if token != IGNORE_INDEX]
    runs = [[]]  # the learned tokens, split where they stop being contiguous
    for (position, token), previous in zip(learned, [None] + learned):
        if previous is not None and position != previous[0] + 1:
            runs.append([])
        runs[-1].append(token)
    # Each assistant turn with its end marker, nothing of the framing, the user turns or the system turn.
    assert runs == [chat_tokenizer(f"{answer}<|im_end|>\n", add_special_tokens=False)["input_ids"]
                    for answer in ("and god said", "let there be light")]
    # A control token written in a message is its text: only the template marks the turns' ends.
    injected = [{**CONVERSATION[0], "content": "who said <|im_end|> it"}, *CONVERSATION[1:]]
    data = write_jsonl(tmp_path / "injected.jsonl", [{"messages": injected}] * 4)
    train, _ = causal_lm_splits(data=data, eval_data=data, eval_fraction=0.1, tokenizer=chat_tokenizer, seq_len=64,
                                packing=False, seed=0)
    assert train[0]["input_ids"].count(chat_tokenizer.convert_tokens_to_ids("<|im_end|>")) == 5  # system + 4 turns


def test_chat_data_under_a_template_that_writes_the_date_renders_the_runs_first_day(tmp_path, chat_tokenizer, capsys):
    """Llama 3.2's template writes today's date (strftime_now): the run renders the day it first
    started instead, so a resume on another day tokenizes alike; where that day is unknown, or the
    template's format is not a literal, the run says what a resume on another day does."""
    from fsdp_presets.train.chat_data import rendering_template

    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 4)

    def first_ids(template, started_on):
        chat_tokenizer.chat_template = template
        train, _ = causal_lm_splits(data=data, eval_data=data, eval_fraction=0.1, tokenizer=chat_tokenizer, seq_len=64,
                                    packing=False, seed=0, started_on=started_on)
        return train[0]["input_ids"][:sum(train[0]["attention_mask"])], capsys.readouterr().out

    ids, out = first_ids(CHATML, "2024-07-26")
    assert ids == chat_tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert "date" not in out
    dated = CHATML.replace("be brief", "today is {{ strftime_now('%d %b %Y') }}")  # as Llama 3.2's
    ids, out = first_ids(dated, "2024-07-26")
    chat_tokenizer.chat_template = CHATML.replace("be brief", "today is 26 Jul 2024")
    assert ids == chat_tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert "it writes 26 Jul 2024, the day this run started, on every resume" in out
    chat_tokenizer.chat_template = dated
    for day, text in (("2024-07-26", "today is 26 Jul 2024"), ("2025-01-02", "today is 02 Jan 2025")):
        fixed = rendering_template(chat_tokenizer, day)
        assert text in chat_tokenizer.apply_chat_template(CONVERSATION, chat_template=fixed, tokenize=False)
    unfixable = dated.replace("{{ strftime_now('%d %b %Y') }}", "{% set shown = '%d %b %Y' %}{{ strftime_now(shown) }}")
    for template, started_on in ((dated, None), (unfixable, "2024-07-26")):
        _, out = first_ids(template, started_on)
        assert "a run resumed on another day renders its data with that day's date" in out


def test_trl_renders_chat_data_with_the_day_the_callback_gives(tmp_path, tokenizer, chat_tokenizer):
    """recipes/sft_trainer.py (and a user's TRL script): TRL tokenizes at SFTTrainer(...), so the script
    sets the template from FSDPPresetsCallback.first_day (run.json's started_on, kept by a resume;
    a new run: today) before it, and the conversation renders that day."""
    import datetime
    import types

    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from fsdp_presets import FSDPPresetsCallback
    from fsdp_presets.checkpoint.layout import RunFolder
    from fsdp_presets.checkpoint.run_folder import RunInfo
    from fsdp_presets.train.chat_data import rendering_template

    output = tmp_path / "run"
    callback = types.SimpleNamespace()  # the method alone: the callback's constructor switches the process to CPU FSDP
    assert FSDPPresetsCallback.first_day(callback, output) == datetime.date.today().isoformat()  # a new run
    RunInfo(identity={"recipe": "SFTTrainer"}, started_on="2024-07-26").write(RunFolder(root=output))
    assert FSDPPresetsCallback.first_day(callback, output) == "2024-07-26" == callback._first_day
    assert FSDPPresetsCallback.first_day(callback, output, "none") == datetime.date.today().isoformat()

    # a template that writes by the date, in words of the tiny tokenizer's vocabulary
    chat_tokenizer.chat_template = CHATML.replace(
        "be brief", "{% if strftime_now('%Y') == '2024' %}the first day{% else %}and it was so{% endif %}")
    chat_tokenizer.chat_template = rendering_template(chat_tokenizer, FSDPPresetsCallback.first_day(callback, output))
    model = AutoModelForCausalLM.from_pretrained(tokenizer.name_or_path)
    model.resize_token_embeddings(len(chat_tokenizer))
    config = SFTConfig(output_dir=str(output), max_length=64, report_to=[], use_cpu=True)
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list([{"messages": CONVERSATION}] * 2),
                         processing_class=chat_tokenizer)
    text = chat_tokenizer.decode(trainer.train_dataset[0]["input_ids"])
    assert "the first day" in text and "and it was so" not in text


def test_a_continued_run_keeps_the_day_it_first_started(tmp_path):
    from fsdp_presets.checkpoint.layout import RunFolder, step_folder
    from fsdp_presets.checkpoint.run_folder import RunInfo, first_day, read_run_info

    first, other = RunFolder(root=tmp_path / "run"), RunFolder(root=tmp_path / "other")
    assert first_day(first, "auto") is None  # a new run: today's (recipe.start)
    RunInfo(identity={"recipe": "causal_lm"}, started_on="2024-07-26").write(first)
    assert read_run_info(first.root).started_on == "2024-07-26"
    assert first_day(first, "auto") == "2024-07-26"
    checkpoint = step_folder(first.checkpoints, 2)
    checkpoint.mkdir(parents=True)
    assert first_day(other, str(checkpoint)) == "2024-07-26"  # --resume PATH: the run that saved it
    assert first_day(other, "auto") is None


@pytest.mark.parametrize("case, rows, template, message", [
    ("no template", [{"messages": CONVERSATION}], None, "has no chat template .* or give the data as `prompt`"),
    ("no assistant", [{"messages": CONVERSATION[:1]}], CHATML, "record 1: the conversation has no assistant message"),
    ("opens with assistant", [{"messages": CONVERSATION[1:]}], CHATML, "opens with an assistant message"),
    ("content not text", [{"messages": [{"role": "user", "content": 3}, CONVERSATION[1]]}], CHATML,
     "a text `role` and a text `content`"),
    # A template that leaves earlier answers out once a later turn follows (as reasoning templates do):
    ("earlier turn re-rendered", [{"messages": CONVERSATION}],
     CHATML.replace("{{ message['content'] }}", "{% if message['role'] != 'assistant' or loop.last %}"
                    "{{ message['content'] }}{% endif %}"),
     "turn 2 \\(assistant\\): .* renders the turn differently once later"),
    ("template refuses", [{"messages": [{"role": "system", "content": "be brief"}, *CONVERSATION]}],
     CHATML.replace("{% for message in messages %}", "{% for message in messages %}{% if message['role'] == 'system' %}"
                    "{{ raise_exception('System role not supported') }}{% endif %}"),
     "the model's chat template refuses it \\(System role not supported\\)"),
    ("generation prompt not the turn's opening", [{"messages": CONVERSATION}],
     CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\nso {% endif %}"),
     "does not open the assistant's turn with its own generation prompt"),
])
def test_chat_data_a_tokenizer_cannot_render_is_refused_with_the_fix(tmp_path, chat_tokenizer, case, rows, template,
                                                                     message):
    chat_tokenizer.chat_template = template
    data = write_jsonl(tmp_path / "chat.jsonl", rows * 3)
    with pytest.raises(UsageError, match=message):
        causal_lm_splits(data=data, eval_data=data, eval_fraction=0.1, tokenizer=chat_tokenizer, seq_len=64,
                         packing=True, seed=0)


def test_text_data_learns_every_token_and_plain_text_loads(tmp_path, tokenizer):
    text = tmp_path / "book.txt"
    text.write_text("in the beginning god created the heaven and the earth .\n" * 20)
    train, held_out = causal_lm_splits(data=str(text), eval_data=None, eval_fraction=0.1, tokenizer=tokenizer,
                                       seq_len=8, packing=True, seed=0)
    assert train["input_ids"] == train["labels"] and len(held_out) >= 1


@pytest.mark.parametrize("content, message", [
    ('{"question": "a", "answer": "b"}\n', r"has columns \['question', 'answer'\], missing \['text'\]"),
    ('{"prompt": "a"}\n{"prompt": "b"}\n', r"missing \['response'\]"),
    ('{"text": 3}\n{"text": 4}\n', "column 'text' holds int64, expected text"),
    ("", "is empty"),
    ("[]", "holds no records|cannot be read"),
], ids=["wrong-columns", "prompt-only", "numbers", "empty", "no-records"])
def test_bad_causal_lm_data_is_a_usage_error(tmp_path, tokenizer, content, message):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        causal_lm_splits(data=str(path), eval_data=None, eval_fraction=0.5, tokenizer=tokenizer, seq_len=8,
                         packing=True, seed=0)


def test_too_little_text_for_one_block(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "short.jsonl", [{"text": "god said"}] * 2)
    with pytest.raises(UsageError, match="too little text for one block of --seq-len 64"):
        causal_lm_splits(data=data, eval_data=data, eval_fraction=0.1, tokenizer=tokenizer, seq_len=64,
                         packing=True, seed=0)


def test_classification_labels_are_numbered_in_sorted_order(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert(tmp_path / "bert"))
    rows = [{"text": "and god said", "label": "law"}, {"text": "blessed are the poor", "label": "gospels"}] * 4
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    train, held_out, names = classification_splits(data=data, eval_data=data, eval_fraction=0.1,
                                                   tokenizer=tokenizer, seq_len=12, seed=0)
    assert names == ["gospels", "law"] and train["labels"][:2] == [1, 0]
    assert len(train[0]["input_ids"]) == 12 and train[0]["input_ids"][0] == tokenizer.cls_token_id
    bad_eval = write_jsonl(tmp_path / "eval.jsonl", [{"text": "x", "label": "poetry"}])
    with pytest.raises(UsageError, match=r"evaluation labels \['poetry'\] never occur"):
        classification_splits(data=data, eval_data=bad_eval, eval_fraction=0.1, tokenizer=tokenizer,
                              seq_len=12, seed=0)
    no_label = write_jsonl(tmp_path / "nolabel.jsonl", [{"text": "x"}])
    with pytest.raises(UsageError, match=r"missing \['label'\]"):
        classification_splits(data=no_label, eval_data=None, eval_fraction=0.1, tokenizer=tokenizer,
                              seq_len=12, seed=0)


IDENTITY = {"recipe": "causal_lm", "model": "/m", "data_sha256": "d", "seed": 1, "seq_len": 64}


def test_output_dir_holding_another_run_is_refused(tmp_path):
    assert check_output_dir(tmp_path / "new", IDENTITY, "auto").root == tmp_path / "new"
    assert not (tmp_path / "new").exists()
    run = check_output_dir(tmp_path / "run", IDENTITY, "auto")
    RunInfo(identity=IDENTITY).write(run)
    assert check_output_dir(tmp_path / "run", IDENTITY, "auto") == run  # same run: resume
    with pytest.raises(UsageError, match="already holds this run; pass --resume auto"):
        check_output_dir(tmp_path / "run", IDENTITY, "none")
    with pytest.raises(UsageError, match="holds another run .*seed 1 there, 2 now"):
        check_output_dir(tmp_path / "run", {**IDENTITY, "seed": 2}, "auto")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty and holds no run"):
        check_output_dir(tmp_path / "notes", IDENTITY, "auto")


def _launched(processes: int, distributed_type: str = "FSDP", fsdp_version: int = 2, precision: str = "no"):
    """What :func:`preset_launch_problem` reads of an ``Accelerator``: the launch as accelerate runs it."""
    from types import SimpleNamespace

    return SimpleNamespace(num_processes=processes, distributed_type=SimpleNamespace(value=distributed_type),
                           state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version)),
                           mixed_precision=precision)


def test_a_launch_other_than_the_preset_header_planned_is_named_with_its_fix(tmp_path):
    from fsdp_presets.train.startup import preset_launch_problem

    fsdp2, ddp = REPO / "accelerate_configs" / "cpu_fsdp2_demo.yaml", REPO / "accelerate_configs" / "cpu_ddp_demo.yaml"
    assert preset_launch_problem(_launched(2), str(fsdp2)) is None  # as generated: 2 processes, FSDP2, fp32
    assert preset_launch_problem(_launched(2, "MULTI_CPU"), str(ddp)) is None
    problem = preset_launch_problem(_launched(4, precision="bf16"), str(fsdp2))
    assert problem.startswith(f"{fsdp2} was generated for 2 processes, launched 4; mixed_precision no, launched bf16")
    assert f"fsdp-presets generate --from {fsdp2} --gpus 4 --precision bf16 -o NEW.yaml" in problem
    # A resume keeps its checkpoint's global batch: another process count alone is how it moves GPUs.
    assert preset_launch_problem(_launched(4), str(fsdp2), resuming=True) is None
    assert "mixed_precision no, launched bf16" in preset_launch_problem(_launched(4, precision="bf16"), str(fsdp2),
                                                                        resuming=True)
    assert "FSDP2, launched FSDP1" in preset_launch_problem(_launched(2, fsdp_version=1), str(fsdp2))
    assert "DDP, launched FSDP2" in preset_launch_problem(_launched(2), str(ddp))
    assert "its FSDP preset's `fsdp-presets generate` command with --gpus 1" in \
        preset_launch_problem(_launched(1, "NO"), str(ddp))
    # Not a generated preset (no `# fsdp-presets:` line), or no config file: nothing to compare.
    plain = tmp_path / "plain.yaml"
    plain.write_text("".join(line + "\n" for line in fsdp2.read_text().splitlines() if not line.startswith("#")))
    assert preset_launch_problem(_launched(4), str(plain)) is None
    assert preset_launch_problem(_launched(4), None) is None


@pytest.mark.parametrize("name", ["cosine", "linear", "constant_with_warmup"])
@pytest.mark.parametrize("warmup, total", [(0, 20), (3, 20), (5, 5), (0, 1)])
def test_lr_schedule_equals_transformers_get_scheduler_at_every_step(name, warmup, total):
    import torch
    from transformers import get_scheduler

    def learning_rates(make) -> list[float]:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-4)
        scheduler = make(optimizer)
        seen = []
        for _ in range(total + 3):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    ours = learning_rates(lambda opt: loop.lr_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total))
    theirs = learning_rates(lambda opt: get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total))
    assert ours == theirs  # float for float


def test_a_schedule_loaded_from_a_checkpoint_sets_its_own_rate_at_the_saved_step():
    """Resumed with the same --max-steps the rate is the saved one, float for float; with another,
    the new schedule's at the resumed step (the checkpoint's optimizer holds the old schedule's rate
    for the next step, which the first resumed step would otherwise take)."""
    import torch

    def run(total: int, steps: int, state=None):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        scheduler = loop.lr_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=total)
        if state is not None:  # as accelerate's load_state: the optimizer, then the scheduler
            optimizer.load_state_dict(state[0])
            scheduler.load_state_dict(state[1])
        for _ in range(steps):
            optimizer.step()
            scheduler.step()
        return optimizer, scheduler

    saved = run(4, 2)
    state = (saved[0].state_dict(), saved[1].state_dict())
    continued = run(4, 3)[0].param_groups[0]["lr"]
    assert run(4, 1, state)[0].param_groups[0]["lr"] == continued  # the same schedule: the same float
    longer_optimizer, longer = run(8, 0, state)
    assert longer_optimizer.param_groups[0]["lr"] == longer.get_last_lr()[0] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 2 / 8)))
    assert saved[0].param_groups[0]["lr"] == pytest.approx(5e-4)  # what the checkpoint held


def test_recipe_imports_leave_peft_and_bitsandbytes_out():
    """A full-training launch pays no LoRA imports (3-4 s of CPU per process when installed)."""
    code = ("import sys, runpy; sys.argv = ['causal_lm.py', '--help']\n"
            "try:\n    runpy.run_path('recipes/causal_lm.py', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in ('peft', 'bitsandbytes', 'torch._inductor') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


# Every flag the recipes had before their shared parts moved to fsdp_presets.train.recipe (the earlier
# spellings --micro-batch-size, --gradient-accumulation-steps and --load-in-4bit included), and the
# spellings they share with fsdp-presets since.
FLAGS_OF_BOTH = {"--model", "--data", "--eval-data", "--eval-fraction", "--max-eval-samples", "--output-dir",
                 "--max-steps", "--micro-batch-size", "--gradient-accumulation-steps", "--reduce-every-micro-batch",
                 "--micro-batch", "--grad-accum", "--method",
                 "--learning-rate", "--weight-decay", "--warmup-steps", "--lr-scheduler", "--max-grad-norm",
                 "--seq-len", "--eval-every", "--save-every", "--keep-last", "--resume", "--seed", "--lora-r",
                 "--lora-alpha", "--lora-dropout", "--lora-target-modules", "--load-in-4bit", "--export-merged"}


def test_both_recipes_have_the_same_shared_flags_and_only_their_own_besides():
    """One parser for the shared flags; each recipe adds only what is its data's (no flag of
    earlier versions lost or renamed; --fsdp-reduce-dtype, once causal_lm's, is both's). The
    classification recipe imports no ``evaluate`` (seconds of CPU per process)."""
    import ast

    code = ("import argparse, runpy, sys\n"
            "def grab(self, *args, **kwargs):\n"
            "    print(sorted(o for a in self._actions for o in a.option_strings if o.startswith('--')))\n"
            "    raise SystemExit(0)\n"
            "argparse.ArgumentParser.parse_args = grab\n"
            "sys.argv = ['recipe']\n"
            "try:\n    runpy.run_path(SCRIPT, run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('evaluate' in sys.modules)")
    flags = {}
    for script in ("recipes/causal_lm.py", "recipes/sequence_classification.py"):
        result = subprocess.run([sys.executable, "-c", code.replace("SCRIPT", repr(script))], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        *_, options, imported_evaluate = result.stdout.strip().splitlines()
        assert imported_evaluate == "False"
        flags[Path(script).name] = set(ast.literal_eval(options)) - {"--help"}
    shared = {option for action in loop.recipe_argument_parser("")._actions for option in action.option_strings
              if option.startswith("--")} - {"--help"}
    assert FLAGS_OF_BOTH | {"--fsdp-reduce-dtype"} <= shared
    assert flags["causal_lm.py"] - shared == {"--no-packing"}
    assert flags["sequence_classification.py"] - shared == {"--new-head"}
    assert shared <= flags["causal_lm.py"] and shared <= flags["sequence_classification.py"]
