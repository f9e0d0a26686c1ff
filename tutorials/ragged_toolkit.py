"""The toolkit of the ragged-batch transformer tutorials, imported by every page.

A ragged batch is **packed values** ``(T, ...)``, every token of every
sequence end to end, plus **offsets** ``(B + 1,)``, where each sequence starts
and the last one ends (the ``cu_seqlens`` of FlashAttention and
``varlen_attn``). This module holds what the pages share:

* lengths and offsets: :func:`sentence_lengths`, :func:`offsets_from_lengths`,
  :func:`token_index`, :func:`to_padded`, :func:`from_padded`;
* attention within each sequence: :func:`ragged_attention` with six named
  backends, and :func:`reference_attention`, the float32 reference;
* measurement: :func:`measure`, :func:`compare_backends`, :func:`work_bound`
  and :func:`speedup_line`;
* the small GPT of the training and decoding pages: :class:`GPT`,
  :class:`KVCache`, the layouts :class:`Packed` and :class:`Padded`, and
  :func:`generate_packed`;
* real documents and data-parallel training: :func:`docstring_corpus`, the
  micro-batch splits (:func:`split_by_token_budget`), the packing checks,
  :func:`data_parallel_step` and :func:`run_data_parallel`.

It needs PyTorch 2.11 or later and numpy. Download it beside a tutorial's
script or notebook (each download also carries its own copy) and
``import ragged_toolkit``.
"""

from __future__ import annotations

import ast
import gc
import inspect
import json
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils import benchmark

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # not in this build of PyTorch
    varlen_attn = None

MINIMUM_TORCH = (2, 11)


def _release(version):
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


# (a documentation build without torch reads this module against a stand-in
# whose __version__ is no string: nothing to check there)
if isinstance(torch.__version__, str) and _release(torch.__version__) < MINIMUM_TORCH:
    raise RuntimeError(
        f"The tutorials need PyTorch {'.'.join(map(str, MINIMUM_TORCH))} or later; "
        f"this is {torch.__version__}. Upgrade with `pip install -U torch`."
    )


# --- Device, dtype and quiet logs ----------------------------------------------


def default_device():
    """``"cuda"`` where a GPU is present, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device):
    """The dtype a page computes in: ``bfloat16`` on CUDA (``float16`` on a GPU
    without it), ``float32`` on CPU. ``TUTORIALS_DTYPE`` overrides it, so the
    low-precision paths can be exercised on a CPU too."""
    name = os.environ.get("TUTORIALS_DTYPE")
    if name:
        if name not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"TUTORIALS_DTYPE must be float32, bfloat16 or float16, got {name!r}"
            )
        return getattr(torch, name)
    if torch.device(device).type != "cuda":
        return torch.float32
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    print("This GPU has no bfloat16: the page runs in float16 instead.")
    return torch.float16


def quick_mode():
    """Whether ``TUTORIALS_QUICK=1`` asks for the small sizes of the test suite."""
    return os.environ.get("TUTORIALS_QUICK") == "1"


# Matplotlib settings for the pages' figures: 12-point text at 100 dpi is
# about 17 px, as large as the page's body text when a figure of at most
# 8 inches (800 px) is shown at its natural size in the content column.
#: Matplotlib ``rcParams`` for the pages' figures (``plt.rcParams.update(FIGURE_STYLE)``).
FIGURE_STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "figure.figsize": (8, 4.5),
    "font.size": 12,
    "axes.titlesize": 12,
    "axes.labelsize": 12,
    "xtick.labelsize": 12,
    "ytick.labelsize": 12,
    "legend.fontsize": 12,
}


class _DropNotes(logging.Filter):
    def filter(self, record):
        return not record.getMessage().startswith(
            ("is_fx_tracing", "Failed to pickle cache key")
        )


def quiet_known_notes():
    """Hide messages PyTorch prints that say nothing about a page's code: the
    prototype notice of nested tensors, inductor's note about caching nested
    graphs, a torch.fx note that building a block mask triggers, and the
    profiler's log lines."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    warnings.filterwarnings("ignore", message=r".*nested tensors is in prototype stage")
    warnings.filterwarnings(
        "ignore", message=r".*does not implement _stable_hash_for_caching"
    )
    for name in ("torch.fx._symbolic_trace", "torch._inductor.codecache"):
        logging.getLogger(name).addFilter(_DropNotes())


# --- Lengths and offsets -------------------------------------------------------


STOP_RANKS = (3, 386, 858)  # ".", "!" and "?" in the WikiText-2 vocabulary


def zipf_stop_probability(alpha):
    """Chance that a word drawn from Zipf(``alpha``) ends a sentence: that it is
    ".", "!" or "?", which have ranks 3, 386 and 858 in WikiText-2."""
    n = 10_000
    ranks = np.arange(1, n + 1, dtype=np.float64)
    # zeta(alpha): a partial sum plus the Euler-Maclaurin estimate of the tail
    zeta = (ranks**-alpha).sum() + n ** (1 - alpha) / (alpha - 1) - 0.5 * n**-alpha
    return float(sum(r**-alpha for r in STOP_RANKS) / zeta)


def sentence_lengths(rng, batch, alpha=1.2, max_len=None):
    """Lengths of ``batch`` sentences of Zipf(``alpha``) words, each ending at its
    first stop word: one geometric draw per sentence. Returns (B,) int64."""
    lengths = rng.geometric(zipf_stop_probability(alpha), size=batch)
    if max_len is not None:
        lengths = np.minimum(lengths, max_len)
    return torch.from_numpy(lengths).long()


def offsets_from_lengths(lengths, device=None):
    """(B,) lengths -> (B + 1,) offsets: where each sequence starts in the packed
    tensor, then where the last one ends (``cu_seqlens`` in FlashAttention)."""
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=device)
    return F.pad(lengths.cumsum(0), (1, 0))


def offsets_from_position_ids(position_ids):
    """Offsets of a packed row whose ``position_ids`` restart at 0 at every
    sequence, as Hugging Face's ``DataCollatorWithFlattening`` writes them."""
    position_ids = position_ids.flatten()
    starts = (position_ids == 0).nonzero().flatten()
    return torch.cat([starts, starts.new_tensor([len(position_ids)])])


def ragged_batch(
    rng, batch, dim, *, alpha=1.2, max_len=None, device="cpu", dtype=torch.float32
):
    """A random ragged batch: packed values (T, dim) and offsets (B + 1,)."""
    lengths = sentence_lengths(rng, batch, alpha, max_len)
    gen = torch.Generator(device).manual_seed(int(rng.integers(2**62)))
    values = torch.randn(
        int(lengths.sum()), dim, generator=gen, device=device, dtype=dtype
    )
    return values, offsets_from_lengths(lengths, device)


def token_index(offsets):
    """The sequence of every packed token and its position in that sequence,
    both (T,): offsets [0, 2, 5] give [0, 0, 1, 1, 1] and [0, 1, 0, 1, 2]."""
    lengths = offsets.diff()
    seq = torch.repeat_interleave(
        torch.arange(len(lengths), device=offsets.device), lengths
    )
    return seq, torch.arange(len(seq), device=offsets.device) - offsets[seq]


def to_padded(values, offsets, pad_value=0.0):
    """Packed (T, ...) -> padded (B, S, ...) and a (B, S) mask, True on real tokens."""
    lengths = offsets.diff()
    S = int(lengths.max()) if len(lengths) else 0
    padded = values.new_full((len(lengths), S, *values.shape[1:]), pad_value)
    padded = padded.index_put(token_index(offsets), values)
    return padded, torch.arange(S, device=values.device) < lengths[:, None]


def from_padded(padded, offsets):
    """Padded (B, S, ...) -> packed (T, ...): the real tokens, in packed order."""
    return padded[token_index(offsets)]


def draw_batch(lengths):
    """A figure of one batch both ways: padded ``(B, S)`` with its padding
    slots, and packed values ``(T,)`` with the offsets under them. Each token
    shows its position in its sequence; each sequence has its own color."""
    import matplotlib.pyplot as plt

    offsets = offsets_from_lengths(lengths)
    seq, pos = token_index(offsets)
    B, S, T = len(lengths), max(lengths), len(seq)
    colors = plt.get_cmap("tab10")(np.arange(B) % 10)
    fig, (ax_pad, ax_pack) = plt.subplots(2, 1, figsize=(8, 1.1 * B + 2.4),
                                          height_ratios=[B, 1.6])

    def cell(ax, x, y, color, text, ink):
        ax.add_patch(plt.Rectangle((x, y), 0.92, 0.86, color=color))
        ax.text(x + 0.46, y + 0.43, text, ha="center", va="center", color=ink)

    for b, n in enumerate(lengths):
        for s in range(S):
            real = s < n
            cell(ax_pad, s, b, colors[b] if real else "0.88", f"{s}" if real else "pad",
                 "white" if real else "0.45")
    for t in range(T):
        cell(ax_pack, t, 0, colors[int(seq[t])], f"{int(pos[t])}", "white")
    ax_pad.set(xlim=(0, S), ylim=(B, 0),
               title=f"padded (B, S) = ({B}, {S}) and a mask: "
               f"{B * S - T} of {B * S} slots are padding")
    ax_pad.axis("off")
    ax_pack.set(xlim=(0, T), ylim=(1, -0.1), yticks=[], xticks=offsets.tolist(),
                title=f"packed values (T,) = ({T},), offsets {offsets.tolist()}")
    ax_pack.set_xlabel("offsets: where each sequence starts, then where the last one ends")
    fig.tight_layout()
    return fig


# --- Attention within each sequence --------------------------------------------


#: The names of ``ragged_attention``'s backends.
BACKENDS = ("varlen", "sdpa_njt", "flex", "loop", "bucketed", "padded")


def varlen_keywords():
    """The keyword arguments the installed ``varlen_attn`` takes (they changed
    between releases: ``is_causal``, then ``window_size``, ``enable_gqa``,
    ``seqused_k``); empty where this PyTorch has no ``varlen_attn``."""
    return (
        set(inspect.signature(varlen_attn).parameters)
        if varlen_attn is not None
        else set()
    )


def backend_support(name, device, dtype, *, is_causal=False, needs_grad=False, gqa=False):
    """None if backend ``name`` can run this job here, else why it cannot."""
    cuda = torch.device(device).type == "cuda"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    if name == "varlen":
        if varlen_attn is None:
            return "this PyTorch has no torch.nn.attention.varlen"
        if not cuda:
            return "needs CUDA (it calls the FlashAttention kernel)"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "needs a GPU of compute capability 8.0 or newer (FlashAttention)"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"needs float16 or bfloat16, not {dtype}"
    if name == "sdpa_njt" and gqa:
        return "SDPA on nested tensors cannot share key/value heads (enable_gqa)"
    if name == "sdpa_njt" and is_causal and not cuda:
        return (
            "on CPU only the math path of SDPA takes nested tensors, "
            "and it refuses is_causal"
        )
    if name == "flex" and needs_grad and not cuda:
        return "FlexAttention has no backward on CPU"
    return None


def default_backend(device, dtype):
    """The backend ``ragged_attention`` uses when none is named: ``varlen``
    where it runs, else ``sdpa_njt`` on CUDA, else the per-sequence loop."""
    for name in ("varlen", "sdpa_njt") if torch.device(device).type == "cuda" else ():
        if backend_support(name, device, dtype, is_causal=True, needs_grad=True) is None:
            return name
    return "loop"


def check_offsets(offsets, total, name="offsets"):
    """Raise ``ValueError``, naming the problem, unless ``offsets`` describe a packed
    tensor of ``total`` tokens."""
    if (
        offsets.dim() != 1
        or len(offsets) < 1
        or offsets.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"{name} must be a 1-D int32 or int64 tensor of B + 1 entries, "
            f"got shape {tuple(offsets.shape)} and {offsets.dtype}"
        )
    if int(offsets[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(offsets[0])}")
    steps = offsets.diff()
    if bool((steps < 0).any()):
        i = int((steps < 0).nonzero()[0])
        raise ValueError(
            f"{name} must not decrease: {name}[{i}] = {int(offsets[i])} "
            f"> {name}[{i + 1}] = {int(offsets[i + 1])}"
        )
    if int(offsets[-1]) != total:
        raise ValueError(
            f"{name} must end at the token count, {total}, got {int(offsets[-1])}"
        )


@dataclass
class RaggedInfo:
    """The lengths of one batch, read from its offsets once, on the host."""

    q_lengths: list  # queries per sequence
    kv_lengths: list  # keys each sequence uses (``kv_used``, or all of its rows)
    kv_rows: list  # key rows each sequence has in the packed tensor
    plans: dict = field(default_factory=dict)  # index tensors a backend built for it


_INFO_CACHE = []  # the last few batches; holding their tensors keeps the ids unique


def _cached(key, compute):
    # ``compute()`` once per tuple of tensors (by identity and version) and sizes
    stamp = tuple(t._version if isinstance(t, torch.Tensor) else t for t in key)
    for cached_key, cached_stamp, value in _INFO_CACHE:
        if cached_stamp == stamp and all(
            a is b
            for a, b in zip(cached_key, key)
            if isinstance(a, torch.Tensor) or a is None
        ):
            return value
    value = compute()
    _INFO_CACHE.insert(0, (key, stamp, value))
    del _INFO_CACHE[16:]
    return value


def _offsets_lengths(q_offsets, kv_offsets, n_q, n_kv):
    check_offsets(q_offsets, n_q, "q_offsets")
    check_offsets(kv_offsets, n_kv, "kv_offsets")
    if len(q_offsets) != len(kv_offsets):
        raise ValueError(
            f"q_offsets and kv_offsets describe different batch sizes: "
            f"{len(q_offsets) - 1} and {len(kv_offsets) - 1} sequences"
        )
    return q_offsets.diff().tolist(), kv_offsets.diff().tolist()


def ragged_info(q_offsets, kv_offsets, n_q, n_kv, kv_used=None, is_causal=False):
    """Check a batch's description and read its lengths, once per batch (the
    offsets once, however often ``kv_used`` changes, as in decoding)."""

    def compute():
        q_lengths, kv_rows = _cached(
            (q_offsets, kv_offsets, n_q, n_kv),
            lambda: _offsets_lengths(q_offsets, kv_offsets, n_q, n_kv),
        )
        kv_lengths = kv_rows if kv_used is None else kv_used.tolist()
        if len(kv_lengths) != len(kv_rows) or any(
            not 0 <= n <= r for n, r in zip(kv_lengths, kv_rows)
        ):
            raise ValueError(
                f"kv_used must hold one count per sequence, between 0 and its key "
                f"rows {kv_rows}; got {kv_lengths}"
            )
        if is_causal and any(0 < lkv < lq for lq, lkv in zip(q_lengths, kv_lengths)):
            raise ValueError(
                "is_causal needs at least as many keys as queries in every sequence "
                "(the last query sees every key)"
            )
        return RaggedInfo(q_lengths, kv_lengths, kv_rows)

    return _cached((q_offsets, kv_offsets, kv_used, n_q, n_kv, is_causal), compute)


def _causal_mask(lq, lkv, device):
    # (lq, lkv), True where a query may see a key; aligned bottom-right, as in
    # FlashAttention and varlen_attn: the last query sees every key
    return torch.ones(lq, lkv, dtype=torch.bool, device=device).tril(lkv - lq)


def _dense(q, k, v, is_causal, scale, mask=None):
    # q: (N, H, Lq, D), k and v: (N, H_kv, Lkv, D); ``mask``, if given, holds
    # everything a query may see. Every query has at least one key.
    lq, lkv, gqa = q.shape[-2], k.shape[-2], q.shape[1] != k.shape[1]
    if mask is None and is_causal and lq == lkv:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=gqa
        )
    if mask is None and is_causal and lq > 1:
        mask = _causal_mask(lq, lkv, q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa
    )


def _loop(q, k, v, info, is_causal, scale, kv_used):
    """One dense SDPA call per sequence, on views of the packed tensors."""
    # (T, H, D) -> (1, H, T, D) once; ``split`` then gives one view per sequence,
    # and its backward is a single concatenation
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = []
    for qi, ki, vi, n, rows in zip(
        qh.split(info.q_lengths, 2),
        kh.split(info.kv_rows, 2),
        vh.split(info.kv_rows, 2),
        info.kv_lengths,
        info.kv_rows,
    ):
        if n < rows:  # a cache with spare room: only the rows in use
            ki, vi = ki[:, :, :n], vi[:, :, :n]
        out.append(_dense(qi, ki, vi, is_causal, scale))  # (1, H, L_q, D)
    return torch.cat(out, 2)[0].transpose(0, 1)  # (T_q, H, D)


def _bucket_plan(info, device, buckets, is_causal):
    # Sequences sorted by length and cut into groups; for each group, indices
    # that gather its rows into a padded block (padding slots read row 0, and
    # are masked or dropped), its mask, and which slots are real queries.
    order = sorted(range(len(info.q_lengths)), key=lambda i: -info.kv_lengths[i])
    q_start = np.concatenate([[0], np.cumsum(info.q_lengths)])
    kv_start = np.concatenate([[0], np.cumsum(info.kv_rows)])
    plan, rows = [], []
    for group in np.array_split(np.array(order), min(buckets, len(order))):
        lq = torch.tensor([info.q_lengths[i] for i in group])
        lkv = torch.tensor([info.kv_lengths[i] for i in group])
        sq, skv = int(lq.max()), int(lkv.max())
        q_real = torch.arange(sq) < lq[:, None]  # (n, Sq)
        kv_real = torch.arange(skv) < lkv[:, None]  # (n, Skv)
        q_idx = torch.where(
            q_real, torch.as_tensor(q_start[group])[:, None] + torch.arange(sq), 0
        )
        kv_idx = torch.where(
            kv_real, torch.as_tensor(kv_start[group])[:, None] + torch.arange(skv), 0
        )
        mask = kv_real[:, None, :]  # (n, 1, Skv): real keys only
        if is_causal:  # query i sees keys up to i + Lkv - Lq
            mask = mask & (
                torch.arange(skv) <= torch.arange(sq)[:, None] + (lkv - lq)[:, None, None]
            )
        # right padding: with equal lengths a causal query never reaches a
        # padding key, and the kernel's own causal mask is enough
        mask = None if is_causal and bool((lq == lkv).all()) else mask[:, None].to(device)
        plan.append((q_idx.to(device), kv_idx.to(device), mask, q_real.to(device)))
        rows.append(q_idx[q_real])
    # where each packed query row lands among the groups' outputs
    return plan, torch.argsort(torch.cat(rows)).to(device)


def _bucketed(q, k, v, info, is_causal, scale, kv_used, buckets=4):
    """Pad sequences in groups of similar length; one dense SDPA call per group."""
    key = ("bucketed", buckets, is_causal)
    if key not in info.plans:
        info.plans[key] = _bucket_plan(info, q.device, buckets, is_causal)
    plan, inverse = info.plans[key]
    out = []
    for q_idx, kv_idx, mask, q_real in plan:
        qb, kb, vb = (
            t[idx].transpose(1, 2) for t, idx in ((q, q_idx), (k, kv_idx), (v, kv_idx))
        )
        ob = _dense(qb, kb, vb, is_causal and mask is None, scale, mask)  # (n, H, Sq, D)
        out.append(ob.transpose(1, 2)[q_real])  # the real rows, (sum Lq, H, D)
    return torch.cat(out)[inverse]


def _padded(q, k, v, info, is_causal, scale, kv_used):
    """Every sequence padded to the longest one, one call: the baseline. A batch
    that already is a rectangle (the same number of queries and of key rows
    per sequence, as in a KV cache with the same room for each) is viewed as
    one, with no copy, and the keys not in use are masked."""
    B, lq, rows = len(info.q_lengths), info.q_lengths[0], info.kv_rows[0]
    if set(info.q_lengths) != {lq} or set(info.kv_rows) != {rows}:
        return _bucketed(q, k, v, info, is_causal, scale, kv_used, buckets=1)
    n = max(info.kv_lengths)
    if (
        "rectangle",
        is_causal,
    ) not in info.plans:  # one mask per batch, shared by every layer
        used = (  # the counts as given, with no copy from the host where there is one
            kv_used if kv_used is not None else torch.tensor(info.kv_lengths, device=q.device)
        ).to(q.device)[:, None, None, None]
        key, query = (
            torch.arange(n, device=q.device),
            torch.arange(lq, device=q.device)[:, None],
        )
        mask = key < used  # (B, 1, 1, n), or with the causal rule (B, 1, Lq, n)
        info.plans["rectangle", is_causal] = (
            mask & (key <= query + used - lq) if is_causal else mask
        )
    qb = q.view(B, lq, *q.shape[1:]).transpose(1, 2)  # (B, H, Lq, D)
    kb, vb = (
        t.view(B, rows, *t.shape[1:])[:, :n].transpose(1, 2) for t in (k, v)
    )  # (B, H_kv, n, D)
    out = F.scaled_dot_product_attention(
        qb,
        kb,
        vb,
        attn_mask=info.plans["rectangle", is_causal],
        scale=scale,
        enable_gqa=qb.shape[1] != kb.shape[1],
    )
    return out.transpose(1, 2).reshape(q.shape)


# Static shapes on CPU (there dynamic shapes fail to compile the document mask
# on 2.13: a C++ compile error), automatic dynamic shapes on CUDA. A static
# graph is compiled per shape, and after ``recompile_limit`` (8) shapes it
# gives up and FlexAttention runs unfused; so ``_flex`` pads every batch to
# one of a few sizes (:func:`flex_rows`), and a run compiles a bounded number
# of graphs however many batch shapes it sees.
compiled_flex_attention = torch.compile(
    flex_attention, dynamic=None if torch.cuda.is_available() else False
)

#: Rows per FlexAttention block: the padded sizes are multiples of it.
FLEX_BLOCK = 128


def flex_rows(n):
    """The number of rows ``_flex`` pads ``n`` packed tokens to: a multiple of
    ``FLEX_BLOCK``, rounded to four sizes per doubling above 8 blocks (at most
    a quarter more rows, plus one block), so that ``n`` from 1 to 8,192 gives 20
    sizes."""
    blocks = max(1, -(-n // FLEX_BLOCK))
    step = 1 << max(0, blocks.bit_length() - 3)  # 1 up to 7 blocks, 2 up to 15, ...
    return -(-blocks // step) * step * FLEX_BLOCK


def _flex_plan(info, device, is_causal):
    # Per-row tables of the padded batch; the mask reads only these, all of
    # the padded lengths, so a new batch of the same padded size compiles
    # nothing. Real rows: their sequence, position, and (keys) the keys
    # their sequence uses, (queries) the causal shift L_kv - L_q. Padding
    # query rows form document -2, which holds one key, the first padding
    # key row; the other padding keys are document -1, seen by no query.
    t_q, t_kv = sum(info.q_lengths), sum(info.kv_rows)
    n_q = flex_rows(t_q)
    n_kv = flex_rows(t_kv + (n_q > t_q))  # a padding query needs a padding key
    q_seq, q_pos = token_index(offsets_from_lengths(info.q_lengths, device))
    kv_seq, kv_pos = token_index(offsets_from_lengths(info.kv_rows, device))
    kv_len = torch.tensor(info.kv_lengths, device=device)
    shift = kv_len - torch.tensor(info.q_lengths, device=device)

    def padded(x, n, fill):
        return torch.cat([x, x.new_full((n - len(x),), fill)])

    q_doc, q_pos, q_shift = padded(q_seq, n_q, -2), padded(q_pos, n_q, 0), padded(
        shift[q_seq], n_q, 0)
    kv_doc = padded(kv_seq, n_kv, -1)
    if n_kv > t_kv:
        kv_doc[t_kv] = -2
    kv_pos, kv_use = padded(kv_pos, n_kv, 0), padded(kv_len[kv_seq], n_kv, 1)

    def document_mask(b, h, q_idx, kv_idx):
        same = (q_doc[q_idx] == kv_doc[kv_idx]) & (kv_pos[kv_idx] < kv_use[kv_idx])
        if is_causal:
            same = same & (kv_pos[kv_idx] <= q_pos[q_idx] + q_shift[q_idx])
        return same

    mask = create_block_mask(document_mask, None, None, n_q, n_kv, device=device,
                             BLOCK_SIZE=FLEX_BLOCK)
    return mask, t_q, t_kv


def _flex(q, k, v, info, is_causal, scale, kv_used):
    """FlexAttention over the whole packed batch, with a document mask, padded
    to one of a few sizes (:func:`flex_rows`) so that it compiles a few times."""
    key = ("flex", is_causal)
    if key not in info.plans:  # one BlockMask per batch, shared by every layer
        info.plans[key] = _flex_plan(info, q.device, is_causal)
    mask, t_q, t_kv = info.plans[key]
    for counter in _COMPILE_COUNTERS:
        counter.saw((t_q, t_kv, q.shape[1], k.shape[1]))
    if not torch.is_grad_enabled():  # on CPU it refuses inputs that require grad
        q, k, v = q.detach(), k.detach(), v.detach()
    n_q, n_kv = mask.seq_lengths
    # (T, H, D) -> (1, H, T_padded, D): the whole batch as one long sequence
    qf = F.pad(q, (0, 0, 0, 0, 0, n_q - t_q)).transpose(0, 1)[None]
    kf, vf = (F.pad(t, (0, 0, 0, 0, 0, n_kv - t_kv)).transpose(0, 1)[None] for t in (k, v))
    out = compiled_flex_attention(
        qf,
        kf,
        vf,
        block_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0, :, :t_q].transpose(0, 1)


def _sdpa_njt(q, k, v, info, is_causal, scale, kv_used):
    """SDPA on nested jagged tensors built from the same values and offsets."""
    if is_causal and info.q_lengths != info.kv_lengths and max(info.q_lengths) > 1:
        raise NotImplementedError(
            "SDPA on nested tensors aligns is_causal top-left: it "
            "needs equal query and key lengths"
        )

    def njt(x, lengths):  # (T, H, D) -> (B, H, j, D)
        offsets = offsets_from_lengths(lengths, x.device)
        nt = torch.nested.nested_tensor_from_jagged(
            x.contiguous(), offsets, max_seqlen=max(lengths)
        )
        return nt.transpose(1, 2)

    causal = (
        is_causal and max(info.q_lengths) > 1
    )  # one query per sequence sees every key
    out = F.scaled_dot_product_attention(
        njt(q, info.q_lengths),
        njt(k, info.kv_rows),
        njt(v, info.kv_rows),
        is_causal=causal,
        scale=scale,
    )
    return out.transpose(1, 2).values()


def _varlen(q, k, v, info, is_causal, scale, kv_used):
    """``varlen_attn``, the variable-length kernel of FlashAttention, on the batch."""
    keywords = varlen_keywords()
    kw = {"scale": scale}
    if is_causal:  # a flag in PyTorch 2.10, a window from 2.11 on
        kw.update(
            {"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True}
        )
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in keywords:
            kw["enable_gqa"] = True
        else:  # older releases: repeat each key/value head for its query heads
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if kv_used is not None:
        kw["seqused_k"] = kv_used.to(torch.int32)
    cu_q = offsets_from_lengths(info.q_lengths, q.device).to(torch.int32)
    cu_k = offsets_from_lengths(info.kv_rows, q.device).to(torch.int32)
    return varlen_attn(q, k, v, cu_q, cu_k, max(info.q_lengths), max(info.kv_rows), **kw)


_BACKEND_FNS = {
    "varlen": _varlen,
    "sdpa_njt": _sdpa_njt,
    "flex": _flex,
    "loop": _loop,
    "bucketed": _bucketed,
    "padded": _padded,
}


def _compact_plan(info, device):
    # Keep the sequences that have queries and keys, and only the key rows they
    # use: the query rows kept, the key rows kept, and the smaller batch.
    keep = [
        i
        for i, (lq, lkv) in enumerate(zip(info.q_lengths, info.kv_lengths))
        if lq and lkv
    ]
    q_start = np.cumsum([0] + info.q_lengths)
    kv_start = np.cumsum([0] + info.kv_rows)
    q_rows = [np.arange(q_start[i], q_start[i] + info.q_lengths[i]) for i in keep]
    kv_rows = [np.arange(kv_start[i], kv_start[i] + info.kv_lengths[i]) for i in keep]
    used = [info.kv_lengths[i] for i in keep]
    return (
        torch.as_tensor(np.concatenate(q_rows or [[]]), dtype=torch.long, device=device),
        torch.as_tensor(np.concatenate(kv_rows or [[]]), dtype=torch.long, device=device),
        RaggedInfo([info.q_lengths[i] for i in keep], used, used),
    )


@torch.compiler.disable  # host-side bookkeeping; a compiled model calls it as is
def ragged_attention(
    q,
    k,
    v,
    q_offsets,
    kv_offsets=None,
    *,
    is_causal=False,
    kv_used=None,
    scale=None,
    backend=None,
):
    """Attention within each sequence of a packed batch.

    q: (T_q, H, D); k, v: (T_kv, H_kv, D), with H a multiple of H_kv.
    q_offsets, kv_offsets: (B + 1,), where each sequence starts and the last
    one ends; kv_offsets defaults to q_offsets (self-attention).
    kv_used: optional (B,), how many key rows each sequence uses from its start.
    is_causal: query i of a sequence with L_q queries and L_kv keys sees keys
    0 .. i + L_kv - L_q (with L_q == L_kv, the usual causal mask).
    backend: one of BACKENDS, or None for ``default_backend``.
    Returns (T_q, H, D); a query without keys gets zeros.
    """
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    if (
        q.dim() != 3
        or k.dim() != 3
        or k.shape != v.shape
        or q.shape[2] != k.shape[2]
        or q.shape[1] % k.shape[1]
    ):
        raise ValueError(
            f"expected q (T_q, H, D) and k, v (T_kv, H_kv, D) with H a multiple "
            f"of H_kv; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if (
        not q.dtype == k.dtype == v.dtype
    ):  # fused kernels refuse a mix; autocast hides it from some
        raise ValueError(
            f"q, k and v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype} "
            "(under autocast, cast float32 rotary outputs back to the projection's dtype)"
        )
    info = ragged_info(q_offsets, kv_offsets, q.shape[0], k.shape[0], kv_used, is_causal)
    name = backend or default_backend(q.device, q.dtype)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    why = backend_support(
        name,
        q.device,
        q.dtype,
        is_causal=is_causal,
        needs_grad=needs_grad,
        gqa=q.shape[1] != k.shape[1],
    )
    if why:
        raise RuntimeError(
            f"ragged_attention: backend {name!r} cannot run this here: {why}"
        )
    fn = _BACKEND_FNS[name]
    reads_kv_used = (
        name in ("loop", "flex")
        or (name == "varlen" and "seqused_k" in varlen_keywords())
        or (name == "padded" and len(set(info.q_lengths)) == len(set(info.kv_rows)) == 1)
    )
    if (
        all(info.q_lengths)
        and all(info.kv_lengths)
        and (kv_used is None or reads_kv_used)
    ):
        return fn(q, k, v, info, is_causal, scale, kv_used)
    if "compact" not in info.plans:
        info.plans["compact"] = _compact_plan(info, q.device)
    q_rows, kv_rows, kept = info.plans["compact"]
    out = q.new_zeros(q.shape)
    if len(q_rows):
        out = out.index_copy(
            0, q_rows, fn(q[q_rows], k[kv_rows], v[kv_rows], kept, is_causal, scale, None)
        )
    return out


def reference_attention(
    q, k, v, q_offsets, kv_offsets=None, *, is_causal=False, kv_used=None, scale=None
):
    """The same attention in float32, sequence by sequence, on the math backend
    of SDPA, with key/value heads repeated and the causal mask built
    explicitly: a reference that shares no kernel with the backends."""
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    info = ragged_info(q_offsets, kv_offsets, q.shape[0], k.shape[0], kv_used, is_causal)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    q_start, kv_start = q_offsets.tolist(), kv_offsets.tolist()
    with sdpa_kernel(SDPBackend.MATH):
        for i, (lq, lkv) in enumerate(zip(info.q_lengths, info.kv_lengths)):
            if lq and lkv:
                qi = q[q_start[i] : q_start[i] + lq].float().transpose(0, 1)  # (H, Lq, D)
                ki, vi = (
                    t[kv_start[i] : kv_start[i] + lkv]
                    .float()
                    .repeat_interleave(group, 1)
                    .transpose(0, 1)
                    for t in (k, v)
                )  # (H, Lkv, D)
                mask = _causal_mask(lq, lkv, q.device) if is_causal else None
                out[q_start[i] : q_start[i] + lq] = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=scale
                ).transpose(0, 1)
    return out


def tolerances(dtype):
    """``assert_close`` tolerances for results computed in ``dtype``."""
    return {
        torch.float32: dict(atol=1e-4, rtol=1e-4),
        torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
        torch.float16: dict(atol=5e-3, rtol=5e-3),
    }[dtype]


# --- Measuring -----------------------------------------------------------------


def synchronize():
    """Wait for the GPU, where there is one, before a clock is read."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


_KERNELS = {  # profiler operator -> the kernel it names
    "aten::_scaled_dot_product_flash_attention_for_cpu": "CPU flash",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_flash_attention_forward": "flash varlen",
    "aten::_efficient_attention_forward": "memory-efficient varlen",
    "aten::_cudnn_attention_forward": "cuDNN varlen",
}


def _kernel_label(events):
    """The attention kernels among profiler events, with their call counts
    (empty if no attention ran)."""
    counts = {}
    for e in events:
        base = e.name.removesuffix("_backward")
        parent = e.cpu_parent
        while (
            parent is not None and parent.name.removesuffix("_backward") not in _KERNELS
        ):
            parent = parent.cpu_parent
        if base in _KERNELS and parent is None:  # not called by another attention op
            label = _KERNELS[base] + (" backward" if e.name.endswith("_backward") else "")
            counts[label] = counts.get(label, 0) + 1
    if not counts and any(e.name.startswith("triton_tem_fused") for e in events):
        counts["FlexAttention Triton kernel"] = 1
    if not counts and any(e.name.startswith("Torch-Compiled Region") for e in events):
        counts["compiled graph (inductor kernel)"] = 1
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counts.items())


#: The CPU threads per operator that ``measure`` times with and every profile runs
#: with: one, ``torch.utils.benchmark``'s default, so that a profile describes
#: the call that was timed (with two threads on a busy 2-core machine, each
#: parallel region can wait a scheduler slice for a thread that is not
#: running: a 2 ms call then profiles at 300 ms). ``None``: as set.
TIMING_THREADS = 1


@contextmanager
def _threads(n):
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def profile_call(fn, threads=TIMING_THREADS):
    """Run ``fn`` once under the profiler (with ``threads``, as it was timed):
    the memory it needed beyond what was allocated before, in MiB, and the
    attention kernels that ran."""
    os.environ.setdefault(
        "KINETO_LOG_LEVEL", "6"
    )  # keep the log lines of the profiler quiet
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # free what earlier calls left behind before counting
    cuda = torch.cuda.is_available()
    if cuda:
        synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _threads(threads), profile(activities=activities, profile_memory=not cuda) as prof:
        fn()
        synchronize()
    if cuda:
        peak = torch.cuda.max_memory_allocated() - before
    else:  # the running sum of the allocation and free events, in time order
        sizes = [
            n
            for _, n in sorted(
                (e.start_ns(), e.nbytes())
                for e in prof.profiler.kineto_results.events()
                if e.name() == "[memory]"
            )
        ]
        peak = max(float(np.cumsum(sizes).max()), 0.0) if sizes else 0.0
    return peak / 2**20, _kernel_label(prof.events())


@dataclass
class Timing:
    """Median and IQR of the timed runs in ms, the first call in s, peak
    memory in MiB, the attention kernels that ran, and the percentiles 25 and 75."""

    median_ms: float
    iqr_ms: float
    first_call_s: float
    peak_mib: float = float("nan")
    kernels: str = ""
    q1_ms: float = float("nan")  # percentiles 25 and 75 of the timed runs
    q3_ms: float = float("nan")
    runs: int = 0  # how many timed runs (blocks) the percentiles come from; 0: unknown

    def __str__(self):
        memory = (
            "" if self.peak_mib != self.peak_mib else f"  peak {self.peak_mib:7.1f} MiB"
        )  # NaN: not measured
        return f"{self.median_ms:9.2f} ms (IQR {self.iqr_ms:6.2f}){memory}" + (
            f"  [{self.kernels}]" if self.kernels else ""
        )


def measure(fns, *, min_run_time=1.0, rounds=3, profile=True, threads=TIMING_THREADS):
    """Time callables side by side. ``fns`` maps a name to a function of no
    arguments; each first call is timed alone, then the functions take turns
    for ``rounds`` rounds. Returns name -> Timing."""
    first = {}
    with _threads(threads):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            synchronize()
            first[name] = time.perf_counter() - start
        times = {name: [] for name in fns}
        for _ in range(rounds):  # take turns, so that a busy machine slows all alike
            for name, fn in fns.items():
                timer = benchmark.Timer(
                    "fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
                )
                times[name] += timer.blocked_autorange(
                    min_run_time=min_run_time / rounds
                ).times
    out = {}
    for name, fn in fns.items():
        q1, median, q3 = np.percentile(times[name], [25, 50, 75]) * 1e3
        peak, kernels = profile_call(fn, threads) if profile else (float("nan"), "")
        out[name] = Timing(median, q3 - q1, first[name], peak, kernels, q1, q3,
                           len(times[name]))
    return out


_OVERHEAD_US = []


def profiler_overhead_us():
    """What the profiler adds per operator it records, in microseconds:
    a loop of trivial operators timed with and without it (measured once)."""
    if not _OVERHEAD_US:
        from torch.profiler import ProfilerActivity, profile

        x, n = torch.zeros(1), 2000
        with _threads(TIMING_THREADS):
            best = []
            for profiled in (False, True, False, True):
                with profile(activities=[ProfilerActivity.CPU]) if profiled else _threads(
                    None
                ):
                    start = time.perf_counter()
                    for _ in range(n):
                        x.add_(0)
                    best.append(time.perf_counter() - start)
        plain, profiled = min(best[0::2]), min(best[1::2])
        _OVERHEAD_US.append(max(profiled - plain, 0.0) / n * 1e6)
    return _OVERHEAD_US[0]


@dataclass
class Profile:
    """A profile of ``calls`` steady-state calls (after warm-up), per call:
    the wall time under the profiler, the operators' own time summed, the
    operators recorded and the profiler's estimated overhead for them, the
    median of the timing without the profiler it describes, and the top operators as
    (name, ms per call, share of the operators' time, calls per call)."""

    calls: int
    wall_ms: float
    self_ms: float
    events: float
    overhead_ms: float
    median_ms: float
    rows: list

    def __str__(self):
        lines = [
            f"  per call, {self.calls} calls after warm-up: {self.wall_ms:.2f} ms under the "
            f"profiler, of which up to about {self.overhead_ms:.2f} ms is its overhead",
            f"  ({self.events:.0f} operators); the timed median is {self.median_ms:.2f} ms. "
            f"Operators' own time: {self.self_ms:.2f} ms per call",
        ]
        lines += [
            f"  {name[:52]:52s} {ms:8.3f} ms {share:5.1f}%  x{count:g}"
            for name, ms, share, count in self.rows
        ]
        return "\n".join(lines)


def where_time_goes(fn, top=6, *, timing=None, warmup=1, threads=TIMING_THREADS):
    """Profile ``fn`` at its steady state, as it was timed: ``warmup`` calls
    first, then enough calls for about 0.2 s, with ``threads``; every figure
    is per call. ``timing``: the :class:`Timing` of ``fn`` from ``measure``
    (else ``fn`` is timed here), whose median the profile is printed beside.
    Returns a :class:`Profile`; printed, the operators that took most time."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    overhead_us = profiler_overhead_us()
    if timing is None:
        timing = measure({"fn": fn}, min_run_time=0.2, profile=False, threads=threads)["fn"]
    calls = int(min(50, max(1, 200 / max(timing.median_ms, 1e-3))))
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _threads(threads):
        for _ in range(warmup):
            fn()
        synchronize()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            synchronize()
            wall = time.perf_counter() - start
    rows = prof.key_averages()
    own = (
        (lambda e: e.self_device_time_total)
        if cuda
        else (lambda e: e.self_cpu_time_total)
    )
    self_us = sum(e.self_cpu_time_total for e in rows)
    total = sum(own(e) for e in rows) or 1
    events = sum(e.count for e in rows) / calls
    return Profile(
        calls=calls,
        wall_ms=wall * 1e3 / calls,
        self_ms=self_us / 1e3 / calls,
        events=events,
        overhead_ms=events * overhead_us / 1e3,
        median_ms=timing.median_ms,
        rows=[
            (e.key, own(e) / 1e3 / calls, 100 * own(e) / total, e.count / calls)
            for e in sorted(rows, key=own, reverse=True)[:top]
        ],
    )


@dataclass
class CompileCount:
    """What ``torch.compile`` did while a :func:`compile_counter` was open:
    the graphs it compiled, the batch shapes seen (``saw``), and the
    warnings that say a compiled function ran without compiling instead."""

    graphs: int = 0
    shapes: set = field(default_factory=set)
    fallbacks: list = field(default_factory=list)

    def saw(self, shape):
        """Note one batch shape (a tuple of sizes, or any value usable as a set member)."""
        self.shapes.add(shape)

    def __str__(self):
        fell = f"; {len(self.fallbacks)} uncompiled fallbacks" if self.fallbacks else ""
        return (f"{self.graphs} graph{'s' * (self.graphs != 1)} compiled for "
                f"{len(self.shapes)} batch shape{'s' * (len(self.shapes) != 1)}{fell}")


_COMPILE_COUNTERS = []  # the open compile_counter()s, which _flex reports its shapes to

_FALLBACK_NOTES = ("called without torch.compile", "recompile_limit", "cache_size_limit")


class _FallbackLog(logging.Handler):
    def __init__(self, count):
        super().__init__(logging.WARNING)
        self.count = count

    def emit(self, record):
        if any(n in record.getMessage() for n in _FALLBACK_NOTES):
            self.count.fallbacks.append(record.getMessage().splitlines()[0][:200])


@contextmanager
def compile_counter():
    """Count what ``torch.compile`` does inside the ``with`` block: yields a
    :class:`CompileCount`, filled when the block ends. The ``flex`` backend
    notes each batch shape itself; other code calls ``count.saw(shape)``."""
    from torch._dynamo.utils import counters

    count = CompileCount()
    before = counters["stats"]["unique_graphs"]
    handler = _FallbackLog(count)
    log = logging.getLogger("torch._dynamo")
    log.addHandler(handler)
    _COMPILE_COUNTERS.append(count)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield count
    finally:
        _COMPILE_COUNTERS.remove(count)
        log.removeHandler(handler)
        count.graphs = counters["stats"]["unique_graphs"] - before
    shown = set()
    for w in caught:  # the others go on, once each, as if not caught
        text = str(w.message)
        if any(n in text for n in _FALLBACK_NOTES):
            count.fallbacks.append(text.splitlines()[0][:200])
        elif (text, w.category) not in shown:
            shown.add((text, w.category))
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def compare_backends(
    q,
    k,
    v,
    q_offsets,
    kv_offsets=None,
    *,
    is_causal=False,
    kv_used=None,
    backward=False,
    backends=BACKENDS,
    min_run_time=0.5,
):
    """Check and time one attention job on each backend. Returns name -> Timing,
    or name -> the reason it did not run. Prints one line per backend."""
    gqa = q.shape[1] != k.shape[1]
    kw = dict(is_causal=is_causal, kv_used=kv_used)
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    # the reference, and its gradients, in float32 from float32 copies
    q32, k32, v32 = (t.detach().float().requires_grad_(backward) for t in (q, k, v))
    reference = reference_attention(q32, k32, v32, q_offsets, kv_offsets, **kw)
    grad_out = torch.randn_like(reference) if backward else None
    if backward:
        ref_grads = torch.autograd.grad(reference, (q32, k32, v32), grad_out)
    results, fns = {}, {}
    for name in backends:
        why = backend_support(
            name, q.device, q.dtype, is_causal=is_causal, needs_grad=backward, gqa=gqa
        )
        if why is None:

            def run(name=name):
                with torch.set_grad_enabled(backward):
                    out = ragged_attention(
                        q, k, v, q_offsets, kv_offsets, backend=name, **kw
                    )
                    return (
                        out,
                        torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
                        if backward
                        else None,
                    )

            try:
                out, grads = run()
            except Exception as err:  # one clear line instead of a traceback
                why = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:120]}"
        if why:
            results[name] = why
            continue
        torch.testing.assert_close(
            out.float(),
            reference,
            **tolerances(q.dtype),
            msg=lambda m, name=name: f"{name} disagrees with the reference: {m}",
        )
        for g, r in zip(grads or (), ref_grads if backward else ()):
            torch.testing.assert_close(
                g.float(),
                r,
                **tolerances(q.dtype),
                msg=lambda m, name=name: f"{name}'s gradients disagree: {m}",
            )
        fns[name] = run
    results.update(measure(fns, min_run_time=min_run_time))
    results = {name: results[name] for name in backends}
    print_timings(results)
    return results


def print_timings(results):
    """One line per entry of ``results`` (name -> :class:`Timing`, or the
    reason it did not run), names aligned."""
    width = max(map(len, results), default=0)
    for name, r in results.items():
        print(f"  {name:{width}s} {r}" if isinstance(r, Timing) else
              f"  {name:{width}s} not available: {r}")


def fastest(results):
    """The backend with the lowest median time among those that ran (no
    regard for noise: :func:`choose` makes the choices the pages act on)."""
    timed = {n: r for n, r in results.items() if isinstance(r, Timing)}
    return min(timed, key=lambda n: timed[n].median_ms)


def outside_noise(a, b):
    """Whether two :class:`Timing` s differ by more than their spread: their
    interquartile ranges, ``[q1, q3]``, do not overlap."""
    return a.q3_ms < b.q1_ms or b.q3_ms < a.q1_ms


#: The fewest timed runs per option from which :func:`choose` names a winner.
MIN_RUNS = 5


def choose(results, default, what="choice"):
    """Choose among measured options only where the measurement can tell.

    The rule: the options are timed in interleaved rounds (``measure``); the
    one with the lowest median wins only if its interquartile range does not
    overlap that of the second fastest. Otherwise the difference is within noise and
    the documented default is returned (so it is, too, when either has fewer
    than ``MIN_RUNS`` timed runs): ``default``, a name or a tuple of
    names in order of preference, the first of them that ran and is within
    the noise of the fastest. The default of an attention backend is
    :func:`default_backend` (the same for a job on every page), of
    compiling, not compiling. ``results``: name -> :class:`Timing` (or the
    reason it did not run). Prints one line saying what was chosen and why;
    returns the name."""
    timed = {n: r for n, r in results.items() if isinstance(r, Timing)}
    ranked = sorted(timed, key=lambda n: timed[n].median_ms)
    if not ranked:
        raise ValueError(f"nothing to choose from for {what}: none of {list(results)} ran")

    def q(n):
        t = timed[n]
        return f"{n} {t.median_ms:.2f} ms (IQR {t.q1_ms:.2f}-{t.q3_ms:.2f})"

    best = ranked[0]
    if len(ranked) == 1:
        print(f"{what}: chosen {best}, the only option that ran")
        return best
    runner = ranked[1]
    gap = timed[runner].q1_ms - timed[best].q3_ms
    few = [n for n in (best, runner) if 0 < timed[n].runs < MIN_RUNS]
    defaults = (default,) if isinstance(default, str) else tuple(default)
    if gap > 0 and few:
        pick = next((d for d in defaults if d in timed), best)
        print(f"{what}: too few timed runs to tell ({', '.join(few)}: under "
              f"{MIN_RUNS}), chosen {pick}")
        return pick
    if gap > 0:
        print(f"{what}: chosen {best}, outside the noise")
        print(f"  {q(best)} against {q(runner)}: {gap:.2f} ms between the IQRs")
        return best
    tied = [n for n in ranked if not outside_noise(timed[best], timed[n])]
    pick = next((d for d in defaults if d in tied), best)
    why = "the default" if pick in defaults else "no default among them: the lowest median"
    print(f"{what}: within noise, chosen {pick} ({why})")
    more = f", and {len(tied) - 2} more" if len(tied) > 2 else ""
    print("  IQRs overlap: " + ", ".join(q(n) for n in tied[:2]) + more)
    return pick


# --- The work bound ------------------------------------------------------------


def pairs_scored(q_lengths, kv_lengths, causal):
    """Query-key pairs a kernel scores: the causal half, L(L+1)/2 per sequence,
    when it skips the masked half, else every pair."""
    q, kv = torch.as_tensor(q_lengths).double(), torch.as_tensor(kv_lengths).double()
    return float((q * (q + 1) / 2 if causal else q * kv).sum())


def work_bound(
    q_lengths,
    kv_lengths=None,
    *,
    per_token,
    per_pair,
    per_kv_token=0.0,
    causal=False,
    padded_causal=None,
):
    """The work of the padded batch over the work of the ragged batch.
    ``padded_causal``: whether the padded side skips the masked half of the
    scores (a causal kernel) or computes the whole square (a merged mask)."""
    q = torch.as_tensor(q_lengths)
    kv = q if kv_lengths is None else torch.as_tensor(kv_lengths)
    padded_causal = causal if padded_causal is None else padded_causal

    def work(ql, kvl, c):
        return (
            per_token * float(ql.sum())
            + per_kv_token * float(kvl.sum())
            + per_pair * pairs_scored(ql, kvl, c)
        )

    full_q, full_kv = torch.full_like(q, int(q.max())), torch.full_like(kv, int(kv.max()))
    return work(full_q, full_kv, padded_causal) / work(q, kv, causal)


def training_work(lengths, per_token, per_pair, padded_causal=True):
    """The work of training steps, one per batch of ``lengths`` (each (B,)):
    ``per_token`` per token and ``per_pair`` per query-key pair scored,
    packed (causal) and padded to each batch's longest (causal where
    ``padded_causal``, a causal kernel; every pair where not, a mask).
    Returns ``(packed, padded)``; their ratio is the work bound."""
    packed = padded = 0.0
    for n in lengths:
        longest = torch.full_like(n, int(n.max()))
        packed += per_token * float(n.sum()) + per_pair * pairs_scored(n, n, True)
        padded += per_token * float(longest.sum()) + per_pair * pairs_scored(
            longest, longest, padded_causal
        )
    return packed, padded


def speedup_line(label, padded, ragged, bound):
    """The speedup of ``ragged`` over ``padded``, beside the work bound;
    "(within noise)" where the two timings' interquartile ranges overlap."""
    s = padded.median_ms / ragged.median_ms
    noise = "" if outside_noise(padded, ragged) else " (within noise)"
    return (
        f"{label}: speedup {s:.2f}x, work bound {bound:.2f}x, "
        f"fraction of bound {s / bound:.2f}{noise}"
    )


# --- A multi-head attention layer, packed or padded --------------------------


class MultiHeadAttention(nn.Module):
    """Multi-head attention on a packed batch or, unchanged, a padded one.

    ``forward(x, offsets)``: x (T, E) packed, offsets (B + 1,), through
    :func:`ragged_attention` with ``backend``. ``forward(x)``: x (B, S, E)
    padded, one SDPA call; ``key_valid`` (B, S_kv) masks padding keys. With
    ``cross=True`` the keys and values come from ``context`` (with
    ``context_offsets`` when packed). Returns the shape of x.
    """

    def __init__(
        self,
        embed,
        heads,
        *,
        cross=False,
        bias=True,
        backend=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.heads, self.cross, self.backend = heads, cross, backend
        if cross:
            self.q_proj = nn.Linear(embed, embed, **kw)
            self.kv_proj = nn.Linear(embed, 2 * embed, **kw)
        else:
            self.qkv_proj = nn.Linear(embed, 3 * embed, **kw)
        self.out_proj = nn.Linear(embed, embed, **kw)

    def forward(
        self,
        x,
        offsets=None,
        *,
        context=None,
        context_offsets=None,
        key_valid=None,
        is_causal=False,
    ):
        # packed: x (T, E) with offsets (B + 1,); padded: x (B, S, E), and
        # key_valid (B, S_kv) where some keys are padding that must be masked
        if self.cross:
            q, (k, v) = self.q_proj(x), self.kv_proj(context).chunk(2, dim=-1)
        else:
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)) for t in (q, k, v))  # (..., H, D)
        if offsets is not None:
            kv_offsets = context_offsets if self.cross else offsets
            out = ragged_attention(
                q, k, v, offsets, kv_offsets, is_causal=is_causal, backend=self.backend
            )  # (T, H, D)
        else:
            mask = None if key_valid is None else key_valid[:, None, None, :]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask,
                is_causal=is_causal,
            ).transpose(1, 2)
        return self.out_proj(out.flatten(-2))


# --- A small GPT that runs packed or padded ------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a :class:`GPT`: vocabulary, width ``dim``, layers, query
    and key/value heads (grouped-query attention when ``n_kv_heads < n_heads``),
    the SwiGLU hidden width and the longest position."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    max_seq_len: int
    rope_base: float = 10000.0

    @property
    def head_dim(self):
        return self.dim // self.n_heads


class KVCache:
    """Keys and values of every layer for ``batch`` sequences with room for
    ``capacity`` tokens each: (layers, batch, capacity, H_kv, D)."""

    def __init__(self, cfg, batch, capacity, device, dtype):
        shape = (cfg.n_layers, batch, capacity, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        # seen as packed rows (batch * capacity, H_kv, D), sequence b owns rows
        # b * capacity ... (b + 1) * capacity - 1: these are its kv_offsets
        self.row_offsets = torch.arange(batch + 1, device=device) * capacity

    def write_rows(self, layer, k, v, rows):
        """Packed new keys (T, H_kv, D) into their rows; returns all rows."""
        k_all, v_all = self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)
        k_all.index_copy_(0, rows, k.to(k_all.dtype))  # autocast may hand us float32
        v_all.index_copy_(0, rows, v.to(v_all.dtype))
        return k_all, v_all

    def write_columns(self, layer, k, v, start):
        """Padded new keys (B, S, H_kv, D) into columns ``start ...``; returns
        every column up to the last one written."""
        end = start + k.shape[1]
        self.k[layer, :, start:end], self.v[layer, :, start:end] = k, v
        return self.k[layer, :, :end], self.v[layer, :, :end]


@dataclass
class Packed:
    """A packed batch: offsets of the new tokens, the attention backend, and
    for a KV cache each new token's row and each sequence's keys in use."""

    offsets: torch.Tensor  # (B + 1,)
    backend: str | None = None
    cache: KVCache | None = None
    rows: torch.Tensor | None = None  # (T,)
    kv_used: torch.Tensor | None = None  # (B,)

    def attend(self, q, k, v, layer):  # (T, H, D), (T, H_kv, D)
        kv_offsets = None
        if self.cache is not None:
            k, v = self.cache.write_rows(layer, k, v, self.rows)
            kv_offsets = self.cache.row_offsets
        return ragged_attention(
            q,
            k,
            v,
            self.offsets,
            kv_offsets,
            is_causal=True,
            kv_used=self.kv_used,
            backend=self.backend,
        )


@dataclass
class Padded:
    """A padded batch (B, S): no mask (right padding, a causal kernel) or a
    (B, 1, S, S_kv) mask, True where a query may see a key; for a KV cache,
    the column the new tokens start at."""

    mask: torch.Tensor | None = None
    cache: KVCache | None = None
    start: int = 0

    def attend(self, q, k, v, layer):  # (B, S, H, D), (B, S, H_kv, D)
        if self.cache is not None:
            k, v = self.cache.write_columns(layer, k, v, self.start)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=self.mask,
            is_causal=self.mask is None,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.transpose(1, 2)


@dataclass
class CachedStep:
    """One new token for each of B sequences against a :class:`KVCache` of
    fixed capacity, in the style of gpt-fast: the slot each sequence's new
    keys go to is a tensor (``slots``, (B,)), and so is the first slot in
    use (``start``, (B,); left padding, or ``None`` for slot 0). Every shape
    is fixed, so one compiled graph serves every step, with no host sync.
    The kernel scores every slot of the cache and masks those not in use."""

    cache: KVCache
    slots: torch.Tensor  # (B,)
    start: torch.Tensor | None = None  # (B,)

    def attend(self, q, k, v, layer):  # (B, H, D), (B, H_kv, D)
        keys, values = self.cache.k[layer], self.cache.v[layer]  # (B, C, H_kv, D)
        batch = torch.arange(len(q), device=q.device)
        keys[batch, self.slots] = k.to(keys.dtype)
        values[batch, self.slots] = v.to(values.dtype)
        slot = torch.arange(self.cache.capacity, device=q.device)
        mask = slot <= self.slots[:, None]  # (B, C)
        if self.start is not None:
            mask = mask & (slot >= self.start[:, None])
        out = F.scaled_dot_product_attention(
            q[:, :, None].to(keys.dtype),  # (B, H, 1, D)
            keys.transpose(1, 2),  # (B, H_kv, C, D)
            values.transpose(1, 2),
            attn_mask=mask[:, None, None],
            enable_gqa=q.shape[1] != keys.shape[2],
        )
        return out[:, :, 0]  # (B, H, D)


def apply_rope(x, cos, sin):
    """Rotary position embedding: x (..., H, D) rotated by the angles whose
    cosines and sines are (..., 1, D / 2), one row per token's position."""
    # x: (..., H, D); cos and sin: (..., 1, D / 2)
    # Rotated in the precision of cos and sin (float32), returned in the dtype
    # of x: under autocast, q and k stay in the dtype of v.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions: q, k and v from one
    matmul, attention by the batch's layout (:class:`Packed` or
    :class:`Padded`). ``forward(x, cos, sin, layout)``: x (T, dim) or
    (B, S, dim), returns the same shape."""

    def __init__(self, cfg, layer):
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = layer, cfg.n_heads, cfg.n_kv_heads
        self.sizes = [
            cfg.n_heads * cfg.head_dim,
            cfg.n_kv_heads * cfg.head_dim,
            cfg.n_kv_heads * cfg.head_dim,
        ]
        self.wqkv = nn.Linear(
            cfg.dim, sum(self.sizes), bias=False
        )  # one matmul for q, k, v
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, layout):
        q, k, v = self.wqkv(x).split(self.sizes, dim=-1)
        q = apply_rope(q.unflatten(-1, (self.n_heads, -1)), cos, sin)
        k = apply_rope(k.unflatten(-1, (self.n_kv_heads, -1)), cos, sin)
        v = v.unflatten(-1, (self.n_kv_heads, -1))
        return self.wo(layout.attend(q, k, v, self.layer).flatten(-2))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(gate) * up)``, gate and up from one matmul. Works on
    the last dimension: (..., dim) -> (..., dim)."""

    def __init__(self, cfg):
        super().__init__()
        self.w13 = nn.Linear(
            cfg.dim, 2 * cfg.ffn_hidden, bias=False
        )  # gate and up, one matmul
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    """A pre-norm decoder block: RMSNorm, :class:`Attention`, residual;
    RMSNorm, :class:`FeedForward`, residual."""

    def __init__(self, cfg, layer):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attn, self.ffn = Attention(cfg, layer), FeedForward(cfg)

    def forward(self, x, cos, sin, layout):
        x = x + self.attn(self.attn_norm(x), cos, sin, layout)
        return x + self.ffn(self.ffn_norm(x))


class GPT(nn.Module):
    """A decoder-only transformer (RMSNorm, rotary positions, SwiGLU, GQA) in
    the style of gpt-fast. ``forward(tokens, positions, layout)``: tokens and
    positions (T,) packed with a :class:`Packed` layout, or (B, S) padded with
    a :class:`Padded` one; returns logits (T, vocab) or (B, S, vocab).
    Positions restart at every sequence: :func:`token_index` gives them."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        half = cfg.head_dim // 2
        freqs = cfg.rope_base ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), freqs)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, tokens, positions, layout):
        # tokens, positions: (T,) packed or (B, S) padded -> logits (..., vocab)
        x = self.tok_embeddings(tokens)
        cos = self.cos[positions].unsqueeze(-2).to(x.dtype)  # (..., 1, D / 2)
        sin = self.sin[positions].unsqueeze(-2).to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, layout)
        return self.output(self.norm(x))


@torch.no_grad()
def prefill_packed(model, prompts, offsets, cache, backend=None):
    """Every prompt at once, packed (T,) with offsets (B + 1,): writes each
    token's keys and values into its sequence's rows of ``cache`` (a
    :class:`KVCache`) and returns the logits of each prompt's last token,
    (B, vocab). Call it under autocast for a lower precision."""
    seq, pos = token_index(offsets)
    layout = Packed(offsets, backend, cache, seq * cache.capacity + pos, offsets.diff())
    return model(prompts, pos, layout)[offsets[1:] - 1]


@torch.no_grad()
def decode_greedy(model, logits, cache, positions, n_new, *, slots=None, start=None,
                  step=None):
    """``n_new`` greedy tokens per sequence from the prefill's last logits
    (B, vocab): each step feeds one token per sequence at its own position
    (``positions``, (B,), the prompt lengths) through a :class:`CachedStep`.
    ``slots`` (B,) is where the first new token's keys go (default: its
    position); ``start`` is the first cache slot in use (left padding).
    ``step(model, tokens, positions, layout)`` runs the model, for example
    ``torch.compile(call_model, dynamic=False)``. Returns (B, n_new)."""
    step = call_model if step is None else step
    slots = positions if slots is None else slots
    out = []
    for i in range(n_new):
        out.append(logits.argmax(-1))  # (B,)
        if i < n_new - 1:
            layout = CachedStep(cache, slots + i, start)
            logits = step(model, out[-1], positions + i, layout)
    return torch.stack(out, 1)


def call_model(model, tokens, positions, layout):
    """``model(tokens, positions, layout)``: the decoding step to compile."""
    return model(tokens, positions, layout)


@torch.no_grad()
def generate_packed(model, prompts, offsets, n_new, backend=None, *, dtype=None):
    """Greedy generation for packed prompts (T,) with offsets (B + 1,): a
    prefill of every prompt at once, then one token per sequence per step
    into a :class:`KVCache`. ``dtype`` (default: :func:`default_dtype` of the
    prompts' device) other than float32 runs under autocast.
    Returns the new tokens, (B, n_new)."""
    dtype = default_dtype(prompts.device) if dtype is None else dtype
    B, lengths = len(offsets) - 1, offsets.diff()
    cache = KVCache(model.cfg, B, int(lengths.max()) + n_new, prompts.device, dtype)
    seq, pos = token_index(offsets)
    with torch.autocast(prompts.device.type, dtype=dtype, enabled=dtype != torch.float32):
        layout = Packed(offsets, backend, cache, seq * cache.capacity + pos, lengths)
        logits = model(prompts, pos, layout)[
            offsets[1:] - 1
        ]  # (B, vocab): each prompt's last token
        one_each, rows = (
            torch.arange(B + 1, device=prompts.device),
            cache.row_offsets[:-1],
        )
        out = []
        for step in range(n_new):
            out.append(logits.argmax(-1))  # (B,)
            if step < n_new - 1:
                pos = lengths + step  # each sequence's own next position
                logits = model(
                    out[-1], pos, Packed(one_each, backend, cache, rows + pos, pos + 1)
                )
    return torch.stack(out, 1)  # (B, n_new)


# --- Documents, token budgets and data-parallel steps ----------------------------

_CORPUS_CACHE = {}
# folders of the standard library whose files are tests, test data or installs
_NOT_LIBRARY = {"site-packages", "dist-packages", "test", "tests", "idle_test",
                "__pycache__"}


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
    and a name for where they came from. Cached within the process."""
    key = (min_chars, limit)
    if key not in _CORPUS_CACHE:
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
        source = f"the Python {version} standard library's docstrings"
        _CORPUS_CACHE[key] = (documents[:limit], source)
    documents, source = _CORPUS_CACHE[key]
    return list(documents), source


def pack_documents(documents, max_len=None):
    """Documents (``bytes``) end to end as byte tokens, 0 to 255: packed
    tokens (T,) int64 and offsets (B + 1,); each cut to ``max_len`` tokens."""
    lengths = [len(d) if max_len is None else min(len(d), max_len) for d in documents]
    flat = b"".join(d[:n] for d, n in zip(documents, lengths))
    tokens = torch.frombuffer(bytearray(flat), dtype=torch.uint8).long()
    return tokens, offsets_from_lengths(lengths)


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
    offsets = torch.cat([*starts_of, starts[-1:]])
    return tokens, offsets


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


def check_documents_apart(model, document, pack, backend=None):
    """Raise ``AssertionError`` unless two copies of ``document`` (``bytes``)
    packed by ``pack`` (a function of a list of documents that returns packed
    tokens and offsets, like :func:`pack_documents`) give the same logits:
    the second copy must not attend to the first."""
    tokens, offsets = pack([document, document])
    n = len(document)
    positions = token_index(offsets)[1]
    with torch.no_grad():
        logits = model(tokens, positions, Packed(offsets, backend))
    gap = (logits[:n] - logits[n:]).abs().max().item()
    assert gap < 1e-4, (
        f"two identical documents in one pack give different logits (largest difference "
        f"{gap:.2f}): the second attends to the first; offsets {offsets.tolist()}"
    )
    return gap


def check_targets(tokens, targets, offsets):
    """Raise ``AssertionError`` unless ``targets`` are each token's next token
    within its document and -100 at each document's last token: the first
    token of a document is never the target of the one before it."""
    for i, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if end == start:
            continue
        last = int(targets[end - 1])
        assert last == -100, (
            f"the last token of document {i} (token {end - 1}) has target {last}"
            + (", the first token of the next document" if end < len(tokens) else "")
            + ": a document is trained to predict the one after it"
        )
        inside = targets[start : end - 1]
        assert torch.equal(inside, tokens[start + 1 : end]), (
            f"document {i}: the targets inside it are not its own next tokens"
        )


def check_positions(positions, offsets):
    """Raise ``AssertionError`` unless ``positions`` restart at 0 at every
    document and count up inside it."""
    expected = token_index(offsets)[1]
    wrong = (positions != expected).nonzero().flatten()
    if len(wrong):
        t = int(wrong[0])
        doc = int(torch.searchsorted(offsets, t, right=True)) - 1
        raise AssertionError(
            f"token {t} (document {doc}, which starts at token {int(offsets[doc])}) has "
            f"position {int(positions[t])}, expected {int(expected[t])}: positions must "
            "restart at 0 at every document"
        )


def token_loss_sum(model, tokens, offsets, backend=None, dtype=torch.float32):
    """The sum of the next-token losses of a packed micro-batch and its
    number of targets (each document's last token has none)."""
    targets = document_targets(tokens, offsets)
    positions = token_index(offsets)[1]
    with torch.autocast(tokens.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(tokens, positions, Packed(offsets, backend))  # (T, vocab)
    loss = F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")
    return loss, (targets != -100).sum()


def data_parallel_step(
    model,
    micro_batches,
    sync=None,
    *,
    reduce_count=True,
    backend=None,
    dtype=torch.float32,
):
    """Forward and backward of one step with gradient accumulation, on this rank.

    The loss of the step is the sum of the token losses of every micro-batch
    on every rank, divided by the number of targets of all of them: the
    count is summed over the ranks (``all_reduce``) before any backward.
    ``sync(last)`` gives the context for a micro-batch's backward (the
    ``no_sync`` of DDP for all but the last). DDP and FSDP2 average the gradients
    over the ranks, so each rank's loss is multiplied by the world size.
    ``reduce_count=False`` is the usual mistake: each rank divides by its own
    count. Returns the step's loss summed over this rank's micro-batches."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = micro_batches[0][0].device
    count = sum(int((document_targets(t, o) != -100).sum()) for t, o in micro_batches)
    count = torch.tensor(count, device=device)
    if reduce_count and world > 1:
        dist.all_reduce(count)  # every rank now holds the step's count
    scale = world / count if reduce_count else 1 / count
    total = 0.0
    for i, (tokens, offsets) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with sync(last) if sync is not None else nullcontext():
            loss_sum, _ = token_loss_sum(model, tokens, offsets, backend, dtype)
            (loss_sum * scale).backward()
        total += loss_sum.item() * float(scale) / world
    return total


def one_process_gradients(model, micro_batches, backend=None):
    """The reference for a data-parallel step: the gradients of the mean
    next-token loss over every micro-batch of every rank, packed as one batch
    in this process (float32). ``{name: gradient}``."""
    tokens, offsets = concat_batches(micro_batches)
    model.zero_grad(set_to_none=True)
    positions = token_index(offsets)[1]
    logits = model(tokens, positions, Packed(offsets, backend)).float()
    targets = document_targets(tokens, offsets)
    F.cross_entropy(logits, targets, ignore_index=-100).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def check_same_gradients(grads, reference, tol=1e-4):
    """Raise ``AssertionError`` unless every gradient in ``grads`` is within
    ``tol`` of the one in ``reference``; returns the largest difference."""
    gaps = {n: (grads[n].float().cpu() - g.float().cpu()).abs().max().item()
            for n, g in reference.items()}
    name = max(gaps, key=gaps.get)
    assert gaps[name] <= tol, (
        f"the data-parallel gradients differ from one process on the whole batch: "
        f"max difference {gaps[name]:.1e} (in {name}) > {tol:.0e}"
    )
    return gaps[name]


#: The script each rank runs, ``worker.py``: it calls :func:`data_parallel_worker`.
DATA_PARALLEL_SCRIPT = """\
import sys

from ragged_toolkit import data_parallel_worker

data_parallel_worker(sys.argv[1])
"""


def _wrap(cfg, state, how, device):
    # a fresh model from the shared weights, wrapped for data parallelism:
    # (the model, what to call, the context of each micro-batch's backward)
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = GPT(cfg).to(device)
    model.load_state_dict(state)
    if how == "ddp":
        ids = [device] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids)
        return model, ddp, lambda last: nullcontext() if last else ddp.no_sync()
    if how == "fsdp":
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)

        def sync(last):
            model.set_requires_gradient_sync(last)  # reduce-scatter at the last only
            return nullcontext()

        return model, model, sync
    raise ValueError(f"unknown wrapper {how!r}: ddp or fsdp")


def data_parallel_worker(folder):
    """One rank of :func:`run_data_parallel`, started by ``torch.distributed.run``
    (which sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``). Reads
    ``job.json`` and ``data.pt`` from ``folder``; for each gradient run, one
    :func:`data_parallel_step` (rank 0 saves the whole gradients); for each
    timed scheme, training steps with AdamW, each timed between barriers.
    Writes ``rank<R>.json``, what this rank measured, or ``rank<R>.error``,
    the traceback it stopped with."""
    folder, rank = Path(folder), int(os.environ["RANK"])
    try:
        report = _data_parallel_rank(folder, rank)
    except BaseException:
        import traceback

        (folder / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    (folder / f"rank{rank}.json").write_text(json.dumps(report))


def _data_parallel_rank(folder, rank):
    job = json.loads((folder / "job.json").read_text())
    data = torch.load(folder / "data.pt", weights_only=True)
    world = int(os.environ["WORLD_SIZE"])
    cuda = job["backend"] == "nccl"
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # the check compares in float32
    dist.init_process_group(job["backend"], device_id=device if cuda else None)
    cfg, dtype = GPTConfig(**job["config"]), getattr(torch, job["dtype"])
    # a rank on the CPU of a GPU machine leaves the GPU alone
    wait = torch.cuda.synchronize if cuda else (lambda: None)
    report = {"rank": rank, "world_size": world, "backend": job["backend"],
              "device": str(device), "threads": torch.get_num_threads(), "timing": {}}
    try:
        mine = [(t.to(device), o.to(device)) for t, o in data["grad_batches"][rank]]
        for run in job["grad_runs"]:
            model, runner, sync = _wrap(cfg, data["init"], run["wrap"], device)
            data_parallel_step(runner, mine, sync, reduce_count=run["reduce_count"],
                               backend=job["grad_backend"])
            grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                     for n, p in model.named_parameters()}  # FSDP2 holds shards: gather
            if rank == 0:
                grads = {n: g.cpu() for n, g in grads.items()}
                torch.save(grads, folder / f"grads-{run['name']}.pt")
        for scheme, steps in data["time_batches"].items():
            model, runner, sync = _wrap(cfg, data["init"], "ddp", device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=job["lr"])
            seconds, tokens = [], []
            for step in steps:  # step[rank]: this rank's micro-batches
                batches = [(t.to(device), o.to(device)) for t, o in step[rank]]
                wait()
                dist.barrier()
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                data_parallel_step(
                    runner, batches, sync, backend=job["time_backend"], dtype=dtype
                )
                optimizer.step()
                wait()
                seconds.append(time.perf_counter() - start)
                tokens.append(sum(len(t) for t, _ in batches))
            report["timing"][scheme] = {"seconds": seconds, "tokens": tokens}
    finally:
        dist.destroy_process_group()
    return report


def data_parallel_command(nproc, script="worker.py", folder="FOLDER"):
    """The command that starts ``nproc`` ranks of the worker script on this
    machine (``torchrun --standalone --nproc-per-node=N`` is the same)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", script, folder]


def run_data_parallel(job, data, nproc, *, timeout=600):
    """Launch :func:`data_parallel_worker` on ``nproc`` ranks with
    :func:`data_parallel_command`, in a temporary folder that holds the job,
    the worker script and this module's own source, which the ranks import
    (so a downloaded page, whose toolkit is no file, launches it too). Each
    rank's output is kept out of the caller's; on failure, its last lines are
    raised. Returns the ranks' reports in rank order and the gradients of
    each gradient run, ``{name: {parameter: gradient}}``."""
    with tempfile.TemporaryDirectory(prefix="data-parallel-") as name:
        folder = Path(name)
        (folder / f"{__name__}.py").write_text(inspect.getsource(sys.modules[__name__]))
        (folder / "worker.py").write_text(DATA_PARALLEL_SCRIPT)
        (folder / "job.json").write_text(json.dumps(job))
        torch.save(data, folder / "data.pt")
        threads = max(1, (os.cpu_count() or 1) // nproc)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        command = data_parallel_command(nproc, folder=str(folder))
        proc = subprocess.run(command, cwd=folder, env=env, capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0:
            errors = sorted(folder.glob("rank*.error"))  # the ranks' own tracebacks
            text = errors[0].read_text() if errors else proc.stdout + proc.stderr
            tail = "\n".join(text.strip().splitlines()[-30:])
            where = f", {errors[0].stem}" if errors else ""
            raise RuntimeError(f"{nproc} ranks on {job['backend']} failed "
                               f"(exit {proc.returncode}{where}):\n{tail}")
        reports = [json.loads((folder / f"rank{r}.json").read_text())
                   for r in range(nproc)]
        grads = {run["name"]: torch.load(folder / f"grads-{run['name']}.pt",
                                         weights_only=True)
                 for run in job["grad_runs"]}
    return reports, grads
