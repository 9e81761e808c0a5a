"""The config layer: the users' own files load as written; every mistake is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashrun.config import DEFAULT_CONFIG, load_config, parse_set
from flashrun.errors import ConfigError

# The two files from product.md, exactly as users already have them.
PRODUCT_CONFIG = """\
[api]
base_url = "https://taotoken.net/api"
api_key_env = "TAOTOKEN_API_KEY"
default_model = "claude-3-5-sonnet"
timeout = 60
max_retries = 3

[experiment]
name = "flash_attention_repro"
device = "cuda"
dtype = "float16"
batch_size = 4
seq_len = 512
num_heads = 8
head_dim = 64

[triton]
num_warps = 4
num_stages = 2
"""

PRODUCT_SETTINGS = """\
{
  "api": {
    "base_url": "https://taotoken.net/api",
    "api_key": "${TAOTOKEN_API_KEY}",
    "default_model": "claude-3-5-sonnet",
    "models": ["claude-3-5-sonnet", "gpt-4o", "deepseek-chat"]
  },
  "request": {"timeout": 60, "max_tokens": 2048, "temperature": 0.7},
  "logging": {"level": "info", "log_dir": "./logs"}
}
"""


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# -- the users' files ---------------------------------------------------------------------------


def test_product_files_load_as_written(tmp_path: Path) -> None:
    write(tmp_path / "config.toml", PRODUCT_CONFIG)
    write(tmp_path / "settings.json", PRODUCT_SETTINGS)
    cfg = load_config(Path("config.toml"))  # settings.json is found next to it
    assert cfg.api.base_url == "https://taotoken.net/api"
    assert cfg.api.api_key_env == "TAOTOKEN_API_KEY"
    assert cfg.api.default_model == "claude-3-5-sonnet"
    assert cfg.api.models == ["claude-3-5-sonnet", "gpt-4o", "deepseek-chat"]
    assert (cfg.api.timeout, cfg.api.max_retries) == (60, 3)
    assert (cfg.request.timeout, cfg.request.max_tokens, cfg.request.temperature) == (60, 2048, 0.7)
    assert cfg.logging.level == "info"
    assert cfg.logging.log_dir == tmp_path / "logs"
    e = cfg.experiment
    assert (e.name, e.device, e.dtype) == ("flash_attention_repro", "cuda", "float16")
    assert (e.batch_size, e.seq_len, e.num_heads, e.head_dim) == (4, 512, 8, 64)
    assert (cfg.triton.num_warps, cfg.triton.num_stages) == (4, 2)
    assert cfg.files == ["settings.json", "config.toml"]
    assert cfg.warnings == []  # "${TAOTOKEN_API_KEY}" is a reference to a variable, not a literal key


@pytest.mark.parametrize("flags", [[], ["--config", "config.toml", "--settings", "settings.json"]])
def test_product_files_pass_the_cli(cli, tmp_path: Path, flags: list[str]) -> None:
    write(tmp_path / "config.toml", PRODUCT_CONFIG)
    write(tmp_path / "settings.json", PRODUCT_SETTINGS)
    result = cli("runs", *flags)
    assert result.exit_code == 0, result.output
    assert "no runs recorded" in result.stdout


def test_settings_alone_with_the_shipped_config(tmp_path: Path) -> None:
    write(tmp_path / "s" / "settings.json", PRODUCT_SETTINGS)
    cfg = load_config(settings=Path("s/settings.json"))
    assert cfg.files == ["s/settings.json", str(DEFAULT_CONFIG)]
    assert cfg.api.models[-1] == "deepseek-chat"
    assert cfg.logging.log_dir == tmp_path / "s" / "logs"  # relative to the settings file


# -- every mistake: exit 2, one line naming file and key, no traceback -----------------------


MISTAKES = {
    "toml-syntax": ("config.toml", "[experiment]\nseq_len = \n",
                    ["config.toml: invalid TOML", "line 2, column"]),
    "toml-duplicate": ("config.toml", "[experiment]\nseq_len = 1\nseq_len = 2\n",
                       ["config.toml: invalid TOML", "line 3"]),
    "unknown-key": ("config.toml", "[experiment]\nseq_lenght = 1024\n",
                    ["config.toml: experiment.seq_lenght: unknown key (did you mean 'seq_len'?)"]),
    "unknown-section": ("config.toml", "[experimnt]\nseq_len = 1024\n",
                        ["config.toml: experimnt: unknown section (did you mean 'experiment'?)"]),
    "wrong-type": ("config.toml", '[experiment]\nhead_dim = "64x"\n',
                   ['config.toml: experiment.head_dim: expected an integer, got "64x"']),
    "bool-for-int": ("config.toml", "[experiment]\nbatch_size = true\n",
                     ["config.toml: experiment.batch_size: expected an integer, got true"]),
    "section-not-table": ("config.toml", "experiment = 3\n",
                          ["config.toml: experiment: expected a table, got 3"]),
    "not-positive": ("config.toml", "[experiment]\nseq_len = 0\n",
                     ["config.toml: experiment.seq_len: expected a value > 0, got 0"]),
    "head-dim-too-big": ("config.toml", "[experiment]\nhead_dim = 512\n",
                         ["config.toml: experiment.head_dim: expected a value <= 256, got 512"]),
    "bad-dtype": ("config.toml", '[experiment]\ndtype = "float8"\n',
                  ["config.toml: experiment.dtype: expected one of", "float16", 'got "float8"']),
    "bad-device": ("config.toml", '[experiment]\ndevice = "gpu"\n',
                   ["config.toml: experiment.device: expected one of", "cuda", 'got "gpu"']),
    "num-warps-not-pow2": ("config.toml", "[triton]\nnum_warps = 3\n",
                           ["config.toml: triton.num_warps: expected a power of two", "got 3"]),
    "heads-not-multiple": ("config.toml", "[experiment]\nnum_heads = 8\nnum_kv_heads = 3\n",
                           ["config.toml: experiment: num_heads (8) must be a multiple of num_kv_heads (3)"]),
    "log-dir-not-path": ("config.toml", "[logging]\nlog_dir = 5\n",
                         ["config.toml: logging.log_dir: expected a path (a string), got 5"]),
    "binary": ("config.toml", b"\x00\xff\xfe\x00\x89PNG", ["config.toml: not a UTF-8 text file"]),
    "empty": ("config.toml", "  \n\n", ["config.toml: the file is empty"]),
    "missing": ("config.toml", None, ["config.toml: no such file"]),
    "json-syntax": ("settings.json", '{\n  "api": {\n    "timeout": 60,\n  }\n}\n',
                    ["settings.json: invalid JSON", "line 4, column 3"]),
    "json-not-object": ("settings.json", "[1, 2]\n", ["settings.json: expected a JSON object at the top level, got list"]),
    "json-wrong-type": ("settings.json", '{"request": {"max_tokens": "many"}}',
                        ['settings.json: request.max_tokens: expected an integer, got "many"']),
    "json-unknown-key": ("settings.json", '{"request": {"max_token": 5}}',
                         ["settings.json: request.max_token: unknown key (did you mean 'max_tokens'?)"]),
    "json-out-of-range": ("settings.json", '{"request": {"temperature": 3}}',
                          ["settings.json: request.temperature: expected a value <= 2.0, got 3"]),
    "json-binary": ("settings.json", b"\xff\xfe{}", ["settings.json: not a UTF-8 text file"]),
    "json-empty": ("settings.json", "", ["settings.json: the file is empty"]),
    "json-missing": ("settings.json", None, ["settings.json: no such file"]),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_config_mistake_is_one_clear_line(cli, tmp_path: Path, name: str) -> None:
    filename, content, expected = MISTAKES[name]
    if content is not None:
        write(tmp_path / filename, content)
    option = "--config" if filename.endswith(".toml") else "--settings"
    result = cli("runs", option, filename)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stdout == ""
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, result.stderr
    for text in expected:
        assert text in error[0]
    assert "hint:" in result.stderr


def test_config_mistake_in_a_real_process(flashrun, tmp_path: Path) -> None:
    write(tmp_path / "config.toml", '[experiment]\nhead_dim = "64x"\n')
    proc = flashrun("check-env", "--config", "config.toml")
    assert proc.returncode == 2
    assert proc.stderr.startswith('error: config.toml: experiment.head_dim: expected an integer, got "64x"\n')
    assert "Traceback" not in proc.stderr + proc.stdout


def test_config_that_is_a_folder(cli, tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    result = cli("runs", "--config", "conf")
    assert result.exit_code == 2
    assert "error: conf: is a folder, not a file" in result.stderr


def test_unreadable_config_path_is_not_a_traceback(cli) -> None:
    result = cli("runs", "--config", "x" * 300 + ".toml")  # ENAMETOOLONG from stat()
    assert result.exit_code == 2
    assert "cannot read" in result.stderr and "Traceback" not in result.output


def test_default_config_is_local_then_shipped(tmp_path: Path) -> None:
    assert load_config().files == [str(DEFAULT_CONFIG)]
    write(tmp_path / "config.toml", "[experiment]\nseq_len = 7\n")
    cfg = load_config()
    assert cfg.experiment.seq_len == 7 and cfg.files == ["config.toml"]


def test_error_names_the_file_the_bad_value_came_from(tmp_path: Path) -> None:
    write(tmp_path / "config.toml", "[experiment]\nseq_len = 8\n")
    write(tmp_path / "settings.json", '{"request": {"max_tokens": -1}}')
    with pytest.raises(ConfigError, match=r"^settings.json: request.max_tokens: expected a value > 0, got -1$"):
        load_config(Path("config.toml"))


# -- --set ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("item", "key", "value"),
    [
        ("experiment.seq_len=1024", "experiment.seq_len", 1024),
        ("experiment.causal=true", "experiment.causal", True),
        ("request.temperature=0.5", "request.temperature", 0.5),
        ("experiment.dtype=bfloat16", "experiment.dtype", "bfloat16"),  # a bare word is a string
        ('experiment.name="a b"', "experiment.name", "a b"),
        ("experiment.name=a b", "experiment.name", "a b"),
        ("api.base_url=https://gw.example/v1", "api.base_url", "https://gw.example/v1"),
        ('experiment.kernel=["flash", "x.py:f"]', "experiment.kernel", ["flash", "x.py:f"]),
        (" experiment.seed = 3 ", "experiment.seed", 3),
        ("experiment.name=", "experiment.name", ""),
    ],
)
def test_set_values_parse_as_toml_then_bare_strings(item: str, key: str, value: object) -> None:
    assert parse_set([item]) == {key: value}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("seq_len=5", "expected section.key=value"),
        ("experiment.seq_len", "expected section.key=value"),
        ("experiment.a.b=1", "expected section.key=value"),
        ("=5", "expected section.key=value"),
        ("experiment.seq_len=[1,", "invalid TOML value"),
        ('experiment.name="unterminated', "invalid TOML value"),
    ],
)
def test_set_syntax_errors(cli, item: str, message: str) -> None:
    result = cli("runs", "--set", item)
    assert result.exit_code == 2
    assert f"error: --set {item!r}: {message}" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("experiment.seq_len=abc", 'error: --set: experiment.seq_len: expected an integer, got "abc"'),
        ("experiment.seq_lenght=5", "error: --set: experiment.seq_lenght: unknown key (did you mean 'seq_len'?)"),
        ("experimnt.seq_len=5", "error: --set: experimnt: unknown section (did you mean 'experiment'?)"),
        ("triton.num_warps=6", "error: --set: triton.num_warps: expected a power of two"),
    ],
)
def test_set_validation_errors_name_the_flag(cli, item: str, message: str) -> None:
    result = cli("runs", "--set", item)
    assert result.exit_code == 2
    assert message in result.stderr


def test_precedence_defaults_settings_config_flags_set(tmp_path: Path) -> None:
    write(tmp_path / "settings.json", json.dumps({
        "request": {"max_tokens": 100},
        "experiment": {"batch_size": 7, "seq_len": 10, "name": "from-settings"},
    }))
    write(tmp_path / "config.toml", '[experiment]\nseq_len = 20\nhead_dim = 32\nname = "from-config"\n')
    cfg = load_config(
        Path("config.toml"),
        flags={"experiment.seq_len": 30, "experiment.seed": 5, "experiment.causal": None},
        sets=["experiment.seed=9", "experiment.name=from-set"],
    )
    assert cfg.experiment.num_heads == 4  # default
    assert cfg.request.max_tokens == 100  # settings.json over the default
    assert cfg.experiment.batch_size == 7  # only settings.json sets it
    assert cfg.experiment.head_dim == 32  # config.toml
    assert cfg.experiment.seq_len == 30  # flags over config.toml over settings.json
    assert cfg.experiment.seed == 9  # --set over flags
    assert cfg.experiment.name == "from-set"
    assert cfg.experiment.causal is False  # a flag left unset (None) does not override


def test_set_repeated_key_last_wins() -> None:
    cfg = load_config(sets=["experiment.seq_len=64", "experiment.seq_len=96"])
    assert cfg.experiment.seq_len == 96


# -- ${VAR}, keys and paths ----------------------------------------------------------------------


def test_variables_are_expanded_in_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHRUN_TEST_GW", "https://gw.example")
    monkeypatch.setenv("FLASHRUN_TEST_MODEL", "gpt-4o")
    write(tmp_path / "settings.json", json.dumps({
        "api": {"base_url": "${FLASHRUN_TEST_GW}/v1", "default_model": "${FLASHRUN_TEST_MODEL}",
                "models": ["${FLASHRUN_TEST_MODEL}", "${FLASHRUN_TEST_UNSET}"]},
    }))
    cfg = load_config(settings=Path("settings.json"))
    assert cfg.api.base_url == "https://gw.example/v1"
    assert cfg.api.default_model == "gpt-4o"
    assert cfg.api.models == ["gpt-4o", "${FLASHRUN_TEST_UNSET}"]  # unset: an error only where needed


def test_key_reference_in_settings_reads_that_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrun.config import key_variable, resolve_api_key
    from flashrun.errors import MissingKeyError

    write(tmp_path / "settings.json", '{"api": {"api_key": "${FLASHRUN_TEST_KEY}"}}')
    cfg = load_config(settings=Path("settings.json"))
    assert key_variable(cfg) == "FLASHRUN_TEST_KEY"
    with pytest.raises(MissingKeyError, match="FLASHRUN_TEST_KEY is not set"):
        resolve_api_key(cfg)
    monkeypatch.setenv("FLASHRUN_TEST_KEY", "  sk-from-env  ")
    assert resolve_api_key(cfg) == "sk-from-env"


def test_partial_key_reference_names_the_missing_variable(tmp_path: Path) -> None:
    from flashrun.config import resolve_api_key
    from flashrun.errors import MissingKeyError

    write(tmp_path / "settings.json", '{"api": {"api_key": "sk-${FLASHRUN_TEST_PART}"}}')
    with pytest.raises(MissingKeyError, match=r"\$\{FLASHRUN_TEST_PART\}, which is not set"):
        resolve_api_key(load_config(settings=Path("settings.json")))


def test_literal_key_is_used_with_a_warning_that_hides_it(cli, tmp_path: Path) -> None:
    secret = "sk-literal-0123456789abcdef"
    write(tmp_path / "settings.json", json.dumps({"api": {"api_key": secret}}))
    cfg = load_config(settings=Path("settings.json"))
    assert len(cfg.warnings) == 1 and secret not in cfg.warnings[0]
    assert "api.api_key holds a literal key" in cfg.warnings[0]
    assert secret not in json.dumps(cfg.public_dict()) and secret not in repr(cfg)
    result = cli("runs", "--settings", "settings.json")
    assert result.exit_code == 0
    assert "warning:" in result.stderr and secret not in result.output


def test_relative_paths_resolve_against_the_config_folder(tmp_path: Path) -> None:
    write(tmp_path / "proj" / "config.toml",
          '[logging]\nlog_dir = "out/logs"\n[experiment]\nkernel = ["flash", "experiments/k.py:attn"]\n')
    cfg = load_config(Path("proj/config.toml"))
    assert cfg.logging.log_dir == tmp_path / "proj" / "out" / "logs"
    assert cfg.experiment.kernel == ["flash", f"{tmp_path / 'proj' / 'experiments' / 'k.py'}:attn"]


def test_paths_resolve_against_the_file_that_set_them(tmp_path: Path) -> None:
    write(tmp_path / "a" / "config.toml", '[bench]\nout = "bench-out"\n')
    write(tmp_path / "b" / "settings.json", '{"logging": {"log_dir": "logs2"}}')
    cfg = load_config(Path("a/config.toml"), Path("b/settings.json"), sets=["experiment.kernel=k.py:f"])
    assert cfg.bench.out == tmp_path / "a" / "bench-out"
    assert cfg.logging.log_dir == tmp_path / "b" / "logs2"
    assert cfg.experiment.kernel == [f"{tmp_path / 'k.py'}:f"]  # --set: relative to the cwd


def test_absolute_paths_are_kept(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    write(tmp_path / "p" / "config.toml", f'[logging]\nlog_dir = "{target.as_posix()}"\n')
    assert load_config(Path("p/config.toml")).logging.log_dir == target


# -- dtype short names ----------------------------------------------------------------------------


def test_short_dtype_names_are_read_everywhere_and_kept_full(tmp_path: Path) -> None:
    # fp16/bf16/fp32 are the names flashrun prints in labels; they are read wherever a dtype is
    config = write(tmp_path / "config.toml", '[experiment]\ndtype = "bf16"\n\n[verify]\ndtype = ["fp16", "fp32"]\n'
                                             '\n[bench]\ndtype = "fp32"\n')
    cfg = load_config(config)
    assert (cfg.experiment.dtype, cfg.verify.dtype, cfg.bench.dtype) == ("bfloat16", ["float16", "float32"], ["float32"])
    dumped = cfg.public_dict()  # what run records and --json hold
    assert (dumped["experiment"]["dtype"], dumped["verify"]["dtype"]) == ("bfloat16", ["float16", "float32"])
    flags = load_config(config, flags={"bench.dtype": ["bf16", "float16"]},  # bench --dtype bf16,float16
                        sets=["experiment.dtype=fp32", "verify.dtype=[bf16,float32]"])
    assert flags.bench.dtype == ["bfloat16", "float16"]
    assert (flags.experiment.dtype, flags.verify.dtype) == ("float32", ["bfloat16", "float32"])


def test_an_unknown_dtype_names_the_short_names_too(cli) -> None:
    result = cli("runs", "--set", "verify.dtype=[fp16,fp8]")
    assert result.exit_code == 2
    assert ("error: --set: verify.dtype.1: expected one of 'float16', 'bfloat16', 'float32' or 'float8_e4m3fn' (or "
            'fp16, bf16, fp32, e4m3), got "fp8"') in result.stderr


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_the_shipped_example_configs_load_as_written(path: Path) -> None:
    from flashrun.harness.shapes import verify_shapes

    shapes = verify_shapes(load_config(path))
    assert shapes
    if path.name == "fp8.toml":  # the e4m3 forward's awkward shapes, every one dense
        assert len(shapes) == 72 and {s.dtype for s in shapes} == {"float8_e4m3fn"}
        assert {s.seq_len for s in shapes} == {1, 17, 97} and {s.head_dim for s in shapes} == {40, 64, 128}
