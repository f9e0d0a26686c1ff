"""
Ragged batches: padding and masks versus packed values and offsets
==================================================================

This page stores one batch of variable-length sequences in two ways: padded,
with a mask, and packed, with offsets. It shows that a nested jagged tensor
is the packed form. Then it measures what padding costs a linear layer. The
page ends with the site's :ref:`glossary <glossary>`.

**Authors:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How a padded batch with a mask and packed values with offsets
         describe the same ragged batch, and how to go from one to the other
       * That a nested jagged tensor (NJT) is exactly values plus offsets
       * How much of a padded batch is padding for realistic sentence
         lengths, and what that costs a ``nn.Linear``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.11 or later
       * A CPU is enough; a CUDA GPU is used when present
"""

# sphinx_gallery_tags = ["basics", "packing", "nested tensors"]

# %%
# Sizes
# -----
# Every size on this page is set here, once, for each device.
# ``page_setup`` picks the device, its dtype and the sizes for that device.
# It also sets the seed and one CPU thread per operator, as every timing of
# the site does. :term:`Quick mode <quick mode>` (``TUTORIALS_QUICK=1``) is
# the test suite's setting: it shrinks the sizes, and every assertion still
# runs.

import torch
from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(batch=512, embed=1024, run_time=1.0),  # the batch of the original tutorial
    "cpu": dict(batch=256, embed=256, run_time=1.0),  # small enough for a two-core laptop
    "quick": dict(batch=64, embed=128, run_time=0.2),  # TUTORIALS_QUICK=1
}
setup = page_setup(SIZES)  # prints the device, dtype and mode
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
print(f"batch {S.batch}, embedding {S.embed}")

# %%
# The same batch, two ways
# ------------------------
# Take three sentences of 3, 1 and 4 tokens, one feature per token, so that
# the numbers stay readable. The padded form stacks them into a ``(B, S)``
# rectangle, where ``S`` is the longest length. It keeps a ``(B, S)`` mask of
# the real tokens. The packed form keeps only the real tokens, end to end, as
# **values** ``(T, ...)``. Beside them it keeps the **offsets** ``(B + 1,)``:
# where each sentence starts, then where the last one ends. On later pages,
# a model whose attention reads a batch in these forms uses the
# :term:`padded layout` or the :term:`packed layout`.

from ragged_toolkit.batches import from_padded, offsets_from_lengths, to_padded

sentences = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0]), torch.tensor([5.0, 6.0, 7.0, 8.0])]
padded = torch.nn.utils.rnn.pad_sequence(sentences, batch_first=True)  # (B, S)
mask = padded != 0  # True on real tokens (no real token is 0 here)
values = torch.cat(sentences)  # (T,)
offsets = offsets_from_lengths([len(s) for s in sentences])  # (B + 1,)
print("padded:\n", padded, "\nmask:\n", mask)
print("values: ", values)
print("offsets:", offsets)

# %%
# Sentence ``i`` is ``values[offsets[i]:offsets[i + 1]]``. The site's toolkit
# module, ``ragged_toolkit``, converts between the two forms. ``to_padded``
# gives the padded tensor and its mask; ``from_padded`` gives the values back.
# The toolkit's :doc:`reference page </toolkit>` lists every function.

padded_again, valid = to_padded(values, offsets)
assert torch.equal(padded_again, padded) and torch.equal(valid, mask)
assert torch.equal(from_padded(padded, offsets), values)
print("sentence 2:", values[offsets[2] : offsets[3]])

# %%
# Here is the same batch as a picture, drawn by ``draw_batch`` from the
# site's figure helpers. Each token shows its position in its sentence, and
# each sentence has its own color.

import matplotlib.pyplot as plt
from ragged_site.figures import FIGURE_STYLE, draw_batch

plt.rcParams.update(FIGURE_STYLE)
draw_batch([len(s) for s in sentences])
plt.show()

# %%
# Sentence lengths that look like text
# ------------------------------------
# A sentence ends when a word is a full stop, an exclamation mark or a
# question mark. Model word frequencies as Zipf(1.2), and put those three at
# the ranks they have in the WikiText-2 corpus: 3, 386 and 858. Then each
# word ends the sentence with the same probability ``p``, whatever the words
# before it. So a sentence's length is a geometric draw. That is what
# ``sentence_lengths`` draws, from a seeded numpy generator. The measuring
# page (:doc:`measuring_ragged_batches`) checks this shortcut against
# drawing the words one by one.

import numpy as np
from ragged_site.workloads import sentence_lengths, zipf_stop_probability

rng = np.random.default_rng(setup.seed)
lengths = sentence_lengths(rng, S.batch)
print(f"stop probability per word: {zipf_stop_probability(1.2):.4f}")
print(
    f"{S.batch} sentences, {int(lengths.sum())} tokens, "
    f"mean length {lengths.double().mean().item():.1f}, longest {int(lengths.max())}"
)

# %%
# The histogram has the long right tail of real text. Most sentences are
# short and a few are very long, so the mean lies above the median (the
# assertion checks it). The longest sentence sets the padded length.

fig, ax = plt.subplots(figsize=(8, 4))
ax.hist(lengths.numpy(), bins=40, color="#4c72b0")
ax.axvline(
    int(lengths.max()),
    color="#c44e52",
    linestyle="--",
    label=f"padded length = {int(lengths.max())}",
)
ax.set_xlabel("sentence length (tokens)")
ax.set_ylabel("sentences")
ax.set_title(f"Zipf(1.2) sentence lengths, batch of {S.batch}")
ax.legend()
fig.tight_layout()
assert lengths.double().mean() > lengths.double().median(), "the lengths have no long right tail"

# %%
# The same two forms at this size, one row of ``S.embed`` features per token:

sentences = [torch.randn(int(n), S.embed, device=DEVICE, dtype=DTYPE) for n in lengths]
padded = torch.nn.utils.rnn.pad_sequence(sentences, batch_first=True)  # (B, S, E)
values = torch.cat(sentences)  # (T, E)
offsets = offsets_from_lengths(lengths, DEVICE)  # (B + 1,)
padded_from_values, valid = to_padded(values, offsets)
assert torch.equal(padded_from_values, padded)
assert torch.equal(from_padded(padded, offsets), values)
print("padded:", tuple(padded.shape), " mask:", tuple(valid.shape))
print("values:", tuple(values.shape), " offsets[:6]:", offsets[:6].tolist())

# %%
# A nested jagged tensor is the packed form
# -----------------------------------------
# ``torch.nested`` with ``layout=torch.jagged`` stores a ragged batch as
# exactly these two tensors: ``values()`` and ``offsets()``. It adds
# ``unbind()`` and ``to_padded_tensor()`` and lets some operations run on the
# batch as a whole. PyTorch's documentation says nested tensors are no
# longer under active development. So the rest of the site works on the
# plain pair of tensors. It uses a nested tensor only as one attention
# backend.

# without max_seqlen, to_padded_tensor would pad to the total token count
njt = torch.nested.nested_tensor_from_jagged(values, offsets, max_seqlen=int(lengths.max()))
# the same memory: building the nested tensor copied nothing
assert njt.values().data_ptr() == values.data_ptr() and torch.equal(njt.offsets(), offsets)
for original, piece in zip(sentences, njt.unbind()):
    assert torch.equal(piece, original)
torch.testing.assert_close(njt.to_padded_tensor(0.0), padded)
print("nested:", njt.shape, "(j is the ragged dimension)")

# %%
# How much of a padded batch is padding?
# --------------------------------------
# Every sentence is stretched to the longest one, so the padded batch holds
# ``B * S`` token slots for ``sum(lengths)`` real tokens.

real_tokens, slots = int(lengths.sum()), S.batch * int(lengths.max())
print(f"real tokens {real_tokens}, padded slots {slots}")
print(
    f"{100 * (1 - real_tokens / slots):.1f}% of the padded batch is padding "
    f"({slots / real_tokens:.2f}x the tokens)"
)
assert slots > 2 * real_tokens, "padding is not most of the padded batch"

# %%
# What padding costs a linear layer
# ---------------------------------
# A token-wise layer such as ``nn.Linear`` works on every slot it is given.
# On the packed values it runs on real tokens only. So the padded batch does
# ``slots / real_tokens`` times the work. That ratio is the
# :term:`work bound` of this comparison: the speedup to expect if time
# followed the work. ``work_bound`` counts it from the lengths and the
# layer's ``Work``, its FLOPs per token. The measured speedup divided by the
# bound is the :term:`fraction of the bound`.
#
# Both sides must give the same result on the real tokens. Then ``measure``
# times both with ``torch.utils.benchmark``, taking turns. It reports the
# median and the interquartile range (IQR) in milliseconds. Outside quick
# mode it also reports the peak memory in MiB.

from ragged_site.measuring.bound import Work, speedup_line, work_bound
from ragged_site.measuring.tables import print_timings
from ragged_site.measuring.timing import measure

linear = torch.nn.Linear(S.embed, 4 * S.embed, device=DEVICE, dtype=DTYPE)
with torch.no_grad():
    torch.testing.assert_close(linear(values), linear(padded)[valid])
    times = measure(
        {"padded": lambda: linear(padded), "packed": lambda: linear(values)},
        min_run_time=S.run_time,
        profile=not setup.quick,
    )
print("nn.Linear: packed and padded results agree on every real token")
print_timings(times)
bound = work_bound(lengths, work=Work(per_token=2 * S.embed * 4 * S.embed, per_pair=0.0))
assert abs(bound - slots / real_tokens) < 1e-9  # a token-wise layer: slots over real tokens
print(speedup_line("nn.Linear", times["padded"], times["packed"], bound))

# %%
# The last figure of the line is the fraction of the bound.
# :ref:`The measuring page <fraction-of-the-bound>` explains, once, what a
# fraction near 1, below 1 or above 1 says, and when to distrust one.
#
# Attention pays more for padding than a linear layer does. Attention's cost
# grows with the square of the padded length. A padded batch also needs a
# mask, so that real tokens do not attend to padding. The next pages build
# whole transformer layers and models that never see a pad token.
#
# Conclusion
# ----------
# A ragged batch is packed values plus offsets. A nested jagged tensor is the
# same two tensors. Token-wise layers run on the values directly and skip the
# padding. For Zipf-distributed sentence lengths, padding is most of a padded
# batch.
#
# .. _glossary:
#
# Glossary
# --------
# The words the pages of this site use for what they measure.
#
# .. glossary::
#
#    work bound
#       The padded implementation's work over the packed one's: the speedup
#       to expect if time followed work. Every speedup on the site is
#       printed beside it (:ref:`how it is counted <work-bound>`).
#
#    fraction of the bound
#       The measured speedup divided by the work bound. :ref:`The measuring
#       page <fraction-of-the-bound>` explains how to read it.
#
#    kernel label
#       The attention kernel that ran, in brackets after a timing, with its
#       call count. It comes from the profiler's operator names:
#
#       * ``CPU flash``: SDPA's fused kernel for CPUs.
#       * ``flash``, ``memory-efficient``, ``cuDNN``: SDPA's fused CUDA
#         kernels; ``flash varlen``: the one ``varlen_attn`` calls.
#       * ``math``: SDPA's unfused reference path.
#       * ``compiled graph (inductor kernel)``: code that ``torch.compile``
#         generated (FlexAttention on CPU).
#       * ``FlexAttention Triton kernel``: FlexAttention's fused CUDA kernel.
#       * A ``backward`` suffix marks the gradient kernel.
#
#    layout
#       How a model's attention reads a batch (``ragged_toolkit.layouts``).
#       The model computes queries, keys and values the same way for every
#       layout.
#
#    packed layout
#       The tokens of all sequences in one row, with offsets
#       (``PackedLayout``). Attention goes through ``ragged_attention`` and
#       the batch's plan.
#
#    padded layout
#       Each sequence in its own row of a ``(B, S)`` tensor, padded to the
#       longest (``PaddedLayout``). Attention is one SDPA call.
#
#    rows layout
#       Documents packed into fixed-length rows (``PackedRows``). Attention
#       is one SDPA call per batch, with a block-diagonal causal mask.
#
#    plan
#       What ``plan_batch`` reads from a batch's offsets once: the lengths,
#       the backend, causal or not. Every attention call of the batch is
#       passed it, so no layer reads the offsets again.
#
#    quick mode
#       ``TUTORIALS_QUICK=1``: every page shrinks its sizes so that the test
#       suite can run it in seconds; every assertion still runs. The
#       published pages never use it.
#
#    the original tutorial's baseline
#       What the 2024 tutorial this site grew from compared against:
#       ``nn.MultiheadAttention`` on the padded batch, with a padding mask
#       and a causal mask merged into one ``(B * H, S, S)`` mask. Our own
#       padded baseline uses a causal kernel and no mask instead.
#
# Further reading
# ---------------
# * `torch.nested documentation <https://docs.pytorch.org/docs/stable/nested.html>`_
#   (note its status line: nested tensors are no longer under active development)
# * `Benchmark utilities <https://docs.pytorch.org/docs/stable/benchmark_utils.html>`_
#   (``torch.utils.benchmark``)
