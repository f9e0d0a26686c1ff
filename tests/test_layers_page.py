"""The training page of the ragged transformer
(tutorials/ragged_transformer_training.py), through its own code (issue 35): its warm-up runs the very training step
it warms, in that step's dtype and autocast; and its benchmark transformer
is checked against ``torch.nn`` layer by layer, because a deep
``bfloat16`` transformer misses the dtype's tolerance as a whole while
every layer meets it."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn as nn

from page_code import run_page
from sitebuild import REPO
from toolkit_api import tk

PAGE = REPO / "tutorials" / "ragged_transformer_training.py"
SEEN = []  # (phase, autocast enabled, autocast dtype) of every forward call of a Recorder


class Recorder(nn.Module):
    """A stand-in for a model of the page: notes the autocast it runs under
    (in a list that ``copy.deepcopy`` does not copy), returns logits and targets."""

    phase = "warm-up"

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 5)

    def forward(self, batch):
        SEEN.append((Recorder.phase, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        n = len(batch["tgt_in"])
        return self.linear(torch.ones(n, 4)), torch.ones(n, dtype=torch.long)


def _batch(n):
    offsets = tk.offsets_from_lengths([n, 2])
    return dict(src=torch.zeros(n + 2, dtype=torch.long), src_offsets=offsets,
                tgt_in=torch.zeros(n + 2, dtype=torch.long), tgt_offsets=offsets)


def test_the_warm_up_runs_the_timed_step_in_its_dtype_and_autocast():
    """Issue 35: the warm-up ran the float32 model without autocast while the
    backends were chosen in bfloat16 (on CUDA, varlen then refuses). Here
    the page's warm-up statement and its timed loop run two recording
    models in bfloat16 on the CPU: every forward call of the warm-up must
    run under the autocast of the timed steps."""
    SEEN.clear()
    namespace = dict(DEVICE="cpu", DTYPE=torch.bfloat16, PAD=0, WARM_SHAPES=True, S=types.SimpleNamespace(lr=1e-3),
                     TRAIN={"steps": 8}, setup=types.SimpleNamespace(seed=0),
                     padded_model=Recorder(), ragged_model=Recorder(), batches=[_batch(n) for n in (3, 5, 3, 7)])
    Recorder.phase = "warm-up"
    run_page(PAGE, namespace, defs=("Run",), calling="warm_every_shape")
    Recorder.phase = "timed"
    run_page(PAGE, namespace, start="losses", stop="timers", calling="step")
    warm = {(on, dtype) for phase, on, dtype in SEEN if phase == "warm-up"}
    timed = {(on, dtype) for phase, on, dtype in SEEN if phase == "timed"}
    assert sum(phase == "warm-up" for phase, *_ in SEEN) == 2 * 3, f"one warm-up step per shape and model: {SEEN}"
    assert timed == {(True, torch.bfloat16)}, f"the timed steps: {timed}"
    assert warm == timed, f"the warm-up ran under {warm}, the steps it warms under {timed}"


def test_a_deep_bfloat16_transformer_meets_the_tolerance_layer_by_layer_not_as_a_whole():
    """Issue 35: 12 bfloat16 layers were checked against float32 at the
    tolerance of one. The page's ``check_layers`` passes on a deeper one
    (16 + 16 layers), whose whole output misses that tolerance."""
    # the page's imports (the layers, torch.nn's reference) and its check_layers
    page = run_page(PAGE, {"DEVICE": "cpu"}, defs=("check_layers",))
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    src, src_off = tk.ragged_batch(rng, 16, 64, max_len=128, dtype=torch.bfloat16)
    tgt, tgt_off = tk.ragged_batch(rng, 16, 64, max_len=128, dtype=torch.bfloat16)
    (src_pad, src_valid), (tgt_pad, tgt_valid) = tk.to_padded(src, src_off), tk.to_padded(tgt, tgt_off)
    kw = dict(dim_feedforward=128, dropout=0.0)
    reference = page["make_nn_transformer"](64, 4, 16, 16, **kw)
    ours = page["load_from_nn"](page["Transformer"](64, 4, 16, 16, **kw), reference).to(torch.bfloat16)
    plans = page["plan_transformer"](src_off, tgt_off)

    def run_reference():
        return page["nn_transformer"](reference, tgt_pad.float(), tgt_valid, src_pad.float(), src_valid,
                                      mask_tgt_padding=False)

    assert page["check_layers"](reference, ours, plans, src_off, tgt_off, run_reference) == 32
    with torch.no_grad(), pytest.raises(AssertionError, match="Mismatched elements"):
        torch.testing.assert_close(ours(src, tgt, plans).float(), run_reference()[tgt_valid],
                                   **tk.tolerances(torch.bfloat16))
