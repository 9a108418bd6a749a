"""Token ids to text as they arrive, with OpenAI's stop strings: what a streamed reply sends, piece by piece, adds up
to exactly what the whole reply says, so streamed and non-streamed text agree.

Each piece is the decoded text that is final: the decode of the newest tokens together with a few before them (a
tokenizer may drop a word's leading space, or need several tokens for one character) minus the decode of those few
alone. Text that may be the start of a stop string is held back until the next tokens show whether it is.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self._prefix = self._read = 0  # ids[_prefix:_read] decoded already; ids[_read:] not yet
        self.text = ""  # all text decoded so far
        self._sent = 0  # characters of `text` handed out
        self.stopped = False  # a stop string was found: the reply ends before it

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> str:
        """The text that `tokens` (the reply's next ones) make final; empty once a stop string was found."""
        if self.stopped:
            return ""
        self.ids += tokens
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once the reply has ended (an incomplete character included, as decode gives it)."""
        if not self.stopped:
            before = self._decode(self.ids[self._prefix:self._read])
            self.text += self._decode(self.ids[self._prefix:])[len(before):]
            self._prefix = self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop:
            start = max(0, self._sent - max(map(len, self.stop)) + 1)  # a stop string may straddle the last piece
            found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if found:
                self.stopped, self.text = True, self.text[:min(found)]
                return self._take(len(self.text))
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        return self._take(end)

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string: not sent until the next tokens say."""
        tail = self.text[self._sent:]
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(tail)), 0, -1)
                    if tail.endswith(s[:n])), default=0)

    def _take(self, end: int) -> str:
        piece = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return piece
