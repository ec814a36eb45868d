"""Declared dependencies match the code: every third-party import of the runtime packages is a
declared runtime dependency (or explicitly optional), every declared floor is met by what is
installed, and every module imports with nothing but the runtime dependencies available."""

from __future__ import annotations

import ast
import contextlib
import json
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .conftest import floor_folders

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = floor_folders()
PACKAGES = tuple(FOLDERS)
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
RUNTIME = [Requirement(r) for r in PROJECT["dependencies"]]
EXTRAS = {k: [Requirement(r) for r in v] for k, v in PROJECT["optional-dependencies"].items()}


def _names(reqs: list[Requirement]) -> set[str]:
    return {canonicalize_name(r.name) for r in reqs}


def _guarded(node: ast.Try) -> bool:
    """A try whose handlers catch ImportError: what it imports is explicitly optional."""
    names = {"ImportError", "ModuleNotFoundError"}
    return any(
        h.type is None or any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(h.type))
        for h in node.handlers
    )


def _imports(tree: ast.AST, optional: bool = False):
    """(top-level module name, optional) for every absolute import; optional ones are inside a
    function (lazy) or a try that catches ImportError."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name.split(".")[0], optional
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0], optional
        else:
            lazy = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _imports(node, optional or lazy or (isinstance(node, ast.Try)
                                                          and _guarded(node)))  # fmt: skip


# Import name -> distribution for optional modules whose names differ: when the module is not
# installed here, packages_distributions() cannot tell, and the import name would be taken for
# the distribution's.
IMPORT_NAMES = {"pynvml": "nvidia-ml-py"}
# Import names that several installed distributions share (a namespace): the one that provides
# what the code imports from it (`google.protobuf`, `grpc`).
SHARED_NAMES = {"google": ["protobuf"], "grpc": ["grpcio"]}


def _third_party() -> dict[tuple[str, bool], list[str]]:
    """{(distribution, optional): [files]} over the runtime packages."""
    dists = packages_distributions()
    ours = set(PACKAGES) | {"__future__", "unikv"}
    found: dict[tuple[str, bool], list[str]] = {}
    for pkg in PACKAGES:
        for f in sorted(FOLDERS[pkg].rglob("*.py")):
            for top, optional in _imports(ast.parse(f.read_text(), str(f))):
                if top in ours or top in sys.stdlib_module_names:
                    continue
                for dist in SHARED_NAMES.get(top) or dists.get(top, [IMPORT_NAMES.get(top, top)]):
                    found.setdefault((canonicalize_name(dist), optional), []).append(
                        str(f.relative_to(ROOT))
                    )
    return found


def test_every_import_is_a_declared_dependency():
    runtime = _names(RUNTIME)
    anywhere = runtime.union(*map(_names, EXTRAS.values()))
    undeclared = {
        f"{dist} ({', '.join(sorted(set(files)))})"
        for (dist, optional), files in _third_party().items()
        if dist not in (anywhere if optional else runtime)
    }
    assert not undeclared, f"imported but not declared in pyproject.toml: {sorted(undeclared)}"


def test_transformers_is_optional_and_explained():
    found = _third_party()
    assert ("transformers", False) not in found  # never a runtime import
    assert found[("transformers", True)] == ["kvstrategies/hf_cache.py"]
    assert "transformers" not in _names(RUNTIME)


@pytest.mark.parametrize("req", RUNTIME + [r for v in EXTRAS.values() for r in v], ids=str)
def test_declared_floors_are_installed(req):
    try:
        installed = version(req.name)
    except PackageNotFoundError:
        if req in RUNTIME:
            pytest.fail(f"runtime dependency {req} is not installed")
        pytest.skip(f"{req.name} (an extra) is not installed here")
    assert req.specifier.contains(installed, prereleases=True), f"{req}: installed {installed}"


# Imports every module of the runtime packages with a meta-path finder that refuses any
# top-level module whose distribution is not a runtime dependency (transformers, pytest...).
_CHILD = r"""
import importlib, importlib.abc, importlib.metadata as md, json, pkgutil, sys
allowed = set(json.loads(sys.argv[1]))
dists = md.packages_distributions()
def canon(n): return n.lower().replace("_", "-").replace(".", "-")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if path is None and top in dists and not {canon(d) for d in dists[top]} & allowed:
            raise ModuleNotFoundError(f"No module named {name!r} (not a runtime dependency)")
sys.meta_path.insert(0, Block())
failed = {}
for pkg in json.loads(sys.argv[2]):
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        try:
            importlib.import_module(info.name)
        except ImportError as e:
            failed[info.name] = str(e)
print(json.dumps(failed))
"""


def _closure(reqs: list[Requirement]) -> set[str]:
    """The distributions `reqs` need installed: themselves and what they require (no extras)."""
    from importlib.metadata import requires

    todo, seen = [r for r in reqs], {"unikv"}
    while todo:
        r = todo.pop()
        name = canonicalize_name(r.name)
        if name in seen or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        # A platform-specific requirement may not be installed here.
        with contextlib.suppress(PackageNotFoundError):
            todo += [Requirement(x) for x in requires(r.name) or []]
    return seen


@pytest.mark.timeout(300)
def test_every_module_imports_with_only_the_runtime_dependencies():
    allowed = sorted(_closure(RUNTIME))
    assert "transformers" not in allowed
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(allowed),
         json.dumps(["unikv." + p for p in PACKAGES])],
        capture_output=True, text=True, cwd=ROOT, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    # The optional modules say which extra to install.
    assert set(failed) == {"unikv.kvstrategies.hf_cache", "unikv.storage.redis_store"}, failed
    assert "unikv[hf]" in failed["unikv.kvstrategies.hf_cache"]
    assert "unikv[remote]" in failed["unikv.storage.redis_store"]


def test_no_folder_at_the_root_hides_an_installed_package():
    """CI broke when transformers 5.25 began to require Hugging Face's `kernels`: pytest (and
    `python -m`) put the repository's root first on sys.path, where a folder `kernels/` hid the
    installed package, and `import transformers` failed inside it. A floor whose name an installed
    distribution also ships must live under unikv/ (as unikv/kernels/ does), not at the root."""
    dists = packages_distributions()
    at_root = [p for p, folder in FOLDERS.items() if folder.parent == ROOT]
    assert at_root, "package-dir maps no floor to the root: the check would be empty"
    hidden = {p: dists[p] for p in at_root if set(dists.get(p, [])) - {"unikv"}}
    assert not hidden, f"root folders with the import name of an installed distribution: {hidden}"


def test_no_code_or_help_text_cites_a_file_outside_the_repository():
    """Issue 33: help texts and docstrings named the design document, which a user of the
    package does not have; the measurement protocol's copy is docs/protocol.md."""
    outside = ("DESIGN.md", "STYLE.md", "../shared")
    found = []
    for folder in [*FOLDERS.values(), ROOT / "benchmarks", ROOT / "configs", ROOT / "tests"]:
        for f in sorted(folder.rglob("*")):
            if f.suffix in (".py", ".toml", ".c", ".html") and f.name != Path(__file__).name:
                text = f.read_text(encoding="utf-8")
                found += [f"{f.relative_to(ROOT)}: {o}" for o in outside if o in text]
    assert not found
