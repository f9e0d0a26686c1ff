"""
Transformer building blocks for ragged batches
==============================================

Build a multi-head attention layer and a GPT-style layer that take a ragged
batch as it is, check them against ``torch.nn``, and measure what skipping the
padding buys on the device at hand.

**Author:** rewritten for PyTorch 2.13 from the original tutorial by
`Mikayla Gawarecki <https://github.com/mikaylagawarecki>`_

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How to write a multi-head attention layer that never pads a
         variable-length batch, from ``torch.nested``,
         ``scaled_dot_product_attention``, ``torch.compile`` and FlexAttention
       * How to check it against ``torch.nn`` (outputs and gradients) and how
         to measure it honestly: median and spread, peak memory, and the
         speedup beside the bound that padding sets
       * Cross-attention, fully masked rows, ALiBi and document masks, and
         packed projections

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.11 or later (checked on 2.11 and 2.13 on CPU; it stops
         with a message on older versions)
       * A CPU is enough. The CUDA branches use the original's full scale
         but were not run for this page; only the CPU path was checked

This page is for engineers who write their own transformer layers and feed
them batches of sequences of different lengths: sentences, documents, image
patches of different counts. The usual recipe pads every sequence to the
longest one and masks the padding away. Every padded token is still
projected, and every padded key is still scored, so a batch whose lengths
vary a lot spends most of its time on zeros. Here we build the same layers
without padding and measure what that buys.

If you want a ready-made model instead, libraries such as
`Hugging Face transformers <https://github.com/huggingface/transformers>`_ and
`torchtune <https://github.com/pytorch/torchtune>`_ provide them; for a
collection of attention masks see
`attention-gym <https://github.com/meta-pytorch/attention-gym>`_.
"""

# sphinx_gallery_tags = ["nested tensors", "SDPA", "torch.compile", "FlexAttention", "benchmarks"]

# %%
# The building blocks
# -------------------
#
# * **Nested jagged tensors** (``torch.nested`` with ``layout=torch.jagged``,
#   NJT for short) hold a batch of sequences of different lengths as one
#   packed ``values`` tensor of shape ``(total_tokens, E)`` plus an
#   ``offsets`` tensor that says where each sequence starts.
# * ``torch.nn.functional.scaled_dot_product_attention`` (SDPA) computes
#   :math:`\mathrm{softmax}(QK^T/\sqrt{d} + B)\,V` and picks a fused kernel
#   when the inputs allow one.
# * ``torch.compile`` captures the Python code as a graph and fuses its
#   element-wise work, which removes most of the framework overhead.
# * **FlexAttention** (``torch.nn.attention.flex_attention``) lets you
#   change attention scores with a small Python function (``score_mod``)
#   and skip whole blocks of them with a ``BlockMask``.
# * **Variable-length attention** (``torch.nn.attention.varlen``) runs
#   attention directly on packed sequences described by cumulative lengths;
#   in 2.13 it is CUDA only.
#
# An honest status note
# ~~~~~~~~~~~~~~~~~~~~~
# The PyTorch documentation now says that nested tensors are not under
# active development, and FlexAttention no longer accepts NJT inputs (the
# support was removed in `PyTorch issue 161734
# <https://github.com/pytorch/pytorch/issues/161734>`_). The durable idea is
# underneath: **pack the tokens of all sequences into one tensor and
# describe the sequence boundaries with offsets**. Linear layers, norms and
# activation functions work on packed tokens as they are; only attention needs to know
# the boundaries, and SDPA on an NJT, FlexAttention with a document mask
# and ``varlen_attn`` all take exactly that description. This page still uses
# NJT as the container because it carries values and offsets together,
# converts to and from padded tensors in one call, and on CUDA sends SDPA to
# fused variable-length kernels without any extra code. Everywhere else we
# reach through it to ``values()`` and ``offsets()``, so the code carries
# over unchanged to a plain ``(values, offsets)`` pair.

# %%
# Setup
# -----
# The page first checks that this PyTorch has what it needs, so that an older
# install fails here with a plain message instead of deep inside a cell.

import logging
import math
import os
import time
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MIN_TORCH = (2, 11)  # the oldest release this page was checked on
CHECKED_ON = ("2.11", "2.13")
_version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if _version < MIN_TORCH:
    raise RuntimeError(
        f"This tutorial needs PyTorch {'.'.join(map(str, MIN_TORCH))} or later "
        f"(it was checked on {' and '.join(CHECKED_ON)}); this is {torch.__version__}. "
        "Upgrade with `pip install -U torch`."
    )
try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError as err:
    raise RuntimeError(
        "This tutorial needs torch.nn.attention.flex_attention, which this "
        f"PyTorch ({torch.__version__}) does not provide: {err}"
    ) from None
if torch.__version__.split("+")[0].rsplit(".", 1)[0] not in CHECKED_ON:
    print(f"Note: this page was checked on PyTorch {' and '.join(CHECKED_ON)}, "
          f"you run {torch.__version__}.")

# Silence, by their text, exactly the messages that compiling nested-tensor
# code and building block masks print; every other warning still shows.
warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")
warnings.filterwarnings("ignore", message=r".*nested tensors is in prototype stage")


class _DropPickleCacheKey(logging.Filter):
    # Inductor logs this, with a stack trace, when it cannot cache an NJT graph.
    def filter(self, record):
        return not record.getMessage().startswith("Failed to pickle cache key")


logging.getLogger("torch._inductor.codecache").addFilter(_DropPickleCacheKey())


class _DropFxTracingNote(logging.Filter):
    # An internal deprecation note that ``create_block_mask`` triggers.
    def filter(self, record):
        return not record.getMessage().startswith("is_fx_tracing will return true")


logging.getLogger("torch.fx._symbolic_trace").addFilter(_DropFxTracingNote())

# Every ``torch.compile(module)`` on this page shares one wrapper frame, and
# each module (and each new input shape) adds an entry to that frame's cache;
# the default limit of 8 entries would silently send later modules back to
# eager mode.
if hasattr(torch._dynamo.config, "recompile_limit"):
    torch._dynamo.config.recompile_limit = 64
else:  # its name before PyTorch 2.7
    torch._dynamo.config.cache_size_limit = 64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUICK = os.environ.get("TUTORIALS_QUICK") == "1"
SEED = 6
print(f"PyTorch {torch.__version__}, device: {DEVICE}, quick mode: {QUICK}")

# %%
# Sizes
# ~~~~~
# All sizes live here. On CUDA they are the original tutorial's (batch 512,
# embedding 512, 8 heads). On CPU the batch and embedding are reduced so the
# whole page, compilation included, runs in a few minutes on two cores.
# ``TUTORIALS_QUICK=1`` shrinks them again for the test suite; every
# assertion still runs.

if DEVICE == "cuda":
    BATCH, EMBED, HEADS = 512, 512, 8  # the original tutorial's scale
    RUN_TIME = 1.0  # seconds of timed runs per measurement
    PROJ_TOKENS_BATCH, PROJ_DIM = 256, 8192  # packed input projection section
    FFN_BATCH, FFN_DIM = 128, 128  # packed SwiGLU section
    LOW_PRECISION = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if LOW_PRECISION is torch.float32:
        print("This GPU has no bfloat16 support: the packed-projection section runs in float32.")
else:
    BATCH, EMBED, HEADS = 64, 256, 8  # real workloads: batch 512, E 512 and up
    RUN_TIME = 0.5
    PROJ_TOKENS_BATCH, PROJ_DIM = 64, 512
    FFN_BATCH, FFN_DIM = 128, 128
    LOW_PRECISION = torch.float32  # ``bfloat16`` is only used on CUDA here
if QUICK:
    BATCH, EMBED = BATCH // 4, EMBED // 2
    RUN_TIME = 0.1
    PROJ_TOKENS_BATCH, PROJ_DIM = PROJ_TOKENS_BATCH // 4, PROJ_DIM // 4
    FFN_BATCH = FFN_BATCH // 4
ZIPF_ALPHA = 1.2  # the original's exponent
FIGURE_ALPHAS = (1.1, 1.2, 1.35, 1.6) if not QUICK else (1.1, 1.35, 1.6)  # batches in the figure
print(f"batch {BATCH}, embedding {EMBED}, heads {HEADS}, timed runs {RUN_TIME} s per measurement")

# %%
# Utilities
# ---------
#
# Sentence lengths
# ~~~~~~~~~~~~~~~~
# Like the original, we model text as words drawn from a Zipf distribution
# over word ranks; a sentence ends at the first ``.``, ``!`` or ``?``, which
# have ranks 3, 386 and 858 in the WikiText-2 vocabulary. The original drew
# word after word in a Python loop. With Zipf exponent ``a``, each word ends
# the sentence independently with the same probability
#
# .. math:: p = \frac{3^{-a} + 386^{-a} + 858^{-a}}{\zeta(a)},
#
# so the number of words up to and including the first terminator follows a
# geometric distribution with parameter ``p``, and one call to
# ``Generator.geometric`` draws the whole batch. The cell below also draws a
# matrix of Zipf words and finds the first terminator in each row, the
# literal version of the original, to show that the two agree.

TERMINATOR_RANKS = np.array([3, 386, 858])


def zeta(a, n=1000):
    # Riemann zeta: a partial sum plus an estimate of the tail
    k = np.arange(1, n)
    return (k**-a).sum() + n ** (1 - a) / (a - 1) + 0.5 * n**-a + a * n ** (-a - 1) / 12


def stop_probability(alpha):
    return (TERMINATOR_RANKS**-alpha).sum() / zeta(alpha)


def zipf_sentence_lengths(rng, batch_size, alpha=ZIPF_ALPHA):
    return torch.from_numpy(rng.geometric(stop_probability(alpha), size=batch_size))


rng = np.random.default_rng(SEED)
words = rng.zipf(ZIPF_ALPHA, size=(5000, 300))  # 5000 sentences of at most 300 words
is_end = np.isin(words, TERMINATOR_RANKS)
literal = is_end.argmax(axis=1)[is_end.any(axis=1)] + 1
print(f"stop probability per word: {stop_probability(ZIPF_ALPHA):.4f}")
print(f"mean length, word by word: {literal.mean():.1f}, "
      f"geometric: {zipf_sentence_lengths(rng, 100_000).float().mean():.1f}, "
      f"expected 1/p: {1 / stop_probability(ZIPF_ALPHA):.1f}")

# %%
# A ragged batch
# ~~~~~~~~~~~~~~
# ``gen_batch`` draws lengths, fills one packed tensor with random
# vectors and wraps it as an NJT. Passing ``max_seqlen`` matters: without
# it ``to_padded_tensor`` pads every sequence to the *total* token count.


def gen_batch(rng, batch_size, embed, alpha=ZIPF_ALPHA, device=DEVICE, dtype=torch.float32):
    lengths = zipf_sentence_lengths(rng, batch_size, alpha)  # (B,)
    offsets = F.pad(lengths.cumsum(0), (1, 0)).to(device)  # (B + 1,)
    values = torch.randn(int(lengths.sum()), embed, device=device, dtype=dtype)  # (T, E)
    x = torch.nested.nested_tensor_from_jagged(values, offsets, max_seqlen=int(lengths.max()))
    return x, lengths  # x: (B, S*, E) with S* ragged


def valid_mask(lengths, device=DEVICE):
    # (B, S_max) True on real tokens; padded[valid] lists tokens in packed order
    return (torch.arange(int(lengths.max()))[None] < lengths[:, None]).to(device)


# %%
# The bound that padding sets
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A layer that skips padding can at best be as much faster as it does less
# work. We count the floating-point operations of one attention layer: the
# four ``E x E`` projections cost ``8 E^2`` per token, and the two attention
# products (``QK^T`` and the weighted sum of ``V``) cost ``4 E`` per
# query-key pair. For causal attention both sides count only the pairs a
# causal kernel must compute, ``L (L + 1) / 2`` per sequence of length
# ``L``. The ratio, padded over ragged, is the speedup bound printed beside
# every measured speedup.


def attention_flops(q_lengths, kv_lengths, embed, causal, padded):
    q, kv = q_lengths.double(), kv_lengths.double()
    if padded:
        q, kv = torch.full_like(q, q.max().item()), torch.full_like(kv, kv.max().item())
    pairs = q * (q + 1) / 2 if causal else q * kv
    # Q and output projections run on query tokens, K and V on key tokens
    return (4 * embed**2 * (q + kv) + 4 * embed * pairs).sum().item()


def padding_bound(q_lengths, kv_lengths, embed, causal):
    return attention_flops(q_lengths, kv_lengths, embed, causal, True) / attention_flops(
        q_lengths, kv_lengths, embed, causal, False
    )


# %%
# Timing and memory
# ~~~~~~~~~~~~~~~~~
# ``compare`` times the first call of each function (which includes
# compilation) on its own, then hands the functions to
# ``torch.utils.benchmark.Timer``, which repeats each in blocks and
# synchronizes CUDA for us. The functions take turns over a few rounds, so
# that a busy machine slows all of them alike and their ratio stays fair; we
# report the median and the interquartile range (IQR) of the block times.
# Peak memory is the most memory the call holds on top of what was live
# before it:
#
# * on CUDA, ``torch.cuda.max_memory_allocated`` after
#   ``torch.cuda.reset_peak_memory_stats``;
# * on CPU there is no allocator counter, so we run the call once under
#   ``torch.profiler`` with ``profile_memory=True``. The profiler records
#   every tensor allocation and free as a signed byte count; the running sum
#   of those events, in time order, is the memory in use, and its maximum is
#   the peak. (Summing each operator's "self" memory would give the net
#   change, not the peak.) Memory that a library allocates outside PyTorch's
#   allocator is not seen.

from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile
from torch.utils.benchmark import Timer


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_memory_mb(fn):
    """Peak memory ``fn`` allocates beyond what was live before it, in MB (1e6 bytes)."""
    if DEVICE == "cuda":
        _sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        _sync()
        return (torch.cuda.max_memory_allocated() - before) / 1e6
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        )
    except (AttributeError, RuntimeError):  # profiler internals changed: say so
        return None
    in_use = np.cumsum([n for _, n in events]) if events else np.zeros(1)
    return max(float(in_use.max()), 0.0) / 1e6


@dataclass
class Timing:
    first_call_s: float  # includes compilation
    median_ms: float
    iqr_ms: float
    peak_mb: float | None  # None: not measured

    def __str__(self):
        mem = "not measured" if self.peak_mb is None else f"{self.peak_mb:8.1f} MB"
        return f"{self.median_ms:8.2f} ms (IQR {self.iqr_ms:5.2f})  peak {mem}"


def compare(*fns, run_time=RUN_TIME, rounds=4):
    """Time functions in interleaved rounds, so that they share the machine's load."""
    first_calls = []
    for fn in fns:
        start = time.perf_counter()
        fn()  # compiles, warms up
        _sync()
        first_calls.append(time.perf_counter() - start)
    times = [[] for _ in fns]  # seconds per call, one entry per timed block
    for _ in range(rounds):
        for fn, ts in zip(fns, times):
            ts += Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=run_time / rounds).times
    results = []
    for fn, first, ts in zip(fns, first_calls, times):
        q1, median, q3 = np.percentile(ts, [25, 50, 75]) * 1e3
        results.append(Timing(first, median, q3 - q1, peak_memory_mb(fn)))
    return results


# %%
# Attention on a ragged batch
# ---------------------------
# Everything in a transformer layer except attention treats tokens
# independently, so it runs on packed tokens unchanged. Attention is the one
# place where sequences must not see each other. Below are three ways to
# compute it; each takes queries, keys and values as NJTs of shape
# ``(B, S*, E)``, splits ``E`` into heads and returns an NJT shaped like the
# queries.
#
# 1. **SDPA on the NJT.** Splitting heads makes ``(B, H, S*, D)`` NJTs and
#    SDPA handles the raggedness itself. On CUDA this reaches the fused
#    variable-length (flash or memory-efficient) kernels. On CPU only the
#    reference "math" path accepts NJTs, and it refuses ``is_causal=True``.
# 2. **FlexAttention over the packed tokens.** Lay all tokens out as one long
#    sequence ``(1, H, T, D)`` and forbid attention across sequences with a
#    document mask built from the offsets (optionally also causal). The
#    ``BlockMask`` skips the blocks that are entirely masked, so most of the
#    ``T x T`` score matrix is never computed. On CPU it has no backward.
# 3. **A loop of dense SDPA calls**, one per sequence, over slices of the
#    packed tokens. Plain, and it has a backward everywhere; its cost is one
#    kernel launch per sequence.


def split_heads(t, n_heads):
    return t.unflatten(-1, (n_heads, -1)).transpose(-3, -2)  # (..., S, E) -> (..., H, S, D)


def merge_heads(t):
    return t.transpose(-3, -2).flatten(-2)  # (..., H, S, D) -> (..., S, E)


def attention_nested_sdpa(q, k, v, n_heads, is_causal):
    # Note: the fused NJT kernels (flash, memory-efficient) refuse a batch that
    # holds a zero-length sequence, and the math path refuses ``is_causal``.
    q, k, v = (split_heads(t, n_heads) for t in (q, k, v))  # (B, H, S*, D)
    return merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=is_causal))


def _wrap_like(values, q):
    # packed (T_q, E) result -> NJT with the queries' offsets
    lengths = q.offsets().diff()
    return torch.nested.nested_tensor_from_jagged(
        values, q.offsets(), max_seqlen=int(lengths.max()) if len(lengths) else 0
    )


@torch.compiler.disable  # a Python loop over sequences is not worth tracing
def attention_loop(q, k, v, n_heads, is_causal):
    q_len, kv_len = q.offsets().diff().tolist(), k.offsets().diff().tolist()
    # packed (T, E) -> (1, H, T, D), then one (1, H, L_i, D) slice per sequence;
    # keep four dimensions, which the fused CPU kernel of SDPA needs
    qs, ks, vs = (
        split_heads(t.values(), n_heads).unsqueeze(0).split(lens, dim=2)
        for t, lens in ((q, q_len), (k, kv_len), (v, kv_len))
    )
    out = [F.scaled_dot_product_attention(a, b, c, is_causal=is_causal) for a, b, c in zip(qs, ks, vs)]
    return _wrap_like(merge_heads(torch.cat(out, dim=2)[0]), q)  # (B, S_q*, E)


def document_ids(offsets):
    # token -> index of its sequence, e.g. offsets [0, 2, 5] -> [0, 0, 1, 1, 1]
    return torch.repeat_interleave(torch.arange(len(offsets) - 1, device=offsets.device), offsets.diff())


_mask_cache = {}


def document_block_mask(q_offsets, kv_offsets, is_causal):
    # One mask per batch, shared by every layer that sees this batch. Causal
    # compares packed positions, so it is meant for self-attention only.
    key = (tuple(q_offsets.tolist()), tuple(kv_offsets.tolist()), is_causal)
    if key not in _mask_cache:
        q_doc, kv_doc = document_ids(q_offsets), document_ids(kv_offsets)

        def mask_mod(b, h, q_idx, kv_idx):
            same_doc = q_doc[q_idx] == kv_doc[kv_idx]
            return same_doc & (q_idx >= kv_idx) if is_causal else same_doc

        _mask_cache.clear()  # keep only the current batch's mask
        _mask_cache[key] = create_block_mask(
            mask_mod, 1, 1, len(q_doc), len(kv_doc), device=q_offsets.device
        )
    return _mask_cache[key]


compiled_flex_attention = torch.compile(flex_attention)


@torch.compiler.disable
def attention_flex(q, k, v, n_heads, is_causal):
    block_mask = document_block_mask(q.offsets(), k.offsets(), is_causal)
    # packed (T, E) -> (1, H, T, D): the whole batch as one long sequence
    q_, k_, v_ = (split_heads(t.values(), n_heads).unsqueeze(0) for t in (q, k, v))
    out = compiled_flex_attention(q_, k_, v_, block_mask=block_mask)
    return _wrap_like(merge_heads(out[0]), q)


# %%
# Measure, then choose
# ~~~~~~~~~~~~~~~~~~~~
# Which of the three is fastest depends on the device, the batch and the
# number of cores, so we measure them on a causal self-attention batch of the
# page's size and print the table before choosing. Each candidate is checked
# against dense SDPA on the padded batch, with a mask that combines the causal
# rule and the padding, on the valid positions. A candidate that fails is
# shown with its error.

torch.manual_seed(SEED)
rng = np.random.default_rng(SEED)
x, lengths = gen_batch(rng, BATCH, EMBED)
print(f"batch: {len(lengths)} sequences, {int(lengths.sum())} tokens, longest {int(lengths.max())}")

CANDIDATES = {
    "SDPA on NJT": attention_nested_sdpa,
    "FlexAttention, document-causal mask": attention_flex,
    "loop of dense SDPA": attention_loop,
}
HAS_BACKWARD = {
    "SDPA on NJT": True,
    "FlexAttention, document-causal mask": DEVICE == "cuda",  # no CPU backward
    "loop of dense SDPA": True,
}
available = {}  # name -> attention function that ran and matched


class _Collect(logging.Handler):
    # keeps the reasons SDPA logs when it finds no kernel, to print them briefly
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


sdpa_log, reasons = logging.getLogger("torch.nested._internal.sdpa"), _Collect()
sdpa_log.addHandler(reasons)
sdpa_log.propagate = False
with torch.no_grad():
    q, k, v = (x.clone() for _ in range(3))
    # Independent reference: dense SDPA on the padded batch, where a query may
    # see a key if the key is not after it and is not padding. Compared on the
    # valid positions only.
    x_pad_c, valid_c = x.to_padded_tensor(0.0), valid_mask(lengths)  # (B, S, E), (B, S)
    S_c = x_pad_c.shape[1]
    causal_c = torch.ones(S_c, S_c, dtype=torch.bool, device=DEVICE).tril()  # True: may attend
    allowed = (causal_c[None] & valid_c[:, None, :])[:, None]  # (B, 1, S, S)
    qkv_c = split_heads(x_pad_c, HEADS)  # (B, H, S, D)
    reference = merge_heads(F.scaled_dot_product_attention(qkv_c, qkv_c, qkv_c, attn_mask=allowed))[valid_c]
    del x_pad_c, allowed, qkv_c  # (T, E) is all we keep
    for name, fn in CANDIDATES.items():
        start = time.perf_counter()
        try:
            out = fn(q, k, v, HEADS, True)
        except Exception as err:  # e.g. no causal jagged SDPA on CPU
            why = [line.strip() for line in reasons.lines if not line.endswith("because:")]
            print(f"{name:36s} not available: {str(err).splitlines()[0]}")
            print(" " * 37 + " ".join(why[:2]))
            continue
        torch.testing.assert_close(out.values(), reference, atol=1e-5, rtol=1e-4)
        print(f"{name:36s} matches padded dense SDPA; first call {time.perf_counter() - start:5.2f} s")
        available[name] = fn
    sdpa_log.removeHandler(reasons)
    sdpa_log.propagate = True
    timings = compare(*(lambda fn=fn: fn(q, k, v, HEADS, True) for fn in available.values()))
candidate_ms = {name: t.median_ms for name, t in zip(available, timings)}
for name, t in zip(available, timings):
    print(f"{name:36s} {t}")

FORWARD_ATTENTION = min(candidate_ms, key=candidate_ms.get)
TRAINING_ATTENTION = min((n for n in candidate_ms if HAS_BACKWARD[n]), key=candidate_ms.get)
print(f"\nchosen on {DEVICE}: forward -> {FORWARD_ATTENTION}; with gradients -> {TRAINING_ATTENTION}")

# %%
# The dispatch used by every layer below is then two lines: the measured
# winner for inference, and the fastest candidate that has a backward when
# gradients are needed.


def ragged_attention(q, k, v, n_heads, is_causal=False):
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    name = TRAINING_ATTENTION if needs_grad else FORWARD_ATTENTION
    return CANDIDATES[name](q, k, v, n_heads, is_causal)


# %%
# Multi-head attention for ragged batches
# ---------------------------------------
# The layer is short: project, attend, project. For self-attention the three
# input projections are one ``Linear`` with three times the output width
# (one matrix multiply instead of three); for cross-attention queries and
# keys come from different tensors, so the projections are separate.


class MultiHeadAttention(nn.Module):
    def __init__(self, embed, n_heads, kv_embed=None, cross=False, bias=True, device=None, dtype=None):
        super().__init__()
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.n_heads, self.cross = n_heads, cross
        if cross:
            self.q_proj = nn.Linear(embed, embed, **kw)
            self.k_proj = nn.Linear(kv_embed or embed, embed, **kw)
            self.v_proj = nn.Linear(kv_embed or embed, embed, **kw)
        else:
            self.qkv_proj = nn.Linear(embed, 3 * embed, **kw)
        self.out_proj = nn.Linear(embed, embed, **kw)

    def forward(self, x, context=None, is_causal=False):
        # x: (B, S_q*, E), and for cross-attention context: (B, S_c*, E_c)
        if self.cross:
            q, k, v = self.q_proj(x), self.k_proj(context), self.v_proj(context)
        else:
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)  # 3 x (B, S*, E)
        y = ragged_attention(q, k, v, self.n_heads, is_causal)  # (B, S_q*, E)
        return self.out_proj(y)


@torch.no_grad()
def copy_from_nn(layer, ref):
    """Give ``layer`` the weights of an ``nn.MultiheadAttention``."""
    if layer.cross:
        projections = (layer.q_proj, layer.k_proj, layer.v_proj)
        for proj, w, b in zip(projections, ref.in_proj_weight.chunk(3), ref.in_proj_bias.chunk(3)):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
    else:
        layer.qkv_proj.weight.copy_(ref.in_proj_weight)
        layer.qkv_proj.bias.copy_(ref.in_proj_bias)
    layer.out_proj.load_state_dict(ref.out_proj.state_dict())
    return layer


# %%
# Causal self-attention against ``nn.MultiheadAttention``
# -------------------------------------------------------
# The reference is ``nn.MultiheadAttention`` on the padded batch with a
# ``key_padding_mask`` and a causal ``attn_mask``, compiled like ours. Both
# layers get the same weights. Padded outputs are compared on the valid
# positions only: what a layer writes at padding is garbage by definition.
# The printed fraction is the measured speedup over the padding bound. It can
# exceed 1, because the bound counts only the causal half of the scores while
# the padded layer, with its merged mask, computes the whole square.

torch.manual_seed(SEED)
ref_mha = nn.MultiheadAttention(EMBED, HEADS, batch_first=True, device=DEVICE)
mha = copy_from_nn(MultiHeadAttention(EMBED, HEADS, device=DEVICE), ref_mha)
compiled_ref, compiled_mha = torch.compile(ref_mha), torch.compile(mha)

S = int(lengths.max())
x_padded = x.to_padded_tensor(0.0)  # (B, S, E)
valid = valid_mask(lengths)  # (B, S)
pad_mask = ~valid  # True where a key is padding
causal_mask = torch.ones(S, S, dtype=torch.bool, device=DEVICE).triu(1)  # True above the diagonal


def padded_forward():
    return compiled_ref(
        x_padded, x_padded, x_padded, key_padding_mask=pad_mask, attn_mask=causal_mask, need_weights=False
    )[0]


def ragged_forward():
    return compiled_mha(x, is_causal=True)


with torch.no_grad():
    t_pad, t_rag = compare(padded_forward, ragged_forward)  # first calls compile
    torch.testing.assert_close(ragged_forward().values(), padded_forward()[valid], atol=1e-5, rtol=1e-4)

bound = padding_bound(lengths, lengths, EMBED, causal=True)
speedup = t_pad.median_ms / t_rag.median_ms
tokens = int(lengths.sum())
print("outputs match on every valid position")
print(f"padded nn.MultiheadAttention {t_pad}   compile+first call {t_pad.first_call_s:5.1f} s")
print(f"ragged MultiHeadAttention    {t_rag}   compile+first call {t_rag.first_call_s:5.1f} s")
print(f"throughput: padded {tokens / t_pad.median_ms * 1e3:,.0f} tokens/s, "
      f"ragged {tokens / t_rag.median_ms * 1e3:,.0f} tokens/s (real tokens)")
print(f"forward speedup {speedup:.2f}x, padding bound {bound:.2f}x, fraction of bound {speedup / bound:.2f}")
if t_pad.peak_mb is not None and t_rag.peak_mb is not None:
    print(f"peak memory saved: {t_pad.peak_mb - t_rag.peak_mb:.1f} MB")

# %%
# Backward
# ~~~~~~~~
# For training we compare the gradient of every parameter. The loss weights
# each valid output by a random number, so the gradients are not trivially
# symmetric; in the padded batch those weights are zero on padding, which
# makes padded positions contribute nothing.
#
# The first forward with gradients compiles a new graph, and the first
# backward may compile the backward graph, so we time those first calls
# separately from the steady state. Steady-state backward time is measured
# on one retained graph (``backward(retain_graph=True)``).

ragged_params = dict(mha.named_parameters())
ref_params = dict(ref_mha.named_parameters())
PARAM_PAIRS = {  # ours -> ``nn.MultiheadAttention``
    "qkv_proj.weight": "in_proj_weight",
    "qkv_proj.bias": "in_proj_bias",
    "out_proj.weight": "out_proj.weight",
    "out_proj.bias": "out_proj.bias",
}
weights = torch.randn_like(x.values())  # (T, E) loss weights on real tokens
weights_padded = torch.zeros_like(x_padded)
weights_padded[valid] = weights


def first_calls(forward, loss_fn):
    start = time.perf_counter()
    out = forward()
    _sync()
    t_fwd = time.perf_counter() - start
    loss = loss_fn(out)
    start = time.perf_counter()
    loss.backward(retain_graph=True)
    _sync()
    return loss, t_fwd, time.perf_counter() - start


def ragged_loss(out):
    return (out.values() * weights).sum()


def padded_loss(out):
    return (out * weights_padded).sum()


loss_pad, pad_first_fwd, pad_first_bwd = first_calls(padded_forward, padded_loss)
loss_rag, rag_first_fwd, rag_first_bwd = first_calls(ragged_forward, ragged_loss)
for ours, theirs in PARAM_PAIRS.items():
    torch.testing.assert_close(ragged_params[ours].grad, ref_params[theirs].grad, atol=1e-4, rtol=1e-4)
print(f"gradients match for all {len(PARAM_PAIRS)} parameters")

t_pad_bwd, t_rag_bwd = compare(
    lambda: loss_pad.backward(retain_graph=True), lambda: loss_rag.backward(retain_graph=True)
)
print(f"first forward with grad: padded {pad_first_fwd:5.2f} s, ragged {rag_first_fwd:5.2f} s")
print(f"first backward:          padded {pad_first_bwd:5.2f} s, ragged {rag_first_bwd:5.2f} s")
print(f"backward, padded {t_pad_bwd}")
print(f"backward, ragged {t_rag_bwd}")
print(f"backward speedup {t_pad_bwd.median_ms / t_rag_bwd.median_ms:.2f}x (padding bound {bound:.2f}x)")

# %%
# Where did the original's 144x backward come from?
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The original tutorial reported a 144x faster backward on an A100, far
# beyond any padding bound. Two suspects:
#
# * **Compilation inside the timing.** Its benchmark timed a single
#   backward call right after a forward-only warm-up. A compiled module
#   compiles its backward graph when the first backward runs, so such a
#   timing can include compilation. The "first backward" line above
#   measures exactly that situation.
# * **The materialized mask.** Given both a ``key_padding_mask`` and an
#   ``attn_mask``, ``nn.MultiheadAttention`` merges them into one
#   ``(B * H, S, S)`` mask, which rules out the fastest fused kernels.
#   With right padding a causal mask alone already hides every padded key
#   from every valid query, so the padding mask is redundant here, and the
#   ``is_causal`` hint lets SDPA use a fused causal kernel.
#
# The cell below measures the second suspect: the same padded layer with
# only ``is_causal``.


def padded_forward_is_causal():
    return compiled_ref(
        x_padded, x_padded, x_padded, attn_mask=causal_mask, is_causal=True, need_weights=False
    )[0]


with torch.no_grad():
    torch.testing.assert_close(
        padded_forward_is_causal()[valid], padded_forward()[valid], atol=1e-5, rtol=1e-4
    )
    t_pm, t_pc = compare(padded_forward, padded_forward_is_causal)
loss_pc, pc_first_fwd, pc_first_bwd = first_calls(padded_forward_is_causal, padded_loss)
t_pm_bwd, t_pc_bwd = compare(
    lambda: loss_pad.backward(retain_graph=True), lambda: loss_pc.backward(retain_graph=True)
)
for label, fwd, bwd in (("merged (B*H, S, S) mask", t_pm, t_pm_bwd), ("is_causal only", t_pc, t_pc_bwd)):
    print(f"padded, {label:24s} forward {fwd.median_ms:7.2f} ms, backward {bwd.median_ms:7.2f} ms")
print(f"is_causal only / merged mask:    forward {t_pc.median_ms / t_pm.median_ms:.2f}, "
      f"backward {t_pc_bwd.median_ms / t_pm_bwd.median_ms:.2f}")
print(f"first backward, which compiles the backward graph: merged mask {pad_first_bwd:.2f} s, "
      f"is_causal {pc_first_bwd:.2f} s, ragged {rag_first_bwd:.2f} s")
print(f"padded first backward / ragged steady backward: {pad_first_bwd * 1e3 / t_rag_bwd.median_ms:.0f}x "
      f"(steady state against steady state: {t_pad_bwd.median_ms / t_rag_bwd.median_ms:.2f}x)")

# %%
# The prints above carry the answer for this build. The first backward is
# where the backward graph gets compiled, or loaded from the compile cache
# that ``torch.compile`` keeps on disk. With a cold cache, as on a fresh
# machine, that takes seconds; with a warm one, as on a second run, we
# expect it to cost far less, but this page does not measure that case.
# Dividing the padded side's cold first
# backward by the ragged side's steady state, which is what one timed call
# after a forward-only warm-up amounts to, gives a ratio in the original's
# range of 100x and more. Timed after warm-up, the backward speedup is of the
# order of the padding bound. It can exceed the bound a little because the
# padded layer with a mask computes the whole ``S x S`` score square while
# the bound counts only the causal half.
#
# The two padded rows answer the mask question for this device. On this CPU
# they differ by much less than either of them differs from the ragged layer,
# and by nowhere near 144x: the materialized mask is not what makes the
# padded layer slow here, the padding is. On a GPU, where the mask decides
# between a fused kernel and the general one, run the comparison before
# drawing the same conclusion.

# %%
# A GPT-style layer
# -----------------
# A decoder layer in the GPT style normalizes the input of each sub-layer
# and adds the result back to its input. With the attention above it is four
# lines, and on NJTs the residuals, the ``LayerNorm`` and the feed-forward
# network simply work on the packed tokens. Its reference is
# ``nn.TransformerEncoderLayer(norm_first=True)`` on the padded batch with a
# causal mask. This is a parity check only, run without compilation to keep
# the page short; the layer's speed follows from the attention and the
# linear layers measured above.


class GPTLayer(nn.Module):
    def __init__(self, embed, n_heads, ffn_dim, device=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(embed, device=device)
        self.attn = MultiHeadAttention(embed, n_heads, device=device)
        self.norm2 = nn.LayerNorm(embed, device=device)
        self.ff_in = nn.Linear(embed, ffn_dim, device=device)
        self.ff_out = nn.Linear(ffn_dim, embed, device=device)

    def forward(self, x):  # (B, S*, E) -> (B, S*, E)
        x = x + self.attn(self.norm1(x), is_causal=True)
        return x + self.ff_out(F.relu(self.ff_in(self.norm2(x))))


@torch.no_grad()
def copy_layer_from_nn(layer, ref):
    copy_from_nn(layer.attn, ref.self_attn)
    for ours, theirs in ((layer.norm1, ref.norm1), (layer.norm2, ref.norm2),
                         (layer.ff_in, ref.linear1), (layer.ff_out, ref.linear2)):
        ours.load_state_dict(theirs.state_dict())
    return layer


torch.manual_seed(SEED)
ref_layer = nn.TransformerEncoderLayer(
    EMBED, HEADS, dim_feedforward=4 * EMBED, dropout=0.0, batch_first=True, norm_first=True, device=DEVICE
)
gpt_layer = copy_layer_from_nn(GPTLayer(EMBED, HEADS, 4 * EMBED, device=DEVICE), ref_layer)

with torch.no_grad():
    out_ref_layer = ref_layer(x_padded, src_mask=causal_mask, src_key_padding_mask=pad_mask, is_causal=True)
    torch.testing.assert_close(gpt_layer(x).values(), out_ref_layer[valid], atol=1e-5, rtol=1e-4)
print("GPTLayer matches nn.TransformerEncoderLayer(norm_first=True) on every valid position")

# %%
# Cross-attention
# ---------------
# In cross-attention the queries come from one sequence and the keys and
# values from another, as in an encoder-decoder model; here the two batches
# have different lengths per item. The padded reference needs two padded
# tensors and a padding mask for the keys; the ragged layer just takes two
# NJTs.

x_q, q_lengths = gen_batch(rng, BATCH, EMBED)
x_kv, kv_lengths = gen_batch(rng, BATCH, EMBED)
print(f"queries: {int(q_lengths.sum())} tokens, longest {int(q_lengths.max())}; "
      f"keys/values: {int(kv_lengths.sum())} tokens, longest {int(kv_lengths.max())}")

torch.manual_seed(SEED)
ref_cross = nn.MultiheadAttention(EMBED, HEADS, batch_first=True, device=DEVICE)
cross = copy_from_nn(MultiHeadAttention(EMBED, HEADS, cross=True, device=DEVICE), ref_cross)
compiled_ref_cross, compiled_cross = torch.compile(ref_cross), torch.compile(cross)
q_padded, kv_padded = x_q.to_padded_tensor(0.0), x_kv.to_padded_tensor(0.0)
q_valid, kv_pad_mask = valid_mask(q_lengths), ~valid_mask(kv_lengths)


def padded_cross():
    return compiled_ref_cross(
        q_padded, kv_padded, kv_padded, key_padding_mask=kv_pad_mask, need_weights=False
    )[0]


def ragged_cross():
    return compiled_cross(x_q, x_kv)


with torch.no_grad():
    torch.testing.assert_close(ragged_cross().values(), padded_cross()[q_valid], atol=1e-5, rtol=1e-4)
    t_cross_pad, t_cross_rag = compare(padded_cross, ragged_cross)
cross_bound = padding_bound(q_lengths, kv_lengths, EMBED, causal=False)
cross_speedup = t_cross_pad.median_ms / t_cross_rag.median_ms
print("cross-attention outputs match on every valid query")
print(f"padded nn.MultiheadAttention {t_cross_pad}")
print(f"ragged MultiHeadAttention    {t_cross_rag}")
print(f"speedup {cross_speedup:.2f}x, padding bound {cross_bound:.2f}x, "
      f"fraction {cross_speedup / cross_bound:.2f}")

# %%
# Fully masked rows
# -----------------
# A batch can contain an empty sequence: a prompt with no context, a
# document whose every token was filtered. In a padded batch that is a row
# with every key masked, and a softmax over no keys has no value. We build a
# batch of lengths 5, 0 and 3 and run the ``torch.nn`` layers on it in
# evaluation mode.
#
# For the ragged layer, this cell and the next one force the loop of dense
# SDPA, whatever the dispatch chose above: the fused NJT kernels that SDPA on
# an NJT reaches on CUDA refuse a zero-length sequence, and its math path
# refuses ``is_causal=True``, so that candidate would find no kernel at all.

lengths_e = torch.tensor([5, 0, 3])
x_e = torch.nested.nested_tensor_from_jagged(
    torch.randn(int(lengths_e.sum()), EMBED, device=DEVICE),
    F.pad(lengths_e.cumsum(0), (1, 0)).to(DEVICE),
    max_seqlen=5,
)
x_e_padded, pad_e = x_e.to_padded_tensor(0.0), ~valid_mask(lengths_e)

import copy
from contextlib import contextmanager


@contextmanager
def forward_attention(name):
    """Use the candidate ``name`` for forward calls inside the block, then restore the choice."""
    global FORWARD_ATTENTION
    chosen, FORWARD_ATTENTION = FORWARD_ATTENTION, name
    try:
        yield
    finally:
        FORWARD_ATTENTION = chosen


layer_eval, mha_eval = copy.deepcopy(ref_layer).eval(), copy.deepcopy(ref_mha).eval()
with torch.no_grad():
    out_layer = layer_eval(x_e_padded, src_key_padding_mask=pad_e)
    out_mha = mha_eval(x_e_padded, x_e_padded, x_e_padded, key_padding_mask=pad_e, need_weights=False)[0]
    with forward_attention("loop of dense SDPA"):
        out_ragged = gpt_layer(x_e)
    # parity of the non-empty sequences: the reference layer in training mode
    # (no fast path; dropout is 0), causal, with the padding mask
    assert ref_layer.training
    S_e = int(lengths_e.max())
    causal_e = torch.ones(S_e, S_e, dtype=torch.bool, device=DEVICE).triu(1)
    out_layer_train = ref_layer(x_e_padded, src_mask=causal_e, src_key_padding_mask=pad_e, is_causal=True)
    valid_e = valid_mask(lengths_e)
    torch.testing.assert_close(out_ragged.values(), out_layer_train[valid_e], atol=1e-5, rtol=1e-4)
# training mode, with gradients: ``nn.MultiheadAttention`` goes through SDPA
out_mha_train = ref_mha(x_e_padded, x_e_padded, x_e_padded, key_padding_mask=pad_e, need_weights=False)[0]


def nan_rows(out):
    return out.isnan().all(-1).sum(-1).tolist()  # NaN rows per sequence


print("NaN rows per sequence (lengths 5, 0, 3)")
print("  nn.TransformerEncoderLayer, eval:      ", nan_rows(out_layer))
print("  nn.MultiheadAttention, eval:           ", nan_rows(out_mha))
print("  nn.MultiheadAttention, training mode:  ", nan_rows(out_mha_train),
      "; empty sequence's rows equal the output bias:",
      torch.allclose(out_mha_train[1], ref_mha.out_proj.bias.expand_as(out_mha_train[1])))
print("  ragged GPTLayer: rows per sequence", [t.shape[0] for t in out_ragged.unbind()],
      "; all finite:", bool(out_ragged.values().isfinite().all()))
assert out_ragged.values().isfinite().all()
print(f"ragged GPTLayer matches nn.TransformerEncoderLayer (training mode, causal) on all "
      f"{int(valid_e.sum())} valid positions of the sequences of lengths 5 and 3")

# %%
# In evaluation mode without gradients both ``torch.nn`` layers take their
# fused inference path ("fast path"), and in this build that path returns
# NaN on every row of the empty sequence: one such sequence is enough to poison a
# loss or a metric computed over the padded output. In training mode
# ``nn.MultiheadAttention`` goes through SDPA instead, which in this build,
# on CPU, returns zero attention for a query with no keys, so those rows are
# just the output projection's bias (the check printed above; other devices
# and kernels were not checked). Which answer you get thus depends on the
# mode. In the ragged batch the empty sequence has no rows at all, so there
# is nothing to go wrong, and the other two sequences match the reference
# layer.
#
# The case that remains is a query whose key set is empty, which happens in
# cross-attention. The ragged layer inherits the rule of SDPA and returns zero
# attention, so the output is again the bias:

kv_lengths_e = torch.tensor([4, 0, 2])  # the second query sequence has no keys
x_kv_e = torch.nested.nested_tensor_from_jagged(
    torch.randn(int(kv_lengths_e.sum()), EMBED, device=DEVICE),
    F.pad(kv_lengths_e.cumsum(0), (1, 0)).to(DEVICE),
    max_seqlen=4,
)
x_q_e, _ = gen_batch(np.random.default_rng(SEED), 3, EMBED)
with torch.no_grad(), forward_attention("loop of dense SDPA"):  # see above
    out_empty = cross(x_q_e, x_kv_e).unbind()[1]  # (L_q, E)
torch.testing.assert_close(out_empty, cross.out_proj.bias.expand_as(out_empty))
print(f"query sequence with no keys: {out_empty.shape[0]} rows, each equal to the output bias")

# %%
# Changing attention scores with FlexAttention
# --------------------------------------------
# FlexAttention no longer takes NJTs, but it does not need to: the packed
# tokens with a document mask are a ragged batch. A ``score_mod`` receives the
# positions ``q_idx`` and ``kv_idx`` in the packed sequence; within one
# document their difference is the distance inside the sentence, so
# relative-position schemes work unchanged. (A mod that needs absolute
# positions would subtract the document's start offset.)
#
# ALiBi (`Press et al., 2021 <https://arxiv.org/abs/2108.12409>`_) subtracts
# a per-head slope times the query-key distance from each score. We check it
# against dense SDPA per sequence with the same bias as an additive mask.

torch.manual_seed(SEED)
# packed (T, E) -> (1, H, T, D), the layout ``attention_flex`` uses
q_f, k_f, v_f = (
    split_heads(torch.randn(tokens, EMBED, device=DEVICE), HEADS).unsqueeze(0) for _ in range(3)
)
slopes = torch.exp2(-8.0 * torch.arange(1, HEADS + 1, device=DEVICE) / HEADS)  # (H,)


def alibi(score, b, h, q_idx, kv_idx):
    return score - slopes[h] * (q_idx - kv_idx)


doc_causal = document_block_mask(x.offsets(), x.offsets(), is_causal=True)
with torch.no_grad():
    out_alibi = compiled_flex_attention(q_f, k_f, v_f, score_mod=alibi, block_mask=doc_causal)
    out_plain = compiled_flex_attention(q_f, k_f, v_f, block_mask=doc_causal)

    reference_alibi, reference_plain = [], []
    for start, end in zip(x.offsets()[:-1].tolist(), x.offsets()[1:].tolist()):
        qs, ks, vs = (t[:, :, start:end] for t in (q_f, k_f, v_f))  # (1, H, L, D)
        pos = torch.arange(end - start, device=DEVICE)
        distance = pos[:, None] - pos[None, :]  # (L, L)
        bias = (-slopes[:, None, None] * distance).masked_fill(distance < 0, -math.inf)  # (H, L, L)
        reference_alibi.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias))
        reference_plain.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
torch.testing.assert_close(out_alibi, torch.cat(reference_alibi, dim=2), atol=1e-5, rtol=1e-4)
torch.testing.assert_close(out_plain, torch.cat(reference_plain, dim=2), atol=1e-5, rtol=1e-4)
print("ALiBi and the document-causal mask match dense SDPA on every sequence")
print(f"the block mask skips {doc_causal.sparsity():.1f}% of the {tokens} x {tokens} score blocks")

# %%
# Packed projections
# ------------------
# When several matrix multiplies read the same input, one multiply with the
# weights stacked reads the input once and launches one kernel. We measure
# two cases, each against its unpacked twin with identical weights:
#
# * the query, key and value projections of self-attention;
# * the SwiGLU feed-forward network (as in Llama), whose two input
#   projections ``w1`` and ``w3`` become one ``w13``.
#
# Packing helps where each multiply is too small to keep the device busy and
# launch overhead or repeated reads of the input show, which is the GPU
# case (the original measured 1.05x and 1.08x on an A100, in ``bfloat16``). On a
# CPU a single large multiply is not faster than three medium ones, so
# expect about 1x there, or less; the sizes differ per device, and on CUDA
# we use ``bfloat16``. Both variants run in eager mode, so that packing is the
# only difference between them. Packing can also cost memory: in eager mode
# the stacked output of ``w13`` stays alive until both of its halves have
# been used, as the peak column shows.


class InputProjection(nn.Module):
    def __init__(self, dim, **kw):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False, **kw) for _ in range(3))

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class PackedInputProjection(nn.Module):
    def __init__(self, dim, **kw):
        super().__init__()
        self.qkv_proj = nn.Linear(dim, 3 * dim, bias=False, **kw)

    def forward(self, x):
        return self.qkv_proj(x).chunk(3, dim=-1)


def swiglu_hidden(dim, multiple_of=256):
    # Llama's rule: 2/3 of 4 * dim, rounded up to a multiple of 256
    return multiple_of * math.ceil(int(8 * dim / 3) / multiple_of)


class SwiGLU(nn.Module):
    def __init__(self, dim, **kw):
        super().__init__()
        hidden = swiglu_hidden(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False, **kw)
        self.w3 = nn.Linear(dim, hidden, bias=False, **kw)
        self.w2 = nn.Linear(hidden, dim, bias=False, **kw)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PackedSwiGLU(nn.Module):
    def __init__(self, dim, **kw):
        super().__init__()
        hidden = swiglu_hidden(dim)
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False, **kw)
        self.w2 = nn.Linear(hidden, dim, bias=False, **kw)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


def compare_packed(plain, packed, x, label):
    with torch.no_grad():
        out_plain, out_packed = plain(x), packed(x)
        tol = dict(atol=1e-2, rtol=1e-2) if x.dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out_packed, out_plain, **tol)
        t_plain, t_packed = compare(lambda: plain(x), lambda: packed(x))
    print(f"{label}, {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}")
    print(f"  three/two matmuls {t_plain}")
    print(f"  packed            {t_packed}")
    print(f"  speedup {t_plain.median_ms / t_packed.median_ms:.2f}x")
    return t_plain.median_ms / t_packed.median_ms


kw = {"device": DEVICE, "dtype": LOW_PRECISION}
torch.manual_seed(SEED)
proj, packed_proj = InputProjection(PROJ_DIM, **kw), PackedInputProjection(PROJ_DIM, **kw)
with torch.no_grad():
    packed_proj.qkv_proj.weight.copy_(
        torch.cat([proj.q_proj.weight, proj.k_proj.weight, proj.v_proj.weight])
    )
tokens_proj = gen_batch(rng, PROJ_TOKENS_BATCH, PROJ_DIM, dtype=LOW_PRECISION)[0].values()  # (T, D)
qkv_speedup = compare_packed(proj, packed_proj, tokens_proj, "QKV projection")

ffn, packed_ffn = SwiGLU(FFN_DIM, **kw), PackedSwiGLU(FFN_DIM, **kw)
with torch.no_grad():
    packed_ffn.w13.weight.copy_(torch.cat([ffn.w1.weight, ffn.w3.weight]))
    packed_ffn.w2.weight.copy_(ffn.w2.weight)
tokens_ffn = gen_batch(rng, FFN_BATCH, FFN_DIM, dtype=LOW_PRECISION)[0].values()  # (T, D)
ffn_speedup = compare_packed(ffn, packed_ffn, tokens_ffn, "SwiGLU feed-forward")

# %%
# Speedup against the bound, across batches
# -----------------------------------------
# One batch proves little about the next. The Zipf exponent sets the
# distribution of sentence lengths: a smaller exponent gives longer
# sentences on average (the expected length ``1 / p`` is printed for each).
# For several exponents we draw one batch each, time
# the causal self-attention layers from above, and plot the measured forward
# speedup against the padding bound of that batch. The bound depends on the
# longest sentence drawn, a single draw per batch and a noisy one, so with
# one batch per exponent the printed bounds need not follow the exponent
# and show no trend to rely on. What the figure does show is how close each
# batch comes to its own bound. A point on the diagonal means that the
# ragged layer wins back everything padding costs. A point above it is
# possible: the bound counts only the causal half of the scores, while the
# padded layer with its merged mask computes the whole square. Compare the
# printed fraction with the token count of each batch: every batch has the
# same number of sequences, so in a batch with fewer tokens any fixed cost
# per sequence (one SDPA call per sequence when the loop is the chosen path,
# for example) weighs
# more. That is a likely cause of a low fraction, not something this page
# measures.

import matplotlib.pyplot as plt

points = []
for alpha in FIGURE_ALPHAS:
    x_a, lengths_a = gen_batch(rng, BATCH, EMBED, alpha=alpha)
    xp_a, S_a = x_a.to_padded_tensor(0.0), int(lengths_a.max())
    pad_a = ~valid_mask(lengths_a)
    causal_a = torch.ones(S_a, S_a, dtype=torch.bool, device=DEVICE).triu(1)
    with torch.no_grad():
        t_p, t_r = compare(
            lambda: compiled_ref(
                xp_a, xp_a, xp_a, key_padding_mask=pad_a, attn_mask=causal_a, need_weights=False
            ),
            lambda: compiled_mha(x_a, is_causal=True),
        )
    b_a = padding_bound(lengths_a, lengths_a, EMBED, causal=True)
    points.append((alpha, b_a, t_p.median_ms / t_r.median_ms))
    print(f"alpha {alpha:4.2f} (expected length {1 / stop_probability(alpha):4.1f}): "
          f"{int(lengths_a.sum()):5d} tokens, longest {S_a:4d}, "
          f"bound {b_a:5.2f}x, speedup {points[-1][2]:5.2f}x, fraction {points[-1][2] / b_a:.2f}")

fig, ax = plt.subplots(figsize=(5.5, 4.2))
bounds, speedups = [p[1] for p in points], [p[2] for p in points]
top = 1.1 * max(bounds + speedups)
ax.plot([1, top], [1, top], "--", color="gray", label="speedup = padding bound")
ax.axhline(1.0, color="lightgray", linewidth=1)
ax.scatter(bounds, speedups, zorder=3, label=f"measured, {DEVICE}")
for alpha, b_a, s_a in points:
    ax.annotate(f"Zipf {alpha}", (b_a, s_a), textcoords="offset points", xytext=(6, -10))
ax.set_xlabel("padding bound (FLOPs padded / ragged)")
ax.set_ylabel("measured forward speedup (x)")
ax.set_title(f"Ragged vs padded causal self-attention\nbatch {BATCH}, E={EMBED}, {HEADS} heads")
ax.legend(loc="upper left")
fig.tight_layout()
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# Conclusion
# ----------
# The lesson of the original tutorial holds: a layer that never pads does
# only the work the batch needs, and the padding bound says how much that
# can be worth. What changed is how it is built. Linear layers, norms and
# residuals run on packed tokens; attention needs only the offsets, and the
# fastest way to use them depends on the device, so measure the candidates,
# as this page did, before you choose. NJT is a convenient container for
# values and offsets, but the code above reaches through it everywhere
# except the CUDA SDPA path, so moving to plain ``(values, offsets)`` pairs
# and ``varlen_attn`` is a small step.
#
# Reference figures from the original tutorial
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# These are **not** from this build. The original, on an A100 with batch
# 512 and embedding 512, reported:
#
# ========================================  ==========================
# measurement                               original (A100)
# ========================================  ==========================
# causal self-attention forward speedup     5.65x
# peak memory saved, forward                3.39 GB
# backward speedup                          144x (see above)
# cross-attention forward speedup           4.01x
# packed input projection speedup           1.05x
# packed SwiGLU speedup                     1.08x
# ========================================  ==========================
#
# Its numpy generator was not seeded, so its batch, and with it the bound,
# is unknown. The cell below computes the bound for the original's setting
# (batch 512, embedding 512, causal, Zipf exponent 1.2) from this page's
# length generator for three seeds; only lengths are drawn, no tensors. The
# printed range shows how much the bound alone moves from seed to seed.
# Then come this build's own figures beside the original's; the sizes
# differ (see the top of the page), so compare each speedup with its bound,
# not with the A100 column.

original_bounds = []
for seed in (0, 1, 2):
    lengths_o = zipf_sentence_lengths(np.random.default_rng(seed), 512, alpha=1.2)
    original_bounds.append(padding_bound(lengths_o, lengths_o, 512, causal=True))
print("padding bound for the original's setting, seeds 0, 1, 2: "
      + ", ".join(f"{b:.2f}x" for b in original_bounds)
      + f" (min {min(original_bounds):.2f}x, max {max(original_bounds):.2f}x)\n")

saved = "not measured" if t_pad.peak_mb is None or t_rag.peak_mb is None else (
    f"{t_pad.peak_mb - t_rag.peak_mb:.1f} MB"
)
summary = [
    ("causal self-attention forward", f"{speedup:.2f}x (bound {bound:.2f}x, {speedup / bound:.2f})", "5.65x"),
    ("peak memory saved, forward", saved, "3.39 GB"),
    ("backward, after warm-up", f"{t_pad_bwd.median_ms / t_rag_bwd.median_ms:.2f}x", "144x, one timed call"),
    ("cross-attention forward", f"{cross_speedup:.2f}x (bound {cross_bound:.2f}x)", "4.01x"),
    ("packed input projection", f"{qkv_speedup:.2f}x", "1.05x"),
    ("packed SwiGLU", f"{ffn_speedup:.2f}x", "1.08x"),
]
print(f"{'measurement':32s} {'this build (' + DEVICE + ')':30s} original (A100, quoted)")
for row in summary:
    print(f"{row[0]:32s} {row[1]:30s} {row[2]}")

# %%
# Further reading
# ---------------
#
# * `torch.nested documentation <https://docs.pytorch.org/docs/stable/nested.html>`_
# * `Scaled dot product attention tutorial
#   <https://docs.pytorch.org/tutorials/intermediate/scaled_dot_product_attention_tutorial.html>`_
# * `FlexAttention blog post <https://pytorch.org/blog/flexattention/>`_ and
#   `attention-gym <https://github.com/meta-pytorch/attention-gym>`_ for
#   document masks and score modifications
# * `torch.compile tutorial <https://docs.pytorch.org/tutorials/intermediate/torch_compile_tutorial.html>`_
# * `gpt-fast <https://github.com/meta-pytorch/gpt-fast>`_ and
#   `nanoGPT <https://github.com/karpathy/nanoGPT>`_ for compact, fast
#   transformer code
