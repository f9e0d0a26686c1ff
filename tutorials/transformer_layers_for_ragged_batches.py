"""
Transformer layers for ragged batches, in parity with ``torch.nn``
==================================================================

Every layer of the ``nn.Transformer`` family on packed values plus offsets:
proven equal to ``torch.nn``, measured against it, trained end to end.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How to write the ``nn.Transformer`` family for a packed batch and
         its plan instead of padding masks, and prove, output for output
         and gradient for gradient, that it computes what ``torch.nn`` does
       * What skipping the padding buys a whole model, beside the
         :term:`work bound`, and that it learns a task as the padded one
         does, ending within a stated tolerance of it

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`packed_attention_layer`: the ``MultiHeadAttention`` layer,
         ``plan_batch`` and ``ragged_attention``
       * PyTorch 2.11 or later; a CPU is enough
"""

# sphinx_gallery_tags = ["nn.Transformer", "parity", "training", "benchmarks"]

# %%
# Sizes
# -----
# ``bench`` for the measurements, ``train`` for training (on CUDA,
# ``nn.Transformer``'s defaults with fewer layers), ``max_len`` the context.

from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(bench=dict(batch=256, d_model=512, nhead=8, dim_ff=2048, layers=6),
                 train=dict(batch=128, d_model=256, nhead=8, dim_ff=1024, layers=3, steps=600),
                 max_len=128, run_time=1.0, lr=1e-3),  # run_time: seconds of timed runs per comparison
    "cpu": dict(bench=dict(batch=48, d_model=128, nhead=4, dim_ff=512, layers=2),
                train=dict(batch=32, d_model=128, nhead=4, dim_ff=512, layers=2, steps=100),
                max_len=128, run_time=0.3, lr=3e-3),
    "quick": dict(bench=dict(batch=16, d_model=64, nhead=4, dim_ff=128, layers=1),
                  train=dict(batch=16, steps=120), max_len=32, run_time=0.1),
}
setup = page_setup(SIZES)  # device, dtype, quick mode, one CPU thread, the seed; prints them
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes

# %%
# Plans instead of masks
# ----------------------
# ``torch.nn``'s layers take a padded ``(B, S, E)`` batch and a padding mask
# per attention; ours, packed values ``(T, E)`` and the batch's plan
# (``plan_batch``: the offsets read once, the backend, causal or not). All
# but attention works token by token; attention, the toolkit's
# ``MultiHeadAttention``, keeps the sequences apart with the plan. The rest
# follows ``torch.nn`` line for line: names (weights load by name),
# defaults and options. The decoder layer adds cross-attention to the
# encoder's output, the ``memory``, with a plan of its own.

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from ragged_toolkit.layers import MultiHeadAttention


class TransformerEncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` on a packed batch: x (T, E) and its plan."""

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1,
                 activation="relu", layer_norm_eps=1e-5, norm_first=False, bias=True):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, nhead, bias=bias)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)  # inside the feed-forward block
        self.dropout1 = nn.Dropout(dropout)  # after attention
        self.dropout2 = nn.Dropout(dropout)  # after the feed-forward block
        self.activation = {"relu": F.relu, "gelu": F.gelu}[activation]
        self.norm_first = norm_first

    def _residual(self, x, norm, sublayer):  # pre-norm or post-norm, as torch.nn
        return x + sublayer(norm(x)) if self.norm_first else norm(x + sublayer(x))

    def _ff(self, x, dropout):
        return dropout(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, x, plan):  # (T, E) -> (T, E); the plan says whether it is causal
        x = self._residual(x, self.norm1, lambda h: self.dropout1(self.self_attn(h, plan)))
        return self._residual(x, self.norm2, lambda h: self._ff(h, self.dropout2))


class TransformerDecoderLayer(TransformerEncoderLayer):
    """``nn.TransformerDecoderLayer``: self-, then cross-attention to ``memory`` (T_src, E)."""

    def __init__(self, d_model, nhead, *args, **kwargs):  # the encoder layer's
        super().__init__(d_model, nhead, *args, **kwargs)
        bias = self.norm1.bias is not None
        self.multihead_attn = MultiHeadAttention(d_model, nhead, cross=True, bias=bias)
        self.norm3 = nn.LayerNorm(d_model, eps=self.norm1.eps, bias=bias)
        self.dropout3 = nn.Dropout(self.dropout1.p)  # dropout2: after cross-attention

    def forward(self, x, plan, memory, memory_plan):
        x = self._residual(x, self.norm1, lambda h: self.dropout1(self.self_attn(h, plan)))
        x = self._residual(x, self.norm2, lambda h: self.dropout2(self.multihead_attn(
            h, memory_plan, context=memory)))
        return self._residual(x, self.norm3, lambda h: self._ff(h, self.dropout3))


# %%
# The stacks and the full transformer
# -----------------------------------
# A stack repeats a layer ``num_layers`` times (copies, as ``torch.nn``)
# and applies an optional final norm, for the encoder and the decoder
# alike. ``Transformer`` wires the two stacks, each with a final layer
# norm, initializes every matrix as ``nn.Transformer`` (Xavier-uniform), and
# takes a batch's three plans, by job (``plan_transformer``). Of
# ``nn.Transformer``'s arguments, the three ``*_key_padding_mask`` are gone
# and a causal mask is ``is_causal=True`` in the decoder's plan. Dropout acts
# where ``torch.nn``'s does, but not on attention weights (``varlen_attn``
# and FlexAttention have no argument for it).

from ragged_toolkit.attention import plan_batch


class TransformerEncoder(nn.Module):
    def __init__(self, encoder_layer, num_layers, norm=None):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(encoder_layer) for _ in range(num_layers))
        self.norm = norm

    def forward(self, x, *args):  # the arguments of its layers
        for layer in self.layers:
            x = layer(x, *args)
        return x if self.norm is None else self.norm(x)


TransformerDecoder = TransformerEncoder  # the same loop, over decoder layers


class Transformer(nn.Module):
    def __init__(self, d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6, dim_feedforward=2048,
                 dropout=0.1, activation="relu", layer_norm_eps=1e-5, norm_first=False, bias=True):
        super().__init__()
        args = (d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, norm_first, bias)
        norm = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.encoder = TransformerEncoder(TransformerEncoderLayer(*args), num_encoder_layers, copy.deepcopy(norm))
        self.decoder = TransformerDecoder(TransformerDecoderLayer(*args), num_decoder_layers, norm)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src, tgt, plans):  # src: (T_src, E), tgt: (T_tgt, E) -> (T_tgt, E)
        memory = self.encoder(src, plans["encoder"])
        return self.decoder(tgt, plans["decoder"], memory, plans["cross"])


def plan_transformer(src_offsets, tgt_offsets, encoder="loop", decoder="loop", cross="loop", flex=None):
    """A batch's plans by job, each on its backend: the encoder's, the decoder's (causal), and
    cross-attention's, from the targets to the sources; ``flex``: the kernel of a flex plan."""
    return {"encoder": plan_batch(src_offsets, backend=encoder, flex=flex),
            "decoder": plan_batch(tgt_offsets, backend=decoder, is_causal=True, flex=flex),
            "cross": plan_batch(tgt_offsets, src_offsets, backend=cross, flex=flex)}


# %%
# Proof of parity with ``torch.nn``
# ---------------------------------
# For each layer and stack we copy the ``torch.nn`` module's weights into
# ours (``in_proj_weight`` is our ``qkv_proj``, or ``q_proj`` and
# ``kv_proj``), run ``torch.nn`` on the padded batch with its masks and ours
# on the packed batch, and compare the outputs at every real token and
# every gradient: a mismatch stops the page. Dropout 0, float32, the loop
# backend (it runs float32 everywhere), ``torch.nn``'s "fast path" off.

import numpy as np
from ragged_toolkit.batches import from_padded, to_padded
from ragged_site.workloads import ragged_batch
from ragged_site.page import tolerances

torch.backends.mha.set_fastpath_enabled(False)


def from_nn_names(tensors):
    """Rename (and split) a ``torch.nn`` state or gradient dict for our layers."""
    out = {}
    for name, t in tensors.items():
        prefix, _, kind = name.rpartition("in_proj_")  # kind: "weight" or "bias"
        if not prefix:
            out[name] = t
        elif prefix.endswith("multihead_attn."):  # cross-attention: q | k, v
            q, kv = t.split([len(t) // 3, 2 * len(t) // 3])
            out[f"{prefix}q_proj.{kind}"], out[f"{prefix}kv_proj.{kind}"] = q, kv
        else:  # self-attention: packed
            out[f"{prefix}qkv_proj.{kind}"] = t
    return out


def load_from_nn(ragged, reference):
    ragged.load_state_dict(from_nn_names(reference.state_dict()), strict=True)
    return ragged


def causal_mask(S, device=DEVICE):
    return torch.ones(S, S, dtype=torch.bool, device=device).triu(1)  # True: masked


def make_nn_transformer(d_model, nhead, num_encoder_layers, num_decoder_layers, **kw):
    """``nn.Transformer``, batch first, its encoder without nested tensors."""
    layer = nn.TransformerEncoderLayer(d_model, nhead, batch_first=True, **kw)
    norm = copy.deepcopy(layer.norm1)  # a fresh LayerNorm with the layers' eps and bias
    encoder = nn.TransformerEncoder(layer, num_encoder_layers, norm, enable_nested_tensor=False)
    return nn.Transformer(d_model, nhead, num_encoder_layers, num_decoder_layers, custom_encoder=encoder,
                          batch_first=True, **kw)


def nn_transformer(m, tgt, tgt_valid, src, src_valid, mask_tgt_padding=True):
    """``torch.nn`` on padded tensors and masks. With right padding no causal query sees a
    padding key: the measurements leave ``tgt_key_padding_mask`` out, for a causal kernel."""
    return m(src, tgt, tgt_mask=causal_mask(tgt.shape[1]), tgt_is_causal=True,
             src_key_padding_mask=~src_valid, memory_key_padding_mask=~src_valid,
             tgt_key_padding_mask=~tgt_valid if mask_tgt_padding else None)


CALLS = {  # kind -> (torch.nn on padded tensors, ours on packed tensors and their offsets)
    "Encoder": (lambda m, x, valid, mem, mem_valid: m(x, src_key_padding_mask=~valid),
                lambda m, x, off, mem, mem_off: m(x, plan_batch(off, backend="loop"))),
    "Decoder": (lambda m, x, valid, mem, mem_valid: m(
                    x, mem, tgt_mask=causal_mask(x.shape[1]), tgt_is_causal=True,
                    tgt_key_padding_mask=~valid, memory_key_padding_mask=~mem_valid),
                lambda m, x, off, mem, mem_off: m(x, plan_batch(off, backend="loop", is_causal=True),
                                                   mem, plan_batch(off, mem_off, backend="loop"))),
    "Transformer": (nn_transformer, lambda m, x, off, mem, mem_off: m(mem, x, plan_transformer(mem_off, off))),
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
        torch.testing.assert_close(grads_rg[n], grads_nn[n], **tolerances(torch.float32),
                                   msg=lambda m, n=n: f"{name} {n}: {m}")
    grad_err = max((grads_rg[n] - grads_nn[n]).abs().max().item() for n in grads_rg)
    print(f"  {name:12s} output {(out_rg - out_nn).abs().max().item():.1e}, gradients {grad_err:.1e} "
          f"({len(grads_rg)} tensors)")


# %%
# Every layer and stack (two layers, a final norm), in both ``norm_first``
# settings, with ReLU and biases, then GELU and no biases; small sizes.

E, NHEAD, FF = 32, 4, 64  # the parity checks' sizes; the benchmark's are S.bench
FAMILY = {  # kind -> torch.nn's layer and stack, then ours
    "Encoder": (nn.TransformerEncoderLayer, nn.TransformerEncoder, TransformerEncoderLayer, TransformerEncoder),
    "Decoder": (nn.TransformerDecoderLayer, nn.TransformerDecoder, TransformerDecoderLayer, TransformerDecoder),
}
rng = np.random.default_rng(setup.seed)
x, x_off = ragged_batch(rng, 6, E, max_len=40, device=DEVICE)
mem, m_off = ragged_batch(rng, 6, E, max_len=40, device=DEVICE)
print("target lengths", x_off.diff().tolist(), "memory lengths", m_off.diff().tolist())

for norm_first in (False, True):
    for activation, bias in (("relu", True), ("gelu", False)):
        kw = dict(dim_feedforward=FF, dropout=0.0, activation=activation, norm_first=norm_first, bias=bias)
        print(f"norm_first={norm_first}, {activation}, bias={bias}:")
        cases = {}  # name -> (torch.nn module, ours), all built before any runs
        for kind, (nn_layer, nn_stack, layer, stack) in FAMILY.items():
            ref, ours = nn_layer(E, NHEAD, batch_first=True, **kw), layer(E, NHEAD, **kw)
            nested = {"enable_nested_tensor": False} if kind == "Encoder" else {}
            cases[f"{kind}Layer"] = ref, ours
            cases[kind] = (nn_stack(ref, 2, nn.LayerNorm(E, bias=bias), **nested),
                           stack(ours, 2, nn.LayerNorm(E, bias=bias)))
        cases["Transformer"] = make_nn_transformer(E, NHEAD, 2, 2, **kw), Transformer(E, NHEAD, 2, 2, **kw)
        for name, (reference, ragged) in cases.items():
            check_parity(name, reference, ragged, x, x_off, mem, m_off)

# %%
# Dropout runs in training mode only: with ``dropout=0.3`` our transformer in
# eval mode must match ``torch.nn``'s, and in training mode two calls must differ.

kw = dict(dim_feedforward=FF, dropout=0.3)
ragged = Transformer(E, NHEAD, 2, 2, **kw).eval()
check_parity("Transformer", make_nn_transformer(E, NHEAD, 2, 2, **kw).eval(), ragged, x, x_off, mem, m_off)
plans = plan_transformer(m_off, x_off)
assert not torch.allclose(ragged.train()(mem, x, plans), ragged(mem, x, plans)), "dropout must act in training"
print("dropout 0.3: in eval mode as nn.Transformer, in training mode at work")

# %%
# Measured: ragged against padded
# -------------------------------
# Now the speed, at the benchmark sizes, in the page's dtype. The padded side
# is ``torch.nn`` at its best on a right-padded batch: padding masks where
# they matter, ``tgt_is_causal=True`` alone for the decoder's self-attention.
# For each of its three attention jobs, the ragged side takes the backend
# ``compare_backends`` measures fastest for training where ``choose`` can
# tell (:doc:`measuring_ragged_batches`), else ``default_backend``.

from ragged_toolkit.attention import default_backend
from ragged_site.measuring.compare import compare_backends
from ragged_toolkit.attention.flex import FlexKernel

FLEX = FlexKernel()  # the page's compiled FlexAttention, for every flex plan
from ragged_site.measuring.noise import choose
from ragged_site.measuring.timing import measure

BENCH = S.bench  # batch, d_model, nhead, dim_ff, layers: read by name
rng = np.random.default_rng(setup.seed)
src, src_off = ragged_batch(rng, BENCH["batch"], BENCH["d_model"], max_len=S.max_len, device=DEVICE, dtype=DTYPE)
tgt, tgt_off = ragged_batch(rng, BENCH["batch"], BENCH["d_model"], max_len=S.max_len, device=DEVICE, dtype=DTYPE)
(src_pad, src_valid), (tgt_pad, tgt_valid) = to_padded(src, src_off), to_padded(tgt, tgt_off)  # (B, S, E), (B, S)
src_len, tgt_len = src_off.diff().cpu(), tgt_off.diff().cpu()
for name, n in (("source", src_len), ("target", tgt_len)):
    print(f"{name}: {int(n.sum())} tokens, longest {int(n.max())}, padded {len(n) * int(n.max())}")

jobs = {  # job -> its queries, keys and values, with their offsets
    "encoder": dict(q=src, kv=src, q_offsets=src_off, kv_offsets=src_off, is_causal=False),
    "decoder": dict(q=tgt, kv=tgt, q_offsets=tgt_off, kv_offsets=tgt_off, is_causal=True),
    "cross": dict(q=tgt, kv=src, q_offsets=tgt_off, kv_offsets=src_off, is_causal=False),
}
chosen = {}  # job -> backend
for job, spec in jobs.items():
    print(f"{job} attention, forward and backward:")
    q, kv = (spec[t].unflatten(-1, (BENCH["nhead"], -1)) for t in ("q", "kv"))
    timings = compare_backends(q, kv, kv, spec["q_offsets"], spec["kv_offsets"], is_causal=spec["is_causal"],
                               backward=True, min_run_time=S.run_time / 2, flex=FLEX)
    chosen[job] = choose(timings, default_backend(DEVICE, DTYPE, q.shape[-1]), f"{job} attention")

# %%
# The whole transformer, both sides with the same weights, eager, dropout 0.
# First each of our layers, in the page's dtype on the chosen backends, fed
# what ``torch.nn``'s layer got in float32, must give that layer's output
# within the tolerance of the dtype: layer by layer, as rounding adds up with
# depth, and a tolerance meant for one layer is not one for twelve. Then the
# forward pass, and forward and backward.


def check_layers(reference, ours, plans, src_off, tgt_off, run_reference):
    """Each layer of ``ours`` (in its dtype) on the input its ``torch.nn`` twin got in
    ``run_reference()``: the twin's output within the dtype tolerance. Returns how many."""
    seen = []  # every torch.nn layer's inputs and output, in the order they ran
    hooks = [layer.register_forward_hook(lambda m, args, out: seen.append((args, out)))
             for layer in (*reference.encoder.layers, *reference.decoder.layers)]
    with torch.no_grad():
        run_reference()
        for hook in hooks:
            hook.remove()
        for i, (layer, (args, out)) in enumerate(zip((*ours.encoder.layers, *ours.decoder.layers), seen)):
            encoder, dtype = i < len(reference.encoder.layers), layer.norm1.weight.dtype
            x_in = from_padded(args[0], src_off if encoder else tgt_off).to(dtype)
            got = layer(x_in, plans["encoder"]) if encoder else \
                layer(x_in, plans["decoder"], from_padded(args[1], src_off).to(dtype), plans["cross"])
            torch.testing.assert_close(got.float(), from_padded(out, src_off if encoder else tgt_off),
                                       **tolerances(dtype), msg=lambda m, i=i: f"layer {i}: {m}")
    return len(seen)


torch.manual_seed(setup.seed)
kw, layers = dict(dim_feedforward=BENCH["dim_ff"], dropout=0.0), BENCH["layers"]
nn_full = make_nn_transformer(BENCH["d_model"], BENCH["nhead"], layers, layers, **kw).to(DEVICE)
rg_full = load_from_nn(Transformer(BENCH["d_model"], BENCH["nhead"], layers, layers, **kw), nn_full)
rg_full, plans = rg_full.to(DEVICE, DTYPE), plan_transformer(src_off, tgt_off, **chosen, flex=FLEX)
checked = check_layers(nn_full, rg_full, plans, src_off, tgt_off, lambda: nn_transformer(
    nn_full, tgt_pad.float(), tgt_valid, src_pad.float(), src_valid, mask_tgt_padding=False))
print(f"benchmark transformer, {checked} layers in {DTYPE}: each gives nn.Transformer's float32 output")
nn_full.to(DTYPE)


def steps(module, call, grad_out):
    """The forward pass of ``call(module)``, and its forward and backward."""
    return {"forward": lambda: call(module),
            "forward+backward": lambda: (module.zero_grad(set_to_none=True), call(module).backward(grad_out))}


grad_tgt = torch.randn_like(tgt)
step_fns = {  # side -> {"forward": ..., "forward+backward": ...}
    "padded": steps(nn_full, lambda m: nn_transformer(m, tgt_pad, tgt_valid, src_pad, src_valid,
                                                      mask_tgt_padding=False), to_padded(grad_tgt, tgt_off)[0]),
    "ragged": steps(rg_full, lambda m: m(src, tgt, plans), grad_tgt),
}

# %%
# The :term:`work bound` counts with ``model_work``: twice a stack's weights
# per token it reads (cross-attention's keys and values per memory token),
# and per query-key pair the scores and the sum over values in each layer,
# the whole square under a padding mask, the causal half under a causal
# kernel; the :term:`fraction of the bound`: :doc:`measuring_ragged_batches`.

from ragged_site.measuring.bound import (attention_layer_work, model_work, pairs_scored,
                                         speedup_line, throughput_line)
from ragged_site.measuring.tables import print_timings


def transformer_work(model, src_len, tgt_len, *, n_layers, width, padded=False):
    """FLOPs of ``model`` on ``src_len``, ``tgt_len`` (B,) tokens; ``padded``: all as the longest."""
    if padded:
        src_len, tgt_len = (torch.full_like(n, int(n.max())) for n in (src_len, tgt_len))
    enc, dec = (model_work(stack, n_layers=n_layers, attention_width=width) for stack in (model.encoder, model.decoder))
    kv = n_layers * attention_layer_work(width, cross=True).per_kv_token  # per memory token, not per target token
    src, tgt = float(src_len.sum()), float(tgt_len.sum())
    return (enc.per_token * src + kv * src + (dec.per_token - kv) * tgt
            + enc.per_pair * pairs_scored(src_len, src_len, False)
            + dec.per_pair * (pairs_scored(tgt_len, tgt_len, True) + pairs_scored(tgt_len, src_len, False)))


sizes = dict(n_layers=layers, width=BENCH["d_model"])
bound = transformer_work(rg_full, src_len, tgt_len, padded=True, **sizes) / transformer_work(rg_full, src_len,
                                                                                              tgt_len, **sizes)
for mode in ("forward", "forward+backward"):
    print(f"transformer, {mode}:")
    times = measure({side: step_fns[side][mode] for side in ("padded", "ragged")}, min_run_time=S.run_time)
    print_timings(times)
    print(speedup_line(f"transformer, {mode}", times["padded"], times["ragged"], bound))

# %%
# Trained end to end
# ------------------
# Parity at initialization says nothing about training, so both models
# learn to copy random symbols (lengths from the site's generator): output
# ``t`` must find source token ``t`` through cross-attention. Ids: 0 pads
# (``torch.nn`` only), 1 starts the target, 2 ends it, the symbols are
# ``3 .. VOCAB - 1``; the decoder reads ``[BOS] + source``, predicts ``source + [EOS]``.

from ragged_toolkit.batches import offsets_from_lengths, token_index
from ragged_site.workloads import sentence_lengths

PAD, BOS, EOS, N_SYMBOLS = 0, 1, 2, 16
VOCAB = 3 + N_SYMBOLS
TRAIN = S.train  # batch, d_model, nhead, dim_ff, layers, steps: read by name


def copy_batch(rng, batch):
    """A batch of the copy task by name: packed ids (T,) and offsets (B + 1,)."""
    lengths = sentence_lengths(rng, batch, max_len=S.max_len - 1).tolist()
    src = [rng.integers(3, VOCAB, n) for n in lengths]
    tgt_in, tgt_out = [np.r_[BOS, s] for s in src], [np.r_[s, EOS] for s in src]
    src, tgt_in, tgt_out = (torch.as_tensor(np.concatenate(seqs), device=DEVICE) for seqs in (src, tgt_in, tgt_out))
    return dict(src=src, src_offsets=offsets_from_lengths(lengths, DEVICE), tgt_in=tgt_in, tgt_out=tgt_out,
                tgt_offsets=offsets_from_lengths([n + 1 for n in lengths], DEVICE))


class Seq2Seq(nn.Module):
    """The copy model: a token embedding, a learned position embedding, a transformer, a
    linear head. The transformer is ``torch.nn``'s, which pads the ids and masks the padding,
    or, given ``backends`` (job -> backend), ours, which plans each batch once."""

    def __init__(self, d_model, nhead, layers, dim_ff, backends=None):
        super().__init__()
        self.backends, self.flex = backends, FlexKernel()  # the model's own compiled FlexAttention
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(S.max_len, d_model)
        make = make_nn_transformer if backends is None else Transformer
        self.core = make(d_model, nhead, layers, layers, dim_feedforward=dim_ff)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, b):  # a batch of copy_batch -> logits and targets, flat
        if self.backends is not None:
            # the batch's plans, built once for all layers
            plans = plan_transformer(b["src_offsets"], b["tgt_offsets"], **self.backends, flex=self.flex)
            h = self.core(self.embed(b["src"]) + self.pos(token_index(b["src_offsets"])[1]),
                          self.embed(b["tgt_in"]) + self.pos(token_index(b["tgt_offsets"])[1]), plans)
            return self.head(h), b["tgt_out"]
        src, tgt_in, tgt_out = (to_padded(b[ids], b[offsets], PAD)[0] for ids, offsets in (
            ("src", "src_offsets"), ("tgt_in", "tgt_offsets"), ("tgt_out", "tgt_offsets")))
        h = self.core(self.embed(src) + self.pos.weight[:src.shape[1]],  # positions 0 .. S - 1
                      self.embed(tgt_in) + self.pos.weight[:tgt_in.shape[1]],
                      tgt_mask=causal_mask(tgt_in.shape[1]), tgt_is_causal=True,
                      src_key_padding_mask=src == PAD, memory_key_padding_mask=src == PAD)
        return self.head(h).flatten(0, 1), tgt_out.flatten()


# %%
# Same initial weights, batches, order, optimizer and schedule, the two
# taking turns, each step timed (``StepTimer``); throughput counts real
# tokens after ``WARMUP`` steps. A ``Run``'s ``step`` is the training step,
# under autocast in the page's dtype. On a GPU, copies of both models first
# meet every batch shape (cuDNN plans one per shape) through that same
# ``step``: the warm-up runs the dtype, autocast and backends it warms.

from dataclasses import dataclass

from ragged_site.measuring.timing import StepTimer, warm_every_shape


@dataclass
class Run:
    """A model in training: AdamW on a one-cycle schedule; ``losses`` gets each step's loss."""

    model: nn.Module
    losses: list

    def __post_init__(self):
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=S.lr)
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(self.optimizer, S.lr, TRAIN["steps"], pct_start=0.1)

    def step(self, batch):
        with torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32):
            logits, target = self.model.train()(batch)
        loss = F.cross_entropy(logits.float(), target, ignore_index=PAD)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.losses.append(loss.item())


cfg = {k: TRAIN[k] for k in ("d_model", "nhead", "layers", "dim_ff")}
torch.manual_seed(setup.seed)
padded_model = Seq2Seq(**cfg).to(DEVICE)
ragged_model = load_from_nn(Seq2Seq(**cfg, backends=chosen), padded_model).to(DEVICE)
data_rng = np.random.default_rng(setup.seed + 1)
batches = [copy_batch(data_rng, TRAIN["batch"]) for _ in range(TRAIN["steps"])]
n_real = sum(len(b["src"]) + len(b["tgt_in"]) for b in batches)
n_slots = sum(TRAIN["batch"] * int(b["src_offsets"].diff().max() + b["tgt_offsets"].diff().max()) for b in batches)
print(f"{TRAIN['steps']} steps of {TRAIN['batch']} sequences, {n_real:,} real tokens; padded, {n_slots / n_real:.2f}x")

WARM_SHAPES = DEVICE == "cuda"  # cuDNN: a plan per shape, built before any timed step
if WARM_SHAPES:
    for warmed in (padded_model, ragged_model):  # a copy of each: the runs start from these weights
        warm_every_shape(Run(copy.deepcopy(warmed), []).step, batches,
                         lambda b: (int(b["src_offsets"].diff().max()), int(b["tgt_offsets"].diff().max())))
losses = {"padded nn.Transformer": [], "ragged Transformer": []}  # the loss of every step
runs = {"padded nn.Transformer": Run(padded_model, losses["padded nn.Transformer"]),
        "ragged Transformer": Run(ragged_model, losses["ragged Transformer"])}
timers = {kind: StepTimer() for kind in runs}
torch.manual_seed(setup.seed)
for batch in batches:
    for kind, training in runs.items():
        with timers[kind].step(len(batch["src"]) + len(batch["tgt_in"])):
            training.step(batch)

WARMUP, LAST = 5, 20  # steps left out of the throughput; steps the final loss averages
final = {}  # name -> the mean of its first five losses, the mean and spread of its last ones
for name, trained in losses.items():
    final[name] = dict(first=np.mean(trained[:5]), mean=np.mean(trained[-LAST:]), std=np.std(trained[-LAST:]))
    print(f"{name:22s} loss {final[name]['first']:.3f} -> {final[name]['mean']:.3f} +- {final[name]['std']:.3f}")
speed = {kind: timer.tokens_per_s(WARMUP) for kind, timer in timers.items()}
work = {side: sum(transformer_work(ragged_model.core, b["src_offsets"].diff().cpu(), b["tgt_offsets"].diff().cpu(),
                                   n_layers=TRAIN["layers"], width=TRAIN["d_model"], padded=side == "padded")
                  for b in batches[WARMUP:]) for side in ("padded", "ragged")}
print(throughput_line("training", speed["ragged Transformer"], speed["padded nn.Transformer"],
                      work["padded"] / work["ragged"]))

# %%
# Both must learn: the page stops unless each model's mean loss over its
# last ``LAST`` steps is below 40% of its mean over the first five (a
# uniform guess scores ``ln(VOCAB)``, 2.9; symbol frequencies alone, 2.8).
# Step by step the losses differ (other dropout masks, batches that swing):
# the page stops if the two means end more than 15% of the descent apart.

for name, result in final.items():
    assert result["mean"] < 0.4 * result["first"], f"{name} did not learn: {result}"
padded_end, ragged_end = final["padded nn.Transformer"], final["ragged Transformer"]
descent, apart = padded_end["first"] - padded_end["mean"], abs(padded_end["mean"] - ragged_end["mean"])
print(f"last {LAST} steps: padded {padded_end['mean']:.3f} +- {padded_end['std']:.3f}, ragged "
      f"{ragged_end['mean']:.3f} +- {ragged_end['std']:.3f};\nthe means differ by {apart:.3f}, "
      f"{apart / descent:.1%} of the padded model's descent")
assert apart < 0.15 * descent, "the two models end further apart than 15% of their descent"

# The loss curves against each model's training time (further left: faster).
import matplotlib.pyplot as plt
from ragged_site.figures import FIGURE_STYLE

plt.rcParams.update(FIGURE_STYLE)
fig, ax = plt.subplots(figsize=(8, 5.5), layout="constrained")
for i, (kind, timer) in enumerate(timers.items()):
    ax.plot(np.cumsum(timer.seconds), losses[kind], marker="os"[i], ls=("-", "--")[i],
            markevery=max(1, TRAIN["steps"] // 12), label=f"{kind}, {speed[kind]:,.0f} real tokens/s")
ax.set(xlabel="seconds of training (measured)", ylabel="cross-entropy loss", yscale="log",
       title=f"Copying ragged sequences, {DEVICE}, {str(DTYPE).removeprefix('torch.')}")
fig.legend(loc="outside lower center")  # below the axes, clear of both curves
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# Conclusion
# ----------
# With packed values and a plan, the ``nn.Transformer`` family fits in a few
# dozen lines, no padding mask left. It matches ``torch.nn`` output for output
# and gradient for gradient; each speedup is printed beside its work bound on
# this device; and it learns the task as the padded one does, ending within
# 15% of their descent.
#
# References
# ----------
# * `nn.Transformer <https://pytorch.org/docs/stable/generated/torch.nn.Transformer.html>`_; Vaswani
#   et al., `Attention Is All You Need <https://arxiv.org/abs/1706.03762>`_; Xiong et al., `On Layer
#   Normalization in the Transformer Architecture <https://arxiv.org/abs/2002.04745>`_ (``norm_first``)
