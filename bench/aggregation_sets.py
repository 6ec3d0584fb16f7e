"""Long-context aggregation sets in the OOLONG style, for code mode against ``--scope all`` and ``auto`` (#44).

Two sets of generated records, each with questions whose answers need every line counted, grouped or paired,
and one that needs the meaning of free-text remarks (a sub-model's work, not a regular expression's).  Answers
are computed here from the generated records, so they are exact.

- ``DEV``: a web service's access log.  Prompts and the bench's reference programs may be tuned on it.
- ``HELDOUT``: a clinic's appointment book, another format, other fields and other wording.  Written and
  committed before any code-mode run or tuning; never read to choose a prompt, a rule or a program.  The
  headline figure of bench/RESULTS.md is this set's.

Run ``python -m bench.aggregation_sets`` to print both sets' sizes and answers.
"""

from __future__ import annotations

import itertools
import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import date, timedelta


@dataclass(frozen=True)
class Question:
    id: str
    text: str
    #: an int for a count, a str for a name or date the answer must give
    answer: int | str


@dataclass(frozen=True)
class AggregationSet:
    name: str
    #: relative path → file text
    files: dict[str, str]
    questions: tuple[Question, ...]

    @property
    def lines(self) -> int:
        return sum(t.count("\n") for t in self.files.values())


_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?![\w])")


def score(question: Question, response: str) -> bool:
    """Right when the answer's first number is the count, or the name asked for is in the answer's first line
    (a list of every candidate would otherwise pass)."""
    text = response.strip()
    if isinstance(question.answer, int):
        m = _NUMBER.search(text.replace("**", ""))
        return m is not None and m.group(0).replace(",", "") == str(question.answer)
    first = text.splitlines()[0] if text else ""
    return question.answer.lower() in first.lower()


# --------------------------------------------------------------------------- dev: an access log

_DEV_NOTES = {
    "payment": [
        "card was declined at the bank",
        "the issuer refused the charge",
        "insufficient funds on the account",
        "payment gateway rejected the card number",
    ],
    "network": [
        "upstream timed out after 30s",
        "connection reset by peer",
        "TLS handshake failed with the proxy",
        "DNS lookup for the api host failed",
    ],
    "user": [
        "form submitted with an empty address",
        "customer closed the tab mid-way",
        "invalid coupon code entered",
        "quantity field held letters",
    ],
}


def _dev() -> AggregationSet:
    rng = random.Random(4401)
    users = [f"u{n:02d}" for n in range(1, 31)]
    weights = [rng.uniform(0.3, 3.0) for _ in users]
    actions = ["login", "search", "checkout", "refund", "logout"]
    regions = ["eu-west", "us-east", "ap-south"]
    start = date(2026, 4, 1)
    rows = []
    for i in range(1400):
        day = start + timedelta(days=rng.randrange(14))
        user = rng.choices(users, weights)[0]
        action = rng.choices(actions, [5, 6, 3, 1, 4])[0]
        failed = rng.random() < (0.3 if action == "checkout" else 0.08)
        cause = rng.choice(list(_DEV_NOTES)) if failed else None
        note = rng.choice(_DEV_NOTES[cause]) if cause else "ok"
        stamp = f"{day.isoformat()}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:{i % 60:02d}Z"
        rows.append(
            {
                "day": day.isoformat(),
                "user": user,
                "action": action,
                "status": "failed" if failed else "ok",
                "region": rng.choice(regions),
                "cause": cause,
                "line": f"{stamp} user={user} action={action} status={'failed' if failed else 'ok'} "
                f'region={{region}} note="{note}"',
            }
        )
    for r in rows:
        r["line"] = r["line"].format(region=r["region"])
    rows.sort(key=lambda r: r["line"])
    failed = [r for r in rows if r["status"] == "failed"]
    per_user = Counter(r["user"] for r in rows)
    per_day_failed = Counter(r["day"] for r in failed)
    logins = Counter(r["user"] for r in rows if r["action"] == "login")
    groups = defaultdict(set)
    for r in rows:
        if r["action"] == "checkout":
            groups[(r["day"], r["region"])].add(r["user"])
    pairs = sum(len(list(itertools.combinations(g, 2))) for g in groups.values())
    questions = (
        Question(
            "dev-failed-checkouts", "How many checkout actions failed?", sum(r["action"] == "checkout" for r in failed)
        ),
        Question("dev-busiest-user", "Which user made the most requests in the log?", _unique_top(per_user)),
        Question(
            "dev-worst-day", "On which day did the most actions fail? Give the date.", _unique_top(per_day_failed)
        ),
        Question(
            "dev-refund-users",
            "How many distinct users made at least one refund?",
            len({r["user"] for r in rows if r["action"] == "refund"}),
        ),
        Question(
            "dev-checkout-pairs",
            "How many pairs of different users checked out in the same region on the same day?",
            pairs,
        ),
        Question(
            "dev-payment-failures",
            "How many failed actions were caused by a payment problem?",
            sum(r["cause"] == "payment" for r in failed),
        ),
        Question(
            "dev-frequent-logins", "How many users logged in at least 5 times?", sum(n >= 5 for n in logins.values())
        ),
        Question(
            "dev-ap-south",
            "How many requests came from the ap-south region?",
            sum(r["region"] == "ap-south" for r in rows),
        ),
    )
    return AggregationSet("dev", {"logs/access.log": "\n".join(r["line"] for r in rows) + "\n"}, questions)


# --------------------------------------------------------------------------- held out: an appointment book

_HELDOUT_REMARKS = {
    "transport": [
        "the bus never came",
        "car broke down on the ring road",
        "missed the last train from the coast",
        "taxi did not show up",
    ],
    "illness": [
        "came down with a fever the night before",
        "stomach bug, staying in bed",
        "child is sick at home",
        "flu symptoms since Monday",
    ],
    "work": [
        "boss scheduled a meeting at the same hour",
        "could not get the shift covered",
        "urgent deadline at the office",
        "travelling for a client visit",
    ],
}


def _heldout() -> AggregationSet:
    rng = random.Random(9917)
    patients = [f"P-{n:04d}" for n in rng.sample(range(1, 10000), 220)]
    clinicians = ["Dr. Okafor", "Dr. Lindqvist", "Dr. Haddad", "Dr. Moreau", "Dr. Tanaka", "Dr. Alvarez"]
    depts = ["cardiology", "dermatology", "neurology", "orthopedics"]
    start = date(2026, 5, 4)
    rows = []
    for _ in range(1300):
        day = start + timedelta(days=rng.randrange(20))
        outcome = rng.choices(["completed", "cancelled", "no-show"], [7, 2, 1])[0]
        reason = rng.choice(list(_HELDOUT_REMARKS)) if outcome == "cancelled" else None
        remark = rng.choice(_HELDOUT_REMARKS[reason]) if reason else "-"
        rows.append(
            {
                "day": day.isoformat(),
                "time": f"{rng.randrange(8, 18):02d}:{rng.choice(['00', '15', '30', '45'])}",
                "patient": rng.choice(patients),
                "clinician": rng.choice(clinicians),
                "dept": rng.choice(depts),
                "outcome": outcome,
                "reason": reason,
                "remark": remark,
            }
        )
    rows.sort(key=lambda r: (r["day"], r["time"], r["patient"]))
    text = "\n".join(
        f"APPT {r['day']} {r['time']} | patient {r['patient']} | clinician {r['clinician']} | dept {r['dept']} "
        f'| outcome {r["outcome"]} | remark: "{r["remark"]}"'
        for r in rows
    )
    done = Counter(r["clinician"] for r in rows if r["outcome"] == "completed")
    cancels = Counter(r["day"] for r in rows if r["outcome"] == "cancelled")
    depts_of = defaultdict(set)
    visits = Counter(r["patient"] for r in rows)
    for r in rows:
        depts_of[r["patient"]].add(r["dept"])
    groups = defaultdict(set)
    for r in rows:
        groups[(r["day"], r["clinician"])].add(r["patient"])
    pairs = sum(len(list(itertools.combinations(g, 2))) for g in groups.values())
    questions = (
        Question(
            "ho-derm-noshow",
            "How many dermatology appointments ended as a no-show?",
            sum(r["dept"] == "dermatology" and r["outcome"] == "no-show" for r in rows),
        ),
        Question("ho-top-clinician", "Which clinician completed the most appointments?", _unique_top(done)),
        Question("ho-cancel-day", "Which date had the most cancelled appointments?", _unique_top(cancels)),
        Question(
            "ho-multi-dept",
            "How many distinct patients had appointments in more than one department?",
            sum(len(d) > 1 for d in depts_of.values()),
        ),
        Question(
            "ho-shared-clinician-pairs",
            "How many pairs of different patients saw the same clinician on the same date?",
            pairs,
        ),
        Question(
            "ho-transport-cancels",
            "How many appointments were cancelled because of trouble getting there?",
            sum(r["reason"] == "transport" for r in rows),
        ),
        Question(
            "ho-two-visits", "How many patients had exactly two appointments?", sum(n == 2 for n in visits.values())
        ),
        Question(
            "ho-cardio-afternoon",
            "How many cardiology appointments started at 12:00 or later?",
            sum(r["dept"] == "cardiology" and r["time"] >= "12:00" for r in rows),
        ),
    )
    return AggregationSet("heldout", {"clinic/appointments.txt": text + "\n"}, questions)


def _unique_top(counts: Counter) -> str:
    (top, n), (_, second) = counts.most_common(2)
    if n == second:  # a tie has no one answer: the generator's seed must give a clear winner
        raise AssertionError(f"tie at the top: {counts.most_common(3)}")
    return top


DEV = _dev()
HELDOUT = _heldout()


if __name__ == "__main__":
    for s in (DEV, HELDOUT):
        print(f"{s.name}: {s.lines} lines, {sum(len(t) for t in s.files.values())} characters")
        for q in s.questions:
            print(f"  {q.id}: {q.answer!r}  ({q.text})")
