"""
A packed GPT, trained and served without padding
================================================

Pretrain a small modern decoder-only model on packed documents, the way
``DataCollatorWithFlattening`` of Hugging Face and the packing of ``torchtune``
and ``torchtitan`` do, against the best padded trainer a reader
would write: same weights, same documents, same optimizer. Then generate from
it with a KV cache that keeps each sequence's own length.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How to write a GPT (RMSNorm, rotary positions that restart at every
         document, SwiGLU, grouped-query attention) whose modules run on a
         packed batch and, unchanged, on a padded one
       * How to train it on packed documents, prove that it computes what the
         padded model computes, and measure real tokens per second against
         the work bound
       * How to prefill packed prompts and decode into a KV cache with
         per-sequence lengths, and how that compares with padded generation

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * The toolkit of the building-blocks page (copied below, so this file
         runs on its own)
       * PyTorch 2.11 or later; a CPU is enough, a CUDA GPU runs it at a
         larger scale in ``bfloat16``

Fine-tuning and pretraining data comes in documents of very different
lengths. Padding them into a ``(B, S)`` rectangle makes every layer work on
the longest document's length for every row; packing them end to end, with
attention kept inside each document, makes every layer work on the real
tokens only. This page measures what that buys for a whole model, end to
end: data, forward, loss, backward and optimizer step.
"""

# sphinx_gallery_tags = ["GPT", "training", "packing", "KV cache", "benchmarks"]

# %%
# Setup
# -----

import copy
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


from ragged_toolkit import (
    GPT, GPTConfig, KVCache, Packed, Padded, Timing, synchronize, compare_backends, default_device,
    default_dtype, fastest, generate_packed, measure, offsets_from_lengths, pairs_scored,
    profile_call, quick_mode, quiet_known_notes, sentence_lengths, speedup_line, to_padded,
    token_index, tolerances, where_time_goes,
)

DEVICE = default_device()
DTYPE = default_dtype(DEVICE)
QUICK = quick_mode()
SEED = 0
print(f"PyTorch {torch.__version__}, device: {DEVICE}, dtype: {DTYPE}, quick mode: {QUICK}")

# sphinx_gallery_start_ignore
quiet_known_notes()
# sphinx_gallery_end_ignore

# %%
# Sizes
# ~~~~~
# Every size is set here. On CPU the model is small (width 256, two layers)
# so that the whole page builds in a few minutes on two cores; on CUDA it is
# four times wider, twice as deep, and trains in ``bfloat16`` autocast. Documents
# are drawn from the site's length generator, uncapped but for the model's
# context length, which a real trainer would cap at too.

if DEVICE == "cuda":
    MODEL = dict(vocab_size=4096, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_hidden=2816,
                 max_seq_len=4096)
    DOCS_PER_BATCH, STEPS, LR, ZIPF_ALPHA = 128, 300, 1e-3, 1.1
    PROMPTS, NEW_TOKENS = 64, 64
else:  # real runs: width 2048 and up, 16+ layers, thousands of documents per step
    MODEL = dict(vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=688,
                 max_seq_len=1024)
    DOCS_PER_BATCH, STEPS, LR, ZIPF_ALPHA = 32, 100, 3e-3, 1.2
    PROMPTS, NEW_TOKENS = 16, 32
if QUICK:
    MODEL.update(vocab_size=128, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=176)
    DOCS_PER_BATCH, STEPS, LR, PROMPTS, NEW_TOKENS = 16, 60, 1e-2, 8, 8
TOPICS = 4  # the corpus below has this many kinds of document
WARMUP_STEPS = 3  # steps left out of the throughput figures (first calls, compilation)
RUN_TIME = 0.2 if QUICK else 1.0 if DEVICE == "cuda" else 0.4  # seconds of timed runs per comparison
print(f"model {MODEL}")
print(f"{STEPS} steps of {DOCS_PER_BATCH} documents, Zipf exponent {ZIPF_ALPHA}")

# %%
# A corpus of packed documents
# ----------------------------
# The documents must be learnable, so that the two trainers can be compared
# on a loss that falls, and they must need attention within the document.
# Each document has a topic, its first token; after that, every token is
# drawn from four likely successors of the previous token, and the table of
# successors is the topic's own. A model that does not look back at the
# document's first token cannot know which table applies, and one that looks
# into the previous document would read the wrong topic, so the document
# boundaries matter. The lengths come from the site's sentence-length
# generator, capped at the model's context length.


def successor_tables(rng, topics, vocab):
    """For each topic and token: four successor tokens (topic ids excluded)."""
    return rng.integers(topics, vocab, size=(topics, vocab, 4))


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
    return torch.from_numpy(np.concatenate([ids[b, :n] for b, n in enumerate(lengths.tolist())]))


def next_token_targets(tokens, offsets):
    """The token each position must predict; -100 (ignored) at each document's end."""
    targets = tokens.roll(-1).clone()
    targets[offsets[1:] - 1] = -100
    return targets


rng = np.random.default_rng(SEED)
tables = successor_tables(rng, TOPICS, MODEL["vocab_size"])
batches, cut = [], 0
for _ in range(STEPS):
    lengths = sentence_lengths(rng, DOCS_PER_BATCH, ZIPF_ALPHA)
    cut += int((lengths > MODEL["max_seq_len"]).sum())
    lengths = lengths.clamp(max=MODEL["max_seq_len"])
    offsets = offsets_from_lengths(lengths)
    batches.append((documents(rng, tables, lengths).to(DEVICE), offsets.to(DEVICE)))
real = sum(len(tokens) for tokens, _ in batches)
slots = sum(DOCS_PER_BATCH * int(offsets.diff().max()) for _, offsets in batches)
print(f"{real} real tokens in {STEPS} batches; padded batches would hold {slots} token slots, "
      f"{slots / real:.2f}x the real tokens ({cut} documents cut at the context length)")
tokens, offsets = batches[0]
print(f"first batch: lengths {offsets.diff().tolist()[:12]} ...")

# %%
# The model
# ---------
# The usual modern decoder-only stack, written flat in the style of
# ``gpt-fast``: token embedding; blocks of RMSNorm, grouped-query attention
# with rotary position embeddings, RMSNorm and a SwiGLU feed-forward network,
# each with a residual connection; a final RMSNorm and an output layer. The
# output layer is a separate matrix, not tied to the embedding, as in Llama.
#
# Every module works on the last dimension only, so the same weights run on
# a packed batch ``(T, dim)`` and on a padded one ``(B, S, dim)``. The one
# place that must know which it is, attention, gets a small *layout* object:
#
# * ``Packed``: the offsets, and ``ragged_attention`` with a backend;
# * ``Padded``: one SDPA call over ``(B, H, S, D)``. With right padding and
#   ``is_causal`` a real token never sees a padding token, so training needs
#   no mask at all and runs a fused causal kernel; generation with left
#   padding passes an explicit mask.
#
# Both layouts can also write the new keys and values into a KV cache first;
# that is for generation, at the end of the page. Rotary embeddings take each
# token's position *in its own document*, which for the packed batch comes
# from ``token_index``: positions restart at every document, exactly the
# ``position_ids`` of Hugging Face's packed format.

from dataclasses import dataclass


cfg = GPTConfig(**MODEL)
torch.manual_seed(SEED)
ragged_model = GPT(cfg).to(DEVICE)
padded_model = copy.deepcopy(ragged_model)  # the same initial weights
n_params = sum(p.numel() for p in ragged_model.parameters())
print(f"{n_params / 1e6:.2f} M parameters; {cfg.n_heads} query heads share {cfg.n_kv_heads} key/value heads")

# %%
# One training step, two ways
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The packed step feeds the documents as they are, ``(T,)`` ids with their
# offsets. The padded step is the best padded trainer a reader would write:
# the same model on right-padded ``(B, S)`` ids, SDPA with ``is_causal`` and
# no mask, the loss masked at padding with ``ignore_index``. Both average the
# loss over the same real targets. On CUDA both run under ``bfloat16``
# autocast, as mixed-precision training does; the weights stay in float32.


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
# thing: same loss, and the same gradient for every parameter, on the first
# batch. The packed side uses the per-sequence loop here, which every device
# has. The padded side runs on PyTorch's math backend of SDPA (attention
# written out as matrix products and a softmax), so that the two share no
# attention kernel.

tolerance = tolerances(DTYPE)
loss_r = packed_loss(ragged_model, tokens, offsets, "loop")
loss_r.backward()
with sdpa_kernel(SDPBackend.MATH):
    loss_p = padded_loss(padded_model, tokens, offsets)
    loss_p.backward()
torch.testing.assert_close(loss_r, loss_p, **tolerance)
for (name, p_r), p_p in zip(ragged_model.named_parameters(), padded_model.parameters()):
    torch.testing.assert_close(p_r.grad, p_p.grad, **tolerance, msg=lambda m, name=name: f"{name}: {m}")
print(f"loss {loss_r.item():.4f} (packed) and {loss_p.item():.4f} (padded); "
      f"gradients of all {n_params:,} parameters agree "
      f"(largest difference {max((a.grad - b.grad).abs().max().item() for a, b in zip(ragged_model.parameters(), padded_model.parameters())):.1e})")
ragged_model.zero_grad(set_to_none=True)
padded_model.zero_grad(set_to_none=True)

# %%
# Which attention backend trains fastest here
# -------------------------------------------
# The model's attention job, measured on this device: causal, grouped-query
# (``n_heads`` query heads over ``n_kv_heads`` key/value heads), forward and
# backward, on the first batch. The packed model trains with the winner.

q_job = torch.randn(len(tokens), cfg.n_heads, cfg.head_dim, device=DEVICE, dtype=DTYPE)
kv_job = torch.randn(len(tokens), cfg.n_kv_heads, cfg.head_dim, device=DEVICE, dtype=DTYPE)
backends = compare_backends(q_job, kv_job, kv_job.clone(), offsets, is_causal=True, backward=True,
                            min_run_time=RUN_TIME)
TRAINING_BACKEND = fastest(backends)
print(f"training backend chosen on {DEVICE}: {TRAINING_BACKEND}")

# %%
# Compile where it helps
# ~~~~~~~~~~~~~~~~~~~~~~
# Every batch has a new token count (packed) or a new longest document
# (padded), so a model compiled for fixed shapes would recompile at almost
# every step. ``torch.compile(dynamic=True)`` compiles each graph once for
# symbolic sizes instead. On the packed side the attention call is not
# traced (``ragged_attention`` is host-side bookkeeping around one kernel
# call per backend), so the compiled packed model is a few graphs around it;
# the probe prints how many graphs were compiled for how many batch sizes,
# which shows whether anything recompiled per batch.
# Whether compiling pays off depends on the device and the sizes, so each
# side trains a few steps both ways, on copies of the models, and keeps the
# faster. The first compiled steps are left out: they compile.


def train_step(model, optimizer, loss):
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


from torch._dynamo.utils import counters


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


def packed_step_loss(model, tokens, offsets):
    return packed_loss(model, tokens, offsets, TRAINING_BACKEND)


PROBE_STEPS = WARMUP_STEPS + (3 if QUICK else 6)
speeds = {}
for side, make_loss, model in (("packed", packed_step_loss, ragged_model),
                               ("padded", padded_loss, padded_model)):
    for compiled in (False, True):
        name = f"{side}, {'compiled' if compiled else 'eager'}"
        speeds[name], warm, graphs = probe(make_loss, model, compiled, PROBE_STEPS)
        print(f"{name:17s} {speeds[name]:9,.0f} tokens/s; its first {WARMUP_STEPS} steps took {warm:5.1f} s"
              + (f"; {graphs} graphs compiled for {PROBE_STEPS} batches of "
                 f"{len({len(t) for t, _ in batches[:PROBE_STEPS]})} different sizes" if compiled else ""))
COMPILE = {side: speeds[f"{side}, compiled"] > speeds[f"{side}, eager"] for side in ("packed", "padded")}
print("compile chosen: " + ", ".join(f"{side} {'yes' if c else 'no'}" for side, c in COMPILE.items()))

# %%
# Training
# --------
# Both trainers start from the same weights and see the same batches in the
# same order, with the same optimizer (AdamW) and learning-rate schedule
# (linear warm-up, cosine decay). They take turns, one step each, so that
# whatever else the machine does slows both alike. Each step is timed from
# the batch on the device to the update of the optimizer, with the device
# synchronized; throughput counts *real* tokens (the padded trainer gets no
# credit for padding) over the steps after the first ``WARMUP_STEPS``.


def schedule(step):
    warmup = max(STEPS // 20, 1)
    return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step / STEPS, 1.0)))


trainers = {}
for side, model, make_loss in (("packed", ragged_model, packed_step_loss),
                               ("padded", padded_model, padded_loss)):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    trainers[side] = dict(model=model, runner=torch.compile(model, dynamic=True) if COMPILE[side] else model,
                          optimizer=optimizer, make_loss=make_loss, losses=[], seconds=[],
                          scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, schedule))
for tokens_i, offsets_i in batches:
    for t in trainers.values():
        start = time.perf_counter()
        loss = train_step(t["model"], t["optimizer"], t["make_loss"](t["runner"], tokens_i, offsets_i))
        t["scheduler"].step()
        synchronize()
        t["seconds"].append(time.perf_counter() - start)
        t["losses"].append(loss.item())

timed_tokens = sum(len(t) for t, _ in batches[WARMUP_STEPS:])
for t in trainers.values():
    t["tokens/s"] = timed_tokens / sum(t["seconds"][WARMUP_STEPS:])
    per_step = np.array([len(b[0]) for b in batches[WARMUP_STEPS:]]) / np.array(t["seconds"][WARMUP_STEPS:])
    q1, q3 = np.percentile(per_step, [25, 75])
    t["spread"] = q3 - q1
for side, t in trainers.items():
    print(f"{side}: loss {np.mean(t['losses'][:5]):.3f} -> {np.mean(t['losses'][-10:]):.3f}, "
          f"{t['tokens/s']:,.0f} real tokens/s (per-step IQR {t['spread']:,.0f})")

# %%
# The work bound of this run
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# What each trainer must compute, counted per token and per query-key pair
# over the timed batches: the projections, feed-forward layers and output
# layer cost ``2 x`` their weights per token, and attention ``4 H D`` per
# pair per layer, the causal half on both sides (the padded trainer's
# causal kernel skips the masked half too). The forward and backward passes
# scale both sides alike, so the ratio is the bound.

per_token = 2 * (n_params - cfg.vocab_size * cfg.dim)  # every matrix but the embedding table
per_pair = cfg.n_layers * 4 * cfg.n_heads * cfg.head_dim
work = {"packed": 0.0, "padded": 0.0}
for _, offsets_i in batches[WARMUP_STEPS:]:
    lengths_i = offsets_i.diff().cpu()
    longest = torch.full_like(lengths_i, int(lengths_i.max()))
    work["packed"] += per_token * float(lengths_i.sum()) + per_pair * pairs_scored(lengths_i, lengths_i, True)
    work["padded"] += per_token * float(longest.sum()) + per_pair * pairs_scored(longest, longest, True)
bound = work["padded"] / work["packed"]
R, P = trainers["packed"]["tokens/s"], trainers["padded"]["tokens/s"]
print(f"training: ragged {R:.0f} tokens/s, padded {P:.0f} tokens/s, speedup {R / P:.2f}x, "
      f"work bound {bound:.2f}x, fraction {R / P / bound:.2f}")

# %%
# Peak memory of one training step on each side (forward and backward of the
# last batch, on copies so the trained models are untouched):

tokens_l, offsets_l = batches[-1]
for side, t in trainers.items():
    model_copy = copy.deepcopy(t["model"])
    peak, kernels = profile_call(lambda: t["make_loss"](model_copy, tokens_l, offsets_l).backward())
    print(f"{side}: peak {peak:.1f} MiB above the weights, attention kernels: {kernels}")

# %%
# The two loss curves must agree: the trainers compute the same thing, so
# they can only drift apart by rounding. The page stops unless the packed
# model learned (its last ten losses average below 60% of its first five)
# and the two curves' averages over the last ten steps agree within 2%.

import matplotlib.pyplot as plt

first, last = np.mean(trainers["packed"]["losses"][:5]), np.mean(trainers["packed"]["losses"][-10:])
last_padded = np.mean(trainers["padded"]["losses"][-10:])
assert last < 0.6 * first, f"the packed model did not learn: loss {first:.3f} -> {last:.3f}"
assert abs(last - last_padded) < 0.02 * last_padded, f"the curves disagree: {last:.4f} vs {last_padded:.4f}"
print(f"packed loss {first:.3f} -> {last:.3f}; last ten steps, packed {last:.4f} and padded {last_padded:.4f}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
for side, style in (("packed", "-"), ("padded", "--")):
    t = trainers[side]
    ax1.plot(t["losses"], style, label=f"{side} ({t['tokens/s']:,.0f} tokens/s)")
    ax2.plot(np.cumsum(t["seconds"]), t["losses"], style, label=side)
ax1.set(xlabel="step", ylabel="training loss", title=f"Same weights, same documents ({DEVICE})")
ax2.set(xlabel="seconds", ylabel="training loss", title="Loss against wall-clock time")
ax1.legend()
ax2.legend()
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# Generation
# ----------
# The trained model now writes. Prompts are the beginnings of new documents;
# ``NEW_TOKENS`` tokens are generated greedily for each. Two ways:
#
# * **packed**: the prompts' tokens packed end to end and prefilled in one
#   call, each writing its keys and values into its sequence's rows of the KV
#   cache; then each step feeds one token per sequence, at that sequence's own
#   position, and attends to that sequence's own keys (``kv_used``).
# * **padded**: the prompts left-padded to the longest one, as Hugging Face's
#   ``generate`` pads them, so that every sequence ends in the same column;
#   prefill with a causal mask that also hides the padding, then each step
#   writes one column of the cache and masks the padding keys.


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
        logits = model(ids, positions, Padded(mask[:, None], cache, 0))[:, -1]  # (B, vocab)
        out = []
        for step in range(n_new):
            out.append(logits.argmax(-1))
            if step < n_new - 1:
                column = S + step
                layout = Padded(keys_valid[:, None, None, :column + 1], cache, column)
                logits = model(out[-1][:, None], (lengths + step)[:, None], layout)[:, -1]
    return torch.stack(out, 1)


# %%
# Prompts, and the backend for decoding: one query per sequence against that
# sequence's cached keys, measured like the training job.

prompt_lengths = sentence_lengths(rng, PROMPTS, ZIPF_ALPHA).clamp(max=cfg.max_seq_len - NEW_TOKENS)
prompt_offsets = offsets_from_lengths(prompt_lengths, DEVICE)
prompts = documents(rng, tables, prompt_lengths).to(DEVICE)
model = trainers["packed"]["model"].eval()
print(f"{PROMPTS} prompts, {len(prompts)} tokens, longest {int(prompt_lengths.max())}; "
      f"left padding makes {PROMPTS * int(prompt_lengths.max())} token slots")

capacity = int(prompt_lengths.max()) + NEW_TOKENS
used = (prompt_lengths + NEW_TOKENS // 2).to(DEVICE)  # a decoding step half way
q_step = torch.randn(PROMPTS, cfg.n_heads, cfg.head_dim, device=DEVICE, dtype=DTYPE)
kv_step = torch.randn(PROMPTS * capacity, cfg.n_kv_heads, cfg.head_dim, device=DEVICE, dtype=DTYPE)
decode_backends = compare_backends(q_step, kv_step, kv_step.clone(), torch.arange(PROMPTS + 1, device=DEVICE),
                                   torch.arange(PROMPTS + 1, device=DEVICE) * capacity, is_causal=True,
                                   kv_used=used, min_run_time=RUN_TIME / 2)

# %%
# That table times one step's attention with its bookkeeping already done.
# In generation the lengths change at every step, so whatever a backend
# prepares per batch (gather indices, a block mask) is prepared again at
# every step, once for all layers. So the choice is made on whole
# generations, for the two backends with the fastest steps above:

ran = sorted((n for n, r in decode_backends.items() if isinstance(r, Timing)),
             key=lambda n: decode_backends[n].median_ms)[:2]
generation_times = measure({name: lambda name=name: generate_packed(model, prompts, prompt_offsets, NEW_TOKENS, name)
                            for name in ran}, min_run_time=RUN_TIME / 2, profile=False)
for name, t in generation_times.items():
    print(f"  generation with {name:9s} {t}")
DECODE_BACKEND = fastest(generation_times)
print(f"decoding backend chosen on {DEVICE}: {DECODE_BACKEND}")

# %%
# Both generations must write the same tokens: they run the same model on
# the same prompts, packed or padded. (In float32 they agree token for
# token; in bfloat16 rounding can flip a near tie, so the check there asks
# for 90% of the tokens.)

out_packed = generate_packed(model, prompts, prompt_offsets, NEW_TOKENS, DECODE_BACKEND)
out_padded = generate_padded(model, prompts, prompt_offsets, NEW_TOKENS)
agree = (out_packed == out_padded).float().mean().item()
assert agree >= (1.0 if DTYPE == torch.float32 else 0.9), f"the generations agree on {agree:.1%} of the tokens"
print(f"packed and padded generation agree on {agree:.1%} of {out_packed.numel()} tokens")

times = measure({"padded": lambda: generate_padded(model, prompts, prompt_offsets, NEW_TOKENS),
                 "packed": lambda: generate_packed(model, prompts, prompt_offsets, NEW_TOKENS, DECODE_BACKEND)},
                min_run_time=2 * RUN_TIME)
new = PROMPTS * NEW_TOKENS
for side, t in times.items():
    print(f"generation, {side}: {t}  {new / t.median_ms * 1e3:,.0f} new tokens/s")
# the work: the tokens and pairs of the prefill, then one token per sequence per
# step, scoring every key in use (padding keys too, on the padded side)
steps = torch.arange(NEW_TOKENS - 1)
work_packed = (per_token * (float(prompt_lengths.sum()) + PROMPTS * (NEW_TOKENS - 1))
               + per_pair * (pairs_scored(prompt_lengths, prompt_lengths, True)
                             + float((prompt_lengths[:, None] + steps + 1).sum())))
longest = int(prompt_lengths.max())
work_padded = (per_token * PROMPTS * (longest + NEW_TOKENS - 1)
               + per_pair * PROMPTS * (longest * (longest + 1) / 2 + float((longest + steps + 1).sum())))
print(speedup_line("generation", times["padded"], times["packed"], work_padded / work_packed))

# %%
# Where the generation time goes: most of the work the packed side saves is
# in the prefill, while every decoding step runs the model on one token per
# sequence on both sides, and the packed side attends sequence by sequence
# when the loop is its decoding backend. The operators that took most of
# each generation's time:

for side, fn in (("padded", lambda: generate_padded(model, prompts, prompt_offsets, NEW_TOKENS)),
                 ("packed", lambda: generate_packed(model, prompts, prompt_offsets, NEW_TOKENS,
                                                    DECODE_BACKEND))):
    print(f"{side} generation:")
    print(where_time_goes(fn))

# %%
# Conclusion
# ----------
# A packed trainer is the padded trainer minus the padding: the same modules,
# the same loss on the same targets, the same optimizer, and a loss curve that
# ends where the padded one ends, within noise. What changes is the work. The training line above
# compares real tokens per second on this device, beside the work bound of
# the run and the fraction of it the packed trainer reached; the peak-memory
# lines show the activations that padding would have held. In generation,
# the work padding adds is in the prefill and in the padding keys that every
# decoding step scores, while each step runs one token per sequence on both
# sides; the generation line says how much of that this device turned into
# speed.
#
# In a real trainer the packed batch is what Hugging Face's
# ``DataCollatorWithFlattening`` produces (``position_ids`` restarting at 0;
# ``offsets_from_position_ids`` on the building-blocks page turns them into
# offsets), and on a GPU ``varlen_attn`` is the attention call.
#
# Further reading
# ---------------
# * `Packing with FlashAttention 2 <https://huggingface.co/blog/packing-with-FA2>`_
# * `torchtitan <https://github.com/pytorch/torchtitan>`_ and
#   `torchtune <https://github.com/pytorch/torchtune>`_ (sample packing)
# * `gpt-fast <https://github.com/meta-pytorch/gpt-fast>`_ (the model's style, the KV cache)
# * Ainslie et al., `GQA <https://arxiv.org/abs/2305.13245>`_; Su et al.,
#   `RoFormer <https://arxiv.org/abs/2104.09864>`_; Shazeer,
#   `GLU variants <https://arxiv.org/abs/2002.05202>`_
