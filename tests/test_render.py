"""The report's markdown → HTML (rlm_api/ui/render.py): paths are literal text and citations stay links."""

from __future__ import annotations

import pytest

from rlm_api.ui.render import report_html


def _cite(chunk: int, shown: str) -> str:
    return f'<a class="cite" data-chunk="{chunk}" href="#chunk-{chunk}">{shown}</a>'


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        ("kombu/__init__.py", "kombu/__init__.py"),
        ("celery/app/_state.py", "celery/app/_state.py"),
        ("pkg/__main__.py", "pkg/__main__.py"),
        ("src/*/x_*.py", "src/*/x_*.py"),
        ("docs/**/*.md", "docs/**/*.md"),
        ("we`ird`/a.py", "we`ird`/a.py"),
        ("a<b>.md", "a&lt;b&gt;.md"),
    ],
)
def test_a_citation_of_any_path_is_one_link_showing_the_path_as_written(path, shown):
    html = report_html(f"The beat wakes up here [chunk 7, celery:{path}:10-58].")
    assert _cite(7, f"[chunk 7, celery:{shown}:10-58]") in html
    assert "<strong>" not in html and "<em>" not in html and "<code>" not in html


def test_path_like_tokens_outside_citations_are_literal():
    html = report_html("Defined in kombu/__init__.py, next to __init__ and celery/*_tasks.py.")
    assert "kombu/__init__.py" in html and " __init__ " in html and "celery/*_tasks.py" in html
    assert "<strong>" not in html and "<em>" not in html


def test_markdown_around_paths_still_works():
    html = report_html(
        "**Answer**: see **kombu/__init__.py** and _the [docs](https://example.com/a__b__/c_d)_.\n\n"
        "| file | where |\n| --- | --- |\n| kombu/__init__.py | [chunk 2, kombu/__init__.py:1-9] |\n\n"
        "_Written offline: no model read it._"
    )
    assert "<strong>Answer</strong>" in html and "<strong>kombu/__init__.py</strong>" in html
    assert 'href="https://example.com/a__b__/c_d"' in html
    assert "<td>kombu/__init__.py</td>" in html and _cite(2, "[chunk 2, kombu/__init__.py:1-9]") in html
    assert "<em>Written offline: no model read it.</em>" in html


def test_a_citation_in_code_stays_code_and_placeholders_cannot_be_forged():
    html = report_html("`[chunk 9, a/__b__.py:1-2]` and\n\n```\nkombu/__init__.py [chunk 3]\n```\n\nrlmheld0x0x")
    assert "<code>[chunk 9, a/__b__.py:1-2]</code>" in html
    assert "<pre><code>kombu/__init__.py [chunk 3]\n</code></pre>" in html
    assert 'class="cite"' not in html and "rlmheld0x0x" in html


@pytest.mark.parametrize(
    ("markdown", "shown"),
    [
        ('> "Set **/etc/default/celeryd** first." (a.md:5)', "<strong>/etc/default/celeryd</strong>"),
        ("Run **./run_all.sh** once.", "<strong>./run_all.sh</strong>"),
        ("Edit *./celery_config.py* here.", "<em>./celery_config.py</em>"),
        ("Every **/etc/x is here**.", "<strong>/etc/x is here</strong>"),
    ],
)
def test_emphasis_around_a_path_is_rendered_not_shown_as_stars(markdown, shown):
    html = report_html(markdown)
    assert shown in html and "*" not in html.replace(shown, ""), html


def test_a_glob_keeps_its_stars():
    html = report_html("Matches **/*.md and src/*_test.py.")
    assert "**/*.md" in html and "src/*_test.py" in html and "<strong>" not in html and "<em>" not in html
