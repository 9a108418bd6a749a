"""The GPU benchmark's parts that run on CPU too: the replay drafter and the static-shape decode step that CUDA
graphs capture (run eagerly here), both checked token for token against our engine's plain decoding."""
import json

import pytest
import torch

from pipeline.bench.graphed_decoder import GraphedGreedyDecoder
from pipeline.bench.harness import measure
from pipeline.bench.random_weights import ReplayDrafter, random_models, random_prompts, run_random_bench
from pipeline.bench.step_costs import step_costs
from pipeline.bench.step_profile import step_profile
from runtime.serving.served_engine import static_verify_config
from runtime.speculation import cuda_graphs
from runtime.speculation.cuda_graphs import StaticVerifier, key_span
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree
from runtime.target.attention import SpecAttnConfig


@pytest.fixture(scope="module")
def smollm2_shape():
    return random_models("smollm2-135m", torch.float32, "cpu", max_seq_len=128, with_hf=False)[0]


def test_static_decode_step_equals_the_engine(smollm2_shape, min_span):
    model = smollm2_shape
    engine = Engine(model, None, EngineConfig(max_seq_len=128, adaptive=False))
    decoder = GraphedGreedyDecoder(model, max_len=128, use_graph=False)
    for prompt in random_prompts(model.config.vocab_size, 2, seed=3):
        expected = engine.generate(prompt, 40, SamplingParams(), stop_ids=()).tokens
        assert decoder.generate(prompt, 40) == expected
        stop = (expected[20],)  # the stop check runs every STOP_CHECK tokens: the output still ends at the stop
        stopped = engine.generate(prompt, 40, SamplingParams(), stop_ids=stop).tokens
        assert len(stopped) <= 21 and decoder.generate(prompt, 40, stop) == stopped


def test_static_steps_attend_over_the_span_that_holds_the_context(smollm2_shape, monkeypatch):
    """key_span: powers of two from MIN_SPAN, capped at the cache. The static decode and verify steps read that
    span of the cache, a longer one as the context grows, not the whole cache."""
    assert [key_span(n, 8192) for n in (1, 256, 257, 5000, 8192)] == [256, 256, 512, 8192, 8192]
    assert key_span(300, 300) == 300
    with pytest.raises(ValueError, match="needs 301 keys, expected 1..300"):
        key_span(301, 300)
    monkeypatch.setattr(cuda_graphs, "MIN_SPAN", 16)
    model = smollm2_shape
    prompt = random_prompts(model.config.vocab_size, 1, seed=3, lengths=(20, 20))[0]
    decoder, spans = GraphedGreedyDecoder(model, max_len=128, use_graph=False), []
    step = decoder.run_step
    monkeypatch.setattr(decoder, "run_step", lambda span: spans.append(span) or step(span))
    decoder.generate(prompt, 40)
    assert spans == [key_span(21 + k, 128) for k in range(39)] and set(spans) == {32, 64}  # positions 20..58

    plain = Engine(model, None, EngineConfig(max_seq_len=128, adaptive=False))
    references = {tuple(prompt): prompt + plain.generate(prompt, 38, SamplingParams()).tokens}
    engine = Engine(model, ReplayDrafter(model.config.vocab_size, references, 0.7, seed=1),
                    EngineConfig(max_seq_len=128, adaptive=False, static_verify=True))
    spans.clear()
    forward = model.forward

    def keys_read(tokens, cache, *a, mask=None, **k):  # a static step's span, else the cached keys and its own
        spans.append(mask.shape[-1] if mask is not None else int(cache.lengths.max()) + tokens.shape[1])
        return forward(tokens, cache, *a, mask=mask, **k)

    monkeypatch.setattr(model, "forward", keys_read)
    assert engine.generate(prompt, 30, SamplingParams()).tokens == references[tuple(prompt)][20:50]
    assert spans[0] == 20  # the prefill, eager: its 20 keys
    assert spans[1:] == sorted(spans[1:]) and set(spans[1:]) == {32, 64}  # cached + a verify's bucket: 21..58


def test_graphs_need_a_cuda_model(smollm2_shape):
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        GraphedGreedyDecoder(smollm2_shape, max_len=64)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        StaticVerifier(smollm2_shape, smollm2_shape.new_cache(1, 64))


def _prefilled(model, prompt, max_len):
    cache = model.new_cache(1, max_len)
    model(torch.tensor([prompt]), cache, torch.arange(len(prompt))[None])
    cache.advance(len(prompt))
    return cache


@pytest.mark.parametrize("buckets, prompt_len", [((1, 2, 4, 8), 20),  # padded 6 -> 8
                                                 ((1, 2, 4, 8), 58),  # 58 + 8 > 64: eager
                                                 ((1, 2, 4), 20)])  # no bucket holds 6: eager
def test_static_verify_step_equals_the_eager_forward(smollm2_shape, buckets, prompt_len, min_span):
    """A padded, whole-cache verify of a branching tree gives the real rows the eager forward's logits, features
    and KV; where no bucket fits, it is the eager forward."""
    model, max_len = smollm2_shape, 64
    prompt = random_prompts(model.config.vocab_size, 1, seed=5, lengths=(prompt_len, prompt_len))[0]
    tree = DraftTree(torch.tensor([11, 12, 13, 14, 15]), torch.tensor([-1, -1, 0, 1, 2]))
    tokens = torch.cat([torch.tensor([7]), tree.tokens])[None]
    positions = prompt_len + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths()])[None]
    with torch.inference_mode():
        eager_cache, static_cache = _prefilled(model, prompt, max_len), _prefilled(model, prompt, max_len)
        eager = model(tokens, eager_cache, positions, tree.ancestor_mask())
        logits, hidden = eager.logits, eager.hidden
        verifier = StaticVerifier(model, static_cache, buckets, use_graph=False)
        s_logits, s_hidden = verifier(tokens, positions, tree.ancestor_mask())
    assert s_logits.shape == logits.shape and s_hidden.shape == hidden.shape
    torch.testing.assert_close(s_logits, logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_hidden, hidden, atol=1e-4, rtol=1e-4)
    live = prompt_len + tokens.shape[1]
    torch.testing.assert_close(static_cache.k[:, :, :, :live], eager_cache.k[:, :, :, :live])
    torch.testing.assert_close(static_cache.v[:, :, :, :live], eager_cache.v[:, :, :, :live])
    assert int(static_cache.lengths[0]) == prompt_len  # a verify writes but does not commit


def test_engine_with_static_verify_is_lossless(smollm2_shape, min_span):
    """Speculation through the static verify step: the plain decode's tokens, and the eager verify's acceptance."""
    model, n = smollm2_shape, 14
    prompts = random_prompts(model.config.vocab_size, 2, seed=7)
    cfg = EngineConfig(max_seq_len=128, adaptive=False)
    plain = Engine(model, None, cfg)
    references = {tuple(p): p + plain.generate(p, n + 8, SamplingParams()).tokens for p in prompts}
    static, eager = (Engine(model, ReplayDrafter(model.config.vocab_size, references, 0.7, seed=1),
                            EngineConfig(max_seq_len=128, adaptive=False, static_verify=flag)) for flag in (True, False))
    for p in prompts:
        expected = references[tuple(p)][len(p):len(p) + n]
        got, ref = static.generate(p, n, SamplingParams()), eager.generate(p, n, SamplingParams())
        assert got.tokens == ref.tokens == expected
        assert got.metrics.tau == ref.metrics.tau > 1.0


def test_static_verify_needs_a_full_precision_cache():
    with pytest.raises(ValueError, match="static_verify needs a full-precision KV cache"):
        EngineConfig(static_verify=True, kv_scheme="int8")


def test_graph_rows_run_a_quantised_kv_bundle_in_full_precision_and_keep_sparse_verification():
    static, note = static_verify_config(EngineConfig(kv_scheme="int8", kv_recent=32, lookup=4))
    assert static.static_verify and static.kv_scheme is None and static.lookup == 4
    assert "int8" in note and "ours_ar_graph" in note
    assert static_verify_config(EngineConfig()) == (EngineConfig(static_verify=True), "")
    sparse = SpecAttnConfig(layer_map=(0,), top_p=0.9)
    assert static_verify_config(EngineConfig(sparse=sparse)) == (EngineConfig(sparse=sparse, static_verify=True), "")


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_replayed_acceptance_is_lossless_and_sets_the_forward_count(rate):
    n = 12
    report = run_random_bench("smollm2-135m", n_prompts=2, max_new_tokens=n, dtype=torch.float32, device="cpu",
                              accept_rate=rate, graphs=False, print_table=False)
    m = report["methods"]
    assert m["ours_spec"]["matching_prefix_min"] == n and m["hf_generate"]["matching_prefix_min"] == n
    assert m["ours_ar"]["tau"] == 1.0
    if rate == 0.0:  # every draft rejected: one token per target forward, exactly as plain decoding
        assert m["ours_spec"]["tau"] == 1.0
    else:  # every draft accepted: a depth-5 chain and its bonus token per forward (11 tokens after prefill: 6 + 5)
        assert m["ours_spec"]["tau"] == 5.5


def test_graph_rows_are_compared_with_the_graphed_decode_of_their_own_kind():
    """measure() checks each graph row's tokens against its partner: speculation against the graphed decode it
    runs beside, the compiled decode against the uncompiled one."""
    def returns(tokens):
        return lambda ids, gen: (tokens, None)

    methods = {"hf_generate": returns([1, 2]), "ours_ar": returns([1, 2]), "ours_ar_graph": returns([1, 2]),
               "ours_spec_graph": returns([1, 2]), "ours_ar_graph_compiled": returns([1, 3]),
               "ours_spec_graph_compiled": returns([1, 3])}
    results = measure(methods, [[5, 6]], seed=0, compare_tokens=True)
    assert results["ours_spec_graph"]["same_tokens_as_ours_ar_graph"] is True
    assert results["ours_ar_graph_compiled"]["same_tokens_as_ours_ar_graph"] is False
    assert results["ours_spec_graph_compiled"]["same_tokens_as_ours_ar_graph_compiled"] is True
    assert results["ours_spec_graph_compiled"]["same_tokens_as_ours_ar"] is False


def test_step_costs_time_every_bucket_and_budget_and_refuse_a_tree_that_does_not_fit():
    costs = step_costs("smollm2-135m", torch.float32, "cpu", context=32, budgets=("1x3/3", "2x3/6"), buckets=(1, 8),
                       repeats=1)
    assert not costs["graphs"] and costs["context"] == 32 and "capture_mb" not in costs  # graph memory: CUDA only
    assert list(costs["verify_ms"]) == [1, 8] and list(costs["draft_ms"]) == ["1x3/3", "2x3/6"]
    assert costs["decode_ms"] > 0 and all(ms > 0 for ms in [*costs["verify_ms"].values(), *costs["draft_ms"].values()])
    with pytest.raises(ValueError, match="budget 9x9: its tree does not fit"):  # 8 x 9 expanded nodes
        step_costs("smollm2-135m", torch.float32, "cpu", context=32, budgets=("9x9",), buckets=(1, 8), repeats=1)


def test_step_tools_take_the_served_cache_length_and_the_smallest_key_span(tmp_path, monkeypatch, capsys):
    """--cache-len sizes the caches as serving does; --min-span the cache's length times the whole-cache steps."""
    from pipeline.bench.step_costs import main

    monkeypatch.setattr(cuda_graphs, "MIN_SPAN", cuda_graphs.MIN_SPAN)  # restored after --min-span sets it
    out = tmp_path / "costs.json"
    main(["--random-weights", "smollm2-135m", "--device", "cpu", "--dtype", "float32", "--context", "32",
          "--budgets", "1x3/3", "--repeats", "1", "--cache-len", "300", "--min-span", "300", "--out", str(out)])
    costs = json.loads(out.read_text())
    assert costs["cache_len"] == 300 and costs["min_span"] == cuda_graphs.MIN_SPAN == 300
    assert "a cache of 300, key spans from 300" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--random-weights", "smollm2-135m", "--device", "cpu", "--min-span", "0"])
    assert "--min-span 0: expected a number of keys >= 1" in capsys.readouterr().err


def test_step_profile_splits_a_step_into_its_phases_and_counts_what_it_dispatches():
    from pipeline.bench.step_profile import main

    p = step_profile("smollm2-135m", torch.float32, "cpu", budget="2x3/6@5", context=16, new_tokens=12)
    assert p["steps"] >= 1 and p["tau"] == pytest.approx(11 / p["steps"])  # the first token comes from the prefill
    phases = sum(p[f"{k}_ms"] for k in ("draft", "verify", "rollback", "other"))
    assert p["ms_a_step"] > 0 and phases == pytest.approx(p["ms_a_step"]) and p["verify_ms"] > 0
    # on the CPU the static steps run eagerly, so their operators count: 30 layers, each with its projections
    assert p["ops_a_step"] > 30 * 4 and p["top_ops"]["linear"] >= 30 * 4
    assert "graph_replays" not in p and "host_waits" not in p  # CUDA only
    # outside the static steps, what a GPU step launches and waits for: a handful a step, none per draft node (the
    # tree is read to the host once and its verify inputs go to the device in one copy)
    assert 0 < p["eager_ops_a_step"] < 80 and p["eager_host_reads_a_step"] <= 6 and p["eager_host_copies_a_step"] <= 6
    with pytest.raises(SystemExit):
        main(["--random-weights", "smollm2-135m", "--device", "cpu", "--budget", "0x3"])
