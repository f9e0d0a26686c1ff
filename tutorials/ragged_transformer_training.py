"""
Training a ragged ``nn.Transformer``: measured against padding
==============================================================

The ragged ``nn.Transformer`` of :doc:`transformer_layers_for_ragged_batches`
against ``torch.nn`` on the padded batch. Both run with the same weights.
The page measures one step of each against the :term:`work bound`, then
trains both on a copy task.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How to choose a backend per attention job (encoder, decoder,
         cross-attention) by measurement
       * How to check a deep 16-bit model layer by layer, not as a whole
       * What skipping the padding buys a whole model, beside the
         :term:`work bound`, and how to read the fraction
       * That it learns a task as the padded model does

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`transformer_layers_for_ragged_batches`: the layers and their
         proof of parity
       * :doc:`measuring_ragged_batches`: how the site measures
       * PyTorch 2.11 or later; a CPU is enough
"""

# sphinx_gallery_tags = ["nn.Transformer", "training", "benchmarks"]

# %%
# Sizes
# -----
# ``bench`` sizes the measurements and ``train`` the training. On CUDA they
# are ``nn.Transformer``'s defaults with fewer layers. ``max_len`` is the
# longest sequence. ``run_time`` is the seconds of timed runs per comparison.

from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(
        bench=dict(batch=256, d_model=512, nhead=8, dim_ff=2048, layers=6),
        train=dict(batch=128, d_model=256, nhead=8, dim_ff=1024, layers=3, steps=600),
        max_len=128,
        run_time=1.0,
        lr=1e-3,
    ),
    "cpu": dict(
        bench=dict(batch=48, d_model=128, nhead=4, dim_ff=512, layers=2),
        train=dict(batch=32, d_model=128, nhead=4, dim_ff=512, layers=2, steps=100),
        max_len=128,
        run_time=0.3,
        lr=3e-3,
    ),
    "quick": dict(
        bench=dict(batch=16, d_model=64, nhead=4, dim_ff=128, layers=1),
        train=dict(batch=16, steps=120),
        max_len=32,
        run_time=0.1,
    ),
}
setup = page_setup(SIZES)  # device, dtype, quick mode, one CPU thread, the seed; prints them
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes

# %%
# A backend for each attention job
# --------------------------------
# The speed is measured at the benchmark sizes, in the page's dtype. The
# padded side is ``torch.nn`` at its best on a right-padded batch. It masks
# padding where it matters. The decoder's self-attention gets
# ``tgt_is_causal=True`` alone, so a causal kernel can run.
#
# The ragged transformer has three attention jobs: the encoder's, the
# decoder's (causal), and cross-attention. For each one, ``compare_backends``
# times every backend for training. ``choose`` takes the fastest where the
# noise rule can tell them apart (:doc:`measuring_ragged_batches`). Otherwise
# it takes ``default_backend``. Each timing ends with its :term:`kernel
# label`: the attention kernel that ran, in brackets.

import copy

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from ragged_site.measuring.compare import compare_backends
from ragged_site.measuring.noise import choose
from ragged_site.measuring.timing import measure
from ragged_site.page import tolerances
from ragged_site.workloads import ragged_batch
from ragged_toolkit.attention import default_backend
from ragged_toolkit.attention.flex import FlexKernel
from ragged_toolkit.batches import from_padded, to_padded

FLEX = FlexKernel()  # the page's compiled FlexAttention, for every flex plan

BENCH = S.bench  # batch, d_model, nhead, dim_ff, layers: read by name
rng = np.random.default_rng(setup.seed)
src, src_off = ragged_batch(
    rng, BENCH["batch"], BENCH["d_model"], max_len=S.max_len, device=DEVICE, dtype=DTYPE
)
tgt, tgt_off = ragged_batch(
    rng, BENCH["batch"], BENCH["d_model"], max_len=S.max_len, device=DEVICE, dtype=DTYPE
)
(src_pad, src_valid), (tgt_pad, tgt_valid) = (
    to_padded(src, src_off),
    to_padded(tgt, tgt_off),
)  # (B, S, E), (B, S)
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
    timings = compare_backends(
        q,
        kv,
        kv,
        spec["q_offsets"],
        spec["kv_offsets"],
        is_causal=spec["is_causal"],
        backward=True,
        min_run_time=S.run_time / 2,
        flex=FLEX,
    )
    chosen[job] = choose(timings, default_backend(DEVICE, DTYPE, q.shape[-1]), f"{job} attention")

# %%
# The benchmark transformer, checked layer by layer
# -------------------------------------------------
# Both sides get the same weights. Both run eagerly, with dropout 0. The
# parity page proved the layers in float32. Here they run in the page's
# dtype, on the chosen backends.
#
# Each of our layers gets what ``torch.nn``'s layer got in float32. It must
# give that layer's output within the tolerance of the dtype. The check goes
# layer by layer because rounding adds up with depth. A tolerance meant for
# one layer is not one for twelve.

from ragged_site.nn_reference import (
    nn_causal_mask,
    load_from_nn,
    make_nn_transformer,
    nn_transformer,
)
from ragged_toolkit.layers import Transformer, plan_transformer


def check_layers(reference, ours, plans, src_off, tgt_off, run_reference):
    """Each layer of ``ours`` (in its dtype) on the input its ``torch.nn`` twin got in
    ``run_reference()``: the twin's output within the dtype tolerance. Returns how many."""
    seen = []  # every torch.nn layer's inputs and output, in the order they ran
    hooks = [
        layer.register_forward_hook(lambda m, args, out: seen.append((args, out)))
        for layer in (*reference.encoder.layers, *reference.decoder.layers)
    ]
    with torch.no_grad():
        run_reference()
        for hook in hooks:
            hook.remove()
        for i, (layer, (args, out)) in enumerate(
            zip((*ours.encoder.layers, *ours.decoder.layers), seen)
        ):
            encoder, dtype = i < len(reference.encoder.layers), layer.norm1.weight.dtype
            x_in = from_padded(args[0], src_off if encoder else tgt_off).to(dtype)
            got = (
                layer(x_in, plans["encoder"])
                if encoder
                else layer(
                    x_in, plans["decoder"], from_padded(args[1], src_off).to(dtype), plans["cross"]
                )
            )
            torch.testing.assert_close(
                got.float(),
                from_padded(out, src_off if encoder else tgt_off),
                **tolerances(dtype),
                msg=lambda m, i=i: f"layer {i}: {m}",
            )
    return len(seen)


torch.manual_seed(setup.seed)
kw, layers = dict(dim_feedforward=BENCH["dim_ff"], dropout=0.0), BENCH["layers"]
nn_full = make_nn_transformer(BENCH["d_model"], BENCH["nhead"], layers, layers, **kw).to(DEVICE)
rg_full = load_from_nn(Transformer(BENCH["d_model"], BENCH["nhead"], layers, layers, **kw), nn_full)
rg_full, plans = rg_full.to(DEVICE, DTYPE), plan_transformer(src_off, tgt_off, **chosen, flex=FLEX)
checked = check_layers(
    nn_full,
    rg_full,
    plans,
    src_off,
    tgt_off,
    lambda: nn_transformer(
        nn_full, tgt_pad.float(), tgt_valid, src_pad.float(), src_valid, mask_tgt_padding=False
    ),
)
print(
    f"benchmark transformer, {checked} layers in {DTYPE}: each gives nn.Transformer's float32 output"
)
nn_full.to(DTYPE)


def steps(module, call, grad_out):
    """The forward pass of ``call(module)``, and its forward and backward."""
    return {
        "forward": lambda: call(module),
        "forward+backward": lambda: (
            module.zero_grad(set_to_none=True),
            call(module).backward(grad_out),
        ),
    }


grad_tgt = torch.randn_like(tgt)
step_fns = {  # side -> {"forward": ..., "forward+backward": ...}
    "padded": steps(
        nn_full,
        lambda m: nn_transformer(m, tgt_pad, tgt_valid, src_pad, src_valid, mask_tgt_padding=False),
        to_padded(grad_tgt, tgt_off)[0],
    ),
    "ragged": steps(rg_full, lambda m: m(src, tgt, plans), grad_tgt),
}

# %%
# The work bound
# --------------
# The :term:`work bound` is the padded side's FLOPs over the ragged side's.
# It is the speedup that skipping padding would give if time followed FLOPs.
# ``model_work`` counts the FLOPs of one layer of width ``E`` and
# feed-forward width ``F``:
#
# * ``8 E^2 + 4 E F`` per encoder token: the four ``E x E`` projections and
#   the two feed-forward matrices, two FLOPs per weight;
# * ``12 E^2 + 4 E F`` per decoder token, with cross-attention's query and
#   output projections, plus ``4 E^2`` per memory token for its keys and
#   values;
# * ``4 E`` per query-key pair: the score and the sum over values.
#
# Under a padding mask, attention scores the whole square of the longest
# sequence. Under a causal kernel, it scores the causal half. Each speedup
# below is printed with its :term:`fraction of the bound`: the speedup over
# the bound.

from ragged_site.measuring.bound import (
    attention_layer_work,
    model_work,
    pairs_scored,
    speedup_line,
    throughput_line,
)
from ragged_site.measuring.tables import print_timings


def transformer_work(model, src_len, tgt_len, *, n_layers, width, padded=False):
    """FLOPs of ``model`` on ``src_len``, ``tgt_len`` (B,) tokens; ``padded``: all as the longest."""
    if padded:
        src_len, tgt_len = (torch.full_like(n, int(n.max())) for n in (src_len, tgt_len))
    enc, dec = (
        model_work(stack, n_layers=n_layers, attention_width=width)
        for stack in (model.encoder, model.decoder)
    )
    kv = (
        n_layers * attention_layer_work(width, cross=True).per_kv_token
    )  # per memory token, not per target token
    src, tgt = float(src_len.sum()), float(tgt_len.sum())
    return (
        enc.per_token * src
        + kv * src
        + (dec.per_token - kv) * tgt
        + enc.per_pair * pairs_scored(src_len, src_len, False)
        + dec.per_pair
        * (pairs_scored(tgt_len, tgt_len, True) + pairs_scored(tgt_len, src_len, False))
    )


sizes = dict(n_layers=layers, width=BENCH["d_model"])
bound = transformer_work(rg_full, src_len, tgt_len, padded=True, **sizes) / transformer_work(
    rg_full, src_len, tgt_len, **sizes
)
for mode in ("forward", "forward+backward"):
    print(f"transformer, {mode}:")
    times = measure(
        {side: step_fns[side][mode] for side in ("padded", "ragged")}, min_run_time=S.run_time
    )
    print_timings(times)
    print(speedup_line(f"transformer, {mode}", times["padded"], times["ragged"], bound))

# %%
# How to read the fraction of the bound. Near 1,
# the ragged model wins back what padding costs in work. Below 1, overheads
# eat part of it: the loop backend makes one attention call per sequence and
# layer, and the bucketed one gathers. Above 1, the padded side is slower
# per unit of work than the packed one. Its larger tensors cost memory
# traffic and allocations, which the bound does not count.

# %%
# Trained end to end
# ------------------
# Parity at initialization says nothing about training. So both models
# learn one task: copy a sequence of random symbols. The lengths come from
# the site's length generator.
#
# The task needs cross-attention. The decoder reads ``[BOS] + source`` and
# predicts ``source + [EOS]``. Its causal self-attention never sees the
# token it must predict next. So for output ``t`` it must find source token
# ``t`` in the encoder's output, through cross-attention.
#
# Token ids: 0 is padding (``torch.nn``'s side only), 1 starts the target,
# 2 ends it. The symbols are ``3 .. VOCAB - 1``.

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
    src, tgt_in, tgt_out = (
        torch.as_tensor(np.concatenate(seqs), device=DEVICE) for seqs in (src, tgt_in, tgt_out)
    )
    return dict(
        src=src,
        src_offsets=offsets_from_lengths(lengths, DEVICE),
        tgt_in=tgt_in,
        tgt_out=tgt_out,
        tgt_offsets=offsets_from_lengths([n + 1 for n in lengths], DEVICE),
    )


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
            plans = plan_transformer(
                b["src_offsets"], b["tgt_offsets"], **self.backends, flex=self.flex
            )
            h = self.core(
                self.embed(b["src"]) + self.pos(token_index(b["src_offsets"])[1]),
                self.embed(b["tgt_in"]) + self.pos(token_index(b["tgt_offsets"])[1]),
                plans,
            )
            return self.head(h), b["tgt_out"]
        src, tgt_in, tgt_out = (
            to_padded(b[ids], b[offsets], PAD)[0]
            for ids, offsets in (
                ("src", "src_offsets"),
                ("tgt_in", "tgt_offsets"),
                ("tgt_out", "tgt_offsets"),
            )
        )
        h = self.core(
            self.embed(src) + self.pos.weight[: src.shape[1]],  # positions 0 .. S - 1
            self.embed(tgt_in) + self.pos.weight[: tgt_in.shape[1]],
            tgt_mask=nn_causal_mask(tgt_in.shape[1], DEVICE),
            tgt_is_causal=True,
            src_key_padding_mask=src == PAD,
            memory_key_padding_mask=src == PAD,
        )
        return self.head(h).flatten(0, 1), tgt_out.flatten()


# %%
# Both models start from the same weights. They see the same batches in the
# same order, with the same optimizer and schedule. They take turns, and
# ``StepTimer`` times each step. The throughput counts real tokens after
# ``WARMUP`` steps.
#
# A ``Run``'s ``step`` is the training step, under autocast in the page's
# dtype. On a GPU, cuDNN plans once per batch shape. So copies of both
# models first meet every batch shape, through that same ``step``: the
# warm-up runs the dtype, autocast and backends of the steps it warms.

from dataclasses import dataclass

from ragged_site.measuring.timing import StepTimer, warm_every_shape


@dataclass
class Run:
    """A model in training: AdamW on a one-cycle schedule; ``losses`` gets each step's loss."""

    model: nn.Module
    losses: list

    def __post_init__(self):
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=S.lr)
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer, S.lr, TRAIN["steps"], pct_start=0.1
        )

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
n_slots = sum(
    TRAIN["batch"] * int(b["src_offsets"].diff().max() + b["tgt_offsets"].diff().max())
    for b in batches
)
print(
    f"{TRAIN['steps']} steps of {TRAIN['batch']} sequences, {n_real:,} real tokens; padded, {n_slots / n_real:.2f}x"
)

WARM_SHAPES = DEVICE == "cuda"  # cuDNN: a plan per shape, built before any timed step
if WARM_SHAPES:
    for warmed in (padded_model, ragged_model):  # a copy of each: the runs start from these weights
        warm_every_shape(
            Run(copy.deepcopy(warmed), []).step,
            batches,
            lambda b: (int(b["src_offsets"].diff().max()), int(b["tgt_offsets"].diff().max())),
        )
losses = {"padded nn.Transformer": [], "ragged Transformer": []}  # the loss of every step
runs = {
    "padded nn.Transformer": Run(padded_model, losses["padded nn.Transformer"]),
    "ragged Transformer": Run(ragged_model, losses["ragged Transformer"]),
}
timers = {kind: StepTimer() for kind in runs}
torch.manual_seed(setup.seed)
for batch in batches:
    for kind, training in runs.items():
        with timers[kind].step(len(batch["src"]) + len(batch["tgt_in"])):
            training.step(batch)

WARMUP, LAST = 5, 20  # steps left out of the throughput; steps the final loss averages
final = {}  # name -> the mean of its first five losses, the mean and spread of its last ones
for name, trained in losses.items():
    final[name] = dict(
        first=np.mean(trained[:5]), mean=np.mean(trained[-LAST:]), std=np.std(trained[-LAST:])
    )
    print(
        f"{name:22s} loss {final[name]['first']:.3f} -> {final[name]['mean']:.3f} +- {final[name]['std']:.3f}"
    )
speed = {kind: timer.tokens_per_s(WARMUP) for kind, timer in timers.items()}
work = {
    side: sum(
        transformer_work(
            ragged_model.core,
            b["src_offsets"].diff().cpu(),
            b["tgt_offsets"].diff().cpu(),
            n_layers=TRAIN["layers"],
            width=TRAIN["d_model"],
            padded=side == "padded",
        )
        for b in batches[WARMUP:]
    )
    for side in ("padded", "ragged")
}
print(
    throughput_line(
        "training",
        speed["ragged Transformer"],
        speed["padded nn.Transformer"],
        work["padded"] / work["ragged"],
    )
)

# %%
# Both must learn. The page stops unless each model's mean loss over its
# last ``LAST`` steps is below 40% of its mean over the first five. A
# uniform guess scores ``ln(VOCAB)``, about 2.9. A model that learned only
# how often each symbol occurs scores about 2.8.
#
# Step by step the losses differ: dropout draws other masks for padded and
# packed tensors, and batches swing. So the page compares means. It stops
# if the two end more than 15% of the padded model's descent apart.

for name, result in final.items():
    assert result["mean"] < 0.4 * result["first"], f"{name} did not learn: {result}"
padded_end, ragged_end = final["padded nn.Transformer"], final["ragged Transformer"]
descent, apart = (
    padded_end["first"] - padded_end["mean"],
    abs(padded_end["mean"] - ragged_end["mean"]),
)
print(
    f"last {LAST} steps: padded {padded_end['mean']:.3f} +- {padded_end['std']:.3f}, ragged "
    f"{ragged_end['mean']:.3f} +- {ragged_end['std']:.3f};\nthe means differ by {apart:.3f}, "
    f"{apart / descent:.1%} of the padded model's descent"
)
assert apart < 0.15 * descent, "the two models end further apart than 15% of their descent"

# %%
# The two loss curves against the time each model spent training. A curve
# that ends further left trained faster.
import matplotlib.pyplot as plt
from ragged_site.figures import FIGURE_STYLE

plt.rcParams.update(FIGURE_STYLE)
fig, ax = plt.subplots(figsize=(8, 5.5), layout="constrained")
for i, (kind, timer) in enumerate(timers.items()):
    ax.plot(
        np.cumsum(timer.seconds),
        losses[kind],
        marker="os"[i],
        ls=("-", "--")[i],
        markevery=max(1, TRAIN["steps"] // 12),
        label=f"{kind}, {speed[kind]:,.0f} real tokens/s",
    )
ax.set(
    xlabel="seconds of training (measured)",
    ylabel="cross-entropy loss",
    yscale="log",
    title=f"Copying ragged sequences, {DEVICE}, {str(DTYPE).removeprefix('torch.')}",
)
fig.legend(loc="outside lower center")  # below the axes, clear of both curves
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# Conclusion
# ----------
# Each attention job ran on the backend measured fastest here, or the
# default. The benchmark transformer met ``torch.nn``'s float32 output
# layer by layer in the page's dtype. Each speedup is printed above beside
# its work bound, measured on this device. Both models learned the copy
# task, their final means within 15% of the padded model's descent.
#
# References
# ----------
# * `nn.Transformer <https://pytorch.org/docs/stable/generated/torch.nn.Transformer.html>`_
# * Vaswani et al., `Attention Is All You Need <https://arxiv.org/abs/1706.03762>`_
