"""Greedy autoregressive decoding with the one-token decode step captured in a CUDA graph (issue #8).

At small model sizes a GPU decode step is bound by Python and kernel-launch overhead, not by the weights it
streams: SmolLM2-135M runs ~30 layers x ~15 kernels per token. Capturing the whole step -- embedding, every
block, the final norm, lm_head, argmax, and feeding the argmax back as the next step's input -- once in a CUDA
graph turns it into one launch, with no host synchronisation between tokens.

Capture needs static shapes, so the captured step differs from `Transformer.run` in one way: attention reads the
whole static KV cache [max_len] with a mask (key slot <= position) instead of slicing the cache to the live
length. The arithmetic over visible keys is the same; masked keys get weight exactly 0. Same modules, same
weights, same KV cache class (runtime/kv_cache.py): the prefill runs through the ordinary `Transformer.forward`.

Scope: greedy decoding, batch 1, no sliding window, no SpecAttn / quantised KV. Speculative verification through
graphs (tree sizes bucketed to static shapes) is not here yet. CUDA only; importing this module needs no GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model import Transformer, apply_rope


class GraphedGreedyDecoder:
    """`generate(prompt_ids, max_new_tokens)` -> new tokens, greedy. `use_graph=False` runs the same static-shape
    step eagerly (to separate what capture buys from what the static step itself changes)."""

    def __init__(self, model: Transformer, max_len: int, use_graph: bool = True, warmup: int = 3):
        c = model.config
        if model.device.type != "cuda" and use_graph:
            raise ValueError(f"CUDA graphs need a CUDA model, got device {model.device}")
        if c.sliding_window is not None:
            raise ValueError("GraphedGreedyDecoder does not support sliding-window attention")
        if max_len > model.max_seq_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {model.max_seq_len}")
        self.model, self.max_len, self.use_graph = model, max_len, use_graph
        dev = model.device
        with torch.inference_mode():
            self.cache = model.new_cache(batch=1, max_len=max_len)
            self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)  # input of the next step
            self.pos = torch.zeros(1, 1, dtype=torch.long, device=dev)  # its position == its cache slot
            self.step = torch.zeros(1, dtype=torch.long, device=dev)  # where the step writes its argmax in `out`
            self.out = torch.zeros(max_len, dtype=torch.long, device=dev)
            self.key_slot = torch.arange(max_len, device=dev)
            self.graph: torch.cuda.CUDAGraph | None = None
            if use_graph:
                self._capture(warmup)

    # ------------------------------------------------------------------ the static step
    def _step(self) -> None:
        m, cache, c = self.model, self.cache, self.model.config
        H, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim
        pos = self.pos
        cos, sin = m.rope_cos[pos].unsqueeze(2), m.rope_sin[pos].unsqueeze(2)  # [1, 1, 1, D]
        visible = (self.key_slot <= pos[0, 0]).view(1, 1, 1, self.max_len)
        slot = pos[0]
        x = m.tok_embeddings(self.token)
        for i, block in enumerate(m.layers):
            a = block.attention
            qkv = a.wqkv(block.attention_norm(x)).view(1, 1, H + 2 * Hkv, D)
            qk, v = qkv[:, :, :H + Hkv], qkv[:, :, H + Hkv:]
            if a.q_norm is not None:
                qk = torch.cat([a.q_norm(qk[:, :, :H]), a.k_norm(qk[:, :, H:])], dim=2)
            q, k = apply_rope(qk, cos, sin).split([H, Hkv], dim=2)
            keys, values = cache.k[i], cache.v[i]  # [1, Hkv, max_len, D] views of the static cache
            keys.index_copy_(2, slot, k.transpose(1, 2))
            values.index_copy_(2, slot, v.transpose(1, 2))
            qg = q.reshape(1, Hkv, H // Hkv, D)  # grouped-query: each kv head's query heads as rows
            o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=visible)
            x = x + a.wo(o.reshape(1, 1, H * D))
            x = x + block.feed_forward(block.ffn_norm(x))
        logits = m.output(m.norm(x))
        nxt = logits[0, -1].argmax().view(1)
        self.out.index_copy_(0, self.step, nxt)
        self.token.copy_(nxt.view(1, 1))
        self.pos.add_(1)
        self.step.add_(1)

    def _capture(self, warmup: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits, cuBLAS workspaces, autotuning
            for _ in range(warmup):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.pos.zero_()
        self.step.zero_()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()
        torch.cuda.synchronize()

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
        logits, _ = m(prompt, cache, torch.arange(n, device=dev)[None], last_logits_only=True)
        first = logits[0, -1].argmax().view(1)
        self.out[:1].copy_(first)
        self.token.copy_(first.view(1, 1))
        self.pos.fill_(n)
        self.step.fill_(1)
        for _ in range(max_new_tokens - 1):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
        tokens = self.out[:max_new_tokens].tolist()  # the one host sync of the whole generation
        stop = set(stop_ids)
        first_stop = next((i for i, t in enumerate(tokens) if t in stop), None)
        return tokens if first_stop is None else tokens[:first_stop + 1]
