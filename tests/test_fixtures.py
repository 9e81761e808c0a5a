"""conftest.py's fixtures are a promise to every test module: a module that defines a fixture
of the same name silently replaces it (and with it the environment scrubbing, the secret reset
and the log clean-up). This test fails if any module does."""

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _fixtures(path: Path) -> dict[str, bool]:
    """Fixture name -> autouse, for every ``@pytest.fixture`` function defined in ``path``."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for decorator in node.decorator_list:
            call = decorator if isinstance(decorator, ast.Call) else None
            target = call.func if call else decorator
            if ast.unparse(target) in ("pytest.fixture", "fixture"):
                autouse = any(k.arg == "autouse" and ast.unparse(k.value) == "True" for k in (call.keywords if call else []))
                found[node.name] = autouse
    return found


def test_conftest_has_an_autouse_isolation_fixture() -> None:
    assert _fixtures(TESTS / "conftest.py").get("isolated") is True


def test_no_module_redefines_a_conftest_fixture() -> None:
    shared = set(_fixtures(TESTS / "conftest.py"))
    shadowing = {f"{path.name}: {name}" for path in sorted(TESTS.glob("test_*.py"))
                 for name in _fixtures(path) if name in shared}
    assert not shadowing, f"these fixtures replace conftest.py's: {sorted(shadowing)}"
