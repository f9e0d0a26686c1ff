""""Run in Google Colab" and "View source on GitHub" beside each page's
downloads, at the end of the page and in the side bar.

The repository and branch come from ``conf.py`` (``tutorials_github_repo``,
``tutorials_github_branch``). "View source" opens ``tutorials/<stem>.py`` on
that branch. Colab opens the page's notebook as the site publishes it: the
deploy workflow pushes the built notebooks to the branch
:data:`NOTEBOOKS_BRANCH` of the same repository, one ``<stem>.ipynb`` each,
since Colab opens notebooks from GitHub.
"""

from __future__ import annotations

from docutils import nodes

from gallery_layout import GALLERY_SRC, tutorial_stem

NOTEBOOKS_BRANCH = "notebooks"


def links(config, stem: str) -> dict[str, tuple[str, str]]:
    """Key -> (label, URL) for one tutorial."""
    repo, branch = config.tutorials_github_repo, config.tutorials_github_branch
    return {
        "colab": ("Run in Google Colab",
                  f"https://colab.research.google.com/github/{repo}/blob/{NOTEBOOKS_BRANCH}/{stem}.ipynb"),
        "github": ("View source on GitHub",
                   f"https://github.com/{repo}/blob/{branch}/{GALLERY_SRC}/{stem}.py"),
    }


def add_links(app, doctree) -> None:
    """``doctree-read``: two more entries in Sphinx-Gallery's download footer."""
    stem = tutorial_stem(app.env.docname)
    if stem is None:
        return
    for footer in doctree.findall(nodes.container):
        if "sphx-glr-footer" not in footer["classes"]:
            continue
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


def setup(app):
    app.add_config_value("tutorials_github_repo", "", "html", types=[str])
    app.add_config_value("tutorials_github_branch", "main", "html", types=[str])
    app.connect("doctree-read", add_links)
    app.connect("html-page-context", page_context)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
