"""
A packed GPT, trained and served without padding
================================================

Train a small modern GPT on packed documents, as Hugging Face's
``DataCollatorWithFlattening``, ``torchtune`` and ``torchtitan`` pack them,
against the best padded trainer: same weights, documents and optimizer.
Then generate with a KV cache in which each sequence keeps its own length.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How one GPT (RMSNorm, rotary positions, SwiGLU, grouped-query
         attention) runs on a packed batch and, unchanged, on a padded one
       * How to train it on packed documents, prove it computes what the
         padded model computes, and measure real tokens per second against
         the :term:`work bound`
       * How to prefill packed prompts and decode into a KV cache with
         per-sequence lengths, against padded generation

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
# .. literalinclude:: ../tutorials/ragged_toolkit.py
#    :pyobject: Packed
#
# .. literalinclude:: ../tutorials/ragged_toolkit.py
#    :pyobject: Padded
#
# (The cache is for generation, at the end.) A tiny model on documents of
# 3, 1 and 4 tokens, packed and then padded, gives the same logits on every
# real token. Positions restart at every document: ``token_index`` gives
# them, exactly the ``position_ids`` of Hugging Face's packed format.

import torch
from ragged_toolkit import GPT, GPTConfig, Packed, Padded, offsets_from_lengths
from ragged_toolkit import to_padded, token_index

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
# CPU model is small so that the page builds in minutes on two cores; the
# CUDA one trains under ``bfloat16`` autocast. (Real runs: width 2048 and
# up, 16 and more layers, thousands of documents per step.)

import numpy as np
from ragged_toolkit import default_device, default_dtype, quick_mode, quiet_known_notes

DEVICE = default_device()
DTYPE = default_dtype(DEVICE)
QUICK = quick_mode()
SEED = 0
if DEVICE == "cuda":
    MODEL = dict(vocab_size=4096, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4,
                 ffn_hidden=2816, max_seq_len=4096)
    DOCS_PER_BATCH, STEPS, LR, ZIPF_ALPHA = 128, 300, 1e-3, 1.1
    PROMPTS, NEW_TOKENS = 64, 64
else:
    MODEL = dict(vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=2,
                 ffn_hidden=688, max_seq_len=1024)
    DOCS_PER_BATCH, STEPS, LR, ZIPF_ALPHA = 32, 100, 3e-3, 1.2
    PROMPTS, NEW_TOKENS = 16, 32
if QUICK:
    MODEL.update(vocab_size=128, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=176)
    DOCS_PER_BATCH, STEPS, LR, PROMPTS, NEW_TOKENS = 16, 60, 1e-2, 8, 8
WARMUP_STEPS = 3  # steps left out of the throughput figures (first calls, compiling)
RUN_TIME = 0.2 if QUICK else 1.0 if DEVICE == "cuda" else 0.4  # s per comparison
print(f"PyTorch {torch.__version__}, device: {DEVICE}, dtype: {DTYPE}, quick: {QUICK}")
print("model: " + ", ".join(f"{k} {v}" for k, v in list(MODEL.items())[:4]))
print("       " + ", ".join(f"{k} {v}" for k, v in list(MODEL.items())[4:]))
print(f"{STEPS} steps of {DOCS_PER_BATCH} documents, Zipf exponent {ZIPF_ALPHA}")

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
# .. literalinclude:: ../tutorials/ragged_toolkit.py
#    :pyobject: GPTConfig
#
# Attention computes q, k and v with one matmul, rotates q and k by each
# token's position, and hands them to the layout; ``n_heads / n_kv_heads``
# query heads share each key/value head (grouped-query attention).
#
# .. literalinclude:: ../tutorials/ragged_toolkit.py
#    :pyobject: apply_rope
#
# .. literalinclude:: ../tutorials/ragged_toolkit.py
#    :pyobject: Attention
#
# The feed-forward network never sees the layout; the block passes it on:
#
# .. literalinclude:: ../tutorials/ragged_toolkit.py
#    :pyobject: FeedForward
#
# .. literalinclude:: ../tutorials/ragged_toolkit.py
#    :pyobject: Block
#
# .. literalinclude:: ../tutorials/ragged_toolkit.py
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
# The documents must be learnable, so that the two trainers are compared on
# a loss that falls, and they must need attention within the document. Each
# document has a topic, its first token; after that, every token is drawn
# from four likely successors of the previous token, from the topic's own
# table. A model that does not look back at the document's first token
# cannot know which table applies, and one that looks into the previous
# document reads the wrong topic, so the boundaries matter. The lengths
# come from the site's length generator, capped at the context length.

from ragged_toolkit import sentence_lengths

TOPICS = 4  # token ids 0 .. TOPICS - 1 are the topics
SUCCESSOR_PROBS = np.array([0.55, 0.25, 0.12, 0.08])


def documents(rng, tables, lengths):
    """Packed token ids (T,) of one document per length, generated together."""
    B, longest = len(lengths), int(lengths.max())
    topic = rng.integers(0, tables.shape[0], size=B)
    ids = np.zeros((B, longest), dtype=np.int64)
    ids[:, 0] = topic
    token = rng.integers(tables.shape[0], tables.shape[1], size=B)
    for p in range(1, longest):
        ids[:, p] = token
        token = tables[topic, token, rng.choice(4, size=B, p=SUCCESSOR_PROBS)]
    rows = [ids[b, :n] for b, n in enumerate(lengths.tolist())]
    return torch.from_numpy(np.concatenate(rows))


def next_token_targets(tokens, offsets):
    """The token each position must predict; -100 (ignored) at each document's end."""
    targets = tokens.roll(-1).clone()
    targets[offsets[1:] - 1] = -100
    return targets


rng = np.random.default_rng(SEED)
# for each topic and token, its four successors (never a topic id)
tables = rng.integers(TOPICS, MODEL["vocab_size"], size=(TOPICS, MODEL["vocab_size"], 4))
batches, cut = [], 0
for _ in range(STEPS):
    lengths = sentence_lengths(rng, DOCS_PER_BATCH, ZIPF_ALPHA)
    cut += int((lengths > MODEL["max_seq_len"]).sum())
    lengths = lengths.clamp(max=MODEL["max_seq_len"])
    offsets = offsets_from_lengths(lengths)
    batches.append((documents(rng, tables, lengths).to(DEVICE), offsets.to(DEVICE)))
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
    return F.cross_entropy(logits.float(), next_token_targets(tokens, offsets))


def padded_loss(model, tokens, offsets):
    ids, valid = to_padded(tokens, offsets)  # (B, S), right padding with id 0
    targets = to_padded(next_token_targets(tokens, offsets), offsets, -100)[0]
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32):
        logits = model(ids, positions, Padded())  # (B, S, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# %%
# Before timing anything, the proof that the two steps compute the same
# thing: the same loss and the same gradient for every parameter, on the
# first batch. The packed side uses the per-sequence loop, the padded side
# SDPA's math backend (matrix products and a softmax): no shared kernel.

from ragged_toolkit import tolerances
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
# Which attention backend trains fastest here
# -------------------------------------------
# The model's attention job on the first batch, causal, grouped-query,
# forward and backward: ``compare_backends`` checks each backend that runs
# here against the float32 reference and times them all. Each row: median
# and interquartile range (IQR) in ms, peak memory in MiB, and in brackets
# the :term:`kernel label` of what ran (``CPU flash`` is SDPA's fused CPU
# kernel). The packed model trains with the fastest.

from ragged_toolkit import Timing, compare_backends, fastest, print_timings




q_job = torch.randn(len(tokens), cfg.n_heads, cfg.head_dim, device=DEVICE, dtype=DTYPE)
kv_job = torch.randn(len(tokens), cfg.n_kv_heads, cfg.head_dim, device=DEVICE,
                     dtype=DTYPE)
backends = compare_backends(q_job, kv_job, kv_job.clone(), offsets, is_causal=True,
                            backward=True, min_run_time=RUN_TIME)
TRAINING_BACKEND = fastest(backends)
print(f"training backend chosen on {DEVICE}: {TRAINING_BACKEND}")

# %%
# Compile where it helps
# ~~~~~~~~~~~~~~~~~~~~~~
# Every batch has a new size, so ``torch.compile(dynamic=True)`` compiles
# each graph once for symbolic sizes. The packed attention call is not
# traced (``ragged_attention`` is host-side bookkeeping around the kernel
# calls): the compiled packed model is a few graphs around it, and the table
# counts them, which shows whether anything recompiled per batch. Each side
# trains a few steps both ways, on copies of the models, and keeps the
# faster; the first steps, which compile, are left out.

import functools
import time

from ragged_toolkit import synchronize
from torch._dynamo.utils import counters  # counts the graphs compiled


def train_step(model, optimizer, loss):
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def probe(make_loss, model, compiled, steps):
    """Tokens per second of ``steps`` training steps on a copy of ``model``,
    after the first ``WARMUP_STEPS``; how long those took; how many graphs
    were compiled on the way."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    runner = torch.compile(model, dynamic=True) if compiled else model
    graphs_before, elapsed = counters["stats"]["unique_graphs"], []
    for tokens_i, offsets_i in batches[:steps]:
        start = time.perf_counter()
        train_step(model, optimizer, make_loss(runner, tokens_i, offsets_i))
        synchronize()
        elapsed.append(time.perf_counter() - start)
    timed = sum(len(t) for t, _ in batches[WARMUP_STEPS:steps])
    graphs = counters["stats"]["unique_graphs"] - graphs_before
    return timed / sum(elapsed[WARMUP_STEPS:]), sum(elapsed[:WARMUP_STEPS]), graphs


packed_step_loss = functools.partial(packed_loss, backend=TRAINING_BACKEND)
PROBE_STEPS = WARMUP_STEPS + (3 if QUICK else 6)
sizes = len({len(t) for t, _ in batches[:PROBE_STEPS]})
print(f"  {'trainer':16s}  tokens/s  first {WARMUP_STEPS} steps  graphs compiled "
      f"({PROBE_STEPS} batches, {sizes} sizes)")
speeds = {}
for side, make_loss, model in (("packed", packed_step_loss, ragged_model),
                               ("padded", padded_loss, padded_model)):
    for compiled in (False, True):
        name = f"{side}, {'compiled' if compiled else 'eager'}"
        speeds[name], warm, graphs = probe(make_loss, model, compiled, PROBE_STEPS)
        print(f"  {name:16s}  {speeds[name]:8,.0f}  {warm:11.1f} s"
              + (f"  {graphs:15d}" if compiled else ""))
COMPILE = {side: speeds[f"{side}, compiled"] > speeds[f"{side}, eager"]
           for side in ("packed", "padded")}
print("compile chosen: " + ", ".join(f"{s} {'yes' if c else 'no'}"
                                     for s, c in COMPILE.items()))

# %%
# Training
# --------
# Same weights, same batches in the same order, same optimizer (AdamW) and
# schedule (linear warm-up, cosine decay). The trainers take turns, one step
# each, so that whatever else the machine does slows both alike. A step is
# timed from the batch on the device to the optimizer's update, synchronized;
# throughput counts *real* tokens (the padded trainer gets no credit for
# padding) after the first ``WARMUP_STEPS``.

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
                          make_loss=make_loss, scheduler=scheduler, seconds=[])
for tokens_i, offsets_i in batches:
    for t in trainers.values():
        start = time.perf_counter()
        loss = t["make_loss"](t["runner"], tokens_i, offsets_i)
        loss = train_step(t["model"], t["optimizer"], loss)
        t["scheduler"].step()
        synchronize()
        t["seconds"].append(time.perf_counter() - start)
        t["losses"].append(loss.item())

timed_tokens = np.array([len(b[0]) for b in batches[WARMUP_STEPS:]])
for side, t in trainers.items():
    seconds = np.array(t["seconds"][WARMUP_STEPS:])
    t["tokens/s"] = timed_tokens.sum() / seconds.sum()
    q1, q3 = np.percentile(timed_tokens / seconds, [25, 75])
    first, last = np.mean(t["losses"][:5]), np.mean(t["losses"][-10:])
    print(f"{side}: loss {first:.3f} -> {last:.3f}, "
          f"{t['tokens/s']:,.0f} real tokens/s (per-step IQR {q3 - q1:,.0f})")

# %%
# The work bound of this run
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# What each trainer must compute over the timed batches: ``2 x`` the weights
# of every matrix per token, and ``4 H D`` per query-key pair and layer for
# attention, the causal half on both sides (the padded causal kernel skips
# the masked half too). The backward pass scales both sides alike.

from ragged_toolkit import pairs_scored

per_token = 2 * (n_params - cfg.vocab_size * cfg.dim)  # every matrix but the embedding
per_pair = cfg.n_layers * 4 * cfg.n_heads * cfg.head_dim
work = {"packed": 0.0, "padded": 0.0}
for _, offsets_i in batches[WARMUP_STEPS:]:
    lengths_i = offsets_i.diff().cpu()
    longest = torch.full_like(lengths_i, int(lengths_i.max()))
    work["packed"] += (per_token * float(lengths_i.sum())
                       + per_pair * pairs_scored(lengths_i, lengths_i, True))
    work["padded"] += (per_token * float(longest.sum())
                       + per_pair * pairs_scored(longest, longest, True))
bound = work["padded"] / work["packed"]
R, P = trainers["packed"]["tokens/s"], trainers["padded"]["tokens/s"]
print(f"training: ragged {R:.0f} tokens/s, padded {P:.0f} tokens/s, "
      f"speedup {R / P:.2f}x, work bound {bound:.2f}x, fraction {R / P / bound:.2f}")

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

from ragged_toolkit import profile_call

tokens_l, offsets_l = batches[-1]
for side, t in trainers.items():
    model_copy = copy.deepcopy(t["model"])
    peak, kernels = profile_call(
        lambda: t["make_loss"](model_copy, tokens_l, offsets_l).backward())
    print(f"{side}: peak {peak:6.1f} MiB above the weights  [{kernels}]")

# %%
# The two loss curves must agree: the trainers compute the same thing, so
# they can only drift apart by rounding. The page stops unless the packed
# model learned (its last ten losses average below 60% of its first five)
# and the two curves' averages over the last ten steps agree within 2%. The
# curves lie on top of each other, so the first figure marks them with
# different symbols at different steps and plots their difference below;
# the second puts them against wall-clock time, where the faster trainer's
# curve reaches each loss first.

losses = {side: np.array(t["losses"]) for side, t in trainers.items()}
first, last = losses["packed"][:5].mean(), losses["packed"][-10:].mean()
last_padded = losses["padded"][-10:].mean()
assert last < 0.6 * first, f"the packed model did not learn: {first:.3f} -> {last:.3f}"
assert abs(last - last_padded) < 0.02 * last_padded, \
    f"the curves disagree: {last:.4f} vs {last_padded:.4f}"
print(f"packed loss {first:.3f} -> {last:.3f}")
print(f"last ten steps: packed {last:.4f}, padded {last_padded:.4f}")

import matplotlib.pyplot as plt
from ragged_toolkit import FIGURE_STYLE

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
# The trained model now writes, greedily, ``NEW_TOKENS`` tokens for each of
# a batch of prompts. The keys and values of every token go into a cache
# with room for ``capacity`` tokens per sequence; seen as packed rows,
# sequence ``b`` owns rows ``b * capacity ...``: a packed batch whose offsets
# are ``capacity`` apart.
#
# .. literalinclude:: ../tutorials/ragged_toolkit.py
#    :pyobject: KVCache
#
# Generation runs two ways:
#
# * **packed**: the prompts packed end to end and prefilled in one call,
#   each token writing its keys and values into its sequence's rows; then
#   each step feeds one token per sequence, at its own position, attending
#   to its own keys (``kv_used``);
# * **padded**: the prompts left-padded, as Hugging Face's ``generate`` pads
#   them; prefill with a causal mask that also hides the padding, then each
#   step writes one column of the cache and masks the padding keys.
#
# .. literalinclude:: ../tutorials/ragged_toolkit.py
#    :pyobject: generate_packed

from ragged_toolkit import KVCache, generate_packed


@torch.no_grad()
def generate_padded(model, prompts, offsets, n_new):
    """Greedy generation for the same prompts, left-padded to (B, S)."""
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
    cache = KVCache(model.cfg, B, S + n_new, prompts.device, DTYPE)
    keys_valid = torch.cat([valid, valid.new_ones(B, n_new)], 1)  # (B, S + n_new)
    with torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32):
        prefill = Padded(mask[:, None], cache, 0)
        logits = model(ids, positions, prefill)[:, -1]  # (B, vocab)
        out = []
        for step in range(n_new):
            out.append(logits.argmax(-1))
            if step < n_new - 1:
                column = S + step
                layout = Padded(keys_valid[:, None, None, :column + 1], cache, column)
                logits = model(out[-1][:, None], (lengths + step)[:, None], layout)[:, -1]
    return torch.stack(out, 1)


# %%
# The decoding backend is measured like the training job: one query per
# sequence against its cached keys (``compiled graph (inductor kernel)`` is
# the code ``torch.compile`` generated, FlexAttention's on a CPU).

prompt_lengths = sentence_lengths(rng, PROMPTS, ZIPF_ALPHA).clamp(
    max=cfg.max_seq_len - NEW_TOKENS)
prompt_offsets = offsets_from_lengths(prompt_lengths, DEVICE)
prompts = documents(rng, tables, prompt_lengths).to(DEVICE)
model = trainers["packed"]["model"].eval()
print(f"{PROMPTS} prompts, {len(prompts)} tokens, longest {int(prompt_lengths.max())}; "
      f"left padding makes {PROMPTS * int(prompt_lengths.max())} token slots")

capacity = int(prompt_lengths.max()) + NEW_TOKENS
used = (prompt_lengths + NEW_TOKENS // 2).to(DEVICE)  # a decoding step half way
q_step = torch.randn(PROMPTS, cfg.n_heads, cfg.head_dim, device=DEVICE, dtype=DTYPE)
kv_step = torch.randn(PROMPTS * capacity, cfg.n_kv_heads, cfg.head_dim, device=DEVICE,
                      dtype=DTYPE)
one_each = torch.arange(PROMPTS + 1, device=DEVICE)  # one query per sequence
decode_backends = compare_backends(q_step, kv_step, kv_step.clone(), one_each,
                                   one_each * capacity, is_causal=True, kv_used=used,
                                   min_run_time=RUN_TIME / 2)

# %%
# That table times one step's attention with its bookkeeping done. While
# generating, the lengths change at every step, so whatever a backend
# prepares per batch (gather indices, a block mask) is prepared again at
# every step; the choice is made on whole generations, for the two backends
# with the fastest steps above:

from ragged_toolkit import measure, speedup_line, where_time_goes

ran = sorted((n for n, r in decode_backends.items() if isinstance(r, Timing)),
             key=lambda n: decode_backends[n].median_ms)[:2]
generation_times = measure(
    {name: lambda name=name: generate_packed(model, prompts, prompt_offsets,
                                             NEW_TOKENS, name) for name in ran},
    min_run_time=RUN_TIME / 2, profile=False)
print_timings({f"generation with {n}": t for n, t in generation_times.items()})
DECODE_BACKEND = fastest(generation_times)
print(f"decoding backend chosen on {DEVICE}: {DECODE_BACKEND}")

# %%
# Both generations must write the same tokens (in float32 token for token;
# in bfloat16 rounding can flip a near tie, so there 90% must agree). Then
# both are timed. The work bound counts the tokens and pairs of the prefill,
# then one token per sequence per step, each scoring every key in use: on
# the padded side the padding keys too.


def padded_generation():
    return generate_padded(model, prompts, prompt_offsets, NEW_TOKENS)


def packed_generation():
    return generate_packed(model, prompts, prompt_offsets, NEW_TOKENS, DECODE_BACKEND)


out_packed, out_padded = packed_generation(), padded_generation()
agree = (out_packed == out_padded).float().mean().item()
assert agree >= (1.0 if DTYPE == torch.float32 else 0.9), \
    f"the generations agree on {agree:.1%} of the tokens"
print(f"packed and padded generation agree on {agree:.1%} of {out_packed.numel()} tokens")

times = measure({"padded": padded_generation, "packed": packed_generation},
                min_run_time=2 * RUN_TIME)
print_timings({f"generation, {n}": t for n, t in times.items()})
new = PROMPTS * NEW_TOKENS
print(", ".join(f"{side} {new / t.median_ms * 1e3:,.0f}" for side, t in times.items())
      + " new tokens/s")
steps = torch.arange(NEW_TOKENS - 1)
longest = int(prompt_lengths.max())
work_packed = (per_token * (float(prompt_lengths.sum()) + PROMPTS * (NEW_TOKENS - 1))
               + per_pair * (pairs_scored(prompt_lengths, prompt_lengths, True)
                             + float((prompt_lengths[:, None] + steps + 1).sum())))
work_padded = (per_token * PROMPTS * (longest + NEW_TOKENS - 1)
               + per_pair * PROMPTS * (longest * (longest + 1) / 2
                                       + float((longest + steps + 1).sum())))
generation_bound = work_padded / work_packed
print(speedup_line("generation", times["padded"], times["packed"], generation_bound))

# %%
# The packed side saves most of its work in the prefill; every decoding
# step runs one token per sequence on both sides, so the bound is smaller
# than in training. A fraction below 1 is the cost of the packed steps'
# bookkeeping (with the loop backend, one attention call per sequence and
# layer); above 1, the padded side is slower per unit of work, its larger
# cache and masks costing memory traffic that the bound does not count.
# The operators that took most of each generation's time:

for side, fn in (("padded", padded_generation), ("packed", packed_generation)):
    print(f"{side} generation:")
    print(where_time_goes(fn))

# %%
# Conclusion
# ----------
# A packed trainer is the padded trainer minus the padding: the same
# modules, loss, targets and optimizer, and a loss curve that ends where the
# padded one ends, within rounding. What changes is the work: the training
# and generation lines say how much of the work bound this device turned
# into speed, the peak-memory lines what padding would have held.
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
