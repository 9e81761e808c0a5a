"""``flashrun check-env``: can this machine run Triton kernels, and if not, why not.

Two layers, so that every hint can be tested with fabricated inputs:

* ``probe_*`` functions gather facts (imports, subprocesses, ctypes, the filesystem). A missing
  tool or library is a fact, never an exception.
* ``check_*`` functions are pure: facts in, one :class:`Check` out. A ``warn`` or ``fail``
  always carries a one-line hint saying what to do.

:func:`run_checks` wires them together; an unexpected crash inside one check becomes a failed
row (with the traceback in the ``-v`` log), and the other rows are still reported.

The troubleshooting knowledge comes from the users' own war stories: a driver older than the
wheel's CUDA, ``+cpu`` wheels, ``CUDA_HOME`` pointing at another toolkit, Triton's bundled
ptxas versus ``TRITON_PTXAS_PATH``, ``nvcc`` from a different toolkit than the runtime, WSL2's
``/usr/lib/wsl/lib``, and an API key variable that the shell never exported.
"""

from __future__ import annotations

import ctypes
import inspect
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import warnings
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal
from urllib.parse import urlsplit

from rich.console import Console
from rich.table import Table
from rich.text import Text

from flashrun.config import Config, key_variable, resolve_api_key
from flashrun.errors import FlashrunError, MissingKeyError
from flashrun.records.redact import redact, redact_data, register_secret

if TYPE_CHECKING:
    from packaging.requirements import Requirement

log = logging.getLogger("flashrun.env.checks")

Status = Literal["ok", "warn", "fail", "skip"]
STATUSES = ("ok", "warn", "fail", "skip")

# Distributions that provide the ``triton`` module (torch nightlies and ROCm/XPU builds rename it).
TRITON_DISTS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")
# Variables with which a user points Triton at another ptxas (newer Triton has one per GPU family).
PTXAS_VARS = ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")
WSL_LIB = Path("/usr/lib/wsl/lib")
INSTALL_TORCH = "https://pytorch.org/get-started/locally"


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    hint: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name}: unknown status {self.status!r}")
        if self.status in ("warn", "fail") and not self.hint:
            raise ValueError(f"check {self.name}: a {self.status} needs a hint")


@dataclass(frozen=True)
class Report:
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    @property
    def outcome(self) -> str:
        failed = [c.name for c in self.checks if c.status == "fail"]
        if failed:
            return "failed: " + ", ".join(failed)
        warned = sum(c.status == "warn" for c in self.checks)
        return "ok" + (f" ({warned} warning{'s' if warned > 1 else ''})" if warned else "")

    def to_json(self) -> dict[str, Any]:
        return redact_data({"ok": self.ok, "outcome": self.outcome, "checks": [asdict(c) for c in self.checks]})


# --------------------------------------------------------------------------------------------
# Facts


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int | None = None
    capability: tuple[int, int] | None = None

    def describe(self) -> str:
        parts = [f"sm_{self.capability[0]}{self.capability[1]}"] if self.capability else []
        if self.memory_bytes:
            parts.append(f"{self.memory_bytes / 2**30:.1f} GiB")
        return self.name + (f" ({', '.join(parts)})" if parts else "")


@dataclass(frozen=True)
class DriverInfo:
    """What the NVIDIA driver says about itself (nvidia-smi, else NVML)."""

    source: str | None = None  # "nvidia-smi" or "NVML"; None when neither exists
    version: str | None = None
    cuda: str | None = None  # the highest CUDA version the driver supports
    gpus: tuple[Gpu, ...] = ()
    problem: str | None = None  # the tool exists but failed: what it said

    @property
    def found(self) -> bool:
        return self.version is not None


@dataclass(frozen=True)
class TorchInfo:
    version: str | None  # None: torch cannot be imported
    cuda: str | None = None  # torch.version.cuda: None on CPU-only and ROCm builds
    hip: str | None = None
    available: bool = False
    gpus: tuple[Gpu, ...] = ()
    error: str | None = None  # why the import failed
    cuda_warning: str | None = None  # what torch warned while looking for a GPU


@dataclass(frozen=True)
class TritonInfo:
    installed: dict[str, str]  # distribution -> version, for every TRITON_DISTS installed
    torch_requires: list[str]  # torch's Requires-Dist lines
    torch_version: str | None
    import_error: str | None = None

    @property
    def usable(self) -> bool:
        return bool(self.installed) and self.import_error is None


@dataclass(frozen=True)
class PtxasInfo:
    arch: int | None  # the GPU's sm number; None without a GPU
    bundled_dir: str  # triton/backends/nvidia/bin
    overrides: dict[str, str] = field(default_factory=dict)  # PTXAS_VARS that are set
    path: str | None = None  # the ptxas Triton will run
    version: str | None = None
    error: str | None = None  # Triton could not find one


@dataclass(frozen=True)
class Toolkit:
    variable: str  # CUDA_HOME or CUDA_PATH
    path: str
    exists: bool
    version: str | None  # from version.json, version.txt or bin/nvcc


@dataclass(frozen=True)
class Nvcc:
    path: str
    version: str | None


@dataclass(frozen=True)
class LibcudaInfo:
    env_path: str | None  # TRITON_LIBCUDA_PATH
    env_has_lib: bool  # libcuda.so.1 exists in env_path
    ldconfig: tuple[str, ...]  # libcuda.so.1 paths in the loader cache
    ld_library_path: tuple[str, ...]  # LD_LIBRARY_PATH folders that hold libcuda.so.1
    wsl_lib: bool  # /usr/lib/wsl/lib/libcuda.so.1 exists


# --------------------------------------------------------------------------------------------
# Small parsers (pure)


def major_minor(text: str | None) -> tuple[int, int] | None:
    """``"13.0"``, ``"12.4.1"`` -> ``(13, 0)``, ``(12, 4)``; anything else -> None."""
    match = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def release_version(output: str) -> str | None:
    """The CUDA release in ``ptxas --version`` / ``nvcc --version`` output (``"release 12.9, V12.9.86"``)."""
    match = re.search(r"release (\d+\.\d+)", output)
    return match.group(1) if match else None


def wsl_version(release: str) -> int | None:
    """2 for a WSL2 kernel (``5.15.153.1-microsoft-standard-WSL2``), 1 for WSL1, None otherwise."""
    lowered = release.lower()
    if "microsoft" not in lowered:
        return None
    return 2 if "wsl2" in lowered or "microsoft-standard" in lowered else 1


def parse_nvidia_smi_xml(text: str) -> DriverInfo:
    """``nvidia-smi -q -x`` -> driver version, its CUDA version, GPU names and memory."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        return DriverInfo(source="nvidia-smi", problem=f"unreadable nvidia-smi -q -x output ({exc})")
    gpus = []
    for gpu in root.findall("gpu"):
        total = re.match(r"\s*(\d+)\s*MiB", gpu.findtext("fb_memory_usage/total") or "")
        gpus.append(Gpu(gpu.findtext("product_name") or "unknown GPU", int(total.group(1)) * 2**20 if total else None))
    cuda = root.findtext("cuda_version")
    return DriverInfo(
        source="nvidia-smi",
        version=(root.findtext("driver_version") or "").strip() or None,
        cuda=cuda.strip() if major_minor(cuda) else None,
        gpus=tuple(gpus),
    )


def parse_ldconfig(output: str) -> tuple[str, ...]:
    """Paths of libcuda.so.1 in ``ldconfig -p`` output (``libcuda.so.1 (libc6,x86-64) => /path``)."""
    return tuple(line.split("=>")[-1].strip() for line in output.splitlines() if line.split()[:1] == ["libcuda.so.1"])


def torch_triton_requirements(requires: list[str]) -> list[Requirement]:
    """The Triton pins in torch's Requires-Dist whose environment markers hold on this machine."""
    from packaging.requirements import InvalidRequirement, Requirement

    pins = []
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name.lower() in TRITON_DISTS and (req.marker is None or req.marker.evaluate({"extra": ""})):
            pins.append(req)
    return pins


# --------------------------------------------------------------------------------------------
# Pure decisions: facts -> one Check each


def check_os(system: str, release: str, dxg: bool) -> Check:
    wsl = wsl_version(release) if system == "Linux" else None
    if wsl == 2:
        if dxg:
            return Check("os", "ok", f"Linux {release} (WSL2, GPU paravirtualization present)")
        return Check(
            "os", "warn", f"Linux {release} (WSL2) without /dev/dxg: no GPU reaches this distro",
            "WSL2 GPUs need Windows 11 22H2+, the Windows NVIDIA driver and `wsl --update` (then `wsl --shutdown`)",
        )
    if wsl == 1:
        return Check("os", "warn", f"Linux {release} (WSL1: no GPU access)",
                     "convert the distro to WSL2: `wsl --set-version <distro> 2`")
    if system == "Linux":
        return Check("os", "ok", f"Linux {release}")
    if system == "Windows":
        return Check("os", "warn", f"Windows {release}: Triton's GPU compiler targets Linux",
                     "run flashrun inside WSL2 (Windows 11 22H2+, `wsl --update`)")
    return Check("os", "warn", f"{system} {release}: no CUDA here; at most the CPU interpreter can run",
                 "for GPU runs use Linux (or WSL2) with an NVIDIA GPU")


def check_python(version: tuple[int, int, int], executable: str, tomli: str | None) -> Check:
    text = ".".join(map(str, version))
    if version[:2] == (3, 10):  # tomllib arrived in 3.11; 3.10 reads TOML with tomli
        text += f", tomli {tomli}"
    return Check("python", "ok", f"{text} ({executable})")


def check_torch(torch: TorchInfo) -> Check:
    if torch.version is None:
        return Check("torch", "fail", f"cannot import torch: {torch.error}",
                     f"install PyTorch: pip install torch (the CUDA build for your driver: {INSTALL_TORCH})")
    if torch.cuda:
        build = f"CUDA {torch.cuda} build"
    elif torch.hip:
        build = f"ROCm {torch.hip} build"
    else:
        build = "CPU-only build"
    return Check("torch", "ok", f"{torch.version} ({build})")


def _hidden_by_visible_devices(value: str | None) -> bool:
    return value is not None and value.strip() in ("", "-1", "none", "NoDevFiles")


def check_cuda(torch: TorchInfo, driver: DriverInfo, visible_devices: str | None) -> Check:
    """``torch.cuda.is_available()`` and, when False, the most likely reason."""
    if torch.version is None:
        return Check("cuda", "skip", "torch is not importable (see the torch row)")
    if torch.available:
        n = len(torch.gpus)
        return Check("cuda", "ok", f"torch.cuda.is_available() = True ({n} GPU{'s' if n != 1 else ''})")
    prefix = "torch.cuda.is_available() = False: "
    if torch.cuda is None and torch.hip is None:
        if driver.found:
            return Check(
                "cuda", "fail",
                prefix + f"torch {torch.version} is a CPU-only wheel, but this machine has an NVIDIA driver",
                f"install a CUDA build of torch for CUDA {driver.cuda or 'your driver supports'} or older "
                f"({INSTALL_TORCH}, pip install torch --index-url https://download.pytorch.org/whl/cuXYZ)",
            )
        return Check("cuda", "warn", prefix + "CPU-only torch and no NVIDIA driver: kernels run in CPU interpreter mode",
                     "for GPU runs use a machine with an NVIDIA GPU, its driver and a CUDA build of torch")
    if _hidden_by_visible_devices(visible_devices):
        return Check("cuda", "fail", prefix + f"CUDA_VISIBLE_DEVICES={visible_devices!r} hides every GPU",
                     "unset CUDA_VISIBLE_DEVICES, or set it to a GPU index such as 0")
    if driver.problem:
        return Check("cuda", "fail", prefix + "the NVIDIA driver is not working (see the driver row)",
                     driver_problem_hint(driver.problem))
    if not driver.found:
        return Check("cuda", "warn", prefix + "no NVIDIA driver found: kernels run in CPU interpreter mode",
                     "on a GPU machine, install the NVIDIA driver (on WSL2: the Windows driver, then `wsl --update`)")
    torch_cuda, driver_cuda = major_minor(torch.cuda), major_minor(driver.cuda)
    if torch_cuda and driver_cuda and driver_cuda[0] < torch_cuda[0]:
        return Check("cuda", "fail", prefix + f"the driver supports CUDA {driver.cuda}, this torch needs CUDA {torch.cuda}",
                     f"update the NVIDIA driver, or install a torch build for CUDA {driver.cuda} or older ({INSTALL_TORCH})")
    said = f" (torch warned: {torch.cuda_warning.splitlines()[0]})" if torch.cuda_warning else ""
    return Check("cuda", "fail", prefix + f"the driver lists {len(driver.gpus)} GPU(s) but torch sees none{said}",
                 "check `nvidia-smi`, a container's GPU access (docker run --gpus all), and reboot after driver updates")


def check_gpus(torch: TorchInfo, driver: DriverInfo) -> Check:
    if torch.gpus:
        detail = "; ".join(gpu.describe() for gpu in torch.gpus)
        old = [gpu for gpu in torch.gpus if gpu.capability and gpu.capability < (8, 0)]
        if old:
            return Check("gpu", "warn", detail + ": older than sm_80",
                         "bfloat16 and the fast kernels' tl.dot paths need sm_80+ (Ampere or newer); use float16")
        return Check("gpu", "ok", detail)
    if driver.gpus:
        return Check("gpu", "warn", "; ".join(gpu.describe() for gpu in driver.gpus) + ": seen by the driver, not by torch",
                     "torch cannot use it: see the cuda row")
    return Check("gpu", "skip", "no NVIDIA GPU found")


def driver_problem_hint(problem: str) -> str:
    lowered = problem.lower()
    if "mismatch" in lowered:
        return "the driver's kernel module and libraries differ (typical after an upgrade): reboot"
    if "communicate with the nvidia driver" in lowered or "not loaded" in lowered:
        return "the driver's kernel module is not loaded: reboot; if that fails, reinstall the driver (Secure Boot can block it)"
    if "no devices were found" in lowered:
        return "no GPU is visible: check `lspci | grep -i nvidia`; in a container, start it with --gpus all"
    if "permission" in lowered:
        return "permission denied on /dev/nvidia*: add your user to the group that owns them (often video)"
    return "run `nvidia-smi` yourself and fix what it reports; reinstalling the driver usually helps"


def check_driver(driver: DriverInfo, torch_sees_gpu: bool = False) -> Check:
    if driver.problem:
        first = driver.problem.strip().splitlines()[0]
        return Check("driver", "fail", f"{driver.source} failed: {first}", driver_problem_hint(driver.problem))
    if not driver.found:
        missing = "nvidia-smi is not on PATH and NVML (libnvidia-ml.so.1) does not load"
        if torch_sees_gpu:  # a driver is there (torch uses it); only the tools to ask it are not
            return Check("driver", "warn", f"version unknown: {missing}, though torch sees a GPU",
                         "put nvidia-smi on PATH (NVIDIA's utils package) to compare the driver's CUDA with torch's")
        return Check("driver", "warn", f"no NVIDIA driver: {missing}",
                     "if this machine has an NVIDIA GPU, install its driver (WSL2: the Windows driver, not a Linux one)")
    cuda = f", supports CUDA {driver.cuda} and older" if driver.cuda else ", CUDA version not reported"
    return Check("driver", "ok", f"{driver.version}{cuda} (from {driver.source})")


def check_driver_vs_torch(driver_cuda: str | None, torch_cuda: str | None) -> Check:
    """Can the driver run the CUDA runtime that torch's wheel ships?"""
    if torch_cuda is None:
        return Check("driver_vs_torch", "skip", "no CUDA build of torch to compare with")
    if driver_cuda is None:
        return Check("driver_vs_torch", "skip", "the driver's CUDA version is unknown (see the driver row)")
    have, need = major_minor(driver_cuda), major_minor(torch_cuda)
    if have is None or need is None:
        return Check("driver_vs_torch", "warn", f"cannot compare driver CUDA {driver_cuda!r} with torch CUDA {torch_cuda!r}",
                     "compare `nvidia-smi`'s CUDA Version with torch.version.cuda yourself")
    if have >= need:
        return Check("driver_vs_torch", "ok", f"driver CUDA {driver_cuda} >= torch's CUDA {torch_cuda}")
    if have[0] == need[0]:
        return Check("driver_vs_torch", "warn",
                     f"driver CUDA {driver_cuda} < torch's CUDA {torch_cuda}: works only through minor-version compatibility",
                     f"update the NVIDIA driver to one that supports CUDA {torch_cuda}")
    return Check("driver_vs_torch", "fail", f"driver CUDA {driver_cuda} is too old for torch's CUDA {torch_cuda}",
                 f"update the NVIDIA driver, or install a torch build for CUDA {driver_cuda} or older ({INSTALL_TORCH})")


def check_triton(triton: TritonInfo) -> Check:
    pins = torch_triton_requirements(triton.torch_requires)
    pin = f"{pins[0].name}{pins[0].specifier}" if pins else None
    if not triton.installed:
        return Check("triton", "fail", "Triton is not installed", f'pip install "{pin or "triton"}"')
    name, version = next(iter(triton.installed.items()))
    if triton.import_error:
        return Check("triton", "fail", f"{name} {version} is installed but cannot be imported: {triton.import_error}",
                     f'reinstall it: pip install --force-reinstall "{pin or name}"')
    if not pins:
        return Check("triton", "ok", f"{name} {version} (torch {triton.torch_version} does not pin a Triton version)")
    for req in pins:
        have = triton.installed.get(req.name.lower())
        if have is not None and req.specifier.contains(have, prereleases=True):
            return Check("triton", "ok", f"{req.name} {have}, as torch {triton.torch_version} requires ({pin})")
    found = ", ".join(f"{n} {v}" for n, v in triton.installed.items())
    return Check("triton", "warn", f"{found} installed, but torch {triton.torch_version} requires {pin}",
                 f'pip install "{pin}" (or install the torch release made for your Triton)')


def ptxas_variable(binary: str) -> str:
    """The variable that overrides a bundled tool, by Triton's rule: ptxas-blackwell -> TRITON_PTXAS_BLACKWELL_PATH."""
    return f"TRITON_{binary.upper().replace('-', '_')}_PATH"


def check_ptxas(ptxas: PtxasInfo | None, driver_cuda: str | None) -> Check:
    """Which ptxas Triton will run, and whether the driver can load what it produces."""
    if ptxas is None:
        return Check("ptxas", "skip", "Triton is not importable (see the triton row)")
    if ptxas.path is None:
        tried = ", ".join(f"{k}={v}" for k, v in ptxas.overrides.items())
        return Check("ptxas", "fail", f"Triton cannot find ptxas: {ptxas.error}" + (f" (tried {tried})" if tried else ""),
                     "reinstall Triton (pip install --force-reinstall triton), or set TRITON_PTXAS_PATH to a toolkit's bin/ptxas")
    where = f" for sm_{ptxas.arch}" if ptxas.arch else " (used only when compiling for a GPU)"
    if str(Path(ptxas.path).parent) == ptxas.bundled_dir:
        variable = ptxas_variable(Path(ptxas.path).name)
        detail = f"{ptxas.path}, CUDA {ptxas.version}, bundled with Triton{where}"
        ignored = ptxas.overrides.get(variable)
        if ignored is not None and ignored != ptxas.path:
            return Check("ptxas", "warn", f"{variable}={ignored} is not a working ptxas, so Triton falls back to {detail}",
                         f"fix or unset {variable}")
        fix = f"point {variable} at a ptxas from an older toolkit"
    else:
        variable = next((k for k, v in ptxas.overrides.items() if v == ptxas.path), None)
        detail = f"{ptxas.path}, CUDA {ptxas.version}, " + (f"from {variable}" if variable else "outside Triton") + where
        fix = f"unset {variable} to use Triton's bundled ptxas" if variable else "use Triton's bundled ptxas"
    have, made = major_minor(driver_cuda), major_minor(ptxas.version)
    if have and made and made[0] > have[0]:
        return Check("ptxas", "warn", f"{detail}: newer than the driver's CUDA {driver_cuda}, whose code it may not load",
                     f"update the NVIDIA driver, or {fix}")
    return Check("ptxas", "ok", detail)


def check_cuda_home(toolkits: list[Toolkit], torch_cuda: str | None) -> Check:
    """CUDA_HOME / CUDA_PATH: unneeded by Triton, harmful when they name another toolkit."""
    if not toolkits:
        return Check("cuda_home", "ok", "CUDA_HOME and CUDA_PATH are not set (fine: Triton ships its own ptxas)")
    if len({os.path.normpath(t.path) for t in toolkits}) > 1:
        named = " and ".join(f"{t.variable}={t.path}" for t in toolkits)
        return Check("cuda_home", "warn", f"{named} name different toolkits", "set one of them, or unset both")
    toolkit = toolkits[0]
    named = " = ".join(t.variable for t in toolkits) + f"={toolkit.path}"
    if not toolkit.exists:
        return Check("cuda_home", "warn", f"{named} does not exist", f"unset {toolkit.variable} or point it at an installed toolkit")
    if toolkit.version is None:
        return Check("cuda_home", "warn", f"{named}: no CUDA version found there (version.json, bin/nvcc)",
                     f"point {toolkit.variable} at a toolkit root (the folder holding bin/nvcc), or unset it")
    detail = f"{named} (CUDA {toolkit.version})"
    have, want = major_minor(toolkit.version), major_minor(torch_cuda)
    if want is None:
        return Check("cuda_home", "ok", detail + "; torch is not a CUDA build, nothing to match")
    if have == want:
        return Check("cuda_home", "ok", detail + ", matches torch")
    if have and have[0] == want[0]:
        return Check("cuda_home", "ok", detail + f"; torch has CUDA {torch_cuda} (same major version: compatible)")
    return Check("cuda_home", "warn", detail + f", but torch was built with CUDA {torch_cuda}",
                 f"unset {toolkit.variable} (Triton ships its own ptxas), or point it at a CUDA {torch_cuda} toolkit")


def check_nvcc(nvcc: Nvcc | None, toolkits: list[Toolkit], torch_cuda: str | None) -> Check:
    """`nvcc --version` describes a local toolkit, which may not be torch's runtime."""
    if nvcc is None:
        return Check("nvcc", "skip", "nvcc is not on PATH (not needed: Triton ships its own ptxas)")
    if nvcc.version is None:
        return Check("nvcc", "warn", f"{nvcc.path} did not report a version", f"run `{nvcc.path} --version` to see why")
    detail = f"{nvcc.path}, CUDA {nvcc.version}"
    home = next((t for t in toolkits if t.exists), None)
    if home and Path(nvcc.path).resolve().parent != (Path(home.path) / "bin").resolve():
        return Check("nvcc", "warn", detail + f": not the toolkit in {home.variable}={home.path}",
                     f"put {home.path}/bin first on PATH, or unset {home.variable}")
    have, want = major_minor(nvcc.version), major_minor(torch_cuda)
    if want and have and have[0] != want[0]:
        return Check("nvcc", "warn", detail + f", but torch's CUDA runtime is {torch_cuda}",
                     "Triton does not need nvcc; building CUDA extensions (flash-attn) needs a toolkit matching torch")
    return Check("nvcc", "ok", detail + (f" (torch's runtime: CUDA {torch_cuda})" if want and have != want else ""))


def check_libcuda(lib: LibcudaInfo, wsl: int | None, driver_found: bool) -> Check:
    # driver_found: the driver answered, or torch reached a GPU through it
    """Where Triton will find libcuda.so.1 (TRITON_LIBCUDA_PATH, the loader cache, LD_LIBRARY_PATH)."""
    if lib.env_path:
        if lib.env_has_lib:
            return Check("libcuda", "ok", f"TRITON_LIBCUDA_PATH={lib.env_path}")
        return Check("libcuda", "fail", f"TRITON_LIBCUDA_PATH={lib.env_path} holds no libcuda.so.1",
                     f"point it at the folder holding libcuda.so.1{' (WSL2: /usr/lib/wsl/lib)' if wsl else ''}, or unset it")
    found = lib.ldconfig or lib.ld_library_path
    if found:
        how = "the loader cache" if lib.ldconfig else "LD_LIBRARY_PATH"
        if wsl == 2 and not any(p.startswith(str(WSL_LIB)) for p in found):
            return Check("libcuda", "warn", f"{', '.join(found)} (from {how}), not {WSL_LIB}",
                         "under WSL2 libcuda must come from the Windows driver: remove NVIDIA driver packages inside WSL")
        return Check("libcuda", "ok", f"{', '.join(found)} (from {how})")
    if wsl == 2 and lib.wsl_lib:
        return Check("libcuda", "fail", f"{WSL_LIB}/libcuda.so.1 exists but the loader does not search {WSL_LIB}",
                     f"export LD_LIBRARY_PATH={WSL_LIB}:$LD_LIBRARY_PATH (or add it to /etc/ld.so.conf.d and run `sudo ldconfig`)")
    if driver_found:
        return Check("libcuda", "fail", "libcuda.so.1 not found, although the driver is installed",
                     "run `sudo ldconfig`, or set TRITON_LIBCUDA_PATH to the folder holding libcuda.so.1")
    return Check("libcuda", "skip", "libcuda.so.1 not found (no NVIDIA driver, see the driver row)")


def check_log_dir(log_dir: Path, problem: str | None) -> Check:
    if problem:
        return Check("log_dir", "fail", f"cannot write run records to {log_dir}: {problem}",
                     "set logging.log_dir to a writable folder (--set logging.log_dir=PATH)")
    return Check("log_dir", "ok", f"{log_dir} (run records: runs.jsonl)")


def check_api_key(cfg: Config) -> Check:
    """Is the key there? Says which variable; never shows a character of the value."""
    variable = key_variable(cfg)
    try:
        value = resolve_api_key(cfg)
    except MissingKeyError as exc:
        return Check("api_key", "fail", exc.message, exc.hint)
    register_secret(value)
    if variable is None:
        return Check("api_key", "warn", "a literal key from a config file is used (value hidden)",
                     "keep keys out of files: export it and name the variable in api.api_key_env")
    return Check("api_key", "ok", f"{variable} is set (value hidden)")


_ENDPOINTS = ("/chat/completions", "/completions", "/models")


def check_base_url(url: str) -> Check:
    """The gateway root: http(s), a host, no endpoint path (the client appends it)."""
    unresolved = re.search(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", url)
    if unresolved:
        return Check("base_url", "fail", f"api.base_url refers to ${{{unresolved.group(1)}}}, which is not set",
                     f"export {unresolved.group(1)}=... in this shell, or write the URL in the config")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return Check("base_url", "fail", f"api.base_url {url!r} is not an http(s) URL with a host",
                     'write the API root, for example base_url = "https://api.openai.com/v1"')
    host = parts.hostname + (f":{parts.port}" if parts.port else "")
    path = parts.path.rstrip("/")
    shown = f"{parts.scheme}://{host}{path}"  # never the user:password part
    if parts.username or parts.password:
        return Check("base_url", "warn", f"{shown}: the URL embeds credentials (not shown)",
                     "remove them from the URL; the key belongs in the variable named by api.api_key_env")
    endpoint = next((e for e in _ENDPOINTS if path.endswith(e)), None)
    if endpoint:
        root = f"{parts.scheme}://{host}{path[: -len(endpoint)]}"
        return Check("base_url", "fail", f"{shown} ends in {endpoint}; the client appends the endpoint itself",
                     f'set base_url = "{root}"')
    if parts.query or parts.fragment:
        return Check("base_url", "warn", f"{shown} carries a query or fragment", "remove everything after the path")
    if parts.scheme == "http" and parts.hostname not in ("localhost", "127.0.0.1", "::1"):
        return Check("base_url", "warn", f"{shown}: plain http sends the key unencrypted", "use https")
    return Check("base_url", "ok", f"{shown} (scheme {parts.scheme}, host {host})")


def smoke_hint(error: str) -> str:
    """A fix for a failed smoke test, from the error text."""
    lowered = error.lower()
    if "ptxas" in lowered:
        return "Triton's ptxas failed: unset CUDA_HOME and TRITON_PTXAS_PATH so Triton uses its bundled ptxas (see the ptxas row)"
    if "libcuda" in lowered:
        return "Triton cannot find libcuda.so.1: run `sudo ldconfig` or set TRITON_LIBCUDA_PATH (WSL2: /usr/lib/wsl/lib)"
    if "python.h" in lowered:
        return "Triton builds a small C launcher: install the Python headers (e.g. apt install python3-dev)"
    if "c compiler" in lowered or "gcc" in lowered or "cc1" in lowered:
        return "Triton builds a small C launcher: install a C compiler (gcc), or set CC to one"
    if "ptx" in lowered or "unsupported toolchain" in lowered or "no kernel image" in lowered:
        return "the driver cannot load code from this ptxas: update the NVIDIA driver (see the driver and ptxas rows)"
    if "out of memory" in lowered:
        return "the GPU is out of memory: another process holds it (see `nvidia-smi`)"
    if "busy or unavailable" in lowered:
        return "the GPU is busy or in exclusive-process mode: stop the process that holds it (see `nvidia-smi`)"
    return "run `flashrun check-env -v` for the traceback, and compare the torch, triton and driver rows"


def smoke_verdict(where: str, kernel: str, seconds: float, max_error: float, ok: bool) -> Check:
    ran = f"{kernel} ran in {seconds:.2f} s (compile included), max error {max_error:.1e}"
    if ok:
        return Check("smoke", "ok", f"{where}: {ran}")
    return Check("smoke", "fail", f"{where}: wrong result: {ran}",
                 "Triton computed wrong numbers: reinstall the Triton version torch requires (see the triton row)")


# --------------------------------------------------------------------------------------------
# Probes (facts from this machine; a missing tool is a fact, not an exception)


def _run(argv: list[str], timeout: float = 30) -> tuple[int, str] | None:
    """Run a tool; (exit code, stdout+stderr), or None when it cannot be started."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.returncode, (proc.stdout or "") + (proc.stderr or "")


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def probe_driver() -> DriverInfo:
    smi = shutil.which("nvidia-smi")
    if smi:
        ran = _run([smi, "-q", "-x"])
        if ran is None:
            return DriverInfo(source="nvidia-smi", problem=f"{smi} could not be run")
        code, output = ran
        if code != 0:
            return DriverInfo(source="nvidia-smi", problem=output.strip() or f"exit code {code}")
        return parse_nvidia_smi_xml(output)
    return probe_nvml()


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def probe_nvml() -> DriverInfo:
    """The driver through NVML (libnvidia-ml.so.1), for machines without nvidia-smi."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return DriverInfo()
    code = nvml.nvmlInit_v2()
    if code != 0:
        return DriverInfo(source="NVML", problem=f"nvmlInit failed with NVML error {code}")
    try:
        buf = ctypes.create_string_buffer(96)
        version = buf.value.decode() if nvml.nvmlSystemGetDriverVersion(buf, 96) == 0 else None
        number = ctypes.c_int()
        cuda = None
        if nvml.nvmlSystemGetCudaDriverVersion(ctypes.byref(number)) == 0:  # 13000 -> "13.0"
            cuda = f"{number.value // 1000}.{number.value % 1000 // 10}"
        count = ctypes.c_uint()
        gpus = []
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0:
            for index in range(count.value):
                handle = ctypes.c_void_p()
                if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                    continue
                name = ctypes.create_string_buffer(96)
                nvml.nvmlDeviceGetName(handle, name, 96)
                memory = _NvmlMemory()
                total = memory.total if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0 else None
                gpus.append(Gpu(name.value.decode() or "unknown GPU", total))
    finally:
        nvml.nvmlShutdown()
    return DriverInfo(source="NVML", version=version, cuda=cuda, gpus=tuple(gpus))


def probe_torch() -> TorchInfo:
    try:
        import torch
    except Exception as exc:  # a broken install raises more than ImportError (OSError on missing .so)
        return TorchInfo(version=None, error=f"{type(exc).__name__}: {exc}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    gpus = []
    if available:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append(Gpu(props.name, props.total_memory, (props.major, props.minor)))
    said = [str(w.message) for w in caught if "cuda" in str(w.message).lower()]
    return TorchInfo(
        version=torch.__version__, cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
        available=available, gpus=tuple(gpus), cuda_warning=said[0] if said else None,
    )


def probe_triton() -> TritonInfo:
    installed = {name: v for name in TRITON_DISTS if (v := _dist_version(name)) is not None}
    try:
        requires = metadata.requires("torch") or []
    except metadata.PackageNotFoundError:
        requires = []
    error = None
    if installed:
        try:
            import triton  # noqa: F401
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    return TritonInfo(installed, requires, _dist_version("torch"), error)


def _triton_ptxas(compiler: Any, arch: int) -> tuple[str, str]:
    """Ask Triton itself which ptxas it runs for ``arch`` (the choice differs across versions)."""
    get_ptxas = getattr(compiler, "get_ptxas", None)
    if get_ptxas is not None:  # Triton >= 3.4 (3.5+ pick ptxas or ptxas-blackwell by arch)
        tool = get_ptxas(arch) if inspect.signature(get_ptxas).parameters else get_ptxas()
        return tool.path, tool.version
    path, version = compiler._path_to_binary("ptxas")  # older Triton
    return path, version


def probe_ptxas(arch: int | None) -> PtxasInfo | None:
    try:
        from triton.backends.nvidia import compiler
    except Exception:  # no Triton, or a broken one: the triton row reports it
        return None
    bundled = str(Path(compiler.__file__).parent / "bin")
    overrides = {var: os.environ[var] for var in PTXAS_VARS if os.environ.get(var)}
    try:
        path, version = _triton_ptxas(compiler, arch or 80)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return PtxasInfo(arch, bundled, overrides, error=str(exc))
    return PtxasInfo(arch, bundled, overrides, path=path, version=version)


def toolkit_version(root: Path) -> str | None:
    """A CUDA toolkit's version: version.json (11.1+), version.txt (older), else bin/nvcc."""
    try:
        data = json.loads((root / "version.json").read_text(encoding="utf-8"))
        return str(data["cuda"]["version"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        match = re.search(r"CUDA Version (\d+\.\d+)", (root / "version.txt").read_text(encoding="utf-8"))
        if match:
            return match.group(1)
    except OSError:
        pass
    ran = _run([str(root / "bin" / "nvcc"), "--version"])
    return release_version(ran[1]) if ran else None


def probe_toolkits() -> list[Toolkit]:
    toolkits = []
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(variable)
        if value:
            root = Path(value)
            toolkits.append(Toolkit(variable, value, root.is_dir(), toolkit_version(root) if root.is_dir() else None))
    return toolkits


def probe_nvcc() -> Nvcc | None:
    path = shutil.which("nvcc")
    if path is None:
        return None
    ran = _run([path, "--version"])
    return Nvcc(path, release_version(ran[1]) if ran else None)


def probe_libcuda() -> LibcudaInfo:
    env_path = os.environ.get("TRITON_LIBCUDA_PATH") or None
    ran = _run(["/sbin/ldconfig", "-p"])
    folders = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    return LibcudaInfo(
        env_path=env_path,
        env_has_lib=bool(env_path) and (Path(env_path) / "libcuda.so.1").exists(),
        ldconfig=parse_ldconfig(ran[1]) if ran and ran[0] == 0 else (),
        ld_library_path=tuple(str(Path(p) / "libcuda.so.1") for p in folders if (Path(p) / "libcuda.so.1").exists()),
        wsl_lib=(WSL_LIB / "libcuda.so.1").exists(),
    )


def probe_log_dir(log_dir: Path) -> str | None:
    """None when run records can be written to ``log_dir`` (created if missing), else why not."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None if os.access(log_dir, os.W_OK) else "no write permission"


def smoke_test(torch: TorchInfo, triton_ok: bool) -> Check:
    """Compile and run a tiny kernel on the GPU, or through the interpreter without one."""
    if torch.version is None or not triton_ok:
        return Check("smoke", "skip", "needs importable torch and Triton (see their rows)")
    from flashrun import device

    try:
        chosen = device.select("auto")  # before the kernel is defined: it sets TRITON_INTERPRET
    except FlashrunError as exc:
        return Check("smoke", "fail", exc.message, exc.hint or smoke_hint(exc.message))
    where = f"GPU ({torch.gpus[0].name})" if chosen.kind == "cuda" and torch.gpus else device.INTERPRETER_NOTICE
    try:
        from flashrun.env import smoke

        result = smoke.run(chosen.torch_device)
    except Exception as exc:  # compile and launch errors come in many types; the text says which
        log.debug("smoke test failed", exc_info=True)
        text = f"{type(exc).__name__}: {exc}"
        first = text.strip().splitlines()[0]
        return Check("smoke", "fail", f"{where}: {first}", smoke_hint(text))
    return smoke_verdict(where, smoke.KERNEL, result.seconds, result.max_error, result.ok)


def check_gateway(cfg: Config, online: bool) -> Check:
    if not online:
        return Check("gateway", "skip", "not contacted (pass --online to send one request)")
    from flashrun.gateway.client import check_online

    fallback = "check api.base_url, the key variable and the network"
    try:
        status, detail, hint = check_online(cfg)
    except FlashrunError as exc:
        return Check("gateway", "fail", exc.message, exc.hint or fallback)
    return Check("gateway", status, detail, hint or (fallback if status in ("warn", "fail") else None))


# --------------------------------------------------------------------------------------------
# Running and reporting


class _Facts:
    """Each probe runs once, when a check first needs it."""

    @cached_property
    def torch(self) -> TorchInfo:
        return probe_torch()

    @cached_property
    def driver(self) -> DriverInfo:
        return probe_driver()

    @cached_property
    def triton(self) -> TritonInfo:
        return probe_triton()

    @cached_property
    def ptxas(self) -> PtxasInfo | None:
        gpu = self.torch.gpus[0] if self.torch.gpus else None
        arch = gpu.capability[0] * 10 + gpu.capability[1] if gpu and gpu.capability else None
        return probe_ptxas(arch)

    @cached_property
    def toolkits(self) -> list[Toolkit]:
        return probe_toolkits()


def _guarded(name: str, build: Callable[[], Check]) -> Check:
    try:
        return build()
    except Exception as exc:
        log.debug("check %s crashed", name, exc_info=True)
        return Check(name, "fail", f"the check itself crashed: {type(exc).__name__}: {exc}",
                     "a flashrun bug: please report it with the output of `flashrun check-env -v`")


def run_checks(cfg: Config, online: bool = False) -> Report:
    facts = _Facts()
    release = platform.release()
    wsl = wsl_version(release) if platform.system() == "Linux" else None
    rows: list[tuple[str, Callable[[], Check]]] = [
        ("os", lambda: check_os(platform.system(), release, Path("/dev/dxg").exists())),
        ("python", lambda: check_python((sys.version_info.major, sys.version_info.minor, sys.version_info.micro),
                                        sys.executable, _dist_version("tomli"))),
        ("torch", lambda: check_torch(facts.torch)),
        ("cuda", lambda: check_cuda(facts.torch, facts.driver, os.environ.get("CUDA_VISIBLE_DEVICES"))),
        ("gpu", lambda: check_gpus(facts.torch, facts.driver)),
        ("driver", lambda: check_driver(facts.driver, facts.torch.available)),
        ("driver_vs_torch", lambda: check_driver_vs_torch(facts.driver.cuda, facts.torch.cuda)),
        ("triton", lambda: check_triton(facts.triton)),
        ("ptxas", lambda: check_ptxas(facts.ptxas, facts.driver.cuda)),
        ("cuda_home", lambda: check_cuda_home(facts.toolkits, facts.torch.cuda)),
        ("nvcc", lambda: check_nvcc(probe_nvcc(), facts.toolkits, facts.torch.cuda)),
        ("libcuda", lambda: check_libcuda(probe_libcuda(), wsl, facts.driver.found or facts.torch.available)),
        ("log_dir", lambda: check_log_dir(cfg.logging.log_dir, probe_log_dir(cfg.logging.log_dir))),
        ("api_key", lambda: check_api_key(cfg)),
        ("base_url", lambda: check_base_url(cfg.api.base_url)),
        ("smoke", lambda: smoke_test(facts.torch, facts.triton.usable)),
        ("gateway", lambda: check_gateway(cfg, online)),
    ]
    checks = []
    for name, build in rows:
        start = time.perf_counter()
        checks.append(_guarded(name, build))
        log.debug("check %s took %.2f s", name, time.perf_counter() - start)
    return Report(checks)


_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def render(report: Report, console: Console) -> None:
    table = Table(title="flashrun check-env", title_justify="left")
    for column in ("check", "status", "detail", "hint"):
        table.add_column(column, overflow="fold")
    for check in report.checks:
        table.add_row(check.name, Text(check.status, style=_STYLE[check.status]),
                      Text(redact(check.detail)), Text(redact(check.hint or ""), style="dim"))
    console.print(table)
    console.print(Text(report.outcome, style="green" if report.ok else "bold red"))


def record(cfg: Config, report: Report, argv: list[str]) -> Path | None:
    """Append the run to runs.jsonl; None when the log_dir check already said it cannot."""
    from flashrun.records.runlog import append_record, make_record

    if any(c.name == "log_dir" and c.status == "fail" for c in report.checks):
        return None
    return append_record(cfg.logging.log_dir, make_record("check-env", argv, cfg.public_dict(), report.to_json()))
