"""The site's synthetic workloads: sentence lengths drawn from a Zipf model
of words (the original tutorial's), random ragged batches, and request
streams with long-tailed output lengths and Poisson arrivals. The pages
measure and prove on them; a trainer or a server brings its own data."""

import numpy as np
import torch

from ragged_toolkit.batches import offsets_from_lengths
from ragged_toolkit.serving.requests import Request

__all__ = [
    "STOP_RANKS",
    "zipf_stop_probability",
    "sentence_lengths",
    "ragged_batch",
    "output_lengths",
    "request_stream",
    "poisson_arrivals",
    "fresh_requests",
]

STOP_RANKS = (3, 386, 858)  # ".", "!" and "?" in the WikiText-2 vocabulary


def zipf_stop_probability(alpha):
    """Chance that a word drawn from Zipf(``alpha``) ends a sentence: that it is
    ".", "!" or "?", which have ranks 3, 386 and 858 in WikiText-2."""
    n = 10_000
    ranks = np.arange(1, n + 1, dtype=np.float64)
    # zeta(alpha): a partial sum plus the Euler-Maclaurin estimate of the tail
    zeta = (ranks**-alpha).sum() + n ** (1 - alpha) / (alpha - 1) - 0.5 * n**-alpha
    return float(sum(r**-alpha for r in STOP_RANKS) / zeta)


def sentence_lengths(rng, batch, alpha=1.2, max_len=None):
    """Lengths of ``batch`` sentences of Zipf(``alpha``) words, each ending at its
    first stop word: one geometric draw per sentence. Returns (B,) int64."""
    lengths = rng.geometric(zipf_stop_probability(alpha), size=batch)
    if max_len is not None:
        lengths = np.minimum(lengths, max_len)
    return torch.from_numpy(lengths).long()


def ragged_batch(rng, batch, dim, *, alpha=1.2, max_len=None, device="cpu", dtype=torch.float32):
    """A random ragged batch: packed values (T, dim) and offsets (B + 1,)."""
    lengths = sentence_lengths(rng, batch, alpha, max_len)
    gen = torch.Generator(device).manual_seed(int(rng.integers(2**62)))
    values = torch.randn(int(lengths.sum()), dim, generator=gen, device=device, dtype=dtype)
    return values, offsets_from_lengths(lengths, device)


def output_lengths(rng, n, median, longest, sigma=1.0):
    """``n`` output lengths from a log-normal distribution (long-tailed, as
    chat outputs are) of the given ``median``, cut to ``[1, longest]``: (n,)."""
    drawn = rng.lognormal(np.log(median), sigma, size=n)
    return np.clip(np.round(drawn), 1, longest).astype(int)


def request_stream(documents, n, rng, *, prompt_max, out_median, out_max):
    """``n`` requests, all waiting at time 0: prompts are the openings, at
    most ``prompt_max`` tokens, of distinct documents drawn from
    ``documents`` (``bytes``, a token per byte); :func:`output_lengths`."""
    if n > len(documents):
        raise ValueError(f"{n} requests need {n} documents; the corpus has {len(documents)}")
    chosen = rng.choice(len(documents), size=n, replace=False)
    outs = output_lengths(rng, n, out_median, out_max)
    return [
        Request(i, list(documents[d][:prompt_max]), int(o))
        for i, (d, o) in enumerate(zip(chosen, outs))
    ]


def poisson_arrivals(rng, n, rate):
    """Arrival times (n,), in seconds, of ``n`` requests at ``rate``
    requests/s on average: a Poisson process, its gaps exponential."""
    return np.cumsum(rng.exponential(1 / rate, size=n))


def fresh_requests(requests, arrivals=None):
    """Copies of ``requests`` with nothing served, arriving at ``arrivals``
    (seconds, one each; default: as they were)."""
    arrivals = [r.arrival for r in requests] if arrivals is None else arrivals
    return [Request(r.rid, r.prompt, r.n_out, float(a)) for r, a in zip(requests, arrivals)]
