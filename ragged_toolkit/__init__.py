"""The library of the ragged-batch transformer tutorials: the technique only,
what a reader lifts into a trainer or a server. It needs PyTorch 2.11 or
later and numpy, nothing else.

A ragged batch is **packed values** ``(T, ...)``, every token of every
sequence end to end, plus **offsets** ``(B + 1,)``, where each sequence starts
and the last one ends (the ``cu_seqlens`` of FlashAttention and
``varlen_attn``). The modules:

* :mod:`ragged_toolkit.batches`: lengths, offsets, positions, padding;
* :mod:`ragged_toolkit.attention`: a batch's plan (``plan_batch``, built
  once by the caller), :func:`~ragged_toolkit.attention.ragged_attention`
  and its backends, one module each;
* :mod:`ragged_toolkit.layers`, :mod:`ragged_toolkit.layouts`,
  :mod:`ragged_toolkit.gpt`: a multi-head attention layer, the layouts a
  model's attention reads a batch through, a small GPT;
* :mod:`ragged_toolkit.kv_cache`, :mod:`ragged_toolkit.decoding`: a KV cache
  and a paged one, a packed prefill and greedy decoding;
* :mod:`ragged_toolkit.data`: real documents and the ways to pack them;
* :mod:`ragged_toolkit.data_parallel`: packed training on several ranks;
* :mod:`ragged_toolkit.recurrent`, :mod:`ragged_toolkit.recurrent_hf`,
  :mod:`ragged_toolkit.hybrid`: recurrent layers over packed sequences;
* :mod:`ragged_toolkit.serving`: serving requests over the paged cache
  (requests, paged attention, the engine, schedulers, the server, the
  prefix cache, shared-prefix attention);
* :mod:`ragged_toolkit.device`, :mod:`ragged_toolkit.clock`: the default
  device and dtype, the one clock.

The site's own machinery (measuring, figures, proofs, page setup) is a
second package, :mod:`ragged_site`, which imports this one and never the
reverse.
"""

import torch

__all__ = []

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
