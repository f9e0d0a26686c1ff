"""Sphinx configuration for the ragged-batch transformer tutorials."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).parent.resolve()
sys.path.insert(0, str(HERE / "sphinxext"))

import gallery_helpers  # noqa: E402

# -- Project -----------------------------------------------------------------
project = "Ragged-batch transformers in PyTorch"
author = "The ragged-transformers tutorial contributors"
copyright = "2026, " + author

# -- General -----------------------------------------------------------------
extensions = [
    "sphinx.ext.mathjax",
    "sphinx_gallery.gen_gallery",
    "sphinx_design",
    "sphinx_copybutton",
]
root_doc = "index"
templates_path = ["_templates"]
exclude_patterns = [
    "_build",
    ".venv",
    ".ci",
    ".github",
    "tests",
    "scripts",
    "sphinxext",
    "README.md",
    "CONTRIBUTING.md",
    "_generated",  # included from index.rst, not a page of its own
    "tutorials",  # sources; Sphinx-Gallery renders them into auto_tutorials/
    "**/*.ipynb",
    "auto_tutorials/*.md5",
]
# A broken cross-reference is an error (with -W), not a silently dead link.
nitpicky = True
suppress_warnings = []

# -- HTML output --------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = project
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_favicon = "_static/favicon.svg"
# The theme warns in the console when no colour mode is set.
html_context = {"default_mode": "auto"}
html_last_updated_fmt = None
html_show_sourcelink = False
html_theme_options = {
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    "secondary_sidebar_items": ["page-toc", "sg_download_links"],
}
# Math is rendered by a copy of MathJax served from _static: a built page
# loads nothing from a CDN (Sphinx points at jsdelivr by default).
mathjax_path = "mathjax/tex-svg.js"
mathjax3_config = {
    "options": {"enableMenu": False},
    "svg": {"fontCache": "global"},
}

# -- Sphinx-Gallery ------------------------------------------------------------
# The notebook a reader downloads starts by installing the pins it was built with.
_tutorial_pins = [
    line.strip()
    for line in (HERE / "requirements-tutorials.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]

sphinx_gallery_conf = {
    "examples_dirs": gallery_helpers.GALLERY_SRC,
    "gallery_dirs": gallery_helpers.GALLERY_OUT,
    # Execute every file in tutorials/, not only files named plot_*.
    # `make html GALLERY_PATTERN=name` narrows this to the matching files.
    "filename_pattern": os.environ.get("GALLERY_PATTERN") or r"/",
    "ignore_pattern": r"__init__\.py",
    # Report every failing tutorial, then fail the build with their tracebacks
    # (file and line), rather than stopping at the first.
    "abort_on_example_error": False,
    "only_warn_on_example_error": False,
    # Seeds, dtype, device, dynamo and matplotlib state are reset before and
    # after every tutorial; before, the build also records the environment
    # stamp and arms the per-tutorial time limit.
    "reset_modules": ("matplotlib", "gallery_helpers.reset_state"),
    "reset_modules_order": "both",
    # CUDA peak allocated when CUDA runs, peak RSS of the build on CPU.
    "show_memory": gallery_helpers.PeakMemory(),
    "write_computation_times": True,
    "junit": "sphinx-gallery/junit-results.xml",
    "first_notebook_cell": "%pip install " + " ".join(_tutorial_pins),
    "download_all_examples": False,
    "remove_config_comments": True,
    # Reading order, not file names: gallery_helpers.READING_ORDER.
    "within_subsection_order": "gallery_helpers.TutorialOrder",
    "min_reported_time": 0,
    "plot_gallery": "True",
    "capture_repr": ("_repr_html_", "__repr__"),
    "matplotlib_animations": False,
    "image_srcset": [],
    "backreferences_dir": None,
    "line_numbers": False,
}

copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True


def setup(app):
    app.connect("source-read", gallery_helpers.add_environment_stamp)
    app.connect("source-read", gallery_helpers.strip_remote_assets)
    # After Sphinx-Gallery's own builder-inited handler (priority 500), so
    # that the thumbnails the cards point at exist.
    app.connect("builder-inited", gallery_helpers.write_landing_cards, priority=900)
