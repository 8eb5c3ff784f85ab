"""The package layering is a contract (``[tool.importlinter]`` in pyproject.toml): trainforge
keeps it, and each contract breaks on a package that violates it, so the check can fail.

The second half runs the same contracts (root package renamed) on a throw-away package
shaped like trainforge's top level, with one forbidden import added per case: what a
contributor would do by accident (the model reaching into training, a cycle between two
modules, a new package nobody placed in the layers)."""

from __future__ import annotations

import re
import subprocess
import sys
from copy import deepcopy
from pathlib import Path

import grimp
import pytest
from importlinter.api import read_configuration
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.layers import LayersContract

import trainforge

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
LAYERED_PACKAGES = ("model",)  # subpackages whose modules a layers contract lists
CONTRACT_TYPES = {"layers": LayersContract, "forbidden": ForbiddenContract, "acyclic_siblings": AcyclicSiblingsContract}


def _broken(config: dict) -> list[str]:
    """Ids of the contracts in ``config`` (``read_configuration``'s shape) that its root package breaks."""
    session = config["session_options"]
    type_only = session.get("exclude_type_checking_imports") in ("True", "true")
    graph = grimp.build_graph(*session["root_packages"], cache_dir=None, exclude_type_checking_imports=type_only)
    broken = []
    for opts in config["contracts_options"]:
        contract = CONTRACT_TYPES[opts["type"]](name=opts["name"], session_options=session, contract_options=opts)
        if not contract.check(deepcopy(graph), verbose=False).kept:  # checks may remove ignored imports
            broken.append(opts["id"])
    return broken


def test_trainforge_keeps_its_layering_contracts():
    broken = _broken(read_configuration(str(PYPROJECT)))
    if broken:  # the readable report: which import breaks which rule
        lint = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
                               "--no-cache", "--no-logo", str(PYPROJECT)], capture_output=True, text=True)
        pytest.fail(f"layering contracts broken: {broken}\n{lint.stdout[-8000:]}")


def _renamed(root: str) -> dict:
    """pyproject.toml's contracts with the root package ``trainforge`` renamed to ``root``."""
    def rename(v):
        if isinstance(v, str):
            return re.sub(r"\btrainforge\b", root, v)
        if isinstance(v, list):
            return [rename(x) for x in v]
        if isinstance(v, dict):
            return {k: rename(x) for k, x in v.items()}
        return v

    return rename(read_configuration(str(PYPROJECT)))


def _mirror(tmp_path: Path, root: str) -> Path:
    """An empty package ``root`` with trainforge's top-level modules and packages."""
    src = Path(trainforge.__file__).parent
    pkg = tmp_path / root
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for p in src.iterdir():
        if p.is_dir() and (p / "__init__.py").is_file():
            (pkg / p.name).mkdir()
            (pkg / p.name / "__init__.py").write_text("")
        elif p.suffix == ".py" and p.name != "__init__.py":
            (pkg / p.name).write_text("")
    for sub in LAYERED_PACKAGES:  # packages with a layers contract of their own: their modules too
        for p in (src / sub).glob("*.py"):
            (pkg / sub / p.name).touch()
    (pkg / "__main__.py").write_text(f"import {root}.cli\n")
    return pkg


# (files to write, relative to the package: {path: import line}, the contracts that must break)
CASES = {
    "clean": ({}, []),
    "model imports train": ({"model/llama.py": "import {root}.train"}, ["layers", "model"]),
    "model imports parallel": ({"model/llama.py": "import {root}.parallel"}, ["layers", "model"]),
    "infer imports train": ({"infer/loading.py": "from {root}.train import checkpoint"}, ["layers", "no-train"]),
    "monitor imports train": ({"monitor/monitor.py": "import {root}.train"}, ["layers", "no-train"]),
    "data imports config": ({"data/pipeline.py": "from {root}.config import x"}, ["layers", "no-config"]),
    "monitor imports the CLI": ({"monitor/report.py": "import {root}.cli"}, ["layers", "no-cli"]),
    "a cycle inside train": ({"train/a.py": "import {root}.train.b", "train/b.py": "import {root}.train.a"},
                             ["acyclic"]),
    "a new package outside the layers": ({"plugins/__init__.py": ""}, ["layers"]),
    "a model module imports the decode step": ({"model/norm.py": "import {root}.model.fast_decode"},
                                                ["model-layers"]),
    "a model family imports a cache lazily": ({"model/llama.py": "def f():\n    import {root}.model.hourglass_cache"},
                                               ["model-layers"]),
    "a new model module outside the layers": ({"model/plugin.py": ""}, ["model-layers"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_contract_breaks_on_a_violation(case, tmp_path, monkeypatch):
    root = "tf_layering_" + re.sub(r"\W", "_", case)
    pkg = _mirror(tmp_path, root)
    files, want = CASES[case]
    for rel, line in files.items():
        (pkg / rel).parent.mkdir(exist_ok=True)
        (pkg / rel).write_text(line.format(root=root) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _broken(_renamed(root)) == want
