"""Recurrent layers on a packed batch: gated linear attention with a scalar
decay (the Mamba-2 form) and the gated delta rule (Gated DeltaNet, as in
Qwen3-Next), each behind a short causal convolution, with the state set back
to zero and the convolution cut at every document start.

Shapes: ``T`` packed tokens, ``B`` documents, ``H`` heads, ``K`` and ``V``
the key and value sizes of a head, ``C`` tokens per chunk, ``R`` rows of
``L`` tokens (one row of ``T`` for a packed batch, ``B`` rows of ``S`` for a
padded one), ``N`` chunks per row. The recurrence, per head, with ``g_t <= 0``
a log decay::

    scalar decay:  S_t = exp(g_t) S_{t-1} + k_t v_t^T
    delta rule:    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    both:          o_t = S_t^T q_t,  S (K, V), and S = 0 before a document's first token

* the definition: ``recurrent_step`` and ``reference_recurrence``,
  token by token, one document at a time;
* the chunked form: ``causal_conv``, ``chunk_decay``,
  ``_delta_values``, ``_carry_states``, put together by
  ``chunked_recurrence``, called by :func:`packed_recurrence` (values
  plus offsets) and :func:`padded_recurrence` (right padding);
* the layers: :class:`ScalarDecayLayer` and :class:`GatedDeltaLayer`, packed,
  padded, their per-document reference, and decoding from a
  :class:`RecurrentCache`: one state per request, whatever its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .batches import token_index

__all__ = [
    "packed_recurrence",
    "padded_recurrence",
    "RecurrentCache",
    "ScalarDecayLayer",
    "GatedDeltaLayer",
]


def _wide(t):
    """float32 for float32 and lower precisions, float64 kept: the dtype the
    recurrence accumulates in."""
    return t if t.dtype == torch.float64 else t.float()


# --- the definition ---------------------------------------------------------------


def recurrent_step(state, q, k, v, g, beta=None):
    """One token of the recurrence, for any leading dims ``...``.

    state: (..., H, K, V); q, k: (..., H, K); v: (..., H, V); g: (..., H),
    the log decay; beta: (..., H) for the delta rule, None for a scalar decay.
    Returns o (..., H, V) and the new state (..., H, K, V).
    """
    state = g.exp()[..., None, None] * state  # exp(g_t) S_{t-1}
    if beta is None:
        write = v  # scalar decay: add k_t v_t^T
    else:
        recalled = (k[..., :, None] * state).sum(-2)  # (..., H, V): k_t^T S, what S holds for k_t
        write = beta[..., None] * (v - recalled)  # delta rule: write the correction
    state = state + k[..., :, None] * write[..., None, :]  # + k_t write^T
    return (q[..., :, None] * state).sum(-2), state  # o_t = S_t^T q_t


def reference_recurrence(q, k, v, g, beta=None):
    """The definition for one document, token by token, in float64.

    q, k: (L, H, K); v: (L, H, V); g, beta: (L, H) (beta None: scalar decay).
    Returns o (L, H, V) and the final state (H, K, V), both float64.
    """
    q, k, v, g = (t.double() for t in (q, k, v, g))
    beta = None if beta is None else beta.double()
    state = q.new_zeros(q.shape[1], k.shape[2], v.shape[2])  # (H, K, V): zero at the start
    out = []
    for t in range(len(q)):
        o, state = recurrent_step(state, q[t], k[t], v[t], g[t], None if beta is None else beta[t])
        out.append(o)
    return (torch.stack(out) if out else v.new_zeros(v.shape)), state


# --- the convolution, cut at document starts ---------------------------------------


def causal_conv(x, weight, pos):
    """Depthwise causal convolution that never reads across a document start.

    x: (..., L, D), packed (T, D) or padded (B, S, D); weight: (D, W), in
    ``nn.Conv1d``'s order (tap W - 1 on the current token); pos: (..., L),
    each token's position in its document. Token t sums
    ``weight[:, W - 1 - m] * x[t - m]`` over the taps m <= pos[t] only.
    Returns (..., L, D).
    """
    width, length = weight.shape[1], x.shape[-2]
    out = torch.zeros_like(_wide(x))
    for m in range(width):  # tap m reads the token m places back
        back = F.pad(x, (0, 0, m, 0))[..., :length, :]  # x[t - m], zeros before the row's start
        inside = (pos >= m)[..., None]  # (..., L, 1): still in t's document
        out = out + _wide(weight[:, width - 1 - m]) * back * inside
    return out.to(x.dtype)


def _conv_tail(x, offsets, width):
    """The convolution's cache: each document's last ``width - 1`` inputs,
    oldest first, zeros before a short document's start. x: (T, D);
    offsets: (B + 1,). Returns (B, width - 1, D)."""
    back = torch.arange(width - 1, 0, -1, device=x.device)  # W - 1, ..., 1 places back from the end
    index = offsets[1:, None] - back  # (B, W - 1) packed token indices
    inside = (index >= offsets[:-1, None])[..., None]  # (B, W - 1, 1)
    return x[index.clamp(min=0)] * inside


# --- the chunked form ----------------------------------------------------------------


def _chunks(t, chunk, value=0):
    """(R, L, ...) -> (R, N, C, ...), padded with ``value`` to N * C tokens."""
    pad = -t.shape[1] % chunk
    t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad), value=value)
    return t.unflatten(1, (-1, chunk))


def _same_document(doc):
    """doc: (..., C), the document of each token of a chunk. Returns (..., C, C),
    True where token j reaches token i: j <= i, and both in one document."""
    C = doc.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=doc.device).tril()
    return causal & (doc[..., :, None] == doc[..., None, :])


def chunk_decay(g, doc, pos):
    """The decays inside each chunk, cut at document starts.

    g: (R, N, H, C) log decays; doc, pos: (R, N, C) each token's document and
    position in it. Returns ``decay`` (R, N, H, C, C), exp(g_{j+1} + ... + g_i)
    from token j to token i where ``_same_document``, else 0; and ``carry``
    (R, N, H, C), exp(g_0 + ... + g_i), the decay of the state carried into
    the chunk, for the tokens whose document began before the chunk, else 0.
    """
    C = g.shape[-1]
    steps = g[..., :, None].expand(*g.shape, C)  # (R, N, H, C, C): [i, j] = g_i
    steps = steps.masked_fill(~torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1), 0)
    between = steps.cumsum(-2)  # [i, j] = g_{j+1} + ... + g_i, no cancellation
    decay = between.masked_fill(~_same_document(doc)[:, :, None], -torch.inf).exp()
    began_before = pos > torch.arange(
        C, device=pos.device
    )  # (R, N, C): position in document > in chunk
    return decay, g.cumsum(-1).exp() * began_before[:, :, None]


def _delta_values(k, v, beta, decay, carry):
    """The delta rule made parallel inside a chunk (the WY form).

    Token i writes ``beta_i (v_i - k_i^T S_{i-1})``, where S_{i-1} is the
    carried state ``S_in`` decayed by ``carry_i`` plus the writes of the earlier
    tokens of its document. So the writes X solve (I + A) X = beta v - beta
    carry k S_in, with A_ij = beta_i (k_i . k_j) decay_ij for j < i: a unit
    lower-triangular system, block diagonal by document. k: (R, N, H, C, K);
    v: (R, N, H, C, V); beta, carry: (R, N, H, C); decay: (R, N, H, C, C).
    Returns u (R, N, H, C, V) and w (R, N, H, C, K): the writes are u - w S_in.
    """
    bk = beta[..., None] * k  # (R, N, H, C, K)
    A = (bk @ k.mT * decay).tril(-1)  # (R, N, H, C, C), strictly lower
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    rhs = torch.cat([beta[..., None] * v, bk * carry[..., None]], -1)
    solved = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    return solved.split([v.shape[-1], k.shape[-1]], -1)


def _carry_states(scale, update, correction=None):
    """The state carried from chunk to chunk, the only sequential step:
    S_{n+1} = scale_n S_n + update_n (- correction_n S_n for the delta rule),
    starting from zero. scale: (R, N, H, 1, 1); update: (R, N, H, K, V);
    correction: (R, N, H, K, K) or None. Returns the state entering each
    chunk, (R, N, H, K, V)."""
    state = torch.zeros_like(update[:, 0])  # (R, H, K, V)
    entering = []
    for n in range(update.shape[1]):
        entering.append(state)
        new = scale[:, n] * state + update[:, n]
        if correction is not None:  # delta rule: what S_n already held, removed
            new = new - correction[:, n] @ state
        state = new
    return torch.stack(entering, 1)


def chunked_recurrence(q, k, v, g, beta, doc, pos, ends, chunk=64):
    """The recurrence on R rows, in chunks of ``chunk`` tokens.

    q, k: (R, L, H, K); v: (R, L, H, V); g, beta: (R, L, H) (beta None: scalar
    decay); doc, pos: (R, L) each token's document and position in it; ends:
    (E, 2), a row and token index after which to return the state. Computes
    in float32 (float64 kept). Returns o (R, L, H, V) and states (E, H, K, V).
    """
    L = q.shape[1]
    q, k, v, g = (_chunks(_wide(t), chunk).transpose(2, 3) for t in (q, k, v, g))  # (R, N, H, C, .)
    decay, carry = chunk_decay(g, _chunks(doc, chunk, -1), _chunks(pos, chunk))
    if beta is None:
        u, w = v, None  # scalar decay: every token writes v
    else:
        u, w = _delta_values(k, v, _chunks(_wide(beta), chunk).transpose(2, 3), decay, carry)
    # the state leaving a chunk is its last document's: decay[..., -1, :] and carry[..., -1] are zero
    # for the tokens of other documents, and for the carried state if that document began in the chunk
    to_end = decay[..., -1, :, None] * k  # (R, N, H, C, K): k_j decayed to the chunk's end
    entering = _carry_states(
        carry[..., -1, None, None], to_end.mT @ u, None if w is None else to_end.mT @ w
    )  # (R, N, H, K, V)
    writes = u if w is None else u - w @ entering  # (R, N, H, C, V)
    o = (q * carry[..., None]) @ entering + (q @ k.mT * decay) @ writes
    r, n, i = ends[:, 0], ends[:, 1] // chunk, ends[:, 1] % chunk
    states = (
        carry[r, n, :, i][..., None, None] * entering[r, n]  # (E, H, K, V): the state after
        + (decay[r, n, :, i][..., None] * k[r, n]).mT @ writes[r, n]
    )  # token i of chunk n
    return o.transpose(2, 3).flatten(1, 2)[:, :L], states


def packed_recurrence(q, k, v, g, offsets, beta=None, *, chunk=64):
    """The chunked recurrence on a packed batch, zero state at every document.

    q, k: (T, H, K); v: (T, H, V); g, beta: (T, H) (beta None: scalar decay);
    offsets: (B + 1,). Returns o (T, H, V) in v's dtype and each document's
    final state (B, H, K, V) in float32 (float64 kept), zeros if empty.
    """
    doc, pos = token_index(offsets, q.shape[0])  # (T,), (T,)
    last = (offsets[1:] - 1).clamp(min=0)  # (B,): each document's last token
    ends = torch.stack([torch.zeros_like(last), last], 1)  # (B, 2): all in row 0
    o, states = chunked_recurrence(
        q[None],
        k[None],
        v[None],
        g[None],
        None if beta is None else beta[None],
        doc[None],
        pos[None],
        ends,
        chunk,
    )
    empty = (offsets.diff() == 0)[:, None, None, None]
    return o[0].to(v.dtype), states.masked_fill(empty, 0)


def padded_recurrence(q, k, v, g, lengths=None, beta=None, *, chunk=64):
    """The same chunked recurrence on right-padded rows, one document each.

    q, k: (B, S, H, K); v: (B, S, H, V); g, beta: (B, S, H); lengths: (B,)
    real tokens per row (None: all S). Padding comes after every real token
    of its row, so the causal recurrence never carries it to them; the final
    state is read at each row's last real token. Returns o (B, S, H, V) in
    v's dtype and the final states (B, H, K, V).
    """
    B, S = q.shape[:2]
    pos = torch.arange(S, device=q.device).expand(B, S)  # (B, S): every row one document
    lengths = torch.full((B,), S, device=q.device) if lengths is None else lengths.to(q.device)
    ends = torch.stack([torch.arange(B, device=q.device), (lengths - 1).clamp(min=0)], 1)
    o, states = chunked_recurrence(q, k, v, g, beta, torch.zeros_like(pos), pos, ends, chunk)
    return o.to(v.dtype), states.masked_fill((lengths == 0)[:, None, None, None], 0)


# --- the layers ------------------------------------------------------------------------


def _l2norm(x, eps=1e-6):
    """x / sqrt(sum x^2 + eps) over the last dim, as Qwen3-Next normalises q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@dataclass
class RecurrentCache:
    """What one layer keeps per request to decode: its recurrent ``state``
    (B, H, K, V), float32, and the convolution's last inputs ``conv``
    (B, W - 1, D): the same size whatever the request's length."""

    state: torch.Tensor
    conv: torch.Tensor


class _RecurrentLayer(nn.Module):
    """A recurrent token mixer, in the layout of Qwen3-Next's GatedDeltaNet:
    q, k, v through a causal depthwise convolution and SiLU, a per-head
    decay ``g = -exp(A_log) softplus(a + dt_bias)``, the recurrence, an RMS
    norm per head gated by SiLU(z), and an output projection; q and k are
    L2-normalised and q scaled by K^-1/2. ``key_heads`` (default ``heads``)
    q/k heads are shared by ``heads`` value heads. K = V = ``head_dim``."""

    delta = False

    def __init__(
        self,
        embed,
        heads,
        head_dim,
        *,
        key_heads=None,
        conv_width=4,
        chunk=64,
        eps=1e-6,
        device=None,
        dtype=None,
    ):
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.heads, self.key_heads, self.head_dim = heads, key_heads or heads, head_dim
        self.chunk, self.eps = chunk, eps
        self.channels = (
            2 * self.key_heads + heads
        ) * head_dim  # q, k, v: the convolution's channels
        self.qkv_proj = nn.Linear(embed, self.channels, **kw)
        self.gate_proj = nn.Linear(embed, heads * head_dim, **kw)  # z, the output gate
        self.ab_proj = nn.Linear(
            embed, heads * (2 if self.delta else 1), **kw
        )  # a (decay step), b (beta)
        fk = {"device": device, "dtype": dtype}
        self.conv_weight = nn.Parameter(
            torch.randn(self.channels, conv_width, **fk) / conv_width**0.5
        )
        self.A_log = nn.Parameter(
            torch.empty(heads, **fk).uniform_(0.01, 16).log()
        )  # as Qwen3-Next
        self.dt_bias = nn.Parameter(torch.ones(heads, **fk))
        self.norm_weight = nn.Parameter(torch.ones(head_dim, **fk))
        self.out_proj = nn.Linear(heads * head_dim, embed, **kw)

    def mixer_inputs(self, mixed, ab):
        """mixed (..., channels) after the convolution, ab (..., H or 2H) ->
        q, k (..., H, K), v (..., H, V), g (..., H), beta (..., H) or None."""
        q, k, v = mixed.unflatten(-1, (-1, self.head_dim)).split(
            [self.key_heads, self.key_heads, self.heads], -2
        )
        a, b = ab.chunk(2, -1) if self.delta else (ab, None)
        step = F.softplus(_wide(a) + self.dt_bias)  # (..., H) the step size
        g = -_wide(self.A_log).exp() * step  # log decay <= 0
        q, k = _l2norm(_wide(q)) * self.head_dim**-0.5, _l2norm(_wide(k))
        if self.delta:
            beta = _wide(b).sigmoid()  # (..., H) how much of v_t to write
        else:  # Mamba-2: the input scaled by its step
            v, beta = v * step[..., None].to(v.dtype), None
        share = self.heads // self.key_heads  # value heads per q/k head
        q, k = (t.repeat_interleave(share, -2).to(v.dtype) for t in (q, k))
        return q, k, v, g, beta

    def output(self, o, x):
        """o (..., H, V) from the recurrence, x (..., E) the layer's input -> (..., E)."""
        o = F.rms_norm(_wide(o), (self.head_dim,), eps=self.eps).to(x.dtype) * self.norm_weight
        o = o * F.silu(_wide(self.gate_proj(x))).unflatten(-1, (self.heads, -1)).to(x.dtype)
        return self.out_proj(o.flatten(-2))

    def forward(self, x, offsets=None):
        """x (T, E) with offsets (B + 1,): a packed batch; x (B, S, E) without:
        right-padded rows. Returns the shape of x."""
        return self._run(x, offsets)[0]

    def _run(self, x, offsets):
        pos = (
            torch.arange(x.shape[1], device=x.device).expand(x.shape[:2])
            if offsets is None
            else token_index(offsets, x.shape[0])[1]
        )
        qkv = self.qkv_proj(x)  # (..., channels)
        q, k, v, g, beta = self.mixer_inputs(
            F.silu(causal_conv(qkv, self.conv_weight, pos)), self.ab_proj(x)
        )
        if offsets is None:
            o, states = padded_recurrence(q, k, v, g, None, beta, chunk=self.chunk)
        else:
            o, states = packed_recurrence(q, k, v, g, offsets, beta, chunk=self.chunk)
        return self.output(o, x), states, qkv

    def prefill(self, x, offsets):
        """A packed forward that also returns the cache to decode from: x
        (T, E), offsets (B + 1,) -> (T, E) and a :class:`RecurrentCache`."""
        out, states, qkv = self._run(x, offsets)
        return out, RecurrentCache(states, _conv_tail(qkv, offsets, self.conv_weight.shape[1]))

    def step(self, x, cache):
        """One new token per request: x (B, E) and its cache -> (B, E) and the
        new cache. The state is updated by ``recurrent_step``."""
        window = torch.cat([cache.conv, self.qkv_proj(x)[:, None]], 1)  # (B, W, channels)
        mixed = F.silu(
            (_wide(window) * _wide(self.conv_weight).T).sum(1).to(x.dtype)
        )  # (B, channels)
        q, k, v, g, beta = self.mixer_inputs(mixed, self.ab_proj(x))
        o, state = recurrent_step(cache.state, _wide(q), _wide(k), _wide(v), g, beta)
        return self.output(o.to(x.dtype), x), RecurrentCache(state, window[:, 1:])

    def reference(self, x, offsets):
        """The definition: each document alone, a plain zero-padded
        ``conv1d``, the recurrence token by token (run on a float64 copy for a
        float64 reference). x (T, E) -> (T, E) and the final states (B, H, K, V)."""
        outs, states = [], []
        for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            xd, width = x[start:end], self.conv_weight.shape[1]  # (L, E): one document
            if end == start:  # empty: no output, a zero state
                states.append(x.new_zeros(self.heads, self.head_dim, self.head_dim))
                continue
            conv = F.conv1d(
                self.qkv_proj(xd).T[None],
                self.conv_weight[:, None],
                padding=width - 1,
                groups=self.channels,
            )[0, :, : end - start].T
            q, k, v, g, beta = self.mixer_inputs(F.silu(conv), self.ab_proj(xd))
            o, state = reference_recurrence(q, k, v, g, beta)
            outs.append(self.output(o.to(x.dtype), xd))
            states.append(state)
        return torch.cat(outs), torch.stack(states)


class ScalarDecayLayer(_RecurrentLayer):
    """Gated linear attention with one decay per head and token (Mamba-2's
    state-space duality form): S_t = exp(g_t) S_{t-1} + k_t (dt_t v_t)^T, the
    input scaled by its step dt_t as Mamba-2 does (which leaves q and k
    unnormalised; here they are normalised as in :class:`GatedDeltaLayer`)."""

    delta = False


class GatedDeltaLayer(_RecurrentLayer):
    """The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention):
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, with q
    and k L2-normalised and beta_t = sigmoid(b_t)."""

    delta = True
