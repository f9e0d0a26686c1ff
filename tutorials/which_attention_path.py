"""
Which attention path should I use?
==================================

Every padding-free attention path PyTorch offers, against every job a reader
has, on the device that built this page: whether it runs and why not,
whether it is correct, how fast, how much memory, and which kernel actually
ran. Then a decision guide drawn from this build's table.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Which of padding with a mask, SDPA on nested tensors, FlexAttention
         with a document mask, ``varlen_attn``, a per-sequence loop and length
         buckets can serve inference, training, decoding against a cache, a
         custom score function and grouped-query attention on your device
       * How to read the kernel that ran, and why the answer changes between
         a CPU and a GPU

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * The toolkit of the building-blocks page (copied below, so this file
         runs on its own)
       * PyTorch 2.11 or later; on a CPU the table shows the CPU, on a CUDA
         GPU it runs at full scale in ``bfloat16``

The answer to "which attention path?" is a measurement, not a rule: it
depends on the device, the dtype, the lengths and the job. This page runs
the measurement; everything it concludes is printed from the table below, so
it holds for the device named at the top of the page and nowhere else.
"""

# sphinx_gallery_tags = ["decision guide", "SDPA", "FlexAttention", "varlen attention", "benchmarks"]

# %%
# Setup
# -----

import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11):
    raise RuntimeError(f"This page needs PyTorch 2.11 or later; this is {torch.__version__}. "
                       "Upgrade with `pip install -U torch`.")

def default_dtype(device):
    """The dtype a page computes in: ``bfloat16`` on CUDA (``float16`` on a GPU
    without it), ``float32`` on CPU. ``TUTORIALS_DTYPE`` overrides it, so the
    low-precision paths can be exercised on a CPU too."""
    name = os.environ.get("TUTORIALS_DTYPE")
    if name:
        if name not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"TUTORIALS_DTYPE must be float32, bfloat16 or float16, got {name!r}")
        return getattr(torch, name)
    if device != "cuda":
        return torch.float32
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    print("This GPU has no bfloat16: the page runs in float16 instead.")
    return torch.float16


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = default_dtype(DEVICE)
QUICK = os.environ.get("TUTORIALS_QUICK") == "1"
SEED = 0
torch.manual_seed(SEED)
print(f"PyTorch {torch.__version__}, device: {DEVICE}"
      + (f" ({torch.cuda.get_device_name()})" if DEVICE == "cuda" else f", {os.cpu_count()} cores")
      + f", dtype: {DTYPE}")

# sphinx_gallery_start_ignore
import logging
import warnings

warnings.filterwarnings("ignore", message=r".*nested tensors is in prototype stage")
warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")


class _DropNotes(logging.Filter):
    def filter(self, record):
        return not record.getMessage().startswith(("is_fx_tracing", "Failed to pickle cache key"))


for _name in ("torch.fx._symbolic_trace", "torch._inductor.codecache"):
    logging.getLogger(_name).addFilter(_DropNotes())
# sphinx_gallery_end_ignore

# %%
# Sizes
# ~~~~~
# One batch of sentences from the site's length generator, with attention of
# ``HEADS`` heads of size ``HEAD_DIM``; the grouped-query job shares each
# key/value head among four query heads.

if DEVICE == "cuda":
    BATCH, HEADS, HEAD_DIM, ZIPF_ALPHA, RUN_TIME = 256, 16, 64, 1.1, 0.5
else:
    BATCH, HEADS, HEAD_DIM, ZIPF_ALPHA, RUN_TIME = 48, 8, 32, 1.2, 0.2
if QUICK:
    BATCH, RUN_TIME = 12, 0.05
KV_HEADS = HEADS // 4  # for the grouped-query job
print(f"batch {BATCH}, {HEADS} heads of {HEAD_DIM}, GQA with {KV_HEADS} key/value heads")

# %%
# The toolkit
# -----------
# An identical copy of the building-blocks page's toolkit, the parts this page
# uses. ``compare_backends`` does the work of this page: for one attention
# job it runs every backend that can take it here, checks it against the
# float32 reference (output and, for training, gradients), times them side by
# side and names the kernel that ran.
#
# .. raw:: html
#
#    <details class="toolkit-copy"><summary>Show the code of the toolkit</summary>

import gc
import inspect
import time
from dataclasses import dataclass, field

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils import benchmark

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # not in this build of PyTorch
    varlen_attn = None

STOP_RANKS = (3, 386, 858)
BACKENDS = ("varlen", "sdpa_njt", "flex", "loop", "bucketed", "padded")


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


def token_index(offsets):
    """The sequence of every packed token and its position in that sequence,
    both (T,): offsets [0, 2, 5] give [0, 0, 1, 1, 1] and [0, 1, 0, 1, 2]."""
    lengths = offsets.diff()
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=offsets.device), lengths)
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


def _varlen_keywords():
    # the keyword arguments of varlen_attn differ between releases: read them
    return set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()


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
        return "on CPU only the math path of SDPA takes nested tensors, and it refuses is_causal"
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
    if offsets.dim() != 1 or len(offsets) < 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32 or int64 tensor of B + 1 entries, "
                         f"got shape {tuple(offsets.shape)} and {offsets.dtype}")
    if int(offsets[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(offsets[0])}")
    steps = offsets.diff()
    if bool((steps < 0).any()):
        i = int((steps < 0).nonzero()[0])
        raise ValueError(f"{name} must not decrease: {name}[{i}] = {int(offsets[i])} "
                         f"> {name}[{i + 1}] = {int(offsets[i + 1])}")
    if int(offsets[-1]) != total:
        raise ValueError(f"{name} must end at the token count, {total}, got {int(offsets[-1])}")


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
        if cached_stamp == stamp and all(a is b for a, b in zip(cached_key, key)
                                         if isinstance(a, torch.Tensor) or a is None):
            return value
    value = compute()
    _INFO_CACHE.insert(0, (key, stamp, value))
    del _INFO_CACHE[16:]
    return value


def _offsets_lengths(q_offsets, kv_offsets, n_q, n_kv):
    check_offsets(q_offsets, n_q, "q_offsets")
    check_offsets(kv_offsets, n_kv, "kv_offsets")
    if len(q_offsets) != len(kv_offsets):
        raise ValueError(f"q_offsets and kv_offsets describe different batch sizes: "
                         f"{len(q_offsets) - 1} and {len(kv_offsets) - 1} sequences")
    return q_offsets.diff().tolist(), kv_offsets.diff().tolist()


def ragged_info(q_offsets, kv_offsets, n_q, n_kv, kv_used=None, is_causal=False):
    """Check a batch's description and read its lengths, once per batch (the
    offsets once, however often ``kv_used`` changes, as in decoding)."""

    def compute():
        q_lengths, kv_rows = _cached((q_offsets, kv_offsets, n_q, n_kv),
                                     lambda: _offsets_lengths(q_offsets, kv_offsets, n_q, n_kv))
        kv_lengths = kv_rows if kv_used is None else kv_used.tolist()
        if len(kv_lengths) != len(kv_rows) or any(not 0 <= n <= r for n, r in zip(kv_lengths, kv_rows)):
            raise ValueError(f"kv_used must hold one count per sequence, between 0 and its key "
                             f"rows {kv_rows}; got {kv_lengths}")
        if is_causal and any(0 < lkv < lq for lq, lkv in zip(q_lengths, kv_lengths)):
            raise ValueError("is_causal needs at least as many keys as queries in every sequence "
                             "(the last query sees every key)")
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
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if mask is None and is_causal and lq > 1:
        mask = _causal_mask(lq, lkv, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _loop(q, k, v, info, is_causal, scale, kv_used):
    """One dense SDPA call per sequence, on views of the packed tensors."""
    # (T, H, D) -> (1, H, T, D) once; ``split`` then gives one view per sequence,
    # and its backward is a single concatenation
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = []
    for qi, ki, vi, n, rows in zip(qh.split(info.q_lengths, 2), kh.split(info.kv_rows, 2),
                                   vh.split(info.kv_rows, 2), info.kv_lengths, info.kv_rows):
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
        q_idx = torch.where(q_real, torch.as_tensor(q_start[group])[:, None] + torch.arange(sq), 0)
        kv_idx = torch.where(kv_real, torch.as_tensor(kv_start[group])[:, None] + torch.arange(skv), 0)
        mask = kv_real[:, None, :]  # (n, 1, Skv): real keys only
        if is_causal:  # query i sees keys up to i + Lkv - Lq
            mask = mask & (torch.arange(skv) <= torch.arange(sq)[:, None] + (lkv - lq)[:, None, None])
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
        qb, kb, vb = (t[idx].transpose(1, 2) for t, idx in ((q, q_idx), (k, kv_idx), (v, kv_idx)))
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
    if ("rectangle", is_causal) not in info.plans:  # one mask per batch, shared by every layer
        used = torch.tensor(info.kv_lengths, device=q.device)[:, None, None, None]
        key, query = torch.arange(n, device=q.device), torch.arange(lq, device=q.device)[:, None]
        mask = key < used  # (B, 1, 1, n), or with the causal rule (B, 1, Lq, n)
        info.plans["rectangle", is_causal] = mask & (key <= query + used - lq) if is_causal else mask
    qb = q.view(B, lq, *q.shape[1:]).transpose(1, 2)  # (B, H, Lq, D)
    kb, vb = (t.view(B, rows, *t.shape[1:])[:, :n].transpose(1, 2) for t in (k, v))  # (B, H_kv, n, D)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=info.plans["rectangle", is_causal], scale=scale,
                                         enable_gqa=qb.shape[1] != kb.shape[1])
    return out.transpose(1, 2).reshape(q.shape)


_compiled_flex_attention = torch.compile(flex_attention, dynamic=False if DEVICE == "cpu" else None)


def _flex(q, k, v, info, is_causal, scale, kv_used):
    """FlexAttention over the whole packed batch, with a document mask."""
    key = ("flex", is_causal)
    if key not in info.plans:  # one BlockMask per batch, shared by every layer
        q_seq, q_pos = token_index(offsets_from_lengths(info.q_lengths, q.device))
        kv_seq, kv_pos = token_index(offsets_from_lengths(info.kv_rows, q.device))
        kv_len = torch.tensor(info.kv_lengths, device=q.device)
        shift = kv_len - torch.tensor(info.q_lengths, device=q.device)

        def document_mask(b, h, q_idx, kv_idx):
            same = (q_seq[q_idx] == kv_seq[kv_idx]) & (kv_pos[kv_idx] < kv_len[kv_seq[kv_idx]])
            if is_causal:
                same = same & (kv_pos[kv_idx] <= q_pos[q_idx] + shift[q_seq[q_idx]])
            return same

        info.plans[key] = create_block_mask(document_mask, None, None, len(q_seq), len(kv_seq),
                                            device=q.device)
    if not torch.is_grad_enabled():  # on CPU it refuses inputs that require grad
        q, k, v = q.detach(), k.detach(), v.detach()
    # (T, H, D) -> (1, H, T, D): the whole batch as one long sequence
    qf, kf, vf = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = _compiled_flex_attention(qf, kf, vf, block_mask=info.plans[key], scale=scale,
                                   enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def _sdpa_njt(q, k, v, info, is_causal, scale, kv_used):
    """SDPA on nested jagged tensors built from the same values and offsets."""
    if is_causal and info.q_lengths != info.kv_lengths and max(info.q_lengths) > 1:
        raise NotImplementedError("SDPA on nested tensors aligns is_causal top-left: it "
                                  "needs equal query and key lengths")

    def njt(x, lengths):  # (T, H, D) -> (B, H, j, D)
        offsets = offsets_from_lengths(lengths, x.device)
        nt = torch.nested.nested_tensor_from_jagged(x.contiguous(), offsets, max_seqlen=max(lengths))
        return nt.transpose(1, 2)

    causal = is_causal and max(info.q_lengths) > 1  # one query per sequence sees every key
    out = F.scaled_dot_product_attention(njt(q, info.q_lengths), njt(k, info.kv_rows),
                                         njt(v, info.kv_rows), is_causal=causal, scale=scale)
    return out.transpose(1, 2).values()


def _varlen(q, k, v, info, is_causal, scale, kv_used):
    """``varlen_attn``: the variable-length kernel of FlashAttention, on the packed batch."""
    keywords = _varlen_keywords()
    kw = {"scale": scale}
    if is_causal:  # a flag in PyTorch 2.10, a window from 2.11 on
        kw.update({"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True})
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


_BACKEND_FNS = {"varlen": _varlen, "sdpa_njt": _sdpa_njt, "flex": _flex,
                "loop": _loop, "bucketed": _bucketed, "padded": _padded}


def _compact_plan(info, device):
    # Keep the sequences that have queries and keys, and only the key rows they
    # use: the query rows kept, the key rows kept, and the smaller batch.
    keep = [i for i, (lq, lkv) in enumerate(zip(info.q_lengths, info.kv_lengths)) if lq and lkv]
    q_start = np.cumsum([0] + info.q_lengths)
    kv_start = np.cumsum([0] + info.kv_rows)
    q_rows = [np.arange(q_start[i], q_start[i] + info.q_lengths[i]) for i in keep]
    kv_rows = [np.arange(kv_start[i], kv_start[i] + info.kv_lengths[i]) for i in keep]
    used = [info.kv_lengths[i] for i in keep]
    return (torch.as_tensor(np.concatenate(q_rows or [[]]), dtype=torch.long, device=device),
            torch.as_tensor(np.concatenate(kv_rows or [[]]), dtype=torch.long, device=device),
            RaggedInfo([info.q_lengths[i] for i in keep], used, used))


@torch.compiler.disable  # host-side bookkeeping; a compiled model calls it as is
def ragged_attention(q, k, v, q_offsets, kv_offsets=None, *, is_causal=False, kv_used=None,
                     scale=None, backend=None):
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
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"expected q (T_q, H, D) and k, v (T_kv, H_kv, D) with H a multiple "
                         f"of H_kv; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:  # fused kernels refuse a mix; autocast hides it from some
        raise ValueError(f"q, k and v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype} "
                         "(under autocast, cast float32 rotary outputs back to the projection's dtype)")
    info = ragged_info(q_offsets, kv_offsets, q.shape[0], k.shape[0], kv_used, is_causal)
    name = backend or default_backend(q.device, q.dtype)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    why = backend_support(name, q.device, q.dtype, is_causal=is_causal, needs_grad=needs_grad,
                          gqa=q.shape[1] != k.shape[1])
    if why:
        raise RuntimeError(f"ragged_attention: backend {name!r} cannot run this here: {why}")
    fn = _BACKEND_FNS[name]
    reads_kv_used = (name in ("loop", "flex") or (name == "varlen" and "seqused_k" in _varlen_keywords())
                     or (name == "padded" and len(set(info.q_lengths)) == len(set(info.kv_rows)) == 1))
    if all(info.q_lengths) and all(info.kv_lengths) and (kv_used is None or reads_kv_used):
        return fn(q, k, v, info, is_causal, scale, kv_used)
    if "compact" not in info.plans:
        info.plans["compact"] = _compact_plan(info, q.device)
    q_rows, kv_rows, kept = info.plans["compact"]
    out = q.new_zeros(q.shape)
    if len(q_rows):
        out = out.index_copy(0, q_rows, fn(q[q_rows], k[kv_rows], v[kv_rows], kept, is_causal, scale, None))
    return out


def reference_attention(q, k, v, q_offsets, kv_offsets=None, *, is_causal=False, kv_used=None,
                        scale=None):
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
                qi = q[q_start[i]:q_start[i] + lq].float().transpose(0, 1)  # (H, Lq, D)
                ki, vi = (t[kv_start[i]:kv_start[i] + lkv].float().repeat_interleave(group, 1)
                          .transpose(0, 1) for t in (k, v))  # (H, Lkv, D)
                mask = _causal_mask(lq, lkv, q.device) if is_causal else None
                out[q_start[i]:q_start[i] + lq] = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=scale).transpose(0, 1)
    return out


def tolerances(dtype):
    """``assert_close`` tolerances for results computed in ``dtype``."""
    return {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
            torch.float16: dict(atol=5e-3, rtol=5e-3)}[dtype]


def _sync():
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
        while parent is not None and parent.name.removesuffix("_backward") not in _KERNELS:
            parent = parent.cpu_parent
        if base in _KERNELS and parent is None:  # not called by another attention op
            label = _KERNELS[base] + (" backward" if e.name.endswith("_backward") else "")
            counts[label] = counts.get(label, 0) + 1
    if not counts and any(e.name.startswith("triton_tem_fused") for e in events):
        counts["FlexAttention Triton kernel"] = 1
    if not counts and any(e.name.startswith("Torch-Compiled Region") for e in events):
        counts["compiled graph (inductor kernel)"] = 1
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counts.items())


def profile_call(fn):
    """Run ``fn`` once under the profiler: the memory it needed beyond what was
    allocated before, in MiB, and the attention kernels that ran."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # keep the log lines of the profiler quiet
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # free what earlier calls left behind before counting
    cuda = torch.cuda.is_available()
    if cuda:
        _sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, profile_memory=not cuda) as prof:
        fn()
        _sync()
    if cuda:
        peak = torch.cuda.max_memory_allocated() - before
    else:  # the running sum of the allocation and free events, in time order
        sizes = [n for _, n in sorted((e.start_ns(), e.nbytes())
                                      for e in prof.profiler.kineto_results.events()
                                      if e.name() == "[memory]")]
        peak = max(float(np.cumsum(sizes).max()), 0.0) if sizes else 0.0
    return peak / 2**20, _kernel_label(prof.events())


@dataclass
class Timing:
    """Median and IQR of the timed runs in ms, the first call in s, peak
    memory in MiB, and the attention kernels that ran."""

    median_ms: float
    iqr_ms: float
    first_call_s: float
    peak_mib: float = float("nan")
    kernels: str = ""

    def __str__(self):
        memory = "" if self.peak_mib != self.peak_mib else f"  peak {self.peak_mib:7.1f} MiB"  # NaN: not measured
        return f"{self.median_ms:9.2f} ms (IQR {self.iqr_ms:6.2f}){memory}" + (f"  [{self.kernels}]" if self.kernels else "")


def measure(fns, *, min_run_time=1.0, rounds=3, profile=True):
    """Time callables side by side. ``fns`` maps a name to a function of no
    arguments; returns name -> Timing."""
    first = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        _sync()
        first[name] = time.perf_counter() - start
    times = {name: [] for name in fns}
    for _ in range(rounds):  # take turns, so that a busy machine slows all alike
        for name, fn in fns.items():
            timer = benchmark.Timer("fn()", globals={"fn": fn})
            times[name] += timer.blocked_autorange(min_run_time=min_run_time / rounds).times
    out = {}
    for name, fn in fns.items():
        q1, median, q3 = np.percentile(times[name], [25, 50, 75]) * 1e3
        peak, kernels = profile_call(fn) if profile else (float("nan"), "")
        out[name] = Timing(median, q3 - q1, first[name], peak, kernels)
    return out


def where_time_goes(fn, top=6):
    """Profile one call of ``fn``: the operators that took most of its time."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        _sync()
    rows = prof.key_averages()
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(own(e) for e in rows) or 1
    rows = sorted(rows, key=own, reverse=True)[:top]
    return "\n".join(f"  {e.key[:52]:52s} {own(e) / 1e3:8.2f} ms {100 * own(e) / total:5.1f}%  "
                     f"x{e.count}" for e in rows)


def compare_backends(q, k, v, q_offsets, kv_offsets=None, *, is_causal=False, kv_used=None,
                     backward=False, backends=BACKENDS, min_run_time=0.5):
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
        why = backend_support(name, q.device, q.dtype, is_causal=is_causal, needs_grad=backward, gqa=gqa)
        if why is None:
            def run(name=name):
                with torch.set_grad_enabled(backward):
                    out = ragged_attention(q, k, v, q_offsets, kv_offsets, backend=name, **kw)
                    return (out, torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
                            if backward else None)
            try:
                out, grads = run()
            except Exception as err:  # one clear line instead of a traceback
                why = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:120]}"
        if why:
            results[name] = why
            continue
        torch.testing.assert_close(out.float(), reference, **tolerances(q.dtype),
                                   msg=lambda m, name=name: f"{name} disagrees with the reference: {m}")
        for g, r in zip(grads or (), ref_grads if backward else ()):
            torch.testing.assert_close(g.float(), r, **tolerances(q.dtype),
                                       msg=lambda m, name=name: f"{name}'s gradients disagree: {m}")
        fns[name] = run
    results.update(measure(fns, min_run_time=min_run_time))
    for name in backends:
        r = results[name]
        print(f"  {name:9s} {r}" if isinstance(r, Timing) else f"  {name:9s} not available: {r}")
    return results


def fastest(results):
    """The backend with the lowest median time among those that ran."""
    timed = {n: r for n, r in results.items() if isinstance(r, Timing)}
    return min(timed, key=lambda n: timed[n].median_ms)


def pairs_scored(q_lengths, kv_lengths, causal):
    """Query-key pairs a kernel scores: the causal half, L(L+1)/2 per sequence,
    when it skips the masked half, else every pair."""
    q, kv = torch.as_tensor(q_lengths).double(), torch.as_tensor(kv_lengths).double()
    return float((q * (q + 1) / 2 if causal else q * kv).sum())


def work_bound(q_lengths, kv_lengths=None, *, per_token, per_pair, per_kv_token=0.0,
               causal=False, padded_causal=None):
    """The work of the padded batch over the work of the ragged batch.
    ``padded_causal``: whether the padded side skips the masked half of the
    scores (a causal kernel) or computes the whole square (a merged mask)."""
    q = torch.as_tensor(q_lengths)
    kv = q if kv_lengths is None else torch.as_tensor(kv_lengths)
    padded_causal = causal if padded_causal is None else padded_causal

    def work(ql, kvl, c):
        return (per_token * float(ql.sum()) + per_kv_token * float(kvl.sum())
                + per_pair * pairs_scored(ql, kvl, c))

    full_q, full_kv = torch.full_like(q, int(q.max())), torch.full_like(kv, int(kv.max()))
    return work(full_q, full_kv, padded_causal) / work(q, kv, causal)


def speedup_line(label, padded, ragged, bound):
    """The speedup of ``ragged`` over ``padded``, beside the work bound."""
    s = padded.median_ms / ragged.median_ms
    return f"{label}: speedup {s:.2f}x, work bound {bound:.2f}x, fraction of bound {s / bound:.2f}"


# %%
# .. raw:: html
#
#    </details>

# %%
# The jobs
# --------
# Five things a reader asks attention to do, all on the same ragged batch:
#
# * **inference**: causal self-attention, forward only;
# * **training**: the same, forward and backward;
# * **decoding**: one new query per sequence against that sequence's keys in
#   a KV cache with spare room (``kv_used``), as in every generation step; a
#   single query sees every key in use, so it needs no causal mask;
# * **GQA**: inference with four query heads per key/value head;
# * **score_mod**: inference with a custom score function, here the
#   distance penalty of ALiBi (the next cell).
#
# The first four go through ``compare_backends``; each row of the table is a
# backend, each column a job.

rng = np.random.default_rng(SEED)
lengths = sentence_lengths(rng, BATCH, ZIPF_ALPHA)
offsets = offsets_from_lengths(lengths, DEVICE)
T = int(lengths.sum())
gen = torch.Generator(DEVICE).manual_seed(SEED)


def randn(*shape):
    return torch.randn(*shape, generator=gen, device=DEVICE).to(DTYPE)


q, k, v = randn(T, HEADS, HEAD_DIM), randn(T, HEADS, HEAD_DIM), randn(T, HEADS, HEAD_DIM)
capacity = int(lengths.max()) + 32
one_each = torch.arange(BATCH + 1, device=DEVICE)
cache_offsets = one_each * capacity
k_cache, v_cache = randn(BATCH * capacity, HEADS, HEAD_DIM), randn(BATCH * capacity, HEADS, HEAD_DIM)
print(f"{BATCH} sequences, {T} tokens, longest {int(lengths.max())}; "
      f"padding would hold {BATCH * int(lengths.max())} slots")

table = {}
print("inference (causal, forward):")
table["inference"] = compare_backends(q, k, v, offsets, is_causal=True, min_run_time=RUN_TIME)
print("training (causal, forward and backward):")
table["training"] = compare_backends(q, k, v, offsets, is_causal=True, backward=True, min_run_time=RUN_TIME)
print("decoding (one query per sequence against its cache):")
q_one = randn(BATCH, HEADS, HEAD_DIM)  # one new query per sequence
table["decoding"] = compare_backends(q_one, k_cache, v_cache, one_each, cache_offsets,
                                     kv_used=lengths.to(DEVICE), min_run_time=RUN_TIME)
print(f"GQA ({HEADS} query heads, {KV_HEADS} key/value heads, causal, forward):")
table["GQA"] = compare_backends(q, k[:, :KV_HEADS].contiguous(), v[:, :KV_HEADS].contiguous(), offsets,
                                is_causal=True, min_run_time=RUN_TIME)

# %%
# The baseline: padded tensors
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The ``padded`` backend pads packed tensors inside the call, which costs it
# a gather and a scatter that a model written for padded batches never pays:
# its tensors are padded from the start. So the baseline of every job is
# attention on tensors that are already padded, ``(B, H, S, D)`` with right
# padding: one SDPA call with ``is_causal`` (a causal query never reaches a
# padding key), or with a key mask where queries see a cache. Each is checked
# against the same reference on the real tokens.

q_pad, valid = to_padded(q, offsets)  # (B, S, H, D), (B, S)
k_pad, v_pad = to_padded(k, offsets)[0], to_padded(v, offsets)[0]
qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q_pad, k_pad, v_pad))  # (B, H, S, D)
kh_gqa, vh_gqa = kh[:, :KV_HEADS].contiguous(), vh[:, :KV_HEADS].contiguous()
q_step = q_one
used = lengths.to(DEVICE)
k_dense = k_cache.view(BATCH, capacity, HEADS, HEAD_DIM)[:, :int(used.max())].transpose(1, 2).contiguous()
v_dense = v_cache.view(BATCH, capacity, HEADS, HEAD_DIM)[:, :int(used.max())].transpose(1, 2).contiguous()
key_in_use = (torch.arange(int(used.max()), device=DEVICE) < used[:, None])[:, None, None, :]  # (B, 1, 1, S)
# The gradient of a masked loss: zero at padding, so padding queries add
# nothing to the gradients of the real keys and values.
grad_packed = randn(T, HEADS, HEAD_DIM)
grad_h = to_padded(grad_packed, offsets)[0].transpose(1, 2).contiguous()
qh_train, kh_train, vh_train = (t.detach().requires_grad_() for t in (qh, kh, vh))


def baseline_inference():
    with torch.no_grad():
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)


def baseline_training():
    out = F.scaled_dot_product_attention(qh_train, kh_train, vh_train, is_causal=True)
    return torch.autograd.grad(out, (qh_train, kh_train, vh_train), grad_h)


def baseline_decoding():
    with torch.no_grad():
        return F.scaled_dot_product_attention(q_step[:, :, None], k_dense, v_dense, attn_mask=key_in_use)


def baseline_gqa():
    with torch.no_grad():
        return F.scaled_dot_product_attention(qh, kh_gqa, vh_gqa, is_causal=True, enable_gqa=True)


def unpad(out):  # (B, H, S, D) -> packed (T, H, D), float32 for the comparison
    return from_padded(out.transpose(1, 2), offsets).float()


tol = tolerances(DTYPE)
torch.testing.assert_close(unpad(baseline_inference()), reference_attention(q, k, v, offsets, is_causal=True), **tol)
torch.testing.assert_close(unpad(baseline_gqa()), reference_attention(q, k[:, :KV_HEADS], v[:, :KV_HEADS], offsets,
                                                                    is_causal=True), **tol)
torch.testing.assert_close(baseline_decoding()[:, :, 0].float(),
                           reference_attention(q_step, k_cache, v_cache, one_each, cache_offsets, kv_used=used), **tol)
q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
reference_grads = torch.autograd.grad(reference_attention(q32, k32, v32, offsets, is_causal=True), (q32, k32, v32),
                                      grad_packed.float())
for name, g, r in zip("qkv", baseline_training(), reference_grads):
    torch.testing.assert_close(unpad(g), r, **tol, msg=lambda m, name=name: f"padded tensors, d{name}: {m}")
baselines = measure({"inference": baseline_inference, "training": baseline_training, "decoding": baseline_decoding,
                     "GQA": baseline_gqa}, min_run_time=RUN_TIME)
for job, t in baselines.items():
    table[job]["padded tensors"] = t
    print(f"{job:10s} padded tensors {t}")

# %%
# A custom score function
# ~~~~~~~~~~~~~~~~~~~~~~~
# ``ragged_attention`` takes no score function: of the backends, only
# FlexAttention accepts arbitrary Python (``score_mod``) and compiles it into
# its kernel. A dense SDPA call can take a precomputed additive bias instead,
# which works for the per-sequence loop (one bias per sequence) and for
# padding (one bias for the padded square). ``varlen_attn`` and SDPA on
# nested tensors take neither. Each path that can is checked against the
# float32 reference with the bias built explicitly.

slopes = torch.exp2(-8.0 * torch.arange(1, HEADS + 1, device=DEVICE) / HEADS)  # (H,)
seq_id, position = token_index(offsets)


def alibi_penalty(score, b, h, q_idx, kv_idx):  # q_idx, kv_idx: packed positions
    return score - slopes[h] * (q_idx - kv_idx)


def causal_within_sequence(b, h, q_idx, kv_idx):
    return (seq_id[q_idx] == seq_id[kv_idx]) & (q_idx >= kv_idx)


@torch.compile(dynamic=False)
def flex_alibi(q, k, v, block_mask):
    return flex_attention(q, k, v, score_mod=alibi_penalty, block_mask=block_mask)


def alibi_bias(n):  # (H, n, n): the penalty, and -inf above the diagonal
    distance = (torch.arange(n, device=DEVICE)[:, None] - torch.arange(n, device=DEVICE)).float()
    return (-slopes[:, None, None] * distance).masked_fill(distance < 0, float("-inf"))


score_mask = create_block_mask(causal_within_sequence, None, None, T, T, device=DEVICE)
q_seqs, k_seqs, v_seqs = (t.split(lengths.tolist()) for t in (q, k, v))


def score_mod_flex():
    with torch.no_grad():
        return flex_alibi(*(t.transpose(0, 1)[None] for t in (q, k, v)), score_mask)[0].transpose(0, 1)


loop_biases = [alibi_bias(len(a)).to(DTYPE)[None] for a in q_seqs]  # built once per batch, as pad_bias below


def score_mod_loop():  # (1, H, L, D) per sequence: four dimensions, as the fused CPU kernel takes them
    with torch.no_grad():
        return torch.cat([F.scaled_dot_product_attention(
            a.transpose(0, 1)[None], b.transpose(0, 1)[None], c.transpose(0, 1)[None], attn_mask=bias
        )[0].transpose(0, 1) for a, b, c, bias in zip(q_seqs, k_seqs, v_seqs, loop_biases)])


pad_bias = alibi_bias(q_pad.shape[1]).masked_fill(~valid[:, None, None, :], float("-inf")).to(DTYPE)


def score_mod_padded():
    with torch.no_grad():
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=pad_bias)


with sdpa_kernel(SDPBackend.MATH):  # float32, and no kernel shared with the paths checked
    reference = torch.cat([F.scaled_dot_product_attention(
        a.float().transpose(0, 1), b.float().transpose(0, 1), c.float().transpose(0, 1), attn_mask=alibi_bias(len(a))
    ).transpose(0, 1) for a, b, c in zip(q_seqs, k_seqs, v_seqs)])
runs = {"flex": score_mod_flex, "loop": score_mod_loop, "padded tensors": score_mod_padded}
for name, fn in runs.items():
    out = unpad(fn()) if name == "padded tensors" else fn().float()
    torch.testing.assert_close(out, reference, **tolerances(DTYPE))
times = measure(runs, min_run_time=RUN_TIME)
table["score_mod"] = {
    "varlen": "no score function or bias argument",
    "sdpa_njt": "SDPA on nested tensors takes no mask or bias",
    "bucketed": "possible with a bias per bucket; not written here",
    "padded": "the padded tensors below take the bias; this backend takes none",
    **times,
}
print("score_mod (ALiBi, causal, forward):")
for name in BACKENDS + ("padded tensors",):
    r = table["score_mod"][name]
    print(f"  {name:9s} {r}" if isinstance(r, Timing) else f"  {name:9s} not available: {r}")

# %%
# The table
# ---------
# One row per path, one column per job: the median time in ms, the speedup
# over the padded tensors for the same job, and in brackets that speedup as
# a fraction of the job's work bound; "n/a" where the path cannot take the
# job here (the printouts above say why). Every number that appears passed
# its correctness check first. The last row is each job's work bound: the
# query-key pairs the padded baseline scores over the pairs the sequences
# need. Where the job is causal, both sides count the causal half (a causal
# kernel skips the rest), except for the score function: there the padded
# baseline and the per-sequence loop add a bias to the whole square and
# compute all of it, so both sides count the square (FlexAttention skips
# the masked blocks, and can pass that bound). For
# decoding, the padded side scores every cached row up to the longest
# sequence, the ragged side the rows in use.

ones = torch.ones(BATCH, dtype=torch.long)
BOUND = {job: work_bound(lengths, per_token=0.0, per_pair=1.0, causal=True)
         for job in ("inference", "training", "GQA")}
BOUND["score_mod"] = work_bound(lengths, per_token=0.0, per_pair=1.0, causal=False)
BOUND["decoding"] = work_bound(ones, lengths, per_token=0.0, per_pair=1.0)
JOBS = list(table)
ROWS = ("padded tensors",) + BACKENDS
# speedup[i, j]: row i over the padded tensors on job j; NaN where row i cannot take it
speedup = np.array([[table[job]["padded tensors"].median_ms / table[job][name].median_ms
                     if isinstance(table[job][name], Timing) else np.nan for job in JOBS] for name in ROWS])


def as_speedup(s):  # a speedup, with two decimals below 1x so that 0.04x does not read 0.0x
    return f"{s:.{1 if s >= 1 else 2}f}x"


width = 24
print(f"{'':10s}" + "".join(f"{job:>{width}s}" for job in JOBS))
for i, name in enumerate(ROWS):
    cells = []
    for j, job in enumerate(JOBS):
        if np.isnan(speedup[i, j]):
            cells.append("n/a")
        elif name == "padded tensors":
            cells.append(f"{table[job][name].median_ms:8.2f} ms")
        else:
            cells.append(f"{table[job][name].median_ms:8.2f} ms {as_speedup(speedup[i, j]):>5s} "
                         f"({speedup[i, j] / BOUND[job]:.2f})")
    print(f"{name:10s}" + "".join(f"{c:>{width}s}" for c in cells))
print(f"{'bound':10s}" + "".join(f"{BOUND[job]:>{width - 1}.1f}x" for job in JOBS))

# %%
# The same table as a figure: each cell is the speedup over the padded
# tensors for that job (higher is better) and, below it, the fraction of
# the job's work bound; "n/a" where the path cannot take the job here.

import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(8.5, 5))
image = ax.imshow(np.log2(speedup), cmap="RdYlGn", vmin=-3, vmax=3, aspect="auto")
for i in range(len(ROWS)):
    for j in range(len(JOBS)):
        text = "n/a" if np.isnan(speedup[i, j]) else as_speedup(speedup[i, j])
        if ROWS[i] != "padded tensors" and not np.isnan(speedup[i, j]):
            text += f"\n{speedup[i, j] / BOUND[JOBS[j]]:.2f} of bound"
        ax.text(j, i, text, ha="center", va="center", fontsize=8)
ax.set_xticks(range(len(JOBS)), JOBS)
ax.set_yticks(range(len(ROWS)), ROWS)
ax.set_title(f"Speedup over padding, {DEVICE}, {str(DTYPE).removeprefix('torch.')}")
fig.colorbar(image, ax=ax, label="log2 speedup")
fig.tight_layout()
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# The decision guide, from this build
# -----------------------------------
# For each job: the fastest path that ran correctly here, how it compares
# with padding, and what runs if your device cannot take it. The kernel
# named is the one the profiler saw.

for job in JOBS:
    ran = {n: r for n, r in table[job].items() if isinstance(r, Timing)}
    best = fastest(ran)
    others = sorted((n for n in ran if n != best), key=lambda n: ran[n].median_ms)
    missing = [n for n in ROWS if n not in ran]
    print(f"{job}: use {best} ({ran[best].median_ms:.2f} ms"
          + (f"; kernel: {ran[best].kernels}" if ran[best].kernels else "") + ")"
          + (f"; then {', '.join(others)}" if others else "")
          + (f"; not here: {', '.join(missing)}" if missing else ""))
    if best != "padded tensors":
        print("    " + speedup_line(f"{best} against padded tensors", ran["padded tensors"], ran[best], BOUND[job]))

# %%
# Where the time goes
# ~~~~~~~~~~~~~~~~~~~
# Attention alone has a large work bound for ragged batches, because padding
# costs it the square of the padded length. A path that does only the real
# work still pays per call, per sequence or per block, costs that the bound
# does not count, and the fractions above show how much of the bound each
# path kept on this device. The profiles of two jobs, inference and the
# score function, for the padded baseline and for the path chosen for each,
# show what each spent its time on.

best = fastest({n: r for n, r in table["inference"].items() if isinstance(r, Timing) and n in BACKENDS})
print("inference, padded tensors:")
print(where_time_goes(baseline_inference))
print(f"inference, the path chosen ({best}):")
with torch.no_grad():
    print(where_time_goes(lambda: ragged_attention(q, k, v, offsets, is_causal=True, backend=best)))
best = fastest({n: r for n, r in table["score_mod"].items() if isinstance(r, Timing) and n != "padded tensors"})
print("score_mod, padded tensors:")
print(where_time_goes(score_mod_padded))
print(f"score_mod, the path chosen ({best}):")
print(where_time_goes(runs[best]))

# %%
# How to read it. The ranking holds for this device, this dtype and these
# lengths: re-run the page (or ``compare_backends`` on your own batch) on the
# machine you will train or serve on. A few things hold everywhere, because
# they follow from what each path computes rather than from a measurement:
#
# * padding does the work of ``B x S_max`` tokens whatever the lengths, so
#   its cost grows with the longest sequence, not with the batch's tokens;
# * the per-sequence loop does exactly the real work but pays one call per
#   sequence, so it suits few long sequences better than many short ones;
# * FlexAttention is the only path here that takes an arbitrary score
#   function, and on CPU it has no backward (in PyTorch 2.11 to 2.15);
# * ``varlen_attn`` needs CUDA and a half-precision dtype, and reads a KV
#   cache with spare room directly (``seqused_k``) where its release has it.
#
# References
# ----------
# * ``scaled_dot_product_attention``: https://docs.pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html
# * FlexAttention: https://pytorch.org/blog/flexattention/
# * ``varlen_attn``: https://docs.pytorch.org/docs/stable/nn.attention.varlen.html
