"""check-env: the real thing on this machine, and every hint from fabricated facts."""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import math
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from flashrun.config import load_config
from flashrun.device import INTERPRETER_NOTICE
from flashrun.env import checks as envcheck
from flashrun.env import probes
from flashrun.env import report as envreport
from flashrun.env.checks import Check
from flashrun.env.probes import (
    DriverInfo,
    Gpu,
    LibcudaInfo,
    Nvcc,
    PtxasInfo,
    Toolkit,
    TorchInfo,
    TritonInfo,
)
from flashrun.env.report import Report
from flashrun.records.redact import redact

NAMES = ["os", "python", "torch", "cuda", "gpu", "driver", "driver_vs_torch", "triton", "ptxas", "cuda_home",
         "nvcc", "libcuda", "log_dir", "api_key", "base_url", "smoke", "gateway"]
FAKE_KEY = "sk-fake-envcheck-77b1e0c2d9"


def rows(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def assert_shape(report: dict) -> None:
    assert set(report) == {"ok", "outcome", "checks"}
    assert [c["name"] for c in report["checks"]] == NAMES
    for check in report["checks"]:
        assert set(check) == {"name", "status", "detail", "hint"}
        assert check["status"] in ("ok", "warn", "fail", "skip") and check["detail"]
        assert bool(check["hint"]) == (check["status"] in ("warn", "fail")), check
    assert report["ok"] == all(c["status"] != "fail" for c in report["checks"])


def fake_tool(folder: Path, name: str, script: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / name
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return tool


# -- on this machine ------------------------------------------------------------------------------


def test_check_env_in_a_real_process(flashrun, tmp_path: Path) -> None:
    proc = flashrun("check-env", "--json", env={"OPENAI_API_KEY": FAKE_KEY})
    report = json.loads(proc.stdout)  # --json: stdout is one JSON object and nothing else
    assert_shape(report)
    assert proc.returncode == (0 if report["ok"] else 1)
    found = rows(report)
    assert found["api_key"] == {"name": "api_key", "status": "ok", "hint": None,
                                "detail": "OPENAI_API_KEY is set (value hidden)"}
    assert found["smoke"]["status"] == "ok", found["smoke"]
    if found["cuda"]["status"] != "ok":  # no GPU here: the kernel ran through the interpreter
        assert found["smoke"]["detail"].startswith(INTERPRETER_NOTICE)
    assert found["gateway"]["status"] == "skip"
    assert FAKE_KEY not in proc.stdout + proc.stderr
    assert FAKE_KEY not in (tmp_path / "logs" / "runs.jsonl").read_text()


def test_missing_key_warns_names_the_variable_and_does_not_fail_the_run(cli, tmp_path: Path) -> None:
    # `flashrun init` suggests `check-env && verify`: a machine without a key must get to verify
    result = cli("check-env", "--json")
    report = json.loads(result.stdout)
    assert_shape(report)
    key = rows(report)["api_key"]
    assert key["status"] == "warn" and "OPENAI_API_KEY is not set" in key["detail"]
    assert "export OPENAI_API_KEY=" in key["hint"]
    failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
    assert "api_key" not in failed and "api_key" not in report["outcome"]
    assert result.exit_code == (1 if failed else 0), failed  # 0 here: nothing else fails on a CPU machine
    record = json.loads((tmp_path / "logs" / "runs.jsonl").read_text().splitlines()[-1])
    assert record["command"] == "check-env" and record["results"]["outcome"] == report["outcome"]


def test_missing_key_fails_the_run_with_online(cli, tmp_path: Path) -> None:
    result = cli("check-env", "--json", "--online")  # no key: the gateway is never contacted
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert_shape(report)
    key = rows(report)["api_key"]
    assert key["status"] == "fail" and "OPENAI_API_KEY is not set" in key["detail"]
    assert "export OPENAI_API_KEY=" in key["hint"]
    assert "api_key" in report["outcome"]
    assert rows(report)["gateway"]["status"] == "fail"
    record = json.loads((tmp_path / "logs" / "runs.jsonl").read_text().splitlines()[-1])
    assert record["command"] == "check-env" and record["results"]["outcome"] == report["outcome"]


def test_table_output(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)
    monkeypatch.setenv("COLUMNS", "200")
    result = cli("check-env")
    for name in NAMES:
        assert name in result.stdout
    assert result.stdout.rstrip().splitlines()[-1].startswith("ok" if result.exit_code == 0 else "failed:")
    assert FAKE_KEY not in result.output


def test_no_nvidia_smi_and_no_nvml_is_a_finding(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no nvidia-smi (nor nvcc) on PATH
    monkeypatch.setattr(probes, "probe_nvml", lambda: DriverInfo())
    result = cli("check-env", "--json")
    assert result.exit_code in (0, 1) and "Traceback" not in result.output
    driver = rows(json.loads(result.stdout))["driver"]
    assert driver["status"] == "warn" and "nvidia-smi is not on PATH" in driver["detail"]


def test_unwritable_log_dir_is_a_failed_row_not_a_crash(cli, tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("")
    result = cli("check-env", "--json", "--set", "logging.log_dir=blocker/logs")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert rows(json.loads(result.stdout))["log_dir"]["status"] == "fail"


def test_a_crashing_check_is_reported_and_the_rest_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> list[Toolkit]:
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(probes, "probe_toolkits", boom)
    monkeypatch.setattr(envreport, "smoke_test", lambda torch, ok: Check("smoke", "skip", "not in this test"))
    report = envreport.run_checks(load_config())
    found = {c.name: c for c in report.checks}
    assert [c.name for c in report.checks] == NAMES
    for name in ("cuda_home", "nvcc"):
        assert found[name].status == "fail"
        assert "the check itself crashed: RuntimeError: probe exploded" in found[name].detail
    assert found["torch"].status == "ok"


def interpreted_smoke(monkeypatch: pytest.MonkeyPatch):
    """flashrun.env.smoke imported afresh, so its kernel is defined for the interpreter even where an
    in-process check-env on a GPU machine already imported it compiled."""
    from flashrun import device

    assert device.select("cpu").interpreter
    monkeypatch.delitem(sys.modules, "flashrun.env.smoke", raising=False)
    return importlib.import_module("flashrun.env.smoke")


def test_interpreter_smoke_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    smoke = interpreted_smoke(monkeypatch)
    result = smoke.run("cpu")
    assert result.ok and result.max_error <= smoke.TOLERANCE


def test_smoke_kernel_that_writes_nothing_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    smoke = interpreted_smoke(monkeypatch)

    class NoLaunch:  # a "kernel" whose launch does nothing: the poisoned output must show it
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(smoke, "_dot_kernel", NoLaunch())
    result = smoke.run("cpu")
    assert math.isnan(result.max_error) and not result.ok
    assert not smoke.SmokeResult(0.5, 0.1).ok and smoke.SmokeResult(0.0, 0.1).ok


# -- probes with fake tools -----------------------------------------------------------------------

SMI_XML = """<?xml version="1.0" ?>
<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">
<nvidia_smi_log>
  <driver_version>580.95.05</driver_version>
  <cuda_version>13.0</cuda_version>
  <attached_gpus>2</attached_gpus>
  <gpu id="00000000:18:00.0">
    <product_name>NVIDIA H200</product_name>
    <fb_memory_usage><total>143771 MiB</total><used>0 MiB</used></fb_memory_usage>
    <bar1_memory_usage><total>262144 MiB</total></bar1_memory_usage>
  </gpu>
  <gpu id="00000000:2A:00.0">
    <product_name>NVIDIA H200</product_name>
    <fb_memory_usage><total>143771 MiB</total></fb_memory_usage>
  </gpu>
</nvidia_smi_log>
"""


def test_parse_nvidia_smi_xml() -> None:
    info = probes.parse_nvidia_smi_xml(SMI_XML)
    assert (info.source, info.version, info.cuda, info.found) == ("nvidia-smi", "580.95.05", "13.0", True)
    assert info.gpus == (Gpu("NVIDIA H200", 143771 * 2**20),) * 2
    assert probes.parse_nvidia_smi_xml("<not xml").problem.startswith("unreadable")


def test_probe_driver_reads_a_working_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "smi.xml").write_text(SMI_XML)
    fake_tool(tmp_path / "bin", "nvidia-smi", f'cat "{tmp_path / "smi.xml"}"\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")  # ahead of a real one
    check = envcheck.check_driver(probes.probe_driver())
    assert check == Check("driver", "ok", "580.95.05, supports CUDA 13.0 and older (from nvidia-smi)")


def test_probe_driver_reports_a_broken_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    message = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
               "Make sure that the latest NVIDIA driver is installed and running.")
    fake_tool(tmp_path / "bin", "nvidia-smi", f'echo "{message}"\nexit 9\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    driver = probes.probe_driver()
    assert not driver.found and driver.problem == message
    check = envcheck.check_driver(driver)
    assert check.status == "fail" and check.detail == f"nvidia-smi failed: {message}"
    assert "kernel module is not loaded" in check.hint


def test_probe_driver_without_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(probes, "probe_nvml", lambda: DriverInfo())
    assert probes.probe_driver() == DriverInfo()


def test_probe_nvml_without_the_library_is_no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(probes.ctypes, "CDLL", no_library)
    assert probes.probe_nvml() == DriverInfo()


FAKE_NVML = r"""
#include <string.h>
typedef struct { unsigned long long total, free, used; } memory_t;
int nvmlInit_v2(void) { return INIT_RESULT; }
int nvmlShutdown(void) { return 0; }
int nvmlSystemGetDriverVersion(char *buf, unsigned int n) { strncpy(buf, "580.95.05", n); return 0; }
int nvmlSystemGetCudaDriverVersion(int *v) { *v = 12080; return 0; }
int nvmlDeviceGetCount_v2(unsigned int *c) { *c = 2; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **h) { *h = (void *)(long)(i + 1); return 0; }
int nvmlDeviceGetName(void *h, char *buf, unsigned int n) {
    strncpy(buf, h == (void *)1 ? "NVIDIA H200" : "NVIDIA A100", n); return 0;
}
int nvmlDeviceGetMemoryInfo(void *h, memory_t *m) { m->total = 1ULL << 34; m->free = m->used = 0; return 0; }
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a stand-in libnvidia-ml")
@pytest.mark.parametrize("init_result", [0, 9])
def test_probe_nvml_reads_the_driver_through_ctypes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     init_result: int) -> None:
    (tmp_path / "nvml.c").write_text(FAKE_NVML.replace("INIT_RESULT", str(init_result)))
    library = tmp_path / "libnvidia-ml.so.1"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(tmp_path / "nvml.c")], check=True)
    load = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL", lambda name: load(str(tmp_path / name)))
    driver = probes.probe_nvml()
    if init_result:  # 9: NVML_ERROR_DRIVER_NOT_LOADED
        assert driver == DriverInfo(source="NVML", problem="nvmlInit failed with NVML error 9")
    else:
        assert driver == DriverInfo("NVML", "580.95.05", "12.8", (Gpu("NVIDIA H200", 2**34), Gpu("NVIDIA A100", 2**34)))


def test_toolkit_version_sources(tmp_path: Path) -> None:
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "version.json").write_text('{"cuda": {"name": "CUDA SDK", "version": "12.4.1"}}')
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "version.txt").write_text("CUDA Version 10.2.89\n")
    fake_tool(tmp_path / "bare" / "bin", "nvcc", 'echo "Cuda compilation tools, release 11.8, V11.8.89"\n')
    (tmp_path / "empty").mkdir()
    assert probes.toolkit_version(tmp_path / "new") == "12.4.1"
    assert probes.toolkit_version(tmp_path / "old") == "10.2"
    assert probes.toolkit_version(tmp_path / "bare") == "11.8"
    assert probes.toolkit_version(tmp_path / "empty") is None


def test_probe_toolkits_and_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvcc = fake_tool(tmp_path / "cuda" / "bin", "nvcc", 'echo "Cuda compilation tools, release 12.8, V12.8.93"\n')
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("PATH", str(tmp_path / "cuda" / "bin"))
    toolkits = probes.probe_toolkits()
    assert toolkits == [Toolkit("CUDA_HOME", str(tmp_path / "cuda"), True, "12.8")]
    assert probes.probe_nvcc() == Nvcc(str(nvcc), "12.8")
    assert envcheck.check_nvcc(probes.probe_nvcc(), toolkits, "12.8").status == "ok"
    assert envcheck.check_cuda_home(toolkits, "13.0").status == "warn"


def test_probe_ptxas_asks_triton() -> None:
    info = probes.probe_ptxas(None)
    assert info is not None and info.path is not None, info
    assert Path(info.path).is_file() and probes.major_minor(info.version)
    assert envcheck.check_ptxas(info, None).status == "ok"


def test_probe_ptxas_reports_an_ignored_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bundled = probes.probe_ptxas(None)
    variable = envcheck.ptxas_variable(Path(bundled.path).name)
    monkeypatch.setenv(variable, str(tmp_path / "no-such-ptxas"))
    check = envcheck.check_ptxas(probes.probe_ptxas(None), None)
    assert check.status == "warn" and check.hint == f"fix or unset {variable}"


def test_probe_log_dir(tmp_path: Path) -> None:
    assert probes.probe_log_dir(tmp_path / "new" / "logs") is None and (tmp_path / "new" / "logs").is_dir()
    (tmp_path / "f").write_text("")
    assert probes.probe_log_dir(tmp_path / "f" / "logs")  # why not, e.g. "Not a directory"


# -- pure decisions -------------------------------------------------------------------------------

NO_DRIVER = DriverInfo()
DRIVER_13 = DriverInfo("nvidia-smi", "580.95.05", "13.0", (Gpu("NVIDIA H200", 143771 * 2**20),))
DRIVER_11 = DriverInfo("nvidia-smi", "470.82.01", "11.4", (Gpu("Tesla T4"),))
CPU_TORCH = TorchInfo("2.13.0+cpu")
CUDA_TORCH_OFF = TorchInfo("2.11.0+cu130", cuda="13.0")
H200 = Gpu("NVIDIA H200", 150 * 2**30, (9, 0))
CUDA_TORCH_ON = TorchInfo("2.11.0+cu130", cuda="13.0", available=True, gpus=(H200,))


def test_check_invariants() -> None:
    with pytest.raises(ValueError, match="needs a hint"):
        Check("x", "warn", "something")
    with pytest.raises(ValueError, match="unknown status"):
        Check("x", "bad", "something")  # type: ignore[arg-type]
    report = Report([Check("a", "ok", "."), Check("b", "warn", ".", "h"), Check("c", "skip", ".")])
    assert (report.ok, report.exit_code, report.outcome) == (True, 0, "ok (1 warning)")
    report = Report([Check("a", "fail", ".", "h"), Check("b", "fail", ".", "h")])
    assert (report.ok, report.exit_code, report.outcome) == (False, 1, "failed: a, b")


@pytest.mark.parametrize(
    ("torch", "driver", "visible", "status", "in_detail", "in_hint"),
    [
        (CUDA_TORCH_ON, DRIVER_13, None, "ok", "True (1 GPU)", None),
        (CPU_TORCH, DRIVER_13, None, "fail", "CPU-only wheel", "CUDA build of torch for CUDA 13.0 or older"),
        (CPU_TORCH, NO_DRIVER, None, "warn", "CPU interpreter mode", "NVIDIA GPU"),
        (CUDA_TORCH_OFF, DRIVER_13, "", "fail", "CUDA_VISIBLE_DEVICES='' hides every GPU", "unset CUDA_VISIBLE_DEVICES"),
        (CUDA_TORCH_OFF, DRIVER_13, "-1", "fail", "hides every GPU", "unset CUDA_VISIBLE_DEVICES"),
        (CUDA_TORCH_OFF, DriverInfo("nvidia-smi", problem="Failed to initialize NVML: Driver/library version mismatch"),
         None, "fail", "driver is not working", "reboot"),
        (CUDA_TORCH_OFF, NO_DRIVER, None, "warn", "no NVIDIA driver found", "install the NVIDIA driver"),
        (CUDA_TORCH_OFF, DRIVER_11, None, "fail", "the driver supports CUDA 11.4, this torch needs CUDA 13.0",
         "update the NVIDIA driver"),
        (CUDA_TORCH_OFF, DRIVER_13, "0", "fail", "the driver lists 1 GPU(s) but torch sees none", "--gpus all"),
        (TorchInfo(None, error="ImportError: libtorch.so"), NO_DRIVER, None, "skip", "not importable", None),
    ],
)
def test_check_cuda(torch, driver, visible, status, in_detail, in_hint) -> None:
    check = envcheck.check_cuda(torch, driver, visible)
    assert check.status == status
    assert in_detail in check.detail
    if in_hint:
        assert in_hint in check.hint


def test_check_cuda_quotes_torchs_own_warning() -> None:
    torch = TorchInfo("2.11.0+cu130", cuda="13.0", cuda_warning="CUDA initialization: Unexpected error from cudaGetDeviceCount()")
    assert "torch warned: CUDA initialization" in envcheck.check_cuda(torch, DRIVER_13, None).detail


def test_check_torch() -> None:
    assert envcheck.check_torch(CPU_TORCH) == Check("torch", "ok", "2.13.0+cpu (CPU-only build)")
    assert envcheck.check_torch(CUDA_TORCH_ON).detail == "2.11.0+cu130 (CUDA 13.0 build)"
    broken = envcheck.check_torch(TorchInfo(None, error="OSError: libcudnn.so.9: cannot open"))
    assert broken.status == "fail" and "libcudnn" in broken.detail and "pip install torch" in broken.hint


def test_check_gpus() -> None:
    assert envcheck.check_gpus(CUDA_TORCH_ON, DRIVER_13) == Check("gpu", "ok", "NVIDIA H200 (sm_90, 150.0 GiB)")
    turing = TorchInfo("2.11.0+cu130", cuda="13.0", available=True, gpus=(Gpu("Tesla T4", 15 * 2**30, (7, 5)),))
    assert envcheck.check_gpus(turing, DRIVER_13).status == "warn"
    unseen = envcheck.check_gpus(CUDA_TORCH_OFF, DRIVER_13)
    assert unseen.status == "warn" and "seen by the driver, not by torch" in unseen.detail
    assert envcheck.check_gpus(CPU_TORCH, NO_DRIVER).status == "skip"


@pytest.mark.parametrize(
    ("driver_cuda", "torch_cuda", "status"),
    [
        ("13.0", "13.0", "ok"),
        ("13.0", "12.8", "ok"),
        ("12.2", "12.4", "warn"),  # minor-version compatibility
        ("11.8", "12.4", "fail"),
        ("12.8", "13.0", "fail"),
        (None, "12.4", "skip"),
        ("13.0", None, "skip"),
        ("N/A", "12.4", "warn"),
    ],
)
def test_check_driver_vs_torch(driver_cuda, torch_cuda, status) -> None:
    check = envcheck.check_driver_vs_torch(driver_cuda, torch_cuda)
    assert check.status == status
    if status == "fail":
        assert "update the NVIDIA driver" in check.hint and f"CUDA {driver_cuda} or older" in check.hint


@pytest.mark.parametrize(
    ("problem", "hint"),
    [
        ("Failed to initialize NVML: Driver/library version mismatch", "reboot"),
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver", "not loaded"),
        ("No devices were found", "--gpus all"),
        ("Insufficient Permissions", "video"),
        ("Segmentation fault", "run `nvidia-smi` yourself"),
    ],
)
def test_driver_problem_hint(problem: str, hint: str) -> None:
    assert hint in envcheck.driver_problem_hint(problem)


def test_check_driver_missing_is_a_warning() -> None:
    check = envcheck.check_driver(NO_DRIVER)
    assert check.status == "warn" and check.detail.startswith("no NVIDIA driver: nvidia-smi is not on PATH")
    unasked = envcheck.check_driver(NO_DRIVER, torch_sees_gpu=True)  # e.g. a container without nvidia-smi
    assert unasked.status == "warn" and unasked.detail.startswith("version unknown") and "nvidia-smi" in unasked.hint


TORCH_211_REQUIRES = ["filelock", "nvidia-cuda-runtime==13.0.96; platform_system == \"Linux\"",
                      "triton==3.6.0; platform_system == \"Linux\"", "optree>=0.13.0; extra == \"optree\""]


@pytest.mark.parametrize(
    ("installed", "requires", "error", "status", "text"),
    [
        ({"triton": "3.6.0"}, TORCH_211_REQUIRES, None, "ok", "triton 3.6.0, as torch 2.11.0 requires (triton==3.6.0)"),
        ({"triton": "3.9.0"}, TORCH_211_REQUIRES, None, "warn", "requires triton==3.6.0"),
        ({}, TORCH_211_REQUIRES, None, "fail", "not installed"),
        ({"triton": "3.6.0"}, TORCH_211_REQUIRES, "ImportError: libtriton.so", "fail", "cannot be imported"),
        ({"triton": "3.9.0"}, ["filelock", "sympy>=1.13.3"], None, "ok", "does not pin"),  # CPU wheels
        ({"triton": "3.9.0"}, ['triton==3.6.0; platform_system == "Windows"'], None, "ok", "does not pin"),
        ({"pytorch-triton": "3.7.0+git9a1b"}, ["pytorch-triton==3.7.0+git9a1b"], None, "ok", "pytorch-triton 3.7.0+git9a1b"),
    ],
)
def test_check_triton(installed, requires, error, status, text) -> None:
    check = envcheck.check_triton(TritonInfo(installed, requires, "2.11.0", error))
    assert check.status == status
    assert text in check.detail
    if status == "warn":
        assert check.hint.startswith('pip install "triton==3.6.0"')


BIN = "/venv/triton/backends/nvidia/bin"


@pytest.mark.parametrize(
    ("info", "driver_cuda", "status", "text"),
    [
        (None, None, "skip", "not importable"),
        (PtxasInfo(None, BIN, path=f"{BIN}/ptxas", version="12.9"), None, "ok",
         f"{BIN}/ptxas, CUDA 12.9, bundled with Triton (used only when compiling for a GPU)"),
        (PtxasInfo(90, BIN, path=f"{BIN}/ptxas", version="12.8"), "13.0", "ok", "for sm_90"),
        (PtxasInfo(100, BIN, path=f"{BIN}/ptxas-blackwell", version="13.1"), "12.8", "warn", "newer than the driver's CUDA 12.8"),
        (PtxasInfo(90, BIN, {"TRITON_PTXAS_PATH": "/opt/cuda-11.8/bin/ptxas"}, path="/opt/cuda-11.8/bin/ptxas",
                   version="11.8"), "13.0", "ok", "from TRITON_PTXAS_PATH"),
        (PtxasInfo(90, BIN, {"TRITON_PTXAS_PATH": "/usr/local/cuda/bin/ptxas"}, path="/usr/local/cuda/bin/ptxas",
                   version="13.0"), "12.4", "warn", "newer than the driver"),
        (PtxasInfo(90, BIN, {"TRITON_PTXAS_PATH": "/gone/ptxas"}, path=f"{BIN}/ptxas", version="12.8"), None, "warn",
         "TRITON_PTXAS_PATH=/gone/ptxas is not a working ptxas"),
        # pointing the variable at the bundled ptxas itself is not a fallback
        (PtxasInfo(90, BIN, {"TRITON_PTXAS_PATH": f"{BIN}/ptxas"}, path=f"{BIN}/ptxas", version="12.8"), None, "ok",
         "bundled"),
        # an override for the other GPU family is not this GPU's business
        (PtxasInfo(90, BIN, {"TRITON_PTXAS_BLACKWELL_PATH": "/gone"}, path=f"{BIN}/ptxas", version="12.8"), None, "ok",
         "bundled"),
        (PtxasInfo(90, BIN, error="Cannot find ptxas"), None, "fail", "Triton cannot find ptxas"),
    ],
)
def test_check_ptxas(info, driver_cuda, status, text) -> None:
    check = envcheck.check_ptxas(info, driver_cuda)
    assert check.status == status
    assert text in check.detail


def test_check_ptxas_hints_name_the_variable_to_change() -> None:
    overridden = PtxasInfo(90, BIN, {"TRITON_PTXAS_PATH": "/usr/local/cuda/bin/ptxas"},
                           path="/usr/local/cuda/bin/ptxas", version="13.0")
    assert "unset TRITON_PTXAS_PATH" in envcheck.check_ptxas(overridden, "12.4").hint
    blackwell = PtxasInfo(100, BIN, path=f"{BIN}/ptxas-blackwell", version="13.1")
    assert "TRITON_PTXAS_BLACKWELL_PATH" in envcheck.check_ptxas(blackwell, "12.8").hint


def test_ptxas_variable_follows_tritons_naming() -> None:
    assert envcheck.ptxas_variable("ptxas") == "TRITON_PTXAS_PATH"
    assert envcheck.ptxas_variable("ptxas-blackwell") == "TRITON_PTXAS_BLACKWELL_PATH"


def tk(version: str | None, path: str = "/usr/local/cuda", variable: str = "CUDA_HOME", exists: bool = True) -> Toolkit:
    return Toolkit(variable, path, exists, version)


@pytest.mark.parametrize(
    ("toolkits", "torch_cuda", "status", "text"),
    [
        ([], "13.0", "ok", "not set"),
        ([tk("13.0")], "13.0", "ok", "matches torch"),
        ([tk("12.4.1")], "12.8", "ok", "same major version"),
        ([tk("11.8")], "12.4", "warn", "CUDA_HOME=/usr/local/cuda (CUDA 11.8), but torch was built with CUDA 12.4"),
        ([tk("11.8")], None, "ok", "nothing to match"),
        ([tk(None, exists=False)], "12.4", "warn", "does not exist"),
        ([tk(None)], "12.4", "warn", "no CUDA version found"),
        ([tk("12.4"), tk("11.8", "/opt/cuda-11.8", "CUDA_PATH")], "12.4", "warn", "name different toolkits"),
        ([tk("12.4"), tk("12.4", "/usr/local/cuda/", "CUDA_PATH")], "12.4", "ok", "CUDA_HOME = CUDA_PATH="),
    ],
)
def test_check_cuda_home(toolkits, torch_cuda, status, text) -> None:
    check = envcheck.check_cuda_home(toolkits, torch_cuda)
    assert check.status == status
    assert text in check.detail
    if "torch was built" in text:
        assert check.hint.startswith("unset CUDA_HOME (Triton ships its own ptxas)")


def test_check_nvcc(tmp_path: Path) -> None:
    home = tmp_path / "cuda-12.4"
    fake_tool(home / "bin", "nvcc", "")
    inside = Nvcc(str(home / "bin" / "nvcc"), "12.4")
    assert envcheck.check_nvcc(None, [], "12.4").status == "skip"
    assert envcheck.check_nvcc(inside, [tk("12.4", str(home))], "12.4").status == "ok"
    elsewhere = envcheck.check_nvcc(Nvcc("/usr/bin/nvcc", "11.5"), [tk("12.4", str(home))], "12.4")
    assert elsewhere.status == "warn" and "not the toolkit in CUDA_HOME" in elsewhere.detail
    old = envcheck.check_nvcc(Nvcc("/usr/bin/nvcc", "11.5"), [], "12.4")
    assert old.status == "warn" and "torch's CUDA runtime is 12.4" in old.detail
    assert envcheck.check_nvcc(Nvcc("/usr/bin/nvcc", "12.1"), [], "12.4").status == "ok"
    assert envcheck.check_nvcc(Nvcc("/usr/bin/nvcc", None), [], "12.4").status == "warn"


def lib(**kw) -> LibcudaInfo:
    base = {"env_path": None, "env_has_lib": False, "ldconfig": (), "ld_library_path": (), "wsl_lib": False}
    return LibcudaInfo(**{**base, **kw})


@pytest.mark.parametrize(
    ("info", "wsl", "driver", "status", "text"),
    [
        (lib(ldconfig=("/lib/x86_64-linux-gnu/libcuda.so.1",)), None, True, "ok", "from the loader cache"),
        (lib(ld_library_path=("/opt/drv/libcuda.so.1",)), None, True, "ok", "from LD_LIBRARY_PATH"),
        (lib(env_path="/opt/x", env_has_lib=True), None, True, "ok", "TRITON_LIBCUDA_PATH=/opt/x"),
        (lib(env_path="/opt/x"), None, True, "fail", "holds no libcuda.so.1"),
        (lib(ldconfig=("/usr/lib/wsl/lib/libcuda.so.1",)), 2, True, "ok", "/usr/lib/wsl/lib/libcuda.so.1"),
        (lib(ldconfig=("/usr/lib/x86_64-linux-gnu/libcuda.so.1",)), 2, True, "warn", "not /usr/lib/wsl/lib"),
        (lib(wsl_lib=True), 2, True, "fail", "the loader does not search /usr/lib/wsl/lib"),
        (lib(), None, True, "fail", "although the driver is installed"),
        (lib(), None, False, "skip", "no NVIDIA driver"),
    ],
)
def test_check_libcuda(info, wsl, driver, status, text) -> None:
    check = envcheck.check_libcuda(info, wsl, driver)
    assert check.status == status
    assert text in check.detail


def test_parse_ldconfig() -> None:
    output = """3 libs found in cache `/etc/ld.so.cache'
	libcudart.so.12 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcudart.so.12
	libcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1
	libcuda.so (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so
"""
    assert probes.parse_ldconfig(output) == ("/usr/lib/x86_64-linux-gnu/libcuda.so.1",)


@pytest.mark.parametrize(
    ("system", "release", "dxg", "status", "text"),
    [
        ("Linux", "6.8.0-45-generic", False, "ok", "Linux 6.8.0-45-generic"),
        ("Linux", "5.15.153.1-microsoft-standard-WSL2", True, "ok", "WSL2"),
        ("Linux", "5.15.153.1-microsoft-standard-WSL2", False, "warn", "without /dev/dxg"),
        ("Linux", "4.4.0-19041-Microsoft", False, "warn", "WSL1"),
        ("Windows", "10", False, "warn", "targets Linux"),
        ("Darwin", "23.4.0", False, "warn", "no CUDA"),
    ],
)
def test_check_os(system, release, dxg, status, text) -> None:
    check = envcheck.check_os(system, release, dxg)
    assert check.status == status and text in check.detail
    if status == "warn" and "WSL2" in text:
        assert "wsl --update" in check.hint


def test_check_python() -> None:
    assert envcheck.check_python((3, 11, 7), "/venv/bin/python", None).detail == "3.11.7 (/venv/bin/python)"
    assert envcheck.check_python((3, 10, 14), "/py", "2.0.1").detail == "3.10.14, tomli 2.0.1 (/py)"


@pytest.mark.parametrize(
    ("url", "status", "text"),
    [
        ("https://taotoken.net/api", "ok", "https://taotoken.net/api (scheme https, host taotoken.net)"),
        ("https://api.openai.com/v1/", "ok", "https://api.openai.com/v1 "),
        ("http://localhost:8000/v1", "ok", "host localhost:8000"),
        ("https://api.openai.com/v1/chat/completions", "fail", "ends in /chat/completions"),
        ("https://gw.example/v1/models", "fail", "ends in /models"),
        ("api.openai.com/v1", "fail", "not an http(s) URL"),
        ("ftp://gw.example/v1", "fail", "not an http(s) URL"),
        ("https:///v1", "fail", "not an http(s) URL"),
        ("${FLASHRUN_GATEWAY}/v1", "fail", "refers to ${FLASHRUN_GATEWAY}, which is not set"),
        ("http://gw.example/v1", "warn", "plain http"),
        ("https://gw.example/v1?key=abc", "warn", "query or fragment"),
    ],
)
def test_check_base_url(url: str, status: str, text: str) -> None:
    check = envcheck.check_base_url(url)
    assert check.status == status and text in check.detail


def test_base_url_fix_hint_and_hidden_credentials() -> None:
    assert envcheck.check_base_url("https://api.openai.com/v1/chat/completions/").hint == \
        'set base_url = "https://api.openai.com/v1"'
    check = envcheck.check_base_url("https://me:hunter2secret@gw.example/v1")
    assert check.status == "warn" and "hunter2secret" not in check.detail + check.hint


@pytest.mark.parametrize("url", ["ftp://gw.example/v1", "https:///v1", "${FLASHRUN_GATEWAY}/v1"])
def test_gateway_refuses_the_base_urls_check_env_fails(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrun.errors import ConfigError
    from flashrun.gateway.client import Gateway

    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)
    cfg = load_config(sets=[f"api.base_url={json.dumps(url)}"])
    with pytest.raises(ConfigError) as refused:
        Gateway(cfg)
    check = envcheck.check_base_url(url)
    assert (check.status, check.detail, check.hint) == ("fail", refused.value.message, refused.value.hint)


def test_gateway_uses_the_root_without_a_trailing_slash(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrun.gateway.client import Gateway

    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)
    assert Gateway(load_config(sets=['api.base_url=" https://gw.example/v1/ "'])).base_url == "https://gw.example/v1"


def test_check_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(sets=["api.api_key_env=FLASHRUN_TEST_KEY"])
    missing = envcheck.check_api_key(cfg)
    assert missing.status == "warn" and "FLASHRUN_TEST_KEY is not set" in missing.detail
    assert "export FLASHRUN_TEST_KEY=" in missing.hint
    online = envcheck.check_api_key(cfg, online=True)
    assert online.status == "fail" and "FLASHRUN_TEST_KEY is not set" in online.detail
    assert online.hint == missing.hint
    monkeypatch.setenv("FLASHRUN_TEST_KEY", "")
    assert "(it is empty)" in envcheck.check_api_key(cfg).detail
    monkeypatch.setenv("FLASHRUN_TEST_KEY", FAKE_KEY)
    present = envcheck.check_api_key(cfg)
    assert present == Check("api_key", "ok", "FLASHRUN_TEST_KEY is set (value hidden)")
    assert redact(f"echo {FAKE_KEY}") == "echo ***"  # registered: masked wherever it turns up


def test_check_api_key_literal(tmp_path: Path) -> None:
    (tmp_path / "settings.json").write_text(json.dumps({"api": {"api_key": FAKE_KEY}}))
    check = envcheck.check_api_key(load_config(settings=Path("settings.json")))
    assert check.status == "warn" and FAKE_KEY not in check.detail + check.hint


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        ("PTXASError: PTXAS error: Internal Triton PTX codegen error\n`ptxas` stderr: ...", "TRITON_PTXAS_PATH"),
        ("AssertionError: libcuda.so cannot found!", "TRITON_LIBCUDA_PATH"),
        ("CalledProcessError: fatal error: Python.h: No such file or directory", "python3-dev"),
        ("RuntimeError: Failed to find C compiler. Please specify via CC environment variable.", "gcc"),
        ("RuntimeError: CUDA error: the provided PTX was compiled with an unsupported toolchain.", "update the NVIDIA driver"),
        ("OutOfMemoryError: CUDA out of memory.", "nvidia-smi"),
        ("RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable", "exclusive-process"),
        ("ValueError: something new", "check-env -v"),
    ],
)
def test_smoke_hint(error: str, hint: str) -> None:
    assert hint in envcheck.smoke_hint(error)
    assert "CUDA_HOME" in envcheck.smoke_hint("ptxas fatal") and "CUDA_HOME" not in envcheck.smoke_hint("libcuda")


def test_smoke_verdict() -> None:
    ok = envcheck.smoke_verdict(INTERPRETER_NOTICE, "a 20x20 tl.dot kernel", 0.05, 0.0, True)
    assert ok == Check("smoke", "ok", f"{INTERPRETER_NOTICE}: a 20x20 tl.dot kernel ran in 0.05 s (compile included), "
                                      "max error 0.0e+00")
    bad = envcheck.smoke_verdict("GPU (NVIDIA H200)", "k", 1.2, math.nan, False)
    assert bad.status == "fail" and bad.detail.startswith("GPU (NVIDIA H200): wrong result") and "triton row" in bad.hint


def test_smoke_test_reports_a_launch_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrun.env import smoke

    def broken(device: str) -> None:
        raise RuntimeError("PTXAS error: Internal Triton PTX codegen error\nmore lines")

    monkeypatch.setattr(smoke, "run", broken)
    check = envreport.smoke_test(CPU_TORCH, True)
    assert check.status == "fail"
    assert check.detail == f"{INTERPRETER_NOTICE}: RuntimeError: PTXAS error: Internal Triton PTX codegen error"
    assert "TRITON_PTXAS_PATH" in check.hint


def test_smoke_test_skips_without_torch_or_triton() -> None:
    assert envreport.smoke_test(TorchInfo(None, error="x"), True).status == "skip"
    assert envreport.smoke_test(CPU_TORCH, False).status == "skip"


def test_gateway_is_skipped_without_online() -> None:
    check = envreport.check_gateway(load_config(), online=False)
    assert check.status == "skip" and "--online" in check.detail


@pytest.mark.skipif(importlib.util.find_spec("flashrun.gateway.client") is None, reason="flashrun.gateway.client not merged yet")
@pytest.mark.parametrize(
    ("answer", "status", "hint"),
    [
        (("ok", "3 models", None), "ok", None),
        (("fail", "HTTP 401", "is the key variable exported?"), "fail", "is the key variable exported?"),
        (("fail", "HTTP 500", None), "fail", "check api.base_url, the key variable and the network"),
    ],
)
def test_gateway_online(monkeypatch: pytest.MonkeyPatch, answer, status, hint) -> None:
    from flashrun.gateway import client as gateway

    monkeypatch.setattr(gateway, "check_online", lambda cfg: answer)
    check = envreport.check_gateway(load_config(), online=True)
    assert (check.status, check.detail, check.hint) == (status, answer[1], hint)
