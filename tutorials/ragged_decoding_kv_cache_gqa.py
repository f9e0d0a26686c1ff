"""
Decoding ragged batches: a KV cache, grouped-query attention and varlen attention
=================================================================================

Generate from a batch of prompts of different lengths with a key/value cache
in which every sequence keeps its own length, prove every step against a
recomputation, shrink the cache with grouped-query attention, and see which
attention kernel serves each decoding step on the device at hand.

**Author:** the ragged-transformers tutorial contributors, building on the
transformer building blocks tutorial by
`Mikayla Gawarecki <https://github.com/mikaylagawarecki>`_

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How to prefill packed prompts and decode into a KV cache whose
         sequences each keep their own length, with ``ragged_attention``'s
         ``kv_used``, and how to prove every cached step correct
       * What the cache costs in memory, and what grouped-query attention
         saves, with the kernel that actually ran printed beside each time
       * How to decode with FlexAttention without rebuilding its block mask at
         every step, and where ``varlen_attn`` fits

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * The toolkit of the building-blocks page and the model of the packed
         GPT page (both copied below, so this file runs on its own)
       * PyTorch 2.11 or later; ``varlen_attn`` needs a CUDA GPU of compute
         capability 8.0 or newer, and the page says what runs in its place
         without one

The original building-blocks tutorial left three sections pending in 2024:
key/value caching on nested tensors, grouped-query attention (GQA) on nested
tensors and FlexAttention on nested tensors. Since then PyTorch has pointed
ragged attention at packed sequences instead: all tokens end to end, with
offsets saying where each sequence starts, which is the toolkit of this
site. This page writes the three sections on it, with the model of the packed GPT page.
"""

# sphinx_gallery_tags = ["KV cache", "GQA", "varlen attention", "FlexAttention", "decoding"]

# %%
# Setup
# -----

import copy
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
print(f"PyTorch {torch.__version__}, device: {DEVICE}, dtype: {DTYPE}, quick mode: {QUICK}")

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
# The model is small and randomly initialized (seeded): the point is the
# mechanics of decoding and their correctness, not the text it writes. For
# scale, Llama-2-70B uses GQA with 8 key/value heads for 64 query heads, a
# width of 8192 and 80 layers, and serves batches of dozens to hundreds of
# sequences.

if DEVICE == "cuda":
    MODEL = dict(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_hidden=2816,
                 max_seq_len=4096)
    PROMPTS, ZIPF_ALPHA, NEW_TOKENS, GEN_LENGTHS = 64, 1.1, 128, (32, 64, 128)
    RUN_TIME = 1.0
else:  # real serving: width 4096 and up, 32+ layers, 64-256 sequences
    MODEL = dict(vocab_size=512, dim=128, n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden=352,
                 max_seq_len=1024)
    PROMPTS, ZIPF_ALPHA, NEW_TOKENS, GEN_LENGTHS = 16, 1.2, 32, (8, 32)
    RUN_TIME = 0.25
if QUICK:
    MODEL.update(dim=64, n_layers=2, ffn_hidden=176, vocab_size=256)
    PROMPTS, NEW_TOKENS, GEN_LENGTHS, RUN_TIME = 6, 8, (4, 8), 0.1
print(f"model {MODEL}; {PROMPTS} prompts, {NEW_TOKENS} new tokens each")

# %%
# The toolkit and the model
# -------------------------
# Identical copies: the toolkit from the building-blocks page (lengths,
# offsets, ``ragged_attention`` with its backends, the reference,
# ``measure``), then the model, the KV cache, the two layouts and
# ``generate_packed`` from the packed GPT page. Those pages explain them.
#
# .. raw:: html
#
#    <details class="toolkit-copy"><summary>Show the code of the toolkit and the model</summary>

import gc
import inspect
import time
from dataclasses import dataclass, field

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
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


def speedup_line(label, padded, ragged, bound):
    """The speedup of ``ragged`` over ``padded``, beside the work bound."""
    s = padded.median_ms / ragged.median_ms
    return f"{label}: speedup {s:.2f}x, work bound {bound:.2f}x, fraction of bound {s / bound:.2f}"


@dataclass(frozen=True)
class GPTConfig:
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
        return ragged_attention(q, k, v, self.offsets, kv_offsets, is_causal=True,
                                kv_used=self.kv_used, backend=self.backend)


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
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.mask is None,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)


def apply_rope(x, cos, sin):
    # x: (..., H, D); cos and sin: (..., 1, D / 2)
    # Rotated in the precision of cos and sin (float32), returned in the dtype
    # of x: under autocast, q and k stay in the dtype of v.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads = layer, cfg.n_heads, cfg.n_kv_heads
        self.sizes = [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]
        self.wqkv = nn.Linear(cfg.dim, sum(self.sizes), bias=False)  # one matmul for q, k, v
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, layout):
        q, k, v = self.wqkv(x).split(self.sizes, dim=-1)
        q = apply_rope(q.unflatten(-1, (self.n_heads, -1)), cos, sin)
        k = apply_rope(k.unflatten(-1, (self.n_kv_heads, -1)), cos, sin)
        v = v.unflatten(-1, (self.n_kv_heads, -1))
        return self.wo(layout.attend(q, k, v, self.layer).flatten(-2))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_hidden, bias=False)  # gate and up, one matmul
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attn, self.ffn = Attention(cfg, layer), FeedForward(cfg)

    def forward(self, x, cos, sin, layout):
        x = x + self.attn(self.attn_norm(x), cos, sin, layout)
        return x + self.ffn(self.ffn_norm(x))


class GPT(nn.Module):
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
def generate_packed(model, prompts, offsets, n_new, backend=None):
    """Greedy generation for packed prompts (T,) with offsets (B + 1,)."""
    B, lengths = len(offsets) - 1, offsets.diff()
    cache = KVCache(model.cfg, B, int(lengths.max()) + n_new, prompts.device, DTYPE)
    seq, pos = token_index(offsets)
    with torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32):
        layout = Packed(offsets, backend, cache, seq * cache.capacity + pos, lengths)
        logits = model(prompts, pos, layout)[offsets[1:] - 1]  # (B, vocab): each prompt's last token
        one_each, rows = torch.arange(B + 1, device=prompts.device), cache.row_offsets[:-1]
        out = []
        for step in range(n_new):
            out.append(logits.argmax(-1))  # (B,)
            if step < n_new - 1:
                pos = lengths + step  # each sequence's own next position
                logits = model(out[-1], pos, Packed(one_each, backend, cache, rows + pos, pos + 1))
    return torch.stack(out, 1)  # (B, n_new)


# %%
# .. raw:: html
#
#    </details>

# %%
# A batch of prompts
# ------------------
# Prompt lengths come from the site's length generator: most prompts are
# short, a few are long. Two models share everything but the number of
# key/value heads: multi-head attention (MHA, one key/value head per query
# head) and grouped-query attention (GQA, ``n_heads / n_kv_heads`` query
# heads share each key/value head).

rng = np.random.default_rng(SEED)
prompt_lengths = sentence_lengths(rng, PROMPTS, ZIPF_ALPHA).clamp(max=MODEL["max_seq_len"] - NEW_TOKENS)
prompt_offsets = offsets_from_lengths(prompt_lengths, DEVICE)
gen = torch.Generator(DEVICE).manual_seed(SEED)
prompts = torch.randint(MODEL["vocab_size"], (int(prompt_lengths.sum()),), generator=gen, device=DEVICE)
print(f"prompt lengths {prompt_lengths.tolist()}")
print(f"{len(prompts)} prompt tokens, longest {int(prompt_lengths.max())}; "
      f"padding to the longest would hold {PROMPTS * int(prompt_lengths.max())}")

gqa_cfg = GPTConfig(**MODEL)
mha_cfg = GPTConfig(**dict(MODEL, n_kv_heads=MODEL["n_heads"]))
torch.manual_seed(SEED)
gqa_model = GPT(gqa_cfg).to(DEVICE).eval()
torch.manual_seed(SEED)
mha_model = GPT(mha_cfg).to(DEVICE).eval()
if DTYPE != torch.float32:  # serving runs the weights in the low precision too
    gqa_model, mha_model = gqa_model.to(DTYPE), mha_model.to(DTYPE)
print(f"MHA: {mha_cfg.n_heads} query heads, {mha_cfg.n_kv_heads} key/value heads; "
      f"GQA: {gqa_cfg.n_heads} query heads, {gqa_cfg.n_kv_heads} key/value heads")

# %%
# The KV cache, step by step
# --------------------------
# During decoding each sequence adds one token per step, and that token's
# query must see the keys and values of everything before it. The cache
# keeps them: ``KVCache`` holds, per layer, room for ``capacity`` tokens per
# sequence, ``(B, capacity, H_kv, D)``. Seen as packed rows, sequence ``b``
# owns rows ``b * capacity ...``, so the cache is a packed batch whose
# offsets are ``capacity`` apart, of which each sequence uses the first
# ``kv_used`` rows: exactly what ``ragged_attention`` (and ``varlen_attn``,
# whose ``seqused_k`` is the same thing) takes.
#
# * **Prefill**: all prompt tokens, packed, go through the model at once;
#   each writes its key and value into its sequence's row ``b * capacity + p``
#   and attends causally to its own prompt.
# * **Decode**: one token per sequence, at that sequence's own position
#   ``lengths[b]``, written into its next row; its query sees every key its
#   sequence has.
#
# The loop below is ``generate_packed`` unrolled, with a check at every step:
# the cached logits must equal a recomputation of the whole history without
# any cache, for every sequence. Both run the per-sequence loop backend, so
# that this check is about the cache's bookkeeping; the kernel of every
# backend is checked against the float32 reference in the tables below.

torch.manual_seed(SEED)
history = [prompts[int(a):int(b)].tolist() for a, b in zip(prompt_offsets[:-1], prompt_offsets[1:])]
cache = KVCache(gqa_cfg, PROMPTS, int(prompt_lengths.max()) + NEW_TOKENS, DEVICE, DTYPE)
lengths = prompt_lengths.to(DEVICE)
seq, pos = token_index(prompt_offsets)
one_each = torch.arange(PROMPTS + 1, device=DEVICE)
worst = 0.0
with torch.no_grad():
    logits = gqa_model(prompts, pos, Packed(prompt_offsets, "loop", cache, seq * cache.capacity + pos,
                                            lengths))[prompt_offsets[1:] - 1]
    for step in range(NEW_TOKENS):
        token = logits.argmax(-1)  # (B,)
        for h, t in zip(history, token.tolist()):
            h.append(t)
        # the same step without a cache: the whole packed history, recomputed
        offsets_h = offsets_from_lengths([len(h) for h in history], DEVICE)
        tokens_h = torch.tensor([t for h in history for t in h], device=DEVICE)
        full = gqa_model(tokens_h, token_index(offsets_h)[1], Packed(offsets_h, "loop"))
        # the cached step: one token per sequence at its own position
        logits = gqa_model(token, lengths, Packed(one_each, "loop", cache,
                                                  cache.row_offsets[:-1] + lengths, lengths + 1))
        lengths = lengths + 1
        torch.testing.assert_close(logits.float(), full[offsets_h[1:] - 1].float(), **tolerances(DTYPE))
        worst = max(worst, (logits.float() - full[offsets_h[1:] - 1].float()).abs().max().item())
print(f"{NEW_TOKENS} steps x {PROMPTS} sequences: every cached step matches the recomputation "
      f"(largest logit difference {worst:.1e})")

# %%
# What the cache buys
# ~~~~~~~~~~~~~~~~~~~
# Without a cache, step ``t`` runs the whole history again: every prompt
# token plus ``t`` generated tokens per sequence. With it, each step runs one
# token per sequence. The work bound counts the tokens each side pushes
# through the model (the projections and feed-forward layers, most of the
# arithmetic) and the query-key pairs its attention scores.


@torch.no_grad()
def generate_no_cache(model, prompts, offsets, n_new, backend=None):
    """Greedy generation that recomputes the whole packed history at every step."""
    lengths = offsets.diff()
    tokens = prompts
    out = []
    for step in range(n_new):
        seq, pos = token_index(offsets)
        logits = model(tokens, pos, Packed(offsets, backend))[offsets[1:] - 1]
        out.append(logits.argmax(-1))
        # insert each sequence's new token at its end: rebuild the packed ids
        lengths = lengths + 1
        new_offsets = offsets_from_lengths(lengths, tokens.device)
        grown = torch.empty(len(tokens) + len(lengths), dtype=tokens.dtype, device=tokens.device)
        grown[new_offsets[1:] - 1] = out[-1]
        keep = torch.ones(len(grown), dtype=torch.bool, device=tokens.device)
        keep[new_offsets[1:] - 1] = False
        grown[keep] = tokens
        tokens, offsets = grown, new_offsets
    return torch.stack(out, 1)


per_token = 2 * sum(p.numel() for n, p in gqa_model.named_parameters() if "embeddings" not in n)
per_pair = gqa_cfg.n_layers * 4 * gqa_cfg.n_heads * gqa_cfg.head_dim
with torch.no_grad():  # both write the same tokens (in bfloat16, rounding may flip a near tie)
    same = (generate_no_cache(gqa_model, prompts, prompt_offsets, 4, "loop")
            == generate_packed(gqa_model, prompts, prompt_offsets, 4, "loop")).float().mean().item()
assert same >= (1.0 if DTYPE == torch.float32 else 0.9), f"with and without the cache: {same:.0%} of tokens agree"
throughput = {"cache": [], "no cache": []}
for n_new in GEN_LENGTHS:
    times = measure({"no cache": lambda: generate_no_cache(gqa_model, prompts, prompt_offsets, n_new, "loop"),
                     "cache": lambda: generate_packed(gqa_model, prompts, prompt_offsets, n_new, "loop")},
                    min_run_time=RUN_TIME, profile=False)
    P, steps = prompt_lengths, torch.arange(n_new)
    grown = P[:, None] + steps  # each sequence's length at each step, (B, n_new)
    work_cached = per_token * (float(P.sum()) + PROMPTS * (n_new - 1)) + per_pair * (
        pairs_scored(P, P, True) + float((grown[:, 1:] + 1).sum()))
    work_recomputed = per_token * float(grown.sum()) + per_pair * pairs_scored(grown.flatten(), grown.flatten(), True)
    for name in throughput:
        throughput[name].append(PROMPTS * n_new / times[name].median_ms * 1e3)
    print(f"{n_new:4d} new tokens: " + speedup_line("cache over no cache", times["no cache"], times["cache"],
                                                    work_recomputed / work_cached))

# %%
# The work bound grows with the output, since the recomputation redoes the
# whole history at every step. The fraction says how much of it this device
# turned into speed: each cached step runs only one token per sequence
# through the model, small matrix multiplies and one attention call per
# sequence and layer, so fixed costs per call weigh more than in the
# big calls of the recomputation. The operators that took most of the cached
# generation's time:

print(where_time_goes(lambda: generate_packed(gqa_model, prompts, prompt_offsets, NEW_TOKENS, "loop")))

# %%
# Cache memory: allocated and used
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The cache holds ``2 x layers x B x capacity x H_kv x D`` numbers, read here
# from its buffers. Of its ``B x capacity`` token slots, ``sum(lengths)``
# hold data: few right after the prefill, more at each step. A cache that
# gives each sequence only the room it can use, ``prompt + new tokens``
# (paged or packed), would allocate ``sum(prompt + new)`` slots; with
# ``varlen_attn``'s ``block_table`` or a FlexAttention mask over pages,
# attention reads such a cache directly.


def cache_report(cfg, name):
    capacity = int(prompt_lengths.max()) + NEW_TOKENS
    c = KVCache(cfg, PROMPTS, capacity, DEVICE, DTYPE)
    allocated = c.k.nbytes + c.v.nbytes
    per_slot = allocated / (PROMPTS * capacity)  # bytes per token, all layers, keys and values
    used = per_slot * (float(prompt_lengths.sum()) + PROMPTS * np.arange(NEW_TOKENS + 1))
    exact = per_slot * float((prompt_lengths + NEW_TOKENS).sum())
    print(f"{name}: {allocated / 2**20:.2f} MiB allocated; used {used[0] / 2**20:.2f} MiB after the "
          f"prefill ({used[0] / allocated:.0%}), {used[-1] / 2**20:.2f} MiB at the end "
          f"({used[-1] / allocated:.0%}); room for exactly what each sequence uses: {exact / 2**20:.2f} MiB")
    return allocated, used, exact


memory = {"MHA": cache_report(mha_cfg, "MHA"), "GQA": cache_report(gqa_cfg, "GQA")}
ratio = memory["MHA"][0] / memory["GQA"][0]
assert math.isclose(ratio, gqa_cfg.n_heads / gqa_cfg.n_kv_heads)
print(f"MHA / GQA cache: {ratio:.1f}x (n_heads / n_kv_heads = {gqa_cfg.n_heads // gqa_cfg.n_kv_heads})")

# %%
# Decoding attention: measure, then choose
# ----------------------------------------
# One decoding step of attention for the GQA model: one query per sequence
# against that sequence's cached keys, in the middle of generation. The
# candidates, each checked against the float32 reference (with the
# key/value heads repeated explicitly, so that it shares no GQA code with
# them). The kernel column says what actually ran: whether a call read the
# small cache directly or repeated its heads first shows up there.

capacity = int(prompt_lengths.max()) + NEW_TOKENS
used = (prompt_lengths + NEW_TOKENS // 2).to(DEVICE)
row_offsets = torch.arange(PROMPTS + 1, device=DEVICE) * capacity
q_step = torch.randn(PROMPTS, gqa_cfg.n_heads, gqa_cfg.head_dim, generator=gen, device=DEVICE).to(DTYPE)
k_cache = torch.randn(PROMPTS * capacity, gqa_cfg.n_kv_heads, gqa_cfg.head_dim, generator=gen,
                      device=DEVICE).to(DTYPE)
v_cache = torch.randn_like(k_cache)
print(f"GQA, {PROMPTS} queries against {int(used.sum())} cached keys in use:")
decode_results = compare_backends(q_step, k_cache, v_cache, one_each, row_offsets, is_causal=True,
                                  kv_used=used, min_run_time=RUN_TIME)

# %%
# That table times one step's attention with its per-batch bookkeeping
# already done. While generating, the lengths change at every step, so
# whatever a backend prepares per batch (gather indices, a block mask) is
# prepared again at every step, once for all layers; the choice is made on
# whole generations, for the two backends with the fastest steps above:

ran = sorted((n for n, r in decode_results.items() if isinstance(r, Timing)),
             key=lambda n: decode_results[n].median_ms)[:2]
generation_times = measure({name: lambda name=name: generate_packed(gqa_model, prompts, prompt_offsets, NEW_TOKENS,
                                                                    name) for name in ran},
                           min_run_time=RUN_TIME / 2, profile=False)
for name, t in generation_times.items():
    print(f"  generation with {name:9s} {t}")
DECODE_BACKEND = fastest(generation_times)
print(f"decoding backend chosen on {DEVICE}: {DECODE_BACKEND}")

# %%
# FlexAttention without rebuilding the mask
# -----------------------------------------
# The ``flex`` backend builds a ``BlockMask`` for each batch it sees, and
# while decoding the lengths change at every step. ``create_block_mask``
# evaluates the mask over the whole grid, a cost added to every step's
# attention. The inference examples of FlexAttention build the
# mask once, for the cache's capacity, and then only refresh it. Here the
# mask function reads the current lengths from a tensor the loop updates in
# place, every listed block is *partial* (so the mask function runs inside
# the kernel), and each step only recomputes how many key blocks each
# sequence has, ``ceil(length / 128)``. Both ways are checked against the
# reference and timed per decoding step, for the GQA cache laid out as
# ``(B, H_kv, capacity, D)``.

BLOCK = 128
current = used.clone()  # the lengths the mask reads, updated in place


def within_length(b, h, q_idx, kv_idx):
    return kv_idx < current[b]


n_blocks = (capacity + BLOCK - 1) // BLOCK
kv_num_blocks = torch.zeros(PROMPTS, 1, 1, dtype=torch.int32, device=DEVICE)
kv_indices = torch.arange(n_blocks, dtype=torch.int32, device=DEVICE).expand(PROMPTS, 1, 1, n_blocks).contiguous()
refreshed_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=BLOCK,
                                          mask_mod=within_length, seq_lengths=(1, capacity))


def refresh(lengths):
    current.copy_(lengths)
    kv_num_blocks.copy_(((lengths + BLOCK - 1) // BLOCK).view(-1, 1, 1))


q_dense = q_step[:, :, None]  # (B, H, 1, D)
k_dense = k_cache.view(PROMPTS, capacity, *k_cache.shape[1:]).transpose(1, 2)  # (B, H_kv, capacity, D)
v_dense = v_cache.view(PROMPTS, capacity, *v_cache.shape[1:]).transpose(1, 2)


def flex_rebuilt():
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < used[b], PROMPTS, None, 1, capacity,
                             device=DEVICE)
    return _compiled_flex_attention(q_dense, k_dense, v_dense, block_mask=mask, enable_gqa=True)


def flex_refreshed():
    refresh(used)
    return _compiled_flex_attention(q_dense, k_dense, v_dense, block_mask=refreshed_mask, enable_gqa=True)


reference_step = reference_attention(q_step, k_cache, v_cache, one_each, row_offsets, is_causal=True, kv_used=used)
with torch.no_grad():
    for fn in (flex_rebuilt, flex_refreshed):
        torch.testing.assert_close(fn()[:, :, 0].float(), reference_step, **tolerances(DTYPE))
    flex_times = measure({"mask rebuilt every step": flex_rebuilt, "mask built once, refreshed": flex_refreshed},
                         min_run_time=RUN_TIME)
for name, t in flex_times.items():
    print(f"FlexAttention decode step, {name:26s} {t}")
print(f"time per step, mask rebuilt / mask refreshed: "
      f"{flex_times['mask rebuilt every step'].median_ms / flex_times['mask built once, refreshed'].median_ms:.2f}x")

# %%
# Grouped-query attention, end to end
# -----------------------------------
# The promise of GQA is a smaller cache, which is what bounds batch size and
# context length in serving, and less memory to read at every step. Both
# models generate with the decoding backend chosen above; the kernels that
# ran are printed beside each time.

for name, model in (("MHA", mha_model), ("GQA", gqa_model)):
    t = measure({name: lambda: generate_packed(model, prompts, prompt_offsets, NEW_TOKENS, DECODE_BACKEND)},
                min_run_time=RUN_TIME / 2)[name]
    throughput[name] = PROMPTS * NEW_TOKENS / t.median_ms * 1e3
    print(f"{name}: {t}  {throughput[name]:,.0f} new tokens/s")
print(f"GQA / MHA decoding throughput: {throughput['GQA'] / throughput['MHA']:.2f}x; "
      f"cache {ratio:.1f}x smaller")

# %%
# Nested tensors do not take the GQA route: SDPA on nested inputs cannot
# share key/value heads, and ``backend_support`` says so, which is why the
# ``sdpa_njt`` rows above are missing for GQA. The call is tried here, so that
# the page notices when a release fixes it.

njt = lambda x: torch.nested.nested_tensor_from_jagged(x, prompt_offsets).transpose(1, 2)  # noqa: E731
q_p = torch.randn(len(prompts), gqa_cfg.n_heads, gqa_cfg.head_dim, device=DEVICE, dtype=DTYPE)
kv_p = torch.randn(len(prompts), gqa_cfg.n_kv_heads, gqa_cfg.head_dim, device=DEVICE, dtype=DTYPE)
try:
    F.scaled_dot_product_attention(njt(q_p), njt(kv_p), njt(kv_p), enable_gqa=True)
    print("SDPA on nested tensors with enable_gqa=True: runs in this build")
except (RuntimeError, NotImplementedError) as err:
    print(f"SDPA on nested tensors with enable_gqa=True: {type(err).__name__}: "
          f"{str(err).strip().splitlines()[0][:100]}")

# %%
# varlen attention
# ----------------
# ``torch.nn.attention.varlen.varlen_attn`` is the variable-length kernel of
# FlashAttention: packed ``(T, H, D)`` queries, keys and values, the
# offsets as ``int32`` ``cu_seq_q`` and ``cu_seq_k``, and the longest lengths.
# Its keyword arguments changed between releases, so the toolkit reads them
# from the signature: causal is ``is_causal=True`` in 2.10 and
# ``window_size=(-1, 0)`` later; ``enable_gqa`` (without it, the toolkit
# repeats the key/value heads) and ``seqused_k`` (without it, the toolkit
# gathers the rows in use) arrived after 2.11. What this build has:

if varlen_attn is None:
    print("this PyTorch has no torch.nn.attention.varlen")
else:
    keywords = _varlen_keywords()
    print(f"varlen_attn{inspect.signature(varlen_attn)}")
    print("causal through: " + ("window_size=(-1, 0)" if "window_size" in keywords else "is_causal=True"))
    print("grouped-query attention: " + ("enable_gqa=True" if "enable_gqa" in keywords
                                         else "not supported: the toolkit repeats the key/value heads"))
    print("keys in use per sequence: " + ("seqused_k" if "seqused_k" in keywords
                                          else "not supported: the toolkit gathers the rows in use"))
why = backend_support("varlen", DEVICE, DTYPE, is_causal=True, gqa=True)
print(f"varlen_attn on this device: {why or 'runs'}; the decoding backend chosen here: {DECODE_BACKEND}")

# %%
# The figure: throughput with and without the cache as the output grows, and
# the cache's memory during generation for both models.

import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
ax1.plot(GEN_LENGTHS, throughput["cache"], "o-", label="KV cache")
ax1.plot(GEN_LENGTHS, throughput["no cache"], "s--", label="recomputed every step")
ax1.set(xlabel="new tokens per sequence", ylabel="new tokens/s (median)", title=f"Greedy decoding, {DEVICE}")
ax1.legend()
steps = np.arange(NEW_TOKENS + 1)
for color, (name, (allocated, used_bytes, exact)) in zip(("C0", "C3"), memory.items()):
    ax2.plot(steps, used_bytes / 2**20, "-", color=color, label=f"{name}, used")
    ax2.axhline(allocated / 2**20, color=color, ls="--", label=f"{name}, allocated")
    ax2.axhline(exact / 2**20, color=color, ls=":", label=f"{name}, exact room")
ax2.set(xlabel="decoding step", ylabel="KV cache (MiB)", ylim=(0, None),
        title=f"Cache memory, {MODEL['n_layers']} layers, {str(DTYPE).removeprefix('torch.')}")
ax2.legend(fontsize="small")
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# Conclusion
# ----------
# The three sections the building-blocks tutorial left pending work today,
# on packed values and offsets rather than nested tensors:
#
# * **A KV cache** for a ragged batch is a buffer with room per sequence and
#   a count of the rows each sequence uses; ``ragged_attention``'s
#   ``kv_used`` (``seqused_k`` in ``varlen_attn``) tells each sequence's
#   rows in use; the ``loop``, ``padded`` and ``flex`` backends, and
#   ``varlen_attn`` where it has ``seqused_k``, read them in place, the others
#   gather them first. Every cached step matched a full recomputation.
# * **GQA** shrinks the cache by ``n_heads / n_kv_heads``; whether a step
#   also reads less memory depends on the kernel, which the tables above
#   name for this device.
# * **FlexAttention** decodes from the same cache with a mask built once and
#   refreshed per step, and **varlen_attn** takes the same offsets on CUDA.
#
# References
# ----------
# * ``varlen_attn``: https://docs.pytorch.org/docs/stable/nn.attention.varlen.html
# * FlexAttention for inference: https://pytorch.org/blog/flexattention-for-inference/
# * ``gpt-fast``: https://github.com/meta-pytorch/gpt-fast
# * Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models
#   from Multi-Head Checkpoints", 2023: https://arxiv.org/abs/2305.13245
