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
    "Write a JavaScript function `{verb}{Noun}s({noun}s)` that {verb}s an array of {noun} objects by their "
    "'{field}' property without mutating the input.",
    "Write a TypeScript interface for a {noun} with an id, a {field} and optional tags, and a function that "
    "returns the {noun}s whose {field} is missing.",
    "Write a Go function that counts how many {noun}s in a slice share each {field}, returning a map.",
    "Write a Rust struct `{Noun}` with an id and a {field}, derive Debug and Clone, and implement a constructor "
    "that rejects an empty {field}.",
    "Write a C function `largest_{field}` that returns the index of the {noun} with the largest {field} in an "
    "array of structs, or -1 when the array is empty.",
    "Write a SQL query that finds {noun}s with a duplicate {field} in the table `{noun}s`, showing each value and "
    "how often it occurs.",
    "Write a SQL CREATE TABLE statement for `{noun}s` with an id primary key, a {field} column and a created_at "
    "timestamp, plus an index on {field}.",
    "Explain what this Python code does and point out one bug:\n"
    "def total_{field}({noun}s):\n    total = 0\n    for i in range(1, len({noun}s)):\n"
    "        total += {noun}s[i]['{field}']\n    return total",
    "Fix the bug in this Python function so that it returns the {n} most recent {noun}s:\n"
    "def latest_{noun}s({noun}s):\n    return sorted({noun}s, key=lambda x: x['created_at'])[:{n}]",
    "Add type hints and a docstring to this Python function:\n"
    "def find_{noun}({noun}s, {field}):\n    for {noun} in {noun}s:\n        if {noun}['{field}'] == {field}:\n"
    "            return {noun}\n    return None",
    "Complete this Python class so that `push` and `pop` work as a stack of {noun}s with a maximum size of {n}:\n\n"
    "class {Noun}Stack:\n    def __init__(self):\n",
    "Write a Python function that implements binary search over a list of {noun}s sorted by '{field}' and returns "
    "the index of the first match, or -1.",
    "Write a Python function that returns the {n} {noun}s with the highest '{field}' using heapq, without sorting "
    "the whole list.",
    "Write a Python function that converts a list of {noun} dicts into a CSV string with a header row, quoting "
    "values that contain commas.",
    "Write an asyncio Python function that fetches {n} {noun}s concurrently with a given async `fetch(id)` and "
    "returns them in id order.",
    "Write a Python function that flattens a nested dict describing a {noun} into dotted keys, such as "
    "'{field}.value'.",
    "Rewrite this recursive Python function as an iterative one:\n"
    "def count_{noun}s(node):\n    if node is None:\n        return 0\n"
    "    return 1 + count_{noun}s(node.left) + count_{noun}s(node.right)",
    "Write a Python decorator `cache_{noun}s` that memoises a function of one argument and evicts the oldest entry "
    "after {n} entries.",
    "Write a Python function that checks whether two {noun} records are equal ignoring case and surrounding "
    "whitespace in every string field.",
    "Write a Python script with argparse that reads a JSON file of {noun}s and prints those whose '{field}' "
    "matches a command-line argument.",
    "Write a Python function that paginates a list of {noun}s: given a page number and a page size of {n}, return "
    "that page and the number of pages.",
    "Write a Python function that merges two lists of {noun}s sorted by '{field}' into one sorted list in linear "
    "time.",
    "Write a Python function that parses a log line such as '2024-01-05 12:00:01 ERROR {noun} {field}=x' into a "
    "dict with date, time, level and fields.",
    "Write a bash one-liner and explain it: count the lines that mention '{noun}' in every .{ext} file in a "
    "directory and print the total.",
    "Write a Python function that builds a graph of {noun}s from (a, b) pairs and returns the connected groups.",
    "Write a JavaScript function that debounces a callback by {n}00 milliseconds, and show it used on a {noun} "
    "search box.",
    "Write a Python function that validates an ISO 8601 date string for a {noun}'s {field} and returns a datetime, "
    "raising ValueError otherwise.",
    "Write a Python function that reads a large .{ext} file of {noun}s line by line and returns how many lines "
    "contain the word '{field}'.",
    "Write a pandas snippet that loads `{noun}s.csv`, drops rows without a {field}, and shows the mean score per "
    "{field}.",
    "Write a Python class `{Noun}Queue` with enqueue, dequeue and peek, backed by collections.deque, raising "
    "IndexError when empty.",
    "Write a Python function that returns the longest run of consecutive {noun}s with the same '{field}' in a "
    "list.",
    "Write a pytest fixture that creates a temporary SQLite database with a `{noun}s` table and {n} rows, and a "
    "test that uses it.",
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
