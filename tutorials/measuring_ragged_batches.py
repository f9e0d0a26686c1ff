"""
Measuring ragged batches: timings, the noise rule and the work bound
====================================================================

This page shows how every figure on this site is made. Functions are timed
side by side. A choice is made only where the measurement can tell. Each
speedup is printed beside the work that padding adds. A profile describes
the call that was timed. Compiles stay out of the timed window. Every other
page uses each of these in one call and links here.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How ``measure`` times functions in interleaved rounds, and how
         ``choose`` decides only outside the noise (an option timed against
         itself is the test)
       * How the :term:`work bound` is counted, and what the
         :term:`fraction of the bound` means: the one place the site
         explains it, and why a fraction far above 1 is a bug in the
         baseline until shown otherwise
       * How to read a profile beside its timing, and how to keep compiles
         out of a timed training loop
       * Where the original tutorial's 144x backward came from

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`transformer_building_blocks` (``ragged_attention`` and its
         backends) and :doc:`packed_attention_layer` (the
         ``MultiHeadAttention`` layer)
       * PyTorch 2.11 or later; a CPU is enough
"""

# sphinx_gallery_tags = ["benchmarks", "profiling", "torch.compile"]

# %%
# Sizes
# -----
# The page measures one batch of sentences and one layer, with sizes set
# here per device. :term:`Quick mode <quick mode>`, the test suite's
# setting, shrinks them. ``page_setup`` also sets one CPU thread per
# operator for the whole page. Every timing of the site runs with that
# thread count (``TIMING_THREADS``). So a profile describes the call that
# was timed, and a compiled function is compiled once, for those threads.

from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(batch=512, embed=512, heads=8, run_time=0.5),  # the original tutorial's scale
    "cpu": dict(batch=48, embed=128, heads=4, run_time=0.3),  # about 20 s on two cores
    "quick": dict(batch=16, embed=64, heads=4, run_time=0.1),  # TUTORIALS_QUICK=1: head size 16
}
setup = page_setup(SIZES)
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
print(f"batch {S.batch}, embedding {S.embed}, heads {S.heads}")

# %%
# The lengths every page measures on
# ----------------------------------
# ``sentence_lengths`` draws a sentence's length as one geometric draw. The
# model behind it: each word is drawn from Zipf(1.2), and the sentence ends
# at a full stop, an exclamation mark or a question mark. Those are ranks 3,
# 386 and 858 in WikiText-2. Each word ends the sentence independently of
# the words before it. This cell checks the shortcut against drawing the
# words one by one. The check is a two-sample Kolmogorov-Smirnov test. It
# takes the largest gap between the two empirical distribution functions.
# That gap must stay below the gap that two samples of one distribution
# exceed with probability 0.1%.

import numpy as np
from ragged_site.workloads import STOP_RANKS, sentence_lengths, zipf_stop_probability

rng = np.random.default_rng(setup.seed)
n_sentences = 5_000 if setup.quick else 20_000
words = rng.zipf(1.2, size=(n_sentences, 400))
is_stop = np.isin(words, STOP_RANKS)
word_by_word = is_stop.argmax(axis=1)[is_stop.any(axis=1)] + 1
geometric = sentence_lengths(rng, n_sentences, 1.2).numpy()
grid = np.arange(1, max(word_by_word.max(), geometric.max()) + 1)
cdf_gap = np.abs(
    np.searchsorted(np.sort(word_by_word), grid, side="right") / len(word_by_word)
    - np.searchsorted(np.sort(geometric), grid, side="right") / len(geometric)
).max()
n, m = len(word_by_word), len(geometric)
critical = 1.95 * np.sqrt((n + m) / (n * m))  # Kolmogorov-Smirnov, 0.1% level
print(
    f"expected length 1/p = {1 / zipf_stop_probability(1.2):.1f}; mean word by word "
    f"{word_by_word.mean():.2f}, geometric {geometric.mean():.2f}"
)
print(f"largest CDF gap {cdf_gap:.4f} (must stay below {critical:.4f})")
assert cdf_gap < critical, "the geometric lengths do not match the word-by-word ones"

# %%
# Timing side by side
# -------------------
# ``measure`` first times each function's first call alone, since that call
# may compile. Then the functions take turns for a few rounds, each a
# ``torch.utils.benchmark`` ``blocked_autorange``. Taking turns means that a
# busy machine slows all of them alike. ``measure`` reports the median and
# the interquartile range (IQR) in ms. With ``profile``, it then runs each
# function once more under the profiler. That run gives the peak memory in
# MiB and the :term:`kernel label`: the attention kernel that ran, in
# brackets after the timing. Quick mode turns ``profile`` off, since there a
# profile would cost more than the timing.
#
# .. literalinclude:: ../ragged_site/measuring/timing.py
#    :pyobject: measure
#
# Every other clock read, such as a step of a loop or of a server, goes
# through one helper, ``stopwatch``. It synchronizes the device before the
# clock starts and before it stops:
#
# .. literalinclude:: ../ragged_toolkit/clock.py
#    :pyobject: stopwatch
#
# The cell times the causal self-attention layer of
# :doc:`packed_attention_layer` on one batch, forward only. It has three
# entries:
#
# * **padded**: the layer on the padded batch, as in the
#   :term:`padded layout`. That is one SDPA call, with a causal kernel and
#   no mask.
# * **packed**: the layer on packed values, as in the :term:`packed layout`.
# * **packed again**: the packed layer again, under another name.
#
# The packed side runs the backend that ``default_backend`` picks on this
# device. That is the per-sequence loop on a CPU, and ``varlen`` on a CUDA
# GPU in ``bfloat16``. Its :term:`plan`, what ``plan_batch`` reads from the
# offsets, is built once, before timing:

import torch
from ragged_toolkit.attention import default_backend, plan_batch
from ragged_toolkit.batches import to_padded
from ragged_site.workloads import ragged_batch
from ragged_toolkit.layers import MultiHeadAttention
from ragged_site.measuring.tables import print_timings
from ragged_site.measuring.timing import measure

x, offsets = ragged_batch(rng, S.batch, S.embed, device=DEVICE, dtype=DTYPE)  # (T, E), (B + 1,)
x_padded, valid = to_padded(x, offsets)  # (B, S, E), (B, S)
PACKED_BACKEND = default_backend(DEVICE, DTYPE, head_dim=S.embed // S.heads)
print(f"packed: the {PACKED_BACKEND} backend")
plan = plan_batch(
    offsets, backend=PACKED_BACKEND, is_causal=True
)  # built once, passed to every call
layer = MultiHeadAttention(S.embed, S.heads, device=DEVICE, dtype=DTYPE)
with torch.no_grad():
    times = measure(
        {
            "padded": lambda: layer(x_padded, is_causal=True),
            "packed": lambda: layer(x, plan),
            "packed again": lambda: layer(x, plan),
        },
        min_run_time=S.run_time,
        profile=not setup.quick,
    )
print_timings(times)

# %%
# When a difference is a difference
# ---------------------------------
# A page chooses between options, such as a backend or compiling or not,
# only where the measurement can tell. ``choose`` takes the lowest median
# only if two things hold:
#
# * its interquartile range does not overlap that of the second fastest
#   (``outside_noise``);
# * each option has at least ``MIN_RUNS`` timed runs.
#
# Otherwise it returns the documented default. For a given job, that
# default is the same on every page. The same function timed twice is the
# test of the rule: it must come out within noise.
#
# .. literalinclude:: ../ragged_site/measuring/noise.py
#    :pyobject: choose

from ragged_site.measuring.noise import choose, outside_noise

choose({k: times[k] for k in ("packed", "packed again")}, "packed", "the same function twice")
choose({k: times[k] for k in ("padded", "packed")}, "padded", "padded or packed")
if outside_noise(times["packed"], times["packed again"]):
    print("the same function timed twice came out apart: this machine is too noisy to choose on")

# %%
# .. _work-bound:
#
# The work bound
# --------------
# A speedup alone does not say whether it is good. The :term:`work bound`
# is the work the padded side must do over the work of the packed side.
# Each side is counted for what it computes. A layer or a model says what it
# computes as a ``Work``, in FLOPs:
#
# * per token, through its matrices;
# * per key/value token (cross-attention);
# * per query-key pair, for the scores and the sum over values.
#
# ``attention_layer_work`` gives it for an attention layer. ``model_work``
# gives it for a whole decoder, at two FLOPs per weight per token:
#
# .. literalinclude:: ../ragged_site/measuring/bound.py
#    :pyobject: attention_layer_work
#
# .. literalinclude:: ../ragged_site/measuring/bound.py
#    :pyobject: model_work
#
# ``work_bound`` counts both sides from the lengths. The packed side counts
# each sequence as it is. The padded side counts every sequence as long as
# the longest. A causal kernel scores the causal half of the pairs,
# ``L (L + 1) / 2``. A merged mask scores the whole square.
#
# ``speedup_line`` prints a speedup beside its bound. It adds the
# :term:`fraction of the bound`: the speedup divided by the bound. Where the
# interquartile ranges of the two timings overlap, it adds "(within noise)".
# ``throughput_line`` does the same for two rates in tokens per second.
#
# .. literalinclude:: ../ragged_site/measuring/bound.py
#    :pyobject: work_bound
#
# .. literalinclude:: ../ragged_site/measuring/bound.py
#    :pyobject: speedup_line

from ragged_site.measuring.bound import attention_layer_work, speedup_line, work_bound

work = attention_layer_work(S.embed)  # four projections; scores and their sum over values
lengths = offsets.diff().cpu()
bound = work_bound(lengths, work=work, causal=True)
print(speedup_line("forward", times["padded"], times["packed"], bound))

# %%
# .. _fraction-of-the-bound:
#
# What a fraction of the bound means
# ----------------------------------
# The :term:`fraction of the bound` is the measured speedup over the work
# bound. It says how much of what skipping padding could buy, counted in
# work, this device delivered. The site prints it beside every speedup.
# Every other page links here instead of explaining it again.
#
# * **Near 1**: the packed code turned the work it skips into speed; time
#   followed the work.
# * **Below 1**: something the bound does not count ate part of the win.
#   Examples: one call per sequence (the loop backend), gathers and index
#   bookkeeping, or a kernel launch per step. Small matrices also use the
#   device less well than one large one. The packed side has room to
#   improve.
# * **Above 1**: the padded side was slower *per unit of work* than the
#   packed one. The bound counts FLOPs only, but a padded batch is also
#   larger in memory. It may miss a cache that the packed one fits in, and
#   it costs more to allocate and move. The linear layer of
#   :doc:`ragged_batches_intro` may show this.
# * **Far above 1** (say 2 or more): a bug in the baseline until shown
#   otherwise. Examples: the padded side ran SDPA's unfused math kernel, or
#   used a mask it did not need. Or it had a compile inside its timed
#   window, as in the story at the end of this page. Each makes the padded
#   side slow for reasons that have nothing to do with padding.
#
# A fraction is as noisy as the two timings it divides. Where their
# interquartile ranges overlap, ``speedup_line`` says "(within noise)", and
# the fraction says nothing either way. A fraction also belongs to one
# device, one dtype and one batch. The next section shows how much the bound
# itself moves from batch to batch. The serving page's *slot bound* is read
# the same way. It is a bound set by idle slots instead of padded tokens,
# printed with the fraction of it reached. This page's batch:

speedup = times["padded"].median_ms / times["packed"].median_ms
fraction = speedup / bound
reading = (
    "near 1: time followed the work"
    if 0.8 <= fraction <= 1.25
    else "below 1: overheads the bound does not count ate part of the win"
    if fraction < 0.8
    else "far above 1: look for a bug in the baseline"
    if fraction >= 2
    else "above 1: the padded side was slower per unit of work"
)
noise = (
    "" if outside_noise(times["padded"], times["packed"]) else " (within noise: it says nothing)"
)
print(f"forward fraction of the bound {fraction:.2f}: {reading}{noise}")

# %%
# One batch proves little
# -----------------------
# Does a smaller Zipf exponent, which makes sentences longer, raise the
# bound? The lengths of many batches answer that without timing anything.
# For each exponent, the cell counts the bound of ``N_BATCHES`` batches of
# this page's size.

N_BATCHES = 50 if setup.quick else 200
alphas = (1.1, 1.2, 1.35, 1.6)
bounds = {
    a: np.array(
        [
            work_bound(sentence_lengths(rng, S.batch, a), work=work, causal=True)
            for _ in range(N_BATCHES)
        ]
    )
    for a in alphas
}
quartiles = {
    a: dict(zip(("q1", "median", "q3"), np.percentile(bounds[a], [25, 50, 75]))) for a in alphas
}
for a, q in quartiles.items():
    print(
        f"Zipf {a:4.2f}: mean length {1 / zipf_stop_probability(a):5.1f}, work bound median "
        f"{q['median']:.2f}x (IQR {q['q1']:.2f}-{q['q3']:.2f}) over {N_BATCHES} batches"
    )
medians = [quartiles[a]["median"] for a in alphas]  # in order of increasing exponent
change = max(medians) - min(medians)
between_batches = np.median([quartiles[a]["q3"] - quartiles[a]["q1"] for a in alphas])
steady = all(x > y for x, y in zip(medians, medians[1:]))
trend = "rises steadily" if steady else "does not move steadily"
size = "less than" if change < between_batches else "more than"
print(
    f"as the exponent falls, the median bound {trend}: it moves by {change:.2f}x in all,\n"
    f"{size} the IQR of the bound between batches of one exponent ({between_batches:.2f}x)"
)

# %%
# The bound is set mostly by the longest sentence of a batch against the
# mean. The line above may find the medians moving by less than the IQR.
# Then the sentences a batch happened to draw matter more than the exponent.
# Timing one batch per exponent would then order the exponents by chance.
# What one batch each can show is whether the speedup follows the bound of
# the batch at hand. One batch per exponent, timed:

measured = {}
for a in alphas[1:] if setup.quick else alphas:
    x_b, offsets_b = ragged_batch(rng, S.batch, S.embed, alpha=a, device=DEVICE, dtype=DTYPE)
    x_b_padded, plan_b = (
        to_padded(x_b, offsets_b)[0],
        plan_batch(offsets_b, backend=PACKED_BACKEND, is_causal=True),
    )
    with torch.no_grad():
        t = measure(
            {
                "padded": lambda: layer(x_b_padded, is_causal=True),
                "packed": lambda: layer(x_b, plan_b),
            },
            min_run_time=S.run_time / 2,
            profile=False,
        )
    measured[a] = dict(
        bound=work_bound(offsets_b.diff().cpu(), work=work, causal=True),
        speedup=t["padded"].median_ms / t["packed"].median_ms,
    )
    print(
        speedup_line(
            f"Zipf {a:4.2f}, longest {int(offsets_b.diff().max()):3d}",
            t["padded"],
            t["packed"],
            measured[a]["bound"],
        )
    )

import matplotlib.pyplot as plt
from ragged_site.figures import FIGURE_STYLE

plt.rcParams.update(FIGURE_STYLE)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 4.5), layout="constrained", width_ratios=[1, 1.2])
ax1.boxplot([bounds[a] for a in alphas], whis=(5, 95))
ax1.set_xticks(range(1, len(alphas) + 1), [f"{a}" for a in alphas])
ax1.set(xlabel="Zipf exponent", ylabel="work bound (x)", title=f"{N_BATCHES} batches of {S.batch}")
top = 1.1 * max(max(v["bound"], v["speedup"]) for v in measured.values())
ax2.plot([1, top], [1, top], "--", color="gray", label="speedup = bound")
ax2.scatter(
    [v["bound"] for v in measured.values()],
    [v["speedup"] for v in measured.values()],
    zorder=3,
    label=f"measured, {DEVICE}",
)
for a, v in measured.items():  # each label on its point's side toward the middle: inside
    right, low = v["bound"] > (1 + top) / 2, v["speedup"] < (1 + top) / 2
    ax2.annotate(
        f"Zipf {a}",
        (v["bound"], v["speedup"]),
        textcoords="offset points",
        xytext=(-6 if right else 6, 6 if low else -12),
        ha="right" if right else "left",
    )
ax2.set(
    xlabel="work bound of the batch (x)",
    ylabel="forward speedup (x)",
    title="One batch each, timed",
)
ax2.legend(loc="upper left")
plt.show()

# %%
# Where the time goes
# -------------------
# When a fraction falls short, a profile says why. ``where_time_goes``
# profiles a function at its steady state, as it was timed:
#
# * warm-up calls first;
# * the same threads;
# * enough calls for a fifth of a second;
# * every figure per call, printed beside the timed median.
#
# The profiler adds time for each operator it records. ``where_time_goes``
# estimates that cost: it measures it on a loop of trivial operators, then
# multiplies it by the operators the call records. It prints the estimate
# beside the gap between the profiled time and the timed median, so that
# the two can be compared. (Quick mode skips profiles: they cost more than
# its timings.)

from ragged_site.measuring.profiles import where_time_goes

if setup.quick:
    print("quick mode: no profiles")
else:
    with torch.no_grad():
        print("padded, forward:")
        print(
            where_time_goes(lambda: layer(x_padded, is_causal=True), top=4, timing=times["padded"])
        )
        print("packed, forward:")
        print(where_time_goes(lambda: layer(x, plan), top=4, timing=times["packed"]))

# %%
# Matrix multiplies (``addmm``) scale with the tokens on both sides. With
# the loop backend, the packed side adds one attention call per sequence,
# which the padded side makes once.
#
# Compiles outside the timed window
# ---------------------------------
# ``torch.compile`` compiles when a function first meets a shape (and, for
# training, when the first backward runs). A compile inside a timed window
# is timed as work. ``compile_counter`` counts the graphs compiled and the
# graph breaks inside a block. ``StepTimer`` times each step of a training
# loop with ``stopwatch`` and records the graphs compiled during it. So a
# page can assert that no graph was compiled in the steps it reports.
#
# .. literalinclude:: ../ragged_site/measuring/timing.py
#    :pyobject: StepTimer

from ragged_site.measuring.compiling import compile_counter
from ragged_site.measuring.timing import StepTimer

compiled_layer = torch.compile(layer, dynamic=False)
timer = StepTimer()
with compile_counter() as compiled:
    for _ in range(4):
        with timer.step(len(x)), torch.no_grad():
            compiled_layer(x_padded, is_causal=True)
print(f"torch.compile: {compiled}")
print("step  ms     graphs compiled in the step")
for number, (seconds, graphs) in enumerate(zip(timer.seconds, timer.graphs)):
    print(f"{number:4d} {1e3 * seconds:8.2f}  {graphs}")
assert timer.graphs[0] > 0 and sum(timer.graphs[1:]) == 0, (
    "a graph was compiled after the first step"
)

# %%
# The first step carried the compile. A page reports only the steps after
# it, and asserts that they compiled nothing.
#
# Where did the original's 144x backward come from?
# -------------------------------------------------
# The original tutorial reported a 144x faster backward on an A100, far
# beyond any padding bound. Its benchmark timed one backward call of a
# compiled module, right after a forward-only warm-up. A compiled module
# compiles its backward graph when the first backward runs, so that one call
# included compilation. The cell repeats that single timing with
# ``stopwatch``, deliberately one shot. It runs on
# :term:`the original tutorial's baseline`: ``nn.MultiheadAttention`` with a
# padding mask and a causal mask merged into one. It compares that with the
# packed layer's steady forward and backward.

import torch.nn as nn
from ragged_toolkit.clock import stopwatch

causal = torch.ones(x_padded.shape[1], x_padded.shape[1], dtype=torch.bool, device=DEVICE).triu(
    1
)  # masked
original = torch.compile(
    nn.MultiheadAttention(S.embed, S.heads, batch_first=True, device=DEVICE, dtype=DTYPE)
)
grad_out, grad_padded = torch.randn_like(x), torch.randn_like(x_padded)


def original_step():
    out = original(
        x_padded, x_padded, x_padded, key_padding_mask=~valid, attn_mask=causal, need_weights=False
    )[0]
    out.backward(grad_padded)


with compile_counter() as compiled:
    with torch.no_grad():  # the forward-only warm-up the original did
        original(
            x_padded,
            x_padded,
            x_padded,
            key_padding_mask=~valid,
            attn_mask=causal,
            need_weights=False,
        )
    with stopwatch() as first_call:
        original_step()  # compiles the backward graph
steady = measure(
    {"original": original_step, "packed": lambda: layer(x, plan).backward(grad_out)},
    min_run_time=S.run_time,
    profile=False,
)
print(f"torch.compile of the original's baseline: {compiled}")
print(
    f"its first forward and backward: {first_call.seconds:.2f} s, "
    f"{first_call.seconds * 1e3 / steady['packed'].median_ms:.0f}x "
    f"the packed layer's steady step ({steady['packed'].median_ms:.2f} ms)"
)
merged = work_bound(lengths, work=work, causal=True, padded_causal=False)
print(
    speedup_line(
        "after its warm-up, forward and backward", steady["original"], steady["packed"], merged
    )
)
compiling = 1 - steady["original"].median_ms / (
    first_call.seconds * 1e3
)  # what was not the step itself
print(
    f"{compiling:.0%} of that first call was not the step: "
    + (
        "it timed the compiler"
        if compiling > 0.5
        else "compiling was short here (a warm compile cache?)"
    )
)

# %%
# The last line says how much of the one-shot timing was not the step
# itself. That part is compiling the backward graph, shorter where
# ``torch.compile``'s cache already holds it (a rebuild). A ratio
# built on such a timing measures the compiler, not padding. Its fraction of
# any bound can land far above 1, the signature of a bug in the baseline.
# Timed after its warm-up, the same baseline stands beside its own work
# bound. That bound counts the whole square that its merged mask computes.
#
# Conclusion
# ----------
# A figure on this site is a median of interleaved rounds, with its spread.
# A choice is made only outside that spread. A speedup stands beside the
# work that padding adds. A profile describes the call that was timed. No
# compile falls inside a timed window. The same helpers measure your own
# batches. For example, ``compare_backends`` on the building-blocks page
# runs every attention backend through them.
#
# Further reading
# ---------------
# * `Benchmark utilities <https://docs.pytorch.org/docs/stable/benchmark_utils.html>`_
#   (``torch.utils.benchmark``)
# * `PyTorch profiler <https://docs.pytorch.org/docs/stable/profiler.html>`_
# * `torch.compile troubleshooting
#   <https://docs.pytorch.org/docs/stable/torch.compiler_troubleshooting.html>`_
