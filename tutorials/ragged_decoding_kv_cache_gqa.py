"""
Decoding ragged batches: a KV cache, grouped-query attention and varlen attention
=================================================================================

Generate from a batch of prompts of different lengths with a key/value cache
in which every sequence keeps its own length, prove every step against a
recomputation, shrink the cache with grouped-query attention, and see which
attention kernel serves each decoding step on the device at hand.

**Author:** the ragged-transformers tutorial contributors, building on the
transformer building blocks tutorial by
`Mikayla Gawarecki <https://github.com/mikaylagawarecki>`_

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How to prefill packed prompts and decode into a KV cache whose
         sequences each keep their own length, with ``ragged_attention``'s
         ``kv_used``, and how to prove every cached step correct
       * What the cache costs in memory, and what grouped-query attention
         saves, with the kernel that actually ran printed beside each time
       * How to decode with FlexAttention without rebuilding its block mask at
         every step, and where ``varlen_attn`` fits

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * The toolkit of the building-blocks page and the model of the packed
         GPT page (both copied below, so this file runs on its own)
       * PyTorch 2.11 or later; ``varlen_attn`` needs a CUDA GPU of compute
         capability 8.0 or newer, and the page says what runs in its place
         without one

The original building-blocks tutorial left three sections pending in 2024:
key/value caching on nested tensors, grouped-query attention (GQA) on nested
tensors and FlexAttention on nested tensors. Since then PyTorch has pointed
ragged attention at packed sequences instead: all tokens end to end, with
offsets saying where each sequence starts, which is the toolkit of this
site. This page writes the three sections on it, with the model of the packed GPT page.
"""

# sphinx_gallery_tags = ["KV cache", "GQA", "varlen attention", "FlexAttention", "decoding"]

# %%
# Setup
# -----

import copy
import inspect
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


from ragged_toolkit import (
    GPT, GPTConfig, KVCache, Packed, Timing, compiled_flex_attention, varlen_attn, varlen_keywords,
    backend_support, compare_backends, default_device, default_dtype, fastest, generate_packed,
    measure, offsets_from_lengths, pairs_scored, quick_mode, quiet_known_notes,
    reference_attention, sentence_lengths, speedup_line, token_index, tolerances,
    where_time_goes,
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
# The model is small and randomly initialized (seeded): the point is the
# mechanics of decoding and their correctness, not the text it writes. For
# scale, Llama-2-70B uses GQA with 8 key/value heads for 64 query heads, a
# width of 8192 and 80 layers, and serves batches of dozens to hundreds of
# sequences.

if DEVICE == "cuda":
    MODEL = dict(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_hidden=2816,
                 max_seq_len=4096)
    PROMPTS, ZIPF_ALPHA, NEW_TOKENS, GEN_LENGTHS = 64, 1.1, 128, (32, 64, 128)
    RUN_TIME = 1.0
else:  # real serving: width 4096 and up, 32+ layers, 64-256 sequences
    MODEL = dict(vocab_size=512, dim=128, n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden=352,
                 max_seq_len=1024)
    PROMPTS, ZIPF_ALPHA, NEW_TOKENS, GEN_LENGTHS = 16, 1.2, 32, (8, 32)
    RUN_TIME = 0.25
if QUICK:
    MODEL.update(dim=64, n_layers=2, ffn_hidden=176, vocab_size=256)
    PROMPTS, NEW_TOKENS, GEN_LENGTHS, RUN_TIME = 6, 8, (4, 8), 0.1
print(f"model {MODEL}; {PROMPTS} prompts, {NEW_TOKENS} new tokens each")

# %%
# A batch of prompts
# ------------------
# Prompt lengths come from the site's length generator: most prompts are
# short, a few are long. Two models share everything but the number of
# key/value heads: multi-head attention (MHA, one key/value head per query
# head) and grouped-query attention (GQA, ``n_heads / n_kv_heads`` query
# heads share each key/value head).

rng = np.random.default_rng(SEED)
prompt_lengths = sentence_lengths(rng, PROMPTS, ZIPF_ALPHA).clamp(max=MODEL["max_seq_len"] - NEW_TOKENS)
prompt_offsets = offsets_from_lengths(prompt_lengths, DEVICE)
gen = torch.Generator(DEVICE).manual_seed(SEED)
prompts = torch.randint(MODEL["vocab_size"], (int(prompt_lengths.sum()),), generator=gen, device=DEVICE)
print(f"prompt lengths {prompt_lengths.tolist()}")
print(f"{len(prompts)} prompt tokens, longest {int(prompt_lengths.max())}; "
      f"padding to the longest would hold {PROMPTS * int(prompt_lengths.max())}")

gqa_cfg = GPTConfig(**MODEL)
mha_cfg = GPTConfig(**dict(MODEL, n_kv_heads=MODEL["n_heads"]))
torch.manual_seed(SEED)
gqa_model = GPT(gqa_cfg).to(DEVICE).eval()
torch.manual_seed(SEED)
mha_model = GPT(mha_cfg).to(DEVICE).eval()
if DTYPE != torch.float32:  # serving runs the weights in the low precision too
    gqa_model, mha_model = gqa_model.to(DTYPE), mha_model.to(DTYPE)
print(f"MHA: {mha_cfg.n_heads} query heads, {mha_cfg.n_kv_heads} key/value heads; "
      f"GQA: {gqa_cfg.n_heads} query heads, {gqa_cfg.n_kv_heads} key/value heads")

# %%
# The KV cache, step by step
# --------------------------
# During decoding each sequence adds one token per step, and that token's
# query must see the keys and values of everything before it. The cache
# keeps them: ``KVCache`` holds, per layer, room for ``capacity`` tokens per
# sequence, ``(B, capacity, H_kv, D)``. Seen as packed rows, sequence ``b``
# owns rows ``b * capacity ...``, so the cache is a packed batch whose
# offsets are ``capacity`` apart, of which each sequence uses the first
# ``kv_used`` rows: exactly what ``ragged_attention`` (and ``varlen_attn``,
# whose ``seqused_k`` is the same thing) takes.
#
# * **Prefill**: all prompt tokens, packed, go through the model at once;
#   each writes its key and value into its sequence's row ``b * capacity + p``
#   and attends causally to its own prompt.
# * **Decode**: one token per sequence, at that sequence's own position
#   ``lengths[b]``, written into its next row; its query sees every key its
#   sequence has.
#
# The loop below is ``generate_packed`` unrolled, with a check at every step:
# the cached logits must equal a recomputation of the whole history without
# any cache, for every sequence. Both run the per-sequence loop backend, so
# that this check is about the cache's bookkeeping; the kernel of every
# backend is checked against the float32 reference in the tables below.

torch.manual_seed(SEED)
history = [prompts[int(a):int(b)].tolist() for a, b in zip(prompt_offsets[:-1], prompt_offsets[1:])]
cache = KVCache(gqa_cfg, PROMPTS, int(prompt_lengths.max()) + NEW_TOKENS, DEVICE, DTYPE)
lengths = prompt_lengths.to(DEVICE)
seq, pos = token_index(prompt_offsets)
one_each = torch.arange(PROMPTS + 1, device=DEVICE)
worst = 0.0
with torch.no_grad():
    logits = gqa_model(prompts, pos, Packed(prompt_offsets, "loop", cache, seq * cache.capacity + pos,
                                            lengths))[prompt_offsets[1:] - 1]
    for step in range(NEW_TOKENS):
        token = logits.argmax(-1)  # (B,)
        for h, t in zip(history, token.tolist()):
            h.append(t)
        # the same step without a cache: the whole packed history, recomputed
        offsets_h = offsets_from_lengths([len(h) for h in history], DEVICE)
        tokens_h = torch.tensor([t for h in history for t in h], device=DEVICE)
        full = gqa_model(tokens_h, token_index(offsets_h)[1], Packed(offsets_h, "loop"))
        # the cached step: one token per sequence at its own position
        logits = gqa_model(token, lengths, Packed(one_each, "loop", cache,
                                                  cache.row_offsets[:-1] + lengths, lengths + 1))
        lengths = lengths + 1
        torch.testing.assert_close(logits.float(), full[offsets_h[1:] - 1].float(), **tolerances(DTYPE))
        worst = max(worst, (logits.float() - full[offsets_h[1:] - 1].float()).abs().max().item())
print(f"{NEW_TOKENS} steps x {PROMPTS} sequences: every cached step matches the recomputation "
      f"(largest logit difference {worst:.1e})")

# %%
# What the cache buys
# ~~~~~~~~~~~~~~~~~~~
# Without a cache, step ``t`` runs the whole history again: every prompt
# token plus ``t`` generated tokens per sequence. With it, each step runs one
# token per sequence. The work bound counts the tokens each side pushes
# through the model (the projections and feed-forward layers, most of the
# arithmetic) and the query-key pairs its attention scores.


@torch.no_grad()
def generate_no_cache(model, prompts, offsets, n_new, backend=None):
    """Greedy generation that recomputes the whole packed history at every step."""
    lengths = offsets.diff()
    tokens = prompts
    out = []
    for step in range(n_new):
        seq, pos = token_index(offsets)
        logits = model(tokens, pos, Packed(offsets, backend))[offsets[1:] - 1]
        out.append(logits.argmax(-1))
        # insert each sequence's new token at its end: rebuild the packed ids
        lengths = lengths + 1
        new_offsets = offsets_from_lengths(lengths, tokens.device)
        grown = torch.empty(len(tokens) + len(lengths), dtype=tokens.dtype, device=tokens.device)
        grown[new_offsets[1:] - 1] = out[-1]
        keep = torch.ones(len(grown), dtype=torch.bool, device=tokens.device)
        keep[new_offsets[1:] - 1] = False
        grown[keep] = tokens
        tokens, offsets = grown, new_offsets
    return torch.stack(out, 1)


per_token = 2 * sum(p.numel() for n, p in gqa_model.named_parameters() if "embeddings" not in n)
per_pair = gqa_cfg.n_layers * 4 * gqa_cfg.n_heads * gqa_cfg.head_dim
with torch.no_grad():  # both write the same tokens (in bfloat16, rounding may flip a near tie)
    same = (generate_no_cache(gqa_model, prompts, prompt_offsets, 4, "loop")
            == generate_packed(gqa_model, prompts, prompt_offsets, 4, "loop")).float().mean().item()
assert same >= (1.0 if DTYPE == torch.float32 else 0.9), f"with and without the cache: {same:.0%} of tokens agree"
throughput = {"cache": [], "no cache": []}
for n_new in GEN_LENGTHS:
    times = measure({"no cache": lambda: generate_no_cache(gqa_model, prompts, prompt_offsets, n_new, "loop"),
                     "cache": lambda: generate_packed(gqa_model, prompts, prompt_offsets, n_new, "loop")},
                    min_run_time=RUN_TIME, profile=False)
    P, steps = prompt_lengths, torch.arange(n_new)
    grown = P[:, None] + steps  # each sequence's length at each step, (B, n_new)
    work_cached = per_token * (float(P.sum()) + PROMPTS * (n_new - 1)) + per_pair * (
        pairs_scored(P, P, True) + float((grown[:, 1:] + 1).sum()))
    work_recomputed = per_token * float(grown.sum()) + per_pair * pairs_scored(grown.flatten(), grown.flatten(), True)
    for name in throughput:
        throughput[name].append(PROMPTS * n_new / times[name].median_ms * 1e3)
    print(f"{n_new:4d} new tokens: " + speedup_line("cache over no cache", times["no cache"], times["cache"],
                                                    work_recomputed / work_cached))

# %%
# The work bound grows with the output, since the recomputation redoes the
# whole history at every step. The fraction says how much of it this device
# turned into speed: each cached step runs only one token per sequence
# through the model, small matrix multiplies and one attention call per
# sequence and layer, so fixed costs per call weigh more than in the
# big calls of the recomputation. The operators that took most of the cached
# generation's time:

print(where_time_goes(lambda: generate_packed(gqa_model, prompts, prompt_offsets, NEW_TOKENS, "loop")))

# %%
# Cache memory: allocated and used
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The cache holds ``2 x layers x B x capacity x H_kv x D`` numbers, read here
# from its buffers. Of its ``B x capacity`` token slots, ``sum(lengths)``
# hold data: few right after the prefill, more at each step. A cache that
# gives each sequence only the room it can use, ``prompt + new tokens``
# (paged or packed), would allocate ``sum(prompt + new)`` slots; with
# ``varlen_attn``'s ``block_table`` or a FlexAttention mask over pages,
# attention reads such a cache directly.


def cache_report(cfg, name):
    capacity = int(prompt_lengths.max()) + NEW_TOKENS
    c = KVCache(cfg, PROMPTS, capacity, DEVICE, DTYPE)
    allocated = c.k.nbytes + c.v.nbytes
    per_slot = allocated / (PROMPTS * capacity)  # bytes per token, all layers, keys and values
    used = per_slot * (float(prompt_lengths.sum()) + PROMPTS * np.arange(NEW_TOKENS + 1))
    exact = per_slot * float((prompt_lengths + NEW_TOKENS).sum())
    print(f"{name}: {allocated / 2**20:.2f} MiB allocated; used {used[0] / 2**20:.2f} MiB after the "
          f"prefill ({used[0] / allocated:.0%}), {used[-1] / 2**20:.2f} MiB at the end "
          f"({used[-1] / allocated:.0%}); room for exactly what each sequence uses: {exact / 2**20:.2f} MiB")
    return allocated, used, exact


memory = {"MHA": cache_report(mha_cfg, "MHA"), "GQA": cache_report(gqa_cfg, "GQA")}
ratio = memory["MHA"][0] / memory["GQA"][0]
assert math.isclose(ratio, gqa_cfg.n_heads / gqa_cfg.n_kv_heads)
print(f"MHA / GQA cache: {ratio:.1f}x (n_heads / n_kv_heads = {gqa_cfg.n_heads // gqa_cfg.n_kv_heads})")

# %%
# Decoding attention: measure, then choose
# ----------------------------------------
# One decoding step of attention for the GQA model: one query per sequence
# against that sequence's cached keys, in the middle of generation. The
# candidates, each checked against the float32 reference (with the
# key/value heads repeated explicitly, so that it shares no GQA code with
# them). The kernel column says what actually ran: whether a call read the
# small cache directly or repeated its heads first shows up there.

capacity = int(prompt_lengths.max()) + NEW_TOKENS
used = (prompt_lengths + NEW_TOKENS // 2).to(DEVICE)
row_offsets = torch.arange(PROMPTS + 1, device=DEVICE) * capacity
q_step = torch.randn(PROMPTS, gqa_cfg.n_heads, gqa_cfg.head_dim, generator=gen, device=DEVICE).to(DTYPE)
k_cache = torch.randn(PROMPTS * capacity, gqa_cfg.n_kv_heads, gqa_cfg.head_dim, generator=gen,
                      device=DEVICE).to(DTYPE)
v_cache = torch.randn_like(k_cache)
print(f"GQA, {PROMPTS} queries against {int(used.sum())} cached keys in use:")
decode_results = compare_backends(q_step, k_cache, v_cache, one_each, row_offsets, is_causal=True,
                                  kv_used=used, min_run_time=RUN_TIME)

# %%
# That table times one step's attention with its per-batch bookkeeping
# already done. While generating, the lengths change at every step, so
# whatever a backend prepares per batch (gather indices, a block mask) is
# prepared again at every step, once for all layers; the choice is made on
# whole generations, for the two backends with the fastest steps above:

ran = sorted((n for n, r in decode_results.items() if isinstance(r, Timing)),
             key=lambda n: decode_results[n].median_ms)[:2]
generation_times = measure({name: lambda name=name: generate_packed(gqa_model, prompts, prompt_offsets, NEW_TOKENS,
                                                                    name) for name in ran},
                           min_run_time=RUN_TIME / 2, profile=False)
for name, t in generation_times.items():
    print(f"  generation with {name:9s} {t}")
DECODE_BACKEND = fastest(generation_times)
print(f"decoding backend chosen on {DEVICE}: {DECODE_BACKEND}")

# %%
# FlexAttention without rebuilding the mask
# -----------------------------------------
# The ``flex`` backend builds a ``BlockMask`` for each batch it sees, and
# while decoding the lengths change at every step. ``create_block_mask``
# evaluates the mask over the whole grid, a cost added to every step's
# attention. The inference examples of FlexAttention build the
# mask once, for the cache's capacity, and then only refresh it. Here the
# mask function reads the current lengths from a tensor the loop updates in
# place, every listed block is *partial* (so the mask function runs inside
# the kernel), and each step only recomputes how many key blocks each
# sequence has, ``ceil(length / 128)``. Both ways are checked against the
# reference and timed per decoding step, for the GQA cache laid out as
# ``(B, H_kv, capacity, D)``.

BLOCK = 128
current = used.clone()  # the lengths the mask reads, updated in place


def within_length(b, h, q_idx, kv_idx):
    return kv_idx < current[b]


n_blocks = (capacity + BLOCK - 1) // BLOCK
kv_num_blocks = torch.zeros(PROMPTS, 1, 1, dtype=torch.int32, device=DEVICE)
kv_indices = torch.arange(n_blocks, dtype=torch.int32, device=DEVICE).expand(PROMPTS, 1, 1, n_blocks).contiguous()
refreshed_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=BLOCK,
                                          mask_mod=within_length, seq_lengths=(1, capacity))


def refresh(lengths):
    current.copy_(lengths)
    kv_num_blocks.copy_(((lengths + BLOCK - 1) // BLOCK).view(-1, 1, 1))


q_dense = q_step[:, :, None]  # (B, H, 1, D)
k_dense = k_cache.view(PROMPTS, capacity, *k_cache.shape[1:]).transpose(1, 2)  # (B, H_kv, capacity, D)
v_dense = v_cache.view(PROMPTS, capacity, *v_cache.shape[1:]).transpose(1, 2)


def flex_rebuilt():
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < used[b], PROMPTS, None, 1, capacity,
                             device=DEVICE)
    return compiled_flex_attention(q_dense, k_dense, v_dense, block_mask=mask, enable_gqa=True)


def flex_refreshed():
    refresh(used)
    return compiled_flex_attention(q_dense, k_dense, v_dense, block_mask=refreshed_mask, enable_gqa=True)


reference_step = reference_attention(q_step, k_cache, v_cache, one_each, row_offsets, is_causal=True, kv_used=used)
with torch.no_grad():
    for fn in (flex_rebuilt, flex_refreshed):
        torch.testing.assert_close(fn()[:, :, 0].float(), reference_step, **tolerances(DTYPE))
    flex_times = measure({"mask rebuilt every step": flex_rebuilt, "mask built once, refreshed": flex_refreshed},
                         min_run_time=RUN_TIME)
for name, t in flex_times.items():
    print(f"FlexAttention decode step, {name:26s} {t}")
print(f"time per step, mask rebuilt / mask refreshed: "
      f"{flex_times['mask rebuilt every step'].median_ms / flex_times['mask built once, refreshed'].median_ms:.2f}x")

# %%
# Grouped-query attention, end to end
# -----------------------------------
# The promise of GQA is a smaller cache, which is what bounds batch size and
# context length in serving, and less memory to read at every step. Both
# models generate with the decoding backend chosen above; the kernels that
# ran are printed beside each time.

for name, model in (("MHA", mha_model), ("GQA", gqa_model)):
    t = measure({name: lambda: generate_packed(model, prompts, prompt_offsets, NEW_TOKENS, DECODE_BACKEND)},
                min_run_time=RUN_TIME / 2)[name]
    throughput[name] = PROMPTS * NEW_TOKENS / t.median_ms * 1e3
    print(f"{name}: {t}  {throughput[name]:,.0f} new tokens/s")
print(f"GQA / MHA decoding throughput: {throughput['GQA'] / throughput['MHA']:.2f}x; "
      f"cache {ratio:.1f}x smaller")

# %%
# Nested tensors do not take the GQA route: SDPA on nested inputs cannot
# share key/value heads, and ``backend_support`` says so, which is why the
# ``sdpa_njt`` rows above are missing for GQA. The call is tried here, so that
# the page notices when a release fixes it.

njt = lambda x: torch.nested.nested_tensor_from_jagged(x, prompt_offsets).transpose(1, 2)  # noqa: E731
q_p = torch.randn(len(prompts), gqa_cfg.n_heads, gqa_cfg.head_dim, device=DEVICE, dtype=DTYPE)
kv_p = torch.randn(len(prompts), gqa_cfg.n_kv_heads, gqa_cfg.head_dim, device=DEVICE, dtype=DTYPE)
try:
    F.scaled_dot_product_attention(njt(q_p), njt(kv_p), njt(kv_p), enable_gqa=True)
    print("SDPA on nested tensors with enable_gqa=True: runs in this build")
except (RuntimeError, NotImplementedError) as err:
    print(f"SDPA on nested tensors with enable_gqa=True: {type(err).__name__}: "
          f"{str(err).strip().splitlines()[0][:100]}")

# %%
# varlen attention
# ----------------
# ``torch.nn.attention.varlen.varlen_attn`` is the variable-length kernel of
# FlashAttention: packed ``(T, H, D)`` queries, keys and values, the
# offsets as ``int32`` ``cu_seq_q`` and ``cu_seq_k``, and the longest lengths.
# Its keyword arguments changed between releases, so the toolkit reads them
# from the signature: causal is ``is_causal=True`` in 2.10 and
# ``window_size=(-1, 0)`` later; ``enable_gqa`` (without it, the toolkit
# repeats the key/value heads) and ``seqused_k`` (without it, the toolkit
# gathers the rows in use) arrived after 2.11. What this build has:

if varlen_attn is None:
    print("this PyTorch has no torch.nn.attention.varlen")
else:
    keywords = varlen_keywords()
    print(f"varlen_attn{inspect.signature(varlen_attn)}")
    print("causal through: " + ("window_size=(-1, 0)" if "window_size" in keywords else "is_causal=True"))
    print("grouped-query attention: " + ("enable_gqa=True" if "enable_gqa" in keywords
                                         else "not supported: the toolkit repeats the key/value heads"))
    print("keys in use per sequence: " + ("seqused_k" if "seqused_k" in keywords
                                          else "not supported: the toolkit gathers the rows in use"))
why = backend_support("varlen", DEVICE, DTYPE, is_causal=True, gqa=True)
print(f"varlen_attn on this device: {why or 'runs'}; the decoding backend chosen here: {DECODE_BACKEND}")

# %%
# The figure: throughput with and without the cache as the output grows, and
# the cache's memory during generation for both models.

import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
ax1.plot(GEN_LENGTHS, throughput["cache"], "o-", label="KV cache")
ax1.plot(GEN_LENGTHS, throughput["no cache"], "s--", label="recomputed every step")
ax1.set(xlabel="new tokens per sequence", ylabel="new tokens/s (median)", title=f"Greedy decoding, {DEVICE}")
ax1.legend()
steps = np.arange(NEW_TOKENS + 1)
for color, (name, (allocated, used_bytes, exact)) in zip(("C0", "C3"), memory.items()):
    ax2.plot(steps, used_bytes / 2**20, "-", color=color, label=f"{name}, used")
    ax2.axhline(allocated / 2**20, color=color, ls="--", label=f"{name}, allocated")
    ax2.axhline(exact / 2**20, color=color, ls=":", label=f"{name}, exact room")
ax2.set(xlabel="decoding step", ylabel="KV cache (MiB)", ylim=(0, None),
        title=f"Cache memory, {MODEL['n_layers']} layers, {str(DTYPE).removeprefix('torch.')}")
ax2.legend(fontsize="small")
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# Conclusion
# ----------
# The three sections the building-blocks tutorial left pending work today,
# on packed values and offsets rather than nested tensors:
#
# * **A KV cache** for a ragged batch is a buffer with room per sequence and
#   a count of the rows each sequence uses; ``ragged_attention``'s
#   ``kv_used`` (``seqused_k`` in ``varlen_attn``) tells each sequence's
#   rows in use; the ``loop``, ``padded`` and ``flex`` backends, and
#   ``varlen_attn`` where it has ``seqused_k``, read them in place, the others
#   gather them first. Every cached step matched a full recomputation.
# * **GQA** shrinks the cache by ``n_heads / n_kv_heads``; whether a step
#   also reads less memory depends on the kernel, which the tables above
#   name for this device.
# * **FlexAttention** decodes from the same cache with a mask built once and
#   refreshed per step, and **varlen_attn** takes the same offsets on CUDA.
#
# References
# ----------
# * ``varlen_attn``: https://docs.pytorch.org/docs/stable/nn.attention.varlen.html
# * FlexAttention for inference: https://pytorch.org/blog/flexattention-for-inference/
# * ``gpt-fast``: https://github.com/meta-pytorch/gpt-fast
# * Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models
#   from Multi-Head Checkpoints", 2023: https://arxiv.org/abs/2305.13245
