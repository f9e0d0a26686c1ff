"""
Packed training across data-parallel ranks
==========================================

This page trains packed documents on several ranks with DDP and FSDP2
(``fully_shard``), started with ``torch.distributed.run``. Each micro-batch is
filled to a token budget, not to a fixed number of documents. Every rank
divides its loss by the targets of the whole step. The gradients are proved
equal to one process's on the whole batch. Real text, offline: Python's
docstrings, one byte per token.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * What a fixed number of documents per micro-batch does to the ranks
         of a data-parallel step, and what a token budget does instead
       * How the training step compiles with ``fullgraph=True``, and when a
         fixed budget compiles once
       * How to normalize the loss over micro-batches and ranks, proved
         against the gradients of one process on the whole batch
       * Three packing mistakes, each caught by a check that fails loudly

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * :doc:`packed_gpt_training` (the model, packed targets and
         positions); the functions used here are on
         :doc:`the toolkit's reference page </toolkit>`
       * PyTorch 2.11 or later; a CPU is enough (two ranks over ``gloo``),
         and each GPU of a CUDA machine runs a rank over NCCL
"""

# sphinx_gallery_tags = ["training", "packing", "distributed", "FSDP2", "DDP"]

# %%
# Sizes
# -----
# Every size is set here, per device; :term:`quick mode` shrinks them. The
# model is the GPT of :doc:`packed_gpt_training`, bytes as tokens. (Real runs:
# thousands of GPUs, a budget of 4096 to 16384 tokens per micro-batch and rank.)

import torch
from ragged_site.page import page_setup

SIZES = {
    "cuda": dict(
        model=dict(
            vocab_size=256,
            dim=256,
            n_layers=4,
            n_heads=8,
            n_kv_heads=2,
            ffn_hidden=688,
            max_seq_len=2048,
        ),
        context=2048,
        docs_per_micro_batch=8,
        steps=8,
        corpus_documents=2000,
        train_tokens=900_000,
    ),
    "cpu": dict(
        model=dict(
            vocab_size=256,
            dim=128,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            ffn_hidden=352,
            max_seq_len=1024,
        ),  # 90 s on 2 cores
        context=1024,
        docs_per_micro_batch=4,
        steps=6,
        corpus_documents=2000,
        train_tokens=800_000,
    ),
    "quick": dict(
        model=dict(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=176),
        context=512,
        docs_per_micro_batch=2,
        steps=4,
        corpus_documents=1200,
        train_tokens=400_000,
    ),
}
setup = page_setup(SIZES)
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
CPU_DTYPE = DTYPE if DEVICE == "cpu" else torch.float32  # what runs on the CPU (the gloo ranks too)
WORLD, MICRO_BATCHES = 2, 2  # ranks on the CPU, over gloo; micro-batches per rank and step
WARMUP_STEPS = 2  # timed steps left out of the figures (first calls)
GRAD_DOCS = 2  # documents per micro-batch in the gradient check (tiny, float32)
GRAD_TOL = 1e-4  # float32: the largest gradient difference allowed
LR = 3e-3  # the learning rate of AdamW
print(
    f"{WORLD} ranks x {MICRO_BATCHES} micro-batches per step, {S.docs_per_micro_batch} documents "
    f"or one token budget each, documents cut at {S.context} tokens"
)

# %%
# Real text, offline
# ------------------
# ``docstring_corpus`` reads the standard library's docstrings of 200
# characters or more with ``ast``. Each byte is a token. The documents are as
# ragged as web documents: a line for a small function, pages for a module.
# They are packed end to end, each cut at ``context`` tokens. The stream's
# first ``train_tokens`` feed every figure below.

import numpy as np
from ragged_toolkit.data import pack_documents, split_by_token_budget
from ragged_site.corpus import docstring_corpus

documents, source = docstring_corpus(min_chars=200, limit=S.corpus_documents)
lengths = np.array([len(d) for d in documents])
print(
    f"corpus: {len(documents)} documents from {source}, lengths min {lengths.min()}, "
    f"median {int(np.median(lengths))}, max {lengths.max()}"
)
print(f"the first one: {documents[0][:70].decode()!r}")
tokens, offsets = pack_documents(documents, max_len=S.context)  # (T,), (B + 1,)
assert len(documents) == S.corpus_documents and len(tokens) >= S.train_tokens, (
    f"this Python's standard library holds {len(documents)} docstrings of 200+ characters, "
    f"{len(tokens)} tokens: lower corpus_documents or train_tokens in SIZES"
)
tokens, offsets = split_by_token_budget(tokens, offsets, S.train_tokens)[
    0
]  # the stream's first train_tokens
print(
    f"{len(tokens):,} tokens of {len(offsets) - 1} documents; "
    f"{(lengths > S.context).sum()} documents of the corpus cut at {S.context}"
)

# %%
# Three packing mistakes, each checked
# ------------------------------------
# A pack is right when each document in it trains as if it were alone.
# Three things make that so. Each check below passes on the right code. Then it
# prints what it fails with on the wrong variant (``failure_message``):
#
# 1. **Attention stays inside each document.** Two copies of one document
#    in one pack must give the same logits. If the offsets describe the pack as
#    one sequence, the second copy attends to the first.
# 2. **The first token of a document is never a target of the one before.**
#    Shifting the whole pack by one token makes every document's last token
#    predict the next document's first. ``document_targets`` puts -100
#    (ignored) there. These are the targets of every loss on this page:
#
#    .. literalinclude:: ../ragged_toolkit/data.py
#       :pyobject: document_targets
#
# 3. **Positions restart at every document** (``token_index``). Rotary scores
#    depend only on the distance between two tokens. So a constant shift moves
#    this model's logits by rounding alone (checked below). Without the
#    restart, learned absolute positions would see other inputs. The position
#    table would run out at ``max_seq_len``. And Hugging Face's padding-free
#    path reads the document boundaries from positions that restart
#    (``offsets_from_position_ids``).

from ragged_toolkit.batches import offsets_from_position_ids, token_index
from ragged_toolkit.data import document_targets
from ragged_site.data_parallel import (
    check_documents_apart,
    check_positions,
    check_targets,
    failure_message,
)
from ragged_toolkit.gpt import GPT, GPTConfig
from ragged_toolkit.layouts import PackedLayout

torch.manual_seed(setup.seed)
cfg = GPTConfig(**S.model)
model = GPT(cfg)  # float32, on the CPU: the reference for everything below
doc = documents[1][:96]


def pack_as_one(docs):
    """The mistake: documents end to end, offsets of one sequence."""
    tokens, _ = pack_documents(docs)
    return tokens, torch.tensor([0, len(tokens)])


gap = check_documents_apart(model, doc, pack_documents)
print(f"1. two copies of a {len(doc)}-token document: largest logit difference {gap:.1e}")
print(failure_message(check_documents_apart, model, doc, pack_as_one))

pair, pair_offsets = pack_documents(documents[2:5], max_len=40)
check_targets(pair, document_targets(pair, pair_offsets), pair_offsets)
print("2. targets of three packed documents: -100 at each document's last token")
print(failure_message(check_targets, pair, pair.roll(-1), pair_offsets))

right, wrong = token_index(pair_offsets)[1], torch.arange(len(pair))
check_positions(right, pair_offsets)
print(f"3. positions restart: {right.tolist()[36:45]} around the first boundary")
print(failure_message(check_positions, wrong, pair_offsets))
with torch.no_grad():
    layout = PackedLayout.of(pair_offsets, "loop")  # the batch's plan, built once for both calls
    shifted = (model(pair, right, layout) - model(pair, wrong, layout)).abs().max()
read = len(offsets_from_position_ids(wrong)) - 1
assert shifted < 1e-3, f"a constant position shift moved this RoPE model's logits by {shifted:.1e}"
print(
    f"   positions not restarted, this RoPE model: logits move by {shifted:.1e}; "
    f"position_ids read {read} document(s), not 3"
)

# %%
# Two ways to fill a micro-batch
# ------------------------------
# Each rank runs ``MICRO_BATCHES`` micro-batches a step. Then it waits for the
# others to sum the gradients. So a step takes as long as its slowest rank.
#
# * **A fixed number of documents** per micro-batch. Its token count is the
#   sum of a few document lengths. So it varies, and so does each rank's work.
# * **A token budget**: the packed stream is cut every ``BUDGET`` tokens,
#   chosen to hold the same tokens on average. A cut goes through any
#   document it falls in, as :doc:`packed_gpt_training` cuts its rows. That
#   gives no padding and one shape. Carrying such a document whole to the
#   next micro-batch instead costs padding.
#
# ``deal_to_ranks`` deals micro-batches to the ranks in turn, as
# ``DistributedSampler`` deals samples. ``token_imbalance`` divides the
# busiest rank's tokens by the mean of the ranks, each summed over the steps.
# It is the factor by which a step is longer than with perfectly balanced work.

from ragged_toolkit.data import split_by_documents, split_carrying_documents
from ragged_toolkit.data_parallel import deal_to_ranks
from ragged_site.data_parallel import rank_tokens, token_imbalance

by_documents = split_by_documents(tokens, offsets, S.docs_per_micro_batch)
BUDGET = int(round(np.mean([len(t) for t, _ in by_documents]) / 64)) * 64
by_budget = split_by_token_budget(tokens, offsets, BUDGET)
carried = split_carrying_documents(tokens, offsets, BUDGET)
steps_docs = deal_to_ranks(by_documents, WORLD, MICRO_BATCHES)
steps_budget = deal_to_ranks(by_budget, WORLD, MICRO_BATCHES)
cuts = torch.arange(BUDGET, len(by_budget) * BUDGET, BUDGET)
cut = int((~torch.isin(cuts, offsets)).sum())  # cuts that fall inside a document
padding = 1 - sum(len(t) for t, _ in carried) / (BUDGET * len(carried))
print(
    f"token budget {BUDGET} (the mean of {S.docs_per_micro_batch} documents); "
    f"{len(steps_docs)} and {len(steps_budget)} steps of the stream"
)
print(
    f"token imbalance (max/mean tokens per rank): fixed documents "
    f"{token_imbalance(steps_docs):.2f}, token budget {token_imbalance(steps_budget):.2f}"
)
print(
    f"the budget cuts {cut} documents (one target each); carrying them instead "
    f"would pad {padding:.1%} of the slots"
)
assert token_imbalance(steps_budget) == 1.0, "a token budget gives every rank the same tokens"

# %%
# The first figure shows how the budget cuts the stream: the first
# micro-batches, each document its color, each cut inside a document marked.
# The second shows the tokens each rank holds in the first steps, both ways:

import matplotlib.pyplot as plt
from ragged_site.figures import FIGURE_STYLE, draw_token_budget

plt.rcParams.update(FIGURE_STYLE)
draw_token_budget(offsets.diff()[:40].tolist(), BUDGET, micro_batches=6)
plt.show()

fig, ax = plt.subplots(figsize=(8, 3.6))
for r, marker in zip(range(WORLD), "os"):  # the first 20 steps
    ax.plot(rank_tokens(steps_docs[:20])[:, r], marker=marker, label=f"rank {r}, fixed documents")
ax.plot(rank_tokens(steps_budget[:20])[:, 0], "k--", label="every rank, token budget")
ax.set(xlabel="step", ylabel="tokens on the rank", ylim=(0, None))
ax.set_title(f"Tokens per rank, first 20 steps: fixed documents or {BUDGET} tokens per micro-batch")
ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
ax.legend(loc="lower right", ncols=2, fontsize=10)
fig.tight_layout()
plt.show()

# %%
# One shape, one compiled graph
# -----------------------------
# A :term:`layout` is how the model's attention reads a batch. A :term:`plan`
# is what ``plan_batch`` reads once from a batch's offsets. A rank computes
# each micro-batch's loss with ``token_loss_sum``. It builds the layout, and
# the batch's plan in it, before the model runs. So ``ragged_attention`` reads
# nothing back from the device. And ``torch.compile(model, fullgraph=True)``
# takes the forward and backward whole (a graph break would be an error):
#
# .. literalinclude:: ../ragged_toolkit/data_parallel.py
#    :pyobject: token_loss_sum
#
# What a graph is specialized on depends on how attention reads the
# micro-batch. :doc:`packed_gpt_training` shows both ways:
#
# * The :term:`rows layout` (``PackedRows``): one SDPA call with a
#   block-diagonal causal mask. Its graph depends on the token count alone.
# * The ``loop`` backend's plan, which the ranks below run on a CPU: one SDPA
#   call per sequence, unrolled into the graph. Its graph depends on how many
#   sequences the micro-batch holds (with static shapes, on every length).
#
# ``compiled_graphs`` compiles the first ``COMPILE_STEPS`` micro-batches of
# each way. It tries static shapes (``dynamic=False``, what CUDA graphs need).
# It tries the default: static, then symbolic where a size changes. It tries
# symbolic sizes from the start (``dynamic=True``). It counts dynamo's graphs
# and breaks. Its ``eager`` backend generates no kernels:
#
# .. literalinclude:: ../ragged_site/data_parallel.py
#    :pyobject: compiled_graphs

from ragged_site.data_parallel import compiled_graphs


def plural(n, word):
    """``1 graph``, ``2 graphs``."""
    return f"{n} {word}" + ("" if n == 1 else "s")


from ragged_toolkit.data_parallel import token_loss_sum
from ragged_toolkit.layouts import PackedRows

COMPILE_STEPS = 3
schemes = {"fixed documents": by_documents, "token budget": by_budget}


def rows(t, o):  # the micro-batch as one row of all its tokens
    return PackedRows.from_offsets(o, len(t))


PATHS = {
    "rows, static shapes": (rows, False),
    "rows, default shapes": (rows, None),  # (layout, dynamic)
    "rows, dynamic shapes": (rows, True),
    "loop plan, default shapes": (lambda t, o: PackedLayout.of(o, "loop"), None),
}  # an SDPA call a sequence
graphs = {}
for path, (layout_of, dynamic) in PATHS.items():
    for scheme, mbs in schemes.items():
        count = compiled_graphs(
            model, mbs[:COMPILE_STEPS], layout_of, dynamic=dynamic, dtype=CPU_DTYPE
        )
        assert count.breaks == 0 and not count.fallbacks, f"{scheme}, {path}: {count}"
        graphs[scheme, path] = count.graphs
        print(
            f"compiled trainer {scheme}, {path}: {plural(count.graphs, 'graph')} for {COMPILE_STEPS} "
            f"steps, {plural(count.breaks, 'graph break')}"
        )

# %%
# On the rows layout the budget compiled once on every path. Fixed documents
# compiled once per token count with static shapes (asserted below). The budget
# buys one static shape, which CUDA graphs need. The loop's plan follows the
# sequences:

token_counts = len({len(t) for t, _ in by_documents[:COMPILE_STEPS]})
assert all(graphs["token budget", path] == 1 for path in PATHS if path.startswith("rows")), graphs
assert graphs["fixed documents", "rows, static shapes"] == token_counts, (graphs, token_counts)
assert graphs["fixed documents", "rows, dynamic shapes"] == 1, graphs
held = {
    scheme: sorted({len(o) - 1 for _, o in mbs[:COMPILE_STEPS]}) for scheme, mbs in schemes.items()
}
loop = {scheme: graphs[scheme, "loop plan, default shapes"] for scheme in schemes}
print(
    f"loop plan: fixed documents hold {held['fixed documents']} sequences, "
    f"{plural(loop['fixed documents'], 'graph')};\nthe budget's micro-batches hold "
    f"{held['token budget']} sequences, {plural(loop['token budget'], 'graph')}: "
    + (
        "a fixed token count saved no graph there"
        if loop["token budget"] >= loop["fixed documents"]
        else "the budget compiled fewer"
    )
)

# %%
# A loss that is right on every rank
# ----------------------------------
# The loss of a step sums every token's loss, over every micro-batch of every
# rank. It divides that sum by the targets of all of them. No rank knows that
# count alone: each sums its own and ``all_reduce`` sums them before the first
# backward. DDP and FSDP2 average the gradients over the ranks. Multiplying
# each rank's loss by the world size undoes that.
#
# .. literalinclude:: ../ragged_toolkit/data_parallel.py
#    :pyobject: data_parallel_step
#
# The reference is independent of all of it: one process, the step's whole
# batch packed as one, ``cross_entropy`` averaged over its targets, float32.
# The check takes tiny micro-batches (``GRAD_DOCS`` whole documents) from the
# most uneven of the first 50 steps. There a wrong normalization shows. The
# common shortcut is one: ``loss / accumulation_steps``, then the average DDP
# takes over the ranks. It divides each micro-batch's loss by its own targets
# and averages those means. It is tried on the same data, in one process.

from ragged_site.data_parallel import one_process_gradients

grad_steps = deal_to_ranks(split_by_documents(tokens, offsets, GRAD_DOCS), WORLD, 3)[:50]
grad_batches = max(grad_steps, key=lambda step: token_imbalance([step]))  # the most uneven
reference = one_process_gradients(model, [mb for rank in grad_batches for mb in rank])
targets_per_rank = [
    sum(int((document_targets(t, o) != -100).sum()) for t, o in rank) for rank in grad_batches
]
print(
    f"gradient check: {WORLD} ranks x 3 micro-batches of {GRAD_DOCS} documents, "
    f"targets per rank {targets_per_rank}"
)

model.zero_grad(set_to_none=True)  # the shortcut: the mean of the micro-batches' means
micro = [mb for turn in zip(*grad_batches) for mb in turn]  # rank r holds micro[r::WORLD]
means = [torch.div(*token_loss_sum(model, t, o)) for t, o in micro]
torch.stack(means).mean().backward()
mean_gap = max((p.grad - reference[n]).abs().max().item() for n, p in model.named_parameters())
model.zero_grad(set_to_none=True)
with torch.no_grad():
    right_loss = sum(token_loss_sum(model, t, o)[0] for t, o in micro) / sum(targets_per_rank)
print(
    f"mean of per-micro-batch means: loss {torch.stack(means).mean():.4f}, "
    f"over every target {right_loss:.4f}; gradient max difference {mean_gap:.1e}"
)
counts_differ = len({int((document_targets(t, o) != -100).sum()) for t, o in micro}) > 1
assert counts_differ and mean_gap > 10 * GRAD_TOL, (
    f"the mean of means should be off when lengths are uneven; difference {mean_gap:.1e}"
)

# %%
# Two ranks, launched as a reader launches them
# ---------------------------------------------
# Each rank wraps its own copy of the model. With DDP every rank holds the
# whole model. ``no_sync`` keeps the gradients local until the last
# micro-batch's backward averages them over the ranks. With FSDP2,
# ``fully_shard`` on every block, then on the model, leaves each rank a shard
# of every weight. ``full_tensor()`` gathers one whole weight.
# ``set_requires_gradient_sync`` plays the part of ``no_sync``:
#
# .. literalinclude:: ../ragged_toolkit/data_parallel.py
#    :pyobject: wrap_model
#
# A ``DataParallelJob`` says what every rank does. First come the gradient runs
# (``RUNS``). Then come timed steps under DDP with AdamW, both ways of filling
# a micro-batch. The tensors travel beside the job. Each rank runs a script
# that calls ``data_parallel_worker``. The ranks leave together before the
# process group is destroyed. Each marks itself done in the job's folder and
# waits for the others. So no rank closes a connection its peer still uses.
# Then the script leaves with ``os._exit``, skipping the interpreter's
# shutdown. There, objects that still held a gloo connection were seen to abort
# a rank about once in 50 launches:
#
# .. literalinclude:: ../ragged_site/data_parallel_launch.py
#    :pyobject: data_parallel_worker
#
# .. literalinclude:: ../ragged_site/data_parallel_launch.py
#    :start-at: DATA_PARALLEL_SCRIPT =
#    :end-at: os._exit(0)
#
# ``run_data_parallel`` writes the job into a temporary folder, starts the
# ranks, reads each rank's report back, and raises with a failing rank's own
# error. The command, and its twin on a CUDA machine (a rank per GPU, NCCL):
#
# * ``python -m torch.distributed.run --standalone --nproc-per-node=2 worker.py FOLDER``
# * ``torchrun --standalone --nproc-per-node=gpu worker.py FOLDER``

from ragged_toolkit.attention import backend_support
from ragged_site.data_parallel import check_same_gradients, nccl_ranks
from ragged_site.data_parallel_launch import DataParallelJob, GradientRun, run_data_parallel
from ragged_site.records import record

RUNS = [
    GradientRun("DDP", wrap="ddp"),
    GradientRun("FSDP2", wrap="fsdp"),
    GradientRun("DDP, count not reduced", wrap="ddp", reduce_count=False),
]


def launch(backend, nproc, device, dtype):
    """The job on ``nproc`` ranks, its micro-batches dealt to them; the gradients checked."""
    fused = (
        backend_support(
            "varlen",
            device,
            dtype,
            is_causal=True,
            needs_grad=True,
            gqa=True,
            head_dim=cfg.head_dim,
        )
        is None
    )  # flash varlen trains here
    job = DataParallelJob(
        backend=backend,
        config=S.model,
        dtype=str(dtype).removeprefix("torch."),
        lr=LR,
        grad_runs=RUNS,
        time_backend="varlen" if fused else "loop",
    )
    data = {
        "init": model.state_dict(),  # every rank starts from these weights
        "grad_batches": [micro[r::nproc] for r in range(nproc)],  # the micro-batches of rank r
        "time_batches": {
            name: deal_to_ranks(mbs, nproc, MICRO_BATCHES)[: WARMUP_STEPS + S.steps]
            for name, mbs in schemes.items()
        },
    }
    reports, grads = run_data_parallel(job, data, nproc)
    print(
        f"{nproc} ranks over {backend} on {reports[0]['device'].split(':')[0]} (CPU threads per rank: "
        f"{reports[0]['threads']}), timed steps on {job.time_backend!r}:"
    )
    for run in RUNS[:2]:
        gap = check_same_gradients(grads[run.name], reference, GRAD_TOL)
        line = f"data-parallel step: world size {nproc}, gradient max difference to one process {gap:.1e}"
        print(f"{run.name}:")
        print(record("data_parallel", line, label=run.name, world_size=nproc, max_difference=gap))
    return reports, grads


reports, grads = launch("gloo", WORLD, "cpu", CPU_DTYPE)
GPUS = torch.cuda.device_count() if DEVICE == "cuda" else 0
NCCL_RANKS = nccl_ranks(GPUS, len(micro))  # one rank per GPU over NCCL, each with a micro-batch
if NCCL_RANKS:
    nccl_reports, _ = launch("nccl", NCCL_RANKS, "cuda", DTYPE)
elif GPUS == 1:
    print(
        "one GPU: NCCL would run one rank, whose collectives do nothing; no data-parallel figure for the GPU"
    )

# %%
# Without the ``all_reduce`` of the count, each rank divides by its own
# number of targets, and the same check fails:

print(failure_message(check_same_gradients, grads["DDP, count not reduced"], reference, GRAD_TOL))

# %%
# What the ranks measured
# -----------------------
# Every rank timed each step between two barriers. Tokens per second count
# every rank's tokens. Ranks sharing one machine's cores add no compute. So a
# CPU build measures correctness, imbalance and graphs. A GPU per rank (the
# NCCL lines) measures throughput. The last line sets the step times beside
# what differs between the two ways. A document cut by the budget is two
# shorter sequences, with fewer attention pairs than the whole.

from ragged_site.data_parallel import step_load
from ragged_site.data_parallel_launch import step_times_ms


def summary(reports, label):
    """Each way's step times, speed, and what its timed steps held."""
    print(label)
    out = {}
    for scheme, micro_batches in schemes.items():
        timed = deal_to_ranks(micro_batches, len(reports), MICRO_BATCHES)[
            WARMUP_STEPS : WARMUP_STEPS + S.steps
        ]
        step_ms = step_times_ms(reports, scheme, skip=WARMUP_STEPS)  # each step's slowest rank
        q1, median, q3 = np.percentile(step_ms, [25, 50, 75])
        out[scheme] = held = dict(median_ms=median, **step_load(timed))  # tokens, pairs, imbalance
        rate = held["tokens"] * len(step_ms) / sum(step_ms) * 1e3
        line = (
            f"  {scheme:15s}: step median {median:6.1f} ms (IQR {q1:.1f}-{q3:.1f}, {len(step_ms)} steps), "
            f"aggregate {rate:,.0f} tokens/s"
        )
        figures = dict(median_ms=median, iqr_ms=q3 - q1, runs=len(step_ms), tokens_per_s=rate)
        print(record("timing", line, label=f"{label} {scheme}", **figures))
        print(
            f"  {'':15s}  imbalance {held['imbalance']:.2f}, attention pairs per step {held['pairs']:,.0f}, "
            f"tokens per step {held['tokens']:,.0f}"
        )
    ratio = {k: out["fixed documents"][k] / out["token budget"][k] for k in out["token budget"]}
    print(
        f"  fixed documents / token budget: step time {ratio['median_ms']:.2f}x, imbalance "
        f"{ratio['imbalance']:.2f}x, tokens {ratio['tokens']:.2f}x, attention pairs {ratio['pairs']:.2f}x"
    )
    return out


gloo = summary(reports, f"{WORLD} ranks over gloo, {S.steps} timed steps after {WARMUP_STEPS}:")
if NCCL_RANKS:
    nccl = summary(nccl_reports, f"{len(nccl_reports)} ranks over NCCL:")

# %%
# Conclusion
# ----------
# A token budget balances the ranks by construction. It gives every micro-batch
# one shape. That shape compiles once where attention reads the micro-batch by
# its shape (the rows layout). Cutting documents at the budget costs a target
# and some context per cut. Carrying them costs padding. Whatever fills the
# micro-batches, the loss is a sum over every token divided by a count summed
# over every rank. A gradient check against one process on the whole batch is
# cheap enough to run in a test.
#
# Further reading
# ---------------
# * `Getting started with DDP
#   <https://docs.pytorch.org/tutorials/intermediate/ddp_tutorial.html>`_ and
#   `FSDP2 <https://docs.pytorch.org/tutorials/intermediate/FSDP_tutorial.html>`_
# * `torchrun <https://docs.pytorch.org/docs/stable/elastic/run.html>`_
# * `torchtitan <https://github.com/pytorch/torchtitan>`_ (FSDP2, packed
#   documents)
# * `Fixing gradient accumulation
#   <https://huggingface.co/blog/gradient_accumulation>`_ (the loss over
#   micro-batches of different sizes)
