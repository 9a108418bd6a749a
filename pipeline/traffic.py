"""Served traffic as training data: the rows `pipeline serve --openai --capture URL` recorded (table
`served_requests`, pipeline.serving.capture), read back for prepare.

Each row is the prompt's token ids as served and the reply's: a training row of both, the loss on the reply. A reply
served at temperature 0 is the target's own greedy reply, so it is self-distillation data as it stands, with no
regeneration pass; one served at temperature > 0 is a draw from the target's own distribution (verification is
lossless), kept by default (`data.traffic_sampled`). The newest rows are held out for validate, so a candidate is
judged on the traffic that came last.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import DraftsmithError
from pipeline.home import digest_json
from pipeline.serving.capture import TABLE

COLUMNS = "id, created, prompt_ids, reply_ids, temperature"
TRAFFIC_VAL = "traffic_val.safetensors"  # prepare's held-out traffic rows, which validate measures on


@dataclass(frozen=True)
class Served:
    """One captured request, as read back."""
    id: int
    created: float
    prompt_ids: list[int]
    reply_ids: list[int]
    temperature: float


@dataclass
class TrafficSplit:
    train: list[tuple[list[int], list[int]]]  # (ids, loss mask) rows, oldest first
    val: list[tuple[list[int], list[int]]]  # the newest rows, held out
    counts: dict = field(default_factory=dict)  # rows read, greedy, sampled, dropped by reason


def shown(url: str) -> str:
    """`url` as messages print it: without a password."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def _engine(url: str):
    """An engine on an existing database holding the capture table; else one line saying what is wrong."""
    from sqlalchemy import create_engine, inspect
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    where = f"data.traffic {shown(url)}"
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DraftsmithError(f"{where}: not a database URL (expected e.g. sqlite:///traffic.db)") from None
    file = parsed.database
    if parsed.get_backend_name() == "sqlite" and file and file != ":memory:" and not Path(file).is_file():
        # SQLite would create an empty file: say that nothing was captured there instead
        raise DraftsmithError(f"{where}: no such database file {file} (expected the one `pipeline serve --openai "
                              "--capture` writes)")
    try:
        engine = create_engine(parsed)
        if not inspect(engine).has_table(TABLE):
            raise DraftsmithError(f"{where}: the database has no table {TABLE} (expected the one `pipeline serve "
                                  "--openai --capture` writes)")
    except (SQLAlchemyError, ImportError) as e:  # an unreachable server, a driver not installed
        raise DraftsmithError(f"{where}: cannot read it: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return engine


def read_served(url: str, newest: int) -> list[Served]:
    """The newest `newest` captured rows, oldest first; rows whose ids are not JSON lists of integers are skipped."""
    from sqlalchemy import text

    with _engine(url).connect() as conn:
        rows = conn.execute(text(f"SELECT {COLUMNS} FROM {TABLE} ORDER BY id DESC LIMIT :n"), {"n": newest}).all()
    if not rows:
        raise DraftsmithError(f"data.traffic {shown(url)}: {TABLE} has no rows (nothing has been captured yet)")
    out = []
    for r in reversed(rows):
        prompt, reply = _ids(r.prompt_ids), _ids(r.reply_ids)
        out.append(Served(int(r.id), float(r.created), prompt, reply, float(r.temperature or 0.0)))
    return out


def _ids(raw) -> list[int]:
    try:
        ids = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return []
    return ids if isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids) else []


def fingerprint(url: str, newest: int) -> str:
    """What prepare's digest holds of the traffic: the ids and times of the rows it would read. A new row changes
    it (and so reruns prepare and everything after it); an unchanged table leaves it, and the run, as they were."""
    from sqlalchemy import text

    with _engine(url).connect() as conn:
        rows = conn.execute(text(f"SELECT id, created FROM {TABLE} ORDER BY id DESC LIMIT :n"), {"n": newest}).all()
    return digest_json([[int(r.id), float(r.created)] for r in rows])


def traffic_rows(served: list[Served], vocab_size: int, max_length: int, min_reply_tokens: int,
                 sampled: str) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """(ids, loss mask) rows, oldest first: prompt + reply cut to `max_length`, the loss on the reply; and counts
    (greedy and sampled rows kept, rows dropped by reason)."""
    rows, counts = [], {"read": len(served), "greedy": 0, "sampled": 0}

    def drop(why: str) -> None:
        counts[f"dropped_{why}"] = counts.get(f"dropped_{why}", 0) + 1

    for s in served:
        if not s.prompt_ids or not s.reply_ids or max(s.prompt_ids + s.reply_ids) >= vocab_size:
            drop("bad_ids")  # not this target's tokens, or not ids at all
        elif s.temperature > 0 and sampled == "drop":
            drop("sampled")
        elif len(s.prompt_ids) + min_reply_tokens > max_length or len(s.reply_ids) < min_reply_tokens:
            drop("too_few_assistant_tokens")
        else:
            ids = (s.prompt_ids + s.reply_ids)[:max_length]
            rows.append((ids, [0] * len(s.prompt_ids) + [1] * (len(ids) - len(s.prompt_ids))))
            counts["sampled" if s.temperature > 0 else "greedy"] += 1
    return rows, counts


def split_recent(rows: list, holdout: float, url: str) -> tuple[list, list]:
    """(older rows, the newest `holdout` share of them, at least one); at least one row on each side."""
    if len(rows) < 2:
        raise DraftsmithError(f"data.traffic {shown(url)}: {len(rows)} usable captured row(s); need at least 2 (one "
                              "to train on, one held out for validate)")
    n_val = min(len(rows) - 1, max(1, math.ceil(len(rows) * holdout)))
    return rows[:-n_val], rows[-n_val:]


def mix_sizes(traffic: int, base: int, share: float) -> tuple[int, int]:
    """(traffic rows, base conversations) to train on so that traffic makes `share` of them: every traffic row when the
    base set has enough to go with it, else as many as the base set allows."""
    if share >= 1:
        return traffic, 0
    want_base = round(traffic * (1 - share) / share)
    if want_base <= base:
        return traffic, want_base
    return min(traffic, max(1, round(base * share / (1 - share)))), base


def read_traffic(d, vocab_size: int) -> TrafficSplit:
    """The data section's traffic (`d.traffic`), as training rows and held-out rows."""
    rows, counts = traffic_rows(read_served(d.traffic, d.traffic_rows), vocab_size, d.max_length,
                                d.min_assistant_tokens, d.traffic_sampled)
    train, val = split_recent(rows, d.traffic_holdout, d.traffic)
    return TrafficSplit(train, val, counts)
