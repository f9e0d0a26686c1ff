"""The order a reader takes the tutorials in.

``conf.py`` names :class:`TutorialOrder` as Sphinx-Gallery's
``within_subsection_order``; the landing cards use the same key. A tutorial
not listed in ``READING_ORDER`` comes after the listed ones, by file name,
and a listed name with no file is ignored, so adding a page needs no change
here beyond placing it in the list.
"""

from __future__ import annotations

from pathlib import Path

READING_ORDER = [
    "ragged_batches_intro",
    "transformer_building_blocks",
    "transformer_layers_for_ragged_batches",
    "packed_gpt_training",
    "hf_packed_training",
    "data_parallel_packed_training",
    "ragged_decoding_kv_cache_gqa",
    "which_attention_path",
]


def reading_order_key(stem: str) -> tuple[int, str]:
    if stem in READING_ORDER:
        return READING_ORDER.index(stem), ""
    return len(READING_ORDER), stem


class TutorialOrder:
    """Sphinx-Gallery ``within_subsection_order``: :data:`READING_ORDER`."""

    def __init__(self, src_dir):
        self.src_dir = src_dir

    def __repr__(self):  # a stable repr keeps Sphinx's pickled config stable
        return "gallery_order.TutorialOrder"

    def __call__(self, filename):
        return reading_order_key(Path(filename).stem)
