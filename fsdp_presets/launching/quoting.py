"""Values said inside generated files, so that a value stays one value: a shell word that bash
reads back as exactly that string, and comment text that stays on its comment line.

    shell_word("my data/x.jsonl")      -> 'my data/x.jsonl'
    shell_word("m\\nmain_process_ip")   -> $'m\\nmain_process_ip'     (one line, still one word)
    comment_text("m\\n#x")               -> m\\n#x                     (escaped, no line break)

``shlex.quote`` alone is not enough for a generated file: it keeps a newline inside the quotes,
which is correct for the shell but splits a ``#`` comment line in two, and the second half is
then code (a script line, or a YAML key). Every line-breaking or other unprintable character
is therefore written as an escape: ANSI-C quoting (``$'...'``, bash) for shell words,
backslash escapes for comment text. Both keep printable Unicode as it is.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

__all__ = ["comment_text", "is_one_line", "shell_join", "shell_word"]


def _escape(character: str) -> str:
    code = ord(character)
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\", "'": "\\'"}
    if character in named:
        return named[character]
    if code < 0x80:
        return f"\\x{code:02x}"
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (Python's surrogateescape): that byte again
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _unprintable(text: str) -> bool:
    return any(not character.isprintable() and character != " " for character in text)


def shell_word(text: str) -> str:
    """``text`` as one bash word on one line: ``shlex.quote`` when it is printable, else ANSI-C
    quoting (``$'...'``) with every unprintable character (newline, carriage return, the Unicode
    line separators...) escaped."""
    text = str(text)
    if not _unprintable(text):
        return shlex.quote(text)
    return "$'" + "".join(_escape(character) if character in "\\'" or (not character.isprintable()
                                                                            and character != " ")
                          else character for character in text) + "'"


def shell_join(words: Iterable[str]) -> str:
    """Words as one line of bash (:func:`shell_word` each)."""
    return " ".join(shell_word(word) for word in words)


def comment_text(text: str) -> str:
    """``text`` for a ``#`` comment line: unprintable characters as backslash escapes, so that
    nothing in it can end the comment (YAML and bash both end it at a line break)."""
    text = str(text)
    if not _unprintable(text):
        return text
    return "".join(_escape(character) if not character.isprintable() and character != " " else character
                   for character in text)


def is_one_line(text: str) -> bool:
    """True when ``text`` holds no line break of any kind that YAML or bash would honour."""
    return len(text.splitlines()) <= 1 and not _unprintable(text.replace(" ", ""))
