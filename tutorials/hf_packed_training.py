"""
Padding-free training in Hugging Face transformers, correct on every device
============================================================================

Hugging Face's padding-free recipe, ``DataCollatorWithFlattening``, packs a
batch into one row. The row's ``position_ids`` restart at every document. Read
as packed values plus offsets, that row can go through the toolkit's
``ragged_attention``. Registered as a ``transformers`` attention
implementation, it lets a stock ``LlamaForCausalLM`` keep every document apart
on any device. The model then computes what the padded model computes. The page
measures what that buys in training against the padded recipe.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How the batch of ``DataCollatorWithFlattening`` maps to packed values
         and offsets, from ``position_ids`` or from ``cu_seq_lens_q``
       * How to register ``ragged_attention`` with ``AttentionInterface``, so
         that any decoder in ``transformers`` runs it by name
       * When stock ``sdpa`` lets packed documents attend to each other, and
         how to prove (logits, gradients) that the registered one does not
       * What padding-free training buys over the padded recipe, naive and
         length-grouped, each beside its :term:`work bound`

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`transformer_building_blocks` (packed values, offsets,
         ``ragged_attention``); the functions used here are on
         :doc:`the toolkit's reference page </toolkit>`
       * ``transformers`` 4.54 or later (models built from a config in code:
         no download) and PyTorch 2.11 or later; a CPU is enough, a CUDA GPU
         runs the page in ``bfloat16`` through ``varlen_attn``
"""

# sphinx_gallery_tags = ["transformers", "training", "packing", "varlen attention"]

# %%
# Sizes
# -----
# Every size is set here, per device; :term:`quick mode` shrinks them. The
# CPU model is the GPT page's CPU model as a ``LlamaConfig``; a step is
# ``docs_per_batch`` documents. (Real runs: width 2048 and up, thousands of
# documents per step.)

import inspect

import torch
import transformers
from packaging.version import Version
from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(
        model=dict(
            vocab_size=4096,
            hidden_size=1024,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=4,
            intermediate_size=2816,
        ),
        docs_per_batch=128,
        steps=40,
    ),
    "cpu": dict(
        model=dict(
            vocab_size=512,
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=688,
        ),
        docs_per_batch=64,
        steps=24,
    ),
    "quick": dict(
        model=dict(vocab_size=128, hidden_size=64, num_attention_heads=4, intermediate_size=176),
        docs_per_batch=16,
        steps=6,
    ),
}
setup = page_setup(SIZES)
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
MAX_LEN, ZIPF_ALPHA, LR = 1024, 1.2, 3e-3  # longest document, length exponent, AdamW rate
WARMUP_STEPS = 2  # steps left out of the throughput figures
# the oldest release this page supports (make check-versions runs it)
MINIMUM_TRANSFORMERS = "4.54.0"
# a pre-release counts as its release
if Version(transformers.__version__).release < Version(MINIMUM_TRANSFORMERS).release:
    raise RuntimeError(
        f"This page needs transformers {MINIMUM_TRANSFORMERS} or later; this is "
        f"{transformers.__version__}. Upgrade with `pip install -U transformers`."
    )

# %%
# The collator's batch is packed values plus offsets
# --------------------------------------------------
# ``DataCollatorWithFlattening`` concatenates the documents of a batch into one
# row of ``input_ids``, shape ``(1, T)``. It writes ``position_ids`` that
# restart at 0 at every document. Where the release has it,
# ``return_flash_attn_kwargs=True`` adds the boundaries themselves:
# ``cu_seq_lens_q`` and ``cu_seq_lens_k``. They are the toolkit's offsets, as
# FlashAttention names them. Three documents of 3, 1 and 4 tokens:

from ragged_toolkit.batches import from_padded, offsets_from_position_ids, to_padded
from transformers import DataCollatorWithFlattening

collator_options = inspect.signature(DataCollatorWithFlattening).parameters
collator = DataCollatorWithFlattening(
    **({"return_flash_attn_kwargs": True} if "return_flash_attn_kwargs" in collator_options else {})
)
docs = [[5, 9, 2], [7], [3, 3, 8, 1]]
batch = collator([{"input_ids": d} for d in docs])
for key, value in batch.items():
    print(f"{key:13s} {value.tolist() if torch.is_tensor(value) else value}")

# %%
# Sequence ``i`` is ``values[offsets[i]:offsets[i + 1]]``. A document starts
# where its position is 0. ``offsets_from_position_ids`` reads the offsets from
# those starts. They must agree with the collator's own ``cu_seq_lens_q``. From
# the offsets, ``to_padded`` gives the batch in the :term:`padded layout`: one
# row per document, padded to the longest. ``from_padded`` gives the packed row
# back: the :term:`packed layout`, every token in one row, with offsets.
#
# .. literalinclude:: ../ragged_toolkit/batches.py
#    :pyobject: offsets_from_position_ids

values = batch["input_ids"][0]  # (T,)
offsets = offsets_from_position_ids(batch["position_ids"])  # (B + 1,)
if "cu_seq_lens_q" in batch:
    assert torch.equal(offsets, batch["cu_seq_lens_q"].long()), "the two boundaries disagree"
    print("offsets from position_ids:", offsets.tolist(), "= cu_seq_lens_q")
padded, valid = to_padded(values, offsets)  # (B, S) and its mask
assert torch.equal(from_padded(padded, offsets), values)
print("padded:", padded.tolist(), "back to the packed row:", from_padded(padded, offsets).tolist())

# %%
# What attention does with that row is up to the model's
# ``attn_implementation``. The FlashAttention implementations read the
# boundaries (on CUDA, with the ``flash_attn`` package). The others see one
# long sequence, unless ``transformers`` rebuilds the boundaries into a mask.
#
# ``ragged_attention`` as an attention implementation
# ---------------------------------------------------
# A ``transformers`` model looks its attention function up by name in
# ``AttentionInterface``. It passes the module, queries ``(B, H, T, D)``, and
# keys and values ``(B, H_kv, T, D)``. It passes the mask its mask function
# built. Ours, registered under the same name in ``AttentionMaskInterface``,
# builds none. Last come keyword arguments: ``position_ids``, what the batch
# brought (``cu_seq_lens_q``) and what the caller passed to the model.
#
# The toolkit's ``ragged_attention_forward`` views the tensors as packed
# ``(B * T, H, D)``. It calls ``ragged_attention`` with the batch's
# :term:`plan`: what ``plan_batch`` reads once from the offsets (lengths,
# backend, causal or not). The caller builds the plan once per batch
# (``plan_of``) and passes it to the model as ``ragged_plan``. Called without
# one, as ``Trainer`` calls a model, it plans from the boundaries in its
# keyword arguments, once per layer.
#
# .. literalinclude:: ../ragged_toolkit/hf_attention.py
#    :pyobject: ragged_attention_forward
#
# ``sequence_offsets`` reads those boundaries:
#
# .. literalinclude:: ../ragged_toolkit/hf_attention.py
#    :pyobject: sequence_offsets
#
# ``training_backend`` picks the backend: the toolkit's default, where it
# takes grouped-query attention with gradients. On a CUDA GPU in
# ``bfloat16`` that is ``varlen`` (``varlen_attn``, the variable-length
# kernel of FlashAttention). On CPU it is the per-sequence loop. Where a
# release calls attention functions another way, the page stops and names
# what changed. ``check_attention_interface`` checks the stock ``sdpa``
# function first.

from ragged_toolkit.attention import plan_batch
from ragged_toolkit.hf_attention import (
    check_attention_interface,
    no_mask,
    ragged_attention_forward,
    sequence_offsets,
    training_backend,
)
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "ragged_toolkit"
HF = f"transformers {transformers.__version__}"
GQA = S.model["num_attention_heads"] != S.model["num_key_value_heads"]
HEAD_DIM = S.model["hidden_size"] // S.model["num_attention_heads"]
BACKEND = training_backend(DEVICE, DTYPE, HEAD_DIM, gqa=GQA)
check_attention_interface(ALL_ATTENTION_FUNCTIONS["sdpa"])


def plan_of(row):
    """The plan of one collator batch (a packed row): pass it to the model as
    ``ragged_plan``, and every layer's attention call uses it."""
    offsets = sequence_offsets(row, 1, row["input_ids"].shape[-1], row["input_ids"].device)
    return plan_batch(offsets, backend=BACKEND, is_causal=True)


# %%
# The mask function, registered under the same name, builds no mask. It
# passes a padding mask on, for the forward to refuse:
#
# .. literalinclude:: ../ragged_toolkit/hf_attention.py
#    :pyobject: no_mask

AttentionInterface.register(NAME, ragged_attention_forward)
AttentionMaskInterface.register(NAME, no_mask)
print(f"{HF}: attn_implementation={NAME!r} runs ragged_attention, backend {BACKEND!r}")

# %%
# A stock model, three ways
# -------------------------
# A ``LlamaForCausalLM`` is built from a config (random weights, no download).
# Two copies get the same weights. One keeps ``sdpa``, the stock
# implementation; the other runs ours. Any decoder that takes
# ``attn_implementation`` works the same way.

import copy

from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(**S.model, max_position_embeddings=MAX_LEN)
torch.manual_seed(setup.seed)
base = LlamaForCausalLM(config).to(DEVICE)


def with_attention(name):
    """A copy of ``base``, with the same weights, running attention ``name``."""
    model = copy.deepcopy(base)
    model.set_attn_implementation(name)
    return model


stock, ours = with_attention("sdpa"), with_attention(NAME)
print(
    f"LlamaForCausalLM, {sum(p.numel() for p in base.parameters()) / 1e6:.2f} M parameters; "
    f"use_cache={config.use_cache} by default"
)

# %%
# The documents, packed and padded
# --------------------------------
# The document lengths come from the site's length generator, capped at
# ``MAX_LEN``. Each document starts with a token that picks a shift. Every
# later token is a Zipf draw shifted by it. So predicting a token needs the
# document's own start, and reading another document hurts.
#
# Every batch is made in each form before anything is timed. One form is the
# collator's packed row. One is the padded recipe on the documents as they
# came: right-padded ``(B, S)`` ids with an ``attention_mask``, and labels
# ``-100`` at padding. The last is that recipe, length-grouped as
# ``TrainingArguments(group_by_length=True)`` does. Each window of batches is
# sorted by length and cut into batches of neighbors. The window is the one
# ``transformers``' ``LengthGroupedSampler`` picks: ``min(steps // 4, 50)``
# batches. The GPT page's padded baseline uses it too.
#
# .. literalinclude:: ../ragged_toolkit/data.py
#    :pyobject: group_by_length

import numpy as np
from ragged_site.hf_training import shifted_zipf_documents
from ragged_site.workloads import sentence_lengths
from ragged_toolkit.batches import offsets_from_lengths
from ragged_toolkit.data import group_by_length


def packed_batch(docs):
    """The collator's row: input_ids, labels, position_ids (and cu_seq_lens)."""
    row = collator([{"input_ids": d} for d in docs])
    return {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in row.items()}


def padded_batch(docs):
    """The padded recipe: (B, S) ids, attention_mask and labels (-100 at padding)."""
    offsets = offsets_from_lengths([len(d) for d in docs])
    ids, mask = to_padded(torch.tensor([t for d in docs for t in d]), offsets)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, -100)}


rng = np.random.default_rng(setup.seed)
corpus = []  # the documents of each step
for _ in range(S.steps):
    doc_lengths = sentence_lengths(rng, S.docs_per_batch, ZIPF_ALPHA, MAX_LEN)
    corpus.append(shifted_zipf_documents(rng, doc_lengths, S.model["vocab_size"]))
every = [doc for docs in corpus for doc in docs]
WINDOW = max(1, min(S.steps // 4, 50))  # batches per sorted window, as in the sampler
groups = group_by_length([len(doc) for doc in every], S.docs_per_batch, WINDOW, rng)
batches = {
    "packed": [packed_batch(docs) for docs in corpus],
    "padded": [padded_batch(docs) for docs in corpus],
    "grouped": [padded_batch([every[i] for i in group]) for group in groups],
}
real = sum(len(doc) for doc in every)
slots = {
    name: sum(int(b["input_ids"].numel()) for b in batches[name]) for name in ("padded", "grouped")
}
print(
    f"{real} real tokens in {S.steps} batches; padded, {slots['padded']} token slots "
    f"({slots['padded'] / real:.2f}x the tokens);\nlength-grouped in windows of {WINDOW} batches, "
    f"{slots['grouped']} ({slots['grouped'] / real:.2f}x)"
)

# %%
# Proof: the packed model computes what the padded one computes
# -------------------------------------------------------------
# On the first batch, the padded model (stock ``sdpa`` with the
# ``attention_mask``) is the reference. Each document is in its own row, the
# padding masked. The packed row goes through stock ``sdpa`` twice. First it
# keeps the default of the config, ``use_cache=True`` (what a hand-written loop
# gets). Then it sets ``use_cache=False`` (``Trainer``'s default from
# transformers 5.0 on). Last, the row goes through ours, with the batch's plan.
# Each is compared with the reference on every real token.

from ragged_site.hf_training import check_close, check_gradients
from ragged_site.page import tolerances


def autocast():
    return torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32)


packed, padded = batches["packed"][0], batches["padded"][0]
with torch.no_grad(), autocast():
    # (T, vocab): the real tokens
    reference = stock(**padded).logits[padded["attention_mask"].bool()].float()
    logits_of = {
        "sdpa, use_cache=True": stock(**packed, use_cache=True).logits[0].float(),
        "sdpa, use_cache=False": stock(**packed, use_cache=False).logits[0].float(),
        NAME: ours(**packed, ragged_plan=plan_of(packed)).logits[0].float(),
    }
tolerance = tolerances(DTYPE)
gaps = {name: (logits - reference).abs().amax(-1) for name, logits in logits_of.items()}
correct = {
    name: torch.allclose(logits, reference, **tolerance) for name, logits in logits_of.items()
}
for name, gap in gaps.items():
    print(
        f"  {name:22s} largest logit difference {gap.max().item():.2e}, "
        f"{'correct' if correct[name] else 'wrong'}"
    )
check_close(logits_of[NAME], reference, tolerance, f"{NAME} differs from the padded model")
D1, D2 = gaps["sdpa, use_cache=True"].max().item(), gaps[NAME].max().item()
if DTYPE == torch.float32:
    assert D2 < 1e-4, f"{NAME}: largest logit difference {D2:.2e}, not below 1e-4"
across = "keep documents apart" if correct["sdpa, use_cache=True"] else "attend across documents"
print(
    f"{HF}: packed rows with 'sdpa' {across} (largest logit difference {D1:.2f}); "
    f"with ragged_attention {D2:.1e}"
)

# %%
# The figure shows where the differences are. The first document has no
# document before it. So every implementation gets it right (checked below). An
# implementation that attends across documents gets each later one wrong,
# wherever attention crosses a boundary.

import matplotlib.pyplot as plt
from ragged_site.figures import FIGURE_STYLE
from ragged_site.hf_training import draw_logit_gaps

first = len(corpus[0][0])
for name, logits in logits_of.items():
    check_close(logits[:first], reference[:first], tolerance, f"{name}, the first document")
starts = offsets_from_position_ids(packed["position_ids"])[1:-1].tolist()
plt.rcParams.update(FIGURE_STYLE)
draw_logit_gaps(gaps, starts, NAME, f"Packed row against the padded model, {HF}")
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# The lines above are this release's. Where ``use_cache`` is on, the model
# makes a cache for the forward pass. The releases checked here look for
# restarts in ``position_ids`` only without a cache. (The lines above show
# whether this one does.) They turn the restarts into a ``(1, 1, T, T)``
# boolean mask over the packed row. The mask keeps documents apart, but every
# query is scored against every key of the row. The registered function reads
# its plan in both cases.
#
# Two more checks follow. A row of one document twice gives the same logits for
# both copies: the second cannot see the first. And one training step's loss
# and gradients are the padded model's. (The collator's labels are ``-100`` at
# every document's first token.)

twice = packed_batch([max(corpus[0], key=len)] * 2)  # the batch's longest document
half = twice["input_ids"].shape[1] // 2
with torch.no_grad(), autocast():
    copies = {
        "sdpa": stock(**twice, use_cache=True).logits[0].float(),
        NAME: ours(**twice, ragged_plan=plan_of(twice), use_cache=True).logits[0].float(),
    }
for name, logits in copies.items():
    print(
        f"  {name:14s} two identical documents: largest difference between the copies "
        f"{(logits[:half] - logits[half:]).abs().max().item():.2e}"
    )
check_close(copies[NAME][half:], copies[NAME][:half], tolerance, f"{NAME}: the second copy differs")

for model in (stock, ours):
    model.zero_grad(set_to_none=True)
with autocast():
    loss_ours = ours(**packed, ragged_plan=plan_of(packed)).loss
    loss_padded = stock(**padded).loss
torch.autograd.backward([loss_ours, loss_padded])
check_close(loss_ours, loss_padded, tolerance, f"{NAME}: the packed loss is not the padded one")
n_tensors, grad_gap = check_gradients(ours, stock, tolerance)
print(
    f"loss {loss_ours.item():.4f} packed with {NAME}, {loss_padded.item():.4f} padded;\n"
    f"gradients of all {n_tensors} parameter tensors agree (largest difference {grad_gap:.1e})"
)

# %%
# Training against what readers run
# ---------------------------------
# The same model and optimizer (AdamW) train five ways. They take turns step by
# step, so that a busy machine slows all alike:
#
# * ``padded``: right-padded rows, an ``attention_mask``, stock ``sdpa``.
#   This is the recipe most readers use.
# * ``grouped``: the same, length-grouped.
# * ``ragged``: the packed rows through the registered ``ragged_attention``.
#   The batch's plan is built inside the timed step.
# * ``packed sdpa`` and ``packed sdpa, cache``: the packed rows through stock
#   ``sdpa``. The first sets ``use_cache=False`` (as ``Trainer`` runs it in
#   transformers 5). The second keeps ``True`` (the default of the config).
#   Each is marked with what the proof found.
#
# All but ``grouped`` see the same batches. ``grouped`` sees the same documents
# in other batches. A step (forward, backward, the optimizer's update) is timed
# with a synchronized clock. Throughput counts *real* tokens after the first
# ``WARMUP_STEPS``.

from ragged_site.hf_training import check_losses, train_taking_turns

verdict = {
    cache: f"use_cache={cache}, "
    + ("correct" if correct[f"sdpa, use_cache={cache}"] else "WRONG (across documents)")
    for cache in (False, True)
}
TRAINERS = {
    "padded": dict(
        attention="sdpa", form="padded", use_cache=False, label="sdpa with attention_mask"
    ),
    "grouped": dict(
        attention="sdpa", form="grouped", use_cache=False, label="the same, length-grouped"
    ),
    "ragged": dict(attention=NAME, form="packed", use_cache=False, label="ragged_attention"),
    "packed sdpa": dict(attention="sdpa", form="packed", use_cache=False, label=verdict[False]),
    "packed sdpa, cache": dict(
        attention="sdpa", form="packed", use_cache=True, label=verdict[True]
    ),
}


def loss_of(run, model, batch):  # the plan of a packed row is built here, inside the timed step
    plan = {"ragged_plan": plan_of(batch)} if run["attention"] == NAME else {}
    with autocast():
        return model(**batch, **plan, use_cache=run["use_cache"]).loss


# on CUDA, every trainer meets every batch shape before any timing
runs = train_taking_turns(
    TRAINERS, batches, with_attention, loss_of, steps=S.steps, lr=LR, skip=WARMUP_STEPS
)
for name, run in runs.items():
    print(
        f"{name:18s} {run['tokens/s']:7,.0f} tokens/s, loss {run['losses'][0]:.3f} -> "
        f"{run['losses'][-1]:.3f}, {run['label']}"
    )

# %%
# The padded and the ragged trainer compute the same thing (checked above). So
# their losses differ by rounding only: in float32, below 1e-3 at every step.
# In a 16-bit dtype, one step's rounding changes the next step's weights. There
# the page checks the first step's losses within the tolerance of the dtype. It
# checks the means of the last five steps within 5%.

print(check_losses(runs["ragged"]["losses"], runs["padded"]["losses"], DTYPE, tolerance))

# %%
# The work bounds of this run
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The :term:`work bound` is a padded trainer's work over the ragged one's: the
# speedup to expect if time followed work. ``model_work`` counts what each
# trainer must compute per real token over its timed batches. It counts ``2 x``
# the weights of every matrix per token (all but the embedding). It adds
# ``4 H D`` per query-key pair and layer. The ragged side scores the causal
# half of each document. A padded side's merged ``attention_mask`` makes
# ``sdpa`` score the whole ``S x S`` square of every row. Those squares are
# counted from each padded trainer's own batches. The last number of a line is
# the :term:`fraction of the bound`: the speedup over the work bound
# (:doc:`measuring_ragged_batches`).

from ragged_site.hf_training import draw_training
from ragged_site.measuring.bound import model_work, throughput_line, work_per_token

work = model_work(
    base, n_layers=S.model["num_hidden_layers"], attention_width=S.model["hidden_size"]
)
lengths = {
    "padded": [torch.tensor([len(doc) for doc in docs]) for docs in corpus[WARMUP_STEPS:]],
    "grouped": [torch.tensor([len(every[i]) for i in group]) for group in groups[WARMUP_STEPS:]],
}
ragged_work = work_per_token(lengths["padded"], work)  # the same documents as the padded trainer
bound = {
    name: work_per_token(lengths[name], work, padded=True, causal=False) / ragged_work
    for name in lengths
}
R, P, G = (runs[name]["tokens/s"] for name in ("ragged", "padded", "grouped"))
print(throughput_line("hf training", R, P, bound["padded"]))
print(throughput_line("hf training against length-grouped padding", R, G, bound["grouped"]))

# %%
# Next: what grouping by length leaves of the padding's work, and where the
# packed ``sdpa`` trainers ended beside the ragged one. With the ``(T, T)``
# mask, attention scores every pair of the row. That work grows with the row's
# square. The ragged side's grows with the sum of the documents' squares. A
# trainer that reads across documents learns from other documents' tokens.

share = (bound["grouped"] - 1) / (bound["padded"] - 1)  # the extra work grouping leaves
print(
    f"length-grouped padding leaves {share:.0%} of the extra work of naive padding (bounds "
    f"{bound['grouped']:.2f}x and {bound['padded']:.2f}x):\ngrouping removes "
    + ("most of it, packing the rest" if share < 0.5 else "less than half of it")
)
end = {name: np.mean(run["losses"][-5:]) for name, run in runs.items()}
for name in ("packed sdpa", "packed sdpa, cache"):
    print(
        f"{name:18s} last five losses {end[name]:.3f} (ragged {end['ragged']:.3f}), "
        f"{runs[name]['tokens/s'] / R:.2f}x its tokens/s: {runs[name]['label']}"
    )

draw_training(runs, DEVICE)
plt.show()

# %%
# On a GPU
# --------
# On CUDA the registered function runs ``varlen_attn`` in ``bfloat16``. Where
# the ``flash_attn`` package is installed, it is compared with
# ``transformers``' ``flash_attention_2``. The profiler names the kernels that
# one training step of the registered model ran. They print as a
# :term:`kernel label`: each kernel with its call count, in brackets
# (``flash varlen`` on a GPU):

import importlib.util

from ragged_site.measuring.timing import profile_call


# one training step
_, kernels = profile_call(lambda: loss_of(runs["ragged"], ours, packed).backward())
print(f"one training step with {NAME}: backend {BACKEND!r}, kernels [{kernels}]")
if DEVICE != "cuda":
    print("flash_attention_2 needs a CUDA GPU: not compared here")
elif importlib.util.find_spec("flash_attn") is None:
    print("the flash_attn package is not installed: flash_attention_2 not compared")
else:
    flash = with_attention("flash_attention_2")
    with torch.no_grad(), autocast():
        logits_flash = flash(**packed).logits[0].float()
        logits_ours = ours(**packed, ragged_plan=plan_of(packed)).logits[0].float()
    torch.testing.assert_close(logits_ours, logits_flash, **tolerance)
    print(
        f"{NAME} and flash_attention_2 agree on the packed row (largest logit difference "
        f"{(logits_ours - logits_flash).abs().max().item():.2e})"
    )

# %%
# Conclusion
# ----------
# The collator's packed row is the toolkit's packed values plus offsets.
# ``transformers`` hands both, and the caller's plan, to any attention function
# it has by name. Registered there, ``ragged_attention`` keeps documents apart
# on every device without a mask, with the padded model's logits and gradients.
# Stock ``sdpa`` keeps them apart only where the proof printed so, through a
# mask over the whole row. The two training lines say what packing bought here,
# against naive and length-grouped padding.
#
# Further reading
# ---------------
# * `Attention interface <https://huggingface.co/docs/transformers/en/attention_interface>`_
#   in the ``transformers`` documentation
# * `Packing with FlashAttention 2 <https://huggingface.co/blog/packing-with-FA2>`_
#   (``DataCollatorWithFlattening``)
# * :doc:`packed_gpt_training`: the same training without ``transformers``
