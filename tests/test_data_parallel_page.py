"""The data-parallel page (tutorials/data_parallel_packed_training.py) through
the toolkit functions it runs: the docstring corpus, the two ways of filling
a micro-batch, micro-batches dealt to the ranks and their imbalance, the
three packing checks failing on the wrong variants (and ``failure_message``
refusing a check that passes), and the two-rank step (DDP, FSDP2;
torch.distributed.run over gloo, tiny sizes) matching one process, and
failing to when the count is not reduced; a failing rank's own error shown;
the step times read from the ranks' reports; the step compiled with
``fullgraph=True`` (no break, and an error when a break or a host sync is
put back), and the rows layout compiling a token budget once."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from sitebuild import REPO
from toolkit_api import MODULES, tk

PAGE = REPO / "tutorials" / "data_parallel_packed_training.py"
CORPUS_LINE = re.compile(r"corpus: (\d+) documents from (.+), lengths min (\d+), median (\d+), max (\d+)")
TINY = dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=512)


@pytest.fixture(scope="module")
def corpus():
    documents, source = tk.docstring_corpus(min_chars=200, limit=3000)
    return documents, source


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tk.GPT(tk.GPTConfig(**TINY))


def test_the_corpus_is_real_deterministic_and_its_line_has_the_page_form(corpus):
    documents, source = corpus
    assert len(documents) >= 1000 and all(isinstance(d, bytes) and len(d) >= 200 for d in documents)
    assert len(set(documents)) == len(documents), "a docstring is kept once"
    assert tk.docstring_corpus(min_chars=200, limit=3000) == (documents, source), "not deterministic"
    assert "/" not in source, f"the source names a machine path: {source}"
    lengths = sorted(len(d) for d in documents)
    line = (f"corpus: {len(documents)} documents from {source}, lengths min {lengths[0]}, "
            f"median {lengths[len(lengths) // 2]}, max {lengths[-1]}")
    match = CORPUS_LINE.fullmatch(line)
    assert match and int(match[1]) >= 1000, line
    # the page prints this very line
    assert 'f"corpus: {len(documents)} documents from {source}, lengths min' in PAGE.read_text()


def test_a_token_budget_cuts_the_stream_and_keeps_every_boundary(corpus):
    tokens, offsets = tk.pack_documents(corpus[0][:60], max_len=300)
    budget = 256
    batches = tk.split_by_token_budget(tokens, offsets, budget)
    assert batches and all(len(t) == budget and o[0] == 0 and o[-1] == budget for t, o in batches)
    joined, joined_offsets = tk.concat_batches(batches)
    assert torch.equal(joined, tokens[: len(joined)])
    inside = offsets[offsets < len(joined)]
    assert set(inside.tolist()) <= set(joined_offsets.tolist()), "a document boundary was lost"
    by_docs = tk.split_by_documents(tokens, offsets, 4)
    assert torch.equal(tk.concat_batches(by_docs)[0], tokens)
    assert len({len(t) for t, _ in by_docs}) > 1, "whole documents give uneven micro-batches"
    carried = tk.split_carrying_documents(tokens, offsets, budget)
    assert all(len(t) <= budget and (o.diff() > 0).all() for t, o in carried)
    assert sum(len(o) - 1 for _, o in carried) == len(offsets) - 1, "every document, whole, once"


def _batch(*lengths):
    """A packed micro-batch of documents of these lengths: (tokens, offsets)."""
    return torch.zeros(sum(lengths), dtype=torch.int64), tk.offsets_from_lengths(list(lengths))


def test_micro_batches_are_dealt_to_the_ranks_in_turn_and_the_imbalance_counts_tokens():
    micro = [_batch(n) for n in (10, 20, 30, 40, 50, 60, 70, 80, 90)]  # 9: one left over
    steps = tk.deal_to_ranks(micro, 2, 2)
    assert len(steps) == 2 and [len(rank) for step in steps for rank in step] == [2, 2, 2, 2]
    assert [[len(t) for t, _ in rank] for rank in steps[0]] == [[10, 30], [20, 40]]  # in turn, as a sampler
    assert tk.rank_tokens(steps).tolist() == [[40, 60], [120, 140]]
    assert tk.token_imbalance(steps) == pytest.approx((60 + 140) / (50 + 130))
    assert tk.token_imbalance(tk.deal_to_ranks([_batch(8, 8)] * 4, 2, 2)) == 1.0
    load = tk.step_load(steps)
    assert load["tokens"] == (100 + 260) / 2 and load["imbalance"] == tk.token_imbalance(steps)
    assert load["pairs"] == sum(n * (n + 1) / 2 for n in range(10, 90, 10)) / 2  # causal, a sequence each
    with pytest.raises(ValueError, match=r"no tokens in 0 steps: deal_to_ranks had fewer micro-batches"):
        tk.token_imbalance(tk.deal_to_ranks(micro[:3], 2, 2))
    with pytest.raises(ValueError, match=r"world \(0\) and per_rank \(2\) must be at least 1"):
        tk.deal_to_ranks(micro, 0, 2)


def test_failure_message_wraps_the_failure_and_refuses_a_check_that_passes():
    def check(x):
        assert x, "the value is false: " + "word " * 40

    message = tk.failure_message(check, False, width=60)
    lines = message.splitlines()
    assert lines[0].startswith("  the value is false: word") and all(len(line) <= 60 for line in lines)
    assert len(lines) > 1 and all(line.startswith("    ") for line in lines[1:])
    with pytest.raises(AssertionError, match="check accepted the wrong variant"):
        tk.failure_message(check, True)


def _message(check, *args):
    with pytest.raises(AssertionError) as failure:
        check(*args)
    return str(failure.value)


def test_documents_apart_passes_and_fails_when_the_pack_is_one_sequence(model, corpus):
    doc = corpus[0][0][:48]
    assert tk.check_documents_apart(model, doc, tk.pack_documents) < 1e-5

    def as_one(docs):
        t, _ = tk.pack_documents(docs)
        return t, torch.tensor([0, len(t)])

    assert "two identical documents in one pack give different logits" in _message(
        tk.check_documents_apart, model, doc, as_one)


def test_targets_check_fails_when_the_whole_pack_is_shifted(corpus):
    tokens, offsets = tk.pack_documents(corpus[0][:3], max_len=20)
    tk.check_targets(tokens, tk.document_targets(tokens, offsets), offsets)
    message = _message(tk.check_targets, tokens, tokens.roll(-1), offsets)
    assert "the last token of document 0 (token 19)" in message and "the next document" in message


def test_positions_check_fails_when_positions_do_not_restart(corpus):
    tokens, offsets = tk.pack_documents(corpus[0][:3], max_len=20)
    tk.check_positions(tk.token_index(offsets)[1], offsets)
    message = _message(tk.check_positions, torch.arange(len(tokens)), offsets)
    assert message.startswith("token 20 (document 1, which starts at token 20) has position 20")


def _grad_setup(corpus, model):
    by_length = sorted(corpus[0][:40], key=len)  # rank 0 the shortest, rank 1 longer ones
    tokens, offsets = tk.pack_documents(by_length[:6] + by_length[-6:], max_len=400)
    micro = tk.split_by_documents(tokens, offsets, 2)  # 6 micro-batches, uneven targets
    per_rank = [micro[:3], micro[3:]]
    counts = [sum(int((tk.document_targets(t, o) != -100).sum()) for t, o in r) for r in per_rank]
    assert max(counts) > 1.1 * min(counts), f"the ranks' target counts are too even: {counts}"
    return per_rank, tk.one_process_gradients(model, micro)


def test_the_mean_of_micro_batch_means_is_not_the_step_loss(corpus, model):
    per_rank, reference = _grad_setup(corpus, model)
    micro = [mb for rank in per_rank for mb in rank]
    model.zero_grad(set_to_none=True)
    tk.data_parallel_step(model, micro)  # one process: the right loss
    gap = tk.check_same_gradients({n: p.grad for n, p in model.named_parameters()}, reference)
    assert gap < 1e-5
    model.zero_grad(set_to_none=True)
    torch.stack([torch.div(*tk.token_loss_sum(model, t, o)) for t, o in micro]).mean().backward()
    with pytest.raises(AssertionError, match="differ from one process on the whole batch"):
        tk.check_same_gradients({n: p.grad for n, p in model.named_parameters()}, reference)
    model.zero_grad(set_to_none=True)


def test_two_ranks_match_one_process_and_fail_when_the_count_is_not_reduced(corpus, model):
    """torch.distributed.run, 2 ranks over gloo: DDP and FSDP2 within 1e-4 of
    one process; DDP whose ranks each divide by their own count, not."""
    per_rank, reference = _grad_setup(corpus, model)
    runs = [tk.GradientRun("ddp", "ddp"), tk.GradientRun("fsdp", "fsdp"),
            tk.GradientRun("unreduced", "ddp", reduce_count=False)]
    job = tk.DataParallelJob(backend="gloo", config=TINY, grad_runs=runs)
    data = {"init": model.state_dict(), "grad_batches": per_rank,
            "time_batches": {"token budget": [per_rank]}}
    reports, grads = tk.run_data_parallel(job, data, 2, timeout=120)
    assert [r["rank"] for r in reports] == [0, 1] and {r["world_size"] for r in reports} == {2}
    assert all(len(r["timing"]["token budget"]["seconds"]) == 1 for r in reports)
    step_ms = tk.step_times_ms(reports, "token budget")
    assert len(step_ms) == 1 and step_ms[0] == 1e3 * max(r["timing"]["token budget"]["seconds"][0] for r in reports)
    assert tk.step_times_ms(reports, "token budget", skip=1) == []
    assert tk.check_same_gradients(grads["ddp"], reference) < 1e-4
    assert tk.check_same_gradients(grads["fsdp"], reference) < 1e-4
    with pytest.raises(AssertionError, match=r"differ from one process on the whole batch: max difference"):
        tk.check_same_gradients(grads["unreduced"], reference)


def test_a_failing_rank_is_reported_with_its_last_lines(model):
    job = tk.DataParallelJob(backend="gloo", config={**TINY, "dim": 30})
    with pytest.raises(RuntimeError, match=r"(?s)2 ranks on gloo failed \(exit 1, rank\d.*size mismatch"):
        tk.run_data_parallel(job, {"init": model.state_dict(), "grad_batches": [[], []],
                                   "time_batches": {"x": [[[], []]]}}, 2, timeout=120)


def test_a_rank_that_fails_before_its_traceback_file_is_reported_from_its_own_stderr(model):
    """A rank that stops before its ``try`` (here ``torch.load`` refuses the
    data) writes no ``rank<R>.error``: the launcher shows the end of that
    rank's own standard error (``torchrun --redirects 3``), not only the
    launcher's summary."""
    import datetime

    job = tk.DataParallelJob(backend="gloo", config=TINY)
    data = {"init": model.state_dict(), "when": datetime.date(2026, 12, 5), "grad_batches": [[], []],
            "time_batches": {}}
    with pytest.raises(RuntimeError, match=r"(?s)2 ranks on gloo failed \(exit 1, rank0, rank1\).*--- rank0:\n"
                                           r"Traceback.*data_parallel_worker.*Unsupported global"):
        tk.run_data_parallel(job, data, 2, timeout=120)


def test_gpu_check_summarizes_every_data_parallel_line():
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check

    records = [{"kind": "data_parallel", "label": name, "world_size": n, "max_difference": d,
                "line": f"data-parallel step: world size {n}, gradient max difference to one process {d:.1e}"}
               for name, n, d in (("DDP", 2, 2.2e-08), ("FSDP2", 2, 3.1e-08), ("DDP", 1, 4.0e-07))]
    line = gpu_check.summarize("data_parallel_packed_training", True, 61.0, records)
    assert line.endswith("| data-parallel gradients: world size 2 2.2e-08, world size 2 3.1e-08, "
                         "world size 1 4.0e-07"), line


# --- the compiled step (issue 32) ------------------------------------------------------

def _budget_micro_batches(corpus, n=3, budget=192):
    tokens, offsets = tk.pack_documents(corpus[0][:40], max_len=150)
    return tk.split_by_token_budget(tokens, offsets, budget)[:n]


def _host_sync(attend):
    def synced(q, k, v, plan, **kw):  # a length read back from the device, and used
        return attend(q[: int(plan.q_offsets[-1])], k, v, plan, **kw)
    return synced


@pytest.mark.parametrize("fault", [None, "host sync", "compiler.disable"])
def test_the_data_parallel_step_compiles_with_fullgraph_and_fails_when_a_break_is_put_back(
        corpus, model, monkeypatch, fault):
    """``data_parallel_step`` (``token_loss_sum``: autocast, the layout and
    its plan built before the model runs) on a model compiled with
    ``fullgraph=True``: one graph per micro-batch shape and no break, the eager
    step's gradients; a host sync or a ``compiler.disable`` put back around
    ``ragged_attention`` makes the same step fail."""
    layouts = MODULES["ragged_toolkit.layouts"]
    if fault == "host sync":
        monkeypatch.setattr(layouts, "ragged_attention", _host_sync(layouts.ragged_attention))
    elif fault == "compiler.disable":
        monkeypatch.setattr(layouts, "ragged_attention", torch.compiler.disable(layouts.ragged_attention))
    micro = [_budget_micro_batches(corpus, n=1)[0]] * 2  # one shape, one set of lengths
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    model.zero_grad(set_to_none=True)
    try:
        if fault is not None:
            with pytest.raises(torch._dynamo.exc.TorchDynamoException):  # Unsupported, or a data-dependent guard
                tk.data_parallel_step(compiled, micro, backend="loop", dtype=torch.bfloat16)
            return
        with tk.compile_counter() as count:
            tk.data_parallel_step(compiled, micro, backend="loop", dtype=torch.bfloat16)
        assert count.breaks == 0 and count.graphs == 1 and not count.fallbacks, str(count)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        tk.data_parallel_step(model, micro, backend="loop", dtype=torch.bfloat16)
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, atol=2e-2, rtol=2e-2, msg=lambda m, n=n: f"{n}: {m}")
    finally:
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()


def test_a_token_budget_compiles_the_rows_layout_once_and_fixed_documents_per_token_count(corpus, model):
    """The page's claim, through ``compiled_graphs``: with the rows layout
    (the micro-batch as one row, its mask built outside), static shapes
    compile one graph for every micro-batch of a budget and one per token
    count for fixed documents; symbolic sizes one for both."""
    tokens, offsets = tk.pack_documents(corpus[0][:40], max_len=400)  # documents of 200 to 400 tokens
    schemes = {"budget": tk.split_by_token_budget(tokens, offsets, 192)[:3],
               "documents": tk.split_by_documents(tokens, offsets, 2)[:3]}
    sizes = len({len(t) for t, _ in schemes["documents"]})
    assert sizes > 1

    def rows(t, o):
        return tk.PackedRows.from_offsets(o, len(t))

    for dynamic, expected in ((False, {"budget": 1, "documents": sizes}), (True, {"budget": 1, "documents": 1})):
        for name, micro in schemes.items():
            count = tk.compiled_graphs(model, micro, rows, dynamic=dynamic)
            assert (count.graphs, count.breaks, count.fallbacks) == (expected[name], 0, []), (name, dynamic, str(count))
    assert all(p.grad is None for p in model.parameters()), "compiled_graphs drops the gradients"


def test_compiled_graphs_follows_the_sequences_with_the_loop_plan(corpus, model):
    """The loop backend's plan unrolls a call per sequence into the graph:
    micro-batches of one token count but other numbers of sequences compile
    again."""
    tokens, offsets = tk.pack_documents(corpus[0][:40], max_len=400)
    micro = tk.split_by_token_budget(tokens, offsets, 192)[:4]
    sequences = {len(o) - 1 for _, o in micro}
    count = tk.compiled_graphs(model, micro, lambda t, o: tk.PackedLayout.of(o, "loop"), dynamic=False)
    assert count.breaks == 0 and count.graphs >= len(sequences), (sequences, str(count))
