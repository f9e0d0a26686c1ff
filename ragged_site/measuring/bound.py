"""The work bound: the work the padded side does over the work the ragged
side does, each counted for what it computes. A speedup is printed beside
it, with the fraction of it reached (the page ``measuring_ragged_batches``
says what that fraction means)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ragged_site.measuring.noise import outside_noise
from ragged_site.records import record

__all__ = [
    "Work",
    "attention_layer_work",
    "model_work",
    "pairs_scored",
    "work_bound",
    "work_per_token",
    "generation_work",
    "speedup_line",
    "fraction_verdict",
    "throughput_line",
]


@dataclass(frozen=True)
class Work:
    """What a model or layer computes, in FLOPs: per query token through its
    matrices, per key/value token (cross-attention's keys and values), and
    per query-key pair its attention scores and sums over values."""

    per_token: float
    per_pair: float
    per_kv_token: float = 0.0


def attention_layer_work(embed, cross=False):
    """The :class:`Work` of one multi-head attention layer of width ``embed``:
    ``2 E^2`` per projection per token (q, k, v and out; cross-attention
    projects k and v from the context's tokens) and ``4 E`` per pair (the
    score ``q . k`` and the sum over values, ``2 E`` each)."""
    if cross:
        return Work(per_token=4 * embed**2, per_kv_token=4 * embed**2, per_pair=4 * embed)
    return Work(per_token=8 * embed**2, per_pair=4 * embed)


def model_work(model, *, n_layers, attention_width):
    """The :class:`Work` of a decoder (the site's ``GPT`` or a Hugging Face
    model): ``2`` FLOPs per parameter per token for every weight but the
    embedding tables (a lookup, no arithmetic), and ``4 x attention_width``
    per pair in each of ``n_layers`` layers (``attention_width``: query
    heads times head size)."""
    lookups = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    weights = sum(p.numel() for p in model.parameters())
    return Work(per_token=2.0 * (weights - lookups), per_pair=4.0 * n_layers * attention_width)


def pairs_scored(q_lengths, kv_lengths, causal):
    """Query-key pairs a kernel scores: the causal half, L(L+1)/2 per sequence,
    when it skips the masked half, else every pair."""
    q, kv = torch.as_tensor(q_lengths).double(), torch.as_tensor(kv_lengths).double()
    return float((q * (q + 1) / 2 if causal else q * kv).sum())


def work_bound(q_lengths, kv_lengths=None, *, work, causal=False, padded_causal=None):
    """The work of the padded batch over the work of the ragged batch, both
    counted with ``work`` (a :class:`Work`). ``padded_causal``: whether the
    padded side skips the masked half of the scores (a causal kernel) or
    computes the whole square (a merged mask); default ``causal``."""
    q = torch.as_tensor(q_lengths)
    kv = q if kv_lengths is None else torch.as_tensor(kv_lengths)
    padded_causal = causal if padded_causal is None else padded_causal

    def total(ql, kvl, c):
        return (
            work.per_token * float(ql.sum())
            + work.per_kv_token * float(kvl.sum())
            + work.per_pair * pairs_scored(ql, kvl, c)
        )

    full_q, full_kv = torch.full_like(q, int(q.max())), torch.full_like(kv, int(kv.max()))
    return total(full_q, full_kv, padded_causal) / total(q, kv, causal)


def work_per_token(batches, work, *, padded=False, causal=True):
    """The work of training steps per real token: one step per entry of
    ``batches`` (each a (B,) tensor of sequence lengths), counted with
    ``work``. Packed (``padded`` False), each sequence as it is, its causal
    half; padded, each batch padded to its longest sequence, the causal half
    where ``causal`` (a causal kernel), else every pair (a merged mask). Two
    trainers' work per token, divided, is the work bound of their tokens per
    second, even when they batch other documents (a length-grouped baseline)."""
    total = tokens = 0.0
    for n in batches:
        if (
            padded
        ):  # every sequence as long as the longest; the causal half only with a causal kernel
            n_padded = torch.full_like(n, int(n.max()))
            total += work.per_token * float(n_padded.sum()) + work.per_pair * pairs_scored(
                n_padded, n_padded, causal
            )
        else:  # the causal half of each sequence
            total += work.per_token * float(n.sum()) + work.per_pair * pairs_scored(n, n, True)
        tokens += float(n.sum())
    return total / tokens


def generation_work(prompt_lengths, n_new, work, *, cache=True):
    """The work of ``n_new`` greedy tokens for each prompt of
    ``prompt_lengths`` (B,), counted with ``work``. With a KV cache: the
    packed prefill (each prompt's causal half), then ``n_new - 1`` steps of
    one token per sequence, each scoring the keys its sequence has then.
    Without (``cache=False``): the whole history, the prompt and the tokens
    so far, run again at every one of the ``n_new`` steps."""
    prompt = torch.as_tensor(prompt_lengths).double()
    grown = prompt[:, None] + torch.arange(n_new)  # (B, n_new): each sequence's length at each step
    if not cache:
        every = grown.flatten()
        return work.per_token * float(every.sum()) + work.per_pair * pairs_scored(
            every, every, True
        )
    steps = grown[:, 1:]  # the keys each decoding step's query scores
    return work.per_token * float(prompt.sum() + steps.numel()) + work.per_pair * (
        pairs_scored(prompt, prompt, True) + float(steps.sum())
    )


def speedup_line(label, padded, ragged, bound):
    """The speedup of ``ragged`` over ``padded`` (two ``Timing`` s), beside the
    work bound; "(within noise)" where their interquartile ranges overlap."""
    s = padded.median_ms / ragged.median_ms
    apart = outside_noise(padded, ragged)
    noise = "" if apart else " (within noise)"
    line = f"{label}: speedup {s:.2f}x, work bound {bound:.2f}x, fraction of bound {s / bound:.2f}{noise}"
    return record(
        "speedup",
        line,
        label=label,
        speedup=s,
        bound=bound,
        fraction=s / bound,
        within_noise=not apart,
    )


def fraction_verdict(label, fraction):
    """``label: fraction F, verdict``: at 0.85 of the work bound or more,
    packing turns the padding it removes into speed; below, costs the bound
    does not count weigh on the packed side."""
    verdict = (
        "packing turns the padding it removes into speed"
        if fraction >= 0.85
        else "short of the bound: costs it does not count weigh on the packed side here"
    )
    return record(
        "fraction", f"{label}: fraction {fraction:.2f}, {verdict}", label=label, fraction=fraction
    )


def throughput_line(label, fast, slow, bound, names=("ragged", "padded")):
    """``label: ragged R tokens/s, padded P tokens/s, speedup S.SSx, work bound
    W.WWx, fraction F.FF`` from two rates in tokens/s (``names`` for the two
    sides) and the work bound."""
    s = fast / slow
    line = (
        f"{label}: {names[0]} {fast:.0f} tokens/s, {names[1]} {slow:.0f} tokens/s, speedup {s:.2f}x, "
        f"work bound {bound:.2f}x, fraction {s / bound:.2f}"
    )
    rates = {names[0]: fast, names[1]: slow}
    return record(
        "throughput",
        line,
        label=label,
        tokens_per_s=rates,
        speedup=s,
        bound=bound,
        fraction=s / bound,
    )
