"""The n-gram drafter kind: no weights, it drafts what followed the current context before (runtime.ngram)."""
from __future__ import annotations

from runtime.drafter import DrafterKind
from runtime.ngram import NgramDrafter


class NgramKind(DrafterKind):
    name = "ngram"
    weighted = False

    def config(self, module, draft_vocab, settings):
        return {"kind": self.name, "max_ngram": settings.max_ngram}

    def drafter(self, module, config, target, max_len, keep_ids):
        return NgramDrafter(target.config.vocab_size, **{k: v for k, v in config.items() if k != "kind"})


KIND = NgramKind()
