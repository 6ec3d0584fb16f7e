"""A report as safe HTML (docs/web-view.md#security): markdown with raw HTML escaped, only http(s) and in-page
links kept, and each chunk citation turned into a link the page opens."""

from __future__ import annotations

import re

# A citation as the synthesizer writes it, ``[chunk 12, path/to/file.md:10-58]``, or a direct answer's
# ``[chunk 12]``; matched on the already escaped HTML text, so what is re-inserted is escaped too.
_CITE = re.compile(r"\[chunk\s+(\d{1,18})(?:,\s*[^\]<>\n]{1,600})?\]", re.I)
_TAG = re.compile(r"(<[^>]*>)")
#: text inside these elements is shown as written: a citation in a code span stays code
_VERBATIM = {"a", "code", "pre"}
_SAFE_LINK = re.compile(r"^(?:https?://|#)", re.I)


def _parser():
    from markdown_it import MarkdownIt

    # html=False: any <script>, <img onerror=…> the model wrote becomes text; images are off so a report
    # cannot make the browser fetch a URL by itself being opened.
    md = MarkdownIt("commonmark", {"html": False}).enable("table").disable("image")
    md.validateLink = lambda url: bool(_SAFE_LINK.match(url.strip()))
    return md


def report_html(markdown: str) -> str:
    """``markdown`` (untrusted: a model wrote it from chunk text) as HTML that carries no markup of its own."""
    html = _parser().render(markdown or "")
    out, inside = [], 0
    for part in _TAG.split(html):
        if part.startswith("<"):
            name = re.match(r"</?([a-zA-Z0-9]+)", part)
            if name and name.group(1).lower() in _VERBATIM:
                inside += -1 if part.startswith("</") else 1
            if part.startswith('<a href="http'):  # away from the page, without telling it where from
                part = part[:-1] + ' rel="noopener noreferrer" target="_blank">'
            out.append(part)
        elif inside > 0:
            out.append(part)
        else:
            out.append(
                _CITE.sub(
                    lambda m: f'<a class="cite" data-chunk="{m.group(1)}" href="#chunk-{m.group(1)}">{m.group(0)}</a>',
                    part,
                )
            )
    return "".join(out)
