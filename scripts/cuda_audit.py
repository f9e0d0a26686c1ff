"""The CUDA plan audit: each page's CUDA sizes, at full size and in quick
mode, checked on a machine without a GPU against what the GPU run will ask
of them, before a lent GPU's minutes are spent finding out.

A page states its sizes in one literal dict at its top, ``SIZES = {"cuda":
{...}, "cpu": {...}, "quick": {...}}`` (CONTRIBUTING.md, "Device and
sizes"). The audit reads it with ``ast.literal_eval`` (nothing of the page
runs), merges it as the page will on a GPU (``page_sizes(SIZES, "cuda",
quick)``), and checks, for ``full`` and ``quick``:

* attention: every head configuration, at any depth (a dict with a width
  of :data:`WIDTH` and a head count of :data:`HEADS`, or a ``head_dim``;
  key/value heads :data:`KV_HEADS`): the width divides into the heads, the
  heads into the key/value heads, and the head size passes
  ``backend_support`` for ``varlen`` and ``flex`` on a CUDA GPU of compute
  capability 9.0 (the lent H100/H200) in ``bfloat16``, causal, with and
  without gradients;
* data: ``train_tokens`` at most the tokens (bytes) of
  ``docstring_corpus(min_chars, limit=corpus_documents)``, ``corpus_documents``
  and ``requests`` at most its documents (see :func:`data_faults`); the
  corpus is this Python's standard library, read once per process.

A page with no ``SIZES`` literal fails, named. With ``--fake`` (a CUDA build
of PyTorch, no GPU needed), each ``GPTConfig`` the CUDA sizes describe is
also built and run on a fake CUDA device (``FakeTensorMode``: shapes, dtypes
and devices, no data), through the library's public API alone, patching
nothing of it: :func:`fake_forward` says what runs and how far it reaches.

``python scripts/cuda_audit.py [--fake] [--pages PATTERN] [PAGE.py ...]``
prints a line per page and mode and each fault, and exits 1 if there is any
(``tests/test_cuda_audit.py`` runs it over every page).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import functools
import inspect
import re
import sys
import unittest.mock
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask

from ragged_site.corpus import docstring_corpus
from ragged_site.page import page_sizes
from ragged_toolkit.attention import BatchPlan, backend_support, plan_batch
from ragged_toolkit.attention.flex import FlexKernel
from ragged_toolkit.batches import offsets_from_lengths
from ragged_toolkit.gpt import GPT, GPTConfig
from ragged_toolkit.kv_cache import CachedStep, KVCache
from ragged_toolkit.layouts import PackedLayout

MODES = ("full", "quick")
BACKENDS = ("varlen", "flex")  # the CUDA paths the pages call through ragged_attention
CAPABILITY = (9, 0)  # the lent GPU machine: one H100 or H200
DTYPE = torch.bfloat16  # default_dtype on such a GPU

WIDTH = ("dim", "hidden_size", "embed", "d_model")
HEADS = ("n_heads", "num_attention_heads", "heads", "nhead")
KV_HEADS = ("n_kv_heads", "num_key_value_heads", "kv_heads")
_CORPUS_DEFAULTS = {name: p.default for name, p in inspect.signature(docstring_corpus).parameters.items()}


class NoSizes(ValueError):
    """A page states no usable ``SIZES`` literal."""


def read_sizes(path: Path) -> dict:
    """The ``SIZES`` dict a page assigns at its top level, read from its
    source with ``ast.literal_eval`` (``dict(key=literal, ...)`` read as a
    dict display). Raises :class:`NoSizes` naming the page and what is wrong."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=str(path))
    found = [node for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             and any(isinstance(t, ast.Name) and t.id == "SIZES"
                     for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))]
    if not found:
        raise NoSizes(f"{Path(path).name}: no SIZES literal at the top level: state the CUDA, CPU and quick sizes "
                      "in one dict, SIZES = {'cuda': {...}, 'cpu': {...}, 'quick': {...}} "
                      "(CONTRIBUTING.md, 'Device and sizes')")
    where = f"{Path(path).name}, line {found[0].lineno}"
    try:
        sizes = ast.literal_eval(ast.fix_missing_locations(_DictCalls().visit(copy.deepcopy(found[0].value))))
    except ValueError as err:
        raise NoSizes(f"{where}: SIZES is not a literal ({err}): write its values out, so that it can be read "
                      "without running the page") from None
    if not isinstance(sizes, dict) or not {"cuda", "cpu"} <= set(sizes) \
            or not all(isinstance(sizes.get(k, {}), dict) for k in ("cuda", "cpu", "quick")):
        raise NoSizes(f"{where}: SIZES must be a dict with 'cuda' and 'cpu' dicts and an optional 'quick' dict")
    unknown = set(sizes) - {"cuda", "cpu", "quick"}
    if unknown:
        raise NoSizes(f"{where}: SIZES has keys {sorted(unknown)}; only 'cuda', 'cpu' and 'quick'")
    return sizes


class _DictCalls(ast.NodeTransformer):
    # dict(a=1, b=2), as CONTRIBUTING.md writes SIZES, is {"a": 1, "b": 2}; any other call stays, and fails
    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args \
                and all(k.arg is not None for k in node.keywords):
            return ast.copy_location(ast.Dict(keys=[ast.Constant(k.arg) for k in node.keywords],
                                              values=[k.value for k in node.keywords]), node)
        return node


def nested(sizes: dict, where: str = ""):
    """``(where, d)`` for ``sizes`` and every dict nested in it, ``where``
    its dotted path ("" at the top)."""
    yield where, sizes
    for key, value in sizes.items():
        if isinstance(value, dict):
            yield from nested(value, f"{where}.{key}" if where else key)


def not_integers(values: dict, least: int) -> list[str]:
    """A fault for each of ``values`` that is not an integer of at least ``least`` (1 or 0)."""
    kind = "positive" if least else "non-negative"
    return [f"{k} {v!r} is not a {kind} integer" for k, v in values.items() if type(v) is not int or v < least]


# --- attention -------------------------------------------------------------------------

class Heads(NamedTuple):
    where: str  # "model", "top level", ...
    width: int | None
    heads: int | None
    kv_heads: int | None
    head_dim: int | None  # as stated


def find_heads(sizes: dict) -> list[Heads]:
    """Every head configuration in ``sizes``, its nested dicts too."""
    first = lambda d, names: next((d[n] for n in names if n in d), None)
    return [Heads(where or "top level", first(d, WIDTH), first(d, HEADS), first(d, KV_HEADS), d.get("head_dim"))
            for where, d in nested(sizes) if first(d, HEADS) is not None or "head_dim" in d]


def capability():
    """``torch.cuda.get_device_capability`` answering 9.0, as on the GPU
    machine (``tests/test_gpu_rules.py`` does the same)."""
    return unittest.mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: CAPABILITY)


def head_faults(h: Heads) -> tuple[int | None, list[str]]:
    """The head size of ``h`` and what is wrong with it on the GPU machine."""
    bad = not_integers({k: v for k, v in zip(Heads._fields[1:], h[1:]) if v is not None}, 1)
    if bad:
        return None, [f"{h.where}: {', '.join(bad)}"]
    if h.head_dim is None and h.width is None:
        return None, [f"{h.where}: {h.heads} heads but no width ({', '.join(WIDTH)}) or head_dim to size them"]
    head_dim = h.head_dim or h.width // h.heads
    faults = [f"{h.where}: width {h.width} does not divide into {h.heads} heads"] \
        if h.head_dim is None and h.width % h.heads else []
    gqa = None not in (h.heads, h.kv_heads) and h.kv_heads != h.heads
    if gqa and h.heads % h.kv_heads:
        faults.append(f"{h.where}: {h.heads} query heads do not divide into {h.kv_heads} key/value heads")
    with capability():
        for backend in BACKENDS:
            why = {backend_support(backend, "cuda", DTYPE, is_causal=True, needs_grad=grad, gqa=gqa,
                                   head_dim=head_dim) for grad in (False, True)} - {None}
            faults += [f"{h.where}: head size {head_dim} on {backend}: {w}" for w in sorted(why)]
    return head_dim, faults


# --- data ------------------------------------------------------------------------------

@functools.cache
def corpus_lengths(min_chars: int) -> tuple[int, ...]:
    """The length in tokens (bytes) of every document of the corpus with at
    least ``min_chars`` characters, all of them: read once per process."""
    documents, _ = docstring_corpus(min_chars=min_chars, limit=None)
    return tuple(len(d) for d in documents)


def corpus_call(path: Path) -> dict:
    """The literal ``min_chars`` and ``limit`` a page passes to its first
    ``docstring_corpus(...)`` call, where it passes constants."""
    for node in ast.walk(ast.parse(Path(path).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == \
                "docstring_corpus":
            return {k.arg: k.value.value for k in node.keywords
                    if k.arg in ("min_chars", "limit") and isinstance(k.value, ast.Constant)}
    return {}


def data_faults(sizes: dict, call: dict | None = None) -> tuple[str, list[str]]:
    """What the sizes ask of the document corpus and what is wrong with it:
    (a line that says what was checked, faults). ``min_chars`` and the
    documents read: the sizes' (``min_chars`` or ``corpus_min_chars``,
    ``corpus_documents``), else the constants of the page's call
    (``call``, :func:`corpus_call`), else ``docstring_corpus``'s defaults."""
    call = {**_CORPUS_DEFAULTS, **(call or {})}
    asks = {f"{where}.{n}" if where else n: d[n] for where, d in nested(sizes)
            for n in ("train_tokens", "corpus_documents", "requests", "min_chars", "corpus_min_chars") if n in d}
    short = {name.split(".")[-1]: value for name, value in asks.items()}
    if not {"train_tokens", "corpus_documents", "requests"} & set(short):
        return "no corpus sizes", []
    bad = not_integers(asks, 0)
    if bad:
        return "corpus sizes", bad
    min_chars = short.get("corpus_min_chars", short.get("min_chars", call["min_chars"]))
    limit = short.get("corpus_documents", call["limit"])
    lengths = corpus_lengths(min_chars)
    read = lengths[:limit]
    tokens = sum(read)
    read_as = f"docstring_corpus(min_chars={min_chars}, limit={limit})"
    faults = []
    if short.get("corpus_documents", 0) > len(lengths):
        faults.append(f"corpus_documents {short['corpus_documents']:,} > the {len(lengths):,} documents of at "
                      f"least {min_chars} characters the corpus has")
    if short.get("train_tokens", 0) > tokens:
        faults.append(f"train_tokens {short['train_tokens']:,} > the {tokens:,} tokens of the {len(read):,} "
                      f"documents read ({read_as}): {short['train_tokens'] / max(tokens, 1):.2f}x the corpus")
    if short.get("requests", 0) > len(read):
        faults.append(f"requests {short['requests']:,} > the {len(read):,} documents read ({read_as})")
    return (f"corpus (min_chars {min_chars}): {len(lengths)} documents; the first {len(read)} hold {tokens:,} "
            "tokens"), faults


# --- a page ----------------------------------------------------------------------------

@dataclasses.dataclass
class PageAudit:
    stem: str
    lines: list[str]  # what was checked, one line per mode (and, with fake, per model and backend)
    faults: list[str]  # "page (mode): what is wrong"


def audit_page(path: Path, fake: bool = False) -> PageAudit:
    """The audit of one page's CUDA sizes, at full size and in quick mode;
    ``fake``: with :func:`fake_forward` of each GPT model they describe."""
    stem = Path(path).stem
    try:
        sizes = read_sizes(path)
    except NoSizes as err:
        return PageAudit(stem, [], [str(err)])
    lines, faults, call = [], [], corpus_call(path)
    for mode in MODES:
        chosen = page_sizes(sizes, "cuda", mode == "quick")
        heads = []
        for h in find_heads(chosen):
            head_dim, wrong = head_faults(h)
            faults += [f"{stem} ({mode}): {w}" for w in wrong]
            if head_dim is not None:
                kv = f" ({h.kv_heads} key/value)" if h.kv_heads not in (None, h.heads) else ""
                heads.append(f"{h.where}: {h.heads or '?'} heads{kv} of {head_dim}")
        data, wrong = data_faults(chosen, call)
        faults += [f"{stem} ({mode}): {w}" for w in wrong]
        lines.append(f"{stem} ({mode}): {'; '.join(heads) or 'no attention sizes'}; {data}")
        models = gpt_models(chosen) if fake else []
        if fake and not models:
            lines.append(f"{stem} ({mode}): no GPTConfig in the CUDA sizes")
        for where, model in models:
            ok, wrong = fake_forward(model)
            lines += [f"{stem} ({mode}) {where}: {line}" for line in ok]
            faults += [f"{stem} ({mode}) {where}: {w}" for w in wrong]
    return PageAudit(stem, lines, faults)


def audit(paths: list[Path], fake: bool = False) -> list[PageAudit]:
    return [audit_page(p, fake) for p in paths]


def page_paths(source: Path = ROOT, pattern: str = "") -> list[Path]:
    """Every page: each ``tutorials/*.py`` (a new page is audited with no change here)."""
    return sorted(p for p in (Path(source) / "tutorials").glob("*.py") if re.search(pattern, p.stem))


# --- fake CUDA tensors -----------------------------------------------------------------

def fake_cuda_reason() -> str | None:
    """Why fake CUDA tensors cannot be made with this PyTorch (None if they can)."""
    return None if torch.version.cuda else (f"PyTorch {torch.__version__} is a CPU build: fake CUDA tensors need "
                                            "a CUDA build (no GPU needed), e.g. 2.11.0+cu130, the GPU machine's")


def gpt_models(sizes: dict) -> list[tuple[str, dict]]:
    """The dicts in ``sizes`` that describe a ``GPTConfig`` (every field
    without a default is there)."""
    need = {f.name for f in dataclasses.fields(GPTConfig) if f.default is dataclasses.MISSING}
    return [(where or "top level", d) for where, d in nested(sizes) if need <= set(d)]


def on_fake_cuda(x):
    """``x`` with every tensor copied to the fake CUDA device (call inside
    ``FakeTensorMode``): a tensor, a ``BlockMask``, a tuple, or a
    ``BatchPlan``, field by field (its ``prepared`` and ``nonempty`` too).
    TODO(issue 38): were ``plan_batch`` to take the lengths its caller holds
    on the host, the plans could be built on the fake device, and this go."""
    if isinstance(x, (torch.Tensor, BlockMask)):
        return x.to("cuda")  # a real CPU tensor in the mode: a fake CUDA copy
    if isinstance(x, tuple):
        return tuple(on_fake_cuda(y) for y in x)
    if isinstance(x, BatchPlan):
        return dataclasses.replace(x, **{f.name: on_fake_cuda(getattr(x, f.name))
                                         for f in dataclasses.fields(x) if f.init})
    return x


def fake_forward(model: dict, backends=BACKENDS) -> tuple[list[str], list[str]]:
    """Build ``GPT(GPTConfig(**model))`` on a fake CUDA device in bfloat16 and
    run, for each backend, packed forwards of three sequences (``max_seq_len``
    tokens, about half, one) and of two others through ``PackedLayout(plan)``,
    then a decode step per sequence against a ``KVCache``: ``CachedStep``
    (SDPA with a mask) and a packed step through the backend (``kv_used``).
    Checks each output's shape, dtype and device. Returns (lines, faults).

    Reached: the model and ``ragged_attention`` as on the GPU (its checks and
    ``backend_support`` with a CUDA device, ``varlen``'s keyword adaptation
    to this release, dynamo tracing FlexAttention with dynamic shapes, to
    ``aot_eager``: inductor's lowering asks the driver). Not reached:
    ``plan_batch`` on a CUDA device (each plan is built on the host from real
    CPU offsets, as a fake tensor has no lengths to read, and copied to the
    fake device with :func:`on_fake_cuda`: the index tensors and
    ``BlockMask`` are built on the CPU, and the mask's function reads tables
    left there); any kernel (fake kernels check shapes and dtypes, not the
    CUDA kernels' limits: :func:`head_faults` does); inductor and triton; a
    backward pass; memory; numbers."""
    try:
        cfg = GPTConfig(**model)
    except TypeError as err:
        return [], [f"GPTConfig(**model): {err}"]
    longest, vocab = cfg.max_seq_len, cfg.vocab_size
    batches = ([longest, longest // 2 + 1, 1], [max(2, longest // 3), 7])
    prompts = batches[0]  # decode: one new token per sequence after its prompt
    b, lines, faults, default = len(prompts), [], [], torch.get_default_dtype()
    for backend in backends:
        try:
            plan = functools.partial(plan_batch, backend=backend, is_causal=True,
                                     flex=FlexKernel(dynamic=True, compile_backend="aot_eager"))
            plans = [plan(offsets_from_lengths(batch)) for batch in batches]
            decode_plan = plan(offsets_from_lengths([1] * b), offsets_from_lengths([longest + 1] * b),
                               kv_used=torch.tensor([k + 1 for k in prompts]))
            with capability(), FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
                torch.set_default_dtype(DTYPE)  # parameters made in bfloat16 (.to() cannot swap fake ones)
                with torch.device("cuda"):
                    net = GPT(cfg)
                torch.set_default_dtype(default)
                cache = KVCache(cfg, b, longest + 1, "cuda", DTYPE)
                slots = torch.tensor(prompts, device="cuda")
                new = torch.zeros(b, dtype=torch.long, device="cuda")
                _expect(net(new, slots, CachedStep(cache, slots)), (b, vocab), "CachedStep decode")
                with _flash_only(backend):
                    for batch, batch_plan in zip(batches, plans):
                        tokens = torch.zeros(sum(batch), dtype=torch.long, device="cuda")
                        positions = torch.cat([torch.arange(k, device="cuda") for k in batch])
                        out = net(tokens, positions, PackedLayout(on_fake_cuda(batch_plan)))
                        _expect(out, (sum(batch), vocab), f"packed forward of {batch}")
                    layout = PackedLayout(on_fake_cuda(decode_plan), cache, cache.row_offsets[:-1] + slots)
                    _expect(net(new, slots, layout), (b, vocab), "packed decode")
            lines.append(f"{backend}: packed forwards of {batches[0]} and {batches[1]} tokens, decode steps -> "
                         f"({b}, {vocab}), {str(DTYPE).removeprefix('torch.')} on cuda")
        except Exception as err:  # noqa: BLE001 - the fault is the finding
            text = str(err).strip().splitlines()
            faults.append(f"{backend}: {type(err).__name__}: {text[0][:300] if text else ''}")
        finally:
            torch.set_default_dtype(default)
    return lines, faults


def _flash_only(backend: str):
    """For ``varlen``: FlashAttention's kernel, chosen without asking the
    device. From 2.15 ``varlen_attn`` chooses between cuDNN and flash for a
    decode step (one query per sequence) by asking the driver, which a
    machine without a GPU has not; 2.11 has flash alone."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if backend == "varlen" else contextlib.nullcontext()


def _expect(t: torch.Tensor, shape: tuple, what: str) -> None:
    if tuple(t.shape) != shape or t.dtype != DTYPE or t.device.type != "cuda":
        raise AssertionError(f"{what}: {tuple(t.shape)} {t.dtype} on {t.device}, expected {shape} {DTYPE} on cuda")


# --- the command line ------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="*", type=Path, help="pages to audit (default: every tutorials/*.py)")
    ap.add_argument("--pages", dest="pattern", default="", help="only the pages whose name matches")
    ap.add_argument("--source", type=Path, default=ROOT, help="the site folder whose tutorials/ are audited")
    ap.add_argument("--fake", action="store_true", help="also run each GPT model on fake CUDA tensors "
                                                        "(a CUDA build of PyTorch)")
    args = ap.parse_args(argv)
    paths = args.pages or page_paths(args.source, args.pattern)
    print(f"cuda audit: PyTorch {torch.__version__}, a CUDA GPU of compute capability "
          f"{'.'.join(map(str, CAPABILITY))} assumed, {str(DTYPE).removeprefix('torch.')}; "
          f"the corpus of Python {sys.version.split()[0]}'s standard library")
    reason = fake_cuda_reason() if args.fake else None
    if reason:
        print(f"fake CUDA: not run: {reason}")
    results = audit(paths, fake=args.fake and not reason)
    faults = [f for r in results for f in r.faults]
    for line in (line for r in results for line in r.lines):
        print(f"  {line}")
    for fault in faults:
        print(f"FAULT {fault}")
    print(f"cuda audit: {len(paths)} pages, {len(faults)} faults")
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
