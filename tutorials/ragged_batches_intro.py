"""
Ragged batches: padding and masks versus nested jagged tensors
==============================================================

A first look at batches of variable-length sequences in PyTorch: the same batch
stored padded with a mask and as a nested jagged tensor, and what the padding
costs a linear layer.

**Authors:** the ragged-transformers tutorial contributors

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How a padded batch with a mask and a nested jagged tensor (NJT)
         describe the same ragged batch
       * The NJT accessors ``offsets()``, ``values()``, ``unbind()`` and
         ``to_padded_tensor()``
       * How many of a padded batch's tokens are padding for realistic
         sentence lengths, and what that costs a ``nn.Linear``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.11 or later (checked on 2.11 and 2.13)
       * A CPU is enough; a CUDA GPU is used when present
"""

# sphinx_gallery_tags = ["nested tensors", "basics"]

# %%
# Device and sizes
# ----------------
# Every size on this page is set here, once, for the device the page runs on.
# ``TUTORIALS_QUICK=1`` shrinks them further for smoke tests; the assertions
# stay the same.
import os

import numpy as np
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUICK = os.environ.get("TUTORIALS_QUICK") == "1"
SEED = 0

if DEVICE == "cuda":
    BATCH, EMBED = 512, 1024  # the batch of the original tutorial
else:
    BATCH, EMBED = 256, 256  # small enough for a two-core laptop
if QUICK:
    BATCH, EMBED = 64, 128

print(f"device: {DEVICE}, batch: {BATCH} sequences, embedding: {EMBED}")
print(f"PyTorch {torch.__version__}")

# %%
# Sentence lengths that look like text
# ------------------------------------
# A sentence ends when a word is a full stop, an exclamation or a question mark.
# Under a Zipf(1.2) model of word frequencies, with those three at the ranks
# they have in the wikitext-2 corpus (3, 386 and 858), each word ends the
# sentence with the same probability ``p``, independently of the words before
# it. So a sentence's length, counted in words including the one that ends it,
# follows a geometric distribution, and a whole batch of lengths is one call to
# a seeded ``numpy.random.Generator``: no loop over words.


def zipf_stop_probability(alpha: float, stop_ranks=(3, 386, 858)) -> float:
    """P(a Zipf(alpha) word has one of ``stop_ranks``)."""
    ranks = np.arange(1, 1_000_001, dtype=np.float64)
    # zeta(alpha): the sum up to 1e6 plus the integral of the tail.
    zeta = (ranks**-alpha).sum() + 1_000_000 ** (1 - alpha) / (alpha - 1)
    return float(sum(r**-alpha for r in stop_ranks) / zeta)


def sentence_lengths(rng: np.random.Generator, batch: int, alpha: float = 1.2) -> torch.Tensor:
    return torch.from_numpy(rng.geometric(zipf_stop_probability(alpha), size=batch))


rng = np.random.default_rng(SEED)
torch.manual_seed(SEED)
lengths = sentence_lengths(rng, BATCH)
print(f"stop probability per word: {zipf_stop_probability(1.2):.4f}")
print(f"{BATCH} sentences, {lengths.sum().item()} tokens, "
      f"mean length {lengths.double().mean().item():.1f}, longest {lengths.max().item()}")

# %%
# The histogram has the long right tail of real text: most sentences are
# short, a few are very long, and the longest one sets the padded length.
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.hist(lengths.numpy(), bins=40, color="#4c72b0")
ax.axvline(lengths.max().item(), color="#c44e52", linestyle="--",
           label=f"padded length = {lengths.max().item()}")
ax.set_xlabel("sentence length (tokens)")
ax.set_ylabel("sentences")
ax.set_title(f"Zipf(1.2) sentence lengths, batch of {BATCH}")
ax.legend()
fig.tight_layout()

# %%
# The same batch, two ways
# ------------------------
# Start from a list of per-sentence tensors, one row of ``EMBED`` features per
# token. The padded form stacks them into a ``(B, S_max, E)`` tensor and keeps a
# ``(B, S_max)`` boolean mask of the real tokens. The nested jagged form keeps
# only the real tokens.
sentences = [torch.randn(int(n), EMBED, device=DEVICE) for n in lengths]

padded = torch.nn.utils.rnn.pad_sequence(sentences, batch_first=True)  # (B, S_max, E)
valid = torch.arange(padded.shape[1], device=DEVICE) < lengths.to(DEVICE)[:, None]  # (B, S_max)

njt = torch.nested.nested_tensor(sentences, layout=torch.jagged)  # (B, j, E)
print("padded:", tuple(padded.shape), "mask:", tuple(valid.shape))
print("nested:", njt.shape, "(the j is the ragged dimension)")

# %%
# Inside the nested tensor
# ~~~~~~~~~~~~~~~~~~~~~~~~
# An NJT is two dense tensors: ``values()``, every real token of the batch
# packed end to end, ``(total_tokens, E)``, and ``offsets()``, where each
# sentence starts in it, ``(B + 1,)``. Nothing else is stored.
values, offsets = njt.values(), njt.offsets()
print("values:", tuple(values.shape), " offsets[:6]:", offsets[:6].tolist())
torch.testing.assert_close(offsets.diff().cpu(), lengths)
assert values.shape[0] == lengths.sum().item()

# %%
# ``unbind()`` gives back the per-sentence tensors, as views into ``values()``;
# ``to_padded_tensor()`` makes the padded form when a dense tensor is needed.
for original, piece in zip(sentences, njt.unbind()):
    torch.testing.assert_close(piece, original)
torch.testing.assert_close(njt.to_padded_tensor(0.0), padded)
print("unbind() and to_padded_tensor() give back the original batch exactly")

# %%
# How much of a padded batch is padding?
# --------------------------------------
# Every sentence is stretched to the longest one, so the padded batch holds
# ``B * S_max`` token slots for ``sum(lengths)`` real tokens.
real_tokens = lengths.sum().item()
slots = BATCH * lengths.max().item()
print(f"real tokens {real_tokens}, padded slots {slots}: "
      f"{100 * (1 - real_tokens / slots):.1f}% of the padded batch is padding "
      f"({slots / real_tokens:.2f}x the tokens)")

# %%
# What padding costs a linear layer
# ---------------------------------
# A token-wise layer such as ``nn.Linear`` works on every slot it is given. On
# the NJT it runs on ``values()`` alone, so the padded batch does
# ``slots / real_tokens`` times the work. We check that both give the same
# result on the real tokens, then time both with ``torch.utils.benchmark``:
# it warms up, picks a number of runs per measurement, repeats, and reports the
# median and the interquartile range (IQR).
from torch.utils import benchmark

linear = torch.nn.Linear(EMBED, 4 * EMBED, device=DEVICE)

with torch.no_grad():
    out_padded = linear(padded)
    out_nested = linear(njt)
torch.testing.assert_close(out_nested.to_padded_tensor(0.0)[valid], out_padded[valid])
print("nn.Linear: nested and padded results agree on every real token")


def time_it(fn, *args, label: str) -> benchmark.Measurement:
    """Median time of ``fn(*args)`` after warm-up; device synchronized."""
    with torch.no_grad():
        fn(*args)  # warm-up
        timer = benchmark.Timer(stmt="fn(*args)", globals={"fn": fn, "args": args},
                                label="nn.Linear", description=label)
        return timer.blocked_autorange(min_run_time=0.2 if QUICK else 1.0)


t_padded = time_it(linear, padded, label="padded")
t_nested = time_it(linear, njt, label="nested")
for name, m in (("padded", t_padded), ("nested", t_nested)):
    print(f"{name:>7}: median {m.median * 1e3:7.2f} ms  IQR {m.iqr * 1e3:5.2f} ms "
          f"({len(m.times)} measurements)")
print(f"speedup {t_padded.median / t_nested.median:.2f}x, "
      f"bound set by padding {slots / real_tokens:.2f}x")

# %%
# The speedup tracks the bound because a linear layer's work is proportional
# to the number of token slots it sees. Attention is worse: its cost grows
# with the square of the padded length, and a padded batch also needs a mask
# to keep real tokens from attending to padding. The next tutorials build whole
# transformer layers that never see a pad token.
#
# Conclusion
# ----------
# A nested jagged tensor stores a ragged batch as packed ``values()`` plus
# ``offsets()``. Token-wise layers run on it directly and skip the padding,
# which for Zipf-distributed sentence lengths is most of a padded batch.
#
# Further reading
# ---------------
# * `torch.nested documentation <https://docs.pytorch.org/docs/stable/nested.html>`_
#   (note its status line: nested tensors are no longer under active development)
# * `Benchmark utilities <https://docs.pytorch.org/docs/stable/benchmark_utils.html>`_
#   (``torch.utils.benchmark``)
