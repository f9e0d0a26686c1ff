"""Sphinx configuration for the ragged-batch transformer tutorials.

Only what differs from Sphinx's and Sphinx-Gallery's defaults is set here;
the build's own code lives in small extensions in ``sphinxext/``.
"""

import os
import sys
from pathlib import Path

HERE = Path(__file__).parent.resolve()
sys.path.insert(0, str(HERE / "sphinxext"))
# The toolkit package the pages import (ragged_toolkit/, beside this file):
# this site's own copy, first on the path, for the pages and for its
# reference page (autodoc), also where another copy is installed.
sys.path.insert(0, str(HERE))

import tutorial_isolation  # noqa: E402
from gallery_layout import GALLERY_OUT, GALLERY_SRC  # noqa: E402

# -- Where the site is published: the one place to change ---------------------
# The GitHub repository and branch the pages link to ("View source on GitHub",
# "Run in Google Colab"). A placeholder until the repository exists.
tutorials_github_repo = "ragged-transformers/tutorials"
tutorials_github_branch = "main"
# Where GitHub Pages publishes the site: the downloaded notebooks link there,
# and install the toolkit's wheel from there when it is not beside them.
tutorials_site_url = "https://ragged-transformers.github.io/tutorials/"

# -- Project -----------------------------------------------------------------
project = "Ragged-batch transformers in PyTorch"
author = "The ragged-transformers tutorial contributors"
copyright = "2026, " + author

# -- Build environment ----------------------------------------------------------
# Every tutorial runs in a process of its own, killed past the time limit,
# so nothing one page does reaches another; the pages compile into the
# build's own inductor/Triton cache, empty when the build began (set
# TORCHINDUCTOR_CACHE_DIR to choose one; the page stamp says which).
# sphinxext/tutorial_isolation.py.
tutorial_isolation.use_private_compile_cache()
tutorial_isolation.run_each_tutorial_in_its_own_process()
# torch.profiler's kineto prints "USDT ... profiler_start/stop" on stderr for
# every profiled region; its lowest level above those lines is 6.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# -- General -----------------------------------------------------------------
extensions = [
    "sphinx.ext.mathjax",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "sphinx_gallery.gen_gallery",
    "sphinx_design",
    "sphinx_copybutton",
    # sphinxext/
    "gallery_layout",  # before Sphinx-Gallery: pages of deleted tutorials out, pages of changed modules stale
    "page_parts",  # landing cards, the build stamp, Colab/GitHub/toolkit links; no empty code blocks
    "downloads",  # the toolkit's wheel; the .py, notebook and zip a reader downloads run alone
    "gpu_results",  # the page gpu_results.rst: a recorded GPU run (gpu-results/), apart from this build's figures
]
templates_path = ["_templates"]
exclude_patterns = [
    "_build",
    ".venv",
    ".venvs",
    "tests",
    "_generated",  # included from index.rst, not a page of its own
    GALLERY_SRC,  # sources; Sphinx-Gallery renders them into GALLERY_OUT
]
# A broken cross-reference is an error (with -W), not a silently dead link.
nitpicky = True

# The toolkit's reference page (toolkit.rst) documents the module itself. A
# build that executes nothing (the GPU workflow's merge job) has no torch:
# autodoc then reads the module against stand-ins for torch and numpy.
autodoc_member_order = "bysource"
autodoc_typehints = "none"
# A method without a docstring of its own (a module's forward) is not listed.
autodoc_inherit_docstrings = False
try:
    import torch  # noqa: F401
except ImportError:
    autodoc_mock_imports = ["torch", "numpy"]

# -- HTML output --------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = project
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_js_files = ["site.js"]  # each figure opens at full size on a click
html_favicon = "_static/favicon.svg"
# The theme warns in the console when no colour mode is set.
html_context = {"default_mode": "auto"}
html_show_sourcelink = False
# No left sidebar on the tutorial pages: the article takes its width, so that
# a code line of scripts/line_widths.py's MAX_CHARS fits at a 1280 px window
# (_static/site.css). The header links to the tutorials; each page links to
# the next and the previous one.
html_sidebars = {"auto_tutorials/*": []}
html_theme_options = {
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    "secondary_sidebar_items": ["page-toc", "sg_download_links", "tutorial_links"],
}
# Math is rendered by a copy of MathJax served from _static: a built page
# loads nothing from a CDN (Sphinx points at jsdelivr by default).
mathjax_path = "mathjax/tex-svg.js"
mathjax3_config = {
    "options": {"enableMenu": False},
    "svg": {"fontCache": "global"},
}

# -- Sphinx-Gallery ------------------------------------------------------------
# The tags line under each page in words: Sphinx-Gallery writes an emoji there,
# which shows as a missing-glyph box where no emoji font is installed.
import sphinx_gallery.gen_rst  # noqa: E402

sphinx_gallery.gen_rst.TAGS_CONTENT = sphinx_gallery.gen_rst.TAGS_CONTENT.replace("\U0001f3f7 ", "")

sphinx_gallery_conf = {
    "examples_dirs": GALLERY_SRC,
    "gallery_dirs": GALLERY_OUT,
    # Execute every file in tutorials/, not only files named plot_*.
    # `make html GALLERY_PATTERN=name` narrows this to the matching files.
    "filename_pattern": os.environ.get("GALLERY_PATTERN") or r"/",
    "ignore_pattern": r"__init__\.py",
    # Reading order, not file names: sphinxext/gallery_layout.py.
    "within_subsection_order": "gallery_layout.TutorialOrder",
    # Each tutorial runs in a fresh process (sphinxext/tutorial_isolation.py):
    # only matplotlib's defaults are set before it, as Sphinx-Gallery does.
    "reset_modules": ("matplotlib",),
    "reset_modules_order": "before",
    # The peak of the tutorial's own process: CUDA allocated with CUDA, peak
    # RSS on CPU; every code block runs through it (sphinxext/tutorial_isolation.py).
    "show_memory": tutorial_isolation.PeakMemory(),
    "junit": "sphinx-gallery/junit-results.xml",
    # Each figure also at twice its resolution, for sharp text on dense
    # screens; it is shown at its drawn size (FIGURE_STYLE in the toolkit).
    "image_srcset": ["2x"],
    # No cell before the title: the downloaded notebook's install cell comes
    # right after it (sphinxext/downloads.py).
    "first_notebook_cell": None,
    "download_all_examples": False,
    "remove_config_comments": True,
}

copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
