import json

import pytest
import torch

from runtime.speculation.tree import DraftTree
from runtime.target.attention import attention_mask
from runtime.target.cpu_packing import Linear, onednn_packs, own_fp32_kernel, packed_min_fp32_rows
from runtime.target.kv_cache import KVCache
from runtime.target.loading import from_pretrained
from runtime.target.model import RMSNorm, Taps, Transformer
from runtime.target.model_config import ModelConfig

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
FAMILIES = [("llama", dict(tie_word_embeddings=True)), ("llama", dict(attention_bias=True, mlp_bias=True)),
            ("llama", dict(rope_parameters=LLAMA3_ROPE)),
            ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0))),
            ("qwen2", {}), ("qwen3", dict(head_dim=32)), ("mistral", dict(sliding_window=6))]


def hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def positions_for(cache: KVCache, t: int) -> torch.Tensor:
    return cache.lengths[:, None] + torch.arange(t)


@pytest.mark.parametrize("arch,overrides", FAMILIES, ids=lambda x: x if isinstance(x, str) else "-".join(x) or "base")
@torch.no_grad()
def test_logits_match_transformers(tiny_model_dir, arch, overrides):
    path = tiny_model_dir(arch, **overrides)
    ids = torch.randint(0, 96, (2, 18), generator=torch.Generator().manual_seed(1))
    ref = hf_model(path)(ids).logits
    model = from_pretrained(path, max_seq_len=64)

    cache = model.new_cache(batch=2)
    out = model(ids, cache, positions_for(cache, 18))
    torch.testing.assert_close(out.logits, ref, atol=2e-5, rtol=1e-4)
    assert out.hidden.shape == (2, 18, 64)

    # prefill then one token at a time through the static cache gives the same logits
    cache = model.new_cache(batch=2)
    steps = []
    for chunk in (ids[:, :11],) + tuple(ids[:, t:t + 1] for t in range(11, 18)):
        steps.append(model(chunk, cache, positions_for(cache, chunk.shape[1])).logits)
        cache.advance(chunk.shape[1])
    torch.testing.assert_close(torch.cat(steps, 1), ref, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_taps_match_transformers_hidden_states_and_attention(tiny_model_dir):
    import transformers

    path = tiny_model_dir("qwen3", head_dim=32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    ref = hf.eval()(ids, output_hidden_states=True, output_attentions=True)
    model = from_pretrained(path, max_seq_len=32)
    cache = model.new_cache()
    out = model(ids, cache, positions_for(cache, 9), taps=Taps(hidden_layers=(0,), attention_layers=(1,)))
    torch.testing.assert_close(out.layer_hidden[0], ref.hidden_states[1], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.attention[1], ref.attentions[1], atol=2e-6, rtol=1e-4)
    assert set(out.layer_hidden) == {0} and set(out.attention) == {1}
    plain = model(ids, model.new_cache(), positions_for(cache, 9))
    assert plain.layer_hidden == {} and plain.attention == {}
    torch.testing.assert_close(plain.logits, out.logits)


@torch.no_grad()
def test_batch_with_different_lengths_matches_single_sequences(tiny_llama_dir):
    model = from_pretrained(tiny_llama_dir, max_seq_len=64)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=gen) for n in (7, 12)]
    nxt = torch.randint(0, 96, (2, 3), generator=gen)

    cache = model.new_cache(batch=2)
    padded = torch.zeros(2, 12, dtype=torch.long)
    for b, p in enumerate(prompts):  # right padding: the pad slots are overwritten by the next forward
        padded[b, :len(p)] = p
    model(padded, cache, positions_for(cache, 12))
    cache.advance(torch.tensor([7, 12]))
    batched = model(nxt, cache, positions_for(cache, 3)).logits

    for b, p in enumerate(prompts):
        single = model.new_cache()
        want = model(torch.cat([p, nxt[b]])[None], single, torch.arange(len(p) + 3)[None]).logits
        torch.testing.assert_close(batched[b], want[0, -3:], atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_forward_over_slots_and_a_mask_the_caller_chose_is_the_forward_that_builds_them(tiny_llama_dir):
    """A static step's placement: the same slots, a mask over a wider key span than the live keys."""
    model = from_pretrained(tiny_llama_dir, max_seq_len=32)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(6))
    built, placed = model.new_cache(), model.new_cache()
    for cache in (built, placed):
        model(ids[:, :8], cache, positions_for(cache, 8))
        cache.advance(8)
    positions = positions_for(built, 4)
    want = model(ids[:, 8:], built, positions)
    mask = attention_mask(placed.lengths, positions, 16, None, always=True)  # keys 12..15: unwritten, unseen
    got = model(ids[:, 8:], placed, positions, slots=placed.slots(4), mask=mask)
    torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(placed.k[:, :, :, :12], built.k[:, :, :, :12])
    with pytest.raises(ValueError, match="slots need the mask"):
        model(ids[:, 8:], placed, positions, slots=placed.slots(4))
    with pytest.raises(ValueError, match="a mask comes with its slots"):
        model(ids[:, 8:], placed, positions, mask=mask)


def random_tree(n: int, gen: torch.Generator) -> DraftTree:
    parents = [-1] + [int(torch.randint(-1, i, (), generator=gen)) for i in range(1, n)]
    return DraftTree(torch.randint(0, 96, (n,), generator=gen), torch.tensor(parents))


def path_to(tree: DraftTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return path[::-1]


def verify_random_tree(model: Transformer, n_prefix: int, n_nodes: int):
    """A random prefix committed to a fresh cache, then one tree-verify forward over a random root and tree:
    (prefix, root, tree, cache, ForwardOutput)."""
    gen = torch.Generator().manual_seed(4)
    prefix, root = torch.randint(0, 96, (n_prefix,), generator=gen), torch.randint(0, 96, (1,), generator=gen)
    tree = random_tree(n_nodes, gen)
    cache = model.new_cache()
    model(prefix[None], cache, positions_for(cache, n_prefix))
    cache.advance(n_prefix)
    tokens = torch.cat([root, tree.tokens])[None]
    positions = n_prefix + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths()])[None]
    return prefix, root, tree, cache, model(tokens, cache, positions, tree.ancestor_mask())


@pytest.mark.parametrize("arch,overrides", [FAMILIES[0], FAMILIES[-1]], ids=["llama", "mistral-window"])
@torch.no_grad()
def test_tree_verify_and_compact_equal_plain_decoding(tiny_model_dir, arch, overrides):
    """Each tree node sees the prefix and its ancestors only; after compacting to one path the cache is the
    cache of plain decoding along that path."""
    model = from_pretrained(tiny_model_dir(arch, **overrides), max_seq_len=64)
    prefix, root, tree, cache, verified = verify_random_tree(model, 10, 9)

    for node in range(len(tree)):
        path = path_to(tree, node)
        seq = torch.cat([prefix, root, tree.tokens[path]])
        want = model(seq[None], model.new_cache(), torch.arange(len(seq))[None])
        torch.testing.assert_close(verified.logits[0, node + 1], want.logits[0, -1], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(verified.hidden[0, node + 1], want.hidden[0, -1], atol=2e-5, rtol=1e-4)

    deepest = int(tree.depths().argmax())
    path = path_to(tree, deepest)
    cache.compact(torch.tensor([0] + [i + 1 for i in path]))
    assert int(cache.lengths[0]) == 11 + len(path)
    nxt = torch.tensor([[5]])
    after = model(nxt, cache, positions_for(cache, 1)).logits
    seq = torch.cat([prefix, root, tree.tokens[path], nxt[0]])
    want = model(seq[None], model.new_cache(), torch.arange(len(seq))[None]).logits
    torch.testing.assert_close(after[0, -1], want[0, -1], atol=2e-5, rtol=1e-4)


def test_kv_cache_compact_moves_slots_in_place():
    cache = KVCache(n_layers=2, batch=2, n_kv_heads=1, max_len=10, head_dim=1)
    cache.lengths[:] = torch.tensor([2, 4])
    cache.k[..., 0] = torch.arange(10.0)  # every slot holds its own index
    cache.compact(torch.tensor([0, 2, 3]))
    assert cache.lengths.tolist() == [5, 7]
    assert cache.k[1, 0, 0, :5, 0].tolist() == [0, 1, 2, 4, 5]
    assert cache.k[0, 1, 0, :7, 0].tolist() == [0, 1, 2, 3, 4, 6, 7]
    with pytest.raises(ValueError, match="ascending"):
        cache.compact(torch.tensor([2, 1]))
    cache.k[1, 0, 0, 5:7, 0] = torch.tensor([50.0, 60.0])  # what a verify wrote after the first row's 5
    cache.compact([0, 1])  # a host list (as the engine gives it), a prefix already in place
    assert cache.lengths.tolist() == [7, 9] and cache.k[1, 0, 0, :7, 0].tolist() == [0, 1, 2, 4, 5, 50, 60]
    with pytest.raises(ValueError, match="offset 1 lies beyond the cache length 10"):
        cache.compact([0, 1])
    assert cache.lengths.tolist() == [7, 9]  # a refused compact changes nothing
    with pytest.raises(ValueError, match="exceed the cache length 10"):
        cache.slots(4)
    with pytest.raises(ValueError, match="overflows"):
        cache.advance(4)
    assert cache.lengths.tolist() == [7, 9]  # a refused advance changes nothing


def test_kv_cache_rows_view_shares_storage_and_move_row_moves_a_sequence():
    cache = KVCache(n_layers=2, batch=3, n_kv_heads=1, max_len=6, head_dim=1)
    cache.lengths[:] = torch.tensor([1, 2, 4])
    cache.k[:, 2, 0, :, 0] = torch.arange(6.0)
    cache.move_row(2, 0)
    assert cache.lengths.tolist() == [4, 2, 0] and cache.k[1, 0, 0, :4, 0].tolist() == [0, 1, 2, 3]
    view = cache.rows_view(0, 2)
    view.advance(1)  # lands in the parent
    assert cache.lengths.tolist() == [5, 3, 0] and view.batch == 2
    with pytest.raises(ValueError, match="rows 2..3 outside the batch of 3"):
        cache.rows_view(2, 4)


def test_prompt_longer_than_cache_is_a_clear_error(tiny_llama_dir):
    model = from_pretrained(tiny_llama_dir, max_seq_len=16)
    cache = model.new_cache(max_len=8)
    with pytest.raises(ValueError, match="9 new tokens after 0 cached ones exceed the cache length 8"):
        model(torch.zeros(1, 9, dtype=torch.long), cache, torch.arange(9)[None])
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len 16"):
        model.new_cache(max_len=17)


def test_loading_sharded_tied_and_bf16(tiny_model_dir, tiny_llama_dir, tmp_path):
    import transformers

    tied = from_pretrained(tiny_llama_dir, max_seq_len=32)
    assert tied.output.weight is tied.tok_embeddings.weight  # one table, stored once
    assert sum(p.numel() for p in tied.parameters()) == sum(
        p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).parameters())

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"))
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded = from_pretrained(tmp_path, max_seq_len=32)
    ids = torch.arange(12)[None]
    with torch.no_grad():
        torch.testing.assert_close(sharded(ids, sharded.new_cache(), ids).logits, hf.eval()(ids).logits,
                                   atol=2e-5, rtol=1e-4)
        bf16 = from_pretrained(tmp_path, dtype=torch.bfloat16, max_seq_len=32)
        logits = bf16(ids, bf16.new_cache(), ids).logits
    assert bf16.rope_cos.dtype == torch.bfloat16 and logits.dtype == torch.bfloat16
    fp32 = dict(sharded.named_parameters())  # each weight cast as it is read: the same bits as a cast after
    assert all(torch.equal(p, fp32[name].bfloat16()) for name, p in bf16.named_parameters())
    # bf16 weights are prepacked only where oneDNN can (AVX-512 or AVX-NE-CONVERT); elsewhere the plain kernel runs
    assert {m.packed is not None for m in bf16.modules() if isinstance(m, Linear)} == {onednn_packs(torch.bfloat16)}
    assert (logits.float() - hf(ids).logits).abs().max() < 0.1


@torch.no_grad()
def test_prepacked_cpu_weights_compute_the_plain_linear(tiny_model_dir):
    model = from_pretrained(tiny_model_dir("qwen2"), max_seq_len=32)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    assert all(m.packed is not None or m.own_fp32 for m in linears)  # own_fp32: kernels/cpu_gemm.py (AMD)
    ids = torch.arange(7)[None]
    packed = model(ids, model.new_cache(), ids).logits
    for m in linears:
        m.unpack()
    torch.testing.assert_close(packed, model(ids, model.new_cache(), ids).logits, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("own_kernel", [True, False], ids=["own-fp32-kernel", "onednn"])
def test_a_lean_model_holds_one_copy_of_each_weight_and_computes_the_same(tiny_model_dir, monkeypatch, own_kernel):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    from runtime.target import cpu_packing

    if not own_kernel or cpu_packing.OWN_FP32_KERNEL:
        monkeypatch.setattr(cpu_packing, "OWN_FP32_KERNEL", own_kernel)
    else:
        pytest.skip("our fp32 kernel does not run on this CPU")
    path = tiny_model_dir("qwen2")
    full, lean = from_pretrained(path, max_seq_len=96), from_pretrained(path, max_seq_len=96, lean=True)
    linears = [m for name, m in lean.named_modules() if isinstance(m, Linear) and name != "output"]
    assert all(m.weight.is_meta and (m.panels is None) != (m.packed is None) for m in linears)  # one copy each
    # the head stays readable, exactly (drafters read its rows): from its panels where our kernel holds it alone
    assert lean.output.weight.is_meta == own_kernel
    ids = torch.tensor([0, 17, 95])
    torch.testing.assert_close(lean.output.weight_rows(), full.output.weight, rtol=0, atol=0)
    torch.testing.assert_close(lean.output.weight_rows(ids), full.output.weight[ids], rtol=0, atol=0)
    # and so does every block weight, from whichever one copy it keeps (quantspec quantises them)
    plain = dict(full.named_modules())
    for name, m in lean.named_modules():
        if isinstance(m, Linear) and name != "output":
            torch.testing.assert_close(m.weight_rows(), plain[name].weight, rtol=0, atol=0)
            rows = ids % m.weight.shape[0]
            torch.testing.assert_close(m.weight_rows(rows), plain[name].weight[rows], rtol=0, atol=0)
    for rows in (1, 5, 80):  # a decode, a verify, a prefill past every kernel's row limit
        ids = torch.randint(0, 96, (1, rows), generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(lean(ids, lean.new_cache(), torch.arange(rows)[None]).logits,
                                   full(ids, full.new_cache(), torch.arange(rows)[None]).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="no plain weight"):
        linears[0].unpack()
    with torch.enable_grad(), pytest.raises(RuntimeError, match="lean Linear"):
        linears[0](torch.randn(2, 64, requires_grad=True))


@torch.no_grad()
def test_a_lean_tied_model_keeps_its_table_once_in_the_head_panels(tiny_model_dir):
    from runtime.drafters.eagle3 import Eagle3Model
    from runtime.target import cpu_packing

    if not torch.backends.mkldnn.is_available() or not cpu_packing.OWN_FP32_KERNEL:
        pytest.skip("our fp32 kernel does not run on this CPU")
    path = tiny_model_dir("qwen2", tie_word_embeddings=True)
    full = from_pretrained(path, max_seq_len=64)
    last = full.config.n_layers - 1  # plain beside the lean rest: a drafter starts from it
    lean = from_pretrained(path, max_seq_len=64, lean=True, plain_blocks=(last,))
    table = full.tok_embeddings.weight
    assert lean.output.weight is lean.tok_embeddings.weight and lean.tok_embeddings.weight.is_meta  # still tied
    assert not [p for p in lean.parameters() if not p.is_meta and p.shape == table.shape]  # no plain table left
    ids = torch.randint(0, table.shape[0], (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lean.tok_embeddings(ids), full.tok_embeddings(ids), rtol=0, atol=0)
    torch.testing.assert_close(lean.tok_embeddings.table(), table, rtol=0, atol=0)
    drafter = Eagle3Model.from_target(lean, None, (0, last, last))  # a drafter shares the table, read the same way
    torch.testing.assert_close(drafter.embedding(ids), table[ids], rtol=0, atol=0)
    for rows in (1, 5):
        torch.testing.assert_close(lean(ids[:1, :rows], lean.new_cache(), torch.arange(rows)[None]).logits,
                                   full(ids[:1, :rows], full.new_cache(), torch.arange(rows)[None]).logits,
                                   atol=1e-5, rtol=1e-5)


def test_fp32_products_are_prepacked_from_one_row_except_on_intel():
    assert packed_min_fp32_rows("GenuineIntel") == 4  # MKL wins for 1..3 rows there
    assert packed_min_fp32_rows("AuthenticAMD") == packed_min_fp32_rows("") == 1
    assert own_fp32_kernel("AuthenticAMD") and not own_fp32_kernel("GenuineIntel")  # measured on AMD only


def test_few_fp32_rows_take_the_plain_kernel_and_more_the_prepacked_one(monkeypatch):
    """On Intel CPUs decode-sized fp32 products run through MKL (faster there), verify-sized ones through the
    prepacked weight."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setattr("runtime.target.cpu_packing.PACKED_MIN_FP32_ROWS", 4)
    monkeypatch.setattr("runtime.target.cpu_packing.OWN_FP32_KERNEL", False)
    linear = Linear(16, 8).requires_grad_(False)
    linear.pack()
    calls = []
    prepacked = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape) or prepacked(*a))
    for rows in (1, 3, 4, 9):
        x = torch.randn(1, rows, 16)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    assert calls == [(1, 4, 16), (1, 9, 16)]


@torch.no_grad()
@pytest.mark.parametrize("k,n", [(576, 576), (8960, 1536)], ids=["smollm2-square", "qwen-1.5b-down"])
def test_prepacked_bf16_products_give_every_row_its_one_row_result(k, n):
    """A tree verify must compute each row exactly as a one-token decode would (greedy speculation stays lossless).
    oneDNN's bf16 kernel alone sums a row differently below 5 rows than from 5 to 32 (the 1.5B's down projection on
    an AMX host) and above 32."""
    if not onednn_packs(torch.bfloat16):
        pytest.skip("oneDNN cannot prepack bf16 weights on this CPU")
    torch.manual_seed(0)
    linear = Linear(k, n, bias=False).to(torch.bfloat16).requires_grad_(False)
    linear.weight.normal_(0, 0.02)
    linear.pack()
    x = torch.randn(1, 70, k, dtype=torch.bfloat16)
    one_row = torch.cat([linear(x[:, i:i + 1]) for i in range(70)], dim=1)
    for rows in (4, 5, 9, 32, 70):
        assert torch.equal(linear(x[:, :rows]), one_row[:, :rows]), rows


def test_rms_norm_under_autocast_takes_the_fused_kernel_with_the_mixed_result():
    """bf16 activations with fp32 weights (distill's autocast): the mixed call runs unfused (and warns); ours
    computes the same values through the fused kernel."""
    from torch.profiler import profile

    torch.manual_seed(0)
    norm, x = RMSNorm(576, 1e-5), torch.randn(64, 576).bfloat16()
    norm.weight.data.normal_()
    mixed = torch.nn.functional.rms_norm(x, (576,), norm.weight, 1e-5)
    with profile() as prof:
        ours = norm(x)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, mixed)
    assert "aten::_fused_rms_norm" in {e.name for e in prof.events()}


def test_unsupported_configs_are_rejected(tiny_llama_dir, tmp_path):
    hf = json.loads((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        ModelConfig.from_hf({**hf, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        ModelConfig.from_hf({**hf, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    legacy = ModelConfig.from_hf({k: v for k, v in hf.items() if k != "rope_parameters"} | {"rope_theta": 5e5})
    assert legacy.rope_theta == 5e5
    with pytest.raises(ValueError, match="no config.json"):
        from_pretrained(tmp_path)


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_logits_match_transformers(smollm2_dir):
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(5))
    ref = hf_model(smollm2_dir)(ids).logits
    model = from_pretrained(smollm2_dir, max_seq_len=64)
    cache = model.new_cache()
    prefill = model(ids[:, :20], cache, positions_for(cache, 20)).logits
    cache.advance(20)
    decode = [prefill]
    for t in range(20, 24):
        decode.append(model(ids[:, t:t + 1], cache, positions_for(cache, 1)).logits)
        cache.advance(1)
    torch.testing.assert_close(torch.cat(decode, 1), ref, atol=1e-3, rtol=1e-4)
    assert torch.equal(torch.cat(decode, 1).argmax(-1), ref.argmax(-1))


@torch.no_grad()
def test_bf16_tree_verify_equals_one_token_decoding_bit_for_bit(tiny_llama_dir):
    """Greedy speculation in bf16 is lossless only if a node's logits in a tree verify are the very bits a
    one-token decode of the same path gives. The matmuls compute a row the same way whatever the batch; SDPA
    does not, so attention computes in fp64 (runtime.target.attention.exact_dtype). With bf16 SDPA instead, 4 of these
    24 nodes differ on the 2-core CI CPU."""
    model = from_pretrained(tiny_llama_dir, max_seq_len=160, dtype=torch.bfloat16)
    prefix, root, tree, _, verified = verify_random_tree(model, 100, 24)

    differs = []
    for node in range(len(tree)):
        decode = model.new_cache()
        model(prefix[None], decode, positions_for(decode, 100))
        decode.advance(100)
        for tok in torch.cat([root, tree.tokens[path_to(tree, node)]]):
            logits = model(tok.view(1, 1), decode, positions_for(decode, 1)).logits
            decode.advance(1)
        if not torch.equal(verified.logits[0, node + 1], logits[0, -1]):
            differs.append(node)
    assert not differs, f"nodes {differs} of {len(tree)}: tree-verify logits differ from one-token decoding"
