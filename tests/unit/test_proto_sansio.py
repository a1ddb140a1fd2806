"""proto/ is sans-IO (DESIGN §9 rule 1): no sockets, event loops, threads or processes, no daemon code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import proto

pytestmark = pytest.mark.timeout(60)

PROTO_DIR = Path(proto.__file__).parent
REPO = PROTO_DIR.parent
FORBIDDEN = frozenset({
    "socket", "_socket", "ssl", "select", "selectors", "asyncio", "uvloop", "threading", "_thread",
    "subprocess", "multiprocessing", "concurrent", "signal", "commd", "client",
})
# What `import proto` must not add to a fresh interpreter (some are imported at startup already).
RUNTIME_FORBIDDEN = ("asyncio", "socket", "threading", "selectors", "subprocess", "select",
                     "uvloop", "multiprocessing", "concurrent", "commd", "client")


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every absolute import in `path`, plus dynamic imports by literal name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call):
            func = node.func
            dynamic = (isinstance(func, ast.Name) and func.id == "__import__") or (
                isinstance(func, ast.Attribute) and func.attr == "import_module")
            if dynamic:
                arg = node.args[0] if node.args else None
                names.add(arg.value.split(".")[0] if isinstance(arg, ast.Constant)
                          and isinstance(arg.value, str) else "<dynamic>")
    return names


def test_every_proto_module_is_scanned() -> None:
    files = {p.name for p in PROTO_DIR.glob("*.py")}
    assert {"__init__.py", "codec.py", "connection.py", "errors.py", "messages.py", "types.py"} <= files


@pytest.mark.parametrize("path", sorted(PROTO_DIR.glob("*.py")), ids=lambda p: p.name)
def test_no_forbidden_imports(path: Path) -> None:
    names = imported_modules(path)
    assert not names & FORBIDDEN, f"{path.name} imports {sorted(names & FORBIDDEN)}"
    assert "<dynamic>" not in names
    assert "importlib" not in names


def test_scanner_sees_imports() -> None:
    """The scanner itself finds what it looks for (so the test above cannot pass vacuously)."""
    assert imported_modules(PROTO_DIR / "codec.py") >= {"msgpack", "dataclasses", "typing"}
    sample = PROTO_DIR.parent / "commd" / "session.py"
    if sample.exists():
        assert "proto" in imported_modules(sample)


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=True,
    )
    return set(out.stdout.split())


def test_importing_proto_loads_no_io_modules() -> None:
    baseline = _modules_after("")
    after = _modules_after("import proto\nassert proto.__file__.startswith(" + repr(str(REPO)) + ")")
    assert "proto.connection" in after and "msgpack" in after  # the import really happened
    added = {name.split(".")[0] for name in after - baseline}
    assert not added & set(RUNTIME_FORBIDDEN), sorted(added & set(RUNTIME_FORBIDDEN))
    for name in ("asyncio", "socket", "threading"):
        assert name not in after or name in baseline
