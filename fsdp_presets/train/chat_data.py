"""Chat data for the causal LM recipe: a ``messages`` column, each record a conversation as a list
of ``{"role": ..., "content": ...}`` (the format of the Hugging Face chat datasets and TRL's
``SFTTrainer``), rendered with the model's own chat template. Only the assistant turns are
learned: every other token gets label -100, as the prompt of prompt/response data does.

The tokens of assistant turn k are those that rendering the conversation up to and including it
adds to rendering the turns before it with the generation prompt (``add_generation_prompt=True``,
e.g. ``<|im_start|>assistant\\n``): the turn's text and its end marker, never the template's
framing. A template that renders an earlier turn differently once later turns follow (some drop
an earlier turn's reasoning) has no such prefix, and its data is refused with the fix.

A template that writes today's date (Llama 3.2's ``strftime_now``) renders with the day the run
first started (``run.json``'s ``started_on``) instead, on every resume and every rank: the same
data gives the same token blocks on any day (:func:`rendering_template`).
"""

from __future__ import annotations

import datetime
import json
import re

from fsdp_presets.errors import UsageError, note

MESSAGES = "messages"
"""The column of chat data."""


def check_chat_data(records, tokenizer, flag: str, path) -> None:
    """Chat data needs the model's chat template (``chat_template`` in its tokenizer files), and
    each record a conversation with an assistant turn to learn; refused naming the record."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"{flag} {path} holds chat data (a `{MESSAGES}` column), but the model's tokenizer has no "
                         "chat template (no chat_template in its tokenizer files) to render it with; use the tokenizer "
                         "of the instruct model whose template the data is meant for, or give the data as `prompt` "
                         "and `response` columns")
    for index, messages in enumerate(records[MESSAGES]):
        _check_conversation(messages, f"{flag} {path}, record {index + 1}")


_TODAY = re.compile(r"""strftime_now\(\s*(['"])([^'"]*)\1\s*\)""")
"""A template's call of transformers' ``strftime_now('FORMAT')`` (today's date in FORMAT)."""


def rendering_template(tokenizer, day: str | None) -> str:
    """The chat template to render with: the tokenizer's own, or where it writes today's date
    (``strftime_now('%d %b %Y')``, Llama 3.2's and 3.3's), that template with each such call
    replaced by ``day`` (``YYYY-MM-DD``, the run's first day) in the call's format, so that a run
    resumed on another day, or ranks on both sides of midnight, render its data alike. Where the
    date cannot be fixed (no ``day``, a format that is not a literal) the template is kept and the
    run says what that does to a resume."""
    template = tokenizer.get_chat_template()
    if "strftime_now" not in template:
        return template
    if day is not None:
        moment = datetime.datetime.combine(datetime.date.fromisoformat(day), datetime.time())
        fixed = _TODAY.sub(lambda call: json.dumps(moment.strftime(call.group(2)), ensure_ascii=False), template)
        if "strftime_now" not in fixed:
            note(f"the model's chat template writes today's date into each conversation (strftime_now): it writes "
                 f"{moment:%d %b %Y}, the day this run started, on every resume, so that the data renders alike")
            return fixed
    note("the model's chat template writes today's date into each conversation (strftime_now): a run resumed "
         "on another day renders its data with that day's date, so its token blocks, and from there its steps, "
         "differ from an uninterrupted run's")
    return template


def _render(tokenizer, messages: list[dict], template: str, *, generation_prompt: bool = False) -> list[int]:
    from jinja2 import TemplateError

    try:
        # sanitize_control_tokens: a control token written in a message's text (``<|im_end|>``) is encoded
        # as that text, so that only the template itself marks where turns begin and end.
        rendered = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=False,
                                                 add_generation_prompt=generation_prompt, sanitize_control_tokens=True)
        return list(rendered)
    except TemplateError as error:  # the template's own raise_exception, e.g. Gemma's "System role not supported"
        raise UsageError(f"the conversation opening {messages[0]['content'][:40]!r}: the model's chat template refuses "
                         f"it ({error}); give the data in the form that template takes, or prompt/response "
                         "columns") from None


def _check_conversation(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: `{MESSAGES}` must be a non-empty list of {{\"role\", \"content\"}} objects")
    for turn in messages:
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            raise UsageError(f"{where}: every message needs a text `role` and a text `content` (got {turn!r:.80}); "
                             "images and tool calls are not supported by the recipe")
    if not any(turn["role"] == "assistant" for turn in messages):
        raise UsageError(f"{where}: the conversation has no assistant message, so nothing of it would be learned; "
                         "leave such records out")
    if messages[0]["role"] == "assistant":  # a template renders no conversation before it to tell it from
        raise UsageError(f"{where}: the conversation opens with an assistant message; start it with the user's "
                         "(or a system) message that the answer follows")


def tokenize_conversation(tokenizer, messages: list[dict], template: str) -> tuple[list[int], list[bool]]:
    """``(input_ids, learned)`` of one conversation (checked by :func:`check_chat_data`): the whole
    conversation rendered by ``template`` (:func:`rendering_template`), and for each token whether it
    belongs to an assistant turn."""
    ids = _render(tokenizer, messages, template)
    learned = [False] * len(ids)
    for index, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], template, generation_prompt=True)
        through = _render(tokenizer, messages[:index + 1], template)
        if through[:len(before)] != before:
            problem = "does not open the assistant's turn with its own generation prompt (e.g. it adds a <think> block)"
        elif ids[:len(through)] != through:
            problem = "renders the turn differently once later turns follow (e.g. it drops an earlier turn's reasoning)"
        else:
            learned[len(before):len(through)] = [True] * (len(through) - len(before))
            continue
        raise UsageError(f"the conversation opening {messages[0]['content'][:40]!r}, turn {index + 1} (assistant): the "
                         f"model's chat template {problem}, so the tokens of the assistant's turn cannot be told "
                         "apart; give the data as `prompt` and `response` columns, one record per assistant turn")
    return ids, learned
