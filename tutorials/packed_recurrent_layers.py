"""
Packed recurrent layers: linear attention and state-space layers that reset at every document
=============================================================================================

The models trained and served today are hybrids: a few full-attention layers
among many recurrent ones, Gated DeltaNet or Mamba-2 (Qwen3-Next, Kimi
Linear, Nemotron-H, Falcon-H1, Jamba). Packing them needs two things at
every document start that attention never needed: the recurrent state set
back to zero, and the short causal convolution in front of it kept from
reading the previous document. This page writes both layers in plain
PyTorch, in chunks, on packed values plus offsets, proves them against the
recurrence token by token, shows what goes wrong without the resets (in
``transformers``, too), and measures them.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * The two recurrences of the hybrids, a scalar decay (gated linear
         attention, Mamba-2) and the gated delta rule, written token by token
       * Their chunked form on a packed batch: the decay mask cut at
         document starts inside a chunk, the triangular solve of the delta
         rule, the state carried from chunk to chunk, the convolution cut
       * How to prove it (outputs, final states, gradients) against the
         recurrence run one document at a time in float64
       * How far packed documents leak into each other without the resets, in
         a stock ``transformers`` Qwen3-Next too, and how to stop it
       * What packing buys over padding, for a layer and for a hybrid
         model in training, beside the :term:`work bound`; the state as the
         decoding cache

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`transformer_building_blocks` (packed values and offsets) and
         :doc:`packed_gpt_training` (the GPT, the corpus); the functions used
         here are on :doc:`the toolkit's reference page </toolkit>`
       * PyTorch 2.11 or later; ``transformers`` 5.9 or later for its
         Qwen3-Next (built from a config: no download); a CPU is enough, a
         CUDA GPU runs the chunked form compiled in ``bfloat16``
"""

# sphinx_gallery_tags = ["linear attention", "state-space models", "Gated DeltaNet", "transformers", "training"]

# %%
# Sizes
# -----
# Every size is set here, per device; :term:`quick mode` shrinks them. The
# recurrent layers have ``heads`` heads of ``head_dim`` (Qwen3-Next: 32 value
# heads of 128); chunks of ``chunk`` tokens. The hybrid model trains on
# ``train_tokens`` bytes of the first ``corpus_documents`` docstrings, in
# steps of ``step_tokens``.

from ragged_toolkit.device import page_setup

SIZES = {
    "cuda": dict(embed=1024, heads=16, head_dim=64, chunk=64, speed_docs=192, max_len=1024, step_tokens=8192,
                 train_tokens=327680, corpus_documents=2000, lr=1e-3,
                 model=dict(vocab_size=256, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=1408,
                            max_seq_len=1024)),
    "cpu": dict(embed=128, heads=4, head_dim=32, chunk=64, speed_docs=32, max_len=512, step_tokens=2048,
                train_tokens=32768, corpus_documents=600, lr=3e-3,  # 90 s on 2 cores for the page
                model=dict(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                           max_seq_len=512)),
    "quick": dict(speed_docs=8, step_tokens=1024, train_tokens=8192, corpus_documents=200),
}
setup = page_setup(SIZES)  # device, dtype, quick mode, one CPU thread, seed; prints them
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
C, H, D = S.chunk, S.heads, S.head_dim

# %%
# The definition, one token at a time
# -----------------------------------
# Both layers keep a state per head, a ``(K, V)`` matrix, and update it at
# every token with a decay ``exp(g_t)``, ``g_t <= 0``. The scalar-decay
# layer (gated linear attention; Mamba-2's state-space duality form) adds
# the outer product of the key and the value; the gated delta rule first
# reads what the state holds for the key, ``k_t^T S``, and writes only the
# correction, by ``beta_t``. The output reads the state with the query::
#
#     scalar decay:  S_t = exp(g_t) S_{t-1} + k_t v_t^T
#     delta rule:    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
#     both:          o_t = S_t^T q_t,   S = 0 before a document's first token
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: recurrent_step
#
# Run one document at a time from a zero state, in float64, this is the
# reference every other form on this page is checked against:
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: reference_recurrence
#
# In the layers, q, k and v come from one projection through a short
# causal depthwise convolution (four taps) and SiLU, as in Qwen3-Next's
# ``GatedDeltaNet`` and Mamba-2; the decay is ``g = -exp(A_log)
# softplus(a + dt_bias)`` per head and token. On a packed row, the
# convolution must not read the previous document's last tokens: each tap
# ``m`` reaches back ``m`` tokens only where the token's position in its
# document is at least ``m``.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: causal_conv

import torch
import torch.nn.functional as F
from ragged_toolkit.batches import offsets_from_lengths, token_index
from ragged_toolkit.recurrent import causal_conv

offsets = offsets_from_lengths([3, 1, 4])  # three documents in one packed row
x, weight = torch.randn(8, 6), torch.randn(6, 4)  # (T, channels), (channels, taps)
alone = [F.conv1d(x[a:b].T[None], weight[:, None], padding=3, groups=6)[0, :, :b - a].T
         for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]  # each document with zeros before it
torch.testing.assert_close(causal_conv(x, weight, token_index(offsets)[1]), torch.cat(alone))
print("the cut convolution on a packed row gives each document's own conv1d")

# %%
# The chunked form
# ----------------
# Token by token, the recurrence is ``T`` small sequential steps. The
# chunked form cuts a packed row into chunks of ``C`` tokens and does the
# work inside a chunk in parallel, with matrix products: token ``i``'s
# output is the state that entered the chunk, decayed to ``i``, read with
# ``q_i``, plus the writes of the earlier tokens ``j`` of the chunk, each
# weighted by ``q_i . k_j`` and the decay from ``j`` to ``i``. Those decays
# form a ``(C, C)`` mask, and the packed row cuts it: token ``j`` reaches
# token ``i`` only if both are in one document, and the entering state
# reaches only the tokens whose document began before the chunk. A
# document that starts inside a chunk starts from zero, though the chunk
# does not.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: same_document
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: chunk_decay
#
# A packed row of eight documents, one of them a single token and one
# longer than two chunks; documents start on chunk edges (64, 256, 320) and
# inside chunks. The fourth chunk, tokens 192 to 255, drawn for one head:
# the document that began at token 64 carries its state into the chunk
# (left column), then two documents start inside it, each cut off from
# everything before.

import matplotlib.pyplot as plt
import numpy as np
from ragged_toolkit.figures import FIGURE_STYLE
from ragged_toolkit.recurrent import chunk_decay, l2norm

plt.rcParams.update(FIGURE_STYLE)
LENGTHS = [40, 1, 23, 150, 7, 35, 64, 20]  # starts 0, 40, 41, 64, 214, 221, 256, 320; 340 tokens


def random_inputs(lengths, rule, dtype=torch.float32, seed=0):
    """Random q, k, v (T, H, D), log decays g (T, H) in (-0.1, 0] (a state
    that lasts tens of tokens), beta (T, H) for the delta rule, unit keys;
    leaves that take gradients."""
    gen, T = torch.Generator().manual_seed(seed), int(sum(lengths))
    q, v = (torch.randn(T, H, D, generator=gen) for _ in range(2))
    k = l2norm(torch.randn(T, H, D, generator=gen))
    g = -0.1 * torch.rand(T, H, generator=gen)
    beta = torch.rand(T, H, generator=gen) if rule == "delta" else None
    return [None if t is None else t.to(DEVICE, dtype).requires_grad_() for t in (q / D**0.5, k, v, g, beta)]


offsets = offsets_from_lengths(LENGTHS, DEVICE)
doc, pos = token_index(offsets)
g = random_inputs(LENGTHS, "scalar")[3].detach()
span = slice(3 * C, 4 * C)  # the fourth chunk
decay, carry = chunk_decay(g[span].T[None, None], doc[None, None, span], pos[None, None, span])
picture = torch.cat([carry[0, 0, 0, :, None], decay[0, 0, 0]], 1).cpu()  # (C, 1 + C), head 0
fig, ax = plt.subplots(figsize=(7, 6), layout="constrained")
shown = ax.imshow(np.ma.masked_equal(picture.numpy(), 0), cmap="viridis", vmin=0, vmax=1,
                  extent=(-1.5, C - 0.5, C - 0.5, -0.5))
ax.axvline(-0.5, color="black", lw=1)
for start in (offsets[(offsets > span.start) & (offsets < span.stop)] - span.start).tolist():
    ax.axhline(start - 0.5, color="red", lw=1, ls="--")
ax.set(xlabel="token j (the column left of 0: the state entering the chunk)", ylabel="token i",
       title=f"Decays from j to i inside chunk 4 of a packed row (C = {C}); blank: cut")
fig.colorbar(shown, ax=ax, label="exp(g_{j+1} + ... + g_i)")
plt.show()

# %%
# For the delta rule, each token's write depends on what the state holds at
# that token, which depends on the earlier writes of the chunk: the writes
# solve a unit lower-triangular system (the "WY form" of Yang et al.), one
# ``solve_triangular`` per chunk, block diagonal by document because its
# matrix carries the same cut decay mask.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: delta_values
#
# Across chunks, the state is carried forward: the only sequential loop,
# one step per chunk instead of per token. The state leaving a chunk is its
# last document's, since the cut decays are zero for every other one.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: carry_states
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: chunked_recurrence
#
# A packed batch is one row; the final state of each document is read at
# its last token, so that decoding can continue from it (the end of this
# page). Right-padded rows (``padded_recurrence``) are the same function
# with one document per row.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: packed_recurrence
#
# The proof
# ---------
# On the row above and two random ones (Zipf sentence lengths, a one-token
# document and one of three chunks and more, shuffled), for both rules: the
# outputs, each document's final state and the gradients of q, k, v, g and
# beta (after the backward of a fixed random projection of outputs and
# states) of the packed chunked form, against the recurrence run on each
# document alone in float64. Each error is the largest difference divided by
# the largest magnitude of the reference tensor. Tolerances: ``1e-4`` in
# float32 and ``4e-2`` in bfloat16 (``tolerances(dtype)``).

from ragged_toolkit.batches import sentence_lengths
from ragged_toolkit.device import tolerances
from ragged_toolkit.recurrent import packed_recurrence, reference_recurrence


def per_document(q, k, v, g, beta, offsets):
    """The reference: each document alone, token by token, in float64."""
    runs = [reference_recurrence(q[a:b], k[a:b], v[a:b], g[a:b], None if beta is None else beta[a:b])
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    return torch.cat([o for o, _ in runs]), torch.stack([s for _, s in runs])


def results(run, leaves, seed=1):
    """Outputs, states and gradients of ``run() -> (o, states)`` with respect
    to ``leaves`` (a dict), after the backward of a fixed random projection."""
    o, states = run()
    gen = torch.Generator().manual_seed(seed)
    loss = sum((t.double() * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)).sum()
               for t in (o, states))
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"output": o, "states": states, **{f"grad {n}": gr for n, gr in zip(leaves, grads)}}


def leaves(tensors):
    """The named inputs that take gradients: q, k, v, g and beta (b)."""
    return {n: t for n, t in zip("qkvgb", tensors) if t is not None}


def worst_error(got, want):
    """The largest error of any tensor, relative to its reference's scale."""
    return max(float((got[n].detach().double() - want[n].detach()).abs().max() / want[n].detach().abs().max())
               for n in want)


rng = np.random.default_rng(setup.seed)
batches = [LENGTHS] + [rng.permutation(np.concatenate([[1, 3 * C + 7], sentence_lengths(rng, 8)])).tolist()
                       for _ in range(2)]
starts = [s % C for lengths in batches for s in np.cumsum(lengths)[:-1].tolist()]  # in-chunk offsets
assert 0 in starts and any(starts) and min(map(min, batches)) == 1 and max(map(max, batches)) > 3 * C
PROOF = {}
for rule in ("scalar", "delta"):
    for dtype in (torch.float32, torch.bfloat16):
        for i, lengths in enumerate(batches if dtype == torch.float32 else batches[:1]):
            ins, offsets = random_inputs(lengths, rule, dtype, seed=i), offsets_from_lengths(lengths, DEVICE)
            wide = [None if t is None else t.detach().double().requires_grad_() for t in ins]
            got = results(lambda: packed_recurrence(*ins[:4], offsets, ins[4], chunk=C), leaves(ins))
            want = results(lambda: per_document(*wide, offsets), leaves(wide))
            PROOF[rule, dtype, i] = worst_error(got, want)
            assert PROOF[rule, dtype, i] <= tolerances(dtype)["atol"], (rule, dtype, i, PROOF[rule, dtype, i])
for rule in ("scalar", "delta"):
    print(f"{rule:6s} chunked, packed, against each document alone: largest error "
          f"{max(PROOF[rule, torch.float32, i] for i in range(3)):.1e} in float32 (3 batches, tolerance 1e-4), "
          f"{PROOF[rule, torch.bfloat16, 0]:.1e} in bfloat16 (tolerance 4e-2)")

# %%
# The layers, the convolution included, are proved the same way, with
# their definition written plainly: each document alone through
# ``F.conv1d`` with zeros before it and the recurrence token by token
# (``reference``, run on a float64 copy of the layer). Outputs, states, and
# the gradients of the input and of every parameter:

import copy

from ragged_toolkit.recurrent import GatedDeltaLayer, ScalarDecayLayer

LAYERS = {"scalar decay": ScalarDecayLayer, "gated delta": GatedDeltaLayer}


def packed_layer(layer, x, offsets):
    """The packed layer's output (T, E) and each document's final state."""
    out, cache = layer.prefill(x, offsets)
    return out, cache.state


torch.manual_seed(setup.seed)
offsets = offsets_from_lengths(LENGTHS, DEVICE)
x = torch.randn(sum(LENGTHS), S.embed, device=DEVICE)
layers = {name: cls(S.embed, H, D, key_heads=H // 2, chunk=C).to(DEVICE) for name, cls in LAYERS.items()}
for name, layer in layers.items():
    wide = copy.deepcopy(layer).double()
    x32, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    got = results(lambda: packed_layer(layer, x32, offsets), {"x": x32, **dict(layer.named_parameters())})
    want = results(lambda: wide.reference(x64, offsets), {"x": x64, **dict(wide.named_parameters())})
    error = worst_error(got, want)
    assert error <= tolerances(torch.float32)["atol"], (name, error)
    print(f"{name} layer, float32, against its float64 definition: largest error {error:.1e} "
          f"over {len(want)} tensors")

# %%
# ``tests/test_recurrent.py`` runs these checks over more batches and
# chunk sizes (1, 3, 8, 64), with empty documents, and plants four faults,
# each of which fails them: the carried state reaching every token of a
# chunk (``no_reset``), documents starting one token late
# (``late_reset``), the convolution reading across documents
# (``conv_across``) and the decay mask not cut inside a chunk
# (``decay_across``).
#
# The leak
# --------
# The same layers on the same packed row without the resets, as a
# recurrent layer that knows nothing of documents runs it: one sequence of
# 340 tokens. Every document but the first starts from the previous
# document's state, and its first three tokens convolve the previous
# document's last ones. Each document's output against the same document
# run alone, relative to the output's scale:

with torch.no_grad():
    whole_row = offsets_from_lengths([sum(LENGTHS)], DEVICE)  # one "document": no reset
    LEAK = {}
    for name, layer in layers.items():
        alone = [layer(x[a:b], offsets_from_lengths([b - a], DEVICE))
                 for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
        scale = max(float(o.abs().max()) for o in alone)
        for label, run in (("without resets", whole_row), ("with resets", offsets)):
            out = layer(x, run)
            LEAK[name, label] = [float((out[a:b] - o).abs().max()) / scale
                                 for o, a, b in zip(alone, offsets[:-1].tolist(), offsets[1:].tolist())]
        print(f"{name}: documents 2 to {len(LENGTHS)} differ from themselves alone by up to "
              f"{max(LEAK[name, 'without resets'][1:]):.1e} without resets, "
              f"{max(LEAK[name, 'with resets']):.1e} with them")
        assert max(LEAK[name, "with resets"]) < 1e-5 < min(LEAK[name, "without resets"][1:])

# %%
# Where the state goes: its size, ``||S_t||`` averaged over the heads, at
# every token of the row, with the resets and without (the scalar-decay
# recurrence on the random inputs of the proof, whose decays keep a state
# for tens of tokens). With the resets it drops to zero at every document
# start (dashed); without them the next document inherits it.

from ragged_toolkit.recurrent import chunked_recurrence

q, k, v, g, _ = (t if t is None else t.detach() for t in random_inputs(LENGTHS, "scalar"))
T = sum(LENGTHS)
every_token = torch.stack([torch.zeros(T, dtype=torch.long), torch.arange(T)], 1).to(DEVICE)  # (T, 2)
norms = {}
with torch.no_grad():
    for label, (d, p) in {"with resets": (doc, pos),
                          "without resets": (torch.zeros_like(doc), torch.arange(T, device=DEVICE))}.items():
        _, states = chunked_recurrence(q[None], k[None], v[None], g[None], None, d[None], p[None], every_token, C)
        norms[label] = states.flatten(2).norm(dim=-1).mean(-1).cpu()  # (T,)
fig, ax = plt.subplots(layout="constrained")
for label, curve in norms.items():
    ax.plot(curve, lw=1.5, label=label)
for start in offsets[1:-1].tolist():
    ax.axvline(start - 0.5, color="gray", lw=0.8, ls="--")
ax.set(xlabel="token of the packed row", ylabel="state norm ||S_t||, mean over heads",
       title="The recurrent state along a packed row of eight documents")
ax.legend()
plt.show()

# %%
# The gap in ``transformers``
# ---------------------------
# ``transformers``' own Qwen3-Next, tiny and with random weights (three
# Gated DeltaNet layers and one full-attention layer, as the real model
# alternates them), on one packed row of three documents, each document's
# logits against the same document run alone. First the way
# ``DataCollatorWithFlattening`` feeds a packed row by default, with
# ``position_ids`` that restart at every document; then with the boundaries
# themselves, ``cu_seq_lens_q`` and ``cu_seq_lens_k``. A packed row needs
# ``use_cache=False``: with a cache, the release reads no documents from
# ``position_ids``, and its attention layers mix documents too. (Its
# decoder passes the boundaries on to the Gated DeltaNet layers from
# release 5.9.0 on; on an older one this section says so and stops.)

import transformers
from ragged_toolkit.recurrent_hf import PASSES_BOUNDARIES, document_differences, passes_boundaries

# sphinx_gallery_start_ignore
transformers.logging.set_verbosity_error()  # its notes that the reference kernels run (no fla here)
# sphinx_gallery_end_ignore

STOCK = RESET = None  # each document's largest logit difference, stock and with the packed layers
if not passes_boundaries():
    print(f"transformers {transformers.__version__}: Qwen3-Next's boundaries do not reach its Gated "
          f"DeltaNet layers; this section needs {PASSES_BOUNDARIES} or later (pip install -U transformers)")
else:
    config = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=0,
        layer_types=["linear_attention"] * 3 + ["full_attention"])
    torch.manual_seed(setup.seed)
    qwen = transformers.Qwen3NextForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(setup.seed)
    docs = [torch.randint(0, 256, (n,), generator=gen) for n in (37, 21, 70)]  # the last over a chunk
    STOCK = document_differences(qwen, docs)  # position_ids only
    print("position_ids only: each document's largest logit difference from itself alone "
          + ", ".join(f"{d:.1e}" for d in STOCK))
    assert max(STOCK[1:]) > 1e-3, "the stock model kept the documents apart"
    try:
        with_boundaries = document_differences(qwen, docs, boundaries=True)
        print("with cu_seq_lens, accepted: " + ", ".join(f"{d:.1e}" for d in with_boundaries))
    except ValueError as refusal:  # 5.22 and later: only flash-linear-attention's kernels take them
        print(f"with cu_seq_lens, transformers {transformers.__version__} refuses: {refusal}")

# %%
# The first document has nothing before it; the others read the previous
# documents' state, silently (a release that accepts the boundaries, such
# as 5.9, still mixes the documents: its PyTorch fallback ignores them).
# The toolkit's packed layer takes the place of every Gated DeltaNet
# layer, with the same weights (``in_proj_qkvz`` and ``in_proj_ba``
# regrouped), and reads the documents from ``cu_seq_lens_q``, on any device:
#
# .. literalinclude:: ../ragged_toolkit/recurrent_hf.py
#    :pyobject: PackedGatedDeltaNet

from ragged_toolkit.recurrent_hf import swap_gated_delta_layers

if STOCK is not None:
    swapped, n_swapped = swap_gated_delta_layers(copy.deepcopy(qwen), chunk=C)
    RESET = document_differences(swapped, docs, boundaries=True)
    assert n_swapped == 3 and max(RESET) < 1e-5, RESET
    print(f"transformers {transformers.__version__} Qwen3-Next Gated DeltaNet on a packed row: max difference "
          f"from each document alone {max(STOCK):.2e} (stock), {max(RESET):.2e} (with resets)")

# %%
# Each document's error, stock against reset: the two layers of this page
# and the Qwen3-Next model (its logits). Errors under ``1e-12`` are drawn at
# ``1e-12``.

panels = {f"{name} layer": (LEAK[name, "without resets"], LEAK[name, "with resets"]) for name in LAYERS}
if STOCK is not None:
    panels["Qwen3-Next logits"] = (STOCK, RESET)
fig, axes = plt.subplots(1, len(panels), figsize=(10, 4), layout="constrained", sharey=True)
for ax, (title, (stock, reset)) in zip(axes, panels.items()):
    at = np.arange(len(stock))
    ax.bar(at - 0.2, np.maximum(stock, 1e-12), 0.4, label="stock (no resets)")
    ax.bar(at + 0.2, np.maximum(reset, 1e-12), 0.4, label="with resets")
    ax.set(yscale="log", title=title, xlabel="document", xticks=at, xticklabels=at + 1)
axes[0].set_ylabel("largest difference from the document alone")
axes[0].legend(loc="lower left")
plt.show()

# %%
# Speed
# -----
# A batch of ``speed_docs`` Zipf-length documents, forward and backward,
# each way: the token loop (the recurrence on the packed row, token by
# token, the state zeroed at each document start), the chunked form on
# the packed row, and the whole layer packed and right-padded (the best
# padded batch: no mask needed, since the padding comes after every real
# token and the recurrence is causal). The chunked form does the same work
# per token whether a token is real or padding, so the work bound is the
# ratio of token slots, ``B x S_max`` over ``T``
# (``Work(per_token=1.0, per_pair=0.0)``). On CUDA the chunked form runs
# compiled, in ``bfloat16``.

from ragged_toolkit.batches import to_padded
from ragged_toolkit.measuring.bound import Work, throughput_line, work_bound
from ragged_toolkit.measuring.tables import print_timings
from ragged_toolkit.measuring.timing import measure
from ragged_toolkit.recurrent import recurrent_step


def token_by_token(q, k, v, g, offsets, beta=None):
    """The recurrence on a packed row, one token at a time: (T, H, V)."""
    first = (token_index(offsets, len(q))[1] == 0).tolist()  # where a document starts
    state, out = q.new_zeros(q.shape[1], k.shape[2], v.shape[2]), []
    for t in range(len(q)):
        state = state * (not first[t])  # the reset
        o, state = recurrent_step(state, q[t], k[t], v[t], g[t], None if beta is None else beta[t])
        out.append(o)
    return torch.stack(out)


speed_lengths = sentence_lengths(rng, S.speed_docs, max_len=S.max_len)
offsets = offsets_from_lengths(speed_lengths, DEVICE)
T = int(offsets[-1])
bound = work_bound(speed_lengths, work=Work(per_token=1.0, per_pair=0.0))
compiled = (lambda f: torch.compile(f, dynamic=False)) if DEVICE == "cuda" else (lambda f: f)
try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # flash-linear-attention
except ImportError:
    chunk_gated_delta_rule = None
    print("flash-linear-attention is not installed: the comparison with its chunk_gated_delta_rule is skipped")
SPEED, FRACTION = {}, {}
for name, layer in layers.items():
    rule = "delta" if layer.delta else "scalar"
    ins = random_inputs(speed_lengths.tolist(), rule, DTYPE)
    layer = copy.deepcopy(layer).to(DTYPE)
    x = torch.randn(T, S.embed, device=DEVICE, dtype=DTYPE, requires_grad=True)
    x_padded = to_padded(x.detach(), offsets)[0].requires_grad_()  # (B, S_max, E)
    chunked, layer_run = compiled(packed_recurrence), compiled(layer)
    fns = {"token loop": lambda: token_by_token(*ins[:4], offsets, ins[4]).sum().backward(),
           "chunked": lambda: chunked(*ins[:4], offsets, ins[4], chunk=C)[0].sum().backward(),
           "layer packed": lambda: layer_run(x, offsets).sum().backward(),
           "layer padded": lambda: layer_run(x_padded).sum().backward()}
    if chunk_gated_delta_rule is not None and rule == "delta":
        fns["fla chunk_gated_delta_rule"] = lambda: chunk_gated_delta_rule(
            *(t[None] for t in ins[:4]), ins[4][None], scale=1.0, cu_seqlens=offsets)[0].sum().backward()
    SPEED[name] = measure(fns, min_run_time=0.2 if setup.quick else 0.6, rounds=2, profile=False)
    print(f"{name}, {T} tokens in {S.speed_docs} documents, forward and backward:")
    print_timings(SPEED[name])
for name, times in SPEED.items():
    rate = {side: T / times[f"layer {side}"].median_ms * 1e3 for side in ("packed", "padded")}
    print(throughput_line(f"recurrent layer {name}", rate["packed"], rate["padded"], bound,
                          names=("packed", "padded")))
    FRACTION[f"the {name} layer"] = rate["packed"] / rate["padded"] / bound
    print(f"  the chunked form: {times['token loop'].median_ms / times['chunked'].median_ms:.1f}x "
          f"the token loop's tokens/s")

# %%
# Training a hybrid
# -----------------
# A small hybrid model, as Qwen3-Next stacks its layers: the site's GPT
# with a Gated DeltaNet layer in place of attention in three blocks of
# four, full attention (``ragged_attention``) in the fourth. The recurrent
# block reads the offsets from the batch's layout, the plan that attention
# reads them from:
#
# .. literalinclude:: ../ragged_toolkit/hybrid.py
#    :pyobject: RecurrentBlock
#
# It trains on real text, the standard library's docstrings as bytes, cut
# into steps of ``step_tokens`` tokens (as :doc:`packed_gpt_training` cuts
# rows): packed, and right-padded with the same sequences, from the same
# weights, the two taking turns step by step. First, the proof that both
# compute the same loss and gradients on the first step.

from ragged_toolkit.data import docstring_corpus, document_targets, pack_documents, split_by_token_budget
from ragged_toolkit.gpt import GPTConfig
from ragged_toolkit.hybrid import HybridGPT
from ragged_toolkit.layouts import PackedLayout, PaddedLayout

corpus, source = docstring_corpus(limit=S.corpus_documents)
stream, stream_offsets = pack_documents([corpus[i] for i in rng.permutation(len(corpus))], max_len=S.max_len)
assert len(stream) >= S.train_tokens, f"{len(stream)} tokens in the corpus, {S.train_tokens} asked for"
steps = [(t.to(DEVICE), o.to(DEVICE))
         for t, o in split_by_token_budget(stream, stream_offsets, S.step_tokens)[:S.train_tokens // S.step_tokens]]
cfg = GPTConfig(**S.model)
torch.manual_seed(setup.seed)
hybrid = HybridGPT(cfg, attention_every=4, chunk=C).to(DEVICE)
print(f"{len(steps)} steps of {S.step_tokens} tokens from {len(corpus)} documents of {source}; "
      f"{sum(p.numel() for p in hybrid.parameters()) / 1e6:.2f} M parameters, attention in block "
      f"{hybrid.attention_layers}")


def autocast():
    return torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32)


def packed_loss(model, tokens, offsets):
    with autocast():
        logits = model(tokens, token_index(offsets)[1], PackedLayout.of(offsets, dtype=DTYPE))  # (T, vocab)
    return F.cross_entropy(logits.float(), document_targets(tokens, offsets))


def padded_loss(model, tokens, offsets):
    ids = to_padded(tokens, offsets)[0]  # (B, S), right padding
    targets = to_padded(document_targets(tokens, offsets), offsets, -100)[0]
    with autocast():
        logits = model(ids, torch.arange(ids.shape[1], device=DEVICE).expand_as(ids), PaddedLayout())
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


proof = {}
for name, loss_of in (("packed", packed_loss), ("padded", padded_loss)):
    loss = loss_of(hybrid, *steps[0])
    proof[name] = [loss.detach(), *torch.autograd.grad(loss, list(hybrid.parameters()))]
for got, want in zip(proof["padded"], proof["packed"]):
    torch.testing.assert_close(got, want, **tolerances(DTYPE))
print(f"first step: loss {proof['packed'][0].item():.4f} packed, {proof['padded'][0].item():.4f} padded, "
      f"and all {len(proof['packed']) - 1} gradients agree")

# %%
# The work bound of training is counted from each step's sequence lengths:
# two FLOPs per weight per token (``model_work``), and for the one
# attention layer four times its width per query-key pair, the causal half
# on both sides. The recurrence's own arithmetic, the same per token on both
# sides, is not counted: that can only raise the bound, so the fraction
# printed is, if anything, low. Compile: not on a CPU (its cost would not
# pay back in a few steps).

from ragged_toolkit.measuring.bound import model_work, work_per_token
from ragged_toolkit.measuring.timing import StepTimer

WARMUP = 2  # steps left out of the rates
trainers = {}
for name, loss_of in (("packed", packed_loss), ("padded", padded_loss)):
    model = copy.deepcopy(hybrid)
    trainers[name] = (model, torch.optim.AdamW(model.parameters(), lr=S.lr), loss_of, StepTimer(), [])
for tokens, offsets in steps:  # the two trainers take turns
    for model, optimizer, loss_of, timer, losses in trainers.values():
        with timer.step(len(tokens)):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model, tokens, offsets)
            loss.backward()
            optimizer.step()
        losses.append(float(loss.detach()))
work = model_work(hybrid, n_layers=len(hybrid.attention_layers), attention_width=cfg.n_heads * cfg.head_dim)
timed = [o.diff().cpu() for _, o in steps[WARMUP:]]
train_bound = work_per_token(timed, work, padded=True) / work_per_token(timed, work)
rate = {name: trainers[name][3].tokens_per_s(WARMUP) for name in trainers}
print(throughput_line("hybrid training", rate["packed"], rate["padded"], train_bound, names=("packed", "padded")))
FRACTION["hybrid training"] = rate["packed"] / rate["padded"] / train_bound
for name, (*_, losses) in trainers.items():
    assert np.mean(losses[-2:]) < 0.8 * losses[0], f"{name} did not learn: {losses}"
    print(f"{name}: loss {losses[0]:.3f} -> {np.mean(losses[-2:]):.3f}")

# %%
# What the fractions say (the :term:`fraction of the bound`,
# :doc:`measuring_ragged_batches` explains it):

for label, fraction in FRACTION.items():
    verdict = ("packing turns the padding it removes into speed" if fraction >= 0.85 else
               "short of it: costs the bound does not count weigh on the packed side here")
    print(f"{label}: fraction {fraction:.2f}, {verdict}")

# %%
# Decoding: the state is the cache
# --------------------------------
# An attention layer keeps every past key and value; a recurrent layer keeps
# its state, ``(H, K, V)``, and the convolution's last three inputs, the same
# size whatever the request's length. ``prefill`` runs a packed batch of
# prompts and returns each document's final state as the cache; ``step``
# adds one token per request with ``recurrent_step``.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: _RecurrentLayer.step
#
# The proof: a few tokens decoded after every document of the first packed
# row equal the packed layer run over the longer documents.

NEW = 4
offsets = offsets_from_lengths(LENGTHS, DEVICE)
prompts = torch.randn(sum(LENGTHS), S.embed, device=DEVICE)  # (T, E): a packed batch of prompts
more = torch.randn(NEW, len(LENGTHS), S.embed, device=DEVICE)  # (steps, B, E): one token per request
caches = {}
with torch.no_grad():
    for name, layer in layers.items():
        _, cache = layer.prefill(prompts, offsets)
        decoded = []
        for t in range(NEW):
            o, cache = layer.step(more[t], cache)
            decoded.append(o)
        caches[name] = cache
        longer = torch.cat([torch.cat([prompts[a:b], more[:, i]]) for i, (a, b)
                            in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))])
        offsets_longer = offsets_from_lengths([n + NEW for n in LENGTHS], DEVICE)
        last = (offsets_longer[1:, None] - torch.arange(NEW, 0, -1, device=DEVICE)).flatten()
        torch.testing.assert_close(torch.stack(decoded, 1).flatten(0, 1), layer(longer, offsets_longer)[last],
                                   **tolerances(torch.float32))
        print(f"{name}: {NEW} tokens decoded after each of {len(LENGTHS)} documents from its state, "
              f"equal to the packed layer over the longer documents")

# %%
# The bytes per request, for one layer at the sizes of Qwen3-Next-80B-A3B
# (``Qwen3NextConfig``'s defaults): a full-attention layer's keys and values
# in ``bfloat16`` (2 key/value heads of 256), against a Gated DeltaNet
# layer's ``float32`` state (32 value heads, keys and values of 128) and its
# convolution's last three inputs in ``bfloat16`` (16 key heads).

kv_per_token = 2 * 2 * 256 * 2  # k and v, 2 heads of 256, 2 bytes each
state_bytes = 32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2  # the state; q, k, v of 3 tokens
for context in (1024, 32768, 262144):
    print(f"context {context:6d}: attention layer {kv_per_token * context / 2**20:7.1f} MiB, "
          f"recurrent layer {state_bytes / 2**20:5.2f} MiB per request")
delta = caches["gated delta"]  # the page's own layer, in float32: the same count
assert sum(t[0].numel() * t.element_size() for t in (delta.state, delta.conv)) == \
    H * D * D * 4 + 3 * layers["gated delta"].channels * 4

# %%
# Conclusion
# ----------
# A recurrent layer on a packed batch needs two cuts at every document
# start, the state and the convolution, and nothing else: the chunked form
# makes them masks, the same cut decay mask that parallelizes the chunk.
# Proved against the recurrence, the packed layer is as exact as the
# padded one and does the real tokens' work only; without the cuts, every
# document but the first reads its neighbours, silently, as stock
# ``transformers`` does on a packed row without ``flash-linear-attention``.
# In decoding the state is the whole cache, one ``(H, K, V)`` per request.
#
# References
# ----------
# * Yang et al., `Gated Delta Networks <https://arxiv.org/abs/2412.06464>`_;
#   `Parallelizing Linear Transformers with the Delta Rule
#   <https://arxiv.org/abs/2406.06484>`_ (the WY form);
#   `Gated Linear Attention <https://arxiv.org/abs/2312.06635>`_
# * Dao and Gu, `Transformers are SSMs (Mamba-2)
#   <https://arxiv.org/abs/2405.21060>`_
# * `flash-linear-attention <https://github.com/fla-org/flash-linear-attention>`_
#   (Triton kernels, ``cu_seqlens``)
