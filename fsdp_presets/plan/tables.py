"""Plain-text tables and counts for the commands' human output (``inspect``, ``plan``,
``rehearse``): fixed-width columns, numbers right-aligned, no trailing spaces."""

from __future__ import annotations


def human_count(count: int) -> str:
    """``70.55 B``, ``26.8 K``: a parameter count at a glance."""
    for size, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(count) >= size:
            return f"{count / size:.2f} {suffix}"
    return str(count)


def text_table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """The lines of a table: each column as wide as its widest cell, the columns whose index is in
    ``right`` right-aligned, two spaces between columns."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            str(cell).rjust(width) if index in right else str(cell).ljust(width)
            for index, (cell, width) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(headers)] + [line(row) for row in rows]
