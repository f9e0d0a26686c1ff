"""Every attention backend of the toolkit that runs on this machine, and the
pages' own ``reference_attention``, against an independent float64
reference written out here: scores, the bottom-right causal rule, softmax
and the key/value head each query head reads, sequence by sequence.

The cases are seeded random ragged batches: grouped-query attention with 1,
2 and 4 query heads per key/value head, cross-attention, a KV cache with
spare rows (``kv_used``), empty sequences, one sequence, decoding (a few
queries against longer keys). Outputs, and gradients where a backend has a
backward here (FlexAttention has none on CPU: forward only)."""

from __future__ import annotations

import warnings

import pytest
import torch

from toolkit_api import MODULES, tk

FLEX = MODULES["ragged_toolkit.attention.flex"]

HEADS, DIM = 4, 8
# float32 results against float64: a wrong mask, head or row is off by O(0.1)
FORWARD = dict(atol=2e-5, rtol=1e-4)
GRADIENT = dict(atol=5e-5, rtol=1e-4)
PORTABLE = {"loop", "bucketed", "padded"}  # run every job on every device


# --- the reference ----------------------------------------------------------

def attention64(q, k, v, q_lengths, kv_rows, kv_used=None, *, is_causal=False, scale=None):
    """Attention in float64, one sequence and one query head at a time.

    q (T_q, H, D) and k, v (T_kv, H_kv, D), packed by ``q_lengths`` and
    ``kv_rows``; sequence b uses its first ``kv_used[b]`` key rows (all of
    them by default). Query head h reads key/value head h // (H / H_kv).
    Causal: query i of a sequence with Lq queries and Lkv keys sees keys
    0 .. i + Lkv - Lq. A query that sees no key gets zeros."""
    q, k, v = q.double(), k.double(), v.double()
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    used = kv_rows if kv_used is None else kv_used
    rows, q_start, kv_start = [], 0, 0
    for lq, n, n_rows in zip(q_lengths, used, kv_rows):
        qs = q[q_start:q_start + lq]  # (Lq, H, D)
        ks, vs = k[kv_start:kv_start + n], v[kv_start:kv_start + n]  # (Lkv, H_kv, D): the rows in use
        q_start, kv_start = q_start + lq, kv_start + n_rows
        per_head = []
        for h in range(heads):
            if n == 0:
                per_head.append(q.new_zeros(lq, dim))
                continue
            kh, vh = ks[:, h // group], vs[:, h // group]  # (Lkv, D)
            scores = (qs[:, h] @ kh.T) * scale  # (Lq, Lkv)
            if is_causal:
                i = torch.arange(lq)[:, None]
                j = torch.arange(n)[None, :]
                scores = scores.masked_fill(j > i + (n - lq), float("-inf"))
            top = scores.max(dim=1, keepdim=True).values
            weights = (scores - top).exp()
            weights = weights / weights.sum(dim=1, keepdim=True)
            per_head.append(weights @ vh)  # (Lq, D)
        rows.append(torch.stack(per_head, dim=1) if per_head else q.new_zeros(lq, heads, dim))
    return torch.cat(rows) if rows else q.new_zeros(0, heads, dim)


# --- the cases ----------------------------------------------------------------

def _ints(g, low, high, n):
    return torch.randint(low, high + 1, (n,), generator=g).tolist()


def make_case(kind, seed, is_causal):
    """Lengths for one case: queries, key rows and keys in use per sequence."""
    g = torch.Generator().manual_seed(seed)
    batch = _ints(g, 2, 5, 1)[0]
    used = None
    if kind == "self":  # every sequence its own queries and keys
        lq = _ints(g, 1, 9, batch)
        rows = lq
    elif kind == "equal":  # one length for all: a rectangle, no padding
        lq = rows = [_ints(g, 1, 7, 1)[0]] * batch
    elif kind == "cross":  # queries and keys of different lengths
        lq, rows = _ints(g, 1, 6, batch), _ints(g, 1, 10, batch)
    elif kind == "cache":  # rows of a KV cache, some of them spare
        rows = _ints(g, 2, 10, batch)
        used = [_ints(g, 1, r - 1, 1)[0] for r in rows]
        lq = [_ints(g, 1, u, 1)[0] for u in used] if is_causal else _ints(g, 1, 6, batch)
    elif kind == "rectangle":  # as many queries and rows in every sequence, keys in use vary
        lq, rows = [2] * batch, [9] * batch
        used = _ints(g, 2, 9, batch)
    elif kind == "empty":  # sequences without queries, without keys, without both, among others
        batch = 6
        lq = [0, 3, 0] + _ints(g, 1, 5, 3)
        if is_causal:
            rows = [4, 0, 0] + [n + extra for n, extra in zip(lq[3:], _ints(g, 0, 3, 3))]
        else:
            rows = [4, 0, 0] + _ints(g, 1, 6, 3)
    elif kind == "single":  # one sequence
        lq = _ints(g, 1, 12, 1)
        rows = lq if is_causal else _ints(g, 1, 12, 1)
    elif kind == "decode":  # 1 to 3 new queries against longer keys
        lq = _ints(g, 1, 3, batch)
        rows = [n + extra for n, extra in zip(lq, _ints(g, 1, 8, batch))]
    elif kind == "decode_cache":  # the same, from a cache of 12 rows per sequence
        lq = _ints(g, 1, 3, batch)
        rows = [12] * batch
        used = [n + extra for n, extra in zip(lq, _ints(g, 0, 9, batch))]
    elif kind == "no_keys":  # every query without keys: all zeros
        lq, rows = [2, 3], [0, 0]
    elif kind == "no_queries":  # keys and no queries at all
        lq, rows = [0, 0], [3, 1]
    else:
        raise ValueError(kind)
    return lq, rows, used


# (kind, query heads per key/value head, causal, scale)
CASES = [
    *[("self", ratio, causal, None) for ratio in (1, 2, 4) for causal in (False, True)],
    *[("cross", ratio, False, None) for ratio in (1, 2, 4)],
    ("cross", 2, False, 0.3),
    ("equal", 4, True, None), ("equal", 1, False, None),
    ("cache", 1, False, None), ("cache", 2, True, None), ("cache", 4, True, None),
    ("rectangle", 2, True, None), ("rectangle", 1, False, None),
    ("empty", 1, False, None), ("empty", 2, True, None), ("empty", 4, False, None),
    ("single", 1, True, None), ("single", 4, False, None),
    ("decode", 1, True, None), ("decode", 4, True, 0.5),
    ("decode_cache", 2, True, None),
    ("no_keys", 2, False, None), ("no_queries", 1, True, None),
]


def _case_id(case):
    kind, ratio, causal, scale = case
    return f"{kind}-gqa{ratio}-{'causal' if causal else 'full'}" + ("" if scale is None else f"-scale{scale}")


def _tensors(case, seed):
    kind, ratio, causal, _ = case
    lq, rows, used = make_case(kind, seed, causal)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(lq), HEADS, DIM, generator=g)
    k = torch.randn(sum(rows), HEADS // ratio, DIM, generator=g)
    v = torch.randn(sum(rows), HEADS // ratio, DIM, generator=g)
    return q, k, v, lq, rows, used


def _expected(q, k, v, lq, rows, used, causal, scale):
    """The float64 output, and its gradients for a fixed random upstream gradient."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = attention64(q64, k64, v64, lq, rows, used, is_causal=causal, scale=scale)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return out.detach(), grad_out, _gradients(out, (q64, k64, v64), grad_out)


def _gradients(out, inputs, grad_out):
    # an output that depends on no input (every query without keys) has zero gradients
    if not out.requires_grad:
        return [torch.zeros_like(t) for t in inputs]
    grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]


def _run(fn, q, k, v, grad_out, with_grad):
    """``fn(q, k, v)`` on float32 leaves: its output, and its gradients if ``with_grad``."""
    q, k, v = (t.detach().requires_grad_(with_grad) for t in (q, k, v))
    with torch.set_grad_enabled(with_grad):
        out = fn(q, k, v)
        return out.detach(), _gradients(out, (q, k, v), grad_out.float()) if with_grad else None


def _check(label, out, grads, expected, expected_grads, q):
    problems = []
    if out.shape != q.shape or out.dtype != torch.float32:
        return [f"{label}: output {tuple(out.shape)} {out.dtype}, expected {tuple(q.shape)} float32"]
    try:
        torch.testing.assert_close(out.double(), expected, **FORWARD)
    except AssertionError as err:
        problems.append(f"{label}: output: {err}")
    for name, g, r in zip("qkv", grads or (), expected_grads):
        try:
            torch.testing.assert_close(g.double(), r, **GRADIENT)
        except AssertionError as err:
            problems.append(f"{label}: d{name}: {err}")
    return problems


SEEDS = (11, 12)


def _compare_backends(case, seed, backends=tk.BACKENDS, flex=None):
    """Run ``case`` on each of ``backends`` that can take it here; the names
    of those that ran."""
    _, ratio, causal, scale = case
    q, k, v, lq, rows, used = _tensors(case, seed)
    qo, ko = tk.offsets_from_lengths(lq), tk.offsets_from_lengths(rows)
    kv_used = None if used is None else torch.tensor(used)
    expected, grad_out, expected_grads = _expected(q, k, v, lq, rows, used, causal, scale)

    ran, problems = [], []
    for name in backends:
        support = dict(is_causal=causal, gqa=ratio > 1)
        with_grad = tk.backend_support(name, "cpu", torch.float32, needs_grad=True, **support) is None
        if not with_grad and tk.backend_support(name, "cpu", torch.float32, needs_grad=False, **support):
            continue  # cannot take this job here at all (varlen without CUDA, ...)

        plan = tk.plan_batch(qo, ko, backend=name, is_causal=causal, kv_used=kv_used, flex=flex)

        def attend(q, k, v, plan=plan):
            return tk.ragged_attention(q, k, v, plan, scale=scale)

        out, grads = _run(attend, q, k, v, grad_out, with_grad)
        problems += _check(f"{name} ({'with' if with_grad else 'without'} gradients)", out, grads,
                           expected, expected_grads, q)
        ran.append(name)
    assert not problems, f"lengths {lq}, key rows {rows}, in use {used}:\n" + "\n".join(problems)
    return ran


def _eager_flex(q, k, v, **kwargs):
    return FLEX.flex_attention(q, k, v, **kwargs)


@pytest.fixture
def eager_flex():
    """A flex kernel that does not compile: on CPU a compile takes seconds per
    token count, and what the grid checks is the toolkit's document mask,
    not inductor's kernel (``test_compiled_flex_attention`` runs that)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?s).*flex_attention called without torch.compile")
        yield _eager_flex


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_backend_matches_the_float64_reference(case, seed, eager_flex):
    ran = _compare_backends(case, seed, flex=eager_flex)
    # on CPU tensors: every backend but varlen, where the job allows
    _, ratio, causal, _ = case
    assert PORTABLE | {"flex"} <= set(ran), f"ran only {ran}"
    assert ("sdpa_njt" in ran) == (ratio == 1 and not causal), f"ran {ran}"


def test_compiled_flex_attention():
    # one compile: GQA, a cache with spare rows, causal, an empty sequence
    kernel = tk.FlexKernel()
    assert _compare_backends(("empty", 2, True, None), SEEDS[0], backends=("flex",), flex=kernel) == ["flex"]
    assert len(kernel.graphs) == 1, kernel.graphs  # compiled in the kernel itself (no backward on CPU)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_the_pages_reference_matches_the_float64_reference(case):
    _, _, causal, scale = case
    q, k, v, lq, rows, used = _tensors(case, SEEDS[0])
    qo, ko = tk.offsets_from_lengths(lq), tk.offsets_from_lengths(rows)
    kv_used = None if used is None else torch.tensor(used)
    expected, grad_out, expected_grads = _expected(q, k, v, lq, rows, used, causal, scale)
    out, grads = _run(lambda q, k, v: tk.reference_attention(q, k, v, qo, ko, is_causal=causal,
                                                             kv_used=kv_used, scale=scale),
                      q, k, v, grad_out, True)
    problems = _check("reference_attention", out, grads, expected, expected_grads, q)
    assert not problems, f"lengths {lq}, key rows {rows}, in use {used}:\n" + "\n".join(problems)


def test_the_cases_cover_what_they_claim():
    """The grid holds each situation it names, so no case silently degenerates."""
    seen = set()
    for case in CASES:
        kind, ratio, causal, _ = case
        for seed in SEEDS:
            lq, rows, used = make_case(kind, seed, causal)
            n_used = rows if used is None else used
            assert len(lq) == len(rows) == len(n_used)
            assert all(0 <= u <= r for u, r in zip(n_used, rows))
            if causal:  # the contract: as many keys as queries, or none
                assert all(u == 0 or u >= n for n, u in zip(lq, n_used))
            seen |= {f"gqa{ratio}"} | ({"causal"} if causal else {"full"})
            seen |= {"B=1"} if len(lq) == 1 else set()
            seen |= {"spare rows"} if any(u < r for u, r in zip(n_used, rows)) else set()
            seen |= {"cross"} if not causal and lq != n_used else set()
            seen |= {"no queries"} if 0 in lq else set()
            seen |= {"no keys"} if any(n and not u for n, u in zip(lq, n_used)) else set()
            seen |= {"more keys than queries, causal"} if causal and all(
                1 <= n <= 3 and u > n for n, u in zip(lq, n_used)) else set()
    assert seen >= {"gqa1", "gqa2", "gqa4", "causal", "full", "B=1", "spare rows", "cross", "no queries",
                    "no keys", "more keys than queries, causal"}


def test_the_reference_itself_on_a_case_worked_by_hand():
    # one sequence, one head, two queries, three keys, causal bottom-right:
    # query 0 sees keys 0 and 1, query 1 sees all three
    q = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 0.0]], [[0.0, 2.0]]])
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[5.0, 5.0]]])
    out = attention64(q, k, v, [2], [3], is_causal=True, scale=1.0)
    e = torch.e
    w0 = torch.tensor([e, 1.0], dtype=torch.float64) / (e + 1)  # scores 1 and 0
    w1 = torch.tensor([1.0, 1.0, e**2], dtype=torch.float64) / (2 + e**2)  # scores 0, 0 and 2
    vs = v[:, 0].double()
    torch.testing.assert_close(out[:, 0], torch.stack([w0 @ vs[:2], w1 @ vs]))
    # two query heads over one key/value head read the same keys; no keys: zeros
    out = attention64(q.expand(2, 2, 2), k[:1], v[:1], [2, 0], [0, 1])
    assert (out == 0).all() and out.shape == (2, 2, 2)


def test_causal_attention_with_fewer_keys_than_queries_is_refused():
    q = torch.randn(5, HEADS, DIM)
    k = v = torch.randn(5, HEADS, DIM)
    qo, ko = tk.offsets_from_lengths([3, 2]), tk.offsets_from_lengths([2, 3])
    for name in PORTABLE:
        with pytest.raises(ValueError, match="is_causal needs at least as many keys as queries"):
            tk.plan_batch(qo, ko, is_causal=True, backend=name)
