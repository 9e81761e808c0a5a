"""The config schema: one pydantic model per section, unknown keys forbidden, values checked.

This module must stay cheap to import: no torch, no triton.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from flashrun.limits import DETERMINISTIC_BACKWARD, DTYPE_ALIASES, MAX_HEAD_DIM, MIN_HEAD_DIM

# The default config ships inside the package so that a non-editable install has it.
DEFAULT_CONFIG = Path(__file__).parents[1] / "data" / "default.toml"

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PathField = Annotated[Path, Field(strict=False)]


def _full_dtype(value: Any) -> Any:
    """``fp16``/``bf16``/``fp32`` (the names flashrun prints) -> the full name kept everywhere after."""
    return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value


Dtype = Annotated[Literal["float16", "bfloat16", "float32"], BeforeValidator(_full_dtype)]
HeadDim = Annotated[int, Field(ge=MIN_HEAD_DIM, le=MAX_HEAD_DIM)]



def _pair(value: Any) -> Any:
    """A window (or packed lengths) from TOML/JSON is a list; it is kept as a tuple."""
    return tuple(value) if isinstance(value, list) else value


def _window_sides(value: tuple[int, int]) -> tuple[int, int]:
    if any(side < -1 for side in value):
        raise ValueError(f"window sides are key counts >= 0, or -1 for unbounded, got {list(value)}")
    return value


# (left, right): query i sees keys i + off - left .. i + off + right (off = Nk - Nq); -1 unbounded
Window = Annotated[tuple[int, int], BeforeValidator(_pair), AfterValidator(_window_sides)]
Softcap = Annotated[float, Field(ge=0)]  # 0: none
# packed sequences' lengths, 0 allowed; a tuple, so that shapes and cases holding them hash
SeqLens = Annotated[tuple[NonNegativeInt, ...], BeforeValidator(_pair), Field(min_length=1)]


def _power_of_two(value: int | None, name: str) -> int | None:
    if value is not None and (value <= 0 or value & (value - 1)):
        raise ValueError(f"expected a power of two for {name}")
    return value


def _as_list(value: Any) -> Any:
    """Sweep keys accept a scalar or a list; a scalar is a one-element sweep."""
    return value if isinstance(value, list) or value is None else [value]


def _as_list_of_lists(value: Any) -> Any:
    """Sweep keys whose values are lists themselves (windows, packed lengths): one list of
    numbers is a one-element sweep, a list of lists the sweep."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value) \
            and value:
        return [list(value)]
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ApiConfig(_Section):
    base_url: str = "https://api.openai.com/v1"
    api_key_env: str = "OPENAI_API_KEY"
    # A literal key is accepted (with a warning) but never shown, dumped or logged.
    api_key: str | None = Field(default=None, repr=False, exclude=True)
    default_model: str = "gpt-4o-mini"
    models: list[str] = []
    timeout: PositiveFloat = 60.0
    max_retries: NonNegativeInt = 3


class RequestConfig(_Section):
    timeout: PositiveFloat | None = None  # overrides api.timeout for chat requests
    max_tokens: PositiveInt = 2048
    temperature: Annotated[float, Field(ge=0, le=2)] = 0.7


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    log_dir: PathField = Path("logs")


class ExperimentConfig(_Section):
    name: str = "flashrun"
    device: Literal["auto", "cuda", "cpu"] = "auto"
    dtype: Dtype = "float16"
    batch_size: PositiveInt = 2
    seq_len: PositiveInt = 128
    seq_len_k: PositiveInt | None = None  # key/value length; defaults to seq_len
    num_heads: PositiveInt = 4
    num_kv_heads: PositiveInt | None = None  # GQA/MQA; defaults to num_heads
    head_dim: HeadDim = 64
    causal: bool = False
    window: Window = (-1, -1)  # sliding window (left, right); -1 unbounded
    softcap: Softcap = 0.0  # > 0: scores become softcap·tanh(s / softcap)
    alibi: bool = False  # ALiBi with the standard slopes of num_heads
    seqlens: SeqLens | None = None  # packed sequences' query lengths (batch_size, seq_len follow)
    seqlens_k: SeqLens | None = None  # their key lengths; defaults to seqlens
    # a KV-cache call: each sequence's cached keys (batch_size, seq_len_k follow), the cache's
    # page size (0: contiguous), keys appended to each sequence by the call
    cache_seqlens: SeqLens | None = None
    page_size: NonNegativeInt = 0
    new_keys: NonNegativeInt = 0
    seed: int = 0
    kernel: list[str] = ["flash"]
    # flash's backward: true the bitwise-repeatable one, false the 5-matmul one that adds dQ with
    # atomics; unset, flashrun.limits.DETERMINISTIC_BACKWARD (the faster per call); flash-deterministic /
    # flash-atomic fix it
    deterministic: bool | None = DETERMINISTIC_BACKWARD

    _kernel_list = field_validator("kernel", mode="before")(_as_list)

    @model_validator(mode="after")
    def _heads_divide(self) -> ExperimentConfig:
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({kv})")
        return self

    @model_validator(mode="after")
    def _packed_lengths(self) -> ExperimentConfig:
        if self.seqlens_k is not None and self.seqlens is None:
            raise ValueError("seqlens_k needs seqlens (the query lengths of the packed sequences)")
        if self.seqlens is not None:
            if self.seqlens_k is not None and len(self.seqlens_k) != len(self.seqlens):
                raise ValueError(f"seqlens_k must give as many lengths as seqlens ({len(self.seqlens)}), "
                                 f"got {len(self.seqlens_k)}")
            if not any(self.seqlens) or not any(self.seqlens_k or self.seqlens):
                raise ValueError("packed sequences need at least one non-empty sequence")
        return self

    @model_validator(mode="after")
    def _cache_lengths(self) -> ExperimentConfig:
        if self.cache_seqlens is None and (self.page_size or self.new_keys):
            raise ValueError("page_size and new_keys describe a KV cache: they need cache_seqlens")
        if self.cache_seqlens is not None and self.seqlens is not None:
            raise ValueError("cache_seqlens (a KV-cache call) and seqlens (packed sequences) exclude each other")
        return self


class TritonConfig(_Section):
    """Launch overrides for our kernels; unset means the tuned table's config, else a heuristic one
    (GPU), or a fixed small config (CPU)."""

    # A key the tuned table misses is tuned on first use (10-20 s of compiling and timing per key)
    # instead of taking the heuristic config; verify then checks the table's/tuned configs.
    tune: bool = False
    num_warps: PositiveInt | None = None
    num_stages: PositiveInt | None = None
    block_m: PositiveInt | None = None
    block_n: PositiveInt | None = None

    @field_validator("num_warps", "block_m", "block_n")
    @classmethod
    def _pow2(cls, value: int | None, info: Any) -> int | None:
        return _power_of_two(value, info.field_name)

    @field_validator("block_m", "block_n")
    @classmethod
    def _block_range(cls, value: int | None) -> int | None:
        if value is not None and not 16 <= value <= 256:
            raise ValueError("expected a power of two from 16 to 256")
        return value


class VerifyConfig(_Section):
    """A sweep: any key given here replaces the [experiment] value with a list of values."""

    batch_size: list[PositiveInt] | None = None
    num_heads: list[PositiveInt] | None = None
    num_kv_heads: list[PositiveInt] | None = None
    seq_len: list[PositiveInt] | None = None
    seq_len_k: list[PositiveInt] | None = None
    head_dim: list[HeadDim] | None = None
    dtype: list[Dtype] | None = None
    causal: list[bool] | None = None
    window: list[Window] | None = None
    softcap: list[Softcap] | None = None
    alibi: list[bool] | None = None
    seqlens: list[list[NonNegativeInt]] | None = None  # [] in the list: not packed
    cache_seqlens: list[list[NonNegativeInt]] | None = None  # [] in the list: no KV cache
    page_size: list[NonNegativeInt] | None = None
    new_keys: list[NonNegativeInt] | None = None
    grad: bool = False
    diagnose: bool = False
    # Through the interpreter, a case expected to take longer than this many seconds is skipped
    # up front (with the reason); 0 runs everything.
    budget_s: Annotated[float, Field(ge=0)] = 120.0

    _lists = field_validator(
        "batch_size", "num_heads", "num_kv_heads", "seq_len", "seq_len_k", "head_dim", "dtype", "causal",
        "softcap", "alibi", "page_size", "new_keys", mode="before",
    )(_as_list)
    _pairs = field_validator("window", "seqlens", "cache_seqlens", mode="before")(_as_list_of_lists)


class CasesConfig(_Section):
    max_seq_len: PositiveInt = 16384
    count: PositiveInt = 12
    prompt: str | None = None


class BenchConfig(_Section):
    providers: list[str] = ["flash", "sdpa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", "torch-naive"]
    baseline: str = "sdpa"
    mode: list[Literal["fwd", "bwd", "fwd_bwd"]] = ["fwd"]
    dtype: list[Dtype] = ["float16"]
    seq_len: list[PositiveInt] = [512, 1024, 2048, 4096, 8192, 16384]
    seq_len_k: list[PositiveInt] | None = None  # decode-like shapes: seq_len queries against these key lengths
    head_dim: list[HeadDim] = [64, 128]
    causal: list[bool] = [False, True]
    hidden: PositiveInt = 2048  # heads = hidden // head_dim (the FlashAttention benchmark convention)
    tokens: PositiveInt = 32768  # batch = tokens // seq_len
    num_kv_heads: PositiveInt | None = None
    # variants: each list multiplies the sweep; varlen batches (lists of lengths) add packed shapes
    window: list[Window] = [(-1, -1)]
    softcap: list[Softcap] = [0.0]
    alibi: list[bool] = [False]
    varlen: list[SeqLens] | None = None
    # each dense shape also as a KV-cache call (every sequence's cache full: seq_len_k keys), once
    # per page size listed (0: a contiguous cache)
    page_size: list[NonNegativeInt] | None = None
    warmup_ms: PositiveInt = 25
    rep_ms: PositiveInt = 100
    out: PathField | None = None  # default <log_dir>/bench

    _lists = field_validator("mode", "dtype", "seq_len", "seq_len_k", "head_dim", "causal", "softcap", "alibi",
                             "page_size", mode="before")(_as_list)
    _pairs = field_validator("window", "varlen", mode="before")(_as_list_of_lists)


class ClusterConfig(_Section):
    """Scale-out over Ray (flashrun[ray]); 1 worker and no address: in this process, no Ray."""

    # Checks (verify) or shapes (bench) run at once: 1 runs them here, one after the other;
    # N > 1 starts a local Ray cluster for the command; with an address, caps what it uses.
    workers: PositiveInt = 1
    address: str | None = None  # an existing Ray cluster: "auto", "HOST:PORT" or "ray://HOST:PORT"

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError('expected "auto", "HOST:PORT" or "ray://HOST:PORT"')
        return None if value is None else value.strip()


class ModelConfig(_Section):
    """``flashrun model``: a kernel swapped into a transformers model (flashrun[model])."""

    arch: Literal["llama", "mistral", "qwen2", "gemma2"] = "llama"
    size: Literal["mini", "1b"] = "mini"
    # a local checkpoint folder (or a hub id already in the local cache) instead of arch/size
    path: str | None = None
    kernel: str = "flash"  # any verify kernel spec: flash, flash-atomic, PATH.py:FUNCTION
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"  # auto: float32 on the CPU, bfloat16 on a GPU
    batch: PositiveInt | None = None  # None: the size's default (mini 1, 1b 4)
    seq_len: PositiveInt | None = None  # None: the size's default (mini 32, 1b 2048)
    sliding_window: PositiveInt | None = None  # overrides the family's window (mistral, gemma2)
    checks: list[Literal["logits", "train-step", "training", "generate"]] = ["logits", "train-step", "training",
                                                                             "generate"]
    train_steps: PositiveInt = 20
    lr: PositiveFloat | None = None  # None: the size's default (mini 1e-3, 1b 1e-4)
    gen_tokens: PositiveInt | None = None  # None: the size's default (mini 16, 1b 64)
    speed: bool = True  # on a GPU: prefill, train step, decode and memory against the baselines
    baselines: list[Literal["sdpa", "eager", "flex_attention", "flash_attention_2"]] = [
        "sdpa", "eager", "flex_attention", "flash_attention_2"]
    reps: PositiveInt = 10  # timed repetitions per phase
    out: PathField | None = None  # speed tables (CSV/JSON); default <log_dir>/model
    seed: int = 0

    _lists = field_validator("checks", "baselines", mode="before")(_as_list)
    _dtype = field_validator("dtype", mode="before")(_full_dtype)


SECTIONS: dict[str, type[_Section]] = {
    "api": ApiConfig,
    "request": RequestConfig,
    "logging": LoggingConfig,
    "experiment": ExperimentConfig,
    "triton": TritonConfig,
    "verify": VerifyConfig,
    "cases": CasesConfig,
    "bench": BenchConfig,
    "cluster": ClusterConfig,
    "model": ModelConfig,
}


class Config(_Section):
    api: ApiConfig = ApiConfig()
    request: RequestConfig = RequestConfig()
    logging: LoggingConfig = LoggingConfig()
    experiment: ExperimentConfig = ExperimentConfig()
    triton: TritonConfig = TritonConfig()
    verify: VerifyConfig = VerifyConfig()
    cases: CasesConfig = CasesConfig()
    bench: BenchConfig = BenchConfig()
    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()

    # Where the values came from (for messages and run records) and warnings to show the user.
    _files: list[str] = PrivateAttr(default_factory=list)
    _key_source: str = PrivateAttr(default="default")
    _warnings: list[str] = PrivateAttr(default_factory=list)
    _set_keys: frozenset[str] = PrivateAttr(default_factory=frozenset)  # "section.key" given by any source

    @property
    def files(self) -> list[str]:
        return list(self._files)

    @property
    def warnings(self) -> list[str]:
        return list(self._warnings)

    def is_set(self, key: str) -> bool:
        """Whether ``"section.key"`` was given by a file or the command line (not a default)."""
        return key in self._set_keys

    def public_dict(self) -> dict[str, Any]:
        """The resolved config as JSON-able data, without secrets (api.api_key is excluded)."""
        return self.model_dump(mode="json")


