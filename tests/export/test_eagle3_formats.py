"""An eagle3 drafter in the layouts serving engines load: loaded by the real `speculators` package (vLLM's format
library) and compared with our runtime on the same inputs, and SGLang's LlamaForCausalLMEagle3 names and shapes as
its loader maps them; the aux layer ids in each engine's own convention."""
import json

import pytest
import torch
from safetensors.torch import load_file

from export.engine_formats import write_engine_export
from runtime.drafters.eagle3 import KIND, Eagle3Config, Eagle3Model, aux_layers
from runtime.target.loading import from_pretrained
from runtime.target.model import Taps, Transformer
from support.helpers import perturbed

VOCAB, DRAFT_VOCAB, LAYERS = 96, 32, 8


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir):
    return tiny_model_dir("llama", num_hidden_layers=LAYERS, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def target(target_dir):
    return from_pretrained(target_dir, max_seq_len=64)


def trained_like(target: Transformer, keep: torch.Tensor | None, seed: int = 0) -> Eagle3Model:
    """An eagle3 drafter with every weight moved off its initial value, as training leaves it."""
    return perturbed(Eagle3Model.from_target(target, keep, aux_layers(None, LAYERS)), seed=seed)


def exported(model, fmt: str, out, verifier: dict) -> dict:
    return write_engine_export(KIND.engine_exports(model, verifier, speculative_tokens=3)[fmt], out)


@pytest.mark.parametrize("reduced", [True, False])
def test_the_speculators_library_loads_our_export_and_drafts_what_our_runtime_drafts(target, target_dir, tmp_path,
                                                                                       reduced):
    from speculators.models.eagle3 import Eagle3DraftModel

    keep = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB] if reduced else None
    model = trained_like(target, keep)
    exported(model, "speculators-eagle3", tmp_path / "spec",
             {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]})
    theirs = Eagle3DraftModel.from_pretrained(tmp_path / "spec").eval()  # the library's own loader
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]  # vLLM's count: the streams entering them
    assert theirs.config.norm_before_residual is False

    g = torch.Generator().manual_seed(1)
    T = 12
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    features = torch.randn(1, T, 3 * target.config.dim, generator=g)
    logits = []
    hook = theirs.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach()))
    with torch.no_grad():
        tokens = theirs(hidden_states=features, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=1)
        ours = model.head(model.causal(ids, features, model.new_cache(1, T)))
    hook.remove()
    torch.testing.assert_close(logits[0], ours, rtol=1e-4, atol=1e-4)
    draft = tokens[0] if isinstance(tokens, list) else tokens[0][0]
    assert torch.equal(draft, ours.argmax(-1))  # draft-vocabulary ids
    if reduced:  # the library maps draft ids to target ids through d2t, as we do through keep_ids
        assert torch.equal(draft + theirs.d2t[draft], model.head.keep_ids[ours.argmax(-1)])


def test_speculators_config_spells_out_what_vllm_reads(target, target_dir, tmp_path):
    model = trained_like(target, torch.arange(DRAFT_VOCAB))
    record = exported(model, "speculators-eagle3", tmp_path / "spec",
                      {"name_or_path": "HuggingFaceTB/SmolLM2-135M", "architectures": ["LlamaForCausalLM"]})
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert "model_type" not in config  # vLLM detects the speculators format by its absence
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["norm_before_residual"] is False  # vLLM assumes true where the key is absent
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M"
    assert record["files"] == ["config.json", "model.safetensors"]
    tensors = load_file(str(tmp_path / "spec" / "model.safetensors"))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(tensors["d2t"] + torch.arange(DRAFT_VOCAB), model.head.keep_ids)
    assert int(tensors["t2d"].sum()) == DRAFT_VOCAB and tensors["t2d"].shape == (VOCAB,)


def sglang_names(hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, draft_vocab: int,
                 vocab: int) -> dict[str, tuple[int, ...]]:
    """The tensors SGLang's LlamaForCausalLMEagle3 maps, with their shapes: python/sglang/srt/models/llama_eagle3.py
    (sglang 0.5.23), LlamaDecoderLayer (q/k/v read 2H for layer 0, no q/k/v bias), LlamaModel (fc: 3H -> H without a
    bias unless config `bias`, norm) and load_weights (the q/k/v and gate/up stacking, `midlayer.` read as
    `layers.0.`, d2t turned into hot_token_id, t2d skipped); the draft's embed_tokens is replaced by the target's."""
    layer = {"self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
             "self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
             "self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
             "self_attn.o_proj.weight": (hidden, heads * head_dim),
             "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
             "mlp.down_proj.weight": (hidden, ffn), "input_layernorm.weight": (hidden,),
             "hidden_norm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
    return {"fc.weight": (hidden, 3 * hidden), "norm.weight": (hidden,), "lm_head.weight": (draft_vocab, hidden),
            "d2t": (draft_vocab,), "t2d": (vocab,), **{f"midlayer.{k}": v for k, v in layer.items()}}


def test_the_kind_lists_every_layout_it_answers_for(target):
    # export loads the target only for a kind with engine_formats: a layout missing from them would go unwritten
    verifier = {"name_or_path": "t", "architectures": []}
    assert set(KIND.engine_exports(trained_like(target, None), verifier)) == set(KIND.engine_formats)


def test_sglang_layout_has_every_name_and_shape_its_loader_maps(target, tmp_path):
    model = trained_like(target, torch.arange(DRAFT_VOCAB))
    record = exported(model, "sglang-eagle3", tmp_path / "sglang", {"name_or_path": "t", "architectures": []})
    c = target.config
    tensors = load_file(str(tmp_path / "sglang" / "model.safetensors"))
    want = sglang_names(c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size, DRAFT_VOCAB, VOCAB)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == DRAFT_VOCAB
    # SGLang counts a layer's output and captures id + 1: the streams entering 2, L/2 and L-3
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert record["launch_flags"] == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "sglang"]


def test_an_export_with_a_tensor_the_loader_does_not_map_is_refused(target, tmp_path):
    from dataclasses import replace

    model = trained_like(target, torch.arange(DRAFT_VOCAB))
    export = KIND.engine_exports(model, {"name_or_path": "t", "architectures": []})["sglang-eagle3"]
    extra = replace(export, tensors={**export.tensors, "midlayer.self_attn.q_norm.weight": torch.ones(4)})
    with pytest.raises(ValueError, match="unexpected \\['midlayer.self_attn.q_norm.weight'\\]"):
        write_engine_export(extra, tmp_path / "a")
    missing = replace(export, tensors={k: v for k, v in export.tensors.items() if k != "d2t"})
    with pytest.raises(ValueError, match="missing \\['d2t'\\]"):
        write_engine_export(missing, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_entering_streams_are_hf_hidden_states_at_the_same_index(target, target_dir):
    """Our layer id k is the residual stream entering layer k: HF's hidden_states[k] (hidden_states[0] is the
    embedding), the index vLLM and speculators use."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ids = torch.arange(3, 15)[None]
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states
        out = target(ids, target.new_cache(1, 12), torch.arange(12)[None], taps=Taps.entering((2, 4, 5)))
    torch.testing.assert_close(out.features((2, 4, 5)), torch.cat([states[2], states[4], states[5]], -1),
                               rtol=1e-4, atol=1e-4)


def test_layer_ids_that_do_not_fit_the_target_are_refused_in_one_line(target):
    assert aux_layers(None, 30) == (2, 15, 27)
    for requested, match in [([2, 4, 9], "outside the target's layers 1..8"), ([4, 2, 5], "distinct ascending"),
                             ([2, 2, 5], "distinct ascending"), ([2, 5], "3 distinct")]:
        with pytest.raises(ValueError, match=match):
            aux_layers(requested, LAYERS)
    with pytest.raises(ValueError, match="too shallow"):
        aux_layers(None, 4)
    config = KIND.config(trained_like(target, None), 0, None)
    with pytest.raises(ValueError, match="chosen for a target of 8 layers, this one has 30"):
        Eagle3Config.from_dict(config, 30)
