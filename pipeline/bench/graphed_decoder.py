"""Greedy autoregressive decoding with the one-token decode step captured in a CUDA graph: the benchmark's graphed
baseline (`ours_ar_graph`). At small model sizes a GPU decode step is bound by kernel launches, not by the weights
it streams; capturing the whole step -- the forward, argmax, and feeding the argmax back as the next input -- turns
it into one launch with no host synchronisation between tokens. The step attends over a static key span of the
cache (runtime.speculation.cuda_graphs.key_span), a graph per span. CUDA only; importing this module needs no GPU."""
from __future__ import annotations

import torch

from runtime.speculation.cuda_graphs import capture, compile_step, key_span, require_cuda
from runtime.target.model import Transformer

STOP_CHECK = 16  # the decoder looks for a stop token every this many tokens: each look waits for the device


class GraphedGreedyDecoder:
    """`generate(prompt_ids, max_new_tokens)` -> new tokens, greedy. `use_graph=False` runs the same static-shape
    step eagerly (to separate what capture buys from what the static step itself changes); `compile` fuses it
    first (compile_step). Each key span's step is captured on first use."""

    def __init__(self, model: Transformer, max_len: int, use_graph: bool = True, warmup: int = 3,
                 compile: bool = False):
        c = model.config
        require_cuda(model.device, use_graph)
        if c.sliding_window is not None:
            raise ValueError("GraphedGreedyDecoder does not support sliding-window attention")
        if max_len > model.max_seq_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {model.max_seq_len}")
        self.model, self.max_len, self.use_graph, self.warmup = model, max_len, use_graph, warmup
        dev = model.device
        with torch.inference_mode():
            self.cache = model.new_cache(batch=1, max_len=max_len)
            self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)  # input of the next step
            self.pos = torch.zeros(1, 1, dtype=torch.long, device=dev)  # its position == its cache slot
            self.step = torch.zeros(1, dtype=torch.long, device=dev)  # where the step writes its argmax in `out`
            self.out = torch.zeros(max_len, dtype=torch.long, device=dev)
            self.key_slot = torch.arange(max_len, device=dev)
        self.next_pos = 0  # the host's copy of `pos`: choosing a span reads nothing from the device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by key span
        self.run_step = compile_step(self._step, compile)

    # ------------------------------------------------------------------ the static step
    def _step(self, span: int) -> None:
        """The model's own forward of one token at static shapes: KV written at its position, attention over the
        span's slots up to it; the argmax feeds the next step."""
        visible = (self.key_slot[:span] <= self.pos[0, 0]).view(1, 1, 1, span)
        out = self.model(self.token, self.cache, self.pos, slots=self.pos, mask=visible, last_logits_only=True)
        nxt = out.logits[0, -1].argmax().view(1)
        self.out.index_copy_(0, self.step, nxt)
        self.token.copy_(nxt.view(1, 1))
        self.pos.add_(1)
        self.step.add_(1)

    def decode_step(self) -> None:
        """One more token: the static step over the span that holds the cache, replayed from its graph."""
        span = key_span(self.next_pos + 1, self.max_len)
        if not self.use_graph:
            self.run_step(span)
        elif span in self.graphs:
            self.graphs[span].replay()
        else:  # warmed up at this slot, rewound after each warm-up step; capture's replay makes this token
            state = (self.token, self.pos, self.step)
            saved = [t.clone() for t in state]
            rewind = lambda: [t.copy_(s) for t, s in zip(state, saved)]  # noqa: E731
            self.graphs[span] = capture(lambda: self.run_step(span), self.warmup, rewind)[0]
        self.next_pos += 1

    # ------------------------------------------------------------------ decoding
    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
        n = len(prompt_ids)
        if not prompt_ids or max_new_tokens < 1 or n + max_new_tokens - 1 > self.max_len:
            raise ValueError(f"prompt of {n} tokens + max_new_tokens={max_new_tokens} does not fit "
                             f"max_len={self.max_len}")
        m, cache, dev = self.model, self.cache, self.model.device
        cache.reset()
        prompt = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
        logits = m(prompt, cache, torch.arange(n, device=dev)[None], last_logits_only=True).logits
        first = logits[0, -1].argmax().view(1)
        self.out[:1].copy_(first)
        self.token.copy_(first.view(1, 1))
        self.pos.fill_(n)
        self.step.fill_(1)
        self.next_pos = n
        stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev) if stop_ids else None
        made = 1
        while made < max_new_tokens:
            # a stop check costs a host sync: look every STOP_CHECK tokens, and trim what follows the stop below
            if stops is not None and made % STOP_CHECK == 0 and bool(torch.isin(self.out[:made], stops).any()):
                break
            self.decode_step()
            made += 1
        tokens = self.out[:made].tolist()
        stop = set(stop_ids)
        first_stop = next((i for i, t in enumerate(tokens) if t in stop), None)
        return tokens if first_stop is None else tokens[:first_stop + 1]
