"""calibrate on a tiny target: quantisation picked by measured tau, a monotone layer map, a measured top-p sweep."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from export.calibrate.budget_search import choose_budget
from export.calibrate.kv import choose_kv_scheme, decode_ms, kv_message, quantized_nll
from export.calibrate import specattn_sweep
from export.calibrate.layer_map import DENSE, LayerMap
from export.calibrate.replay import ReplayTarget, reference, replay
from export.calibrate.specattn_sweep import (calibration_row, choose_top_p, draft_selector, effective_keys,
                                             next_token_nll, sparse_nll, target_selector, teacher_forced)
from export.calibrate.stage import CalibrateSettings, long_prompts, long_rows, run_calibrate
from export.calibrate.weights import choose_scheme
from pipeline.config import Config
from pipeline.runstore import RunStore
from pipeline.stages.context import StageContext
from runtime.drafters import DRAFT_VOCAB, drafter_config, drafter_module, drafter_tensors, get_kind, served_drafter
from runtime.drafters.ngram import NgramDrafter
from runtime.files import read_tensors
from runtime.speculation.decode_stats import tokens_per_forward
from runtime.speculation.draft_budget import DraftBudget, ServedBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.target.attention import SpecAttnConfig, head_groups
from runtime.target.loading import from_pretrained
from runtime.target.precision import float_dtype
from runtime.target.quant_kv_cache import KVQuant, QuantizedKVCache
from runtime.weight_quant import quantize_state_dict
from train.batches import Batches
from train.data import TokenizedSet, prompts_from
from train.recipes import eagle as eagle_recipe
from train.recipes import lm as lm_recipe
from train.spec import TrainSpec
from train.trainer import train

N_LAYERS, INTERMEDIATE = 4, 128  # every matrix dim a multiple of 64: int4-g32 fits, int4-g128 does not
TOP_P = [0.5, 0.9, 0.99]
FAST = CalibrateSettings(tau_prompts=3, tau_new_tokens=24)
BUDGET_PROMPTS = 2  # calibrate.budget_prompts
SCHEMES = ["int8", "int4-g128", "int4-g32"]
REPLY = 16  # validate.max_new_tokens: the reply length budgets are timed at (FAST.budget_new_tokens 0)


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir):
    # a large init gives peaked next-token distributions, as a trained model's are (random ones are near-uniform)
    return tiny_model_dir("llama", tie_word_embeddings=True, initializer_range=0.3, num_hidden_layers=N_LAYERS,
                          intermediate_size=INTERMEDIATE)


@pytest.fixture(scope="module")
def distilled(target_dir, tmp_path_factory):
    """(val rows, eagle tensors): a briefly trained drafter on the target's own greedy text, so tau is well above
    1 and a damaging quantisation shows up as a tau drop."""
    target = from_pretrained(target_dir, max_seq_len=256)
    engine = Engine(target, None, EngineConfig(max_seq_len=256))
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(12):
        prompt = torch.randint(0, 96, (6,), generator=g).tolist()
        rows.append((prompt + engine.generate(prompt, 34, SamplingParams()).tokens, [0] * 6 + [1] * 34))
    data = TokenizedSet.from_rows(rows)
    keep = torch.arange(64)
    model = eagle_recipe.build_eagle(target, keep, from_target=False)
    train(model, eagle_recipe.eagle_loss(target), Batches(data, 8, seed=0), TrainSpec(steps=40, lr=3e-3, warmup=2),
          tmp_path_factory.mktemp("ckpt"), log=lambda step, m: None)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    tensors[DRAFT_VOCAB] = keep
    return data, tensors


def make_hard_to_quantise(tensors: dict, factor: float) -> None:
    """Same function, harder to quantise: FFN up-channel k is scaled by `factor` on the side where it lies along
    dim 1 of the stored matrix (inside a quantisation row/group) and divided on the other side. Which side that
    is depends on whether runtime.target.cpu_packing.Linear stores [out, in] (`weight`) or [in, out] (`weight_t`)."""
    w13, w2 = (next(v for k, v in tensors.items() if k.startswith(f"block.feed_forward.{n}.")) for n in ("w13", "w2"))
    transposed = any(k.endswith("w2.weight_t") for k in tensors)
    for k in range(0, INTERMEDIATE, 8):
        if transposed:  # w13 [dim, 2I], w2 [I, dim]
            w13[:, INTERMEDIATE + k] *= factor
            w2[k] /= factor
        else:  # w13 [2I, dim], w2 [dim, I]
            w2[:, k] *= factor
            w13[INTERMEDIATE + k] /= factor


def make_run(tmp_path, target_dir, distilled, kind="eagle", tolerance=0.02, outlier=0.0, context=0) -> StageContext:
    cfg = Config.model_validate({"run": {"dir": str(tmp_path)},
                                 "drafter": {"kind": kind, "draft_vocab": 64, "depth": 4, "width": 2, "nodes": 8},
                                 "calibrate": {"tau_tolerance": tolerance, "prompts": 3, "top_p": TOP_P,
                                               "budget_prompts": BUDGET_PROMPTS,
                                               "context": context,
                                               "weight_schemes": SCHEMES,
                                               "kv_recent": 8},  # 40-token rows: a history to quantise
                                 "validate": {"max_new_tokens": REPLY}})
    store = RunStore(tmp_path, "r1")
    prep, distill = store.stage_dir("prepare"), store.stage_dir("distill")
    prep.mkdir(parents=True)
    distill.mkdir()
    data, tensors = distilled
    for split in ("train", "val"):
        data.save(prep / f"{split}.safetensors")
    if kind == "ngram":
        (distill / "drafter_config.json").write_text(json.dumps({"kind": "ngram", "max_ngram": 4}))
    elif kind == "quantspec":  # as distill writes a weightless kind's config
        (distill / "drafter_config.json").write_text(json.dumps(get_kind(kind).config(None, 0, None)))
    elif kind == "lm":  # every target layer: a drafter that attends exactly as the target does
        target = from_pretrained(target_dir, max_seq_len=256)
        lm = lm_recipe.build_lm(target, N_LAYERS, "target")
        save_file(drafter_tensors(lm, tensors[DRAFT_VOCAB]), str(distill / "drafter.safetensors"))
        (distill / "drafter_config.json").write_text(json.dumps(drafter_config("lm", lm, 64, None)))
    else:  # saved the way pipeline/stages/distill.py saves it
        tensors = {k: v.clone() for k, v in tensors.items()}
        if outlier:
            make_hard_to_quantise(tensors, outlier)
        save_file(tensors, str(distill / "drafter.safetensors"))
        (distill / "drafter_config.json").write_text(json.dumps({"kind": "eagle", "draft_vocab": 64}))
    out = tmp_path / "calibrate.tmp"
    out.mkdir()
    ctx = StageContext(cfg, store, out)
    ctx.__dict__["target_dir"] = target_dir  # cached_property: no hub lookup for the tiny target
    return ctx


def test_eagle_quant_and_layer_map(tmp_path, target_dir, distilled):
    ctx = make_run(tmp_path, target_dir, distilled)
    result = run_calibrate(ctx, FAST)
    quant = json.loads((ctx.out / "quant.json").read_text())
    measured = [c for c in quant["candidates"] if "tau" in c]
    assert measured and quant["fp32_tau"] > 1.0
    within = [c for c in measured if c["tau_drop"] <= 0.02]
    if quant["chosen"] == "fp32":
        assert not within
    else:
        chosen = next(c for c in measured if c["scheme"] == quant["chosen"])
        assert chosen["tau_drop"] <= 0.02 and all(chosen["bytes"] <= c["bytes"] for c in within)
        with safe_open(str(ctx.out / "quant.safetensors"), "pt") as f:
            assert f.metadata()["scheme"] == quant["chosen"]
            stored = {k: f.get_tensor(k) for k in f.keys()}
        # the bits whose tau was measured, and the bytes the report counted
        expected = quantize_state_dict(read_tensors(ctx.input("distill") / "drafter.safetensors"), quant["chosen"])
        assert stored.keys() == expected.keys() and any(k.endswith(".qweight") for k in stored)
        assert all(torch.equal(stored[k], expected[k]) for k in stored)
        assert sum(t.numel() * t.element_size() for t in stored.values()) == chosen["bytes"]
    for c in measured:
        assert 0 < c["rel_error"] < 0.5
    skipped = {c["scheme"]: c["skipped"] for c in quant["candidates"] if "skipped" in c}
    assert list(skipped) == ["int4-g128"] and "not a multiple" in skipped["int4-g128"]

    layer_map = LayerMap.from_json((ctx.out / "layer_map.json").read_text())  # validates monotonicity
    assert len(layer_map.mapping) == N_LAYERS and layer_map.mapping[:2] == (DENSE, DENSE)
    assert all(m == 0 for m in layer_map.mapping[2:])  # one draft layer
    assert all(v <= 0 for v in layer_map.scores[0])  # -KL
    for png in ("layer_map.png", "sparsity.png"):
        assert (ctx.out / png).stat().st_size > 1000
    m = result.metrics
    assert len([k for k in m if k.startswith("neg_kl_layer_")]) == N_LAYERS

    report = json.loads((ctx.out / "sparsity.json").read_text())
    sweep = report["sweep"]
    assert [r["top_p"] for r in sweep] == TOP_P and report["dense_tau"] > 1.0
    assert 1.0 <= report["draft_attention_keys"] < 40 and 1.0 <= report["target_attention_keys"] < 40  # 40-token rows
    saved = [r["kv_saved"] for r in sweep]
    assert all(a >= b for a, b in zip(saved, saved[1:])) and 0 < saved[0] < 0.5  # nested sets; 2 of 4 layers dense
    for r in sweep:  # measured, and reported both ways
        p = r["top_p"]
        assert r["tau"] >= 1.0 and 0 <= r["kv_saved_generating"] < 0.5 and math.isfinite(r["ppl_change"])
        assert [m[f"{k}_p{p}"] for k in ("kv_saved", "ppl_change", "tau")] == [r["kv_saved"], r["ppl_change"], r["tau"]]
    settings = SpecAttnConfig.from_json((ctx.out / "specattn.json").read_text())  # what export puts in the bundle
    assert settings.layer_map == layer_map.mapping and settings.dense_first == 2
    within = [r for r in sweep if r["ppl_change"] <= 0.01]
    best = max(within, key=lambda r: r["kv_saved"]) if within else {"top_p": 1.0, "kv_saved": 0.0}
    assert settings.top_p == best["top_p"] and m["kv_saved_at_ppl_tolerance"] == best["kv_saved"]
    assert "SpecAttn" in result.message and "specattn" in result.outputs
    ceiling = report["ceiling_sweep"]  # every target layer choosing by its own attention
    assert [r["top_p"] for r in ceiling] == TOP_P and all(math.isfinite(r["ppl_change"]) for r in ceiling)
    ceiling_saved = [r["kv_saved"] for r in ceiling]
    assert all(a >= b for a, b in zip(ceiling_saved, ceiling_saved[1:])) and 0 < ceiling_saved[0] < 0.5
    within = [r["kv_saved"] for r in ceiling if r["ppl_change"] <= 0.01]
    assert m["ceiling_kv_saved_at_ppl_tolerance"] == report["ceiling_kv_saved_at_ppl_tolerance"] == max(within, default=0.0)
    assert "ceiling" in result.message

    kv = json.loads((ctx.out / "kv_quant.json").read_text())
    cands = {c["scheme"]: c for c in kv["candidates"]}
    assert list(cands) == ["int8", "int4", "hier-int4"] and kv["dense_tau"] > 1.0 and kv["recent"] == 8
    assert cands["int4"]["target_bits"] < cands["int8"]["target_bits"] <= cands["hier-int4"]["target_bits"]
    assert cands["hier-int4"]["draft_bits"] < cands["hier-int4"]["target_bits"]  # the drafter reads the upper half
    assert cands["int4"]["ppl_change"] > cands["int8"]["ppl_change"]  # int4 loses more than int8
    serving = str(float_dtype("auto", torch.device("cpu"))).removeprefix("torch.")  # validate.precision's default
    # calibrate.tokens (256) is the whole 256-position context of this target: the decode step is timed after 255
    assert kv["decode_dtype"] == serving and kv["decode_context"] == 255 and kv["full_precision_decode_ms"] > 0
    for c in cands.values():  # each scheme's decode step timed against the full-precision cache's
        assert c["decode_ms"] > 0 and c["slowdown"] == pytest.approx(c["decode_ms"] / kv["full_precision_decode_ms"] - 1)
    ok = [c for c in cands.values() if c["tau_drop"] <= 0.02 and c["ppl_change"] <= 0.01 and c["slowdown"] <= 0.05]
    assert kv["chosen"] == (min(ok, key=lambda c: (c["target_bits"], c["draft_bits"]))["scheme"] if ok else "none")
    assert kv["max_slowdown"] == 0.05 and m["kv_int4_slowdown"] == cands["int4"]["slowdown"]
    assert m["kv_int8_ppl_change"] == cands["int8"]["ppl_change"] and "kv_quant" in result.outputs

    budget = json.loads((ctx.out / "draft_budget.json").read_text())  # candidates within the configured 4x2/8
    predictions = budget["predictions"]  # every candidate predicted; those that could win timed, in the sweep
    shapes = [(r["depth"], r["width"], r["nodes"], r["adaptive"], r["lookup"], r["max_tree"]) for r in predictions]
    trees = [(1, 1, 1, False), (2, 1, 2, False), (2, 2, 4, False), (3, 2, 6, False), (4, 2, 8, False), (4, 2, 8, True)]
    lookup = ctx.cfg.drafter.lookup
    cut = [(2, 1, 2, 5), (2, 2, 4, 5), (3, 2, 6, 5), (2, 2, 4, 11), (3, 2, 6, 11), (4, 2, 8, 11)]  # with the lookup
    assert shapes == [t + (n, 0) for n in (0, lookup) for t in trees] + [(*t, False, lookup, c) for *t, c in cut]
    keys = ("depth", "width", "nodes", "adaptive", "lookup", "max_tree")
    assert [{k: r[k] for k in keys} for r in budget["sweep"]] == [{k: r[k] for k in keys} for r in predictions
                                                                   if r["timed"]]
    assert 2 <= len(budget["sweep"]) == m["budget_timed"] <= len(predictions)
    for r in budget["sweep"]:  # timed, with the prediction beside the measurement
        p = next(p for p in predictions if all(p[k] == r[k] for k in keys))
        assert r["predicted_tokens_per_s"] == p["predicted_tokens_per_s"] > 0
    for p in predictions:  # replayed: tau and the step's parts, the speedup over plain decoding's prediction
        assert p["tau"] >= 1.0 and p["draft_ms"] > 0 and p["verify_ms"] > 0 and p["rollback_ms"] > 0
        assert p["predicted_speedup"] == p["predicted_tokens_per_s"] / budget["predicted_tokens_per_s_ar"]
    assert all(r["tokens_per_s"] > 0 and r["tau"] >= 1.0 for r in budget["sweep"]) and budget["tokens_per_s_ar"] > 0
    gate = ctx.cfg.validate.gate
    assert (budget["min_tau"], budget["min_speedup"], budget["tau_margin"]) == (
        gate.min_tau, gate.min_speedup, FAST.budget_tau_margin)
    assert {r["prompts"] for r in budget["sweep"]} == {budget["prompts"]} == {BUDGET_PROMPTS}  # one round
    assert budget["new_tokens"] == REPLY
    fastest = choose_budget(budget["sweep"], gate.min_tau, gate.min_speedup, FAST.budget_tau_margin)
    assert budget["chosen"] == {k: fastest[k] for k in ("depth", "width", "nodes", "adaptive", "lookup", "max_tree")}
    assert m["budget_speedup"] == fastest["tokens_per_s"] / budget["tokens_per_s_ar"]
    assert (ctx.out / "draft_budget.png").stat().st_size > 1000 and "draft_budget" in result.outputs
    # for a serving GPU to time: the chosen budget, then the device ladder's trees within 4x2/8, tau on every prompt
    device = budget["device_candidates"]
    assert device[0] == budget["chosen"] | {"tau": fastest["tau"], "prompts": BUDGET_PROMPTS}
    ladder = {"depth": 4, "width": 2, "nodes": 8, "adaptive": False, "lookup": lookup, "max_tree": 15}
    assert [{k: r[k] for k in ladder} for r in device[1:]] == ([ladder] if ladder != budget["chosen"] else [])
    assert all(r["tau"] >= 1.0 and r["prompts"] == BUDGET_PROMPTS for r in device)






def test_zero_tolerance_rejects_damaging_schemes(tmp_path, target_dir, distilled):
    ctx = make_run(tmp_path, target_dir, distilled, tolerance=0.0, outlier=20.0)
    run_calibrate(ctx, FAST)
    quant = json.loads((ctx.out / "quant.json").read_text())
    assert any(c.get("tau_drop", 0) > 0 for c in quant["candidates"] if c["scheme"].startswith("int4"))
    assert quant["chosen"] in ("fp32", "int8")
    for c in quant["candidates"]:
        if c["scheme"] == quant["chosen"]:
            assert c["tau_drop"] <= 0.0


def test_long_rows_join_the_held_out_rows_and_a_long_prompt_leaves_its_own_conversation_out(distilled):
    data = distilled[0]  # 12 rows of 40 tokens
    held_out = [data.row(i)[0].tolist() for i in range(len(data))]
    rows = long_rows(data, 3, 100)
    assert [r.tolist() for r in rows] == [sum(held_out, [])[i * 100:(i + 1) * 100] for i in range(3)]
    assert len(long_rows(data, 10, 100)) == 4  # 480 tokens hold four whole rows of 100
    prompts = prompts_from(data, 3)
    for i, (prompt, long) in enumerate(zip(prompts, long_prompts(data, prompts, 100))):
        others = sum(held_out[:i] + held_out[i + 1:], [])
        assert long == others[-(100 - len(prompt)):] + prompt
    with pytest.raises(ValueError, match=r"^calibrate.context=1000: the validation split holds 480 tokens, not one "):
        long_rows(data, 1, 1000)
    with pytest.raises(ValueError, match=r"^calibrate.context=1000: the validation split holds 440 tokens besides"):
        long_prompts(data, prompts, 1000)


def test_a_calibrate_context_measures_the_kv_schemes_and_specattn_at_that_context(tmp_path, target_dir, distilled):
    ctx = make_run(tmp_path, target_dir, distilled, context=120)
    result = run_calibrate(ctx, FAST)
    kv, sparsity = (json.loads((ctx.out / name).read_text()) for name in ("kv_quant.json", "sparsity.json"))
    assert kv["decode_context"] == 120 and kv["rows"] == 3 and "120 tokens of context" in result.message
    assert sparsity["tokens"] == 3 * 120 and sparsity["layer_map_tokens"] == 3 * 40  # the layer map: short rows
    # both dense taus are the drafter's at 120 tokens of context, measured here again
    data = distilled[0]
    target = ctx.load_target(precision=ctx.cfg.validate.precision)  # calibrate measures as validate runs
    config = json.loads((ctx.input("distill") / "drafter_config.json").read_text())
    tensors = load_file(str(ctx.input("distill") / "drafter.safetensors"))
    drafter = served_drafter(config, drafter_module(config, target, tensors), target, tensors)
    long = long_prompts(data, prompts_from(data, FAST.tau_prompts), 120)
    tau = ctx.tau_probe(long, FAST.tau_new_tokens).measure(target, drafter)["tau"]
    assert kv["dense_tau"] == sparsity["dense_tau"] == tau
    assert tau != json.loads((ctx.out / "quant.json").read_text())["fp32_tau"]  # the short prompts' tau differs
    # the top-p sweep read the long rows: its KV reads saved and perplexity, recomputed on them
    layer_map = LayerMap.from_json((ctx.out / "layer_map.json").read_text())
    model = drafter_module(config, target, tensors)
    rows = [calibration_row(target, get_kind("eagle"), model, r, target_attention=False)
            for r in long_rows(data, 3, 120)]
    first = sparsity["sweep"][0]
    again = teacher_forced(target, rows, SpecAttnConfig(layer_map.mapping, first["top_p"], layer_map.dense_first),
                           draft_selector, sparsity["dense_perplexity"])
    assert again["kv_saved"] == pytest.approx(first["kv_saved"]) and again["perplexity"] == pytest.approx(
        first["perplexity"])


def test_a_calibrate_context_beyond_the_target_s_is_one_clear_error(tmp_path, target_dir, distilled):
    ctx = make_run(tmp_path, target_dir, distilled, context=240)  # the tiny target holds 256 positions
    with pytest.raises(ValueError, match=r"^calibrate.context=240: drafting 24 tokens after it needs 289 positions, "
                                         r"more than the target's context of 256$"):
        run_calibrate(ctx, FAST)


def test_choose_scheme_prefers_smallest_within_tolerance():
    cands = [{"scheme": "int8", "tau_drop": 0.0, "bytes": 100}, {"scheme": "int4-g64", "tau_drop": 0.05, "bytes": 60},
             {"scheme": "int4-g32", "skipped": "group size"}]
    assert choose_scheme(cands, 0.1) == "int4-g64"
    assert choose_scheme(cands, 0.01) == "int8"
    assert choose_scheme(cands[1:], 0.0) == "fp32"


def test_an_lm_drafter_is_calibrated_and_one_that_attends_as_the_target_selects_as_the_ceiling(
        tmp_path, target_dir, distilled):
    ctx = make_run(tmp_path, target_dir, distilled, kind="lm")
    result = run_calibrate(ctx, FAST)
    quant = json.loads((ctx.out / "quant.json").read_text())
    assert quant["fp32_tau"] > 2.0 and [c["scheme"] for c in quant["candidates"] if "tau" in c] == ["int8", "int4-g32"]
    assert json.loads((ctx.out / "kv_quant.json").read_text())["dense_tau"] > 2.0
    assert json.loads((ctx.out / "draft_budget.json").read_text())["chosen"]["depth"] >= 1
    layer_map = LayerMap.from_json((ctx.out / "layer_map.json").read_text())
    assert layer_map.mapping == (DENSE, DENSE, 2, 3)  # each target layer to its own copy: KL 0
    report = json.loads((ctx.out / "sparsity.json").read_text())
    for drafted, own in zip(report["sweep"], report["ceiling_sweep"]):
        assert drafted["top_p"] == own["top_p"]
        assert drafted["kv_saved"] == pytest.approx(own["kv_saved"], abs=1e-3)
        assert drafted["ppl_change"] == pytest.approx(own["ppl_change"], abs=0.01)  # near-ties round apart
    assert report["sweep"][0]["kv_saved"] > 0 and "SpecAttn" in result.message


def test_ngram_is_not_applicable(tmp_path, target_dir, distilled):
    ctx = make_run(tmp_path, target_dir, distilled, kind="ngram")
    result = run_calibrate(ctx, FAST)
    assert "not applicable" in result.message
    assert json.loads((ctx.out / "quant.json").read_text())["chosen"] == "not applicable"
    assert not (ctx.out / "layer_map.json").exists()


def test_quantspec_has_no_weights_to_quantise_but_its_kv_and_budget_are_calibrated(tmp_path, target_dir, distilled):
    ctx = make_run(tmp_path, target_dir, distilled, kind="quantspec")
    result = run_calibrate(ctx, FAST)
    assert json.loads((ctx.out / "quant.json").read_text())["chosen"] == "not applicable"
    # the copy agrees (int4 where our kernel runs: on this tiny random model less than int8's 2.0; never agreeing: 1)
    assert json.loads((ctx.out / "kv_quant.json").read_text())["dense_tau"] > 1.5
    budget = json.loads((ctx.out / "draft_budget.json").read_text())
    assert budget["chosen"]["depth"] >= 1 and budget["sweep"]
    assert "no weights to quantise" in result.message and not (ctx.out / "layer_map.json").exists()


def test_effective_keys_counts_the_keys_a_row_spreads_over():
    uniform = torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.0]])
    one_hot = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]])
    assert effective_keys([uniform]) == pytest.approx(4.0) and effective_keys([one_hot]) == pytest.approx(1.0)
    assert effective_keys([uniform, one_hot]) == pytest.approx(2.5)


def test_choose_top_p_saves_most_within_the_perplexity_tolerance():
    sweep = [{"top_p": 0.5, "kv_saved": 0.7, "ppl_change": 0.04}, {"top_p": 0.8, "kv_saved": 0.5, "ppl_change": 0.008},
             {"top_p": 0.9, "kv_saved": 0.4, "ppl_change": -0.001}]
    assert choose_top_p(sweep, 0.01)["top_p"] == 0.8
    assert choose_top_p(sweep, 0.05)["top_p"] == 0.5
    assert choose_top_p(sweep[:1], 0.01) is None


def test_teacher_forced_sparse_nll_at_top_p_1_is_the_dense_nll(target_dir, distilled):
    target = from_pretrained(target_dir, max_seq_len=64)
    eagle = eagle_recipe.build_eagle(target, None).eval()
    row = calibration_row(target, get_kind("eagle"), eagle, distilled[0].row(0)[0][:30])
    nll, reads, dense = sparse_nll(target, row, SpecAttnConfig((-1, 0, 0, 0), top_p=1.0, dense_first=1))
    assert torch.equal(nll, row.dense_nll) and reads == dense
    nll, reads, dense = sparse_nll(target, row, SpecAttnConfig((-1, 0, 0, 0), 0.5, dense_first=1, sink=1, recent=2))
    assert reads < dense and nll.shape == row.dense_nll.shape
    own = SpecAttnConfig((-1, 1, 2, 3), top_p=1.0, dense_first=1)  # each target layer ranks keys by its own attention
    nll, reads, dense = sparse_nll(target, row, own, target_selector)
    assert torch.equal(nll, row.dense_nll) and reads == dense
    own = SpecAttnConfig((-1, 1, 2, 3), 0.5, dense_first=1, sink=1, recent=2)
    nll, reads, dense = sparse_nll(target, row, own, target_selector)
    assert reads < dense and not torch.equal(nll, row.dense_nll)


def test_a_long_row_keeps_draft_heads_averaged_per_kv_head_and_measures_the_same(target_dir, distilled, monkeypatch):
    """What lets the top-p sweep read rows of thousands of tokens: the draft heads averaged as tapped, the sparse
    forward a slice of queries at a time, the logits through the head a slice of positions at a time; the keys kept,
    the reads and the perplexity stay the same."""
    target = from_pretrained(target_dir, max_seq_len=64)
    eagle = eagle_recipe.build_eagle(target, None).eval()
    ids = distilled[0].row(0)[0][:30]
    monkeypatch.setattr(specattn_sweep.hidden_nll, "__defaults__", (7,))  # logits 7 positions at a time
    full = calibration_row(target, get_kind("eagle"), eagle, ids)
    long = calibration_row(target, get_kind("eagle"), eagle, ids, target_attention=False)
    assert long.target_attention is None and long.draft_attention is None
    torch.testing.assert_close(next(long.draft_slices(30)), head_groups(full.draft_attention, target.config.n_kv_heads))
    logits = target(ids[None], target.new_cache(1, 30), torch.arange(30)[None]).logits
    torch.testing.assert_close(full.dense_nll, next_token_nll(logits, ids))
    sparse = SpecAttnConfig((-1, 0, 0, 0), 0.5, dense_first=1, sink=1, recent=2)
    (nll, reads, dense), (long_nll, long_reads, _) = sparse_nll(target, full, sparse), sparse_nll(target, long, sparse)
    assert reads == long_reads < dense
    torch.testing.assert_close(nll, long_nll)
    monkeypatch.setattr(specattn_sweep, "QUERY_SLICE", 7)  # forwards of 7 queries over the growing cache
    sliced_nll, sliced_reads, _ = sparse_nll(target, long, sparse)
    assert sliced_reads == reads
    torch.testing.assert_close(sliced_nll, nll, atol=1e-4, rtol=1e-4)
    sliced = calibration_row(target, get_kind("eagle"), eagle, ids, target_attention=False)  # its forward sliced too
    torch.testing.assert_close(sliced.dense_nll, full.dense_nll, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(next(sliced.draft_slices(30)), next(long.draft_slices(30)), atol=1e-5, rtol=1e-4)


def test_an_lm_drafters_long_row_computes_its_attention_a_slice_at_a_time(target_dir, distilled, monkeypatch):
    """An lm drafter's long row never holds its whole draft attention: its own forward runs a slice of queries at a
    time over a growing cache as the sweep reads it, and the keys kept, the reads and the perplexity stay the same."""
    target = from_pretrained(target_dir, max_seq_len=64)
    lm = lm_recipe.build_lm(target, 2, "target").eval()
    kind, ids = get_kind("lm"), distilled[0].row(0)[0][:30]
    full, long = (calibration_row(target, kind, lm, ids, target_attention=t) for t in (True, False))
    sliced = list(long.draft_slices(7))
    assert [s.shape[-2:] for s in sliced] == [(7, 7), (7, 14), (7, 21), (7, 28), (2, 30)]
    whole = head_groups(full.draft_attention, target.config.n_kv_heads)
    for start, s in zip(range(0, 30, 7), sliced):
        torch.testing.assert_close(s, whole[:, :, start:start + 7, :start + s.shape[-2]])
    sparse = SpecAttnConfig((-1, 0, 1, 1), 0.5, dense_first=1, sink=1, recent=2)
    nll, reads, dense = sparse_nll(target, full, sparse)
    monkeypatch.setattr(specattn_sweep, "QUERY_SLICE", 7)
    long_nll, long_reads, long_dense = sparse_nll(target, long, sparse)
    assert long_reads == reads < dense == long_dense
    assert dense == target.config.n_layers * target.config.n_kv_heads * 30 * 31 // 2  # each query's keys 0..t
    torch.testing.assert_close(long_nll, nll, atol=1e-4, rtol=1e-4)


def test_the_sweep_taps_and_ranks_only_the_draft_layers_its_map_reads(target_dir, distilled, monkeypatch):
    """A long row's draft attention is computed for the mapped draft layers alone (a sibling's map reads about half
    of them), and each target layer's keys are still ranked by the draft layer it is mapped to."""
    from dataclasses import replace

    target = from_pretrained(target_dir, max_seq_len=64)
    lm = lm_recipe.build_lm(target, 2, "target").eval()
    kind, ids = get_kind("lm"), distilled[0].row(0)[0][:30]
    full, long = (calibration_row(target, kind, lm, ids, target_attention=t) for t in (True, False))
    tapped, lm_forward = [], lm.forward

    def forward(*args, **kwargs):
        tapped.append(kwargs["taps"].attention_layers)
        return lm_forward(*args, **kwargs)

    monkeypatch.setattr(lm, "forward", forward)
    monkeypatch.setattr(specattn_sweep, "QUERY_SLICE", 7)
    by_layer_1 = SpecAttnConfig((0, 1, 1, 1), 0.5, dense_first=1, sink=1, recent=2)  # layer 0 is dense: unread
    assert by_layer_1.draft_layers() == (1,)
    nll, reads, dense = sparse_nll(target, long, by_layer_1)
    assert tapped == [(1,)] * 5
    layer_1_alone = SpecAttnConfig((-1, 0, 0, 0), 0.5, dense_first=1, sink=1, recent=2)
    ref_nll, ref_reads, _ = sparse_nll(target, replace(full, draft_attention=full.draft_attention[1:]), layer_1_alone)
    assert reads == ref_reads < dense
    torch.testing.assert_close(nll, ref_nll, atol=1e-4, rtol=1e-4)
    other_nll, other_reads, _ = sparse_nll(target, full, layer_1_alone)  # ranked by layer 0 instead: other keys
    assert other_reads != reads or not torch.allclose(other_nll, nll, atol=1e-4, rtol=1e-4)


def test_a_long_rows_draft_slice_is_let_go_before_the_sparse_forward_reads_the_next(target_dir, distilled,
                                                                                     monkeypatch):
    """What bounds the sweep's memory at 4k tokens: neither the lm's slice generator nor sparse_nll holds a slice
    of draft attention (or the taps it was stacked from) once the keys are chosen, while the target's forward runs."""
    import weakref

    target = from_pretrained(target_dir, max_seq_len=64)
    lm = lm_recipe.build_lm(target, 2, "target").eval()
    ids = distilled[0].row(0)[0][:30]
    long = calibration_row(target, get_kind("lm"), lm, ids, target_attention=False)
    taps, slices, live_at_forward = [], [], []
    lm_forward, target_forward = lm.forward, target.forward

    def tapped(*args, **kwargs):
        out = lm_forward(*args, **kwargs)
        taps.extend(weakref.ref(a) for a in out.attention.values())
        return out

    def seen(s):
        slices.append(weakref.ref(s))
        return s

    def selector(row, rows, layers):
        return map(seen, draft_selector(row, rows, layers))

    def forward(*args, **kwargs):
        live_at_forward.append(sum(r() is not None for r in taps + slices))
        return target_forward(*args, **kwargs)

    monkeypatch.setattr(lm, "forward", tapped)
    monkeypatch.setattr(target, "forward", forward)
    monkeypatch.setattr(specattn_sweep, "QUERY_SLICE", 7)
    sparse_nll(target, long, SpecAttnConfig((-1, 0, 1, 1), 0.5, dense_first=1, sink=1, recent=2), selector)
    assert len(slices) == 5 and len(taps) == 5 * lm.config.n_layers
    assert live_at_forward == [0] * 5


def test_choose_kv_scheme_is_the_smallest_within_both_tolerances_and_the_slowdown():
    cands = [{"scheme": "int8", "tau_drop": 0.0, "ppl_change": 0.001, "target_bits": 8.5, "draft_bits": 8.5,
              "slowdown": 0.02},
             {"scheme": "int4", "tau_drop": 0.0, "ppl_change": 0.03, "target_bits": 5.0, "draft_bits": 5.0,
              "slowdown": 0.3},
             {"scheme": "hier-int4", "tau_drop": 0.01, "ppl_change": 0.001, "target_bits": 8.5, "draft_bits": 4.5,
              "slowdown": 0.04}]
    assert choose_kv_scheme(cands, 0.02, 0.01, 1.0) == "hier-int4"  # int8's reads for the target, half for the drafter
    assert choose_kv_scheme(cands, 0.02, 0.05, 1.0) == "int4"
    assert choose_kv_scheme(cands, 0.02, 0.05, 0.05) == "hier-int4"  # int4 is accurate enough but too slow
    assert choose_kv_scheme(cands, 0.02, 0.01, 0.03) == "int8"
    assert choose_kv_scheme(cands, 0.02, 0.01, 0.01) == "none"
    assert choose_kv_scheme(cands, 0.0, 0.0, 1.0) == "none"


def test_kv_message_says_when_speed_alone_ruled_compression_out():
    cands = [{"scheme": "int4", "tau_drop": 0.0, "ppl_change": 0.001, "target_bits": 5.0, "slowdown": 0.3}]
    assert kv_message(cands, "none", 0.02, 0.01, 0.05) == ("KV: full precision (within the accuracy tolerances but "
                                                           "decoding slower here: int4 +30%; "
                                                           "calibrate.kv_max_slowdown=0.05)")
    assert kv_message(cands, "none", 0.02, 0.0, 0.05) == "KV: no scheme within tolerance, cache stays full precision"


def test_decode_ms_times_every_storage_after_the_context(target_dir):
    target = from_pretrained(target_dir, max_seq_len=64)
    quants = {"none": None, "int4": KVQuant("int4", recent=4)}
    times = decode_ms(target, quants, context=40, rounds=2, steps=1)
    assert set(times) == {"none", "int4"} and all(0 < t < 10_000 for t in times.values())
    with pytest.raises(ValueError, match="max_seq_len"):  # the context must fit the target
        decode_ms(target, quants, context=64, rounds=1, steps=1)


def test_chunked_quantised_nll_reads_the_history_as_one_token_decoding_does(target_dir, distilled, monkeypatch):
    target = from_pretrained(target_dir, max_seq_len=64)
    ids = distilled[0].row(0)[0][:40]
    dense = quantized_nll(target, ids, None)
    full = target(ids[None], target.new_cache(1, 40), torch.arange(40)[None]).logits
    torch.testing.assert_close(dense, F.cross_entropy(full[0, :-1].float(), ids[1:], reduction="none"))
    monkeypatch.setattr(specattn_sweep, "QUERY_SLICE", 7)  # a long row's forwards: 7 queries at a time
    torch.testing.assert_close(quantized_nll(target, ids, None), dense, atol=1e-4, rtol=1e-5)
    errors = {}
    for scheme in ("int8", "int4"):
        quant = KVQuant(scheme, recent=4)
        nll = quantized_nll(target, ids, quant)
        cache = QuantizedKVCache(N_LAYERS, 1, target.config.n_kv_heads, 40, target.config.head_dim, quant)
        one_by_one = []
        with torch.inference_mode():
            for t in range(40):
                one_by_one.append(target(ids[None, t:t + 1], cache, torch.tensor([[t]])).logits)
                cache.advance(1)
        # the tolerance covers fp32 kernels that differ by row count (runtime.target.cpu_packing.Linear), not a
        # misread history
        torch.testing.assert_close(nll, F.cross_entropy(torch.cat(one_by_one, 1)[0, :-1].float(), ids[1:],
                                                    reduction="none"), atol=1e-4, rtol=1e-5)
        errors[scheme] = (nll - dense).abs().mean()
        assert errors[scheme] > 1e-3  # what reading the history unquantised (or quantised differently) would miss
    assert 0 < errors["int8"] < errors["int4"]


def test_a_replay_over_a_quantised_history_commits_the_reply(target_dir):
    """The replayed target writes no KV, yet a quantised cache's window must grow as a real forward grows it: after a
    reply that filled the cache, the next prompt starts in the short window left at its end."""
    target = from_pretrained(target_dir, max_seq_len=250)
    # the first reply ends at 249 tokens, 192 of them quantised: 58 slots are left, fewer than the 64 the window
    # fills before its boundary moves (kv_recent and the block, 32 each)
    fields = dict(max_seq_len=250, kv_scheme="int8", kv_recent=32)
    engine = Engine(target, None, EngineConfig(**fields))
    prompts = [[3 + i % 90 for i in range(n)] for n in (150, 20)]
    refs = [reference(engine, p, 99, ()) for p in prompts]
    replayed = ReplayTarget(target)
    assert replay(replayed, Engine(replayed, None, EngineConfig(**fields)), refs, 99, ())["new_tokens"] == 198


def test_a_replayed_budget_commits_the_reply_and_reaches_the_engines_tau(target_dir, distilled):
    data, tensors = distilled
    target = from_pretrained(target_dir, max_seq_len=256)
    config = {"kind": "eagle", "draft_vocab": 64}
    module = drafter_module(config, target, tensors)
    prompts = [data.row(i)[0][:8].tolist() for i in range(4)]
    corpus = NgramDrafter.corpus(target.config.vocab_size, [data.row(i)[0] for i in range(4, 12)], max_depth=4)
    replayed = ReplayTarget(target)
    refs = [reference(Engine(target, None, EngineConfig(max_seq_len=128)), p, 40, (7,)) for p in prompts]
    for budget in (ServedBudget(DraftBudget(1, 1, 1)), ServedBudget(DraftBudget(4, 2, 8), adaptive=True),
                   ServedBudget(DraftBudget(3, 2, 6), lookup=4, max_tree=5)):
        fields = dict(max_seq_len=128, lookup_corpus=corpus, **budget.engine_fields())
        real = [Engine(target, served_drafter(config, module, target, tensors), EngineConfig(**fields)).generate(
            p, 40, SamplingParams(), None, (7,)) for p in prompts]
        assert [g.tokens for g in real] == [r.reply for r in refs]  # lossless: every budget commits the reply
        engine = Engine(replayed, served_drafter(config, module, target, tensors), EngineConfig(**fields))
        row = replay(replayed, engine, refs, 40, (7,))
        forwards = sum(g.metrics.target_forwards for g in real)
        assert row["forwards"] == forwards and row["tau"] == tokens_per_forward(sum(len(r.reply) for r in refs), 4, forwards)
        assert sum(row["verify_rows"].values()) == forwards and row["draft_s"] > 0 and row["rollback_s"] > 0
        nodes = sum(g.metrics.draft_nodes for g in real)
        assert sum((n - 1) * k for n, k in row["verify_rows"].items()) == nodes  # each verify: the root + its tree
