"""Requests that share their beginnings, as real traffic does: a few system
prompts each in front of many user messages, and conversations whose every
turn resends the turns before it; and how much of a stream a prefix cache
could find (:func:`reusable_tokens`)."""

from __future__ import annotations

import torch

from ragged_toolkit.batches import offsets_from_lengths
from ragged_toolkit.decoding import generate_packed
from ragged_toolkit.serving.requests import Request, output_lengths

__all__ = ["system_prompt_stream", "greedy_answers", "conversation_stream", "reusable_tokens"]


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
    :func:`~ragged_toolkit.serving.requests.output_lengths`."""
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
