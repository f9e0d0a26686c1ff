""""Download the toolkit", "Run in Google Colab" and "View source on GitHub"
beside each page's downloads, at the end of the page and in the side bar.

"Download the toolkit" is a Sphinx download of ``tutorials/ragged_toolkit.py``
(the build copies it to ``_downloads/``, the same file for every page): the
module every page imports, which the page's own ``.py`` and notebook also
carry (``downloads.py``).

The repository and branch come from ``conf.py`` (``tutorials_github_repo``,
``tutorials_github_branch``). "View source" opens ``tutorials/<stem>.py`` on
that branch. Colab opens the page's notebook as the site publishes it: the
deploy workflow pushes the built notebooks to the branch
:data:`NOTEBOOKS_BRANCH` of the same repository, one ``<stem>.ipynb`` each,
since Colab opens notebooks from GitHub.
"""

from __future__ import annotations

from docutils import nodes
from sphinx import addnodes

from gallery_layout import GALLERY_SRC, TOOLKIT, tutorial_stem

NOTEBOOKS_BRANCH = "notebooks"
TOOLKIT_LABEL = "Download the toolkit"
TOOLKIT_CLASS = "tutorial-toolkit-link"


def links(config, stem: str) -> dict[str, tuple[str, str]]:
    """Key -> (label, URL) for one tutorial."""
    repo, branch = config.tutorials_github_repo, config.tutorials_github_branch
    return {
        "colab": ("Run in Google Colab",
                  f"https://colab.research.google.com/github/{repo}/blob/{NOTEBOOKS_BRANCH}/{stem}.ipynb"),
        "github": ("View source on GitHub",
                   f"https://github.com/{repo}/blob/{branch}/{GALLERY_SRC}/{stem}.py"),
    }


def toolkit_download(app, docname: str) -> addnodes.download_reference:
    """A download link to the toolkit module, registered as Sphinx's own
    ``:download:`` role registers its file."""
    target = f"/{GALLERY_SRC}/{TOOLKIT}"  # from the sources' root
    ref = addnodes.download_reference("", "", refdoc=docname, reftarget=target, refexplicit=True,
                                      classes=[TOOLKIT_CLASS])
    ref += nodes.literal("", f"{TOOLKIT_LABEL}: {TOOLKIT}", classes=["xref", "download"])
    rel, _ = app.env.relfn2path(target, docname)
    app.env.note_dependency(rel)
    ref["filename"] = app.env.dlfiles.add_file(docname, rel).as_posix()
    return ref


def add_links(app, doctree) -> None:
    """``doctree-read``: three more entries in Sphinx-Gallery's download
    footer: the toolkit right after the page's own .py, Colab and GitHub at
    the end."""
    stem = tutorial_stem(app.env.docname)
    if stem is None:
        return
    for footer in doctree.findall(nodes.container):
        if "sphx-glr-footer" not in footer["classes"]:
            continue
        box = nodes.container(classes=["sphx-glr-download", "sphx-glr-download-toolkit"])
        para = nodes.paragraph()
        para += toolkit_download(app, app.env.docname)
        box += para
        python = [i for i, child in enumerate(footer.children)
                  if "sphx-glr-download-python" in child.get("classes", [])]
        footer.insert(python[0] + 1 if python else len(footer.children), box)
        for key, (label, url) in links(app.config, stem).items():
            box = nodes.container(classes=["sphx-glr-download", f"sphx-glr-download-{key}"])
            para = nodes.paragraph()
            para += nodes.reference("", label, refuri=url, classes=[f"tutorial-{key}-link"])
            box += para
            footer += box
        break


def page_context(app, pagename, templatename, context, doctree) -> None:
    """``html-page-context``: the same links for the side-bar component."""
    stem = tutorial_stem(pagename)
    if stem is not None and doctree is not None:
        context["tutorial_links"] = links(app.config, stem)
        for ref in doctree.findall(addnodes.download_reference):
            if TOOLKIT_CLASS in ref["classes"] and "filename" in ref:
                context["tutorial_toolkit"] = {"link": f"_downloads/{ref['filename']}",
                                               "label": TOOLKIT_LABEL, "title": TOOLKIT}
                break


def setup(app):
    app.add_config_value("tutorials_github_repo", "", "html", types=[str])
    app.add_config_value("tutorials_github_branch", "main", "html", types=[str])
    app.connect("doctree-read", add_links)
    app.connect("html-page-context", page_context)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
