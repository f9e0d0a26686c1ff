"""The landing page's card grid: one card per tutorial, in reading order.

The title, the description and the tags of a card are what Sphinx-Gallery
itself reads from the tutorial (``split_code_and_text_blocks`` and
``extract_intro_and_title``, the calls its page generator makes), so any
file it accepts gets a card: any title underline, a label or directive
before the title, no tags, no thumbnail. A card's tags link to the gallery
index filtered by that tag (Sphinx-Gallery's own tag filter, ``?sg-tags=``).

The cards are written at ``builder-inited`` before Sphinx-Gallery's own
handler, so a file whose metadata Sphinx-Gallery would reject fails the
build in seconds, naming itself, before any tutorial is executed.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from sphinx.errors import ExtensionError
from sphinx_gallery import py_source_parser
from sphinx_gallery.gen_rst import extract_intro_and_title

import gallery_layout
from gallery_layout import GALLERY_OUT
from gallery_order import reading_order_key

CARDS = Path("_generated") / "cards.rst"


def card_info(path: Path) -> dict:
    """Title, description and tags of one tutorial, as Sphinx-Gallery reads
    them; ExtensionError naming the file when it would reject it."""
    try:
        file_conf, blocks = py_source_parser.split_code_and_text_blocks(str(path))
        intro, title = extract_intro_and_title(str(path), blocks[0].content)
    except ExtensionError as err:
        raise ExtensionError(f"{path}: {err}") from None
    except (SyntaxError, ValueError) as err:
        raise ExtensionError(f"{path}: Sphinx-Gallery cannot read this file: {err}") from None
    tags = file_conf.get("tags", [])
    if not (isinstance(tags, list) and all(isinstance(t, str) and t.strip() for t in tags)):
        raise ExtensionError(f"{path}: sphinx_gallery_tags must be a list of words, got {tags!r}")
    thumb = file_conf.get("thumbnail_number", 1)
    if isinstance(thumb, bool) or not isinstance(thumb, int):
        raise ExtensionError(f"{path}: sphinx_gallery_thumbnail_number must be a whole number, "
                             f"got {thumb!r}")
    return {"stem": path.stem, "title": title, "description": intro, "tags": tags}


def tutorial_sources(src_dir: Path) -> list[Path]:
    """The tutorials in reading order."""
    return sorted(gallery_layout.tutorial_sources(src_dir), key=lambda p: reading_order_key(p.stem))


def cards_rst(src_dir: Path) -> str:
    out = [".. grid:: 1 2 2 3", "   :gutter: 3", ""]
    for path in tutorial_sources(src_dir):
        card = card_info(path)
        stem = card["stem"]
        out += [
            f"   .. grid-item-card:: {card['title']}",
            f"      :link: {GALLERY_OUT}/{stem}",
            "      :link-type: doc",
            f"      :img-top: /{GALLERY_OUT}/images/thumb/sphx_glr_{stem}_thumb.png",
            f"      :img-alt: Thumbnail of {card['title']}",
            "      :class-card: tutorial-card",
            "",
            f"      {card['description']}",
            "",
        ]
        if card["tags"]:
            badges = " ".join(
                f":bdg-link-secondary:`{tag} <{GALLERY_OUT}/index.html?sg-tags={quote(tag)}>`"
                for tag in card["tags"])
            out += ["      " + badges, ""]
    return "\n".join(out) + "\n"


def write_cards(app) -> None:
    """``builder-inited``, before Sphinx-Gallery: ``_generated/cards.rst``."""
    src_dir = Path(app.srcdir)
    target = src_dir / CARDS
    target.parent.mkdir(exist_ok=True)
    text = cards_rst(src_dir)
    if not target.exists() or target.read_text() != text:
        target.write_text(text)


def setup(app):
    # Sphinx-Gallery generates (and executes) the gallery at priority 500.
    app.connect("builder-inited", write_cards, priority=400)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
