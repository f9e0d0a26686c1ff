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
import logging


class _DropNotes(logging.Filter):
    def filter(self, record):
        return not record.getMessage().startswith(("is_fx_tracing", "Failed to pickle cache key"))


for _name in ("torch.fx._symbolic_trace", "torch._inductor.codecache"):
    logging.getLogger(_name).addFilter(_DropNotes())
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


def speedup_line(label, padded, ragged, bound):
    """The speedup of ``ragged`` over ``padded``, beside the work bound."""
    s = padded.median_ms / ragged.median_ms
    return f"{label}: speedup {s:.2f}x, work bound {bound:.2f}x, fraction of bound {s / bound:.2f}"


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
