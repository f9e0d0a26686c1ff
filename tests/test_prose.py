"""The pages' prose reads like pytorch/tutorials': short sentences, counted by
``scripts/sentence_lengths.py`` (issue 43). Every page in ``tutorials/``,
new ones included, is held to its limits."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import sentence_lengths  # noqa: E402

PAGES = sorted((REPO / "tutorials").glob("*.py"))


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_every_page_has_short_sentences(page):
    result = sentence_lengths.measure(page)
    assert result["sentences"] > 10, f"{page.name}: no prose found (the counter lost its blocks)"
    long = "\n".join(f"  [{sentence_lengths.words(s)}] {s}" for s in result["long"])
    assert not result["fails"], (
        f"{page.name}: {'; '.join(result['fails'])}; rewrite with "
        f"`python scripts/sentence_lengths.py {page.relative_to(REPO)} --long`:\n{long}"
    )


SAMPLE = '''"""
A title
=======

The first sentence has five words. The second one, e.g. this, has ``a.b``
and :doc:`a page <target>` in it!

**Author:** someone

.. note::

   A directive is left out. Its sentences are not counted.
"""

# %%
# A section
# ---------
# A block's sentence.
#
# * A bullet without a full stop
# * Another bullet. With two sentences
#
# A literal block follows::
#
#    code = "is not prose. At all."
#
# | a | table |

x = 1  # a comment in code. It is not prose.
'''


def test_the_counter_splits_as_documented(tmp_path):
    page = tmp_path / "sample.py"
    page.write_text(SAMPLE)
    found = sentence_lengths.page_sentences(page)
    assert [sentence_lengths.words(s) for s in found] == [6, 12, 3, 6, 2, 3, 4], found
    result = sentence_lengths.measure(page)
    assert result["max"] == 12 and result["median"] == 4 and not result["fails"]


def test_the_limits_fail_a_long_sentence(tmp_path):
    page = tmp_path / "long.py"
    page.write_text('"""\nTitle\n=====\n\n' + " ".join(["word"] * 46) + ".\n" + '"""\n')
    assert sentence_lengths.measure(page)["fails"] == ["median 46 > 15", "p90 46.0 > 30", "max 46 > 45"]
