"""
A multi-head attention layer for ragged batches
===============================================

This page builds the attention layer that every transformer repeats, on
packed values plus offsets. Its input projections are packed into one
matmul, and so are the SwiGLU feed-forward's two. The layer is checked
against ``torch.nn``. Its attention backend is chosen by measurement. Then
it is timed against the best padded layer on the device at hand.

**Author:** rewritten for PyTorch 2.11 and later from the original tutorial by
`Mikayla Gawarecki <https://github.com/mikaylagawarecki>`_

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * A multi-head attention layer that runs packed values with the
         batch's plan, and the same module on a padded batch
       * Packed projections: the query, key and value projections as one
         ``Linear``, SwiGLU's two input matmuls as one, each proved equal to
         the separate form and measured against it
       * Parity with ``nn.MultiheadAttention``, for self- and
         cross-attention, and for sequences with no tokens
       * How to choose the attention backend by measurement, and the
         layer's speed beside the :term:`work bound` that padding sets

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`transformer_building_blocks`: packed values, offsets, the
         batch's plan and ``ragged_attention``
       * PyTorch 2.11 or later; a CPU is enough (a CUDA GPU runs the page at
         the original tutorial's scale, in ``bfloat16``)
"""

# sphinx_gallery_tags = ["toolkit", "SDPA", "torch.nn"]

# %%
# Sizes are set here, once, for the device at hand. ``page_setup`` picks
# them, with the dtype, one CPU thread per operator and the seed.
# :term:`Quick mode <quick mode>`, the test suite's setting, shrinks them.
# The timing helpers (``measure``, ``choose``, the work bound) are explained
# on :doc:`measuring_ragged_batches`.

from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(batch=512, embed=512, heads=8, run_time=1.0),  # the original tutorial's scale
    "cpu": dict(
        batch=64, embed=256, heads=8, run_time=0.3
    ),  # real workloads: batch 512, E 512 and up
    "quick": dict(batch=16, embed=128, run_time=0.1),  # TUTORIALS_QUICK=1
}
setup = page_setup(SIZES, seed=6)  # run_time: seconds per comparison
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
print(f"batch {S.batch}, embedding {S.embed}, heads {S.heads}")

import numpy as np
import torch
from ragged_toolkit.attention import BACKENDS, backend_support, default_backend, plan_batch
from ragged_toolkit.attention.flex import FlexKernel
from ragged_toolkit.batches import from_padded, offsets_from_lengths, to_padded
from ragged_site.page import tolerances
from ragged_site.workloads import ragged_batch, sentence_lengths

DEFAULT = default_backend(DEVICE, DTYPE, head_dim=S.embed // S.heads)
FLEX = FlexKernel()  # the page's compiled FlexAttention, passed to every flex plan
rng = np.random.default_rng(setup.seed)

# %%
# The layer
# ---------
# The layer is short: project, attend, project. For self-attention, the
# three input projections are one ``Linear`` with three times the output
# width. For cross-attention, the queries come from one batch and the keys
# and values from another.
#
# Given packed values and the batch's :term:`plan`, the layer calls
# ``ragged_attention``. (The plan is what ``plan_batch`` reads once from a
# batch's offsets.) Given a padded ``(B, S, E)`` batch and no plan, the
# *same module* runs the padded path: one SDPA call. So the padded baseline
# below differs from the ragged layer in nothing but the padding. With right
# padding, a causal query never sees a padding key. So the causal padded
# path needs no mask and can use a causal kernel.
#
# .. literalinclude:: ../ragged_toolkit/layers.py
#    :pyobject: MultiHeadAttention
#
# ``copy_from_nn`` gives it the weights of an ``nn.MultiheadAttention``, for
# the parity checks below.

import torch.nn as nn
from ragged_toolkit.layers import MultiHeadAttention


@torch.no_grad()
def copy_from_nn(layer, ref):
    """Give ``layer`` the weights of an ``nn.MultiheadAttention``."""
    third = len(ref.in_proj_weight) // 3
    if layer.cross:
        layer.q_proj.weight.copy_(ref.in_proj_weight[:third])
        layer.q_proj.bias.copy_(ref.in_proj_bias[:third])
        layer.kv_proj.weight.copy_(ref.in_proj_weight[third:])
        layer.kv_proj.bias.copy_(ref.in_proj_bias[third:])
    else:
        layer.qkv_proj.weight.copy_(ref.in_proj_weight)
        layer.qkv_proj.bias.copy_(ref.in_proj_bias)
    layer.out_proj.load_state_dict(ref.out_proj.state_dict())
    return layer


# %%
# Causal self-attention against ``nn.MultiheadAttention``
# -------------------------------------------------------
# First correctness. The reference is ``nn.MultiheadAttention`` in float32
# on the padded batch, with a ``key_padding_mask`` and a causal
# ``attn_mask``. The ragged layer gets the same weights, in the page's
# dtype, and the batch's plan on the default backend. (Every backend was
# checked against the reference on :doc:`transformer_building_blocks`.)
# Outputs are compared on the real tokens only: what a padded layer writes
# at padding is garbage by definition.

x, offsets = ragged_batch(rng, S.batch, S.embed, device=DEVICE, dtype=DTYPE)  # (T, E), (B + 1,)
lengths = offsets.diff().cpu()
print(
    f"batch: {len(lengths)} sequences, {len(x)} tokens, longest {int(lengths.max())}; "
    f"padded, {len(lengths) * int(lengths.max())} token slots"
)
torch.manual_seed(setup.seed)
ref_mha = nn.MultiheadAttention(S.embed, S.heads, batch_first=True, device=DEVICE)
mha = copy_from_nn(MultiHeadAttention(S.embed, S.heads, device=DEVICE), ref_mha).to(DTYPE)
x_padded, valid = to_padded(x, offsets)  # (B, S, E), (B, S)
causal_mask = torch.ones(
    x_padded.shape[1], x_padded.shape[1], dtype=torch.bool, device=DEVICE
).triu(1)
with torch.no_grad():
    x32_padded = x_padded.float()
    ref_out = ref_mha(
        x32_padded,
        x32_padded,
        x32_padded,
        key_padding_mask=~valid,
        attn_mask=causal_mask,
        need_weights=False,
    )[0]  # True in the masks: masked
    ragged_out = mha(x, plan_batch(offsets, backend=DEFAULT, is_causal=True))
    torch.testing.assert_close(ragged_out.float(), ref_out[valid], **tolerances(DTYPE))
    padded_out = from_padded(mha(x_padded, is_causal=True), offsets)
    torch.testing.assert_close(padded_out.float(), ref_out[valid], **tolerances(DTYPE))
print("ragged layer and padded path both match nn.MultiheadAttention on every real token")

# %%
# Packed projections
# ------------------
# The layer's three input projections are one ``Linear`` of width ``3 E``:
# one matmul, its output split into queries, keys and values. SwiGLU's two
# input matmuls, the gate's and the up projection's, are one as well, in
# the site's GPT:
#
# .. literalinclude:: ../ragged_toolkit/gpt.py
#    :pyobject: FeedForward
#
# Packing saves no arithmetic: it does the same multiply-adds either way. So
# the :term:`work bound` is one: that is the speedup to expect if time
# followed the work. What packing saves is reads and launches. The separate
# form reads the input once per matmul and launches one kernel each. Packed,
# the input is read once and one larger matmul runs.
#
# Each packed form is first proved equal to the separate one, given the same
# weights. Then both are timed on this page's packed batch. Each result line
# prints the speedup, the bound and the :term:`fraction of the bound`: the
# speedup divided by the bound.

import torch.nn.functional as F
from ragged_site.measuring.noise import outside_noise
from ragged_site.measuring.tables import print_timings
from ragged_site.records import record
from ragged_site.measuring.timing import measure

hidden = 4 * S.embed  # SwiGLU's hidden width
torch.manual_seed(setup.seed)
q_proj, k_proj, v_proj, w1, w3 = (
    nn.Linear(S.embed, width, bias=False, device=DEVICE, dtype=DTYPE)
    for width in (S.embed, S.embed, S.embed, hidden, hidden)
)
qkv_proj = nn.Linear(S.embed, 3 * S.embed, bias=False, device=DEVICE, dtype=DTYPE)
w13 = nn.Linear(S.embed, 2 * hidden, bias=False, device=DEVICE, dtype=DTYPE)
with torch.no_grad():  # the packed weights are the separate ones, stacked
    qkv_proj.weight.copy_(torch.cat([q_proj.weight, k_proj.weight, v_proj.weight]))
    w13.weight.copy_(torch.cat([w1.weight, w3.weight]))


def separate_qkv(x):  # (T, E) -> three (T, E)
    return q_proj(x), k_proj(x), v_proj(x)


def packed_qkv(x):  # (T, E) -> three (T, E), views of one (T, 3 E)
    return qkv_proj(x).chunk(3, dim=-1)


def separate_swiglu_input(x):  # (T, E) -> (T, hidden)
    return F.silu(w1(x)) * w3(x)


def packed_swiglu_input(x):  # (T, E) -> (T, hidden)
    gate, up = w13(x).chunk(2, dim=-1)
    return F.silu(gate) * up


x_proj = ragged_batch(rng, S.batch, S.embed, device=DEVICE, dtype=DTYPE)[0]  # (T, E)
with torch.no_grad():
    for got, want in zip(packed_qkv(x_proj), separate_qkv(x_proj)):
        torch.testing.assert_close(got, want, **tolerances(DTYPE))
    torch.testing.assert_close(
        packed_swiglu_input(x_proj), separate_swiglu_input(x_proj), **tolerances(DTYPE)
    )
print(f"packed and separate projections agree on {len(x_proj)} tokens")
with torch.no_grad():
    projections = measure(
        {
            "QKV, separate": lambda: separate_qkv(x_proj),
            "QKV, packed": lambda: packed_qkv(x_proj),
            "SwiGLU input, separate": lambda: separate_swiglu_input(x_proj),
            "SwiGLU input, packed": lambda: packed_swiglu_input(x_proj),
        },
        min_run_time=S.run_time,
        profile=not setup.quick,
    )
print_timings(projections)
for name, label in (("QKV", "packed QKV projection"), ("SwiGLU input", "packed SwiGLU projection")):
    separate, packed = projections[f"{name}, separate"], projections[f"{name}, packed"]
    speedup = separate.median_ms / packed.median_ms
    line = f"{label}: speedup {speedup:.2f}x, work bound 1.00x, fraction of bound {speedup:.2f}"
    print(record("speedup", line, label=label, speedup=speedup, bound=1.0, fraction=speedup))
    if not outside_noise(separate, packed):
        print(f"  {name}: the two timings' interquartile ranges overlap (within noise)")

# %%
# A fraction above 1 is what the saved reads and launches are worth here.
# Near 1, or below, they are too small to see beside the matmuls at this
# page's sizes. The layer and the site's GPT use the packed form either way:
# one weight to store, and one matmul to launch.

# %%
# Measure, then choose
# --------------------
# Which backend wins depends on the device, the dtype, the lengths and the
# number of cores. So the page measures. ``compare_backends`` runs one job
# on every backend that can take it here:
#
# * it builds each backend's plan;
# * it checks each output against the reference, and for training its
#   gradients too;
# * it times the backends together.
#
# ``choose`` takes the fastest only outside the noise. Otherwise it takes
# ``DEFAULT``, from ``default_backend``, the same on every page.
# :doc:`measuring_ragged_batches` explains the rule.
#
# .. literalinclude:: ../ragged_site/measuring/compare.py
#    :pyobject: compare_backends
#
# The job is the attention of that layer: causal, with ``S.heads`` heads, on
# this page's batch. It runs forward alone (inference), then forward and
# backward (training). Each row ends with the :term:`kernel label`: the
# attention kernel that ran, in brackets. Quick mode skips the profiles that
# find it, so there the rows end without one.

from ragged_site.measuring.compare import compare_backends
from ragged_site.measuring.noise import choose

gen = torch.Generator(DEVICE).manual_seed(setup.seed + 1)
q_a = x.unflatten(
    -1, (S.heads, -1)
)  # queries from the batch; keys and values drawn apart, (T, H, D)
k_a, v_a = (
    torch.randn(x.shape, generator=gen, device=DEVICE).to(DTYPE).unflatten(-1, (S.heads, -1))
    for _ in range(2)
)
job = dict(is_causal=True, flex=FLEX, min_run_time=S.run_time, profile=not setup.quick)
print("forward:")
FORWARD_BACKEND = choose(
    compare_backends(q_a, k_a, v_a, offsets, **job), DEFAULT, "forward backend"
)
print("forward and backward:")
TRAINING_BACKEND = choose(
    compare_backends(q_a, k_a, v_a, offsets, backward=True, **job), DEFAULT, "training backend"
)

# %%
# Then speed: each chosen backend gets a plan, built once. The cell times
# three forward passes on the same batch, and both sides' forward and
# backward:
#
# * **padded**, the baseline: the same module on the padded batch, as in
#   the :term:`padded layout`. It runs with ``is_causal`` (right padding, no
#   mask). It is what a reader writing a padded layer today would write.
# * **ragged**: the module on packed values with the batch's plan, as in the
#   :term:`packed layout`.
# * **original baseline**: :term:`the original tutorial's baseline`,
#   ``nn.MultiheadAttention`` with a ``key_padding_mask`` and a causal
#   ``attn_mask``. It merges them into one ``(B * H, S, S)`` mask, and so
#   computes the whole score square. Its bound counts that square.
#
# Each speedup is printed beside its :term:`work bound`, counted from the
# layer's ``Work`` (``attention_layer_work``). :ref:`The measuring page
# <work-bound>` shows how. The line ends with the
# :term:`fraction of the bound` reached.

from ragged_site.measuring.bound import attention_layer_work, speedup_line, work_bound

ref_mha_lp = ref_mha.to(DTYPE)
grad_out = torch.randn_like(x)
grad_padded = to_padded(grad_out, offsets)[0]
forward_plan = plan_batch(offsets, backend=FORWARD_BACKEND, is_causal=True, flex=FLEX)
training_plan = plan_batch(offsets, backend=TRAINING_BACKEND, is_causal=True, flex=FLEX)
with torch.no_grad():
    forward = measure(
        {
            "padded": lambda: mha(x_padded, is_causal=True),
            "ragged": lambda: mha(x, forward_plan),
            "original baseline": lambda: ref_mha_lp(
                x_padded,
                x_padded,
                x_padded,
                need_weights=False,
                key_padding_mask=~valid,
                attn_mask=causal_mask,
            ),
        },
        min_run_time=S.run_time,
        profile=not setup.quick,
    )
training = measure(
    {
        "padded": lambda: mha(x_padded, is_causal=True).backward(grad_padded),
        "ragged": lambda: mha(x, training_plan).backward(grad_out),
    },
    min_run_time=S.run_time,
    profile=not setup.quick,
)
print_timings(
    {f"forward, {n}": t for n, t in forward.items()}
    | {f"forward and backward, {n}": t for n, t in training.items()}
)
bound = work_bound(lengths, work=attention_layer_work(S.embed), causal=True)
merged = work_bound(lengths, work=attention_layer_work(S.embed), causal=True, padded_causal=False)
print(speedup_line("forward against padded", forward["padded"], forward["ragged"], bound))
print(
    speedup_line(
        "forward against the original's baseline",
        forward["original baseline"],
        forward["ragged"],
        merged,
    )
)
print(
    speedup_line(
        "forward and backward against padded", training["padded"], training["ragged"], bound
    )
)

# %%
# :ref:`The measuring page <fraction-of-the-bound>` explains, once, what
# those fractions say, near 1, below or above it. It also profiles both
# sides of this layer, to show where their time goes.
#
# Cross-attention
# ---------------
# In cross-attention, the queries come from one batch and the keys and
# values from another, as in an encoder-decoder model. Each item has its own
# pair of lengths, so the plan takes both offsets. The padded path needs two
# padded tensors and a mask for the padding keys. Neither side is causal, so
# both compute the whole score rectangle of their batch. The layer's
# ``Work`` counts the keys' and values' projections per context token.

x_q, offsets_q = ragged_batch(rng, S.batch, S.embed, device=DEVICE, dtype=DTYPE)
x_kv, offsets_kv = ragged_batch(rng, S.batch, S.embed, device=DEVICE, dtype=DTYPE)
torch.manual_seed(setup.seed)
ref_cross = nn.MultiheadAttention(S.embed, S.heads, batch_first=True, device=DEVICE)
cross = copy_from_nn(MultiHeadAttention(S.embed, S.heads, cross=True, device=DEVICE), ref_cross).to(
    DTYPE
)
q_padded, q_valid = to_padded(x_q, offsets_q)
kv_padded, kv_valid = to_padded(x_kv, offsets_kv)
with torch.no_grad():
    ref_cross_out = ref_cross(
        q_padded.float(),
        kv_padded.float(),
        kv_padded.float(),
        key_padding_mask=~kv_valid,
        need_weights=False,
    )[0]
    default_plan = plan_batch(offsets_q, offsets_kv, backend=DEFAULT)  # queries' and keys' offsets
    torch.testing.assert_close(
        cross(x_q, default_plan, context=x_kv).float(), ref_cross_out[q_valid], **tolerances(DTYPE)
    )
print("cross-attention matches nn.MultiheadAttention on every real query")
with torch.no_grad():
    cross_backend = choose(
        compare_backends(
            *(t.unflatten(-1, (S.heads, -1)) for t in (x_q, x_kv, x_kv)),
            offsets_q,
            offsets_kv,
            min_run_time=S.run_time / 2,
            profile=not setup.quick,
            flex=FLEX,
        ),
        DEFAULT,
        "cross-attention backend",
    )
    cross_plan = plan_batch(offsets_q, offsets_kv, backend=cross_backend, flex=FLEX)
    cross_times = measure(
        {
            "padded": lambda: cross(q_padded, context=kv_padded, key_valid=kv_valid),
            "ragged": lambda: cross(x_q, cross_plan, context=x_kv),
        },
        min_run_time=S.run_time,
        profile=not setup.quick,
    )
print_timings(cross_times)
cross_bound = work_bound(
    offsets_q.diff().cpu(), offsets_kv.diff().cpu(), work=attention_layer_work(S.embed, cross=True)
)
print(
    speedup_line(
        "cross-attention forward", cross_times["padded"], cross_times["ragged"], cross_bound
    )
)

# %%
# Empty sequences and fully masked rows
# -------------------------------------
# Padded, an empty sequence is a row with every key masked. A softmax over
# no keys has no value. The cell runs the ``torch.nn`` layer in evaluation
# mode and the ragged layer on lengths 5, 0 and 3. The ragged layer runs on
# every backend that runs here:

offsets_empty = offsets_from_lengths([5, 0, 3], DEVICE)
x_empty = torch.randn(8, S.embed, generator=gen, device=DEVICE).to(DTYPE)
x_empty_padded, valid_empty = to_padded(x_empty, offsets_empty)
with torch.no_grad():
    x32_empty = x_empty_padded.float()
    out_nn = ref_mha.float().eval()(
        x32_empty, x32_empty, x32_empty, key_padding_mask=~valid_empty, need_weights=False
    )[0]
    print(
        f"nn.MultiheadAttention, eval: NaN rows per sequence {out_nn.isnan().all(-1).sum(-1).tolist()}"
    )
    for name in BACKENDS:
        if (
            backend_support(name, DEVICE, DTYPE, is_causal=True, head_dim=S.embed // S.heads)
            is None
        ):
            out = mha(x_empty, plan_batch(offsets_empty, backend=name, is_causal=True, flex=FLEX))
            assert out.shape == (8, S.embed) and out.isfinite().all(), name
    print("ragged layer: 8 rows (5 + 0 + 3), all finite, on every backend that runs here")

# %%
# Conclusion
# ----------
# A layer that never pads does only the work the batch needs. The work bound
# says how much that can be worth. Linear layers, norms and residuals run on
# packed values. Attention needs the batch's plan, built once by
# ``plan_batch`` and passed to every ``ragged_attention`` call. The plan's
# backend is the one measured fastest on the device at hand, or the default
# where the measurement cannot tell. Each backend is checked against a
# reference that shares no kernel with it. The other pages build on these
# functions. :doc:`which_attention_path` measures every backend against
# every job. It also covers score modifications such as ALiBi with
# FlexAttention.
#
# **Figures from the original tutorial, not from this build:** it ran on an
# A100 with batch 512 and embedding 512. It reported:
#
# * causal self-attention forward: 5.65x faster;
# * 3.39 GB of peak memory saved;
# * backward: 144x (:doc:`measuring_ragged_batches` shows where that came
#   from);
# * cross-attention forward: 4.01x.
#
# Its numpy generator was not seeded, so its batch and its bound are
# unknown. Below is the bound of its setting for three seeds of this page's
# generator. Its padded layer is counted as it ran: a merged mask, so the
# whole square.

original_bounds = [
    work_bound(
        sentence_lengths(np.random.default_rng(seed), 512),
        work=attention_layer_work(512),
        causal=True,
        padded_causal=False,
    )
    for seed in (0, 1, 2)
]
print(
    "work bound of the original's setting, seeds 0, 1, 2: "
    + ", ".join(f"{b:.2f}x" for b in original_bounds)
)

# %%
# Further reading
# ---------------
# * `torch.nested documentation <https://docs.pytorch.org/docs/stable/nested.html>`_
# * `varlen_attn <https://docs.pytorch.org/docs/stable/nn.attention.varlen.html>`_
# * The `scaled dot product attention tutorial
#   <https://docs.pytorch.org/tutorials/intermediate/scaled_dot_product_attention_tutorial.html>`_
# * The `FlexAttention blog post <https://pytorch.org/blog/flexattention/>`_ and
#   `attention-gym <https://github.com/meta-pytorch/attention-gym>`_
# * `Packing with FlashAttention 2 in Hugging Face transformers
#   <https://huggingface.co/blog/packing-with-FA2>`_
# * `gpt-fast <https://github.com/meta-pytorch/gpt-fast>`_ and
#   `nanoGPT <https://github.com/karpathy/nanoGPT>`_
