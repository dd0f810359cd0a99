"""Which way the packages point, read from their sources (every `import`, at the top or inside a
function): the engine imports the kernels, never the other way round."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the GPU run and bench scripts drive the engine: they are tools over it, not kernels
KERNEL_TOOLS = {"gpu_run.py", "gpu_serve.py", "bench_gpu.py"}


def imported(source: str) -> set[str]:
    """Every module a source imports, by its absolute name (relative imports are not used here)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def reaching(paths, packages: tuple[str, ...]) -> list[str]:
    """`path: module` for every import in `paths` of a module in (or under) `packages`."""
    return [f"{path.relative_to(ROOT)}: {name}" for path in sorted(paths)
            for name in sorted(imported(path.read_text(encoding="utf-8")))
            if any(name == p or name.startswith(p + ".") for p in packages)]


def test_the_reader_finds_imports_at_the_top_and_inside_functions():
    source = ("import a.b\nfrom c import d\n"
              "def f():\n    from services.decode import reservations\n")
    assert imported(source) >= {"a.b", "c", "c.d", "services.decode",
                                "services.decode.reservations"}


def test_no_kernel_module_imports_anything_from_services():
    kernels = [p for p in (ROOT / "kernels").glob("*.py") if p.name not in KERNEL_TOOLS]
    assert kernels
    found = reaching(kernels, ("services",))
    assert not found, "kernels/ is below the engine; it must not import it:\n" + "\n".join(found)


def test_the_worker_imports_no_role():
    """The worker serves the Role it is given (services/worker/role.py); only the process entry
    (services/cli/serve_cmd.py) knows the roles by name."""
    worker = list((ROOT / "services" / "worker").rglob("*.py"))
    assert worker
    found = reaching(worker, ("services.prefill", "services.decode", "services.mixed",
                              "services.cli"))
    assert not found, "services/worker must not import a role package:\n" + "\n".join(found)
