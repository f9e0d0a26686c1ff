"""
Which attention path should I use?
==================================

This page runs every padding-free attention path PyTorch offers against
every job a reader has, on the device that built this page. For each path
and job, it shows whether the path runs (and why not), whether it is
correct, how fast it is, and which kernel ran. Then it builds a decision
guide from those measurements.

**Author:** the ragged-transformers tutorial contributors

.. grid:: 1 1 2 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Which of padding, SDPA on nested tensors, FlexAttention with a
         document mask, ``varlen_attn``, a per-sequence loop and length
         buckets can serve inference, training, decoding against a cache,
         grouped-query attention, a custom score function and a serving
         step on your device
       * How fast each is against the padded layout the job would otherwise
         run, beside the :term:`work bound`
       * What a decoding step pays for its bookkeeping, and how
         FlexAttention decodes without rebuilding its block mask
       * How to read which kernel ran (its :term:`kernel label`), and what
         this release's ``varlen_attn`` takes

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * The :doc:`building-blocks page <transformer_building_blocks>`:
         ``ragged_attention``, its six backends and ``compare_backends``
       * PyTorch 2.11 or later; on a CPU the tables show the CPU, on a CUDA
         GPU the page runs at full scale in ``bfloat16``
"""

# sphinx_gallery_tags = ["decision guide", "SDPA", "FlexAttention", "varlen attention", "benchmarks"]

# %%
# Six jobs, every path, one measurement
# -------------------------------------
# Which attention path is fastest is a measurement, not a rule: it depends
# on the device, the dtype, the lengths and the job. This page runs six jobs
# on one ragged batch:
#
# * **inference**: causal self-attention, forward only;
# * **training**: the same, forward and backward;
# * **decoding**: a generation step, its bookkeeping included. One new query
#   per sequence attends to the keys it has in a KV cache with spare room
#   (``kv_used``). A single query sees all of them (no causal mask);
# * **GQA**: inference with four query heads per key/value head;
# * **score_mod**: inference with a custom score function, the penalty of ALiBi;
# * **serving**: one step of continuous batching over a paged KV cache,
#   prompt chunks and decode tokens in one packed batch.
#
# Each job goes through:
#
# * the six backends of ``ragged_attention``, whose code is on the
#   :doc:`building-blocks page <transformer_building_blocks>`, section "Six
#   backends, six ways to compute it";
# * the :term:`padded layout` the job would otherwise run: each sequence in
#   its own row, padded to the longest;
# * the paths written below.
#
# Every number printed passed its correctness check first. Every conclusion
# is printed from the numbers.
#
# One kernel choice is made for you on CUDA. There, SDPA may try cuDNN
# attention first. cuDNN builds a plan for every new shape it sees. The
# ``loop`` backend meets a new shape for nearly every length, and
# ``bucketed`` for nearly every batch. So these two put flash and
# memory-efficient attention ahead of cuDNN attention
# (``many_shapes_kernels``). The padded baselines keep SDPA's own order,
# the kernel a practitioner gets.
#
# .. literalinclude:: ../ragged_toolkit/attention/dense.py
#    :pyobject: many_shapes_kernels
#
# The sizes are set per device. :term:`Quick mode <quick mode>`, the test
# suite's fast run, shrinks them:

import os

import inspect

import torch
from ragged_site.page import page_setup

SIZES = {
    # a serving batch; blocks of 256 rows, as the paged kernel of FlashAttention needs
    "cuda": dict(batch=256, heads=16, head_dim=64, zipf_alpha=1.1, block=256, run_time=0.5),
    # 90 s on 2 cores; real batches are the CUDA size and larger
    "cpu": dict(batch=48, heads=8, head_dim=32, zipf_alpha=1.2, block=16, run_time=0.2),
    "quick": dict(batch=12, run_time=0.05),  # TUTORIALS_QUICK=1, on either device
}
setup = page_setup(SIZES)
DEVICE, DTYPE, S = setup.device, setup.dtype, setup.sizes
KV_HEADS = S.heads // 4  # the GQA job: four query heads share each key/value head
where = torch.cuda.get_device_name() if DEVICE == "cuda" else f"{os.cpu_count()} cores"
print(
    f"{where}; batch {S.batch}, {S.heads} heads of {S.head_dim}, GQA with {KV_HEADS} key/value heads"
)

# %%
# The batch is drawn from the site's length generator. The first four jobs
# go through ``compare_backends``, which checks each backend against a
# float32 reference before timing it. The decoding job builds each
# backend's :term:`plan` (what ``plan_batch`` prepares for a batch) inside
# the timed call (``plan_per_call``). While generating, the lengths change
# at every step. So whatever a backend prepares per batch (gather indices, a
# block mask) is prepared again at every step.
#
# Each line ends with the :term:`kernel label`: the attention kernel that
# ran, in brackets, with its call count. Quick mode profiles nothing, so it
# shows none.

import numpy as np
from ragged_toolkit.batches import offsets_from_lengths
from ragged_site.workloads import sentence_lengths
from ragged_site.measuring.compare import compare_backends
from ragged_toolkit.attention.flex import FLEX_BLOCK, FlexKernel

FLEX = FlexKernel()  # the page's compiled FlexAttention, passed to every flex call
lengths = sentence_lengths(np.random.default_rng(setup.seed), S.batch, S.zipf_alpha)
offsets = offsets_from_lengths(lengths, DEVICE)
T = int(lengths.sum())
gen = torch.Generator(DEVICE).manual_seed(setup.seed)


def randn(*shape):
    return torch.randn(*shape, generator=gen, device=DEVICE).to(DTYPE)


q, k, v = (randn(T, S.heads, S.head_dim) for _ in range(3))  # (T, H, D)
k_gqa, v_gqa = k[:, :KV_HEADS].contiguous(), v[:, :KV_HEADS].contiguous()  # (T, H_kv, D)
capacity = int(lengths.max()) + 32  # a KV cache's room per sequence
one_each = torch.arange(S.batch + 1, device=DEVICE)  # query offsets: one query per sequence
cache_offsets = one_each * capacity
k_cache, v_cache = (randn(S.batch * capacity, S.heads, S.head_dim) for _ in range(2))
q_one = randn(S.batch, S.heads, S.head_dim)  # one new query per sequence
used = lengths.to(DEVICE)  # the keys each sequence has in its cache
print(
    f"{S.batch} sequences, {T} tokens, longest {int(lengths.max())}; "
    f"padding would hold {S.batch * int(lengths.max())} slots"
)

JOBS = {  # job -> the tensors and offsets compare_backends gets, and its keywords
    "inference": ((q, k, v, offsets), dict(is_causal=True)),
    "training": ((q, k, v, offsets), dict(is_causal=True, backward=True)),
    "decoding": (
        (q_one, k_cache, v_cache, one_each, cache_offsets),
        dict(kv_used=used, plan_per_call=True),
    ),
    "GQA": ((q, k_gqa, v_gqa, offsets), dict(is_causal=True)),
}
table = {}  # job -> path -> its Timing, or why it cannot take the job here
for job, (tensors, keywords) in JOBS.items():
    print(f"{job}:")
    table[job] = compare_backends(
        *tensors, **keywords, flex=FLEX, min_run_time=S.run_time, profile=not setup.quick
    )

# %%
# varlen_attn in this release
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``varlen_attn`` is the variable-length kernel of FlashAttention: CUDA only,
# in ``float16`` or ``bfloat16``. Its keyword arguments changed in every
# release from 2.10 to 2.12. Causal came as ``is_causal``, then as
# ``window_size``. ``enable_gqa``, ``seqused_k`` and ``block_table`` came
# later. So the toolkit adapts every call in one place, to the keywords of
# the installed release. It reads them from the release's signature. A
# feature the release lacks raises ``VarlenUnavailable``, which names it.
# The feature is never dropped. What this release takes:
#
# .. literalinclude:: ../ragged_toolkit/attention/varlen.py
#    :pyobject: varlen_kwargs

from ragged_toolkit.attention import backend_support
from ragged_toolkit.attention.varlen import VarlenUnavailable, varlen_kwargs, varlen_missing

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # a release without it
    varlen_attn = None
parameters = inspect.signature(varlen_attn).parameters if varlen_attn else {}
print(
    f"varlen_attn in PyTorch {torch.__version__}: "
    + (f"{len(parameters)} parameters" if parameters else "none in this build")
)
WITHOUT = {  # what the toolkit does where the release lacks a feature
    "causal": "no causal job runs on varlen",
    "enable_gqa": "the backend repeats the key/value heads",
    "seqused_k": "the keys in use are gathered first",
    "block_table": "a paged cache is gathered first",
}
for feature, instead in WITHOUT.items():
    print(f"  {feature:11s} {'no: ' + instead if varlen_missing([feature]) else 'yes'}")
try:  # a call that needs what 2.11's varlen_attn lacks, against 2.11's keywords
    varlen_kwargs(is_causal=True, enable_gqa=True, keywords={"return_aux", "scale", "window_size"})
except VarlenUnavailable as err:
    print(f"an older release, simulated with the keywords of 2.11:\n  {err}")
why_not = backend_support("varlen", DEVICE, DTYPE, is_causal=True, head_dim=S.head_dim)
print(f"varlen_attn on this device: {why_not or 'runs'}")

# %%
# Decoding without rebuilding the mask
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The ``flex`` row of the decoding job pays ``create_block_mask`` at every
# step: its plan evaluates the mask over the whole grid. FlexAttention's
# inference examples build the mask once, for the cache's capacity, and
# only refresh it. This page does the same:
#
# * the cache is read in place as ``(B, H, capacity, D)``;
# * the mask function reads the lengths from a tensor that each step
#   updates in place;
# * every listed block is *partial*, so the mask function runs inside the
#   kernel;
# * a step only recounts each sequence's key blocks.

from torch.nn.attention.flex_attention import BlockMask

k_rect, v_rect = (
    t.view(S.batch, capacity, S.heads, S.head_dim).transpose(1, 2) for t in (k_cache, v_cache)
)  # (B, H, capacity, D): the cache, read in place
in_use = used.clone()  # the lengths the mask reads, updated in place


def within_length(b, h, q_idx, kv_idx):
    return kv_idx < in_use[b]


n_blocks = -(-capacity // FLEX_BLOCK)
kv_num_blocks = torch.zeros(S.batch, 1, 1, dtype=torch.int32, device=DEVICE)
kv_indices = torch.arange(n_blocks, dtype=torch.int32, device=DEVICE).expand(
    S.batch, 1, 1, n_blocks
)
decoding_mask = BlockMask.from_kv_blocks(
    kv_num_blocks,
    kv_indices.contiguous(),
    BLOCK_SIZE=FLEX_BLOCK,
    mask_mod=within_length,
    seq_lengths=(1, capacity),
)


@torch.no_grad()
def flex_refreshed():  # a decoding step: the mask's lengths refreshed, nothing rebuilt
    in_use.copy_(used)
    kv_num_blocks.copy_((-(-used // FLEX_BLOCK)).view(-1, 1, 1))
    return FLEX(q_one[:, :, None], k_rect, v_rect, block_mask=decoding_mask)


# %%
# The baseline, and one row with a mask
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The ``padded`` backend pads inside the call, a gather and a scatter that a
# model written for padded batches never pays. So the baseline of every job
# is attention on tensors padded from the start. For decoding, it is the
# fixed-shape step of ``CachedStep`` (:doc:`ragged_decoding_kv_cache_gqa`).
# *One row with a mask* is the batch as the packed row ``transformers``
# sees:
#
# .. literalinclude:: ../ragged_site/decision.py
#    :pyobject: padded_attention
#
# .. literalinclude:: ../ragged_site/decision.py
#    :pyobject: padded_decoding
#
# .. literalinclude:: ../ragged_site/decision.py
#    :pyobject: one_row_attention
#
# ``compare_calls`` checks each call against the float32 reference (the
# training job's ``dq``, ``dk``, ``dv`` too), then times them together.

from ragged_site.reference import reference_attention
from ragged_site.decision import one_row_paths, padded_decoding, padded_paths
from ragged_site.measuring.compare import compare_calls
from ragged_site.measuring.tables import print_timings

grad_packed = randn(T, S.heads, S.head_dim)  # the gradient of a loss at the output
q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
causal = reference_attention(q32, k32, v32, offsets, is_causal=True)
REFERENCE = {  # job -> what its paths must return, in float32
    "inference": causal.detach(),
    "training": torch.autograd.grad(
        causal, (q32, k32, v32), grad_packed.float()
    ),  # ``dq``, ``dk``, ``dv``
    "decoding": reference_attention(q_one, k_cache, v_cache, one_each, cache_offsets, kv_used=used),
    "GQA": reference_attention(q, k_gqa, v_gqa, offsets, is_causal=True),
}
padded = padded_paths(q, k, v, offsets, grad_packed, KV_HEADS)
padded["decoding"] = padded_decoding(q_one, k_rect, v_rect, used)
one_row = one_row_paths(q, k, v, offsets, grad_packed, KV_HEADS)
OTHER_PATHS = {  # (job, path) -> the call, and how its output becomes the reference's layout
    **{(job, "baseline"): padded[job] for job in JOBS},
    **{(job, "one row + mask"): call for job, call in one_row.items()},
    ("decoding", "flex (refreshed)"): (
        flex_refreshed,
        lambda out: out[:, :, 0].float(),
    ),  # (B, H, D)
}
other_times = compare_calls(
    {key: (*path, REFERENCE[key[0]]) for key, path in OTHER_PATHS.items()},
    dtype=DTYPE,
    min_run_time=S.run_time,
    profile=not setup.quick,
)
print_timings(other_times)
for (job, path), timing in other_times.items():
    table[job][path] = timing
table["decoding"]["one row + mask"] = "a cache with spare rows needs kv_used, not one row"
rebuilt, refreshed = table["decoding"].get("flex"), table["decoding"]["flex (refreshed)"]
if hasattr(rebuilt, "median_ms"):
    print(
        f"flex, one decoding step: mask rebuilt {rebuilt.median_ms:.2f} ms, refreshed "
        f"{refreshed.median_ms:.2f} ms: {rebuilt.median_ms / refreshed.median_ms:.1f}x"
    )

# %%
# A custom score function
# ~~~~~~~~~~~~~~~~~~~~~~~
# ``ragged_attention`` takes no score function: only FlexAttention accepts
# arbitrary Python (``score_mod``), compiled into its kernel:
#
# .. literalinclude:: ../ragged_site/decision.py
#    :pyobject: alibi_score_mod
#
# A dense SDPA call takes a precomputed additive bias instead, one per
# sequence for the loop, one for the padded square (``alibi_paths``):
#
# .. literalinclude:: ../ragged_site/decision.py
#    :pyobject: alibi_bias
#
# ``varlen_attn`` and SDPA on nested tensors take neither.

from ragged_site.decision import alibi_paths, alibi_reference

slopes = torch.exp2(
    -8.0 * torch.arange(1, S.heads + 1, device=DEVICE) / S.heads
)  # (H,): the slopes of ALiBi
alibi_want = alibi_reference(q, k, v, offsets, slopes)  # (T, H, D), float32
alibi = {path: (*call, alibi_want) for path, call in alibi_paths(q, k, v, offsets, slopes).items()}
NOT_FOR_SCORE_MOD = {  # path -> why it does not take this job here
    "one row + mask": "possible with a bias over the whole row; not written here",
    "varlen": "no score function or bias argument",
    "sdpa_njt": "SDPA on nested tensors takes no mask or bias",
    "bucketed": "possible with a bias per bucket; not written here",
    "padded": "takes no bias (the padded baseline does)",
}
table["score_mod"] = NOT_FOR_SCORE_MOD | compare_calls(
    alibi, dtype=DTYPE, min_run_time=S.run_time, profile=not setup.quick
)
print("score_mod (ALiBi, causal, forward):")
print_timings(table["score_mod"])

# %%
# Serving: a continuous batch over a paged KV cache
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# This job is one step of continuous batching, built with the serving code
# of :doc:`serving_continuous_batching`. Four newcomers, the longest
# requests, feed the last chunk of their prompts. Every other request feeds
# its last generated token. The keys live in blocks of a ``PagedKVCache``.
# The blocks were handed out as the requests grew side by side.
# ``build_step`` packs the step. It also builds what the path reads the
# cache with, once for every layer. The paths read the cache in three ways:
#
# * ``gathered`` gathers the keys in use and runs ``ragged_attention`` with
#   a backend (``loop``, ``bucketed``, ``padded`` below);
# * ``varlen`` reads the cache in place through its block table;
# * ``flex`` reads it through a paged block mask.
#
# The serving page shows the first two. Here is the code of the third:
#
# .. literalinclude:: ../ragged_toolkit/serving/paged_attention.py
#    :pyobject: _flex_paged_attention
#
# The baseline is the padded layout that a server without ragged attention
# runs (``PaddedServing``, padded once per step). It pads two groups:
#
# * the decode tokens, as one-query rows against their keys padded to the
#   longest;
# * the prompt chunks, padded apart, each query seeing the keys up to its
#   own position.
#
# .. literalinclude:: ../ragged_site/decision.py
#    :pyobject: PaddedServing.__call__

from ragged_site.decision import PaddedServing
from ragged_toolkit.gpt import GPTConfig
from ragged_toolkit.kv_cache import PagedKVCache, paged_rows
from ragged_toolkit.serving.engine import build_step
from ragged_toolkit.serving.paged_attention import PAGED_PATHS, paged_varlen_support
from ragged_toolkit.serving.requests import Request

CHUNK = 16  # prompt tokens a newcomer feeds per step
cfg = GPTConfig(
    vocab_size=256,
    dim=S.heads * S.head_dim,
    n_layers=1,
    n_heads=S.heads,
    n_kv_heads=S.heads,
    ffn_hidden=4 * S.heads * S.head_dim,
    max_seq_len=capacity,
)
newcomers = lengths.argsort(descending=True)[
    :4
].tolist()  # the four longest: their prompts are still fed
requests = [
    Request(rid, [0] * n, n_out=1, computed=max(n - CHUNK, 0))
    if rid in newcomers  # a last chunk
    else Request(rid, [0] * (n - 1), n_out=2, generated=[0], computed=n - 1)  # a decode token
    for rid, n in enumerate(lengths.tolist())
]
cache = PagedKVCache(cfg, sum(-(-r.length() // S.block) for r in requests), S.block, DEVICE, DTYPE)
for grown in range(S.block, int(lengths.max()) + S.block, S.block):  # block by block, side by side
    assert all(cache.reserve(r.rid, min(grown, r.length())) for r in requests)
cache.k[0], cache.v[0] = (
    randn(*cache.k.shape[1:]),
    randn(*cache.v.shape[1:]),
)  # the keys written so far
work = [(r, r.pending()) for r in requests]  # (request, tokens it feeds)


def paged_call(path, backend=None):
    """The step's attention through ``path``, its layout built once, as
    every layer of the step shares it: the call, and its output as float32."""
    _, _, layout = build_step(
        cache, work, DEVICE, path, backend, flex=FLEX
    )  # tokens, positions, layout
    q_step = q[: int(layout.q_offsets[-1])]  # (T_step, H, D)
    return lambda: PAGED_PATHS[path](q_step, layout, 0), lambda out: out.float()


_, _, step = build_step(
    cache, work, DEVICE, "varlen"
)  # the step's offsets, lengths and block table
q_len, kv_len, q_step = step.q_offsets.diff(), step.kv_lengths, q[: int(step.q_offsets[-1])]
rows = paged_rows(step.block_table, kv_len, S.block)  # every key in use, request after request
serving_reference = reference_attention(
    q_step,
    cache.k[0][rows],
    cache.v[0][rows],
    step.q_offsets,
    offsets_from_lengths(kv_len, DEVICE),
    is_causal=True,
)
padded_serving = PaddedServing(step, q_step)  # two SDPA calls: the decode rows, the prompt chunks
serving_paths = {
    "baseline": (padded_serving, padded_serving.packed),
    "flex": paged_call("flex"),
    **{name: paged_call("gathered", name) for name in ("loop", "bucketed", "padded")},
}
NOT_FOR_SERVING = {  # path -> why it does not take this job here
    "one row + mask": "not written for a paged cache",
    "varlen": paged_varlen_support(DEVICE, DTYPE, S.block),  # None: it runs
    "sdpa_njt": "SDPA on nested tensors aligns is_causal top-left: not for more keys than queries",
}
if NOT_FOR_SERVING["varlen"] is None:
    serving_paths["varlen"] = paged_call("varlen")
serving = {path: (*call, serving_reference) for path, call in serving_paths.items()}
table["serving"] = NOT_FOR_SERVING | compare_calls(
    serving, dtype=DTYPE, min_run_time=S.run_time, profile=not setup.quick
)
chunks, decodes = (
    int(padded_serving.groups[name].sum()) for name in ("prompt chunks", "decode tokens")
)
print(
    f"serving ({S.batch} requests in blocks of {S.block} rows: {chunks} prompt chunks, {decodes} decode tokens):"
)
print_timings(table["serving"])

# %%
# The decision guide, from this build
# -----------------------------------
# For each job, the guide prints:
#
# * the path chosen here, with its median and kernels;
# * its speedup over the padded baseline, beside the job's
#   :term:`work bound` and the :term:`fraction of the bound` it reaches;
# * what to use next;
# * which paths cannot take the job here (the lines above say why);
# * one rule per job: "use X; if X is not available here, Y".
#
# A CPU build also prints the rules for CUDA. They come from a GPU run,
# once one is recorded, or else from published figures, marked "not measured
# here yet".
#
# The work bound is the speedup to expect if time followed work: the padded
# baseline's work divided by the packed path's. The fraction of the bound is
# the measured speedup divided by the work bound.
#
# ``choose`` takes the fastest path only where its interquartile range (IQR)
# does not overlap the next one's. Within the noise, it keeps the default
# from ``default_backend``: the loop on a CPU. The bound counts query-key
# pairs:
#
# * for causal jobs, the causal half (a causal kernel skips the rest);
# * for the score function, the whole square (its padded baseline and loop
#   bias all of it);
# * for decoding, the cached rows up to the longest in use;
# * for serving, the rectangles of the two padded groups, against each
#   query's keys up to its own position.

from ragged_toolkit.attention import BACKENDS, default_backend
from ragged_site.decision import GPU_RECORD, PUBLISHED_CUDA, decision_guide, device_rules
from ragged_site.measuring.bound import Work, work_bound

PAIRS = Work(per_token=0.0, per_pair=1.0)  # attention's work: the query-key pairs scored
causal_bound = work_bound(lengths, work=PAIRS, causal=True)
serving_pairs = float((q_len * kv_len - q_len * (q_len - 1) / 2).sum())  # the ragged step's pairs
BOUND = {
    "inference": causal_bound,
    "training": causal_bound,
    "GQA": causal_bound,
    "decoding": work_bound(
        torch.ones_like(lengths), lengths, work=PAIRS
    ),  # one query, its keys in use
    "score_mod": work_bound(lengths, work=PAIRS),
    "serving": padded_serving.pairs / serving_pairs,
}
BEYOND = {  # what two other pages measure for these jobs
    "serving": "with shared prompts: a prefix cache, and shared-prefix attention where many requests "
    "share a long prefix (serving_shared_prompts)",
    "training": "hybrid models: recurrent layers reset at every document (packed_recurrent_layers)",
}
cuda_rules = [] if DEVICE == "cuda" else device_rules("cuda", PUBLISHED_CUDA, GPU_RECORD)
default = (default_backend(DEVICE, DTYPE, S.head_dim), "loop")
decision_guide(table, BOUND, default, BEYOND, device=DEVICE, elsewhere=cuda_rules)

# %%
# The same speedups for every path
# --------------------------------
# Each cell is a path's measured speedup over the padded baseline for that
# job; higher is better. In brackets is its fraction of the job's work
# bound. :doc:`measuring_ragged_batches` explains what that fraction tells,
# and what it does not.

import matplotlib.pyplot as plt
from ragged_site.decision import speedup_grid
from ragged_site.figures import FIGURE_STYLE, draw_speedups

plt.rcParams.update(FIGURE_STYLE)
ROWS = (
    "baseline",
    "one row + mask",
    *BACKENDS,
    "flex (refreshed)",
)  # every path, the baseline first
draw_speedups(
    speedup_grid(table, ROWS),
    ROWS,
    list(table),
    [BOUND[job] for job in table],
    f"Measured speedup over the padded baseline, {DEVICE}, {str(DTYPE).removeprefix('torch.')}\n"
    "(in brackets: fraction of the computed work bound)",
)
plt.show()

# sphinx_gallery_thumbnail_number = 1

# %%
# How to read it
# --------------
# The ranking holds for this device, this dtype and these lengths. Re-run
# the page, or ``compare_backends`` on your own batch, on the machine you
# will train or serve on. Profile a path's call to see why it wins or loses
# (:doc:`measuring_ragged_batches`). A few things hold everywhere, because
# they follow from what each path computes:
#
# * padding does the work of ``B x S_max`` tokens whatever the lengths, so
#   its cost grows with the longest sequence, not with the batch's tokens;
# * the per-sequence loop does exactly the real work but pays one call per
#   sequence, so it suits few long sequences better than many short ones;
# * a decoding step pays for whatever its path prepares per batch, at every
#   step. A plan that needs no mask, or a mask refreshed in place, keeps
#   that cost small;
# * one row with a mask scores every pair of the row, so its cost grows with
#   the square of the batch's tokens, not with the sum of its sequences';
# * FlexAttention is the only path here that takes an arbitrary score
#   function. ``backend_support`` says whether it has a backward on this
#   device; on a CPU it has none;
# * attention is not every layer. A hybrid model's recurrent layers need
#   their state and convolution reset at every document of a packed row
#   (:doc:`packed_recurrent_layers`). A server whose requests share prompts
#   gains most from caching them (:doc:`serving_shared_prompts`). Those
#   pages measure what each buys on the build's device.
#
# References
# ----------
# * `scaled_dot_product_attention
#   <https://docs.pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html>`_
# * `FlexAttention <https://pytorch.org/blog/flexattention/>`_;
#   `FlexAttention for inference <https://pytorch.org/blog/flexattention-for-inference/>`_
# * `varlen_attn <https://docs.pytorch.org/docs/stable/nn.attention.varlen.html>`_
