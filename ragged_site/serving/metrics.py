"""What a serving run measured: throughput (over runs, and its spread from
run to run), the slot bound of static batches, time to first token and
time per output token, what a slot bound leaves out (:func:`step_costs`);
the words for a spread and for a speedup claimed (:func:`rate_spread`,
:func:`speedup_claim`); and their pictures (:func:`draw_steps`,
:func:`draw_throughput_and_latency`)."""

from __future__ import annotations

import numpy as np

from ragged_site.measuring.timing import Timing

__all__ = [
    "tokens_per_second",
    "ms_per_token",
    "slot_bound",
    "step_costs",
    "latency_ms",
    "rate_spread",
    "speedup_claim",
    "draw_steps",
    "draw_throughput_and_latency",
]


def tokens_per_second(runs):
    """Generated tokens over busy seconds (time stepping), over ``runs``."""
    tokens = sum(r.n_out for run in runs for r in run.requests)
    return tokens / sum(s.seconds for run in runs for s in run.steps)


def ms_per_token(runs):
    """The spread of throughput from run to run: a
    :class:`~ragged_site.measuring.timing.Timing` of each run's busy
    milliseconds per generated token (median, IQR, percentiles 25 and 75,
    the number of runs), for the noise rule (``outside_noise``). A rate in
    tokens/s is ``1000 / ms``: the median's, and an IQR from ``1000 / q3_ms``
    to ``1000 / q1_ms``."""
    return Timing.of(
        [
            1e3 * sum(s.seconds for s in run.steps) / sum(r.n_out for r in run.requests)
            for run in runs
        ]
    )


def slot_bound(run):
    """What idle slots cost a static run: slot-steps (its slots times its
    steps) over the tokens it generated."""
    slots = max(s.running for s in run.steps)
    return slots * len(run.steps) / sum(r.n_out for r in run.requests)


def step_costs(steps, slots):
    """Two costs of a continuous run that its slot bound leaves out, from
    its ``steps`` (``StepRecord`` s, seconds measured): the *tail*, steps
    with fewer than ``slots`` requests running and none waiting; and the
    prompt tokens mixed into decode steps, as the seconds that the steps
    carrying them took beyond as many decode-only steps (the median of
    those neither mixed nor in the tail). A dict: ``seconds``, ``tail_steps``,
    ``tail_seconds``, ``mixed_steps``, ``prompt_tokens``, ``prompt_seconds``,
    ``decode_step_s``."""
    seconds = np.array([s.seconds for s in steps])
    tail = np.array([s.running < slots and s.waiting == 0 for s in steps])
    mixed = np.array([s.prefill > 0 for s in steps])
    plain = ~mixed & ~tail
    decode_step = float(np.median(seconds[plain] if plain.any() else seconds))
    return dict(
        seconds=float(seconds.sum()),
        tail_steps=int(tail.sum()),
        tail_seconds=float(seconds[tail].sum()),
        mixed_steps=int(mixed.sum()),
        prompt_tokens=int(sum(s.prefill for s in steps)),
        prompt_seconds=float(seconds[mixed].sum() - mixed.sum() * decode_step),
        decode_step_s=decode_step,
    )


def latency_ms(requests):
    """Percentiles 50 and 99, in ms, of the time to first token (from
    arrival) and of the time per output token after the first:
    ``{"ttft": (p50, p99), "tpot": (p50, p99)}``."""
    ttft = [r.first_token_s - r.arrival for r in requests]
    tpot = [(r.finish_s - r.first_token_s) / (r.n_out - 1) for r in requests if r.n_out > 1]
    return {
        name: tuple(np.percentile(np.array(x) * 1e3, [50, 99]).tolist())
        for name, x in (("ttft", ttft), ("tpot", tpot))
    }


def rate_spread(timing):
    """A line's words for the spread of throughput over runs, from
    :func:`ms_per_token`'s ``timing``: ``"median R tokens/s, IQR a-b, over n
    runs"``, rates in tokens/s."""
    t = timing
    return (
        f"median {1e3 / t.median_ms:.0f} tokens/s, IQR {1e3 / t.q3_ms:.0f}-"
        f"{1e3 / t.q1_ms:.0f}, over {t.runs} runs"
    )


def speedup_claim(apart, whose="the runs"):
    """What the noise rule says of a speedup, in words: it stands where the
    interquartile ranges of ``whose`` do not overlap (``apart``, from
    ``outside_noise``), else it is not claimed."""
    if apart:
        return f"stands: the IQRs of {whose} do not overlap"
    return f"is not claimed: the IQRs of {whose} overlap"


def draw_steps(steps, token_budget, title):
    """A figure of a run's steps (``StepRecord`` s), one bar each: above,
    the tokens it fed, a decode token per running request under the prompt
    tokens, beside ``token_budget``; below, the requests running and
    waiting after it. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, layout="constrained")
    number, decoded = np.arange(len(steps)), [s.decode for s in steps]
    ax1.bar(number, decoded, width=1.0, color="C0", label="decode tokens")
    ax1.bar(
        number,
        [s.prefill for s in steps],
        bottom=decoded,
        width=1.0,
        color="C1",
        label="prompt tokens",
    )
    ax1.axhline(token_budget, color="k", ls=":", label="token budget")
    ax1.set(ylabel="tokens in the step", ylim=(0, 1.45 * token_budget), title=title)
    ax1.legend(loc="upper right", ncol=3)
    ax2.step(number, [s.running for s in steps], where="mid", color="C2", label="running")
    ax2.step(number, [s.waiting for s in steps], where="mid", color="C3", label="waiting")
    ax2.set(xlabel="step", ylabel="requests")
    ax2.legend(loc="upper right")
    return fig


def draw_throughput_and_latency(runs, latency, rate):
    """A figure of schedulers side by side, a color each. Left, ``runs``
    (name -> its ``ServingRun`` s, all requests at once): each run's
    generated tokens/s a point, their median a bar. Right, ``latency`` (name
    -> :func:`latency_ms` of requests arriving at ``rate`` requests/s): time
    to first token and per output token, p50 and p99, in ms on a log scale
    with labelled ticks 1, 2, 5 per decade, each bar's value on it.
    Returns the figure."""
    import matplotlib.pyplot as plt

    colors = ["C0", "C3", "C7", "C2", "C1"]
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(8, 4.5), layout="constrained", width_ratios=[1, 1.6]
    )
    for col, (name, each) in enumerate(runs.items()):
        ax1.plot(
            [col] * len(each),
            [tokens_per_second([run]) for run in each],
            "o",
            color=colors[col],
            alpha=0.6,
        )
        ax1.plot([col - 0.3, col + 0.3], [1e3 / ms_per_token(each).median_ms] * 2, color="k")
    ax1.set_xticks(range(len(runs)), [name.replace(", ", ",\n") for name in runs])
    ax1.set(ylabel="generated tokens/s", ylim=(0, None), title="All at once, every run")
    width = 0.8 / len(latency)
    for col, (name, lat) in enumerate(latency.items()):
        bars = ax2.bar(
            np.arange(4) + width * (col + 0.5) - 0.4,
            [*lat["ttft"], *lat["tpot"]],
            width,
            color=colors[col],
            label=name,
        )
        ax2.bar_label(bars, fmt="%.3g", fontsize=8, padding=1)
    ax2.set_xticks(
        range(4), ["first\ntoken p50", "first\ntoken p99", "per token\np50", "per token\np99"]
    )
    values = [v for lat in latency.values() for v in (*lat["ttft"], *lat["tpot"]) if v > 0]
    ax2.set(yscale="log", ylabel="ms (log scale)", title=f"Arrivals at {rate:.1f} requests/s")
    if values:  # labelled ticks 1, 2, 5 per decade, where the values are
        lo, hi = min(values) / 1.6, max(values) * 2.5  # room below the lowest, above the labels
        decades = range(int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi))) + 1)
        ticks = [m * 10.0**e for e in decades for m in (1, 2, 5) if lo <= m * 10.0**e <= hi]
        ax2.set_ylim(lo, hi)
        ax2.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax2.yaxis.set_minor_formatter(plt.NullFormatter())
    ax2.legend(loc="upper right")
    return fig
