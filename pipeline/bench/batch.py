"""`pipeline bench --batch N`: batched speculation, our batched autoregressive decode and HF `generate` over the same
batches of N prompts (HF's left-padded), in one process; plus each batch's batch-1 greedy decode, which every
greedy batched row must equal token for token.

The prompts go in groups of N, each group a batch our methods run back to back (runtime.serving.batch_engine: each
row drafts, verifies and stops on its own), so a host that slows down slows them alike; HF's row runs in a phase of
its own before ours, so that its model and ours are never resident together. Throughput is new tokens
over wall time, prefill included.
"""
from __future__ import annotations

from pathlib import Path

import torch

from pipeline.bench.harness import Speculation, device_name, interleaved, with_hf
from pipeline.tokens import encode, stop_ids
from runtime.host_memory import release_freed_memory
from runtime.serving.batch_engine import BatchEngine, BatchRequest
from runtime.serving.served_engine import batch_config
from runtime.speculation.decode_stats import tokens_per_forward
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.loading import from_pretrained

POLICIES = ("fixed", "measured")


def hf_generate_batch(hf, batch: list[list[int]], max_new_tokens: int, stops: tuple[int, ...]) -> list[list[int]]:
    """HF greedy `generate` over a left-padded batch; each row's tokens up to its first stop id."""
    pad = stops[0] if stops else 0
    longest = max(map(len, batch))
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in batch], device=hf.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch], device=hf.device)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=list(stops) or None, pad_token_id=pad)
    rows = []
    for row in out[:, longest:].tolist():
        first = next((i for i, t in enumerate(row) if t in stops), None)
        rows.append(row if first is None else row[:first + 1])
    return rows


def run_batch_bench(target_dir: str | Path, prompts: list[str | list[int]], speculation: Speculation | None,
                    batch: int, max_new_tokens: int = 128, *, dtype: torch.dtype = torch.float32,
                    device: str = "cpu", policy: str = "fixed", chat_template: bool = True,
                    print_table: bool = True, lean: bool = False) -> dict:
    """Time each method over `prompts` in batches of `batch`. `policy`: the batched speculation's draft budget at
    each batch size, the served one (`fixed`) or measured here first (`measured`, as serving chooses). HF's model
    is loaded only for its own phase, first; `lean` (on a CPU): ours holds one copy of each weight (run_bench)."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    if batch < 1 or not prompts:
        raise ValueError(f"run_batch_bench: batch={batch} and {len(prompts)} prompts, expected >= 1 of each")
    if policy not in POLICIES:
        raise ValueError(f"run_batch_bench: policy={policy!r}, expected one of {POLICIES}")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt_ids = [p if isinstance(p, list) else encode(tokenizer, p, chat_template) for p in prompts]
    stops = stop_ids(tokenizer)
    max_seq_len = max(map(len, prompt_ids)) + max_new_tokens + (speculation.longest if speculation else 0) + 1
    groups = [prompt_ids[i:i + batch] for i in range(0, len(prompt_ids), batch)]
    n_methods = 2 + (speculation is not None)
    totals: dict[str, dict] = {}

    def add(runs) -> None:
        for name, seconds, tokens, forwards in runs:
            t = totals.setdefault(name, {"seconds": 0.0, "new_tokens": 0, "forwards": 0, "tokens": []})
            t["seconds"] += seconds
            t["new_tokens"] += sum(map(len, tokens))
            t["forwards"] += forwards
            t["tokens"] += tokens

    with tqdm(total=n_methods * (1 + len(groups)) + len(prompt_ids), desc="batch bench", unit="run") as bar:
        def timed(methods: dict):
            for name, run in methods.items():  # warm-up: allocator, kernels, caches
                bar.set_postfix_str(f"{name}, warm-up")
                run([p[:8] for p in groups[0]])
                bar.update()
            return list(interleaved(methods, groups, seed=0, progress=bar))  # greedy

        add(with_hf(target_dir, dtype, device, lambda hf: timed({"hf_generate_batch": lambda group, _gen=None: (
            hf_generate_batch(hf, group, max_new_tokens, stops), 0)})))
        target = from_pretrained(target_dir, dtype=dtype, max_seq_len=max_seq_len, device=device,
                                 lean=lean and torch.device(device).type == "cpu")
        release_freed_memory()  # the load's buffers and the plain weights lean packing let go
        served = speculation.build(target, max_seq_len, prompt_ids[0]) if speculation else None
        cfg, note = batch_config(served.eager_config) if served else (EngineConfig(max_seq_len=max_seq_len), "")
        engines = {"ours_ar_batch": BatchEngine(target, None, cfg, batch)}
        if served is not None:
            measured = served.measure_policy(batch, prompt_ids) if policy == "measured" else None
            engines["ours_spec_batch"] = served.batched(batch, measured)[0]

        def ours(engine: BatchEngine):
            def run(group: list[list[int]], _gen=None):
                out = engine.generate([BatchRequest(i, p, max_new_tokens, stop_ids=stops)
                                       for i, p in enumerate(group)])
                return [g.tokens for g in out], sum(g.metrics.target_forwards for g in out)
            return run

        add(timed({name: ours(e) for name, e in engines.items()}))
        bar.set_postfix_str("each prompt's batch-1 decode")
        single = Engine(target, None, cfg)
        batch1 = []
        for p in prompt_ids:
            batch1.append(single.generate(p, max_new_tokens, stop_ids=stops).tokens)
            bar.update()
    results = {}
    for name, t in totals.items():
        r = results[name] = {"new_tokens": t["new_tokens"], "seconds": t["seconds"],
                             "tokens_per_s": t["new_tokens"] / t["seconds"], "same_tokens_as_batch1": t["tokens"] == batch1}
        if t["forwards"]:  # tokens per row-forward: each row's verify counted once
            r["tau"] = tokens_per_forward(t["new_tokens"], len(prompt_ids), t["forwards"])
    for r in results.values():
        r["speedup_vs_ours_ar_batch"] = r["tokens_per_s"] / results["ours_ar_batch"]["tokens_per_s"]
        r["speedup_vs_hf_batch"] = r["tokens_per_s"] / results["hf_generate_batch"]["tokens_per_s"]
    spec = engines.get("ours_spec_batch")
    report = {"target": str(target_dir), "drafter": speculation.label if speculation else None, "batch": batch,
              "dtype": str(dtype).removeprefix("torch."), "prompts": len(prompts), "max_new_tokens": max_new_tokens,
              "device": device_name(), "torch_threads": torch.get_num_threads(), "methods": results,
              "budget": served.budget.spec if served else None,
              "policy": None if spec is None else spec.policy.describe(),
              "policy_report": None if spec is None else spec.policy.report,
              "notes": [note] * bool(note) + ["hf_generate_batch timed in its own phase before ours (its model is "
                                              "loaded only then), not interleaved with our rows"]}
    if print_table:
        print_batch_report(report)
    return report


def print_batch_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{Path(report['target']).name}: {report['dtype']}, batch {report['batch']}, "
                        f"{report['prompts']} prompts, {report['max_new_tokens']} new tokens, greedy")
    for col in ("method", "tokens", "s", "tok/s", "vs HF", "vs our AR", "tau", "=batch 1"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    for name, r in report["methods"].items():
        table.add_row(name, str(r["new_tokens"]), f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup_vs_hf_batch']:.2f}x", f"{r['speedup_vs_ours_ar_batch']:.2f}x",
                      f"{r['tau']:.2f}" if "tau" in r else "-", "yes" if r["same_tokens_as_batch1"] else "NO")
    console = Console(width=max(Console().width, 110))
    console.print(table)
    console.print(f"drafter {report['drafter']}, budget {report['budget']}, by batch size: {report['policy']}; "
                  f"{report['device']}, {report['torch_threads']} torch threads")
    for note in report["notes"]:
        console.print(f"note: {note}")
