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

from flashrun.limits import DETERMINISTIC_BACKWARD, DTYPE_ALIASES, FP8_DTYPE, MAX_HEAD_DIM, MIN_HEAD_DIM

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
# a verify case's: e4m3 too (q, k, v in float8_e4m3fn with descales; the fp8 forward)
CaseDtype = Annotated[Literal["float16", "bfloat16", "float32", "float8_e4m3fn"], BeforeValidator(_full_dtype)]
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
KvScale = Literal["", "tensor", "token"]  # a KV cache in the inputs' dtype, or e4m3 with these scales
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
    # a field's docstring is its description: the configuration reference is generated from them
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


class ApiConfig(_Section):
    base_url: str = "https://api.openai.com/v1"
    """OpenAI-compatible gateway; flashrun appends `/chat/completions` and `/models`."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable that holds the key."""
    api_key: str | None = Field(default=None, repr=False, exclude=True)
    """A literal key: accepted with a warning, never shown, dumped or logged; prefer `api_key_env`."""
    default_model: str = "gpt-4o-mini"
    """Model for `gen-cases` without `--model`, and for `check-env --online`."""
    models: list[str] = []
    """Models for `gen-cases --all-models`."""
    timeout: PositiveFloat = 60.0
    """Seconds per request."""
    max_retries: NonNegativeInt = 3
    """Retries on 429, 5xx and timeouts (honouring `retry-after`)."""


class RequestConfig(_Section):
    timeout: PositiveFloat | None = None
    """Overrides `api.timeout` for chat requests."""
    max_tokens: PositiveInt = 2048
    """Completion budget."""
    temperature: Annotated[float, Field(ge=0, le=2)] = 0.7
    """Sampling temperature."""


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level (`-v` = debug)."""
    log_dir: PathField = Path("logs")
    """Run records (`runs.jsonl`) and bench results (`bench/`)."""


class ExperimentConfig(_Section):
    name: str = "flashrun"
    """A label for your records."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """`cpu` runs Triton's interpreter; `auto` uses the GPU when torch sees one."""
    dtype: CaseDtype = "float16"
    """Input dtype (`fp16`, `bf16`, `fp32`, `e4m3` accepted; records keep the full name). `e4m3`: the fp8 forward - q,
    k, v drawn in bf16 and quantized to float8_e4m3fn with a descale per batch and kv head, a bf16 output, judged by
    FlashAttention-3's rule; dense attention only (causal, window, GQA), no backward."""
    batch_size: PositiveInt = 2
    """Batch."""
    seq_len: PositiveInt = 128
    """Query length."""
    seq_len_k: PositiveInt | None = None
    """Key/value length (`Nq != Nk`); unset: `seq_len`."""
    num_heads: PositiveInt = 4
    """Query heads."""
    num_kv_heads: PositiveInt | None = None
    """K/V heads (GQA/MQA; must divide `num_heads`); unset: `num_heads`."""
    head_dim: HeadDim = 64
    """Head dimension."""
    causal: bool = False
    """Causal mask, bottom-right aligned when `Nq != Nk`."""
    window: Window = (-1, -1)
    """Sliding window `[left, right]` in keys: query i sees keys i + off - left .. i + off + right (off = Nk - Nq); -1
    unbounded."""
    softcap: Softcap = 0.0
    """`> 0`: scores become `softcap·tanh(s / softcap)`; 0 none."""
    alibi: bool = False
    """ALiBi with the standard slopes of `num_heads`."""
    seqlens: SeqLens | None = None
    """Packed sequences: their query lengths (0 allowed, one at least non-empty); `batch_size` and `seq_len` follow
    from them."""
    seqlens_k: SeqLens | None = None
    """Packed sequences' key lengths (as many as `seqlens`); unset: `seqlens`."""
    cache_seqlens: SeqLens | None = None
    """A KV-cache call: the keys each sequence's cache holds (0 allowed); `batch_size` and `seq_len_k` follow from
    them, `seq_len` is the queries per sequence."""
    page_size: NonNegativeInt = 0
    """The KV cache's page size (0: contiguous); needs `cache_seqlens`."""
    new_keys: NonNegativeInt = 0
    """Keys and values the KV-cache call appends to each sequence; needs `cache_seqlens`."""
    kv_scale: KvScale = ""
    """The KV cache's format: `""` in `dtype`; `"tensor"` or `"token"`: float8_e4m3fn with one scale for the whole
    cache, or one per key and kv head (needs `cache_seqlens` and a float16/bfloat16 `dtype`)."""
    seed: int = 0
    """Inputs of case i use seed + i."""
    kernel: list[str] = ["flash"]
    """Kernels to verify: `flash`, `flash-deterministic`, `flash-atomic`, `minimal`, `PATH.py:FUNCTION`."""
    deterministic: bool | None = DETERMINISTIC_BACKWARD
    """`flash`'s backward: true the bitwise-repeatable one, false the one that adds dQ with atomics; unset, per call
    the faster on the H200. `flash-deterministic` / `flash-atomic` fix it."""

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
        if self.kv_scale and (self.cache_seqlens is None or self.dtype not in ("float16", "bfloat16")):
            raise ValueError("kv_scale (an fp8 KV cache) needs cache_seqlens and a float16 or bfloat16 dtype")
        return self

    @model_validator(mode="after")
    def _fp8_dense(self) -> ExperimentConfig:
        if self.dtype == FP8_DTYPE:
            given = [name for name, on in (("softcap", self.softcap), ("alibi", self.alibi),
                                           ("seqlens", self.seqlens is not None),
                                           ("cache_seqlens", self.cache_seqlens is not None)) if on]
            if given:
                raise ValueError(f"dtype e4m3 (the fp8 forward) runs dense attention - causal, window, GQA - not "
                                 f"{', '.join(given)}")
        return self


class TritonConfig(_Section):
    """Launch overrides for our kernels; unset means the tuned table's config, else a heuristic one
    (GPU), or a fixed small config (CPU)."""

    tune: bool = False
    """A shape the shipped tuned table misses is tuned on first use (compiling and timing candidates) instead of
    running a heuristic config at once; verify then checks the tuned configs (`--tune`; `FLASHRUN_TUNE=1` for the
    Python API)."""
    num_warps: PositiveInt | None = None
    """Pin flash's warps (a power of two); unset: the tuned table's, else a heuristic."""
    num_stages: PositiveInt | None = None
    """Pin flash's pipeline stages; unset: the tuned table's, else a heuristic."""
    block_m: PositiveInt | None = None
    """Pin flash's query block (a power of two, 16-256)."""
    block_n: PositiveInt | None = None
    """Pin flash's key block (a power of two, 16-256)."""

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
    """Sweep: replaces `experiment.batch_size` with each value (lists expand as a cartesian product)."""
    num_heads: list[PositiveInt] | None = None
    """Sweep over `experiment.num_heads`."""
    num_kv_heads: list[PositiveInt] | None = None
    """Sweep over `experiment.num_kv_heads`."""
    seq_len: list[PositiveInt] | None = None
    """Sweep over `experiment.seq_len`."""
    seq_len_k: list[PositiveInt] | None = None
    """Sweep over `experiment.seq_len_k`."""
    head_dim: list[HeadDim] | None = None
    """Sweep over `experiment.head_dim`."""
    dtype: list[CaseDtype] | None = None
    """Sweep over `experiment.dtype`."""
    causal: list[bool] | None = None
    """Sweep over `experiment.causal`."""
    window: list[Window] | None = None
    """Sweep over `experiment.window`: a list of pairs (one pair is one value)."""
    softcap: list[Softcap] | None = None
    """Sweep over `experiment.softcap`."""
    alibi: list[bool] | None = None
    """Sweep over `experiment.alibi`."""
    seqlens: list[list[NonNegativeInt]] | None = None
    """Sweep over `experiment.seqlens`: a list of length lists (`[]`: not packed; keys = queries)."""
    cache_seqlens: list[list[NonNegativeInt]] | None = None
    """Sweep over `experiment.cache_seqlens`: a list of length lists (`[]`: no KV cache)."""
    page_size: list[NonNegativeInt] | None = None
    """Sweep over `experiment.page_size`."""
    new_keys: list[NonNegativeInt] | None = None
    """Sweep over `experiment.new_keys`."""
    kv_scale: list[KvScale] | None = None
    """Sweep over `experiment.kv_scale` (`""` among them: the cache in the case's dtype)."""
    grad: bool = False
    """Also check dq, dk, dv (`--grad`)."""
    diagnose: bool = False
    """Report the logit range of q·kᵀ·scale (`--diagnose`)."""
    budget_s: Annotated[float, Field(ge=0)] = 120.0
    """Through the CPU interpreter, cases expected to take longer than this many seconds are skipped up front, with the
    reason (`--budget`; 0 runs everything)."""

    _lists = field_validator(
        "batch_size", "num_heads", "num_kv_heads", "seq_len", "seq_len_k", "head_dim", "dtype", "causal",
        "softcap", "alibi", "page_size", "new_keys", "kv_scale", mode="before",
    )(_as_list)
    _pairs = field_validator("window", "seqlens", "cache_seqlens", mode="before")(_as_list_of_lists)


class CasesConfig(_Section):
    max_seq_len: PositiveInt = 16384
    """Largest `seq_len` gen-cases accepts."""
    count: PositiveInt = 12
    """Cases per model (`--count`)."""
    prompt: str | None = None
    """What to ask the model for (the JSON format is always requested); unset: the built-in prompt."""


class BenchConfig(_Section):
    providers: list[str] = ["flash", "sdpa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", "torch-naive"]
    """What to time: `flash`, `flash-atomic`, `flash-deterministic`, `flash-fp8`, `cudnn-fp8`, `minimal`, `PATH.py:FUNCTION`,
    `torch-naive`, `sdpa`, `sdpa-flash`, `sdpa-cudnn`, `sdpa-efficient`, `sdpa-math`, `flex`, `flash-attn`, any of
    them with `+graph`; unavailable ones show n/a and why."""
    baseline: str = "sdpa"
    """The provider speedups are against (`--baseline`; always measured)."""
    mode: list[Literal["fwd", "bwd", "fwd_bwd"]] = ["fwd"]
    """`fwd`, `bwd` (timed alone), `fwd_bwd`."""
    dtype: list[Dtype] = ["float16"]
    """Dtypes to sweep."""
    seq_len: list[PositiveInt] = [512, 1024, 2048, 4096, 8192, 16384]
    """Query lengths."""
    seq_len_k: list[PositiveInt] | None = None
    """Key lengths, for decode-like shapes (`--seq-lens 1 --seq-lens-k 4096,16384`); unset: the query length."""
    head_dim: list[HeadDim] = [64, 128]
    """Head dims."""
    causal: list[bool] = [False, True]
    """Masks to sweep (`--causal yes/no/both`)."""
    hidden: PositiveInt = 2048
    """Heads = hidden / head_dim (the FlashAttention benchmark convention)."""
    tokens: PositiveInt = 32768
    """Batch = tokens / max(seq_len, seq_len_k)."""
    num_kv_heads: PositiveInt | None = None
    """GQA in the benchmark; unset: every head its own K/V."""
    window: list[Window] = [(-1, -1)]
    """Windows to sweep; each variant list multiplies the sweep."""
    softcap: list[Softcap] = [0.0]
    """Softcaps to sweep."""
    alibi: list[bool] = [False]
    """ALiBi off/on to sweep."""
    varlen: list[SeqLens] | None = None
    """Packed batches, each a list of sequence lengths (keys = queries): adds one shape per batch."""
    page_size: list[NonNegativeInt] | None = None
    """Each dense shape again as a KV-cache call with full caches, once per page size (0: contiguous)."""
    kv_scale: list[KvScale] = [""]
    """The KV-cache shapes' formats: `""` the cache in the sweep's dtype; `"tensor"`/`"token"`: float8_e4m3fn with one
    scale, or one per key and kv head (fp16/bf16 sweeps)."""
    warmup_ms: PositiveInt = 25
    """Warm-up time before the timed calls (`triton.testing.do_bench`'s recipe)."""
    rep_ms: PositiveInt = 100
    """Time the timed calls fill (`triton.testing.do_bench`'s recipe)."""
    l2_flush: Literal["write", "read"] = "write"
    """How L2 is emptied before each timed GPU call: `write` zeroes 256 MB (`do_bench`'s way; the call then writes back
    the dirty lines it evicts), `read` reads 256 MB (nothing left to write back)."""
    out: PathField | None = None
    """Where `<gpu>-<timestamp>.csv` and `.json` go (`--out`); unset: `<log_dir>/bench`."""
    compare: list[PathField] | None = None
    """Earlier results files (.csv or .json) to print ratios against (`--compare`); a benchmark suite names its
    committed runs."""

    _lists = field_validator("mode", "dtype", "seq_len", "seq_len_k", "head_dim", "causal", "softcap", "alibi",
                             "page_size", "compare", "kv_scale", mode="before")(_as_list)
    _pairs = field_validator("window", "varlen", mode="before")(_as_list_of_lists)


class ClusterConfig(_Section):
    """Scale-out over Ray (flashrun[ray]); 1 worker and no address: in this process, no Ray."""

    workers: PositiveInt = 1
    """Checks (verify) or shapes (bench) run at once (`--workers`): 1 in this process without Ray; N > 1 on a local Ray
    cluster started for the command; with an address, a cap."""
    address: str | None = None
    """An existing Ray cluster (`--cluster`): `auto`, `HOST:PORT` or `ray://HOST:PORT`."""

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError('expected "auto", "HOST:PORT" or "ray://HOST:PORT"')
        return None if value is None else value.strip()


class ModelConfig(_Section):
    """``flashrun model``: a kernel swapped into a transformers model (flashrun[model])."""

    arch: Literal["llama", "mistral", "qwen2", "gemma2", "gemma3", "phi3"] = "llama"
    """The family `flashrun model` builds (`--arch`)."""
    size: Literal["mini", "1b"] = "mini"
    """`mini` (CPU-sized, 4 layers) or `1b` (about 1B parameters, for a GPU) (`--size`)."""
    path: str | None = None
    """A local checkpoint folder, or a hub id already in the local cache, instead of arch/size (`--model`); nothing is
    downloaded."""
    kernel: str = "flash"
    """The kernel swapped in (`--kernel`): any verify kernel spec."""
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    """The model's dtype; `auto`: float32 through the CPU interpreter, bfloat16 on a GPU."""
    batch: PositiveInt | None = None
    """Sequences per batch (`--batch`); unset: the size's (mini 1, 1b 4)."""
    seq_len: PositiveInt | None = None
    """Tokens per sequence (`--seq-len`); unset: the size's (mini 32, 1b 2048)."""
    sliding_window: PositiveInt | None = None
    """Overrides the family's window (mistral, gemma2, gemma3)."""
    checks: list[Literal["logits", "train-step", "training", "generate", "generate-fp8"]] = [
        "logits", "train-step", "training", "generate"]
    """Which checks run (`logits` with its padded and packed batches; `generate-fp8`: generation over an e4m3 KV
    cache, flashrun's kernels only); `[]` for speed only."""
    train_steps: PositiveInt = 20
    """The `training` check's AdamW steps."""
    lr: PositiveFloat | None = None
    """The `training` check's learning rate; unset: the size's (mini 1e-3, 1b 1e-4)."""
    gen_tokens: PositiveInt | None = None
    """New tokens in the `generate` check; unset: the size's (mini 16, 1b 64)."""
    speed: bool = True
    """On a GPU, time prefill, train step, decode and peak memory against the baselines (`--no-speed` skips it)."""
    baselines: list[Literal["sdpa", "eager", "flex_attention", "flash_attention_2", "none"]] = [
        "sdpa", "eager", "flex_attention", "flash_attention_2"]
    """Attention implementations to time against; `none` times the model without attention (V passed through): the floor no kernel beats."""
    reps: PositiveInt = 10
    """Timed repetitions per phase (median)."""
    out: PathField | None = None
    """Where the speed CSV/JSON go; unset: `<log_dir>/model`."""
    seed: int = 0
    """Weights and token batches."""

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


