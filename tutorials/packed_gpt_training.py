"""
A packed GPT on real text: training and prefill without padding
===============================================================

Train a small modern GPT on packed documents of real text, as Hugging
Face's ``DataCollatorWithFlattening``, ``torchtune`` and ``torchtitan`` pack
them, against the best padded trainer: same weights, documents and
optimizer. Then generate: a packed prefill of prompts of different lengths,
and decoding steps of fixed shape from a KV cache.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How one GPT (RMSNorm, rotary positions, SwiGLU, grouped-query
         attention) runs on a packed batch and, unchanged, on a padded one
       * How to train it on packed documents, prove it computes what the
         padded model computes, and measure real tokens per second against
         the :term:`work bound`
       * How to prefill packed prompts into a KV cache, and why decoding
         gains nothing from packing: one token per sequence is a rectangle

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`transformer_building_blocks`: packed values and offsets, and
         ``ragged_attention``; the model and the measuring helpers come from
         the site's module ``ragged_toolkit`` (:doc:`reference </toolkit>`)
       * PyTorch 2.11 or later; a CPU is enough, a CUDA GPU runs the page at
         a larger scale in ``bfloat16``
"""

# sphinx_gallery_tags = ["GPT", "training", "packing", "KV cache", "benchmarks"]

# %%
# One model, two layouts
# ----------------------
# Every module of a transformer but attention works on the last dimension
# only: embeddings, linear layers, norms, activations and residuals treat a
# packed batch ``(T, dim)`` and a padded one ``(B, S, dim)`` alike. So one
# model can run on both, if attention alone is told which it got. Here
# attention gets a small *layout* object: ``Packed`` holds the offsets and
# calls ``ragged_attention``; ``Padded`` runs one SDPA call. With right
# padding and ``is_causal`` a real token never sees a padding token, so the
# padded layout needs no mask for training.
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
from ragged_toolkit.batches import offsets_from_lengths
from ragged_toolkit.gpt import GPT, GPTConfig, Packed, Padded
from ragged_toolkit.batches import to_padded, token_index

torch.manual_seed(0)
tiny = GPT(GPTConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     ffn_hidden=64, max_seq_len=16))
docs = [torch.tensor([5, 9, 2]), torch.tensor([7]), torch.tensor([3, 3, 8, 1])]
tokens = torch.cat(docs)  # (T,) = (8,)
offsets = offsets_from_lengths([len(d) for d in docs])  # [0, 3, 4, 8]
positions = token_index(offsets)[1]  # [0, 1, 2, 0, 0, 1, 2, 3]
ids, valid = to_padded(tokens, offsets)  # (B, S) = (3, 4), right padding
with torch.no_grad():
    packed = tiny(tokens, positions, Packed(offsets, "loop"))  # (T, vocab)
    padded = tiny(ids, torch.arange(4).expand_as(ids), Padded())  # (B, S, vocab)
torch.testing.assert_close(packed, padded[valid])
print(f"packed logits {tuple(packed.shape)}, padded {tuple(padded.shape)}: "
      f"equal on all {len(tokens)} real tokens")

# %%
# The padded batch spent 12 slots on 8 tokens. Real document lengths have a
# long tail, so padding is most of the batch; the page measures what
# skipping it buys a whole training step, and generation.
#
# Sizes
# ~~~~~
# Every size is set here, per device; :term:`quick mode` shrinks them. The
# tokens are bytes (a vocabulary of 256), so that no tokenizer is needed.
# The CPU model is small so that the page builds in a minute or two on two
# cores; the CUDA one trains under ``bfloat16`` autocast. (Real runs: width
# 2048 and up, 16 and more layers, thousands of documents per step.)

import numpy as np
from ragged_toolkit.device import default_device, default_dtype, quick_mode
from ragged_toolkit.measure import TIMING_THREADS
from ragged_toolkit.device import quiet_known_notes

DEVICE = default_device()
DTYPE = default_dtype(DEVICE)
# One CPU thread for the whole page, as every timing and profile of the site
# uses (TIMING_THREADS): torch.compile guards on the thread count, so what is
# compiled is compiled once, for the threads it is timed with.
torch.set_num_threads(TIMING_THREADS)
QUICK = quick_mode()
SEED = 0
if DEVICE == "cuda":
    MODEL = dict(vocab_size=256, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4,
                 ffn_hidden=2816, max_seq_len=2048)
    DOCS_PER_BATCH, STEPS, LR = 128, 300, 1e-3
    PROMPTS, NEW_TOKENS = 64, 64
else:
    MODEL = dict(vocab_size=256, dim=256, n_layers=2, n_heads=8, n_kv_heads=2,
                 ffn_hidden=688, max_seq_len=192)
    DOCS_PER_BATCH, STEPS, LR = 12, 70, 6e-3
    PROMPTS, NEW_TOKENS = 16, 40
if QUICK:
    MODEL.update(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=176, max_seq_len=128)
    DOCS_PER_BATCH, STEPS, LR, PROMPTS, NEW_TOKENS = 8, 30, 1e-2, 8, 8
WARMUP_STEPS = 3  # steps left out of the throughput figures (first calls, compiling)
RUN_TIME = 0.2 if QUICK else 1.0 if DEVICE == "cuda" else 0.4  # s per comparison
print(f"PyTorch {torch.__version__}, device: {DEVICE}, dtype: {DTYPE}, quick: {QUICK}")
print("model: " + ", ".join(f"{k} {v}" for k, v in list(MODEL.items())[:4]))
print("       " + ", ".join(f"{k} {v}" for k, v in list(MODEL.items())[4:]))
print(f"{STEPS} steps of {DOCS_PER_BATCH} documents")

# sphinx_gallery_start_ignore
quiet_known_notes()
# sphinx_gallery_end_ignore

# %%
# The model
# ---------
# The usual modern decoder-only stack, written flat in the style of
# ``gpt-fast``: a token embedding; blocks of RMSNorm, grouped-query attention
# with rotary position embeddings, RMSNorm and a SwiGLU feed-forward network,
# each with a residual connection; a final RMSNorm and an output layer, not
# tied to the embedding, as in Llama.
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: GPTConfig
#
# Attention computes q, k and v with one matmul, rotates q and k by each
# token's position, and hands them to the layout; ``n_heads / n_kv_heads``
# query heads share each key/value head (grouped-query attention).
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: apply_rope
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: Attention
#
# The feed-forward network never sees the layout; the block passes it on:
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: FeedForward
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: Block
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: GPT
#
# One copy of the model for each trainer:

import copy

cfg = GPTConfig(**MODEL)
torch.manual_seed(SEED)
ragged_model = GPT(cfg).to(DEVICE)
padded_model = copy.deepcopy(ragged_model)  # the same initial weights
n_params = sum(p.numel() for p in ragged_model.parameters())
print(f"{n_params / 1e6:.2f} M parameters; "
      f"{cfg.n_heads} query heads share {cfg.n_kv_heads} key/value heads")

# %%
# A corpus of packed documents
# ----------------------------
# Real text, with the long tail of real document lengths, on every machine
# and without a download: the docstrings of Python's own standard library,
# read from its source files (``docstring_corpus`` parses them with ``ast``
# and imports nothing). Each document is its UTF-8 bytes; one longer than
# the context is cut there. Each step draws ``DOCS_PER_BATCH`` documents;
# the prompts for generation, at the end, come from documents no step
# trains on.

from ragged_toolkit.data import as_tokens, docstring_corpus, document_targets

docs, source = docstring_corpus(min_chars=2)
doc_lengths = np.array([len(d) for d in docs])
print(f"corpus: {len(docs)} documents from {source}, lengths min {doc_lengths.min()}, "
      f"median {int(np.median(doc_lengths))}, max {doc_lengths.max()}")


rng = np.random.default_rng(SEED)
order = rng.permutation(len(docs))
held_out, train_docs = order[:PROMPTS], order[PROMPTS:]
batches, cut = [], 0
for step in range(STEPS):
    chosen = rng.choice(train_docs, size=DOCS_PER_BATCH, replace=False)
    pieces = [as_tokens(docs[i], MODEL["max_seq_len"]) for i in chosen]
    cut += sum(len(docs[i]) > MODEL["max_seq_len"] for i in chosen)
    offsets = offsets_from_lengths([len(p) for p in pieces])
    batches.append((torch.cat(pieces).to(DEVICE), offsets.to(DEVICE)))
real = sum(len(tokens) for tokens, _ in batches)
slots = sum(DOCS_PER_BATCH * int(offsets.diff().max()) for _, offsets in batches)
print(f"{real} real tokens in {STEPS} batches ({cut} documents cut at the context)")
print(f"padded batches would hold {slots} token slots, {slots / real:.2f}x the tokens")
tokens, offsets = batches[0]
print(f"first batch: lengths {offsets.diff().tolist()[:12]} ...")

# %%
# One training step, two ways
# ---------------------------
# The packed step feeds the documents as they are, ``(T,)`` ids and their
# offsets. The padded step is the best padded trainer a reader would write:
# right-padded ``(B, S)`` ids, a causal kernel and no mask, the loss masked
# at padding. Both average the loss over the same real targets, under
# autocast where the dtype is not float32 (the weights stay in float32).

import torch.nn.functional as F


def packed_loss(model, tokens, offsets, backend):
    positions = token_index(offsets)[1]
    with torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32):
        logits = model(tokens, positions, Packed(offsets, backend))  # (T, vocab)
    return F.cross_entropy(logits.float(), document_targets(tokens, offsets))


def padded_loss(model, tokens, offsets):
    ids, valid = to_padded(tokens, offsets)  # (B, S), right padding with id 0
    targets = to_padded(document_targets(tokens, offsets), offsets, -100)[0]
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32):
        logits = model(ids, positions, Padded())  # (B, S, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# %%
# Before timing anything, the proof that the two steps compute the same
# thing: the same loss and the same gradient for every parameter, on the
# first batch. The packed side uses the per-sequence loop, the padded side
# SDPA's math backend (matrix products and a softmax): no shared kernel.

from ragged_toolkit.device import tolerances
from torch.nn.attention import SDPBackend, sdpa_kernel

tolerance = tolerances(DTYPE)
loss_r = packed_loss(ragged_model, tokens, offsets, "loop")
loss_r.backward()
with sdpa_kernel(SDPBackend.MATH):
    loss_p = padded_loss(padded_model, tokens, offsets)
    loss_p.backward()
torch.testing.assert_close(loss_r, loss_p, **tolerance)
pairs = list(zip(ragged_model.named_parameters(), padded_model.parameters()))
for (name, p_r), p_p in pairs:
    torch.testing.assert_close(p_r.grad, p_p.grad, **tolerance,
                               msg=lambda m, name=name: f"{name}: {m}")
gap = max((p_r.grad - p_p.grad).abs().max().item() for (_, p_r), p_p in pairs)
print(f"loss {loss_r.item():.4f} (packed) and {loss_p.item():.4f} (padded)")
print(f"gradients of all {n_params:,} parameters agree (largest difference {gap:.1e})")
ragged_model.zero_grad(set_to_none=True)
padded_model.zero_grad(set_to_none=True)

# %%
# Which attention backend trains here
# -----------------------------------
# The model's attention job on the first batch, causal, grouped-query,
# forward and backward: ``compare_backends`` checks each backend that runs
# here against the float32 reference and times them all. Each row: median
# and interquartile range (IQR) in ms, peak memory in MiB, and in brackets
# the :term:`kernel label` of what ran (``CPU flash`` is SDPA's fused CPU
# kernel). ``choose`` takes the fastest only if its IQR does not overlap the
# runner-up's; within the noise it keeps the site's default backend, the one
# ``ragged_attention`` uses when none is named.

from ragged_toolkit.attention import default_backend
from ragged_toolkit.attention.compare import compare_backends
from ragged_toolkit.measure import Timing, choose, print_timings

q_job = torch.randn(len(tokens), cfg.n_heads, cfg.head_dim, device=DEVICE, dtype=DTYPE)
kv_job = torch.randn(len(tokens), cfg.n_kv_heads, cfg.head_dim, device=DEVICE,
                     dtype=DTYPE)
backends = compare_backends(q_job, kv_job, kv_job.clone(), offsets, is_causal=True,
                            backward=True, min_run_time=RUN_TIME)
TRAINING_BACKEND = choose(backends, default_backend(DEVICE, DTYPE), "training backend")

# %%
# Compile, or not
# ~~~~~~~~~~~~~~~
# Every batch has a new size, so ``torch.compile(dynamic=True)`` compiles
# each graph once for symbolic sizes. The packed attention call is not
# traced (``ragged_attention`` is host-side bookkeeping around the kernel
# calls): the compiled packed model is a few graphs around it. Each side
# trains a few steps eager and compiled, on copies of the models, after the
# steps that compile; the step times, per thousand real tokens, decide by
# the same rule, and within the noise the default is not to compile.

import functools
import time

from ragged_toolkit.device import synchronize
from torch._dynamo.utils import counters  # counts the graphs compiled


def train_step(model, optimizer, loss):
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def step_timing(seconds, n_tokens):
    """A :class:`Timing` of steps, in ms per thousand real tokens."""
    per_k = np.asarray(seconds) / np.asarray(n_tokens) * 1e6
    q1, median, q3 = np.percentile(per_k, [25, 50, 75])
    return Timing(median, q3 - q1, float("nan"), q1_ms=q1, q3_ms=q3)


def probe(make_loss, model, compiled, steps):
    """Step times of ``steps`` training steps on a copy of ``model`` after
    the first ``WARMUP_STEPS`` (a :class:`Timing` per thousand tokens), and
    how many graphs were compiled in those timed steps."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    runner = torch.compile(model, dynamic=True) if compiled else model
    elapsed, graphs = [], 0
    for i, (tokens_i, offsets_i) in enumerate(batches[:steps]):
        before = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        train_step(model, optimizer, make_loss(runner, tokens_i, offsets_i))
        synchronize()
        elapsed.append(time.perf_counter() - start)
        graphs += (counters["stats"]["unique_graphs"] - before) * (i >= WARMUP_STEPS)
    n = [len(t) for t, _ in batches[WARMUP_STEPS:steps]]
    return step_timing(elapsed[WARMUP_STEPS:], n), graphs


packed_step_loss = functools.partial(packed_loss, backend=TRAINING_BACKEND)
PROBE_STEPS = WARMUP_STEPS + (4 if QUICK else 8)
COMPILE = {}
for side, make_loss, model in (("packed", packed_step_loss, ragged_model),
                               ("padded", padded_loss, padded_model)):
    timings = {}
    for compiled in (False, True):
        timings["compiled" if compiled else "eager"], graphs = probe(
            make_loss, model, compiled, PROBE_STEPS)
        assert graphs == 0, f"{side}, compiled: {graphs} graphs compiled after the warm-up"
    print_timings({f"{side} step, {name} (ms per 1k tokens)": t for name, t in timings.items()})
    COMPILE[side] = choose(timings, "eager", f"{side} trainer") == "compiled"

# %%
# Training
# --------
# Same weights, same batches in the same order, same optimizer (AdamW) and
# schedule (linear warm-up, cosine decay). The trainers take turns, one step
# each, so that whatever else the machine does slows both alike. A step is
# timed from the batch on the device to the optimizer's update, synchronized;
# throughput counts *real* tokens (the padded trainer gets no credit for
# padding) after the first ``WARMUP_STEPS``, which compile where compiling
# was chosen. The graphs compiled in the timed steps are counted for each
# trainer, and must be none: a compile inside the window would be timed as
# training.

import math


def schedule(step):
    warmup = max(STEPS // 20, 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(step / STEPS, 1.0)))
    return min(1.0, (step + 1) / warmup) * cosine


trainers = {}
for side, model, make_loss in (("packed", ragged_model, packed_step_loss),
                               ("padded", padded_model, padded_loss)):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    runner = torch.compile(model, dynamic=True) if COMPILE[side] else model
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    trainers[side] = dict(model=model, runner=runner, optimizer=optimizer, losses=[],
                          make_loss=make_loss, scheduler=scheduler, seconds=[], graphs=0)
for step, (tokens_i, offsets_i) in enumerate(batches):
    for t in trainers.values():
        before = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        loss = t["make_loss"](t["runner"], tokens_i, offsets_i)
        loss = train_step(t["model"], t["optimizer"], loss)
        t["scheduler"].step()
        synchronize()
        t["seconds"].append(time.perf_counter() - start)
        t["losses"].append(loss.item())
        if step >= WARMUP_STEPS:
            t["graphs"] += counters["stats"]["unique_graphs"] - before

print(f"timed-window compiles: packed {trainers['packed']['graphs']}, "
      f"padded {trainers['padded']['graphs']}")
assert trainers["packed"]["graphs"] == trainers["padded"]["graphs"] == 0, \
    "a graph was compiled inside the timed steps: warm up on every shape first"
timed_tokens = np.array([len(b[0]) for b in batches[WARMUP_STEPS:]])
for side, t in trainers.items():
    seconds = np.array(t["seconds"][WARMUP_STEPS:])
    t["tokens/s"] = timed_tokens.sum() / seconds.sum()
    per_step = timed_tokens / seconds
    q1, median, q3 = np.percentile(per_step, [25, 50, 75])
    first, last = np.mean(t["losses"][:5]), np.mean(t["losses"][-10:])
    print(f"{side}: loss {first:.3f} -> {last:.3f}; real tokens/s: mean {t['tokens/s']:,.0f}, "
          f"per-step median {median:,.0f} (IQR {q3 - q1:,.0f}), slowest step "
          f"{seconds.max() / np.median(seconds):.1f}x the median")

# %%
# The work bound of this run
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# What each trainer must compute over the timed batches: ``2 x`` the weights
# of every matrix per token, and ``4 H D`` per query-key pair and layer for
# attention, the causal half on both sides (the padded causal kernel skips
# the masked half too). The backward pass scales both sides alike.

from ragged_toolkit.bound import pairs_scored, training_work

per_token = 2 * (n_params - cfg.vocab_size * cfg.dim)  # every matrix but the embedding
per_pair = cfg.n_layers * 4 * cfg.n_heads * cfg.head_dim
packed_work, padded_work = training_work(
    [offsets_i.diff().cpu() for _, offsets_i in batches[WARMUP_STEPS:]], per_token, per_pair)
bound = padded_work / packed_work
R, P = trainers["packed"]["tokens/s"], trainers["padded"]["tokens/s"]
print(f"training: ragged {R:.0f} tokens/s, padded {P:.0f} tokens/s, "
      f"speedup {R / P:.2f}x, work bound {bound:.2f}x, fraction {R / P / bound:.2f}")

# %%
# Where the packed step's time goes, whenever it reaches less than 0.9 of
# the bound: one step on the last batch, profiled at its steady state, per
# call, beside its own median.

from ragged_toolkit.profiles import where_time_goes

if R / P / bound < 0.9:
    tokens_l, offsets_l = batches[-1]
    for side, t in trainers.items():  # forward and backward, as compiled or not
        print(f"{side} step, forward and backward:")
        print(where_time_goes(lambda: t["make_loss"](t["runner"], tokens_l, offsets_l).backward()))
        t["model"].zero_grad(set_to_none=True)
else:
    print(f"the packed trainer reached {R / P / bound:.2f} of the bound: no profile needed")

# %%
# The last number is the :term:`fraction of the bound`, the measured
# speedup over the work bound. Near 1, the packed trainer turned all the work
# it skips into speed. Below 1, part of it went to overheads: one attention
# call per document with the loop backend, the bookkeeping of the packed
# batch, the graph breaks of the compiled packed model. Above 1, the padded
# trainer is slower per unit of work than the packed one: its larger
# activations cost memory traffic, cache misses and allocations that the
# bound, which counts FLOPs only, does not see.
# Those activations show in the peak memory of one step on the last batch:

from ragged_toolkit.measure import profile_call

tokens_l, offsets_l = batches[-1]
for side, t in trainers.items():
    model_copy = copy.deepcopy(t["model"])
    peak, kernels = profile_call(
        lambda: t["make_loss"](model_copy, tokens_l, offsets_l).backward())
    print(f"{side}: peak {peak:6.1f} MiB above the weights  [{kernels}]")

# %%
# The two loss curves must agree: the trainers compute the same thing, so
# they can only drift apart by rounding. The page stops unless the packed
# model learned (its last ten losses average below 60% of the loss of a
# uniform guess over the 256 bytes, ln 256 = 5.55 nats) and the two curves'
# averages over the last ten steps agree within 2%. The
# curves lie on top of each other, so the first figure marks them with
# different symbols at different steps and plots their difference below;
# the second puts them against wall-clock time, where the faster trainer's
# curve reaches each loss first.

losses = {side: np.array(t["losses"]) for side, t in trainers.items()}
first, last = losses["packed"][:5].mean(), losses["packed"][-10:].mean()
last_padded = losses["padded"][-10:].mean()
uniform = math.log(cfg.vocab_size)
assert last < 0.6 * uniform, \
    f"the packed model did not learn: {first:.3f} -> {last:.3f} (a uniform guess: {uniform:.2f})"
assert abs(last - last_padded) < 0.02 * last_padded, \
    f"the curves disagree: {last:.4f} vs {last_padded:.4f}"
print(f"packed loss {first:.3f} -> {last:.3f}, against {uniform:.2f} for a uniform guess")
print(f"last ten steps: packed {last:.4f}, padded {last_padded:.4f}")

import matplotlib.pyplot as plt
from ragged_toolkit.figures import FIGURE_STYLE

plt.rcParams.update(FIGURE_STYLE)
every = max(STEPS // 12, 1)
styles = {"packed": dict(ls="-", lw=3, alpha=0.6, marker="o", markevery=(0, every)),
          "padded": dict(ls="--", marker="s", mfc="none", markevery=(every // 2, every))}
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=[2, 1],
                               layout="constrained")
for side, style in styles.items():
    ax1.plot(losses[side], label=side, **style)
ax1.set(ylabel="training loss", title=f"Same weights, same documents ({DEVICE})")
ax1.legend()
ax2.plot(losses["packed"] - losses["padded"], ".-", color="C2")
ax2.axhline(0, color="gray", lw=0.8)
ax2.set(xlabel="step", ylabel="loss, packed - padded")
plt.show()

fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
for side, style in styles.items():
    t = trainers[side]
    ax.plot(np.cumsum(t["seconds"]), losses[side], **style,
            label=f"{side}, {t['tokens/s']:,.0f} real tokens/s")
ax.set(xlabel="seconds", ylabel="training loss", title="Loss against wall-clock time")
ax.legend()
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# Generation
# ----------
# The trained model now continues, greedily, ``NEW_TOKENS`` bytes for each
# of a batch of prompts: the openings of documents no step trained on, of
# different lengths. Generation has two phases, and packing does different
# things to each:
#
# * **prefill** runs every prompt at once and writes each token's keys and
#   values into a cache. Prompts of different lengths are a ragged batch:
#   packed, the prefill computes the real tokens only; padded, every prompt
#   is as long as the longest.
# * **decode** then feeds one token per sequence per step. That batch is a
#   rectangle on both sides, ``(B,)`` new tokens against a cache with room
#   for ``capacity`` tokens per sequence; only which slots are in use
#   differs, so packing removes no work here.
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: KVCache
#
# The packed prefill writes sequence ``b``'s keys into rows
# ``b * capacity ...`` of the cache seen as packed rows:
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: prefill_packed
#
# The padded prefill left-pads the prompts, as Hugging Face's ``generate``
# pads them, with a causal mask that also hides the padding:

from ragged_toolkit.kv_cache import KVCache, prefill_packed

prompt_docs = [docs[i] for i in held_out]


def opening(doc, n):
    """The first ``n`` bytes of ``doc`` or fewer, ending at a word's end."""
    cut = doc[:n].rfind(b" ") if len(doc) > n else -1
    return doc[:cut + 1] if cut > 0 else doc[:n]


# openings of 8 to 8 + 3 (B - 1) bytes: prompts of different lengths
prompt_docs = [opening(d, 8 + 3 * i) for i, d in enumerate(prompt_docs)]
prompt_lengths = torch.tensor([len(d) for d in prompt_docs])
prompt_offsets = offsets_from_lengths(prompt_lengths, DEVICE)
prompts = torch.cat([as_tokens(d) for d in prompt_docs])
prompts = prompts.to(DEVICE)
longest = int(prompt_lengths.max())
capacity = longest + NEW_TOKENS
model = trainers["packed"]["model"].eval()
print(f"{PROMPTS} prompts, {len(prompts)} tokens, longest {longest}; "
      f"left padding makes {PROMPTS * longest} token slots")


@torch.no_grad()
def prefill_padded(model, prompts, offsets, cache):
    """The same prompts left-padded to (B, S) into ``cache``: the logits of
    each prompt's last token (B, vocab), and the padding per prompt (B,)."""
    B, lengths = len(offsets) - 1, offsets.diff()
    S = int(lengths.max())
    seq, pos = token_index(offsets)
    pad = S - lengths  # (B,) padding columns on the left
    ids = torch.zeros(B, S, dtype=torch.long, device=prompts.device)
    ids[seq, pad[seq] + pos] = prompts
    valid = torch.arange(S, device=prompts.device) >= pad[:, None]  # (B, S)
    positions = (torch.arange(S, device=prompts.device) - pad[:, None]).clamp(min=0)
    causal = torch.ones(S, S, dtype=torch.bool, device=prompts.device).tril()
    eye = torch.eye(S, dtype=torch.bool, device=prompts.device)
    # a padding query sees itself, so that no row of the mask is empty
    mask = (causal & valid[:, None, :]) | (eye & ~valid[:, :, None])  # (B, S, S)
    return model(ids, positions, Padded(mask[:, None], cache, 0))[:, -1], pad


def autocast():
    return torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32)


# %%
# The prefill's attention backend is chosen by the same rule as training's,
# on the prompts' causal forward job:

q_pre = torch.randn(len(prompts), cfg.n_heads, cfg.head_dim, device=DEVICE, dtype=DTYPE)
kv_pre = torch.randn(len(prompts), cfg.n_kv_heads, cfg.head_dim, device=DEVICE, dtype=DTYPE)
prefill_backends = compare_backends(q_pre, kv_pre, kv_pre.clone(), prompt_offsets,
                                    is_causal=True, min_run_time=RUN_TIME / 2)
PREFILL_BACKEND = choose(prefill_backends, default_backend(DEVICE, DTYPE),
                         "prefill backend")

caches = {side: KVCache(cfg, PROMPTS, capacity, DEVICE, DTYPE) for side in ("packed", "padded")}


def packed_prefill():
    with autocast():
        return prefill_packed(model, prompts, prompt_offsets, caches["packed"],
                              PREFILL_BACKEND)


def padded_prefill():
    with autocast():
        return prefill_padded(model, prompts, prompt_offsets, caches["padded"])


logits_packed, (logits_padded, pad) = packed_prefill(), padded_prefill()
torch.testing.assert_close(logits_packed.float(), logits_padded.float(), **tolerance)
gap = (logits_packed - logits_padded).abs().max().item()
print(f"prefill with the backend chosen, {PREFILL_BACKEND}: the last-token logits "
      f"of all {PROMPTS} prompts agree (largest difference {gap:.1e})")

# %%
# The work bound of the prefill counts, as in training, ``2 x`` the weights
# per token and ``4 H D`` per query-key pair and layer, on the real tokens
# against the padded ``B x S``.

from ragged_toolkit.bound import speedup_line
from ragged_toolkit.measure import measure

times = measure({"padded": padded_prefill, "packed": packed_prefill},
                min_run_time=2 * RUN_TIME)
print_timings({f"prefill, {n}": t for n, t in times.items()})
work_packed = (per_token * float(prompt_lengths.sum())
               + per_pair * pairs_scored(prompt_lengths, prompt_lengths, True))
full = torch.full_like(prompt_lengths, longest)
work_padded = per_token * PROMPTS * longest + per_pair * pairs_scored(full, full, True)
prefill_bound = work_padded / work_packed
print(speedup_line("prefill", times["padded"], times["packed"], prefill_bound))
if times["padded"].median_ms / times["packed"].median_ms / prefill_bound < 0.9:
    print(where_time_goes(packed_prefill, timing=times["packed"]))

# %%
# Decoding, one step
# ~~~~~~~~~~~~~~~~~~
# A decoding step is cheap to run only if it has nothing to prepare: in the
# style of gpt-fast the cache has a fixed capacity, each sequence's next
# slot is a tensor, and the step's shapes never change, so one compiled
# graph can serve every step, with no host sync. The layout both sides use:
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: CachedStep
#
# The packed cache holds sequence ``b`` from slot 0; the left-padded one
# from slot ``pad[b]``, with the new tokens at the same slot for all. Each
# token keeps its own position (for the rotary embedding) on both sides.
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: decode_greedy

from ragged_toolkit.kv_cache import call_model, decode_greedy

lengths_dev = prompt_lengths.to(DEVICE)
column = torch.full_like(lengths_dev, longest)
compiled_step = torch.compile(call_model, dynamic=False)


def packed_decode(step=None):
    with autocast():
        return decode_greedy(model, logits_packed, caches["packed"], lengths_dev,
                             NEW_TOKENS, step=step)


def padded_decode(step=None):
    with autocast():
        return decode_greedy(model, logits_padded, caches["padded"], lengths_dev,
                             NEW_TOKENS, slots=column, start=pad, step=step)


graphs_before = counters["stats"]["unique_graphs"]
out_packed, out_padded = packed_decode(), padded_decode()
out_compiled = packed_decode(compiled_step)
padded_decode(compiled_step)  # the padded step compiles too, before any timing
decode_graphs = counters["stats"]["unique_graphs"] - graphs_before
agree = (out_packed == out_padded).float().mean().item()
assert agree >= (1.0 if DTYPE == torch.float32 else 0.9), \
    f"packed and padded decoding agree on {agree:.1%} of the tokens"
same = (out_compiled == out_packed).float().mean().item()
assert same >= (1.0 if DTYPE == torch.float32 else 0.9), \
    f"the compiled step agrees with the eager one on {same:.1%} of the tokens"
print(f"with the prefill backend chosen ({PREFILL_BACKEND}), packed and padded decoding "
      f"agree on {agree:.1%} of {out_packed.numel()} tokens;\nthe compiled step, after the "
      f"chosen prefill: {same:.1%}, {decode_graphs} graphs for {NEW_TOKENS - 1} steps")

# %%
# Compiling the step is chosen by the rule, and the choice applies to both
# sides. The bound of decoding is 1.00: both sides feed the same tokens
# through the same weights, and the kernel scores every slot of the cache
# on both (masked where not in use).

with_step = {"eager": packed_decode,
             "compiled": functools.partial(packed_decode, compiled_step)}
step_times = measure(with_step, min_run_time=RUN_TIME, profile=False)
print_timings({f"decode, packed, {n}": t for n, t in step_times.items()})
DECODE_STEP = compiled_step if choose(step_times, "eager", "decode step") == "compiled" else None
times = measure({"padded": functools.partial(padded_decode, DECODE_STEP),
                 "packed": functools.partial(packed_decode, DECODE_STEP)},
                min_run_time=2 * RUN_TIME)
print_timings({f"decode, {n}": t for n, t in times.items()})
new = PROMPTS * (NEW_TOKENS - 1)
print(", ".join(f"{side} {new / t.median_ms * 1e3:,.0f}" for side, t in times.items())
      + " new tokens/s")
print(speedup_line("decode", times["padded"], times["packed"], 1.0))
if times["padded"].median_ms / times["packed"].median_ms < 0.9:
    print(where_time_goes(functools.partial(packed_decode, DECODE_STEP), timing=times["packed"]))

# %%
# What the model learned: a few prompts, and the bytes it wrote after them
# (after ``|``). A model this small, trained for a minute on a CPU, has
# learned the most frequent bytes and words of English docstrings and little
# else, so greedy decoding repeats them; the CUDA sizes train a larger model
# on many more tokens. Either way, the packed and padded generations are
# the same tokens, checked above.

for b in range(min(4, PROMPTS)):
    prompt = bytes(prompts[prompt_offsets[b]:prompt_offsets[b + 1]].tolist())
    written = bytes(out_padded[b].tolist())  # the packed tokens too (checked above)
    show = (prompt.decode(errors="replace") + " | " + written.decode(errors="replace"))
    print(repr(show)[:118])

# %%
# Conclusion
# ----------
# A packed trainer is the padded trainer minus the padding: the same
# modules, loss, targets and optimizer, and a loss curve that ends where the
# padded one ends, within the tolerance the page asserts. What changes is
# the work: the training and prefill lines say how much of the work bound
# this device turned into speed, the peak-memory lines what padding would
# have held. Decoding does the same work on both sides; its line says
# whether the packed cache cost anything there.
#
# In a real trainer the packed batch is what ``DataCollatorWithFlattening``
# produces (``offsets_from_position_ids`` turns its ``position_ids`` into
# offsets), and on a GPU ``varlen_attn`` is the attention call.
# :doc:`ragged_decoding_kv_cache_gqa` takes the KV cache further.
#
# Further reading
# ---------------
# * `Packing with FlashAttention 2 <https://huggingface.co/blog/packing-with-FA2>`_
# * `torchtitan <https://github.com/pytorch/torchtitan>`_ and
#   `torchtune <https://github.com/pytorch/torchtune>`_ (sample packing)
# * `gpt-fast <https://github.com/meta-pytorch/gpt-fast>`_ (the model's style,
#   the KV cache)
# * Ainslie et al., `GQA <https://arxiv.org/abs/2305.13245>`_; Su et al.,
#   `RoFormer <https://arxiv.org/abs/2104.09864>`_; Shazeer,
#   `GLU variants <https://arxiv.org/abs/2002.05202>`_
