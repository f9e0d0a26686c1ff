"""Packed recurrent layers (``ragged_toolkit.recurrent``) against their
definition: the recurrence token by token, one document at a time, in
float64. Batches hold one-token and empty documents, documents of several
chunks, and boundaries both on and inside chunk edges (chunks of 8 tokens).

Tolerances, each tensor divided by the largest magnitude of its reference
before ``assert_close`` with ``tolerances(dtype)`` (so they hold relative to
the tensor's scale): float32 1e-4 (measured: about 1e-6 on outputs and
states, 1e-5 on gradients); float64 1e-10 for the chunked algorithm itself.
In bfloat16 the recurrence's inputs get ``tolerances(bfloat16)``; the whole
layer is held to the error the definition itself makes from the same
bfloat16 activations (the gated RMS norm of a near-zero head output
magnifies rounding, packed or not), plus 1%.

Planted faults: ``RECURRENT_FAULT=<name>`` plants one of ``FAULTS`` in every
test of this file, to see which tests catch it; ``test_planted_fault_is_caught``
asserts that each one is caught.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from ragged_toolkit import recurrent
from ragged_toolkit.batches import offsets_from_lengths, to_padded
from ragged_site.reference import documents_reference, token_loop
from ragged_site.workloads import sentence_lengths
from ragged_site.page import tolerances

CHUNK = 8
# 0..1 | 1..8 | 8..16 | empty | 16..17 | 17..47 | 47..50 | 50..66 | 66..67 | 67..72: starts on chunk
# edges (8, 16), inside chunks, one-token documents, one of almost four chunks
LENGTHS = [1, 7, 8, 0, 1, 30, 3, 16, 1, 5]
EMBED, HEADS, KEY_HEADS, HEAD_DIM = 32, 4, 2, 8
LAYERS = [recurrent.ScalarDecayLayer, recurrent.GatedDeltaLayer]


# --- planted faults: each one a small patch of the module, never in it -----------------


def _no_reset(mp):
    """The state carried into a chunk reaches every token of it, and leaves
    it, whichever document they belong to."""
    decay = recurrent.chunk_decay
    mp.setattr(recurrent, "chunk_decay", lambda g, doc, pos: (decay(g, doc, pos)[0], g.cumsum(-1).exp()))


def _late_reset(mp):
    """Every document starts one token late: its first token is still the
    previous document's, for the state and the convolution."""
    index = recurrent.token_index

    def late(offsets, total=None):
        shifted = offsets.clone()
        shifted[1:-1] = (shifted[1:-1] + 1).clamp(max=int(offsets[-1]))
        return index(shifted, total)
    mp.setattr(recurrent, "token_index", late)


def _conv_across(mp):
    """The convolution reads the packed stream as one sequence."""
    conv = recurrent.causal_conv
    mp.setattr(recurrent, "causal_conv", lambda x, w, pos: conv(x, w, torch.arange(x.shape[-2]).expand_as(pos)))


def _decay_across(mp):
    """Inside a chunk, a token reaches the earlier tokens of other documents."""
    same = recurrent._same_document
    mp.setattr(recurrent, "_same_document", lambda doc: same(torch.zeros_like(doc)))


FAULTS = {"no_reset": _no_reset, "late_reset": _late_reset, "conv_across": _conv_across,
          "decay_across": _decay_across}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One CPU thread: these small tensors gain nothing from two, and on a
    busy machine a second thread makes every operator wait for it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _planted_from_environment(monkeypatch):
    name = os.environ.get("RECURRENT_FAULT")
    if name:
        FAULTS[name](monkeypatch)


# --- helpers -------------------------------------------------------------------------------


def batches():
    """The fixed batch, and two of Zipf-like sentence lengths."""
    rng = np.random.default_rng(0)
    return [LENGTHS] + [sentence_lengths(rng, 8, max_len=40).tolist() for _ in range(2)]


def close(actual, expected, dtype, scale_factor=1.0):
    """``assert_close`` relative to the reference tensor's largest magnitude."""
    scale = expected.abs().max().clamp(min=1e-30) * scale_factor
    torch.testing.assert_close(actual.double() / scale, expected.double() / scale, **tolerances(dtype))


def recurrence_inputs(rule, lengths, seed=0, dtype=torch.float32):
    """Random q, k, v, g, beta (T, H, .) with unit keys and decays in (-1, 0]."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(T, HEADS, HEAD_DIM, generator=gen)
    k = recurrent._l2norm(torch.randn(T, HEADS, HEAD_DIM, generator=gen))
    v = torch.randn(T, HEADS, HEAD_DIM + 2, generator=gen)
    g = -torch.rand(T, HEADS, generator=gen)
    beta = torch.rand(T, HEADS, generator=gen) if rule == "delta" else None
    return [None if t is None else t.to(dtype) for t in (q, k, v, g, beta)]


def per_document_reference(q, k, v, g, beta, offsets):
    """The definition: each document alone, token by token, float64."""
    return documents_reference(q, k, v, g, offsets, beta)


def layer_results(layer, x, offsets, weights, run):
    """Output, final states and the gradients of x and every parameter, after
    backward of a fixed random projection of output and states."""
    layer.zero_grad()
    x = x.detach().clone().requires_grad_()
    out, states = run(layer, x, offsets)
    ((out.double() * weights[0]).sum() + (states.double() * weights[1]).sum()).backward()
    grads = {f"grad {name}": p.grad for name, p in layer.named_parameters()}
    return {"output": out.detach(), "states": states.detach(), "grad x": x.grad, **grads}


def packed(layer, x, offsets):
    out, cache = layer.prefill(x, offsets)
    return out, cache.state


def reference(layer, x, offsets):
    return layer.reference(x, offsets)


def layer_case(cls, lengths, dtype, seed=0):
    torch.manual_seed(seed)
    layer = cls(EMBED, HEADS, HEAD_DIM, key_heads=KEY_HEADS, chunk=CHUNK).to(dtype)
    offsets = offsets_from_lengths(lengths)
    x = torch.randn(sum(lengths), EMBED).to(dtype)
    weights = (torch.randn(sum(lengths), EMBED, dtype=torch.float64),
               torch.randn(len(lengths), HEADS, HEAD_DIM, HEAD_DIM, dtype=torch.float64))
    return layer, x, offsets, weights


def check_layer_float32(cls, lengths):
    layer, x, offsets, weights = layer_case(cls, lengths, torch.float32)
    got = layer_results(layer, x, offsets, weights, packed)
    want = layer_results(copy.deepcopy(layer).double(), x.double(), offsets, weights, reference)
    for name in want:
        try:
            close(got[name], want[name], torch.float32)
        except AssertionError as err:
            raise AssertionError(f"{cls.__name__} {name}: {err}") from None


# --- the chunked form against the definition ----------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
@pytest.mark.parametrize("rule", ["scalar", "delta"])
def test_chunked_form_is_the_definition_in_float64(rule, chunk):
    q, k, v, g, beta = (None if t is None else t.double() for t in recurrence_inputs(rule, LENGTHS))
    offsets = offsets_from_lengths(LENGTHS)
    out, states = recurrent.packed_recurrence(q, k, v, g, offsets, beta, chunk=chunk)
    want_out, want_states = per_document_reference(q, k, v, g, beta, offsets)
    torch.testing.assert_close(out, want_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(states, want_states, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("rule", ["scalar", "delta"])
def test_the_token_loop_on_the_packed_row_is_the_definition(rule):
    q, k, v, g, beta = (None if t is None else t.double() for t in recurrence_inputs(rule, LENGTHS))
    offsets = offsets_from_lengths(LENGTHS)
    out = token_loop(q, k, v, g, offsets, beta)
    torch.testing.assert_close(out, per_document_reference(q, k, v, g, beta, offsets)[0], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("lengths", batches(), ids=["fixed", "zipf-a", "zipf-b"])
@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_layer_in_float32_matches_the_float64_definition(cls, lengths):
    check_layer_float32(cls, lengths)


@pytest.mark.parametrize("rule", ["scalar", "delta"])
def test_recurrence_in_bfloat16_within_its_tolerance(rule):
    inputs = [None if t is None else t.requires_grad_() for t in recurrence_inputs(rule, LENGTHS, dtype=torch.bfloat16)]
    offsets = offsets_from_lengths(LENGTHS)
    out, states = recurrent.packed_recurrence(*inputs[:4], offsets, inputs[4], chunk=CHUNK)
    wide = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    want_out, want_states = per_document_reference(*wide, offsets)
    gen = torch.Generator().manual_seed(1)
    w_out, w_states = torch.randn(out.shape, generator=gen), torch.randn(states.shape, generator=gen)
    ((out.float() * w_out).sum() + (states * w_states).sum()).backward()
    ((want_out * w_out).sum() + (want_states * w_states).sum()).backward()
    assert out.dtype == torch.bfloat16
    close(out, want_out, torch.bfloat16)
    close(states, want_states, torch.bfloat16)
    for got, want in zip(inputs, wide):
        if got is not None:
            close(got.grad, want.grad, torch.bfloat16)


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_layer_in_bfloat16_adds_no_error_to_the_definitions(cls):
    layer, x, offsets, weights = layer_case(cls, LENGTHS, torch.bfloat16)
    got = layer_results(layer, x, offsets, weights, packed)
    definition = layer_results(layer, x, offsets, weights, reference)  # same bfloat16 activations
    want = layer_results(copy.deepcopy(layer).double(), x.double(), offsets, weights, reference)
    for name in want:
        scale = want[name].abs().max()
        error, allowed = (got[name].double() - want[name]).abs().max() / scale, \
            (definition[name].double() - want[name]).abs().max() / scale + 0.01
        assert error <= allowed, f"{cls.__name__} {name}: error {error:.3g} of its scale, allowed {allowed:.3g}"


# --- padded rows, decoding -------------------------------------------------------------------


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_padded_rows_give_the_packed_results(cls):
    layer, x, offsets, _ = layer_case(cls, LENGTHS, torch.float32)
    with torch.no_grad():
        out_packed, cache = layer.prefill(x, offsets)
        x_padded, valid = to_padded(x, offsets)  # (B, S, E), (B, S)
        close(layer(x_padded)[valid], out_packed, torch.float32)
        q, k, v, g, beta = recurrence_inputs("delta" if layer.delta else "scalar", LENGTHS)
        _, packed_states = recurrent.packed_recurrence(q, k, v, g, offsets, beta, chunk=CHUNK)
        pad = [None if t is None else to_padded(t, offsets)[0] for t in (q, k, v, g, beta)]
        _, padded_states = recurrent.padded_recurrence(*pad[:4], offsets.diff(), pad[4], chunk=CHUNK)
    close(padded_states, packed_states, torch.float32)


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_decoding_from_the_cache_continues_the_recurrence(cls):
    layer, x, offsets, _ = layer_case(cls, LENGTHS, torch.float32)
    B, new = len(LENGTHS), 3
    more = torch.randn(new, B, EMBED)  # three more tokens per request
    with torch.no_grad():
        _, cache = layer.prefill(x, offsets)
        assert cache.state.shape == (B, HEADS, HEAD_DIM, HEAD_DIM) and cache.conv.shape[:2] == (B, 3)
        steps = []
        for t in range(new):
            out, cache = layer.step(more[t], cache)
            steps.append(out)
        longer = torch.cat([torch.cat([x[a:b], more[:, i]]) for i, (a, b)
                            in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))])
        offsets_longer = offsets_from_lengths([n + new for n in LENGTHS])
        full = layer(longer, offsets_longer)  # (T + B * new, E)
    last = (offsets_longer[1:, None] - torch.arange(new, 0, -1)).flatten()  # each request's new tokens
    close(torch.stack(steps, 1).flatten(0, 1), full[last], torch.float32)


# --- planted faults ------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_planted_fault_is_caught(fault, monkeypatch):
    FAULTS[fault](monkeypatch)
    for cls in LAYERS:
        with pytest.raises(AssertionError):
            check_layer_float32(cls, LENGTHS)


# --- transformers: Qwen3-Next's Gated DeltaNet swapped for the packed layer -------------------


def test_qwen3_next_keeps_packed_documents_apart_with_the_swapped_layers():
    transformers = pytest.importorskip("transformers")
    from ragged_site.reference import document_differences
    from ragged_toolkit.recurrent_hf import swap_gated_delta_layers

    config = transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=0,
        layer_types=["linear_attention"] * 3 + ["full_attention"])
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 64, (n,), generator=gen) for n in (21, 1, 70)]  # the last over a chunk
    stock = document_differences(model, docs)
    with pytest.raises(ValueError, match="can't keep packed sequences apart"):
        document_differences(model, docs, boundaries=True)
    swapped, n = swap_gated_delta_layers(copy.deepcopy(model))
    ours = document_differences(swapped, docs, boundaries=True)
    assert n == 3
    assert stock[0] < 1e-5, stock  # the first document has nothing before it
    assert min(stock[1:]) > 1e-3, stock  # the others read the documents before them
    assert max(ours) < 1e-5, ours


def test_swapping_refuses_a_release_that_keeps_the_boundaries_from_the_layers(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from ragged_toolkit.recurrent_hf import forwards_cu_seq_lens, swap_gated_delta_layers

    monkeypatch.setattr(transformers, "__version__", "5.8.1")
    assert not forwards_cu_seq_lens()
    with pytest.raises(RuntimeError, match=r"transformers 5.8.1 does not pass .* upgrade to transformers 5.9.0"):
        swap_gated_delta_layers(torch.nn.Module())
    monkeypatch.setattr(transformers, "__version__", "5.9.0")
    assert forwards_cu_seq_lens()


# --- compiled, and in a hybrid model --------------------------------------------------------------


def test_the_packed_recurrence_traces_into_one_graph():
    """``token_index`` is given the token count, so nothing is read back from
    the device: ``fullgraph=True`` traces it (the eager backend: no kernels
    generated, only the graph checked)."""
    q, k, v, g, beta = recurrence_inputs("delta", LENGTHS)
    offsets = offsets_from_lengths(LENGTHS)
    run = torch.compile(recurrent.packed_recurrence, fullgraph=True, backend="eager", dynamic=False)
    for got, want in zip(run(q, k, v, g, offsets, beta, chunk=CHUNK),
                         recurrent.packed_recurrence(q, k, v, g, offsets, beta, chunk=CHUNK)):
        torch.testing.assert_close(got, want)


def test_the_hybrid_model_gives_the_same_logits_packed_and_padded():
    from ragged_toolkit.gpt import GPTConfig
    from ragged_toolkit.hybrid import HybridGPT, hybrid_loss
    from ragged_toolkit.layouts import PackedLayout, PaddedLayout
    from ragged_toolkit.batches import token_index

    lengths = [n for n in LENGTHS if n]  # the attention plan takes no empty document here
    cfg = GPTConfig(vocab_size=50, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64)
    torch.manual_seed(0)
    model = HybridGPT(cfg, chunk=CHUNK)
    assert model.attention_layers == [3]
    assert [type(b).__name__ for b in model.layers] == ["RecurrentBlock"] * 3 + ["Block"]
    offsets = offsets_from_lengths(lengths)
    tokens = torch.randint(0, 50, (sum(lengths),))
    ids, valid = to_padded(tokens, offsets)
    with torch.no_grad():
        packed = model(tokens, token_index(offsets)[1], PackedLayout.of(offsets))
        padded = model(ids, torch.arange(ids.shape[1]).expand_as(ids), PaddedLayout())
        close(padded[valid], packed, torch.float32)
        close(hybrid_loss(model, tokens, offsets, padded=True), hybrid_loss(model, tokens, offsets), torch.float32)
        with pytest.raises(ValueError, match="right-padded rows"):
            model(ids, torch.arange(ids.shape[1]).expand_as(ids), PaddedLayout(mask=valid[:, None, None, :]))
