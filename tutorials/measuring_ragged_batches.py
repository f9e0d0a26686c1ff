"""
Measuring ragged batches: timings, the noise rule and the work bound
====================================================================

How every figure on this site is made: functions timed side by side, a
choice made only where the measurement can tell, each speedup printed
beside the work that padding adds, profiles that describe the call that was
timed, and compiles kept out of the timed window. Every other page uses
these in one call and links here.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How ``measure`` times functions in interleaved rounds, and how
         ``choose`` decides only outside the noise (an option timed against
         itself is the test)
       * The :term:`work bound` and the :term:`fraction of the bound`, and
         why a fraction far above 1 is a bug in the baseline until shown
         otherwise
       * How to read a profile beside its timing, and how to keep compiles
         out of a timed training loop
       * Where the original tutorial's 144x backward came from

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`transformer_building_blocks`: ``ragged_attention``, its
         backends and the ``MultiHeadAttention`` layer
       * PyTorch 2.11 or later; a CPU is enough
"""

# sphinx_gallery_tags = ["benchmarks", "profiling", "torch.compile"]

# %%
# Sizes
# -----
# One batch of sentences, one layer; set here per device, shrunk in
# :term:`quick mode`. Every timing of the site runs with one CPU thread per
# operator (``TIMING_THREADS``), so that a profile describes the call that was
# timed and a compiled function is compiled once, for those threads.

import numpy as np
import torch
from ragged_toolkit.device import default_device, default_dtype, quick_mode, quiet_known_notes
from ragged_toolkit.measuring.timing import TIMING_THREADS

DEVICE, QUICK, SEED = default_device(), quick_mode(), 0
DTYPE = default_dtype(DEVICE)
torch.set_num_threads(TIMING_THREADS)
if DEVICE == "cuda":  # the original tutorial's scale
    BATCH, EMBED, HEADS, RUN_TIME = 512, 512, 8, 0.5
else:
    BATCH, EMBED, HEADS, RUN_TIME = 48, 128, 4, 0.3
if QUICK:
    BATCH, EMBED, RUN_TIME = 16, 64, 0.1
print(f"PyTorch {torch.__version__}, device: {DEVICE}, dtype: {DTYPE}")
print(f"batch {BATCH}, embedding {EMBED}, heads {HEADS}")

# sphinx_gallery_start_ignore
quiet_known_notes()
# sphinx_gallery_end_ignore

# %%
# The lengths every page measures on
# ----------------------------------
# ``sentence_lengths`` draws a sentence's length as one geometric draw: a word
# drawn from Zipf(1.2) ends the sentence when it is ".", "!" or "?" (ranks 3,
# 386 and 858 in WikiText-2), independently of the words before it. The
# shortcut is checked against drawing the words one by one with a
# two-sample Kolmogorov-Smirnov test: the largest gap between the two
# empirical distribution functions must stay below the gap that two samples
# of one distribution exceed with probability 0.1%.

from ragged_toolkit.batches import STOP_RANKS, sentence_lengths, zipf_stop_probability

rng = np.random.default_rng(SEED)
n_sentences = 5_000 if QUICK else 20_000
words = rng.zipf(1.2, size=(n_sentences, 400))
is_stop = np.isin(words, STOP_RANKS)
word_by_word = is_stop.argmax(axis=1)[is_stop.any(axis=1)] + 1
geometric = sentence_lengths(rng, n_sentences, 1.2).numpy()
grid = np.arange(1, max(word_by_word.max(), geometric.max()) + 1)
cdf_gap = np.abs(np.searchsorted(np.sort(word_by_word), grid, side="right") / len(word_by_word)
                 - np.searchsorted(np.sort(geometric), grid, side="right") / len(geometric)).max()
n, m = len(word_by_word), len(geometric)
critical = 1.95 * np.sqrt((n + m) / (n * m))  # Kolmogorov-Smirnov, 0.1% level
print(f"expected length 1/p = {1 / zipf_stop_probability(1.2):.1f}; mean word by word "
      f"{word_by_word.mean():.2f}, geometric {geometric.mean():.2f}")
print(f"largest CDF gap {cdf_gap:.4f} (must stay below {critical:.4f})")
assert cdf_gap < critical, "the geometric lengths do not match the word-by-word ones"

# %%
# Timing side by side
# -------------------
# ``measure`` times each function's first call alone (it may compile), then
# lets the functions take turns for a few rounds, each round a
# ``torch.utils.benchmark`` ``blocked_autorange``, so that a busy machine
# slows all of them alike. It reports the median and interquartile range
# (IQR) in ms, then runs each once more under the profiler for its peak
# memory in MiB and the :term:`kernel label` of the attention that ran.
#
# .. literalinclude:: ../ragged_toolkit/measure.py
#    :pyobject: measure
#
# The causal self-attention layer of the building-blocks page on one batch,
# padded (one SDPA call, a causal kernel, no mask) and packed (the
# per-sequence loop backend), forward only; and, a third entry, the packed
# layer again under another name:

from ragged_toolkit.batches import ragged_batch, to_padded
from ragged_toolkit.layers import MultiHeadAttention
from ragged_toolkit.measuring.timing import measure
from ragged_toolkit.measuring.tables import print_timings

torch.manual_seed(SEED)
x, offsets = ragged_batch(rng, BATCH, EMBED, device=DEVICE, dtype=DTYPE)  # (T, E), (B + 1,)
x_padded = to_padded(x, offsets)[0]  # (B, S, E)
layer = MultiHeadAttention(EMBED, HEADS, backend="loop", device=DEVICE, dtype=DTYPE)
with torch.no_grad():
    times = measure({"padded": lambda: layer(x_padded, is_causal=True),
                     "packed": lambda: layer(x, offsets, is_causal=True),
                     "packed again": lambda: layer(x, offsets, is_causal=True)},
                    min_run_time=RUN_TIME)
print_timings(times)

# %%
# When a difference is a difference
# ---------------------------------
# A page chooses between options (a backend, compiling or not) only where
# the measurement can tell: ``choose`` takes the lowest median only if its
# interquartile range does not overlap that of the second fastest, and
# otherwise returns the documented default, the same for a job on every
# page. The same function timed twice is the test of the rule: it must come
# out within noise.
#
# .. literalinclude:: ../ragged_toolkit/measure.py
#    :pyobject: choose

from ragged_toolkit.measuring.noise import choose, outside_noise

choose({k: times[k] for k in ("packed", "packed again")}, "packed", "the same function twice")
choose({k: times[k] for k in ("padded", "packed")}, "padded", "padded or packed")
if outside_noise(times["packed"], times["packed again"]):
    print("the same function timed twice came out apart: this machine is too noisy to choose on")

# %%
# The work bound
# --------------
# A speedup alone does not say whether it is good. The :term:`work bound`
# is the work the padded side must do over the work of the packed side, each
# counted for what it computes: FLOPs per token for the projections, FLOPs
# per query-key pair for the scores, the causal half ``L (L + 1) / 2`` for a
# causal kernel, the whole ``S x S`` square for a merged mask. Every speedup
# on the site is printed beside it, with the :term:`fraction of the bound`.
#
# .. literalinclude:: ../ragged_toolkit/bound.py
#    :pyobject: work_bound
#
# .. literalinclude:: ../ragged_toolkit/bound.py
#    :pyobject: speedup_line

from ragged_toolkit.measuring.bound import speedup_line, work_bound

per_token, per_pair = 8 * EMBED**2, 4 * EMBED  # four projections; scores and their sum over values
lengths = offsets.diff().cpu()
bound = work_bound(lengths, per_token=per_token, per_pair=per_pair, causal=True)
print(speedup_line("forward", times["padded"], times["packed"], bound))

# %%
# A fraction near 1: the packed code turned the work it skips into speed.
# Below 1: overheads the bound does not count (one call per sequence, the
# bookkeeping of the batch). Above 1: the padded side was slower per unit of
# work than the packed one, for costs the bound does not see (memory
# traffic, allocations). A fraction far above 1 is a bug in the baseline
# until shown otherwise: a padded side that ran SDPA's unfused math kernel,
# a mask it did not need, or a compile inside its timed window (the story at
# the end of this page).
#
# One batch proves little about the next. Sentence lengths drawn with a
# smaller Zipf exponent are longer, which raises the bound; for four
# exponents, one batch each, the speedup against the bound of that batch:

alphas = (1.1, 1.35, 1.6) if QUICK else (1.1, 1.2, 1.35, 1.6)
points = []
for alpha in alphas:
    x_b, offsets_b = ragged_batch(rng, BATCH, EMBED, alpha=alpha, device=DEVICE, dtype=DTYPE)
    x_b_padded = to_padded(x_b, offsets_b)[0]
    with torch.no_grad():
        t = measure({"padded": lambda: layer(x_b_padded, is_causal=True),
                     "packed": lambda: layer(x_b, offsets_b, is_causal=True)},
                    min_run_time=RUN_TIME / 2, profile=False)
    b = work_bound(offsets_b.diff().cpu(), per_token=per_token, per_pair=per_pair, causal=True)
    points.append((alpha, b, t["padded"].median_ms / t["packed"].median_ms))
    print(speedup_line(f"Zipf {alpha:4.2f}, longest {int(offsets_b.diff().max()):3d}", t["padded"],
                       t["packed"], b))

import matplotlib.pyplot as plt
from ragged_toolkit.figures import FIGURE_STYLE

plt.rcParams.update(FIGURE_STYLE)
fig, ax = plt.subplots(figsize=(8, 5))
top = 1.1 * max(max(p[1], p[2]) for p in points)
ax.plot([1, top], [1, top], "--", color="gray", label="speedup = work bound")
ax.scatter([p[1] for p in points], [p[2] for p in points], zorder=3, label=f"measured, {DEVICE}")
for alpha, b, s in points:
    ax.annotate(f"Zipf {alpha}", (b, s), textcoords="offset points", xytext=(6, -12))
ax.set(xlabel="work bound (padded work / packed work)", ylabel="measured forward speedup (x)",
       title=f"Causal self-attention layer, batch {BATCH}, E={EMBED}, {str(DTYPE)[6:]}")
ax.legend(loc="upper left")
fig.tight_layout()
plt.show()

# %%
# Where the time goes
# -------------------
# When a fraction falls short, a profile says why. ``where_time_goes``
# profiles a function at its steady state, as it was timed: warm-up calls
# first, the same threads, enough calls for a fifth of a second, every
# figure per call and printed beside the timed median. The profiler adds
# time per operator it records; measured on a loop of trivial operators and
# multiplied by the operators the call records, that estimate accounts for
# most of the gap between the two.

from ragged_toolkit.measuring.profiles import where_time_goes

for side in ("padded", "packed"):
    fn = {"padded": lambda: layer(x_padded, is_causal=True),
          "packed": lambda: layer(x, offsets, is_causal=True)}[side]
    with torch.no_grad():
        print(f"{side}, forward:")
        print(where_time_goes(fn, top=4, timing=times[side]))

# %%
# Matrix multiplies (``addmm``) scale with the tokens on both sides; the
# packed side adds one attention call per sequence with the loop backend,
# which the padded side makes once.
#
# Compiles outside the timed window
# ---------------------------------
# ``torch.compile`` compiles when a function first meets a shape (and, for
# training, when the first backward runs). A compile inside a timed window
# is timed as work. ``compile_counter`` counts the graphs compiled and the
# graph breaks inside a block; ``StepTimer`` times each step of a training
# loop, synchronized, with the graphs compiled during it, so that a page can
# assert that none was compiled in the steps it reports.
#
# .. literalinclude:: ../ragged_toolkit/measure.py
#    :pyobject: StepTimer

from ragged_toolkit.measuring.timing import StepTimer
from ragged_toolkit.measuring.compiling import compile_counter

compiled_layer = torch.compile(layer, dynamic=False)
timer = StepTimer()
with compile_counter() as compiled:
    for step in range(4):
        with timer.step(len(x)), torch.no_grad():
            compiled_layer(x_padded, is_causal=True)
print(f"torch.compile: {compiled}")
print("step  ms     graphs compiled in the step")
for i, (s, g) in enumerate(zip(timer.seconds, timer.graphs)):
    print(f"{i:4d} {1e3 * s:8.2f}  {g}")
assert sum(timer.graphs[1:]) == 0, "a graph was compiled after the first step"

# %%
# The first step carried the compile; a page reports only the steps after
# it, and asserts that they compiled nothing.
#
# Where did the original's 144x backward come from?
# -------------------------------------------------
# The original tutorial reported a 144x faster backward on an A100, far
# beyond any padding bound. Its benchmark timed one backward call of a
# compiled module right after a forward-only warm-up; a compiled module
# compiles its backward graph when the first backward runs, so that one call
# included compilation. The cell repeats that single timing, deliberately
# one shot, on :term:`the original tutorial's baseline`, against the packed
# layer's steady forward and backward.

import time

import torch.nn as nn
from ragged_toolkit.device import synchronize

valid = to_padded(x, offsets)[1]
S = x_padded.shape[1]
causal = torch.ones(S, S, dtype=torch.bool, device=DEVICE).triu(1)  # True: masked
original = torch.compile(nn.MultiheadAttention(EMBED, HEADS, batch_first=True, device=DEVICE,
                                               dtype=DTYPE))
with compile_counter() as compiled:
    with torch.no_grad():  # the forward-only warm-up the original did
        original(x_padded, x_padded, x_padded, key_padding_mask=~valid, attn_mask=causal,
                 need_weights=False)
    start = time.perf_counter()
    out = original(x_padded, x_padded, x_padded, key_padding_mask=~valid, attn_mask=causal,
                   need_weights=False)[0]
    out.backward(torch.randn_like(out))  # compiles the backward graph
    synchronize()
    first_s = time.perf_counter() - start
grad_out, grad_padded = torch.randn_like(x), torch.randn_like(x_padded)


def original_step():
    out = original(x_padded, x_padded, x_padded, key_padding_mask=~valid, attn_mask=causal,
                   need_weights=False)[0]
    out.backward(grad_padded)


steady = measure({"original": original_step,
                  "packed": lambda: layer(x, offsets, is_causal=True).backward(grad_out)},
                 min_run_time=RUN_TIME, profile=False)
print(f"torch.compile of the original's baseline: {compiled}")
print(f"its first forward and backward: {first_s:.2f} s, {first_s * 1e3 / steady['packed'].median_ms:.0f}x "
      f"the packed layer's steady step ({steady['packed'].median_ms:.2f} ms)")
merged = work_bound(lengths, per_token=per_token, per_pair=per_pair, causal=True, padded_causal=False)
print(speedup_line("after its warm-up, forward and backward", steady["original"], steady["packed"], merged))

# %%
# A ratio like the first measures the compiler, not padding. Timed after
# its warm-up, the same baseline stands beside its own work bound, which
# counts the whole square its merged mask computes.
#
# Conclusion
# ----------
# A figure on this site is a median of interleaved rounds with its spread,
# a choice is made only outside that spread, a speedup stands beside the
# work padding adds, a profile describes the call that was timed, and no
# compile falls inside a timed window. The same helpers measure your own
# batches: ``compare_backends`` on the building-blocks page runs every
# attention backend through them.
#
# Further reading
# ---------------
# * `Benchmark utilities <https://docs.pytorch.org/docs/stable/benchmark_utils.html>`_
#   (``torch.utils.benchmark``)
# * `PyTorch profiler <https://docs.pytorch.org/docs/stable/profiler.html>`_
# * `torch.compile troubleshooting
#   <https://docs.pytorch.org/docs/stable/torch.compiler_troubleshooting.html>`_
