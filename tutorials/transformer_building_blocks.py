"""
Transformer building blocks for ragged batches
==============================================

The toolkit every page of this site uses: a ragged batch as packed values
plus offsets, one ``ragged_attention`` function with measured backends, and
honest timing. Then a multi-head attention layer built on it, checked against
``torch.nn`` and measured against the best padded layer on the device at hand.

**Author:** rewritten for PyTorch 2.11 and later from the original tutorial by
`Mikayla Gawarecki <https://github.com/mikaylagawarecki>`_

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How to describe a batch of sequences of different lengths as packed
         values plus offsets, the ``cu_seqlens`` of FlashAttention and
         ``varlen_attn``, and how that maps to Hugging Face's packed
         ``position_ids``
       * One attention function over that batch with six named backends
         (``varlen_attn``, SDPA on nested tensors, FlexAttention, a
         per-sequence loop, length buckets, padding), each checked against a
         float32 reference and chosen by measurement, for the forward pass and
         for training
       * How to measure honestly: median and spread, peak memory, the kernel
         that ran, and every speedup beside the work bound that padding sets

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.11 or later (the stamp at the top of the page says which
         versions the page was checked on)
       * A CPU is enough; on a CUDA GPU the page runs at the original's scale,
         in ``bfloat16``

This page is for engineers who write their own transformer layers and feed
them batches of sequences of different lengths: sentences, documents, image
patches of different counts. The usual recipe pads every sequence to the
longest one and masks the padding away. Every padded token is still
projected, and every padded key is still scored, so a batch whose lengths
vary a lot spends most of its time on zeros. Here we build the pieces to do
without padding, and measure what that buys.

If you want a ready-made model instead, libraries such as
`Hugging Face transformers <https://github.com/huggingface/transformers>`_ and
`torchtune <https://github.com/pytorch/torchtune>`_ provide them; for a
collection of attention masks see
`attention-gym <https://github.com/meta-pytorch/attention-gym>`_.
"""

# sphinx_gallery_tags = ["toolkit", "SDPA", "FlexAttention", "varlen attention", "benchmarks"]

# %%
# Packed values plus offsets
# --------------------------
# The idea of this site fits in one picture. A batch of ``B`` sequences of
# lengths ``L_0, L_1, ...`` is stored as
#
# * **values**, ``(T, ...)``: every token of every sequence, end to end, with
#   ``T = L_0 + L_1 + ...``;
# * **offsets**, ``(B + 1,)``: where each sequence starts in ``values``, then
#   where the last one ends: ``[0, L_0, L_0 + L_1, ..., T]``.
#
# Everything in a transformer except attention works on one token at a time
# (linear layers, norms, activations, residuals), so it runs on ``values`` as
# if the batch were one long sequence, with no padding and no mask. Attention
# is the one place that needs the offsets, to keep sequences from seeing each
# other. The same two tensors go by other names elsewhere:
#
# * FlashAttention and ``torch.nn.attention.varlen.varlen_attn`` call the
#   offsets ``cu_seqlens`` (cumulative sequence lengths, as ``int32``);
# * a jagged nested tensor (NJT, ``torch.nested`` with
#   ``layout=torch.jagged``) *is* values plus offsets, with ``values()`` and
#   ``offsets()`` to reach them;
# * Hugging Face's ``DataCollatorWithFlattening`` packs a batch into one row of
#   ``input_ids`` and encodes the boundaries as ``position_ids`` that restart
#   at 0 at every sequence; the offsets are where ``position_ids == 0``, plus
#   ``T`` (the conversion is below).
#
# A status note. The PyTorch documentation now says that nested tensors are
# not under active development, FlexAttention no longer accepts them
# (`PyTorch issue 161734 <https://github.com/pytorch/pytorch/issues/161734>`_),
# and the maintainers point ragged attention at packed sequences with
# ``varlen_attn`` or document masks. So the interface on this site is the
# plain pair of tensors; an NJT appears only where it earns its place, as one
# of the attention backends.

# %%
# Setup
# -----
# The page stops here with a plain message on a PyTorch that is too old,
# rather than half way down with a traceback.

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
SEED = 6
print(f"PyTorch {torch.__version__}, device: {DEVICE}, dtype: {DTYPE}, quick mode: {QUICK}")

# sphinx_gallery_start_ignore
# Messages PyTorch prints that say nothing about the code on this page:
# the prototype notice of nested tensors, the note of the inductor about caching nested
# graphs, and a torch.fx deprecation note that building a block mask triggers.
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
# Every size on the page is set here. On CUDA they are the original
# tutorial's (batch 512, embedding 512, 8 heads), in ``bfloat16``. On CPU the
# batch and embedding are reduced so the whole page runs in a few minutes on
# two cores. ``TUTORIALS_QUICK=1`` shrinks them again for the test suite;
# every assertion still runs.

if DEVICE == "cuda":
    BATCH, EMBED, HEADS = 512, 512, 8  # the original tutorial's scale
    RUN_TIME = 1.0  # seconds of timed runs per comparison
else:
    BATCH, EMBED, HEADS = 64, 256, 8  # real workloads: batch 512, E 512 and up
    RUN_TIME = 0.3
if QUICK:
    BATCH, EMBED, RUN_TIME = BATCH // 4, EMBED // 2, 0.1
ZIPF_ALPHA = 1.2  # the original's exponent
print(f"batch {BATCH}, embedding {EMBED}, heads {HEADS}")

# %%
# The toolkit
# -----------
# Every page of this site uses the same few functions, under the same names.
# This page introduces them; every other page carries an identical copy of the
# ones it uses, so that each downloaded script runs on its own (the test suite
# checks, function by function, that the copies match this page).
#
# Sentence lengths
# ~~~~~~~~~~~~~~~~
# Like the original, we model text as words drawn from a Zipf distribution
# over word ranks; a sentence ends at its first ``.``, ``!`` or ``?``, which
# have ranks 3, 386 and 858 in the WikiText-2 vocabulary. With Zipf exponent
# ``a``, every word ends the sentence independently with the same probability
#
# .. math:: p = \frac{3^{-a} + 386^{-a} + 858^{-a}}{\zeta(a)},
#
# so a sentence's length, counting the word that ends it, is a geometric
# draw with parameter ``p``: one call to a seeded ``numpy.random.Generator``
# draws a whole batch, with no loop over words.

STOP_RANKS = (3, 386, 858)


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


# %%
# The shortcut must give the same lengths as the literal process, so the
# cell draws sentences word by word too (a matrix of Zipf words; each row's
# first stop word ends it) and compares the two samples. The check is a
# two-sample Kolmogorov-Smirnov test: the largest gap between the two
# empirical distribution functions must stay below the gap that two samples
# of one distribution exceed with probability 0.1%. The page stops if it does
# not.

rng = np.random.default_rng(SEED)
n_sentences = 5_000 if QUICK else 20_000
words = rng.zipf(ZIPF_ALPHA, size=(n_sentences, 400))
is_stop = np.isin(words, STOP_RANKS)
word_by_word = is_stop.argmax(axis=1)[is_stop.any(axis=1)] + 1
geometric = sentence_lengths(rng, n_sentences, ZIPF_ALPHA).numpy()
grid = np.arange(1, max(word_by_word.max(), geometric.max()) + 1)
cdf_gap = np.abs(np.searchsorted(np.sort(word_by_word), grid, side="right") / len(word_by_word)
                 - np.searchsorted(np.sort(geometric), grid, side="right") / len(geometric)).max()
n, m = len(word_by_word), len(geometric)
critical = 1.95 * np.sqrt((n + m) / (n * m))  # Kolmogorov-Smirnov, 0.1% level
print(f"stop probability per word: {zipf_stop_probability(ZIPF_ALPHA):.4f}, "
      f"expected length 1/p = {1 / zipf_stop_probability(ZIPF_ALPHA):.1f}")
print(f"mean length word by word {word_by_word.mean():.2f}, geometric {geometric.mean():.2f}; "
      f"largest CDF gap {cdf_gap:.4f} (must stay below {critical:.4f})")
assert cdf_gap < critical, "the geometric shortcut does not match the word-by-word lengths"

# %%
# A packed batch
# ~~~~~~~~~~~~~~
# Offsets come from lengths with one cumulative sum. ``token_index`` gives,
# for every packed token, its sequence and its position in that sequence,
# which is all a layer needs to build positions (rotary embeddings restart at
# every sequence) or to pad the batch when a padded tensor is needed.


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


def ragged_batch(rng, batch, dim, *, alpha=1.2, max_len=None, device="cpu", dtype=torch.float32):
    """A random ragged batch: packed values (T, dim) and offsets (B + 1,)."""
    lengths = sentence_lengths(rng, batch, alpha, max_len)
    gen = torch.Generator(device).manual_seed(int(rng.integers(2**62)))
    values = torch.randn(int(lengths.sum()), dim, generator=gen, device=device, dtype=dtype)
    return values, offsets_from_lengths(lengths, device)


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


# %%
# The mapping to Hugging Face's packed format, on a batch of three: the
# positions that ``token_index`` computes are the ``position_ids`` the collator
# writes, and they give the offsets back.

offsets = offsets_from_lengths([3, 1, 4])
seq, position_ids = token_index(offsets)
print("offsets (cu_seqlens):", offsets.tolist())
print("sequence of each token:", seq.tolist())
print("position_ids:         ", position_ids.tolist())
assert torch.equal(offsets_from_position_ids(position_ids[None]), offsets)

values, offsets = ragged_batch(rng, 5, 4)
padded, valid = to_padded(values, offsets)
assert torch.equal(from_padded(padded, offsets), values) and int(valid.sum()) == len(values)
print(f"5 sequences, lengths {offsets.diff().tolist()}: values {tuple(values.shape)}, "
      f"padded {tuple(padded.shape)}, {1 - len(values) / valid.numel():.0%} of it padding")

# %%
# One attention function
# ~~~~~~~~~~~~~~~~~~~~~~
# ``ragged_attention(q, k, v, q_offsets, kv_offsets, *, is_causal, ...)``
# takes packed queries ``(T_q, H, D)`` and keys and values ``(T_kv, H_kv, D)``
# and lets sequence ``i`` of the queries attend only to sequence ``i`` of the
# keys. ``H_kv`` may be smaller than ``H`` (grouped-query attention). With
# ``is_causal`` a query sees the keys up to its own position; when a sequence
# has more keys than queries (decoding against a cache) the queries are the
# *last* ones, as in FlashAttention and ``varlen_attn``. ``kv_used`` says how
# many of a sequence's key rows are filled, for a cache with spare room
# (``seqused_k`` in ``varlen_attn``).
#
# Six backends compute it:
#
# * ``varlen``: ``varlen_attn``, the variable-length kernel of FlashAttention.
#   CUDA only, ``float16`` or ``bfloat16``. Its keyword arguments changed
#   between releases (``is_causal`` in 2.10, ``window_size`` later, then
#   ``enable_gqa`` and ``seqused_k``), so the code reads its signature.
# * ``sdpa_njt``: ``scaled_dot_product_attention`` on nested tensors built
#   from the same values and offsets. On CUDA it reaches the fused
#   variable-length kernels; on CPU only the math path takes nested tensors.
# * ``flex``: FlexAttention over the whole packed batch as one long sequence,
#   with a *document mask* built from the offsets; its ``BlockMask`` skips the
#   blocks where sequences would see each other. No backward on CPU.
# * ``loop``: one dense SDPA call per sequence, on views of the packed tensors.
#   Runs everywhere, with gradients; it costs one call per sequence.
# * ``bucketed``: sequences sorted by length and cut into a few groups, each
#   padded to its own longest sequence: a few calls, a little padding.
# * ``padded``: every sequence padded to the longest one, one call. This is
#   the baseline the others must beat.
#
# A batch can hold sequences with no queries or no keys (an empty prompt, a
# filtered document). Such sequences are dropped before a backend runs and a
# query without keys gets zeros, so no backend sees an empty sequence and no
# NaN appears. Bad offsets are refused with a message that names the problem.

import inspect
from dataclasses import dataclass, field

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # not in this build of PyTorch
    varlen_attn = None

BACKENDS = ("varlen", "sdpa_njt", "flex", "loop", "bucketed", "padded")


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


# Static shapes on CPU (there dynamic shapes fail to compile on 2.13): one
# compile per token count. Automatic dynamic shapes on CUDA: a new token count
# each batch does not compile again.
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


# %%
# Every backend against the reference, on a batch with an empty sequence
# (lengths 5, 0, 3, 7), causal, with four query heads sharing two key/value
# heads, in this page's dtype. A backend that cannot run here says why.

lengths_e = torch.tensor([5, 0, 3, 7])
offsets_e = offsets_from_lengths(lengths_e, DEVICE)
gen = torch.Generator(DEVICE).manual_seed(SEED)
q_e = torch.randn(int(lengths_e.sum()), 4, 16, generator=gen, device=DEVICE, dtype=DTYPE)
k_e, v_e = (torch.randn(int(lengths_e.sum()), 2, 16, generator=gen, device=DEVICE, dtype=DTYPE)
            for _ in range(2))
reference_e = reference_attention(q_e, k_e, v_e, offsets_e, is_causal=True)
for name in BACKENDS:
    why = backend_support(name, DEVICE, DTYPE, is_causal=True, gqa=True)
    if why:
        print(f"{name:9s} not available: {why}")
        continue
    with torch.no_grad():
        out_e = ragged_attention(q_e, k_e, v_e, offsets_e, is_causal=True, backend=name)
    assert out_e.isfinite().all(), f"{name} returned NaN or inf"
    torch.testing.assert_close(out_e.float(), reference_e, **tolerances(DTYPE))
    print(f"{name:9s} matches the reference, max |difference| "
          f"{(out_e.float() - reference_e).abs().max().item():.1e}")

# %%
# Bad offsets get an error that names the problem:

for bad in ([0, 5, 5, 8, 16], [1, 5, 5, 8, 15], [0, 5, 3, 8, 15]):
    try:
        ragged_attention(q_e, k_e, v_e, torch.tensor(bad, device=DEVICE), offsets_e)
    except ValueError as err:
        print(f"offsets {bad}: {err}")
    else:
        raise AssertionError(f"offsets {bad} were accepted")

# %%
# Measuring
# ~~~~~~~~~
# ``measure`` times several functions side by side with
# ``torch.utils.benchmark``: it times each first call alone (it may compile),
# then lets the functions take turns for a few rounds, so that a busy machine
# slows all of them alike, and reports the median and the interquartile range
# (IQR) of the timed blocks, in milliseconds. It then runs each function once
# more under ``torch.profiler`` for two things:
#
# * **peak memory**, in MiB, beyond what was allocated before the call: on
#   CUDA ``torch.cuda.max_memory_allocated``; on CPU, which keeps no such
#   counter, the running sum of the allocation and free events the profiler records;
# * **the attention kernel that ran**, read from the operator names the
#   profiler recorded (the CPU flash kernel, FlashAttention, the
#   memory-efficient or cuDNN kernel, the math path, a compiled graph), with
#   the number of calls.

import gc
import time

from torch.utils import benchmark


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


# %%
# Measure, then choose
# ~~~~~~~~~~~~~~~~~~~~
# ``compare_backends`` runs one attention job on every backend that can take
# it here: it checks the output (and, for training, the gradients) against
# ``reference_attention``, then times all of them together. A backend that
# cannot run says why; one that runs but disagrees with the reference stops
# the page. For training it times the forward and backward passes together,
# because that is what a training step pays.


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


# %%
# The work bound
# ~~~~~~~~~~~~~~
# If time followed work, a ragged layer would be as much faster as it does
# less work. The **work bound** of a comparison is the work the padded implementation must
# do divided by the work the ragged one must do, each counted for what it
# actually computes: floating-point operations per token for the projections
# and feed-forward layers (``per_token``), and per query-key pair for the
# attention scores (``per_pair``). A kernel that skips the masked half of a
# causal score matrix counts ``L (L + 1) / 2`` pairs per sequence of length
# ``L``; a padded layer with a merged mask computes the whole ``S x S``
# square, and is counted that way. Every speedup on this site is printed
# beside its bound, with the fraction of the bound it reaches.


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
# Attention alone: measure, then choose
# -------------------------------------
# Now the choice, on this page's batch: causal self-attention with ``HEADS``
# heads, first the forward pass alone (inference), then forward and backward
# (training). Which backend wins depends on the device, the dtype, the
# lengths and the number of cores, so the page takes whatever measured
# fastest here, and every layer below uses those two choices.

torch.manual_seed(SEED)
rng = np.random.default_rng(SEED)
x, offsets = ragged_batch(rng, BATCH, EMBED, device=DEVICE, dtype=DTYPE)
lengths = offsets.diff().cpu()
print(f"batch: {len(lengths)} sequences, {len(x)} tokens, longest {int(lengths.max())}; "
      f"padding would hold {len(lengths) * int(lengths.max())} token slots")
# Queries from the batch; keys and values drawn apart, so that no query is
# favored by being its own key. Each (T, H, D).
gen = torch.Generator(DEVICE).manual_seed(SEED + 1)
q_a = x.unflatten(-1, (HEADS, -1))
k_a, v_a = (torch.randn(x.shape, generator=gen, device=DEVICE).to(DTYPE).unflatten(-1, (HEADS, -1))
            for _ in range(2))

print("forward:")
forward_results = compare_backends(q_a, k_a, v_a, offsets, is_causal=True, min_run_time=RUN_TIME)
print("forward and backward:")
training_results = compare_backends(q_a, k_a, v_a, offsets, is_causal=True, backward=True,
                                    min_run_time=RUN_TIME)
FORWARD_BACKEND, TRAINING_BACKEND = fastest(forward_results), fastest(training_results)
print(f"chosen on {DEVICE}: forward -> {FORWARD_BACKEND}, training -> {TRAINING_BACKEND}")

# %%
# Multi-head attention for ragged batches
# ---------------------------------------
# The layer is short: project, attend, project. For self-attention the three
# input projections are one ``Linear`` with three times the output width; for
# cross-attention the queries come from one batch and the keys and values
# from another, so the projections are separate. Given packed values and
# offsets it calls ``ragged_attention``; given a padded ``(B, S, E)`` batch
# and no offsets, the *same module* runs the padded path, one SDPA call, so
# the padded baseline below differs from the ragged layer in nothing but the
# padding. With right padding a causal query never sees a padding key, so
# the causal padded path needs no mask at all and can use a causal kernel.


class MultiHeadAttention(nn.Module):
    def __init__(self, embed, heads, *, cross=False, bias=True, backend=None, device=None, dtype=None):
        super().__init__()
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.heads, self.cross, self.backend = heads, cross, backend
        if cross:
            self.q_proj = nn.Linear(embed, embed, **kw)
            self.kv_proj = nn.Linear(embed, 2 * embed, **kw)
        else:
            self.qkv_proj = nn.Linear(embed, 3 * embed, **kw)
        self.out_proj = nn.Linear(embed, embed, **kw)

    def forward(self, x, offsets=None, *, context=None, context_offsets=None, key_valid=None,
                is_causal=False):
        # packed: x (T, E) with offsets (B + 1,); padded: x (B, S, E), and
        # key_valid (B, S_kv) where some keys are padding that must be masked
        if self.cross:
            q, (k, v) = self.q_proj(x), self.kv_proj(context).chunk(2, dim=-1)
        else:
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)) for t in (q, k, v))  # (..., H, D)
        if offsets is not None:
            kv_offsets = context_offsets if self.cross else offsets
            out = ragged_attention(q, k, v, offsets, kv_offsets, is_causal=is_causal,
                                   backend=self.backend)  # (T, H, D)
        else:
            mask = None if key_valid is None else key_valid[:, None, None, :]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask, is_causal=is_causal).transpose(1, 2)
        return self.out_proj(out.flatten(-2))


@torch.no_grad()
def copy_from_nn(layer, ref):
    """Give ``layer`` the weights of an ``nn.MultiheadAttention``."""
    if layer.cross:
        layer.q_proj.weight.copy_(ref.in_proj_weight[:len(ref.in_proj_weight) // 3])
        layer.q_proj.bias.copy_(ref.in_proj_bias[:len(ref.in_proj_bias) // 3])
        layer.kv_proj.weight.copy_(ref.in_proj_weight[len(ref.in_proj_weight) // 3:])
        layer.kv_proj.bias.copy_(ref.in_proj_bias[len(ref.in_proj_bias) // 3:])
    else:
        layer.qkv_proj.weight.copy_(ref.in_proj_weight)
        layer.qkv_proj.bias.copy_(ref.in_proj_bias)
    layer.out_proj.load_state_dict(ref.out_proj.state_dict())
    return layer


# %%
# Causal self-attention against ``nn.MultiheadAttention``
# -------------------------------------------------------
# First correctness. The reference is ``nn.MultiheadAttention`` in float32 on
# the padded batch, with a ``key_padding_mask`` and a causal ``attn_mask``;
# the ragged layer gets the same weights, in the page's dtype. Outputs are
# compared on the real tokens only: what a padded layer writes at padding is
# garbage by definition.

torch.manual_seed(SEED)
ref_mha = nn.MultiheadAttention(EMBED, HEADS, batch_first=True, device=DEVICE)
mha = copy_from_nn(MultiHeadAttention(EMBED, HEADS, device=DEVICE), ref_mha).to(DTYPE)

x_padded, valid = to_padded(x, offsets)  # (B, S, E), (B, S)
S = x_padded.shape[1]
causal_mask = torch.ones(S, S, dtype=torch.bool, device=DEVICE).triu(1)  # True: masked
x32, x32_padded = x.float(), x_padded.float()
with torch.no_grad():
    ref_out = ref_mha(x32_padded, x32_padded, x32_padded, key_padding_mask=~valid,
                      attn_mask=causal_mask, need_weights=False)[0]
    mha.backend = FORWARD_BACKEND
    torch.testing.assert_close(mha(x, offsets, is_causal=True).float(), ref_out[valid],
                               **tolerances(DTYPE))
    torch.testing.assert_close(from_padded(mha(x_padded, is_causal=True), offsets).float(),
                               ref_out[valid], **tolerances(DTYPE))
print("ragged layer and padded path both match nn.MultiheadAttention on every real token")

# %%
# Then speed. Three forward passes on the same batch:
#
# * **padded**, the baseline: the same module on the padded batch with
#   ``is_causal`` (right padding, no mask), what a reader writing a padded
#   layer today would write;
# * **ragged**: the module on packed values and offsets, with the backend
#   chosen above;
# * **the seed's baseline**: ``nn.MultiheadAttention`` with a
#   ``key_padding_mask`` and a causal ``attn_mask``, which it merges into one
#   ``(B * H, S, S)`` mask, as the original tutorial compared against. A
#   merged mask computes the whole score square, and its bound says so.
#
# Each side's forward-and-backward pass is timed too, with the chosen
# training backend. The bound counts ``8 E^2`` FLOPs per token for the four
# projections and ``4 E`` per query-key pair.

ref_mha_lp = ref_mha.to(DTYPE)
grad_out = torch.randn_like(x)
grad_padded = to_padded(grad_out, offsets)[0]


def padded_forward():
    with torch.no_grad():
        return mha(x_padded, is_causal=True)


def ragged_forward():
    with torch.no_grad():
        return mha(x, offsets, is_causal=True)


def seed_forward():
    with torch.no_grad():
        return ref_mha_lp(x_padded, x_padded, x_padded, key_padding_mask=~valid,
                          attn_mask=causal_mask, need_weights=False)[0]


def padded_training():
    mha(x_padded, is_causal=True).backward(grad_padded)


def ragged_training():
    mha(x, offsets, is_causal=True).backward(grad_out)


mha.backend = FORWARD_BACKEND
forward = measure({"padded": padded_forward, "ragged": ragged_forward, "seed's baseline": seed_forward},
                  min_run_time=RUN_TIME)
mha.backend = TRAINING_BACKEND
training = measure({"padded": padded_training, "ragged": ragged_training}, min_run_time=RUN_TIME)
per_token, per_pair = 8 * EMBED**2, 4 * EMBED
bound = work_bound(lengths, per_token=per_token, per_pair=per_pair, causal=True)
seed_bound = work_bound(lengths, per_token=per_token, per_pair=per_pair, causal=True, padded_causal=False)
for name, t in forward.items():
    print(f"forward, {name:16s} {t}")
for name, t in training.items():
    print(f"fwd+bwd, {name:16s} {t}")
print(speedup_line("forward against padded", forward["padded"], forward["ragged"], bound))
print(speedup_line("forward against the seed's baseline", forward["seed's baseline"], forward["ragged"],
                   seed_bound))
print(speedup_line("forward and backward against padded", training["padded"], training["ragged"], bound))
tokens = len(x)
print(f"throughput, forward: padded {tokens / forward['padded'].median_ms * 1e3:,.0f} tokens/s, "
      f"ragged {tokens / forward['ragged'].median_ms * 1e3:,.0f} tokens/s (real tokens)")

# %%
# Where the time goes
# ~~~~~~~~~~~~~~~~~~~
# The fraction of the bound says how much of what padding costs the ragged
# layer wins back. When it falls short, the profile says why: the operators
# that took most of each side's time in one forward-and-backward pass. The
# matrix multiplies (``addmm``, ``mm``) scale with the tokens on both sides;
# what the ragged side adds is one attention call per sequence for the loop
# backend, or the gathers of the bucketed one, and the bookkeeping around
# them.

mha.backend = TRAINING_BACKEND
print("padded, forward and backward:")
print(where_time_goes(padded_training))
print("ragged, forward and backward:")
print(where_time_goes(ragged_training))

# %%
# Where did the original's 144x backward come from?
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The original tutorial reported a 144x faster backward on an A100, far
# beyond any padding bound. Its benchmark timed a single backward call of a
# compiled module right after a forward-only warm-up, and a compiled module
# compiles its backward graph when the first backward runs, so that one call
# included compilation. The cell below compiles the seed's baseline and
# times its first backward (which compiles, or loads from the compile cache)
# against the ragged layer's steady backward.

compiled_seed = torch.compile(ref_mha_lp)
grad_seed = torch.randn_like(x_padded)


def seed_loss():
    return (compiled_seed(x_padded, x_padded, x_padded, key_padding_mask=~valid,
                          attn_mask=causal_mask, need_weights=False)[0] * grad_seed).sum()


with torch.no_grad():
    seed_loss()  # the forward-only warm-up the original did
start = time.perf_counter()
loss = seed_loss()  # compiles the graph that records for backward
_sync()
first_forward_s = time.perf_counter() - start
start = time.perf_counter()
loss.backward()  # compiles (or loads) the backward graph
_sync()
first_backward_s = time.perf_counter() - start
print(f"seed's baseline, first forward with gradients {first_forward_s:.2f} s, "
      f"first backward {first_backward_s:.2f} s")
print(f"ragged layer, steady forward and backward: {training['ragged'].median_ms:.2f} ms")
print(f"first forward and backward / ragged steady step: "
      f"{(first_forward_s + first_backward_s) * 1e3 / training['ragged'].median_ms:.0f}x; "
      f"steady state against steady state: the speedup above")

# %%
# Cross-attention
# ---------------
# In cross-attention the queries come from one batch and the keys and values
# from another, as in an encoder-decoder model, and each item has its own
# pair of lengths. The padded path needs two padded tensors and a mask for
# the padding keys; the ragged layer takes two offsets. Neither side is
# causal, so both compute the whole score rectangle of their batch.

x_q, offsets_q = ragged_batch(rng, BATCH, EMBED, device=DEVICE, dtype=DTYPE)
x_kv, offsets_kv = ragged_batch(rng, BATCH, EMBED, device=DEVICE, dtype=DTYPE)
torch.manual_seed(SEED)
ref_cross = nn.MultiheadAttention(EMBED, HEADS, batch_first=True, device=DEVICE)
cross = copy_from_nn(MultiHeadAttention(EMBED, HEADS, cross=True, device=DEVICE), ref_cross).to(DTYPE)
q_padded, q_valid = to_padded(x_q, offsets_q)
kv_padded, kv_valid = to_padded(x_kv, offsets_kv)
with torch.no_grad():
    ref_cross_out = ref_cross(q_padded.float(), kv_padded.float(), kv_padded.float(),
                              key_padding_mask=~kv_valid, need_weights=False)[0]
    cross.backend = fastest(compare_backends(
        *(t.unflatten(-1, (HEADS, -1)) for t in (x_q, x_kv, x_kv)), offsets_q, offsets_kv,
        min_run_time=RUN_TIME / 2))
    torch.testing.assert_close(cross(x_q, offsets_q, context=x_kv, context_offsets=offsets_kv).float(),
                               ref_cross_out[q_valid], **tolerances(DTYPE))
print(f"cross-attention matches nn.MultiheadAttention on every real query (backend chosen: {cross.backend})")


def padded_cross():
    with torch.no_grad():
        return cross(q_padded, context=kv_padded, key_valid=kv_valid)


def ragged_cross():
    with torch.no_grad():
        return cross(x_q, offsets_q, context=x_kv, context_offsets=offsets_kv)


cross_times = measure({"padded": padded_cross, "ragged": ragged_cross}, min_run_time=RUN_TIME)
lq, lkv = offsets_q.diff().cpu(), offsets_kv.diff().cpu()
cross_bound = work_bound(lq, lkv, per_token=4 * EMBED**2, per_kv_token=4 * EMBED**2, per_pair=4 * EMBED)
for name, t in cross_times.items():
    print(f"cross-attention, {name:7s} {t}")
print(speedup_line("cross-attention forward", cross_times["padded"], cross_times["ragged"], cross_bound))

# %%
# Empty sequences and fully masked rows
# -------------------------------------
# A batch can contain an empty sequence: a prompt with no context, a document
# whose every token was filtered. In a padded batch that is a row with every
# key masked, and a softmax over no keys has no value. We run the ``torch.nn``
# layer in evaluation mode on a batch of lengths 5, 0 and 3, and the ragged
# layer on the same batch with every backend that runs here.

offsets_empty = offsets_from_lengths([5, 0, 3], DEVICE)
x_empty = torch.randn(8, EMBED, generator=torch.Generator(DEVICE).manual_seed(SEED), device=DEVICE).to(DTYPE)
x_empty_padded, valid_empty = to_padded(x_empty, offsets_empty)
with torch.no_grad():
    out_nn = ref_mha.float().eval()(x_empty_padded.float(), x_empty_padded.float(), x_empty_padded.float(),
                                    key_padding_mask=~valid_empty, need_weights=False)[0]
    print(f"nn.MultiheadAttention, eval: NaN rows per sequence {out_nn.isnan().all(-1).sum(-1).tolist()}")
    for name in BACKENDS:
        if backend_support(name, DEVICE, DTYPE, is_causal=True) is None:
            mha.backend = name
            out = mha(x_empty, offsets_empty, is_causal=True)
            assert out.shape == (8, EMBED) and out.isfinite().all(), name
    print("ragged layer: 8 rows (5 + 0 + 3), all finite, on every backend that runs here")
ref_mha = ref_mha.to(DTYPE)

# %%
# Changing attention scores with FlexAttention
# --------------------------------------------
# The packed tokens with a document mask are a ragged batch for FlexAttention
# too. A ``score_mod`` receives positions in the packed sequence; within one
# document their difference is the distance inside the sentence, so
# relative-position schemes work unchanged. ALiBi
# (`Press et al., 2021 <https://arxiv.org/abs/2108.12409>`_) subtracts a
# per-head slope times the query-key distance from each score. The check is
# against the reference computed sequence by sequence with the same bias as
# an explicit additive mask.

slopes = torch.exp2(-8.0 * torch.arange(1, HEADS + 1, device=DEVICE) / HEADS)  # (H,)


def alibi(score, b, h, q_idx, kv_idx):
    return score - slopes[h] * (q_idx - kv_idx)


seq_ids = token_index(offsets)[0]


def document_causal(b, h, q_idx, kv_idx):
    return (seq_ids[q_idx] == seq_ids[kv_idx]) & (q_idx >= kv_idx)


@torch.compile(dynamic=False)
def alibi_attention(q, k, v, block_mask):
    return flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)


block_mask = create_block_mask(document_causal, None, None, len(x), len(x), device=DEVICE)
qf, kf, vf = (t.transpose(0, 1)[None] for t in (q_a, k_a, v_a))  # (1, H, T, D): the batch as one sequence
with torch.no_grad():
    out_alibi = alibi_attention(qf, kf, vf, block_mask)[0]
    reference_alibi = torch.zeros(out_alibi.shape, device=DEVICE)
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        pos = torch.arange(end - start, device=DEVICE)
        distance = (pos[:, None] - pos[None, :]).float()
        bias = (-slopes[:, None, None] * distance).masked_fill(distance < 0, float("-inf"))
        qs, ks, vs = (t[0, :, start:end].float() for t in (qf, kf, vf))
        with sdpa_kernel(SDPBackend.MATH):
            reference_alibi[:, start:end] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias)
torch.testing.assert_close(out_alibi.float(), reference_alibi, **tolerances(DTYPE))
print(f"ALiBi over the document-causal mask matches the reference on all {len(x)} tokens; "
      f"the block mask skips {block_mask.sparsity():.1f}% of the score blocks")

# %%
# Speedup against the bound, across batches
# -----------------------------------------
# One batch proves little about the next. The Zipf exponent sets the
# distribution of sentence lengths: a smaller exponent gives longer sentences
# (the expected length ``1 / p`` is printed for each). For several exponents
# we draw one batch each, time the causal self-attention layer forward,
# padded against ragged, and plot the speedup against the work bound of that
# batch. A point on the diagonal means the ragged layer wins back what
# padding costs in work; below it, part of that is lost to overheads.

import matplotlib.pyplot as plt

mha.backend = FORWARD_BACKEND
points = []
for alpha in (1.1, 1.35, 1.6) if QUICK else (1.1, 1.2, 1.35, 1.6):
    x_b, offsets_b = ragged_batch(rng, BATCH, EMBED, alpha=alpha, device=DEVICE, dtype=DTYPE)
    x_b_padded = to_padded(x_b, offsets_b)[0]
    with torch.no_grad():
        t = measure({"padded": lambda: mha(x_b_padded, is_causal=True),
                     "ragged": lambda: mha(x_b, offsets_b, is_causal=True)},
                    min_run_time=RUN_TIME / 2, profile=False)
    b = work_bound(offsets_b.diff().cpu(), per_token=per_token, per_pair=per_pair, causal=True)
    points.append((alpha, b, t["padded"].median_ms / t["ragged"].median_ms))
    print(f"Zipf {alpha:4.2f} (expected length {1 / zipf_stop_probability(alpha):5.1f}): "
          f"{len(x_b):6d} tokens, longest {int(offsets_b.diff().max()):4d}, "
          + speedup_line("forward", t["padded"], t["ragged"], b))

fig, ax = plt.subplots(figsize=(5.5, 4.2))
top = 1.1 * max(max(p[1], p[2]) for p in points)
ax.plot([1, top], [1, top], "--", color="gray", label="speedup = work bound")
ax.scatter([p[1] for p in points], [p[2] for p in points], zorder=3, label=f"measured, {DEVICE}")
for alpha, b, s in points:
    ax.annotate(f"Zipf {alpha}", (b, s), textcoords="offset points", xytext=(6, -10))
ax.set_xlabel("work bound (padded work / ragged work)")
ax.set_ylabel("measured forward speedup (x)")
ax.set_title(f"Ragged vs padded causal self-attention\nbatch {BATCH}, E={EMBED}, {HEADS} heads, {DTYPE}")
ax.legend(loc="upper left")
fig.tight_layout()
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# Conclusion
# ----------
# The lesson of the original tutorial holds: a layer that never pads does
# only the work the batch needs, and the work bound says how much that can
# be worth. What changed is how it is built. Linear layers, norms and
# residuals run on packed values; attention needs only the offsets, and
# ``ragged_attention`` takes them with whichever backend measured fastest on
# the device at hand, checked against a reference that shares no kernel with
# it. The other pages of this site build on exactly these functions: the
# ``torch.nn.Transformer`` family, a packed GPT trained end to end, decoding
# with a KV cache, and a guide to which attention path to use when.
#
# Reference figures from the original tutorial
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# These are **not** from this build. The original, on an A100 with batch
# 512 and embedding 512, reported: causal self-attention forward 5.65x
# faster, 3.39 GB of peak memory saved, backward 144x (see above),
# cross-attention forward 4.01x. Its numpy generator was not seeded, so its
# batch, and with it the bound, is unknown. The cell below computes the
# bound for the original's setting from this page's length generator for
# three seeds, counting the original's padded layer as it ran (a merged mask:
# the whole square).

original_bounds = [work_bound(sentence_lengths(np.random.default_rng(s), 512), per_token=8 * 512**2,
                              per_pair=4 * 512, causal=True, padded_causal=False) for s in (0, 1, 2)]
print("work bound of the original's setting, seeds 0, 1, 2: "
      + ", ".join(f"{b:.2f}x" for b in original_bounds))

# %%
# Further reading
# ---------------
#
# * `torch.nested documentation <https://docs.pytorch.org/docs/stable/nested.html>`_
# * `varlen_attn <https://docs.pytorch.org/docs/stable/nn.attention.varlen.html>`_
# * `Scaled dot product attention tutorial
#   <https://docs.pytorch.org/tutorials/intermediate/scaled_dot_product_attention_tutorial.html>`_
# * `FlexAttention blog post <https://pytorch.org/blog/flexattention/>`_ and
#   `attention-gym <https://github.com/meta-pytorch/attention-gym>`_ for
#   document masks and score modifications
# * `Packing with FlashAttention 2 in Hugging Face transformers
#   <https://huggingface.co/blog/packing-with-FA2>`_ (``DataCollatorWithFlattening``)
# * `gpt-fast <https://github.com/meta-pytorch/gpt-fast>`_ and
#   `nanoGPT <https://github.com/karpathy/nanoGPT>`_ for compact, fast
#   transformer code
