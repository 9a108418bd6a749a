"""The flashinfer backend's layouts, on the CPU: the KV cache read in place as flashinfer's HND pages, and SpecAttn's
keep masks as the per-kv-head block map of its variable block-sparse wrapper. flashinfer's kernels only run on a GPU
(`python -m kernels.flashinfer_attention` compares them with SDPA there); here the torch references read the same
layouts and must equal the sdpa backend on the tensors the runtime passes."""
import pytest
import torch

from kernels.flashinfer_attention import (PAGE, FlashInferBackend, _random_tree_mask, paged_attention_torch,
                                          paged_view, sparse_blocks, unpage)
from kernels.sparse_attention import sparse_attention_torch
from runtime.attention import BACKENDS
from runtime.kv_cache import KVCache

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


@pytest.mark.parametrize("T", [1, 5])
def test_paged_attention_equals_sdpa(T):
    torch.manual_seed(0)
    S = 45
    _, keys, values = cache_slice(S, 60)
    q = torch.randn(1, 3 * HKV, T, D)  # 3 query heads per kv head
    mask = None if T == 1 else _random_tree_mask(T, S, "cpu")
    key_pages, value_pages, _, last = paged_view(keys[0], values[0])
    want = BACKENDS["sdpa"](q, keys, values, mask, None)
    torch.testing.assert_close(paged_attention_torch(q, key_pages, value_pages, last, mask), want)


@pytest.mark.parametrize("per_query", [False, True])
def test_block_map_is_each_kv_heads_own_mask_and_keep(per_query):
    torch.manual_seed(1)
    T, S, G = 4, 20, 3
    q, keys, values = torch.randn(1, G * HKV, T, D), torch.randn(1, HKV, S, D), torch.randn(1, HKV, S, D)
    mask = _random_tree_mask(T, S, "cpu")
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
    mask = _random_tree_mask(3, 30, "cpu")
    backend = FlashInferBackend()
    torch.testing.assert_close(backend(q, keys, values, mask, None), BACKENDS["sdpa"](q, keys, values, mask, None))
    assert backend._fi is None
