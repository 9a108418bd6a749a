"""The quantspec drafter: the target's int8 copy drafting for it (no training), lossless under verification by the
full-precision target, and its bundle, which holds the scheme and no weights."""
import json

import pytest
import torch

from export.bundle_writer import write_bundle
from pipeline.sources import target_fingerprint
from runtime.bundle_reader import BundleError, read_bundle
from runtime.drafters import build_drafter, get_kind
from runtime.drafters.quantspec import QuantSpecDrafter, shared_copy
from runtime.speculation.draft_budget import ServedBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.cpu_packing import Packable
from runtime.target.loading import from_pretrained
from runtime.target.quantized_copy import Int8Linear, int8_copy

VOCAB, MAX_LEN = 96, 256
KIND = get_kind("quantspec")


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir):
    # qwen2-shaped (q/k/v biases, 2 kv heads, tied head); a large init gives peaked distributions as a trained model's
    return tiny_model_dir("qwen2", tie_word_embeddings=True, initializer_range=0.3)


@pytest.fixture(scope="module")
def target(target_dir):
    return from_pretrained(target_dir, max_seq_len=MAX_LEN)


def prompts(n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (8,), generator=g).tolist() for _ in range(n)]


def test_the_copy_quantises_every_linear_layer_and_shares_the_rest(target, target_dir, monkeypatch):
    monkeypatch.setattr("runtime.target.quantized_copy.ROWS_AT_ONCE", 7)  # every layer quantised in several slices
    copied = int8_copy(target)
    linears = [m for m in target.modules() if isinstance(m, Packable)]
    int8 = [m for m in copied.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == len(linears) == 4 * target.config.n_layers + 1  # qkv, o, gate-up, down; the head
    assert copied.tok_embeddings is target.tok_embeddings and copied.layers[0].attention_norm is target.layers[0].attention_norm
    for plain, q in zip(linears, int8):
        codes, scales = q.codes_and_scales()
        assert ((codes.float() * scales[:, None] - plain.weight).abs() <= scales[:, None] / 2 + 1e-6).all()
        assert q.has_bias == (plain.bias is not None)
    # a lean target keeps only our kernel's panels: the copy read from them is the same
    lean = from_pretrained(target_dir, max_seq_len=MAX_LEN, lean=True)
    assert lean.layers[0].feed_forward.w2.weight.is_meta
    for a, b in zip(int8, (m for m in int8_copy(lean).modules() if isinstance(m, Int8Linear))):
        assert all(torch.equal(x, y) for x, y in zip(a.codes_and_scales(), b.codes_and_scales()))


def test_the_copy_s_logits_are_near_the_target_s(target):
    tokens = torch.tensor([prompts(1)[0]])
    full = target.forward_uncached(tokens).logits
    draft = shared_copy(target).forward_uncached(tokens).logits
    assert (draft - full).abs().max() < 0.1 * full.abs().max()
    assert (draft.argmax(-1) == full.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("budget,kv", [("4x1", None), ("3x2/5", None), ("4x1", "hier-int4")])
def test_speculation_with_it_is_plain_greedy_decoding(target, budget, kv):
    drafter = KIND.drafter(None, KIND.config(None, 0, None), target, MAX_LEN, None)
    assert isinstance(drafter, QuantSpecDrafter) and drafter.model is shared_copy(target)  # one copy per target
    fields = ServedBudget.parse(budget).engine_fields()
    kv_fields = {} if kv is None else {"kv_scheme": kv, "kv_recent": 8}
    plain = Engine(target, None, EngineConfig(max_seq_len=MAX_LEN, **kv_fields))
    spec = Engine(target, drafter, EngineConfig(max_seq_len=MAX_LEN, speed_check=False, **fields, **kv_fields))
    taus = []
    for p in prompts():
        out = spec.generate(p, 48)
        assert out.tokens == plain.generate(p, 48).tokens
        taus.append(out.metrics.tau)
    assert sum(taus) / len(taus) > 2.0  # the copy agrees with its target on most tokens


def test_a_bundle_holds_the_scheme_and_no_weights_and_serves(tmp_path, target, target_dir):
    fingerprint = target_fingerprint(target_dir)
    write_bundle(tmp_path / "b", KIND.config(None, 0, None), None, target_fingerprint=fingerprint, data_digest="d",
                 config={}, code_version="test")
    bundle = read_bundle(tmp_path / "b", fingerprint)
    assert json.loads((tmp_path / "b" / "drafter_config.json").read_text()) == {
        "kind": "quantspec", "weights": "int8", "kv_reader": "draft"}
    assert not (tmp_path / "b" / "drafter.safetensors").exists()
    drafter = build_drafter(bundle, target, MAX_LEN)
    plain = Engine(target, None, EngineConfig(max_seq_len=MAX_LEN))
    spec = Engine(target, drafter, EngineConfig(max_seq_len=MAX_LEN, speed_check=False,
                                                **ServedBudget.parse("4x1").engine_fields()))
    p = prompts(1)[0]
    assert spec.generate(p, 32).tokens == plain.generate(p, 32).tokens

    write_bundle(tmp_path / "bad", {"kind": "quantspec", "weights": "int4-g32"}, None, target_fingerprint=fingerprint,
                 data_digest="d", config={}, code_version="test")
    with pytest.raises(BundleError, match=r"quantspec weights 'int4-g32': expected 'int8'$"):
        build_drafter(read_bundle(tmp_path / "bad", fingerprint), target, MAX_LEN)
