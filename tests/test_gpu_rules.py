"""Issue 25's rules for a GPU, pinned on a CPU machine: what the toolkit
refuses or does on CUDA (a backend with no kernel, CPU ranks that must not
touch the GPU, a parity check that must fit the math path's memory), a
backend that should run and raises, FlexAttention's bounded compiles, and
generations checked against teacher-forced logits."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

from toolkit_api import MODULES, tk

ATTENTION = MODULES["ragged_toolkit.attention"]
FLEX = MODULES["ragged_toolkit.attention.flex"]
LAUNCH = MODULES["ragged_site.data_parallel_launch"]


# --- a backend with no kernel on CUDA --------------------------------------------

def test_nested_tensors_are_refused_for_float32_causal_training_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H200, here
    why = tk.backend_support("sdpa_njt", "cuda", torch.float32, is_causal=True, needs_grad=True)
    assert why and "no CUDA kernel" in why, why
    # so the default for a float32 parity check on CUDA is the loop, not nested tensors
    assert tk.default_backend("cuda", torch.float32) == "loop"
    assert tk.default_backend("cuda", torch.bfloat16) == "varlen"
    assert tk.backend_support("sdpa_njt", "cuda", torch.bfloat16, is_causal=True, needs_grad=True) is None


def test_head_sizes_the_cuda_kernels_refuse_are_not_available_not_errors(monkeypatch):
    """Issue 35: 16 heads at width 64 gave the decoding page a head size of 4
    on CUDA, which flash's varlen kernel (a multiple of 8, at most 256) and
    CUDA FlexAttention (at least 16) refuse: backend_support names the rule,
    so the job prints "not available" instead of failing."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    support = tk.backend_support
    assert "a multiple of 8, at most 256, not 4" in support("varlen", "cuda", torch.bfloat16, head_dim=4)
    assert "at most 256, not 512" in support("varlen", "cuda", torch.bfloat16, head_dim=512)
    assert "at least 16, not 8" in support("flex", "cuda", torch.bfloat16, head_dim=8)
    assert support("varlen", "cuda", torch.bfloat16, head_dim=64) is None
    assert support("flex", "cuda", torch.bfloat16, head_dim=16) is None
    assert tk.default_backend("cuda", torch.bfloat16, head_dim=4) == "sdpa_njt"  # varlen cannot take it
    # the float32 warm-up of issue 35's layers page: varlen refuses the dtype, by name
    assert "float16 or bfloat16, not torch.float32" in support("varlen", "cuda", torch.float32)


# --- CPU ranks on a GPU machine ---------------------------------------------------

def test_gloo_ranks_are_launched_with_no_gpu_to_see(monkeypatch):
    seen = {}

    def run(command, **kwargs):
        seen.update(kwargs["env"])
        return subprocess.CompletedProcess(command, 1, "", "stopped by the test")

    monkeypatch.setattr(LAUNCH.subprocess, "run", run)
    job = tk.DataParallelJob(backend="gloo", config={})
    with pytest.raises(RuntimeError, match="2 ranks on gloo failed"):
        tk.run_data_parallel(job, {}, 2)
    assert seen.get("CUDA_VISIBLE_DEVICES") == "", "a CPU rank could build its mesh on a GPU"
    # ranks on one machine talk over the loopback interface
    assert seen.get("GLOO_SOCKET_IFNAME") == "lo" and seen.get("MASTER_ADDR") == "127.0.0.1"


@pytest.fixture
def one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_builds_its_mesh_on_the_ranks_device_even_where_cuda_is_there(one_rank, monkeypatch):
    torch.manual_seed(0)
    model = tk.GPT(tk.GPTConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32,
                                max_seq_len=16))
    # a GPU machine: FSDP2's own guess of a mesh is the accelerator's
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    runner, sync = tk.wrap_model(model, "fsdp", torch.device("cpu"))
    weight = model.layers[0].attn.wqkv.weight
    assert weight.device_mesh.device_type == "cpu" and weight.device.type == "cpu"


def test_one_gpu_runs_no_nccl_ranks_and_more_run_one_rank_each():
    assert tk.nccl_ranks(1, 6) is None, "one rank over NCCL exchanges nothing: no data-parallel figure"
    assert tk.nccl_ranks(0, 6) is None
    assert tk.nccl_ranks(2, 6) == 2 and tk.nccl_ranks(8, 3) == 3  # a rank needs a micro-batch


def test_every_shape_is_met_once_before_any_timing():
    met = []
    batches = [(2, 5), (2, 7), (2, 5), (3, 7), (2, 7)]
    shapes = tk.warm_every_shape(met.append, batches, lambda b: b)
    assert shapes == [(2, 5), (2, 7), (3, 7)] and met == shapes


# --- a parity check that fits the math path ---------------------------------------

def test_the_math_check_takes_a_slice_that_fits_at_cuda_sizes():
    # the GPT page's CUDA step: rows of 2,048 tokens, 16 heads, 4 layers; the
    # documents of the site's corpus cut into rows (lengths of up to 2,048)
    documents, _ = tk.docstring_corpus(min_chars=2)
    tokens, offsets = tk.pack_documents(documents)
    rows = tk.split_by_token_budget(tokens, offsets, 2048)[:8]
    lengths = tk.concat_batches(rows)[1].diff()
    budget = 2**31
    whole = tk.math_scores_bytes(lengths, 16, 4)
    assert whole > 10 * budget, f"the whole step needs {whole / 2**30:.0f} GiB: no slice needed?"
    n = tk.math_check_sequences(lengths, 16, 4, budget=budget)
    assert n >= 1 and tk.math_scores_bytes(lengths[:n], 16, 4) <= budget, n
    # the old page's check: 128 documents, the longest 2,048 tokens: about 137 GB
    assert tk.math_scores_bytes(torch.tensor([2048] * 128), 16, 4) > 100e9


# --- a backend that should run and raises ----------------------------------------

def test_compare_backends_names_a_backend_that_raises_instead_of_dropping_it(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel missing")

    monkeypatch.setitem(ATTENTION._ATTEND, "bucketed", broken)
    offsets = tk.offsets_from_lengths([3, 5])
    q = k = v = torch.randn(8, 2, 4)
    with pytest.raises(RuntimeError, match=r"backend 'bucketed' should run this job here and raised: kernel missing"):
        tk.compare_backends(q, k, v, offsets, backends=("loop", "bucketed"), min_run_time=0.01)
    # a limit stated by design still prints as "not available"
    out = tk.compare_backends(q, k, v, offsets, backends=("loop", "varlen"), min_run_time=0.01)
    assert isinstance(out["varlen"], str) and "CUDA" in out["varlen"]


# --- FlexAttention: compiled per head configuration, never unfused ------------------

def test_flex_compiles_every_head_configuration_and_never_runs_unfused():
    """A kernel the caller owns: one configuration at 9 padded sizes (past
    dynamo's recompile limit of 8 for one function, where a shared
    ``torch.compile(flex_attention)`` runs unfused) and three more
    configurations, each batch twice: 12 graphs, none compiled twice, none
    run unfused."""
    rng = np.random.default_rng(0)
    configs = [(2, 1, 8), (4, 2, 8), (4, 4, 16), (8, 2, 16)]  # heads, key/value heads, head size
    batches = [(configs[0], size) for size in range(1, 10)] + [(c, 1) for c in configs[1:]]
    kernel = tk.FlexKernel()
    with tk.compile_counter() as count, warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for i, ((heads, kv_heads, dim), size) in enumerate(batches * 2):  # size: blocks of 128 rows
            lengths = torch.as_tensor(rng.integers(1, 30, size=200))
            lengths = lengths[lengths.cumsum(0) <= 128 * size - 20][-(8 * size):]
            offsets = tk.offsets_from_lengths(lengths)
            g = torch.Generator().manual_seed(i)
            q = torch.randn(int(offsets[-1]), heads, dim, generator=g)
            k, v = (torch.randn(int(offsets[-1]), kv_heads, dim, generator=g) for _ in range(2))
            plan = tk.plan_batch(offsets, is_causal=True, backend="flex", flex=kernel)
            out = tk.ragged_attention(q, k, v, plan)
            torch.testing.assert_close(out, tk.reference_attention(q, k, v, offsets, is_causal=True),
                                       atol=1e-5, rtol=1e-4)
    unfused = [str(w.message).splitlines()[0] for w in caught if "without torch.compile" in str(w.message)]
    assert not unfused and not count.fallbacks, (unfused or count.fallbacks)[:2]
    assert len(kernel.graphs) == len(batches) == count.graphs, (len(kernel.graphs), count.graphs)


def test_flex_past_its_bound_fails_naming_the_cause():
    kernel = tk.FlexKernel(max_graphs=1)
    q = torch.randn(1, 2, 128, 8)
    with torch.no_grad():
        kernel(q, q, q, block_mask=None)
        kernel(q, q, q, block_mask=None)  # the same configuration: no new graph
        with pytest.raises(RuntimeError, match=r"1 graphs already compiled; 2 heads, 2 key/value heads, head "
                                               r"size 8, torch.float32, 256 query rows would compile one more"):
            q2 = torch.randn(1, 2, 256, 8)
            kernel(q2, q2, q2, block_mask=None)


def test_flex_outside_a_compile_needs_the_callers_kernel():
    offsets = tk.offsets_from_lengths([3, 5])
    q = torch.randn(8, 2, 8)
    with pytest.raises(ValueError, match=r"build one \(flex = FlexKernel\(\)\).*plan_batch\(\.\.\., backend='flex', flex=flex\)"):
        tk.ragged_attention(q, q, q, tk.plan_batch(offsets, is_causal=True, backend="flex"))


# --- greedy generations against teacher forcing ------------------------------------

def test_a_generation_matches_its_teacher_forced_logits_and_a_cache_bug_does_not():
    torch.manual_seed(0)
    cfg = tk.GPTConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=64)
    model = tk.GPT(cfg).eval()
    offsets = tk.offsets_from_lengths([5, 1, 9, 3])
    prompts = torch.randint(0, cfg.vocab_size, (18,))
    for dtype in (torch.float32, torch.bfloat16):
        tokens, logits = tk.generate_packed(model, prompts, offsets, 6, "loop", dtype=dtype, return_logits=True)
        torch.testing.assert_close(logits.float(), tk.teacher_forced_logits(model, prompts, offsets, tokens),
                                   **tk.tolerances(dtype))
    # a cache whose steps write one row too far: the check fails
    cache = tk.KVCache(cfg, 4, 16, "cpu", torch.float32)
    with torch.no_grad():
        first = tk.prefill_packed(model, prompts, offsets, cache, "loop")
        lengths = offsets.diff()
        tokens, logits = tk.decode_greedy(model, first, cache, lengths, 6, slots=lengths + 1, return_logits=True)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(logits, tk.teacher_forced_logits(model, prompts, offsets, tokens),
                                   **tk.tolerances(torch.float32))


# --- cuDNN attention's per-shape plans ------------------------------------------

def test_the_backends_that_meet_many_shapes_put_cudnn_last_on_cuda_and_the_padded_baseline_does_not(monkeypatch):
    """Issue 41: cuDNN attention, first on an H100 under PyTorch 2.11, builds
    a plan for every new shape; ``loop`` meets a new shape for nearly every
    length and ``bucketed`` for nearly every batch, so on CUDA they run under
    an order with flash and memory-efficient attention first. ``padded``, the
    baseline, keeps SDPA's own order. Pinned here by the order each call
    runs under, with the backends' device check answered as CUDA."""
    from torch.nn.attention import SDPBackend

    dense, loop, padded = (MODULES[f"ragged_toolkit.attention.{m}"] for m in ("dense", "loop", "padded"))
    names = {int(b): name for name, b in SDPBackend.__members__.items()}
    order = lambda: [names[i] for i in torch._C._get_sdp_priority_order()]  # noqa: E731
    own = torch._C._get_sdp_priority_order()
    # the order PyTorch 2.11 picks on an H100 (cuDNN 9.19, sm90, CUDA 13): cuDNN first
    torch._C._set_sdp_priority_order([int(SDPBackend.CUDNN_ATTENTION), *(i for i in own if i != 3)])
    try:
        _check_many_shapes_orders(monkeypatch, dense, loop, padded, names, order)
    finally:
        torch._C._set_sdp_priority_order(own)


def _check_many_shapes_orders(monkeypatch, dense, loop, padded, names, order):
    default = order()
    assert default[0] == "CUDNN_ATTENTION", default
    with dense.many_shapes_kernels("cuda"):
        inside = order()
    assert inside[:3] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"], inside
    assert order() == default, "the order was not restored"
    assert isinstance(dense.many_shapes_kernels("cpu"), type(contextlib.nullcontext()))

    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        seen.append(order()[0])
        return real_sdpa(*args, **kwargs)

    def as_if_cuda(device):
        return dense.many_shapes_kernels("cuda")

    monkeypatch.setattr(dense.F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(padded.F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(loop, "many_shapes_kernels", as_if_cuda)
    monkeypatch.setattr(padded, "many_shapes_kernels", as_if_cuda)
    offsets = torch.tensor([0, 5, 12, 20])
    q = torch.randn(20, 2, 8)
    for backend, first in (("loop", "FLASH_ATTENTION"), ("bucketed", "FLASH_ATTENTION"), ("padded", "CUDNN_ATTENTION")):
        seen.clear()
        tk.ragged_attention(q, q, q, tk.plan_batch(offsets, backend=backend, is_causal=True))
        assert seen and set(seen) == {first}, (backend, seen)
