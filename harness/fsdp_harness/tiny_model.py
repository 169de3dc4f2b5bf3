"""Tiny model folders for tests and trials: a real Hugging Face folder (config, random weights in
safetensors, a word-level tokenizer built from your text), made offline in well under a second;
and the token batches the test workers train tiny models on (:func:`counting_batch`).

    write_tiny_model("tmp/tiny-llama", kind="llama", text=Path("data/kjv_sft/train.jsonl").read_text())
    accelerate launch ... recipes/causal_lm.py --model tmp/tiny-llama ...
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Literal

Kind = Literal["llama", "llama-tied", "bert", "qwen2", "mixtral"]
KINDS = ("llama", "llama-tied", "bert", "qwen2", "mixtral")

_LLAMA_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
_BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_WORD = re.compile(r"\w+|[^\w\s]")


def _tokenizer(text: str, vocab_size: int, specials: list[str], unk: str):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    counts = Counter(_WORD.findall(text.lower()))
    words = [word for word, _ in counts.most_common(vocab_size - len(specials))]
    vocab = {token: index for index, token in enumerate(specials + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # \w+|[^\w\s]+, as _WORD above
    return tokenizer


def write_tiny_model(folder: str | os.PathLike, *, kind: Kind = "llama", text: str,
                     vocab_size: int = 512, max_positions: int = 128, num_labels: int = 2,
                     seed: int = 0) -> Path:
    """Write a tiny model of ``kind`` with a tokenizer whose vocabulary is the most frequent words
    of ``text``. Llama (and Qwen2, untied, with attention biases): hidden 64, 2 layers, 4 heads (2 key/value); Mixtral
    the same with 4 experts of which 2 per token (a mixture of experts for expert parallelism); BERT: hidden 64, 2
    layers, for sequence classification with ``num_labels`` labels."""
    import torch
    from tokenizers import processors
    from transformers import (BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                              MixtralForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    folder = Path(folder)
    torch.manual_seed(seed)
    if kind == "bert":
        backend = _tokenizer(text, vocab_size, _BERT_SPECIALS, "[UNK]")
        backend.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
            special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                            cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
        config = BertConfig(vocab_size=len(backend.get_vocab()), hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=128, max_position_embeddings=max_positions,
                            num_labels=num_labels, pad_token_id=0)
        model = BertForSequenceClassification(config)
    else:
        backend = _tokenizer(text, vocab_size, _LLAMA_SPECIALS, "<unk>")
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                            eos_token="</s>", unk_token="<unk>")
        config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                     "mixtral": (MixtralConfig, MixtralForCausalLM)}.get(kind, (LlamaConfig,
                                                                                                LlamaForCausalLM))
        experts = {"num_local_experts": 4, "num_experts_per_tok": 2} if kind == "mixtral" else {}
        config = config_class(vocab_size=len(backend.get_vocab()), hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2, tie_word_embeddings=kind == "llama-tied", **experts)
        model = model_class(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def counting_batch(step: int, *, global_batch: int, seq_len: int, vocab_size: int):
    """Token ids ``[global_batch, seq_len]`` of global batch ``step`` (1-based), the same for every
    world size (each rank takes its slice of the rows). Each row counts up modulo the vocabulary
    from its own start with a stride of 1, 2 or 3, so a tiny model has a pattern to learn (random
    tokens barely move the loss)."""
    import torch

    rows = torch.arange(global_batch * (step - 1), global_batch * step)
    starts = (rows * 7919) % vocab_size
    return (starts[:, None] + torch.arange(seq_len)[None, :] * ((rows[:, None] % 3) + 1)) % vocab_size
