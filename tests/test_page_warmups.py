"""Issue 41's honest GPU figures, through the pages' own code on the CPU:
the recurrent page's hybrid training meets every shape on both sides
before any timed step, on throwaway copies, through the step it times; the
measuring page times packing with the backend ``default_backend`` picks on
the device, not the per-sequence loop."""

from __future__ import annotations

import ast
import types

import torch
import torch.nn as nn

from page_code import run_page
from sitebuild import REPO
from toolkit_api import tk

RECURRENT = REPO / "tutorials" / "packed_hybrid_model.py"  # the hybrid's training
MEASURING = REPO / "tutorials" / "measuring_ragged_batches.py"
CALLS = []  # (model id, tokens' shape, inside a timed step) of every forward call of a Recorder
TIMING = [False]


class Recorder(nn.Module):
    """A stand-in for the hybrid: notes which copy ran, on what shape, and
    whether a timed step was open; returns logits of the tokens' shape."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 7)

    def forward(self, tokens, positions, layout):
        CALLS.append((id(self), tuple(tokens.shape), TIMING[0]))
        return self.linear(torch.ones(*tokens.shape, 4))


class FlagTimer:
    """``StepTimer``'s ``step`` as the page uses it, marking the timed window."""

    def step(self, tokens):
        timer = self

        class Window:
            def __enter__(self):
                TIMING[0] = True

            def __exit__(self, *exc):
                TIMING[0] = False

        return Window()


def _step(lengths):
    offsets = tk.offsets_from_lengths(lengths)
    return torch.zeros(int(offsets[-1]), dtype=torch.long), offsets


def test_the_hybrid_training_meets_every_shape_on_both_sides_before_any_timed_step(monkeypatch):
    CALLS.clear()
    steps = [_step(n) for n in ([3, 5], [4, 4], [3, 5], [2, 6, 1], [4, 4])]  # 3 shapes, 5 steps
    hybrid = Recorder()
    namespace = dict(DEVICE="cuda", DTYPE=torch.float32, S=types.SimpleNamespace(lr=1e-3), hybrid=hybrid,
                     steps=steps)
    run_page(RECURRENT, namespace, defs=("trainer", "step_shape"))
    monkeypatch.setitem(namespace["train_in_turns"].__globals__, "StepTimer", FlagTimer)
    run_page(RECURRENT, namespace, start="WARMUP", stop="TRAINED")
    assert namespace["WARM_SHAPES"], "on CUDA the page warms every shape"
    warm = [c for c in CALLS if not c[2]]
    timed = [c for c in CALLS if c[2]]
    assert CALLS[:len(warm)] == warm, "a shape was met for the first time inside a timed step"
    assert len(timed) == 2 * len(steps)
    timed_models = {m for m, _, _ in timed}
    assert len(timed_models) == 2 and not timed_models & {m for m, _, _ in warm}, \
        "the warm-up trained a model that is then timed"
    for ndim in (1, 2):  # packed (T,), padded (B, S)
        warm_shapes = {s for _, s, _ in warm if len(s) == ndim}
        timed_shapes = {s for _, s, _ in timed if len(s) == ndim}
        assert timed_shapes and timed_shapes <= warm_shapes, (ndim, warm_shapes, timed_shapes)
    assert len(warm) == 2 * 3, f"one warm-up step per shape and side: {warm}"
    CALLS.clear()
    run_page(RECURRENT, {**namespace, "DEVICE": "cpu"}, start="WARMUP", stop="TRAINED")
    assert CALLS and all(c[2] for c in CALLS), "on a CPU the page warms nothing (no per-shape plans there)"


def test_the_measuring_page_times_packing_with_the_default_backend_of_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100, here
    for device, dtype, want in (("cpu", torch.float32, "loop"), ("cuda", torch.bfloat16, "varlen")):
        namespace = dict(DEVICE=device, DTYPE=dtype, S=types.SimpleNamespace(embed=512, heads=8))
        run_page(MEASURING, namespace, start="PACKED_BACKEND", stop="PACKED_BACKEND")
        assert namespace["PACKED_BACKEND"] == want, (device, namespace["PACKED_BACKEND"])
    calls = [n for n in ast.walk(ast.parse(MEASURING.read_text())) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "plan_batch"]
    backends = {ast.unparse(k.value) for c in calls for k in c.keywords if k.arg == "backend"}
    assert calls and backends == {"PACKED_BACKEND"}, backends
