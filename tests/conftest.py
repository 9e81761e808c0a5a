"""Shared test setup.

CI has no GPU, so kernels run through Triton's interpreter. Triton reads TRITON_INTERPRET when
a kernel is defined, so it is set here, before any test module can import triton.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from flashrun.cli import app  # noqa: E402
from flashrun.records import redact  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# Variables from the developer's shell that would change what flashrun sees.
_DROPPED_PREFIXES = ("OPENAI_", "TAOTOKEN_", "FLASHRUN_")
_DROPPED = (
    "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES",
    "TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH", "TRITON_LIBCUDA_PATH",
)


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A clean environment, a fresh secret registry, and the cwd in tmp_path.

    The shipped config's log_dir is relative ("logs"), so with the cwd in tmp_path every run
    record a test causes lands in ``tmp_path / "logs"``.
    """
    for name in list(os.environ):
        if name.startswith(_DROPPED_PREFIXES) or name in _DROPPED:
            monkeypatch.delenv(name)
    # device.select() edits TRITON_INTERPRET directly (on a GPU machine check-env drops it);
    # setting it through monkeypatch restores the session's value after every test.
    monkeypatch.setenv("TRITON_INTERPRET", os.environ["TRITON_INTERPRET"])
    monkeypatch.setattr(redact, "_secrets", set())
    attention = sys.modules.get("flashrun.kernels.flash.attention")  # (not imported for it)
    if attention is not None:  # flash's lean-launch plans keep the kernel and launch of the test that made them
        monkeypatch.setattr(attention, "_forward_plans", {})
        monkeypatch.setattr(attention, "_delta_plans", {})
        monkeypatch.setattr(attention, "_checked_calls", {})  # (and flash-decoding's, with the checked calls)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    logging.getLogger("flashrun").handlers.clear()  # the CLI bound them to a now-closed stream


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session, in this process: two CPUs and two made-up
    GPU types (``accelerator_type:*`` resources, for --per-gpu-type's scheduling without GPUs),
    listening on 127.0.0.1 only. Starting Ray costs seconds, and a command in this process uses
    the Ray already initialized (its workers stay warm from test to test). Yields ``.address``
    (for ``--cluster`` from another process) and ``.gpu_types``."""
    # Ray's switch for "this machine only": read when ray is imported, inherited by subprocesses
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray = pytest.importorskip("ray", reason="needs Ray: pip install 'flashrun[ray]'")

    gpu_types = ("TEST-A", "TEST-B")
    ray.init(num_cpus=2, resources={f"accelerator_type:{name}": 1 for name in gpu_types},
             include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
             object_store_memory=256 << 20)
    yield SimpleNamespace(address=ray.get_runtime_context().gcs_address, gpu_types=gpu_types)
    ray.shutdown()


@pytest.fixture
def cli():
    """Invoke the CLI in-process: ``cli("runs", "--json")`` -> a Result with exit_code/stdout/stderr."""
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(app, list(args), prog_name="flashrun")

    return invoke


def _python(args: list[str], env: dict[str, str] | None) -> subprocess.CompletedProcess:
    environ = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environ, timeout=300, check=False)


@pytest.fixture
def python():
    """Run this interpreter as a real process, importing this checkout: ``python("-c", code)``."""
    return lambda *args, env=None: _python(list(args), env)


@pytest.fixture
def flashrun():
    """``python -m flashrun ARGS`` as a real process (the cwd is the test's tmp_path)."""
    return lambda *args, env=None: _python(["-m", "flashrun", *args], env)
