"""The site's toolkit, the package ``ragged_toolkit/``: one vocabulary (the
pages import it and define none of its names), ``ragged_attention``'s
contract on bad input and empty sequences, varlen keyword detection and the
dtype switch (the GPU check is tested in ``test_gpu_check.py``). The
backends' parity with an independent float64 reference is in
``test_toolkit_parity.py``."""

from __future__ import annotations

import ast
import json
import inspect
import types

import pytest
import torch

from sitebuild import REPO, tutorial_sources
from toolkit_api import FILES, MODULES, OWNER, defined_names
from toolkit_api import tk as toolkit

from gallery_layout import PACKAGES, TOOLKIT  # (on the path through sitebuild)

PAGES = tutorial_sources(REPO)


# --- one vocabulary ---------------------------------------------------------

def _top_level(tree):
    """The statements that run at import: the module's body, and what
    if/try/with/for blocks hold, but not function or class bodies."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for name in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(n for n in getattr(node, name, ()) if isinstance(n, ast.AST))


def _definitions(path):
    """Name -> line of every function, class and variable ``path`` defines at
    top level, also inside if/try/with/for blocks."""
    out = {}
    for node in _top_level(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.setdefault(node.name, node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out.setdefault(name.id, node.lineno)
    return out


# What the toolkit defines itself, private helpers included: a page that
# defines one of these carries a copy of toolkit code.
OWN = {name for path in FILES.values() for name in defined_names(path)}

# Names of helpers that the pages used to define, each under its own name, for
# what the toolkit now does once: neither the toolkit nor a page may bring them back.
RETIRED = {"time_it", "time_ms", "timeit", "compare", "zipf_lengths", "gen_batch", "peak_memory_mb",
           "peak_mib", "padding_bound", "attention_flops", "valid_mask", "attend_per_sequence",
           "ragged_from_lengths", "stop_probability", "zipf_sentence_lengths",
           # the toolkit's own names before it became a package, and what nothing used
           "_sync", "_varlen_keywords", "_compiled_flex_attention", "compiled_flex_attention",
           "FLEX_RECOMPILE_LIMIT", "fastest", "ragged_info", "RaggedInfo"}

# Only these toolkit functions may call these: timing goes through
# ``measure``, every clock through ``stopwatch``, sentence lengths
# through ``sentence_lengths``.
ONLY_INSIDE = {"Timer": "measure", "perf_counter": "stopwatch", "geometric": "sentence_lengths"}


def test_the_package_defines_the_names_the_pages_rely_on():
    assert {"ragged_attention", "reference_attention", "measure", "compare_backends", "sentence_lengths",
            "to_padded", "work_bound", "synchronize", "varlen_kwargs", "FlexKernel", "plan_batch",
            "default_device", "quick_mode", "quiet_known_notes", "MultiHeadAttention",
            "generate_packed", "wrap_model", "StepTimer"} <= set(OWNER)


@pytest.mark.parametrize("path", [*FILES.values(), *PAGES], ids=lambda p: p.stem)
def test_one_vocabulary(path):
    defined = _definitions(path)
    retired = sorted(set(defined) & RETIRED)
    assert not retired, "\n".join(f"{path.name}:{defined[n]}: defines retired {n}" for n in retired)
    if path not in FILES.values():  # a page uses the toolkit's names; it defines none of them
        copies = sorted(set(defined) & OWN, key=defined.get)
        assert not copies, "a page imports these from ragged_toolkit; it does not define them:\n" + \
            "\n".join(f"{path.name}:{defined[n]}: defines {n}" for n in copies)
    for node in ast.parse(path.read_text()).body:
        scope = getattr(node, "name", None)  # the top-level function or class, if any
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            name = getattr(call.func, "attr", getattr(call.func, "id", ""))
            if name in ONLY_INSIDE:
                assert scope == ONLY_INSIDE[name], \
                    f"{path.name}:{call.lineno}: calls {name} outside {ONLY_INSIDE[name]}"


def test_the_vocabulary_checks_name_a_copy_and_its_line(tmp_path):
    page = tmp_path / "page.py"
    page.write_text("from ragged_site.measuring.timing import measure\n\nx = 1\n\n\ndef to_padded(values, offsets):\n"
                    "    return values\n\n\nif x:\n    ragged_attention = None\n")
    with pytest.raises(AssertionError, match=r"page.py:6: defines to_padded\s+page.py:11: defines ragged_attention"):
        test_one_vocabulary(page)
    page.write_text("import numpy as np\nrng = np.random.default_rng(0)\nlengths = rng.geometric(0.1, 4)\n")
    with pytest.raises(AssertionError, match="page.py:3: calls geometric outside sentence_lengths"):
        test_one_vocabulary(page)
    with pytest.raises(AssertionError, match="page.py does not import from ragged_toolkit"):
        test_every_page_imports_the_toolkit(page)
    page.write_text("from ragged_site.measuring.timing import measure, time_it\n")
    with pytest.raises(AssertionError, match=r"imports names ragged_site.measuring.timing does not define: \['time_it'\]"):
        test_every_page_imports_the_toolkit(page)
    page.write_text("from ragged_toolkit import measure\n")
    with pytest.raises(AssertionError, match="imports names ragged_toolkit does not define"):
        test_every_page_imports_the_toolkit(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_every_page_imports_the_toolkit(page):
    """Each name from the module that defines it (so the build knows which
    modules a page uses), the library's and the harness's; the packages
    themselves export nothing. Every page uses the library."""
    missing, imported = [], False
    for node in _top_level(ast.parse(page.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
            imported |= node.module.split(".")[0] == TOOLKIT
            module = MODULES.get(node.module)
            gone = [a.name for a in node.names if module is None or not hasattr(module, a.name)
                    or isinstance(getattr(module, a.name), types.ModuleType)]
            assert not gone, f"{page.name} imports names {node.module} does not define: {gone}"
    assert imported, f"{page.name} does not import from ragged_toolkit"


# --- the toolkit ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tk():
    """The toolkit's public names (tests/toolkit_api.py)."""
    return toolkit


def _batch(tk, q_lengths, kv_lengths=None, heads=4, kv_heads=4, dtype=torch.float32, seed=0):
    kv_lengths = q_lengths if kv_lengths is None else kv_lengths
    g = torch.Generator().manual_seed(seed)
    qo, ko = tk.offsets_from_lengths(q_lengths), tk.offsets_from_lengths(kv_lengths)
    q = torch.randn(int(qo[-1]), heads, 8, generator=g).to(dtype)
    k = torch.randn(int(ko[-1]), kv_heads, 8, generator=g).to(dtype)
    v = torch.randn(int(ko[-1]), kv_heads, 8, generator=g).to(dtype)
    return q, k, v, qo, ko


def _attend(tk, q, k, v, qo, ko=None, *, backend="loop", **plan):
    """``ragged_attention`` with the batch's plan, built here; the flex
    backend runs the package's own kernel, built once, as a model owns one."""
    if backend == "flex" and "flex" not in plan:
        plan["flex"] = FLEX_KERNEL
    return tk.ragged_attention(q, k, v, tk.plan_batch(qo, ko, backend=backend, **plan))


FLEX_KERNEL = toolkit.FlexKernel()  # the tests' one flex kernel, as a model owns one


@pytest.mark.parametrize("offsets, message", [
    ([1, 3, 7], "must start at 0, got 1"),
    ([0, 5, 3, 7], "must not decrease: q_offsets[1] = 5 > q_offsets[2] = 3"),
])
def test_bad_offsets_are_refused_naming_the_problem(tk, offsets, message):
    _, _, _, _, ko = _batch(tk, [3, 4])
    with pytest.raises(ValueError, match="q_offsets " + message.replace("[", r"\[").replace("]", r"\]")):
        tk.plan_batch(torch.tensor(offsets), ko, backend="loop")


def test_a_plan_of_another_batch_is_refused(tk):
    q, k, v, qo, ko = _batch(tk, [3, 4])
    plan = tk.plan_batch(tk.offsets_from_lengths([3, 3]), backend="loop")
    with pytest.raises(ValueError, match="the plan describes 6 query rows and 6 key rows; got 7 and 7"):
        tk.ragged_attention(q, k, v, plan)
    with pytest.raises(TypeError, match="takes the batch's plan"):
        tk.ragged_attention(q, k, v, qo)


def test_different_batch_sizes_and_bad_kv_used_are_refused(tk):
    q, k, v, qo, ko = _batch(tk, [3, 4])
    with pytest.raises(ValueError, match="different batch sizes: 2 and 1"):
        _attend(tk, q, k, v, qo, torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="kv_used must hold one count per sequence"):
        _attend(tk, q, k, v, qo, ko, kv_used=torch.tensor([3, 5]))
    with pytest.raises(ValueError, match="H a multiple of H_kv"):
        _attend(tk, q, k[:, :3], v[:, :3], qo, ko)
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        _attend(tk, q, k, v, qo, ko, backend="fast")
    # float32 rotary outputs beside a bfloat16 value under autocast
    with pytest.raises(ValueError, match="one dtype; got torch.float32, torch.float32, torch.bfloat16"):
        _attend(tk, q, k, v.bfloat16(), qo, ko, backend="loop")


CPU_BACKENDS = ("sdpa_njt", "flex", "loop", "bucketed", "padded")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_empty_sequences_on_every_backend(tk, backend, causal):
    lengths = [0, 4, 3, 0, 5]
    kv_lengths = lengths if causal else [2, 4, 0, 0, 6]  # a query sequence with no keys, too
    q, k, v, qo, ko = _batch(tk, lengths, kv_lengths)
    needs_grad = backend in ("loop", "bucketed", "padded") or (backend == "sdpa_njt" and not causal)
    why = tk.backend_support(backend, "cpu", torch.float32, is_causal=causal, needs_grad=needs_grad)
    if why:
        pytest.skip(why)
    for t in (q, k, v):
        t.requires_grad_(needs_grad)
    with torch.set_grad_enabled(needs_grad):
        out = _attend(tk, q, k, v, qo, ko, is_causal=causal, backend=backend)
    reference = tk.reference_attention(q, k, v, qo, ko, is_causal=causal)
    assert out.shape == q.shape and out.isfinite().all()
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-4)
    if not causal:  # the third sequence has queries (rows 4-6) and no keys: zeros
        assert (out[4:7] == 0).all()
    if needs_grad:
        out.sum().backward()
        assert all(t.grad is not None and t.grad.isfinite().all() for t in (q, k, v))


@pytest.mark.parametrize("backend", ("flex", "loop", "bucketed", "padded"))
def test_decoding_against_a_cache_with_gqa(tk, backend):
    # one query per sequence, keys in rows of 8 with 3, 8 and 1 in use, 8 heads over 2
    q, k, v, qo, ko = _batch(tk, [1, 1, 1], [8, 8, 8], heads=8, kv_heads=2)
    used = torch.tensor([3, 8, 1])
    with torch.no_grad():
        out = _attend(tk, q, k, v, qo, ko, is_causal=True, kv_used=used, backend=backend)
    torch.testing.assert_close(out, tk.reference_attention(q, k, v, qo, ko, kv_used=used), atol=1e-5, rtol=1e-4)


def test_padded_backend_reads_a_rectangular_cache_in_place(tk):
    # three sequences of 3 new queries each (a chunk of prefill), rows of 8 keys
    # of which 3, 8 and 5 are in use: bottom-right causal within each
    q, k, v, qo, ko = _batch(tk, [3, 3, 3], [8, 8, 8], heads=4, kv_heads=2)
    used = torch.tensor([3, 8, 5])
    with torch.no_grad():
        out = _attend(tk, q, k, v, qo, ko, is_causal=True, kv_used=used, backend="padded")
    torch.testing.assert_close(out, tk.reference_attention(q, k, v, qo, ko, is_causal=True, kv_used=used),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ("flex", "loop", "bucketed", "padded"))
def test_low_precision_matches_the_float32_reference(tk, backend):
    q, k, v, qo, ko = _batch(tk, [5, 1, 9, 3], heads=8, kv_heads=2, dtype=torch.bfloat16)
    with torch.no_grad():
        out = _attend(tk, q, k, v, qo, ko, is_causal=True, backend=backend)
    assert out.dtype == torch.bfloat16
    reference = tk.reference_attention(q, k, v, qo, ko, is_causal=True)
    torch.testing.assert_close(out.float(), reference, **tk.tolerances(torch.bfloat16))
    # the tolerance is tight enough to catch a wrong mask
    wrong = tk.reference_attention(q, k, v, qo, ko, is_causal=False)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out.float(), wrong, **tk.tolerances(torch.bfloat16))


# --- varlen_attn across releases ---------------------------------------------

#: ``varlen_attn``'s signature in each release, recorded from its build
#: (``scripts/varlen_signature.py``), and 2.10's, from its source.
SIGNATURES = json.loads((REPO / "tests" / "fixtures" / "varlen_signatures.json").read_text())
KEYWORDS = {release[:4]: frozenset(p["name"] for p in record["members"]["varlen_attn"]["parameters"])
            for release, record in SIGNATURES.items()}
KEYWORDS["2.10"] = frozenset("query key value cu_seq_q cu_seq_k max_q max_k return_aux is_causal scale".split())


def test_the_recorded_releases_are_the_checked_ones():
    assert set(KEYWORDS) == {"2.10", "2.11", "2.13", "2.15"}
    assert "window_size" in KEYWORDS["2.11"] and "enable_gqa" not in KEYWORDS["2.11"]
    assert {"enable_gqa", "seqused_k", "block_table", "num_splits"} <= KEYWORDS["2.13"] <= KEYWORDS["2.15"]


@pytest.mark.parametrize("release", sorted(KEYWORDS))
def test_the_varlen_adapter_maps_each_feature_or_names_it_missing(tk, release):
    keywords = KEYWORDS[release]
    causal = tk.varlen_kwargs(is_causal=True, scale=0.5, keywords=keywords)
    assert causal == ({"is_causal": True, "scale": 0.5} if release == "2.10"
                      else {"window_size": (-1, 0), "scale": 0.5})
    paged = dict(is_causal=True, enable_gqa=True, seqused_k=torch.tensor([3]), block_table=torch.zeros(1, 1),
                 num_splits=1, keywords=keywords)
    if release in ("2.10", "2.11"):
        with pytest.raises(tk.VarlenUnavailable, match="has no enable_gqa, seqused_k, block_table, num_splits"):
            tk.varlen_kwargs(**paged)
    else:
        kw = tk.varlen_kwargs(**paged)
        assert kw["num_splits"] == 1 and kw["enable_gqa"] is True and kw["window_size"] == (-1, 0)
        assert set(kw) <= keywords
    assert tk.varlen_kwargs(keywords=keywords) == {}  # nothing asked, nothing passed


def _fake_varlen():
    """A stand-in for ``varlen_attn`` that records the arguments it gets."""
    calls = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kw):
        calls.append({"key_heads": key.shape[1], "cu": (cu_seq_q.dtype, cu_seq_k.tolist()),
                      "max": (max_q, max_k), **kw})
        return torch.zeros_like(query)

    return varlen_attn, calls


@pytest.mark.parametrize("release", sorted(KEYWORDS))
def test_the_varlen_backend_follows_the_installed_signature(tk, release, monkeypatch):
    fake, calls = _fake_varlen()
    varlen = MODULES["ragged_toolkit.attention.varlen"]
    monkeypatch.setattr(varlen, "varlen_attn", fake)
    monkeypatch.setattr(varlen, "VARLEN_KEYWORDS", KEYWORDS[release])
    monkeypatch.setattr(MODULES["ragged_toolkit.attention"], "backend_support",
                        lambda *a, **kw: None)  # as if on a GPU
    # decoding: one query per sequence, 8 query heads over 2 key/value heads,
    # rows of 8 keys of which 3 and 8 are in use
    q, k, v, qo, ko = _batch(tk, [1, 1], [8, 8], heads=8, kv_heads=2, dtype=torch.bfloat16)
    _attend(tk, q, k, v, qo, ko, is_causal=True, kv_used=torch.tensor([3, 8]), backend="varlen")
    call = calls[-1]
    if release == "2.10":
        assert call["is_causal"] is True and "window_size" not in call
    else:
        assert call["window_size"] == (-1, 0) and "is_causal" not in call
    if release in ("2.13", "2.15"):  # reads the cache in place and shares the key/value heads
        assert call["cu"] == (torch.int32, [0, 8, 16]) and call["seqused_k"].tolist() == [3, 8]
        assert call["enable_gqa"] is True and call["key_heads"] == 2
    else:  # no seqused_k: only the rows in use are passed; no enable_gqa: heads repeated
        assert call["cu"] == (torch.int32, [0, 3, 11]) and "seqused_k" not in call
        assert "enable_gqa" not in call and call["key_heads"] == 8
    assert call["max"] == (1, 8)


def test_backend_support_names_what_is_missing(tk):
    assert "needs CUDA" in tk.backend_support("varlen", "cpu", torch.bfloat16)
    assert "no backward on CPU" in tk.backend_support("flex", "cpu", torch.float32, needs_grad=True)
    assert "refuses is_causal" in tk.backend_support("sdpa_njt", "cpu", torch.float32, is_causal=True)
    assert "enable_gqa" in tk.backend_support("sdpa_njt", "cpu", torch.float32, gqa=True)
    assert tk.backend_support("loop", "cpu", torch.bfloat16, is_causal=True, needs_grad=True, gqa=True) is None


def test_default_dtype_reads_the_environment(tk, monkeypatch):
    monkeypatch.delenv("TUTORIALS_DTYPE", raising=False)
    assert tk.default_dtype("cpu") == torch.float32
    monkeypatch.setenv("TUTORIALS_DTYPE", "bfloat16")
    assert tk.default_dtype("cpu") == torch.bfloat16
    monkeypatch.setenv("TUTORIALS_DTYPE", "bf16")
    with pytest.raises(ValueError, match="TUTORIALS_DTYPE must be float32, bfloat16 or float16, got 'bf16'"):
        tk.default_dtype("cpu")


def test_the_kernel_that_ran_is_read_from_the_profiler(tk):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 4, 16, 8)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert tk.profile_call(lambda: sdpa(q, q, q, is_causal=True))[1] == "CPU flash"

    def forced_math():
        with sdpa_kernel(SDPBackend.MATH):
            sdpa(q, q, q, is_causal=True)

    assert tk.profile_call(forced_math)[1] == "math"
    assert tk.profile_call(lambda: q + 1)[1] == ""


def test_the_work_bound_counts_what_each_side_computes(tk):
    lengths = torch.tensor([1, 3])  # padded to 3: 6 slots for 4 tokens
    tokens, pairs = tk.Work(per_token=1.0, per_pair=0.0), tk.Work(per_token=0.0, per_pair=1.0)
    assert tk.work_bound(lengths, work=tokens) == pytest.approx(6 / 4)
    # causal on both sides: pairs 2 * 6 = 12 against 1 + 6 = 7
    assert tk.work_bound(lengths, work=pairs, causal=True) == pytest.approx(12 / 7)
    # a merged mask computes the whole square: 2 * 9 = 18 against 7
    assert tk.work_bound(lengths, work=pairs, causal=True, padded_causal=False) == pytest.approx(18 / 7)
    # a model's work: 2 FLOPs per weight per token but the embedding's, 4 H D per pair per layer
    cfg = tk.GPTConfig(vocab_size=50, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=32)
    model = tk.GPT(cfg)
    work = tk.model_work(model, n_layers=2, attention_width=16)
    weights = sum(p.numel() for p in model.parameters()) - 50 * 16
    assert work == tk.Work(per_token=2.0 * weights, per_pair=4.0 * 2 * 16)


def _greedy_without_cache(tk, model, prompt, n_new):
    """The reference: every step runs the whole sequence again, alone, with a
    plain causal SDPA call and no cache."""
    seq = prompt.clone()
    for _ in range(n_new):
        positions = torch.arange(len(seq))
        logits = model(seq[None], positions[None], tk.PaddedLayout())[0, -1]
        seq = torch.cat([seq, logits.argmax()[None]])
    return seq[len(prompt):]


@pytest.mark.parametrize("left_padded", [False, True])
def test_prefill_and_fixed_shape_decoding_match_recomputing_each_sequence(tk, left_padded):
    """``prefill_packed`` + ``decode_greedy`` (a fixed-capacity cache read
    through ``CachedStep``) write the tokens that recomputing each sequence
    alone, without a cache, writes; with the cache left-padded too (the
    padded generation's layout: ``slots`` and ``start``)."""
    torch.manual_seed(0)
    cfg = tk.GPTConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       ffn_hidden=48, max_seq_len=64)
    model = tk.GPT(cfg).eval()
    lengths = torch.tensor([5, 1, 9, 3])
    offsets = tk.offsets_from_lengths(lengths)
    prompts = torch.randint(0, cfg.vocab_size, (int(lengths.sum()),))
    n_new, longest = 6, int(lengths.max())
    cache = tk.KVCache(cfg, len(lengths), longest + n_new, "cpu", torch.float32)
    with torch.no_grad():
        if left_padded:  # the same keys, moved right by each sequence's padding
            logits = tk.prefill_packed(model, prompts, offsets, cache, "loop")
            pad = longest - lengths
            for layer in range(cfg.n_layers):
                for b, n in enumerate(lengths.tolist()):
                    for t in (cache.k, cache.v):
                        t[layer, b, pad[b]:longest] = t[layer, b, :n].clone()
                        t[layer, b, :pad[b]] = 7.0  # garbage the mask must hide
            out = tk.decode_greedy(model, logits, cache, lengths, n_new,
                                   slots=torch.full_like(lengths, longest), start=pad)
        else:
            logits = tk.prefill_packed(model, prompts, offsets, cache, "loop")
            out = tk.decode_greedy(model, logits, cache, lengths, n_new)
        for b in range(len(lengths)):
            want = _greedy_without_cache(tk, model, prompts[offsets[b]:offsets[b + 1]], n_new)
            assert out[b].tolist() == want.tolist(), f"sequence {b}"
