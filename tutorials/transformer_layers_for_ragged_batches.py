"""
Transformer layers for ragged batches, in parity with ``torch.nn``
==================================================================

Every layer of the ``nn.Transformer`` family, written for packed values
plus offsets. Each one is proven equal to ``torch.nn``, output for output
and gradient for gradient.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How to write the ``nn.Transformer`` family for a packed batch and
         its plan, with no padding mask
       * How to load ``torch.nn``'s weights into it by name
       * How to prove that it computes what ``torch.nn`` computes: every
         output at a real token, every gradient

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`packed_attention_layer`: the ``MultiHeadAttention`` layer,
         ``plan_batch`` and ``ragged_attention``
       * PyTorch 2.11 or later; a CPU is enough
"""

# sphinx_gallery_tags = ["nn.Transformer", "parity"]

# %%
# Sizes
# -----
# The proofs run small models in float32 on every device. On CUDA the
# width doubles, so that each head has the 16 dimensions that FlexAttention
# needs there. The next page,
# :doc:`ragged_transformer_training`, measures and trains at full size.

from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(embed=64, heads=4, dim_ff=128, batch=6, max_len=40),
    "cpu": dict(embed=32, heads=4, dim_ff=64, batch=6, max_len=40),
}
setup = page_setup(SIZES)  # device, dtype, quick mode, one CPU thread, the seed; prints them
DEVICE, S = setup.device, setup.sizes

# %%
# Plans instead of masks
# ----------------------
# ``torch.nn``'s layers take a padded ``(B, S, E)`` batch. Each attention
# gets a padding mask. Ours take packed values ``(T, E)`` and the batch's
# :term:`plan`. A plan is what ``plan_batch`` builds once per batch: the
# offsets read once, the backend, causal or not.
#
# Everything but attention works token by token, so it needs no change.
# Attention is the toolkit's ``MultiHeadAttention``. It keeps the sequences
# apart with the plan. The rest follows ``torch.nn`` line for line: the
# same names (weights load by name), defaults and options.
#
# .. literalinclude:: ../ragged_toolkit/layers.py
#    :pyobject: TransformerEncoderLayer
#
# The decoder layer adds cross-attention to the encoder's output, the
# ``memory``. Cross-attention has a plan of its own: queries from the
# targets, keys from the sources.
#
# .. literalinclude:: ../ragged_toolkit/layers.py
#    :pyobject: TransformerDecoderLayer

import torch
import torch.nn as nn
from ragged_toolkit.layers import (
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
    plan_transformer,
)

# %%
# The stacks and the full transformer
# -----------------------------------
# A stack repeats a layer ``num_layers`` times and applies an optional final
# norm. The encoder and the decoder share that loop.
#
# .. literalinclude:: ../ragged_toolkit/layers.py
#    :pyobject: TransformerEncoder
#
# ``Transformer`` wires the two stacks, each with a final layer norm. It
# initializes every matrix as ``nn.Transformer`` does (Xavier-uniform).
#
# .. literalinclude:: ../ragged_toolkit/layers.py
#    :pyobject: Transformer
#
# It takes a batch's three plans, one per job. ``plan_transformer`` builds
# them, each on its own backend.
#
# .. literalinclude:: ../ragged_toolkit/layers.py
#    :pyobject: plan_transformer
#
# Three of ``nn.Transformer``'s arguments are gone: the
# ``*_key_padding_mask`` ones. A causal mask becomes ``is_causal=True`` in
# the decoder's plan. Dropout acts where ``torch.nn``'s does, with one
# exception: not on attention weights. ``varlen_attn`` and FlexAttention
# have no argument for it.

# %%
# Proof of parity with ``torch.nn``
# ---------------------------------
# The proof has three steps for each layer and stack:
#
# * copy the ``torch.nn`` module's weights into ours
#   (``from_nn_names``: ``in_proj_weight`` is our ``qkv_proj``, or
#   ``q_proj`` and ``kv_proj``);
# * run ``torch.nn`` on the padded batch with its masks, and ours on the
#   packed batch;
# * compare the outputs at every real token, and every gradient.
#
# A mismatch stops the page. The proofs run with dropout 0, in float32, on
# the loop backend (it runs float32 everywhere). ``torch.nn``'s "fast path"
# is off.
#
# .. literalinclude:: ../ragged_site/nn_reference.py
#    :pyobject: from_nn_names

import numpy as np
from ragged_toolkit.attention import plan_batch
from ragged_toolkit.batches import from_padded, to_padded
from ragged_site.workloads import ragged_batch
from ragged_site.nn_reference import (
    nn_causal_mask,
    from_nn_names,
    load_from_nn,
    make_nn_transformer,
    nn_transformer,
)
from ragged_site.page import tolerances

torch.backends.mha.set_fastpath_enabled(False)


# %%
# The ``torch.nn`` side runs on padded tensors. ``make_nn_transformer``
# builds ``nn.Transformer`` batch first; ``nn_transformer`` calls it with
# every mask it needs. ``CALLS`` pairs each kind with the two ways to call
# it, and ``check_parity`` runs both and compares them.
#
# .. literalinclude:: ../ragged_site/nn_reference.py
#    :pyobject: nn_transformer

CALLS = {  # kind -> (torch.nn on padded tensors, ours on packed tensors and their offsets)
    "Encoder": (
        lambda m, x, valid, mem, mem_valid: m(x, src_key_padding_mask=~valid),
        lambda m, x, off, mem, mem_off: m(x, plan_batch(off, backend="loop")),
    ),
    "Decoder": (
        lambda m, x, valid, mem, mem_valid: m(
            x,
            mem,
            tgt_mask=nn_causal_mask(x.shape[1], x.device),
            tgt_is_causal=True,
            tgt_key_padding_mask=~valid,
            memory_key_padding_mask=~mem_valid,
        ),
        lambda m, x, off, mem, mem_off: m(
            x,
            plan_batch(off, backend="loop", is_causal=True),
            mem,
            plan_batch(off, mem_off, backend="loop"),
        ),
    ),
    "Transformer": (
        nn_transformer,
        lambda m, x, off, mem, mem_off: m(mem, x, plan_transformer(mem_off, off)),
    ),
}


def check_parity(name, reference, ragged, x, x_off, mem, mem_off):
    """Outputs at real tokens and every gradient, ours against torch.nn."""
    run_nn, run_ragged = CALLS[name.removesuffix("Layer")]
    reference, ragged = reference.to(DEVICE), load_from_nn(ragged, reference).to(DEVICE)
    out_nn = from_padded(run_nn(reference, *to_padded(x, x_off), *to_padded(mem, mem_off)), x_off)
    out_rg = run_ragged(ragged, x, x_off, mem, mem_off)
    cotangent = torch.randn_like(out_rg)  # a random weighting of the outputs
    for out in (out_nn, out_rg):
        (out * cotangent).sum().backward()
    torch.testing.assert_close(out_rg, out_nn, **tolerances(torch.float32))
    grads_nn = from_nn_names({n: p.grad for n, p in reference.named_parameters()})
    grads_rg = {n: p.grad for n, p in ragged.named_parameters()}
    assert grads_nn.keys() == grads_rg.keys()
    for n in grads_rg:
        torch.testing.assert_close(
            grads_rg[n],
            grads_nn[n],
            **tolerances(torch.float32),
            msg=lambda m, n=n: f"{name} {n}: {m}",
        )
    grad_err = max((grads_rg[n] - grads_nn[n]).abs().max().item() for n in grads_rg)
    print(
        f"  {name:12s} output {(out_rg - out_nn).abs().max().item():.1e}, gradients {grad_err:.1e} "
        f"({len(grads_rg)} tensors)"
    )


# %%
# Every layer and stack (two layers, a final norm), in both ``norm_first``
# settings, with ReLU and biases, then GELU and no biases; small sizes.

E, NHEAD, FF = S.embed, S.heads, S.dim_ff  # width, heads, feed-forward width
FAMILY = {  # kind -> torch.nn's layer and stack, then ours
    "Encoder": (
        nn.TransformerEncoderLayer,
        nn.TransformerEncoder,
        TransformerEncoderLayer,
        TransformerEncoder,
    ),
    "Decoder": (
        nn.TransformerDecoderLayer,
        nn.TransformerDecoder,
        TransformerDecoderLayer,
        TransformerDecoder,
    ),
}
rng = np.random.default_rng(setup.seed)
x, x_off = ragged_batch(rng, S.batch, E, max_len=S.max_len, device=DEVICE)
mem, m_off = ragged_batch(rng, S.batch, E, max_len=S.max_len, device=DEVICE)
print("target lengths", x_off.diff().tolist(), "memory lengths", m_off.diff().tolist())

for norm_first in (False, True):
    for activation, bias in (("relu", True), ("gelu", False)):
        kw = dict(
            dim_feedforward=FF, dropout=0.0, activation=activation, norm_first=norm_first, bias=bias
        )
        print(f"norm_first={norm_first}, {activation}, bias={bias}:")
        cases = {}  # name -> (torch.nn module, ours), all built before any runs
        for kind, (nn_layer, nn_stack, layer, stack) in FAMILY.items():
            ref, ours = nn_layer(E, NHEAD, batch_first=True, **kw), layer(E, NHEAD, **kw)
            nested = {"enable_nested_tensor": False} if kind == "Encoder" else {}
            cases[f"{kind}Layer"] = ref, ours
            cases[kind] = (
                nn_stack(ref, 2, nn.LayerNorm(E, bias=bias), **nested),
                stack(ours, 2, nn.LayerNorm(E, bias=bias)),
            )
        cases["Transformer"] = (
            make_nn_transformer(E, NHEAD, 2, 2, **kw),
            Transformer(E, NHEAD, 2, 2, **kw),
        )
        for name, (reference, ragged) in cases.items():
            check_parity(name, reference, ragged, x, x_off, mem, m_off)

# %%
# Dropout runs in training mode only: with ``dropout=0.3`` our transformer in
# eval mode must match ``torch.nn``'s, and in training mode two calls must differ.

kw = dict(dim_feedforward=FF, dropout=0.3)
ragged = Transformer(E, NHEAD, 2, 2, **kw).eval()
check_parity(
    "Transformer", make_nn_transformer(E, NHEAD, 2, 2, **kw).eval(), ragged, x, x_off, mem, m_off
)
plans = plan_transformer(m_off, x_off)
assert not torch.allclose(ragged.train()(mem, x, plans), ragged(mem, x, plans)), (
    "dropout must act in training"
)
print("dropout 0.3: in eval mode as nn.Transformer, in training mode at work")

# %%
# Conclusion
# ----------
# With packed values and a plan, the ``nn.Transformer`` family fits in a
# few dozen lines. No padding mask is left. It loads ``torch.nn``'s weights
# by name. It matches ``torch.nn`` output for output and gradient for
# gradient, in both ``norm_first`` settings, with and without biases.
#
# The next page, :doc:`ragged_transformer_training`, measures it against
# padded ``nn.Transformer`` and trains both on a task.
#
# References
# ----------
# * `nn.Transformer <https://pytorch.org/docs/stable/generated/torch.nn.Transformer.html>`_
# * Vaswani et al., `Attention Is All You Need <https://arxiv.org/abs/1706.03762>`_
# * Xiong et al., `On Layer Normalization in the Transformer Architecture
#   <https://arxiv.org/abs/2002.04745>`_ (``norm_first``)
