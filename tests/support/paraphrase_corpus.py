"""Long essays with one-sentence facts in them, and each fact asked in other words.

The essays are generated from sentence patterns over many topics, so each file is several thousand
word pieces of on-topic prose; the facts are about something else entirely and stated once.  A
search that embeds long windows averages a fact away among its neighbours; one that keeps a
sentence visible finds it from a paraphrase.  (The benchmark on public essays is bench/retrieval.py.)
"""

from __future__ import annotations

from pathlib import Path

#: near the facts' subjects on purpose (houses, locks, boats, savings): in a long window the fact's
#: meaning blurs into text about the same things, which is what a search must see through
TOPICS = [
    "locksmithing and door hardware",
    "island ferry services",
    "village choirs",
    "renovating old houses",
    "harbour timetables",
    "apple orchards",
    "office furniture restoration",
    "coastal boat building",
    "orchards and village chapels",
    "keeping house records",
    "rural postal routes",
    "church bell ringing",
]

PATTERNS = [
    "Anyone who spends a season around {t} learns that the work rewards patience more than strength.",
    "The earliest written accounts of {t} are fragmentary, and historians still argue about their dates.",
    "In the northern provinces, {t} developed its own vocabulary, much of which survives in local dialects.",
    "A common mistake among beginners in {t} is to copy the experts' tools before understanding their habits.",
    "Several museums keep collections devoted to {t}, though few of them are open to the public all year.",
    "Researchers measuring {t} today rely on instruments that would have astonished their predecessors.",
    "The economics of {t} changed sharply once cheaper materials and faster transport became available.",
    "Guilds once controlled who could practise {t}, and apprentices served for seven years before joining.",
    "Critics have said that modern {t} lost some of its character when it was standardised.",
    "Every serious textbook on {t} begins with definitions, then moves quickly to worked examples.",
    "Seasonal weather shapes {t} more than most people expect, especially in coastal regions.",
    "Some of the best practitioners of {t} were self-taught and kept detailed notebooks of their failures.",
    "Local festivals sometimes celebrate {t} with parades, competitions and long communal meals.",
    "The vocabulary of {t} borrowed freely from sailors, farmers and merchants over the centuries.",
    "Newcomers to {t} are often surprised by how much of the craft depends on careful record keeping.",
    "Disputes about the proper method for {t} have filled entire volumes of trade journals.",
]

#: (fact stated once in one essay, the same fact asked in other words)
FACTS = [
    (
        "Marguerite keeps her spare house key taped beneath the third drawer of the blue filing cabinet.",
        "where is the extra key to her home hidden?",
    ),
    (
        "The ferry to Skellig Island leaves only on Thursdays, at twenty past six in the morning.",
        "which day and what time does the boat out to the island depart?",
    ),
    (
        "Old Tobias buried the family's silver coins under the apple tree behind the chapel in 1911.",
        "where did the grandfather hide the money long ago?",
    ),
]


def essay(i: int, topic: str, fact: str | None, depth: float) -> str:
    """About 14,000 characters on ``topic``; ``fact`` goes in at ``depth`` (0-1) of the text."""
    sentences = []
    for r in range(7):
        for k, p in enumerate(PATTERNS):
            sentences.append(p.format(t=topic).replace("{n}", str(r)))
            if (k + r + i) % 5 == 4:
                sentences.append(f"Chapter {r + 1} of the standard account of {topic} returns to this point.")
    if fact is not None:
        sentences.insert(int(depth * len(sentences)), fact)
    paragraphs = [" ".join(sentences[j : j + 6]) for j in range(0, len(sentences), 6)]
    return f"# On {topic}\n\n" + "\n\n".join(paragraphs) + "\n"


def write_corpus(root: Path, n_files: int = 12) -> list[tuple[str, str, str]]:
    """The essays under ``root``; returns (file name, fact, question) for each fact placed."""
    root.mkdir(parents=True, exist_ok=True)
    placed = []
    holders = {2: 0, 6: 1, 10: 2}  # file index -> fact index
    depths = {0: 0.5, 1: 0.15, 2: 0.85}
    for i, topic in enumerate(TOPICS[:n_files]):
        name = f"{i:02d}-{topic.replace(' ', '-')}.md"
        f = holders.get(i)
        fact = FACTS[f][0] if f is not None else None
        (root / name).write_text(essay(i, topic, fact, depths[f] if f is not None else 0.0))
        if f is not None:
            placed.append((name, FACTS[f][0], FACTS[f][1]))
    return placed
