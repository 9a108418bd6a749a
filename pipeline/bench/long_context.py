"""`pipeline bench --context N,...`: prefill time and decode speed at long contexts, HF transformers `generate`
against our engine (autoregressive, and speculative with a drafter), one prompt per context length.

Each prompt is a document and a question in the chat template, exactly N tokens long: the document is real text
(assistant replies of held-out ShareGPT conversations, the same held-out side prepare splits off, one after
another), the question asks about it. Time to the first token is the prefill (ours: Metrics.prefill_s; HF: when
`generate` hands its streamer the first new token); decode speed counts the tokens after it. HF's rows run in a
phase of their own before ours, so that its model and ours are never resident together.
"""
from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from pipeline.bench.harness import Speculation, device_name, hf_generate, interleaved, with_hf
from pipeline.errors import DraftsmithError
from pipeline.tokens import stop_ids
from runtime.host_memory import release_freed_memory
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.target.loading import from_pretrained
from runtime.target.model_config import ModelConfig, context_error

MAX = "max"  # --context: the longest prompt the model's context holds with max_new_tokens after it
QUESTION = "Summarise the document above in a few sentences, then name its main topic."
DOCUMENT_MARK = "\x00DOCUMENT\x00"
HELD_OUT_FRACTION = 0.05  # data.val_fraction's default: the conversations prepare holds out


def context_lengths(spec: str, context: int, max_new_tokens: int) -> list[int]:
    """--context "1024,2048,max" -> prompt lengths; `max` is the longest that fits `context` positions."""
    longest = context - max_new_tokens + 1
    lengths = []
    for item in spec.split(","):
        item = item.strip()
        n = longest if item == MAX else int(item) if item.isdigit() else None
        if n is None or n < 16:
            raise DraftsmithError(f"--context {spec}: {item!r} is not a length of at least 16 tokens or {MAX!r}")
        overflow = context_error(n, max_new_tokens, context, "the model's context of max_position_embeddings")
        if overflow:
            raise DraftsmithError(f"--context {item}: {overflow} (--context {MAX} is {longest} here)")
        lengths.append(n)
    return lengths


def held_out_documents(dataset: str = "sharegpt", conversations: int = 4000) -> list[str]:
    """Assistant replies of the held-out conversations among the dataset's first `conversations`."""
    from pipeline.sources import load_conversations
    from train.data import is_validation

    loaded = load_conversations(dataset, limit=conversations).items
    return [t["content"] for turns in loaded if is_validation(turns, HELD_OUT_FRACTION)
            for t in turns if t["role"] == "assistant" and len(t["content"]) > 200]


def document_prompt(tokenizer, n_tokens: int, documents: list[str]) -> list[int]:
    """A user turn "<document>\\n\\nQuestion: ..." in the chat template, the document cut to make n_tokens."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{DOCUMENT_MARK}\n\nQuestion: {QUESTION}"}],
                                         tokenize=False, add_generation_prompt=True)
    head, tail = (tokenizer(part, add_special_tokens=False).input_ids for part in text.split(DOCUMENT_MARK))
    room = n_tokens - len(head) - len(tail)
    body: list[int] = []
    for doc in documents:
        if len(body) >= room:
            break
        body += tokenizer(doc + "\n\n", add_special_tokens=False).input_ids
    if len(body) < room:
        raise DraftsmithError(f"--context {n_tokens}: the held-out documents hold only {len(body)} tokens")
    return head + body[:room] + tail


class _TokenTimes:
    """A `generate` streamer noting when each put() comes: the prompt first, then every new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_context_bench(target_dir: str | Path, spec: str, speculation: Speculation | None = None,
                      max_new_tokens: int = 128, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                      repeats: int = 1, seed: int = 0, print_table: bool = True, lean: bool = False) -> dict:
    """Prefill seconds and decode tokens/s per context length of `spec` (see context_lengths), greedy. HF's model
    is loaded only for its own phase, first; `lean` (on a CPU): ours holds one copy of each weight (run_bench)."""
    from transformers import AutoTokenizer
    from tqdm import tqdm

    limit = ModelConfig.from_dir(target_dir).max_position_embeddings
    lengths = context_lengths(spec, limit, max_new_tokens)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    documents = held_out_documents()
    prompts = [document_prompt(tokenizer, n, documents) for n in lengths]
    stops, params = stop_ids(tokenizer), SamplingParams()
    max_seq_len = min(limit, max(lengths) + max_new_tokens + (speculation.longest if speculation else 0) + 1)
    rows: list[dict] = [{} for _ in lengths]
    with tqdm(total=len(prompts) * (2 + (speculation is not None)) * repeats, desc="context bench",
              unit="run") as bar:
        def timed(methods: dict) -> None:
            for run in methods.values():  # warm-up: allocator, kernels, caches
                run(prompts[0][:64], torch.Generator().manual_seed(seed))

            def counted(run):
                def step(ids, gen):
                    bar.set_postfix_str(f"{len(ids)} tokens")
                    out = run(ids, gen)
                    bar.update()
                    return out
                return step

            measured = iter(interleaved({name: counted(run) for name, run in methods.items()}, prompts, seed,
                                        repeats))
            for row in rows:
                for _ in methods:
                    name, _, tokens, timing = next(measured)
                    row[name] = {**timing, "new_tokens": len(tokens), "tokens": tokens}

        def hf_run(hf, ids, gen):
            times = _TokenTimes()
            start = time.perf_counter()
            tokens = hf_generate(hf, ids, max_new_tokens, params, stops, gen, streamer=times)
            return tokens, {"prefill_s": times.times[1] - start, "decode_s": time.perf_counter() - times.times[1]}

        with_hf(target_dir, dtype, device, lambda hf: timed({"hf_generate": partial(hf_run, hf)}))
        target = from_pretrained(target_dir, dtype=dtype, max_seq_len=max_seq_len, device=device,
                                 lean=lean and torch.device(device).type == "cpu")
        release_freed_memory()  # the load's buffers and the plain weights lean packing let go
        served = speculation.build(target, max_seq_len, prompts[0][:64]) if speculation else None
        cfg = served.eager_config if served else EngineConfig(max_seq_len=max_seq_len)

        def ours(engine: Engine):
            def run(ids, gen):
                out = engine.generate(ids, max_new_tokens, params, gen, stops)
                m = out.metrics
                return out.tokens, {"prefill_s": m.prefill_s, "decode_s": m.total_s - m.prefill_s, "tau": m.tau}
            return run

        methods = {"ours_ar": ours(Engine(target, None, replace(cfg, sparse=None)))}
        if served is not None:
            methods["ours_spec"] = ours(Engine(target, served.new_drafter(), cfg))
        timed(methods)
    contexts = [compare(n, row) for n, row in zip(lengths, rows)]
    report = {"target": str(target_dir), "drafter": speculation.label if speculation else None,
              "dtype": str(dtype).removeprefix("torch."), "device": device_name(),
              "torch_threads": torch.get_num_threads(), "max_new_tokens": max_new_tokens, "context_limit": limit,
              "repeats": repeats, "contexts": contexts}
    if print_table:
        print_context_report(report)
    return report


def compare(n: int, row: dict[str, dict]) -> dict:
    """One context's methods with their decode speed and their ratios to HF (and speculation's to our AR)."""
    for r in row.values():  # the first new token comes from the prefill
        r["decode_tokens_per_s"] = (r["new_tokens"] - 1) / r["decode_s"] if r["new_tokens"] > 1 else 0.0
    hf, ar = row["hf_generate"], row["ours_ar"]
    for name, r in row.items():
        r["prefill_speedup_vs_hf"] = hf["prefill_s"] / r["prefill_s"]
        r["decode_speedup_vs_hf"] = r["decode_tokens_per_s"] / hf["decode_tokens_per_s"] \
            if hf["decode_tokens_per_s"] else None
        r["decode_speedup_vs_ours_ar"] = r["decode_tokens_per_s"] / ar["decode_tokens_per_s"] \
            if ar["decode_tokens_per_s"] else None
        r["same_tokens_as_ours_ar"] = r["tokens"] == ar["tokens"]
    return {"prompt_tokens": n, "methods": {name: {k: v for k, v in r.items() if k != "tokens"}
                                            for name, r in row.items()}}


def print_context_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{Path(report['target']).name}: {report['dtype']}, document + question prompts, "
                        f"{report['max_new_tokens']} new tokens, greedy")
    for col in ("context", "method", "prefill s", "vs HF", "decode tok/s", "vs HF", "vs AR", "tau", "=AR"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    ratio = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    for c in report["contexts"]:
        for name, r in c["methods"].items():
            table.add_row(str(c["prompt_tokens"]), name, f"{r['prefill_s']:.2f}", ratio(r["prefill_speedup_vs_hf"]),
                          f"{r['decode_tokens_per_s']:.1f}", ratio(r["decode_speedup_vs_hf"]),
                          ratio(r["decode_speedup_vs_ours_ar"]), f"{r['tau']:.2f}" if "tau" in r else "-",
                          "yes" if r["same_tokens_as_ours_ar"] else "NO")
    console = Console(width=max(Console().width, 110))
    console.print(table)
    console.print(f"drafter {report['drafter']}; {report['device']}, {report['torch_threads']} torch threads; "
                  f"model context {report['context_limit']} positions; best of {report['repeats']} run(s) each")
