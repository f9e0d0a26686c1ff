"""How long the sentences of each page's prose are, as issue 43 counts them.

Prose is the page's docstring and its text blocks (``# %%`` and the comment
lines after it). Left out: section titles, directives with their indented
content, literal blocks (after ``::``), tables and field lines
(``**Author:**``). Each bullet is a paragraph of its own. A sentence ends at
``.``, ``!`` or ``?`` followed by a space or the paragraph's end; a
paragraph's last words are a sentence even without one. A word is a
whitespace-separated token with a letter or digit in it; an inline literal
(````code````) or a role (``:doc:`page```) counts as the words of its text.

The limits (:data:`LIMITS`): median at most 15 words, 90th percentile at most
30, no sentence over 45. Standard library only::

    python scripts/sentence_lengths.py [PAGE.py ...] [--long] [--json]

``--long`` prints every sentence over 30 words, to rewrite. Exit status 1
when a page passes a limit.
"""

from __future__ import annotations

import ast
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMITS = {"median": 15, "p90": 30, "max": 45}
LONG = 30  # --long prints the sentences over this many words

ABBREVIATIONS = re.compile(r"\b(e\.g|i\.e|etc|vs|cf|al|approx)\.", re.I)
ROLE = re.compile(r":[\w:+-]+:`([^`<]*?)(?:\s*<[^`>]*>)?`")  # :doc:`text <target>` -> text
LITERAL = re.compile(r"``(.+?)``")
LINK = re.compile(r"`([^`<]+?)\s*<[^`>]+>`_+")  # `text <url>`_ -> text
BULLET = re.compile(r"^(\s*)([*+-]|\d+\.|#\.)\s+")
UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1{2,}\s*$")
TABLE = re.compile(r"^\s*([|+]|=+\s+=+)")
FIELD = re.compile(r"^:[\w -]+:(\s|$)")  # :class-card: ..., inside a directive
AUTHOR = re.compile(r"^\*\*[^*]+:\*\*")  # **Author:** ...
SENTENCE_END = re.compile(r"(?<=[.!?])[)\"'*]*\s+")


def prose_blocks(source: str) -> list[list[str]]:
    """The page's docstring and each text block, as lists of lines
    (the ``# `` of a text block taken off)."""
    tree = ast.parse(source)
    blocks = [ast.get_docstring(tree, clean=True).splitlines()] if ast.get_docstring(tree) else []
    lines = source.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "# %%":
            block = []
            i += 1
            while i < len(lines) and (lines[i].startswith("# ") or lines[i] == "#"):
                block.append(lines[i][2:])
                i += 1
            blocks.append(block)
        else:
            i += 1
    return blocks


def paragraphs(block: list[str]) -> list[str]:
    """The block's paragraphs of running text, one per bullet, with what is
    not prose left out."""
    out, current = [], []
    skip_indent = None  # inside a directive or a literal block: deeper than this

    def flush():
        if current:
            out.append(" ".join(current))
            current.clear()

    for n, line in enumerate(block):
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not line.strip() or indent > skip_indent:
                continue
            skip_indent = None
        stripped = line.strip()
        following = block[n + 1] if n + 1 < len(block) else ""
        if not stripped:
            flush()
        elif stripped.startswith(".. ") or FIELD.match(stripped):
            flush()  # a directive, a comment, a field
            skip_indent = indent
        elif UNDERLINE.match(stripped) or UNDERLINE.match(following.strip()):
            flush()  # a title or its underline
        elif TABLE.match(line) or AUTHOR.match(stripped):
            flush()
        elif BULLET.match(line):
            flush()
            current.append(BULLET.sub("", line).strip())
        else:
            current.append(stripped)
        if stripped.endswith("::") and skip_indent is None:
            text = stripped[:-2].rstrip()
            if current:
                current[-1] = current[-1][:-2].rstrip() + ("" if text == "" else ":")
            flush()
            skip_indent = indent  # the literal block that follows
    flush()
    return out


def words(sentence: str) -> int:
    return sum(1 for token in sentence.split() if re.search(r"\w", token))


def sentences(paragraph: str) -> list[str]:
    text = LINK.sub(r"\1", ROLE.sub(r"\1", paragraph))
    text = LITERAL.sub(lambda m: m.group(1).replace(".", "\u2024").replace("!", "\u01c3").replace("?", "\u0294"), text)
    text = ABBREVIATIONS.sub(lambda m: m.group(1) + "\u2024", text)
    return [s.strip() for s in SENTENCE_END.split(text) if words(s)]


def page_sentences(path: Path) -> list[str]:
    return [s for block in prose_blocks(path.read_text(encoding="utf-8")) for p in paragraphs(block)
            for s in sentences(p)]


def percentile(values: list[int], q: float) -> float:
    """The ``q`` quantile, interpolated between the closest ranks."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def measure(path: Path) -> dict:
    found = page_sentences(path)
    counts = [words(s) for s in found]
    if not counts:
        return {"page": path.stem, "sentences": 0, "median": 0, "p90": 0, "max": 0, "long": [], "fails": []}
    result = {"page": path.stem, "sentences": len(counts), "median": statistics.median(counts),
              "p90": round(percentile(counts, 0.9), 1), "max": max(counts),
              "long": [s for s in found if words(s) > LONG]}
    result["fails"] = [f"{key} {result[key]} > {limit}" for key, limit in LIMITS.items() if result[key] > limit]
    return result


def main(argv: list[str]) -> int:
    show_long, as_json = "--long" in argv, "--json" in argv
    pages = [Path(a) for a in argv if not a.startswith("--")] or sorted((REPO / "tutorials").glob("*.py"))
    results = [measure(p) for p in pages]
    if as_json:
        print(json.dumps(results, indent=1))
    else:
        print(f"{'page':40s} {'sentences':>9s} {'median':>6s} {'p90':>5s} {'max':>4s}  (limits "
              + ", ".join(f"{k} {v}" for k, v in LIMITS.items()) + ")")
        for r in results:
            verdict = "ok" if not r["fails"] else "over: " + "; ".join(r["fails"])
            print(f"{r['page']:40s} {r['sentences']:9d} {r['median']:6.1f} {r['p90']:5.1f} {r['max']:4d}  {verdict}")
            if show_long:
                for s in r["long"]:
                    print(f"    [{words(s)}] {s}")
    return 1 if any(r["fails"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
