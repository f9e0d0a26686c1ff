"""
Packed recurrent layers: linear attention and state-space layers that reset at every document
=============================================================================================

Today's hybrid models (Qwen3-Next, Kimi Linear, Nemotron-H, Falcon-H1,
Jamba) mix a few attention layers with many Gated DeltaNet or Mamba-2
layers. Packed, these need two things at every document start that
attention never needed. The recurrent state must be set back to zero. The
causal convolution must not read the previous document. This page builds
both layers in plain PyTorch, in chunks, on packed values plus offsets. It
proves them, shows the leak without the resets (in ``transformers`` too),
and measures them.
:doc:`packed_hybrid_model` trains a hybrid model built from them.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * A scalar decay (gated linear attention, Mamba-2) and the gated
         delta rule, token by token and in chunks on a packed batch, cut at
         every document start, proved against the recurrence in float64
       * How far packed documents leak into each other without the cuts,
         in a stock ``transformers`` Qwen3-Next too, and how to stop it
       * What packing buys over padding for a layer, forward and backward,
         beside the :term:`work bound`

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
# Every size is set here, per device. :term:`quick mode`, the test suite's
# small run, shrinks them. A layer has ``heads`` heads of ``head_dim``
# (Qwen3-Next: 32 of 128). A chunk is ``chunk`` tokens. The speed test
# times ``speed_docs`` documents of at most ``max_len`` tokens.

from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(embed=1024, heads=16, head_dim=64, chunk=64, speed_docs=96, max_len=1024),
    "cpu": dict(embed=128, heads=4, head_dim=32, chunk=64, speed_docs=64, max_len=512),
    "quick": dict(speed_docs=8),
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
# product of key and value. The gated delta rule reads what the state holds
# for the key, ``k_t^T S``. It writes only the correction, scaled by
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
# short causal depthwise convolution (four taps) and SiLU. The decay is
# ``g = -exp(A_log) softplus(a + dt_bias)``. On a packed row the convolution
# must not read the previous document. Tap ``m`` reads ``m`` tokens back
# only where the token's position in its document is at least ``m``.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: causal_conv
#
# The proof: three documents in one packed row, cut this way, give what
# ``F.conv1d`` gives each document alone, with zeros before it.

import torch
import torch.nn.functional as F
from ragged_toolkit.batches import offsets_from_lengths, token_index
from ragged_toolkit.recurrent import causal_conv

conv_offsets = offsets_from_lengths([3, 1, 4])  # three documents, 8 tokens
x_conv, taps = torch.randn(8, 6), torch.randn(6, 4)  # (T, channels), (channels, 4 taps)
alone = [
    F.conv1d(x_conv[a:b].T[None], taps[:, None], padding=3, groups=6)[0, :, : b - a].T
    for a, b in zip(conv_offsets[:-1].tolist(), conv_offsets[1:].tolist())
]  # each document alone: (L, channels)
torch.testing.assert_close(
    causal_conv(x_conv, taps, token_index(conv_offsets)[1]), torch.cat(alone)
)
print("the cut convolution on a packed row gives each document's own conv1d")

# %%
# The chunked form
# ----------------
# Token by token, the recurrence is ``T`` small sequential steps. The chunked
# form works on chunks of ``C`` tokens with matrix products. Token ``i`` reads
# the state that entered the chunk, decayed to ``i``. It adds the writes of the
# earlier tokens ``j`` of the chunk. Each write is weighted by ``q_i . k_j``
# and the decay from ``j`` to ``i``. A packed row cuts that ``(C, C)`` decay
# mask: ``j`` reaches ``i`` only inside one document. The entering state
# reaches only the tokens whose document began before the chunk. So a document
# that starts inside a chunk starts from zero.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: _same_document
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: chunk_decay
#
# A packed row of eight documents (one of a single token, one over two chunks),
# starting on chunk edges and inside chunks. Below: its fourth chunk, tokens
# 192 to 255, for one head. The document begun at token 64 carries its state in
# (the column left of 0). Two documents start inside it (dashed).

import matplotlib.pyplot as plt
import numpy as np
import torch
from ragged_toolkit.batches import offsets_from_lengths, token_index
from ragged_site.figures import FIGURE_STYLE, draw_floor
from ragged_toolkit.recurrent import chunk_decay

plt.rcParams.update(FIGURE_STYLE)
LENGTHS = [40, 1, 23, 150, 7, 35, 64, 20]  # starts 0, 40, 41, 64, 214, 221, 256, 320; 340 tokens


def random_inputs(lengths, rule, dtype=torch.float32, seed=0):
    """q, k (unit), v (T, H, D), g (T, H) in (-0.1, 0] (a state lasting tens of
    tokens), beta (T, H) or None (scalar decay): leaves that take gradients."""
    gen, T = torch.Generator().manual_seed(seed), int(sum(lengths))
    q, v = (torch.randn(T, H, D, generator=gen) for _ in range(2))
    k = F.normalize(torch.randn(T, H, D, generator=gen), dim=-1)
    g = -0.1 * torch.rand(T, H, generator=gen)
    beta = torch.rand(T, H, generator=gen) if rule == "delta" else None
    return [
        None if t is None else t.to(DEVICE, dtype).requires_grad_()
        for t in (q / D**0.5, k, v, g, beta)
    ]


offsets = offsets_from_lengths(LENGTHS, DEVICE)
doc, pos = token_index(offsets)
g = random_inputs(LENGTHS, "scalar")[3].detach()
span = slice(3 * C, 4 * C)  # the fourth chunk
decay, carry = chunk_decay(g[span].T[None, None], doc[None, None, span], pos[None, None, span])
picture = torch.cat([carry[0, 0, 0, :, None], decay[0, 0, 0]], 1).cpu()  # (C, 1 + C), head 0
fig, ax = plt.subplots(figsize=(7, 6), layout="constrained")
shown = ax.imshow(
    np.ma.masked_equal(picture.numpy(), 0), vmin=0, vmax=1, extent=(-1.5, C - 0.5, C - 0.5, -0.5)
)
for start in (offsets[(offsets > span.start) & (offsets < span.stop)] - span.start).tolist():
    ax.axhline(start - 0.5, color="red", lw=1, ls="--")
ax.set(
    xlabel="token j of the chunk (left of 0: the entering state)",
    ylabel="token i of the chunk",
    title=f"Chunk 4 of a packed row (C = {C}): decay from j to i; blank: cut",
)
fig.colorbar(shown, ax=ax, label=r"$\exp(g_{j+1} + \dots + g_i)$")
plt.show()
# sphinx_gallery_thumbnail_number = 1

# %%
# For the delta rule, a token's write depends on the earlier writes of the
# chunk. The writes solve a unit lower-triangular system (the "WY form" of
# Yang et al.), one ``solve_triangular`` per chunk. The system is block
# diagonal by document, since it carries the same cut decays.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: _delta_values
#
# Across chunks the state is carried forward: the one sequential loop, a
# step per chunk. The state leaving a chunk is its last document's.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: _carry_states
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: chunked_recurrence
#
# A packed batch is one row. Each document's final state is read at its
# last token, for decoding (:doc:`packed_hybrid_model`). Right-padded rows
# (``padded_recurrence``) are the same function, a document per row.
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: packed_recurrence
#
# The proof
# ---------
# The proof runs on the row above and on two random rows. These have Zipf
# lengths, a one-token document and one of over three chunks. For both
# rules it checks the packed chunked form's outputs, final states and the
# gradients of q, k, v, g and beta. The reference is ``documents_reference``:
# each document alone, in float64. An error is the largest difference over
# the reference's largest magnitude, held to ``tolerances(dtype)`` (printed).

from ragged_site.workloads import sentence_lengths
from ragged_site.page import tolerances
from ragged_toolkit.recurrent import packed_recurrence
from ragged_site.reference import documents_reference


def results(run, leaves, seed=1):
    """``run() -> (o, states)``: o, states and the gradients of ``leaves`` (None
    skipped) after the backward of a fixed random projection of o and states."""
    o, states = run()
    gen, leaves = torch.Generator().manual_seed(seed), [t for t in leaves if t is not None]
    loss = sum(
        (t.double() * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)).sum()
        for t in (o, states)
    )
    return [o.detach(), states.detach(), *torch.autograd.grad(loss, leaves)]


def worst_error(got, want):
    """The largest error of any tensor, relative to its reference's scale."""
    return max(
        float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True)
    )


rng = np.random.default_rng(setup.seed)
batches = [LENGTHS] + [
    rng.permutation(np.concatenate([[1, 3 * C + 7], sentence_lengths(rng, 8)])).tolist()
    for _ in range(2)
]
in_chunk = [
    s % C for lengths in batches for s in np.cumsum(lengths)[:-1].tolist()
]  # where documents start
assert (
    0 in in_chunk
    and any(in_chunk)
    and min(map(min, batches)) == 1
    and max(map(max, batches)) > 3 * C
)
PROOF = {}
for rule in ("scalar", "delta"):
    for dtype, cases in ((torch.float32, batches), (torch.bfloat16, batches[:1])):
        for i, lengths in enumerate(cases):
            ins, offsets = (
                random_inputs(lengths, rule, dtype, seed=i),
                offsets_from_lengths(lengths, DEVICE),
            )
            wide = [None if t is None else t.detach().double().requires_grad_() for t in ins]
            got = results(lambda: packed_recurrence(*ins[:4], offsets, ins[4], chunk=C), ins)
            want = results(lambda: documents_reference(*wide[:4], offsets, wide[4]), wide)
            PROOF[rule, dtype, i] = worst_error(got, want)
            assert PROOF[rule, dtype, i] <= tolerances(dtype)["atol"], (
                rule,
                dtype,
                i,
                PROOF[rule, dtype, i],
            )
    print(
        f"{rule:6s} chunked and packed against each document alone: largest error "
        f"{max(PROOF[rule, torch.float32, i] for i in range(3)):.1e} in float32 (3 batches, tolerance 1e-4),\n  "
        f"{PROOF[rule, torch.bfloat16, 0]:.1e} in bfloat16 (tolerance 4e-2)"
    )

# %%
# The layers, convolution included, are proved the same way against their
# plain definition (``reference``, on a float64 copy). It runs each document
# alone through ``F.conv1d``, then token by token. Checked: outputs, states,
# and the gradients of the input and of every parameter.

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
layers = {
    name: cls(S.embed, H, D, key_heads=H // 2, chunk=C).to(DEVICE) for name, cls in LAYERS.items()
}
for name, layer in layers.items():
    wide = copy.deepcopy(layer).double()
    x32, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    got = results(lambda: packed_layer(layer, x32, offsets), [x32, *layer.parameters()])
    want = results(lambda: wide.reference(x64, offsets), [x64, *wide.parameters()])
    assert worst_error(got, want) <= tolerances(torch.float32)["atol"], (
        name,
        worst_error(got, want),
    )
    print(
        f"{name} layer in float32 against its float64 definition: largest error "
        f"{worst_error(got, want):.1e} over {len(want)} tensors"
    )

# %%
# ``tests/test_recurrent.py`` checks more batches, chunk sizes and empty
# documents. It plants four faults, and each one fails it. The faults: the
# entering state reaches a whole chunk, documents start a token late, the
# convolution is not cut, the decay mask is not cut.
#
# The leak
# --------
# The same layers run on the same row without the resets, as one sequence
# of 340 tokens. Each document's output is compared with the document
# alone, over the output's scale.

with torch.no_grad():
    whole_row = offsets_from_lengths([sum(LENGTHS)], DEVICE)  # one "document": no reset
    LEAK = {}
    for name, layer in layers.items():
        alone = [
            layer(x[a:b], offsets_from_lengths([b - a], DEVICE))
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())
        ]
        scale = max(float(o.abs().max()) for o in alone)
        for label, cuts in (("without resets", whole_row), ("with resets", offsets)):
            out = layer(x, cuts)
            LEAK[name, label] = [
                float((out[a:b] - o).abs().max()) / scale
                for o, a, b in zip(alone, offsets[:-1].tolist(), offsets[1:].tolist())
            ]
        assert max(LEAK[name, "with resets"]) < 1e-5 < min(LEAK[name, "without resets"][1:])
        print(
            f"{name}, each document's largest difference from itself alone:\n  without resets "
            + " ".join(f"{d:.0e}" for d in LEAK[name, "without resets"])
            + "\n  with resets    "
            + " ".join(f"{d:.0e}" for d in LEAK[name, "with resets"])
        )

# %%
# The state's norm along the row, for the scalar decay on the proof's
# inputs. With the resets it restarts from the first token's write at every
# document (dashed). Without them each document inherits the previous state.

from ragged_toolkit.recurrent import chunked_recurrence

q, k, v, g = (t.detach() for t in random_inputs(LENGTHS, "scalar")[:4])
every_token = torch.stack(
    [torch.zeros_like(pos), torch.arange(len(pos), device=DEVICE)], 1
)  # (T, 2)
documents = {
    "without resets": (torch.zeros_like(doc), every_token[:, 1]),
    "with resets": (doc, pos),
}
fig, ax = plt.subplots(layout="constrained")
with torch.no_grad():
    for label, (d, p) in documents.items():  # each token's document and position
        _, states = chunked_recurrence(
            q[None], k[None], v[None], g[None], None, d[None], p[None], every_token, C
        )
        ax.plot(states.flatten(2).norm(dim=-1).mean(-1).cpu(), lw=1.5, label=label)  # (T,)
for start in offsets[1:-1].tolist():
    ax.axvline(start - 0.5, color="gray", lw=0.8, ls="--")
ax.set(
    xlabel="token of the packed row",
    ylabel="state norm, mean over heads",
    title="The recurrent state along a packed row of eight documents",
)
ax.legend()
plt.show()

# %%
# The gap in ``transformers``
# ---------------------------
# ``transformers``' Qwen3-Next, tiny, with random weights: three Gated DeltaNet
# layers, then attention. It runs on a packed row of three documents. Each
# document's logits are compared with the document alone. First with
# ``position_ids`` that restart at every document
# (``DataCollatorWithFlattening``'s default), then with ``cu_seq_lens_q/k``.
# Both run with ``use_cache=False``; with the cache, attention mixes the
# documents too. Before 5.9 (by its source) the layers never see
# ``cu_seq_lens_q``: checked.

import textwrap
import transformers
from ragged_toolkit.recurrent_hf import FORWARDS_CU_SEQ_LENS, forwards_cu_seq_lens
from ragged_site.reference import document_differences

# sphinx_gallery_start_ignore
transformers.logging.set_verbosity_error()  # its notes that its reference kernels run
# sphinx_gallery_end_ignore

STOCK = RESET = None  # each document's largest logit difference, stock and with the packed layers
if not forwards_cu_seq_lens():
    print(
        f"transformers {transformers.__version__} keeps cu_seq_lens_q from its Gated DeltaNet layers: "
        f"skipped (it needs {FORWARDS_CU_SEQ_LENS} or later)"
    )
else:
    config = transformers.Qwen3NextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=0,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )
    torch.manual_seed(setup.seed)
    qwen = transformers.Qwen3NextForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(setup.seed)
    docs = [
        torch.randint(0, 256, (n,), generator=gen) for n in (37, 21, 70)
    ]  # the last over a chunk
    STOCK = document_differences(qwen, docs)  # position_ids only
    assert max(STOCK[1:]) > 1e-3, "the stock model kept the documents apart"
    print(
        "position_ids only, each document's largest logit difference from itself alone: "
        + ", ".join(f"{d:.1e}" for d in STOCK)
    )
    try:
        accepted = document_differences(qwen, docs, boundaries=True)
        kept_apart = max(accepted[1:]) <= 1e-3
        verdict = "kept apart" if kept_apart else "still mixed"  # 5.17, for one: ignored silently
        print(
            f"with cu_seq_lens, transformers {transformers.__version__} accepts them, documents "
            f"{verdict}: " + ", ".join(f"{d:.1e}" for d in accepted)
        )
    except ValueError as refusal:  # 5.23, for one: only flash-linear-attention's kernels take them
        print(
            f"with cu_seq_lens, transformers {transformers.__version__} refuses:\n"
            + textwrap.fill(str(refusal), 100, initial_indent="  ", subsequent_indent="  ")
        )

# %%
# The first document has nothing before it. The others read their
# predecessors' state, silently. Where a release accepts the document
# starts, the line above prints how far each document still is from itself
# alone. The toolkit's packed layer, with the same weights, takes the place
# of every Gated DeltaNet layer. It reads ``cu_seq_lens_q``, on any device:
#
# .. literalinclude:: ../ragged_toolkit/recurrent_hf.py
#    :pyobject: PackedGatedDeltaNet

from ragged_toolkit.recurrent_hf import swap_gated_delta_layers
from ragged_site.records import record

if STOCK is not None:
    swapped, n_swapped = swap_gated_delta_layers(copy.deepcopy(qwen), chunk=C)
    RESET = document_differences(swapped, docs, boundaries=True)
    assert n_swapped == 3 and max(RESET) < 1e-5, RESET
    line = (
        f"transformers {transformers.__version__} Qwen3-Next Gated DeltaNet on a packed row: max difference "
        f"from each document alone {max(STOCK):.2e} (stock), {max(RESET):.2e} (with resets)"
    )
    figures = dict(max_difference=max(RESET), stock_max_difference=max(STOCK), tolerance=1e-5)
    print(record("difference", line, label="Qwen3-Next Gated DeltaNet, with resets", **figures))

# each document's error, stock against reset: this page's layers (over the output's scale) and
# Qwen3-Next's logits; errors under 1e-12 (zero included) are drawn at 1e-12
panels = {
    f"{name} layer": (LEAK[name, "without resets"], LEAK[name, "with resets"]) for name in LAYERS
}
if STOCK is not None:
    panels["Qwen3-Next logits"] = (STOCK, RESET)
fig, axes = plt.subplots(1, len(panels), figsize=(10, 4.5), layout="constrained", sharey=True)
for ax, (title, (stock, reset)) in zip(axes, panels.items()):
    at = np.arange(len(stock))
    ax.bar(at - 0.2, np.maximum(stock, 1e-12), 0.4, label="stock (no resets)")
    ax.bar(at + 0.2, np.maximum(reset, 1e-12), 0.4, label="with resets")
    ax.set(yscale="log", title=title, xlabel="document", xticks=at, xticklabels=at + 1)
    draw_floor(ax, 1e-12)
axes[0].set_ylabel("largest difference from the document alone")
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3)
fig.suptitle("Each document of a packed row against the document alone: stock or with resets")
plt.show()

# %%
# Speed
# -----
# ``speed_docs`` documents of Zipf lengths run forward and backward. Timed: the
# token loop on the packed row, the chunked form, and the whole layer packed
# and right-padded. Right padding is the best padded batch. It needs no mask,
# as padding follows every real token and the recurrence is causal. The
# :term:`work bound` is the padded layer's work over the packed one's: the
# speedup to expect if time followed work. The chunked form does the same work
# per token, real or padding. So the work bound is the ratio of token slots,
# ``B x S_max`` over ``T``. The :term:`fraction of the bound` is the measured
# speedup over the bound (:doc:`measuring_ragged_batches`). On CUDA the chunked
# form runs compiled in ``bfloat16``, beside ``flash-linear-attention`` where
# installed.
#
# The token loop is the site's baseline, not library code:
#
# .. literalinclude:: ../ragged_site/reference.py
#    :pyobject: token_loop

from ragged_toolkit.batches import to_padded
from ragged_site.measuring.bound import Work, fraction_verdict, throughput_line, work_bound
from ragged_site.measuring.tables import print_timings
from ragged_site.measuring.timing import measure
from ragged_site.reference import token_loop

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # flash-linear-attention (Triton)
except ImportError:
    chunk_gated_delta_rule = None
    print(
        "flash-linear-attention is not installed: the comparison with its chunk_gated_delta_rule is skipped"
    )
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
    runs = {
        "token loop": lambda: token_loop(*ins[:4], speed_offsets, ins[4]).sum().backward(),
        "chunked": lambda: chunked(*ins[:4], speed_offsets, ins[4], chunk=C)[0].sum().backward(),
        "layer packed": lambda: layer(x, speed_offsets).sum().backward(),
        "layer padded": lambda: layer(x_padded).sum().backward(),
    }
    if chunk_gated_delta_rule is not None and layer.delta:
        runs["fla chunk_gated_delta_rule"] = lambda: (
            chunk_gated_delta_rule(
                *(t[None] for t in ins[:4]), ins[4][None], scale=1.0, cu_seqlens=speed_offsets
            )[0]
            .sum()
            .backward()
        )
    return measure(runs, min_run_time=0.2 if setup.quick else 0.6, rounds=2, profile=False)


SPEED = {name: time_layer(layer) for name, layer in layers.items()}
layer_bound = work_bound(speed_lengths, work=Work(per_token=1.0, per_pair=0.0))
FRACTION = {}
for name, times in SPEED.items():
    print(
        f"{name}, {int(speed_offsets[-1])} tokens in {S.speed_docs} documents, forward and backward:"
    )
    print_timings(times)
    speedup = times["layer padded"].median_ms / times["layer packed"].median_ms
    print(
        throughput_line(
            f"recurrent layer {name}",
            int(speed_offsets[-1]) / times["layer packed"].median_ms * 1e3,
            int(speed_offsets[-1]) / times["layer padded"].median_ms * 1e3,
            layer_bound,
            names=("packed", "padded"),
        )
    )
    FRACTION[f"{name} layer"] = speedup / layer_bound
    print(
        f"the chunked form: {times['token loop'].median_ms / times['chunked'].median_ms:.1f}x the token loop "
        f"(first call{', compiling' if DEVICE == 'cuda' else ''}: {times['chunked'].first_call_s:.1f} s)"
    )
for label, fraction in FRACTION.items():
    print(fraction_verdict(label, fraction))

# %%
# Conclusion
# ----------
# A packed recurrent layer needs two cuts at every document start: the state
# and the convolution. In the chunked form, the cuts are masks. With them each
# document is computed as if alone. Without them documents read their
# neighbors. :doc:`packed_hybrid_model` trains a hybrid model built from these
# layers, packed, and decodes from their state.
#
# References
# ----------
# * Yang et al., `Gated Delta Networks <https://arxiv.org/abs/2412.06464>`_,
#   `the delta rule in parallel <https://arxiv.org/abs/2406.06484>`_ (the WY
#   form), `Gated Linear Attention <https://arxiv.org/abs/2312.06635>`_
# * Dao and Gu, `Mamba-2 <https://arxiv.org/abs/2405.21060>`_;
#   `flash-linear-attention <https://github.com/fla-org/flash-linear-attention>`_
