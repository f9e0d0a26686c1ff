"""Measured figures as the pages print them: timings one per line
(:func:`print_timings`), and tables that keep every cell readable at any
width (:class:`Table`)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from itertools import zip_longest

from ragged_site.measuring.timing import Timing
from ragged_site.records import record

__all__ = ["print_timings", "Table"]


def print_timings(results):
    """One line per entry of ``results`` (name -> ``Timing``, or the reason it
    did not run), names aligned; a name that is a tuple (job, path) is
    printed joined by commas."""
    names = {key: ", ".join(key) if isinstance(key, tuple) else key for key in results}
    width = max(map(len, names.values()), default=0)
    for key, r in results.items():
        name = names[key]
        if isinstance(r, Timing):
            line = f"  {name:{width}s} {r}"
            figures = dict(median_ms=r.median_ms, iqr_ms=r.iqr_ms, peak_mib=r.peak_mib)
            print(record("timing", line, label=name, **figures, kernels=r.kernels, runs=r.runs))
        else:
            print(
                record("timing", f"  {name:{width}s} not available: {r}", label=name, reason=str(r))
            )


@dataclass
class Table:
    """A table of a page's figures: ``header``, the column names, and
    ``rows``, each a list of cells (strings; ``"\\n"`` breaks a cell's
    line), the first cell naming the row. Where a page or a notebook shows
    the last value of a cell, it is an HTML ``<table>`` of class
    ``figures-table`` (and ``css_class``) whose cells wrap their words (the
    site's stylesheet stacks them in a narrow window), so nothing is cut off
    or hidden in a scrolling box; printed, it is text, columns aligned."""

    header: list
    rows: list
    css_class: str = ""

    def _repr_html_(self):
        def cell(tag, text, label):
            lines = "<br>".join(html.escape(line) for line in str(text).split("\n"))
            return f'<{tag} data-label="{html.escape(label)}">{lines}</{tag}>'

        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.header)
        body = "".join(
            "<tr>"
            + "".join(
                cell("th" if i == 0 else "td", c, h)
                for i, (c, h) in enumerate(zip(row, self.header))
            )
            + "</tr>"
            for row in self.rows
        )
        classes = " ".join(["figures-table", self.css_class]).strip()
        return (
            f'<table class="{classes}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
        )

    def __str__(self):
        cells = [[str(c).split("\n") for c in row] for row in [self.header, *self.rows]]
        widths = [
            max(len(line) for row in cells for line in row[i]) for i in range(len(self.header))
        ]
        out = []
        for row in cells:
            for lines in zip_longest(*row, fillvalue=""):
                out.append("  ".join(f"{line:{w}s}" for line, w in zip(lines, widths)).rstrip())
        return "\n".join(out)
