"""Traffic capture (off unless a database URL is given): each answered request's prompt and reply, text and token
ids, into a database through SQLAlchemy (SQLite by default; any URL it takes, Postgres included). At temperature 0
a served reply is the target's own greedy reply, so captured traffic is self-distillation data as it stands.

Rows are written by one thread of their own, never on the server's event loop; the table keeps at most `max_rows`
rows, none older than `max_age_days` (the oldest go first). A request refused for want of the API key never reaches
it, nor does one that failed.
"""
from __future__ import annotations

import json
import math
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from pipeline.errors import DraftsmithError
from pipeline.serving.settings import env_number

URL_ENV, ROWS_ENV, AGE_ENV = "DRAFTSMITH_CAPTURE_URL", "DRAFTSMITH_CAPTURE_MAX_ROWS", "DRAFTSMITH_CAPTURE_MAX_AGE_DAYS"
TABLE = "served_requests"
PENDING_ROWS = 1024  # rows waiting for the writer; beyond them a row is dropped (and counted), never waited for


@dataclass(frozen=True)
class CaptureSettings:
    url: str | None = None  # None: capture is off
    max_rows: int = 100_000
    max_age_days: float = 30.0

    def __post_init__(self):
        if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int) or self.max_rows < 1:
            raise DraftsmithError(f"capture max_rows={self.max_rows!r}: expected an integer >= 1")
        if not (isinstance(self.max_age_days, (int, float)) and math.isfinite(self.max_age_days)
                and self.max_age_days > 0):
            raise DraftsmithError(f"capture max_age_days={self.max_age_days!r}: expected a number > 0")

    @staticmethod
    def from_env(url: str | None = None) -> "CaptureSettings":
        """`url` (a flag) over $DRAFTSMITH_CAPTURE_URL; the limits from their variables."""
        d = CaptureSettings()
        # max_age_days > 0 is __post_init__'s check: env_number's bound is inclusive
        return CaptureSettings(url or os.environ.get(URL_ENV) or None, env_number(ROWS_ENV, d.max_rows, int, 1),
                               env_number(AGE_ENV, d.max_age_days, float, 0))


@dataclass(frozen=True)
class Captured:
    endpoint: str
    model: str
    prompt: object  # the request's prompt text, token ids or chat messages, as sent
    prompt_ids: list[int]
    reply: str
    reply_ids: list[int]
    temperature: float
    finish_reason: str | None


class TrafficCapture:
    def __init__(self, settings: CaptureSettings):
        from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text, create_engine
        from sqlalchemy.exc import SQLAlchemyError

        self.settings = settings
        try:
            self.db = create_engine(settings.url)
            meta = MetaData()
            self.table = Table(TABLE, meta, Column("id", Integer, primary_key=True, autoincrement=True),
                               Column("created", Float, nullable=False, index=True),
                               Column("endpoint", String(64)), Column("model", String(256)),
                               Column("prompt", Text), Column("prompt_ids", Text), Column("reply", Text),
                               Column("reply_ids", Text), Column("temperature", Float),
                               Column("finish_reason", String(16)))
            meta.create_all(self.db)
        except (SQLAlchemyError, ValueError) as e:  # a bad URL or an unreachable database: say which, once
            raise DraftsmithError(f"traffic capture: cannot open {settings.url!r}: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0]}") from None
        self.dropped = 0  # rows not captured: the writer was too far behind, or the database refused them
        self._queue: queue.Queue = queue.Queue(PENDING_ROWS)
        self._thread = threading.Thread(target=self._write_loop, name="draftsmith-capture", daemon=True)
        self._thread.start()

    def add(self, row: Captured, created: float | None = None) -> None:
        """Queue `row` for the writer (`created`: its time, default now); never blocks."""
        try:
            self._queue.put_nowait((time.time() if created is None else created, row))
        except queue.Full:
            self.dropped += 1

    def flush(self) -> None:
        """Wait until every queued row is written (and the limits applied)."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            rows = [self._queue.get()]
            while True:  # whatever else is waiting goes in the same transaction
                try:
                    rows.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write(rows)
            except Exception:  # a database error costs these rows, not the server
                self.dropped += len(rows)
                traceback.print_exc(file=sys.stderr)
            finally:
                for _ in rows:
                    self._queue.task_done()

    def _write(self, rows: list[tuple[float, Captured]]) -> None:
        from sqlalchemy import delete, insert, select

        t = self.table
        values = [{"created": created, "endpoint": r.endpoint, "model": r.model, "prompt": json.dumps(r.prompt),
                   "prompt_ids": json.dumps(r.prompt_ids), "reply": r.reply, "reply_ids": json.dumps(r.reply_ids),
                   "temperature": r.temperature, "finish_reason": r.finish_reason} for created, r in rows]
        with self.db.begin() as conn:
            conn.execute(insert(t), values)
            conn.execute(delete(t).where(t.c.created < time.time() - self.settings.max_age_days * 86400))
            # the newest max_rows stay: ids grow with time
            cutoff = conn.execute(select(t.c.id).order_by(t.c.id.desc()).offset(self.settings.max_rows)
                                  .limit(1)).scalar()
            if cutoff is not None:
                conn.execute(delete(t).where(t.c.id <= cutoff))
