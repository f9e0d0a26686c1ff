"""What only the decision page (``which_attention_path``) uses: the dense
paths a reader would write without ragged attention (tensors padded from the
start, the batch as one row with a mask), ALiBi as a score function and as
biases, a serving step padded as a server without ragged attention runs it,
and the decision guide assembled from the page's measurements.

A path here is ``(call, packed)``: a call of no arguments, and what turns its
output into the packed layout of the reference, ``(T, H, D)`` in float32
(:func:`~ragged_site.measuring.compare.compare_calls` checks and times
them). Nothing here times."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ragged_toolkit.batches import from_padded, offsets_from_lengths, to_padded, token_index
from ragged_toolkit.kv_cache import paged_rows
from ragged_site.measuring.bound import speedup_line
from ragged_site.measuring.noise import choose, outside_noise
from ragged_site.measuring.tables import Table
from ragged_site.measuring.timing import Timing
from ragged_site.records import record

__all__ = [
    "padded_attention",
    "one_row_attention",
    "padded_paths",
    "one_row_paths",
    "padded_decoding",
    "alibi_score_mod",
    "alibi_bias",
    "alibi_paths",
    "alibi_reference",
    "PaddedServing",
    "decision_guide",
    "device_rules",
    "GPU_RECORD",
    "PUBLISHED_CUDA",
    "speedup_grid",
]

_BASELINE = "baseline"  # the path every speedup is measured against
GPU_RECORD = Path(__file__).resolve().parent.parent / "gpu-results" / "summary.json"
_DEVICE_NAMES = {"cpu": "CPU", "cuda": "CUDA"}  # as the rules print them

# What published measurements say for CUDA, until a GPU run of the decision
# page is recorded (job -> the rule, and the figures it rests on).
PUBLISHED_CUDA = {
    "inference": (
        "use varlen; if varlen is not available here, sdpa_njt.",
        "pytorch/pytorch#164502 timed varlen_attn at 0.22 ms against 0.43 ms for padded SDPA "
        "(H100, bfloat16, 8 sequences of up to 2,048 tokens, not causal). The original tutorial "
        "timed SDPA on nested tensors 5.65x faster than its masked nn.MultiheadAttention (A100).",
    ),
    "training": (
        "use sdpa_njt.",
        "The original tutorial timed its backward pass 144x faster than its masked "
        "nn.MultiheadAttention's (A100). No cited figure ranks a second path.",
    ),
}


def padded_attention(qh, kh, vh):
    """Causal attention as a model written for padded batches runs it: one
    SDPA call with ``is_causal`` on tensors padded from the start, q (B, H,
    S, D), k and v (B, H_kv, S, D) -> (B, H, S, D). With right padding a
    causal query never reaches a padding key."""
    return F.scaled_dot_product_attention(
        qh, kh, vh, is_causal=True, enable_gqa=kh.shape[1] != qh.shape[1]
    )


def one_row_attention(qr, kr, vr, row_mask):
    """The whole batch as one sequence, q (1, H, T, D), k and v (1, H_kv, T,
    D), with a (T, T) block-diagonal causal mask, what ``transformers`` builds
    from the position ids of a packed row: every pair of the row is scored.
    Returns (1, H, T, D)."""
    return F.scaled_dot_product_attention(
        qr, kr, vr, attn_mask=row_mask, enable_gqa=kr.shape[1] != qr.shape[1]
    )


def _forward(attention, *tensors):
    """A call of ``attention(*tensors)`` without autograd."""
    return torch.no_grad()(lambda: attention(*tensors))


def _backward(attention, q, k, v, grad):
    """A call that returns ``dq, dk, dv`` of ``attention(q, k, v)`` against
    ``grad``, the gradient of a loss at its output (leaves made once)."""
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    return lambda: torch.autograd.grad(attention(*leaves), leaves, grad)


def padded_paths(q, k, v, offsets, grad, kv_heads):
    """The baseline of the inference, training and GQA jobs:
    :func:`padded_attention` on the packed batch q, k, v (T, H, D) padded
    once, before any call, to (B, H, S, D); training against ``grad`` (T, H,
    D), zero at padding (padding adds nothing to ``dk``, ``dv``); GQA with
    the first ``kv_heads`` key/value heads, contiguous as a GQA model holds
    them. Returns job -> ``(call, packed)``; training's call returns ``dq,
    dk, dv``."""
    qh, kh, vh = (
        to_padded(t, offsets)[0].transpose(1, 2).contiguous() for t in (q, k, v)
    )  # (B, H, S, D)
    grad_h = to_padded(grad, offsets)[0].transpose(1, 2)
    kh_gqa, vh_gqa = kh[:, :kv_heads].contiguous(), vh[:, :kv_heads].contiguous()  # (B, H_kv, S, D)

    def unpad(out):  # (B, H, S, D) -> (T, H, D)
        return from_padded(out.transpose(1, 2), offsets).float()

    return {
        "inference": (_forward(padded_attention, qh, kh, vh), unpad),
        "training": (_backward(padded_attention, qh, kh, vh, grad_h), unpad),
        "GQA": (_forward(padded_attention, qh, kh_gqa, vh_gqa), unpad),
    }


def one_row_paths(q, k, v, offsets, grad, kv_heads):
    """The same jobs as :func:`padded_paths` through
    :func:`one_row_attention`: q, k, v (T, H, D) viewed as (1, H, T, D), the
    row's mask built once. Returns job -> ``(call, packed)``."""
    seq, position = token_index(offsets)[0], torch.arange(len(q), device=q.device)
    row_mask = (seq[:, None] == seq) & (position[:, None] >= position)  # (T, T)
    qr, kr, vr = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, H, T, D)

    def attend(*qkv):
        return one_row_attention(*qkv, row_mask)

    def unrow(out):  # (1, H, T, D) -> (T, H, D)
        return out[0].transpose(0, 1).float()

    return {
        "inference": (_forward(attend, qr, kr, vr), unrow),
        "training": (_backward(attend, qr, kr, vr, grad.transpose(0, 1)[None]), unrow),
        "GQA": (_forward(attend, qr, kr[:, :kv_heads], vr[:, :kv_heads]), unrow),
    }


def padded_decoding(q_one, k_rect, v_rect, used):
    """The baseline of a decoding step, a fixed-shape step as
    ``CachedStep`` runs it: one query per
    sequence, q_one (B, H, D), against the cache read in place as
    rectangles k_rect, v_rect (B, H, capacity, D); the rows up to the
    longest in use are scored, those past each sequence's ``used`` (B,)
    masked. Returns ``(call, packed)``, packed (B, H, D)."""
    n_used = int(used.max())

    @torch.no_grad()
    def step():  # (B, H, 1, D)
        in_use = torch.arange(n_used, device=used.device) < used[:, None]  # (B, n_used)
        return F.scaled_dot_product_attention(
            q_one[:, :, None],
            k_rect[:, :, :n_used],
            v_rect[:, :, :n_used],
            attn_mask=in_use[:, None, None],
        )

    return step, lambda out: out[:, :, 0].float()


def alibi_score_mod(slopes):
    """ALiBi as a FlexAttention ``score_mod``: each score lowered by its
    head's slope (``slopes``, (H,)) times the distance from the query back
    to the key. The indices are packed positions, whose differences within
    a sequence are the sequence's own."""

    def alibi_penalty(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    return alibi_penalty


def alibi_bias(slopes, n):
    """ALiBi as an additive bias for a dense SDPA call over ``n`` positions:
    (H, n, n), the penalty below the diagonal, ``-inf`` above it (causal)."""
    distance = torch.arange(n, device=slopes.device)[:, None] - torch.arange(
        n, device=slopes.device
    )
    return (-slopes[:, None, None] * distance.float()).masked_fill(distance < 0, float("-inf"))


def alibi_paths(q, k, v, offsets, slopes):
    """The score-function job, causal attention with ALiBi on q, k, v (T, H,
    D), through three paths. ``flex``: FlexAttention over the packed row
    (1, H, T, D), :func:`alibi_score_mod` compiled into its kernel, a block
    mask causal within each sequence; ``loop``: one SDPA call per sequence on
    (1, H, L, D) views, each with its bias (1, H, L, L) built once per batch;
    ``baseline``: the padded baseline, one SDPA call on (B, H, S, D) with a bias (B, H, S,
    S) that also masks the padding keys. Returns path -> ``(call, packed)``."""
    lengths = offsets.diff().tolist()
    seq = token_index(offsets)[0]
    alibi_penalty = alibi_score_mod(slopes)

    def causal_within_sequence(b, h, q_idx, kv_idx):
        return (seq[q_idx] == seq[kv_idx]) & (q_idx >= kv_idx)

    @torch.compile(dynamic=False)
    def flex_alibi(q, k, v, block_mask):
        return flex_attention(q, k, v, score_mod=alibi_penalty, block_mask=block_mask)

    score_mask = create_block_mask(
        causal_within_sequence, None, None, len(q), len(q), device=q.device
    )
    qr, kr, vr = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, H, T, D)
    per_seq = list(zip(*(t.split(lengths) for t in (q, k, v))))  # (L, H, D) each
    biases = [alibi_bias(slopes, n).to(q.dtype)[None] for n in lengths]
    qh, kh, vh = (
        to_padded(t, offsets)[0].transpose(1, 2).contiguous() for t in (q, k, v)
    )  # (B, H, S, D)
    valid = to_padded(q, offsets)[1]  # (B, S)
    pad_bias = (
        alibi_bias(slopes, qh.shape[2])
        .masked_fill(~valid[:, None, None, :], float("-inf"))
        .to(q.dtype)
    )

    def loop():
        return torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(t.transpose(0, 1)[None] for t in qkv), attn_mask=bias
                )[0]
                for qkv, bias in zip(per_seq, biases)
            ],
            1,
        ).transpose(0, 1)

    return {
        "flex": (
            torch.no_grad()(lambda: flex_alibi(qr, kr, vr, score_mask)[0].transpose(0, 1)),
            lambda out: out.float(),
        ),
        "loop": (torch.no_grad()(loop), lambda out: out.float()),
        _BASELINE: (
            torch.no_grad()(lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=pad_bias)),
            lambda out: from_padded(out.transpose(1, 2), offsets).float(),
        ),
    }


def alibi_reference(q, k, v, offsets, slopes):
    """Causal attention with ALiBi, (T, H, D) in float32, from float32
    copies, sequence by sequence with SDPA's math kernel: no kernel shared
    with the paths of :func:`alibi_paths`."""
    with sdpa_kernel(SDPBackend.MATH):
        return torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(t.float().transpose(0, 1) for t in (a, b, c)),
                    attn_mask=alibi_bias(slopes, len(a)),
                ).transpose(0, 1)
                for a, b, c in zip(*(t.split(offsets.diff().tolist()) for t in (q, k, v)))
            ]
        )


class PaddedServing:
    """A serving step as a server without ragged attention runs it: the
    decode tokens as one-query rows against their keys padded to the
    longest, the prompt chunks padded apart, each query seeing the keys up
    to its own position; two SDPA calls. ``step``: the step's
    :class:`~ragged_toolkit.serving.paged_attention.PagedLayout`; ``q`` (T,
    H, D): its queries; ``layer``: the cache layer read. ``groups``: name ->
    which requests (B,) it holds; ``tensors``: name -> its padded queries (B_g, H,
    S_q, D), keys and values (B_g, H_kv, S_kv, D), the mask of the keys each
    query sees (B_g, 1, S_q, S_kv) and the queries' offsets, by name;
    ``pairs``: the query-key pairs the two calls score (their rectangles).
    Calling it returns name -> (B_g, H, S_q, D); :meth:`packed` puts them
    back in the step's order."""

    def __init__(self, step, q, layer=0):
        q_len, kv_len, device = step.q_offsets.diff(), step.kv_lengths, q.device
        rows = paged_rows(
            step.block_table, kv_len, step.cache.block_size
        )  # every key in use, request by request
        keys, values = step.cache.k[layer][rows], step.cache.v[layer][rows]
        self.q_seq, kv_seq = (
            token_index(step.q_offsets)[0],
            token_index(offsets_from_lengths(kv_len, device))[0],
        )
        self.groups = {"decode tokens": q_len == 1, "prompt chunks": q_len > 1}
        self.tensors = {}
        for name, group in self.groups.items():
            q_offsets = offsets_from_lengths(q_len[group], device)
            qp = to_padded(q[group[self.q_seq]], q_offsets)[0].transpose(1, 2)
            kp, vp = (
                to_padded(t[group[kv_seq]], offsets_from_lengths(kv_len[group], device))[
                    0
                ].transpose(1, 2)
                for t in (keys, values)
            )
            i, j = (
                torch.arange(qp.shape[2], device=device),
                torch.arange(kp.shape[2], device=device),
            )
            shift = (kv_len - q_len)[group][
                :, None, None
            ]  # a query at i sees the keys up to i + shift
            sees = (j <= i[:, None] + shift) & (j < kv_len[group][:, None, None])
            self.tensors[name] = dict(q=qp, k=kp, v=vp, mask=sees[:, None], q_offsets=q_offsets)
        self.pairs = sum(t["mask"].numel() for t in self.tensors.values())

    @torch.no_grad()
    def __call__(self):
        return {
            name: F.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=t["mask"])
            for name, t in self.tensors.items()
        }

    def packed(self, outs):
        """The outputs of a call, name -> (B_g, H, S_q, D), as the step's
        packed (T, H, D) in float32."""
        first = next(iter(outs.values()))
        out = first.new_empty(len(self.q_seq), first.shape[1], first.shape[3], dtype=torch.float32)
        for name, o in outs.items():
            where = self.groups[name][self.q_seq]  # (T,): the tokens of the group's requests
            out[where] = from_padded(o.transpose(1, 2), self.tensors[name]["q_offsets"]).float()
        return out


def _rule(job, device, best, then):
    """One sentence for a job on a device: use the path chosen there; if it
    is not available, the fastest other path that ran (where padding wins,
    the fastest ragged path)."""
    name = _DEVICE_NAMES.get(device, device)
    fallback = then[0] if then else None
    if fallback is None:
        line = f"{job} on {name}: use {best}, the only path that ran."
    elif best == _BASELINE:
        line = (
            f"{job} on {name}: use the padded baseline; the fastest ragged path here is {fallback}."
        )
    else:
        line = f"{job} on {name}: use {best}; if {best} is not available here, {fallback}."
    return record("rule", line, job=job, device=device, use=best, fallback=fallback)


def _recorded_rules(summary, device):
    """The rule lines for ``device`` of the decision page's recorded runs in
    ``summary`` (``gpu-results/summary.json``), from its full-size run where
    that passed, else its quick one."""
    page = json.loads(summary.read_text()).get("pages", {}).get("which_attention_path", {})
    runs = sorted(page.get("runs", []), key=lambda run: run.get("mode") != "full")
    for run in runs:
        if run.get("status") == "pass":
            lines = [
                r["line"].strip()
                for r in run.get("records", [])
                if r.get("kind") == "rule" and r.get("device") == device
            ]
            if lines:
                return lines
    return []


def device_rules(device, published, results=None):
    """The rules for ``device`` where this build did not run on it: the
    ``rule`` records of this page's recorded GPU run (``results``: the
    ``summary.json`` of ``gpu-results/``, from ``scripts/gpu_record.py``),
    the full-size run first; where none is recorded, ``published`` (job ->
    (rule, evidence): what a cited source measured), each marked "not
    measured here yet", its evidence indented below it."""
    results = Path(results) if results else None
    recorded = _recorded_rules(results, device) if results and results.is_file() else []
    if recorded:
        return [f"{line.rstrip('.')} (recorded GPU run)." for line in recorded]
    name = _DEVICE_NAMES.get(device, device)
    lines = []
    for job, (rule, evidence) in published.items():
        lines.append(f"{job} on {name}, not measured here yet: {rule}")
        lines += textwrap.wrap(evidence, 96, initial_indent="  ", subsequent_indent="  ")
    lines.append(f"other jobs on {name}: not measured here yet, and no published figure is cited.")
    return lines


def decision_guide(table, bounds, default, pointers=None, *, device="cpu", elsewhere=()):
    """The decision guide from a page's measurements. ``table``: job -> path
    -> :class:`~ragged_site.measuring.timing.Timing`, or why the path
    cannot take the job here, each job with the baseline ``"padded
    tensors"``; ``bounds``: job -> its work bound; ``default``: what
    :func:`~ragged_site.measuring.noise.choose` keeps within the noise;
    ``pointers``: job -> a line to add under its "then" cell. Per job it
    prints the choice and the ``speedup_line`` of the chosen path (where
    padding wins, of the fastest other path) against the baseline; returns
    the :class:`~ragged_site.measuring.tables.Table`, a row per job:
    chosen here, against the padded baseline, then (the others, fastest first),
    not here. Before the table it prints one rule per job for ``device``
    ("use X; if X is not available here, Y"), then the lines of
    ``elsewhere`` (:func:`device_rules`, for the device this build did not
    run on)."""
    rows, rules = [], []
    for job, results in table.items():
        ran = {name: r for name, r in results.items() if isinstance(r, Timing)}
        best = choose(ran, default, f"{job} path")
        then = sorted((name for name in ran if name != best), key=lambda name: ran[name].median_ms)
        rules.append(_rule(job, device, best, then))
        ragged = best if best != _BASELINE else then[0]
        padded, bound = ran[_BASELINE], bounds[job]
        print(speedup_line(f"{job}, {ragged} against {_BASELINE}", padded, ran[ragged], bound))
        gain = padded.median_ms / ran[ragged].median_ms
        kernels = f"\nkernels: {ran[best].kernels}" if ran[best].kernels else ""
        chosen = f"{best}, {ran[best].median_ms:.2f} ms{kernels}"
        versus = (
            (f"{ragged}: " if ragged != best else "")
            + f"speedup {gain:.2f}x\nwork bound {bound:.2f}x\n"
            f"fraction {gain / bound:.2f}"
            + ("" if outside_noise(padded, ran[ragged]) else " (within noise)")
        )
        pointer = f"\n{pointers[job]}" if pointers and job in pointers else ""
        rows.append(
            [
                job,
                chosen,
                versus,
                ", ".join(then) + pointer,
                ", ".join(name for name, r in results.items() if not isinstance(r, Timing)),
            ]
        )
    print("rules of thumb, one per job:")
    for line in [*rules, *elsewhere]:
        print(f"  {line}")
    return Table(
        ["job", "chosen here", f"against {_BASELINE}", "then", "not here"],
        rows,
        css_class="decision-guide",
    )


def speedup_grid(table, paths):
    """(paths, jobs): each path's speedup over ``"baseline"`` for each
    job of ``table`` (as :func:`decision_guide` takes it), NaN where the path
    did not run; for :func:`~ragged_site.figures.draw_speedups`."""
    return np.array(
        [
            [
                table[job][_BASELINE].median_ms / table[job][path].median_ms
                if isinstance(table[job].get(path), Timing)
                else np.nan
                for job in table
            ]
            for path in paths
        ]
    )
