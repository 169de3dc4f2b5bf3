"""Plain-text tables for the commands' human output (``inspect``, ``plan``,
``rehearse``): fixed-width columns, numbers right-aligned, no trailing spaces. Counts and bytes are
formatted by :mod:`fsdp_presets.fileio`."""

from __future__ import annotations


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
