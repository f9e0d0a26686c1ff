"""The toolkit of the ragged-batch transformer tutorials: small modules, one
concern each, that the pages import.

A ragged batch is **packed values** ``(T, ...)``, every token of every
sequence end to end, plus **offsets** ``(B + 1,)``, where each sequence starts
and the last one ends (the ``cu_seqlens`` of FlashAttention and
``varlen_attn``). The modules:

* :mod:`ragged_toolkit.device`: the device and dtype a page computes in,
  tolerances, quick mode, quiet logs;
* :mod:`ragged_toolkit.batches`: lengths, offsets, positions, padding;
* :mod:`ragged_toolkit.attention`: :func:`~ragged_toolkit.attention.ragged_attention`
  and its backends, one module each, and the float32 reference;
* :mod:`ragged_toolkit.measure`: timings, profiles, compile counts and the
  noise rule that makes a choice; :mod:`ragged_toolkit.bound`: the work bound;
* :mod:`ragged_toolkit.layers`, :mod:`ragged_toolkit.gpt`,
  :mod:`ragged_toolkit.kv_cache`: a multi-head attention layer, a small GPT
  that runs packed or padded, a KV cache and greedy decoding;
* :mod:`ragged_toolkit.data`: real documents and the ways to pack them;
* :mod:`ragged_toolkit.data_parallel`: packed training on several ranks;
* :mod:`ragged_toolkit.serving`: continuous batching over a paged KV cache;
* :mod:`ragged_toolkit.figures`: the pictures the pages draw.

A page imports each name from its module (``from ragged_toolkit.batches
import token_index``), so the build knows which modules each page uses. It
needs PyTorch 2.11 or later and numpy.
"""

import torch

MINIMUM_TORCH = (2, 11)


def _release(version):
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


# (a documentation build without torch reads the package against a stand-in
# whose __version__ is no string: nothing to check there)
if isinstance(torch.__version__, str) and _release(torch.__version__) < MINIMUM_TORCH:
    raise RuntimeError(
        f"The tutorials need PyTorch {'.'.join(map(str, MINIMUM_TORCH))} or later; "
        f"this is {torch.__version__}. Upgrade with `pip install -U torch`."
    )
