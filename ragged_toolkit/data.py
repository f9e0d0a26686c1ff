"""Real documents, offline, and the ways to cut them into packed batches.

Documents are ``bytes``; each byte is a token (a vocabulary of 256). A packed
batch is tokens ``(T,)`` plus offsets ``(B + 1,)``.
"""

import ast
import gc
import os
import sys
import sysconfig
from pathlib import Path

import torch

from .batches import offsets_from_lengths

__all__ = [
    "docstring_corpus",
    "as_tokens",
    "pack_documents",
    "document_targets",
    "concat_batches",
    "split_by_documents",
    "split_by_token_budget",
    "split_carrying_documents",
    "group_by_length",
]

# folders of the standard library whose files are tests, test data or installs
_NOT_LIBRARY = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def _definitions_in_order(body):
    # the modules' classes and functions, in source order, also inside if,
    # try, with and loop statements, without visiting any expression
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, name, ()):
                if isinstance(child, ast.stmt):
                    yield from _definitions_in_order([child])
                else:  # an except handler or a match case holds statements
                    yield from _definitions_in_order(child.body)


def docstring_corpus(min_chars=200, limit=3000):
    """Real text, offline: the docstrings of the modules, classes and functions
    of Python's standard library, read with ``ast`` from the ``.py`` files of
    ``sysconfig.get_paths()["stdlib"]`` (no module is imported), files in the
    order of their paths and definitions in source order, tests left out and
    duplicates dropped. Returns ``(documents, source)``: at most ``limit``
    documents of at least ``min_chars`` characters, each as UTF-8 ``bytes``,
    and a name for where they came from. Read afresh at every call (about a
    second): a page reads it once and keeps it."""
    root, files = sysconfig.get_paths()["stdlib"], []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _NOT_LIBRARY]
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    seen, documents = set(), []
    for path in sorted(files, key=lambda f: Path(f).relative_to(root).parts):
        # a syntax tree is many small objects: with torch loaded, the
        # garbage collector's passes over them would triple the time
        collecting = gc.isenabled()
        gc.disable()
        try:
            tree = ast.parse(Path(path).read_bytes())
        except (SyntaxError, ValueError):  # Python 2 examples kept as data
            continue
        finally:
            if collecting:
                gc.enable()
        for node in [tree, *_definitions_in_order(tree.body)]:
            text = ast.get_docstring(node)
            if text and len(text) >= min_chars and text not in seen:
                seen.add(text)
                documents.append(text.encode("utf-8"))
        if limit is not None and len(documents) >= limit:
            break
    version = ".".join(map(str, sys.version_info[:2]))
    return documents[:limit], f"the Python {version} standard library's docstrings"


def as_tokens(document, limit=None):
    """A document's bytes as token ids (n,) int64, cut at ``limit``."""
    return torch.frombuffer(bytearray(document[:limit]), dtype=torch.uint8).long()


def pack_documents(documents, max_len=None):
    """Documents (``bytes``) end to end as byte tokens, 0 to 255: packed
    tokens (T,) int64 and offsets (B + 1,); each cut to ``max_len`` tokens."""
    lengths = [len(d) if max_len is None else min(len(d), max_len) for d in documents]
    flat = b"".join(d[:n] for d, n in zip(documents, lengths))
    return as_tokens(flat), offsets_from_lengths(lengths)


def document_targets(tokens, offsets):
    """The token each packed position must predict: the next one in its own
    document, -100 (ignored by ``cross_entropy``) at each document's last token."""
    targets = tokens.roll(-1).clone()
    targets[offsets[1:][offsets[1:] > offsets[:-1]] - 1] = -100
    return targets


def concat_batches(batches):
    """Packed micro-batches ``[(tokens, offsets), ...]`` as one packed batch."""
    tokens = torch.cat([t for t, _ in batches])
    starts = torch.tensor([0] + [len(t) for t, _ in batches]).cumsum(0)
    starts_of = [o[:-1] + s for (_, o), s in zip(batches, starts)]
    return tokens, torch.cat([*starts_of, starts[-1:]])


def split_by_documents(tokens, offsets, n_docs):
    """Micro-batches of ``n_docs`` whole documents each (the last may have
    fewer): a list of ``(tokens, offsets)``. Their token counts vary."""
    out = []
    for i in range(0, len(offsets) - 1, n_docs):
        o = offsets[i : i + n_docs + 1]
        out.append((tokens[o[0] : o[-1]].clone(), o - o[0]))
    return out


def split_by_token_budget(tokens, offsets, budget):
    """Micro-batches of exactly ``budget`` tokens: the packed stream cut every
    ``budget`` tokens. A document that crosses a cut is cut there, and its rest
    starts the next micro-batch as a sequence of its own (it loses the
    context before the cut and the one target across it). The tail shorter
    than ``budget`` is left out. A list of ``(tokens, offsets)``."""
    out = []
    for lo in range(0, len(tokens) - budget + 1, budget):
        inner = offsets[(offsets > lo) & (offsets < lo + budget)] - lo
        o = torch.cat([offsets.new_zeros(1), inner, offsets.new_full((1,), budget)])
        out.append((tokens[lo : lo + budget].clone(), o))
    return out


def split_carrying_documents(tokens, offsets, budget):
    """Micro-batches of whole documents, at most ``budget`` tokens each: a
    document that does not fit is carried to the next micro-batch, and what
    is left of the budget is padding (documents longer than ``budget`` are
    cut to it). A list of ``(tokens, offsets)``, each shorter than ``budget``
    by its padding."""
    lengths, out, current = offsets.diff().clamp(max=budget).tolist(), [], []

    def close():
        if current:
            out.append(concat_batches(current))
            current.clear()

    for start, n in zip(offsets[:-1].tolist(), lengths):
        if sum(len(t) for t, _ in current) + n > budget:
            close()
        current.append((tokens[start : start + n], torch.tensor([0, n])))
    close()
    return out


def group_by_length(lengths, batch_size, window, rng):
    """Batches for the padded baseline a careful practitioner uses, Hugging
    Face's ``group_by_length``: the documents of each run of ``window``
    batches, in the order of ``lengths`` (a list of ints), sorted longest
    first and cut into batches of ``batch_size``, so that a batch holds
    documents of similar length and little padding; the batches then
    shuffled by ``rng`` (a seeded ``numpy.random.Generator``). Returns a
    list of batches, each a list of indices into ``lengths``."""
    batches = []
    for lo in range(0, len(lengths), batch_size * window):
        chunk = sorted(
            range(lo, min(lo + batch_size * window, len(lengths))), key=lambda i: -lengths[i]
        )
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]
