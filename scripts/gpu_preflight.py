"""The GPU check's probes of the machine, each in a Python of its own (run by
``scripts/gpu_check.py``; importing torch there would hold memory for the
whole run).

    python scripts/gpu_preflight.py --machine   # one JSON line: versions and device
    python scripts/gpu_preflight.py             # the preflight: one line per probe

Each preflight probe prints one line as it finishes; a probe that fails
prints "FAILED" and the others go on (exit status 1 at the end).
"""

import importlib.metadata as md
import inspect
import json
import platform
import sys
import time

import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def machine() -> dict:
    """The versions and the device, as the run's summary and the record keep them."""
    info = {"cuda_available": CUDA, "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if CUDA else None, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(0) if CUDA else None,
            "gpus": torch.cuda.device_count() if CUDA else 0}
    for name in ("triton", "transformers", "numpy", "matplotlib"):
        try:
            info[name] = md.version(name)
        except md.PackageNotFoundError:
            info[name] = None
    return info


def sync():
    if CUDA:
        torch.cuda.synchronize()


def versions():
    info = machine()
    return (f"torch {info['torch']}, CUDA {info['cuda']}, cuDNN {info['cudnn']}, triton {info['triton']}, "
            f"transformers {info['transformers']}, Python {info['python']}")


def gpu():
    if not CUDA:
        return "no CUDA GPU (CPU run)"
    p = torch.cuda.get_device_properties(0)
    return (f"{p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB; "
            f"{torch.cuda.device_count()} GPU(s) visible")


def varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as err:
        return f"not in this PyTorch ({err})"
    sig = inspect.signature(varlen_attn)  # without annotations: the names, defaults and the *
    sig = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()])
    return f"varlen_attn{sig.replace(return_annotation=sig.empty)}"


def sdpa_kernel():
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(2, 8, 1024, 64, device=DEVICE, dtype=torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=activities) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        sync()
    prefixes = ("aten::_scaled_dot_product", "aten::_flash", "aten::_efficient", "aten::_cudnn")
    ops = sorted({e.name for e in prof.events() if e.name.startswith(prefixes)})
    return f"bfloat16, causal, (2, 8, 1024, 64): {', '.join(ops) or 'no SDPA op seen'}"


def cudnn_first_calls():
    if not CUDA:
        return "no CUDA GPU: not measured"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    costs = []
    for shape in ((1, 8, 128, 64), (4, 8, 512, 64), (2, 8, 2048, 64)):
        q = torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16)
        times = []
        try:  # not fatal: SDPA falls back to another kernel where cuDNN's cannot run
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                for _ in range(2):
                    sync()
                    start = time.perf_counter()
                    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
                    sync()
                    times.append(time.perf_counter() - start)
        except RuntimeError as err:
            costs.append(f"{tuple(shape)} not available ({str(err).splitlines()[0][:120]})")
            continue
        costs.append(f"{tuple(shape)} first {times[0]:.2f} s, then {1e3 * times[1]:.2f} ms")
    return "; ".join(costs)


def tiny_compile():
    f = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2 + 1)
    x = torch.randn(256, device=DEVICE)
    start = time.perf_counter()
    torch.testing.assert_close(f(x), torch.nn.functional.gelu(x) * 2 + 1)
    sync()
    return f"a tiny function compiled and ran in {time.perf_counter() - start:.1f} s"


def tiny_flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, q, k: q >= k, 1, 1, 256, 256, device=DEVICE)
    q = torch.randn(1, 2, 256, 64, device=DEVICE, dtype=torch.bfloat16 if CUDA else torch.float32)
    start = time.perf_counter()
    out = torch.compile(flex_attention)(q, q, q, block_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    sync()
    return f"a causal block mask, compiled and checked against SDPA in {time.perf_counter() - start:.1f} s"


PROBES = {"versions": versions, "device": gpu, "varlen_attn": varlen, "SDPA kernel": sdpa_kernel,
          "cuDNN first call": cudnn_first_calls, "torch.compile": tiny_compile, "flex_attention": tiny_flex}


def preflight() -> int:
    failed = []
    for name, probe in PROBES.items():
        start = time.perf_counter()
        try:
            line = probe()
        except Exception as err:  # noqa: BLE001 - a probe reports, it does not stop the others
            failed.append(name)
            line = f"FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        print(f"{name}: {line} [{time.perf_counter() - start:.1f} s]", flush=True)
    print(f"preflight: {'FAILED: ' + ', '.join(failed) if failed else 'every probe ran'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--machine"]:
        print(json.dumps(machine()))
        sys.exit(0)
    sys.exit(preflight())
