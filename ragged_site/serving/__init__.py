"""The serving pages' machinery, one concern per module:

* :mod:`.metrics`: throughput, the slot bound, latency, and their pictures;
* :mod:`.proof`: every request against decoding it alone;
* :mod:`.batching`: one step on every paged attention path, the cache step by step;
* :mod:`.runs`: servers run again and again, the spread of their runs;
* :mod:`.prefix_tree`: the tree of the prefix cache's blocks, and its picture;
* :mod:`.shared_prompts`: requests that share their beginnings.
"""

__all__ = []
