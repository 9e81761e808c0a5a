"""What ``bench --metrics`` reads of a compiled Triton kernel, for the CPU tests: the article's
kernel (tests/kernels/article_kernel.py: fp16, D = 64, BLOCK = 64, 4 warps) compiled for an
H100/H200 (sm_90) on a machine without a GPU. It writes tests/data/article_fwd_sm90/: Triton's
metadata file of the kernel (what ``CompiledKernel.metadata`` is read from) and ``ptxas -v``'s
log of its PTX (the registers and local memory that the driver reports once the kernel is loaded,
which needs a GPU). tests/test_metrics.py reads both; the GPU suite checks the driver against
``ptxas -v`` (tests/test_gpu.py).

    python tests/metrics_fixture.py           # rewrite the fixture
    python tests/metrics_fixture.py --check   # compile again, compare with it

Exit status 0: written, or the same; 1: differs; 3: this Triton cannot compile for sm_90 here, or
is not the version that wrote the fixture (registers change between versions), nothing compared.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (read when the kernel is defined)
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS.parent))  # this checkout's flashrun

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashrun.harness.metrics import parse_ptxas  # noqa: E402

FIXTURE = TESTS / "data" / "article_fwd_sm90"
SIGNATURE = {"Q": "*fp16", "K": "*fp16", "V": "*fp16", "O": "*fp16", "N": "i32", "D": "constexpr",
             "BLOCK": "constexpr"}
CONSTANTS = {"D": 64, "BLOCK": 64}


def compile_article() -> tuple[dict, str]:
    """(Triton's metadata of the compiled kernel, ptxas -v's log of its PTX)."""
    from flashrun.harness.probe import ptxas_log

    spec = importlib.util.spec_from_file_location("article_kernel", TESTS / "kernels" / "article_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    compiled = triton.compile(ASTSource(module._article_fwd, SIGNATURE, CONSTANTS), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 3})
    metadata_file = next(Path(p) for name, p in compiled.metadata_group.items() if name.endswith(".json"))
    return json.loads(metadata_file.read_text()), ptxas_log(compiled.asm["ptx"], compiled.metadata)


def main(check: bool) -> int:
    try:
        metadata, log = compile_article()
    except Exception as exc:  # noqa: BLE001 - no CUDA backend or ptxas in this Triton: nothing to compare
        print(f"cannot compile for sm_90 here: {type(exc).__name__}: {exc}")
        return 3
    if not check:
        FIXTURE.mkdir(parents=True, exist_ok=True)
        # library paths are this machine's: kept relative to Triton's package, so the fixture names none
        triton_dir = str(Path(triton.__file__).parent)
        metadata["extern_libs"] = [[name, path.replace(triton_dir, "<triton>")] for name, path in
                                   metadata.get("extern_libs", [])]
        (FIXTURE / "_article_fwd.json").write_text(json.dumps(metadata, indent=1) + "\n")
        (FIXTURE / "ptxas.log").write_text(log)
        print(f"wrote {FIXTURE}: {parse_ptxas(log)}")
        return 0
    fixture = json.loads((FIXTURE / "_article_fwd.json").read_text())
    if fixture.get("triton_version") != metadata.get("triton_version"):
        print(f"the fixture is from triton {fixture.get('triton_version')}, this is {metadata.get('triton_version')}")
        return 3
    fields = ("name", "num_warps", "num_ctas", "shared")
    same = ({f: metadata[f] for f in fields} == {f: fixture[f] for f in fields}
            and parse_ptxas(log) == parse_ptxas((FIXTURE / "ptxas.log").read_text()))
    print("same as the fixture" if same else f"differs from the fixture: {parse_ptxas(log)}, "
          f"{ {f: metadata[f] for f in fields} }")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
