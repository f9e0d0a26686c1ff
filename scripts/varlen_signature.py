"""Print, as JSON, the public API of ``torch.nn.attention.varlen`` for the
interpreter running this script.

Records the torch version, whether the module imports (on this machine, CPU
or GPU), its public names (``__all__``, or ``dir()`` without underscores),
and for each public callable (``varlen_attn`` and ``varlen_attn_out`` first,
when present) the signature: every parameter's name, kind, default (repr)
and annotation (as a string).

Only the standard library is used besides ``torch`` itself (imported, not
required: without it the output says so), so it runs in any environment::

    .venvs/torch-2.15.0/bin/python scripts/varlen_signature.py
"""

from __future__ import annotations

import importlib
import inspect
import json
import platform
import sys
import traceback

MODULE = "torch.nn.attention.varlen"
FIRST = ("varlen_attn", "varlen_attn_out")


def _annotation(obj) -> str | None:
    if obj is inspect.Parameter.empty:
        return None
    if isinstance(obj, str):
        return obj
    return inspect.formatannotation(obj)


def describe(fn) -> dict:
    """A callable's signature, parameter by parameter."""
    out: dict = {"type": type(fn).__name__}
    target = fn
    if isinstance(fn, type):
        out["kind"] = "class"
    else:
        out["kind"] = "callable"
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is not None:
        out["wraps"] = getattr(wrapped, "__qualname__", repr(wrapped))
    out["module"] = getattr(fn, "__module__", None)
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError) as e:
        out["signature_error"] = f"{type(e).__name__}: {e}"
        return out
    out["signature"] = str(sig)
    out["parameters"] = [
        {
            "name": p.name,
            "kind": p.kind.name,
            "default": None if p.default is inspect.Parameter.empty else repr(p.default),
            "has_default": p.default is not inspect.Parameter.empty,
            "annotation": _annotation(p.annotation),
        }
        for p in sig.parameters.values()
    ]
    out["return_annotation"] = _annotation(sig.return_annotation)
    return out


def main() -> int:
    result: dict = {"python": platform.python_version(), "executable": sys.executable}
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        result["torch_import_error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(result, indent=1))
        return 0
    result["torch"] = torch.__version__
    result["cuda_build"] = torch.version.cuda
    result["cuda_available"] = torch.cuda.is_available()
    try:
        mod = importlib.import_module(MODULE)
    except Exception as e:  # noqa: BLE001
        result["imports"] = False
        result["import_error"] = f"{type(e).__name__}: {e}"
        result["import_traceback"] = traceback.format_exc().splitlines()[-6:]
        print(json.dumps(result, indent=1))
        return 0
    result["imports"] = True
    result["file"] = getattr(mod, "__file__", None)
    has_all = hasattr(mod, "__all__")
    result["__all__"] = list(mod.__all__) if has_all else None
    public_dir = sorted(n for n in dir(mod) if not n.startswith("_"))
    result["dir_public"] = public_dir
    names = list(mod.__all__) if has_all else []
    names += [n for n in FIRST if hasattr(mod, n) and n not in names]
    # public names defined in the module itself (not re-exported imports)
    for n in public_dir:
        obj = getattr(mod, n)
        if n not in names and getattr(obj, "__module__", None) == MODULE and callable(obj):
            names.append(n)
    names = [n for n in FIRST if n in names] + [n for n in names if n not in FIRST]
    result["present"] = {n: hasattr(mod, n) for n in FIRST}
    members = {}
    for n in names:
        if not hasattr(mod, n):
            members[n] = {"missing": True}
            continue
        obj = getattr(mod, n)
        if callable(obj):
            members[n] = describe(obj)
        else:
            members[n] = {"kind": "value", "type": type(obj).__name__, "repr": repr(obj)[:300]}
    result["members"] = members
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
