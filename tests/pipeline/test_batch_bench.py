"""`pipeline bench --batch N` on a tiny chat target: every method runs over the same batches, our batched rows equal
each prompt's batch-1 greedy decode, and the work shows a progress bar."""
from test_bench import chain_speculation

from pipeline.bench.batch import run_batch_bench
from runtime.drafters.ngram import NgramDrafter

PROMPTS = ["w5 w6 w7 w5 w6 w7", "w40 w41 w40 w41", "w9 w8 w9"]


def test_batch_bench_times_every_method_on_batches_equal_to_batch1(tiny_chat_target, capfd):
    ngram = chain_speculation("ngram", lambda t: NgramDrafter(t.config.vocab_size))
    report = run_batch_bench(tiny_chat_target, PROMPTS, ngram, batch=2, max_new_tokens=12, print_table=False)
    methods = report["methods"]
    assert set(methods) == {"hf_generate_batch", "ours_ar_batch", "ours_spec_batch"}
    assert methods["ours_ar_batch"]["same_tokens_as_batch1"] and methods["ours_spec_batch"]["same_tokens_as_batch1"]
    assert all(m["new_tokens"] > 0 and m["tokens_per_s"] > 0 for m in methods.values())
    assert methods["ours_spec_batch"]["tau"] >= 1.0 and report["batch"] == 2 and report["prompts"] == 3
    assert "batch bench: 100%" in capfd.readouterr().err
