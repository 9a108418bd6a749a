"""The retraining loop against a real `mlflow server` on 127.0.0.1: a champion serves chat requests through the
OpenAI API with capture into a real SQLite database; a second run prepares on that traffic, warm-starts distill from
the champion's drafter (fetched through the registry, every hash checked), validates beside the champion on the newest
traffic and on the base prompts, and promote applies the loop's rule. Calibrate is stubbed (its own tests cover it)."""
from __future__ import annotations

import json

import pytest
import torch
from support.mlflow_server import mlflow_server
from support.retraining import MODEL, TINY_EAGLE, base_chats, dotted, run_pipeline, serve_and_capture

from pipeline.config import load_config
from pipeline.errors import DraftsmithError
from pipeline.registry import CHAMPION, Decision, alias_ref, aliased, decide_on_traffic, fetch_bundle, registry_client
from pipeline.stages import STAGES
from pipeline.stages.context import StageContext
from pipeline.stages.warm_start import carried_head_rows, load_warm_start
from runtime.bundle_reader import read_bundle


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


@pytest.fixture(scope="module")
def loop(tmp_path_factory, server_url, tiny_chat_target):
    """A champion (a cold run on base chats), the traffic it served (captured), and the loop's run on it."""
    tmp = tmp_path_factory.mktemp("loop")
    base = [f"target={tiny_chat_target}", f"run.dir={tmp / 'runs'}", f"data.source={base_chats(tmp / 'chats.jsonl')}",
            f"register.tracking_uri={server_url}", *dotted(TINY_EAGLE), "drafter.lookup=4"]  # with a corpus
    cold = load_config(None, base)
    assert run_pipeline(cold, "champion").record("promote")["metrics"]["promoted"]
    first = aliased(**alias_ref(cold, CHAMPION))
    traffic = f"sqlite:///{tmp / 'traffic.db'}"
    serve_and_capture(cold, traffic)
    warm = load_config(None, [*base, f"data.traffic={traffic}", "data.traffic_share=0.5", "data.traffic_holdout=0.25",
                              "distill.warm_start=champion"])
    return first, warm, run_pipeline(warm, "loop")


def test_the_loop_retrains_on_traffic_from_the_champion_and_promotes_by_its_rule(loop):
    first, warm, store = loop
    prepared = store.record("prepare")["metrics"]
    assert prepared["traffic_read"] == 12 and prepared["traffic_sampled"] == 2 and prepared["traffic_val_rows"] == 3
    distilled = store.record("distill")
    assert distilled["outputs"]["warm_start"] == f"models:/{MODEL}/1" and distilled["metrics"]["steps"] == 4
    report = json.loads((store.stage_dir("validate") / "report.json").read_text())
    m = report["metrics"]
    assert report["versus_champion"]["traffic_prompts"] == 3 and m["compared_with_version"] == 1
    assert all(1.0 <= m[k] <= 3.0 for k in ("traffic_tau", "base_tau", "champion_traffic_tau", "champion_base_tau"))
    assert "Beside the champion" in (store.stage_dir("validate") / "report.md").read_text()

    client = registry_client(warm)
    validate_run = client.search_runs([client.get_experiment_by_name("draftsmith").experiment_id],
                                      "tags.`draftsmith.run_id` = 'loop' and tags.`draftsmith.stage` = 'validate'")[0]
    assert validate_run.data.metrics["traffic_tau"] == m["traffic_tau"]  # logged to MLflow
    assert validate_run.data.metrics["champion_base_tau"] == m["champion_base_tau"]

    promoted = store.record("promote")
    wins = m["traffic_tau"] > m["champion_traffic_tau"] and m["base_tau"] >= m["champion_base_tau"] - 0.05
    assert promoted["metrics"]["promoted"] == wins, promoted["message"]
    assert client.get_model_version_by_alias(MODEL, CHAMPION).version == ("2" if wins else "1")
    assert ("traffic tau" in promoted["message"]) and promoted["metrics"]["traffic_tau"] == m["traffic_tau"]

    # idempotent: a rerun of the run reruns nothing, though the champion may have moved to its own candidate
    finished = {s.name: store.record(s.name)["finished"] for s in STAGES}
    again = run_pipeline(warm, "loop")
    assert [s.name for s in STAGES if again.record(s.name)["finished"] != finished[s.name]] == []
    assert client.get_model_version_by_alias(MODEL, CHAMPION).version == ("2" if wins else "1")


def test_warm_start_loads_the_registered_drafter_every_hash_checked(loop):
    from pipeline.sources import target_fingerprint
    from pipeline.stages.distill import build, distill_target
    from runtime.drafters import bundle_weights

    first, warm, store = loop  # first: version 1, the champion the loop started from
    ctx = StageContext(warm, store, store.dir / "unused")
    target = distill_target(ctx)  # as distill loads it: lean, the blocks the drafter starts from plain
    _, model, _ = build(ctx, target, None)
    load_warm_start(ctx, first, model, target)
    bundle = read_bundle(fetch_bundle(first), target_fingerprint(ctx.target_dir))
    _, tensors = bundle_weights(bundle, torch.float32)
    state = model.state_dict()
    assert tensors and all(torch.equal(state[k], v) for k, v in tensors.items())

    wrong = warm.model_copy(update={"drafter": warm.drafter.model_copy(update={"kind": "medusa"})})
    with pytest.raises(DraftsmithError, match="is a eagle drafter, drafter.kind is medusa"):
        load_warm_start(StageContext(wrong, store, store.dir / "unused"), first, model, target)
    tampered = fetch_bundle(first) / "drafter_config.json"
    original = tampered.read_text()
    tampered.write_text(original + " ")
    try:
        with pytest.raises(DraftsmithError, match="drafter_config.json has sha256"):
            load_warm_start(ctx, first, model, target)
    finally:
        tampered.write_text(original)


def test_distill_continues_from_the_champions_weights(loop):
    """One step at a vanishing rate: what distill writes is the champion's drafter (a cold start would be its
    initialisation, which the champion's training moved away from)."""
    import shutil

    from safetensors.torch import load_file

    from pipeline.runstore import RunStore
    from pipeline.sources import resolve_target, target_fingerprint
    from pipeline.stages import inputs_digest
    from runtime.drafters import bundle_weights

    _, warm, store = loop
    cfg = warm.model_copy(update={"distill": warm.distill.model_copy(update={"warm_steps": 1, "lr": 1e-9})})
    check = RunStore(cfg.run.dir, "warm-check")
    shutil.copytree(store.stage_dir("prepare"), check.stage_dir("prepare"))
    distill = next(s for s in STAGES if s.name == "distill")
    digest = inputs_digest(distill, cfg, check)
    check.run_stage("distill", digest, lambda out: distill.run(StageContext(cfg, check, out, digest)))
    source = aliased(**alias_ref(cfg, CHAMPION))  # what distill started from: nothing has moved the alias since
    assert check.record("distill")["outputs"]["warm_start"] == f"models:/{MODEL}/{source.version}"
    _, champion = bundle_weights(read_bundle(fetch_bundle(source), target_fingerprint(resolve_target(cfg.target))),
                                  torch.float32)
    trained = load_file(check.stage_dir("distill") / "drafter.safetensors")
    same_shape = [k for k, v in champion.items() if k in trained and trained[k].shape == v.shape]
    assert len(same_shape) >= 4, sorted(trained)
    assert all(torch.allclose(trained[k].float(), champion[k], atol=1e-5) for k in same_shape)


def test_a_warm_start_keeps_the_champions_tokens_in_the_slots_its_data_leaves(loop):
    """A retraining set holds fewer distinct tokens than the draft vocabulary has slots: they go to the champion's
    tokens (here all ids: its vocabulary was full), lowest first, not left empty."""
    import shutil

    from safetensors.torch import load_file

    from pipeline.runstore import RunStore
    from pipeline.stages import inputs_digest
    from runtime.drafters import DRAFT_VOCAB
    from train.data import TokenizedSet

    _, warm, store = loop
    seen = torch.unique(TokenizedSet.load(store.stage_dir("prepare") / "train.safetensors").input_ids.long())
    size = seen.numel() + 5
    assert size < 96, "the tiny target's 96 ids must leave slots"
    cfg = warm.model_copy(update={"distill": warm.distill.model_copy(update={"warm_steps": 1}),
                                  "drafter": warm.drafter.model_copy(update={"draft_vocab": size})})
    check = RunStore(cfg.run.dir, "warm-vocab")
    shutil.copytree(store.stage_dir("prepare"), check.stage_dir("prepare"))
    distill = next(s for s in STAGES if s.name == "distill")
    digest = inputs_digest(distill, cfg, check)
    check.run_stage("distill", digest, lambda out: distill.run(StageContext(cfg, check, out, digest)))
    vocab = load_file(check.stage_dir("distill") / "drafter.safetensors")[DRAFT_VOCAB].long()
    unseen = torch.tensor([i for i in range(96) if i not in set(seen.tolist())])
    assert vocab.tolist() == sorted(seen.tolist() + unseen[:5].tolist())


def test_a_warm_start_keeps_the_champions_lookup_corpus_after_the_new_answers(loop):
    from runtime.drafters.ngram import answer_spans, corpus_spans
    from train.data import TokenizedSet

    first, _, store = loop
    champions = read_bundle(fetch_bundle(first))
    old = [s.tolist() for s in corpus_spans(champions.path("lookup_corpus.safetensors"))[0]]
    ts = TokenizedSet.load(store.stage_dir("prepare") / "train.safetensors")
    new = [s.tolist() for s in answer_spans(ts.input_ids, ts.loss_mask, ts.offsets)]
    kept = [s.tolist() for s in corpus_spans(store.stage_dir("distill") / "lookup_corpus.safetensors")[0]]
    assert old and new and any(s not in new for s in old)  # the champion's corpus holds answers the new set lacks
    assert kept == [list(s) for s in dict.fromkeys(map(tuple, new + old))]  # the new first, then the old; each once


def test_carried_head_rows_keep_the_rows_both_vocabularies_hold():
    from torch import nn

    from runtime.drafters.shared.draft_head import DraftHead

    lm_head = torch.arange(10.0)[:, None].expand(10, 3).clone()  # row t holds t
    model = nn.Module()
    model.head = DraftHead(lm_head, torch.tensor([2, 5, 7]), norm=nn.Identity())
    saved = {"head.weight": torch.tensor([[-1.0] * 3, [-5.0] * 3])}  # trained rows of the old vocabulary [1, 5]
    rows = carried_head_rows(model, saved, torch.tensor([5, 1]), 10)["head.weight"]
    assert rows[:, 0].tolist() == [2.0, -5.0, 7.0]  # token 5 keeps its trained row; 2 and 7 start from the target's


def test_the_loops_promotion_rule():
    def tags(traffic, base, champ_traffic=2.0, champ_base=2.0, version=1, lossless=True):
        t = {"metric.traffic_tau": traffic, "metric.base_tau": base, "metric.champion_traffic_tau": champ_traffic,
             "metric.champion_base_tau": champ_base, "metric.compared_with_version": version,
             "metric.lossless": lossless}
        return {k: json.dumps(v) for k, v in t.items() if v is not None}

    assert decide_on_traffic(tags(2.5, 1.96), "1", 0.05).promote  # wins on traffic, within the margin on base
    assert not decide_on_traffic(tags(2.5, 1.9), "1", 0.05).promote  # loses too much on base
    assert "does not beat" in decide_on_traffic(tags(2.0, 2.5), "1", 0.05).reason  # a tie on traffic keeps it
    assert "version 3 is the champion now" in decide_on_traffic(tags(2.5, 2.5), "3", 0.05).reason
    assert not decide_on_traffic(tags(2.5, 2.5, lossless=False), "1", 0.05).promote
    assert decide_on_traffic(tags(2.5, 2.5, version=None), None, 0.05) == Decision(True, "there is no champion yet")
    assert not decide_on_traffic(tags(2.5, 2.5, version=None), "1", 0.05).promote  # measured with none: stale
