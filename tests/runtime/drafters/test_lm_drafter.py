"""The lm drafter: a small LM distilled from the target (KD, or LoRA on an existing small LM), its tree drafting
and KV cache, the ours <-> HF weight conversion, and the whole distill -> export -> validate path."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from export.bundle_writer import write_bundle
from export.onnx_export import ONNX_FILE, check_onnx_parity, example_inputs, export_onnx
from pipeline.config import Config
from pipeline.errors import DraftsmithError
from pipeline.runstore import RunStore, StageResult
from pipeline.sources import target_fingerprint
from pipeline.stages.context import StageContext
from pipeline.stages.distill import build, run_distill
from pipeline.stages.export import run_export
from pipeline.stages.validate import REPORT_JSON, REPORT_MD, gate_reasons, run_validate
from runtime.bundle_reader import LOOKUP_CORPUS, SPECATTN, read_bundle
from runtime.drafters import (build_drafter, drafter_config, drafter_factory, drafter_module, drafter_tensors,
                              get_kind)
from runtime.drafters.lm import LMDrafter
from runtime.drafters.ngram import answer_spans
from runtime.speculation.draft_budget import DraftBudget, ServedBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.target.attention import SpecAttnConfig
from runtime.target.cpu_packing import Packable
from runtime.target.loading import from_pretrained
from runtime.target.loading import hf_causal_lm, hf_config, hf_state_dict
from runtime.target.model import Transformer
from support.helpers import perturbed, run_stage_on, self_distilled_rows
from train.batches import Batches
from train.losses import KD_DISTANCES
from train.recipes import lm as lm_recipe
from train.spec import TrainSpec
from train.shards import save_features
from train.trainer import train

VOCAB = 96  # tests/conftest.py TINY


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir):
    # a large init makes next-token distributions peaked, as a trained model's are (random ones are near-uniform)
    return tiny_model_dir("llama", tie_word_embeddings=True, initializer_range=0.3)


@pytest.fixture(scope="module")
def target(target_dir):
    return from_pretrained(target_dir, max_seq_len=256)


@pytest.fixture(scope="module")
def self_distilled(target):
    return self_distilled_rows(target, rows=16, prompt_vocab=VOCAB, new_tokens=34)


def _train(model, loss_fn, data, steps, ckpt, lr):
    history = []
    train(model, loss_fn, Batches(data, 8, seed=0), TrainSpec(steps=steps, lr=lr, warmup=2), ckpt,
          log=lambda step, m: history.append(m))
    return history


def test_kd_distances_on_a_hand_checked_case():
    p, q = torch.tensor([[0.5, 0.5]]), torch.tensor([[0.25, 0.75]])
    mask = torch.tensor([True])
    kl = KD_DISTANCES["forward_kl"](p.log(), q.log(), mask)
    tv = KD_DISTANCES["tv"](p.log(), q.log(), mask)
    assert kl.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-6)
    assert tv.item() == pytest.approx(0.25, abs=1e-6)


@pytest.mark.parametrize("kind", ["forward_kl", "tv"])
def test_kd_loss_compares_next_token_distributions_on_assistant_tokens(target, kind):
    """A full copy of the target has zero loss; a perturbed one has, on the one assistant position, exactly the
    distance between the two models' next-token distributions there, each computed by a plain cached forward."""
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(1, 10, dtype=torch.long)
    mask[0, 7] = 1  # only token 7 is the assistant's: row 6 predicts it
    batch = {"input_ids": ids, "loss_mask": mask}
    loss_fn = lm_recipe.lm_kd_loss(target, kind)
    copy = lm_recipe.build_lm(target, target.config.n_layers, "target")
    loss, metrics = loss_fn(copy, batch)
    assert loss.item() == pytest.approx(0.0, abs=1e-5) and metrics["top1"] == 1.0

    drafter = perturbed(lm_recipe.build_lm(target, target.config.n_layers, "target"), scale=0.2)
    loss, _ = loss_fn(drafter, batch)

    def next_token_logits(model):
        with torch.no_grad():
            return model(ids[:, :7], model.new_cache(1, 10), torch.arange(7)[None]).logits[:, -1]

    want = KD_DISTANCES[kind](next_token_logits(target), next_token_logits(drafter), torch.tensor([True]))
    assert want > 1e-3 and loss.item() == pytest.approx(want.item(), rel=1e-4)
    # offline mode: the target's features come from the batch (prepare's cache) instead of a target forward
    cached = target.forward_uncached(ids, no_logits=True).hidden
    assert loss_fn(drafter, {**batch, "features": cached})[0].item() == pytest.approx(loss.item(), rel=1e-5)
    assert loss_fn(copy, {**batch, "features": torch.zeros_like(cached)})[0].item() > 1e-3


@pytest.mark.parametrize("kind", ["forward_kl", "tv"])
def test_kd_loss_in_chunks_equals_it_whole(target, kind):
    """The loss runs a few positions at a time to bound its [rows, vocab] intermediates: its value, top-1 and
    gradient equal the whole batch's at once, with chunks that do not divide the masked positions evenly."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0, 4:], mask[1, 6:10] = 1, 1  # 8 + 4 assistant tokens: 12 masked rows
    batch = {"input_ids": ids, "loss_mask": mask}
    drafter = perturbed(lm_recipe.build_lm(target, 1, "target"), scale=0.2)

    def loss_and_grads(chunk_rows):
        drafter.zero_grad()
        loss, metrics = lm_recipe.lm_kd_loss(target, kind, chunk_rows=chunk_rows)(drafter, batch)
        loss.backward()
        return loss.item(), metrics["top1"], [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    whole, chunked = loss_and_grads(1000), loss_and_grads(5)
    assert whole[0] > 1e-3 and chunked[0] == pytest.approx(whole[0], rel=1e-5) and chunked[1] == whole[1]
    assert len(chunked[2]) == len(whole[2]) > 0
    for a, b in zip(chunked[2], whole[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind,init", [("forward_kl", "random"), ("tv", "target")])
def test_lm_learns_and_stays_lossless(target, self_distilled, tmp_path, kind, init):
    keep = torch.arange(0, VOCAB)
    model = lm_recipe.build_lm(target, 1, init)
    history = _train(model, lm_recipe.lm_kd_loss(target, kind, keep), self_distilled, 40, tmp_path / "ckpt", 3e-3)
    first, last = history[0], history[-1]
    assert last["loss"] < 0.8 * first["loss"]
    assert last["top1"] > first["top1"] + 0.1

    config = drafter_config("lm", model, keep.numel(), None)
    write_bundle(tmp_path / "bundle", config, drafter_tensors(model, keep), target_fingerprint="t", data_digest="d",
                 config={}, code_version="test")
    drafter = build_drafter(read_bundle(tmp_path / "bundle", "t"), target, 256)
    assert isinstance(drafter, LMDrafter) and not drafter.needs_features
    plain = Engine(target, None, EngineConfig(max_seq_len=256))
    spec = Engine(target, drafter, EngineConfig(max_seq_len=256, budget=DraftBudget(3, 2, 6), adaptive=False))
    taus = []
    for i in range(3):  # prompts it was trained on: a 40-step drafter of a random target does not generalise
        prompt = self_distilled.row(i)[0][:6].tolist()
        got = spec.generate(prompt, 30, SamplingParams())
        assert got.tokens == plain.generate(prompt, 30, SamplingParams()).tokens
        taus.append(got.metrics.tau)
    assert sum(taus) / len(taus) > 1.2


def test_kept_tree_kv_matches_a_fresh_drafter(target):
    """After commits that reuse the KV of expanded tree nodes (compacted in place), the drafter proposes what a
    drafter reset on the whole committed sequence proposes: a wrong slot, position or mask would show."""
    model = perturbed(lm_recipe.build_lm(target, 2, "target"), scale=0.1)
    drafter = LMDrafter(model, 128)
    tokens = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(5))
    drafter.reset(tokens, None)
    params, budget = SamplingParams(temperature=1.0), DraftBudget(depth=4, width=3, nodes=12)
    kept = 0
    for step in range(4):
        tree = drafter.propose(budget, params, torch.Generator().manual_seed(step))
        fresh = LMDrafter(model, 128)
        fresh.reset(tokens, None)
        twin = fresh.propose(budget, params, torch.Generator().manual_seed(step))
        assert tree.tokens.tolist() == twin.tokens.tolist()
        torch.testing.assert_close(tree.q, twin.q, rtol=1e-4, atol=1e-6)
        path = [0]  # commit the first child chain of the tree (deepest first-children), then one more token
        while tree.children()[path[-1] + 1]:
            path.append(tree.children()[path[-1] + 1][0])
        committed = torch.cat([tree.tokens[path], torch.tensor([step])])
        before = int(drafter.cache.lengths[0])
        drafter.commit(committed, None)
        kept += int(drafter.cache.lengths[0]) - before
        tokens = torch.cat([tokens, committed])
    assert kept > 0  # some committed tokens kept the KV their tree node had


def test_drafters_around_one_module_share_its_packed_head(target):
    """Calibrate builds a drafter per budget around one module: the packed head (a copy of the LM's output rows)
    is built once per draft vocabulary, not once per drafter."""
    lm = lm_recipe.build_lm(target, 1, "target").eval()
    keep = torch.arange(0, 96, 2)
    first, second = LMDrafter(lm, 64), LMDrafter(lm, 64)
    reduced, again = LMDrafter(lm, 64, keep), LMDrafter(lm, 64, keep.clone())
    assert first.head is second.head and reduced.head is again.head and first.head is not reduced.head
    assert reduced.head.vocab_size == 96 and torch.equal(reduced.head.keep_ids, keep)
    # the whole vocabulary is the LM's own head: its packed copy shared, not read back and packed again
    packed = lm.output.panels if lm.output.panels is not None else lm.output.packed
    assert packed is not None and any(packed is t for t in (first.head.panels, first.head.packed))
    h = torch.randn(3, lm.config.dim, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(first.head(h), h @ lm.output.weight_rows().t(), rtol=1e-5, atol=1e-5)


def test_lora_trains_only_adapters_and_merges(target, self_distilled, tiny_model_dir, tmp_path):
    base_dir = tiny_model_dir("llama", tie_word_embeddings=True, num_hidden_layers=1)
    model = lm_recipe.build_lm_lora(target, base_dir, rank=4)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # the plain weights alone: packed copies (two in fp32) would be gigabytes for a 0.5B, and stale once it learns
    assert not any(m.packed is not None or m.panels is not None for m in model.modules() if isinstance(m, Packable))
    history = _train(model, lm_recipe.lm_kd_loss(target, "forward_kl"), self_distilled, 12, tmp_path / "ckpt", 1e-2)
    assert history[-1]["loss"] < history[0]["loss"]
    merged, base = lm_recipe.merge_lora(model), from_pretrained(base_dir, max_seq_len=256)
    assert isinstance(merged, Transformer)
    merged_sd, base_sd = merged.state_dict(), base.state_dict()
    assert merged_sd.keys() == base_sd.keys()
    changed = {k for k in base_sd if not torch.equal(merged_sd[k], base_sd[k])}
    assert "layers.0.attention.wqkv.weight" in changed and "layers.0.feed_forward.w2.weight" in changed
    assert "tok_embeddings.weight" not in changed and "norm.weight" not in changed  # not adapted
    with pytest.raises(ValueError, match="vocab_size 80"):
        lm_recipe.build_lm_lora(target, tiny_model_dir("llama", vocab_size=80), rank=4)


def test_bad_lm_settings_are_refused(target, self_distilled):
    ctx = StageContext(Config.model_validate({"drafter": {"kind": "lm", "lm_layers": 3}}), None, None)
    with pytest.raises(DraftsmithError, match="lm_layers=3: expected 1..2"):  # the CLI prints it as one line
        build(ctx, target, None)
    with pytest.raises(ValueError, match="lm_init='copy'"):
        lm_recipe.build_lm(target, 1, "copy")
    with pytest.raises(ValueError, match="kd_loss='reverse_kl'"):
        lm_recipe.lm_kd_loss(target, "reverse_kl")


@pytest.mark.parametrize("arch,overrides", [("llama", {"tie_word_embeddings": True}),
                                            ("qwen2", {}), ("qwen3", {"attention_bias": True})])
def test_hf_conversion_round_trips(tiny_model_dir, tmp_path, arch, overrides):
    """ours -> HF names and config -> ours is the identity, and HF transformers computes the same logits."""
    model = from_pretrained(tiny_model_dir(arch, **overrides), max_seq_len=64)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(model.config)))
    save_file(hf_state_dict(model), str(tmp_path / "model.safetensors"))
    back = from_pretrained(tmp_path, max_seq_len=64)
    assert back.config == model.config
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())
    ids = torch.randint(0, VOCAB, (1, 9))
    ours = model(ids, model.new_cache(1, 9), torch.arange(9)[None]).logits
    with torch.no_grad():
        torch.testing.assert_close(hf_causal_lm(model)(ids).logits, ours, rtol=1e-4, atol=1e-4)


def test_lm_step_exports_to_onnx(target, tmp_path):
    model = perturbed(lm_recipe.build_lm(target, 1, "random"))
    path = tmp_path / ONNX_FILE
    record = export_onnx(model, "lm", example_inputs(model, "lm", 2, 5), path)
    assert record["inputs"] == {"input_ids": ["batch", "seq"]} and record["outputs"]["logits"] == ["batch", "seq", 96]
    for batch, seq in [(3, 7), (1, 1)]:
        assert check_onnx_parity(model, "lm", path, example_inputs(model, "lm", batch, seq, seed=batch))["passed"]


# ---------------------------------------------------------------- distill -> export -> validate


def _lm_config(onnx: bool = False, **gate) -> Config:
    return Config.model_validate({
        "drafter": {"kind": "lm", "lm_layers": 1, "draft_vocab": 64, "depth": 3, "width": 2, "nodes": 6},
        "distill": {"steps": 4, "batch_size": 4, "lr": 3e-3, "warmup": 1, "kd_loss": "tv"},
        "export": {"onnx": onnx},
        "validate": {"num_prompts": 2, "max_new_tokens": 10, "temperatures": [0.0],
                     "gate": {"min_tau": 1.0, "min_speedup": 0.0, **gate}}})


def _distilled(tmp_path, cfg: Config, target_dir, self_distilled) -> tuple[RunStore, dict]:
    """A run whose prepare wrote the self-distilled rows and whose distill trained `cfg`'s lm drafter on them."""
    store = RunStore(tmp_path / "runs", "r1")

    def prepare(ctx):
        self_distilled.save(ctx.out / "train.safetensors")
        self_distilled.save(ctx.out / "val.safetensors")
        return StageResult(outputs={"train": "train.safetensors", "val": "val.safetensors"})

    run_stage_on(store, "prepare", cfg, target_dir, prepare)
    return store, run_stage_on(store, "distill", cfg, target_dir, run_distill)


def test_lm_bundle_from_distill_exports_and_validates_with_hf_peers(tmp_path, target_dir, target, self_distilled):
    cfg = _lm_config(onnx=True)
    store, rec = _distilled(tmp_path, cfg, target_dir, self_distilled)
    assert rec["metrics"]["tau"] >= 1.0 and rec["message"].startswith("lm: tau")
    assert rec["metrics"]["tau_lookup"] >= 1.0 and "with the lookup branch" in rec["message"]
    config = json.loads((store.stage_dir("distill") / "drafter_config.json").read_text())
    assert config["kind"] == "lm" and config["model"]["n_layers"] == 1 and config["draft_vocab"] == 64

    def calibrate(ctx):  # only the draft budget, as calibrate writes it: with the lookup branch
        chosen = {"depth": 3, "width": 2, "nodes": 6, "adaptive": False, "lookup": 4}
        (ctx.out / "draft_budget.json").write_text(json.dumps({"chosen": chosen, "sweep": []}))
        return StageResult(outputs={"draft_budget": "draft_budget.json"})

    run_stage_on(store, "calibrate", cfg, target_dir, calibrate)
    run_stage_on(store, "export", cfg, target_dir, run_export)
    bundle = read_bundle(store.stage_dir("export") / "bundle", target_fingerprint(target_dir))
    assert bundle.has(ONNX_FILE) and bundle.manifest["onnx"]["kind"] == "lm"
    assert bundle.manifest["onnx"]["parity"]["passed"]
    drafter = build_drafter(bundle, target, 256)
    assert isinstance(drafter, LMDrafter) and drafter.head.keep_ids.numel() == 64
    # the lookup branch's corpus: the training rows' answers, each after its last 4 tokens of context
    spans = answer_spans(self_distilled.input_ids, self_distilled.loss_mask, self_distilled.offsets)
    assert torch.equal(load_file(str(bundle.path(LOOKUP_CORPUS)))["tokens"].long(), torch.cat(spans))
    corpus = bundle.engine_fields(bundle.served_budget(ServedBudget()))["lookup_corpus"]
    assert corpus.max_depth == 4  # the calibrated branch's depth

    rec = run_stage_on(store, "validate", cfg, target_dir, run_validate)
    report = json.loads((store.stage_dir("validate") / REPORT_JSON).read_text())
    assert rec["status"] == "completed" and report["metrics"]["lossless"] is True
    row = report["temperatures"][0]
    assert row["tokens_per_s_hf_assisted"] > 0 and row["new_tokens"]["hf_assisted"] > 0
    assert row["speedup_hf_assisted"] == pytest.approx(row["tokens_per_s"] / row["tokens_per_s_hf_assisted"])
    assert report["metrics"]["speedup_hf_assisted"] == row["speedup_hf_assisted"]
    assert report["budget"]["lookup"] == 4  # HF prompt lookup of as many tokens is the lookup branch's peer
    assert report["budget"]["lookup_corpus"] and report["configured_tree"]["budget"]["lookup_corpus"]
    assert row["tokens_per_s_hf_lookup"] > 0 and row["new_tokens"]["hf_lookup"] > 0
    assert report["metrics"]["speedup_hf_lookup"] == pytest.approx(row["tokens_per_s"] / row["tokens_per_s_hf_lookup"])
    md = (store.stage_dir("validate") / REPORT_MD).read_text()
    assert "HF assisted" in md and "HF prompt lookup" in md and "HF prompt lookup" in rec["message"]


def test_an_lm_base_distilled_for_no_steps_ships_as_it_is(tmp_path, target_dir, target, self_distilled,
                                                         tiny_model_dir):
    """distill.steps 0: a same-tokenizer sibling drafts as it is, through the stages like a trained drafter."""
    base_dir = tiny_model_dir("llama", tie_word_embeddings=True, num_hidden_layers=1)
    cfg = _lm_config().model_copy(update={
        "drafter": _lm_config().drafter.model_copy(update={"lm_base": str(base_dir), "draft_vocab": 0}),
        "distill": _lm_config().distill.model_copy(update={"steps": 0})})
    store, rec = _distilled(tmp_path, cfg, target_dir, self_distilled)
    assert rec["metrics"]["steps"] == 0 and rec["message"].endswith("untrained (distill.steps 0)")
    tensors = load_file(str(store.stage_dir("distill") / "drafter.safetensors"))
    config = json.loads((store.stage_dir("distill") / "drafter_config.json").read_text())
    shipped = drafter_module(config, target, tensors).state_dict()
    base = from_pretrained(base_dir, max_seq_len=256).state_dict()
    assert shipped.keys() == base.keys() and all(torch.equal(shipped[k], base[k]) for k in base)


def test_distill_lets_the_trained_module_go_before_it_builds_the_served_drafter(tmp_path, target_dir,
                                                                               self_distilled, monkeypatch):
    """distill's tau runs the drafter as a bundle serves it, packed lean: the trained module beside it would hold
    its plain weights a second time (2 GB for the 0.5B sibling in fp32)."""
    import gc
    import weakref

    import runtime.drafters as drafters

    trained, alive = [], []
    tensors_of, serve = drafters.drafter_tensors, drafters.served_drafter
    monkeypatch.setattr(drafters, "drafter_tensors", lambda m, keep: trained.append(weakref.ref(m)) or
                        tensors_of(m, keep))

    def served(*args, **kwargs):
        gc.collect()
        alive.append(trained[0]() is not None)
        return serve(*args, **kwargs)

    monkeypatch.setattr(drafters, "served_drafter", served)
    _distilled(tmp_path, _lm_config(), target_dir, self_distilled)
    assert alive == [False]


def test_distill_on_cached_features_reads_the_targets_blocks_only_for_its_tau(tmp_path, target_dir, target,
                                                                             self_distilled, tiny_model_dir,
                                                                             monkeypatch):
    """With prepare's features cached, training reads nothing of the target but its head: distill leaves its blocks
    unread (a teacher that cannot run them), loads it whole for the tau after training, and trains the very drafter
    it trains with the blocks loaded."""
    import pipeline.stages.distill as distill

    base = str(tiny_model_dir("llama", tie_word_embeddings=True, num_hidden_layers=1))
    cfg = _lm_config().model_copy(update={
        "drafter": _lm_config().drafter.model_copy(update={"lm_base": base, "draft_vocab": 0})})
    with torch.no_grad():
        features = torch.cat([target(ids[None], target.new_cache(1, len(ids)), torch.arange(len(ids))[None],
                                     no_logits=True).hidden[0] for ids in (self_distilled.row(i)[0]
                                                                          for i in range(len(self_distilled)))])
    loads, load = [], StageContext.load_target

    def recorded(self, *args, **kwargs):
        loaded = load(self, *args, **kwargs)
        loads.append(any(not p.is_meta for p in loaded.layers.parameters()))
        return loaded

    monkeypatch.setattr(StageContext, "load_target", recorded)

    def distilled(name: str) -> dict:
        store = RunStore(tmp_path / name, "r1")

        def prepare(ctx):
            for split in ("train", "val"):
                self_distilled.save(ctx.out / f"{split}.safetensors")
                save_features(features, ctx.out, split)
            return StageResult(outputs={"train": "train.safetensors", "val": "val.safetensors"})

        run_stage_on(store, "prepare", cfg, target_dir, prepare)
        rec = run_stage_on(store, "distill", cfg, target_dir, run_distill)
        assert rec["status"] == "completed" and rec["metrics"]["offline_features"] == 1 and rec["metrics"]["tau"] > 1
        return load_file(str(store.stage_dir("distill") / "drafter.safetensors"))

    lean = distilled("lean")
    assert loads == [False, True]  # training's teacher without its blocks, then the target whole for the tau
    whole = distill.distill_target
    monkeypatch.setattr(distill, "distill_target", lambda ctx, teacher=False: whole(ctx))
    loads.clear()
    trained_whole = distilled("whole")
    assert loads == [True, True]
    assert lean.keys() == trained_whole.keys() and all(torch.equal(lean[k], trained_whole[k]) for k in lean)
    head_only = from_pretrained(target_dir, max_seq_len=64, lean=True, blocks=())
    with pytest.raises(RuntimeError, match="meta"):  # the unread blocks cannot run: no weights are there
        head_only(torch.tensor([[1, 2]]), head_only.new_cache(1, 2), torch.tensor([[0, 1]]))


def test_distill_holds_the_target_in_fp32_only_where_the_drafter_starts_from_its_weights(tmp_path, target_dir,
                                                                                        tiny_model_dir, monkeypatch):
    """A base LM only learns from the target, which distill then holds in the precision training runs in (half the
    bytes in bf16); a drafter built from the target's own layers trains in the target's dtype, so fp32. `auto`
    follows the training rule: a CPU with AVX512_BF16 but no AMX trains in bf16 though it infers in fp32."""
    import runtime.target.precision as precision
    from pipeline.stages.distill import distill_target

    monkeypatch.setattr(precision, "bf16_is_fast", lambda device, training=False: training)  # that CPU's flags
    base = str(tiny_model_dir("llama", tie_word_embeddings=True, num_hidden_layers=1))
    for lm_base, chosen, dtype in ((None, "bf16", torch.float32), (base, "bf16", torch.bfloat16),
                                   (base, "auto", torch.bfloat16), (base, "fp32", torch.float32)):
        cfg = _lm_config().model_copy(update={
            "drafter": _lm_config().drafter.model_copy(update={"lm_base": lm_base}),
            "distill": _lm_config().distill.model_copy(update={"precision": chosen})})
        ctx = StageContext(cfg, RunStore(tmp_path / "runs", "r1"), tmp_path)
        ctx.__dict__["target_dir"] = target_dir  # cached_property: no hub lookup for the tiny target
        assert distill_target(ctx).dtype == dtype
    model = lm_recipe.build_lm_lora(distill_target(ctx), base, rank=4)  # the base trains in fp32 all the same
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_bundle_with_sparse_verification_is_served_sparse_and_reported_lossy_by_design(tmp_path, target_dir,
                                                                                         self_distilled):
    """Calibrate chose SpecAttn top-p 0.5: validate runs the speculative engine sparse and the AR baseline dense,
    reports the KV reads skipped, and where the gate asks for losslessness says why it may fail."""
    cfg = _lm_config(require_lossless=False)
    store, _ = _distilled(tmp_path, cfg, target_dir, self_distilled)
    sparse = SpecAttnConfig((-1, 0), top_p=0.5, dense_first=1, sink=1, recent=2)

    def calibrate(ctx):
        (ctx.out / SPECATTN).write_text(sparse.to_json())
        return StageResult(outputs={"specattn": SPECATTN})

    run_stage_on(store, "calibrate", cfg, target_dir, calibrate)
    run_stage_on(store, "export", cfg, target_dir, run_export)
    bundle = read_bundle(store.stage_dir("export") / "bundle", target_fingerprint(target_dir))
    assert bundle.engine_fields(ServedBudget())["sparse"] == sparse
    rec = run_stage_on(store, "validate", cfg, target_dir, run_validate)
    report = json.loads((store.stage_dir("validate") / REPORT_JSON).read_text())
    assert report["sparse"]["top_p"] == 0.5 and 0 < report["metrics"]["kv_saved"] < 1
    assert rec["status"] == "completed" and "SpecAttn top-p 0.5 skipped" in rec["message"]
    assert "SpecAttn sparse verification (top-p 0.5" in (store.stage_dir("validate") / REPORT_MD).read_text()
    lossy = {**report["metrics"], "lossless": False, "lossy_prompts": 1}
    assert "lossy by design" in gate_reasons(lossy, _lm_config().validate.gate, sparse=True)[0]
    assert "lossy by design" not in gate_reasons(lossy, _lm_config().validate.gate)[0]


def test_a_drafter_module_holds_the_tensors_it_is_given_its_tied_head_still_tied(target, tiny_model_dir):
    """No second copy of a drafter's weights beside the loaded ones (a 0.5B sibling's are 2 GB) nor beside the packed
    ones, and a tied head, stored once, is the embedding again."""
    base = from_pretrained(tiny_model_dir("llama", tie_word_embeddings=True, num_hidden_layers=1), max_seq_len=64)
    tensors = drafter_tensors(base, None)
    assert "output.weight" not in tensors
    config = drafter_config("lm", base, 0, None)
    # nor a random init first: the module is built empty, every parameter assigned (the rope tables are computed)
    empty = get_kind("lm").module(config, target, 64, None)
    assert all(p.is_meta for p in empty.parameters()) and not empty.rope_cos.is_meta
    module = drafter_module(config, target, tensors)
    held = {t.data_ptr() for t in tensors.values()}
    assert all(p.data_ptr() in held for p in module.parameters())
    assert module.output.weight is module.tok_embeddings.weight
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.allclose(module.forward_uncached(ids).logits, base.forward_uncached(ids).logits, atol=1e-5)
    LMDrafter(module, 64)  # drafting packs it, one copy of each weight: the packed one but the tied head's
    assert all(m.weight.is_meta for m in module.layers.modules() if isinstance(m, Packable))


def test_a_bundles_drafters_share_one_module_and_keep_their_own_state(target, self_distilled, tmp_path):
    """Serving makes a drafter per batch row and per budget: they share the bundle's module, loaded once, and
    interleaved they draft what a drafter alone drafts."""
    model = perturbed(lm_recipe.build_lm(target, 1, "target"), scale=0.05)
    write_bundle(tmp_path / "bundle", drafter_config("lm", model, 0, None), drafter_tensors(model, None),
                 target_fingerprint="t", data_digest="d", config={}, code_version="test")
    bundle = read_bundle(tmp_path / "bundle", "t")
    new = drafter_factory(bundle, target, 256)
    first, second = new(), new()
    assert first.model is second.model and first.cache is not second.cache
    cfg = EngineConfig(max_seq_len=256, budget=DraftBudget(3, 2, 6), adaptive=False)
    prompts = [self_distilled.row(i)[0][:6].tolist() for i in range(2)]
    alone = [Engine(target, build_drafter(bundle, target, 256), cfg).generate(p, 20, SamplingParams()) for p in prompts]
    engines = [Engine(target, first, cfg), Engine(target, second, cfg)]
    for _ in range(2):  # each engine's prompt in turn, the other's state left in the shared module's drafters
        for engine, prompt, want in zip(engines, prompts, alone):
            got = engine.generate(prompt, 20, SamplingParams())
            assert got.tokens == want.tokens and got.metrics.target_forwards == want.metrics.target_forwards
