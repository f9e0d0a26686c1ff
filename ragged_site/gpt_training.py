"""The GPT page's machinery: how it sizes and reports its packed rows, the
padded baselines' batches and loss, the proofs that two steps compute the
same loss and gradients, the trainers, the probe that decides whether to
compile, the training figures and the padded prefill it measures against."""

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ragged_toolkit.batches import offsets_from_lengths, to_padded, token_index
from ragged_toolkit.data import document_targets, split_carrying_documents
from ragged_toolkit.layouts import PaddedLayout

from .figures import FIGURE_STYLE
from .measuring.bound import throughput_line, work_per_token
from .measuring.noise import MIN_RUNS, choose, outside_noise
from .measuring.timing import StepTimer, warm_every_shape
from .page import tolerances

__all__ = [
    "print_corpus",
    "print_packing",
    "padded_batches",
    "padded_loss",
    "loss_and_grads",
    "check_same",
    "Trainer",
    "probe_compile",
    "train_side_by_side",
    "print_training_speed",
    "check_learned",
    "plot_training",
    "prefill_padded",
]


def print_corpus(docs, source, stream_tokens, n_tokens, steps, asked):
    """Print the corpus, and how much of it ``steps`` steps of ``n_tokens``
    tokens in all read; say when it holds fewer than the ``asked`` tokens."""
    fewer = f" (asked for {asked:,}: the corpus holds fewer)" if n_tokens < asked else ""
    print(
        f"corpus: {len(docs)} documents, {len(stream_tokens):,} tokens, from {source};\n"
        f"training reads {n_tokens:,} of them in {steps} steps" + fewer
    )


def print_packing(stream_tokens, stream_offsets, rows, row_len, rows_per_step, n_docs):
    """Print what cutting the stream into ``rows`` of ``row_len`` tokens fills
    and cuts, and what carrying the ``n_docs`` documents the rows touch
    (``split_carrying_documents``) instead would pad."""
    n_tokens = sum(len(t) for t, _ in rows)
    row_starts = torch.arange(row_len, n_tokens, row_len)
    cut = int((~torch.isin(row_starts, stream_offsets)).sum())  # row starts inside a document
    # the last document as far as the rows go
    used = torch.cat([stream_offsets[:n_docs], torch.tensor([n_tokens])])
    carried = split_carrying_documents(stream_tokens[:n_tokens], used, row_len)
    carried_real = sum(len(t) for t, _ in carried) / (len(carried) * row_len)
    real = n_tokens / (len(rows) * row_len)
    print(
        f"packing: {rows_per_step} rows of {row_len} tokens per step, {real:.0%} of token "
        f"slots hold real tokens, {cut} documents cut"
    )
    print(
        f"carrying them instead: {len(carried)} rows for the same tokens, "
        f"{carried_real:.0%} of the slots real"
    )


def padded_batches(stream_tokens, stream_offsets, doc_lengths, batches):
    """The padded trainers' batches: for each name, each batch of document
    indices of the stream as packed (tokens, offsets), each document its
    first ``doc_lengths[i]`` tokens. Prints each trainer's padded slots per
    real token (each batch padded to its longest document)."""
    out = {}
    for name, indices in batches.items():
        out[name] = []
        for batch in indices:
            pieces = [stream_tokens[int(stream_offsets[i]) :][: int(doc_lengths[i])] for i in batch]
            out[name].append((torch.cat(pieces), offsets_from_lengths([len(p) for p in pieces])))
        lengths = [o.diff() for _, o in out[name]]
        slots = sum(len(n) * int(n.max()) for n in lengths) / sum(int(n.sum()) for n in lengths)
        print(f"{name}: padded slots {slots:.2f}x the real tokens")
    return out


def padded_loss(model, tokens, offsets, dtype):
    """The padded step's loss: the batch right-padded to ``(B, S)`` ids, one
    causal SDPA call with no mask, the loss masked at padding; under autocast
    to ``dtype`` unless float32."""
    ids = to_padded(tokens, offsets)[0]  # (B, S), right padding with id 0
    targets = to_padded(document_targets(tokens, offsets), offsets, -100)[0]
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(ids, positions, PaddedLayout())  # (B, S, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def loss_and_grads(model, loss_of):
    """The loss ``loss_of(copy)`` on a copy of ``model``, and every gradient, by name."""
    copy_ = copy.deepcopy(model)
    loss = loss_of(copy_)
    loss.backward()
    return {"loss": loss, "grads": {n: p.grad for n, p in copy_.named_parameters()}}


def check_same(name, got, want, dtype):
    """Raise ``AssertionError`` unless ``got`` (from :func:`loss_and_grads`)
    has the loss and gradients of ``want`` within ``dtype``'s tolerances;
    returns the largest gradient difference."""
    tol = tolerances(dtype)
    torch.testing.assert_close(got["loss"], want["loss"], **tol, msg=lambda m: f"{name}, loss: {m}")
    for n, g in got["grads"].items():
        torch.testing.assert_close(
            g, want["grads"][n], **tol, msg=lambda m, n=n: f"{name}, {n}: {m}"
        )
    return max((g - want["grads"][n]).abs().max().item() for n, g in got["grads"].items())


@dataclass
class Trainer:
    """A trainer: its own copy of the model, compiled or not (``fullgraph=True``,
    ``dynamic`` shapes or not), AdamW at ``lr``, and the losses of its steps.
    ``loss_of(runner, tokens, offsets)`` is one step's loss."""

    model: torch.nn.Module
    loss_of: object
    lr: float
    compiled: bool = False
    dynamic: bool = False
    losses: list = field(default_factory=list)

    def __post_init__(self):
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        self.runner = (
            self.model
            if not self.compiled
            else torch.compile(self.model, fullgraph=True, dynamic=self.dynamic)
        )  # a graph break is an error

    def loss(self, tokens, offsets):
        """This trainer's loss of one step, on its runner."""
        return self.loss_of(self.runner, tokens, offsets)

    def step(self, tokens, offsets):
        """One step: the loss, its backward, AdamW; the loss is kept."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(tokens, offsets)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.item())


def probe_compile(new_trainer, model, batches, warmup, quick, device):
    """Whether to compile each trainer: ``new_trainer(kind, model, compiled)``
    eager and compiled on copies of ``model``, interleaved, over the first
    steps of ``batches[kind]``; ``choose`` decides (within the noise: eager).
    On a GPU every trainer first meets every batch shape. Prints each
    compiled trainer's new graphs and graph breaks (none allowed).
    ``{kind: True to compile}``."""
    if device == "cuda":
        for kind in batches:
            step = new_trainer(kind, copy.deepcopy(model), False).step
            warm_every_shape(
                lambda batch, step=step: step(*batch),
                batches[kind],
                lambda batch: (len(batch[1]) - 1, int(batch[1].diff().max())),
            )  # (B, S) padded
    # MIN_RUNS: the fewest timed runs choose reads
    probe_steps = warmup + (3 if quick else MIN_RUNS)
    torch._dynamo.reset()  # the counts start here
    compile_ = {}
    for kind in batches:
        probe = {
            mode: new_trainer(kind, copy.deepcopy(model), mode == "compiled")
            for mode in ("eager", "compiled")
        }
        timers = {mode: StepTimer() for mode in probe}
        for tokens, offsets in batches[kind][:probe_steps]:
            for mode, trainer in probe.items():
                with timers[mode].step(len(tokens)):
                    trainer.step(tokens, offsets)
        # counted since the reset
        graphs, breaks = sum(timers["compiled"].graphs), sum(timers["compiled"].breaks)
        new = f"{graphs} new graph{'s' * (graphs != 1)}"
        new += "" if graphs else " (an earlier trainer's, reused)"
        print(f"compiled trainer {kind}: {new} for {probe_steps} steps, {breaks} graph breaks")
        assert breaks == 0, f"the compiled {kind} trainer broke its graph"
        per_1k = {mode: timers[mode].per_1k_tokens(warmup) for mode in probe}
        compile_[kind] = choose(per_1k, "eager", f"{kind} trainer (ms per 1k tokens)") == "compiled"
    return compile_


def train_side_by_side(trainers, batches, steps, warmup):
    """Every trainer's ``steps`` steps, one step each in turn, each timed.
    Raises ``AssertionError`` if a graph is compiled after the first
    ``warmup`` steps. ``{kind: StepTimer}``."""
    timers = {kind: StepTimer() for kind in trainers}
    for step_i in range(steps):
        for kind, trainer in trainers.items():
            tokens, offsets = batches[kind][step_i]
            with timers[kind].step(len(tokens)):
                trainer.step(tokens, offsets)
    for kind, timer in timers.items():
        assert sum(timer.graphs[warmup:]) == 0, (
            f"{kind}: a graph was compiled inside the timed steps"
        )
    return timers


def print_training_speed(timers, batches, work, warmup):
    """Print the packed trainer's throughput against each padded trainer's,
    each beside its work bound (from that trainer's own batches), and the
    median step per 1k real tokens, each padded one within or outside the noise."""

    def lengths_of(name):  # the sequence lengths of each timed step of trainer ``name``
        return [o.diff().cpu() for _, o in batches[name][warmup:]]

    packed_work = work_per_token(lengths_of("packed"), work)
    bound = {
        kind: work_per_token(lengths_of(kind), work, padded=True) / packed_work
        for kind in ("naive", "grouped")
    }
    packed_speed = timers["packed"].tokens_per_s(warmup)
    for kind, label in (
        ("naive", "training"),
        ("grouped", "training against length-grouped padding"),
    ):
        speed = timers[kind].tokens_per_s(warmup)
        print(throughput_line(label, packed_speed, speed, bound[kind]))
    per_1k = {kind: timer.per_1k_tokens(warmup) for kind, timer in timers.items()}
    noise = {
        k: "outside" if outside_noise(per_1k["packed"], per_1k[k]) else "within" for k in bound
    }
    print(
        f"median step per 1k real tokens: packed {per_1k['packed'].median_ms:.0f} ms, naive "
        f"{per_1k['naive'].median_ms:.0f} ms ({noise['naive']} the noise),\nlength-grouped "
        f"{per_1k['grouped'].median_ms:.0f} ms ({noise['grouped']} the noise)"
    )


def check_learned(losses, vocab_size):
    """Raise ``AssertionError`` unless each trainer's last five losses average
    below 70% of a uniform guess over ``vocab_size`` tokens; print their spread."""
    uniform = math.log(vocab_size)
    for name, trained in losses.items():
        last = np.array(trained[-5:])
        assert last.mean() < 0.7 * uniform, (
            f"{name} did not learn: {trained[0]:.3f} -> {last.mean():.3f}"
        )
        print(f"{name:8s} last five losses {last.mean():.3f} +- {last.std():.3f}")


def plot_training(timers, losses, warmup, device):
    """The figure of each trainer's loss against its measured seconds of
    training, its throughput in the legend."""
    import matplotlib.pyplot as plt

    plt.rcParams.update(FIGURE_STYLE)
    _, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for (kind, timer), style in zip(timers.items(), ("-o", "--s", ":^")):
        ax.plot(
            np.cumsum(timer.seconds),
            losses[kind],
            style,
            markevery=max(1, len(losses[kind]) // 8),
            lw=2,
            label=f"{kind}, {timer.tokens_per_s(warmup):.0f} real tokens/s",
        )
    ax.set(
        xlabel="seconds of training (measured)",
        ylabel="training loss",
        title=f"Same documents, three trainers ({device})",
    )
    ax.legend()
    plt.show()


@torch.no_grad()
def prefill_padded(model, prompts, offsets, cache):
    """The same prompts left-padded to (B, S) into ``cache``, with a mask that
    also hides the padding: the logits of each prompt's last token (B, vocab)."""
    lengths = offsets.diff()
    S, pad = int(lengths.max()), int(lengths.max()) - lengths  # (B,) padding columns on the left
    seq, pos = token_index(offsets)
    ids = torch.zeros(len(lengths), S, dtype=torch.long, device=prompts.device)
    ids[seq, pad[seq] + pos] = prompts
    column = torch.arange(S, device=prompts.device)
    valid = column >= pad[:, None]  # (B, S)
    causal = column[:, None] >= column
    padding = ~valid[:, :, None] & (column[:, None] == column)  # a padding row sees itself
    mask = (causal & valid[:, None, :]) | padding  # (B, S, S)
    layout = PaddedLayout(mask[:, None], cache, 0)
    return model(ids, (column - pad[:, None]).clamp(min=0), layout)[:, -1]
