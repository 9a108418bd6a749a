"""The flashinfer backend on the CPU: the KV cache read in place as flashinfer's HND pages, SpecAttn's keep masks as
the per-kv-head block map of its variable block-sparse wrapper, and the backend's calls of the three wrappers.
flashinfer's kernels only run on a GPU (`python -m pipeline.bench.flashinfer_check` compares them with SDPA there); here
a torch stand-in of the wrappers (torch_flashinfer.py) takes the backend's calls, and must give the sdpa backend's
results on the tensors the runtime passes."""
import pytest
import torch

from kernels.sparse_attention import sparse_attention_torch
from pipeline.bench.flashinfer_check import random_tree_mask
from pipeline.bench.random_weights import ReplayDrafter
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.engine import Engine, EngineConfig
from runtime.target.attention import BACKEND_ENV, BACKENDS
from runtime.target.attention.flashinfer import PAGE, FlashInferBackend, paged_view, sparse_blocks
from runtime.target.kv_cache import KVCache
from runtime.target.loading import from_pretrained
from support.torch_flashinfer import TorchFlashInfer, unpage

HKV, D = 2, 8


def cache_slice(S: int, max_len: int, layer: int = 1) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """A layer's live keys and values as KVCache.write returns them: a slice of the whole cache."""
    cache = KVCache(3, 1, HKV, max_len, D)
    cache.k.normal_(), cache.v.normal_()
    return cache, cache.k[layer, :, :, :S], cache.v[layer, :, :, :S]


@pytest.mark.parametrize("S, max_len, page", [(40, 64, PAGE), (64, 64, PAGE), (50, 53, 4), (1, 53, PAGE)])
def test_pages_are_the_cache_in_place(S, max_len, page):
    cache, keys, values = cache_slice(S, max_len)
    key_pages, value_pages, got_page, last = paged_view(keys[0], values[0])
    assert got_page == page and key_pages.shape == (-(-S // page), HKV, page, D) and 1 <= last <= page
    assert torch.equal(unpage(key_pages, last), keys[0]) and torch.equal(unpage(value_pages, last), values[0])
    # no copy: a write to the cache shows through the pages
    assert key_pages.untyped_storage().data_ptr() == cache.k.untyped_storage().data_ptr()
    cache.k[1, 0, 1, S - 1] += 1.0
    assert torch.equal(unpage(key_pages, last)[1, S - 1], cache.k[1, 0, 1, S - 1])


def test_other_layouts_are_copied_into_pages():
    keys = torch.randn(HKV, D, 30).transpose(1, 2)  # [Hkv, S, D], not a cache slice
    values = torch.randn(HKV, 30, D)
    key_pages, value_pages, page, last = paged_view(keys, values)
    assert torch.equal(unpage(key_pages, last), keys) and torch.equal(unpage(value_pages, last), values)
    assert page * (key_pages.shape[0] - 1) + last == 30


@pytest.mark.parametrize("per_query", [False, True])
def test_block_map_is_each_kv_heads_own_mask_and_keep(per_query):
    torch.manual_seed(1)
    T, S, G = 4, 20, 3
    q, keys, values = torch.randn(1, G * HKV, T, D), torch.randn(1, HKV, S, D), torch.randn(1, HKV, S, D)
    mask = random_tree_mask(T, S, "cpu")
    keep = torch.rand(1, HKV, T if per_query else 1, S) < 0.5
    keep[..., S - T:] = True
    blocks = sparse_blocks(mask, keep, T)
    assert blocks.shape == (HKV, T, S)
    for h in range(HKV):
        assert torch.equal(blocks[h], keep[0, h].expand(T, S) & mask[0, 0])
    # flashinfer's grouping: query head h reads kv head h // G through that head's block map
    out = torch.stack([torch.nn.functional.scaled_dot_product_attention(
        q[0, h], keys[0, h // G], values[0, h // G], attn_mask=blocks[h // G]) for h in range(G * HKV)])
    torch.testing.assert_close(out[None], sparse_attention_torch(q, keys, values, mask, keep))
    assert torch.equal(sparse_blocks(None, keep, T), keep[0].expand(-1, T, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calls_flashinfer_cannot_take_go_to_sdpa(dtype):
    """fp32 has no flashinfer kernel, and a CPU tensor none at all: the backend answers through sdpa and never
    imports flashinfer."""
    _, keys, values = cache_slice(30, 40)
    keys, values = keys.to(dtype), values.to(dtype)
    q = torch.randn(1, 2 * HKV, 3, D, dtype=dtype)
    mask = random_tree_mask(3, 30, "cpu")
    backend = FlashInferBackend()
    torch.testing.assert_close(backend(q, keys, values, mask, None), BACKENDS["sdpa"](q, keys, values, mask, None))
    assert backend._fi is None


def stand_in_backend() -> tuple[FlashInferBackend, TorchFlashInfer]:
    module = TorchFlashInfer()
    backend = FlashInferBackend(module)
    backend.device_type = "cpu"  # the stand-in runs where the tests do
    return backend, module


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


@pytest.mark.parametrize("T, sparse, per_query", [(1, False, False), (5, False, False), (5, True, False),
                                                  (5, True, True)], ids=["decode", "tree", "sparse", "sparse-rows"])
def test_backend_calls_equal_sdpa(T, sparse, per_query):
    """What the backend hands each wrapper (pages of the cache, the flattened mask, the block map, the queries'
    layout) gives the sdpa backend's result: bf16 computed the same way rounds the same."""
    torch.manual_seed(2)
    S = 37
    cache, keys, values = cache_slice(S, 50)
    keys, values = keys.to(torch.bfloat16), values.to(torch.bfloat16)
    q = bf16(1, 3 * HKV, T, D)
    mask = None if T == 1 else random_tree_mask(T, S, "cpu")
    keep = None
    if sparse:
        keep = torch.rand(1, HKV, T if per_query else 1, S) < 0.5
        keep[..., S - T:] = True
    backend, module = stand_in_backend()
    with torch.inference_mode():  # as the engine runs: sdpa then computes bf16 in fp64 (exact_dtype)
        got, want = backend(q, keys, values, mask, keep), BACKENDS["sdpa"](q, keys, values, mask, keep)
    assert got.dtype == torch.bfloat16 and module.plans() == 1
    assert torch.equal(got, want)
    kind = "VariableBlockSparse" if sparse else "BatchDecode" if T == 1 else "BatchPrefill"
    assert [type(w).__name__.split("Attention")[0].split("WithPaged")[0] for w in module.made] == [kind]


def test_a_plan_serves_every_layer_of_a_forward():
    """Layers share their forward's mask (and keep): one plan each; a new mask, a longer decode or a new keep
    plans again; a drafter's differently shaped forwards keep their own wrappers and plans."""
    torch.manual_seed(3)
    backend, module = stand_in_backend()
    _, keys, values = cache_slice(30, 64)
    keys, values = keys.to(torch.bfloat16), values.to(torch.bfloat16)
    q, q_draft = bf16(1, 2 * HKV, 4, D), bf16(1, HKV, 4, D)  # the drafter: another head count
    mask = random_tree_mask(4, 30, "cpu")
    for _ in range(3):  # three target layers, a drafter layer between them
        backend(q, keys, values, mask, None)
        backend(q_draft, keys, values, mask, None)
    assert module.plans() == 2 and len(module.made) == 2
    backend(q, keys, values, random_tree_mask(4, 30, "cpu"), None)  # the next forward
    assert module.plans() == 3
    for S in (20, 20, 21):  # decode: the plan depends on the key count only
        backend(q[:, :, :1], keys[:, :, :S], values[:, :, :S], None, None)
    assert module.plans() == 5
    keep = torch.ones(1, HKV, 1, 30, dtype=torch.bool)
    for k in (keep, keep, keep.clone()):  # the layers mapped to one draft layer share its keep object
        backend(q, keys, values, mask, k)
    assert module.plans() == 7


def test_engine_through_the_flashinfer_calls_is_the_sdpa_engine(tiny_model_dir, monkeypatch):
    """Greedy decoding and speculation in bf16, every attention call through the backend's flashinfer calls (the
    stand-in's kernels): the tokens equal the sdpa engine's, and each target forward plans once, not per layer."""
    target = from_pretrained(tiny_model_dir("llama", num_hidden_layers=3), dtype=torch.bfloat16,
                                         max_seq_len=128)
    prompt, n_new = [5, 17, 33, 5, 17, 42, 8, 5, 17], 24
    cfg = EngineConfig(max_seq_len=64, budget=DraftBudget(depth=4))
    ar = Engine(target, None, cfg).generate(prompt, n_new).tokens
    replay = lambda: ReplayDrafter(target.config.vocab_size, {tuple(prompt): prompt + ar}, 0.7, seed=1)  # noqa: E731
    spec = Engine(target, replay(), cfg).generate(prompt, n_new)
    assert spec.tokens == ar and spec.metrics.target_forwards < n_new - 1

    backend, module = stand_in_backend()
    monkeypatch.setitem(BACKENDS, backend.name, backend)
    monkeypatch.setenv(BACKEND_ENV, backend.name)
    assert Engine(target, None, cfg).generate(prompt, n_new).tokens == ar
    # the prefill plans twice (its last layer attends for the last query alone: a decode call), then n_new - 1
    # decodes once each, each plan serving all 3 layers
    assert module.plans() == n_new + 1
    planned = module.plans()
    through = Engine(target, replay(), cfg).generate(prompt, n_new)
    assert through.tokens == ar and through.metrics.tau == spec.metrics.tau
    # each verify plans once; the prefill's causal plan depends on shapes only and is still held from the first
    # run, its last layer's decode plan is new
    assert module.plans() - planned == 1 + through.metrics.target_forwards

