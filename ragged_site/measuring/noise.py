"""The noise rule: a choice between measured options is made only where the
measurement can tell them apart (their interquartile ranges do not
overlap); otherwise a documented default is kept."""

from __future__ import annotations

from ragged_site.measuring.timing import Timing
from ragged_site.records import record

__all__ = ["outside_noise", "MIN_RUNS", "choose"]


def outside_noise(a, b):
    """Whether two :class:`~ragged_site.measuring.timing.Timing` s differ by
    more than their spread: their interquartile ranges, ``[q1, q3]``, do not
    overlap."""
    return a.q3_ms < b.q1_ms or b.q3_ms < a.q1_ms


#: The fewest timed runs per option from which :func:`choose` names a winner.
MIN_RUNS = 5


def choose(results, default, what="choice"):
    """Choose among measured options only where the measurement can tell.

    The rule: the options are timed in interleaved rounds
    (:func:`~ragged_site.measuring.timing.measure`); the one with the
    lowest median wins only if its interquartile range does not overlap that
    of the second fastest. Otherwise the difference is within noise and the
    documented default is returned (so it is, too, when either has fewer
    than :data:`MIN_RUNS` timed runs): ``default``, a name or a tuple of
    names in order of preference, the first of them that ran and is within
    the noise of the fastest. ``results``: name -> ``Timing`` (or the reason
    it did not run). Prints what was chosen and why; returns the name."""
    timed = {n: r for n, r in results.items() if isinstance(r, Timing)}
    ranked = sorted(timed, key=lambda n: timed[n].median_ms)
    if not ranked:
        raise ValueError(f"nothing to choose from for {what}: none of {list(results)} ran")

    def q(n):
        t = timed[n]
        return f"{n} {t.median_ms:.2f} ms (IQR {t.q1_ms:.2f}-{t.q3_ms:.2f})"

    best = ranked[0]
    if len(ranked) == 1:
        print(f"{what}: chosen {best}, the only option that ran")
        return best
    runner = ranked[1]
    gap = timed[runner].q1_ms - timed[best].q3_ms
    few = [n for n in (best, runner) if 0 < timed[n].runs < MIN_RUNS]
    defaults = (default,) if isinstance(default, str) else tuple(default)
    if gap > 0 and few:
        pick = next((d for d in defaults if d in timed), best)
        print(
            f"{what}: too few timed runs to tell ({', '.join(few)}: under {MIN_RUNS}), chosen {pick}"
        )
        return pick
    if gap > 0:
        print(f"{what}: chosen {best}, outside the noise")
        line = f"  {q(best)} against {q(runner)}: {gap:.2f} ms between the IQRs"
        medians = {n: timed[n].median_ms for n in (best, runner)}
        print(record("choice", line, label=what, chosen=best, median_ms=medians, gap_ms=gap))
        return best
    tied = [n for n in ranked if not outside_noise(timed[best], timed[n])]
    pick = next((d for d in defaults if d in tied), best)
    why = "the default" if pick in defaults else "no default among them: the lowest median"
    print(f"{what}: within noise, chosen {pick} ({why})")
    more = f", and {len(tied) - 2} more" if len(tied) > 2 else ""
    line = "  IQRs overlap: " + ", ".join(q(n) for n in tied[:2]) + more
    medians = {n: timed[n].median_ms for n in tied}
    print(record("choice", line, label=what, chosen=pick, median_ms=medians, within_noise=True))
    return pick
