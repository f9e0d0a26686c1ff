"""One attention job on every backend that can take it here
(:func:`compare_backends`), or any calls a page writes itself
(:func:`compare_calls`): each checked against the float32 reference, then
all measured together."""

import torch

from ragged_toolkit.attention import BACKENDS, backend_support, plan_batch, ragged_attention
from ragged_toolkit.attention.flex import FlexKernel
from ragged_site.reference import reference_attention
from ragged_site.page import tolerances
from ragged_site.measuring.tables import print_timings
from ragged_site.measuring.timing import measure

__all__ = ["compare_backends", "compare_calls"]


def compare_backends(
    q,
    k,
    v,
    q_offsets,
    kv_offsets=None,
    *,
    is_causal=False,
    kv_used=None,
    backward=False,
    backends=BACKENDS,
    min_run_time=0.5,
    profile=True,
    plan_per_call=False,
    flex=None,
):
    """Check and time one attention job on each backend, each with its plan
    built once, before timing (``plan_batch``: the per-batch bookkeeping is
    not in the timed call); ``profile``: also profile one call of each for
    its peak memory and kernels (``measure``'s ``profile``);
    ``plan_per_call``: build the plan inside every timed call instead, as a
    decoding step does (its lengths change at every step); ``flex``: the
    page's :class:`~ragged_toolkit.attention.flex.FlexKernel` (default: one
    built for this comparison, its graphs dropped after). Returns name ->
    :class:`~ragged_site.measuring.timing.Timing`, or name -> the reason
    :func:`~ragged_toolkit.attention.backend_support` gives for not running it; prints one line per
    backend. A backend that should run and raises, or disagrees with the
    reference, raises, naming it: no silent fallback."""
    gqa = q.shape[1] != k.shape[1]
    kw = dict(is_causal=is_causal, kv_used=kv_used)
    plan_kw = dict(kw, flex=FlexKernel() if flex is None else flex)
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    # the reference, and its gradients, in float32 from float32 copies
    q32, k32, v32 = (t.detach().float().requires_grad_(backward) for t in (q, k, v))
    reference = reference_attention(q32, k32, v32, q_offsets, kv_offsets, **kw)
    grad_out = torch.randn_like(reference) if backward else None
    ref_grads = torch.autograd.grad(reference, (q32, k32, v32), grad_out) if backward else ()
    results, runs = {}, {}
    for name in backends:
        why = backend_support(
            name,
            q.device,
            q.dtype,
            is_causal=is_causal,
            needs_grad=backward,
            gqa=gqa,
            head_dim=q.shape[-1],
        )
        if why:
            results[name] = why
            continue

        def run(plan):
            with torch.set_grad_enabled(backward):
                out = ragged_attention(q, k, v, plan)
                grads = (
                    torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype)) if backward else ()
                )
            return out, grads

        try:
            plan = plan_batch(q_offsets, kv_offsets, backend=name, **plan_kw)
            out, grads = run(plan)
        except Exception as err:
            raise RuntimeError(
                f"backend {name!r} should run this job here and raised: {err}"
            ) from err
        for what, got, want in (
            ("output", out, reference),
            *zip(("dq", "dk", "dv"), grads, ref_grads),
        ):
            torch.testing.assert_close(
                got.float(),
                want,
                **tolerances(q.dtype),
                msg=lambda m, n=name, w=what: f"{n}: {w} disagrees with the reference: {m}",
            )
        runs[name] = lambda run=run, plan=plan: run(plan)
        if plan_per_call:
            runs[name] = lambda run=run, name=name: run(
                plan_batch(q_offsets, kv_offsets, backend=name, **plan_kw)
            )
    results.update(measure(runs, min_run_time=min_run_time, profile=profile))
    results = {name: results[name] for name in backends}
    print_timings(results)
    return results


def compare_calls(calls, *, dtype, min_run_time=0.5, profile=True):
    """Check each call against its reference, then time them all together
    (``measure``). ``calls``: name -> ``(call, packed, want)``: a call of no
    arguments; ``packed``, what turns its output into the layout of
    ``want``; ``want``, the float32 reference, or a tuple of them where the
    call returns a tuple (gradients); ``dtype``, what the calls compute in,
    which sets the tolerances (``tolerances``). Returns name -> :class:`~ragged_site.measuring.timing.Timing`;
    a call that disagrees with its reference raises, naming it."""
    for name, (call, packed, want) in calls.items():
        got = call()
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(
                packed(g),
                w,
                **tolerances(dtype),
                msg=lambda m, n=name, i=i: f"{n} (output {i}) disagrees with the reference: {m}",
            )
    return measure(
        {name: call for name, (call, _, _) in calls.items()},
        min_run_time=min_run_time,
        profile=profile,
    )
