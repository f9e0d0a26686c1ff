"""The proof that a server changed nothing: each request's logits and
tokens against greedy decoding of that request alone, without a cache. A
server keeps each request's tokens only; the proof records the logits that
chose them through the server's ``on_token`` (:class:`TokenLogits`)."""

from __future__ import annotations

import torch

from ragged_toolkit.layouts import PaddedLayout

__all__ = [
    "TokenLogits",
    "logits_after",
    "logits_alone",
    "check_against_alone",
    "check_runs_against_alone",
]


class TokenLogits:
    """A server's ``on_token(request, logits)``: keeps, per request served,
    the logits (vocab,) that chose each of its tokens, in float32, for a
    proof (a server does not keep them). ``of(request)``: (n_out, vocab)."""

    def __init__(self):
        self._seen = {}  # id(request) -> (request, [logits]); the request kept, so its id stays its own

    def __call__(self, request, logits):
        self._seen.setdefault(id(request), (request, []))[1].append(logits.float())

    def of(self, request):
        if id(request) not in self._seen:
            raise KeyError(
                f"request {request.rid}: no logits recorded; serve it with on_token=this record"
            )
        return torch.stack(self._seen[id(request)][1])


@torch.no_grad()
def logits_after(model, history):
    """The logits (vocab,) with which greedy decoding alone, without a cache,
    chooses the token after ``history`` (token ids): one causal pass over
    it, padded layout."""
    device = next(model.parameters()).device
    ids = torch.tensor(history, device=device)[None]  # (1, S)
    return model(ids, torch.arange(ids.shape[1], device=device)[None], PaddedLayout())[0, -1]


@torch.no_grad()
def logits_alone(model, request):
    """The logits with which greedy decoding of ``request`` alone, without a
    cache, chooses each of its tokens: one causal pass, padded layout, over
    its prompt and its tokens but the last (teacher forcing). (n_out, vocab)."""
    device = next(model.parameters()).device
    ids = torch.tensor(request.prompt + request.generated[:-1], device=device)[None]  # (1, S)
    positions = torch.arange(ids.shape[1], device=device)[None]
    return model(ids, positions, PaddedLayout())[0, len(request.prompt) - 1 :]


def check_against_alone(reference, requests, tolerance, logits):
    """Prove each request's tokens are those of greedy decoding it alone with
    ``reference`` (a float32 model): the server's logits (``logits``, the
    :class:`TokenLogits` it was served with) agree with
    :func:`logits_alone` within ``tolerance`` (``assert_close`` keywords),
    and each token is the reference's greedy choice or ties with it within
    ``tolerance["atol"]``; by induction on the tokens, the request then
    generated what decoding it alone generates. Raises ``AssertionError``
    naming the request; returns ``(largest logit difference, ties)``."""
    worst, ties = 0.0, 0
    for req in requests:
        assert req.done() and len(req.generated) == req.n_out, f"request {req.rid} did not finish"
        ref = logits_alone(reference, req).float()  # (n_out, vocab)
        got = logits.of(req).to(ref.device)
        torch.testing.assert_close(
            got,
            ref,
            **tolerance,
            msg=lambda m, r=req: f"request {r.rid}: logits differ from decoding it alone: {m}",
        )
        chosen = ref.gather(1, torch.tensor(req.generated, device=ref.device)[:, None])[:, 0]
        gap = ref.max(-1).values - chosen  # 0 where the token is the reference's choice
        bad = (gap > tolerance["atol"]).nonzero().flatten().tolist()
        assert not bad, f"request {req.rid}: token {bad[0]} is not what decoding it alone chooses"
        ties += int((gap > 0).sum())
        worst = max(worst, float((got - ref).abs().max()))
    return worst, ties


def check_runs_against_alone(reference, runs, tolerance, logits):
    """:func:`check_against_alone` for every request of every run of
    ``runs`` (``ServingRun`` s served with ``on_token=logits``). Returns
    ``(largest logit difference, ties)`` over them all."""
    worst, ties = 0.0, 0
    for run in runs:
        difference, tied = check_against_alone(reference, run.requests, tolerance, logits)
        worst, ties = max(worst, difference), ties + tied
    return worst, ties
