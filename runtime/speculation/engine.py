"""Speculative decoding engine: draft a tree, verify it in one target forward, keep the accepted path.

Without a drafter every step is a one-token tree-less verify, i.e. plain autoregressive decoding through the
same model, cache and verifier -- the baseline speculative decoding is measured against. Greedy output is
token-for-token that of plain decoding; sampled output has the target's distribution (runtime.speculation.verify).

With `EngineConfig.sparse` (SpecAttn) the verify forward reads, in the mapped layers, only the prefix keys the
drafter's attention selects (runtime.target.attention.kept_keys). The output is then that of the *sparse* target: lossy
w.r.t. the dense target by design (calibrate bounds the perplexity change); top_p = 1.0 equals dense exactly.

With `EngineConfig.lookup` a greedy step's tree also holds what followed an earlier occurrence of the sequence's last
tokens (an n-gram trie beside the drafter): one trie with the drafter's tree (DraftTree.union), verified as one.
With `EngineConfig.lookup_corpus` the branch drafts from that corpus where the sequence has no match.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from runtime.drafters.ngram import NgramDrafter
from runtime.speculation.cuda_graphs import StaticVerifier
from runtime.speculation.decode_stats import Clock, DecodeStats, Metrics
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.drafter import Drafter
from runtime.speculation.engine_config import EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree
from runtime.speculation.verify import verify
from runtime.target.attention import SpecAttnConfig, kept_keys
from runtime.target.model import Taps, Transformer
from runtime.target.model_config import context_error
from runtime.target.quant_kv_cache import QuantizedKVCache, kv_cache_as


@dataclass(frozen=True)
class Generation:
    tokens: list[int]  # new tokens only; ends at the first stop id (included) or after max_new_tokens
    metrics: Metrics


class Engine:
    def __init__(self, target: Transformer, drafter: Drafter | None = None, cfg: EngineConfig = EngineConfig(),
                 *, clock: Callable[[], float] = time.perf_counter):
        """`clock`: the seconds every phase, the metrics and EngineConfig.speed_check are timed with (a test's
        fake clock makes the speed check's verdict independent of the host's load)."""
        if cfg.max_seq_len > target.max_seq_len:
            raise ValueError(f"EngineConfig.max_seq_len={cfg.max_seq_len} exceeds the target's max_seq_len "
                             f"{target.max_seq_len} (load the target with a larger max_seq_len)")
        vocab = target.config.vocab_size
        if drafter is not None and drafter.vocab_size != vocab:
            raise ValueError(f"drafter vocab_size {drafter.vocab_size} != target vocab_size {vocab}: a drafter "
                             "must propose tokens of the target's vocabulary")
        if cfg.sparse is not None and (drafter is None or len(cfg.sparse.layer_map) != target.config.n_layers):
            raise ValueError(f"EngineConfig.sparse needs a drafter and a layer map with one entry per target layer "
                             f"({target.config.n_layers}), got {len(cfg.sparse.layer_map)}")
        self.target, self.drafter, self.cfg, self.clock = target, drafter, cfg, clock
        quant, c = cfg.kv_quant, target.config
        self.cache = target.new_cache(batch=1, max_len=cfg.max_seq_len) if quant is None else QuantizedKVCache(
            c.n_layers, 1, c.n_kv_heads, cfg.max_seq_len, c.head_dim, quant, target.dtype, target.device)
        shares = drafter is not None and drafter.read_target_cache(self.cache)  # quantspec reads the target's KV
        if hasattr(drafter, "cache") and not shares:  # EAGLE and LM keep their own: same scheme, drafter reader
            drafter.cache = kv_cache_as(drafter.cache, quant and replace(quant, reader="draft"))
        self.sparse = self._track_attention(drafter, cfg.sparse)
        self.lookup = NgramDrafter(vocab, max_depth=cfg.lookup, corpus=cfg.lookup_corpus) \
            if cfg.lookup and drafter is not None and not isinstance(drafter, NgramDrafter) else None
        # what the drafter reads of each target forward: the residual streams entering these layers, or () the
        # final hidden states
        self.features = drafter.feature_layers if drafter is not None and drafter.needs_features else ()
        self.taps = Taps.entering(self.features)
        self.static = None
        if cfg.static_verify:
            on_gpu = target.device.type == "cuda"
            self.static = StaticVerifier(target, self.cache, use_graph=on_gpu, sparse=self.sparse,
                                         features=self.features, compile=cfg.compile_static)
            if drafter is not None:
                drafter.use_static(use_graph=on_gpu, compile=cfg.compile_static)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 generator: torch.Generator | None = None, stop_ids: tuple[int, ...] = ()) -> Generation:
        self._check_request(prompt_ids, max_new_tokens)
        cfg, target, cache, drafter = self.cfg, self.target, self.cache, self.drafter
        device, stop = target.device, set(stop_ids)
        clock = Clock(device, self.clock)
        cache.reset()

        n = len(prompt_ids)
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
        speculating = drafter is not None
        wanted = self.features if speculating and drafter.needs_features else None
        logits, hidden = target.prefill(prompt[None], cache, features=wanted)
        root = verify(DraftTree.empty(device), logits[0], params, generator).next_token
        out = [root]
        lookup = self.lookup if params.greedy else None
        if speculating:
            drafter.reset(*prompt_window(torch.tensor(prompt_ids + [root], device=device),
                                         None if hidden is None else hidden[0], cfg.draft_window))
            if lookup is not None:
                lookup.reset(torch.tensor(prompt_ids + [root]))
        prefill_s = clock.lap()

        stats = DecodeStats(cfg)
        stopped = root in stop
        n_cached = n  # the cache's length, kept on the host: reading it would wait for the device
        while len(out) < max_new_tokens and not stopped:
            room = min(cfg.max_seq_len - n_cached - 1, max_new_tokens - len(out) - 1)
            if isinstance(cache, QuantizedKVCache):  # one quantisation boundary per verify keeps it lossless
                room = min(room, cache.exact_depth())
            tree = DraftTree.empty(device)
            plain = speculating and stats.plain_next()  # timed against speculation, or a pause
            step_s = 0.0
            if speculating and room > 0 and not plain:
                tree = drafter.propose(stats.budget(room), params, generator)
                if len(tree) > room:
                    raise ValueError(f"drafter proposed {len(tree)} nodes, more than the budget of {room}")
                cap = min(cfg.max_tree, room) if cfg.max_tree and params.greedy else room
                if lookup is not None:
                    # both branches draft within the room and the best-scored nodes of their union fill it: the
                    # drafter's tree first would starve the lookup branch once a reply nears max_new_tokens
                    tree = tree.union(lookup.propose(DraftBudget(depth=min(cfg.lookup, room)), params), limit=cap)
                if len(tree) > cap:  # greedy only: max_tree
                    tree = tree.best(cap)
                step_s += clock.lap()
                stats.draft_s += step_s

            # the verify's inputs in one copy from the host: tokens, positions and (with a tree) the ancestor mask
            depths = [0] + tree.depth_list()
            inputs = torch.tensor([[root] + tree.host_lists().tokens, [n_cached + d for d in depths]]
                                  + (tree.ancestor_rows() if len(tree) else []), dtype=torch.long, device=device)
            tokens, positions = inputs[:1], inputs[1:2]
            n_live = n_cached + tokens.shape[1]
            # SpecAttn: the draft layers' kept keys, over the whole static cache for a static step
            keep = self._kept_keys(n_cached, cache.max_len if self.static is not None else n_live) \
                if self.sparse is not None and len(tree) else None
            layers = self._layer_keep(keep if keep is None else keep[..., :n_live])  # per target layer, live keys
            tree_mask = inputs[2:].bool() if len(tree) else None
            if self.static is not None:
                logits, hidden = self.static(tokens, positions, tree_mask, keep, cached=n_cached)
            else:
                verified = target(tokens, cache, positions, tree_mask, kv_keep=layers, taps=self.taps)
                logits, hidden = verified.logits, verified.features(self.features)
            stats.count_reads(layers, n_live, target.config.n_layers, target.config.n_kv_heads)
            verdict = verify(tree, logits[0], params, generator)
            verify_s = clock.lap()
            stats.verify_s += verify_s

            rows = [0] + [i + 1 for i in verdict.accepted]  # the root's and the accepted nodes' slots
            cache.compact(rows)
            n_cached += len(rows)
            rollback_s = clock.lap()
            stats.rollback_s += rollback_s
            step_s += verify_s + rollback_s

            committed = [tree.host_lists().tokens[i] for i in verdict.accepted] + [verdict.next_token]
            if speculating:  # the committed tokens and their rows, one copy to the device
                moved = torch.tensor([committed, rows], device=device)
                drafter.commit(moved[0], self._features(hidden[0].index_select(0, moved[1])))
                if lookup is not None:
                    lookup.commit(torch.tensor(committed))
                commit_s = clock.lap()
                stats.draft_s += commit_s
                step_s += 0.0 if plain else commit_s  # plain decoding alone would not keep the drafter in step
            stats.record(tree, verdict.accepted)
            if speculating:
                stats.time_step(tree, len(committed), step_s, plain)
            if speculating and stats.should_fall_back():
                speculating = False
            out += committed
            root = out[-1]
            stopped = not stop.isdisjoint(committed)

        first_stop = next((i for i, t in enumerate(out) if t in stop), None)
        out = out[: max_new_tokens if first_stop is None else min(first_stop + 1, max_new_tokens)]
        return Generation(out, stats.metrics(n, len(out), prefill_s, clock.total()))

    @staticmethod
    def _track_attention(drafter: Drafter | None, sparse: SpecAttnConfig | None) -> SpecAttnConfig | None:
        """Have the drafter gather the attention of the draft layers SpecAttn's map reads, and return the settings
        over what it gathers (None: dense verification, as where the map reads no draft layer)."""
        layers = () if sparse is None else sparse.draft_layers()
        if drafter is not None:
            drafter.track_attention = bool(layers)
            drafter.attention_layers = layers or None
        if not layers:
            return None
        return sparse if drafter.attention_layers is None else sparse.over(drafter.attention_layers)

    def _kept_keys(self, prefix: int, n_keys: int) -> torch.Tensor:
        """Per draft layer, the keys [Ld, Hkv, 1, n_keys] this verify reads (SpecAttn): keys at or beyond the
        committed `prefix` (this verify's own) are all kept."""
        sparse = self.sparse
        attention = self.drafter.draft_attention()
        if attention is None or attention.shape[-1] != prefix:
            got = None if attention is None else tuple(attention.shape)
            raise ValueError(f"sparse verification needs the drafter's attention over the {prefix} committed keys; "
                             f"{type(self.drafter).__name__}.draft_attention() gave {got}")
        return kept_keys(attention[:, :, None], torch.tensor([prefix], device=attention.device), n_keys,
                         self.target.config.n_kv_heads, sparse.top_p, sparse.sink, sparse.recent)

    def _layer_keep(self, keep: torch.Tensor | None) -> list[torch.Tensor | None] | None:
        """Per target layer, the keys [1, Hkv, 1, S] it reads; None: every layer dense."""
        layers = None if keep is None else self.sparse.layer_keep(keep)
        return None if layers is None or all(k is None for k in layers) else layers

    def _features(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return hidden if self.drafter is not None and self.drafter.needs_features else None

    def _check_request(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        check_request(prompt_ids, max_new_tokens, self.target.config.vocab_size, self.cfg.max_seq_len)


def prompt_window(tokens: torch.Tensor, features: torch.Tensor | None,
                  window: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a drafter reads of a prompt: its last `window` tokens before the root, the root, and their features
    (one fewer than the tokens); all of it with window 0."""
    if not window or tokens.numel() <= window + 1:
        return tokens, features
    return tokens[-(window + 1):], None if features is None else features[-window:]


def check_request(prompt_ids: list[int], max_new_tokens: int, vocab: int, max_seq_len: int) -> None:
    """A clear error for a request an engine cannot run: an empty prompt, ids outside the vocabulary, a bad
    max_new_tokens, or more tokens than the KV cache holds."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: at least one prompt token is needed")
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_ids contains {bad[:3]}, outside the target vocabulary 0..{vocab - 1}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}, expected an int >= 1")
    overflow = context_error(len(prompt_ids), max_new_tokens, max_seq_len, "the KV cache of max_seq_len")
    if overflow:
        raise ValueError(overflow)
