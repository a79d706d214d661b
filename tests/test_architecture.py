"""The layering of gradpool, enforced on the source: imports only point down.

Bottom up: errors; layout, reuse, dtypes, device; pool | comm | exchange | gathered (siblings);
pack (the device writer); host (the CPU host writer: caches, kernels, views, writer); writers;
reducer; runtime and
testing. hyper_parallel sits on top and imports gradpool only through its root; gradpool.app, the
CLI and the benchmarks runner sit on top of both.
"""
import ast
import re
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "gradpool"
HOST = CORE / "host"
# A core module (or subpackage, "host") may import only core modules of a strictly lower layer.
LAYER = {"errors": 0, "layout": 1, "reuse": 1, "dtypes": 1, "device": 1, "pool": 2, "comm": 2,
         "exchange": 2, "gathered": 2, "pack": 3, "host": 4, "writers": 5, "reducer": 6, "runtime": 7,
         "testing": 7}
# Inside the host subpackage, the same rule among its modules.
HOST_LAYER = {"caches": 0, "kernels": 1, "views": 2, "writer": 3}
ABOVE_CORE = ("hyper_parallel", "gradpool.app", "benchmarks")


def imported_modules(path: pathlib.Path) -> list[str]:
    """Every module ``path`` imports, anywhere in the file (inside functions too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:       # relative: resolve against the file's package
                package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-node.level])
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module
            found.append(base)
            # ``from gradpool import pack`` imports the submodule gradpool.pack
            found += [f"{base}.{alias.name}" for alias in node.names]
    return found


def core_files():
    return sorted(p for p in CORE.glob("*.py") if p.stem not in ("__init__", "__main__"))


def host_files():
    return sorted(p for p in HOST.glob("*.py") if p.stem != "__init__")


def test_every_core_module_has_a_layer():
    assert {p.stem for p in core_files()} | {HOST.name} == set(LAYER)
    assert {p.stem for p in host_files()} == set(HOST_LAYER)


def gradpool_imports(path: pathlib.Path, where: str):
    """``(module, parts after "gradpool")`` of every gradpool module ``path`` imports; none may
    be above the core."""
    for module in imported_modules(path):
        assert not module.startswith(ABOVE_CORE), f"{where} imports {module}"
        parts = module.split(".")
        if parts[0] == "gradpool" and len(parts) > 1:
            yield module, parts[1:]


@pytest.mark.parametrize("path", core_files(), ids=lambda p: p.stem)
def test_core_imports_point_down(path):
    mine = LAYER[path.stem]
    for module, (top, *_) in gradpool_imports(path, path.name):
        if top in LAYER:
            assert LAYER[top] < mine, \
                f"{path.name} (layer {mine}) imports {module} (layer {LAYER[top]})"


@pytest.mark.parametrize("path", host_files(), ids=lambda p: p.stem)
def test_host_imports_point_down(path):
    """The host subpackage imports the core's lower layers, and its own lower modules."""
    mine = HOST_LAYER[path.stem]
    for module, (top, *rest) in gradpool_imports(path, f"host/{path.name}"):
        if top != "host":
            assert top in LAYER and LAYER[top] < LAYER["host"], \
                f"host/{path.name} imports {module} (layer {LAYER.get(top)})"
        elif rest and rest[0] in HOST_LAYER:
            assert HOST_LAYER[rest[0]] < mine, f"host/{path.name} imports {module}"


def test_the_pool_knows_no_host_path():
    """Where a bucket is written is the writers' business: the pool imports neither the host
    subpackage nor the writers, and its records hold no host memory."""
    for module in imported_modules(CORE / "pool.py"):
        assert not module.startswith(("gradpool.host", "gradpool.writers", "gradpool.pack",
                                      "numpy", "ml_dtypes", "numba")), module
    source = (CORE / "pool.py").read_text()
    for name in ("host_array", "host_address", "host_alias", "compile_host_loops", "asnumpy"):
        assert name not in source, name


def test_pool_and_comm_do_not_know_each_other():
    assert not any(m.startswith("gradpool.comm") for m in imported_modules(CORE / "pool.py"))
    assert not any(m.startswith("gradpool.pool") for m in imported_modules(CORE / "comm.py"))


def test_layout_is_pure_python():
    for module in imported_modules(CORE / "layout.py"):
        assert not module.startswith(("mindspore", "numpy")), module
        if module.startswith("gradpool."):
            assert module.startswith("gradpool.errors"), module


def test_reuse_is_pure_python():
    """The bucket reuse rule, shared by the pool and the memory plan, needs no device."""
    for module in imported_modules(CORE / "reuse.py"):
        assert not module.startswith(("mindspore", "numpy", "gradpool")), module


def test_kernels_are_numpy_and_numba_only():
    """The compiled loops work on addresses and NumPy arrays: no MindSpore, no gradpool but the
    cache sizes their thresholds come from."""
    for module in imported_modules(HOST / "kernels.py"):
        assert not module.startswith("mindspore"), module
        assert not module.startswith("gradpool") or module.startswith("gradpool.host.caches") \
            or module == "gradpool.host", module


def test_caches_are_pure_python():
    """The cache sizes and the thresholds derived from them need neither a device nor numba."""
    for module in imported_modules(HOST / "caches.py"):
        assert not module.startswith(("mindspore", "numpy", "numba", "gradpool")), module


def test_the_facade_names_resolve_and_stay_below_the_application():
    import gradpool
    for name in gradpool.__all__:
        assert getattr(gradpool, name) is not None, name
    for module in imported_modules(CORE / "__init__.py"):
        assert not module.startswith(ABOVE_CORE), module
    for required in ("BucketPool", "Lease", "PoolStats", "ReduceScatterLayout", "GradReducer",
                     "ReducerConfig", "ReduceResult", "GradPoolConfig", "communicator_for",
                     "SingleProcessCommunicator", "SUPPORTED_DTYPES", "GradPoolError",
                     "InvalidArgumentError", "LeaseStateError", "PoolCapacityError"):
        assert required in gradpool.__all__, required


@pytest.mark.parametrize("path", sorted((ROOT / "hyper_parallel").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_hyper_parallel_imports_gradpool_only_through_its_root(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradpool"):
            assert node.module == "gradpool", f"{path.name}: from {node.module} import ..."
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert not alias.name.startswith("gradpool."), f"{path.name}: import {alias.name}"


_MACHINE_FIGURE = re.compile(
    r"\b\d+(?:[.,]\d+)?(?:\s?-\s?\d+(?:[.,]\d+)?)?\s?(?:ns|us|µs|ms)\b"
    r"|\b[GMK]B/s\b|\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x (?:faster|slower)\b"
    r"|\b0\.\d+(?:-\d?\.\d+)? of (?:a|the|that|NumPy's) memcpy"
    r"|\b(?:Intel|AMD|EPYC|Xeon)\b|\b\d+-core\b")


def _comments_and_docstrings(path: pathlib.Path):
    import io
    import tokenize
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "lineno", 1), doc


@pytest.mark.parametrize("path", core_files() + host_files(), ids=lambda p: p.stem)
def test_core_comments_hold_no_machine_figures(path):
    """Timings of a particular machine go stale in a comment: they live in docs/benchmarks/
    (host-path.md), and the comment says why in words."""
    hits = [(line, m.group(0)) for line, text in _comments_and_docstrings(path)
            for m in _MACHINE_FIGURE.finditer(text)]
    assert not hits, f"{path.name}: machine figures in comments at {hits}"


def _house_modules() -> dict[str, pathlib.Path]:
    """Every module of the house (core, hyper_parallel, app, benchmarks) by dotted name."""
    out = {}
    for top in ("gradpool", "hyper_parallel", "benchmarks"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imported_names(path: pathlib.Path) -> list[str]:
    """What ``path`` imports, one dotted name per imported thing: ``from gradpool import pack``
    gives gradpool.pack, ``from gradpool import BucketPool`` gives gradpool.BucketPool."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out += [f"{node.module}.{alias.name}" for alias in node.names]
    return out


def _import_graph() -> dict[str, set[str]]:
    """``{module: house modules it imports}``; an imported name resolves to the longest house
    module it starts with (a submodule, else the package that defines the name)."""
    modules = _house_modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imported_names(path):
            parts = imported.split(".")
            for cut in range(len(parts), 0, -1):
                candidate = ".".join(parts[:cut])
                if candidate in modules:
                    if candidate != name:
                        targets.add(candidate)
                    break
        graph[name] = targets
    return graph


def test_no_import_cycle_anywhere_in_the_house():
    graph = _import_graph()
    state: dict[str, int] = {}        # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_layers_above_the_core_point_down():
    """core <- hyper_parallel <- app <- benchmarks: the app never imports the benchmarks (gradpool
    bench runs them as a module), the core neither."""
    for name, targets in _import_graph().items():
        if name.endswith("__main__"):
            continue            # ``python -m gradpool`` is the CLI's entry point
        if name.startswith(("gradpool", "hyper_parallel")):
            assert not any(t.startswith("benchmarks") for t in targets), (name, targets)
        if name.startswith("hyper_parallel"):
            assert not any(t.startswith("gradpool.app") for t in targets), (name, targets)
        if not name.startswith(("gradpool.app", "benchmarks")) and name.startswith("gradpool"):
            assert not any(t.startswith(("gradpool.app", "hyper_parallel")) for t in targets), \
                (name, targets)
