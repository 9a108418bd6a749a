"""The interfaces of a drafter: `Drafter`, what the engine drives while decoding, and `DrafterKind`, what the
stages need to know about one kind of drafter (runtime/drafters holds one module per kind)."""
from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree
from runtime.target.attention import query_slices

if TYPE_CHECKING:
    from runtime.target.model import ForwardOutput, Transformer


class Drafter(abc.ABC):
    """Proposes draft trees below the root, the last committed token (not yet in the target KV cache).

    Sequence bookkeeping: after reset(x_0..x_n, f_0..f_{n-1}) the root is x_n; commit(tokens, features) appends
    the accepted path plus the target's next token, and the features of the rows that produced them (old root
    and accepted nodes), so len(features) == len(tokens) - 1 holds over the whole sequence.
    """

    vocab_size: int
    needs_features: bool = False  # True: the engine passes what the drafter reads of each target forward:
    # the residual streams entering `feature_layers`, concatenated, or with () the final hidden (after its norm)
    feature_layers: tuple[int, ...] = ()
    # True: propose() also gathers draft_attention(); only SpecAttn verification reads it (the engine sets it)
    track_attention: bool = False
    # the draft layers draft_attention() holds, in this order: the engine asks for those its layer map reads; a
    # drafter that cannot leave layers out keeps None (every layer)
    attention_layers: tuple[int, ...] | None = None

    @abc.abstractmethod
    def reset(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """Start a new sequence: tokens [n+1] long, features [n, H] or None."""

    @abc.abstractmethod
    def propose(self, budget: DraftBudget, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree:
        """A tree within the budget. Siblings must be listed in the order they were drawn (draw_children)."""

    @abc.abstractmethod
    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """Append newly committed tokens [m] and their features [m, H] (or None)."""

    def read_target_cache(self, cache: Any) -> bool:
        """Read the committed sequence's KV from the target's own cache (`cache`: one sequence, committed up to the
        root) instead of a cache of one's own, where this drafter can: True if it does from now on. Such a drafter
        writes only past the cache's length (the verify then overwrites those slots) and never advances or compacts
        it. The default keeps its own (False)."""
        return False

    def use_static(self, use_graph: bool, compile: bool = False) -> None:
        """EngineConfig.static_verify: draft at static shapes too, as CUDA graphs where `use_graph` (each step fused
        by torch.compile first where `compile`), where this drafter can (EAGLE's greedy trees); the default keeps
        drafting as it is."""

    def draft_attention(self) -> torch.Tensor | None:
        """SpecAttn: how the last propose()'s root and tree queries attended to the committed prefix, as
        non-negative weights over the target's key positions 0..prefix-1, [draft layers, heads, prefix] (those of
        attention_layers where set); None after a commit or while track_attention is off. Drafters without attention
        return None (the default), and verification stays dense."""
        return None

    def batched(self, rows: int) -> "BatchDrafter | None":
        """This drafter's kind drafting `rows` sequences at once, each row's draft forwards run together (a fresh
        state, this drafter's weights); None (the default): runtime.drafters.shared.batch_drafter keeps one drafter per
        row."""
        return None


class BatchDrafter(abc.ABC):
    """Drafts for the rows of a batch (runtime.serving.batch_engine): row r's sequence bookkeeping is a Drafter's
    (reset, propose, commit), and `move` follows the engine when it packs its busy rows together."""

    vocab_size: int
    needs_features: bool = False
    feature_layers: tuple[int, ...] = ()  # as Drafter's

    @abc.abstractmethod
    def reset(self, row: int, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """Start row's new sequence, as Drafter.reset."""

    @abc.abstractmethod
    def propose(self, rows: list[int], budgets: list[DraftBudget], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[DraftTree]:
        """One tree for each of `rows`, within its budget, as Drafter.propose."""

    @abc.abstractmethod
    def commit(self, rows: list[int], tokens: list[torch.Tensor], features: list[torch.Tensor | None]) -> None:
        """Append each row's committed tokens and their features, as Drafter.commit."""

    @abc.abstractmethod
    def move(self, src: int, dst: int) -> None:
        """Row src's sequence becomes row dst's; row src is left free."""

    def read_target_cache(self, row_cache: Callable[[int], Any]) -> None:
        """Drafter.read_target_cache for each row's drafter that can: `row_cache(r)` is the target's cache of row r.
        The default keeps every row's own."""


@dataclass(frozen=True)
class EngineExport:
    """A drafter in the layout a serving engine loads: config.json, the tensors of its weights file under the
    names the engine's loader maps (exactly `expected`: export refuses a missing or an unexpected one), and any
    other files (name -> bytes)."""
    format: str
    config: dict
    tensors: dict[str, Tensor]
    expected: tuple[str, ...]
    files: dict[str, bytes] = field(default_factory=dict)
    launch_flags: tuple[str, ...] = ()  # how the engine is told to serve it; "{dir}" stands for the export's dir


class DrafterKind:
    """One kind of drafter for the stages that train, calibrate, export and serve it. Its module in
    runtime/drafters defines it as `KIND`; its training recipe lives in train/recipes/<name>.py. A method a kind
    does not support raises ValueError naming the kind and what it lacks."""

    name: ClassVar[str]
    weighted: ClassVar[bool] = True  # trained weights; False: built from its config alone
    calibrates: ClassVar[bool] = True  # calibrate picks its KV scheme and draft budget (weightless kinds too)
    attends: ClassVar[bool] = False  # its attention can select the target's keys (SpecAttn's layer map)
    module_type: ClassVar[type | None] = None  # the class of its trained module; None: weightless
    onnx_inputs: ClassVar[tuple[str, ...]] = ()  # its ONNX step's input and output names; (): no ONNX step
    onnx_outputs: ClassVar[tuple[str, ...]] = ()
    engine_formats: ClassVar[tuple[str, ...]] = ()  # the serving-engine layouts engine_exports answers for

    def unsupported(self, what: str) -> ValueError:
        return ValueError(f"a {self.name} drafter has no {what}")

    def config(self, module: nn.Module | None, draft_vocab: int, settings: Any) -> dict:
        """drafter_config.json: with the weights, everything `module` needs to rebuild a trained drafter.
        `settings`: the run's drafter section (pipeline.config.DrafterCfg)."""
        raise NotImplementedError

    def streams(self, settings: Any, n_layers: int) -> tuple[int, ...]:
        """The target layers whose entering residual streams this kind reads beside the final hidden state (prepare
        caches them); ValueError where `settings` name layers a target `n_layers` deep does not have."""
        return ()

    def reads(self, module: nn.Module) -> tuple[int, ...]:
        """The layers whose entering residual streams a trained module of this kind reads (streams, once built)."""
        return ()

    def module(self, config: dict, target: Transformer, max_len: int, keep_ids: Tensor | None) -> nn.Module:
        """The untrained module a config describes; `keep_ids`: its reduced draft vocabulary, if any."""
        raise self.unsupported("weights")

    def drafter(self, module: nn.Module | None, config: dict, target: Transformer, max_len: int,
                keep_ids: Tensor | None) -> Drafter:
        """The Drafter the engine drives around a trained module (None for a weightless kind); `keep_ids` is a
        reduced draft vocabulary where the module's head does not carry it."""
        raise NotImplementedError

    def onnx_step(self, module: nn.Module) -> nn.Module:
        """The cache-free step export writes to ONNX, taking onnx_inputs and returning onnx_outputs."""
        raise self.unsupported("ONNX step")

    def onnx_example(self, module: nn.Module, batch: int, seq: int, generator: torch.Generator) -> dict[str, Tensor]:
        """Random inputs of onnx_inputs' names and shapes."""
        raise self.unsupported("ONNX step")

    def draft_attention(self, module: nn.Module, target_out: ForwardOutput, ids: Tensor,
                        kv_heads: int = 0) -> Tensor:
        """SpecAttn calibration: [draft layers, heads, T, T], query t's weights over the target's keys 0..t as the
        drafter sees them when it proposes x_{t+1}; `target_out` is the target's forward over `ids` [T].
        kv_heads > 0: the heads averaged into the target's kv-head groups as each layer is tapped (head_groups)."""
        raise self.unsupported("attention over the target's keys")

    def draft_attention_slices(self, module: nn.Module, target_out: ForwardOutput, ids: Tensor, kv_heads: int,
                               rows: int, layers: tuple[int, ...] | None = None) -> Iterator[Tensor]:
        """draft_attention `rows` queries at a time, each slice over the keys up to its last query: a long row's in
        bounded memory; only the draft `layers` (default all), in their order. The default slices the whole; a kind
        that can compute a slice alone holds one at a time."""
        attention = self.draft_attention(module, target_out, ids, kv_heads)
        return query_slices(attention if layers is None else attention[list(layers)], rows)

    def engine_exports(self, module: nn.Module, verifier: dict,
                       speculative_tokens: int = 5) -> dict[str, EngineExport | str]:
        """The serving-engine layouts of this kind (engine_formats), by format name: this drafter in it, or why it
        cannot express it. `verifier`: the target's name_or_path and architectures; `speculative_tokens`: the draft length the
        engine is told to propose."""
        return {}

    def hf_assistant(self, config: dict) -> nn.Module | None:
        """For HF assisted generation as validate's peer: the untrained module of `config`, built without the
        target, whose trained weights make an HF causal LM (hf_causal_lm); None where the kind has none."""
        return None

    def hf_causal_lm(self, module: nn.Module) -> nn.Module:
        """The HF causal LM with a trained hf_assistant module's weights."""
        raise self.unsupported("HF assistant")
