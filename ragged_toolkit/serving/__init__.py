"""Serving ragged requests over a paged KV cache
(:class:`~ragged_toolkit.kv_cache.PagedKVCache`), one concern per module:

* :mod:`.requests`: the request stream (prompts, output lengths, arrivals);
* :mod:`.paged_attention`: a step's layout and the three ways attention
  reads the cache through its block tables;
* :mod:`.engine`: one step, each request fed its next tokens, packed;
* :mod:`.schedulers`: static batches, and continuous batching with chunked
  prefill and preemption;
* :mod:`.server`: the simulated server and its clock, servers taking turns;
* :mod:`.prefix_cache`: the paged cache keeping every full block of a prefix;
* :mod:`.shared_prefix_attention`: decoding attention reading a shared
  prefix once.

A page imports each name from its module, so the build knows which
modules it uses.
"""

__all__ = []
