"""The eagle3 drafter kind on a tiny 8-layer target: it learns and stays lossless through the bundle, the engine drafts
what the training unroll predicts, it drafts the same trees at static shapes, reads the residual streams the engine
taps (eager and static verify), trains on the same features offline and online, exports its ONNX step, and refuses
a bundle made for a target of another depth."""
import copy

import pytest
import torch

from export.bundle_writer import write_bundle
from export.calibrate.replay import ReplayTarget, reference, replay
from runtime.bundle_reader import BundleError, read_bundle
from runtime.drafters import build_drafter, drafter_config, drafter_tensors
from runtime.drafters.eagle3 import Eagle3Model, aux_layers
from runtime.drafters.shared.eagle_drafting import EagleDrafter
from runtime.drafters.shared.eagle_static import StaticEagleTree
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.target.loading import from_pretrained
from runtime.target.model import Taps, Transformer
from support.helpers import perturbed, self_distilled_rows
from train.batch_generate import BatchGenerator, Request
from train.batches import Batches
from train.recipes import get_recipe
from train.spec import TrainSpec
from train.target_outputs import target_features
from train.trainer import train
from train.ttt import unroll

LAYERS, VOCAB = 8, 96


class Settings:
    """The drafter and distill sections as a recipe reads them."""
    aux_layers, depth, token_candidates, ttt_depth, ttt_decay = None, 4, 0, 2, None


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir):
    # a large init makes next-token distributions peaked, as a trained model's are
    return tiny_model_dir("llama", num_hidden_layers=LAYERS, tie_word_embeddings=True, initializer_range=0.3)


@pytest.fixture(scope="module")
def target(target_dir):
    return from_pretrained(target_dir, max_seq_len=256)


@pytest.fixture(scope="module")
def rows(target):
    return self_distilled_rows(target, rows=24, prompt_vocab=VOCAB, new_tokens=40)


def randomised(target: Transformer) -> Eagle3Model:
    # every weight off its pass-through init: every token, position and key matters
    model = Eagle3Model.from_target(target, torch.arange(0, VOCAB, 2), aux_layers(None, LAYERS))
    return perturbed(model, scale=0.1).requires_grad_(False)


@pytest.fixture(scope="module")
def random_eagle3(target):
    return randomised(target)  # drafters prepack it for the CPU: tests that export build their own


@pytest.fixture(scope="module")
def trained(target, rows, tmp_path_factory) -> tuple[Eagle3Model, list[dict]]:
    """An eagle3 drafter trained 60 steps on the target's own rows, and its training log."""
    recipe, keep = get_recipe("eagle3"), torch.arange(0, VOCAB)
    model = recipe.build(target, Settings, Settings, keep)
    history = []
    train(model, recipe.loss(target, Settings, Settings, keep), Batches(rows, 8, seed=0),
          TrainSpec(steps=60, lr=3e-3, warmup=2), tmp_path_factory.mktemp("ckpt"),
          log=lambda step, m: history.append(m))
    return model.eval().requires_grad_(False), history


def test_eagle3_learns_and_stays_lossless_through_its_bundle(target, rows, trained, tmp_path):
    keep = torch.arange(0, VOCAB)
    model, history = trained
    assert model.aux_layers == (2, 4, 5)
    assert history[-1]["loss"] < 0.8 * history[0]["loss"] and history[-1]["top1"] > history[0]["top1"] + 0.1
    assert history[0]["feature_loss"] == 0.0  # tokens only: no feature regression

    config = drafter_config("eagle3", model, keep.numel(), Settings)
    assert config == {"kind": "eagle3", "aux_layers": [2, 4, 5], "target_layers": LAYERS, "draft_vocab": VOCAB}
    write_bundle(tmp_path / "bundle", config, drafter_tensors(model, keep), target_fingerprint="t", data_digest="d",
                 config={}, code_version="test")
    drafter = build_drafter(read_bundle(tmp_path / "bundle", "t"), target, 320)
    assert drafter.feature_layers == (2, 4, 5)
    plain = Engine(target, None, EngineConfig(max_seq_len=256))
    spec = Engine(target, drafter, EngineConfig(max_seq_len=256, budget=DraftBudget(3, 2, 6), adaptive=False))
    taus = []
    for i in range(3):  # prompts it was trained on: a 60-step drafter of a random target does not generalise
        prompt = rows.row(i)[0][:6].tolist()
        got = spec.generate(prompt, 30, SamplingParams())
        assert got.tokens == plain.generate(prompt, 30, SamplingParams()).tokens
        taus.append(got.metrics.tau)
    assert sum(taus) / len(taus) > 1.2  # accepted beyond the bonus token


def replayed_verifies(model: Eagle3Model, target: Transformer, row: torch.Tensor, prompt_len: int, depth: int) -> int:
    """Verifies a greedy chain of `depth` takes to commit `row`'s reply when it drafts what the training-time
    unroll predicts there: after the prefill, pairs up to (x_{j+1}, f_j) are committed with j = prompt_len - 1."""
    t = target_features(target, {"input_ids": row, "loss_mask": torch.ones_like(row)}, model.aux_layers)
    with torch.no_grad():
        drafts = [model.head.keep_ids[model.head(p[0]).argmax(-1)].tolist()
                  for p in unroll(model, row, t.drafter_input[:, :-1], depth)]
    tokens, n = row[0].tolist(), row.shape[1]
    verifies, j = 0, prompt_len - 1
    while j + 2 < n:
        accepted = 0
        while accepted < depth and j + 2 + accepted < n and drafts[accepted][j] == tokens[j + 2 + accepted]:
            accepted += 1
        verifies, j = verifies + 1, j + accepted + 1
    return verifies


def test_the_engine_drafts_what_training_unrolls(target, rows, trained):
    """Replaying the unroll's drafts over the engine's own reply takes exactly the engine's verifies: the engine
    feeds the drafter the pairs and streams training reads. A stream off by one layer or a pair off by one position
    only lowers acceptance, which no other check would notice."""
    model, _ = trained
    engine = Engine(target, EagleDrafter(copy.deepcopy(model), 256),  # the drafter prepacks its copy
                    EngineConfig(max_seq_len=256, budget=DraftBudget(3), adaptive=False))
    new = verifies = 0
    for i in range(6):
        prompt = rows.row(i)[0][:6].tolist()
        out = engine.generate(prompt, 30, SamplingParams())
        row = torch.tensor(prompt + out.tokens)[None]
        assert replayed_verifies(model, target, row, len(prompt), 3) == out.metrics.target_forwards
        new, verifies = new + len(out.tokens) - 1, verifies + out.metrics.target_forwards
    assert new - verifies >= 12  # accepted drafts: the count is not that of a drafter that never hits


def test_a_bundle_for_a_target_of_another_depth_is_refused(target, tiny_model_dir, tmp_path, random_eagle3):
    config = drafter_config("eagle3", random_eagle3, VOCAB // 2, Settings)
    write_bundle(tmp_path / "b", config, drafter_tensors(random_eagle3, random_eagle3.head.keep_ids),
                 target_fingerprint="t", data_digest="d", config={}, code_version="test")
    shallower = from_pretrained(tiny_model_dir("llama", num_hidden_layers=6), max_seq_len=64)
    with pytest.raises(BundleError, match="chosen for a target of 8 layers, this one has 6"):
        build_drafter(read_bundle(tmp_path / "b"), shallower, 64)


def test_the_engine_feeds_eagle3_the_streams_of_every_verify(target, random_eagle3):
    """What the drafter's committed pairs carry equals the target's streams at those positions: the prefill's and
    each verify's accepted rows, eager and at static shapes (which return the streams from inside the step)."""
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    seen = []
    for static in (False, True):
        drafter = EagleDrafter(random_eagle3, 256)
        commit, reset = drafter.commit, drafter.reset
        pairs = []
        drafter.reset = lambda t, f: pairs.append(f) or reset(t, f)
        drafter.commit = lambda t, f: pairs.append(f) or commit(t, f)
        engine = Engine(target, drafter, EngineConfig(max_seq_len=256, budget=DraftBudget(3, 2, 5), adaptive=False,
                                                      static_verify=static))
        out = engine.generate(prompt, 24, SamplingParams())
        seen.append((out.tokens, torch.cat(pairs)))
    tokens, features = seen[0]
    assert seen[1][0] == tokens
    # the same streams; fp32 sums over a static key span round a little differently from the live keys'
    torch.testing.assert_close(seen[1][1], features, rtol=1e-3, atol=1e-3)
    ids = torch.tensor(prompt + tokens)[None]
    with torch.no_grad():
        full = target(ids, target.new_cache(1, ids.shape[1]), torch.arange(ids.shape[1])[None],
                      taps=Taps.entering((2, 4, 5)))
    streams = full.features((2, 4, 5))[0, :features.shape[0]]  # pair j carries position j's streams
    torch.testing.assert_close(features, streams, rtol=1e-3, atol=1e-3)


def test_calibrate_replays_eagle3_on_the_streams_it_reads(target, random_eagle3):
    """calibrate's replayed verify hands eagle3 the streams it fuses: it commits the reply with the real forwards."""
    prompts = [torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in (3, 4)]
    config = EngineConfig(max_seq_len=128, budget=DraftBudget(3, 2, 5), adaptive=False)
    real = Engine(target, EagleDrafter(random_eagle3, 128), config)
    refs = [reference(real, p, 24, ()) for p in prompts]
    forwards = sum(real.generate(p, 24, SamplingParams()).metrics.target_forwards for p in prompts)
    replayed = ReplayTarget(target)
    row = replay(replayed, Engine(replayed, EagleDrafter(random_eagle3, 128), config), refs, 24, ())
    assert row["forwards"] == forwards and forwards < sum(len(r.reply) for r in refs)


def test_static_trees_are_the_eager_trees(target, random_eagle3):
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats = target(ids[None], target.new_cache(1, 32), torch.arange(30)[None],
                       taps=Taps.entering((2, 4, 5))).features((2, 4, 5))[0]
    eager, static = EagleDrafter(random_eagle3, 64), EagleDrafter(random_eagle3, 64)
    static.static = StaticEagleTree(random_eagle3, static.cache, use_graph=False)
    for d in (eager, static):
        d.reset(ids[:11], feats[:10])
    pos = 11
    for budget, n_commit in ((DraftBudget(3), 2), (DraftBudget(4, 2), 3), (DraftBudget(2, 4, 6), 1)):
        trees = [d.propose(budget, SamplingParams()) for d in (eager, static)]
        assert trees[1].tokens.tolist() == trees[0].tokens.tolist() and len(trees[0]) == budget.max_nodes
        assert trees[1].parents.tolist() == trees[0].parents.tolist()
        torch.testing.assert_close(trees[1].scores, trees[0].scores)
        for d in (eager, static):
            d.commit(ids[pos:pos + n_commit], feats[pos - 1:pos - 1 + n_commit])
        pos += n_commit


def test_training_reads_the_same_streams_from_the_cache_as_online(target, rows):
    """prepare's cache ([final hidden; streams], from the continuous-batching generator) gives the loss the online
    target pass gives; a cache without the streams is refused."""
    gen = BatchGenerator(target, 2, keep_hidden=True, streams=(2, 4, 5), max_len=128)
    gen.submit(Request("a", rows.row(0)[0][:10].tolist(), 8))
    (done,) = [c for _ in range(20) for c in gen.step()]
    ids = torch.tensor(done.prompt + done.tokens)[None]
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    online = target_features(target, batch, (2, 4, 5))
    cached = target_features(target, {**batch, "features": done.hidden[None]}, (2, 4, 5))
    # one token a step against one prefill: fp32 sums in another order
    torch.testing.assert_close(cached.features, online.features, rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(cached.drafter_input, online.streams, rtol=1e-3, atol=2e-3)
    with pytest.raises(ValueError, match="holds 0 residual streams beside the final hidden state, this drafter reads 3"):
        target_features(target, {**batch, "features": online.features}, (2, 4, 5))


def test_eagle3_onnx_step_matches_onnxruntime(target, tmp_path):
    from export.onnx_export import check_onnx_parity, example_inputs, export_onnx

    model = randomised(target)
    record = export_onnx(model, "eagle3", example_inputs(model, "eagle3", 2, 5), tmp_path / "d.onnx")
    assert record["inputs"]["features"] == ["batch", "seq", 3 * model.cfg.dim]
    parity = check_onnx_parity(model, "eagle3", tmp_path / "d.onnx", example_inputs(model, "eagle3", 1, 7, seed=1))
    assert parity["passed"], parity


def test_eagle3_runs_every_stage_from_distill_to_validate(target_dir, rows, tmp_path):
    """distill (with prepare's cache of the streams), calibrate (weights, KV, budget, SpecAttn), export (bundle,
    ONNX, both engine layouts) and validate's gate, through the stage functions the CLI runs."""
    import json

    from export.calibrate.stage import CalibrateSettings, run_calibrate
    from pipeline.config import Config
    from pipeline.runstore import RunStore, StageResult
    from pipeline.stages.distill import run_distill
    from pipeline.stages.export import run_export
    from pipeline.stages.validate import REPORT_JSON, run_validate
    from support.helpers import run_stage_on
    from train.shards import save_features

    cfg = Config.model_validate({
        "drafter": {"kind": "eagle3", "draft_vocab": 64, "depth": 3, "width": 2, "nodes": 6, "lookup": 4},
        "distill": {"steps": 6, "batch_size": 4, "lr": 3e-3, "warmup": 1},
        "calibrate": {"weight_schemes": ["int8"], "kv_schemes": ["int8"], "prompts": 2, "tokens": 32,
                      "top_p": [0.9], "budget_prompts": 2},
        "validate": {"num_prompts": 2, "max_new_tokens": 10, "gate": {"min_tau": 1.0, "min_speedup": 0.0}}})
    store = RunStore(tmp_path / "runs", "r1")
    target = from_pretrained(target_dir, max_seq_len=256)

    def prepare(ctx):  # the self-distilled rows, and the cache prepare writes for an eagle3 drafter
        features = []
        for i in range(len(rows)):
            ids = rows.row(i)[0][None]
            with torch.no_grad():
                out = target(ids, target.new_cache(1, ids.shape[1]), torch.arange(ids.shape[1])[None],
                             taps=Taps.entering((2, 4, 5)))
            features.append(out.with_streams((2, 4, 5))[0])
        for split in ("train", "val"):
            rows.save(ctx.out / f"{split}.safetensors")
            save_features(torch.cat(features), ctx.out, split, (2, 4, 5))
        return StageResult(outputs={"train": "train.safetensors", "val": "val.safetensors"})

    run_stage_on(store, "prepare", cfg, target_dir, prepare)
    distilled = run_stage_on(store, "distill", cfg, target_dir, run_distill)
    assert distilled["metrics"]["offline_features"] == 1 and distilled["message"].startswith("eagle3: tau")
    calibrated = run_stage_on(store, "calibrate", cfg, target_dir,
                              lambda ctx: run_calibrate(ctx, CalibrateSettings(tau_prompts=2)))
    assert {"quant", "kv_quant", "draft_budget", "specattn"} <= set(calibrated["outputs"])
    exported = run_stage_on(store, "export", cfg, target_dir, run_export)
    engines = exported["outputs"]["engine_formats"]
    assert set(engines) == {"speculators-eagle3", "sglang-eagle3"}
    assert all(isinstance(r, dict) for r in engines.values())  # both layouts express it
    spec_dir = store.stage_dir("export") / "engines" / "speculators-eagle3"
    assert json.loads((spec_dir / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    bundle = read_bundle(store.stage_dir("export") / "bundle")
    assert bundle.manifest["onnx"]["parity"]["passed"] and bundle.manifest["onnx"]["kind"] == "eagle3"
    validated = run_stage_on(store, "validate", cfg, target_dir, run_validate)
    report = json.loads((store.stage_dir("validate") / REPORT_JSON).read_text())
    assert validated["status"] == "completed" and report["metrics"]["lossless"] and report["drafter_kind"] == "eagle3"


@pytest.mark.parametrize("layers,why", [("[2,4,99]", "[99] outside the target's layers 1..8"),
                                        ("[5,4,2]", "3 distinct ascending layer ids")])
def test_layer_ids_the_target_lacks_are_one_line_before_anything_runs(target_dir, tmp_path, capsys, layers, why):
    from pipeline.cli import main

    code = main(["run", "drafter.kind=eagle3", f"drafter.aux_layers={layers}", f"target={target_dir}",
                 f"run.dir={tmp_path}"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and why in err and "Traceback" not in err
    assert not any(tmp_path.glob("*/prepare"))  # refused before prepare ran
