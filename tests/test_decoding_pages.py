"""What the decoding page and the decision page rely on, without running
them: the toolkit pieces only they use (``compare_backends``'
``plan_per_call`` and ``profile``, ``Table``, ``draw_speedups``,
``generation_work``) do what the pages say. (Their CUDA sizes are checked
with every page's by ``tests/test_cuda_audit.py``.)"""

from __future__ import annotations

import numpy as np
import torch

from toolkit_api import MODULES
from toolkit_api import tk as toolkit


def test_compare_backends_plans_inside_the_call_when_asked(monkeypatch):
    compare = MODULES["ragged_toolkit.measuring.compare"]
    calls = []
    real = compare.plan_batch
    monkeypatch.setattr(compare, "plan_batch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    offsets = toolkit.offsets_from_lengths([3, 1, 4])
    q = torch.randn(8, 2, 16)
    for per_call in (False, True):
        calls.clear()
        results = compare.compare_backends(q, q, q, offsets, is_causal=True, backends=("loop",), min_run_time=0.01,
                                           plan_per_call=per_call, profile=False)
        timing = results["loop"]
        assert isinstance(timing, toolkit.Timing) and timing.kernels == "" and timing.peak_mib != timing.peak_mib
        assert (len(calls) > timing.runs) if per_call else len(calls) == 1, (per_call, len(calls), timing.runs)


def test_table_renders_every_cell_escaped_with_its_label():
    table = toolkit.Table(["job", "chosen"], [["decoding", "loop, 1.00 ms\nkernels: CPU flash x4"], ["a<b", "&"]],
                          css_class="decision-guide")
    html = table._repr_html_()
    assert html.startswith('<table class="figures-table decision-guide">') and html.count("<tr>") == 3
    assert '<td data-label="chosen">loop, 1.00 ms<br>kernels: CPU flash x4</td>' in html
    assert '<th data-label="job">a&lt;b</th>' in html and "&amp;" in html
    assert str(table).splitlines() == ["job       chosen", "decoding  loop, 1.00 ms", "          kernels: CPU flash x4",
                                       "a<b       &"]


def test_draw_speedups_writes_each_cell():
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    speedup = np.array([[1.0, 1.0], [2.5, np.nan], [0.04, 0.5]])
    fig = toolkit.draw_speedups(speedup, ["padded", "a", "b"], ["job 1", "job 2"], [5.0, 2.0], "title")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["1.0x", "1.0x", "2.5x\n(0.50)", "n/a", "0.04x\n(0.01)", "0.50x\n(0.25)"]
    plt.close(fig)


def test_generation_work_counts_what_each_side_computes():
    work = toolkit.Work(per_token=10.0, per_pair=1.0)
    # prompts of 2 and 3 tokens, 3 new tokens each
    cached = 10 * (5 + 2 * 2) + (3 + 6) + (3 + 4) + (4 + 5)  # prefill, then steps seeing 3, 4 and 4, 5 keys
    again = 10 * (2 + 3 + 4 + 3 + 4 + 5) + (3 + 6 + 10 + 6 + 10 + 15)  # the whole history, three times
    assert toolkit.generation_work([2, 3], 3, work) == cached
    assert toolkit.generation_work([2, 3], 3, work, cache=False) == again
