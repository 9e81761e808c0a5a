"""``flashrun check-env``'s facts: what this machine has, gathered without judging it.

A missing tool or library is a fact, never an exception: every ``probe_*`` returns a value that
says what was (not) found, and the verdicts in :mod:`flashrun.env.checks` decide what it means.
The small parsers are pure, so that each can be tested with text captured on real machines.
"""

from __future__ import annotations

import ctypes
import inspect
import json
import os
import re
import shutil
import subprocess
import warnings
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packaging.requirements import Requirement

# Distributions that provide the ``triton`` module (torch nightlies and ROCm/XPU builds rename it).
TRITON_DISTS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")
# Variables with which a user points Triton at another ptxas (newer Triton has one per GPU family).
PTXAS_VARS = ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")
WSL_LIB = Path("/usr/lib/wsl/lib")


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
# Probes (facts from this machine; a missing tool is a fact, not an exception)


def run_tool(argv: list[str], timeout: float = 30) -> tuple[int, str] | None:
    """Run a tool; (exit code, stdout+stderr), or None when it cannot be started."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.returncode, (proc.stdout or "") + (proc.stderr or "")


def dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def probe_driver() -> DriverInfo:
    smi = shutil.which("nvidia-smi")
    if smi:
        ran = run_tool([smi, "-q", "-x"])
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
    installed = {name: v for name in TRITON_DISTS if (v := dist_version(name)) is not None}
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
    return TritonInfo(installed, requires, dist_version("torch"), error)


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
    ran = run_tool([str(root / "bin" / "nvcc"), "--version"])
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
    ran = run_tool([path, "--version"])
    return Nvcc(path, release_version(ran[1]) if ran else None)


def probe_libcuda() -> LibcudaInfo:
    env_path = os.environ.get("TRITON_LIBCUDA_PATH") or None
    ran = run_tool(["/sbin/ldconfig", "-p"])
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
