"""``flashrun check-env``'s verdicts: pure functions from facts to one :class:`Check` each.

A ``warn`` or ``fail`` always carries a one-line hint saying what to do, so every hint can be
tested with fabricated facts (see :mod:`flashrun.env.probes` for where the real ones come from).

The troubleshooting knowledge comes from the users' own war stories: a driver older than the
wheel's CUDA, ``+cpu`` wheels, ``CUDA_HOME`` pointing at another toolkit, Triton's bundled
ptxas versus ``TRITON_PTXAS_PATH``, ``nvcc`` from a different toolkit than the runtime, WSL2's
``/usr/lib/wsl/lib``, and an API key variable that the shell never exported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from flashrun.config import Config, base_url_root, key_variable, resolve_api_key
from flashrun.env.probes import (
    WSL_LIB,
    DriverInfo,
    LibcudaInfo,
    Nvcc,
    PtxasInfo,
    Toolkit,
    TorchInfo,
    TritonInfo,
    major_minor,
    torch_triton_requirements,
    wsl_version,
)
from flashrun.errors import ConfigError, MissingKeyError
from flashrun.records.redact import register_secret

Status = Literal["ok", "warn", "fail", "skip"]
STATUSES = ("ok", "warn", "fail", "skip")
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


def check_api_key(cfg: Config, online: bool = False) -> Check:
    """Is the key there? Says which variable; never shows a character of the value.

    Only the gateway (gen-cases, ``--online``) needs a key, so a missing one fails the run only
    with ``online``; otherwise it warns, and ``check-env && verify`` works on a machine without one.
    """
    variable = key_variable(cfg)
    try:
        value = resolve_api_key(cfg)
    except MissingKeyError as exc:
        if online:
            return Check("api_key", "fail", exc.message, exc.hint)
        return Check("api_key", "warn", exc.message + " (needed only by gen-cases and --online)", exc.hint)
    register_secret(value)
    if variable is None:
        return Check("api_key", "warn", "a literal key from a config file is used (value hidden)",
                     "keep keys out of files: export it and name the variable in api.api_key_env")
    return Check("api_key", "ok", f"{variable} is set (value hidden)")


_ENDPOINTS = ("/chat/completions", "/completions", "/models")


def check_base_url(url: str) -> Check:
    """The gateway root: http(s), a host, no endpoint path (the client appends it)."""
    try:
        base_url_root(url)
    except ConfigError as exc:
        return Check("base_url", "fail", exc.message, exc.hint)
    parts = urlsplit(url.strip())
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
