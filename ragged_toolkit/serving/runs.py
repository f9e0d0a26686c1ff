"""What repeated serving runs (``take_turns(..., runs=n)``) measured and
proved: any figure of a run as the median and interquartile range over its
runs (:func:`spread`; a speedup is claimed only outside that spread, by the
site's noise rule, :func:`~ragged_toolkit.measuring.noise.outside_noise`);
what skipping prompt tokens could buy at this device's costs, read from a
run's own steps; and every request of every run against decoding it alone.
Nothing here reads a clock: the server timed the steps."""

from __future__ import annotations

import numpy as np
import torch

from ..measuring.timing import Timing
from .proof import check_against_alone

__all__ = ["busy_seconds", "spread", "prompt_token_seconds", "skipping_bound", "prove_every_run"]


def busy_seconds(run):
    """The seconds a run spent stepping (its clock less the waits for arrivals)."""
    return sum(s.seconds for s in run.steps)


def spread(runs, figure):
    """``figure(run)`` over ``runs`` as a
    :class:`~ragged_toolkit.measuring.timing.Timing` (median,
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
        raise ValueError("the cost of a prompt token needs steps with prompt tokens and steps without")
    decode_only = np.median(seconds[prompt == 0])
    return float((seconds[prompt > 0].sum() - (prompt > 0).sum() * decode_only) / prompt.sum())


def skipping_bound(run, skipped):
    """What skipping ``skipped`` prompt tokens could buy in ``run`` (a run
    that computed them): its busy time over that time less what the skipped
    tokens cost in it (:func:`prompt_token_seconds`)."""
    total = busy_seconds(run)
    return total / (total - skipped * prompt_token_seconds(run.steps))


def prove_every_run(reference, runs, tolerance):
    """Every request of every run proved equal to decoding it alone: each
    distinct history (prompt and tokens generated) once, by
    :func:`~ragged_toolkit.serving.proof.check_against_alone`; a request
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
                torch.testing.assert_close(torch.stack(req.logits), torch.stack(proved[history].logits),
                                           **tolerance, msg=lambda m, r=req: f"request {r.rid}: logits "
                                           f"differ from a proved request's with the same tokens: {m}")
            else:
                difference, tied = check_against_alone(reference, [req], tolerance)
                proved[history], worst, ties = req, max(worst, difference), ties + tied
            checked += 1
    return worst, ties, checked
