"""What repeated serving runs (``take_turns(..., runs=n)``) measured and
proved: any figure of a run as the median and interquartile range over its
runs (:func:`spread`; a speedup is claimed only outside that spread, by the
site's noise rule, :func:`~ragged_site.measuring.noise.outside_noise`);
what skipping prompt tokens could buy at this device's costs, read from a
run's own steps; one stream served with a prefix cache and without, taking
turns (:func:`with_and_without`), and what it did over an online trace
(:func:`draw_trace`); and every request of every run against decoding it
alone. Nothing here reads a clock: the server timed the steps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ragged_toolkit.kv_cache import PagedKVCache
from ragged_site.measuring.timing import Timing
from ragged_site.serving.metrics import latency_ms, ms_per_token
from ragged_toolkit.serving.prefix_cache import PrefixCache, PrefixStats, retire_caching
from ragged_site.serving.proof import check_against_alone
from ragged_site.workloads import fresh_requests
from ragged_toolkit.serving.schedulers import retire_finished
from ragged_toolkit.serving.server import serve, take_turns

__all__ = [
    "busy_seconds",
    "spread",
    "prompt_token_seconds",
    "skipping_bound",
    "CachingRuns",
    "with_and_without",
    "prefix_cache_line",
    "draw_trace",
    "prove_every_run",
]


def busy_seconds(run):
    """The seconds a run spent stepping (its clock less the waits for arrivals)."""
    return sum(s.seconds for s in run.steps)


def spread(runs, figure):
    """``figure(run)`` over ``runs`` as a
    :class:`~ragged_site.measuring.timing.Timing` (median,
    interquartile range and percentiles 25 and 75 of the runs), the figure
    in whatever unit it is (the ``_ms`` fields then hold that unit)."""
    return Timing.of([figure(run) for run in runs])


def prompt_token_seconds(steps):
    """What a prompt token adds to a step, in seconds, from a run's own
    steps: the steps that carried prompt tokens, less as many steps of the
    median decode-only step, over the prompt tokens they carried (as the
    serving page measures it)."""
    seconds = np.array([s.seconds for s in steps])
    prompt = np.array([s.prefill for s in steps])
    if not (prompt == 0).any() or not prompt.any():
        raise ValueError(
            "the cost of a prompt token needs steps with prompt tokens and steps without"
        )
    decode_only = np.median(seconds[prompt == 0])
    return float((seconds[prompt > 0].sum() - (prompt > 0).sum() * decode_only) / prompt.sum())


def skipping_bound(run, skipped):
    """What skipping ``skipped`` prompt tokens could buy in ``run`` (a run
    that computed them): its busy time over that time less what the skipped
    tokens cost in it (:func:`prompt_token_seconds`)."""
    total = busy_seconds(run)
    return total / (total - skipped * prompt_token_seconds(run.steps))


@dataclass
class CachingRuns:
    """What :func:`with_and_without` served and measured, each figure by the
    name of its server (``"with"`` the prefix cache, ``"without"``):
    ``runs``, its ``ServingRun`` s;
    ``prefill``, the prompt tokens its first run computed; ``per_token``, the
    spread over its runs of the milliseconds per generated token
    (:func:`~ragged_site.serving.metrics.ms_per_token`); ``ttft``, the
    spread of its runs' median time to first token, in ms. And ``cache``,
    the :class:`~ragged_toolkit.serving.prefix_cache.PrefixCache` of the
    first run with it; ``hit``, the share of prompt tokens that run's
    admissions found cached; ``bound``, the work bound of skipping them
    (:func:`skipping_bound`, the median over the runs without)."""

    runs: dict
    prefill: dict
    per_token: dict
    ttft: dict
    cache: PrefixCache
    stats: PrefixStats
    hit: float
    bound: float


def with_and_without(
    model, requests, plan, *, n_blocks, block_size, runs, observe=None, on_token=None
):
    """Serve ``requests`` (fresh copies each run) with a
    :class:`~ragged_toolkit.serving.prefix_cache.PrefixCache`, whose steps
    end with :func:`~ragged_toolkit.serving.prefix_cache.retire_caching`,
    and with a plain :class:`~ragged_toolkit.kv_cache.PagedKVCache`, each of
    ``n_blocks`` blocks of ``block_size`` rows on the model's device and in
    its dtype, taking turns step by step until each ran ``runs`` times
    (:func:`~ragged_toolkit.serving.server.take_turns`). ``plan`` is the
    scheduler; ``observe`` watches the runs with the cache; ``on_token``
    (a :class:`~ragged_site.serving.proof.TokenLogits`) sees every run's
    tokens. Returns
    :class:`CachingRuns`."""
    weights, caches, stats = next(model.parameters()), [], PrefixStats()

    def starter(cache_type, retire, **kw):
        def start():
            extra = dict(stats=stats if not caches else None) if cache_type is PrefixCache else {}
            caches.append(
                cache_type(model.cfg, n_blocks, block_size, weights.device, weights.dtype, **extra)
            )
            return serve(
                model, fresh_requests(requests), caches[-1], plan, retire, on_token=on_token, **kw
            )

        return start

    served = dict(
        zip(
            ("with", "without"),
            take_turns(
                starter(PrefixCache, retire_caching, observe=observe),
                starter(PagedKVCache, retire_finished),
                runs=runs,
            ),
        )
    )
    cache = caches[0]  # the first run with the cache started first
    prefill = {name: sum(s.prefill for s in done[0].steps) for name, done in served.items()}
    skipped = prefill["without"] - prefill["with"]
    return CachingRuns(
        runs=served,
        prefill=prefill,
        per_token={name: ms_per_token(done) for name, done in served.items()},
        ttft={
            name: spread(done, lambda run: latency_ms(run.requests)["ttft"][0])
            for name, done in served.items()
        },
        cache=cache,
        stats=stats,
        hit=stats.hit_rate(),
        bound=float(np.median([skipping_bound(run, skipped) for run in served["without"]])),
    )


def prefix_cache_line(offline):
    """The line that sums up :func:`with_and_without`'s ``offline`` runs
    (a :class:`CachingRuns`), and its figures for the record: hit rate,
    prompt tokens computed, time to first token, throughput each way, the
    speedup beside the work bound and their fraction."""
    per_token, ttft = offline.per_token, offline.ttft
    R, P = 1e3 / per_token["with"].median_ms, 1e3 / per_token["without"].median_ms
    K, N, W = offline.prefill["with"], offline.prefill["without"], offline.bound
    line = (
        f"prefix cache: hit rate {offline.hit:.0%}, prefill tokens {K} of {N} computed, "
        f"time to first token p50 {ttft['with'].median_ms:.0f} ms (without: "
        f"{ttft['without'].median_ms:.0f} ms), throughput {R:.0f} tokens/s (without: {P:.0f} "
        f"tokens/s), speedup {R / P:.2f}x, work bound {W:.2f}x, fraction {R / P / W:.2f}"
    )
    figures = dict(hit_rate=offline.hit, prefill_tokens=K, prefill_tokens_without=N)
    figures.update(ttft_ms={side: t.median_ms for side, t in ttft.items()})
    figures.update(
        tokens_per_s={"with": R, "without": P}, speedup=R / P, bound=W, fraction=R / P / W
    )
    return line, figures


def draw_trace(requests, served, title):
    """A figure of ``requests`` (with their arrivals) served online with and
    without a prefix cache (``served``, their :class:`CachingRuns`), the
    first run of each, over the trace: above, each request's share of its
    prompt found cached at its first admission and the hit rate so far;
    below, each request's time to first token in ms. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, layout="constrained")
    arrival = [r.arrival for r in requests]
    prompt = np.array([len(r.prompt) for r in requests])
    found = np.array([served.stats.first_hit.get(r.rid, 0) for r in requests])
    ax1.scatter(arrival, found / prompt, s=12, color="C0", label="each request")
    ax1.plot(arrival, np.cumsum(found) / np.cumsum(prompt), color="C1", label="hit rate so far")
    ax1.set(ylabel="prompt found cached", ylim=(-0.05, 1.05), title=title)
    ax1.legend(loc="lower right")
    for name, color in (("with", "C0"), ("without", "C3")):
        first = {r.rid: r.first_token_s for r in served.runs[name][0].requests}
        ax2.scatter(
            arrival,
            [(first[r.rid] - r.arrival) * 1e3 for r in requests],
            s=12,
            color=color,
            label=f"{name} the cache",
        )
    ax2.set(
        xlabel="arrival (s, simulated clock)", ylabel="time to first token (ms)", ylim=(0, None)
    )
    ax2.legend(loc="upper left")
    return fig


def prove_every_run(reference, runs, tolerance, logits):
    """Every request of every run proved equal to decoding it alone (the
    runs served with ``on_token=logits``, a
    :class:`~ragged_site.serving.proof.TokenLogits`): each
    distinct history (prompt and tokens generated) once, by
    :func:`~ragged_site.serving.proof.check_against_alone`; a request
    that generated the same tokens for the same prompt as a proved one, by
    its logits, within ``tolerance`` of that one's. Raises
    ``AssertionError`` naming the request; returns ``(largest logit
    difference from decoding alone, ties, requests checked)``."""
    proved, worst, ties, checked = {}, 0.0, 0, 0
    for run in runs:
        for req in run.requests:
            history = (tuple(req.prompt), tuple(req.generated))
            if history in proved:
                assert req.done(), f"request {req.rid} did not finish"
                torch.testing.assert_close(
                    logits.of(req),
                    logits.of(proved[history]),
                    **tolerance,
                    msg=lambda m, r=req: (
                        f"request {r.rid}: logits "
                        f"differ from a proved request's with the same tokens: {m}"
                    ),
                )
            else:
                difference, tied = check_against_alone(reference, [req], tolerance, logits)
                proved[history], worst, ties = req, max(worst, difference), ties + tied
            checked += 1
    return worst, ties, checked
