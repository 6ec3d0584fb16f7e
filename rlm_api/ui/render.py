"""A report as safe HTML (docs/web-view.md#security): markdown with raw HTML escaped, only http(s) and in-page
links kept, each chunk citation turned into a link the page opens, and paths shown as written."""

from __future__ import annotations

import html as html_lib
import re
import secrets

from markdown_it import MarkdownIt

# A citation as the synthesizer writes it, ``[chunk 12, path/to/file.md:10-58]``, or a direct answer's
# ``[chunk 12]``.  Matched on the markdown before it is parsed: a path is literal text, and markdown would
# read ``kombu/__init__.py`` as emphasis and cut the citation in pieces (a backslash escape such as ``\]`` is
# kept inside it).
_CITE = re.compile(r"\[chunk\s+(\d{1,18})(?:,\s*(?:\\[^\n]|[^\]\\\n]){1,600})?\]", re.I)
# A path-like token outside citations (``kombu/__init__.py``, ``src/*.py``, ``__init__``): it starts after a
# space or punctuation other than a path's own, so a URL's inner parts stay out, and it ends on a letter, a
# digit or a dunder's "__", so the markers of ``**bold**`` and ``_emphasis._`` around it stay markdown.
_PATHISH = re.compile(r"(?<![\w/\\.`-])(?:\*(?=[./])|[\w.])[\w.*/-]*(?:[A-Za-z0-9]|__)")
_PATH_SHAPE = re.compile(r"/|\w\.\w|__\w+__")
#: what CommonMark unescapes: a backslash before ASCII punctuation
_MD_ESCAPE = re.compile(r"\\([!-/:-@\[-`{-~])")
_TAG = re.compile(r"(<[^>]*>)")
#: text inside these elements is shown as written: a citation in a code span stays code
_VERBATIM = {"a", "code", "pre"}
_SAFE_LINK = re.compile(r"^(?:https?://|#)", re.I)


def _parser():

    # html=False: any <script>, <img onerror=…> the model wrote becomes text; images are off so a report
    # cannot make the browser fetch a URL by itself being opened.
    md = MarkdownIt("commonmark", {"html": False}).enable("table").disable("image")
    md.validateLink = lambda url: bool(_SAFE_LINK.match(url.strip()))
    return md


def _is_path(token: str) -> bool:
    # only a token markdown could mangle is held back: emphasis needs "_" or "*"
    return bool(_PATH_SHAPE.search(token)) and ("_" in token or "*" in token)


def report_html(markdown: str) -> str:
    """``markdown`` (untrusted: a model wrote it from chunk text) as HTML that carries no markup of its own."""
    # Citations and paths are swapped for inert placeholders before parsing and put back, escaped, after.  The
    # placeholder's random part cannot be guessed by the text, so text cannot forge one.
    nonce = secrets.token_hex(8)
    held: list[tuple[str | None, str]] = []  # (chunk id of a citation, text as shown)

    def hold(chunk: str | None, text: str) -> str:
        held.append((chunk, text))
        return f"rlmheld{nonce}x{len(held) - 1}x"

    def path_token(m: re.Match[str]) -> str:
        token, star = m.group(0), ""
        # A leading "*" with another "*" right before it or right after the token is emphasis around a path
        # (``**/etc/celeryd**``, ``*./run.sh*``), not a glob's: held, it showed as literal stars.
        if token.startswith("*") and "*" in (m.string[m.start() - 1 : m.start()], m.string[m.end() : m.end() + 1]):
            star, token = "*", token[1:]
        return star + (hold(None, token) if _is_path(token) else token)

    source = _CITE.sub(lambda m: hold(m.group(1), _MD_ESCAPE.sub(r"\1", m.group(0))), markdown or "")
    source = _PATHISH.sub(path_token, source)
    placeholder = re.compile(rf"rlmheld{nonce}x(\d+)x")

    def restore(text: str, *, link: bool) -> str:
        def one(m: re.Match[str]) -> str:
            chunk, shown = held[int(m.group(1))]
            shown = html_lib.escape(shown)
            if chunk is None or not link:
                return shown
            return f'<a class="cite" data-chunk="{chunk}" href="#chunk-{chunk}">{shown}</a>'

        return placeholder.sub(one, text)

    out, inside = [], 0
    for part in _TAG.split(_parser().render(source)):
        if part.startswith("<"):
            name = re.match(r"</?([a-zA-Z0-9]+)", part)
            if name and name.group(1).lower() in _VERBATIM:
                inside += -1 if part.startswith("</") else 1
            if part.startswith('<a href="http'):  # away from the page, without telling it where from
                part = part[:-1] + ' rel="noopener noreferrer" target="_blank">'
            out.append(restore(part, link=False))  # a placeholder in an attribute (a link's URL) is text
        else:
            out.append(restore(part, link=inside <= 0))
    return "".join(out)
