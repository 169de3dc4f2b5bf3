"""Bounds on a pickle, checked on its opcode stream before anything of it is unpickled.

An allow-list of types (:mod:`fsdp_presets.checkpoint.safe_unpickle`) stops a pickle from running
code, not from costing memory or depth: 36 bytes can ask an allowed ``bytearray`` for 1.5 GB, and
200 KB of allowed tuples nested 200,000 deep crash the process that later hashes or prints them.
:func:`check_pickle_bounds` walks the stream with :func:`pickletools.genops` (which reads every
argument from the file itself, so a length the file does not hold is a short read, never an
allocation) and simulates the unpickler's stack, carrying for each value how deeply it nests:

- **depth**: a value built from others is one deeper than the deepest of them; a value deeper than
  :data:`METADATA_MAX_DEPTH` is refused. To keep the count exact, a container may not be filled
  after it has gone into another one (what a pickler never writes, except for self-references,
  which DCP metadata never holds).
- **marks**: at most :data:`METADATA_MAX_DEPTH` open marks at once.
- **size**: the caller bounds the file (:data:`METADATA_MAX_BYTES`); every value the pickle builds
  is then in proportion to it, because the one allowed callable that allocates from a number,
  ``bytearray(n)``, is admitted only with bytes or text (:func:`bytearray_of_data`).
"""

from __future__ import annotations

import io
import pickletools
from typing import Any

METADATA_MAX_BYTES = 256 * 1024**2
"""Largest DCP ``.metadata`` read (256 MiB). A real index holds one entry per tensor and shard:
a 70B-parameter model on 1,024 ranks writes a few MiB."""
METADATA_MAX_DEPTH = 64
"""Deepest nesting admitted in a ``.metadata`` pickle. Real ones nest about 8 deep (Metadata ->
dict -> TensorStorageMetadata -> list -> ChunkStorageMetadata -> torch.Size -> tuple)."""

_MUTATORS = {"APPEND": 1, "SETITEM": 2, "BUILD": 1}  # pop this many, then fill the value below
_MARK_MUTATORS = {"APPENDS", "SETITEMS", "ADDITEMS"}  # pop to the mark, then fill the value below
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}


class PickleOutOfBounds(ValueError):
    """The pickle is deeper, wider or longer than the data it claims to be ever is."""


class _Value:
    """One value on the simulated stack: how deeply it nests, and whether it already went into
    another value (then its depth is final)."""

    __slots__ = ("depth", "sealed")

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.sealed = False


_MARK = object()


def check_pickle_bounds(data: bytes, *, max_depth: int = METADATA_MAX_DEPTH) -> None:
    """Raise :class:`PickleOutOfBounds` when the pickle ``data`` nests deeper than ``max_depth``,
    fills a value after using it, or is malformed (an opcode the stack cannot satisfy, a length the
    file does not hold). Costs time and memory in proportion to ``len(data)``."""
    stack: list[Any] = []
    memo: dict[int, _Value] = {}
    marks = 0

    def pop(count: int) -> list[_Value]:
        if count > len(stack) or any(item is _MARK for item in stack[len(stack) - count:]):
            raise PickleOutOfBounds("its opcodes take values the stack does not hold")
        taken = stack[len(stack) - count:] if count else []
        del stack[len(stack) - count:]
        return taken

    def pop_to_mark() -> list[_Value]:
        nonlocal marks
        for index in range(len(stack) - 1, -1, -1):
            if stack[index] is _MARK:
                taken = stack[index + 1:]
                del stack[index:]
                marks -= 1
                return taken
        raise PickleOutOfBounds("its opcodes close a mark that was never opened")

    def built_from(children: list[_Value]) -> _Value:
        for child in children:
            child.sealed = True
        value = _Value(1 + max((child.depth for child in children), default=-1))
        if value.depth > max_depth:
            raise PickleOutOfBounds(f"it nests deeper than {max_depth} levels, which DCP metadata never does")
        return value

    try:
        for opcode, argument, _ in pickletools.genops(io.BytesIO(data)):
            name = opcode.name
            if name == "MARK":
                marks += 1
                if marks > max_depth:
                    raise PickleOutOfBounds(f"it opens more than {max_depth} marks at once")
                stack.append(_MARK)
            elif name in _GETS:
                if argument not in memo:
                    raise PickleOutOfBounds(f"it refers to memo entry {argument!r}, which it never stored")
                stack.append(memo[argument])
            elif name in _PUTS or name == "MEMOIZE":
                if not stack or stack[-1] is _MARK:
                    raise PickleOutOfBounds("it stores a value the stack does not hold")
                memo[len(memo) if name == "MEMOIZE" else argument] = stack[-1]
            elif name == "DUP":
                stack.extend(pop(1) * 2)
            elif name == "POP":
                if stack and stack[-1] is _MARK:
                    pop_to_mark()
                else:
                    pop(1)
            elif name == "POP_MARK":
                pop_to_mark()
            elif name in _MUTATORS or name in _MARK_MUTATORS:
                children = pop_to_mark() if name in _MARK_MUTATORS else pop(_MUTATORS[name])
                target = pop(1)[0]
                if target.sealed:
                    raise PickleOutOfBounds("it fills a value after using it (a self-reference), which DCP "
                                            "metadata never holds")
                filled = built_from(children)
                target.depth = max(target.depth, filled.depth)
                stack.append(target)
            else:
                before = opcode.stack_before
                children = []
                if pickletools.markobject in before:
                    children = pop_to_mark()
                    children += pop(before.index(pickletools.markobject))
                else:
                    children = pop(len(before))
                if name == "STOP":
                    break
                stack.extend(built_from(children) for _ in opcode.stack_after)
    except PickleOutOfBounds:
        raise
    except Exception as error:  # genops: an unknown opcode, a length past the end of the file
        raise PickleOutOfBounds(f"it is not a well-formed pickle ({str(error)[:200]})") from None


def bytearray_of_data(*arguments: Any) -> bytearray:
    """``bytearray`` as a pickle may call it: from bytes (``bytearray(b"...")``, protocol 3 and
    later) or from text and its encoding (protocol 2), never from a number of bytes to allocate."""
    if not arguments:
        return bytearray()
    if isinstance(arguments[0], (bytes, bytearray)) and len(arguments) == 1:
        return bytearray(arguments[0])
    if isinstance(arguments[0], str) and len(arguments) == 2 and isinstance(arguments[1], str):
        return bytearray(arguments[0], arguments[1])
    import pickle

    raise pickle.UnpicklingError("it calls bytearray with something other than bytes or text (a size to "
                                 "allocate?), which DCP metadata never does")
