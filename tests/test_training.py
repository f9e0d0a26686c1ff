"""The GPT page's training paths (issue 26): the fixed-length rows layout
compiles a training step whole, one graph with no graph break, and computes
what the packed step computes; so does the packed layout, ``ragged_attention``
with the batch's plan, on every backend that trains here (issue 32); the
document stream cut into rows keeps every boundary; the work per token of a
padded trainer counts its own batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from toolkit_api import tk


def _step(model, tokens, offsets, layout):
    logits = model(tokens, tk.token_index(offsets)[1], layout)
    loss = F.cross_entropy(logits, tk.document_targets(tokens, offsets))
    loss.backward()
    return loss


def test_the_rows_layout_compiles_a_training_step_into_one_graph_with_no_break():
    torch.manual_seed(0)
    cfg = tk.GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=64)
    model = tk.GPT(cfg)
    documents = [bytes(range(65, 65 + n)) for n in (30, 50, 7, 90, 12, 40, 25)]
    tokens, offsets = tk.pack_documents(documents)
    rows = tk.split_by_token_budget(tokens % 64, offsets, 64)[:2]
    step_tokens, step_offsets = tk.concat_batches(rows)  # 2 rows of 64 tokens, a boundary at 64
    assert 64 in step_offsets.tolist()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)  # a graph break is an error
    with tk.compile_counter() as count:
        for _ in range(2):  # the same shape again: no new graph
            model.zero_grad(set_to_none=True)
            loss = _step(compiled, step_tokens, step_offsets, tk.PackedRows.from_offsets(step_offsets, 64))
    assert count.breaks == 0 and count.graphs == 1, str(count)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    reference = _step(model, step_tokens, step_offsets, tk.PackedLayout.of(step_offsets, "loop"))
    torch.testing.assert_close(loss, reference)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("backend", ["loop", "bucketed", "padded"])
def test_the_packed_layout_compiles_a_training_step_with_the_plan_and_no_break(backend):
    """``ragged_attention`` given the batch's plan reads nothing back from the
    device and is not hidden from the compiler: ``fullgraph=True`` compiles
    the whole step (a graph break, a ``compiler.disable`` or a host sync whose
    value is used, such as ``int(offsets[-1])``, put back into it is an
    error here), and the compiled
    step computes the eager one's loss and gradients."""
    torch.manual_seed(0)
    cfg = tk.GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=64)
    model = tk.GPT(cfg)
    offsets = tk.offsets_from_lengths([20, 5, 39])
    tokens = torch.randint(0, 64, (64,))
    layout = tk.PackedLayout(tk.plan_batch(offsets, backend=backend, is_causal=True))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with tk.compile_counter() as count:
        loss = _step(compiled, tokens, offsets, layout)
    assert count.breaks == 0 and count.graphs == 1, str(count)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss, _step(model, tokens, offsets, tk.PackedLayout.of(offsets, "loop")))
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    torch._dynamo.reset()


def test_flex_with_the_plan_compiles_inside_a_model_forward():
    """FlexAttention's ``BlockMask`` lives in the plan: a compiled forward
    (no backward on CPU) takes it with no graph break."""
    torch.manual_seed(0)
    cfg = tk.GPTConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=64)
    model = tk.GPT(cfg).eval()
    offsets = tk.offsets_from_lengths([20, 44])
    tokens = torch.randint(0, 64, (64,))
    positions = tk.token_index(offsets)[1]
    torch._dynamo.reset()
    with torch.no_grad(), tk.compile_counter() as count:
        got = torch.compile(model, fullgraph=True)(tokens, positions, tk.PackedLayout.of(offsets, "flex"))
    assert count.breaks == 0, str(count)
    with torch.no_grad():
        torch.testing.assert_close(got, model(tokens, positions, tk.PackedLayout.of(offsets, "loop")),
                                   atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()


def test_work_per_token_counts_each_trainers_own_batches():
    # packed: causal pairs of each sequence; padded: each batch to its longest
    pairs, tokens = tk.Work(per_token=0.0, per_pair=1.0), tk.Work(per_token=1.0, per_pair=0.0)
    packed = tk.work_per_token([torch.tensor([1, 3])], pairs)
    assert packed == pytest.approx((1 + 6) / 4)
    padded = tk.work_per_token([torch.tensor([1, 3])], pairs, padded=True)
    assert padded == pytest.approx((6 + 6) / 4)
    grouped = tk.work_per_token([torch.tensor([1]), torch.tensor([3])], tokens, padded=True)
    assert grouped == pytest.approx(1.0), "batches of one length carry no padding"
    masked = tk.work_per_token([torch.tensor([1, 3])], pairs, padded=True, causal=False)
    assert masked == pytest.approx((9 + 9) / 4)
