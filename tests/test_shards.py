"""The shard planner and merger that the GPU workflow calls."""

from __future__ import annotations

import json
import re
import sys

import pytest

from pages import soup
from sitebuild import FIXTURES, REPO, build, make_site

sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "sphinxext"))
import shards  # noqa: E402
from gallery_layout import is_image_of  # noqa: E402

DUR = {
    "a": {"seconds": 300}, "b": {"seconds": 200}, "c": {"seconds": 200},
    "d": {"seconds": 100}, "e": {"seconds": 100, "needs_gpu": True},
}


def test_plan_balances_longest_first():
    p = shards.plan(list(DUR), DUR, shards=2)
    assert sorted(s for sh in p for s in sh["tutorials"]) == sorted(DUR)
    loads = sorted(sh["seconds"] for sh in p)
    assert loads == [400.0, 500.0]  # LPT: a+d | b+c+e or a+e | b+c+d ...
    assert max(loads) - min(loads) <= 100


def test_plan_is_reproducible():
    assert shards.plan(list(DUR), DUR, 3) == shards.plan(list(reversed(DUR)), DUR, 3)


def test_gpu_tutorials_only_on_gpu_shards():
    p = shards.plan(list(DUR), DUR, shards=3, gpu_shards=1)
    gpu = [sh for sh in p if sh["runner"] == "gpu"]
    assert len(gpu) == 1 and "e" in gpu[0]["tutorials"]
    assert all("e" not in sh["tutorials"] for sh in p if sh["runner"] == "cpu")


def test_gpu_tutorial_without_gpu_shard_is_an_error():
    with pytest.raises(ValueError, match="need a GPU"):
        shards.plan(list(DUR), DUR, shards=2, gpu_shards=0)


def test_unknown_tutorial_counts_as_the_longest_known():
    p = shards.plan(["new", "a", "d"], {"a": {"seconds": 300}, "d": {"seconds": 10}}, 2)
    by = {s: sh for sh in p for s in sh["tutorials"]}
    assert by["new"]["index"] != by["a"]["index"]
    # The planned load says what the unknown tutorial was counted as.
    assert sorted(sh["seconds"] for sh in p) == [300.0, 310.0]


def test_more_shards_than_tutorials_plans_only_shards_with_work(tmp_path, capsys):
    # An empty shard would run `make html` with a pattern that matches no
    # tutorial, which the validator fails: the plan the workflow reads has none.
    assert [sh["tutorials"] for sh in shards.plan(["a"], DUR, shards=3)] == [["a"]]
    (tmp_path / "tutorials").mkdir()
    for stem in ("a", "b"):
        (tmp_path / "tutorials" / f"{stem}.py").write_text("")
    assert shards.main(["plan", "--shards", "3", "--tutorials", str(tmp_path / "tutorials"),
                        "--durations", str(tmp_path / "none.json")]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert sorted(s for sh in planned for s in sh["tutorials"]) == ["a", "b"]
    assert all(sh["tutorials"] for sh in planned) and len(planned) == 2


def test_pattern_selects_exactly_its_files():
    pat = shards.pattern_for(["ragged_intro", "b"])
    assert re.search(pat, "/site/tutorials/ragged_intro.py")
    assert re.search(pat, "/site/tutorials/b.py")
    assert not re.search(pat, "/site/tutorials/ab.py")
    assert not re.search(pat, "/site/tutorials/ragged_intro_2.py")


def test_record_reads_junit_and_rejects_zero_time(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuite><testcase classname="x" file="tutorials/a.py" '
                     'name="a" time="12.34"/></testsuite>')
    out = tmp_path / "d.json"
    data = shards.record(junit, out, needs_gpu=["a"])
    assert data["tutorials"]["a"] == {"seconds": 12.3, "needs_gpu": True}
    assert json.loads(out.read_text()) == data
    junit.write_text('<testsuite><testcase file="tutorials/a.py" name="a" time="0"/></testsuite>')
    with pytest.raises(ValueError, match="no run time"):
        shards.record(junit, out, [])


def test_durations_file_is_well_formed():
    # A tutorial with no recorded duration yet (a new page) is planned as the
    # longest known one, so the file need not list every tutorial.
    recorded = shards.load_durations(REPO / ".github" / "tutorial-durations.json")
    assert recorded and all(d["seconds"] > 0 for d in recorded.values())


def _fake_shard(root, executed, also_present):
    """A shard folder as Sphinx-Gallery leaves it: the executed tutorial's
    files and figures, and placeholder thumbnails for the others."""
    g = root / "auto_tutorials"
    (g / "images" / "thumb").mkdir(parents=True)
    for stem in [executed, *also_present]:
        (g / f"{stem}.rst").write_text(f"{stem} from {root.name}")
        (g / "images" / "thumb" / f"sphx_glr_{stem}_thumb.png").write_text(
            f"{'real' if stem == executed else 'placeholder'} thumb of {stem}")
    (g / f"{executed}.py.md5").write_text("x")
    (g / "images" / f"sphx_glr_{executed}_001.png").write_text(f"figure of {executed}")
    return g


@pytest.mark.parametrize("order", [("attn", "attn_gqa"), ("attn_gqa", "attn")])
def test_merge_matches_stems_exactly_when_one_is_a_prefix_of_another(tmp_path, order):
    dirs, plan = [], []
    for i, stem in enumerate(order):
        other = [s for s in order if s != stem]
        dirs.append(_fake_shard(tmp_path / f"shard{i}", stem, other))
        plan.append({"index": i, "tutorials": [stem]})
    out = tmp_path / "merged"
    shards.merge(dirs, plan, out)
    for stem in order:
        assert (out / "images" / "thumb" / f"sphx_glr_{stem}_thumb.png").read_text() == f"real thumb of {stem}"
        assert (out / "images" / f"sphx_glr_{stem}_001.png").read_text() == f"figure of {stem}"


def test_image_names_are_matched_exactly():
    assert is_image_of("sphx_glr_attn_001.png", "attn")
    assert is_image_of("sphx_glr_attn_thumb.png", "attn")
    assert is_image_of("sphx_glr_attn_001_2_00x.png", "attn")
    assert not is_image_of("sphx_glr_attn_gqa_001.png", "attn")
    assert not is_image_of("sphx_glr_attn_gqa_thumb.png", "attn")


def _pages(html):
    return {str(p.relative_to(html)) for p in html.rglob("*.html")}


def test_two_shards_merge_into_the_single_build(tmp_path, fixture_site):
    tutorials = sorted((FIXTURES / "tutorials").glob("*.py"))
    stems = [p.stem for p in tutorials]
    p = shards.plan(stems, {}, shards=2)
    assert all(len(sh["tutorials"]) == 1 for sh in p)
    shard_dirs = []
    for sh in p:
        site = make_site(tmp_path / f"shard{sh['index']}", tutorials=tutorials)
        result = build(site, env={"GALLERY_PATTERN": sh["pattern"]})
        assert result.returncode == 0, result.log[-5000:]
        assert "successfully executed 1 out of 1 file" in result.log
        shard_dirs.append(site / "auto_tutorials")

    merged = make_site(tmp_path / "merged", tutorials=tutorials)
    assert shards.merge(shard_dirs, p, merged / "auto_tutorials") == sorted(stems)
    final = build(merged)
    assert final.returncode == 0, final.log[-5000:]
    assert re.search(r"successfully executed 0 out of 0 file", final.log), final.log[-3000:]
    assert _pages(final.html) == _pages(fixture_site.html)
    for stem in stems:
        page = soup(final.html / "auto_tutorials" / f"{stem}.html")
        assert page.select("div.sphx-glr-script-out"), f"{stem}: merged page lost its output"


def test_merge_refuses_a_shard_that_did_not_execute(tmp_path):
    empty = tmp_path / "shard0"
    empty.mkdir()
    with pytest.raises(ValueError, match="did not execute"):
        shards.merge([empty], [{"index": 0, "tutorials": ["a"]}], tmp_path / "out")
