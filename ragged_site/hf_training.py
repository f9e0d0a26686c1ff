"""The machinery of the ``transformers`` page (``hf_packed_training``): its
documents, its trainers taking turns, its checks of the packed model's
losses and gradients against the padded one, and its two figures.
Matplotlib is imported when a figure is drawn; ``transformers`` is not
imported here."""

import copy

import numpy as np
import torch

from .figures import draw_floor
from .measuring.timing import StepTimer, warm_every_shape

__all__ = [
    "shifted_zipf_documents",
    "train_taking_turns",
    "check_close",
    "check_gradients",
    "check_losses",
    "draw_logit_gaps",
    "draw_training",
]


def shifted_zipf_documents(rng, lengths, vocab):
    """Token ids of one document per length: the first picks a shift, every
    later one is a Zipf(1.5) draw plus that shift (mod ``vocab``)."""
    out = []
    for n in lengths.tolist():
        shift = int(rng.integers(vocab))
        draws = (rng.zipf(1.5, size=n - 1) - 1 + shift) % vocab
        out.append([shift, *draws.tolist()])
    return out


def _real_tokens(batch):
    """The real tokens of a batch: the packed row's, or the padded batch's mask."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return batch["input_ids"].numel()


def train_taking_turns(trainers, batches, make_model, loss_of, *, steps, lr, skip):
    """Train one model per trainer, taking turns step by step, so that a busy
    machine slows all alike. ``trainers``: name -> a dict with ``attention``
    (the model, ``make_model(attention)``) and ``form`` (its batches,
    ``batches[form]``). A step is ``loss_of(run, model, batch)``, backward and
    AdamW's update at ``lr``, timed over the batch's real tokens.
    On CUDA each trainer's step first runs once on every batch shape, on a
    copy of its model: cuDNN builds a plan per new shape. Returns name
    -> the trainer's dict with its ``model``, ``timer``, ``losses`` and
    ``tokens/s`` (after the first ``skip`` steps)."""
    runs = {}
    for name, trainer in trainers.items():
        model = make_model(trainer["attention"]).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        runs[name] = dict(trainer, model=model, optimizer=optimizer, timer=StepTimer(), losses=[])
    for run in runs.values():
        if next(run["model"].parameters()).is_cuda:
            warm = copy.deepcopy(run["model"])
            warm_every_shape(
                lambda b, run=run, m=warm: loss_of(run, m, b).backward(),
                batches[run["form"]],
                lambda b: tuple(b["input_ids"].shape),
            )
    for i in range(steps):
        for run in runs.values():
            batch = batches[run["form"]][i]
            with run["timer"].step(_real_tokens(batch)):
                loss = loss_of(run, run["model"], batch)
                run["optimizer"].zero_grad(set_to_none=True)
                loss.backward()
                run["optimizer"].step()
            run["losses"].append(loss.item())
    for run in runs.values():
        run["tokens/s"] = run["timer"].tokens_per_s(skip)
    return runs


def check_close(actual, expected, tolerance, what):
    """``torch.testing.assert_close`` within ``tolerance`` (its keyword
    arguments), the message led by ``what``."""
    torch.testing.assert_close(actual, expected, **tolerance, msg=lambda m: f"{what}: {m}")


def check_gradients(model, reference, tolerance):
    """Raise ``AssertionError`` unless every parameter's gradient in ``model``
    is the one in ``reference`` (the same weights) within ``tolerance``;
    returns how many parameter tensors were compared and the largest
    difference."""
    pairs = list(zip(model.named_parameters(), reference.parameters()))
    for (name, p), p_reference in pairs:
        check_close(p.grad, p_reference.grad, tolerance, f"gradient of {name}")
    return len(pairs), max((a.grad - b.grad).abs().max().item() for (_, a), b in pairs)


def check_losses(ragged, padded, dtype, tolerance):
    """Raise ``AssertionError`` unless the ragged trainer's losses are the
    padded one's: in float32 within 1e-3 (relative) at every step; in a
    16-bit dtype the first within ``tolerance``, the means of the last five
    within 5%. Returns the line that says so."""
    ragged, padded = np.array(ragged), np.array(padded)
    if dtype == torch.float32:
        gap = np.max(np.abs(ragged - padded) / padded)
        assert gap < 1e-3, f"the losses drift apart: {gap:.1e}"
        return (
            f"ragged and padded losses agree at every step (largest relative difference {gap:.1e})"
        )
    torch.testing.assert_close(torch.tensor(ragged[0]), torch.tensor(padded[0]), **tolerance)
    last = abs(ragged[-5:].mean() - padded[-5:].mean()) / padded[-5:].mean()
    assert last < 0.05, f"the last five losses differ by {last:.1%} on average"
    return (
        f"first step: losses {ragged[0]:.4f} and {padded[0]:.4f}; last five steps: means "
        f"{ragged[-5:].mean():.4f} and {padded[-5:].mean():.4f} ({last:.1%} apart)"
    )


def draw_logit_gaps(gaps, starts, ours, title):
    """A figure of each implementation's largest logit difference per token
    of the packed row (``gaps``: name -> (T,)), on a log scale (a difference
    at most 1e-9, an exact 0 included, drawn at the floor 1e-9, its dashed
    line in the legend), with a gray line where each document ``starts``;
    the implementation ``ours`` is labelled as ``ragged_attention``."""
    import matplotlib.pyplot as plt

    floor = 1e-9
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for (name, gap), style in zip(gaps.items(), ("-", "--", "-")):
        label = name + " (ragged_attention)" * (name == ours)
        ax.plot(gap.clamp(min=floor).cpu(), style, label=label, lw=1.2)
    draw_floor(ax, floor)
    for start in starts:
        ax.axvline(start, color="0.85", lw=0.6, zorder=0)
    ax.set(
        yscale="log",
        xlabel="token of the packed row (gray: where a document starts)",
        ylabel="largest logit difference",
        title=title,
    )
    ax.legend(loc="center right")
    return fig


def draw_training(runs, device):
    """A figure of the trainers of :func:`train_taking_turns`: each one's
    training loss per step, and its real tokens per second on ``device``.
    A trainer whose ``label`` the page's proof marked ``WRONG`` (it attends
    across documents) is drawn as wrong: its bar hatched and pale,
    labelled with why, and named wrong in the legend of the losses."""
    import matplotlib.pyplot as plt

    wrong = {name for name, run in runs.items() if "WRONG" in run.get("label", "")}
    why = "wrong: attends\nacross documents"
    fig, (ax_loss, ax_speed) = plt.subplots(
        1, 2, figsize=(8, 4.2), layout="constrained", width_ratios=[3, 2]
    )
    for (name, run), style in zip(runs.items(), ("-", "-.", "--", ":", "-.")):
        label = f"{name} (wrong)" if name in wrong else name
        ax_loss.plot(run["losses"], style, label=label, lw=2)
    ax_loss.set(
        xlabel="step", ylabel="training loss (nats per token)", title="Same weights, same documents"
    )
    ax_loss.legend(fontsize=10)
    speeds = [run["tokens/s"] for run in runs.values()]
    bars = ax_speed.barh(list(runs), speeds, color=[f"C{i}" for i in range(len(runs))])
    for bar, name in zip(bars, runs):
        if name in wrong:
            bar.set(hatch="//", alpha=0.35, edgecolor="k")
            ax_speed.text(
                0.02 * max(speeds), bar.get_y() + bar.get_height() / 2, why, va="center", fontsize=9
            )
    ax_speed.invert_yaxis()
    ax_speed.set(xlabel="real tokens/s", title=f"Training speed ({device})")
    return fig
