"""
Transformer building blocks for ragged batches
==============================================

A batch of sequences of different lengths, stored without padding as packed
values plus offsets; one attention function over it with six measured
backends; and a multi-head attention layer built on both, checked against
``torch.nn`` and timed against the best padded layer on the device at hand.

**Author:** rewritten for PyTorch 2.11 and later from the original tutorial by
`Mikayla Gawarecki <https://github.com/mikaylagawarecki>`_

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How packed values plus offsets describe a ragged batch, and how they
         map to ``cu_seqlens`` and to Hugging Face's ``position_ids``
       * ``ragged_attention``: one call, six backends, each checked against a
         float32 reference and chosen by measurement
       * How to time a ragged layer honestly, beside the
         :term:`work bound` that padding sets

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.11 or later; a CPU is enough (a CUDA GPU runs the page at
         the original's scale, in ``bfloat16``)
       * The terms of the :ref:`glossary <glossary>`; the functions used here
         are listed on :doc:`the toolkit's reference page </toolkit>`
"""

# sphinx_gallery_tags = ["toolkit", "SDPA", "FlexAttention", "varlen attention"]

# %%
# The idea in one picture
# -----------------------
# A padded batch stores ``B`` sequences as a ``(B, S)`` rectangle, ``S`` the
# longest length, with a mask saying which slots are real. A packed batch
# stores the same tokens end to end, **values** ``(T, ...)`` with ``T`` the
# number of real tokens, plus **offsets** ``(B + 1,)``, where each sequence
# starts and the last one ends. The picture draws both for one small batch.

import matplotlib.pyplot as plt
from ragged_toolkit.figures import FIGURE_STYLE, draw_batch

plt.rcParams.update(FIGURE_STYLE)
draw_batch([5, 2, 7, 3])
plt.show()

# %%
# Everything in a transformer but attention works on one token at a time
# (linear layers, norms, activations, residuals), so it runs on the values as
# one long sequence, with no padding and no mask; attention alone needs the
# offsets, to keep sequences apart. The two tensors go by other names:
#
# * FlashAttention and ``torch.nn.attention.varlen.varlen_attn`` call the
#   offsets ``cu_seqlens`` (cumulative sequence lengths, as ``int32``);
# * a jagged nested tensor (``torch.nested`` with ``layout=torch.jagged``) is
#   values plus offsets, with ``values()`` and ``offsets()`` to reach them;
# * Hugging Face's ``DataCollatorWithFlattening`` writes one row of
#   ``input_ids`` whose ``position_ids`` restart at 0 at every sequence: the
#   offsets are where ``position_ids == 0``, plus ``T``.
#
# PyTorch's documentation says nested tensors are not under active
# development, and FlexAttention no longer accepts them
# (`PyTorch issue 161734 <https://github.com/pytorch/pytorch/issues/161734>`_);
# the maintainers point ragged attention at packed sequences. So the
# interface here is the plain pair of tensors, and a nested tensor appears
# only as one attention backend among six.
#
# Every function this page uses comes from one module, ``ragged_toolkit``
# (``draw_batch`` drew the picture), and is shown where it is explained.
# Sizes are set here, once, for the device at hand.

import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from ragged_toolkit.attention import BACKENDS, backend_support, default_backend, ragged_attention
from ragged_toolkit.attention.compare import compare_backends
from ragged_toolkit.attention.reference import reference_attention
from ragged_toolkit.batches import (
    STOP_RANKS, from_padded, offsets_from_lengths, offsets_from_position_ids, ragged_batch,
    sentence_lengths, to_padded, token_index, zipf_stop_probability,
)
from ragged_toolkit.bound import speedup_line, work_bound
from ragged_toolkit.device import (
    default_device, default_dtype, quick_mode, quiet_known_notes, synchronize, tolerances,
)
from ragged_toolkit.layers import MultiHeadAttention
from ragged_toolkit.measure import TIMING_THREADS, choose, compile_counter, measure
from ragged_toolkit.profiles import where_time_goes

DEVICE = default_device()
DTYPE = default_dtype(DEVICE)
# One CPU thread for the whole page, as every timing and profile uses
# (TIMING_THREADS): torch.compile guards on the thread count, so compiled
# code is then compiled once, for the threads it is timed with.
torch.set_num_threads(TIMING_THREADS)
QUICK = quick_mode()  # the test suite's small sizes, TUTORIALS_QUICK=1
SEED = 6
if DEVICE == "cuda":  # the original tutorial's scale; RUN_TIME: seconds per comparison
    BATCH, EMBED, HEADS, RUN_TIME = 512, 512, 8, 1.0
else:  # real workloads: batch 512, E 512 and up
    BATCH, EMBED, HEADS, RUN_TIME = 64, 256, 8, 0.3
if QUICK:
    BATCH, EMBED, RUN_TIME = BATCH // 4, EMBED // 2, 0.1
ZIPF_ALPHA = 1.2  # the original's exponent
print(f"PyTorch {torch.__version__}, device: {DEVICE}, dtype: {DTYPE}")
print(f"batch {BATCH}, embedding {EMBED}, heads {HEADS}")

# sphinx_gallery_start_ignore
quiet_known_notes()
# sphinx_gallery_end_ignore

# %%
# Sentence lengths
# ----------------
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
#
# .. literalinclude:: ../ragged_toolkit/batches.py
#    :pyobject: sentence_lengths
#
# The cell checks the shortcut against drawing words one by one with a
# two-sample Kolmogorov-Smirnov test: the largest gap between the two
# empirical distribution functions must stay below the gap that two samples
# of one distribution exceed with probability 0.1%.

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
p_stop = zipf_stop_probability(ZIPF_ALPHA)
print(f"stop probability per word {p_stop:.4f}, expected length 1/p = {1 / p_stop:.1f}")
print(f"mean length: word by word {word_by_word.mean():.2f}, geometric {geometric.mean():.2f}")
print(f"largest CDF gap {cdf_gap:.4f} (must stay below {critical:.4f})")
assert cdf_gap < critical, "the geometric lengths do not match the word-by-word ones"

# %%
# Offsets, positions and padding
# ------------------------------
# Offsets come from lengths with one cumulative sum (``offsets_from_lengths``).
# ``token_index`` gives every packed token its sequence and its position in
# it: all a layer needs to build positions (rotary embeddings restart at
# every sequence) or to pad the batch where a padded tensor is needed.
#
# .. literalinclude:: ../ragged_toolkit/batches.py
#    :pyobject: token_index
#
# .. literalinclude:: ../ragged_toolkit/batches.py
#    :pyobject: to_padded
#
# On a batch of three, the positions ``token_index`` computes are the
# ``position_ids`` that Hugging Face's collator writes, and they give the
# offsets back:

offsets = offsets_from_lengths([3, 1, 4])
seq, position_ids = token_index(offsets)
print("offsets (cu_seqlens):  ", offsets.tolist())
print("sequence of each token:", seq.tolist())
print("position_ids:          ", position_ids.tolist())
assert torch.equal(offsets_from_position_ids(position_ids[None]), offsets)

values, offsets = ragged_batch(rng, 5, 4)
padded, valid = to_padded(values, offsets)
assert torch.equal(from_padded(padded, offsets), values)
assert int(valid.sum()) == len(values)
print(f"lengths {offsets.diff().tolist()}: values {tuple(values.shape)}, "
      f"padded {tuple(padded.shape)}, {1 - len(values) / valid.numel():.0%} padding")

# %%
# One attention function
# ----------------------
# ``ragged_attention`` takes packed queries ``(T_q, H, D)`` and keys and
# values ``(T_kv, H_kv, D)``, and lets sequence ``i`` of the queries attend
# only to sequence ``i`` of the keys. ``H_kv`` may be smaller than ``H``
# (grouped-query attention). With ``is_causal`` a query sees the keys up to
# its own position; where a sequence has more keys than queries (decoding
# against a cache) the queries are the *last* ones, as in FlashAttention.
# ``kv_used`` says how many of a sequence's key rows are filled, for a cache
# with spare room (``seqused_k`` in ``varlen_attn``).
#
# .. literalinclude:: ../ragged_toolkit/attention/__init__.py
#    :pyobject: ragged_attention
#
# Six backends compute it; ``backend_support`` says which can run a job here:
#
# * ``varlen``: ``varlen_attn``, the variable-length kernel of FlashAttention.
#   CUDA only, ``float16`` or ``bfloat16``. Its keyword arguments changed
#   between releases, so the toolkit reads its signature.
# * ``sdpa_njt``: ``scaled_dot_product_attention`` on nested tensors built
#   from the same values and offsets. On CUDA it reaches fused
#   variable-length kernels; on CPU only the math path takes nested tensors.
# * ``flex``: FlexAttention over the whole packed batch as one long sequence,
#   with a *document mask* built from the offsets; its ``BlockMask`` skips the
#   blocks where sequences would see each other. No backward on CPU.
# * ``loop``: one dense SDPA call per sequence, on views of the packed
#   tensors. Runs everywhere, with gradients, at one call per sequence.
# * ``bucketed``: sequences sorted by length and cut into a few groups, each
#   padded to its own longest sequence: a few calls, a little padding.
# * ``padded``: every sequence padded to the longest one, one call.
#
# Sequences with no queries or no keys (an empty prompt, a filtered document)
# are dropped before a backend runs, and a query without keys gets zeros, so
# no NaN appears. The reference every backend is checked against,
# ``reference_attention``, runs sequence by sequence in float32 on SDPA's math
# backend, with key/value heads repeated and the causal mask built
# explicitly: it shares no kernel with the backends. Here it checks every
# backend on a batch with an empty sequence (lengths 5, 0, 3, 7), causal,
# with four query heads sharing two key/value heads, in this page's dtype:

lengths_e = torch.tensor([5, 0, 3, 7])
offsets_e = offsets_from_lengths(lengths_e, DEVICE)
gen = torch.Generator(DEVICE).manual_seed(SEED)
T_e = int(lengths_e.sum())
q_e = torch.randn(T_e, 4, 16, generator=gen, device=DEVICE, dtype=DTYPE)
k_e, v_e = (torch.randn(T_e, 2, 16, generator=gen, device=DEVICE, dtype=DTYPE)
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
    gap = (out_e.float() - reference_e).abs().max().item()
    print(f"{name:9s} matches the reference, max |difference| {gap:.1e}")

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
# ---------
# ``measure`` times functions side by side with ``torch.utils.benchmark``:
# each first call alone (it may compile), then the functions take turns for
# a few rounds, so that a busy machine slows all alike; it reports the median
# and interquartile range (IQR) in ms, then profiles each call once more for
# its peak memory in MiB and the :term:`kernel that ran <kernel label>`.
#
# .. literalinclude:: ../ragged_toolkit/measure.py
#    :pyobject: measure
#
# ``compare_backends`` runs one attention job on every backend that can take
# it here, checks the output (and, for training, the gradients) against the
# reference, and measures them all together; a backend that disagrees stops
# the page. Each speedup is printed beside its :term:`work bound`: the work
# the padded side must do over the work of the ragged side, counted for what
# each computes (FLOPs per token for the projections, per query-key pair for
# the scores; a causal kernel scores ``L (L + 1) / 2`` pairs per sequence, a
# merged mask the whole ``S x S`` square).
#
# .. literalinclude:: ../ragged_toolkit/bound.py
#    :pyobject: work_bound

# %%
# Attention alone: measure, then choose
# -------------------------------------
# Now the choice, on this page's batch: causal self-attention with ``HEADS``
# heads, first the forward pass alone (inference), then forward and backward
# (training). Which backend wins depends on the device, the dtype, the
# lengths and the number of cores, so the page measures, and every layer
# below uses those two choices. A backend is chosen for being faster only
# outside the noise: ``choose`` takes the lowest median only if its
# interquartile range (IQR) does not overlap that of the second fastest (the backends
# take turns in interleaved rounds); otherwise it prints "within noise" and
# takes the default, ``default_backend`` (the per-sequence loop on a CPU,
# ``varlen`` where it runs), the same default on every page.
#
# .. literalinclude:: ../ragged_toolkit/measure.py
#    :pyobject: choose

torch.manual_seed(SEED)
rng = np.random.default_rng(SEED)
x, offsets = ragged_batch(rng, BATCH, EMBED, device=DEVICE, dtype=DTYPE)
lengths = offsets.diff().cpu()
print(f"batch: {len(lengths)} sequences, {len(x)} tokens, longest {int(lengths.max())}; "
      f"padded, {len(lengths) * int(lengths.max())} token slots")
# Queries from the batch; keys and values drawn apart, so that no query is
# favored by being its own key. Each (T, H, D).
gen = torch.Generator(DEVICE).manual_seed(SEED + 1)
q_a = x.unflatten(-1, (HEADS, -1))
k_a, v_a = (torch.randn(x.shape, generator=gen, device=DEVICE).to(DTYPE)
            .unflatten(-1, (HEADS, -1)) for _ in range(2))

print("forward:")
with compile_counter() as flex_compiled:  # what the flex backend compiles
    forward_results = compare_backends(q_a, k_a, v_a, offsets, is_causal=True,
                                       min_run_time=RUN_TIME)
print(f"torch.compile, the flex backend: {flex_compiled}")
print("forward and backward:")
training_results = compare_backends(q_a, k_a, v_a, offsets, is_causal=True, backward=True,
                                    min_run_time=RUN_TIME)
DEFAULT = default_backend(DEVICE, DTYPE)
FORWARD_BACKEND = choose(forward_results, DEFAULT, "forward backend")
TRAINING_BACKEND = choose(training_results, DEFAULT, "training backend")
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
#
# .. literalinclude:: ../ragged_toolkit/layers.py
#    :pyobject: MultiHeadAttention
#
# ``copy_from_nn`` gives it the weights of an ``nn.MultiheadAttention``, for
# the parity check below.


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
    padded_out = from_padded(mha(x_padded, is_causal=True), offsets)
    torch.testing.assert_close(padded_out.float(), ref_out[valid], **tolerances(DTYPE))
print("ragged layer and padded path both match nn.MultiheadAttention on every real token")

# %%
# Then speed. Three forward passes on the same batch:
#
# * **padded**, the baseline: the same module on the padded batch with
#   ``is_causal`` (right padding, no mask), what a reader writing a padded
#   layer today would write;
# * **ragged**: the module on packed values and offsets, with the backend
#   chosen above;
# * :term:`the original tutorial's baseline`: ``nn.MultiheadAttention``
#   with a ``key_padding_mask`` and a causal ``attn_mask``, which it merges
#   into one ``(B * H, S, S)`` mask. A merged mask computes the whole score
#   square, and its bound says so.
#
# Each side's forward-and-backward pass is timed too, with the chosen
# training backend. The bound counts ``8 E^2`` FLOPs per token for the four
# projections and ``4 E`` per query-key pair.

ref_mha_lp = ref_mha.to(DTYPE)
grad_out = torch.randn_like(x)
grad_padded = to_padded(grad_out, offsets)[0]


mha.backend = FORWARD_BACKEND
with torch.no_grad():
    forward = measure({
        "padded": lambda: mha(x_padded, is_causal=True),
        "ragged": lambda: mha(x, offsets, is_causal=True),
        "original baseline": lambda: ref_mha_lp(
            x_padded, x_padded, x_padded, key_padding_mask=~valid, attn_mask=causal_mask,
            need_weights=False)}, min_run_time=RUN_TIME)
mha.backend = TRAINING_BACKEND
padded_training = lambda: mha(x_padded, is_causal=True).backward(grad_padded)  # noqa
ragged_training = lambda: mha(x, offsets, is_causal=True).backward(grad_out)  # noqa
training = measure({"padded": padded_training, "ragged": ragged_training},
                   min_run_time=RUN_TIME)
per_token, per_pair = 8 * EMBED**2, 4 * EMBED
bound = work_bound(lengths, per_token=per_token, per_pair=per_pair, causal=True)
original_bound = work_bound(lengths, per_token=per_token, per_pair=per_pair, causal=True,
                            padded_causal=False)
for name, t in forward.items():
    print(f"forward, {name:16s} {t}")
for name, t in training.items():
    print(f"fwd+bwd, {name:16s} {t}")
print(speedup_line("forward against padded", forward["padded"], forward["ragged"], bound))
print(speedup_line("forward against the original's baseline",
                   forward["original baseline"], forward["ragged"], original_bound))
print(speedup_line("forward and backward against padded", training["padded"],
                   training["ragged"], bound))
tokens = len(x)
per_s = {name: tokens / forward[name].median_ms * 1e3 for name in ("padded", "ragged")}
print(f"forward, real tokens/s: padded {per_s['padded']:,.0f}, "
      f"ragged {per_s['ragged']:,.0f}")

# %%
# A :term:`fraction of the bound <fraction of the bound>` near 1 means the
# ragged layer wins back what padding costs in work. It can exceed 1: the
# bound counts FLOPs only, and a padded batch also costs memory traffic and
# allocations (the original's baseline reads its merged ``(B * H, S, S)``
# mask from memory), so the padded side can be slower per FLOP than the
# ragged one. Below 1, part of the win is lost to overheads, which the
# profile shows.

# %%
# Where the time goes
# ~~~~~~~~~~~~~~~~~~~
# When the fraction falls short, the profile says why: the operators that
# took most of each side's time in one forward-and-backward pass. Matrix
# multiplies (``addmm``, ``mm``) scale with the tokens on both sides; the
# ragged side adds one attention call per sequence (loop backend) or gathers
# (bucketed), and the bookkeeping around them.

print("padded, forward and backward:")
print(where_time_goes(padded_training, timing=training["padded"]))
print("ragged, forward and backward:")
print(where_time_goes(ragged_training, timing=training["ragged"]))

# %%
# Packed projections
# ------------------
# The original tutorial also packed projections: q, k and v from one matmul
# against a ``(3E, E)`` weight instead of three against ``(E, E)``, and
# SwiGLU's gate and up from one ``(2F, E)`` matmul instead of two. Both sides
# do the same FLOPs, so the :term:`work bound` is 1 and the fraction of the
# bound is the speedup itself: whatever one larger matmul gains over several
# smaller ones on this device. The two versions share their weights, and
# both are checked against the same product computed in float64.

HIDDEN = 64 * round(8 * EMBED / 3 / 64)  # SwiGLU's hidden width, as in Llama
torch.manual_seed(SEED)
qkv_one = nn.Linear(EMBED, 3 * EMBED, bias=False, device=DEVICE, dtype=DTYPE)
gate_up_one = nn.Linear(EMBED, 2 * HIDDEN, bias=False, device=DEVICE, dtype=DTYPE)


# the separate matmuls use the same weights, as views of the packed one
qkv_three = [lambda x, w=w: F.linear(x, w) for w in qkv_one.weight.chunk(3)]
gate_up_two = [lambda x, w=w: F.linear(x, w) for w in gate_up_one.weight.chunk(2)]
x_in = x.detach().requires_grad_()


def swiglu_one(x):
    gate, up = gate_up_one(x).chunk(2, -1)
    return [F.silu(gate) * up]


jobs = {  # name -> (separate matmuls, one packed matmul), each a function of x
    "packed QKV": (lambda x: [p(x) for p in qkv_three], lambda x: qkv_one(x).chunk(3, -1)),
    "packed SwiGLU": (lambda x: [F.silu(gate_up_two[0](x)) * gate_up_two[1](x)], swiglu_one),
}
with torch.no_grad():
    x64 = x.double()
    q64, k64, v64 = (x64 @ qkv_one.weight.double().T).chunk(3, -1)
    g64, u64 = (x64 @ gate_up_one.weight.double().T).chunk(2, -1)
    expected = {"packed QKV": [q64, k64, v64], "packed SwiGLU": [F.silu(g64) * u64]}
    for name, (separate, packed) in jobs.items():
        for fn in (separate, packed):
            for out, ref in zip(fn(x), expected[name]):
                torch.testing.assert_close(out.double(), ref, **tolerances(DTYPE))
print("one matmul and several give the float64 result, for q, k, v and for SwiGLU")

for name, (separate, packed) in jobs.items():
    grads = [torch.randn_like(out) for out in separate(x)]
    with torch.no_grad():
        t = measure({"separate": lambda: separate(x), "one": lambda: packed(x)},
                    min_run_time=RUN_TIME, profile=False)
    print(speedup_line(f"{name}, forward", t["separate"], t["one"], 1.0))
    t = measure({"separate": lambda: torch.autograd.backward(separate(x_in), grads),
                 "one": lambda: torch.autograd.backward(packed(x_in), grads)},
                min_run_time=RUN_TIME, profile=False)
    print(speedup_line(f"{name}, forward and backward", t["separate"], t["one"], 1.0))

# %%
# Where did the original's 144x backward come from?
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The original tutorial reported a 144x faster backward on an A100, far
# beyond any padding bound. Its benchmark timed one backward call of a
# compiled module right after a forward-only warm-up, and a compiled module
# compiles its backward graph when the first backward runs, so that one call
# included compilation. The cell repeats that single timing, deliberately one
# shot, on the original's baseline, against the ragged layer's steady step.

compiled_original = torch.compile(ref_mha_lp)
with compile_counter() as compiled:
    with torch.no_grad():  # the forward-only warm-up the original did
        compiled_original(x_padded, x_padded, x_padded, key_padding_mask=~valid,
                          attn_mask=causal_mask, need_weights=False)
    start = time.perf_counter()
    out = compiled_original(x_padded, x_padded, x_padded, key_padding_mask=~valid,
                            attn_mask=causal_mask, need_weights=False)[0]
    out.backward(torch.randn_like(out))  # compiles (or loads) the backward graph
    synchronize()
    first_s = time.perf_counter() - start
    compiled.saw(tuple(x_padded.shape))
print(f"torch.compile of the original's baseline: {compiled}")
ratio = first_s * 1e3 / training["ragged"].median_ms
print(f"original's baseline, first forward and backward: {first_s:.2f} s, {ratio:.0f}x "
      f"the "
      f"ragged layer's steady step ({training['ragged'].median_ms:.2f} ms)")

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
cross = MultiHeadAttention(EMBED, HEADS, cross=True, device=DEVICE)
cross = copy_from_nn(cross, ref_cross).to(DTYPE)
q_padded, q_valid = to_padded(x_q, offsets_q)
kv_padded, kv_valid = to_padded(x_kv, offsets_kv)
with torch.no_grad():
    ref_cross_out = ref_cross(q_padded.float(), kv_padded.float(), kv_padded.float(),
                              key_padding_mask=~kv_valid, need_weights=False)[0]
    cross.backend = choose(compare_backends(
        *(t.unflatten(-1, (HEADS, -1)) for t in (x_q, x_kv, x_kv)), offsets_q, offsets_kv,
        min_run_time=RUN_TIME / 2), DEFAULT, "cross-attention backend")
    cross_out = cross(x_q, offsets_q, context=x_kv, context_offsets=offsets_kv)
    torch.testing.assert_close(cross_out.float(), ref_cross_out[q_valid],
                               **tolerances(DTYPE))
print("cross-attention matches nn.MultiheadAttention on every real query "
      f"(backend chosen: {cross.backend})")


with torch.no_grad():
    cross_times = measure({
        "padded": lambda: cross(q_padded, context=kv_padded, key_valid=kv_valid),
        "ragged": lambda: cross(x_q, offsets_q, context=x_kv,
                                context_offsets=offsets_kv)},
        min_run_time=RUN_TIME)
lq, lkv = offsets_q.diff().cpu(), offsets_kv.diff().cpu()
cross_bound = work_bound(lq, lkv, per_token=4 * EMBED**2, per_kv_token=4 * EMBED**2,
                         per_pair=4 * EMBED)
for name, t in cross_times.items():
    print(f"cross-attention, {name:7s} {t}")
print(speedup_line("cross-attention forward", cross_times["padded"],
                   cross_times["ragged"], cross_bound))

# %%
# Empty sequences and fully masked rows
# -------------------------------------
# An empty sequence (a prompt with no context, a document whose every token
# was filtered) is, padded, a row with every key masked, and a softmax over
# no keys has no value. The ``torch.nn`` layer in evaluation mode and the
# ragged layer, on every backend that runs here, on lengths 5, 0 and 3:

offsets_empty = offsets_from_lengths([5, 0, 3], DEVICE)
gen = torch.Generator(DEVICE).manual_seed(SEED)
x_empty = torch.randn(8, EMBED, generator=gen, device=DEVICE).to(DTYPE)
x_empty_padded, valid_empty = to_padded(x_empty, offsets_empty)
with torch.no_grad():
    x32_empty = x_empty_padded.float()
    out_nn = ref_mha.float().eval()(x32_empty, x32_empty, x32_empty,
                                    key_padding_mask=~valid_empty, need_weights=False)[0]
    nan_rows = out_nn.isnan().all(-1).sum(-1).tolist()
    print(f"nn.MultiheadAttention, eval: NaN rows per sequence {nan_rows}")
    for name in BACKENDS:
        if backend_support(name, DEVICE, DTYPE, is_causal=True) is None:
            mha.backend = name
            out = mha(x_empty, offsets_empty, is_causal=True)
            assert out.shape == (8, EMBED) and out.isfinite().all(), name
    print("ragged layer: 8 rows (5 + 0 + 3), all finite, on every backend that runs here")

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

mha.backend = FORWARD_BACKEND
points = []
for alpha in (1.1, 1.35, 1.6) if QUICK else (1.1, 1.2, 1.35, 1.6):
    x_b, offsets_b = ragged_batch(rng, BATCH, EMBED, alpha=alpha, device=DEVICE,
                                  dtype=DTYPE)
    x_b_padded = to_padded(x_b, offsets_b)[0]
    with torch.no_grad():
        t = measure({"padded": lambda: mha(x_b_padded, is_causal=True),
                     "ragged": lambda: mha(x_b, offsets_b, is_causal=True)},
                    min_run_time=RUN_TIME / 2, profile=False)
    b = work_bound(offsets_b.diff().cpu(), per_token=per_token, per_pair=per_pair,
                   causal=True)
    points.append((alpha, b, t["padded"].median_ms / t["ragged"].median_ms))
    label = (f"Zipf {alpha:4.2f} (mean length {1 / zipf_stop_probability(alpha):4.1f}), "
             f"longest {int(offsets_b.diff().max()):3d}")
    print(speedup_line(label, t["padded"], t["ragged"], b))

fig, ax = plt.subplots(figsize=(8, 5.5))
top = 1.1 * max(max(p[1], p[2]) for p in points)
ax.plot([1, top], [1, top], "--", color="gray", label="speedup = work bound")
ax.scatter([p[1] for p in points], [p[2] for p in points], zorder=3,
           label=f"measured, {DEVICE}")
for alpha, b, s in points:
    ax.annotate(f"Zipf {alpha}", (b, s), textcoords="offset points", xytext=(6, -10))
ax.set_xlabel("work bound (padded work / ragged work)")
ax.set_ylabel("measured forward speedup (x)")
ax.set_title(f"Ragged vs padded causal self-attention\n"
             f"batch {BATCH}, E={EMBED}, {HEADS} heads, {DTYPE}")
ax.legend(loc="upper left")
fig.tight_layout()
plt.show()

# sphinx_gallery_thumbnail_number = 2

# %%
# Conclusion
# ----------
# A layer that never pads does only the work the batch needs, and the work
# bound says how much that can be worth. Linear layers, norms and residuals
# run on packed values; attention needs only the offsets, and
# ``ragged_attention`` takes them with the backend measured on the device at
# hand (the default where the measurement cannot tell), checked against a
# reference that shares no kernel with it. The other pages build on these functions; score modifications such as
# ALiBi with FlexAttention are on the :doc:`which-path page
# <which_attention_path>`.
#
# **Figures from the original tutorial, not from this build:** on an A100
# with batch 512 and embedding 512, causal self-attention forward 5.65x
# faster, 3.39 GB of peak memory saved, backward 144x (see above),
# cross-attention forward 4.01x. Its numpy generator was not seeded, so its
# batch and its bound are unknown; here is the bound of its setting for three
# seeds of this page's generator, its padded layer counted as it ran (a
# merged mask: the whole square).

original_bounds = [
    work_bound(sentence_lengths(np.random.default_rng(s), 512), per_token=8 * 512**2,
               per_pair=4 * 512, causal=True, padded_causal=False) for s in (0, 1, 2)]
print("work bound of the original's setting, seeds 0, 1, 2: "
      + ", ".join(f"{b:.2f}x" for b in original_bounds))

# %%
# Further reading
# ---------------
# * `torch.nested documentation <https://docs.pytorch.org/docs/stable/nested.html>`_
# * `varlen_attn <https://docs.pytorch.org/docs/stable/nn.attention.varlen.html>`_
# * The `scaled dot product attention tutorial
#   <https://docs.pytorch.org/tutorials/intermediate/scaled_dot_product_attention_tutorial.html>`_
# * The `FlexAttention blog post <https://pytorch.org/blog/flexattention/>`_ and
#   `attention-gym <https://github.com/meta-pytorch/attention-gym>`_
# * `Packing with FlashAttention 2 in Hugging Face transformers
#   <https://huggingface.co/blog/packing-with-FA2>`_
# * `gpt-fast <https://github.com/meta-pytorch/gpt-fast>`_ and
#   `nanoGPT <https://github.com/karpathy/nanoGPT>`_
