"""
A hybrid model, packed: training it and decoding from its state
===============================================================

A small hybrid, stacked as Qwen3-Next stacks its layers: Gated DeltaNet layers
with an attention layer every four. It trains packed on real text, against the
same model right-padded, from the same weights. Then it decodes from the
recurrent layers' state. That state is the whole cache a request needs.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How a recurrent block reads the offsets from the plan that
         attention reads, in one packed model
       * Packed against padded training of a hybrid: the first step's loss
         and gradients proved equal, then tokens per second beside the
         :term:`work bound`
       * Decoding from the state: a fixed size per request and layer,
         whatever its length, proved against the packed layer

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`packed_recurrent_layers` (the layers and their cuts at every
         document start) and :doc:`packed_gpt_training` (the site's GPT)
       * PyTorch 2.11 or later; a CPU is enough
"""

# sphinx_gallery_tags = ["linear attention", "state-space models", "Gated DeltaNet", "training"]

# %%
# Sizes
# -----
# Every size is set here, per device. :term:`Quick mode <quick mode>`
# (``TUTORIALS_QUICK=1``, for the test suite) shrinks them. The recurrent
# layers have ``heads`` heads of ``head_dim``, in chunks of ``chunk`` tokens.
# The hybrid trains on ``train_tokens`` bytes of the first ``corpus_documents``
# docstrings. A step holds ``step_tokens`` tokens (real runs: 4096 to 65536).

import copy

import numpy as np
import torch
from ragged_site.page import page_setup, tolerances
from ragged_site.measuring.bound import fraction_verdict, throughput_line
from ragged_toolkit.batches import offsets_from_lengths

SIZES = {
    "cuda": dict(
        embed=1024,
        heads=16,
        head_dim=64,
        chunk=64,
        max_len=1024,
        step_tokens=4096,
        train_tokens=196608,
        corpus_documents=2000,
        lr=1e-3,
        model=dict(
            vocab_size=256,
            dim=512,
            n_layers=4,
            n_heads=8,
            n_kv_heads=4,
            ffn_hidden=1408,
            max_seq_len=1024,
        ),
    ),
    "cpu": dict(
        embed=128,
        heads=4,
        head_dim=32,
        chunk=64,
        max_len=512,
        step_tokens=2048,
        train_tokens=32768,
        corpus_documents=600,
        lr=3e-3,
        model=dict(
            vocab_size=256,
            dim=64,
            n_layers=4,
            n_heads=4,
            n_kv_heads=2,
            ffn_hidden=128,
            max_seq_len=512,
        ),
    ),
    "quick": dict(step_tokens=1024, train_tokens=8192, corpus_documents=200),
}
setup = page_setup(SIZES)  # device, dtype, quick mode, one CPU thread, seed; prints them
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
C, H, D = S.chunk, S.heads, S.head_dim
rng = np.random.default_rng(setup.seed)

# %%
# Training a hybrid
# -----------------
# The hybrid is stacked as Qwen3-Next stacks its layers. It is the site's
# GPT with a Gated DeltaNet layer in place of attention in three blocks of
# four. Attention reads the batch's :term:`plan`: what ``plan_batch`` reads
# once from the offsets. A recurrent block reads the offsets from that same
# plan:
#
# .. literalinclude:: ../ragged_toolkit/hybrid.py
#    :pyobject: RecurrentBlock
#
# It trains on the standard library's docstrings as bytes. They are cut into
# steps of ``step_tokens`` tokens, as :doc:`packed_gpt_training` cuts its
# rows. Each step runs in two layouts, with the same sequences and from the
# same weights:
#
# * the :term:`packed layout`: every token in one row, with offsets;
# * the :term:`padded layout`: each sequence in its own row, right-padded to
#   the longest.
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
stream, stream_offsets = pack_documents(
    [corpus[i] for i in rng.permutation(len(corpus))], max_len=S.max_len
)
assert len(stream) >= S.train_tokens, (
    f"{len(stream)} tokens in the corpus, {S.train_tokens} asked for"
)
steps = [
    (t.to(DEVICE), o.to(DEVICE))
    for t, o in split_by_token_budget(stream, stream_offsets, S.step_tokens)[
        : S.train_tokens // S.step_tokens
    ]
]
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
print(
    f"attention in block {hybrid.attention_layers}; first step: loss {float(first[False][0]):.4f} packed, "
    f"{float(first[True][0]):.4f} padded, all {len(first[True]) - 1} gradients agree"
)

# %%
# The two trainers take turns, one step each, with AdamW. Both run eager:
# compiling would not pay back in a few steps on a CPU.
#
# The :term:`work bound` is the padded side's work over the packed side's:
# the speedup to expect if time followed work. It counts two FLOPs per
# weight per token (``model_work``). For the attention layer it adds four
# times its width per query-key pair, the causal half on both sides. The
# recurrence's own work is the same per token on both sides, and is left
# out. Leaving it out can only raise the bound. So the printed
# :term:`fraction of the bound`, the speedup over the bound, is if anything
# low.
#
# On a GPU, throwaway copies of both first meet every step's shape, through
# the same training step. cuDNN builds its own plan for each new shape. That
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
work = model_work(
    hybrid, n_layers=len(hybrid.attention_layers), attention_width=cfg.n_heads * cfg.head_dim
)
timed_lengths = [offsets_i.diff().cpu() for tokens_i, offsets_i in steps[WARMUP:]]
train_bound = work_per_token(timed_lengths, work, padded=True) / work_per_token(timed_lengths, work)
rate = {way: TRAINED[way][0].tokens_per_s(WARMUP) for way in WAYS}
print(
    throughput_line(
        "hybrid training", rate["packed"], rate["padded"], train_bound, names=("packed", "padded")
    )
)
print(fraction_verdict("hybrid training", rate["packed"] / rate["padded"] / train_bound))

# %%
# Decoding: the state is the cache
# --------------------------------
# An attention layer keeps every past key and value. A recurrent layer keeps
# its state ``(H, K, V)`` and the convolution's last three inputs, whatever
# the request's length. ``prefill`` runs packed prompts and returns each
# document's final state as the cache. ``step`` adds a token per request:
#
# .. literalinclude:: ../ragged_toolkit/recurrent.py
#    :pyobject: _RecurrentLayer.step
#
# Proof: four tokens decoded after each document of the row of eight equal
# the packed layer run over the longer documents.

from ragged_toolkit.recurrent import GatedDeltaLayer, ScalarDecayLayer

LENGTHS = [40, 1, 23, 150, 7, 35, 64, 20]  # a row of eight documents, 340 tokens
torch.manual_seed(setup.seed)
layers = {
    "scalar decay": ScalarDecayLayer(S.embed, H, D, key_heads=H // 2, chunk=C).to(DEVICE),
    "gated delta": GatedDeltaLayer(S.embed, H, D, key_heads=H // 2, chunk=C).to(DEVICE),
}
NEW = 4
prompt_offsets = offsets_from_lengths(LENGTHS, DEVICE)
prompts = torch.randn(sum(LENGTHS), S.embed, device=DEVICE)  # (T, E): a packed batch of prompts
more = torch.randn(
    NEW, len(LENGTHS), S.embed, device=DEVICE
)  # (steps, B, E): one token per request
longer_offsets = offsets_from_lengths([n + NEW for n in LENGTHS], DEVICE)
longer = torch.cat(
    [
        torch.cat([prompts[a:b], more[:, i]])
        for i, (a, b) in enumerate(zip(prompt_offsets[:-1].tolist(), prompt_offsets[1:].tolist()))
    ]
)
new_rows = (
    longer_offsets[1:, None] - torch.arange(NEW, 0, -1, device=DEVICE)
).flatten()  # (B * NEW,)
CACHES = {}
with torch.no_grad():
    for kind, mixer in layers.items():
        _, cache = mixer.prefill(prompts, prompt_offsets)
        decoded = []
        for t in range(NEW):
            out, cache = mixer.step(more[t], cache)
            decoded.append(out)
        CACHES[kind] = cache
        torch.testing.assert_close(
            torch.stack(decoded, 1).flatten(0, 1),
            mixer(longer, longer_offsets)[new_rows],
            **tolerances(torch.float32),
        )
        print(
            f"{kind}: {NEW} tokens decoded after each of {len(LENGTHS)} documents from its state,\n"
            f"  equal to the packed layer over the longer documents"
        )

# %%
# Next, the bytes per request and layer at the sizes of Qwen3-Next-80B-A3B
# (``Qwen3NextConfig``'s defaults). Attention keeps keys and values in
# ``bfloat16`` (2 heads of 256). Gated DeltaNet keeps a ``float32`` state
# (32 heads of 128 by 128) and three convolution inputs in ``bfloat16``.

kv_per_token = 2 * 2 * 256 * 2  # k and v, 2 heads of 256, 2 bytes each
state_bytes = (
    32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2
)  # the state; q, k, v of 3 tokens
for context in (1024, 32768, 262144):
    print(
        f"context {context:6d}: attention layer {kv_per_token * context / 2**20:7.1f} MiB, "
        f"recurrent layer {state_bytes / 2**20:5.2f} MiB per request"
    )
held = CACHES["gated delta"]  # the page's own layer, in float32: counted the same way
assert (
    sum(t[0].numel() * t.element_size() for t in (held.state, held.conv))
    == H * D * D * 4 + 3 * layers["gated delta"].channels * 4
)

# %%
# Conclusion
# ----------
# A hybrid model packs as a transformer does. The recurrent blocks read the
# offsets from the plan that attention reads. They cut their state and
# convolution at every document start. Packed and padded training agree on
# the first step. The rate above says what packing is worth here. A request
# decoding through a recurrent layer needs its state, not its history.
#
# References
# ----------
# * Yang et al., `Gated Delta Networks <https://arxiv.org/abs/2412.06464>`_,
#   `the delta rule in parallel <https://arxiv.org/abs/2406.06484>`_ (the WY
#   form), `Gated Linear Attention <https://arxiv.org/abs/2312.06635>`_
# * Dao and Gu, `Mamba-2 <https://arxiv.org/abs/2405.21060>`_;
#   `flash-linear-attention <https://github.com/fla-org/flash-linear-attention>`_
