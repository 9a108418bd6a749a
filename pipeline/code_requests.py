"""Code requests of this project's own making, for measuring a drafter on traffic unlike its chat training data, and
as the `code-requests` dataset (data.source), whose answers the target writes itself (data.regenerate): programming
tasks from templates whose blanks are filled from small word lists, in a seeded order."""
from __future__ import annotations

import random

TEMPLATES = (
    "Write a Python function `{verb}_{noun}s(items: list[dict]) -> list[dict]` that {verb}s the {noun}s by their "
    "'{field}' field. Include type hints and a docstring.",
    "Write a Python class `{Noun}Store` that keeps {noun}s in a dict keyed by id, with methods add, get, remove and "
    "a `__len__`.",
    "Write a SQL query that returns the number of {noun}s per {field} from the table `{noun}s`, largest first.",
    "Write a pytest test for a function `parse_{noun}(text: str) -> dict` that checks the '{field}' key is parsed "
    "and that an empty string raises ValueError.",
    "Write a bash script that finds every .{ext} file under the current directory changed in the last {n} days and "
    "prints its size.",
    "Write a Python function that reads a CSV file of {noun}s and returns the average of the '{field}' column, "
    "skipping rows where it is missing.",
    "Write a Python dataclass `{Noun}` with fields id: int, {field}: str and tags: list[str], and a classmethod "
    "`from_json(text: str)`.",
    "Write a regular expression in Python that matches a {noun} {field} like the examples in a docstring, and a "
    "function that returns all matches in a string.",
    "Refactor this Python loop into a list comprehension and explain why it is equivalent:\n"
    "result = []\nfor {noun} in {noun}s:\n    if {noun}.{field}:\n        result.append({noun}.{field}.lower())",
    "Write a Python function `fetch_{noun}_with_retry(fetch, attempts={n})` that calls fetch until it returns a "
    "{noun}, sleeping twice as long after each failure, and re-raises the last error.",
    "Write a FastAPI endpoint `GET /{noun}s/{{id}}` that returns one {noun} from an in-memory dict and 404 when it "
    "is missing.",
    "Write a Python generator that yields {noun}s from a file in batches of {n} lines.",
    "Write a Python function that groups a list of {noun}s by '{field}' and returns a dict of lists, in the order "
    "the groups first appear.",
    "Write a unittest TestCase for a `{Noun}Store` class with a setUp that adds {n} {noun}s.",
    "Write a Python function that validates a {noun} dict: '{field}' must be a non-empty string and 'id' a positive "
    "int; raise ValueError naming the bad field.",
    "Write a Python context manager `timed(label)` that prints how long the block took, and use it to time sorting "
    "{n} {noun}s.",
)
NOUNS = ("user", "order", "invoice", "ticket", "book", "song", "sensor", "device", "message", "task", "product",
         "employee", "city", "event", "comment", "payment")
FIELDS = ("name", "email", "price", "created_at", "status", "title", "country", "score", "owner", "category")
VERBS = ("sort", "filter", "dedupe", "rank", "group", "merge")
EXTS = ("py", "log", "json", "csv", "md")


def code_prompts(n: int, seed: int = 0, avoid: set[str] = frozenset()) -> list[str]:
    """`n` distinct requests, the templates taken in turn with blanks drawn from `seed`, none of them in `avoid`."""
    rng, out, seen = random.Random(seed), [], set(avoid)
    for _ in range(1000 * n):  # a template with few fillings can run out of new ones
        if len(out) == n:
            break
        noun = rng.choice(NOUNS)
        text = TEMPLATES[len(out) % len(TEMPLATES)].format(
            noun=noun, Noun=noun.title(), field=rng.choice(FIELDS), verb=rng.choice(VERBS), ext=rng.choice(EXTS),
            n=rng.choice((3, 5, 7, 10, 20)))
        if text not in seen:
            seen.add(text)
            out.append(text)
    else:
        raise ValueError(f"code_prompts: fewer than {n} distinct requests left")
    rng.shuffle(out)
    return out


CODE_REQUESTS = "code-requests"  # the dataset's name as data.source
# the dataset's size: the template with the fewest fillings (16) runs out of new ones past this many rounds
MAX_REQUESTS = 12 * len(TEMPLATES)


def request_conversations(limit: int | None = None) -> list[list[dict]]:
    """The dataset: up to `limit` requests (at most MAX_REQUESTS), each a user turn and an empty assistant turn
    for the target's own answer to fill."""
    n = MAX_REQUESTS if limit is None else min(limit, MAX_REQUESTS)
    return [[{"role": "user", "content": text}, {"role": "assistant", "content": ""}] for text in code_prompts(n)]
