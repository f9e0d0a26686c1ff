"""The CUDA plan audit: each page's CUDA sizes, at full size and in quick
mode, checked on a machine without a GPU against what the GPU run will ask
of them, before a lent GPU's minutes are spent finding out.

A page states its sizes in one literal dict at its top (CONTRIBUTING.md,
"Device and sizes")::

    SIZES = {"cuda": {...}, "cpu": {...}, "quick": {...}}

The audit reads it from the page's source with ``ast.literal_eval`` (nothing
of the page runs), merges it as the page will on a GPU
(``ragged_site.page.page_sizes(SIZES, "cuda", quick)``), and checks,
for ``full`` and ``quick``:

* attention: every head configuration the sizes describe, found anywhere in
  them (a dict with a width ``dim``, ``hidden_size``, ``embed`` or
  ``d_model`` and a head count ``n_heads``, ``num_attention_heads``,
  ``heads`` or ``nhead``, or an explicit ``head_dim``; key/value heads
  ``n_kv_heads``, ``num_key_value_heads`` or ``kv_heads``): the width
  divides into the heads, the heads into the key/value heads, and the head
  size passes ``backend_support`` for ``varlen`` and ``flex`` on a CUDA GPU
  of compute capability 9.0 (the lent H100/H200) in ``bfloat16``, causal,
  with and without gradients;
* data: ``train_tokens`` at most the tokens (bytes) of
  ``docstring_corpus(min_chars, limit=corpus_documents)``, and
  ``corpus_documents`` and ``requests`` at most the documents there are
  (``min_chars`` and ``corpus_documents`` where the sizes state them, else
  ``docstring_corpus``'s defaults). The corpus is read once per process, from
  this Python's standard library.

A page with no ``SIZES`` literal fails, named. With ``--fake`` (a CUDA build
of PyTorch, no GPU needed), each model the CUDA sizes describe as a
``GPTConfig`` is also built on a fake CUDA device in ``bfloat16``
(``FakeTensorMode``: shapes, dtypes and devices, no data) and run: a packed
forward through ``PackedLayout(plan_batch(offsets, backend=b,
is_causal=True))`` for ``varlen`` and ``flex``, and decode steps against a
``KVCache`` (the fixed-shape ``CachedStep``, and a packed step through each
backend). See :func:`fake_forward` for how far that reaches.

``python scripts/cuda_audit.py [--fake] [--pages PATTERN] [PAGE.py ...]``
prints a line per page and mode and each fault, and exits 1 if there is any
(``tests/test_cuda_audit.py`` runs it over every page).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import inspect
import re
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ragged_toolkit.attention import backend_support  # noqa: E402
from ragged_site.corpus import docstring_corpus
from ragged_site.page import page_sizes  # noqa: E402

MODES = ("full", "quick")
BACKENDS = ("varlen", "flex")  # the CUDA paths the pages call through ragged_attention
CAPABILITY = (9, 0)  # the lent GPU machine: one H100 or H200
DTYPE = torch.bfloat16  # default_dtype on such a GPU

WIDTH = ("dim", "hidden_size", "embed", "d_model")
HEADS = ("n_heads", "num_attention_heads", "heads", "nhead")
KV_HEADS = ("n_kv_heads", "num_key_value_heads", "kv_heads")
HEAD_DIM = ("head_dim",)
_CORPUS_DEFAULTS = {name: p.default for name, p in inspect.signature(docstring_corpus).parameters.items()}


class NoSizes(ValueError):
    """A page states no usable ``SIZES`` literal."""


def read_sizes(path: Path) -> dict:
    """The ``SIZES`` dict a page assigns at its top level, read from its
    source with ``ast.literal_eval``. Raises :class:`NoSizes` naming the page
    and what is wrong."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=str(path))
    found = [node for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             and any(isinstance(t, ast.Name) and t.id == "SIZES"
                     for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))]
    if not found:
        raise NoSizes(f"{Path(path).name}: no SIZES literal at the top level: state the CUDA, CPU and quick sizes "
                      "in one dict, SIZES = {'cuda': {...}, 'cpu': {...}, 'quick': {...}} "
                      "(CONTRIBUTING.md, 'Device and sizes')")
    try:
        sizes = ast.literal_eval(_dict_calls_as_literals(found[0].value))
    except ValueError as err:
        raise NoSizes(f"{Path(path).name}, line {found[0].lineno}: SIZES is not a literal ({err}): write its "
                      "values out, so that it can be read without running the page") from None
    if not isinstance(sizes, dict) or not isinstance(sizes.get("cuda"), dict) or \
            not isinstance(sizes.get("cpu"), dict) or not isinstance(sizes.get("quick", {}), dict):
        raise NoSizes(f"{Path(path).name}, line {found[0].lineno}: SIZES must be a dict with 'cuda' and 'cpu' dicts "
                      "and an optional 'quick' dict")
    unknown = set(sizes) - {"cuda", "cpu", "quick"}
    if unknown:
        raise NoSizes(f"{Path(path).name}, line {found[0].lineno}: SIZES has keys {sorted(unknown)}; "
                      "only 'cuda', 'cpu' and 'quick'")
    return sizes


class _DictCalls(ast.NodeTransformer):
    # dict(a=1, b=2), as CONTRIBUTING.md writes SIZES, is {"a": 1, "b": 2}
    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args \
                and all(k.arg is not None for k in node.keywords):
            return ast.copy_location(ast.Dict(keys=[ast.Constant(k.arg) for k in node.keywords],
                                              values=[k.value for k in node.keywords]), node)
        return node


def _dict_calls_as_literals(node: ast.expr) -> ast.expr:
    """``node`` with every ``dict(key=literal, ...)`` written as a dict display,
    for ``ast.literal_eval``; any other call stays, and fails there."""
    import copy

    return ast.fix_missing_locations(_DictCalls().visit(copy.deepcopy(node)))


def cuda_sizes(sizes: dict, mode: str) -> dict:
    """The sizes a page picks on a GPU, at full size or in quick mode."""
    return page_sizes(sizes, "cuda", mode == "quick")


# --- attention -------------------------------------------------------------------------

class Heads(NamedTuple):
    where: str  # "model", "top level", ...
    width: int | None
    heads: int | None
    kv_heads: int | None
    head_dim: int | None  # as stated


def _first(node: dict, names: tuple[str, ...]):
    return next(((name, node[name]) for name in names if name in node), (None, None))


def find_heads(sizes: dict, where: str = "") -> list[Heads]:
    """Every head configuration in ``sizes``, its nested dicts too."""
    found = []
    (_, width), (_, heads), (_, kv), (_, head_dim) = (_first(sizes, names) for names in
                                                       (WIDTH, HEADS, KV_HEADS, HEAD_DIM))
    if heads is not None or head_dim is not None:
        found.append(Heads(where or "top level", width, heads, kv, head_dim))
    for key, value in sizes.items():
        if isinstance(value, dict):
            found += find_heads(value, f"{where}.{key}" if where else key)
    return found


@contextlib.contextmanager
def capability(cap=CAPABILITY):
    """``torch.cuda.get_device_capability`` answering ``cap``, as on the GPU
    machine (``tests/test_gpu_rules.py`` does the same)."""
    real = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: cap
    try:
        yield
    finally:
        torch.cuda.get_device_capability = real


def head_faults(h: Heads) -> tuple[int | None, list[str]]:
    """The head size of ``h`` and what is wrong with it on the GPU machine."""
    names = dict(zip(("width", "heads", "kv_heads", "head_dim"), h[1:]))
    bad = [f"{k} {v!r} is not a positive integer" for k, v in names.items()
           if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0)]
    if bad:
        return None, [f"{h.where}: {', '.join(bad)}"]
    faults = []
    if h.head_dim is not None:
        head_dim = h.head_dim
    elif h.width is None:
        return None, [f"{h.where}: {h.heads} heads but no width ({', '.join(WIDTH)}) or head_dim to size them"]
    else:
        head_dim = h.width // h.heads
        if h.width % h.heads:
            faults.append(f"{h.where}: width {h.width} does not divide into {h.heads} heads")
    if h.kv_heads is not None and h.heads is not None and h.heads % h.kv_heads:
        faults.append(f"{h.where}: {h.heads} query heads do not divide into {h.kv_heads} key/value heads")
    gqa = h.kv_heads is not None and h.heads is not None and h.kv_heads != h.heads
    with capability():
        for backend in BACKENDS:
            why = {backend_support(backend, "cuda", DTYPE, is_causal=True, needs_grad=grad, gqa=gqa,
                                   head_dim=head_dim) for grad in (False, True)} - {None}
            faults += [f"{h.where}: head size {head_dim} on {backend}: {w}" for w in sorted(why)]
    return head_dim, faults


# --- data ------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def corpus_lengths(min_chars: int) -> tuple[int, ...]:
    """The length in tokens (bytes) of every document of the corpus with at
    least ``min_chars`` characters, all of them: read once per process."""
    documents, _ = docstring_corpus(min_chars=min_chars, limit=None)
    return tuple(len(d) for d in documents)


def _find(sizes: dict, names: tuple[str, ...]) -> list[tuple[str, object]]:
    found = [(name, sizes[name]) for name in names if name in sizes]
    for key, value in sizes.items():
        if isinstance(value, dict):
            found += [(f"{key}.{n}", v) for n, v in _find(value, names)]
    return found


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
    asks = {name: value for name, value in _find(sizes, ("train_tokens", "corpus_documents", "requests",
                                                         "min_chars", "corpus_min_chars"))}
    short = {name.split(".")[-1]: value for name, value in asks.items()}
    if not {"train_tokens", "corpus_documents", "requests"} & set(short):
        return "no corpus sizes", []
    bad = [f"{n} {v!r} is not a non-negative integer" for n, v in asks.items()
           if not isinstance(v, int) or isinstance(v, bool) or v < 0]
    if bad:
        return "corpus sizes", bad
    min_chars = short.get("corpus_min_chars", short.get("min_chars", call["min_chars"]))
    limit = short.get("corpus_documents", call["limit"])
    lengths = corpus_lengths(min_chars)
    read = lengths[:limit]
    tokens = sum(read)
    line = (f"corpus (min_chars {min_chars}): {len(lengths)} documents; the first {len(read)} hold {tokens:,} "
            f"tokens")
    faults = []
    if "corpus_documents" in short and short["corpus_documents"] > len(lengths):
        faults.append(f"corpus_documents {short['corpus_documents']:,} > the {len(lengths):,} documents of at "
                      f"least {min_chars} characters the corpus has")
    if "train_tokens" in short and short["train_tokens"] > tokens:
        faults.append(f"train_tokens {short['train_tokens']:,} > the {tokens:,} tokens of the {len(read):,} "
                      f"documents read (docstring_corpus(min_chars={min_chars}, limit={limit})): "
                      f"{short['train_tokens'] / max(tokens, 1):.2f}x the corpus")
    if "requests" in short and short["requests"] > len(read):
        faults.append(f"requests {short['requests']:,} > the {len(read):,} documents read "
                      f"(docstring_corpus(min_chars={min_chars}, limit={limit}))")
    return line, faults


# --- a page ----------------------------------------------------------------------------

@dataclasses.dataclass
class PageAudit:
    stem: str
    lines: list[str]  # what was checked, one line per mode
    faults: list[str]  # "page (mode): what is wrong"


def audit_page(path: Path) -> PageAudit:
    """The audit of one page's CUDA sizes, at full size and in quick mode."""
    stem = Path(path).stem
    try:
        sizes = read_sizes(path)
    except NoSizes as err:
        return PageAudit(stem, [], [str(err)])
    lines, faults, call = [], [], corpus_call(path)
    for mode in MODES:
        chosen = cuda_sizes(sizes, mode)
        found = find_heads(chosen)
        heads = []
        for h in found:
            head_dim, wrong = head_faults(h)
            faults += [f"{stem} ({mode}): {w}" for w in wrong]
            if head_dim is not None:
                kv = f" ({h.kv_heads} key/value)" if h.kv_heads not in (None, h.heads) else ""
                heads.append(f"{h.where}: {h.heads or '?'} heads{kv} of {head_dim}")
        data, wrong = data_faults(chosen, call)
        faults += [f"{stem} ({mode}): {w}" for w in wrong]
        lines.append(f"{stem} ({mode}): {'; '.join(heads) or 'no attention sizes'}; {data}")
    return PageAudit(stem, lines, faults)


def audit(paths: list[Path]) -> list[PageAudit]:
    return [audit_page(p) for p in paths]


def page_paths(source: Path = ROOT, pattern: str = "") -> list[Path]:
    """Every page: each ``tutorials/*.py`` (a new page is audited with no change here)."""
    return sorted(p for p in (Path(source) / "tutorials").glob("*.py") if re.search(pattern, p.stem))


# --- fake CUDA tensors -----------------------------------------------------------------

def fake_cuda_reason() -> str | None:
    """Why fake CUDA tensors cannot be made with this PyTorch (None if they can)."""
    if torch.version.cuda is None:
        return (f"PyTorch {torch.__version__} is a CPU build: fake CUDA tensors need a CUDA build "
                "(no GPU needed), e.g. 2.11.0+cu130, the GPU machine's")
    return None


def gpt_models(sizes: dict, where: str = "") -> list[tuple[str, dict]]:
    """The dicts in ``sizes`` that describe a ``GPTConfig`` (every field
    without a default is there)."""
    from ragged_toolkit.gpt import GPTConfig

    need = {f.name for f in dataclasses.fields(GPTConfig) if f.default is dataclasses.MISSING}
    found = [(where or "top level", sizes)] if need <= set(sizes) else []
    for key, value in sizes.items():
        if isinstance(value, dict):
            found += gpt_models(value, f"{where}.{key}" if where else key)
    return found


class _Host:
    """Inside ``FakeTensorMode``: tensors on the fake CUDA device that keep
    their real values on the host, for the few reads ``plan_batch`` makes
    on the host (lengths as Python ints): ``plan._lengths``, ``kv_used.tolist()``,
    and the tables ``flex`` builds from the offsets with ``token_index``."""

    def __init__(self, mode, unset):
        self.mode, self.unset = mode, unset

    def tensor(self, values) -> torch.Tensor:
        """A fake CUDA tensor of ``values`` (a list or a real CPU tensor) that
        keeps them on the host."""
        with self.unset():
            host = torch.as_tensor(values)
        fake = host.to("cuda")  # a real CPU tensor in the mode: a fake CUDA copy
        fake._audit_host = host
        fake.tolist = host.tolist
        return fake

    def offsets_from_lengths(self, lengths, device=None):
        from ragged_toolkit import batches

        if isinstance(lengths, torch.Tensor):
            lengths = getattr(lengths, "_audit_host", lengths)
        with self.unset():
            host = batches.offsets_from_lengths(lengths)
        return self.tensor(host) if torch.device(device or "cpu").type == "cuda" else host

    def token_index(self, offsets):
        from ragged_toolkit import batches

        host = getattr(offsets, "_audit_host", None)
        if host is None:
            return batches.token_index(offsets)
        with self.unset():
            seq, pos = batches.token_index(host)
        return seq.to("cuda"), pos.to("cuda")

    def lengths(self, real):
        def _lengths(q_offsets, kv_offsets):
            q, kv = (getattr(t, "_audit_host", None) for t in (q_offsets, kv_offsets))
            if q is None or kv is None:
                raise RuntimeError("cuda_audit: an offsets tensor with no host values reached plan_batch")
            with self.unset():
                return real(q, kv)
        return _lengths


@contextlib.contextmanager
def fake_cuda():
    """``FakeTensorMode`` with CUDA as the lent machine has it (compute
    capability 9.0), the host reads of a plan answered from real values
    (:class:`_Host`). Yields the :class:`_Host`. The plans' FlexAttention
    kernel is the audit's own (:func:`fake_flex_kernel`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    from ragged_toolkit.attention import flex, plan

    host = _Host(None, unset_fake_temporarily)
    patches = [(plan, "_lengths", host.lengths(plan._lengths)),
               (plan, "offsets_from_lengths", host.offsets_from_lengths),
               (flex, "offsets_from_lengths", host.offsets_from_lengths), (flex, "token_index", host.token_index)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    torch._dynamo.reset()
    try:
        with capability(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
            host.mode = mode
            yield host
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        torch._dynamo.reset()


def fake_flex_kernel():
    """FlexAttention compiled as on CUDA (``dynamic=True``) but to
    ``aot_eager``: inductor's lowering asks the driver for the GPU's
    properties. The library's public seam: ``FlexKernel``'s
    ``compile_backend``."""
    from ragged_toolkit.attention.flex import FlexKernel

    return FlexKernel(dynamic=True, compile_backend="aot_eager")


def _model_on_fake_cuda(cfg):
    from ragged_toolkit.gpt import GPT

    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)  # parameters made in bfloat16 (.to() cannot swap fake parameters)
    try:
        with torch.device("cuda"):
            return GPT(cfg)
    finally:
        torch.set_default_dtype(default)


def fake_forward(model: dict, backends=BACKENDS) -> tuple[list[str], list[str]]:
    """Build ``GPT(GPTConfig(**model))`` on a fake CUDA device in bfloat16 and
    run, for each backend, a packed forward of three sequences (the longest
    ``max_seq_len``, one of about half, one of a single token) through
    ``PackedLayout(plan_batch(offsets, backend=b, is_causal=True))`` and one
    of two other sequences (FlexAttention should trace no second graph for
    it, as it compiles with dynamic shapes on CUDA), then a
    decode step for each sequence against a ``KVCache``: the fixed-shape
    ``CachedStep`` (SDPA with a mask) and a packed step through the backend
    (``plan_batch`` with ``kv_used``). Checks each output's shape, dtype and
    device. Returns (lines, faults).

    How far it reaches: the toolkit's own code runs as on the GPU (the
    checks of ``ragged_attention`` and ``backend_support`` with a CUDA
    device, ``varlen``'s keyword adaptation to this release, the plan's
    index tensors, the ``BlockMask`` ``create_block_mask`` builds on CUDA,
    dynamo tracing FlexAttention with dynamic shapes). Not reached: any
    kernel (fake kernels check shapes and dtypes, not the CUDA kernels'
    limits, which :func:`head_faults` checks from ``backend_support``),
    inductor and triton (lowering asks the driver), a backward pass,
    memory, and numbers."""
    from ragged_toolkit.attention import plan_batch
    from ragged_toolkit.gpt import GPTConfig
    from ragged_toolkit.kv_cache import CachedStep, KVCache
    from ragged_toolkit.layouts import PackedLayout

    try:
        cfg = GPTConfig(**model)
    except TypeError as err:
        return [], [f"GPTConfig(**model): {err}"]
    longest = cfg.max_seq_len
    lengths = [longest, longest // 2 + 1, 1]
    lines, faults = [], []
    for backend in backends:
        try:
            with fake_cuda() as host:
                flex = fake_flex_kernel()
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                net = _model_on_fake_cuda(cfg)
                # two packed batches of different sizes: one graph for both, with dynamic shapes
                for batch in (lengths, [max(2, longest // 3), 7]):
                    n = sum(batch)
                    tokens = torch.zeros(n, dtype=torch.long, device="cuda")
                    positions = torch.cat([torch.arange(k, device="cuda") for k in batch])
                    offsets = host.offsets_from_lengths(batch, "cuda")
                    with torch.no_grad(), _flash_only(backend):
                        layout = PackedLayout(plan_batch(offsets, backend=backend, is_causal=True, flex=flex))
                        _expect(net(tokens, positions, layout), (n, cfg.vocab_size), f"packed forward of {batch}")
                forward_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
                # decode: one new token per sequence after its prompt
                b = len(lengths)
                cache = KVCache(cfg, b, longest + 1, "cuda", DTYPE)
                cache.row_offsets = host.tensor([i * cache.capacity for i in range(b + 1)])
                slots = torch.tensor(lengths, device="cuda")
                new = torch.zeros(b, dtype=torch.long, device="cuda")
                with torch.no_grad():
                    step = net(new, slots, CachedStep(cache, slots))
                    _expect(step, (b, cfg.vocab_size), "CachedStep decode")
                    one_each = host.tensor(list(range(b + 1)))
                    used = host.tensor([k + 1 for k in lengths])
                    decode_plan = plan_batch(one_each, cache.row_offsets, backend=backend, is_causal=True,
                                             kv_used=used, flex=flex)
                    rows = cache.row_offsets[:-1] + slots
                    with _flash_only(backend):
                        step = net(new, slots, PackedLayout(decode_plan, cache, rows))
                    _expect(step, (b, cfg.vocab_size), "packed decode")
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
            compiled = (f"; FlexAttention traced {forward_graphs} graph(s) for both forwards, {graphs} with the "
                        "decode steps (dynamic shapes)") if backend == "flex" else ""
            lines.append(f"{backend}: packed forwards of {lengths} and {[max(2, longest // 3), 7]} tokens, decode "
                         f"steps -> ({b}, {cfg.vocab_size}), {str(DTYPE).removeprefix('torch.')} on cuda{compiled}")
        except Exception as err:  # noqa: BLE001 - the fault is the finding
            text = str(err).strip().splitlines()
            faults.append(f"{backend}: {type(err).__name__}: {text[0][:300] if text else ''}")
    return lines, faults


def _flash_only(backend: str):
    """For ``varlen``: FlashAttention's kernel, chosen without asking the
    device. From 2.15 ``varlen_attn`` chooses between cuDNN and flash for a
    decode step (one query per sequence) by asking the driver, which a
    machine without a GPU has not; 2.11 has flash alone."""
    if backend != "varlen":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def _expect(t: torch.Tensor, shape: tuple, what: str) -> None:
    if tuple(t.shape) != shape or t.dtype != DTYPE or t.device.type != "cuda":
        raise AssertionError(f"{what}: {tuple(t.shape)} {t.dtype} on {t.device}, expected {shape} {DTYPE} on cuda")


def fake_audit_page(path: Path) -> PageAudit:
    """:func:`fake_forward` for each GPT model of a page's CUDA sizes, at full
    size and in quick mode (a page without SIZES: nothing; :func:`audit_page`
    names it)."""
    stem = Path(path).stem
    try:
        sizes = read_sizes(path)
    except NoSizes:
        return PageAudit(stem, [], [])  # named by audit_page
    lines, faults = [], []
    for mode in MODES:
        models = gpt_models(cuda_sizes(sizes, mode))
        if not models:
            lines.append(f"{stem} ({mode}): no GPTConfig in the CUDA sizes")
        for where, model in models:
            ok, wrong = fake_forward(model)
            lines += [f"{stem} ({mode}) {where}: {line}" for line in ok]
            faults += [f"{stem} ({mode}) {where}: {w}" for w in wrong]
    return PageAudit(stem, lines, faults)


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
    results = audit(paths)
    if args.fake:
        reason = fake_cuda_reason()
        if reason:
            print(f"fake CUDA: not run: {reason}")
        else:
            results += [fake_audit_page(p) for p in paths]
    faults = [f for r in results for f in r.faults]
    for r in results:
        for line in r.lines:
            print(f"  {line}")
    for fault in faults:
        print(f"FAULT {fault}")
    print(f"cuda audit: {len(paths)} pages, {len(faults)} faults")
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
