"""Requests that share their beginnings, as real traffic does: a few system
prompts each in front of many user messages, and conversations whose every
turn resends the turns before it, each stream in a few words
(:func:`stream_summary`); how much of a stream a prefix cache could find
(:func:`reusable_tokens`); a decoding step of requests that share
a prefix, on random keys, to check and time shared-prefix attention
(:func:`shared_prefix_step`), the key/value rows it reads
(:func:`rows_read`), and its cases timed against the gathered path
(:func:`time_shared_prefix`, :func:`print_where_it_pays`,
:func:`draw_shared_prefix`)."""

from __future__ import annotations

import torch

from ragged_toolkit.batches import offsets_from_lengths
from ragged_toolkit.decoding import generate_packed
from ragged_toolkit.serving.engine import build_step
from ragged_toolkit.serving.prefix_cache import PrefixCache
from ragged_toolkit.serving.requests import Request

from ..figures import draw_speedup_cases
from ..measuring.noise import outside_noise
from ..measuring.timing import measure
from ..records import record
from ..workloads import output_lengths

__all__ = [
    "system_prompt_stream",
    "greedy_answers",
    "conversation_stream",
    "reusable_tokens",
    "stream_summary",
    "rows_read",
    "shared_prefix_step",
    "time_shared_prefix",
    "print_where_it_pays",
    "draw_shared_prefix",
]


def _openings(documents, rng, n, longest, shortest=1):
    """The openings, at most ``longest`` tokens, of ``n`` distinct documents
    of at least ``shortest`` bytes, drawn with ``rng``; and the documents
    left."""
    pool = [d for d in documents if len(d) >= shortest]
    if n > len(pool):
        raise ValueError(
            f"{n} openings need {n} documents of at least {shortest} bytes; "
            f"the corpus has {len(pool)}: ask for fewer requests or shorter prompts"
        )
    chosen = rng.choice(len(pool), size=n, replace=False)
    taken = {id(pool[i]) for i in chosen}
    return [list(pool[i][:longest]) for i in chosen], [d for d in documents if id(d) not in taken]


def system_prompt_stream(documents, n, rng, *, systems, system_len, user_max, out_median, out_max):
    """``n`` requests, all waiting at time 0, each one of ``systems`` system
    prompts (the first ``system_len`` tokens of a long document, drawn with
    equal chances) followed by a user message (the opening, at most
    ``user_max`` tokens, of another document); output lengths from
    :func:`~ragged_site.workloads.output_lengths`."""
    system, rest = _openings(documents, rng, systems, system_len, shortest=system_len)
    users, _ = _openings(rest, rng, n, user_max)
    which, outs = rng.integers(0, systems, size=n), output_lengths(rng, n, out_median, out_max)
    return [
        Request(i, system[s] + u, int(o)) for i, (s, u, o) in enumerate(zip(which, users, outs))
    ]


@torch.no_grad()
def greedy_answers(model, prompts, n_outs, dtype=torch.float32):
    """What greedy decoding gives each prompt (a list of token ids) alone:
    ``n_outs[i]`` tokens for prompt ``i``, one packed generation
    (:func:`~ragged_toolkit.decoding.generate_packed`) in ``dtype``."""
    device = next(model.parameters()).device
    tokens = torch.tensor([t for p in prompts for t in p], device=device)
    offsets = offsets_from_lengths([len(p) for p in prompts], device)
    new = generate_packed(model, tokens, offsets, max(n_outs), dtype=dtype).tolist()
    return [row[:n] for row, n in zip(new, n_outs)]


def conversation_stream(
    documents, rng, *, conversations, turns, message_max, out_median, out_max, answer
):
    """``conversations`` conversations of ``turns`` turns, all waiting at
    time 0, turn after turn (every first turn, then every second...). Turn
    ``t``'s prompt is turn ``t - 1``'s prompt, its answer and a new message
    (the opening, at most ``message_max`` tokens, of a document not used
    before). ``answer(prompts, n_outs)`` gives each turn's answer
    (:func:`greedy_answers`: what the server must generate, proved)."""
    messages, _ = _openings(documents, rng, conversations * turns, message_max)
    outs = output_lengths(rng, conversations * turns, out_median, out_max).tolist()
    prompts, requests = [[] for _ in range(conversations)], []
    for t in range(turns):
        turn = [t * conversations + c for c in range(conversations)]
        prompts = [p + messages[i] for p, i in zip(prompts, turn)]
        requests += [Request(i, p, outs[i]) for i, p in zip(turn, prompts)]
        if t + 1 < turns:
            prompts = [p + a for p, a in zip(prompts, answer(prompts, [outs[i] for i in turn]))]
    return requests


def stream_summary(requests):
    """``requests`` in a few words: how many, their prompts' shortest and
    longest lengths and total, and the tokens they generate."""
    lengths = [len(r.prompt) for r in requests]
    return (
        f"{len(requests)} requests, prompts {min(lengths)} to {max(lengths)} tokens "
        f"({sum(lengths)} in all), outputs {sum(r.n_out for r in requests)} tokens"
    )


def reusable_tokens(requests, block_size):
    """Prompt tokens of ``requests`` (in order) in full blocks that an earlier
    request's prompt or answer holds: what a prefix cache that never evicts
    finds (the last token of each prompt always computed). A block is known
    here by all the tokens up to its end, not by the cache's hash: an
    independent count."""
    seen, found = set(), 0
    for req in requests:
        history = req.prompt + req.generated
        for i in range((len(req.prompt) - 1) // block_size):
            found += block_size * (tuple(req.prompt[: (i + 1) * block_size]) in seen)
        for i in range(len(history) // block_size):  # what this request leaves cached
            seen.add(tuple(history[: (i + 1) * block_size]))
    return found


def rows_read(prefix, suffixes, shared):
    """Key/value rows a decoding step's attention reads for requests that
    share a ``prefix`` of rows and each have their own ``suffixes`` (Q,):
    once the prefix and every suffix (``shared``), or each request's whole
    rows (gathered). Their ratio is the work bound of sharing: the scores
    computed are the same, the keys read are not."""
    suffixes = torch.as_tensor(suffixes)
    return float(prefix + suffixes.sum()) if shared else float((prefix + suffixes).sum())


def shared_prefix_step(cfg, prefix, suffixes, block_size, device, dtype, generator=None):
    """A decoding step of ``len(suffixes)`` requests (ids 0, 1, ...) whose
    prompts share their first ``prefix`` tokens, request ``i`` then
    ``suffixes[i]`` tokens of its own, admitted one after another into a
    :class:`~ragged_toolkit.serving.prefix_cache.PrefixCache` (so that they
    share the prefix's full blocks), each feeding its last prompt token.
    The cache's keys and values are random (standard normal, from
    ``generator``, on the cache's device), as a model would have written them. Returns the cache
    and the step's :class:`~ragged_toolkit.serving.paged_attention.PagedLayout`
    (its ``kv_lengths``: each request's prompt length)."""
    n_blocks = sum(-(-(prefix + s) // block_size) for s in suffixes) + 1
    cache = PrefixCache(cfg, n_blocks, block_size, device, dtype)
    cache.k.normal_(generator=generator), cache.v.normal_(generator=generator)
    step = []
    for i, suffix in enumerate(suffixes):
        req = Request(
            i, list(range(prefix)) + [-1 - i] * suffix, 1
        )  # its own tokens: none of the prefix's
        req.computed = cache.take_prefix(i, req.prompt)
        if not cache.reserve(i, len(req.prompt)):
            raise RuntimeError(
                f"{n_blocks} blocks are too few for request {i}"
            )  # cannot happen: one each
        req.computed = len(req.prompt) - 1  # all but the token the step feeds
        cache.note_computed(req)
        step.append((req, 1))
    _, _, layout = build_step(cache, step, device)
    return cache, layout


def time_shared_prefix(cases):
    """Time shared-prefix attention against the gathered path, case by case.
    ``cases`` maps ``(requests, prefix, suffix)`` to a dict: ``bound``, the
    work bound of sharing (:func:`rows_read`), and ``paths``, ``"gathered"``
    and ``"shared"``, each a function of no arguments. Each case's paths
    take turns (:func:`~ragged_site.measuring.timing.measure`, a second,
    five rounds, not profiled); a line each: the speedup, its bound and
    their fraction, "(within noise)" where the IQRs overlap. Returns case
    -> path -> ``Timing``."""
    timed = {
        case: measure(c["paths"], min_run_time=1.0, rounds=5, profile=False)
        for case, c in cases.items()
    }
    for (n_req, prefix, suffix), t in timed.items():
        gain, bound = (
            t["gathered"].median_ms / t["shared"].median_ms,
            cases[n_req, prefix, suffix]["bound"],
        )
        apart = outside_noise(t["gathered"], t["shared"])
        line = (
            f"shared-prefix attention: {n_req} requests over a prefix of {prefix} tokens, suffixes "
            f"of {suffix} tokens: {gain:.2f}x the gathered path, work bound {bound:.2f}x, "
            f"fraction {gain / bound:.2f}" + ("" if apart else " (within noise)")
        )
        case = dict(requests=n_req, prefix=prefix, suffix=suffix)
        figures = dict(speedup=gain, bound=bound, fraction=gain / bound, within_noise=not apart)
        print(record("speedup", line, label="shared-prefix attention", **case, **figures))
    return timed


def print_where_it_pays(timed):
    """Two lines from :func:`time_shared_prefix`'s ``timed``: the cases in
    which shared-prefix attention was slower than the gathered path, and
    those in which it was faster, outside the noise only."""
    for tell in ("slower", "faster"):
        told = [
            f"{n_req} over {prefix}+{suffix}"
            for (n_req, prefix, suffix), t in timed.items()
            if outside_noise(t["gathered"], t["shared"])
            and (t["shared"].median_ms > t["gathered"].median_ms) == (tell == "slower")
        ]
        print(f"{tell} than gathered, outside the noise: {', '.join(told) or 'none'}")


def draw_shared_prefix(timed, cases):
    """The cases of :func:`time_shared_prefix` as a chart: each case's
    speedup of shared-prefix attention over the gathered path, beside its
    work bound (``cases[case]["bound"]``), hatched where within the noise."""
    shown = {
        f"{n_req} requests, {prefix} + {suffix}": (
            t["gathered"].median_ms / t["shared"].median_ms,
            cases[n_req, prefix, suffix]["bound"],
            not outside_noise(t["gathered"], t["shared"]),
        )
        for (n_req, prefix, suffix), t in timed.items()
    }
    title = "shared-prefix attention over the gathered path (prefix + suffix tokens)"
    return draw_speedup_cases(shown, title, "speedup over the gathered path")
