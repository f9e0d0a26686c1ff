"""What a rendered tutorial page must not contain.

* **Empty code blocks.** A cell whose only lines are Sphinx-Gallery
  configuration comments (``# sphinx_gallery_tags = [...]`` right after the
  introduction) is rendered as an empty code block once
  ``remove_config_comments`` has removed them. They are dropped from the
  page.
* **Scripts from other hosts.** Sphinx-Gallery's computation-times pages load
  jQuery and DataTables from CDNs to make their table sortable; a page of this
  site loads nothing from other hosts, so the plain table stays.
"""

from __future__ import annotations

import re

from docutils import nodes

from gallery_layout import GALLERY_OUT

_REMOTE_RAW = re.compile(r"^(?P<i>[ ]*)\.\. raw:: html\n(?:\n|(?P=i)[ ]+.*\n)*", re.M)


def drop_empty_code_blocks(app, doctree) -> None:
    """``doctree-read``."""
    if not app.env.docname.startswith(GALLERY_OUT + "/"):
        return
    for block in list(doctree.findall(nodes.literal_block)):
        if not block.astext().strip():
            block.parent.remove(block)


def strip_remote_assets(app, docname, source) -> None:
    """``source-read``."""
    if docname.endswith("sg_execution_times"):
        source[0] = _REMOTE_RAW.sub(
            lambda m: m.group(0) if "https://" not in m.group(0) else "", source[0])


def setup(app):
    app.connect("doctree-read", drop_empty_code_blocks)
    app.connect("source-read", strip_remote_assets)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
