"""
Padding-free training in Hugging Face transformers, correct on every device
============================================================================

Hugging Face's padding-free recipe, ``DataCollatorWithFlattening``, packs a
batch into one row whose ``position_ids`` restart at every document. Read as
packed values plus offsets, that row can go through the toolkit's
``ragged_attention``, registered as a ``transformers`` attention
implementation: a stock ``LlamaForCausalLM`` then keeps every document
apart on any device and computes what the padded model computes; the page
measures what that buys in training against the padded recipe.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * How the batch of ``DataCollatorWithFlattening`` maps to packed values
         and offsets, from ``position_ids`` or from ``cu_seq_lens_q``
       * How to register ``ragged_attention`` with ``AttentionInterface``, so
         that any decoder in ``transformers`` runs it by name
       * When the stock ``sdpa`` implementation lets packed documents attend
         to each other, and how to prove, logits and gradients, that the
         registered one does not
       * What padding-free training buys over the padded recipe, beside the
         :term:`work bound`

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
# The collator's batch is packed values plus offsets
# --------------------------------------------------
# ``DataCollatorWithFlattening`` concatenates the documents of a batch into
# one row of ``input_ids``, shape ``(1, T)``, and writes ``position_ids``
# that restart at 0 at every document. Where the release has it,
# ``return_flash_attn_kwargs=True`` adds the boundaries themselves,
# ``cu_seq_lens_q`` and ``cu_seq_lens_k``: the toolkit's offsets under
# the name FlashAttention gives them. Three documents of 3, 1 and 4 tokens:

import inspect

import torch
import transformers
from ragged_toolkit.batches import from_padded, offsets_from_position_ids, to_padded
from transformers import DataCollatorWithFlattening

MINIMUM_TRANSFORMERS = "4.54.0"  # the oldest release this page supports (make check-versions runs it)


def release(version):
    """'5.23.0' -> (5, 23, 0); a local or pre-release suffix is ignored."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())


if release(transformers.__version__) < release(MINIMUM_TRANSFORMERS):
    raise RuntimeError(
        f"This page needs transformers {MINIMUM_TRANSFORMERS} or later; this is "
        f"{transformers.__version__}. Upgrade with `pip install -U transformers`.")

collator_options = inspect.signature(DataCollatorWithFlattening).parameters
collator = DataCollatorWithFlattening(
    **({"return_flash_attn_kwargs": True} if "return_flash_attn_kwargs" in collator_options
       else {}))
docs = [[5, 9, 2], [7], [3, 3, 8, 1]]
batch = collator([{"input_ids": d} for d in docs])
for key, value in batch.items():
    print(f"{key:13s} {value.tolist() if torch.is_tensor(value) else value}")

# %%
# Sequence ``i`` is ``values[offsets[i]:offsets[i + 1]]``, and a document
# starts where its position is 0: ``offsets_from_position_ids`` reads the
# offsets from that, and they must agree with the collator's own
# ``cu_seq_lens_q``. From the offsets, ``to_padded`` gives the padded batch
# (one row per document) and ``from_padded`` the packed row back.
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
print("padded:", padded.tolist())
print("back to the packed row:", from_padded(padded, offsets).tolist())

# %%
# What attention does with that row is up to the model's
# ``attn_implementation``. The FlashAttention implementations read the
# boundaries (CUDA, and the ``flash_attn`` package); the others see one
# long sequence, unless ``transformers`` rebuilds the boundaries into a mask
# itself, which the page measures below. The toolkit's ``ragged_attention``
# takes exactly this batch, on every device.
#
# Sizes
# ~~~~~
# Every size is set here, per device; :term:`quick mode` shrinks them. The
# CPU model is the GPT page's CPU model as a ``LlamaConfig``: width 256, two
# layers, 8 query heads sharing 2 key/value heads. (Real runs: width 2048
# and up, thousands of documents per step.)

import numpy as np
from ragged_toolkit.device import default_device, default_dtype, quick_mode
from ragged_toolkit.measuring.timing import TIMING_THREADS
from ragged_toolkit.device import quiet_known_notes

DEVICE = default_device()
DTYPE = default_dtype(DEVICE)
# One CPU thread, as every timing of the site uses (TIMING_THREADS).
torch.set_num_threads(TIMING_THREADS)
QUICK = quick_mode()
SEED = 0
if DEVICE == "cuda":
    MODEL = dict(vocab_size=4096, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=4, intermediate_size=2816)
    DOCS_PER_BATCH, STEPS = 128, 40
else:
    MODEL = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=688)
    DOCS_PER_BATCH, STEPS = 64, 24
if QUICK:
    MODEL.update(vocab_size=128, hidden_size=64, num_attention_heads=4, intermediate_size=176)
    DOCS_PER_BATCH, STEPS = 16, 6
MAX_LEN, ZIPF_ALPHA, LR = 1024, 1.2, 3e-3  # longest document, length exponent, AdamW rate
WARMUP_STEPS = 2  # steps left out of the throughput figures
print(f"PyTorch {torch.__version__}, transformers {transformers.__version__}, "
      f"device: {DEVICE}, dtype: {DTYPE}, quick: {QUICK}")
print("model: " + ", ".join(f"{k} {v}" for k, v in list(MODEL.items())[:3]))
print("       " + ", ".join(f"{k} {v}" for k, v in list(MODEL.items())[3:]))
print(f"{STEPS} steps of {DOCS_PER_BATCH} documents")

# sphinx_gallery_start_ignore
quiet_known_notes()
# sphinx_gallery_end_ignore

# %%
# ``ragged_attention`` as an attention implementation
# ---------------------------------------------------
# A ``transformers`` model looks its attention function up by name in
# ``AttentionInterface``, and calls it with the module, queries
# ``(B, H, T, D)``, keys and values ``(B, H_kv, T, D)`` (fewer heads with
# grouped-query attention), the mask its mask function built, and keyword
# arguments that include the model's ``position_ids`` and whatever the batch
# brought, such as ``cu_seq_lens_q``. It returns ``(B, T, H, D)``. The
# function below reads the boundaries from those keyword arguments, views
# the tensors as packed ``(B * T, H, D)``, and calls ``ragged_attention``
# with the key/value heads as the model made them (the loop backend shares
# them through SDPA's ``enable_gqa``; ``varlen_attn`` takes ``enable_gqa``
# where its release has it, and gets them repeated where not). The backend
# is the toolkit's default where it takes grouped-query attention with
# gradients: ``varlen`` on a CUDA GPU in ``bfloat16`` (``varlen_attn``, the
# variable-length kernel of FlashAttention), the per-sequence loop on CPU.
#
# The model builds its mask with the function ``AttentionMaskInterface``
# holds under the same name; ours builds none. Both are registered under
# one name, and the check below stops the page, naming what changed, where
# a release calls attention functions another way.

from ragged_toolkit.attention import backend_support, default_backend, ragged_attention
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "ragged_toolkit"
HF = f"transformers {transformers.__version__}"
GQA = MODEL["num_attention_heads"] != MODEL["num_key_value_heads"]
BACKEND = next(name for name in (default_backend(DEVICE, DTYPE), "bucketed", "loop")
               if backend_support(name, DEVICE, DTYPE, is_causal=True, needs_grad=True,
                                  gqa=GQA) is None)


def interface_changed(what):
    return RuntimeError(f"{HF} has changed its attention interface: {what}. This page needs "
                        "attention functions called as (module, query (B, H, T, D), key, value, "
                        "attention_mask, **kwargs), as the release this page was written for calls them")


expected = ["module", "query", "key", "value", "attention_mask"]
called_with = list(inspect.signature(ALL_ATTENTION_FUNCTIONS["sdpa"]).parameters)[:5]
if called_with != expected:
    raise interface_changed(f"its sdpa function takes {called_with}, not {expected}")


def sequence_offsets(kwargs, batch, tokens, device):
    """(B + 1,) offsets over the B * T tokens of the rows: from ``cu_seq_lens_q``
    where the batch brought it, else where ``position_ids`` restart at 0."""
    if kwargs.get("cu_seq_lens_q") is not None:
        offsets = kwargs["cu_seq_lens_q"].to(device, torch.long)
    elif kwargs.get("position_ids") is not None:
        position_ids = kwargs["position_ids"]  # (B, T) or (1, T)
        if position_ids.shape[-1] != tokens:
            raise interface_changed(f"position_ids of shape {tuple(position_ids.shape)} for "
                                    f"queries of {tokens} tokens: not (B, H, T, D)")
        offsets = offsets_from_position_ids(position_ids.expand(batch, -1))
    else:
        raise interface_changed("the attention function got neither cu_seq_lens_q nor "
                                "position_ids")
    if int(offsets[-1]) != batch * tokens:
        raise interface_changed(f"boundaries up to {int(offsets[-1])} for {batch} x {tokens} "
                                "tokens")
    return offsets


def ragged_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                             scaling=None, is_causal=None, **kwargs):
    """transformers' attention call on the toolkit: query (B, H, T, D), key and
    value (B, H_kv, T, D) -> (B, T, H, D), attention within each document."""
    if attention_mask is not None:
        raise ValueError(f"{NAME} takes packed rows (DataCollatorWithFlattening), "
                         "not a padding mask")
    if dropout:
        raise ValueError(f"{NAME} has no attention dropout; set attention_dropout=0")
    if query.dim() != 4 or key.shape[:1] + key.shape[2:] != query.shape[:1] + query.shape[2:]:
        raise interface_changed(f"query {tuple(query.shape)} and key {tuple(key.shape)} are "
                                "not (B, H, T, D) and (B, H_kv, T, D)")
    B, H, T, D = query.shape
    offsets = sequence_offsets(kwargs, B, T, query.device)
    q, k, v = (t.transpose(1, 2).reshape(B * T, -1, D) for t in (query, key, value))
    # under autocast the rotary embedding returns q and k in float32: all in the dtype of v
    q, k = q.to(v.dtype), k.to(v.dtype)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = ragged_attention(q, k, v, offsets, is_causal=causal, scale=scaling, backend=BACKEND)
    return out.view(B, T, H, D), None


def no_mask(*args, attention_mask=None, **kwargs):
    """The mask function for ``NAME``: none, unless the batch has padding, which
    ``ragged_attention_forward`` then refuses."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


AttentionInterface.register(NAME, ragged_attention_forward)
AttentionMaskInterface.register(NAME, no_mask)
print(f"{HF}: attn_implementation={NAME!r} runs ragged_attention, backend {BACKEND!r}")

# %%
# A stock model, three ways
# -------------------------
# A ``LlamaForCausalLM`` built from a config (random weights, no download),
# and two copies of it with the same weights: one keeps ``sdpa``, the
# stock implementation on every device, the other runs ours. Any decoder in
# ``transformers`` that takes ``attn_implementation`` works the same way.

import copy

from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(**MODEL, max_position_embeddings=MAX_LEN)
torch.manual_seed(SEED)
base = LlamaForCausalLM(config).to(DEVICE)


def with_attention(name):
    """A copy of ``base``, with the same weights, running attention ``name``."""
    model = copy.deepcopy(base)
    model.set_attn_implementation(name)
    return model


stock, ours = with_attention("sdpa"), with_attention(NAME)
n_params = sum(p.numel() for p in base.parameters())
print(f"LlamaForCausalLM, {n_params / 1e6:.2f} M parameters; use_cache={config.use_cache} "
      "by default")

# %%
# The documents, packed and padded
# --------------------------------
# The document lengths come from the site's length generator, capped at
# ``MAX_LEN``. Each document starts with a token that picks a shift, and
# every later token is a Zipf draw shifted by it: predicting a token needs
# the document's own start, so reading another document hurts. Every batch
# is made in both forms once, before anything is timed: the collator's
# packed row, and the padded recipe, right-padded ``(B, S)`` ids with an
# ``attention_mask`` and the labels ``-100`` at padding.

from ragged_toolkit.batches import offsets_from_lengths, sentence_lengths


def documents(rng, lengths, vocab):
    """Token ids of one document per length: the first picks a shift, every
    later one is a Zipf(1.5) draw plus that shift (mod ``vocab``)."""
    out = []
    for n in lengths.tolist():
        shift = int(rng.integers(vocab))
        draws = (rng.zipf(1.5, size=n - 1) - 1 + shift) % vocab
        out.append([shift, *draws.tolist()])
    return out


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


rng = np.random.default_rng(SEED)
corpus = [documents(rng, sentence_lengths(rng, DOCS_PER_BATCH, ZIPF_ALPHA, MAX_LEN),
                    MODEL["vocab_size"]) for _ in range(STEPS)]
batches = [(packed_batch(d), padded_batch(d)) for d in corpus]
real = sum(int(p["input_ids"].numel()) for p, _ in batches)
slots = sum(int(b["input_ids"].numel()) for _, b in batches)
print(f"{real} real tokens in {STEPS} batches; padded, {slots} token slots "
      f"({slots / real:.2f}x the tokens)")

# %%
# Proof: the packed model computes what the padded one computes
# -------------------------------------------------------------
# On the first batch, the padded model (stock ``sdpa`` with the
# ``attention_mask``) is the reference: each document in its own row, the
# padding masked. The packed row goes through the stock ``sdpa``
# implementation twice, with the default of the config, ``use_cache=True`` (what a
# hand-written loop gets) and with ``use_cache=False`` (what ``Trainer``
# sets from transformers 5.0 on: ``TrainingArguments.use_cache`` is
# ``False`` by default), then through ours.
# Each is compared with the reference on every real token.

from ragged_toolkit.device import tolerances


def autocast():
    return torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32)


packed, padded = batches[0]
real_tokens = padded["attention_mask"].bool()  # (B, S), True on real tokens
with torch.no_grad(), autocast():
    reference = stock(**padded).logits[real_tokens].float()  # (T, vocab)
    logits_of = {"sdpa, use_cache=True": stock(**packed, use_cache=True).logits[0].float(),
                 "sdpa, use_cache=False": stock(**packed, use_cache=False).logits[0].float(),
                 NAME: ours(**packed).logits[0].float()}
tolerance = tolerances(DTYPE)
gaps = {name: (logits - reference).abs().amax(-1) for name, logits in logits_of.items()}
correct = {name: torch.allclose(logits, reference, **tolerance)
           for name, logits in logits_of.items()}
for name, gap in gaps.items():
    print(f"  {name:22s} largest logit difference {gap.max().item():.2e}, "
          f"{'correct' if correct[name] else 'wrong'}")
torch.testing.assert_close(logits_of[NAME], reference, **tolerance,
                           msg=lambda m: f"{NAME} differs from the padded model: {m}")
D1, D2 = gaps["sdpa, use_cache=True"].max().item(), gaps[NAME].max().item()
if DTYPE == torch.float32:
    assert D2 < 1e-4, f"{NAME}: largest logit difference {D2:.2e}, not below 1e-4"
print(f"{HF}: packed rows with 'sdpa' attend across documents (largest logit difference "
      f"{D1:.2f}); with ragged_attention {D2:.1e}")

# %%
# The figure shows where the differences are: the first document has no
# document before it, so it is right whatever the implementation; every
# later one is wrong wherever attention crosses a boundary.

import matplotlib.pyplot as plt
from ragged_toolkit.figures import FIGURE_STYLE

plt.rcParams.update(FIGURE_STYLE)
fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
floor = 1e-9  # a difference of exactly 0 drawn at the bottom of the log scale
for (name, gap), style in zip(gaps.items(), ("-", "--", "-")):
    label = f"{name} (ragged_attention)" if name == NAME else name
    ax.plot(gap.clamp(min=floor).cpu(), style, label=label, lw=1.2)
for start in offsets_from_position_ids(packed["position_ids"])[1:-1].tolist():
    ax.axvline(start, color="0.85", lw=0.6, zorder=0)
ax.set(yscale="log", xlabel="token of the packed row (gray: where a document starts)",
       ylabel="largest logit difference", title=f"Packed row against the padded model, {HF}")
ax.legend(loc="center right")
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# The lines above are this release's (printed at the top of the page). Where
# ``use_cache`` is on, the model makes a cache for the forward pass, and this
# release looks for restarts in ``position_ids`` only when there is no cache
# (the lines above show whether): with one, ``sdpa`` attends across the
# whole row. Without one
# they turn the restarts into a ``(1, 1, T, T)`` boolean mask over the
# packed row, which keeps documents apart, at the price of a mask that grows
# with the square of the row, every query scored against every key of it.
# The registered function gets the same call in both cases and reads the
# boundaries itself.
#
# Two more checks. A row of the same document twice must give the same
# logits for both copies: the second copy cannot see the first. And one
# training step's gradients, for every parameter, must be the padded
# model's, the loss averaged over the same real targets (the collator's
# labels are ``-100`` at every document's first token, so no document
# predicts the next one's start).

twice = packed_batch([max(corpus[0], key=len)] * 2)  # the batch's longest document
half = twice["input_ids"].shape[1] // 2
with torch.no_grad(), autocast():
    for name, model in (("sdpa", stock), (NAME, ours)):
        logits = model(**twice, use_cache=True).logits[0].float()
        print(f"  {name:14s} two identical documents: largest difference between the copies "
              f"{(logits[:half] - logits[half:]).abs().max().item():.2e}")
torch.testing.assert_close(logits[half:], logits[:half], **tolerance,
                           msg=lambda m: f"{NAME}: the second copy differs: {m}")

for model in (stock, ours):
    model.zero_grad(set_to_none=True)
with autocast():
    loss_ours = ours(**packed).loss
    loss_padded = stock(**padded).loss
loss_ours.backward()
loss_padded.backward()
torch.testing.assert_close(loss_ours, loss_padded, **tolerance,
                           msg=lambda m: f"{NAME}: the packed loss is not the padded one: {m}")
pairs = list(zip(ours.named_parameters(), stock.parameters()))
for (name, p_ours), p_padded in pairs:
    torch.testing.assert_close(p_ours.grad, p_padded.grad, **tolerance,
                               msg=lambda m, name=name: f"gradient of {name}: {m}")
grad_gap = max((a.grad - b.grad).abs().max().item() for (_, a), b in pairs)
print(f"loss {loss_ours.item():.4f} packed with {NAME}, {loss_padded.item():.4f} padded")
print(f"gradients of all {len(pairs)} parameter tensors agree "
      f"(largest difference {grad_gap:.1e})")

# %%
# Training against what readers run
# ---------------------------------
# The same model, the same batches and the same optimizer (AdamW), four
# ways, taking turns step by step so that a busy machine slows all alike:
#
# * ``padded``: right-padded rows with an ``attention_mask``, stock
#   ``sdpa``: the recipe most readers use;
# * ``ragged``: the packed rows through the registered ``ragged_attention``;
# * ``packed sdpa`` and ``packed sdpa, cache``: the packed rows through stock
#   ``sdpa``, with ``use_cache=False`` (as ``Trainer`` runs it in transformers 5) and
#   with ``use_cache=True`` (the default of the config), each marked with what
#   the proof above measured for it.
#
# The step is forward, backward and the optimizer's update, timed with a
# synchronized clock; throughput counts *real* tokens (the padded trainer
# gets no credit for padding) after the first ``WARMUP_STEPS``.

from ragged_toolkit.measuring.timing import StepTimer, warm_every_shape


def verdict(use_cache):
    right = correct[f"sdpa, use_cache={use_cache}"]
    return f"use_cache={use_cache}, " + ("correct" if right else "WRONG (across documents)")


TRAINERS = {  # name: attention, batch form (0 packed, 1 padded), use_cache, label
    "padded": ("sdpa", 1, False, "sdpa with attention_mask"),
    "ragged": (NAME, 0, False, "ragged_attention"),
    "packed sdpa": ("sdpa", 0, False, verdict(False)),
    "packed sdpa, cache": ("sdpa", 0, True, verdict(True)),
}
runs = {}
for name, (attention, form, use_cache, label) in TRAINERS.items():
    model = with_attention(attention).train()
    runs[name] = dict(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                      form=form, use_cache=use_cache, label=label, timer=StepTimer(), losses=[])
if DEVICE == "cuda":  # cuDNN builds a plan per new shape: every trainer meets every shape before any timing
    for run in runs.values():
        with autocast():
            warm_every_shape(lambda b, m=copy.deepcopy(run["model"]), run=run: m(
                **b[run["form"]], use_cache=run["use_cache"]).loss.backward(), batches,
                lambda b, run=run: tuple(b[run["form"]]["input_ids"].shape))
for packed_i, padded_i in batches:
    for run in runs.values():
        with run["timer"].step(int(packed_i["input_ids"].numel())):  # real tokens, on every side
            with autocast():
                loss = run["model"](**(packed_i, padded_i)[run["form"]], use_cache=run["use_cache"]).loss
            run["optimizer"].zero_grad(set_to_none=True)
            loss.backward()
            run["optimizer"].step()
        run["losses"].append(loss.item())

for name, run in runs.items():
    run["tokens/s"] = run["timer"].tokens_per_s(WARMUP_STEPS)
    print(f"{name:18s} {run['tokens/s']:7,.0f} tokens/s, loss {run['losses'][0]:.3f} -> "
          f"{run['losses'][-1]:.3f}, {run['label']}")

# %%
# The padded and the ragged trainer compute the same thing (the first step's
# loss and gradients were checked above), so their losses differ only by
# rounding. In float32 that stays below 1e-3 at every step. In a 16-bit
# dtype the rounding of one step changes the weights of the next, and the
# difference grows over the run: the page then checks the first step's
# losses within the tolerance of the dtype and the means of the last five steps
# within 5%.

ragged_losses, padded_losses = np.array(runs["ragged"]["losses"]), np.array(runs["padded"]["losses"])
if DTYPE == torch.float32:
    gap = np.max(np.abs(ragged_losses - padded_losses) / padded_losses)
    assert gap < 1e-3, f"the losses drift apart: {gap:.1e}"
    print(f"ragged and padded losses agree at every step (largest relative difference {gap:.1e})")
else:
    torch.testing.assert_close(torch.tensor(ragged_losses[0]), torch.tensor(padded_losses[0]), **tolerance)
    last = abs(ragged_losses[-5:].mean() - padded_losses[-5:].mean()) / padded_losses[-5:].mean()
    assert last < 0.05, f"the last five losses differ by {last:.1%} on average"
    print(f"first step: losses {ragged_losses[0]:.4f} and {padded_losses[0]:.4f}; last five steps: means "
          f"{ragged_losses[-5:].mean():.4f} and {padded_losses[-5:].mean():.4f} ({last:.1%} apart)")

# %%
# The work bound of this run
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# What each side must compute over the timed batches, counted as on the GPT
# page: ``2 x`` the weights of every matrix per token (all but the
# embedding), and ``4 H D`` per query-key pair and layer. The ragged side
# scores the causal half of each document; the padded side's merged
# ``attention_mask`` makes ``sdpa`` score the whole ``S x S`` square of
# every row.

from ragged_toolkit.measuring.bound import work_per_token

per_token = 2 * (n_params - MODEL["vocab_size"] * MODEL["hidden_size"])
per_pair = MODEL["num_hidden_layers"] * 4 * MODEL["hidden_size"]  # 4 H D per layer
step_lengths = [offsets_from_position_ids(packed_i["position_ids"]).diff().cpu()
                for packed_i, _ in batches[WARMUP_STEPS:]]
bound = (work_per_token(step_lengths, per_token, per_pair, padded=True, causal=False)
         / work_per_token(step_lengths, per_token, per_pair))
R, P = runs["ragged"]["tokens/s"], runs["padded"]["tokens/s"]
print(f"hf training: ragged {R:.0f} tokens/s, padded {P:.0f} tokens/s, "
      f"speedup {R / P:.2f}x, work bound {bound:.2f}x, fraction {R / P / bound:.2f}")

# %%
# The last number is the :term:`fraction of the bound`: how much of the work
# that padding adds this device turned into speed. The packed ``sdpa``
# trainers are drawn beside it. Where it reads across documents, the loss
# curve shows what that does to learning on these documents, whose tokens
# only their own document predicts. Where it builds the ``(T, T)`` mask, its
# attention scores every pair of the packed row: that work grows with the
# square of the row, the ragged side's with the sum of the squares of the
# documents, so the gap between the two widens as rows get longer.

fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(8, 4.2), layout="constrained",
                                        width_ratios=[3, 2])
styles = ("-", "--", ":", "-.")
for (name, run), style in zip(runs.items(), styles):
    ax_loss.plot(run["losses"], style, label=name, lw=2)
ax_loss.set(xlabel="step", ylabel="training loss", title="Same weights, same batches")
ax_loss.legend(fontsize=10)
names = list(runs)
ax_speed.barh(names, [runs[n]["tokens/s"] for n in names],
              color=["C0", "C1", "C2", "C3"])
ax_speed.invert_yaxis()
ax_speed.set(xlabel="real tokens/s", title=f"Training speed ({DEVICE})")
plt.show()

# %%
# On a GPU
# --------
# On CUDA the registered function runs ``varlen_attn`` (the ``varlen``
# backend) in ``bfloat16``, and the page compares it with ``transformers``'
# own ``flash_attention_2`` where the ``flash_attn`` package is installed.
# The profiler names the kernels one training step of the registered model
# ran (``flash varlen`` on a GPU):

import importlib.util

from ragged_toolkit.measuring.profiles import profile_call


def training_step():
    with autocast():
        loss = ours(**packed).loss
    loss.backward()


_, kernels = profile_call(training_step)
print(f"one training step with {NAME}: backend {BACKEND!r}, kernels [{kernels}]")
if DEVICE != "cuda":
    print("flash_attention_2 needs a CUDA GPU: not compared here")
elif importlib.util.find_spec("flash_attn") is None:
    print("the flash_attn package is not installed: flash_attention_2 not compared")
else:
    flash = with_attention("flash_attention_2")
    with torch.no_grad(), autocast():
        logits_flash = flash(**packed).logits[0].float()
        logits_ours = ours(**packed).logits[0].float()
    torch.testing.assert_close(logits_ours, logits_flash, **tolerance)
    print(f"{NAME} and flash_attention_2 agree on the packed row (largest logit difference "
          f"{(logits_ours - logits_flash).abs().max().item():.2e})")

# %%
# Conclusion
# ----------
# The collator's packed row is the toolkit's packed values plus offsets, and
# ``transformers`` hands both to any attention function it has by name:
# ``position_ids`` on every call, ``cu_seq_lens_q`` where the collator wrote
# it. Registered there, ``ragged_attention`` keeps documents apart on every
# device without a mask, with the padded model's logits and gradients, and
# on a GPU it is the variable-length kernel of FlashAttention. The stock
# ``sdpa`` implementation, in the releases checked here, keeps them apart
# only when no cache is made, and then through a mask over the whole row.
#
# Further reading
# ---------------
# * `Attention interface <https://huggingface.co/docs/transformers/en/attention_interface>`_
#   in the ``transformers`` documentation
# * `Packing with FlashAttention 2 <https://huggingface.co/blog/packing-with-FA2>`_
#   (``DataCollatorWithFlattening``)
# * :doc:`packed_gpt_training`: the same training without ``transformers``
