"""The one typed definition of a run's configuration.

YAML files under `configs/` override these defaults, `key=value` overrides (dotted paths) override the file.
Unknown or mistyped keys are a one-line error naming the key and where it came from.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from pipeline.code_requests import CODE_REQUESTS
from pipeline.errors import DraftsmithError
from runtime.target.precision import PRECISIONS


# keys that change how fast a stage runs, not what it writes: left out of its inputs digest (pipeline.stages), so
# changing them neither reruns a finished stage nor loses a killed one's resumable work
DIGEST_EXEMPT = ("data.regen_concurrency", "data.regen_retries", "data.regen_timeout_s", "data.regen_api_key_env")
# an optional string where an empty one (`key=` on the command line, as the DAG passes an unset param) means None
Blankable = Annotated[str | None, BeforeValidator(lambda v: None if isinstance(v, str) and not v.strip() else v)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class RunCfg(Section):
    dir: str = "runs"  # run store root; runs/<run_id>/<stage>/
    seed: int = 0


class DataCfg(Section):
    source: str = "sharegpt"  # preset name or a ShareGPT-style .json/.jsonl file
    max_records: int = Field(900, ge=1)
    max_length: int = Field(384, ge=16)  # tokens per templated conversation; longer ones are truncated
    min_assistant_tokens: int = Field(8, ge=1)
    val_fraction: float = Field(0.05, gt=0, lt=1)
    regenerate: bool = True  # replace assistant turns with the target's own answers (self-distillation)
    regen_max_new_tokens: int = Field(160, ge=1)
    regen_temperature: float = Field(0.0, ge=0)
    regen_batch_size: int = Field(32, ge=1)  # sequences decoded together (continuous batching)
    # regeneration through an OpenAI-compatible server instead of the local target (docs/config.md)
    regen_url: str | None = None  # its base URL, e.g. http://127.0.0.1:8000/v1; None: the target regenerates here
    regen_model: str | None = None  # the served model id; None: the one GET /v1/models lists
    regen_api_key_env: str = "DRAFTSMITH_REGEN_API_KEY"  # environment variable holding its API key (unset: none)
    regen_concurrency: int = Field(16, ge=1)  # conversations in flight
    regen_retries: int = Field(5, ge=0)  # per request, on 408/409/429/5xx, timeouts and refused connections
    regen_timeout_s: float = Field(600.0, gt=0)  # per request
    cache_hidden: bool = True  # store target hidden states on disk (offline distillation)
    precision: Literal[PRECISIONS] = "auto"  # the target's weights while regenerating and caching features
    # served traffic (pipeline.traffic): a SQLAlchemy URL of the database `pipeline serve --openai --capture` writes
    traffic: Blankable = None
    traffic_share: float = Field(0.5, gt=0, le=1)  # of the training rows; 1: traffic alone (base val still read)
    traffic_holdout: float = Field(0.1, gt=0, lt=1)  # the most recent share of traffic rows, held out for validate
    traffic_rows: int = Field(20_000, ge=2)  # the newest rows read
    traffic_sampled: Literal["keep", "drop"] = "keep"  # rows served at temperature > 0

    @field_validator("regenerate")
    @classmethod
    def _answered(cls, regenerate: bool, info: ValidationInfo) -> bool:
        if not regenerate and info.data.get("source") == CODE_REQUESTS:
            raise ValueError(f"expected true: data.source {CODE_REQUESTS} holds requests only, for the target to answer")
        return regenerate

    @field_validator("regen_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError("expected an http:// or https:// base URL such as http://127.0.0.1:8000/v1")
        return url


class DrafterCfg(Section):
    kind: str = "eagle"  # a module of runtime/drafters
    draft_vocab: int = Field(8192, ge=0)  # reduced draft vocabulary (most frequent train tokens); 0 = full
    medusa_heads: int = Field(4, ge=1)
    max_ngram: int = Field(4, ge=1)  # ngram drafter: longest suffix matched
    depth: int = Field(6, ge=1)  # draft tree budget used by validate and serving
    width: int = Field(4, ge=1)
    nodes: int = Field(24, ge=0)
    lookup: int = Field(16, ge=0)  # n-gram lookup branch merged into greedy draft trees, calibrate tries 0 and this
    lookup_corpus: bool = True  # the branch drafts from the target's training answers where a reply has no match
    lm_layers: int = Field(4, ge=1)  # lm: decoder layers of the small independent LM
    lm_init: Literal["target", "random"] = "target"  # lm: start from the target's embeddings and first layers
    lm_base: str | None = None  # lm: an existing small causal LM (HF dir or hub id) to LoRA-tune instead
    lora_rank: int = Field(16, ge=1)  # lm_base: peft LoRA rank
    # eagle3: the target layers whose entering residual streams it fuses (low, middle, high; vLLM's count);
    # None: 2, L/2 and L-3
    aux_layers: list[int] | None = None
    # quantspec: the draft copy's weights, one of runtime.target.quantized_copy.SCHEMES; "auto": int4-g32 where our
    # int4 kernel runs, else int8
    quant_weights: str = "auto"

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        from runtime.drafters import kind_names

        if kind not in kind_names():
            raise ValueError(f"expected one of {', '.join(kind_names())}")
        return kind

    @field_validator("quant_weights")
    @classmethod
    def _known_scheme(cls, scheme: str) -> str:
        from runtime.target.quantized_copy import SCHEMES

        if scheme not in ("auto", *SCHEMES):
            raise ValueError(f"expected auto or one of {', '.join(SCHEMES)}")
        return scheme


class DistillCfg(Section):
    steps: int = Field(1400, ge=0)  # 0: the drafter as built, untrained (an lm drafter's lm_base as it is)
    batch_size: int = Field(8, ge=1)
    lr: float = Field(1e-3, gt=0)
    warmup: int = Field(50, ge=0)
    weight_decay: float = Field(1.0, ge=0)  # AdamW's, on weight matrices: the eagle head memorises its few rows
    ckpt_every: int = Field(250, ge=1)
    noise: float = Field(0.1, ge=0)  # eagle: uniform noise on input features
    # eagle, eagle3: draft depths trained the way they are drafted (1 = teacher forcing); None: the kind's default
    ttt_depth: int | None = Field(None, ge=1)
    ttt_decay: float | None = Field(None, gt=0, le=1)  # eagle, eagle3: depth d's loss weighs decay**(d-1); None: kind's
    token_candidates: int = Field(8, ge=0)  # eagle: soft CE over the batch goals' top-k ids only (0: all)
    eval_every: int = Field(250, ge=0)  # steps between simulated-tau evaluations on validation rows (0: end only)
    eval_rows: int = Field(16, ge=1)  # validation rows in each evaluation
    deepspeed: str | None = None  # path to a deepspeed JSON config, or zero1|zero2|zero3
    kd_loss: Literal["forward_kl", "tv"] = "forward_kl"  # lm: distance to the target's next-token distribution
    precision: Literal[PRECISIONS] = "auto"  # training matmuls; auto: bf16 autocast where the hardware is fast
    # an alias of register.model_name (e.g. champion) whose drafter training starts from; None or no such version:
    # from scratch
    warm_start: Blankable = None
    warm_steps: int = Field(300, ge=1)  # steps when warm-started (instead of `steps`)


class CalibrateCfg(Section):
    tau_tolerance: float = Field(0.02, ge=0, le=1)  # pick the most compressed setting within this tau drop
    ppl_tolerance: float = Field(0.01, ge=0)  # relative target perplexity increase allowed (KV quant, SpecAttn)
    weight_schemes: list[str] = ["int8", "int4-g128", "int4-g64", "int4-g32"]  # drafter weights
    kv_schemes: list[str] = ["int8", "int4", "hier-int4"]  # KV cache of target and drafter
    kv_recent: int = Field(64, ge=0)  # most recent tokens kept in full precision (rollback never requantises)
    # a KV scheme whose decode step (validate's precision, this device) is slower than a full-precision cache's by
    # more than this share is not chosen: where the history is dequantised on every read, compression costs speed
    kv_max_slowdown: float = Field(0.05, ge=0)
    prompts: int = Field(4, ge=1)  # calibration prompts from the validation split
    tokens: int = Field(256, ge=8)  # tokens per calibration row
    # held-out prompts the draft budget's finalists are timed on (successive halving), after validate's own where
    # the split has more; on a large target each is a generation per budget, most of calibrate's time
    budget_prompts: int = Field(12, ge=1)
    # > 0: KV schemes and the SpecAttn top-p are measured at this many tokens of context (held-out conversations
    # joined), where they pay off; 0: on the calibration rows above
    context: int = Field(0, ge=0)
    dense_first: int = Field(2, ge=0)  # SpecAttn: the first target layers always attend densely
    top_p: list[float] = [0.5, 0.8, 0.9, 0.95, 0.99]  # SpecAttn: draft attention mass kept per head


class ExportCfg(Section):
    onnx: bool = True


class GateCfg(Section):
    min_tau: float = Field(1.5, ge=1)
    min_speedup: float = Field(1.0, ge=0)  # over our own autoregressive decode
    require_lossless: bool = True


class ValidateCfg(Section):
    # the target and drafter while validating (and while calibrate times draft budgets); auto: bf16 where it is
    # fast, as serving would run. Our decode is then lossless too (runtime.target.attention.exact_dtype); HF runs
    # in it too
    precision: Literal[PRECISIONS] = "auto"
    num_prompts: int = Field(16, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    temperatures: list[float] = [0.0]
    # runs of each method per prompt, the methods taking turns; the fastest counts (the least disturbed by the host)
    repeats: int = Field(1, ge=1)
    gate: GateCfg = GateCfg()


class RegisterCfg(Section):
    model_name: str = "draftsmith-drafter"
    tracking_uri: str | None = None  # default: sqlite under the run store


class PromoteCfg(Section):
    metric: str = "speedup"
    # a candidate validated against the champion on served traffic (data.traffic) is promoted when its traffic tau
    # beats the champion's and its base tau is at most this much below; `metric` is not read then
    base_margin: float = Field(0.05, ge=0)


# Stage names double as section names; `validate`/`register` shadow deprecated BaseModel methods, harmlessly.
warnings.filterwarnings("ignore", message='Field name "(validate|register)"', category=UserWarning)


class Config(Section):
    target: str = "smollm2-135m-instruct"
    expected_minutes: int | None = Field(None, ge=1)  # a full run's measured wall time, said when it starts
    run: RunCfg = RunCfg()
    data: DataCfg = DataCfg()
    drafter: DrafterCfg = DrafterCfg()
    distill: DistillCfg = DistillCfg()
    calibrate: CalibrateCfg = CalibrateCfg()
    export: ExportCfg = ExportCfg()
    validate: ValidateCfg = ValidateCfg()
    register: RegisterCfg = RegisterCfg()
    promote: PromoteCfg = PromoteCfg()


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise DraftsmithError(f"override {dotted}: {p} is not a section")
    node[leaf] = value


def parse_overrides(pairs: list[str]) -> dict:
    tree: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise DraftsmithError(f"override {pair!r}: expected key=value, e.g. distill.steps=200")
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    return tree


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _explain(err: ValidationError, origin: str) -> DraftsmithError:
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden":
        return DraftsmithError(f"{origin}: unknown key '{key}'")
    return DraftsmithError(f"{origin}: {key}: {e['msg']} (got {e.get('input')!r})")


def load_config(path: str | Path | None = None, overrides: list[str] = (), base: dict | None = None) -> Config:
    """Defaults <- `base` (e.g. a run's saved config) <- YAML file <- key=value overrides."""
    tree = dict(base or {})
    origin = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise DraftsmithError(f"config {path}: no such file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise DraftsmithError(f"config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise DraftsmithError(f"config {path}: expected a mapping of sections at the top level")
        tree = _merge(tree, data)
        origin = str(path)
    try:
        Config.model_validate(tree)
    except ValidationError as e:
        raise _explain(e, origin) from None
    if overrides:
        tree = _merge(tree, parse_overrides(list(overrides)))
        try:
            return Config.model_validate(tree)
        except ValidationError as e:
            raise _explain(e, "override") from None
    return Config.model_validate(tree)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
