"""
A packed GPT on real text: fixed-length rows against the best padded trainers
=============================================================================

Train a small modern GPT on real documents packed as ``torchtitan`` packs
them. The document stream is cut into rows of a fixed length. Each row is a
packed batch with its offsets, so every step has one shape. The page
measures it against two padded trainers on the same documents: naive
padding, and the length-grouped padding a careful practitioner uses. A
measurement on this device decides whether each trainer runs eager or
compiled. Then a packed prefill of prompts of different lengths.

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
         training step compiles with ``fullgraph=True``, with no graph break
       * How to prefill packed prompts into a KV cache

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`transformer_building_blocks` (packed values and offsets,
         ``plan_batch`` and ``ragged_attention``) and
         :doc:`measuring_ragged_batches` (how the site times and chooses);
         the model and helpers come from the site's toolkit
         (:doc:`reference </toolkit>`)
       * PyTorch 2.11 or later; a CPU is enough, a CUDA GPU runs the page at
         a larger scale in ``bfloat16``
"""

# sphinx_gallery_tags = ["GPT", "training", "packing", "torch.compile", "benchmarks"]

# %%
# Sizes
# -----
# Every size is set here, per device. :term:`quick mode`, the test suite's
# small run, shrinks them. The tokens are bytes (a vocabulary of 256), so that
# no tokenizer is needed. A step is ``rows`` rows of the model's context
# (``max_seq_len`` tokens). A run reads ``train_tokens`` tokens of the
# ``corpus_documents`` documents it asks the corpus for. Real runs: width 2048
# and up, rows of 2,048 to 8,192 tokens, many rows per step, billions of
# tokens.

from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(
        model=dict(
            vocab_size=256,
            dim=1024,
            n_layers=4,
            n_heads=16,
            n_kv_heads=4,
            ffn_hidden=2816,
            max_seq_len=2048,
        ),
        rows=8,
        train_tokens=1_048_576,
        corpus_documents=6000,
        lr=1e-3,
        prompts=64,
    ),  # 64 steps
    "cpu": dict(
        model=dict(
            vocab_size=256,
            dim=256,
            n_layers=2,
            n_heads=8,
            n_kv_heads=2,
            ffn_hidden=688,
            max_seq_len=512,
        ),
        rows=2,
        train_tokens=40_960,
        corpus_documents=3000,
        lr=6e-3,
        prompts=16,
    ),  # 40 steps
    "quick": dict(
        model=dict(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=176, max_seq_len=256),
        rows=2,
        train_tokens=12_288,
        corpus_documents=1000,
        lr=2e-2,
        prompts=8,
    ),  # 24 steps
}
setup = page_setup(SIZES)  # device, dtype, quick mode, one CPU thread, the seed; prints them
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
ROW_LEN = S.model["max_seq_len"]  # a row is the model's context
WARMUP_STEPS = 3  # steps left out of every throughput figure (first calls, compiling)

# %%
# One model, two layouts
# ----------------------
# Every module of a transformer but attention works on the last dimension
# only. Embeddings, linear layers, norms, activations and residuals treat a
# packed batch ``(T, dim)`` and a padded one ``(B, S, dim)`` alike. So one
# model can run on both, if attention alone is told which it got. A small
# object tells it: the :term:`layout`, how attention reads the batch.
#
# * ``PackedLayout`` is the :term:`packed layout`. It holds the batch's
#   :term:`plan` and calls ``ragged_attention``. The plan is what
#   ``plan_batch`` reads from the offsets, once per batch (here: causal).
# * ``PaddedLayout`` is the :term:`padded layout`. It runs one SDPA call.
#   With right padding and ``is_causal``, a real token never sees a padding
#   token, so no mask is needed.
#
# .. literalinclude:: ../ragged_toolkit/layouts.py
#    :pyobject: PackedLayout
#
# .. literalinclude:: ../ragged_toolkit/layouts.py
#    :pyobject: PaddedLayout
#
# (The cache is for generation, at the end.) A tiny model runs on documents
# of 3, 1 and 4 tokens, packed and then padded. It gives the same logits on
# every real token. Positions restart at every document. ``token_index``
# gives them: exactly the ``position_ids`` of Hugging Face's packed format.

import torch
from ragged_toolkit.batches import offsets_from_lengths, to_padded, token_index
from ragged_toolkit.gpt import GPT, GPTConfig
from ragged_toolkit.layouts import PackedLayout, PaddedLayout

tiny = GPT(
    GPTConfig(
        vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16
    )
)
tokens = torch.tensor([5, 9, 2, 7, 3, 3, 8, 1])  # (T,): documents of 3, 1 and 4 tokens
offsets = offsets_from_lengths([3, 1, 4])  # [0, 3, 4, 8]
ids, valid = to_padded(tokens, offsets)  # (B, S) = (3, 4), right padding
with torch.no_grad():
    packed = tiny(tokens, token_index(offsets)[1], PackedLayout.of(offsets, "loop"))  # (T, vocab)
    padded = tiny(ids, torch.arange(4).expand_as(ids), PaddedLayout())  # (B, S, vocab)
torch.testing.assert_close(packed, padded[valid])
print(
    f"packed logits {tuple(packed.shape)}, padded {tuple(padded.shape)}: equal on all 8 real tokens"
)

# %%
# The model
# ---------
# The usual modern decoder-only stack, written flat in the style of
# ``gpt-fast``:
#
# * a token embedding;
# * blocks of RMSNorm, grouped-query attention with rotary position
#   embeddings, RMSNorm and a SwiGLU feed-forward network, each with a
#   residual connection;
# * a final RMSNorm and an output layer.
#
# Attention computes q, k and v with one matmul. It rotates q and k by each
# token's position and hands them to the layout. In grouped-query attention,
# ``n_heads / n_kv_heads`` query heads share each key/value head.
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: _apply_rope
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: Attention
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: GPT

cfg = GPTConfig(**S.model)
torch.manual_seed(setup.seed)
model = GPT(cfg).to(DEVICE)  # every trainer starts from a copy of these weights
n_params = sum(p.numel() for p in model.parameters())
print(
    f"{n_params / 1e6:.2f} M parameters; {cfg.n_heads} query heads share {cfg.n_kv_heads} key/value heads"
)

# %%
# Documents packed into fixed-length rows
# ---------------------------------------
# Real text, offline: the docstrings of Python's standard library, in a seeded
# random order. ``docstring_corpus`` parses them with ``ast`` and imports
# nothing. Each docstring is a document of UTF-8 bytes. ``torchtitan`` packs
# such a stream as here: the documents end to end, cut every ``ROW_LEN``
# tokens. A document that crosses a row's end is *cut*. Its rest opens the next
# row as a sequence of its own. The rest starts without the context before the
# cut, and the target across the cut is lost. Every token slot holds a real
# token, and every step has one shape. The run takes ``train_tokens`` tokens,
# or as many whole steps as the corpus holds, and says which.
#
# The alternative is *carrying* (``torchtune``'s default). A document that
# does not fit moves to the next row, and the rest of the row is padding.
# Every document stays whole, at the price of padding.
#
# .. literalinclude:: ../ragged_toolkit/data.py
#    :pyobject: split_by_token_budget

import numpy as np
from ragged_toolkit.data import concat_batches, pack_documents, split_by_token_budget
from ragged_site.corpus import docstring_corpus
from ragged_site.gpt_training import print_corpus, print_packing

docs, source = docstring_corpus(min_chars=2, limit=S.corpus_documents)
rng = np.random.default_rng(setup.seed)
order = rng.permutation(len(docs))
# prompts for generation, at the end: never trained on
held_out = [docs[i] for i in order[: S.prompts]]
# the other documents end to end: tokens (T,), offsets (B + 1,)
stream_tokens, stream_offsets = pack_documents([docs[i] for i in order[S.prompts :]])
# whole steps, never more than the corpus holds
STEPS = min(S.train_tokens, len(stream_tokens)) // (S.rows * ROW_LEN)
n_tokens = STEPS * S.rows * ROW_LEN
print_corpus(docs, source, stream_tokens, n_tokens, STEPS, asked=S.train_tokens)
rows = split_by_token_budget(stream_tokens[:n_tokens], stream_offsets, ROW_LEN)  # STEPS * rows rows
# each step (rows * ROW_LEN,): S.rows rows end to end
steps = [concat_batches(rows[i : i + S.rows]) for i in range(0, len(rows), S.rows)]
n_docs = int(torch.searchsorted(stream_offsets, n_tokens))  # the documents the rows touch
assert n_docs >= STEPS, f"{n_docs} documents for {STEPS} padded steps: make each step longer"
print_packing(stream_tokens, stream_offsets, rows, ROW_LEN, S.rows, n_docs)  # cut and carried

# %%
# Hugging Face's ``DataCollatorWithFlattening`` instead flattens each batch
# of whole documents into one row (:doc:`hf_packed_training`). Nothing is
# cut and nothing is padded. But every step has a new shape: a new input
# size to compile.
#
# Two padded trainers
# -------------------
# The padded trainers see the same documents, whole, each cut at the model's
# context. They take as many steps as the packed trainer, ``B`` documents a
# step. These are the documents the rows touch, and the next few of the stream
# to fill the last step. Where the corpus has no more, ``B`` rounds down and
# leaves a few out. Two ways to batch them:
#
# * **naive**: in stream order, each batch padded to its longest document;
# * **grouped**: as Hugging Face's ``group_by_length`` does. The documents
#   of a window of a few batches are sorted by length, cut into batches
#   again, then shuffled. Little padding is left, but which documents share
#   a step depends on their length.
#
# .. literalinclude:: ../ragged_toolkit/data.py
#    :pyobject: group_by_length

from ragged_toolkit.data import group_by_length
from ragged_site.gpt_training import padded_batches

B = min(-(-n_docs // STEPS), (len(stream_offsets) - 1) // STEPS)  # documents per padded step
# whole documents, cut at the context
doc_lengths = stream_offsets[: STEPS * B + 1].diff().clamp(max=ROW_LEN)
print(
    f"padded trainers: {STEPS} steps of {B} documents, {STEPS * B} for the {n_docs} the rows touch"
)
naive = [range(i * B, (i + 1) * B) for i in range(STEPS)]  # in stream order
grouped = group_by_length(doc_lengths.tolist(), B, 4, rng)  # sorted in windows of 4 batches
padded_steps = padded_batches(
    stream_tokens, stream_offsets, doc_lengths, {"naive": naive, "grouped": grouped}
)
batches = {"packed": steps, **padded_steps}  # (tokens, offsets) of each step, each trainer
assert {len(b) for b in batches.values()} == {STEPS}, "every trainer makes as many steps"
batches = {name: [(t.to(DEVICE), o.to(DEVICE)) for t, o in b] for name, b in batches.items()}

# %%
# One training step, three ways
# -----------------------------
# The packed step feeds a step's rows as one packed batch: ``(T,)`` ids and
# offsets. The offsets mark every document and every row start. The batch's
# plan runs on the documented default backend. The padded step is the best
# padded trainer a reader would write. It takes right-padded ``(B, S)`` ids and
# a causal kernel with no mask, and masks the loss at padding. Both average the
# loss over the real targets, under autocast where the dtype is not float32.
#
# .. literalinclude:: ../ragged_site/gpt_training.py
#    :pyobject: padded_loss

import torch.nn.functional as F
from ragged_toolkit.attention import backend_support, default_backend, plan_batch
from ragged_toolkit.data import document_targets
from ragged_site.gpt_training import padded_loss

EAGER_BACKEND = default_backend(DEVICE, DTYPE, cfg.head_dim)


def autocast():
    return torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32)


def packed_loss(model, tokens, offsets, layout):
    with autocast():
        logits = model(tokens, token_index(offsets)[1], layout)  # (T, vocab)
    return F.cross_entropy(logits.float(), document_targets(tokens, offsets))


# %%
# Before timing anything, the proof that they compute the same thing. It runs
# on the first step's sequences. The packed step uses the per-sequence loop
# backend. The padded step of the same sequences uses SDPA's math backend:
# matrix products and a softmax, so no kernel is shared. Both give the same
# loss and the same gradient for every parameter. On a GPU the check takes as
# many sequences as the math path's scores fit in 2 GiB
# (``math_check_sequences``).

from ragged_site.gpt_training import check_same, loss_and_grads
from ragged_site.reference import math_check_sequences
from ragged_site.page import tolerances
from torch.nn.attention import SDPBackend, sdpa_kernel

tokens, offsets = batches["packed"][0]
n = math_check_sequences(offsets.diff(), cfg.n_heads, cfg.n_layers, budget=2**31)
tokens_n, offsets_n = tokens[: int(offsets[n])], offsets[: n + 1]
layout_n = PackedLayout.of(offsets_n, "loop")
packed_n = loss_and_grads(model, lambda m: packed_loss(m, tokens_n, offsets_n, layout_n))
with sdpa_kernel(SDPBackend.MATH):
    padded_n = loss_and_grads(model, lambda m: padded_loss(m, tokens_n, offsets_n, DTYPE))
gap = check_same("padded, math path", padded_n, packed_n, DTYPE)
print(
    f"{n} sequences: loss {packed_n['loss'].item():.4f} packed, {padded_n['loss'].item():.4f} padded; "
    f"all {n_params} gradients agree (largest difference {gap:.1e})"
)

# %%
# Compile, or not
# ---------------
# ``ragged_attention`` given the batch's plan compiles into a model's graph
# with ``fullgraph=True`` (a graph break is an error). The graph is specialized
# to what the plan holds as Python values. The loop backend's plan holds every
# sequence's length: a graph for every batch of new lengths. FlexAttention's
# plan holds a ``BlockMask`` of one shape for every step of ``rows * ROW_LEN``
# tokens: one graph. So the compiled packed trainer takes the flex plan where
# FlexAttention trains. Elsewhere (a CPU, where FlexAttention has no backward)
# it takes ``PackedRows``, the :term:`rows layout`: documents packed into
# fixed-length rows. It makes one SDPA call over the ``(rows, ROW_LEN)`` rows
# with a block-diagonal causal mask. Every shape is fixed.
#
# .. literalinclude:: ../ragged_toolkit/layouts.py
#    :pyobject: PackedRows
#
# Each trainer runs a few steps eager and compiled, on copies of the model,
# interleaved. The rule of :doc:`measuring_ragged_batches` then chooses, on the
# time per thousand real tokens after the warm-up steps. Compiling falls in
# those warm-up steps. Within the noise, the rule chooses eager. The padded
# trainers compile with dynamic shapes. Each compiled trainer's graphs and
# graph breaks are counted over its steps. A trainer that meets a graph already
# compiled compiles none: the grouped trainer may meet the naive one's. A
# ``Trainer`` holds a model, compiled or not, its optimizer and its losses.
#
# .. literalinclude:: ../ragged_site/gpt_training.py
#    :pyobject: Trainer

from ragged_toolkit.layouts import PackedRows
from ragged_site.gpt_training import Trainer

why_not_flex = backend_support(
    "flex", DEVICE, DTYPE, is_causal=True, needs_grad=True, head_dim=cfg.head_dim
)


def packed_layout(offsets, compiled):
    """The packed step's layout: eager, the batch's plan, built once per batch;
    inside ``torch.compile``, the flex plan where FlexAttention trains, else the rows layout."""
    if not compiled:
        return PackedLayout(plan_batch(offsets, backend=EAGER_BACKEND, is_causal=True))
    if why_not_flex is None:
        return PackedLayout(plan_batch(offsets, backend="flex", is_causal=True))
    return PackedRows.from_offsets(offsets, ROW_LEN)


def new_trainer(kind, model, compiled=False):
    """A trainer of ``kind`` (packed, naive, grouped) on ``model``: AdamW, and
    its step's loss; a compiled padded trainer takes dynamic shapes."""
    if kind != "packed":
        return Trainer(
            model, lambda m, t, o: padded_loss(m, t, o, DTYPE), S.lr, compiled, dynamic=True
        )
    return Trainer(
        model, lambda m, t, o: packed_loss(m, t, o, packed_layout(o, compiled)), S.lr, compiled
    )


print(
    f"compiled packed trainer: {'the flex plan' if why_not_flex is None else 'PackedRows'} "
    f"({why_not_flex or 'FlexAttention trains here'}); eager: the {EAGER_BACKEND} plan"
)

# %%
# On a GPU, every trainer first meets every batch shape (cuDNN plans one per
# shape), through the step it is timed with.

from ragged_site.gpt_training import probe_compile

# prints each compiled trainer's graphs and breaks, then each choice
COMPILE = probe_compile(new_trainer, model, batches, WARMUP_STEPS, setup.quick, DEVICE)

# %%
# From the same weights, on the first batch, the compiled packed step gives
# the eager step's loss and gradients. Its graph was compiled above.

tokens, offsets = batches["packed"][0]
layout = PackedLayout.of(offsets, "loop")
packed_step = loss_and_grads(model, lambda m: packed_loss(m, tokens, offsets, layout))
compiled_step = loss_and_grads(
    model, lambda m: new_trainer("packed", m, True).loss(tokens, offsets)
)
gap = check_same("compiled packed step", compiled_step, packed_step, DTYPE)
print(
    f"the compiled packed step: the eager step's loss and gradients (largest difference {gap:.1e})"
)

# %%
# Training
# --------
# Same initial weights, same documents, same optimizer (AdamW), each trainer
# compiled or eager as chosen above. The three take turns, one step each, so
# that whatever else the machine does slows all alike. Throughput counts
# *real* tokens after the first ``WARMUP_STEPS``. A graph compiled inside
# the timed steps would be timed as training, so there must be none.

import copy

from ragged_site.gpt_training import train_side_by_side

models = {name: copy.deepcopy(model) for name in batches}
trainers = {kind: new_trainer(kind, models[kind], COMPILE[kind]) for kind in batches}
timers = train_side_by_side(trainers, batches, STEPS, WARMUP_STEPS)  # kind -> its step timer
losses = {kind: trainer.losses for kind, trainer in trainers.items()}
for kind, timer in timers.items():
    print(
        f"{kind:8s} loss {np.mean(losses[kind][:3]):.3f} -> {np.mean(losses[kind][-5:]):.3f}, "
        f"{timer.tokens_per_s(WARMUP_STEPS):.0f} real tokens/s ({'compiled' if COMPILE[kind] else 'eager'})"
    )

# %%
# The work bounds of this run
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The :term:`work bound` is the padded trainer's work over the packed one's:
# the speedup to expect if time followed work. ``model_work`` counts what each
# trainer must compute per real token. Per token, that is twice the weights of
# every matrix. Per query-key pair, it is the scores and the sum over values,
# in every layer. Every side counts the causal half only: the padded causal
# kernel skips the masked half too. Each padded trainer's bound comes from its
# own batches. The :term:`fraction of the bound` is the measured speedup over
# the bound. :doc:`measuring_ragged_batches` explains how to read it.

from ragged_site.measuring.bound import model_work
from ragged_site.gpt_training import print_training_speed

work = model_work(model, n_layers=cfg.n_layers, attention_width=cfg.n_heads * cfg.head_dim)
# each padded trainer's bound from its own timed steps; medians within or outside the noise
print_training_speed(timers, batches, work, WARMUP_STEPS)

# %%
# Against naive padding, the bound is what padding a random batch to its
# longest document costs. Against length-grouped padding, it is what sorted
# windows leave. The lines above say what this run turned into speed, and
# whether its steps differ beyond the noise. Packing buys three things even
# where the bound is small:
#
# * one shape for every step, ``rows * ROW_LEN`` tokens (the compiled packed
#   trainer's graphs are counted above);
# * a memory footprint that does not depend on which documents meet in a
#   step;
# * batches whose make-up does not depend on length. Grouping puts the long
#   documents together.
#
# The loss curves differ by the batches each trainer saw, not only by rounding.
# The page asserts that each learned at least how often each byte occurs. Its
# last five losses must be below 70% of a uniform guess over 256 bytes
# (ln 256 = 5.55 nats). The page also prints the spread of the last losses.

from ragged_site.gpt_training import check_learned, plot_training

check_learned(losses, cfg.vocab_size)  # each below 70% of ln(vocab_size)
plot_training(timers, losses, WARMUP_STEPS, DEVICE)  # loss against measured seconds

# sphinx_gallery_thumbnail_number = 1

# %%
# Prefill
# -------
# The trained packed model now reads a batch of prompts of different lengths.
# They are the openings of documents no step trained on. Prefill runs every
# prompt at once and writes each token's keys and values into a cache. Packed,
# it computes the real tokens only. Padded, every prompt is as long as the
# longest, left-padded as Hugging Face's ``generate`` pads prompts. Its mask
# also hides the padding, so its kernel scores every pair of the square. A
# timing ends with a :term:`kernel label`: the attention kernel that ran, with
# its call count, in brackets.
#
# .. literalinclude:: ../ragged_toolkit/decoding.py
#    :pyobject: prefill_packed
#
# .. literalinclude:: ../ragged_site/gpt_training.py
#    :pyobject: prefill_padded

from ragged_toolkit.data import as_tokens
from ragged_toolkit.decoding import generate_packed, prefill_packed
from ragged_toolkit.kv_cache import KVCache
from ragged_site.measuring.bound import speedup_line, work_bound
from ragged_site.measuring.tables import print_timings
from ragged_site.measuring.timing import measure
from ragged_site.gpt_training import prefill_padded

model = models["packed"].eval()  # the packed trainer's model (not a compiled wrapper)
# openings of 8 to 8 + 3 (B - 1) bytes
prompt_docs = [d[: 8 + 3 * i] for i, d in enumerate(held_out)]
prompt_lengths = torch.tensor([len(d) for d in prompt_docs])
prompt_offsets = offsets_from_lengths(prompt_lengths, DEVICE)
prompts = torch.cat([as_tokens(d) for d in prompt_docs]).to(DEVICE)
longest = int(prompt_lengths.max())
caches = {
    side: KVCache(cfg, S.prompts, longest + 8, DEVICE, DTYPE) for side in ("packed", "padded")
}
prefills = {
    "padded": lambda: prefill_padded(model, prompts, prompt_offsets, caches["padded"]),
    "packed": lambda: prefill_packed(
        model, prompts, prompt_offsets, caches["packed"], EAGER_BACKEND
    ),
}
with autocast():
    torch.testing.assert_close(
        prefills["packed"]().float(), prefills["padded"]().float(), **tolerances(DTYPE)
    )
    times = measure(prefills, min_run_time=0.5 if setup.quick else 1.0)
print(
    f"prefill of {S.prompts} prompts ({len(prompts)} tokens, longest {longest}): the last-token logits agree"
)
print_timings(times)
print(
    speedup_line(
        "prefill",
        times["padded"],
        times["packed"],
        work_bound(prompt_lengths, work=work, causal=True, padded_causal=False),
    )
)

# %%
# Decoding then feeds one token per sequence per step. That is a rectangle on
# both sides, so packing removes no work there.
# :doc:`ragged_decoding_kv_cache_gqa` measures it, and the KV cache itself.
# What the model learned: a few prompts, and the bytes greedy decoding writes
# after them (after ``|``). They come from a model this small, trained this
# briefly.

with torch.no_grad():
    written = generate_packed(model, prompts, prompt_offsets, 24, dtype=DTYPE)
for b in range(min(4, S.prompts)):
    text = (
        prompt_docs[b].decode(errors="replace")
        + " | "
        + bytes(written[b].tolist()).decode(errors="replace")
    )
    print(repr(text)[:100])

# %%
# Conclusion
# ----------
# A packed trainer is the padded trainer minus the padding. It has the same
# modules, loss and optimizer, proved to compute the same loss and gradients.
# Packed into fixed-length rows, as ``torchtitan`` packs, every step has one
# shape. The packed step compiles with ``fullgraph=True`` and no graph break.
# It goes through the batch's plan where FlexAttention trains, and through the
# rows layout elsewhere. Whether compiling paid, the probe decided and printed.
# The documents cut at the rows' ends lose a little context. The two training
# lines say what this device turned into speed. Against naive padding, packing
# removes the padding of random batches. Against length-grouped padding, it
# removes what grouping left.
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
