"""
Packed training across data-parallel ranks
==========================================

Packed documents on several ranks: DDP and FSDP2 (``fully_shard``) started
with ``torch.distributed.run``, micro-batches filled to a fixed token budget
instead of a fixed number of documents, and a loss divided by the number of
targets of the whole step on every rank, proved against one process on
the whole batch. Real text, offline: the docstrings of Python's standard
library, one byte per token.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * What a fixed number of documents per micro-batch does to the ranks
         of a data-parallel step, and what a token budget does instead
       * How the training step compiles with ``fullgraph=True``, and when a
         fixed budget compiles once
       * How to normalize the loss with gradient accumulation on several
         ranks, and how to prove it: the gradients of one process on the
         whole batch
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
# Every size is set here, per device; :term:`quick mode` shrinks them. Two
# ranks run on the CPU over ``gloo`` on every machine; a CUDA machine also
# runs one rank per GPU over NCCL. The model is the GPT of the training page
# with a byte vocabulary (256 tokens). ``corpus_documents`` docstrings are
# read, cut at ``context`` tokens and packed end to end; the first
# ``train_tokens`` of that stream are cut into micro-batches, and every
# figure below reads from them. (Real runs: thousands of GPUs, a budget of
# 4096 to 16384 tokens per micro-batch and rank.)

import torch
from ragged_toolkit.device import page_setup

SIZES = {
    "cuda": dict(model=dict(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden=688,
                            max_seq_len=2048),
                 context=2048, docs_per_micro_batch=8, steps=8, corpus_documents=2000, train_tokens=900_000),
    "cpu": dict(model=dict(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=352,
                           max_seq_len=1024),  # 90 s on 2 cores
                context=1024, docs_per_micro_batch=4, steps=6, corpus_documents=2000, train_tokens=800_000),
    "quick": dict(model=dict(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=176), context=512,
                  docs_per_micro_batch=2, steps=4, corpus_documents=1200, train_tokens=400_000),
}
setup = page_setup(SIZES)
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
CPU_DTYPE = DTYPE if DEVICE == "cpu" else torch.float32  # what runs on the CPU (the gloo ranks too)
WORLD, MICRO_BATCHES = 2, 2  # ranks on the CPU, over gloo; micro-batches per rank and step
WARMUP_STEPS = 2  # timed steps left out of the figures (first calls)
GRAD_DOCS = 2  # documents per micro-batch in the gradient check (tiny, float32)
GRAD_TOL = 1e-4  # float32: the largest gradient difference allowed
LR = 3e-3  # the learning rate of AdamW
print(f"{WORLD} ranks x {MICRO_BATCHES} micro-batches per step, {S.docs_per_micro_batch} documents "
      f"or one token budget each, documents cut at {S.context} tokens")

# %%
# Real text, offline
# ------------------
# The documents are the docstrings of the standard library of the Python
# that runs the page: ``docstring_corpus`` reads every ``.py`` file of
# ``sysconfig.get_paths()["stdlib"]`` with ``ast`` (no module is imported),
# in the order of their paths, and keeps the docstrings of modules, classes
# and functions of at least 200 characters, each once. Each byte
# is a token. Docstrings are as ragged as web documents: a line for a small
# function, pages for a module.


import numpy as np
from ragged_toolkit.data import docstring_corpus, pack_documents

documents, source = docstring_corpus(min_chars=200, limit=S.corpus_documents)
lengths = np.array([len(d) for d in documents])
print(f"corpus: {len(documents)} documents from {source}, lengths min {lengths.min()}, "
      f"median {int(np.median(lengths))}, max {lengths.max()}")
print(f"the first one: {documents[0][:70].decode()!r}")
tokens, offsets = pack_documents(documents, max_len=S.context)  # (T,), (B + 1,)
assert len(documents) == S.corpus_documents and len(tokens) >= S.train_tokens, (
    f"this Python's standard library holds {len(documents)} docstrings of 200+ characters, "
    f"{len(tokens)} tokens: lower corpus_documents or train_tokens in SIZES")
inside = offsets[offsets < S.train_tokens]  # the documents the stream's first train_tokens touch
tokens, offsets = tokens[:S.train_tokens], torch.cat([inside, inside.new_tensor([S.train_tokens])])
print(f"{len(tokens):,} tokens of {len(offsets) - 1} documents; "
      f"{(lengths > S.context).sum()} documents of the corpus cut at {S.context}")

# %%
# Three packing mistakes, each checked
# ------------------------------------
# A pack is right when each document in it trains as if it were alone.
# Three things make that so, and each has a check in the toolkit that
# fails, naming the problem, when it is broken:
#
# 1. **Attention stays inside each document.** Two copies of one document
#    in one pack must give the same logits; if the offsets describe the pack
#    as one sequence, the second copy attends to the first.
# 2. **The first token of a document is never a target of the one before.**
#    Shifting the whole pack by one token makes every document's last token
#    predict the next document's first: ``document_targets`` puts -100
#    (ignored) there. These are the targets of every loss on this page:
#
#    .. literalinclude:: ../ragged_toolkit/data.py
#       :pyobject: document_targets
#
# 3. **Positions restart at every document.** ``token_index`` gives them. With
#    rotary embeddings the scores depend only on the distance between two
#    tokens, so a constant shift moves this model's logits by rounding alone
#    (the page checks it); but a model with learned absolute positions sees other
#    inputs, the position table runs out at ``max_seq_len``, and Hugging Face's
#    padding-free path reads the document boundaries from positions that
#    restart (``offsets_from_position_ids``).
#
# Each check runs on the right code, then on the wrong variant; the page
# shows the message the wrong one fails with.

from ragged_toolkit.batches import offsets_from_position_ids, token_index
from ragged_toolkit.data import document_targets
from ragged_toolkit.data_parallel import check_documents_apart, check_positions, check_targets
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


def shows_failure(check, *args):
    """Run a check that must fail; return its message."""
    try:
        check(*args)
    except AssertionError as failure:
        return str(failure)
    raise AssertionError(f"{check.__name__} accepted the wrong variant")


def wrapped(message, width=110):
    import textwrap

    return "\n".join(textwrap.wrap(message, width, initial_indent="  ",
                                   subsequent_indent="    "))


gap = check_documents_apart(model, doc, pack_documents)
print(f"1. two copies of a {len(doc)}-token document: largest logit difference {gap:.1e}")
print(wrapped(shows_failure(check_documents_apart, model, doc, pack_as_one)))

pair, pair_offsets = pack_documents(documents[2:5], max_len=40)
check_targets(pair, document_targets(pair, pair_offsets), pair_offsets)
print("2. targets of three packed documents: -100 at each document's last token")
print(wrapped(shows_failure(check_targets, pair, pair.roll(-1), pair_offsets)))

right, wrong = token_index(pair_offsets)[1], torch.arange(len(pair))
check_positions(right, pair_offsets)
print(f"3. positions restart: {right.tolist()[36:45]} around the first boundary")
print(wrapped(shows_failure(check_positions, wrong, pair_offsets)))
with torch.no_grad():
    layout = PackedLayout.of(pair_offsets, "loop")  # the batch's plan, built once for both calls
    shifted = (model(pair, right, layout) - model(pair, wrong, layout)).abs().max()
read = len(offsets_from_position_ids(wrong)) - 1
assert shifted < 1e-3, f"a constant position shift moved this RoPE model's logits by {shifted:.1e}"
print(f"   positions not restarted, this RoPE model: logits move by {shifted:.1e}; "
      f"position_ids read {read} document(s), not 3")

# %%
# Two ways to fill a micro-batch
# ------------------------------
# Each rank of a data-parallel step runs ``MICRO_BATCHES`` micro-batches and
# then waits for the others (the gradients are summed over the ranks at the
# end of the last backward), so the step takes as long as its slowest rank.
#
# * **A fixed number of documents** per micro-batch: the token count of a
#   micro-batch is the sum of a few document lengths, so it varies, and so
#   does each rank's work.
# * **A token budget**: the packed stream cut every ``BUDGET`` tokens, the
#   budget chosen here to hold the same tokens on average. A document that
#   crosses a cut is **cut** there; its rest opens the next micro-batch as a
#   sequence of its own. That costs the rest its context before the cut and
#   one target, and nothing else: no padding, one shape. The alternative is to
#   **carry** a document that does not fit whole to the next micro-batch and
#   pad what is left; that keeps every document whole but costs padding, and
#   documents longer than the budget must be cut anyway.
#
# Micro-batches are dealt to the ranks in turn, as ``DistributedSampler``
# deals samples. The imbalance is the token count of the slowest rank over
# the mean of the ranks, summed over every step of the stream: the factor by
# which the step is longer than it would be with perfectly balanced work.

from ragged_toolkit.data import split_by_documents, split_by_token_budget, split_carrying_documents

by_documents = split_by_documents(tokens, offsets, S.docs_per_micro_batch)
BUDGET = int(round(np.mean([len(t) for t, _ in by_documents]) / 64)) * 64
by_budget = split_by_token_budget(tokens, offsets, BUDGET)
carried = split_carrying_documents(tokens, offsets, BUDGET)


def deal(micro_batches, world=WORLD, per_rank=MICRO_BATCHES):
    """Steps of ``world`` ranks with ``per_rank`` micro-batches each, dealt
    in turn: ``steps[s][r]`` is the list of rank ``r``'s micro-batches."""
    per_step = world * per_rank
    return [[micro_batches[s + r : s + per_step : world] for r in range(world)]
            for s in range(0, len(micro_batches) - per_step + 1, per_step)]


def rank_tokens(steps):
    return np.array([[sum(len(t) for t, _ in rank) for rank in step] for step in steps])


def imbalance(steps):
    per_rank = rank_tokens(steps)  # (steps, ranks)
    return per_rank.max(1).sum() / per_rank.mean(1).sum()


steps_docs, steps_budget = deal(by_documents), deal(by_budget)
cuts = torch.arange(BUDGET, len(by_budget) * BUDGET, BUDGET)
cut = int((~torch.isin(cuts, offsets)).sum())  # cuts that fall inside a document
padding = 1 - sum(len(t) for t, _ in carried) / (BUDGET * len(carried))
print(f"token budget {BUDGET} (the mean of {S.docs_per_micro_batch} documents); "
      f"{len(steps_docs)} and {len(steps_budget)} steps of the stream")
print(f"token imbalance (max/mean tokens per rank): fixed documents "
      f"{imbalance(steps_docs):.2f}, token budget {imbalance(steps_budget):.2f}")
print(f"the budget cuts {cut} documents (one target each); carrying them instead "
      f"would pad {padding:.1%} of the slots")
assert imbalance(steps_budget) == 1.0, "a token budget gives every rank the same tokens"

# %%
# How the budget cuts the stream: the first micro-batches, each document its
# color, each cut inside a document marked.

import matplotlib.pyplot as plt
from ragged_toolkit.figures import FIGURE_STYLE, draw_token_budget

plt.rcParams.update(FIGURE_STYLE)
draw_token_budget(offsets.diff()[:40].tolist(), BUDGET, micro_batches=6)
plt.show()

# %%
# The tokens each rank holds in the first steps, both ways:

fig, ax = plt.subplots(figsize=(8, 3.6))
shown = min(20, len(steps_docs))
for r, marker in zip(range(WORLD), "os"):
    ax.plot(rank_tokens(steps_docs[:shown])[:, r], marker=marker,
            label=f"rank {r}, fixed documents")
ax.plot(rank_tokens(steps_budget[:shown])[:, 0], "k--", label="every rank, token budget")
ax.set(xlabel="step", ylabel="tokens on the rank", ylim=(0, None))
ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
ax.legend(loc="lower right", ncols=2, fontsize=10)
fig.tight_layout()
plt.show()

# %%
# One shape, one compiled graph
# -----------------------------
# A rank computes each micro-batch's loss with ``token_loss_sum``. The
# layout it hands the model, and the batch's plan in it, is built before the
# model runs, so ``ragged_attention`` reads nothing back from the device and
# ``torch.compile(model, fullgraph=True)`` takes a micro-batch's forward
# whole, with its backward: a graph break would be an error.
#
# .. literalinclude:: ../ragged_toolkit/data_parallel.py
#    :pyobject: token_loss_sum
#
# What a compiled graph is specialized on depends on how attention reads
# the micro-batch, and that decides what a fixed budget buys:
#
# * the **rows** layout, ``PackedRows`` (:doc:`packed_gpt_training`): the
#   micro-batch as one row, one SDPA call with a block-diagonal causal mask
#   built outside the model. The graph depends on the token count alone. It
#   scores every pair of the row and masks those across documents (on CUDA,
#   ``FlexRows`` skips them).
# * the **packed** layout with the ``loop`` backend's plan, what the ranks
#   below run on a CPU: one SDPA call per sequence, unrolled into the graph,
#   which therefore depends on how many sequences the micro-batch holds (and,
#   with static shapes, on every length), whatever its token count.
#
# Each path compiles the first ``COMPILE_STEPS`` micro-batches of each way
# of filling them: with static shapes (``dynamic=False``, what CUDA graphs
# need), the default (static, then symbolic sizes where a size changes) and
# symbolic sizes from the start (``dynamic=True``). ``compile_counter``
# counts the graphs and graph breaks, with dynamo's recompile limit lifted
# (past 8 versions of a function it would stop compiling it). Graphs and
# breaks are dynamo's, whatever compiles the graphs after it: the ``eager``
# backend runs each graph as captured, where inductor would spend seconds
# generating its kernels (:doc:`packed_gpt_training` times that).

from ragged_toolkit.data_parallel import token_loss_sum
from ragged_toolkit.layouts import PackedRows
from ragged_toolkit.measuring.compiling import compile_counter

COMPILE_STEPS = 3
schemes = {"fixed documents": by_documents, "token budget": by_budget}


def rows(t, o):  # the micro-batch as one row of all its tokens
    return PackedRows.from_offsets(o, len(t))


def loop_plan(t, o):
    return PackedLayout.of(o, "loop")


PATHS = {"rows, static shapes": (rows, False), "rows, default shapes": (rows, None),
         "rows, dynamic shapes": (rows, True), "loop plan, default shapes": (loop_plan, None)}


def compiled_trainer(micro_batches, layout_of, dynamic):
    """Each micro-batch's forward and backward through the model compiled
    with ``fullgraph=True``; returns what ``torch.compile`` did."""
    torch._dynamo.reset()  # each path counts its own graphs
    runner = torch.compile(model, backend="eager", fullgraph=True, dynamic=dynamic)
    with torch._dynamo.config.patch(recompile_limit=64), compile_counter() as count:
        for t, o in micro_batches:
            loss, targets = token_loss_sum(runner, t, o, dtype=CPU_DTYPE, layout=layout_of(t, o))
            (loss / targets).backward()
    model.zero_grad(set_to_none=True)
    return count


graphs = {}
for path, (layout_of, dynamic) in PATHS.items():
    for scheme, micro_batches in schemes.items():
        count = compiled_trainer(micro_batches[:COMPILE_STEPS], layout_of, dynamic)
        assert count.breaks == 0 and not count.fallbacks, f"{scheme}, {path}: {count}"
        graphs[scheme, path] = count.graphs
        print(f"compiled trainer {scheme}, {path}: {count.graphs} graphs for {COMPILE_STEPS} steps, "
              f"{count.breaks} graph breaks")
torch._dynamo.reset()

# %%
# No path broke its graph. With the rows layout, the budget compiled one
# graph on every path, fixed documents one per token count with static
# shapes and one with symbolic sizes from the start (each checked below):
# what the budget buys there is one static shape, which CUDA graphs need.
# With the loop's plan, the graph follows the sequences:

token_counts = len({len(t) for t, _ in by_documents[:COMPILE_STEPS]})
assert all(graphs["token budget", path] == 1 for path in PATHS if path.startswith("rows")), graphs
assert graphs["fixed documents", "rows, static shapes"] == token_counts, (graphs, token_counts)
assert graphs["fixed documents", "rows, dynamic shapes"] == 1, graphs
held = {scheme: sorted({len(o) - 1 for _, o in mbs[:COMPILE_STEPS]}) for scheme, mbs in schemes.items()}
loop = {scheme: graphs[scheme, "loop plan, default shapes"] for scheme in schemes}
print(f"loop plan: fixed documents hold {held['fixed documents']} sequences, {loop['fixed documents']} "
      f"graphs; the budget's micro-batches hold {held['token budget']} sequences, "
      f"{loop['token budget']} graphs: " + ("a fixed token count saved no graph there"
      if loop["token budget"] >= loop["fixed documents"] else "the budget compiled fewer"))

# %%
# A loss that is right on every rank
# ----------------------------------
# The loss of a step is the mean over its targets: the sum of every token's
# loss, over every micro-batch of every rank, divided by the number of
# targets of all of them. No rank knows that number alone, so each sums its
# own count and ``all_reduce`` sums the counts before the first backward.
# DDP and FSDP2 then average the gradients over the ranks; multiplying each
# rank's loss by the world size undoes that average.
#
# .. literalinclude:: ../ragged_toolkit/data_parallel.py
#    :pyobject: data_parallel_step
#
# The reference is independent of all of it: one process, the whole batch of
# the step packed as one, ``cross_entropy`` averaged over its targets, float32.
# The gradient check uses tiny micro-batches of ``GRAD_DOCS`` whole documents:
# the most uneven of the first 50 steps, since uneven target counts are where
# a wrong normalization shows.

from ragged_toolkit.data_parallel import one_process_gradients

grad_steps = deal(split_by_documents(tokens, offsets, GRAD_DOCS), per_rank=3)[:50]
grad_batches = max(grad_steps, key=lambda step: imbalance([step]))  # the most uneven
reference = one_process_gradients(model, [mb for rank in grad_batches for mb in rank])
targets_per_rank = [sum(int((document_targets(t, o) != -100).sum()) for t, o in rank)
                    for rank in grad_batches]
print(f"gradient check: {WORLD} ranks x 3 micro-batches of {GRAD_DOCS} documents, "
      f"targets per rank {targets_per_rank}")

# %%
# The common shortcut divides each micro-batch's loss by its own targets and
# averages those means (``loss / accumulation_steps``, then the average that
# DDP takes over the ranks).
# On the same data, in one process:

model.zero_grad(set_to_none=True)
micro = [mb for turn in zip(*grad_batches) for mb in turn]  # rank r holds micro[r::WORLD]
means = [torch.div(*token_loss_sum(model, t, o)) for t, o in micro]
torch.stack(means).mean().backward()
shortcut = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
model.zero_grad(set_to_none=True)
mean_gap = max((shortcut[n] - g).abs().max().item() for n, g in reference.items())
with torch.no_grad():
    right_loss = sum(token_loss_sum(model, t, o)[0] for t, o in micro)
    right_loss /= sum(targets_per_rank)
print(f"mean of per-micro-batch means: loss {torch.stack(means).mean():.4f}, "
      f"over every target {right_loss:.4f}; gradient max difference {mean_gap:.1e}")
counts_differ = len({int((document_targets(t, o) != -100).sum()) for t, o in micro}) > 1
assert counts_differ and mean_gap > 10 * GRAD_TOL, (
    f"the mean of means should be off when lengths are uneven; difference {mean_gap:.1e}")

# %%
# Two ranks, launched as a reader launches them
# ---------------------------------------------
# Each rank wraps its own copy of the model. With DDP, every rank holds the
# whole model and the gradients are averaged over the ranks during the
# backward of the last micro-batch: ``no_sync`` keeps the others local.
# With FSDP2, ``fully_shard`` on every block and then on the model leaves
# each rank a shard of every weight (``full_tensor()`` gathers one), and
# ``set_requires_gradient_sync`` plays the part of ``no_sync``. The mesh is
# named, not guessed: ranks on the CPU build it on the CPU.
#
# .. literalinclude:: ../ragged_toolkit/data_parallel.py
#    :pyobject: wrap_model
#
# What every rank does is a ``DataParallelJob``: the process group's
# backend, the model's sizes, the gradient runs (DDP, FSDP2, and DDP with
# the count not reduced, the mistake), then timed training steps under DDP
# with AdamW, both ways of filling a micro-batch, on the attention backend
# named for them. The tensors (the initial weights, each rank's
# micro-batches) travel beside it. Each rank runs the same script, which
# calls ``data_parallel_worker``. The ranks leave together, each marking
# itself done in the job's folder and waiting for the others, before the
# process group is destroyed, so that no rank closes a connection its peer
# still uses; then the script exits without the interpreter's teardown
# (``os._exit``), where objects that still held a gloo connection were seen
# to abort a rank about once in 50 launches:
#
# .. literalinclude:: ../ragged_toolkit/data_parallel_launch.py
#    :pyobject: data_parallel_worker
#
# .. literalinclude:: ../ragged_toolkit/data_parallel_launch.py
#    :start-at: DATA_PARALLEL_SCRIPT =
#    :end-at: os._exit(0)
#
# ``torch.distributed.run`` (``torchrun``) starts the ranks, over the
# local network interface; ``run_data_parallel`` writes the job into a temporary
# folder, reads each rank's report back, and where a rank fails, raises with
# that rank's own error. The command, and its twin on a CUDA machine, where
# each rank takes a GPU and the ranks talk over NCCL:
#
# * ``python -m torch.distributed.run --standalone --nproc-per-node=2 worker.py FOLDER``
# * ``torchrun --standalone --nproc-per-node=gpu worker.py FOLDER`` (a rank per GPU)

from ragged_toolkit.attention import backend_support
from ragged_toolkit.data_parallel import check_same_gradients, nccl_ranks
from ragged_toolkit.data_parallel_launch import DataParallelJob, GradientRun, run_data_parallel

RUNS = [GradientRun("DDP", wrap="ddp"), GradientRun("FSDP2", wrap="fsdp"),
        GradientRun("DDP, count not reduced", wrap="ddp", reduce_count=False)]


def launch(backend, nproc, device, dtype):
    """The job on ``nproc`` ranks: the gradient check's micro-batches and the
    timed steps dealt to that many ranks; the gradients checked."""
    fused = backend_support("varlen", device, dtype, is_causal=True, needs_grad=True, gqa=True,
                            head_dim=cfg.head_dim)
    job = DataParallelJob(backend=backend, config=S.model, dtype=str(dtype).removeprefix("torch."), lr=LR,
                          grad_runs=RUNS, grad_backend="loop", time_backend="varlen" if fused is None else "loop")
    data = {"init": model.state_dict(),  # every rank starts from these weights
            "grad_batches": [micro[r::nproc] for r in range(nproc)],  # the micro-batches of rank r
            "time_batches": {name: deal(mbs, world=nproc)[:WARMUP_STEPS + S.steps]
                             for name, mbs in schemes.items()}}
    reports, grads = run_data_parallel(job, data, nproc)
    print(f"{nproc} ranks over {backend} on {reports[0]['device'].split(':')[0]} (CPU threads per rank: "
          f"{reports[0]['threads']}), timed steps on {job.time_backend!r}:")
    for run in RUNS[:2]:
        gap = check_same_gradients(grads[run.name], reference, GRAD_TOL)
        print(f"{run.name}:")
        print(f"data-parallel step: world size {nproc}, gradient max difference to one process {gap:.1e}")
    return reports, grads


reports, grads = launch("gloo", WORLD, "cpu", CPU_DTYPE)
GPUS = torch.cuda.device_count() if DEVICE == "cuda" else 0
NCCL_RANKS = nccl_ranks(GPUS, len(micro))  # one rank per GPU over NCCL, each with a micro-batch
if NCCL_RANKS:
    nccl_reports, _ = launch("nccl", NCCL_RANKS, "cuda", DTYPE)
elif GPUS == 1:
    print("one GPU: NCCL would run one rank, whose collectives do nothing; no data-parallel figure for the GPU")

# %%
# Without the ``all_reduce`` of the count, each rank divides by its own
# number of targets, and the same check fails:

print(wrapped(shows_failure(check_same_gradients, grads["DDP, count not reduced"], reference, GRAD_TOL)))

# %%
# What the ranks measured
# -----------------------
# Every rank timed each step between two barriers; a step ends for all
# ranks when the slowest has sent its gradients. Tokens per second count
# every rank's tokens. Ranks that share the cores of one machine add no
# compute, so what the CPU build measures is correctness (the gradients),
# the imbalance and the compile counts; with a GPU per rank, the same
# script measures data-parallel throughput (the NCCL lines, where the build
# machine has more than one GPU). The last line sets the step times of the
# two ways side by side with what differs between their steps: the
# imbalance, the tokens, and the attention pairs (a document cut by the
# budget is two shorter sequences, with fewer pairs than the whole).

from ragged_toolkit.measuring.bound import pairs_scored


def summary(reports, label):
    """Each way's step times, speed, imbalance, attention pairs and tokens per step."""
    print(label)
    out = {}
    for scheme in schemes:
        per_rank = [r["timing"][scheme] for r in reports]
        step_ms = 1e3 * np.max([t["seconds"][WARMUP_STEPS:] for t in per_rank], axis=0)
        q1, median, q3 = np.percentile(step_ms, [25, 50, 75])
        total = sum(sum(t["tokens"][WARMUP_STEPS:]) for t in per_rank)
        timed = deal(schemes[scheme], world=len(reports))[WARMUP_STEPS:WARMUP_STEPS + S.steps]
        pairs = np.mean([sum(pairs_scored(o.diff(), o.diff(), True) for rank in step for _, o in rank)
                         for step in timed])
        out[scheme] = dict(median_ms=median, imbalance=imbalance(timed), pairs=pairs, tokens=total / len(step_ms))
        print(f"  {scheme:15s}: step median {median:6.1f} ms (IQR {q1:.1f}-{q3:.1f}, {len(step_ms)} steps), "
              f"aggregate {total / step_ms.sum() * 1e3:,.0f} tokens/s")
        print(f"  {'':15s}  imbalance {out[scheme]['imbalance']:.2f}, attention pairs per step {pairs:,.0f}, "
              f"tokens per step {out[scheme]['tokens']:,.0f}")
    ratio = {k: out["fixed documents"][k] / out["token budget"][k] for k in out["token budget"]}
    print(f"  fixed documents / token budget: step time {ratio['median_ms']:.2f}x, imbalance "
          f"{ratio['imbalance']:.2f}x, tokens {ratio['tokens']:.2f}x, attention pairs {ratio['pairs']:.2f}x")
    return out


gloo = summary(reports, f"{WORLD} ranks over gloo, {S.steps} timed steps after {WARMUP_STEPS}:")
if NCCL_RANKS:
    nccl = summary(nccl_reports, f"{len(nccl_reports)} ranks over NCCL:")

# %%
# Conclusion
# ----------
# Filling micro-batches to a token budget balances the ranks by
# construction and gives every micro-batch one shape, which compiles once
# where attention reads the micro-batch by its shape (the rows layout);
# cutting documents at the budget costs a target and some context per cut,
# carrying them costs padding. Whatever fills the micro-batches, the loss is a sum over every
# token divided by a count summed over every rank, and a gradient check
# against one process on the whole batch is cheap enough to run in a test.
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
