"""The GPT page's training paths (issue 26): the fixed-length rows layout
compiles a training step whole, one graph with no graph break, and computes
what the packed step computes; so does the packed layout, ``ragged_attention``
with the batch's plan, on every backend that trains here (issue 32); the
document stream cut into rows keeps every boundary; the work per token of a
padded trainer counts its own batches. The GPT page itself (issue 35): its
sizes fit the corpus, and its batching takes what the corpus holds, in as
many steps for every trainer."""

from __future__ import annotations

import ast
import types

import pytest
import torch
import torch.nn.functional as F

from page_code import run_page
from sitebuild import REPO
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


# --- the GPT page (tutorials/packed_gpt_training.py), through its own code -------

PAGE = REPO / "tutorials" / "packed_gpt_training.py"


def _page_sizes():
    """The page's SIZES literal, and the keywords of its docstring_corpus call."""
    tree = ast.parse(PAGE.read_text())
    node = next(n.value for n in tree.body
                if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "SIZES" for t in n.targets))
    sizes = eval(compile(ast.Expression(node), str(PAGE), "eval"), {"__builtins__": {}, "dict": dict})  # literals
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "docstring_corpus")
    return sizes, {k.arg: k.value for k in call.keywords}


@pytest.fixture(scope="module")
def whole_corpus():
    sizes, keywords = _page_sizes()
    min_chars = ast.literal_eval(keywords["min_chars"])
    return tk.docstring_corpus(min_chars=min_chars, limit=None)[0]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_the_gpt_pages_sizes_ask_no_more_tokens_than_the_corpus_holds(whole_corpus, device, quick):
    """Issue 35: at full size on CUDA the page asked for 3.28 M tokens of a
    corpus of 0.73 M. Each device's ``train_tokens`` (whole steps) must fit
    in the documents it asks for (``corpus_documents``, None: all), less the
    held-out prompts, counted as the longest documents."""
    sizes, keywords = _page_sizes()
    assert ast.unparse(keywords["limit"]) == "S.corpus_documents", "the page reads as many documents as it says"
    s = tk.page_sizes(sizes, device, quick)
    step = s["rows"] * s["model"]["max_seq_len"]
    assert s["train_tokens"] % step == 0, f"train_tokens {s['train_tokens']} is not whole steps of {step} tokens"
    documents = whole_corpus[:s["corpus_documents"]]
    held_out = sum(sorted(map(len, documents))[-s["prompts"]:])
    room = sum(map(len, documents)) - held_out
    assert s["train_tokens"] <= room, (f"{device}: train_tokens {s['train_tokens']:,} but the "
                                       f"{len(documents)} documents hold {room:,} tokens to train on")


@pytest.mark.parametrize("asked", [10**7, 5 * 512], ids=["more than the corpus", "less"])
def test_the_gpt_page_trains_on_what_the_corpus_holds_in_as_many_padded_steps(asked, capsys):
    """Issue 35 (the naive trainer read one document past the end when the
    rows asked for more tokens than the corpus held) and issue 32 (the
    padded trainers made fewer steps than the packed one): the page's own
    batching, on a small corpus, takes whole steps the corpus holds, says
    when it holds fewer than asked, and gives every trainer as many steps,
    the padded ones the documents the rows touch, but for fewer than a step's
    worth."""
    sizes = types.SimpleNamespace(corpus_documents=60, prompts=4, rows=2, train_tokens=asked)
    page = run_page(PAGE, dict(S=sizes, setup=types.SimpleNamespace(seed=0), ROW_LEN=256, DEVICE="cpu"),
                    start="docs", stop="batches")
    out = capsys.readouterr().out
    steps, corpus = page["STEPS"], len(page["stream_tokens"])
    assert 0 < steps * 512 <= min(asked, corpus) < (steps + 1) * 512
    assert ("the corpus holds fewer" in out) == (asked > corpus), out
    assert {len(b) for b in page["batches"].values()} == {steps}, "every trainer makes as many steps"
    assert all(len(t) == 512 for t, _ in page["batches"]["packed"])
    n_docs = page["n_docs"]
    assert n_docs <= len(page["stream_offsets"]) - 1
    assert int(page["stream_offsets"][n_docs - 1]) < steps * 512 <= int(page["stream_offsets"][n_docs])
    docs = {name: sum(len(o) - 1 for _, o in page["batches"][name]) for name in ("naive", "grouped")}
    assert docs["naive"] == docs["grouped"] == steps * page["B"], docs
    assert n_docs - steps < steps * page["B"] < n_docs + steps, "the documents the rows touch, but for a few"


def test_a_plan_that_holds_lengths_compiles_per_batch_and_a_flex_plan_once():
    """What the GPT page says of its compiled packed trainer: with a plan on
    the loop backend (lengths as Python ints) a compiled model compiles a
    graph for every batch of new lengths; with a flex plan (a ``BlockMask``
    of one shape for a fixed token count) it compiles one graph for all."""
    torch.manual_seed(0)
    cfg = tk.GPTConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=128)
    model = tk.GPT(cfg).eval()
    tokens = torch.randint(0, 64, (128,))
    graphs = {}
    for backend in ("loop", "flex"):
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, dynamic=False)
        with torch.no_grad(), tk.compile_counter() as count:
            for lengths in ([20, 44, 64], [100, 28]):  # 128 tokens each, in other documents
                offsets = tk.offsets_from_lengths(lengths)
                compiled(tokens, tk.token_index(offsets)[1],
                         tk.PackedLayout(tk.plan_batch(offsets, backend=backend, is_causal=True)))
        assert count.breaks == 0, str(count)
        graphs[backend] = count.graphs
    torch._dynamo.reset()
    assert graphs == {"loop": 2, "flex": 1}, graphs
