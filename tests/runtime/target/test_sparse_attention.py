"""Attention backends and SpecAttn sparse verification: registry, exactness of the sparse path, minimal top-p
key sets, the EAGLE and lm draft attention's alignment, and the engine verifying sparsely (through sdpa's masks and
the Triton kernel that reads only the kept keys)."""
import os
from dataclasses import replace

import pytest
import torch

from runtime.drafters.lm import LMDrafter
from runtime.drafters.shared.eagle_drafting import EagleDrafter
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.drafter import Drafter
from runtime.speculation.engine import Engine, EngineConfig
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree
from runtime.target.attention import (BACKEND_ENV, BACKENDS, SdpaBackend, SpecAttnConfig, head_groups, kept_keys,
                                      pick_backend)
import runtime.target.attention.triton_sparse
from runtime.target.loading import from_pretrained
from runtime.target.model import Taps
from support.helpers import run_in_triton_interpreter
from train.recipes import eagle as eagle_recipe
from train.recipes import lm as lm_recipe

N_LAYERS = 4


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    # 4 query heads over 2 kv heads: the kept sets are per kv head, shared by its query heads
    return from_pretrained(tiny_model_dir("llama", num_hidden_layers=N_LAYERS, initializer_range=0.3),
                                       max_seq_len=128)


@pytest.fixture(scope="module")
def eagle(target):
    return eagle_recipe.build_eagle(target, None).eval()  # "one more target layer": untrained, but it attends


def test_registry_picks_sdpa_on_cpu_and_honours_an_override(monkeypatch, target):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert pick_backend(torch.device("cpu")).name == "sdpa"

    class Counting(SdpaBackend):
        name = "counting"
        calls = 0

        def __call__(self, *args):
            Counting.calls += 1
            return super().__call__(*args)

    monkeypatch.setitem(BACKENDS, "counting", Counting())
    assert pick_backend(torch.device("cpu")).name == "sdpa"  # not in the automatic order: only when named
    assert pick_backend(torch.device("cpu"), "counting").name == "counting"
    monkeypatch.setenv(BACKEND_ENV, "counting")
    target(torch.tensor([[1, 2, 3]]), target.new_cache(), torch.arange(3)[None])
    assert Counting.calls == N_LAYERS  # the model's attention goes through the interface
    monkeypatch.setenv(BACKEND_ENV, "nope")
    with pytest.raises(ValueError, match="'nope' is not available"):
        pick_backend(torch.device("cpu"))


def reference_attention(q, keys, values, mask, keep):
    """Per query head, repeating kv heads: softmax over the keys both `mask` and `keep` allow."""
    G = q.shape[1] // keys.shape[1]
    allowed = mask & keep.repeat_interleave(G, dim=1)
    scores = (q @ keys.repeat_interleave(G, 1).transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values.repeat_interleave(G, 1)


def test_sdpa_sparse_equals_reference_and_keep_all_equals_dense():
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, S, D = 2, 6, 3, 4, 13, 8
    q, keys, values = (torch.randn(*shape, generator=g) for shape in ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    mask = torch.rand(B, 1, T, S, generator=g) > 0.3
    mask[..., 0] = True
    sdpa = BACKENDS["sdpa"]
    for rows in (1, T):  # one kept set for every query (serving) or one per query (teacher-forced calibration)
        keep = torch.rand(B, Hkv, rows, S, generator=g) > 0.5
        keep[..., 0] = True
        torch.testing.assert_close(sdpa(q, keys, values, mask, keep), reference_attention(q, keys, values, mask, keep))
        assert torch.equal(sdpa(q, keys, values, mask, torch.ones_like(keep)), sdpa(q, keys, values, mask, None))


def sort_based_topp(w: torch.Tensor, p: float) -> torch.Tensor:
    """Keep-mask of the smallest set of largest weights whose mass reaches p (w has no ties)."""
    order = w.sort(-1, descending=True)
    before = order.values.cumsum(-1) - order.values  # mass of the strictly larger weights
    return torch.zeros_like(w, dtype=torch.bool).scatter(-1, order.indices, before < p)


@pytest.mark.parametrize("p", [0.3, 0.7, 0.95])
def test_kept_keys_are_the_minimal_set_reaching_p_plus_the_always_kept(p):
    g = torch.Generator().manual_seed(1)
    Ld, H, Hkv, R, P, n_new, sink, recent = 2, 4, 2, 3, 40, 5, 2, 3
    att = torch.rand(Ld, H, R, P, generator=g) ** 4
    keep = kept_keys(att, torch.full((R,), P), P + n_new, Hkv, p, sink, recent)
    assert keep.shape == (Ld, Hkv, R, P + n_new)
    w = att.view(Ld, Hkv, 2, R, P).mean(2)[..., sink:P - recent]  # sinks' and recent keys' mass does not count
    expected = torch.ones(Ld, Hkv, R, P, dtype=torch.bool)
    expected[..., sink:P - recent] = sort_based_topp(w / w.sum(-1, keepdim=True), p)
    assert torch.equal(keep[..., :P], expected)
    assert keep[..., P:].all()  # the tokens being verified
    assert (keep[..., :P].sum(-1) < P).all()  # it does select

    assert kept_keys(att, torch.full((R,), P), P + n_new, Hkv, 1.0, 0, 0).all()
    # per-row prefixes (teacher forcing): keys at or beyond a row's prefix are the row's own tokens, always kept
    rows = kept_keys(att, torch.tensor([10, 25, 40]), P, Hkv, p, 0, 0)
    assert rows[:, :, 0, 10:].all() and rows[:, :, 1, 25:].all() and not rows[:, :, 2].all()
    # draft heads that do not group onto the kv heads (3 onto 2): each kv head keeps what all of them averaged rank
    odd = kept_keys(att[:, :3], torch.full((R,), P), P + n_new, Hkv, p, sink, recent)
    averaged = kept_keys(att[:, :3].mean(1, keepdim=True), torch.full((R,), P), P + n_new, 1, p, sink, recent)
    assert torch.equal(odd, averaged.expand(Ld, Hkv, R, P + n_new))


def test_settings_over_the_draft_layers_they_read_give_each_target_layer_the_same_keys():
    """SpecAttnConfig.over: the keep masks of only the draft layers the map reads, in their order, reach every
    target layer as the masks of all the draft layers do."""
    sparse = SpecAttnConfig((6, -1, 5, 3, 7, 5), 0.9, dense_first=1)  # draft layer 6 below dense_first: unread
    assert sparse.draft_layers() == (3, 5, 7)
    keep = torch.rand(8, 2, 3, 4) > 0.5
    every, read = sparse.layer_keep(keep), sparse.over((3, 5, 7)).layer_keep(keep[[3, 5, 7]])
    assert [k is None for k in read] == [k is None for k in every] == [True, True, False, False, False, False]
    assert all(torch.equal(a, b) for a, b in zip(every[2:], read[2:]))


@pytest.mark.parametrize("heads", [4, 3])  # two per kv head; three that do not group onto 2
def test_draft_heads_averaged_early_keep_the_same_keys(heads):
    """What lets a long calibration row keep its draft attention averaged per kv head (head_groups) as it is tapped."""
    g = torch.Generator().manual_seed(3)
    att = torch.rand(2, heads, 3, 40, generator=g) ** 4
    prefix = torch.full((3,), 40)
    grouped = head_groups(att, 2)
    assert grouped.shape == (2, 2 if heads == 4 else 1, 3, 40)
    assert torch.equal(kept_keys(grouped, prefix, 45, 2, 0.7, 2, 3), kept_keys(att, prefix, 45, 2, 0.7, 2, 3))


def test_attention_taps_averaged_per_kv_head_are_the_plain_taps_averaged(target):
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    layers = tuple(range(target.config.n_layers))
    plain, grouped = (target(ids, target.new_cache(), torch.arange(12)[None],
                             taps=Taps(attention_layers=layers, attention_groups=groups)) for groups in (0, 2))
    for i in layers:
        assert grouped.attention[i].shape[1] == 2
        torch.testing.assert_close(grouped.attention[i], head_groups(plain.attention[i], 2))


def test_taps_of_the_last_row_are_the_last_row_of_every_rows_taps(target):
    """A drafter's root forward after a long prompt reads only its last row's weights (LMDrafter.propose, root_taps)."""
    ids = torch.randint(0, 96, (1, 18), generator=torch.Generator().manual_seed(8))
    layers = tuple(range(target.config.n_layers))
    for cached in (0, 11):  # the whole prompt at once, and its tail after a cached prefix
        outs = []
        for last_row in (False, True):
            cache = target.new_cache()
            if cached:
                target(ids[:, :cached], cache, torch.arange(cached)[None])
                cache.advance(cached)
            outs.append(target(ids[:, cached:], cache, torch.arange(cached, 18)[None],
                               taps=Taps(attention_layers=layers, attention_last_row=last_row)))
        every, last = outs
        for i in layers:
            assert last.attention[i].shape == (1, target.config.n_heads, 1, 18)
            torch.testing.assert_close(last.attention[i], every.attention[i][:, :, -1:])


def tree(*parents):
    return DraftTree(torch.arange(5, 5 + len(parents)), torch.tensor(parents))


def test_model_keep_all_equals_dense_bit_for_bit(target):
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    t = tree(-1, 0, 0, 1)
    outputs = []
    for keep_all in (False, True):
        cache = target.new_cache()
        target(ids, cache, torch.arange(30)[None])
        cache.advance(30)
        tokens = torch.cat([torch.tensor([7]), t.tokens])[None]
        keep = [None, None] + [torch.ones(1, 2, 1, 35, dtype=torch.bool)] * (N_LAYERS - 2) if keep_all else None
        outputs.append(target(tokens, cache, 30 + torch.cat([torch.tensor([0]), t.depths()])[None],
                              t.ancestor_mask(), kv_keep=keep).logits)
    assert torch.equal(*outputs)


def test_eagle_draft_attention_is_aligned_to_target_keys(target, eagle):
    prompt = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(3))
    cache = target.new_cache()
    hidden = target(prompt[None], cache, torch.arange(20)[None]).hidden
    drafter = EagleDrafter(eagle, 128)
    drafter.reset(torch.cat([prompt, torch.tensor([9])]), hidden[0])
    drafter.propose(DraftBudget(depth=1, width=2), SamplingParams())
    assert drafter.draft_attention() is None  # gathered only for SpecAttn, which turns track_attention on
    drafter.reset(torch.cat([prompt, torch.tensor([9])]), hidden[0])
    drafter.track_attention = True
    assert drafter.draft_attention() is None
    drafter.propose(DraftBudget(depth=1, width=2), SamplingParams())  # depth 1: the root query alone
    att = drafter.draft_attention()
    assert att.shape == (1, 4, 20) and (att[..., 0] == 0).all()
    # the root pair (x_20, f_19) sits in slot 19; slots 0..18 stand for target keys 1..19
    _, w = eagle.causal_step(torch.cat([prompt[1:], torch.tensor([9])])[None], hidden, eagle.new_cache(1, 20),
                             want_weights=True)
    torch.testing.assert_close(att[0, :, 1:], w[0, :, -1, :19])
    drafter.commit(torch.tensor([9]), hidden[0, :1])
    assert drafter.draft_attention() is None


def test_lm_draft_attention_is_every_layers_rows_over_the_prefix(target):
    lm = lm_recipe.build_lm(target, 2, "target").eval()
    prompt = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(5))
    tokens = torch.cat([prompt, torch.tensor([9])])  # the root, 9, sits at position 20 after keys 0..19
    drafter = LMDrafter(lm, 128)
    drafter.reset(tokens)
    drafter.propose(DraftBudget(depth=1, width=2), SamplingParams())
    assert drafter.draft_attention() is None  # gathered only for SpecAttn, which turns track_attention on
    drafter.track_attention = True
    drafter.reset(tokens)
    drafter.propose(DraftBudget(depth=1, width=2), SamplingParams())  # depth 1: the root query alone
    att = drafter.draft_attention()
    assert att.shape == (2, 4, 20)
    out = lm(tokens[None], lm.new_cache(1, 21), torch.arange(21)[None], taps=Taps(attention_layers=(0, 1)))
    torch.testing.assert_close(att, torch.stack([out.attention[i][0, :, -1, :20] for i in (0, 1)]))
    drafter.reset(tokens)
    drafter.propose(DraftBudget(depth=3, width=2, nodes=4), SamplingParams())  # expanded nodes add their rows
    deeper = drafter.draft_attention()
    assert (deeper >= att - 1e-6).all() and (deeper.sum(-1) > att.sum(-1) + 0.5).all()
    drafter.commit(torch.tensor([3, 4]))
    assert drafter.draft_attention() is None


def test_engine_sparse_verification_with_an_lm_drafter(target):
    """An lm drafter made of every target layer attends exactly as the target does: mapped layer to layer, its
    attention selects keys for verification."""
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    lm = lm_recipe.build_lm(target, N_LAYERS, "target").eval()
    budget = DraftBudget(depth=3, width=2, nodes=5)

    def generate(sparse):
        engine = Engine(target, LMDrafter(lm, 128), EngineConfig(max_seq_len=128, budget=budget, sparse=sparse))
        return engine.generate(prompt, 16, SamplingParams())

    dense = generate(None)
    full = generate(SpecAttnConfig((-1, -1, 2, 3), top_p=1.0))
    assert full.tokens == dense.tokens and full.metrics.kv_saved == 0.0
    sparse = generate(SpecAttnConfig((-1, -1, 2, 3), top_p=0.5, sink=1, recent=2))
    assert 0 < sparse.metrics.kv_saved < 0.5  # two of four layers stay dense


class EveryLayerDrafter(LMDrafter):
    """An lm drafter that gathers every layer's attention whatever the engine asks (as before it could choose)."""
    attention_layers = property(lambda self: None, lambda self, layers: None)


def test_engine_has_an_lm_drafter_gather_only_the_layers_its_map_reads(target):
    """A map reading draft layers 1 and 3 of four: the drafter's forwards tap those two alone, and verification
    reads the same keys as with every layer gathered."""
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    lm = lm_recipe.build_lm(target, N_LAYERS, "target").eval()
    sparse = SpecAttnConfig((-1, -1, 3, 1), top_p=0.5, sink=1, recent=2)
    config = EngineConfig(max_seq_len=128, budget=DraftBudget(depth=3, width=2, nodes=5), sparse=sparse)
    tapped = set()
    forward = lm.forward
    lm.forward = lambda *args, taps=Taps(), **kw: tapped.add(taps.attention_layers) or forward(*args, taps=taps, **kw)

    def generate(kind):
        tapped.clear()
        return Engine(target, kind(lm, 128), config).generate(prompt, 16, SamplingParams()), set(tapped)

    (chosen, chosen_taps), (every, every_taps) = generate(LMDrafter), generate(EveryLayerDrafter)
    assert chosen_taps == {(1, 3)} and every_taps == {(0, 1, 2, 3)}
    assert chosen.tokens == every.tokens and chosen.metrics.kv_saved == every.metrics.kv_saved > 0


def test_engine_sparse_verification(target, eagle):
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    layer_map = (-1, -1, 0, 0)
    budget = DraftBudget(depth=3, width=2, nodes=5)

    def generate(sparse):
        engine = Engine(target, EagleDrafter(eagle, 128), EngineConfig(max_seq_len=128, budget=budget, sparse=sparse))
        return engine.generate(prompt, 16, SamplingParams())

    dense = generate(None)
    assert dense.metrics.kv_saved == 0.0
    full = generate(SpecAttnConfig(layer_map, top_p=1.0))
    assert full.tokens == dense.tokens and full.metrics.kv_saved == 0.0
    sparse = generate(SpecAttnConfig(layer_map, top_p=0.5, sink=1, recent=2))
    assert 0 < sparse.metrics.kv_saved < 0.5  # two of four layers stay dense
    assert generate(SpecAttnConfig(layer_map, top_p=0.5, dense_first=N_LAYERS)).metrics.kv_saved == 0.0


def check_triton_sparse_verifies_as_sdpa(model_dir: str) -> None:
    target = from_pretrained(model_dir, max_seq_len=128)
    calls, listings = [], []
    kernel, listing = runtime.target.attention.triton_sparse.sparse_attention_triton, runtime.target.attention.triton_sparse.kept_positions
    runtime.target.attention.triton_sparse.sparse_attention_triton = lambda *args: calls.append(1) or kernel(*args)
    listed = []  # (keys the keep mask spans, the most any kv head keeps)

    def listing_spy(keep):
        listings.append(1)
        positions, counts = listing(keep)
        listed.append((keep.shape[-1], int(counts.max())))
        return positions, counts

    runtime.target.attention.triton_sparse.kept_positions = listing_spy
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    config = EngineConfig(max_seq_len=128, budget=DraftBudget(depth=3, width=2, nodes=5),
                          sparse=SpecAttnConfig((-1, -1, 0, 0), top_p=0.5, sink=1, recent=2))
    drafter = EagleDrafter(eagle_recipe.build_eagle(target, None).eval(), 128)
    outs = {}
    for name in ("sdpa", "triton_sparse"):
        os.environ[BACKEND_ENV] = name
        outs[name] = Engine(target, drafter, config).generate(prompt, 16, SamplingParams())
    assert calls and len(calls) == 2 * len(listings)  # two sparse layers a verify share one listing of the keys
    # the static step too, as a CUDA graph captures it: kept keys over the whole static cache, narrowed in the step
    listed.clear()
    outs["static"] = Engine(target, drafter, replace(config, static_verify=True)).generate(prompt, 16, SamplingParams())
    # it lists only live keys and the step's: at most 40 + 16 + a bucket of 8 of the static cache's 128
    assert listed and all(span == 128 and kept <= 64 for span, kept in listed)
    for name in ("triton_sparse", "static"):
        assert outs[name].tokens == outs["sdpa"].tokens
        assert outs[name].metrics.kv_saved == outs["sdpa"].metrics.kv_saved > 0


def test_engine_verifies_through_the_triton_sparse_kernel_as_through_sdpa(tiny_model_dir):
    """The kernel in the engine, in Triton's CPU interpreter: the same tokens and reads as sdpa's masked path."""
    with pytest.raises(ValueError, match="cannot run on device 'cpu'"):
        pick_backend(torch.device("cpu"), "triton_sparse")  # outside the interpreter: CUDA only
    run_in_triton_interpreter(check_triton_sparse_verifies_as_sdpa,
                              str(tiny_model_dir("llama", num_hidden_layers=N_LAYERS, initializer_range=0.3)))


def test_engine_static_sparse_verification_is_the_eager_one(target, eagle, min_span):
    """The static (CUDA-graph) verify step with SpecAttn, run eagerly on the CPU: the eager sparse verify's tokens,
    acceptance and KV reads, with the kept keys over the whole static cache narrowed to the live ones; and so with
    compile_static, which leaves the sparse steps uncompiled (and compiles a dense one where a verify has no tree)."""
    prompt = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    sparse = SpecAttnConfig((-1, -1, 0, 0), top_p=0.5, sink=1, recent=2)
    runs = [Engine(target, EagleDrafter(eagle, 128), EngineConfig(
        max_seq_len=128, budget=DraftBudget(depth=3, width=2, nodes=5), sparse=sparse, static_verify=static,
        compile_static=compiled)).generate(prompt, 24, SamplingParams())
            for static, compiled in ((False, False), (True, False), (True, True))]
    for run in runs[1:]:
        assert run.tokens == runs[0].tokens and run.metrics.tau == runs[0].metrics.tau
        assert run.metrics.kv_saved == runs[0].metrics.kv_saved > 0


def test_engine_sparse_settings_are_checked(target, eagle):
    with pytest.raises(ValueError, match="top_p"):
        SpecAttnConfig((0,) * N_LAYERS, top_p=0.0)
    with pytest.raises(ValueError, match="one entry per target layer"):
        Engine(target, EagleDrafter(eagle, 128), EngineConfig(max_seq_len=128, sparse=SpecAttnConfig((0,), 0.9)))
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(target, None, EngineConfig(max_seq_len=128, sparse=SpecAttnConfig((0,) * N_LAYERS, 0.9)))

    class OneToken(Drafter):  # proposes one node and has no attention to share
        vocab_size = 96

        def reset(self, tokens, features):
            pass

        def commit(self, tokens, features):
            pass

        def propose(self, budget, params, generator=None):
            return DraftTree.chain(torch.tensor([5]))

    sparse = EngineConfig(max_seq_len=128, sparse=SpecAttnConfig((0,) * N_LAYERS, 0.9))
    with pytest.raises(ValueError, match="OneToken.draft_attention"):
        Engine(target, OneToken(), sparse).generate([1, 2, 3], 8)
    config = SpecAttnConfig((-1, 0, 0, 0), 0.8, dense_first=1, recent=4)
    assert SpecAttnConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="layer_map, top_p"):
        SpecAttnConfig.from_json('{"top_p": 0.9}')


def test_sdpa_converts_each_new_mask():
    """The backend converts a forward's mask once for all its layers; the next mask must be converted anew, or
    attention would read the previous one."""
    from runtime.target.attention import BACKENDS

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 3, 8, generator=gen), torch.randn(1, 2, 6, 8, generator=gen),
               torch.randn(1, 2, 6, 8, generator=gen))
    sdpa, dense_mask = BACKENDS["sdpa"], torch.ones(1, 1, 3, 6, dtype=torch.bool)
    narrow_mask = dense_mask.clone()
    narrow_mask[..., 4:] = False
    dense = sdpa(q, k, v, dense_mask, None)
    assert torch.equal(sdpa(q, k, v, dense_mask, None), dense)
    narrowed = sdpa(q, k, v, narrow_mask, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :4].repeat_interleave(2, 1),
                                                             v[:, :, :4].repeat_interleave(2, 1))
    torch.testing.assert_close(narrowed, want)
    assert not torch.allclose(dense, narrowed)
