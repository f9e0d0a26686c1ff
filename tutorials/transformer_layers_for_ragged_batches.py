"""
Transformer layers for ragged batches, in parity with ``torch.nn``
==================================================================

Every layer of the ``nn.Transformer`` family on packed values plus offsets:
proven equal to ``torch.nn``, measured against it, trained end to end.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How to write the encoder and decoder layers, their stacks and
         ``nn.Transformer`` for packed values plus offsets instead of a
         padded batch and three kinds of padding masks, and how to prove,
         output for output and gradient for gradient, that they compute
         what ``torch.nn`` computes
       * What skipping the padding buys a whole model, beside the
         :term:`work bound`, and that the ragged model learns a task as the
         padded one does: both losses fall, and end within a stated tolerance

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * The :doc:`building-blocks page <transformer_building_blocks>`: the
         ``MultiHeadAttention`` layer and ``ragged_attention`` used here
       * PyTorch 2.11 or later; a CPU is enough
"""

# sphinx_gallery_tags = ["nn.Transformer", "parity", "training", "benchmarks"]

# %%
# Offsets instead of masks
# ------------------------
# ``torch.nn``'s transformer layers take a padded ``(B, S, E)`` batch and a
# padding mask for each attention. The layers below take packed values
# ``(T, E)`` and offsets ``(B + 1,)``, and no mask: everything but attention
# works token by token, on the packed values as they are, and attention, the
# toolkit's ``MultiHeadAttention``, keeps the sequences apart with the
# offsets. The rest follows ``torch.nn`` line for line: the same submodule
# names (so weights load by name), defaults (post-norm, ``dropout=0.1``,
# ReLU) and options (``norm_first``, GELU, ``bias``). The decoder layer adds
# cross-attention to the encoder's output, the ``memory``, with its offsets.

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from ragged_toolkit.layers import MultiHeadAttention


class TransformerEncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` on a packed batch: x (T, E), offsets (B + 1,)."""

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

    def _sa(self, x, offsets, is_causal):
        return self.dropout1(self.self_attn(x, offsets, is_causal=is_causal))

    def _ff(self, x, dropout):
        return dropout(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, x, offsets, is_causal=False):  # (T, E) -> (T, E)
        x = self._residual(x, self.norm1, lambda h: self._sa(h, offsets, is_causal))
        return self._residual(x, self.norm2, lambda h: self._ff(h, self.dropout2))


class TransformerDecoderLayer(TransformerEncoderLayer):
    """``nn.TransformerDecoderLayer``: causal self-attention, cross-attention to
    ``memory`` (T_src, E) with its own offsets, then the feed-forward block."""

    def __init__(self, d_model, nhead, *args, **kwargs):  # the encoder layer's
        super().__init__(d_model, nhead, *args, **kwargs)
        bias = self.norm1.bias is not None
        self.multihead_attn = MultiHeadAttention(d_model, nhead, cross=True, bias=bias)
        self.norm3 = nn.LayerNorm(d_model, eps=self.norm1.eps, bias=bias)
        self.dropout3 = nn.Dropout(self.dropout1.p)  # dropout2: after cross-attention

    def forward(self, x, offsets, memory, memory_offsets, is_causal=True):
        x = self._residual(x, self.norm1, lambda h: self._sa(h, offsets, is_causal))
        x = self._residual(x, self.norm2, lambda h: self.dropout2(self.multihead_attn(
            h, offsets, context=memory, context_offsets=memory_offsets)))
        return self._residual(x, self.norm3, lambda h: self._ff(h, self.dropout3))


# %%
# Sizes
# -----
# ``BENCH`` for the measurements, ``TRAIN`` for the training run: on CUDA,
# ``nn.Transformer``'s defaults with fewer layers; :term:`quick mode` shrinks them.

import numpy as np
from ragged_toolkit.device import default_device, default_dtype, quick_mode, quiet_known_notes
from ragged_toolkit.measuring.timing import TIMING_THREADS

DEVICE, QUICK, SEED = default_device(), quick_mode(), 0
DTYPE = default_dtype(DEVICE)
torch.set_num_threads(TIMING_THREADS)  # as every timing of the site (measuring_ragged_batches)
if DEVICE == "cuda":
    BENCH = dict(batch=256, d_model=512, nhead=8, dim_ff=2048, layers=6)
    TRAIN = dict(batch=128, d_model=256, nhead=8, dim_ff=1024, layers=3, steps=600)
    RUN_TIME, LR = 1.0, 1e-3  # seconds of timed runs per comparison, learning rate
else:
    BENCH = dict(batch=48, d_model=128, nhead=4, dim_ff=512, layers=2)
    TRAIN = dict(batch=32, d_model=128, nhead=4, dim_ff=512, layers=2, steps=100)
    RUN_TIME, LR = 0.3, 3e-3
if QUICK:
    BENCH, RUN_TIME = dict(batch=16, d_model=64, nhead=4, dim_ff=128, layers=1), 0.1
    TRAIN.update(steps=120, batch=16)
MAX_LEN = 32 if QUICK else 128  # the context length: longer sentences are cut
print(f"PyTorch {torch.__version__}, device: {DEVICE}, dtype: {DTYPE}, quick: {QUICK}")
print("benchmark:", ", ".join(f"{k} {v}" for k, v in BENCH.items()))
print("training: ", ", ".join(f"{k} {v}" for k, v in TRAIN.items()))

# sphinx_gallery_start_ignore
quiet_known_notes()
# sphinx_gallery_end_ignore

# %%
# The stacks and the full transformer
# -----------------------------------
# A stack repeats a layer ``num_layers`` times (by copying it, as
# ``torch.nn`` does) and applies an optional final norm; the decoder stack
# is the same loop over decoder layers, so it is the same class. ``Transformer``
# wires an encoder stack and a decoder stack, each with a final layer norm,
# and initializes every matrix with Xavier-uniform, as ``nn.Transformer``.


class TransformerEncoder(nn.Module):
    def __init__(self, encoder_layer, num_layers, norm=None):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(encoder_layer)
                                    for _ in range(num_layers))
        self.norm = norm

    def forward(self, x, *args, **kwargs):  # the arguments of its layers
        for layer in self.layers:
            x = layer(x, *args, **kwargs)
        return x if self.norm is None else self.norm(x)


TransformerDecoder = TransformerEncoder  # the same loop, over decoder layers


class Transformer(nn.Module):
    def __init__(self, d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
                 dim_feedforward=2048, dropout=0.1, activation="relu",
                 layer_norm_eps=1e-5, norm_first=False, bias=True):
        super().__init__()
        args = (d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                norm_first, bias)
        norm = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.encoder = TransformerEncoder(TransformerEncoderLayer(*args),
                                          num_encoder_layers, copy.deepcopy(norm))
        self.decoder = TransformerDecoder(TransformerDecoderLayer(*args),
                                          num_decoder_layers, norm)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src, src_offsets, tgt, tgt_offsets, tgt_is_causal=True):
        # src: (T_src, E), tgt: (T_tgt, E) -> (T_tgt, E)
        memory = self.encoder(src, src_offsets)
        return self.decoder(tgt, tgt_offsets, memory, src_offsets,
                            is_causal=tgt_is_causal)


# %%
# Of ``nn.Transformer``'s arguments, the three ``*_key_padding_mask`` are
# gone (the offsets say where each sequence ends) and a causal mask becomes
# ``is_causal=True``. Dropout acts where ``torch.nn``'s does, but not on
# attention weights, which ``varlen_attn`` and FlexAttention have no
# argument for; the other arguments keep their meaning and defaults.
#
# Proof of parity with ``torch.nn``
# ---------------------------------
# For each layer and stack we copy the weights of the ``torch.nn`` module
# into ours, run ``torch.nn`` on the padded batch with its masks and ours on
# the packed batch, and compare the outputs at every real token and every
# parameter's gradient; any mismatch stops the page. Dropout is 0, in
# float32, and ``torch.nn``'s eval-mode "fast path" is off. Weights load by
# name (``in_proj_weight`` is our ``qkv_proj``, or ``q_proj`` and
# ``kv_proj`` for cross-attention).

from ragged_toolkit.batches import from_padded, ragged_batch, to_padded
from ragged_toolkit.device import tolerances

torch.manual_seed(SEED)  # the layers' initial weights and the random gradients below
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
    encoder = nn.TransformerEncoder(layer, num_encoder_layers, norm,
                                    enable_nested_tensor=False)
    return nn.Transformer(d_model, nhead, num_encoder_layers, num_decoder_layers,
                          custom_encoder=encoder, batch_first=True, **kw)


# The calls: torch.nn gets padded tensors and masks, ours packed tensors and
# offsets. With right padding no causal query reaches a padding key, so the
# measurements leave tgt_key_padding_mask out and torch.nn runs a causal kernel.


def nn_transformer(m, tgt, tgt_valid, src, src_valid, mask_tgt_padding=True):
    return m(src, tgt, tgt_mask=causal_mask(tgt.shape[1]), tgt_is_causal=True,
             src_key_padding_mask=~src_valid, memory_key_padding_mask=~src_valid,
             tgt_key_padding_mask=~tgt_valid if mask_tgt_padding else None)


CALLS = {  # kind -> (torch.nn on padded tensors, ours on packed tensors)
    "Encoder": (lambda m, x, valid, mem, mem_valid: m(x, src_key_padding_mask=~valid),
                lambda m, x, off, mem, mem_off: m(x, off)),
    "Decoder": (lambda m, x, valid, mem, mem_valid: m(
                    x, mem, tgt_mask=causal_mask(x.shape[1]), tgt_is_causal=True,
                    tgt_key_padding_mask=~valid, memory_key_padding_mask=~mem_valid),
                lambda m, x, off, mem, mem_off: m(x, off, mem, mem_off)),
    "Transformer": (nn_transformer,
                    lambda m, x, off, mem, mem_off: m(mem, mem_off, x, off)),
}


def check_parity(name, reference, ragged, x, x_off, mem, mem_off):
    """Outputs at real tokens and every gradient, ours against torch.nn."""
    run_nn, run_ragged = CALLS[name.removesuffix("Layer")]
    reference, ragged = reference.to(DEVICE), load_from_nn(ragged, reference).to(DEVICE)
    out_nn = run_nn(reference, *to_padded(x, x_off), *to_padded(mem, mem_off))
    out_nn = from_padded(out_nn, x_off)
    out_rg = run_ragged(ragged, x, x_off, mem, mem_off)
    cotangent = torch.randn_like(out_rg)  # a random weighting of the outputs
    (out_nn * cotangent).sum().backward()
    (out_rg * cotangent).sum().backward()
    torch.testing.assert_close(out_rg, out_nn, **tolerances(torch.float32))
    grads_nn = from_nn_names({n: p.grad for n, p in reference.named_parameters()})
    grads_rg = {n: p.grad for n, p in ragged.named_parameters()}
    assert grads_nn.keys() == grads_rg.keys()
    for n in grads_rg:
        torch.testing.assert_close(grads_rg[n], grads_nn[n], **tolerances(torch.float32),
                                   msg=lambda m, n=n: f"{name} {n}: {m}")
    out_err = (out_rg - out_nn).abs().max().item()
    grad_err = max((grads_rg[n] - grads_nn[n]).abs().max().item() for n in grads_rg)
    print(f"  {name:12s} output {out_err:.1e}, gradients {grad_err:.1e} "
          f"({len(grads_rg)} tensors)")


# %%
# Every layer and stack, in both ``norm_first`` settings, with ReLU and
# biases, then with GELU and no biases. The stacks have two layers and a
# final layer norm.

E, NHEAD, FF = 32, 4, 64
FAMILY = {  # kind -> torch.nn's layer and stack, then ours
    "Encoder": (nn.TransformerEncoderLayer, nn.TransformerEncoder,
                TransformerEncoderLayer, TransformerEncoder),
    "Decoder": (nn.TransformerDecoderLayer, nn.TransformerDecoder,
                TransformerDecoderLayer, TransformerDecoder),
}
rng = np.random.default_rng(SEED)
x, x_off = ragged_batch(rng, 6, E, max_len=40, device=DEVICE)
mem, m_off = ragged_batch(rng, 6, E, max_len=40, device=DEVICE)
print("target lengths", x_off.diff().tolist(), "memory lengths", m_off.diff().tolist())

for norm_first in (False, True):
    for activation, bias in (("relu", True), ("gelu", False)):
        kw = dict(dim_feedforward=FF, dropout=0.0, activation=activation,
                  norm_first=norm_first, bias=bias)
        print(f"norm_first={norm_first}, {activation}, bias={bias}:")
        cases = {}  # name -> (torch.nn module, ours), all built before any runs
        for kind, (nn_layer, nn_stack, layer, stack) in FAMILY.items():
            ref, ours = nn_layer(E, NHEAD, batch_first=True, **kw), layer(E, NHEAD, **kw)
            nested = {"enable_nested_tensor": False} if kind == "Encoder" else {}
            cases[f"{kind}Layer"] = ref, ours
            cases[kind] = (nn_stack(ref, 2, nn.LayerNorm(E, bias=bias), **nested),
                           stack(ours, 2, nn.LayerNorm(E, bias=bias)))
        cases["Transformer"] = (make_nn_transformer(E, NHEAD, 2, 2, **kw),
                                Transformer(E, NHEAD, 2, 2, **kw))
        for name, (reference, ragged) in cases.items():
            check_parity(name, reference, ragged, x, x_off, mem, m_off)

# %%
# Dropout runs in training mode only: with ``dropout=0.3`` our transformer in
# eval mode must match ``torch.nn``'s, and in training mode two calls must
# differ.

kw = dict(dim_feedforward=FF, dropout=0.3)
reference = make_nn_transformer(E, NHEAD, 2, 2, **kw).to(DEVICE).eval()
ragged = load_from_nn(Transformer(E, NHEAD, 2, 2, **kw), reference).to(DEVICE)
with torch.no_grad():
    out_nn = nn_transformer(reference, *to_padded(x, x_off), *to_padded(mem, m_off))
    torch.testing.assert_close(ragged.eval()(mem, m_off, x, x_off),
                               from_padded(out_nn, x_off), **tolerances(torch.float32))
    ragged.train()
    two_calls = ragged(mem, m_off, x, x_off), ragged(mem, m_off, x, x_off)
    assert not torch.allclose(*two_calls), "dropout must be active in training mode"
print("eval mode: matches nn.Transformer; training mode: dropout active")

# %%
# Measured: ragged against padded
# -------------------------------
# Now the speed, at the benchmark sizes and in the page's dtype. The padded
# side is ``torch.nn`` used as well as it can be on a right-padded batch:
# padding masks where they matter, and only ``tgt_is_causal=True`` for the
# decoder's self-attention. The ragged side takes, for each of its three
# attention jobs, the backend that ``compare_backends`` (building-blocks
# page) measures for training; each line ends with the :term:`kernel label`
# of what ran, such as ``[CPU flash x16]``. As on every page, ``choose``
# takes the lowest median only where its interquartile range does not
# overlap that of the second fastest, and otherwise the default, ``default_backend``.

from ragged_toolkit.attention import default_backend
from ragged_toolkit.measuring.compare import compare_backends
from ragged_toolkit.measuring.noise import choose
from ragged_toolkit.measuring.compiling import compile_counter
from ragged_toolkit.measuring.timing import measure

B, E, NHEAD, FF, LAYERS = BENCH.values()  # batch, d_model, nhead, dim_ff, layers
rng = np.random.default_rng(SEED)
src, src_off = ragged_batch(rng, B, E, max_len=MAX_LEN, device=DEVICE, dtype=DTYPE)
tgt, tgt_off = ragged_batch(rng, B, E, max_len=MAX_LEN, device=DEVICE, dtype=DTYPE)
src_pad, src_valid = to_padded(src, src_off)  # (B, S_src, E), (B, S_src)
tgt_pad, tgt_valid = to_padded(tgt, tgt_off)
src_len, tgt_len = src_off.diff().cpu(), tgt_off.diff().cpu()
for name, lengths in (("source", src_len), ("target", tgt_len)):
    print(f"{name}: {int(lengths.sum())} tokens, longest {int(lengths.max())}, "
          f"padded {B * int(lengths.max())}")

jobs = {"encoder self-attention": (src, src, src_off, src_off, False),
        "decoder self-attention": (tgt, tgt, tgt_off, tgt_off, True),
        "cross-attention": (tgt, src, tgt_off, src_off, False)}
chosen = {}
with compile_counter() as flex_compiled:  # the flex backend, where it trains
    for job, (xq, xkv, q_off, kv_off, causal) in jobs.items():
        print(f"{job}, forward and backward:")
        q, kv = xq.unflatten(-1, (NHEAD, -1)), xkv.unflatten(-1, (NHEAD, -1))
        chosen[job] = choose(compare_backends(q, kv, kv, q_off, kv_off, is_causal=causal,
                                              backward=True, min_run_time=RUN_TIME / 2),
                             default_backend(DEVICE, DTYPE), job)
if flex_compiled.shapes:
    print(f"torch.compile, the flex backend: {flex_compiled}")

# %%
# The whole transformer, both sides with the same weights (checked in the
# page's dtype against ``torch.nn`` in float32), eager, in training mode
# with dropout 0: the forward pass with autograd recording, so that its
# memory is the activation memory, then forward and backward from the same
# output gradient.


def set_backends(model):
    """Give every attention of ``model`` the backend chosen for its job."""
    for m in model.modules():
        if isinstance(m, TransformerDecoderLayer):
            m.self_attn.backend = chosen["decoder self-attention"]
            m.multihead_attn.backend = chosen["cross-attention"]
        elif isinstance(m, TransformerEncoderLayer):
            m.self_attn.backend = chosen["encoder self-attention"]
    return model


torch.manual_seed(SEED)
kw = dict(dim_feedforward=FF, dropout=0.0)
nn_full = make_nn_transformer(E, NHEAD, LAYERS, LAYERS, **kw).to(DEVICE)
rg_full = set_backends(load_from_nn(Transformer(E, NHEAD, LAYERS, LAYERS, **kw), nn_full)).to(DEVICE)

with torch.no_grad():
    out_nn = nn_transformer(nn_full, tgt_pad.float(), tgt_valid, src_pad.float(),
                            src_valid, mask_tgt_padding=False)
    out_rg = rg_full.to(DTYPE)(src, src_off, tgt, tgt_off)
    torch.testing.assert_close(out_rg.float(), out_nn[tgt_valid], **tolerances(DTYPE))
print(f"benchmark transformer in {DTYPE} matches nn.Transformer in float32")
nn_full.to(DTYPE)


def steps(module, call, grad_out):
    """The forward pass of ``call(module)``, and its forward and backward."""

    def forward_backward():
        module.zero_grad(set_to_none=True)
        call(module).backward(grad_out)

    return {"forward": lambda: call(module), "forward+backward": forward_backward}


grad_tgt = torch.randn_like(tgt)
step_fns = {  # side -> {"forward": ..., "forward+backward": ...}
    "padded": steps(nn_full, lambda m: nn_transformer(m, tgt_pad, tgt_valid, src_pad, src_valid,
                                                      mask_tgt_padding=False), to_padded(grad_tgt, tgt_off)[0]),
    "ragged": steps(rg_full, lambda m: m(src, src_off, tgt, tgt_off), grad_tgt),
}

# %%
# The :term:`work bound` counts, per layer, ``8 E^2 + 4 E F`` FLOPs per
# encoder token, ``12 E^2 + 4 E F`` per decoder token plus ``4 E^2`` per
# memory token, and ``4 E`` per query-key pair: the whole square where a
# padding mask is applied, the causal half where a causal kernel runs.

from ragged_toolkit.measuring.bound import pairs_scored, speedup_line
from ragged_toolkit.measuring.tables import print_timings


def stack_work(src_len, tgt_len=None, *, d_model, dim_ff, layers, padded=False):
    """FLOPs of the encoder over sequences of ``src_len`` tokens, plus the
    decoder over ``tgt_len``; ``padded``: each as long as the longest."""
    src_len = torch.full_like(src_len, int(src_len.max())) if padded else src_len
    e, f, src = d_model, dim_ff, float(src_len.sum())
    work = (8 * e * e + 4 * e * f) * src + 4 * e * pairs_scored(src_len, src_len, False)
    if tgt_len is not None:
        tgt_len = torch.full_like(tgt_len, int(tgt_len.max())) if padded else tgt_len
        work += ((12 * e * e + 4 * e * f) * float(tgt_len.sum()) + 4 * e * e * src
                 + 4 * e * (pairs_scored(tgt_len, tgt_len, True)
                            + pairs_scored(tgt_len, src_len, False)))
    return layers * work


sizes = dict(d_model=E, dim_ff=FF, layers=LAYERS)
bound = stack_work(src_len, tgt_len, padded=True, **sizes) / stack_work(src_len, tgt_len, **sizes)
for mode in ("forward", "forward+backward"):
    print(f"transformer, {mode}:")
    times = measure({side: step_fns[side][mode] for side in ("padded", "ragged")}, min_run_time=RUN_TIME)
    print_timings(times)
    print(speedup_line(f"transformer, {mode}", times["padded"], times["ragged"], bound))

# %%
# A :term:`fraction of the bound` near 1 means the ragged model wins back
# what padding costs in work; below 1, overheads (one attention call per
# sequence and layer for the loop backend, the gathers of the bucketed one)
# eat part of it; above 1, the padded side is slower per unit of work, for
# the memory traffic of its larger tensors. :doc:`measuring_ragged_batches`
# shows how to profile either side.
#
# Trained end to end
# ------------------
# Parity at initialization says nothing about training, so we train both
# models to copy a sequence of random symbols: the decoder never sees the
# next token, so for output ``t`` it must find source token ``t`` through
# cross-attention. The lengths come from the site's generator, cut at the
# context length. Token ids: 0 is padding (``torch.nn`` side only), 1 starts
# the target, 2 ends it, the symbols are ``3 .. VOCAB - 1``; the decoder
# reads ``[BOS] + source`` and predicts ``source + [EOS]``.

from ragged_toolkit.batches import offsets_from_lengths, sentence_lengths, token_index

PAD, BOS, EOS, N_SYMBOLS = 0, 1, 2, 16
VOCAB = 3 + N_SYMBOLS


def copy_batch(rng, batch):
    """Packed ids: source, its offsets, decoder input, target, their offsets."""
    lengths = sentence_lengths(rng, batch, max_len=MAX_LEN - 1).tolist()
    src = [rng.integers(3, VOCAB, n) for n in lengths]
    tgt_in, tgt_out = [np.r_[BOS, s] for s in src], [np.r_[s, EOS] for s in src]
    src, tgt_in, tgt_out = (torch.as_tensor(np.concatenate(seqs), device=DEVICE)
                            for seqs in (src, tgt_in, tgt_out))
    return (src, offsets_from_lengths(lengths, DEVICE), tgt_in, tgt_out,
            offsets_from_lengths([n + 1 for n in lengths], DEVICE))


# %%
# The two models share everything but the transformer in the middle: a token
# embedding, a learned position embedding (``nn.Transformer`` has none), and
# a linear head. The ``torch.nn`` one pads the ids and builds its masks from
# them; ours works on the packed ids and their offsets.


class Seq2Seq(nn.Module):
    def __init__(self, padded, d_model, nhead, layers, dim_ff):
        super().__init__()
        self.padded = padded
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(MAX_LEN, d_model)
        make = make_nn_transformer if padded else Transformer
        self.core = make(d_model, nhead, layers, layers, dim_feedforward=dim_ff)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, batch):  # a batch of copy_batch -> logits and targets, flat
        src, src_off, tgt_in, tgt_out, tgt_off = batch
        if not self.padded:
            h = self.core(self.embed(src) + self.pos(token_index(src_off)[1]), src_off,
                          self.embed(tgt_in) + self.pos(token_index(tgt_off)[1]), tgt_off)
            return self.head(h), tgt_out
        src, tgt_in, tgt_out = (to_padded(t, off, PAD)[0] for t, off in
                                ((src, src_off), (tgt_in, tgt_off), (tgt_out, tgt_off)))
        pos_s, pos_t = (torch.arange(t.shape[1], device=DEVICE) for t in (src, tgt_in))
        h = self.core(self.embed(src) + self.pos(pos_s),
                      self.embed(tgt_in) + self.pos(pos_t),
                      tgt_mask=causal_mask(tgt_in.shape[1]), tgt_is_causal=True,
                      src_key_padding_mask=src == PAD, memory_key_padding_mask=src == PAD)
        return self.head(h).flatten(0, 1), tgt_out.flatten()


# %%
# Both models start from the same weights and see the same batches in the
# same order, with the same optimizer and schedule, taking turns, each step
# timed (``StepTimer``); throughput counts real tokens after ``WARMUP`` steps.

from ragged_toolkit.measuring.timing import StepTimer, warm_every_shape

cfg = {k: TRAIN[k] for k in ("d_model", "nhead", "layers", "dim_ff")}
torch.manual_seed(SEED)
padded_model = Seq2Seq(True, **cfg).to(DEVICE)
ragged_model = set_backends(load_from_nn(Seq2Seq(False, **cfg), padded_model)).to(DEVICE)
data_rng = np.random.default_rng(SEED + 1)
batches = [copy_batch(data_rng, TRAIN["batch"]) for _ in range(TRAIN["steps"])]
n_real = sum(len(b[0]) + len(b[2]) for b in batches)
n_slots = sum(TRAIN["batch"] * int(b[1].diff().max() + b[4].diff().max()) for b in batches)
print(f"{TRAIN['steps']} steps of {TRAIN['batch']} sequences, {n_real:,} real tokens; padded, {n_slots / n_real:.2f}x")

runs = {}
for name, model in (("padded nn.Transformer", padded_model), ("ragged Transformer", ragged_model)):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, LR, total_steps=TRAIN["steps"], pct_start=0.1)
    runs[name] = (model.train(), optimizer, scheduler, StepTimer(), [])
for model in (copy.deepcopy(padded_model), copy.deepcopy(ragged_model)) if DEVICE == "cuda" else ():
    warm_every_shape(lambda b, m=model: F.cross_entropy(*m(b)).backward(), batches,  # cuDNN: a plan per shape
                     lambda b: (int(b[1].diff().max()), int(b[4].diff().max())))
torch.manual_seed(SEED)
for batch in batches:
    for model, optimizer, scheduler, timer, losses in runs.values():
        with timer.step(len(batch[0]) + len(batch[2])):
            with torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32):
                logits, target = model(batch)
            loss = F.cross_entropy(logits.float(), target, ignore_index=PAD)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        losses.append(loss.item())

WARMUP, LAST = 5, 20  # steps left out of the throughput; steps the final loss averages
speed, final = {}, {}
for name, (_, _, _, timer, losses) in runs.items():
    speed[name] = timer.tokens_per_s(WARMUP)
    final[name] = np.mean(losses[-LAST:]), np.std(losses[-LAST:])
    print(f"{name:22s} loss {np.mean(losses[:5]):.3f} -> {final[name][0]:.3f} +- {final[name][1]:.3f} "
          f"(last {LAST} steps), {speed[name]:,.0f} real tokens/s")
sizes = {k: TRAIN[k] for k in ("d_model", "dim_ff", "layers")}
work = {side: sum(stack_work(b[1].diff().cpu(), b[4].diff().cpu(), **sizes, padded=side == "padded")
                  for b in batches[WARMUP:]) for side in ("padded", "ragged")}
speedup = speed["ragged Transformer"] / speed["padded nn.Transformer"]
bound = work["padded"] / work["ragged"]
print(f"training: speedup {speedup:.2f}x, work bound {bound:.2f}x, fraction of bound {speedup / bound:.2f}")

# %%
# The fraction reads as above. Both must learn: the page stops unless each
# model's mean loss over its last ``LAST`` steps is below 40% of its mean over
# the first five (both start near ``ln(VOCAB)``, about 2.9; a model that
# learned only how often each symbol occurs would stay near ``ln(16)``, about
# 2.8). Their losses are not equal step by step: dropout draws different
# masks for padded and packed tensors, and a step's loss swings with its
# batch (the spread printed beside each mean). What the runs show is how far
# apart the two means end, against how far both fell: the page stops if
# they end more than 15% of that descent apart.

for name, (_, _, _, _, losses) in runs.items():
    assert final[name][0] < 0.4 * np.mean(losses[:5]), f"{name} did not learn: {losses[:5]} -> {final[name]}"
(mean_p, std_p), (mean_r, std_r) = final["padded nn.Transformer"], final["ragged Transformer"]
descent = np.mean(runs["padded nn.Transformer"][4][:5]) - mean_p
print(f"last {LAST} steps: padded {mean_p:.3f} +- {std_p:.3f}, ragged {mean_r:.3f} +- {std_r:.3f};\nthe means "
      f"differ by {abs(mean_p - mean_r):.3f}, {abs(mean_p - mean_r) / descent:.1%} of the padded model's descent")
assert abs(mean_p - mean_r) < 0.15 * descent, "the two models end further apart than 15% of their descent"

# %%
# The two loss curves against the time each model spent training: a curve
# that ends further left trained faster. Markers keep both curves visible
# where they overlap.

import matplotlib.pyplot as plt
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
from ragged_toolkit.figures import FIGURE_STYLE

plt.rcParams.update(FIGURE_STYLE)
fig, ax = plt.subplots(figsize=(8, 5.5), layout="constrained")
every = max(1, TRAIN["steps"] // 12)
for i, (name, (_, _, _, timer, losses)) in enumerate(runs.items()):
    ax.plot(np.cumsum(timer.seconds), losses, marker="os"[i], ls=("-", "--")[i], markevery=(i * every // 2, every),
            label=f"{name}, {speed[name]:,.0f} real tokens/s")
ax.set_xlabel("seconds of training (measured)")
ax.set_ylabel("cross-entropy loss")
ax.set_yscale("log")
ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # ticks at 1, 2, 5 x 10^k
ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
ax.yaxis.set_minor_formatter(NullFormatter())
ax.set_title(f"Copying ragged sequences, {DEVICE}, {str(DTYPE).removeprefix('torch.')}")
fig.legend(loc="outside lower center")  # below the axes, clear of both curves
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# Conclusion
# ----------
# Once the batch is packed values plus offsets, every layer of the
# ``nn.Transformer`` family fits in a few dozen lines: no ``*_padding_mask``
# is left, and the decoder's causal mask becomes a flag. The layers match
# ``torch.nn`` output for output and gradient for gradient; each speedup is
# printed beside its work bound on this device; and the ragged transformer
# learns the same task from the same start, its mean loss over the last
# steps as far from the padded model's as printed above, a small share of
# how far both fell.
#
# References
# ----------
# * `nn.Transformer
#   <https://pytorch.org/docs/stable/generated/torch.nn.Transformer.html>`_
# * Vaswani et al., `Attention Is All You Need <https://arxiv.org/abs/1706.03762>`_
# * Xiong et al., `On Layer Normalization in the Transformer Architecture
#   <https://arxiv.org/abs/2002.04745>`_ (``norm_first``)
