"""
A packed GPT on real text: fixed-length rows against the best padded trainers
=============================================================================

Train a small modern GPT on real documents packed as ``torchtitan`` packs
them: the document stream cut into rows of a fixed length, each row a
packed batch with its offsets, so that every step has one shape. Measure it
against two padded trainers on the same documents, naive padding and the
length-grouped padding a careful practitioner uses, compiled where
compiling wins. Then a packed prefill of prompts of different lengths.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How one GPT (RMSNorm, rotary positions, SwiGLU, grouped-query
         attention) runs on a packed batch and, unchanged, on a padded one
       * How to pack documents into fixed-length rows, what cutting a
         document at a row's end costs, and how that differs from
         flattening each batch (Hugging Face's collator)
       * What packing buys over naive padding and over length-grouped
         padding, each beside its :term:`work bound`, and how a packed
         trainer compiles into one graph with no graph break
       * How to prefill packed prompts into a KV cache

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`transformer_building_blocks` (packed values and offsets,
         ``ragged_attention``) and :doc:`measuring_ragged_batches` (how the
         site times and chooses); the model and helpers come from the
         site's toolkit (:doc:`reference </toolkit>`)
       * PyTorch 2.11 or later; a CPU is enough, a CUDA GPU runs the page at
         a larger scale in ``bfloat16``
"""

# sphinx_gallery_tags = ["GPT", "training", "packing", "torch.compile", "benchmarks"]

# %%
# One model, two layouts
# ----------------------
# Every module of a transformer but attention works on the last dimension
# only: embeddings, linear layers, norms, activations and residuals treat a
# packed batch ``(T, dim)`` and a padded one ``(B, S, dim)`` alike. So one
# model can run on both, if attention alone is told which it got: a small
# *layout* object. ``Packed`` holds the offsets and calls
# ``ragged_attention``; ``Padded`` runs one SDPA call (right padding and
# ``is_causal``: a real token never sees a padding token, no mask needed).
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: Packed
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: Padded
#
# (The cache is for generation, at the end.) A tiny model on documents of
# 3, 1 and 4 tokens, packed and then padded, gives the same logits on every
# real token. Positions restart at every document: ``token_index`` gives
# them, exactly the ``position_ids`` of Hugging Face's packed format.

import torch
from ragged_toolkit.batches import offsets_from_lengths, to_padded, token_index
from ragged_toolkit.gpt import GPT, GPTConfig
from ragged_toolkit.layouts import PackedLayout, PaddedLayout

torch.manual_seed(0)
tiny = GPT(GPTConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                     max_seq_len=16))
tokens = torch.tensor([5, 9, 2, 7, 3, 3, 8, 1])  # (T,): documents of 3, 1 and 4 tokens
offsets = offsets_from_lengths([3, 1, 4])  # [0, 3, 4, 8]
ids, valid = to_padded(tokens, offsets)  # (B, S) = (3, 4), right padding
with torch.no_grad():
    packed = tiny(tokens, token_index(offsets)[1], PackedLayout(offsets, "loop"))  # (T, vocab)
    padded = tiny(ids, torch.arange(4).expand_as(ids), PaddedLayout())  # (B, S, vocab)
torch.testing.assert_close(packed, padded[valid])
print(f"packed logits {tuple(packed.shape)}, padded {tuple(padded.shape)}: equal on all 8 real tokens")

# %%
# Sizes
# ~~~~~
# Every size is set here, per device; :term:`quick mode` shrinks them. The
# tokens are bytes (a vocabulary of 256), so that no tokenizer is needed.
# A step is ``ROWS`` rows of ``ROW_LEN`` tokens. (Real runs: width 2048 and
# up, rows of 2,048 to 8,192 tokens, many rows per step.)

import numpy as np
from ragged_toolkit.device import default_device, default_dtype, quick_mode, quiet_known_notes
from ragged_toolkit.measuring.timing import TIMING_THREADS

DEVICE = default_device()
DTYPE = default_dtype(DEVICE)
torch.set_num_threads(TIMING_THREADS)  # as every timing of the site (measuring_ragged_batches)
QUICK = quick_mode()
SEED = 0
if DEVICE == "cuda":
    MODEL = dict(vocab_size=256, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_hidden=2816,
                 max_seq_len=2048)
    ROWS, STEPS, LR, PROMPTS = 8, 200, 1e-3, 64
else:
    MODEL = dict(vocab_size=256, dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=688,
                 max_seq_len=512)
    ROWS, STEPS, LR, PROMPTS = 2, 40, 6e-3, 16
if QUICK:
    MODEL.update(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=176, max_seq_len=256)
    ROWS, STEPS, LR, PROMPTS = 2, 24, 2e-2, 8
ROW_LEN = MODEL["max_seq_len"]  # a row is the model's context
WARMUP_STEPS = 3  # steps left out of every throughput figure (first calls, compiling)
print(f"PyTorch {torch.__version__}, device: {DEVICE}, dtype: {DTYPE}, quick: {QUICK}")
print("model: " + ", ".join(f"{k} {v}" for k, v in MODEL.items()))

# sphinx_gallery_start_ignore
quiet_known_notes()
# sphinx_gallery_end_ignore

# %%
# The model
# ---------
# The usual modern decoder-only stack, written flat in the style of
# ``gpt-fast``: a token embedding; blocks of RMSNorm, grouped-query attention
# with rotary position embeddings, RMSNorm and a SwiGLU feed-forward network,
# each with a residual connection; a final RMSNorm and an output layer.
# Attention computes q, k and v with one matmul, rotates q and k by each
# token's position, and hands them to the layout; ``n_heads / n_kv_heads``
# query heads share each key/value head.
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: Attention
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: GPT

cfg = GPTConfig(**MODEL)
torch.manual_seed(SEED)
model = GPT(cfg).to(DEVICE)  # every trainer starts from a copy of these weights
n_params = sum(p.numel() for p in model.parameters())
print(f"{n_params / 1e6:.2f} M parameters; {cfg.n_heads} query heads share {cfg.n_kv_heads} key/value heads")

# %%
# Documents packed into fixed-length rows
# ---------------------------------------
# Real text, offline: the docstrings of Python's standard library
# (``docstring_corpus`` parses them with ``ast`` and imports nothing), each
# a document of UTF-8 bytes, in a seeded random order. ``torchtitan`` packs
# such a stream as here: the documents end to end, cut every ``ROW_LEN``
# tokens. A document that crosses a row's end is *cut*: its rest opens the
# next row as a sequence of its own, without the context before the cut and
# the target across it. Every token slot holds a real token, and every step
# has one shape. The alternative, *carrying* a document that does not fit
# to the next row and padding the rest (``torchtune``'s default), keeps every
# document whole at the price of padding.
#
# .. literalinclude:: ../ragged_toolkit/data.py
#    :pyobject: split_by_token_budget

from ragged_toolkit.data import (
    concat_batches, docstring_corpus, pack_documents, split_by_token_budget, split_carrying_documents,
)

docs, source = docstring_corpus(min_chars=2)
rng = np.random.default_rng(SEED)
order = rng.permutation(len(docs))
held_out = [docs[i] for i in order[:PROMPTS]]  # prompts for generation, at the end: never trained on
stream_tokens, stream_offsets = pack_documents([docs[i] for i in order[PROMPTS:]])  # (T,), (B + 1,)
rows = split_by_token_budget(stream_tokens, stream_offsets, ROW_LEN)[:STEPS * ROWS]
steps = [concat_batches(rows[i:i + ROWS]) for i in range(0, len(rows), ROWS)]  # (ROWS * ROW_LEN,) each
n_docs = int(torch.searchsorted(stream_offsets, STEPS * ROWS * ROW_LEN))  # documents the rows touch
row_starts = torch.arange(ROW_LEN, STEPS * ROWS * ROW_LEN, ROW_LEN)
cut = int((~torch.isin(row_starts, stream_offsets)).sum())  # row starts inside a document
used = stream_offsets[:n_docs + 1].clone()
used[-1] = STEPS * ROWS * ROW_LEN
carried = split_carrying_documents(stream_tokens[:int(used[-1])], used, ROW_LEN)
carried_real = sum(len(t) for t, _ in carried) / (len(carried) * ROW_LEN)
print(f"corpus: {len(docs)} documents from {source}")
print(f"packing: {ROWS} rows of {ROW_LEN} tokens per step, 100% of token slots hold real tokens, "
      f"{cut} documents cut")
print(f"carrying them instead: {len(carried)} rows for the same tokens, {carried_real:.0%} of the slots real")

# %%
# Hugging Face's ``DataCollatorWithFlattening`` is the other common scheme:
# it flattens each batch of whole documents into one row, so the row's
# length changes with every batch (:doc:`hf_packed_training` trains that
# way). Nothing is cut, nothing is padded, and every step has a new shape,
# which a compiled model meets as a new input size.
#
# Two padded trainers
# -------------------
# The padded trainers see the same documents, whole (each cut at the
# context), batched two ways:
#
# * **naive**: in stream order, ``B`` documents per step, padded to the
#   longest of them;
# * **grouped**: as Hugging Face's ``group_by_length``: a window of a few
#   batches' documents is sorted by length and cut into batches, which are
#   shuffled, so that a batch holds documents of similar length and little
#   padding. It changes which documents share a step.
#
# ``B`` is chosen so that both make as many steps as the packed trainer.


def group_by_length(lengths, batch_size, window, rng):
    """Batches (lists of document indices) of ``batch_size``: each window of
    ``window`` batches' documents sorted by length, longest first, cut into
    batches; the batches then shuffled."""
    order = np.arange(len(lengths))
    batches = []
    for lo in range(0, len(order), batch_size * window):
        chunk = sorted(order[lo:lo + batch_size * window], key=lambda i: -lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


doc_lengths = stream_offsets[:n_docs + 1].diff().clamp(max=ROW_LEN)  # whole documents, cut at the context
B = -(-n_docs // STEPS)
naive = [list(range(i, min(i + B, n_docs))) for i in range(0, n_docs, B)]
grouped = group_by_length(doc_lengths.tolist(), B, window=4, rng=rng)


def padded_batch(indices):
    """Documents ``indices`` of the stream, packed (tokens, offsets)."""
    pieces = [stream_tokens[int(stream_offsets[i]):][:int(doc_lengths[i])] for i in indices]
    return torch.cat(pieces), offsets_from_lengths([len(p) for p in pieces])


for name, batches in (("naive", naive), ("grouped", grouped)):
    n = [doc_lengths[b] for b in batches]
    slots = sum(len(x) * int(x.max()) for x in n) / sum(int(x.sum()) for x in n)
    print(f"{name}: {len(batches)} steps of {B} documents, padded slots {slots:.2f}x the real tokens")
batches = {"packed": steps, "naive": [padded_batch(b) for b in naive],
           "grouped": [padded_batch(b) for b in grouped]}
batches = {name: [(t.to(DEVICE), o.to(DEVICE)) for t, o in b] for name, b in batches.items()}

# %%
# One training step, three ways
# -----------------------------
# The packed step feeds a step's rows as one packed batch, ``(T,)`` ids and
# offsets that mark every document and every row start. The padded step is
# the best padded trainer a reader would write: right-padded ``(B, S)`` ids,
# a causal kernel and no mask, the loss masked at padding. Both average the
# loss over the real targets, under autocast where the dtype is not float32.
# For ``torch.compile`` the packed rows have a third layout, ``PackedRows``:
# one SDPA call over the ``(ROWS, ROW_LEN)`` rows with a block-diagonal causal
# mask built before the model runs, so the compiled model is one graph (on
# CUDA, ``FlexRows``: FlexAttention with a document ``BlockMask``, which skips
# the blocks across documents).
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: PackedRows

import torch.nn.functional as F
from ragged_toolkit.data import document_targets
from ragged_toolkit.layouts import FlexRows, PackedRows

ROWS_LAYOUT = FlexRows if DEVICE == "cuda" else PackedRows


def autocast():
    return torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32)


def packed_loss(model, tokens, offsets, layout):
    with autocast():
        logits = model(tokens, token_index(offsets)[1], layout)  # (T, vocab)
    return F.cross_entropy(logits.float(), document_targets(tokens, offsets))


def padded_loss(model, tokens, offsets):
    ids, valid = to_padded(tokens, offsets)  # (B, S), right padding with id 0
    targets = to_padded(document_targets(tokens, offsets), offsets, -100)[0]
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with autocast():
        logits = model(ids, positions, PaddedLayout())  # (B, S, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# %%
# Before timing anything, the proof that they compute the same thing. On the
# first step's sequences, the packed step (the per-sequence loop backend)
# and the padded step of the same sequences on SDPA's math backend (matrix
# products and a softmax: no kernel shared) give the same loss and the same
# gradient for every parameter; on a GPU the check takes as many sequences as
# the math path's scores fit in 2 GiB (``math_check_sequences``). Then the
# rows layout, on the whole step and compiled as its trainer runs it, gives
# the packed step's loss and gradients.

import copy

from ragged_toolkit.attention.reference import math_check_sequences
from ragged_toolkit.device import tolerances
from torch.nn.attention import SDPBackend, sdpa_kernel


def loss_and_grads(loss_of):
    """The loss ``loss_of(model)`` on a copy of the model, and every gradient."""
    copy_ = copy.deepcopy(model)
    loss = loss_of(copy_)
    loss.backward()
    return loss, {n: p.grad for n, p in copy_.named_parameters()}


def check_same(name, got, want):
    torch.testing.assert_close(got[0], want[0], **tolerances(DTYPE), msg=lambda m: f"{name}, loss: {m}")
    for n, g in got[1].items():
        torch.testing.assert_close(g, want[1][n], **tolerances(DTYPE), msg=lambda m, n=n: f"{name}, {n}: {m}")
    return max((g - want[1][n]).abs().max().item() for n, g in got[1].items())


tokens, offsets = batches["packed"][0]
n = math_check_sequences(offsets.diff(), cfg.n_heads, cfg.n_layers, budget=2**31)
tokens_n, offsets_n = tokens[:int(offsets[n])], offsets[:n + 1]
packed_n = loss_and_grads(lambda m: packed_loss(m, tokens_n, offsets_n, PackedLayout(offsets_n, "loop")))
with sdpa_kernel(SDPBackend.MATH):
    padded_n = loss_and_grads(lambda m: padded_loss(m, tokens_n, offsets_n))
gap = check_same("padded, math path", padded_n, packed_n)
print(f"{n} sequences: loss {packed_n[0].item():.4f} packed, {padded_n[0].item():.4f} padded; "
      f"all {n_params} gradients agree (largest difference {gap:.1e})")
packed_step = loss_and_grads(lambda m: packed_loss(m, tokens, offsets, PackedLayout(offsets, "loop")))
rows_step = loss_and_grads(lambda m: packed_loss(torch.compile(m, fullgraph=True, dynamic=False), tokens,
                                                  offsets, ROWS_LAYOUT.from_offsets(offsets, ROW_LEN)))
gap = check_same("rows layout", rows_step, packed_step)
print(f"the whole step, {ROWS_LAYOUT.__name__}: the packed step's loss and gradients "
      f"(largest difference {gap:.1e})")

# %%
# Compile, or not
# ---------------
# Each trainer runs a few steps eager and compiled, on copies of the model,
# interleaved, and the rule of :doc:`measuring_ragged_batches` chooses
# (within the noise: eager). The packed trainer compiles the rows layout,
# one shape, ``fullgraph=True`` (a graph break would be an error); the padded
# trainers, whose batch shape changes every step, compile with dynamic
# shapes. The step time is per thousand real tokens; compiles fall into the
# warm-up steps, left out. Each compiled trainer's graphs and graph breaks
# are counted over its steps; a trainer that meets a graph already compiled
# compiles none (the grouped trainer runs the naive one's model code).

from ragged_toolkit.measuring.timing import StepTimer, warm_every_shape
from ragged_toolkit.measuring.noise import choose


def trainer(name, compiled):
    """A training step for trainer ``name``: a copy of the model, AdamW, and
    the step's loss, through ``torch.compile`` where ``compiled``."""
    copy_ = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(copy_.parameters(), lr=LR)
    if name == "packed":
        runner = torch.compile(copy_, fullgraph=True, dynamic=False) if compiled else copy_

        def loss_of(tokens, offsets):
            layout = ROWS_LAYOUT.from_offsets(offsets, ROW_LEN) if compiled else PackedLayout(offsets)
            return packed_loss(runner, tokens, offsets, layout)
    else:
        runner = torch.compile(copy_, dynamic=True) if compiled else copy_

        def loss_of(tokens, offsets):
            return padded_loss(runner, tokens, offsets)

    def step(tokens, offsets):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(tokens, offsets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step, copy_


if DEVICE == "cuda":  # cuDNN builds a plan per new shape: every trainer meets every shape before any timing
    for name in batches:
        warm_every_shape(lambda batch, step=trainer(name, False)[0]: step(*batch), batches[name],
                         lambda batch: (len(batch[1]) - 1, int(batch[1].diff().max())))  # (B, S) padded
PROBE = WARMUP_STEPS + (3 if QUICK else 6)
torch._dynamo.reset()  # the graphs of the checks above out: each trainer's count starts here
probes = {(name, c): (trainer(name, c == "compiled")[0], StepTimer())
          for name in batches for c in ("eager", "compiled")}
for i in range(PROBE):
    for (name, _), (step, timer) in probes.items():
        tokens_i, offsets_i = batches[name][i]
        with timer.step(len(tokens_i)):
            step(tokens_i, offsets_i)
COMPILE = {}
for name in batches:
    timings = {c: probes[name, c][1].per_1k_tokens(WARMUP_STEPS) for c in ("eager", "compiled")}
    compiled_timer = probes[name, "compiled"][1]
    print(f"compiled trainer {name}: {sum(compiled_timer.graphs)} graphs for {PROBE} steps, "
          f"{sum(compiled_timer.breaks)} graph breaks")
    assert sum(compiled_timer.breaks) == 0, f"the compiled {name} trainer broke its graph"
    COMPILE[name] = choose(timings, "eager", f"{name} trainer (ms per 1k tokens)") == "compiled"

# %%
# Training
# --------
# Same initial weights, same documents, same optimizer (AdamW), each trainer
# compiled or not as chosen above. The three take turns, one step each, so
# that whatever else the machine does slows all alike. Throughput counts
# *real* tokens after the first ``WARMUP_STEPS``; a graph compiled inside
# the timed steps would be timed as training, so there must be none.

trainers = {name: (*trainer(name, COMPILE[name]), StepTimer(), []) for name in batches}
for i in range(STEPS):
    for name, (step, _, timer, losses) in trainers.items():
        if i < len(batches[name]):
            tokens_i, offsets_i = batches[name][i]
            with timer.step(len(tokens_i)):
                losses.append(step(tokens_i, offsets_i).item())
for name, (_, _, timer, losses) in trainers.items():
    assert sum(timer.graphs[WARMUP_STEPS:]) == 0, f"{name}: a graph was compiled inside the timed steps"
    print(f"{name:8s} loss {np.mean(losses[:3]):.3f} -> {np.mean(losses[-5:]):.3f}, "
          f"{timer.tokens_per_s(WARMUP_STEPS):.0f} real tokens/s ({'compiled' if COMPILE[name] else 'eager'})")

# %%
# The work bounds of this run
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What each trainer must compute per real token: ``2 x`` the weights of
# every matrix per token, and ``4 H D`` per query-key pair and layer, the
# causal half on every side (the padded causal kernel skips the masked half
# too). Each padded trainer's bound is computed from its own batches.

from ragged_toolkit.measuring.bound import work_per_token

per_token = 2 * (n_params - cfg.vocab_size * cfg.dim)  # every matrix but the embedding
per_pair = cfg.n_layers * 4 * cfg.n_heads * cfg.head_dim


def lengths_of(name):  # the sequence lengths of each timed step of trainer ``name``
    return [o.diff().cpu() for _, o in batches[name][WARMUP_STEPS:STEPS]]


packed_work = work_per_token(lengths_of("packed"), per_token, per_pair)
R = trainers["packed"][2].tokens_per_s(WARMUP_STEPS)
for name, label in (("naive", "training"), ("grouped", "training against length-grouped padding")):
    bound = work_per_token(lengths_of(name), per_token, per_pair, padded=True) / packed_work
    P = trainers[name][2].tokens_per_s(WARMUP_STEPS)
    print(f"{label}: ragged {R:.0f} tokens/s, padded {P:.0f} tokens/s, speedup {R / P:.2f}x, "
          f"work bound {bound:.2f}x, fraction {R / P / bound:.2f}")

# %%
# The last number is the :term:`fraction of the bound`. Against naive
# padding, the bound is what padding a random batch to its longest document
# costs, and packing turns it into speed. Against length-grouped padding
# the bound is small on this corpus: sorted windows leave little padding, so
# packing buys little speed there. What it still buys: one shape for every
# step (one compiled graph, no recompiles), a memory footprint that does not
# depend on which documents meet in a step, and batches whose composition
# does not depend on length, where grouping puts the long documents
# together. Where lengths have a long tail and no grouping is done, packing
# buys speed too.
#
# The loss curves: the trainers see the same documents in different
# batches, so their curves differ by the batches they saw, not only by
# rounding; the page asserts that each learned at least how often each byte
# occurs (the mean of its last five losses below 70% of a uniform guess over
# the 256 bytes, ln 256 = 5.55 nats) and prints the spread of the last
# losses.

import math

import matplotlib.pyplot as plt
from ragged_toolkit.figures import FIGURE_STYLE

uniform = math.log(cfg.vocab_size)
for name, (_, _, _, losses) in trainers.items():
    last = np.array(losses[-5:])
    assert last.mean() < 0.7 * uniform, f"{name} did not learn: {losses[0]:.3f} -> {last.mean():.3f}"
    print(f"{name:8s} last five losses {last.mean():.3f} +- {last.std():.3f}")

plt.rcParams.update(FIGURE_STYLE)
fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
for (name, (_, _, timer, losses)), style in zip(trainers.items(), ("-o", "--s", ":^")):
    ax.plot(np.cumsum(timer.seconds), losses, style, markevery=max(1, STEPS // 8), lw=2,
            label=f"{name}, {timer.tokens_per_s(WARMUP_STEPS):.0f} real tokens/s")
ax.set(xlabel="seconds of training (measured)", ylabel="training loss",
       title=f"Same documents, three trainers ({DEVICE})")
ax.legend()
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# Prefill
# -------
# The trained packed model now reads a batch of prompts, the openings of
# documents no step trained on, of different lengths. Prefill runs every
# prompt at once and writes each token's keys and values into a cache:
# packed, it computes the real tokens only; padded (left-padded, as
# Hugging Face's ``generate`` pads prompts), every prompt is as long as the
# longest, with a mask that also hides the padding.
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: prefill_packed

from ragged_toolkit.attention import default_backend
from ragged_toolkit.measuring.bound import pairs_scored, speedup_line
from ragged_toolkit.data import as_tokens
from ragged_toolkit.kv_cache import KVCache
from ragged_toolkit.decoding import generate_packed, prefill_packed
from ragged_toolkit.measuring.timing import measure
from ragged_toolkit.measuring.tables import print_timings

model = trainers["packed"][1].eval()  # the packed trainer's model (not the compiled wrapper)
prompt_docs = [d[:8 + 3 * i] for i, d in enumerate(held_out)]  # openings of 8 to 8 + 3 (B - 1) bytes
prompt_lengths = torch.tensor([len(d) for d in prompt_docs])
prompt_offsets = offsets_from_lengths(prompt_lengths, DEVICE)
prompts = torch.cat([as_tokens(d) for d in prompt_docs]).to(DEVICE)
longest = int(prompt_lengths.max())


@torch.no_grad()
def prefill_padded(model, prompts, offsets, cache):
    """The same prompts left-padded to (B, S) into ``cache``: the logits of
    each prompt's last token (B, vocab)."""
    lengths = offsets.diff()
    S, pad = int(lengths.max()), int(lengths.max()) - lengths  # (B,) padding columns on the left
    seq, pos = token_index(offsets)
    ids = torch.zeros(len(lengths), S, dtype=torch.long, device=prompts.device)
    ids[seq, pad[seq] + pos] = prompts
    column = torch.arange(S, device=prompts.device)
    valid = column >= pad[:, None]  # (B, S)
    causal = column[:, None] >= column
    mask = (causal & valid[:, None, :]) | (~valid[:, :, None] & (column[:, None] == column))  # (B, S, S)
    return model(ids, (column - pad[:, None]).clamp(min=0), PaddedLayout(mask[:, None], cache, 0))[:, -1]


caches = {side: KVCache(cfg, PROMPTS, longest + 8, DEVICE, DTYPE) for side in ("packed", "padded")}
backend = default_backend(DEVICE, DTYPE)
with autocast():
    prefills = {"padded": lambda: prefill_padded(model, prompts, prompt_offsets, caches["padded"]),
                "packed": lambda: prefill_packed(model, prompts, prompt_offsets, caches["packed"], backend)}
    torch.testing.assert_close(prefills["packed"]().float(), prefills["padded"]().float(),
                               **tolerances(DTYPE))
    times = measure(prefills, min_run_time=0.5 if QUICK else 1.0)
print(f"prefill of {PROMPTS} prompts ({len(prompts)} tokens, longest {longest}): the last-token logits agree")
print_timings(times)
prefill_bound = ((per_token * PROMPTS * longest + per_pair * PROMPTS * pairs_scored([longest], [longest], True))
                 / (per_token * len(prompts) + per_pair * pairs_scored(prompt_lengths, prompt_lengths, True)))
print(speedup_line("prefill", times["padded"], times["packed"], prefill_bound))

# %%
# Decoding then feeds one token per sequence per step: a rectangle on both
# sides, so packing removes no work there; :doc:`ragged_decoding_kv_cache_gqa`
# measures it, and the KV cache itself. What the model learned: a few
# prompts, and the bytes greedy decoding writes after them (after ``|``). A
# model this small, trained for seconds on a CPU, has learned the most
# frequent bytes and words of English docstrings and little else.

with torch.no_grad():
    written = generate_packed(model, prompts, prompt_offsets, 24, dtype=DTYPE)
for b in range(min(4, PROMPTS)):
    text = prompt_docs[b].decode(errors="replace") + " | " + bytes(written[b].tolist()).decode(errors="replace")
    print(repr(text)[:100])

# %%
# Conclusion
# ----------
# A packed trainer is the padded trainer minus the padding: the same
# modules, loss and optimizer, proved to compute the same loss and
# gradients. Packed into fixed-length rows, as ``torchtitan`` packs, every
# step has one shape and compiles into one graph with no graph break; the
# documents cut at the rows' ends lose a little context. The two training
# lines say what this device turned into speed: against naive padding, the
# padding of random batches; against length-grouped padding, little padding
# to remove, so there packing's gains are one shape, predictable memory and
# batches mixed independently of length.
#
# Further reading
# ---------------
# * `torchtitan <https://github.com/pytorch/torchtitan>`_ (document packing,
#   document masks) and `torchtune <https://github.com/pytorch/torchtune>`_
#   (``PackedDataset``)
# * `Packing with FlashAttention 2 <https://huggingface.co/blog/packing-with-FA2>`_
# * `gpt-fast <https://github.com/meta-pytorch/gpt-fast>`_ (the model's style,
#   the KV cache)
# * Ainslie et al., `GQA <https://arxiv.org/abs/2305.13245>`_; Su et al.,
#   `RoFormer <https://arxiv.org/abs/2104.09864>`_; Shazeer,
#   `GLU variants <https://arxiv.org/abs/2002.05202>`_
