"""Documents and the ways to cut them into packed batches.

Documents are ``bytes``; each byte is a token (a vocabulary of 256). A packed
batch is tokens ``(T,)`` plus offsets ``(B + 1,)``.
"""

import torch

from .batches import offsets_from_lengths

__all__ = [
    "as_tokens",
    "pack_documents",
    "document_targets",
    "concat_batches",
    "split_by_documents",
    "split_by_token_budget",
    "split_carrying_documents",
    "group_by_length",
]


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
