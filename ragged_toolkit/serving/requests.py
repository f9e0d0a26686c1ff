"""The requests a server is sent: prompts (token ids) from real documents,
long-tailed output lengths, arrivals on a clock; and the check that refuses,
by name, a request the server cannot serve (``check_request``)."""

from __future__ import annotations

from dataclasses import dataclass, field


__all__ = ["Request"]


@dataclass
class Request:
    """A prompt (token ids), how many tokens to generate (fixed, as benchmarks
    fix it by ignoring the end-of-sequence token), the arrival (seconds of the
    simulated clock); then the tokens generated (token ids, not the logits
    that chose them: a proof records those itself), how many of
    ``prompt + generated`` have keys in the cache, the clock at the first and
    last tokens, and the times it was preempted."""

    rid: int
    prompt: list
    n_out: int
    arrival: float = 0.0
    generated: list = field(default_factory=list)
    computed: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    preempted: int = 0

    def length(self):
        """Tokens whose keys the request needs: prompt and generated."""
        return len(self.prompt) + len(self.generated)

    def pending(self):
        """Tokens to feed before its next token can be chosen."""
        return self.length() - self.computed

    def done(self):
        """Whether it generated all its tokens."""
        return len(self.generated) >= self.n_out


def next_tokens(req, start, n):
    """The ``n`` tokens of ``req``'s history (``prompt + generated``) from
    position ``start``: two slices, not a copy of the whole history."""
    cut = len(req.prompt)
    return (
        req.prompt[start : start + n] + req.generated[max(start - cut, 0) : max(start + n - cut, 0)]
    )


def check_request(request, cfg, cache):
    """Raise ``ValueError`` naming ``request`` and the limit it breaks if the
    server cannot serve it: an empty prompt, an output length below one,
    token ids outside the vocabulary of ``cfg`` (a ``GPTConfig``), a prompt
    plus its output longer than the model's positions (``max_seq_len``), or
    more tokens than the whole ``cache`` (a ``PagedKVCache``) holds. Called
    on arrival, before any step that the request could join runs."""
    rid, prompt, n_out = request.rid, list(request.prompt), request.n_out
    if not prompt:
        raise ValueError(f"request {rid}: empty prompt; a request needs at least one prompt token")
    if n_out < 1:
        raise ValueError(
            f"request {rid}: output length {n_out}; a request generates at least one token"
        )
    bad = next(((i, t) for i, t in enumerate(prompt) if not 0 <= t < cfg.vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"request {rid}: token id {bad[1]} at prompt position {bad[0]} is outside the "
            f"vocabulary (ids 0 to {cfg.vocab_size - 1})"
        )
    total = len(prompt) + n_out
    if total > cfg.max_seq_len:
        raise ValueError(
            f"request {rid}: prompt of {len(prompt)} tokens plus {n_out} output tokens is "
            f"{total} positions; the model has {cfg.max_seq_len} (max_seq_len)"
        )
    blocks = -(-total // cache.block_size)
    if blocks > cache.n_blocks:
        raise ValueError(
            f"request {rid}: {total} tokens need {blocks} blocks of {cache.block_size} rows; "
            f"the whole cache has {cache.n_blocks}"
        )
