"""
Transformer building blocks for ragged batches
==============================================

This page stores a batch of sequences of different lengths without padding,
as packed values plus offsets. One attention function runs over it, through
six backends. The page shows the code of each backend and checks each one
against a float32 reference.

**Author:** rewritten for PyTorch 2.11 and later from the original tutorial by
`Mikayla Gawarecki <https://github.com/mikaylagawarecki>`_

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How packed values plus offsets describe a ragged batch, and how they
         map to ``cu_seqlens`` and to Hugging Face's ``position_ids``
       * The batch's plan (``plan_batch``): built once per batch, held by
         the caller and passed to every ``ragged_attention`` call, as
         FlexAttention's ``create_block_mask`` is used
       * The code of each of ``ragged_attention``'s six backends (a loop,
         padding, buckets, FlexAttention with a document mask,
         ``varlen_attn``, nested tensors), each checked against a float32
         reference

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.11 or later; a CPU is enough (a CUDA GPU runs the page at
         the original's scale, in ``bfloat16``)
       * The terms of the :ref:`glossary <glossary>`; the functions used here
         are listed on :doc:`the toolkit's reference page </toolkit>`
"""

# sphinx_gallery_tags = ["toolkit", "SDPA", "FlexAttention", "varlen attention"]

# %%
# The idea in one picture
# -----------------------
# A padded batch stores ``B`` sequences as a ``(B, S)`` rectangle, with ``S``
# the longest length. A mask says which slots are real. A model that reads
# its batch this way uses the :term:`padded layout`.
#
# A packed batch stores the same tokens end to end, in two tensors:
#
# * **values** ``(T, ...)``, with ``T`` the number of real tokens;
# * **offsets** ``(B + 1,)``: where each sequence starts, and where the last
#   one ends.
#
# A model that reads its batch this way uses the :term:`packed layout`. The
# picture draws both for one small batch.

import matplotlib.pyplot as plt
from ragged_site.figures import FIGURE_STYLE, draw_batch

plt.rcParams.update(FIGURE_STYLE)
draw_batch([5, 2, 7, 3])
plt.show()

# %%
# Everything in a transformer but attention works on one token at a time:
# linear layers, norms, activations, residuals. So these run on the values as
# one long sequence, with no padding and no mask. Only attention needs the
# offsets, to keep sequences apart. The two tensors go by other names:
#
# * FlashAttention and ``torch.nn.attention.varlen.varlen_attn`` call the
#   offsets ``cu_seqlens`` (cumulative sequence lengths, as ``int32``);
# * a jagged nested tensor (``torch.nested`` with ``layout=torch.jagged``) is
#   values plus offsets, with ``values()`` and ``offsets()`` to reach them;
# * Hugging Face's ``DataCollatorWithFlattening`` writes one row of
#   ``input_ids`` whose ``position_ids`` restart at 0 at every sequence: the
#   offsets are where ``position_ids == 0``, plus ``T``.
#
# PyTorch's documentation says nested tensors are not under active
# development. FlexAttention no longer accepts them
# (`PyTorch issue 161734 <https://github.com/pytorch/pytorch/issues/161734>`_).
# The maintainers point ragged attention at packed sequences. So the
# interface here is the plain pair of tensors. A nested tensor appears only
# as one attention backend among six.
#
# Every function this page explains comes from the site's toolkit, the
# package ``ragged_toolkit``. The page shows each function's code where it
# explains it. The pictures are drawn by ``ragged_site.figures``.
#
# Sizes are set here, once, for the device at hand. ``page_setup`` picks
# them, with the dtype, one CPU thread per operator and the seed. The
# ``quick`` sizes are for :term:`quick mode`, where the test suite runs the
# page in seconds.

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
ZIPF_ALPHA = 1.2  # the original's exponent
print(f"batch {S.batch}, embedding {S.embed}, heads {S.heads}")

# %%
# Offsets, positions and padding
# ------------------------------
# Offsets come from lengths with one cumulative sum (``offsets_from_lengths``).
# ``token_index`` gives every packed token its sequence and its position in
# it. That is all a layer needs to build positions, such as those of rotary
# embeddings, which restart at every sequence. It is also all a layer needs
# to pad the batch where a padded tensor is needed.
#
# .. literalinclude:: ../ragged_toolkit/batches.py
#    :pyobject: offsets_from_lengths
#
# .. literalinclude:: ../ragged_toolkit/batches.py
#    :pyobject: token_index
#
# .. literalinclude:: ../ragged_toolkit/batches.py
#    :pyobject: to_padded
#
# On a batch of three, the positions from ``token_index`` are the
# ``position_ids`` that Hugging Face's collator writes. They give the offsets
# back. The batches of this page come from the site's length generator,
# ``sentence_lengths``. It draws Zipf-distributed words, and a sentence ends
# at its first full stop. :doc:`measuring_ragged_batches` checks it.

import numpy as np
import torch
from ragged_toolkit.batches import (
    from_padded,
    offsets_from_lengths,
    offsets_from_position_ids,
    to_padded,
    token_index,
)
from ragged_site.workloads import ragged_batch

offsets = offsets_from_lengths([3, 1, 4])
seq, position_ids = token_index(offsets)
print("offsets (cu_seqlens):  ", offsets.tolist())
print("sequence of each token:", seq.tolist())
print("position_ids:          ", position_ids.tolist())
assert torch.equal(offsets_from_position_ids(position_ids[None]), offsets)

rng = np.random.default_rng(setup.seed)
values, offsets = ragged_batch(rng, 5, 4)
padded, valid = to_padded(values, offsets)
assert torch.equal(from_padded(padded, offsets), values)
print(
    f"lengths {offsets.diff().tolist()}: values {tuple(values.shape)}, "
    f"padded {tuple(padded.shape)}, {1 - len(values) / valid.numel():.0%} padding"
)

# %%
# One attention function
# ----------------------
# ``ragged_attention`` takes packed queries ``(T_q, H, D)``, and keys and
# values ``(T_kv, H_kv, D)``. Sequence ``i`` of the queries attends only to
# sequence ``i`` of the keys. ``H_kv`` may be smaller than ``H``
# (grouped-query attention). With ``is_causal``, a query sees the keys up to
# its own position. A sequence may have more keys than queries, as when
# decoding against a cache. Then the queries are the *last* ones, as in
# FlashAttention. ``kv_used`` says how many of a sequence's key rows are
# filled, for a cache with spare room (``seqused_k`` in ``varlen_attn``).
#
# The picture shows what causal attention scores on a packed batch: a
# triangle per sequence on the diagonal. Beside it is what a padded batch
# scores:

from ragged_site.figures import draw_scores

draw_scores([5, 2, 7, 3])
plt.show()

# %%
# Plan once, attend in every layer
# --------------------------------
# Attention needs more than the tensors. It needs each sequence's lengths
# as Python integers, to split the batch or to size a padded block or a
# kernel. It also needs whatever its backend builds for the batch: gather
# indices, a padding mask, FlexAttention's block mask. Reading lengths from
# offsets on a GPU copies them to the host. Building a mask runs kernels.
#
# Both depend on the batch, not on the layer. So they happen once per batch,
# in a call the caller makes and sees. That call is ``plan_batch``:
#
# * it checks the offsets;
# * it reads the lengths;
# * it builds what the chosen backend needs;
# * it returns the batch's ``BatchPlan``.
#
# The batch's :term:`plan` is what its attention needs, read from its
# offsets once. The caller holds the plan. It passes the plan to every
# attention call of the batch: every layer, forward and backward.
# FlexAttention works the same way: ``create_block_mask`` is built once and
# passed to every ``flex_attention`` call. Nothing is cached behind the
# caller's back.
#
# .. literalinclude:: ../ragged_toolkit/attention/plan.py
#    :pyobject: plan_batch
#
# .. literalinclude:: ../ragged_toolkit/attention/plan.py
#    :pyobject: BatchPlan
#
# A plan is built for one backend, so ``backend`` has no default in
# ``plan_batch``. Where a caller has measured nothing, ``default_backend``
# gives the documented choice. It depends on the device, the dtype and the
# head size, since the CUDA kernels limit the head size.
# :doc:`packed_attention_layer` measures the backends, and keeps this
# default wherever the measurement cannot tell.
#
# .. literalinclude:: ../ragged_toolkit/attention/__init__.py
#    :pyobject: default_backend
#
# The call itself checks the tensors against the plan. It checks that the
# backend can run the job here, and hands the job over. Given a plan, it
# reads nothing back from the device. So a compiled model that takes the
# plan compiles attention into its graph. The plan sets aside sequences
# with no queries or no keys in use, such as an empty prompt or a filtered
# document. Their queries get zeros, so no NaN appears.
#
# .. literalinclude:: ../ragged_toolkit/attention/__init__.py
#    :pyobject: ragged_attention
#
# One plan, two layers' attention on it, and a plan of another batch
# refused:

from ragged_toolkit.attention import default_backend, plan_batch, ragged_attention

DEFAULT = default_backend(DEVICE, DTYPE, head_dim=S.embed // S.heads)
small = offsets_from_lengths([5, 2, 7, 3], DEVICE)
plan = plan_batch(small, backend=DEFAULT, is_causal=True)  # once per batch
gen = torch.Generator(DEVICE).manual_seed(setup.seed)
q1, k1, v1, q2, k2, v2 = (
    torch.randn(17, 2, 16, generator=gen, device=DEVICE, dtype=DTYPE) for _ in range(6)
)
out1, out2 = ragged_attention(q1, k1, v1, plan), ragged_attention(q2, k2, v2, plan)  # every layer
print(
    f"default backend here: {DEFAULT}; the plan: {plan.backend}, lengths {plan.q_lengths}, "
    f"{plan.n_q} rows, longest {plan.max_q}"
)
try:
    ragged_attention(q1[:10], k1[:10], v1[:10], plan)
except ValueError as err:
    print(f"a plan of another batch:\n  {err}")

# %%
# Six backends, six ways to compute it
# ------------------------------------
# Every backend takes the packed tensors and the plan. The **loop** makes
# one dense SDPA call per sequence, on views of the packed tensors. It does
# exactly the real work, pays one call per sequence, and has a backward on
# every device.
#
# .. literalinclude:: ../ragged_toolkit/attention/loop.py
#    :pyobject: loop_backend
#
# **Padding** pads every sequence to the longest inside the call: one SDPA
# call over a rectangle, the work of ``B x S`` tokens. A KV cache with the
# same room for every sequence already is a rectangle, read in place.
#
# .. literalinclude:: ../ragged_toolkit/attention/padded.py
#    :pyobject: padded_backend
#
# **Buckets** sort the sequences by length and cut them into a few groups.
# Each group is padded to its own longest: a few calls, a little padding.
# For buckets, the plan holds the index of every slot of every group. The
# call gathers each group, attends, and scatters the real rows back:
#
# .. literalinclude:: ../ragged_toolkit/attention/padded.py
#    :pyobject: _bucket_plan
#
# .. literalinclude:: ../ragged_toolkit/attention/padded.py
#    :pyobject: _attend_in_groups
#
# **FlexAttention** sees the whole batch as one long sequence, with a
# *document mask* built from the offsets. In that mask, a query sees the
# keys of its own sequence. ``create_block_mask`` evaluates the mask block by
# block (128 x 128) and lists the blocks to compute. The kernel skips the
# others. The batch is padded to one of a few lengths (``flex_rows``), which
# keeps the number of compiled kernels small. The padding rows form a
# sequence of their own. The mask is what a ``flex`` plan holds:
#
# .. literalinclude:: ../ragged_toolkit/attention/flex.py
#    :pyobject: document_block_mask
#
# .. literalinclude:: ../ragged_toolkit/attention/flex.py
#    :pyobject: flex_backend
#
# The compiled kernel is the caller's. ``FlexKernel`` compiles
# ``flex_attention`` once per configuration and padded size, and the plan
# carries it. Past its ``max_graphs`` a call fails, naming the cause. It
# never falls back to the unfused kernel, which materializes every score.
# The mask of a batch of this page's size, block by block:

from ragged_site.workloads import sentence_lengths
from ragged_site.figures import draw_block_mask
from ragged_toolkit.attention.flex import FlexKernel

FLEX = FlexKernel()  # the page's compiled FlexAttention, passed to every plan

lengths = sentence_lengths(np.random.default_rng(setup.seed), S.batch, ZIPF_ALPHA)
flex_plan = plan_batch(offsets_from_lengths(lengths), backend="flex", is_causal=True, flex=FLEX)
fig, skipped = draw_block_mask(flex_plan.prepared)
plt.show()
print(f"{S.batch} sequences, {int(lengths.sum())} tokens: {skipped:.0%} of the blocks skipped")

# %%
# **varlen_attn** is the variable-length kernel of FlashAttention. It takes
# the offsets as ``int32`` ``cu_seq_q`` and ``cu_seq_k``, plus the longest
# lengths, and makes one call for the batch. CUDA only, in ``float16`` or
# ``bfloat16``. Its keyword arguments changed between releases: causal as a
# flag, then as a window; ``enable_gqa`` and ``seqused_k`` later. So the
# toolkit reads them from its signature.
#
# .. literalinclude:: ../ragged_toolkit/attention/varlen.py
#    :pyobject: varlen_backend
#
# **Nested tensors** are the same values and offsets, seen as a
# ``(B, H, j, D)`` tensor with a ragged dimension. SDPA takes them. On CUDA,
# SDPA reaches fused variable-length kernels with them. On CPU only the math
# path takes them, and it refuses ``is_causal``.
#
# .. literalinclude:: ../ragged_toolkit/attention/njt.py
#    :pyobject: _as_nested
#
# .. literalinclude:: ../ragged_toolkit/attention/njt.py
#    :pyobject: sdpa_njt_backend
#
# ``backend_support`` answers which backends can run a job here. A backend
# it allows that then fails is an error, never a silent fallback.
#
# Every backend is checked against ``reference_attention``. It runs
# sequence by sequence, in float32, on SDPA's math backend. It repeats the
# key/value heads and builds the causal mask explicitly. So it shares no
# kernel with the backends. Here it checks every backend, each with its own
# plan, in this page's dtype. The batch has lengths 5, 0, 3 and 7, so one
# sequence is empty. Attention is causal, with four query heads sharing two
# key/value heads:
#
# .. literalinclude:: ../ragged_toolkit/attention/__init__.py
#    :pyobject: backend_support
#
# .. literalinclude:: ../ragged_site/reference.py
#    :pyobject: reference_attention

from ragged_toolkit.attention import BACKENDS, backend_support
from ragged_site.reference import reference_attention
from ragged_site.page import tolerances

offsets_e = offsets_from_lengths([5, 0, 3, 7], DEVICE)
q_e = torch.randn(15, 4, 16, generator=gen, device=DEVICE, dtype=DTYPE)  # (T, H, D)
k_e, v_e = (torch.randn(15, 2, 16, generator=gen, device=DEVICE, dtype=DTYPE) for _ in range(2))
reference_e = reference_attention(q_e, k_e, v_e, offsets_e, is_causal=True)
for name in BACKENDS:
    why = backend_support(name, DEVICE, DTYPE, is_causal=True, gqa=True, head_dim=16)
    if why:
        print(f"{name:9s} not available: {why}")
        continue
    with torch.no_grad():
        out_e = ragged_attention(
            q_e, k_e, v_e, plan_batch(offsets_e, backend=name, is_causal=True, flex=FLEX)
        )
    assert out_e.isfinite().all(), f"{name} returned NaN or inf"
    torch.testing.assert_close(out_e.float(), reference_e, **tolerances(DTYPE))
    gap = (out_e.float() - reference_e).abs().max().item()
    print(f"{name:9s} matches the reference, max |difference| {gap:.1e}")

# %%
# Bad offsets get an error that names the problem. ``plan_batch`` raises it
# where the offsets cannot describe a batch. ``ragged_attention`` raises it
# where they describe another batch than its tensors:

for bad in ([0, 5, 5, 8, 16], [1, 5, 5, 8, 15], [0, 5, 3, 8, 15]):
    try:
        ragged_attention(
            q_e, k_e, v_e, plan_batch(torch.tensor(bad, device=DEVICE), offsets_e, backend=DEFAULT)
        )
    except ValueError as err:
        print(f"offsets {bad}:\n  {err}")
    else:
        raise AssertionError(f"offsets {bad} were accepted")

# %%
# Conclusion
# ----------
# Linear layers, norms and residuals run on packed values as one long
# sequence. Only attention needs the offsets. The batch's plan is built once
# by ``plan_batch`` and passed to every ``ragged_attention`` call. Each
# backend was checked against a reference that shares no kernel with it.
# :doc:`packed_attention_layer` builds a multi-head attention layer on these
# functions and measures it. :doc:`which_attention_path` measures every
# backend against every job.

# sphinx_gallery_thumbnail_number = 3

# %%
# Further reading
# ---------------
# * `torch.nested documentation <https://docs.pytorch.org/docs/stable/nested.html>`_
# * `varlen_attn <https://docs.pytorch.org/docs/stable/nn.attention.varlen.html>`_
# * The `FlexAttention blog post <https://pytorch.org/blog/flexattention/>`_ and
#   `attention-gym <https://github.com/meta-pytorch/attention-gym>`_
# * `Packing with FlashAttention 2 in Hugging Face transformers
#   <https://huggingface.co/blog/packing-with-FA2>`_
