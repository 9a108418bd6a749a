"""`pipeline bench` (pipeline/bench/harness.py): the weight-streaming floor it reports against, and a bench on the real
SmolLM2 target where HF generate, our AR decode and our speculation give the same tokens, densely and with SpecAttn."""
import json
import weakref

import pytest
import torch

from pipeline.bench.harness import (Speculation, copy_bandwidth, default_bench_prompts, run_bench,
                                    weight_bytes_per_token, with_hf)
from runtime.drafters.ngram import NgramDrafter
from runtime.drafters.shared.eagle_drafting import EagleDrafter
from runtime.serving.served_engine import ServedEngine
from runtime.speculation.draft_budget import DraftBudget, ServedBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.attention import SpecAttnConfig
from runtime.target.loading import from_pretrained
from train.recipes import eagle as eagle_recipe


def test_weight_bytes_count_a_tied_table_once(tiny_model_dir):
    import transformers

    for tied in (True, False):
        path = tiny_model_dir("llama", tie_word_embeddings=tied)
        n_hf = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(path).parameters())
        streamed = n_hf if tied else n_hf - 96 * 64  # an untied input embedding reads one row per token
        assert weight_bytes_per_token(from_pretrained(path, max_seq_len=16)) == 4 * streamed
    assert copy_bandwidth(n_bytes=1 << 20, repeats=2) > 0


def test_hf_model_is_freed_before_ours_loads(tiny_chat_target):
    refs = []
    out = with_hf(tiny_chat_target, torch.float32, "cpu", lambda hf: refs.append(weakref.ref(hf)) or len(refs))
    assert out == 1 and refs[0]() is None  # timed's result came back, HF's model is gone


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
