"""Which line of the chunks answers the question: the offline provider's ranking of the passages it may quote.

The extractive provider (``extractive.py``) sees only what a stage put in its prompt (the request's
``stage_input``), so it ranks with what that holds and with what the worker already has at hand:

- **search rank**: chunks appear in the message in the order the search ranked them (the direct answer's
  chunks, an analyst batch's slice of the ranking), so a chunk's position is a prior;
- **meaning**: each passage, with its context, embedded by the buffers' encoder (the one the search embedded
  the query with; local, no network) and compared with the query's vector, which is what found the chunk's
  nearest window in the first place, one line at a time instead of one window;
- **words**: BM25 over the candidate passages of the message, identifiers split into their parts (and the
  question's words found inside run-together ones: ``urlparse``);
- **shape**: in code, a definition (``name = value``, ``name=Option(…)``, ``'key': value``, a signature's
  ``param=default``, ``def``, ``class``) is what a "default …" or "where is … defined" question wants; a
  comment or docstring only describes it, so the definition carries its neighbouring documentation's words
  (past a signature laid out over many lines) and the documentation itself ranks below any code line that
  matches as well; so does a message (a line whose words are mostly inside its string literals), and a line
  with nothing of its own (``pass``, ``return None``) is never quoted for what its context matched;
- **agreement**: words shared with a passage whose meaning is unrelated to the question are a coincidence
  and count less;
- **intent**: the question's wording says which definition: a value ("the default …", "how many …": a literal,
  under a name that measures what is asked) or code ("the function that …", "how do I …": a ``def`` or
  ``class``, or for "where does … happen" the function whose body holds the best line).

A passage's context is its own text, the line it is nested under (``broker=Namespace(`` above
``heartbeat=Option(120)``: the setting's full name) and, for a definition, the comment or docstring lines
next to it.  Prose passages (sentences of a paragraph) are matched as they are.

Nothing here executes or obeys chunk text: it is tokenised, embedded and measured.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..config import get_settings
from ..ingest.embed import get_embedder, resolve_runtime
from ..pipeline.prompts import unescape_content
from ..pipeline.records import CODE_LINE
from ..search.service import query_vector
from ..search.tokenize import tokenize

log = logging.getLogger("rlm.llm.line_rank")

#: file suffixes read as code (comments and docstrings there are documentation, not the answer)
CODE_SUFFIXES = frozenset(
    ".py .pyi .js .jsx .ts .tsx .mjs .cjs .go .rs .java .kt .kts .scala .c .h .cc .cpp .hpp .cs .rb .php .swift "
    ".m .sh .bash .zsh .ps1 .lua .pl .r .jl .ex .exs .erl .hs .ml .clj .sql .toml .ini .cfg .conf .yaml .yml "
    ".json .tf .proto .gradle .cmake .mk .dockerfile".split()
)
#: a chunk of an unknown suffix is code when this share of its non-blank lines look like code
CODE_SHARE = 0.4
#: a definition or assignment: ``def f``/``class C``/``fn f``…, ``name = value``, ``name=Option(``,
#: ``'key': value``, ``key: value`` (YAML), ``#define NAME``
_DEFINITION = re.compile(
    r"""^\s*(?:
        (?:(?:export|pub|public|private|protected|static|async|abstract|final|override|inline)\s+)*
        (?:def|class|function|fn|func|struct|enum|interface|trait|impl|module|type|macro|defmacro)\s+[\w$]
      | (?:(?:const|let|var|val|final|static|readonly)\s+)*[\w$.\[\]]+\s*(?::\s*[^=\n]{1,60})?=(?![=>])
      | ['"][^'"\n]{1,80}['"]\s*:
      | [\w.-]+\s*:\s+\S
      | \#\s*define\s+\w
    )""",
    re.X,
)
#: a function's own line: what is assigned anywhere under it is local, not a definition a reader looks up
_FUNCTION = re.compile(r"^(?:(?:async|export|pub|public|private|protected|static)\s+)*(?:def|function|fn|func)\b")
#: the line above a nested one that makes it local: a function body or signature, a statement's block
_LOCAL_SCOPE = re.compile(
    _FUNCTION.pattern
    + r"|^(?:if|elif|else|for|while|with|try|except|finally|catch|switch|case|match|return|do|foreach)\b"
)
_TRAILING_COMMENT = re.compile(r"\s(?:#|//)\s.*$")
_COMMENT = re.compile(r"^\s*(?:#|//|/\*|\*|--|;;|<!--|%)")
_TRIPLE = re.compile(r'"""|\'\'\'')
_DOCSTRING_OPENERS = ('"""', "'''")
#: a documentation line next to a definition that the definition takes in: the docstring right after it, the
#: comment lines right above it
DOC_LINES_AFTER = 3
DOC_LINES_BEFORE = 3
#: words of "where is X defined", "what is X set to", "the default X": the question wants a definition
_DEFINITION_QUESTION = re.compile(
    r"\b(?:default\w*|defined?|definition|declared?|set\s+to|configured?|setting|value|where\s+is|where\s+are|"
    r"which|how\s+(?:many|long|much|often))\b",
    re.I,
)
#: a question after a value: "the default X", "is X enabled"; and after a number: "how many", "how long"
_VALUE_QUESTION = re.compile(r"\b(?:default\w*|set\s+to|value|enabled?|disabled?|on\s+or\s+off|name\s+of)\b", re.I)
_HOW_MUCH = r"how\s+(?:many|long|much|often|big|large|soon)|number\s+of"
_NUMBER_QUESTION = re.compile(
    rf"\b(?:{_HOW_MUCH}|max(?:imum)?|min(?:imum)?|limit|timeout|interval|size|version|port|count)\b", re.I
)
#: "how many", "how long": asked for a number, which a line without a digit does not give
_COUNT_QUESTION = re.compile(rf"\b(?:{_HOW_MUCH})\b", re.I)
#: a definition that gives a literal value, possibly through a call: ``x = 3``, ``x=Option(120``, ``'x':
#: 'json'``; group 1 a number (``3 * 60`` too), 2 a string or boolean.  None/null says "no value": no answer.
_LITERAL = re.compile(
    r"""[=:]\s*(?:[\w.]+\()?\s*(?:([-+]?\d[\d_.]*(?:\s*[*+]\s*\d[\d_.]*)*)|(['"][^'"\n]*['"]|True|False|true|false))"""
    r"""\s*[,)}\]\s*#*]"""
)


#: a question after code to call or read rather than a value: a function, a class, "how do I …", "where is …
#: implemented"
_HOW_DO_I = r"how\s+(?:can|do|does|should|would|could)\s+(?:i|we|you|one)"
_CALLABLE_QUESTION = re.compile(
    r"\b(?:functions?|methods?|class(?:es)?|decorators?|callables?|enums?|exceptions?|errors?\s+class|"
    rf"implement\w*|code\s+that|{_HOW_DO_I}\b)",
    re.I,
)
#: a question after the place where something is done
_WHERE_QUESTION = re.compile(
    r"\bwhere\b|\bwhich\s+(?:function|method|class|code|module|file)\b|\bfunctions?\b|\bmethods?\b"
    r"|\bhow\s+(?:can|do|does|should)\s+(?:i|we|you|one)\b",
    re.I,
)
#: a definition of something called (a function, a class, a type), as opposed to a name given a value
_CALLABLE_DEF = re.compile(
    r"^\s*(?:(?:export|pub|public|private|protected|static|async|abstract|final|override|inline)\s+)*"
    r"(?:def|class|function|fn|func|struct|enum|interface|trait|impl|module|macro|defmacro)\s+[\w$]"
)


#: a name spelled as code (``IntRange``, ``max_retries``), not an English word a question uses anyway
_IDENTIFIER_LIKE = re.compile(r"\w_\w|[a-z][A-Z]")
_ASKS_FUNCTION = re.compile(rf"\b(?:functions?|methods?|{_HOW_DO_I})\b", re.I)
_ASKS_TYPE = re.compile(r"\b(?:class(?:es)?|enums?|exceptions?|types?|structs?|interfaces?)\b", re.I)
_TYPE_DEF = re.compile(
    r"^\s*(?:(?:export|pub|public|private|protected|abstract|final)\s+)*(?:class|struct|enum|interface|trait)\s"
)


def _asks_other_callable(query: str, line: str) -> bool:
    """Whether the question asks for a function and the line defines a type, or the reverse."""
    is_type = bool(_TYPE_DEF.match(line))
    function, kind = bool(_ASKS_FUNCTION.search(query)), bool(_ASKS_TYPE.search(query))
    if function == kind:
        return False
    return is_type != kind


def intent(query: str) -> str:
    """What kind of definition answers the question: ``callable`` (a function or class), ``value`` (a name
    given a value: "the default X", "how many"), or ``either`` ("where is X defined")."""
    if _CALLABLE_QUESTION.search(query):
        return "callable"
    if _VALUE_QUESTION.search(query) or _NUMBER_QUESTION.search(query):
        return "value"
    return "either"


#: what a number measures, asked (the question's words) and given (the words of the name it is assigned to):
#: "how many times" is not answered by a delay, nor "how long … wait" by a retry count
_MEASURE_ASKED = (
    (
        "size",
        re.compile(
            r"\bhow\s+(?:long|big|large)\s+(?:can|may|could|might|must|should|is|are)\b[^?]*\bbe\b"
            r"|\b(?:length|size|bytes|characters|chars|kb|mb)\b",
            re.I,
        ),
    ),
    ("count", re.compile(r"\bhow\s+many\b|\bnumber\s+of\b|\btimes\b|\battempts?\b", re.I)),
    (
        "duration",
        re.compile(
            r"\bhow\s+(?:long|often|soon)\b|\bwait\w*|\btime\s*outs?\b|\bdelay\w*|\binterval|\bexpir\w*"
            r"|\b(?:seconds?|minutes?|hours?|ttl)\b",
            re.I,
        ),
    ),
)
_MEASURE_NAMED = {
    "size": frozenset("size length len maxsize bytes chars width capacity buffer max limit".split()),
    "count": frozenset("max min retries count num number limit attempts times concurrency workers tries".split()),
    "duration": frozenset(
        "delay timeout interval wait expires expiry expiration ttl time seconds secs sec ms millis period "
        "countdown age sleep backoff heartbeat".split()
    ),
}
_PART = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")


def measure_fit(query: str, line: str) -> float:
    """+1 when the defined name says it measures what the question asks (a count for "how many"), -1 when it
    says it measures something else, 0 when either is silent."""
    asked = next((kind for kind, pattern in _MEASURE_ASKED if pattern.search(query)), None)
    ident = defined_identifier(line)
    if asked is None or not ident:
        return 0.0
    parts = {p.lower() for p in _PART.findall(ident)}
    named = {kind for kind, words in _MEASURE_NAMED.items() if parts & words}
    if not named:
        return 0.0
    return 1.0 if asked in named else -1.0


#: a name given no value: ``x = None``, ``x: null``, ``x=Option(None``
_NO_VALUE = re.compile(r"[=:]\s*(?:[\w.]+\()?\s*(?:None|null|nil|undefined)\s*(?:[,)}\]]|$)")
#: a name given another name (``broker_connection = connection``): the value is where that one is defined
_ALIAS = re.compile(
    r"^\s*[\w.]+\s*=\s*(?!(?:True|False|true|false|yes|no|on|off|nil|null)\b)[A-Za-z_][\w.]*\s*[,;]?\s*$"
)
_DIGIT = re.compile(r"\d")
_WORD = re.compile(r"[A-Za-z_$][\w$]*")


def _gives_no_value(c: Candidate, text: str) -> bool:
    """Whether a definition leaves its value to somewhere else: ``x = None``, ``x = other_name``, or a parameter
    defaulting to a name."""
    return bool(_NO_VALUE.search(text) or _ALIAS.match(text) or (c.parameter and not _LITERAL.search(text + " ")))


def value_bonus(query: str, line: str) -> float:
    """How well a definition's literal fits what the question asks for: a number for "how many", any value
    for "the default"."""
    m = _LITERAL.search(line + " ")
    if not m:
        return 0.0
    if _NUMBER_QUESTION.search(query):
        return VALUE_BONUS if m.group(1) else VALUE_BONUS / 3
    return VALUE_BONUS if _VALUE_QUESTION.search(query) else 0.0


#: weights of the fused score (see ``fuse``)
W_MEANING, W_WORDS, W_RANK = 0.45, 0.45, 0.10
MEASURE_PENALTY = 0.3
BODY_CREDIT = 1.01
DEFINITION_BONUS, CODE_BONUS, NAME_BONUS, VALUE_BONUS, MEASURE_BONUS = 0.10, 0.03, 0.15, 0.10, 0.10
NUMBERLESS_PENALTY = 0.10
DOC_FACTOR = 0.7
#: at most this many passages are embedded per message (the rest are ranked by words and rank only)
MAX_EMBEDDED = 320
MAX_EMBED_CHARS = 240
BM25_K1, BM25_B = 1.2, 0.75
#: similarities closer together than this are not stretched apart: near-identical passages stay near-equal
MIN_SPREAD = 0.15
#: a passage this similar to the query is evidence by its meaning alone (all-MiniLM-L6-v2's scale: a
#: paraphrase of the question scores 0.4–0.7, an unrelated line of the same domain 0.1–0.3)
MEANING_FLOOR = 0.4
#: the band of "unrelated, same domain" on that scale: a passage's shared words count fully above it, not at all
#: below it, in proportion inside it
UNRELATED_LOW, UNRELATED_HIGH = 0.1, 0.3


@dataclass
class Candidate:
    """One passage the provider may quote.  ``text`` is as the message has it (fence-escaped), ``line`` its
    0-based line inside the chunk, ``chunk`` the chunk's position in the message (its search rank)."""

    text: str
    line: int
    chunk: int
    context: str = ""
    kind: str = "prose"  # prose | doc | code | definition
    #: a definition's documentation (the comments above it, the docstring below), part of ``context``
    doc: str = ""
    #: cosine similarity to the query, once ``fuse`` has embedded it (or that of a use that lent it its score)
    similarity: float | None = None
    #: the line (in the chunk) of the function or class this line lies in, where the chunk shows it
    owner: int | None = None
    #: a parameter's default in a signature (a definition only when it is a literal value)
    parameter: bool = False


def is_code(path: str, lines: Sequence[str]) -> bool:
    """Whether a chunk is code, by its file's suffix or, failing that, by how many of its lines look like code."""
    name = path.rsplit("/", 1)[-1].lower()
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
    if suffix in CODE_SUFFIXES or name in ("dockerfile", "makefile"):
        return True
    body = [ln for ln in lines if ln.strip()]
    return bool(body) and sum(bool(CODE_LINE.search(ln)) for ln in body) >= CODE_SHARE * len(body)


def _doc_lines(lines: Sequence[str]) -> list[bool]:
    """Per line: a comment, or a line of a triple-quoted docstring.  A chunk may start inside a docstring, and
    a lone closing mark looks like an opening one: of the two readings, the one that files fewer code lines
    under documentation (and fewer prose lines under code) wins."""
    comments = [bool(_COMMENT.match(ln)) for ln in lines]
    marks = [len(_TRIPLE.findall(ln)) % 2 for ln in lines]
    if not any(marks):
        return comments
    code = [bool(CODE_LINE.search(ln) or _DEFINITION.match(ln)) for ln in lines]
    readings = []
    for inside in (False, True):
        flags = []
        for ln, mark in zip(lines, marks, strict=True):
            # a docstring on one line has both its marks: it opens and closes, and is documentation all the same
            flags.append(inside or bool(mark) or ln.lstrip().lstrip("rbuRBU").startswith(_DOCSTRING_OPENERS))
            inside ^= bool(mark)
        cost = sum(
            (f and c) or (not f and not c and bool(ln.strip()))
            for f, c, ln, comment in zip(flags, code, lines, comments, strict=True)
            if not comment
        )
        readings.append((cost, flags))
    flags = min(readings, key=lambda r: r[0])[1]  # ties: not inside, the first reading
    return [f or c for f, c in zip(flags, comments, strict=True)]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _scopes(raw: Sequence[str], docs: Sequence[bool], line: int) -> list[tuple[int, str]]:
    """The lines a line is nested under, nearest first (by indentation, within the chunk): each line's index and
    text without its trailing remark (``else:  # protocol version 1``).  A signature's closing line
    (``) -> Result:``) is not a scope: the ``def`` it closes is."""
    out = []
    depth = _indent(raw[line])
    for j in range(line - 1, -1, -1):
        above = raw[j]
        if depth == 0:
            break
        if above.strip() and not docs[j] and _indent(above) < depth and not above.lstrip().startswith(_CLOSERS):
            out.append((j, _TRAILING_COMMENT.sub("", above).strip()))
            depth = _indent(above)
    return out


_CLOSERS = (")", "]", "}")
#: languages where ``name: Type`` declares a type (Python, TypeScript), not a YAML-like ``key: value``
ANNOTATED_SUFFIXES = (".py", ".pyi", ".ts", ".tsx")
_ANNOTATION_ONLY = re.compile(r"^\s*[\w.]+\s*:\s*[^=\n]+$")
#: a keyword parameter with a default, one per line in a signature laid out over lines
_PARAMETER_DEFAULT = re.compile(r"^\s*\*{0,2}\w+\s*(?::\s*[^=\n]+)?=\s*[^=\s].*,\s*(?:#.*)?$")
#: a signature's first line, its parameters on the lines below
_OPEN_CALL = re.compile(r"\(\s*(?:#.*)?$")
#: statements only a function body holds: an assignment beside them is a local variable
_BODY_STATEMENT = re.compile(r"^(?:return|assert|raise|yield|await|del|break|continue)\b|^self\.\w")


def _is_local(raw: Sequence[str], line: int, scopes: Sequence[tuple[int, str]]) -> bool:
    """Whether a line lies in a function body or a statement's block.  A chunk may begin inside a long function,
    its ``def`` out of sight: then the statements beside the line (``return``, ``raise``…) tell."""
    if scopes:
        return bool(_LOCAL_SCOPE.match(scopes[0][1])) or any(_FUNCTION.match(text) for _, text in scopes)
    depth = _indent(raw[line])
    if depth == 0:
        return False
    for step in (-1, 1):
        j = line + step
        while 0 <= j < len(raw):
            text = raw[j]
            if text.strip():
                if _indent(text) < depth:
                    break
                if _indent(text) == depth and _BODY_STATEMENT.match(text.lstrip()):
                    return True
            j += step
    return False


#: the longest signature followed to the docstring below it
SIGNATURE_LINES = 40
_OPENERS = ("(", "[", "{")
_STRING = re.compile(r"""[rRbBuUfF]{0,2}(?:"[^"\n]*"|'[^'\n]*'|`[^`\n]*`)""")


def _is_message(line: str) -> bool:
    """Whether most of a code line's words are inside its string literals: a message for a reader (``raise
    TypeError("Expected two columns")``, ``"Timed out waiting for "``), which describes as a comment does."""
    inside = sum(len(_WORDISH.findall(m)) for m in _STRING.findall(line))
    return inside >= 2 and inside > len(_WORDISH.findall(_STRING.sub(" ", line)))


def _signature_end(raw: Sequence[str], docs: Sequence[bool], line: int) -> int:
    """The last line of the definition starting at ``line``: where the brackets its first line opens close
    (``def confirm(`` with one parameter a line, then ``) -> bool:``), else ``line`` itself."""
    depth = 0
    for j in range(line, min(len(raw), line + SIGNATURE_LINES)):
        if j > line and docs[j]:
            break
        code = _TRAILING_COMMENT.sub("", raw[j])
        depth += sum(code.count(o) for o in _OPENERS) - sum(code.count(c) for c in _CLOSERS)
        if depth <= 0:
            return j
    return line


def candidates(body: str, path: str, chunk: int, units: Sequence[tuple[str, int]]) -> list[Candidate]:
    """The chunk's passages (``units``: text and 0-based line, as the provider cuts them) with their kind and
    the context they are matched by."""
    raw = unescape_content(body).split("\n")
    code = is_code(path, raw)
    docs = _doc_lines(raw) if code else [False] * len(raw)
    annotated = path.lower().endswith(ANNOTATED_SUFFIXES)
    out = []
    for text, line in units:
        if not code:
            out.append(Candidate(text, line, chunk, unescape_content(text), "prose"))
            continue
        own = raw[line] if line < len(raw) else unescape_content(text)
        scopes = _scopes(raw, docs, line) if own.strip() else []
        parent = scopes[0][1] if scopes else ""
        # the function (or class) this line belongs to: "where does X happen" is answered by its def
        owner = next((j for j, text in scopes if _CALLABLE_DEF.match(text)), None)
        parameter = False
        if docs[line] if line < len(docs) else False:
            kind = "doc"
        elif annotated and _ANNOTATION_ONLY.match(own):
            kind = "code"  # ``width: int``: a name declared with a type, given no value here
        elif (
            _PARAMETER_DEFAULT.match(own)
            and scopes
            and _FUNCTION.match(scopes[0][1])
            and _OPEN_CALL.search(scopes[0][1])
        ):
            kind = "definition"  # ``charset: str = "utf-8",`` of a signature: the parameter's default value
            parameter = True
        elif _DEFINITION.match(own) and not _is_local(raw, line, scopes):
            kind = "definition"
        else:
            kind = "code"  # a local variable: not where a thing is defined
        parts = [parent] if parent else []
        if kind == "definition":
            j = line - 1
            before: list[str] = []
            while j >= 0 and docs[j] and len(before) < DOC_LINES_BEFORE and raw[j].strip():
                before.insert(0, raw[j].strip())
                j -= 1
            parts += before
        parts.append(unescape_content(text))
        if kind == "definition":
            j = _signature_end(raw, docs, line) + 1
            while j < len(raw) and not docs[j] and j <= line + 3 and raw[j].strip() and _indent(raw[j]) > _indent(own):
                j += 1  # a signature continued over lines comes before its docstring
            after = 0
            while j < len(raw) and docs[j] and after < DOC_LINES_AFTER:
                if raw[j].strip():
                    parts.append(raw[j].strip())
                    after += 1
                j += 1
        own_parts = [parent, unescape_content(text)] if parent else [unescape_content(text)]
        doc = "\n".join(p for p in parts if p not in own_parts)
        out.append(Candidate(text, line, chunk, "\n".join(parts), kind, doc, owner=owner, parameter=parameter))
    return out


_TO_I = re.compile(r"(?:ies|ied|y)$")
_SUFFIX = re.compile(r"(?:ations?|ions?|ings?|ments?|ers?|ed|es|s|ly|e)$")
#: a stem keeps at most this many characters: "multiplier" and "multiply" meet, as "retries" and "retried"
STEM_CHARS = 6


def terms(text: str) -> list[str]:
    """Words and identifier parts, stemmed alike wherever they come from (the question's "retried", an
    identifier's "max_retries"): a suffix off, then a prefix of STEM_CHARS."""
    out = []
    for t in tokenize(text):
        if t.isalpha() and len(t) > 4:
            t = _SUFFIX.sub("", _TO_I.sub("i", t))[:STEM_CHARS]
        out.append(t)
    return out


_NAME = re.compile(
    r"^\s*(?:(?:export|pub|public|private|protected|static|async|abstract|final|const|let|var|val|readonly)\s+)*"
    r"(?:(?:def|class|function|fn|func|struct|enum|interface|trait|type|\#\s*define)\s+)?['\"]?([\w$.-]+)"
)


def defined_identifier(line: str) -> str:
    """The identifier a definition line defines, as written, without its owner (``self.retries = 3`` →
    retries); "" for a line that defines none."""
    m = _NAME.match(line)
    return m.group(1).rsplit(".", 1)[-1] if m else ""


def defined_name(line: str) -> list[str]:
    """The terms of the name a definition line defines (``heartbeat=Option(…)`` → heartbeat)."""
    m = _NAME.match(line)
    if not m:
        return []
    parts = terms(m.group(1).rsplit(".", 1)[-1])
    whole = m.group(1).lower()
    return [t for t in parts if t != whole] or parts


#: the shortest question term looked for inside a longer identifier, and the shortest identifier taken for an
#: abbreviation of a question term
MIN_PART_CHARS, MIN_ABBREVIATION_CHARS = 4, 3


def _with_parts(doc: list[str], query: list[str]) -> list[str]:
    """A passage's terms plus the question terms its run-together identifiers hold (``urlparse`` holds "pars",
    ``resultrepr`` "repr") or abbreviate (``dict`` for "dictionary"): the tokenizer splits snake_case and
    camelCase, not words written together."""
    wanted = [q for q in set(query) if q.isalpha()]
    extra = [
        q
        for t in doc
        if t.isalpha()
        for q in wanted
        if t != q
        and (
            (len(q) >= MIN_PART_CHARS and len(t) > len(q) and q in t)
            or (len(t) >= MIN_ABBREVIATION_CHARS and len(q) > len(t) and q.startswith(t))
        )
    ]
    return doc + extra


def _bm25(query: list[str], docs: list[list[str]]) -> list[float]:
    n = len(docs)
    if not n or not query:
        return [0.0] * n
    avg = sum(len(d) for d in docs) / n or 1.0
    df = Counter(t for d in docs for t in set(d))
    idf = {t: math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5)) for t in set(query)}
    out = []
    for d in docs:
        tf = Counter(d)
        norm = BM25_K1 * (1 - BM25_B + BM25_B * len(d) / avg)
        out.append(sum(idf[t] * tf[t] * (BM25_K1 + 1) / (tf[t] + norm) for t in idf if tf[t]))
    return out


_encoder_failed = False


def meaning(query: str, texts: Sequence[str]) -> list[float] | None:
    """Cosine similarity of each text to the query by the configured embedding model, or None where no encoder
    can be had (then the ranking goes by words and rank alone).  The model is local: nothing leaves the
    machine."""
    global _encoder_failed
    if _encoder_failed or not texts:
        return None
    try:
        model = get_settings().embedding_model
        runtime = resolve_runtime(model)
        qvec = query_vector(model, query, runtime)
        vecs = get_embedder(model, runtime).encode([t[:MAX_EMBED_CHARS] for t in texts])
        return [float(x) for x in np.asarray(vecs) @ np.asarray(qvec)]
    except Exception as exc:  # no model files, no runtime: rank by words, and say so once
        _encoder_failed = True
        log.warning("the offline provider ranks passages by words only: no embedding model (%s)", exc)
        return None


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def readable(text: str) -> str:
    """Identifiers as words for a sentence encoder: ``default_queue`` → "default queue", ``MapRoute`` →
    "Map Route" (it reads ``default_queue`` as one rare token, far from the question's "default queue")."""
    return _CAMEL.sub(" ", text).replace("_", " ")


def shortlist(cands: Sequence[Candidate], lexical: Sequence[float]) -> list[int]:
    """The candidates worth embedding, at most MAX_EMBEDDED: embedding every line of a direct answer's chunks
    (over a thousand) costs seconds on a small CPU.  First those that share the most words with the query (the
    words found them; meaning tells which of them answers), then the definitions, then the other lines, each in
    search rank order: a paraphrase shares no word, but the search put its chunk near the top, and a definition
    carries the documentation next to it."""
    out: dict[int, None] = {}
    worded = sorted((i for i, x in enumerate(lexical) if x > 0), key=lambda i: -lexical[i])
    for i in worded[: MAX_EMBEDDED * 3 // 8]:
        out[i] = None
    by_rank = sorted(range(len(cands)), key=lambda i: cands[i].chunk)
    for i in [i for i in by_rank if cands[i].kind == "definition"] + by_rank:
        if len(out) >= MAX_EMBEDDED:
            break
        if len(_WORDISH.findall(cands[i].text)) >= 2:
            out.setdefault(i)
    return list(out)


_WORDISH = re.compile(r"[^\W\d_]{2,}")
#: the words of a code line that says nothing by itself (``pass``, ``else:``, ``end``): block keywords (``do``
#: and ``then`` are stopwords, which ``tokenize`` drops already)
_BARE_WORDS = frozenset("pass else try finally break continue return end done fi esac begin none null nil self".split())


def fuse(query: str, cands: Sequence[Candidate]) -> list[float]:
    """A score per candidate, higher is better.

    A weighted sum of normalised signals rather than reciprocal-rank fusion: RRF keeps only each list's order,
    and here the margin matters (a line that holds every query term against one that holds one; a line whose
    meaning is far nearer the query than the rest), while the lists are short enough that scores within one
    message are comparable.  Words and meaning weigh alike (each covers the other's blind spot: paraphrases,
    and identifiers a sentence encoder reads poorly), the search rank a little (it saw the whole chunk), and
    the kind of line breaks near-ties: a definition before other code, any code before the comment about it.
    """
    if not cands:
        return []
    q_terms = terms(query)
    lines = [unescape_content(c.text) for c in cands]
    # a passage's own words count twice, its context's once: the line it is nested under names what it belongs
    # to, but a comment on an ``else:`` above must not outweigh the line itself
    lexical = _bm25(
        q_terms, [_with_parts(terms(t) + terms(c.context), q_terms) for c, t in zip(cands, lines, strict=True)]
    )
    top_lex = max(lexical) or 1.0
    words = [x / top_lex for x in lexical]
    order = shortlist(cands, lexical)
    # A definition is compared twice, as code (with the line it is nested under) and as its documentation, and
    # keeps the nearer: the encoder reads a docstring's sentence far better than the two mixed.
    texts = [
        readable(cands[i].context if not cands[i].doc else cands[i].context.replace(cands[i].doc, "")) for i in order
    ]
    documented = [i for i in order if cands[i].doc]
    sims = meaning(query, texts + [readable(cands[i].doc) for i in documented])
    if sims:
        by_doc = dict(zip(documented, sims[len(order) :], strict=True))
        sims = [max(s, by_doc.get(i, s)) for i, s in zip(order, sims, strict=False)]
    semantic = [0.0] * len(cands)
    if sims:
        ranked = sorted(sims)
        floor, top = ranked[len(ranked) // 2], ranked[-1]
        for i, s in zip(order, sims, strict=False):
            semantic[i] = max(0.0, (s - floor) / max(top - floor, MIN_SPREAD))
            cands[i].similarity = s
    w_words = W_WORDS if sims else W_WORDS + W_MEANING
    wanted = intent(query)
    wants_definition = wanted == "callable" or bool(_DEFINITION_QUESTION.search(query))
    asked = set(q_terms)
    spelled = set(tokenize(query))
    numeric = wanted == "value" and bool(_COUNT_QUESTION.search(query))
    out = []
    for c, text, w, s in zip(cands, lines, words, semantic, strict=True):
        if c.similarity is not None and c.similarity < UNRELATED_HIGH:
            # words shared with a passage whose meaning is unrelated are a coincidence (``lost_wait`` shares
            # "wait" with "how long before a task is tried again"): they count less the further it is
            w *= max(0.0, (c.similarity - UNRELATED_LOW) / (UNRELATED_HIGH - UNRELATED_LOW))
        score = w_words * w + (W_MEANING * s if sims else 0.0) + W_RANK / (1 + c.chunk / 3)
        if c.kind == "definition":
            called = bool(_CALLABLE_DEF.match(text))
            # "the default queue" is answered by a value, not by a method named so; "the function that sends a
            # task" by a def, not by a setting that mentions sending
            if wanted == "either" or (wanted == "callable") == called:
                # a value question is not answered by a name set to nothing (``x = None``), to another name,
                # or by a parameter defaulting to a name: the value is where that name is defined
                share = 0.0 if wanted == "value" and _gives_no_value(c, text) else 1.0
                score += share * (DEFINITION_BONUS if wants_definition else CODE_BONUS)
                # the name defined is what was asked when all of it is in the question: "heartbeat", not
                # "heartbeat_checkrate", for "the broker heartbeat interval".  Squared: one part the question
                # leaves out makes it another thing ("the default queue" is not ``default_queue_type``)
                name = defined_name(text)
                if name and wants_definition:
                    score += share * NAME_BONUS * (sum(t in asked for t in name) / len(name)) ** 2
                    # the question names it exactly: "where is the IntRange type", not the INT beside it
                    ident = defined_identifier(text)
                    if _IDENTIFIER_LIKE.search(ident) and ident.lower() in spelled:
                        score += share * NAME_BONUS
            if called and wanted == "callable" and _asks_other_callable(query, text):
                score -= DEFINITION_BONUS  # "the function that splits" is not answered by a class, nor the reverse
            if not called:
                fit = measure_fit(query, text)
                score += value_bonus(query, text) + (MEASURE_BONUS * fit if fit >= 0 else -MEASURE_PENALTY)
        elif c.kind == "code" and set(tokenize(text)) <= _BARE_WORDS:
            score = 0.0  # ``pass``, ``else:``, ``)``: nothing of its own to quote, whatever its context matched
        elif c.kind == "code" and _is_message(text):
            score *= DOC_FACTOR  # a message (``raise TypeError("Expected two columns …")``) describes, as a comment
        elif c.kind == "code":
            # a question after a definition is not answered by a statement that uses it
            score += CODE_BONUS if not wants_definition else -CODE_BONUS
        elif c.kind == "doc":
            score *= DOC_FACTOR
        if numeric and c.kind in ("code", "definition") and not _DIGIT.search(text) and not _CALLABLE_DEF.match(text):
            score -= NUMBERLESS_PENALTY  # "how many times" is not answered by ``broker_connection = connection``
        out.append(score)
    if wants_definition and wanted != "callable":
        _credit_uses(cands, lines, out)
    if wanted != "value" and _WHERE_QUESTION.search(query):
        # "where does a POST become a GET" is answered by the function whose body does it: its def takes the
        # score of its best line (the comment or the statement that matched), and wins the tie
        at = {(c.chunk, c.line): i for i, c in enumerate(cands) if c.kind == "definition"}
        for i, c in enumerate(cands):
            j = at.get((c.chunk, c.owner)) if c.owner is not None and c.kind in ("code", "doc") else None
            if j is not None and _CALLABLE_DEF.match(lines[j]):
                out[j] = max(out[j], out[i] * BODY_CREDIT)
    return out


def _credit_uses(cands: Sequence[Candidate], lines: Sequence[str], out: list[float]) -> None:
    """A statement that uses a defined name lends its score to the definition (``"Accept-Encoding":
    ACCEPT_ENCODING`` to ``ACCEPT_ENCODING = ", ".join(``): asked for a value, the answer is where the name
    gets it, and the use only matched the question's words better.  Names spelled as code only (``col_max``,
    ``ACCEPT_ENCODING``), so an English word in a statement credits nothing."""
    defs: dict[str, int] = {}
    for i, (c, text) in enumerate(zip(cands, lines, strict=True)):
        if c.kind != "definition" or _CALLABLE_DEF.match(text) or _gives_no_value(c, text):
            continue
        ident = defined_identifier(text)
        if _IDENTIFIER_LIKE.search(ident) or (len(ident) >= 3 and ident.isupper()):
            if ident not in defs or out[i] > out[defs[ident]]:
                defs[ident] = i
    for i, c in enumerate(cands):
        if c.kind == "code":
            for name in set(_WORD.findall(lines[i])):
                if (j := defs.get(name)) is not None and out[i] * BODY_CREDIT > out[j]:
                    out[j] = out[i] * BODY_CREDIT
                    # and its nearness: the definition is quoted for what the use matched
                    cands[j].similarity = max(cands[j].similarity or 0.0, cands[i].similarity or 0.0)


#: a passage scoring this share of the message's best counts as medium (or high) evidence, whatever its words
RELATIVE_MEDIUM, RELATIVE_HIGH = 0.7, 0.85
#: quotes of a chunk kept besides its best: those scoring this share of it
KEEP_SHARE = 0.8


def relative_cover(score: float, top: float) -> float:
    """A fused score as the coverage its grade would need (extractive ``_grade``: 0.6 high, 0.35 medium)."""
    if top <= 0:
        return 0.0
    share = score / top
    return 0.6 if share >= RELATIVE_HIGH else 0.35 if share >= RELATIVE_MEDIUM else 0.0


_QUOTE_PLACE = re.compile(r'^"(.*)" \([^()\n]*:\d+\)$', re.S)


def quote_candidate(finding: str, rank: int = 0) -> Candidate:
    """A finding (``"quote" (file:line)``) as a candidate: only its own line is known, and its rank among the
    findings (collect order)."""
    m = _QUOTE_PLACE.match(finding)
    text = m.group(1) if m else finding
    if _COMMENT.match(text) or text.startswith(('"""', "'''")):
        kind = "doc"
    elif _DEFINITION.match(text) and CODE_LINE.search(text):
        kind = "definition"
    else:
        kind = "prose"
    return Candidate(text, 0, rank, text, kind)
