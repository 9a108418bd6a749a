"""One thread owns a BatchEngine; callers on any thread hand it requests and wait for their own answers.

A caller's request (one or more rows) is accepted whole or refused at once: refused when the rows running and
waiting would exceed `max_batch + max_queue` (QueueFull), never left to hang. An accepted request is always answered:
with its generations, with RequestTimedOut once `timeout_s` has passed since it was accepted (its rows are dropped
from the engine at the next step, freeing theirs), or with the engine's error should a step fail (every row then in
the engine gets it, and the engine starts over empty). A caller that stops waiting (a client that went away) costs
nothing but its rows' steps: its answer is dropped when it comes, and every other request goes on.

`generate` waits on the caller's thread. `submit` returns at once with a Pending: a streaming caller passes
`on_tokens`, handed each row's tokens as they are committed, and `on_done`, called once all rows have finished or
failed (both on the scheduler's thread: they must only hand the news on), and may `cancel` it at any time.
"""
from __future__ import annotations

import itertools
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from runtime.serving.batch_engine import BatchEngine, BatchRequest
from runtime.speculation.engine import Generation, check_request


class SchedulerError(RuntimeError):
    """A request the scheduler refused or could not finish."""


class QueueFull(SchedulerError):
    pass


class RequestTimedOut(SchedulerError):
    pass


@dataclass(eq=False)
class _Ticket:
    rows: int
    accepted: float
    answers: dict[int, Generation] = field(default_factory=dict)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    on_tokens: Callable[[int, list[int]], None] | None = None  # (row, tokens) as they land
    on_done: Callable[[], None] | None = None

    def finish(self) -> None:
        self.done.set()
        if self.on_done is not None:
            _call(self.on_done)

    def hand_out(self, row: int, tokens: list[int]) -> None:
        if self.on_tokens is not None and not _call(self.on_tokens, row, tokens):
            self.on_tokens = None  # a failing callback is not called again


def _call(fn, *args) -> bool:
    """A caller's callback on the scheduler's thread: its failure is printed, never the step's that everyone shares."""
    try:
        fn(*args)
        return True
    except Exception:
        traceback.print_exc(file=sys.stderr)
        return False


class Pending:
    """An accepted request: its answers (`result`), or its rows dropped (`cancel`)."""

    def __init__(self, scheduler: "Scheduler", tid: int, ticket: _Ticket):
        self._scheduler, self._tid, self._ticket = scheduler, tid, ticket
        self.deadline = ticket.accepted + scheduler.timeout_s  # time.monotonic()'s clock

    @property
    def done(self) -> bool:
        return self._ticket.done.is_set()

    def result(self) -> list[Generation]:
        """Wait until every row has finished, at most until the deadline: the generations in order; RequestTimedOut
        (its rows then leave the engine) or the engine's error as SchedulerError."""
        s, ticket = self._scheduler, self._ticket
        if not ticket.done.wait(max(0.0, self.deadline - time.monotonic())):
            with s._cond:
                if not ticket.done.is_set():  # it may have finished while the lock was taken
                    s._give_up(self._tid, ticket)
                    raise RequestTimedOut(
                        f"request timed out after {s.timeout_s:g} s: {ticket.rows - len(ticket.answers)} of its "
                        f"{ticket.rows} rows unfinished ({s._rows} rows running or queued)")
        if ticket.error is not None:
            raise SchedulerError(f"generation failed: {type(ticket.error).__name__}: {ticket.error}")
        return [ticket.answers[i] for i in range(ticket.rows)]

    def cancel(self) -> bool:
        """Stop the request (a client that went away, a stop string seen): its unfinished rows leave the engine at
        the next step and no callback of it runs after this returns. Whether it was still unfinished."""
        with self._scheduler._cond:
            if self._ticket.done.is_set() or self._tid not in self._scheduler._tickets:
                return False
            self._scheduler._give_up(self._tid, self._ticket)
            return True


class Scheduler:
    def __init__(self, engine: BatchEngine, max_queue: int, timeout_s: float):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"Scheduler: max_queue={max_queue!r}, expected an int >= 0")
        if not timeout_s > 0:
            raise ValueError(f"Scheduler: timeout_s={timeout_s!r}, expected a number > 0")
        self.engine, self.max_queue, self.timeout_s = engine, max_queue, timeout_s
        self.capacity = engine.max_batch + max_queue  # rows running and waiting, at most
        self._cond = threading.Condition()
        self._incoming: deque[tuple[_Ticket, BatchRequest]] = deque()
        self._dropped: list[tuple[int, int]] = []  # keys of rows whose caller gave up
        self._tickets: dict[int, _Ticket] = {}
        self._rows = 0  # rows accepted and not yet answered or dropped
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="draftsmith-scheduler", daemon=True)
        self._thread.start()

    @property
    def rows_in_flight(self) -> int:
        with self._cond:
            return self._rows

    def generate(self, requests: list[BatchRequest]) -> list[Generation]:
        """Run `requests` (their keys are replaced by the scheduler's) and wait for all of their generations, in
        order. ValueError for a request no engine could run; QueueFull, RequestTimedOut or the engine's error as
        SchedulerError otherwise."""
        return self.submit(requests).result()

    def submit(self, requests: list[BatchRequest], on_tokens: Callable[[int, list[int]], None] | None = None,
               on_done: Callable[[], None] | None = None) -> Pending:
        """Accept `requests` whole and return at once (ValueError or QueueFull as `generate` raises them)."""
        cfg, vocab = self.engine.cfg, self.engine.target.config.vocab_size
        for r in requests:
            check_request(r.prompt, r.max_new_tokens, vocab, cfg.max_seq_len)
        if len(requests) > self.capacity:
            raise QueueFull(f"a request of {len(requests)} rows can never fit: the server runs {self.engine.max_batch} "
                            f"rows and queues {self.max_queue} more (send fewer rows a request)")
        ticket = _Ticket(len(requests), time.monotonic(), on_tokens=on_tokens, on_done=on_done)
        with self._cond:
            if self._rows + len(requests) > self.capacity:
                raise QueueFull(f"server busy: {self._rows} rows running or queued, at most {self.capacity} "
                                f"({self.engine.max_batch} running + a queue of {self.max_queue}); retry later")
            tid = next(self._ids)
            self._tickets[tid] = ticket
            self._rows += len(requests)
            if on_tokens is not None:
                self.engine.on_commit = self._hand_out
            self._incoming.extend((ticket, replace(r, key=(tid, i))) for i, r in enumerate(requests))
            self._cond.notify()
        return Pending(self, tid, ticket)

    @property
    def alive(self) -> bool:
        """Whether the thread that steps the engine is running (it only ends with the process)."""
        return self._thread.is_alive()

    @property
    def rows_waiting(self) -> int:
        """Rows accepted and not yet in the engine's batch."""
        with self._cond:
            return self._rows - self.engine.running

    def _hand_out(self, key: tuple[int, int], tokens: list[int]) -> None:
        """(Scheduler thread, inside a step.) A row's fresh tokens to its caller's on_tokens, unless it gave up."""
        with self._cond:
            ticket = self._tickets.get(key[0])
            if ticket is not None:  # under the lock: a cancel that has returned is never followed by a callback
                ticket.hand_out(key[1], tokens)

    def _give_up(self, tid: int, ticket: _Ticket) -> None:
        """(Lock held.) The caller stopped waiting: its rows still waiting here go, those in the engine are dropped
        at the next step."""
        del self._tickets[tid]
        waiting = {r.key for t, r in self._incoming if t is ticket}
        self._incoming = deque((t, r) for t, r in self._incoming if t is not ticket)
        self._rows -= len(waiting)
        self._dropped += [(tid, i) for i in range(ticket.rows) if i not in ticket.answers and (tid, i) not in waiting]
        self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._incoming or self._dropped or self.engine.busy):
                    self._cond.wait()
                incoming, self._incoming = list(self._incoming), deque()
                dropped, self._dropped = self._dropped, []
            freed = sum(self.engine.cancel(key) for key in dropped)  # a row that finished meanwhile is not there
            with self._cond:
                self._rows -= freed
            submitted = 0
            try:
                for _, request in incoming:
                    self.engine.submit(request)
                    submitted += 1
                finished = self.engine.step()
            except Exception as e:  # a bug: answer everyone with it, start over empty, keep serving
                traceback.print_exc(file=sys.stderr)
                self._fail_all(e, [r.key for _, r in incoming[submitted:]])
                continue
            with self._cond:
                for (tid, i), generation in finished.items():
                    self._rows -= 1
                    ticket = self._tickets.get(tid)
                    if ticket is None:  # its caller gave up: nobody reads it
                        continue
                    ticket.answers[i] = generation
                    if len(ticket.answers) == ticket.rows:
                        del self._tickets[tid]
                        ticket.finish()

    def _fail_all(self, error: BaseException, unsubmitted: list[tuple[int, int]]) -> None:
        """Every row in the engine is dropped and its request answered with `error`, as are `unsubmitted` rows."""
        keys = [r.key for r in self.engine.queue] + [row.request.key for row in self.engine.rows if row is not None]
        for key in keys:
            self.engine.cancel(key)
        with self._cond:
            self._rows -= len(keys) + len(unsubmitted)
            for tid in {tid for tid, _ in keys + unsubmitted}:
                ticket = self._tickets.pop(tid, None)
                if ticket is not None:
                    ticket.error = error
                    ticket.finish()
