"""
Decoding ragged batches: a KV cache and grouped-query attention
===============================================================

Generate from a batch of prompts of different lengths with a key/value (KV)
cache. In the cache, every sequence keeps its own length. This page proves
every step against a recomputation and measures what the cache saves. Then
it shrinks the cache with grouped-query attention.

**Author:** the ragged-transformers tutorial contributors, building on the
transformer building blocks tutorial by
`Mikayla Gawarecki <https://github.com/mikaylagawarecki>`_

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Why a KV cache for a ragged batch is a packed batch with spare
         rows, read with ``ragged_attention``'s ``kv_used``
       * How a packed prefill and greedy decoding fill and read it, and how
         to prove every cached step against a recomputation
       * What the cache saves in time, what it costs in memory, and what
         grouped-query attention (GQA) saves

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`transformer_building_blocks` (packed values, offsets,
         ``ragged_attention``) and the model of :doc:`packed_gpt_training`,
         both from the site's module ``ragged_toolkit``
         (:doc:`reference </toolkit>`)
       * PyTorch 2.11 or later, on any device; which attention path decodes
         fastest on yours is measured on :doc:`which_attention_path`
"""

# sphinx_gallery_tags = ["KV cache", "GQA", "decoding"]

# %%
# Sizes
# -----
# Every size is set here, per device. :term:`quick mode`, the test suite's
# fast run, shrinks them. The model is the GPT of :doc:`packed_gpt_training`
# (RMSNorm, rotary positions, SwiGLU). It is small and randomly initialized.
# The point is the mechanics of decoding and their correctness, not the
# text. For scale, Llama-2-70B has 8 key/value heads for 64 query heads,
# width 8192 and 80 layers.

import torch
from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(
        model=dict(
            vocab_size=32000,
            dim=1024,
            n_layers=8,
            n_heads=16,
            n_kv_heads=4,
            ffn_hidden=2816,
            max_seq_len=4096,
        ),
        prompts=64,
        zipf_alpha=1.1,
        new_tokens=64,
        gen_lengths=(16, 64),
        run_time=1.0,
    ),
    # 90 s on 2 cores; real serving: width 4096 and up, 32+ layers, 64-256 sequences
    "cpu": dict(
        model=dict(
            vocab_size=512,
            dim=128,
            n_layers=4,
            n_heads=8,
            n_kv_heads=2,
            ffn_hidden=352,
            max_seq_len=1024,
        ),
        prompts=16,
        zipf_alpha=1.2,
        new_tokens=32,
        gen_lengths=(8, 32),
        run_time=0.25,
    ),
    # head size 16 on either device (the CUDA kernels want a multiple of 8, at least 16)
    "quick": dict(
        model=dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=176),
        prompts=6,
        new_tokens=8,
        gen_lengths=(4, 8),
        run_time=0.1,
    ),
}
setup = page_setup(SIZES)
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
print("model: " + ", ".join(f"{key} {value}" for key, value in S.model.items()))
print(f"{S.prompts} prompts, {S.new_tokens} new tokens each")

# %%
# A KV cache is a packed batch with spare rows
# --------------------------------------------
# While decoding, each sequence adds one token per step. That token's query
# must see the keys and values of everything before it. Give the cache room
# for ``capacity`` tokens per sequence, and view it as packed rows
# ``(B * capacity, H_kv, D)``. It is then a packed batch whose offsets are
# ``capacity`` apart. Sequence ``b`` owns rows ``b * capacity ...`` and uses
# the first ``kv_used[b]`` of them. ``varlen_attn`` calls that count
# ``seqused_k``.
#
# The example below has three sequences with 3, 1 and 4 cached tokens, and
# one new query each. Four query heads share two key/value heads. The spare
# rows hold NaN, so any read of them would show in the output:

import torch.nn.functional as F
from ragged_toolkit.attention import plan_batch, ragged_attention

cached = torch.tensor([3, 1, 4])  # keys each sequence has cached
B, capacity, H, H_kv, D = 3, 6, 4, 2, 8
row_offsets = torch.arange(B + 1) * capacity  # [0, 6, 12, 18]
gen = torch.Generator().manual_seed(setup.seed)
k = torch.randn(B * capacity, H_kv, D, generator=gen)  # the cache, as packed rows
v = torch.randn(B * capacity, H_kv, D, generator=gen)
spare = (torch.arange(capacity) >= cached[:, None]).flatten()  # rows not written yet
k[spare], v[spare] = float("nan"), float("nan")
q = torch.randn(B, H, D, generator=gen)  # one new query per sequence
one_each = torch.arange(B + 1)  # query offsets: [0, 1, 2, 3]
plan = plan_batch(one_each, row_offsets, backend="loop", is_causal=True, kv_used=cached)
out = ragged_attention(q, k, v, plan)
assert out.isfinite().all(), "a spare row was read"
for b, n in enumerate(cached.tolist()):  # the same, one sequence at a time
    kb, vb = (
        t[b * capacity : b * capacity + n].repeat_interleave(H // H_kv, 1).transpose(0, 1)
        for t in (k, v)
    )  # (H, n, D): the rows in use
    expected = F.scaled_dot_product_attention(q[b][:, None], kb, vb)[:, 0]  # (H, D)
    torch.testing.assert_close(out[b], expected)
print(
    f"row offsets {row_offsets.tolist()}, kv_used {cached.tolist()}: "
    f"{int(spare.sum())} spare rows never read"
)

# %%
# The same cache, drawn row by row, shows the rows in use and the spare
# ones. It also marks the row each sequence's next token will write: its
# ``kv_used``, before it grows by one.

import matplotlib.pyplot as plt
from ragged_site.figures import FIGURE_STYLE, draw_kv_cache

plt.rcParams.update(FIGURE_STYLE)
draw_kv_cache(cached, capacity, new=cached)
plt.show()

# %%
# The toolkit's ``KVCache`` holds such rows for every layer of a model. It
# writes new keys into them with ``write_rows`` (``write_columns`` is for a
# padded batch):
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: KVCache
#
# A batch of prompts, two models
# ------------------------------
# Prompt lengths come from the site's length generator. Most prompts are
# short; a few are long. The attention of the GPT takes a :term:`layout`:
# the object that knows how the batch is laid out (:doc:`packed_gpt_training`).
# Two models share everything but the number of key/value heads:
#
# * multi-head attention (MHA) has one key/value head per query head;
# * in GQA, ``n_heads / n_kv_heads`` query heads share each key/value head.

import numpy as np
from ragged_toolkit.batches import offsets_from_lengths
from ragged_site.workloads import sentence_lengths
from ragged_toolkit.gpt import GPT, GPTConfig

prompt_lengths = sentence_lengths(
    np.random.default_rng(setup.seed),
    S.prompts,
    S.zipf_alpha,
    max_len=S.model["max_seq_len"] - S.new_tokens,
)
prompt_offsets = offsets_from_lengths(prompt_lengths, DEVICE)
prompts = torch.randint(
    S.model["vocab_size"],
    (int(prompt_lengths.sum()),),
    device=DEVICE,
    generator=torch.Generator(DEVICE).manual_seed(setup.seed),
)
print(f"prompt lengths {prompt_lengths.tolist()}")
print(
    f"{len(prompts)} prompt tokens, longest {int(prompt_lengths.max())}; "
    f"padding to the longest would hold {S.prompts * int(prompt_lengths.max())}"
)

CONFIGS = {
    "MHA": GPTConfig(**dict(S.model, n_kv_heads=S.model["n_heads"])),
    "GQA": GPTConfig(**S.model),
}
models = {}
for name, cfg in CONFIGS.items():
    torch.manual_seed(setup.seed)
    models[name] = (
        GPT(cfg).to(DEVICE, DTYPE).eval()
    )  # serving runs the weights in the low precision too
    print(f"{name}: {cfg.n_heads} query heads, {cfg.n_kv_heads} key/value heads of {cfg.head_dim}")

# %%
# The KV cache, step by step
# --------------------------
# The :term:`packed layout` holds the tokens of all sequences in one row,
# with offsets. It writes each new token's key and value into its row of the
# cache. Then it attends over the cache's rows with the batch's plan:
#
# .. literalinclude:: ../ragged_toolkit/layouts.py
#    :pyobject: PackedLayout
#
# A generation uses it twice. The **prefill** runs all prompt tokens at
# once, packed. Each writes its key and value into its sequence's row
# ``b * capacity + p``, and attends causally to its own prompt. Then each
# **decoding** step feeds one token per sequence, at that sequence's own
# position ``lengths[b]``. The token is written into its sequence's next
# row. Its query sees every key its sequence has. Every step builds a new
# plan, since the keys in use grow by one at each step:
#
# .. literalinclude:: ../ragged_toolkit/decoding.py
#    :pyobject: prefill_packed
#
# .. literalinclude:: ../ragged_toolkit/decoding.py
#    :pyobject: decode_greedy
#
# ``decode_greedy`` has a second kind of step, ``fixed_shape=True``. A
# decoding batch is a rectangle: one token per sequence, the same room for
# each. So a step can have fixed shapes instead, as in gpt-fast. The slot
# each new key goes to is a tensor. One SDPA call scores every slot of the
# cache, masked where not in use. That is more arithmetic, but no per-step
# plan, and one compiled graph for every step. :doc:`which_attention_path`
# measures what each kind of step costs on this device (its decoding job).
#
# .. literalinclude:: ../ragged_toolkit/kv_cache.py
#    :pyobject: CachedStep
#
# ``generate_packed`` is the prefill and then ``decode_greedy``, under
# autocast in a lower precision. Its proof compares logits. The logits that
# chose every new token must equal those of a recomputation with no cache.
# The recomputation runs the prompt and the tokens generated so far through
# the model at once, packed. This is *teacher forcing*: the next tokens are
# fed, not re-chosen. So a near tie that rounding breaks differently cannot
# derail the comparison:
#
# .. literalinclude:: ../ragged_site/reference.py
#    :pyobject: teacher_forced_logits
#
# Both kinds of step are checked, for every step and every sequence. The
# check uses the per-sequence loop backend, so that it is about the cache's
# bookkeeping. :doc:`which_attention_path` checks every backend's kernel
# against the float32 reference.

from ragged_toolkit.decoding import generate_packed
from ragged_site.reference import teacher_forced_logits
from ragged_site.page import tolerances

for fixed_shape in (False, True):
    new, chose = generate_packed(
        models["GQA"],
        prompts,
        prompt_offsets,
        S.new_tokens,
        "loop",
        fixed_shape=fixed_shape,
        return_logits=True,
    )  # (B, n), (B, n, vocab)
    forced = teacher_forced_logits(models["GQA"], prompts, prompt_offsets, new)
    step_kind = "fixed-shape" if fixed_shape else "packed"
    torch.testing.assert_close(
        chose.float(),
        forced,
        **tolerances(DTYPE),
        msg=lambda m, kind=step_kind: f"{kind} steps: {m}",
    )
    print(
        f"{step_kind} steps: {S.new_tokens} steps x {S.prompts} sequences match the recomputation "
        f"(largest logit difference {(chose.float() - forced).abs().max():.1e})"
    )

# %%
# What the cache buys
# -------------------
# Without a cache, step ``t`` runs the whole history again: every prompt
# token plus ``t`` generated tokens per sequence, packed. In float32 it
# chooses the very tokens the cached generation chose. In a lower precision,
# rounding may break a near tie differently. That is why the proof above
# compares logits.

from ragged_toolkit.attention import default_backend
from ragged_toolkit.batches import token_index
from ragged_toolkit.layouts import PackedLayout

DECODE_BACKEND = default_backend(DEVICE, DTYPE, CONFIGS["GQA"].head_dim)


@torch.no_grad()
def generate_no_cache(model, n_new):
    """Greedy generation that runs the whole packed history at every step."""
    tokens, offsets, out = prompts, prompt_offsets, []
    for _ in range(n_new):
        logits = model(tokens, token_index(offsets)[1], PackedLayout.of(offsets, DECODE_BACKEND))
        out.append(logits[offsets[1:] - 1].argmax(-1))  # (B,): each sequence's next token
        history = tokens.split(offsets.diff().tolist())  # each sequence's tokens, then its new one
        tokens = torch.cat([t for seq, new in zip(history, out[-1]) for t in (seq, new[None])])
        offsets = offsets_from_lengths(offsets.diff() + 1, DEVICE)
    return torch.stack(out, 1)  # (B, n_new)


def generate(model, n_new, cache=True):
    if cache:
        return generate_packed(model, prompts, prompt_offsets, n_new, DECODE_BACKEND)
    return generate_no_cache(model, n_new)


if DTYPE == torch.float32:
    assert torch.equal(
        generate(models["GQA"], S.new_tokens, False), generate(models["GQA"], S.new_tokens)
    ), "with and without the cache, other tokens"
print(f"backend of both generations: {DECODE_BACKEND} (default_backend on {DEVICE})")

# %%
# The :term:`work bound` is the speedup to expect if time followed work. It
# counts the work each side pushes through the model:
#
# * two FLOPs per weight per token, for the projections and feed-forward
#   layers (most of the arithmetic);
# * four FLOPs per pair and channel, for the query-key pairs its attention
#   scores.
#
# Here the bound is the work of the recomputation over the work of the
# cached generation. The :term:`fraction of the bound` is the measured
# speedup over the bound. It says how much of the bound this device turned
# into speed. Both generations take turns, for two output lengths.
#
# .. literalinclude:: ../ragged_site/measuring/bound.py
#    :pyobject: generation_work

from ragged_site.measuring.bound import generation_work, model_work, speedup_line
from ragged_site.measuring.timing import measure

cfg = CONFIGS["GQA"]
work = model_work(models["GQA"], n_layers=cfg.n_layers, attention_width=cfg.n_heads * cfg.head_dim)
runs = {
    (n, cache): (lambda n=n, cache=cache: generate(models["GQA"], n, cache))
    for n in S.gen_lengths
    for cache in (True, False)
}
cache_times = measure(runs, min_run_time=S.run_time, profile=False)
for n in S.gen_lengths:
    bound = generation_work(prompt_lengths, n, work, cache=False) / generation_work(
        prompt_lengths, n, work
    )
    print(
        speedup_line(
            f"KV cache, {n:3d} new tokens", cache_times[n, False], cache_times[n, True], bound
        )
    )

# %%
# The bound grows with the output, since the recomputation redoes the whole
# history at every step. A cached step runs one token per sequence through
# every layer. That is many small operators for little arithmetic. Each
# operator has a fixed cost: Python, dispatch, the step's plan. The more the
# cached steps are bound by operator count, the less of the bound the cached
# side reaches. :doc:`measuring_ragged_batches` shows how to profile a step
# to see it.

fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
x = np.arange(len(S.gen_lengths))
for shift, cache, label, hatch in (
    (-0.2, True, "KV cache", None),
    (0.2, False, "recomputed every step", "//"),
):
    rates = [S.prompts * n / cache_times[n, cache].median_ms * 1e3 for n in S.gen_lengths]
    ax.bar(x + shift, rates, 0.4, label=label, hatch=hatch)
ax.set_xticks(x, [str(n) for n in S.gen_lengths])
ax.set(
    xlabel="new tokens per sequence",
    ylabel="new tokens/s (median)",
    title=f"Greedy decoding, {S.prompts} prompts, {DEVICE}",
)
fig.legend(loc="outside lower center", ncol=2)
plt.show()

# sphinx_gallery_thumbnail_number = 2

# %%
# Cache memory: allocated and used
# --------------------------------
# The cache holds ``2 x layers x B x capacity x H_kv x D`` numbers. The
# figures below are computed from the shapes of its buffers, not measured.
# Of its ``B x capacity`` token slots, ``sum(lengths)`` hold data. Few do
# right after the prefill; more do at each step. A cache could give each
# sequence only the room it can use, ``prompt + new tokens``. It would
# allocate ``sum(prompt + new)`` slots: the *exact room*. A paged cache comes
# close without knowing the lengths in advance
# (:doc:`serving_continuous_batching`).

from ragged_toolkit.kv_cache import KVCache

room = int(prompt_lengths.max()) + S.new_tokens  # each sequence's capacity
in_use = {
    "after prefill": float(prompt_lengths.sum()),
    "at the end": float((prompt_lengths + S.new_tokens).sum()),
}
print(f"{'MiB, from shapes':16s} {'allocated':>10s} {'after prefill':>14s} {'at the end':>14s}")
allocated = {}
for name, cfg in CONFIGS.items():
    kv = KVCache(cfg, S.prompts, room, DEVICE, DTYPE)
    allocated[name] = (kv.k.nbytes + kv.v.nbytes) / 2**20
    per_slot = allocated[name] / (
        S.prompts * room
    )  # MiB per token slot, every layer, keys and values
    print(
        f"{name:16s} {allocated[name]:10.2f}"
        + "".join(
            f"{per_slot * n:8.2f} ({per_slot * n / allocated[name]:3.0%})" for n in in_use.values()
        )
    )
cache_ratio = allocated["MHA"] / allocated["GQA"]
assert np.isclose(cache_ratio, CONFIGS["GQA"].n_heads / CONFIGS["GQA"].n_kv_heads)
print(
    f"MHA / GQA cache: {cache_ratio:.1f}x (n_heads / n_kv_heads); the exact room would be "
    f"{in_use['at the end'] / (S.prompts * room):.0%} of the allocation"
)

# %%
# The same figures as bars: each model's allocation, and what its tokens fill.

from ragged_site.figures import draw_cache_memory

draw_cache_memory(allocated, {stage: n / (S.prompts * room) for stage, n in in_use.items()})
plt.show()

# %%
# Grouped-query attention, end to end
# -----------------------------------
# GQA promises a smaller cache and less memory to read at every step. In
# serving, the cache's size is what bounds batch size and context length.
# Both models generate with the same backend. Each time is printed with its
# :term:`kernel label`: the attention kernels that ran, in brackets, with
# their call counts. The two models take turns, round by round, so that
# their spreads can be compared.

from ragged_site.measuring.noise import outside_noise
from ragged_site.measuring.tables import print_timings
from ragged_site.records import record

gqa_times = measure(
    {name: (lambda model=model: generate(model, S.new_tokens)) for name, model in models.items()},
    min_run_time=S.run_time,
    rounds=6,
    profile=not setup.quick,
)
print_timings(gqa_times)
throughput = {name: S.prompts * S.new_tokens / t.median_ms * 1e3 for name, t in gqa_times.items()}
line = (
    f"new tokens/s: MHA {throughput['MHA']:,.0f}, GQA {throughput['GQA']:,.0f}; GQA / MHA "
    f"{throughput['GQA'] / throughput['MHA']:.2f}x, its cache {cache_ratio:.1f}x smaller"
)
ratio = throughput["GQA"] / throughput["MHA"]
print(
    record(
        "throughput",
        line,
        label="decoding, GQA against MHA",
        tokens_per_s=throughput,
        speedup=ratio,
    )
)
if outside_noise(gqa_times["GQA"], gqa_times["MHA"]):
    word = "faster" if throughput["GQA"] > throughput["MHA"] else "slower"
    print(f"GQA decodes {word} than MHA here, outside the noise (the IQRs do not overlap)")
else:
    print("GQA against MHA, time per generation: within noise (the IQRs overlap)")

# %%
# Conclusion
# ----------
# The original building-blocks tutorial left three sections pending in 2024,
# all on nested tensors: key/value caching, GQA and FlexAttention. On packed
# values and offsets all three work today:
#
# * **A KV cache** for a ragged batch is a buffer with room per sequence,
#   plus a count of the rows each sequence uses. ``ragged_attention``'s
#   ``kv_used`` gives that count (``seqused_k`` in ``varlen_attn``). Every
#   cached step matched a recomputation with no cache.
# * **GQA** shrinks the cache by ``n_heads / n_kv_heads``. Whether a step
#   also reads less memory depends on the kernel. The table above names the
#   kernel for this device.
# * **FlexAttention** decodes from the same cache, with a mask built once and
#   refreshed at every step. ``varlen_attn`` takes the same offsets on CUDA.
#   :doc:`which_attention_path` measures both, with every other path, on a
#   decoding step.
#
# References
# ----------
# * ``gpt-fast``: https://github.com/meta-pytorch/gpt-fast
# * Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models
#   from Multi-Head Checkpoints", 2023: https://arxiv.org/abs/2305.13245
# * FlexAttention for inference: https://pytorch.org/blog/flexattention-for-inference/
