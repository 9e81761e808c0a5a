"""``flashrun gen-cases`` against a real local HTTP gateway, the offline generator, the cases file.

Every gateway test checks the exit code, whether the cases file was written, the run record's
outcome, and that the fake key appears nowhere: not in stdout/stderr, logs or written files.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from fake_gateway import (
    FakeGateway,
    Reply,
    api_error,
    cases_json,
    completion,
    rate_limited,
    refuses_json_schema,
)
from typer.testing import CliRunner

from flashrun.cli import app
from flashrun.config import load_config
from flashrun.errors import InputError
from flashrun.gateway import gencases
from flashrun.gateway.client import check_online
from flashrun.gateway.replies import extract_items, validate
from flashrun.harness.cases import HEAD_DIMS, load_cases, offline_cases, variant_cases

REPO = Path(__file__).resolve().parents[1]
KEY_VAR = "FLASHRUN_TEST_KEY"
KEY = "sk-test-SECRET-0123456789abcdef"
GOOD = cases_json((1, 64), (17, 64), (129, 128))
GOOD_CASES = [{"seq_len": 1, "head_dim": 64}, {"seq_len": 17, "head_dim": 64}, {"seq_len": 129, "head_dim": 128}]


@pytest.fixture(autouse=True)
def gateway_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """On top of conftest's isolation: no proxy variable sends loopback traffic elsewhere, and
    the key lives in our own variable."""
    for name in list(os.environ):
        if name.upper() in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(KEY_VAR, KEY)
    return KEY


@pytest.fixture
def gateway() -> Iterator[FakeGateway]:
    server = FakeGateway().start()
    yield server
    server.stop()


def write_config(tmp_path: Path, base_url: str, request_timeout: float = 60, **api: Any) -> Path:
    """1 retry; logs under tmp_path. Timeouts are generous, so that a loaded machine cannot turn a
    local reply into a timeout; the timeout tests make the gateway hang and pass a short one."""
    settings = {"models": ["good-model", "other-model", "missing-model"], "timeout": 60, "max_retries": 1, **api}
    lines = [f'base_url = "{base_url}"', f'api_key_env = "{KEY_VAR}"', 'default_model = "good-model"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    path = tmp_path / "config.toml"
    path.write_text("[api]\n" + "\n".join(lines) + f"\n\n[request]\ntimeout = {request_timeout}\n\n"
                    '[logging]\nlog_dir = "logs"\n')
    return path


def gen(config: Path, *args: str) -> Any:
    return CliRunner().invoke(app, ["gen-cases", "--config", str(config), *args])


def records(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "logs" / "runs.jsonl").read_text().splitlines()]


def assert_no_secret(tmp_path: Path, *texts: str) -> None:
    """No piece of the key (servers echo it abbreviated too) nor an Authorization header, anywhere."""
    needles = [KEY[:8], KEY[8:14], KEY[-8:], "Bearer "]
    for text in texts:
        for needle in needles:
            assert needle not in text
    for path in tmp_path.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            for needle in needles:
                assert needle.encode() not in data, f"{needle!r} found in {path}"


# --------------------------------------------------------------------------------------------
# Replies that yield cases


@pytest.mark.parametrize(
    ("reply", "expected", "n_rejected"),
    [
        pytest.param(GOOD, GOOD_CASES, 0, id="good-json"),
        pytest.param(f"Here you go:\n```json\n{GOOD}\n```\nEnjoy!", GOOD_CASES, 0, id="fenced"),
        pytest.param(f"Sure! These stress the masks: {GOOD} Hope it helps [1].", GOOD_CASES, 0, id="prose-around"),
        pytest.param("[[1, 64], [17, 64], [129, 128]]", GOOD_CASES, 0, id="bare-pairs"),
        pytest.param(
            json.dumps({"cases": [
                {"seq_len": 1, "head_dim": 64}, {"seq_len": 0, "head_dim": 64}, {"seq_len": "17", "head_dim": "64"},
                {"seq_len": 1, "head_dim": 64}, {"seq_len": 99999, "head_dim": 64}, {"seq_len": 64, "head_dim": 8},
                {"seq_len": 1.5, "head_dim": 64}, "junk", {"head_dim": 64}, [129, 128],
            ]}),
            GOOD_CASES, 7, id="invalid-items-mixed",
        ),
    ],
)
def test_reply_shapes_give_cases(gateway: FakeGateway, isolated: Path, reply: str, expected: list[dict[str, int]],
                                 n_rejected: int) -> None:
    gateway.script("good-model", completion(reply))
    result = gen(write_config(isolated, gateway.base_url))
    assert result.exit_code == 0, result.output
    written = json.loads((isolated / "cases.json").read_text())
    assert [{k: c[k] for k in ("seq_len", "head_dim")} for c in written["cases"]] == expected
    assert all(c["model"] == "good-model" for c in written["cases"])
    (source,) = written["models"]
    assert len(source["rejected"]) == n_rejected and all(r["reason"] for r in source["rejected"])
    assert source["response_format"] == "json_schema"
    assert source["usage"] == {"prompt_tokens": 50, "completion_tokens": 20}
    assert written["base_url"] == gateway.base_url and written["prompt"]["system"]
    assert load_cases(isolated / "cases.json") == expected
    assert records(isolated)[-1]["results"]["outcome"] == "ok"
    assert_no_secret(isolated, result.output)


def test_rejected_items_say_why(gateway: FakeGateway, isolated: Path) -> None:
    items = [{"seq_len": 0, "head_dim": 64}, {"seq_len": 64, "head_dim": 8}, {"seq_len": 17, "head_dim": 64},
             {"seq_len": 17, "head_dim": 64}, {"seq_len": "x", "head_dim": 64}]
    gateway.script("good-model", completion(json.dumps({"cases": items})))
    result = gen(write_config(isolated, gateway.base_url), "--max-seq-len", "100")
    assert result.exit_code == 0, result.output
    reasons = [r["reason"] for r in json.loads((isolated / "cases.json").read_text())["models"][0]["rejected"]]
    assert reasons == ["seq_len 0 is outside 1..100 (max_seq_len)",
                       "head_dim 8 is outside 16..256 (what the kernels support)",
                       "duplicate of an earlier case", 'seq_len "x" is not an integer']
    assert "head_dim 8 is outside" in result.stderr


# --------------------------------------------------------------------------------------------
# Variants: seq_len_k, causal, window, softcap, alibi, packed seqlens/seqlens_k

# (item as a model writes it, the case kept as verify reads it back)
VARIANT_ITEMS = [
    ({"seq_len": 97, "head_dim": 64, "window": [0, 0]}, {"seq_len": 97, "head_dim": 64, "window": (0, 0)}),
    ({"seq_len": 17, "seq_len_k": 97, "head_dim": 40, "causal": True, "window": [8, 0]},
     {"seq_len": 17, "seq_len_k": 97, "head_dim": 40, "causal": True, "window": (8, 0)}),
    ({"seq_len": 33, "head_dim": 64, "window": [64, -1], "causal": False},  # wider than the sequence
     {"seq_len": 33, "head_dim": 64, "causal": False, "window": (64, -1)}),
    ({"seq_len": 65, "head_dim": 64, "window": [16, 0], "softcap": 2, "alibi": True},
     {"seq_len": 65, "head_dim": 64, "window": (16, 0), "softcap": 2.0, "alibi": True}),
    ({"head_dim": 32, "seqlens": [0, 1, 17, 5], "seqlens_k": [3, 1, 17, 0]},  # packed: seq_len follows
     {"seq_len": 17, "head_dim": 32, "seqlens": (0, 1, 17, 5), "seqlens_k": (3, 1, 17, 0)}),
    ({"seq_len": 9, "head_dim": 16, "seqlens": [9, 0], "seq_len_k": 9},
     {"seq_len": 9, "seq_len_k": 9, "head_dim": 16, "seqlens": (9, 0)}),
    # a strict JSON schema makes models write every key: null is "not set"
    ({"seq_len": 33, "head_dim": 32, "seq_len_k": None, "causal": None, "window": None, "softcap": None,
      "alibi": None, "seqlens": None, "seqlens_k": None}, {"seq_len": 33, "head_dim": 32}),
]


def test_variant_fields_are_asked_for_kept_and_saved(gateway: FakeGateway, isolated: Path) -> None:
    gateway.script("good-model", completion(json.dumps({"cases": [item for item, _ in VARIANT_ITEMS]})))
    result = gen(write_config(isolated, gateway.base_url), "--json")
    assert result.exit_code == 0, result.output
    expected = [case for _, case in VARIANT_ITEMS]
    assert load_cases(isolated / "cases.json") == expected
    written = json.loads((isolated / "cases.json").read_text())
    assert written["models"][0]["rejected"] == []
    # on disk as JSON: pairs and lengths are lists; each case names its model
    assert written["cases"][4] == {"seq_len": 17, "head_dim": 32, "seqlens": [0, 1, 17, 5],
                                   "seqlens_k": [3, 1, 17, 0], "model": "good-model"}
    # the request: every optional key in the strict schema (nullable), described in the system
    # message with its limits; the default prompt asks for the variants' edge cases
    body = gateway.chats()[0].body
    item = body["response_format"]["json_schema"]["schema"]["properties"]["cases"]["items"]
    optional = ["seq_len_k", "causal", "window", "softcap", "alibi", "seqlens", "seqlens_k"]
    assert sorted(item["required"]) == sorted(["seq_len", "head_dim", *optional]) == sorted(item["properties"])
    assert all("null" in item["properties"][key]["type"] for key in optional)
    system, user = (m["content"] for m in body["messages"])
    assert all(f'"{key}"' in system for key in optional) and "-1 is unbounded" in system
    assert "at most 16384" in system
    for edge in ("window of 0", "wider than the sequence", "seq_len_k different from seq_len", "softcap together "
                 "with a window", "ALiBi", "empty and length-1 sequences"):
        assert edge in user


# (item, why it is dropped); each item is otherwise valid
BAD_VARIANTS = [
    ({"window": [-2, 0]}, "window [-2, 0]: a side is a number of keys >= 0, or -1 for unbounded"),
    ({"window": [8]}, "window [8] is not a [left, right] pair of integers"),
    ({"window": "8,0"}, 'window "8,0" is not a [left, right] pair of integers'),
    ({"window": [8, "left"]}, 'window [8, "left"] is not a [left, right] pair of integers'),
    ({"softcap": -1.5}, "softcap -1.5 is not a number >= 0 (0: no softcap)"),
    ({"softcap": "high"}, 'softcap "high" is not a number'),
    ({"softcap": True}, "softcap true is not a number"),
    ({"alibi": "yes"}, 'alibi "yes" is not true or false'),
    ({"alibi": 1}, "alibi 1 is not true or false"),
    ({"causal": "false"}, 'causal "false" is not true or false'),
    ({"seq_len_k": 0}, "seq_len_k 0 is outside 1..100 (max_seq_len)"),
    ({"seq_len_k": 101}, "seq_len_k 101 is outside 1..100 (max_seq_len)"),
    ({"seqlens": [3, -1]}, "seqlens [3, -1] is not a list of lengths (integers >= 0)"),
    ({"seqlens": [3, 1.5]}, "seqlens [3, 1.5] is not a list of lengths (integers >= 0)"),
    ({"seqlens": []}, "seqlens [] is not a list of lengths (integers >= 0)"),
    ({"seqlens": 5}, "seqlens 5 is not a list of lengths (integers >= 0)"),
    ({"seqlens": [0, 0]}, "packed sequences need at least one non-empty sequence"),
    ({"seqlens": [3, 101]}, "seqlens [3, 101]: 101 is over 100 (max_seq_len)"),
    ({"seqlens": [3, 4], "seqlens_k": [3]}, "seqlens_k must give as many lengths as seqlens (2), got 1"),
    ({"seqlens": [3, 4], "seqlens_k": [3, 101]}, "seqlens_k [3, 101]: 101 is over 100 (max_seq_len)"),
    ({"seqlens_k": [3, 4]}, "seqlens_k needs seqlens (the query lengths of the packed sequences)"),
    ({"seqlens": [3, 4], "seq_len": 10}, "seq_len 10 is not the longest of seqlens (4); packed cases may leave "
                                         "seq_len out"),
    ({"seqlens": [3, 4], "seqlens_k": [5, 0], "seq_len": 4, "seq_len_k": 4},
     "seq_len_k 4 is not the longest of seqlens_k (5); packed cases may leave seq_len_k out"),
]


def test_bad_variant_fields_drop_that_case_with_the_reason(gateway: FakeGateway, isolated: Path) -> None:
    items = [{"seq_len": 7, "head_dim": 16, **fields} for fields, _ in BAD_VARIANTS]
    items.append({"seq_len": 7, "head_dim": 16, "window": [2, 0]})  # the one valid case
    gateway.script("good-model", completion(json.dumps({"cases": items})))
    result = gen(write_config(isolated, gateway.base_url), "--max-seq-len", "100")
    assert result.exit_code == 0, result.output
    assert load_cases(isolated / "cases.json") == [{"seq_len": 7, "head_dim": 16, "window": (2, 0)}]
    rejected = json.loads((isolated / "cases.json").read_text())["models"][0]["rejected"]
    assert [r["reason"] for r in rejected] == [why for _, why in BAD_VARIANTS]
    assert [r["item"] for r in rejected] == items[:-1]  # kept as the model wrote them
    assert "rejected from good-model:" in result.stderr and "not true or false" in result.stderr


def test_only_bad_variants_are_asked_again_with_the_reasons(gateway: FakeGateway, isolated: Path) -> None:
    bad = json.dumps({"cases": [{"seq_len": 7, "head_dim": 16, "softcap": -1}]})
    good = json.dumps({"cases": [{"seq_len": 7, "head_dim": 16, "softcap": 1}]})
    gateway.script("good-model", completion(bad), completion(good))
    result = gen(write_config(isolated, gateway.base_url))
    assert result.exit_code == 0, result.output
    assert "softcap -1 is not a number >= 0" in gateway.chats()[1].body["messages"][-1]["content"]
    assert load_cases(isolated / "cases.json") == [{"seq_len": 7, "head_dim": 16, "softcap": 1.0}]


def test_saved_variant_cases_run_in_verify(gateway: FakeGateway, isolated: Path) -> None:
    """The file gen-cases writes is what `verify --cases` reads: tiny cases, through the interpreter."""
    items = [{"seq_len": 5, "seq_len_k": 9, "head_dim": 16, "causal": True, "window": [2, 0]},
             {"seq_len": 7, "head_dim": 16, "window": [0, 0], "softcap": 1.5, "alibi": True},
             {"head_dim": 16, "seqlens": [0, 1, 6], "seqlens_k": [2, 0, 6]}]
    gateway.script("good-model", completion(json.dumps({"cases": items})))
    config = write_config(isolated, gateway.base_url)
    assert gen(config).exit_code == 0
    result = CliRunner().invoke(app, ["verify", "--config", str(config), "--cases", "cases.json", "--json",
                                      "--set", "experiment.batch_size=1", "--set", "experiment.num_heads=2"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verdict"] == "3 passed, 0 failed"
    assert [r["label"] for r in data["results"]] == [
        "B1 H2 N5x9 D16 fp16 causal w2,0", "B1 H2 N7 D16 fp16 w0,0 cap1.5 alibi",
        "B3 H2 N6 D16 fp16 varlen[0,1,6]x[2,0,6]"]


def test_json_schema_refused_falls_back_and_is_remembered(gateway: FakeGateway, isolated: Path) -> None:
    gateway.script("good-model", refuses_json_schema(completion("no cases here"), completion(GOOD)))
    result = gen(write_config(isolated, gateway.base_url))
    assert result.exit_code == 0, result.output
    modes = [(c.body or {}).get("response_format", {}).get("type") for c in gateway.chats()]
    # Refused once, then json_object for the first ask and (remembered) for the re-ask.
    assert modes == ["json_schema", "json_object", "json_object"]
    source = json.loads((isolated / "cases.json").read_text())["models"][0]
    assert source["response_format"] == "json_object"
    assert source["response_format_refused"][0]["mode"] == "json_schema"
    assert "not supported" in source["response_format_refused"][0]["refused"]


def test_retry_after_is_honoured(gateway: FakeGateway, isolated: Path) -> None:
    gateway.script("good-model", rate_limited("1"), completion(GOOD))
    result = gen(write_config(isolated, gateway.base_url))
    assert result.exit_code == 0, result.output
    first, second = gateway.chats()
    assert second.time - first.time >= 0.95  # the SDK's own backoff would be at most 0.5 s
    assert load_cases(isolated / "cases.json") == GOOD_CASES


def test_server_error_is_retried(gateway: FakeGateway, isolated: Path) -> None:
    gateway.script("good-model", api_error(500, "upstream exploded"), completion(GOOD))
    result = gen(write_config(isolated, gateway.base_url))
    assert result.exit_code == 0, result.output
    assert len(gateway.chats()) == 2


def test_reask_with_reasons_then_success(gateway: FakeGateway, isolated: Path) -> None:
    gateway.script("good-model", completion('{"cases": [{"seq_len": 0, "head_dim": 64}]}'), completion(GOOD))
    result = gen(write_config(isolated, gateway.base_url))
    assert result.exit_code == 0, result.output
    followup = gateway.chats()[1].body["messages"]
    assert followup[-2]["role"] == "assistant" and "seq_len 0 is outside" in followup[-1]["content"]
    source = json.loads((isolated / "cases.json").read_text())["models"][0]
    assert len(source["requests"]) == 2 and source["usage"]["completion_tokens"] == 40


# --------------------------------------------------------------------------------------------
# Failures: one line + hint, exit code, nothing written, no key anywhere

ECHO_KEY = api_error(401, f"Incorrect API key provided: {KEY}. Also known as {KEY[:8]}****{KEY[-4:]}.")
HANG = Reply(hang=True)  # never answers: the request times out on any machine


@pytest.mark.parametrize(
    ("script", "args", "message", "hint"),
    [
        pytest.param([completion("I cannot help with that {")], [], "gave no valid case, even when asked again",
                     "another model", id="invalid-json"),
        pytest.param([completion("")], [], "model 'good-model' returned an empty reply", "--offline", id="empty"),
        pytest.param([ECHO_KEY], [], f"rejected the API key from {KEY_VAR} (401 Unauthorized)",
                     f"is {KEY_VAR} exported in this shell", id="401-echoes-key"),
        pytest.param([api_error(403, "key not permitted for this model")], [], "not allowed to use model 'good-model'",
                     "permission", id="403"),
        pytest.param([], ["--model", "claude-3.5-sonnet"], "does not know model 'claude-3.5-sonnet' (HTTP 404)",
                     "did you mean 'claude-3-5-sonnet'?", id="404-model"),
        pytest.param([rate_limited("0.1")], [], "rate limited by the gateway (429) on model 'good-model': gave up "
                     "after 1 retry, honouring retry-after (0.1 s)", "raise api.max_retries", id="429-forever"),
        pytest.param([api_error(503, "overloaded")], [], "failed (HTTP 503) on model 'good-model' after 1 retry",
                     "try again later", id="5xx-forever"),
        pytest.param([HANG], ["--set", "request.timeout=0.5"], "within 0.5 s (after 1 retry)", "request.timeout",
                     id="slow"),
        pytest.param([Reply(body={"error": {"message": "upstream provider unavailable"}})], [],
                     "answered HTTP 200 carrying an error for model 'good-model'", "try again", id="200-error-object"),
        pytest.param([completion('{"cases": [{"seq_len": 1', finish_reason="length")], [],
                     "hit the token limit (request.max_tokens = 2048)", "raise request.max_tokens", id="length"),
    ],
)
def test_gateway_failures(gateway: FakeGateway, isolated: Path, script: list[Reply], args: list[str], message: str,
                          hint: str) -> None:
    if script:
        gateway.script("good-model", *script)
    result = gen(write_config(isolated, gateway.base_url), *args)
    assert result.exit_code == 1, result.output
    error_line, hint_line = result.stderr.strip().splitlines()[-2:]
    assert error_line.startswith("error: ") and message in error_line
    assert hint_line.startswith("hint: ") and hint in hint_line
    assert "Traceback" not in result.output
    assert not (isolated / "cases.json").exists()
    assert records(isolated)[-1]["results"]["outcome"] == "failed"
    assert_no_secret(isolated, result.output)


@pytest.mark.parametrize(
    ("suffix", "hint"),
    [
        pytest.param("", 'set api.base_url = "{root}/v1"', id="missing-v1"),
        pytest.param("/v1/chat/completions", 'set api.base_url = "{root}/v1"', id="with-chat-completions"),
        pytest.param("/api", 'try api.base_url = "{root}/api/v1"', id="nothing-there"),
    ],
)
@pytest.mark.parametrize("spa", [False, True], ids=["html-404", "html-200"])
def test_wrong_base_url(isolated: Path, suffix: str, hint: str, spa: bool) -> None:
    server = FakeGateway(spa=spa).start()
    try:
        result = gen(write_config(isolated, server.root + suffix))
    finally:
        server.stop()
    assert result.exit_code == 1, result.output
    assert "does not answer like an OpenAI-compatible API" in result.stderr
    assert "an HTML page" in result.stderr
    assert hint.format(root=server.root) in result.stderr
    assert not (isolated / "cases.json").exists()


def test_connection_refused(isolated: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on once it is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = gen(write_config(isolated, f"http://127.0.0.1:{port}/v1"))
    assert result.exit_code == 1
    assert f"cannot connect to 127.0.0.1:{port}: connection refused" in result.stderr
    assert "is the gateway running" in result.stderr


def test_missing_key_variable_is_named(gateway: FakeGateway, isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_VAR)
    result = gen(write_config(isolated, gateway.base_url))
    assert result.exit_code == 2
    assert f"the API key variable {KEY_VAR} is not set" in result.stderr
    assert gateway.seen == [] and not (isolated / "cases.json").exists()


def test_existing_file_survives_a_failure(gateway: FakeGateway, isolated: Path) -> None:
    (isolated / "cases.json").write_text("previous")
    gateway.script("good-model", completion(""))
    # --force: the run means to replace the file, and a failed run still must not clobber it
    assert gen(write_config(isolated, gateway.base_url), "--force").exit_code == 1
    assert (isolated / "cases.json").read_text() == "previous"


@pytest.mark.parametrize("args", [[], ["--offline"], ["-o", "mine.json"], ["--json"]],
                         ids=["gateway", "offline", "out", "json"])
def test_existing_file_is_not_overwritten_without_force(gateway: FakeGateway, isolated: Path,
                                                        args: list[str]) -> None:
    target = isolated / ("mine.json" if "mine.json" in args else "cases.json")
    target.write_text("previous")
    config = write_config(isolated, gateway.base_url)
    result = gen(config, *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[0] == f"error: would overwrite {target.name}"
    assert "--force" in result.stderr and "Traceback" not in result.output
    assert result.stdout == ""  # not even with --json: an error is no report
    assert target.read_text() == "previous"
    assert gateway.seen == []  # nothing was asked of the gateway
    assert not (isolated / "logs" / "runs.jsonl").exists()


def test_force_overwrites(gateway: FakeGateway, isolated: Path) -> None:
    (isolated / "cases.json").write_text("previous")
    gateway.script("good-model", completion(GOOD))
    result = gen(write_config(isolated, gateway.base_url), "--force")
    assert result.exit_code == 0, result.output
    assert load_cases(isolated / "cases.json") == GOOD_CASES


def test_key_never_leaks_from_a_real_process(gateway: FakeGateway, isolated: Path) -> None:
    gateway.script("good-model", ECHO_KEY)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "flashrun", "gen-cases", "--config",
                           str(write_config(isolated, gateway.base_url))],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: the gateway rejected the API key")
    assert gateway.chats()[0].headers["authorization"] == f"Bearer {KEY}"  # the key did go to the gateway
    assert_no_secret(isolated, proc.stdout, proc.stderr)


def test_help_does_not_import_the_sdk() -> None:
    code = "import sys; from flashrun.cli import app; assert 'openai' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)


# --------------------------------------------------------------------------------------------
# Several models


def test_one_model_failing_keeps_the_others(gateway: FakeGateway, isolated: Path) -> None:
    gateway.script("good-model", completion(GOOD))
    gateway.script("other-model", completion(cases_json((1, 64), (33, 80))))
    result = gen(write_config(isolated, gateway.base_url), "--all-models", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["outcome"] == "partial"
    rows = {m["model"]: m for m in report["models"]}
    assert rows["good-model"]["cases"] == 3 and rows["other-model"]["cases"] == 2
    assert "does not know model 'missing-model'" in rows["missing-model"]["error"]["message"]
    written = json.loads((isolated / "cases.json").read_text())
    assert {c["model"] for c in written["cases"]} == {"good-model", "other-model"}
    # verify reads the union: (1, 64) from both models counts once.
    assert load_cases(isolated / "cases.json") == GOOD_CASES + [{"seq_len": 33, "head_dim": 80}]
    assert records(isolated)[-1]["results"]["outcome"] == "partial"


def test_table_compares_models(gateway: FakeGateway, isolated: Path) -> None:
    gateway.script("good-model", completion(GOOD))
    gateway.script("other-model", completion(cases_json((1, 64)), prompt_tokens=7, completion_tokens=3))
    result = gen(write_config(isolated, gateway.base_url), "-m", "good-model", "-m", "other-model")
    assert result.exit_code == 0, result.output
    assert "wrote 4 cases from 2 of 2 model(s) to cases.json" in result.stdout
    row = next(line for line in result.stdout.splitlines() if "other-model" in line)
    assert [cell.strip() for cell in row.strip("│ ").split("│")][:3] == ["other-model", "1 / 0", "7 / 3"]


def test_every_model_failing_writes_nothing(gateway: FakeGateway, isolated: Path) -> None:
    result = gen(write_config(isolated, gateway.base_url), "-m", "nope-1", "-m", "nope-2")
    assert result.exit_code == 1
    assert "error: the gateway does not know model 'nope-1'" in result.stderr
    assert "nope-2" in result.stdout  # the table still shows every model
    assert not (isolated / "cases.json").exists()


def test_status_names_the_model_being_waited_for(gateway: FakeGateway, isolated: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    import flashrun.cli

    terminal = io.StringIO()
    monkeypatch.setattr(flashrun.cli, "err", Console(file=terminal, force_terminal=True, width=120))
    gateway.script("good-model", completion(GOOD))
    gateway.script("other-model", completion(GOOD))
    result = gen(write_config(isolated, gateway.base_url), "-m", "good-model", "-m", "other-model", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["n_cases"] == 6  # stdout holds the JSON and nothing else
    shown = terminal.getvalue()
    assert f"waiting for good-model (1 of 2) at {gateway.base_url}" in shown
    assert "waiting for other-model (2 of 2)" in shown


def test_no_status_off_a_terminal(gateway: FakeGateway, isolated: Path) -> None:
    import io

    from rich.console import Console

    piped = io.StringIO()
    gateway.script("good-model", completion(GOOD))
    cfg = load_config(write_config(isolated, gateway.base_url), None, None, None)
    report = gencases.run(cfg, out=isolated / "cases.json", console=Console(file=piped, force_terminal=False))
    assert report.exit_code == 0 and piped.getvalue() == ""


def test_json_output_on_failure(gateway: FakeGateway, isolated: Path) -> None:
    gateway.script("good-model", ECHO_KEY)
    result = gen(write_config(isolated, gateway.base_url), "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)  # stdout holds the JSON and nothing else
    assert (report["outcome"], report["out"], report["n_cases"]) == ("failed", None, 0)
    assert "401 Unauthorized" in report["models"][0]["error"]["message"]
    assert_no_secret(isolated, result.output)


# --------------------------------------------------------------------------------------------
# check-env --online gives gen-cases' diagnosis


@pytest.mark.parametrize(
    ("script", "path"),
    [
        pytest.param([ECHO_KEY], "/v1", id="401"),
        pytest.param([api_error(403, "forbidden")], "/v1", id="403"),
        pytest.param([], "/v1", id="404-model"),
        pytest.param([], "", id="html-404-base-url"),
        pytest.param([HANG], "/v1", id="slow"),
        pytest.param([api_error(503, "overloaded")], "/v1", id="5xx"),
    ],
)
def test_check_online_matches_gen_cases(gateway: FakeGateway, isolated: Path, script: list[Reply], path: str) -> None:
    if script:
        gateway.script("good-model", *script)
    timeout = 0.5 if HANG in script else 60  # the hanging gateway: both must give up the same way
    cfg = load_config(write_config(isolated, gateway.root + path, request_timeout=timeout), None, None, None)
    error = gencases.run(cfg, out=isolated / "cases.json").error
    assert error is not None
    assert check_online(cfg) == ("fail", error.message, error.hint)
    assert_no_secret(isolated, error.message)


def test_check_online_names_a_missing_key(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_VAR)
    status, detail, hint = check_online(load_config(write_config(isolated, "http://127.0.0.1:9/v1"), None, None, None))
    assert (status, detail) == ("fail", f"the API key variable {KEY_VAR} is not set") and KEY_VAR in (hint or "")


def test_check_online_ok_and_rate_limited(gateway: FakeGateway, isolated: Path) -> None:
    cfg = load_config(write_config(isolated, gateway.base_url), None, None, None)
    gateway.script("good-model", completion("OK"))
    status, detail, hint = check_online(cfg)
    assert (status, hint) == ("ok", None) and "model 'good-model' answered" in detail
    assert gateway.chats()[-1].body["max_tokens"] == 1
    gateway.script("good-model", rate_limited("0.1"))
    assert check_online(cfg)[0] == "warn"


# --------------------------------------------------------------------------------------------
# --offline


def test_offline_needs_no_gateway_and_feeds_verify(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_VAR)
    config = write_config(isolated, "http://127.0.0.1:9/v1")
    result = gen(config, "--offline", "--max-seq-len", "1000")
    assert result.exit_code == 0, result.output
    cases = load_cases(isolated / "cases.json")
    lengths = {c["seq_len"] for c in cases}
    assert {1, 15, 16, 17, 127, 128, 129, 251, 256, 509, 512, 1000} <= lengths and max(lengths) == 1000
    assert {c["head_dim"] for c in cases} == set(HEAD_DIMS)
    first = (isolated / "cases.json").read_text()
    assert gen(config, "--offline", "--max-seq-len", "1000", "--force").exit_code == 0  # deterministic: same set again
    assert json.loads(first)["cases"] == json.loads((isolated / "cases.json").read_text())["cases"]
    assert records(isolated)[-1]["results"]["generator"] == "offline"


def test_offline_count_caps_the_set(isolated: Path) -> None:
    result = gen(write_config(isolated, "http://127.0.0.1:9/v1"), "--offline", "--count", "5", "--json")
    assert result.exit_code == 0
    # the count caps the length cases; the variants' few small edge cases always come after them
    assert json.loads(result.stdout)["n_cases"] == 5 + len(variant_cases(16384))


@pytest.mark.parametrize("max_seq_len", [1, 2, 64, 100, 16384])
def test_offline_covers_every_head_dim(max_seq_len: int) -> None:
    cases = offline_cases(max_seq_len)
    assert {c.head_dim for c in cases} == set(HEAD_DIMS)
    assert max(c.seq_len for c in cases) == max_seq_len and min(c.seq_len for c in cases) == 1
    assert len(set(cases)) == len(cases)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--offline", "--model", "gpt-4o"], "--offline asks no model", id="offline-with-model"),
        pytest.param(["--count", "0"], "cases.count", id="count-zero"),
        pytest.param(["--out", "."], "is a folder", id="out-is-folder"),
    ],
)
def test_usage_errors(isolated: Path, args: list[str], message: str) -> None:
    result = gen(write_config(isolated, "http://127.0.0.1:9/v1"), *args)
    assert result.exit_code == 2 and message in result.stderr


def test_all_models_needs_a_list(isolated: Path) -> None:
    result = gen(write_config(isolated, "http://127.0.0.1:9/v1", models=[]), "--all-models")
    assert result.exit_code == 2 and "api.models is empty" in result.stderr


# --------------------------------------------------------------------------------------------
# Parsing and the cases file, without a server


@pytest.mark.parametrize(
    ("text", "n_items", "why"),
    [
        ('{"cases": [{"seq_len": 1, "head_dim": 64}]}', 1, None),
        ("[(3, 64), (4, 32)]", 2, None),  # a Python literal
        ("[{3, 64}, b'x']", 2, None),  # not JSON-able as is: turned into strings
        ('{"test_cases": [[1, 64]]}', 1, None),
        ('{"seq_len": 1, "head_dim": 64}', 1, None),
        ('x {"cases": [{"seq_len": 2, "head_dim": 64, "note": "a ] \\" }"}]} y', 1, None),
        ("[see below] then [[5, 64]]", 1, None),
        ("no json here", 0, "no JSON found in the reply"),
        ('{"answer": 42}', 0, 'the JSON is not a list of cases or {"cases": [...]}'),
    ],
)
def test_extract_items(text: str, n_items: int, why: str | None) -> None:
    items, reason = extract_items(text)
    assert (len(items), reason) == (n_items, why)


def test_odd_literals_are_rejected_with_a_reason(gateway: FakeGateway, isolated: Path) -> None:
    gateway.script("good-model", completion("[(1, 64), {3, 64}, (17, 64j)]"))
    result = gen(write_config(isolated, gateway.base_url), "--json")
    assert result.exit_code == 0, result.output
    reasons = [r["reason"] for r in json.loads(result.stdout)["models"][0]["rejected"]]
    assert reasons == ['expected {"seq_len": N, "head_dim": D} or a [seq_len, head_dim] pair',
                       'head_dim "64j" is not an integer']


def test_validate_caps_at_count() -> None:
    cases, rejected = validate([[n, 64] for n in range(1, 6)], max_seq_len=100, count=3)
    assert [c.seq_len for c in cases] == [1, 2, 3]
    assert [r.reason for r in rejected] == ["more than the 3 cases asked for"] * 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(None, "no such cases file", id="missing"),
        pytest.param("{", "invalid JSON", id="bad-json"),
        pytest.param('{"cases": 3}', 'expected {"cases": [...]} or a list of cases', id="not-a-list"),
        pytest.param('[{"seqlen": 1}]', "cases[0].seqlen: unknown key", id="unknown-key"),
        pytest.param('[{"seq_len": "64"}]', "cases[0].seq_len: input should be a valid integer", id="string"),
        pytest.param('[{"head_dim": 512}]', "cases[0].head_dim", id="head-dim-range"),
        pytest.param('[{"model": "x"}]', "cases[0] sets no shape key", id="empty-case"),
        pytest.param("[3]", "cases[0]: expected an object", id="not-an-object"),
        pytest.param('{"cases": []}', "holds no cases", id="no-cases"),
    ],
)
def test_load_cases_errors(isolated: Path, content: str | None, message: str) -> None:
    path = isolated / "cases.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InputError, match=None) as info:
        load_cases(path)
    assert message in info.value.message and info.value.hint


def test_load_cases_hand_written(isolated: Path) -> None:
    path = isolated / "mine.json"
    path.write_text('[{"seq_len": 97, "head_dim": 40, "causal": true, "dtype": "bfloat16"}, {"seq_len": 1}]')
    assert load_cases(path) == [{"seq_len": 97, "head_dim": 40, "causal": True, "dtype": "bfloat16"},
                                {"seq_len": 1}]


def test_load_cases_reads_short_dtype_names(isolated: Path) -> None:
    path = isolated / "mine.json"
    path.write_text('[{"seq_len": 97, "dtype": "bf16"}, {"seq_len": 1, "dtype": "fp32"}, {"seq_len": 2, "dtype": "fp16"}]')
    assert [c["dtype"] for c in load_cases(path)] == ["bfloat16", "float32", "float16"]


def test_verbose_traceback_masks_the_key(gateway: FakeGateway, isolated: Path) -> None:
    # -v prints the traceback of a user-facing error; the server's reply in it echoes the key
    gateway.script("good-model", ECHO_KEY)
    result = gen(write_config(isolated, gateway.base_url), "-v")
    assert result.exit_code == 1
    assert "Traceback" in result.output and "GatewayError" in result.output
    assert_no_secret(isolated, result.output)
