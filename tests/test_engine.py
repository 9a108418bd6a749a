import json
from collections import Counter
from dataclasses import replace

import pytest
import torch

from helpers import NoisyOracle, assert_three_tokens_follow_the_target

from runtime.target.attention import SpecAttnConfig
from pipeline.bench.harness import (Speculation, copy_bandwidth, default_bench_prompts, run_bench,
                                    weight_bytes_per_token)
from runtime.speculation.draft_budget import DraftBudget, ServedBudget
from runtime.drafters.shared.eagle_drafting import EagleDrafter
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.weights import from_pretrained
from runtime.drafters.ngram import NgramDrafter
from runtime.speculation.sampling import SamplingParams
from runtime.serving.served_engine import ServedEngine
from runtime.speculation.tree import DraftTree
from train.recipes import eagle as eagle_recipe

PROMPT = [5, 17, 33, 5, 17, 42, 8, 5, 17, 33, 61, 2, 9]


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return from_pretrained(tiny_llama_dir, max_seq_len=128)


@torch.no_grad()
def greedy_reference(target, prompt, n):
    """Plain greedy decoding by full forwards, no cache: the oracle the engine must reproduce."""
    seq = list(prompt)
    for _ in range(n):
        logits = target(torch.tensor([seq]), target.new_cache(), torch.arange(len(seq))[None]).logits
        seq.append(int(logits[0, -1].argmax()))
    return seq


def test_autoregressive_engine_is_greedy_decoding(target):
    want = greedy_reference(target, PROMPT, 30)[len(PROMPT):]
    gen = Engine(target, None, EngineConfig(max_seq_len=64)).generate(PROMPT, 30)
    assert gen.tokens == want
    m = gen.metrics
    assert (m.new_tokens, m.target_forwards, m.tau, m.fell_back, m.draft_nodes) == (30, 29, 1.0, False, 0)


def test_ngram_speculation_is_lossless(target):
    want = Engine(target, None, EngineConfig(max_seq_len=128)).generate(PROMPT, 60).tokens
    for budget in (DraftBudget(depth=4), DraftBudget(depth=3, width=2, nodes=5)):
        drafter = NgramDrafter(target.config.vocab_size)
        gen = Engine(target, drafter, EngineConfig(max_seq_len=128, budget=budget, adaptive=False)).generate(PROMPT, 60)
        assert gen.tokens == want
        assert gen.metrics.target_forwards < 59  # random tiny models repeat themselves: n-grams get accepted


def test_lookup_branch_adds_accepted_tokens_and_stays_lossless(target):
    """A drafter that is always wrong, plus the n-gram lookup branch: the tiny target repeats itself, so the
    branch's nodes get accepted and the target runs fewer forwards, with greedy output unchanged."""
    want = Engine(target, None, EngineConfig(max_seq_len=128)).generate(PROMPT, 60).tokens
    forwards = {}
    for lookup in (0, 6):
        drafter = NoisyOracle(target.config.vocab_size, [], p_right=0.0, width=2, seed=0)
        cfg = EngineConfig(max_seq_len=128, budget=DraftBudget(depth=2, width=2), adaptive=False, lookup=lookup)
        gen = Engine(target, drafter, cfg).generate(PROMPT, 60)
        assert gen.tokens == want
        forwards[lookup] = gen.metrics.target_forwards
        assert gen.metrics.draft_nodes <= forwards[lookup] * (4 + lookup)  # the lookup nodes come on top
    assert forwards[6] < forwards[0] // 2, forwards  # (measured 58 -> 14; a random wrong token is right now and then)
    with pytest.raises(ValueError, match="lookup=-1"):
        EngineConfig(lookup=-1)


class ScoredWrongDrafter(NoisyOracle):
    """Always wrong, and says so: its nodes score far below the lookup branch's."""

    def propose(self, budget, params, generator=None):
        tree = super().propose(budget, params, generator)
        return DraftTree(tree.tokens, tree.parents, scores=-10.0 * tree.depths().float())


def test_a_wide_tree_does_not_starve_the_lookup_branch_near_the_end_of_a_reply(target):
    """Near max_new_tokens the room for nodes shrinks; the union keeps the best-scored nodes, so a wrong drafter's
    12-node tree leaves the lookup branch as many accepted tokens as a 1-node one does."""
    want = Engine(target, None, EngineConfig(max_seq_len=128)).generate(PROMPT, 60).tokens
    forwards = {}
    for nodes in (1, 12):
        drafter = ScoredWrongDrafter(target.config.vocab_size, [], p_right=0.0, width=3, seed=0)
        cfg = EngineConfig(max_seq_len=128, budget=DraftBudget(4, 3, nodes), adaptive=False, lookup=6)
        gen = Engine(target, drafter, cfg).generate(PROMPT, 60)
        assert gen.tokens == want
        forwards[nodes] = gen.metrics.target_forwards
    assert forwards[12] <= forwards[1] + 2, forwards


def test_max_tree_cuts_each_verify_to_its_likeliest_nodes_and_stays_lossless(target, monkeypatch):
    """The n-gram drafter's tree plus the lookup branch, cut to 3 nodes a verify: greedy output unchanged, no verify
    over the cap, and the cut keeps what gets accepted (the repeating tiny target's continuations)."""
    want = Engine(target, None, EngineConfig(max_seq_len=128)).generate(PROMPT, 60).tokens
    widest = []
    engine = Engine(target, NgramDrafter(target.config.vocab_size),
                    EngineConfig(max_seq_len=128, budget=DraftBudget(3, 2, 6), adaptive=False, lookup=6, max_tree=3))
    verify = engine.target.forward
    monkeypatch.setattr(engine.target, "forward",
                        lambda tokens, *a, **k: widest.append(tokens.shape[1]) or verify(tokens, *a, **k))
    gen = engine.generate(PROMPT, 60)
    assert gen.tokens == want and max(widest[1:]) == 4  # root + 3 nodes; widest[0] is the prefill
    assert gen.metrics.target_forwards < 30
    with pytest.raises(ValueError, match="max_tree=-1"):
        EngineConfig(max_tree=-1)


@pytest.mark.parametrize("width,adaptive", [(1, False), (3, False), (2, True)], ids=["chain", "tree", "adaptive"])
def test_noisy_oracle_speculation_is_lossless(target, width, adaptive):
    n_new = 50
    reference = greedy_reference(target, PROMPT, n_new + 8)
    drafter = NoisyOracle(target.config.vocab_size, reference, p_right=0.7, width=width, seed=width)
    cfg = EngineConfig(max_seq_len=80, budget=DraftBudget(depth=4, width=width), adaptive=adaptive)
    gen = Engine(target, drafter, cfg).generate(PROMPT, n_new)
    assert gen.tokens == reference[len(PROMPT):len(PROMPT) + n_new]
    m = gen.metrics
    assert 1.0 < m.tau < 5.0 and m.target_forwards < n_new - 1
    assert 0.0 < m.acceptance_by_depth[0] < 1.0  # both accepts and rejects happened
    assert not m.fell_back

    # the features handed to the drafter are the target's hidden states of the committed sequence, in order
    features = torch.cat(drafter.features)
    seq = torch.tensor(drafter.tokens[:-1])
    with torch.no_grad():
        hidden = target(seq[None], target.new_cache(), torch.arange(len(seq))[None]).hidden
    assert features.shape[0] == len(drafter.tokens) - 1
    torch.testing.assert_close(features, hidden[0], atol=2e-5, rtol=1e-4)


def test_useless_drafter_falls_back_to_plain_decoding(target):
    want = Engine(target, None, EngineConfig(max_seq_len=80)).generate(PROMPT, 40).tokens
    drafter = NoisyOracle(target.config.vocab_size, [], p_right=0.0, width=1, seed=0)
    cfg = EngineConfig(max_seq_len=80, budget=DraftBudget(depth=3), warmup_steps=4, fallback_tau=1.5)
    gen = Engine(target, drafter, cfg).generate(PROMPT, 40)
    assert gen.tokens == want
    m = gen.metrics
    assert m.fell_back and m.fallback_step is not None and 4 <= m.fallback_step < 39
    assert m.draft_nodes <= 3 * m.fallback_step and m.acceptance_by_depth[0] == 0.0


class FakeClock:
    """Seconds that pass only where a test charges them, so timings do not depend on the host's load."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowOracle(NoisyOracle):
    """Always right, but each proposal costs `cost_s` on `clock`."""

    def __init__(self, vocab_size, reference, clock, cost_s):
        super().__init__(vocab_size, reference, p_right=1.0, width=1, seed=0)
        self.clock, self.cost_s = clock, cost_s

    def propose(self, budget, params, generator=None):
        self.clock.now += self.cost_s
        return super().propose(budget, params, generator)


@pytest.mark.parametrize("slowdown", [0, 3], ids=["fast", "slow"])
def test_speed_check_times_a_plain_step_and_pauses_speculation_that_loses_to_it(target, slowdown, monkeypatch):
    """On a clock where every target forward takes a second (a verify of 4 tokens costs what a decode does) and
    a drafter's 4 tokens a step cost `slowdown` plain decode steps each: speculation loses at 3, and pauses for
    4, 8, 16, ... plain steps between runs of 4 drafted ones; at 0 it wins and drafts to the end."""
    reference = greedy_reference(target, PROMPT, 110)
    want = reference[len(PROMPT):len(PROMPT) + 100]
    cfg = EngineConfig(max_seq_len=128, budget=DraftBudget(depth=3), adaptive=False, warmup_steps=4, speed_check=True)
    forward = target.forward

    def run(cfg):
        clock, widths = FakeClock(), []

        def timed_forward(tokens, *a, **k):
            widths.append(tokens.shape[1])
            clock.now += 1.0
            return forward(tokens, *a, **k)

        monkeypatch.setattr(target, "forward", timed_forward)
        engine = Engine(target, SlowOracle(target.config.vocab_size, reference, clock, 4.0 * slowdown), cfg,
                        clock=clock)
        gen = engine.generate(PROMPT, 100)
        assert gen.tokens == want
        assert gen.metrics.prefill_s == 1.0 and gen.metrics.verify_s == gen.metrics.target_forwards  # on `clock`
        return gen.metrics, widths[1:]  # widths[0]: the prefill

    m, widths = run(cfg)
    drafted, timed = [4] * 4, [1]
    expected = drafted + timed + sum(([1] * 4 * 2 ** i + drafted for i in range(5)), []) if slowdown else \
        drafted + timed + [4] * 100
    assert widths[:-1] == expected[:len(widths) - 1]  # the last step drafts only what the reply has room for
    assert m.fell_back == (slowdown > 0) and m.fallback_step == (5 if slowdown else None)
    assert m.plain_steps == widths.count(1)
    m, widths = run(replace(cfg, speed_check=False))  # unchecked, it drafts to the end
    assert not m.fell_back and m.plain_steps == 0 and set(widths[:-1]) == {4}


def test_adaptive_depth_follows_acceptance(target):
    reference = greedy_reference(target, PROMPT, 48)

    def proposed_depths(p_right: float) -> list[int]:
        drafter = NoisyOracle(target.config.vocab_size, reference, p_right=p_right, width=1, seed=0)
        depths, propose = [], drafter.propose
        drafter.propose = lambda budget, params, gen=None: depths.append(budget.depth) or propose(budget, params, gen)
        cfg = EngineConfig(max_seq_len=80, budget=DraftBudget(depth=6), fallback_tau=0.0)
        assert Engine(target, drafter, cfg).generate(PROMPT, 40).tokens == reference[len(PROMPT):len(PROMPT) + 40]
        return depths

    assert proposed_depths(1.0)[:4] == [6, 6, 6, 6]  # a perfect drafter keeps the full depth
    poor = proposed_depths(0.3)
    assert poor[0] == 6 and min(poor) <= 2  # a poor one drafts shallower


def test_stop_ids_end_generation(target):
    full = Engine(target, None, EngineConfig(max_seq_len=64)).generate(PROMPT, 30).tokens
    stop = full[7]
    first = full.index(stop)
    drafter = NgramDrafter(target.config.vocab_size)
    gen = Engine(target, drafter, EngineConfig(max_seq_len=64)).generate(PROMPT, 30, stop_ids=(stop,))
    assert gen.tokens == full[:first + 1]


def test_sampling_speculation_keeps_the_target_distribution(target):
    """First three tokens under top-k=2 sampling: speculative and exact target probabilities agree (chi-square)."""
    params = SamplingParams(temperature=1.0, top_k=2)
    prompt = PROMPT[:6]
    reference = greedy_reference(target, prompt, 3)
    drafter = NoisyOracle(target.config.vocab_size, reference, p_right=0.8, width=2, seed=1)
    engine = Engine(target, drafter, EngineConfig(max_seq_len=16, budget=DraftBudget(depth=2, width=2),
                                                    adaptive=False))
    gen = torch.Generator().manual_seed(0)
    n = 800
    counts = Counter(tuple(engine.generate(prompt, 3, params, gen).tokens) for _ in range(n))

    assert_three_tokens_follow_the_target(target, prompt, params, counts, n)


def test_bad_requests_fail_before_generating(target):
    engine = Engine(target, None, EngineConfig(max_seq_len=32))
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.generate([], 5)
    with pytest.raises(ValueError, match="does not fit the KV cache of max_seq_len=32"):
        engine.generate(list(range(30)), 5)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        engine.generate(PROMPT, 0)
    with pytest.raises(ValueError, match=r"contains \[96\]"):
        engine.generate([1, 96], 3)
    with pytest.raises(ValueError, match="drafter vocab_size 50 != target vocab_size 96"):
        Engine(target, NgramDrafter(50), EngineConfig(max_seq_len=32))
    with pytest.raises(ValueError, match="depth=0"):
        EngineConfig(budget=DraftBudget(depth=0))
    with pytest.raises(ValueError, match="exceeds the target's max_seq_len 128"):
        Engine(target, None, EngineConfig(max_seq_len=256))


def test_weight_bytes_count_a_tied_table_once(tiny_model_dir):
    import transformers

    for tied in (True, False):
        path = tiny_model_dir("llama", tie_word_embeddings=tied)
        n_hf = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(path).parameters())
        streamed = n_hf if tied else n_hf - 96 * 64  # an untied input embedding reads one row per token
        assert weight_bytes_per_token(from_pretrained(path, max_seq_len=16)) == 4 * streamed
    assert copy_bandwidth(n_bytes=1 << 20, repeats=2) > 0


def chain_speculation(label: str, new_drafter, **fields) -> Speculation:
    """A depth-3 chain of `new_drafter(target)`, with further EngineConfig fields."""
    budget = ServedBudget(DraftBudget(3))

    def build(target, max_seq_len, _prompt):
        cfg = EngineConfig(max_seq_len=max_seq_len, **budget.engine_fields(), **fields)
        return ServedEngine(Engine(target, new_drafter(target), cfg), budget, cfg, lambda: new_drafter(target))

    return Speculation(label, budget.tree.max_nodes, build)


@pytest.mark.slow
def test_bench_on_smollm2(smollm2_dir):
    report = run_bench(smollm2_dir, default_bench_prompts()[:1], chain_speculation("ngram", lambda t: NgramDrafter(t.config.vocab_size)),
                       max_new_tokens=12, print_table=False)
    methods = report["methods"]
    assert set(methods) == {"hf_generate", "ours_ar", "ours_spec"}
    assert all(m["same_tokens_as_ours_ar"] for m in methods.values())  # greedy fp32: HF, AR and speculative agree
    assert methods["ours_ar"]["new_tokens"] == 12 and methods["ours_ar"]["tau"] == 1.0
    assert report["weight_bytes_per_token"] == 4 * 134_515_008  # SmolLM2-135M, tied table counted once
    assert 0 < report["ours_ar_fraction_of_floor"] and report["torch_threads"] >= 1
    assert report["specattn"] is None and report["attention_backend"] == "sdpa"
    json.dumps(report)
    # SpecAttn (as a sparse bundle or --specattn-top-p asks): the speculative rows verify sparsely, AR stays dense
    sparse = SpecAttnConfig((-1, -1) + (0,) * 28, top_p=0.5)
    eagle = chain_speculation("eagle", lambda t: EagleDrafter(eagle_recipe.build_eagle(t, None).eval(), t.max_seq_len),
                              sparse=sparse)
    report = run_bench(smollm2_dir, default_bench_prompts()[:1], eagle, max_new_tokens=8, print_table=False)
    assert report["specattn"]["top_p"] == 0.5 and 0 < report["methods"]["ours_spec"]["kv_saved"] < 1
    assert "kv_saved" not in report["methods"]["ours_ar"] and report["methods"]["ours_ar"]["tau"] == 1.0


def test_a_lookup_corpus_drafts_what_the_reply_has_not_said_yet_and_stays_lossless(smollm2_dir):
    """The corpus holds SmolLM2's greedy reply to this prompt (as a bundle's holds the target's answers to training
    prompts): the lookup branch drafts it where the reply has no earlier match, with greedy output unchanged."""
    from transformers import AutoTokenizer

    target = from_pretrained(smollm2_dir, max_seq_len=256)
    chat = [{"role": "user", "content": default_bench_prompts()[1]}]
    prompt = AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(chat, add_generation_prompt=True)
    prompt = list(getattr(prompt, "input_ids", prompt))
    want = Engine(target, None, EngineConfig(max_seq_len=256)).generate(prompt, 40).tokens
    corpus = NgramDrafter.corpus(target.config.vocab_size, [torch.tensor(prompt[-4:] + want)], max_depth=8)
    forwards = {}
    for name, lookup_corpus in (("history", None), ("corpus", corpus)):
        drafter = NoisyOracle(target.config.vocab_size, [], p_right=0.0, width=2, seed=0)
        cfg = EngineConfig(max_seq_len=256, budget=DraftBudget(depth=2, width=2), adaptive=False, lookup=8,
                           lookup_corpus=lookup_corpus)
        gen = Engine(target, drafter, cfg).generate(prompt, 40)
        assert gen.tokens == want
        forwards[name] = gen.metrics.target_forwards
    assert forwards["corpus"] < forwards["history"] // 2, forwards  # (measured 37 -> 9)
    with pytest.raises(ValueError, match="lookup_corpus"):
        EngineConfig(lookup=6, lookup_corpus=[1, 2])
