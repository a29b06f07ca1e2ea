"""Plain-text tables for the bench's terminal output: one way to align them."""
from __future__ import annotations


def align(rows: list[list[str]]) -> list[str]:
    """Lines of ``rows`` (the first is the header): first column left, the others right aligned,
    the last (free text: flags, notes) left as is; a rule under the header."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [row[c].rjust(widths[c]) for c in range(1, len(row) - 1)]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths).rstrip())
    return lines
