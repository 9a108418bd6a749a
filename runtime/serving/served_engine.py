"""The one way a bundle becomes the engine that serves it. Validate, serving, `pipeline bench` and scripts all call
`served_engine`, so what validate measures is what serving runs: the calibrated budget, KV scheme and SpecAttn, and
on a GPU every verify and greedy draft step a CUDA graph with the budget that runs fastest there."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from runtime.bundle_reader import Bundle
from runtime.drafters import drafter_factory, get_kind
from runtime.drafters.ngram import NgramDrafter
from runtime.serving.batch_engine import BatchEngine
from runtime.serving.budget_tuner import BATCH_NEW_TOKENS, ENGINE_NEW_TOKENS, choose_on_device, measure_policy
from runtime.serving.reply_corpus import ReplyCorpus
from runtime.speculation.draft_budget import BatchPolicy, ServedBudget
from runtime.speculation.drafter import Drafter
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.model import Transformer


# prompt tokens a trained drafter reads (EngineConfig.draft_window): it learned on rows of at most a few hundred, and
# reading a long document costs its first proposal seconds; an n-gram drafter reads every token. Measured in
# docs/logs/cpu-2026-11.md,
# "Trained drafters read the prompt's last 512 tokens (`EngineConfig.draft_window`, #43)"
DRAFT_WINDOW = 512


def static_verify_config(cfg: EngineConfig) -> tuple[EngineConfig, str]:
    """The engine config of the `ours_spec_graph` row, and a note: a quantised KV cache has no static step, so that
    row runs full-precision KV (as ours_ar_graph always does) and its tokens are compared with ours_ar_graph's."""
    if cfg.kv_scheme is None:
        return replace(cfg, static_verify=True), ""
    return (replace(cfg, kv_scheme=None, static_verify=True),
            f"graph rows run a full-precision KV cache (the {cfg.kv_scheme} KV cache has no static step): "
            "ours_spec_graph is lossless if it equals ours_ar_graph, ours_ar runs the quantised cache")


def batch_config(cfg: EngineConfig) -> tuple[EngineConfig, str]:
    """The batched engine's config (runtime.serving.batch_engine: full-precision KV, dense verification), and a note
    naming what it drops from `cfg`."""
    dropped = [what for what, on in (("the quantised KV cache", cfg.kv_scheme), ("SpecAttn", cfg.sparse)) if on]
    note = f"batched rows run without {' and '.join(dropped)}: one boundary or key selection per sequence " \
           "is not shared by a batch" if dropped else ""
    return replace(cfg, kv_scheme=None, sparse=None), note


@dataclass(frozen=True)
class ServedEngine:
    engine: Engine
    budget: ServedBudget  # the budget it runs
    eager_config: EngineConfig  # the same settings without static steps (a quantised KV cache included)
    new_drafter: Callable[[], Drafter]  # a fresh drafter of the same bundle
    device_report: dict | None = None  # choose_on_device's, where the budget was chosen by timing this device
    # budgets a batch may draft within, smaller than `budget`, with calibrate's tau where it measured one
    batch_candidates: tuple[tuple[ServedBudget, float | None], ...] = ()

    def plain(self) -> Engine:
        """Our autoregressive decode with the same target, cache and verifier: the baseline speculation is
        measured against (dense: it reads every key)."""
        return Engine(self.engine.target, None, replace(self.engine.cfg, sparse=None))

    def policy_candidates(self) -> list[tuple[ServedBudget, float | None]]:
        """The budgets a batch policy chooses among (beside plain decoding): `budget` and the smaller
        batch_candidates, each with calibrate's tau or None."""
        return [(self.budget, None)] + [c for c in self.batch_candidates if c[0] != self.budget]

    def measure_policy(self, max_batch: int, prompts: list[list[int]],
                       new_tokens: int = BATCH_NEW_TOKENS) -> BatchPolicy:
        """The draft budget at each batch size up to `max_batch`, timed here on `prompts` among policy_candidates
        and plain decoding (runtime.serving.budget_tuner.measure_policy)."""
        return measure_policy(self.engine.target, self.new_drafter, batch_config(self.engine.cfg)[0],
                              self.policy_candidates(), prompts, max_batch, new_tokens)

    def batched(self, max_batch: int, policy: BatchPolicy | None = None, plain: bool = False,
                learn_tokens: int = 0) -> tuple[BatchEngine, str]:
        """The engine serving up to `max_batch` rows at once, and a note on what it runs: drafting within `policy`
        (measure_policy's, or a kept one), default `budget` at every batch size. `plain`: no drafter, plain batched
        decoding (our batched autoregressive baseline). `learn_tokens` > 0: the lookup branch, and an n-gram
        drafter, also draft from the last replies served, up to that many tokens (runtime.serving.reply_corpus)."""
        cfg, note = batch_config(self.engine.cfg)
        if plain:
            return BatchEngine(self.engine.target, None, cfg, max_batch), note
        policy = policy or BatchPolicy.fixed(self.budget)
        if not learn_tokens:
            return BatchEngine(self.engine.target, self.new_drafter, cfg, max_batch, policy), note
        depth = max([max(b.tree.depth, b.lookup) for b in policy.budgets() if b is not None], default=1)
        replies = ReplyCorpus(self.engine.target.config.vocab_size, learn_tokens, depth, base=cfg.lookup_corpus)

        def new_drafter() -> Drafter:
            drafter = self.new_drafter()
            if isinstance(drafter, NgramDrafter) and drafter.corpus is None:
                drafter.corpus = replies
            return drafter

        return BatchEngine(self.engine.target, new_drafter, replace(cfg, lookup_corpus=replies), max_batch, policy,
                           replies), note


def smaller_budgets(budget: ServedBudget, sweep: list[dict], most: int = 3) -> list[tuple[ServedBudget, float | None]]:
    """Up to `most` budgets for a growing batch, verifying at most 1/2, 1/4, ... of `budget`'s rows down to a single
    node: at each limit the best tau among calibrate's fixed sweep budgets (rows with tau) that fit, else `budget`
    cut to that many nodes, its greedy rows keeping their likeliest (DraftTree.best; its tau is then measured where
    the batch policy times it)."""
    def rows(b: ServedBudget) -> int:
        n = b.tree.max_nodes + b.lookup
        return min(n, b.max_tree) if b.max_tree else n

    fixed = [(ServedBudget.from_dict(r), r["tau"]) for r in sweep if not r.get("adaptive") and "tau" in r]
    out: list[tuple[ServedBudget, float | None]] = []
    limit = rows(budget) // 2
    while limit >= 1 and len(out) < most:
        fits = [c for c in fixed if rows(c[0]) <= limit and c not in out]
        out.append(max(fits, key=lambda c: c[1]) if fits else (replace(budget, max_tree=limit), None))
        limit //= 2
    return out


def served_engine(bundle: Bundle, target: Transformer, max_seq_len: int, *, fallback: ServedBudget = ServedBudget(),
                  budget: ServedBudget | None = None, device_prompt: list[int] | None = None,
                  specattn_top_p: float | None = None, graphed: bool | None = None,
                  new_tokens: int = ENGINE_NEW_TOKENS, speed_check: bool = True,
                  new_drafter: Callable[[], Drafter] | None = None) -> ServedEngine:
    """The engine `bundle` serves with on `target`'s device. Its budget: `budget` where given, else the one calibrate
    chose (`fallback` for bundles without one); with `device_prompt`, the bundle's device candidate that commits the
    most tokens a second on this device, each timed first on that prompt. `graphed` (default: on CUDA) captures
    every static step in a CUDA graph. `speed_check` pauses speculation while it loses to plain decoding
    (EngineConfig.speed_check); off, the engine measures how far a budget reaches. `new_drafter`: another served
    engine's, whose module this one shares instead of loading the bundle's again."""
    graphed = target.device.type == "cuda" if graphed is None else graphed
    new_drafter = new_drafter or drafter_factory(bundle, target, max_seq_len)

    window = DRAFT_WINDOW if get_kind(bundle.kind).weighted else 0

    def eager(b: ServedBudget) -> EngineConfig:
        fields = bundle.engine_fields(b, specattn_top_p)
        return EngineConfig(max_seq_len=max_seq_len, speed_check=speed_check,
                            draft_window=0 if fields.get("sparse") else window, **fields)

    def config(b: ServedBudget) -> EngineConfig:
        return static_verify_config(eager(b))[0] if graphed else eager(b)

    chosen, report = budget or bundle.served_budget(fallback), None
    candidates = bundle.device_candidates() if device_prompt is not None and budget is None else []
    if candidates:
        best, report = choose_on_device(target, new_drafter, candidates, device_prompt, config, new_tokens)
        chosen = candidates[best][0]
    smaller = smaller_budgets(chosen, bundle.budget_sweep())
    return ServedEngine(Engine(target, new_drafter(), config(chosen)), chosen, eager(chosen), new_drafter, report,
                        tuple(smaller))
