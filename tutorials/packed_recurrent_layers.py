"""
Packed recurrent layers: linear attention and state-space layers that reset at every document
=============================================================================================

Today's hybrid models (Qwen3-Next, Kimi Linear, Nemotron-H, Falcon-H1,
Jamba) mix a few attention layers with many Gated DeltaNet or Mamba-2
layers. Packed, these need at every document start what attention never
needed: the recurrent state set back to zero, and the causal convolution
kept from reading the previous document. Both layers in plain PyTorch, in
chunks, on packed values plus offsets: proved, the leak without the resets
shown (in ``transformers`` too), and measured.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * A scalar decay (gated linear attention, Mamba-2) and the gated
         delta rule, token by token and in chunks on a packed batch, cut at
         every document start, proved against the recurrence in float64
       * How far packed documents leak into each other without the cuts,
         in a stock ``transformers`` Qwen3-Next too, and how to stop it
       * What packing buys over padding, for a layer and for a hybrid model
         in training, beside the :term:`work bound`; the state as the cache

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`transformer_building_blocks` and :doc:`packed_gpt_training`;
         the functions used here are on :doc:`the toolkit's reference page
         </toolkit>`
       * PyTorch 2.11 or later; ``transformers`` 5.9 or later (by its
         source) for its Qwen3-Next, built from a config; a CPU is enough, a
         CUDA GPU runs the chunked form compiled in ``bfloat16``
"""

# sphinx_gallery_tags = ["linear attention", "state-space models", "Gated DeltaNet", "transformers", "training"]

# %%
# Sizes
# -----
# Every size is set here, per device; :term:`quick mode` shrinks them:
# layers of ``heads`` heads of ``head_dim`` (Qwen3-Next: 32 of 128), chunks
# of ``chunk`` tokens; a hybrid trained on ``train_tokens`` bytes of the first
# ``corpus_documents`` docstrings, ``step_tokens`` a step (real: 4096 to 65536).

from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(embed=1024, heads=16, head_dim=64, chunk=64, speed_docs=96, max_len=1024, step_tokens=4096,
                 train_tokens=196608, corpus_documents=2000, lr=1e-3,
                 model=dict(vocab_size=256, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=1408,
                            max_seq_len=1024)),
    "cpu": dict(embed=128, heads=4, head_dim=32, chunk=64, speed_docs=64, max_len=512, step_tokens=2048,
                train_tokens=32768, corpus_documents=600, lr=3e-3,  # the page: 90 s on 2 cores
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
# Both layers keep a ``(K, V)`` state per head and decay it by
# ``exp(g_t)``, ``g_t <= 0``, at every token. The scalar decay (gated
# linear attention; Mamba-2's state-space duality form) adds the outer
# product of key and value; the gated delta rule reads what the state holds
# for the key, ``k_t^T S``, and writes only the correction, scaled by
# ``beta_t``. The query reads the state::
#
#     scalar decay:  S_t = exp(g_t) S_{t-1} + k_t v_t^T
#     delta rule:    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
#     both:          o_t = S_t^T q_t,   S = 0 before a document's first token
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: recurrent_step
#
# Each document alone from a zero state, in float64: the reference below.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: reference_recurrence
#
# In the layers (as in Qwen3-Next and Mamba-2), q, k and v pass through a
# short causal depthwise convolution (four taps) and SiLU, and
# ``g = -exp(A_log) softplus(a + dt_bias)``. On a packed row the convolution
# must not read the previous document: tap ``m`` reads ``m`` tokens back
# only where the token's position in its document is at least ``m``.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: causal_conv
#
# The chunked form
# ----------------
# Token by token, the recurrence is ``T`` small sequential steps. The
# chunked form works on chunks of ``C`` tokens with matrix products: token
# ``i`` reads the state that entered the chunk, decayed to ``i``, plus the
# writes of the earlier tokens ``j`` of the chunk, each weighted by ``q_i .
# k_j`` and the decay from ``j`` to ``i``. A packed row cuts that ``(C,
# C)`` decay mask: ``j`` reaches ``i`` only inside one document, and the
# entering state only the tokens whose document began before the chunk, so
# a document that starts inside a chunk starts from zero.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: _same_document
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: chunk_decay
#
# A packed row of eight documents (one of a single token, one over two
# chunks), starting on chunk edges and inside chunks. Its fourth chunk,
# tokens 192 to 255, for one head: the document begun at token 64 carries
# its state in (the column left of 0); two documents start inside (dashed).

import matplotlib.pyplot as plt
import numpy as np
import torch
from ragged_toolkit.batches import offsets_from_lengths, token_index
from ragged_site.figures import FIGURE_STYLE
from ragged_toolkit.recurrent import chunk_decay, l2norm

plt.rcParams.update(FIGURE_STYLE)
LENGTHS = [40, 1, 23, 150, 7, 35, 64, 20]  # starts 0, 40, 41, 64, 214, 221, 256, 320; 340 tokens


def random_inputs(lengths, rule, dtype=torch.float32, seed=0):
    """q, k (unit), v (T, H, D), g (T, H) in (-0.1, 0] (a state lasting tens of
    tokens), beta (T, H) or None (scalar decay): leaves that take gradients."""
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
shown = ax.imshow(np.ma.masked_equal(picture.numpy(), 0), vmin=0, vmax=1, extent=(-1.5, C - 0.5, C - 0.5, -0.5))
for start in (offsets[(offsets > span.start) & (offsets < span.stop)] - span.start).tolist():
    ax.axhline(start - 0.5, color="red", lw=1, ls="--")
ax.set(xlabel="token j of the chunk (left of 0: the entering state)", ylabel="token i of the chunk",
       title=f"Chunk 4 of a packed row (C = {C}): decay from j to i; blank: cut")
fig.colorbar(shown, ax=ax, label=r"$\exp(g_{j+1} + \dots + g_i)$")
plt.show()
# sphinx_gallery_thumbnail_number = 1

# %%
# For the delta rule, a token's write depends on the earlier writes of the
# chunk: the writes solve a unit lower-triangular system (the "WY form" of
# Yang et al.), one ``solve_triangular`` per chunk, block diagonal by
# document since it carries the same cut decays.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: _delta_values
#
# Across chunks the state is carried forward, the one sequential loop, a
# step per chunk; the state leaving a chunk is its last document's.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: _carry_states
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: chunked_recurrence
#
# A packed batch is one row; each document's final state is read at its
# last token, for decoding (the end of this page). Right-padded rows
# (``padded_recurrence``) are the same function, a document per row.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: packed_recurrence
#
# The proof
# ---------
# On the row above and two random ones (Zipf lengths, a one-token document
# and one of over three chunks), both rules: outputs, final states and the
# gradients of q, k, v, g and beta of the packed chunked form, against
# ``documents_reference`` (each document alone, float64). An error is the
# largest difference over the reference's largest magnitude; tolerances
# (``tolerances(dtype)``): ``1e-4`` in float32, ``4e-2`` in bfloat16.

from ragged_site.workloads import sentence_lengths
from ragged_site.page import tolerances
from ragged_toolkit.recurrent import packed_recurrence
from ragged_site.reference import documents_reference


def results(run, leaves, seed=1):
    """``run() -> (o, states)``: o, states and the gradients of ``leaves`` (None
    skipped) after the backward of a fixed random projection of o and states."""
    o, states = run()
    gen, leaves = torch.Generator().manual_seed(seed), [t for t in leaves if t is not None]
    loss = sum((t.double() * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)).sum()
               for t in (o, states))
    return [o.detach(), states.detach(), *torch.autograd.grad(loss, leaves)]


def worst_error(got, want):
    """The largest error of any tensor, relative to its reference's scale."""
    return max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True))


rng = np.random.default_rng(setup.seed)
batches = [LENGTHS] + [rng.permutation(np.concatenate([[1, 3 * C + 7], sentence_lengths(rng, 8)])).tolist()
                       for _ in range(2)]
in_chunk = [s % C for lengths in batches for s in np.cumsum(lengths)[:-1].tolist()]  # where documents start
assert 0 in in_chunk and any(in_chunk) and min(map(min, batches)) == 1 and max(map(max, batches)) > 3 * C
PROOF = {}
for rule in ("scalar", "delta"):
    for dtype, cases in ((torch.float32, batches), (torch.bfloat16, batches[:1])):
        for i, lengths in enumerate(cases):
            ins, offsets = random_inputs(lengths, rule, dtype, seed=i), offsets_from_lengths(lengths, DEVICE)
            wide = [None if t is None else t.detach().double().requires_grad_() for t in ins]
            got = results(lambda: packed_recurrence(*ins[:4], offsets, ins[4], chunk=C), ins)
            want = results(lambda: documents_reference(*wide[:4], offsets, wide[4]), wide)
            PROOF[rule, dtype, i] = worst_error(got, want)
            assert PROOF[rule, dtype, i] <= tolerances(dtype)["atol"], (rule, dtype, i, PROOF[rule, dtype, i])
    print(f"{rule:6s} chunked and packed against each document alone: largest error "
          f"{max(PROOF[rule, torch.float32, i] for i in range(3)):.1e} in float32 (3 batches, tolerance 1e-4),\n  "
          f"{PROOF[rule, torch.bfloat16, 0]:.1e} in bfloat16 (tolerance 4e-2)")

# %%
# The layers, convolution included, are proved the same way against their
# plain definition (``reference``, on a float64 copy): each document alone
# through ``F.conv1d``, then token by token. Outputs, states, and the
# gradients of the input and of every parameter:

import copy

from ragged_toolkit.recurrent import GatedDeltaLayer, ScalarDecayLayer


def packed_layer(layer, x, offsets):
    """The packed layer's output (T, E) and each document's final state."""
    out, cache = layer.prefill(x, offsets)
    return out, cache.state


LAYERS = {"scalar decay": ScalarDecayLayer, "gated delta": GatedDeltaLayer}
torch.manual_seed(setup.seed)
offsets = offsets_from_lengths(LENGTHS, DEVICE)
x = torch.randn(sum(LENGTHS), S.embed, device=DEVICE)
layers = {name: cls(S.embed, H, D, key_heads=H // 2, chunk=C).to(DEVICE) for name, cls in LAYERS.items()}
for name, layer in layers.items():
    wide = copy.deepcopy(layer).double()
    x32, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    got = results(lambda: packed_layer(layer, x32, offsets), [x32, *layer.parameters()])
    want = results(lambda: wide.reference(x64, offsets), [x64, *wide.parameters()])
    assert worst_error(got, want) <= tolerances(torch.float32)["atol"], (name, worst_error(got, want))
    print(f"{name} layer in float32 against its float64 definition: largest error "
          f"{worst_error(got, want):.1e} over {len(want)} tensors")

# %%
# ``tests/test_recurrent.py`` checks more batches, chunk sizes and empty
# documents, and plants four faults that each fail it (the entering state
# reaching a whole chunk, documents starting a token late, the convolution
# or the decay mask not cut).
#
# The leak
# --------
# The same layers on the same row without the resets (one sequence of 340
# tokens), each document's output against it alone, over the output's scale:

with torch.no_grad():
    whole_row = offsets_from_lengths([sum(LENGTHS)], DEVICE)  # one "document": no reset
    LEAK = {}
    for name, layer in layers.items():
        alone = [layer(x[a:b], offsets_from_lengths([b - a], DEVICE))
                 for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
        scale = max(float(o.abs().max()) for o in alone)
        for label, cuts in (("without resets", whole_row), ("with resets", offsets)):
            out = layer(x, cuts)
            LEAK[name, label] = [float((out[a:b] - o).abs().max()) / scale
                                 for o, a, b in zip(alone, offsets[:-1].tolist(), offsets[1:].tolist())]
        assert max(LEAK[name, "with resets"]) < 1e-5 < min(LEAK[name, "without resets"][1:])
        print(f"{name}, each document's largest difference from itself alone:\n  without resets "
              + " ".join(f"{d:.0e}" for d in LEAK[name, "without resets"]) + "\n  with resets    "
              + " ".join(f"{d:.0e}" for d in LEAK[name, "with resets"]))

# %%
# The state's norm along the row (scalar decay, the proof's inputs): with
# the resets it restarts from the first token's write at every document
# (dashed); without them each document inherits the previous state.

from ragged_toolkit.recurrent import chunked_recurrence

q, k, v, g = (t.detach() for t in random_inputs(LENGTHS, "scalar")[:4])
every_token = torch.stack([torch.zeros_like(pos), torch.arange(len(pos), device=DEVICE)], 1)  # (T, 2)
documents = {"without resets": (torch.zeros_like(doc), every_token[:, 1]), "with resets": (doc, pos)}
fig, ax = plt.subplots(layout="constrained")
with torch.no_grad():
    for label, (d, p) in documents.items():  # each token's document and position
        _, states = chunked_recurrence(q[None], k[None], v[None], g[None], None, d[None], p[None], every_token, C)
        ax.plot(states.flatten(2).norm(dim=-1).mean(-1).cpu(), lw=1.5, label=label)  # (T,)
for start in offsets[1:-1].tolist():
    ax.axvline(start - 0.5, color="gray", lw=0.8, ls="--")
ax.set(xlabel="token of the packed row", ylabel="state norm, mean over heads",
       title="The recurrent state along a packed row of eight documents")
ax.legend()
plt.show()

# %%
# The gap in ``transformers``
# ---------------------------
# ``transformers``' Qwen3-Next, tiny, random weights (three Gated DeltaNet
# layers, then attention), on a packed row of three documents, each
# document's logits against the document alone: with ``position_ids`` that
# restart at every document (``DataCollatorWithFlattening``'s default), then
# with ``cu_seq_lens_q/k``; ``use_cache=False``, or attention mixes them too.
# Before 5.9 (by its source) the layers never see ``cu_seq_lens_q``: checked.

import textwrap
import transformers
from ragged_toolkit.recurrent_hf import (FORWARDS_CU_SEQ_LENS, document_differences,
                                         forwards_cu_seq_lens)

# sphinx_gallery_start_ignore
transformers.logging.set_verbosity_error()  # its notes that its reference kernels run
# sphinx_gallery_end_ignore

STOCK = RESET = None  # each document's largest logit difference, stock and with the packed layers
if not forwards_cu_seq_lens():
    print(f"transformers {transformers.__version__} keeps cu_seq_lens_q from its Gated DeltaNet layers: "
          f"skipped (it needs {FORWARDS_CU_SEQ_LENS} or later)")
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
    assert max(STOCK[1:]) > 1e-3, "the stock model kept the documents apart"
    print("position_ids only, each document's largest logit difference from itself alone: "
          + ", ".join(f"{d:.1e}" for d in STOCK))
    try:
        accepted = document_differences(qwen, docs, boundaries=True)
        kept_apart = max(accepted[1:]) <= 1e-3
        verdict = "kept apart" if kept_apart else "still mixed"  # 5.17, for one: ignored silently
        print(f"with cu_seq_lens, transformers {transformers.__version__} accepts them, documents "
              f"{verdict}: " + ", ".join(f"{d:.1e}" for d in accepted))
    except ValueError as refusal:  # 5.23, for one: only flash-linear-attention's kernels take them
        print(f"with cu_seq_lens, transformers {transformers.__version__} refuses:\n"
              + textwrap.fill(str(refusal), 100, initial_indent="  ", subsequent_indent="  "))

# %%
# The first document has nothing before it; the others read their
# predecessors' state, silently (where a release accepts the document
# starts, the line above prints how far they still are). The
# toolkit's packed layer, with the same weights, takes the place of every
# Gated DeltaNet layer and reads ``cu_seq_lens_q``, on any device:
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

# each document's error, stock against reset: this page's layers (over the output's scale) and
# Qwen3-Next's logits; errors under 1e-12 (zero included) are drawn at 1e-12
panels = {f"{name} layer": (LEAK[name, "without resets"], LEAK[name, "with resets"]) for name in LAYERS}
if STOCK is not None:
    panels["Qwen3-Next logits"] = (STOCK, RESET)
fig, axes = plt.subplots(1, len(panels), figsize=(10, 4.5), layout="constrained", sharey=True)
for ax, (title, (stock, reset)) in zip(axes, panels.items()):
    at = np.arange(len(stock))
    ax.bar(at - 0.2, np.maximum(stock, 1e-12), 0.4, label="stock (no resets)")
    ax.bar(at + 0.2, np.maximum(reset, 1e-12), 0.4, label="with resets")
    ax.set(yscale="log", title=title, xlabel="document", xticks=at, xticklabels=at + 1)
axes[0].set_ylabel("largest difference from the document alone")
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside upper center", ncols=2)
plt.show()

# %%
# Speed
# -----
# ``speed_docs`` documents of Zipf lengths, forward and backward: the token
# loop on the packed row, the chunked form, and the whole layer packed and
# right-padded (the best padded batch: no mask, as padding follows every
# real token and the recurrence is causal). The chunked form does the same
# work per token, real or padding, so the work bound is the ratio of token
# slots, ``B x S_max`` over ``T`` (:doc:`measuring_ragged_batches` explains
# the :term:`fraction of the bound`). On CUDA the chunked form runs compiled
# in ``bfloat16``, beside ``flash-linear-attention`` where installed.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: token_loop

from ragged_toolkit.batches import to_padded
from ragged_site.measuring.bound import Work, throughput_line, work_bound
from ragged_site.measuring.tables import print_timings
from ragged_site.measuring.timing import measure
from ragged_toolkit.recurrent import token_loop

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # flash-linear-attention (Triton)
except ImportError:
    chunk_gated_delta_rule = None
    print("flash-linear-attention is not installed: the comparison with its chunk_gated_delta_rule is skipped")
speed_lengths = sentence_lengths(rng, S.speed_docs, max_len=S.max_len)
speed_offsets = offsets_from_lengths(speed_lengths, DEVICE)
compiled = (lambda f: torch.compile(f, dynamic=False)) if DEVICE == "cuda" else (lambda f: f)


def time_layer(layer):
    """Forward and backward, each way, timed side by side (``measure``)."""
    ins = random_inputs(speed_lengths.tolist(), "delta" if layer.delta else "scalar", DTYPE)
    layer = copy.deepcopy(layer).to(DTYPE)
    x = torch.randn(int(speed_offsets[-1]), S.embed, device=DEVICE, dtype=DTYPE, requires_grad=True)
    x_padded = to_padded(x.detach(), speed_offsets)[0].requires_grad_()  # (B, S_max, E)
    chunked = compiled(packed_recurrence)
    runs = {"token loop": lambda: token_loop(*ins[:4], speed_offsets, ins[4]).sum().backward(),
            "chunked": lambda: chunked(*ins[:4], speed_offsets, ins[4], chunk=C)[0].sum().backward(),
            "layer packed": lambda: layer(x, speed_offsets).sum().backward(),
            "layer padded": lambda: layer(x_padded).sum().backward()}
    if chunk_gated_delta_rule is not None and layer.delta:
        runs["fla chunk_gated_delta_rule"] = lambda: chunk_gated_delta_rule(
            *(t[None] for t in ins[:4]), ins[4][None], scale=1.0, cu_seqlens=speed_offsets)[0].sum().backward()
    return measure(runs, min_run_time=0.2 if setup.quick else 0.6, rounds=2, profile=False)


SPEED = {name: time_layer(layer) for name, layer in layers.items()}
layer_bound = work_bound(speed_lengths, work=Work(per_token=1.0, per_pair=0.0))
FRACTION = {}
for name, times in SPEED.items():
    print(f"{name}, {int(speed_offsets[-1])} tokens in {S.speed_docs} documents, forward and backward:")
    print_timings(times)
    speedup = times["layer padded"].median_ms / times["layer packed"].median_ms
    print(throughput_line(f"recurrent layer {name}", int(speed_offsets[-1]) / times["layer packed"].median_ms * 1e3,
                          int(speed_offsets[-1]) / times["layer padded"].median_ms * 1e3, layer_bound,
                          names=("packed", "padded")))
    FRACTION[f"{name} layer"] = speedup / layer_bound
    print(f"the chunked form: {times['token loop'].median_ms / times['chunked'].median_ms:.1f}x the token loop "
          f"(first call{', compiling' if DEVICE == 'cuda' else ''}: {times['chunked'].first_call_s:.1f} s)")

# %%
# Training a hybrid
# -----------------
# A small hybrid, stacked as Qwen3-Next stacks its layers: the site's GPT
# with a Gated DeltaNet layer in place of attention in three blocks of four.
# A recurrent block reads the offsets from the plan that attention reads:
#
# .. literalinclude:: ../ragged_toolkit/hybrid.py
#    :pyobject: RecurrentBlock
#
# It trains on the standard library's docstrings as bytes, cut into steps of
# ``step_tokens`` tokens (as :doc:`packed_gpt_training` cuts its rows),
# packed and right-padded with the same sequences, from the same weights:
#
# .. literalinclude:: ../ragged_toolkit/hybrid.py
#    :pyobject: hybrid_loss
#
# First, the proof that both give the first step's loss and gradients:

from ragged_toolkit.data import pack_documents, split_by_token_budget
from ragged_site.corpus import docstring_corpus
from ragged_toolkit.gpt import GPTConfig
from ragged_toolkit.hybrid import HybridGPT, hybrid_loss

corpus, source = docstring_corpus(limit=S.corpus_documents)
stream, stream_offsets = pack_documents([corpus[i] for i in rng.permutation(len(corpus))], max_len=S.max_len)
assert len(stream) >= S.train_tokens, f"{len(stream)} tokens in the corpus, {S.train_tokens} asked for"
steps = [(t.to(DEVICE), o.to(DEVICE))
         for t, o in split_by_token_budget(stream, stream_offsets, S.step_tokens)[:S.train_tokens // S.step_tokens]]
cfg = GPTConfig(**S.model)
torch.manual_seed(setup.seed)
hybrid = HybridGPT(cfg, attention_every=4, chunk=C).to(DEVICE)
first = {}
for padded in (False, True):
    loss = hybrid_loss(hybrid, *steps[0], padded=padded, dtype=DTYPE)
    first[padded] = [loss.detach(), *torch.autograd.grad(loss, list(hybrid.parameters()))]
for got, want in zip(first[True], first[False]):
    torch.testing.assert_close(got, want, **tolerances(DTYPE))
print(f"{len(steps)} steps of {S.step_tokens} tokens from {len(corpus)} documents of {source}")
print(f"attention in block {hybrid.attention_layers}; first step: loss {float(first[False][0]):.4f} packed, "
      f"{float(first[True][0]):.4f} padded, all {len(first[True]) - 1} gradients agree")

# %%
# The two trainers take turns, one step each, with AdamW, eager (compiling
# would not pay back in a few steps on a CPU); the work bound counts two
# FLOPs per weight per token (``model_work``) and, for the attention layer,
# four times its width per query-key pair, the causal half on both sides.
# The recurrence's own work, the same per token on both sides, is left out:
# that can only raise the bound, so the fraction printed is if anything low.
#
# On a GPU, throwaway copies of both first meet every step's shape, through
# the same training step: cuDNN builds a plan for each new shape, and that
# must not land in a timed step on either side.

from ragged_site.measuring.bound import model_work, work_per_token
from ragged_site.measuring.timing import train_in_turns

WARMUP = 2  # steps left out of the rates
WAYS = {"packed": False, "padded": True}  # name -> hybrid_loss's padded
WARM_SHAPES = DEVICE == "cuda"


def trainer(padded):
    """A fresh copy of the hybrid and its AdamW: a function that takes one
    step on a batch (tokens, offsets) and returns the loss."""
    model = copy.deepcopy(hybrid)
    optimizer = torch.optim.AdamW(model.parameters(), lr=S.lr)

    def train_step(batch):
        optimizer.zero_grad(set_to_none=True)
        loss = hybrid_loss(model, *batch, padded=padded, dtype=DTYPE)
        loss.backward()
        optimizer.step()
        return loss

    return train_step


def step_shape(batch):
    """What a step's shapes depend on: tokens, documents, the longest one."""
    tokens, offsets = batch
    return len(tokens), len(offsets) - 1, int(offsets.diff().max())


TRAINED = train_in_turns(
    {way: trainer(padded) for way, padded in WAYS.items()},
    steps,
    tokens_of=lambda batch: len(batch[0]),
    shape_of=step_shape,
    warm_first={way: trainer(padded) for way, padded in WAYS.items()} if WARM_SHAPES else None,
)
for way, (_, losses) in TRAINED.items():
    assert np.mean(losses[-2:]) < 0.8 * losses[0], f"{way} did not learn: {losses}"
    print(f"{way}: loss {losses[0]:.3f} -> {np.mean(losses[-2:]):.3f}")
work = model_work(hybrid, n_layers=len(hybrid.attention_layers), attention_width=cfg.n_heads * cfg.head_dim)
timed_lengths = [offsets_i.diff().cpu() for tokens_i, offsets_i in steps[WARMUP:]]
train_bound = work_per_token(timed_lengths, work, padded=True) / work_per_token(timed_lengths, work)
rate = {way: TRAINED[way][0].tokens_per_s(WARMUP) for way in WAYS}
print(throughput_line("hybrid training", rate["packed"], rate["padded"], train_bound, names=("packed", "padded")))
FRACTION["hybrid training"] = rate["packed"] / rate["padded"] / train_bound
for label, fraction in FRACTION.items():
    verdict = ("packing turns the padding it removes into speed" if fraction >= 0.85 else
               "short of the bound: costs it does not count weigh on the packed side here")
    print(f"{label}: fraction {fraction:.2f}, {verdict}")

# %%
# Decoding: the state is the cache
# --------------------------------
# An attention layer keeps every past key and value; a recurrent layer, its
# state ``(H, K, V)`` and the convolution's last three inputs, whatever the
# request's length. ``prefill`` runs packed prompts and returns each
# document's final state as the cache; ``step`` adds a token per request:
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: _RecurrentLayer.step
#
# Proof: four tokens decoded after each document of the row of eight equal
# the packed layer run over the longer documents.

NEW = 4
prompt_offsets = offsets_from_lengths(LENGTHS, DEVICE)
prompts = torch.randn(sum(LENGTHS), S.embed, device=DEVICE)  # (T, E): a packed batch of prompts
more = torch.randn(NEW, len(LENGTHS), S.embed, device=DEVICE)  # (steps, B, E): one token per request
longer_offsets = offsets_from_lengths([n + NEW for n in LENGTHS], DEVICE)
longer = torch.cat([torch.cat([prompts[a:b], more[:, i]]) for i, (a, b)
                    in enumerate(zip(prompt_offsets[:-1].tolist(), prompt_offsets[1:].tolist()))])
new_rows = (longer_offsets[1:, None] - torch.arange(NEW, 0, -1, device=DEVICE)).flatten()  # (B * NEW,)
CACHES = {}
with torch.no_grad():
    for kind, mixer in layers.items():
        _, cache = mixer.prefill(prompts, prompt_offsets)
        decoded = []
        for t in range(NEW):
            out, cache = mixer.step(more[t], cache)
            decoded.append(out)
        CACHES[kind] = cache
        torch.testing.assert_close(torch.stack(decoded, 1).flatten(0, 1), mixer(longer, longer_offsets)[new_rows],
                                   **tolerances(torch.float32))
        print(f"{kind}: {NEW} tokens decoded after each of {len(LENGTHS)} documents from its state,\n"
              f"  equal to the packed layer over the longer documents")

# %%
# Bytes per request and layer at the sizes of Qwen3-Next-80B-A3B
# (``Qwen3NextConfig``'s defaults): attention's keys and values in
# ``bfloat16`` (2 heads of 256), against the Gated DeltaNet ``float32`` state
# (32 heads of 128 by 128) and three convolution inputs in ``bfloat16``.

kv_per_token = 2 * 2 * 256 * 2  # k and v, 2 heads of 256, 2 bytes each
state_bytes = 32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2  # the state; q, k, v of 3 tokens
for context in (1024, 32768, 262144):
    print(f"context {context:6d}: attention layer {kv_per_token * context / 2**20:7.1f} MiB, "
          f"recurrent layer {state_bytes / 2**20:5.2f} MiB per request")
held = CACHES["gated delta"]  # the page's own layer, in float32: counted the same way
assert sum(t[0].numel() * t.element_size() for t in (held.state, held.conv)) == \
    H * D * D * 4 + 3 * layers["gated delta"].channels * 4

# %%
# Conclusion
# ----------
# A packed recurrent layer needs two cuts at every document start, the state
# and the convolution: in the chunked form, masks. With them each document
# is computed as if alone; without them documents read their neighbors.
#
# References
# ----------
# * Yang et al., `Gated Delta Networks <https://arxiv.org/abs/2412.06464>`_,
#   `the delta rule in parallel <https://arxiv.org/abs/2406.06484>`_ (the WY
#   form), `Gated Linear Attention <https://arxiv.org/abs/2312.06635>`_
# * Dao and Gu, `Mamba-2 <https://arxiv.org/abs/2405.21060>`_;
#   `flash-linear-attention <https://github.com/fla-org/flash-linear-attention>`_
