"""
Ragged batches: padding and masks versus packed values and offsets
==================================================================

A first look at batches of variable-length sequences in PyTorch: the same
batch stored padded with a mask and packed with offsets, how a nested jagged
tensor holds the packed form, and what padding costs a linear layer.

**Authors:** the ragged-transformers tutorial contributors

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How a padded batch with a mask and packed values with offsets
         describe the same ragged batch, and how to go from one to the other
       * That a nested jagged tensor (NJT) is exactly values plus offsets
       * How many of a padded batch's tokens are padding for realistic
         sentence lengths, and what that costs a ``nn.Linear``, measured
         against the work bound

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.11 or later
       * A CPU is enough; a CUDA GPU is used when present
"""

# sphinx_gallery_tags = ["basics", "packing", "nested tensors"]

# %%
# Device and sizes
# ----------------
# Every size on this page is set here, once, for the device the page runs on.
# ``TUTORIALS_QUICK=1`` shrinks them further for smoke tests; the assertions
# stay the same.

import os

import numpy as np
import torch
import torch.nn.functional as F


from ragged_toolkit import (
    default_device, default_dtype, from_padded, measure, offsets_from_lengths, quick_mode,
    quiet_known_notes, sentence_lengths, speedup_line, to_padded, zipf_stop_probability,
)

DEVICE = default_device()
DTYPE = default_dtype(DEVICE)
QUICK = quick_mode()
SEED = 0

if DEVICE == "cuda":
    BATCH, EMBED = 512, 1024  # the batch of the original tutorial
else:
    BATCH, EMBED = 256, 256  # small enough for a two-core laptop
if QUICK:
    BATCH, EMBED = 64, 128
RUN_TIME = 0.2 if QUICK else 1.0
print(f"PyTorch {torch.__version__}, device: {DEVICE}, dtype: {DTYPE}")
print(f"batch: {BATCH} sequences, embedding: {EMBED}")

# sphinx_gallery_start_ignore
quiet_known_notes()
# sphinx_gallery_end_ignore

# %%
# Sentence lengths that look like text
# ------------------------------------
# A sentence ends when a word is a full stop, an exclamation or a question
# mark. Under a Zipf(1.2) model of word frequencies, with those three at the
# ranks they have in the WikiText-2 corpus (3, 386 and 858), each word ends
# the sentence with the same probability ``p``, independently of the words
# before it, so a sentence's length is a geometric draw. These two functions
# are the site's length generator; the building-blocks page checks them
# against drawing the words one by one.


rng = np.random.default_rng(SEED)
torch.manual_seed(SEED)
lengths = sentence_lengths(rng, BATCH)
print(f"stop probability per word: {zipf_stop_probability(1.2):.4f}")
print(f"{BATCH} sentences, {int(lengths.sum())} tokens, "
      f"mean length {lengths.double().mean().item():.1f}, longest {int(lengths.max())}")

# %%
# The histogram has the long right tail of real text: most sentences are
# short, a few are very long, and the longest one sets the padded length.
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.hist(lengths.numpy(), bins=40, color="#4c72b0")
ax.axvline(int(lengths.max()), color="#c44e52", linestyle="--", label=f"padded length = {int(lengths.max())}")
ax.set_xlabel("sentence length (tokens)")
ax.set_ylabel("sentences")
ax.set_title(f"Zipf(1.2) sentence lengths, batch of {BATCH}")
ax.legend()
fig.tight_layout()

# %%
# The same batch, two ways
# ------------------------
# Start from a list of per-sentence tensors, one row of ``EMBED`` features per
# token. The padded form stacks them into a ``(B, S_max, E)`` tensor and
# keeps a ``(B, S_max)`` boolean mask of the real tokens. The packed form
# keeps only the real tokens, end to end, as **values** ``(T, E)``, and the
# **offsets** ``(B + 1,)`` where each sentence starts, then where the last
# one ends. The functions below are the site's toolkit for going between
# the two.


sentences = [torch.randn(int(n), EMBED, device=DEVICE, dtype=DTYPE) for n in lengths]
padded = torch.nn.utils.rnn.pad_sequence(sentences, batch_first=True)  # (B, S_max, E)
values = torch.cat(sentences)  # (T, E)
offsets = offsets_from_lengths(lengths, DEVICE)  # (B + 1,)
padded_from_values, valid = to_padded(values, offsets)
assert torch.equal(padded_from_values, padded)
assert torch.equal(from_padded(padded, offsets), values)
print("padded:", tuple(padded.shape), " mask:", tuple(valid.shape))
print("values:", tuple(values.shape), " offsets[:6]:", offsets[:6].tolist())

# %%
# A nested jagged tensor is the packed form
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.nested`` with ``layout=torch.jagged`` stores a ragged batch as
# exactly these two tensors: ``values()`` and ``offsets()``. It adds
# ``unbind()`` and ``to_padded_tensor()`` and lets some operations run on the
# batch as a whole. PyTorch's documentation says nested tensors are no
# longer under active development, so the rest of the site works on the plain
# pair of tensors and uses an NJT only where it is the fastest attention
# backend.

# without ``max_seqlen``, to_padded_tensor would pad to the total token count
njt = torch.nested.nested_tensor_from_jagged(values, offsets, max_seqlen=int(lengths.max()))  # (B, j, E)
# the same memory: building the NJT copied nothing
assert njt.values().data_ptr() == values.data_ptr() and torch.equal(njt.offsets(), offsets)
for original, piece in zip(sentences, njt.unbind()):
    assert torch.equal(piece, original)
torch.testing.assert_close(njt.to_padded_tensor(0.0), padded)
print("nested:", njt.shape, "(the j is the ragged dimension); values() and offsets() are ours")

# %%
# How much of a padded batch is padding?
# --------------------------------------
# Every sentence is stretched to the longest one, so the padded batch holds
# ``B * S_max`` token slots for ``sum(lengths)`` real tokens.
real_tokens, slots = int(lengths.sum()), BATCH * int(lengths.max())
print(f"real tokens {real_tokens}, padded slots {slots}: "
      f"{100 * (1 - real_tokens / slots):.1f}% of the padded batch is padding "
      f"({slots / real_tokens:.2f}x the tokens)")

# %%
# What padding costs a linear layer
# ---------------------------------
# A token-wise layer such as ``nn.Linear`` works on every slot it is given. On
# the packed values it runs on real tokens only, so the padded batch does
# ``slots / real_tokens`` times the work: that ratio is the *work bound* of
# this comparison, the speedup to expect if time follows the work. A small
# layer can beat it (time per call also pays fixed costs, and a smaller
# matrix may fit a faster cache) or fall short of it. We check that
# both give the same result on the real tokens, then time both with
# ``measure`` (the site's timing helper, from the building-blocks page): it
# uses ``torch.utils.benchmark``, lets the two take turns, and reports the
# median and the interquartile range (IQR) in milliseconds, and the peak
# memory in MiB.

import gc
import time
from dataclasses import dataclass

from torch.utils import benchmark


linear = torch.nn.Linear(EMBED, 4 * EMBED, device=DEVICE, dtype=DTYPE)
with torch.no_grad():
    torch.testing.assert_close(linear(values), linear(padded)[valid])
    times = measure({"padded": lambda: linear(padded), "packed": lambda: linear(values)},
                    min_run_time=RUN_TIME)
print("nn.Linear: packed and padded results agree on every real token")
for name, t in times.items():
    print(f"{name:>7}: {t}")
print(speedup_line("nn.Linear", times["padded"], times["packed"], slots / real_tokens))

# %%
# A linear layer's work is proportional to the number of token slots it
# sees, so the bound is what skipping padding can buy it, and the fraction
# says how much of that this device delivered. Attention is worse: its cost grows
# with the square of the padded length, and a padded batch also needs a mask
# to keep real tokens from attending to padding. The next pages build whole
# transformer layers and models that never see a pad token.
#
# Conclusion
# ----------
# A ragged batch is packed values plus offsets; a nested jagged tensor is the
# same two tensors. Token-wise layers run on the values directly and skip the
# padding, which for Zipf-distributed sentence lengths is most of a padded
# batch.
#
# Further reading
# ---------------
# * `torch.nested documentation <https://docs.pytorch.org/docs/stable/nested.html>`_
#   (note its status line: nested tensors are no longer under active development)
# * `Benchmark utilities <https://docs.pytorch.org/docs/stable/benchmark_utils.html>`_
#   (``torch.utils.benchmark``)
