"""The package layering is a contract (``[tool.importlinter]`` in pyproject.toml): trainforge
keeps it, and each contract breaks on a package that violates it, so the check can fail.

The second half runs the same contracts (root package renamed) on a throw-away package
shaped like trainforge's top level, with one forbidden import added per case: what a
contributor would do by accident (the model reaching into training, a cycle between two
modules, a new package nobody placed in the layers).

Two rules import-linter cannot express are checked on the source text at the end:
``parallel/`` names no model family (each family declares its tensor-parallel plan in
``model/``), and ``tests/`` (not a package) does not import ``bench/``."""

from __future__ import annotations

import ast
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
    """An empty package ``root`` with trainforge's packages and modules (empty files; contracts
    name some: ``model.mla``), and the imports the contracts ignore (so each ignore matches, as
    in trainforge)."""
    src = Path(trainforge.__file__).parent
    pkg = tmp_path / root
    for p in src.rglob("*.py"):
        if (p.parent / "__init__.py").is_file():
            (pkg / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (pkg / p.relative_to(src)).write_text("")
    for opts in _renamed(root)["contracts_options"]:
        for ignored in opts.get("ignore_imports", []):
            importer, imported = (m.strip() for m in ignored.split("->"))
            with open(pkg.joinpath(*importer.split(".")[1:]).with_suffix(".py"), "a") as f:
                f.write(f"import {imported}\n")
    return pkg


# (files to write, relative to the package: {path: import line}, the contracts that must break)
CASES = {
    "clean": ({}, []),
    "model imports train": ({"model/llama.py": "import {root}.train"}, ["layers", "model"]),
    # parallel/ imports model/ (expert_parallel -> model.moe), so the pair is a cycle as well.
    "model imports parallel": ({"model/llama.py": "import {root}.parallel"}, ["layers", "model", "acyclic"]),
    "infer imports train": ({"infer/loading.py": "from {root}.train import checkpoint"}, ["layers", "no-train"]),
    "monitor imports train": ({"monitor/monitor.py": "import {root}.train"}, ["layers", "no-train"]),
    "data imports config": ({"data/pipeline.py": "from {root}.config import x"}, ["layers", "no-config"]),
    "monitor imports the CLI": ({"monitor/report.py": "import {root}.cli"}, ["layers", "no-cli"]),
    "a cycle inside train": ({"train/a.py": "import {root}.train.b", "train/b.py": "import {root}.train.a"},
                             ["acyclic"]),
    "a new package outside the layers": ({"plugins/__init__.py": ""}, ["layers"]),
    # Training takes the quantisation grids and the file loading from the packages below both.
    "train imports the engine": ({"train/qat.py": "from {root}.infer.quantize import int4"}, ["train-not-infer"]),
    "train imports infer's loading": ({"train/init_from.py": "import {root}.infer.loading"}, ["train-not-infer"]),
    "loading imports infer": ({"loading/loader.py": "from {root}.infer import quantize"}, ["layers"]),
    "quant_formats imports train": ({"quant_formats/int4.py": "import {root}.train.qat"}, ["layers", "no-train"]),
    # parallel/ finds a family's plan through model/tp_plans.py, never by importing the family.
    "parallel imports a family": ({"parallel/tensor_parallel.py": "from {root}.model.mla import MLA"},
                                  ["parallel-no-family"]),
    "parallel imports a family's plan": ({"parallel/tensor_parallel.py": "from {root}.model import mtp_tp"},
                                         ["parallel-no-family"]),
    "parallel reaches a family through tp_plans": ({"parallel/tensor_parallel.py": "import {root}.model.tp_plans",
                                                    "model/tp_plans.py": "import {root}.model.hourglass"}, []),
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
        with open(pkg / rel, "a") as f:
            f.write(line.format(root=root) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _broken(_renamed(root)) == want


# ----------------------------------------------------------------------------- source-text rules
REPO = PYPROJECT.parent
# A model family's name as a word, or inside an identifier (is_mla, mtp_depth, hourglass_stages).
FAMILY = re.compile(r"(?<![a-z])(hourglass|mla|mtp|latent|moe|multi-token|mixture-of-experts|deepseek|"
                    r"shorten\w*|upsampl\w*)(?![a-z])", re.IGNORECASE)
# parallel/ files that still name a family, and why. The list may only shrink: a file that no
# longer names one must leave it (the test says so), and no other file may join it.
NAMES_FAMILIES = {
    "expert_parallel.py": "expert parallelism is the routed-experts layer's own parallelism, not a plan applied to it",
}


def _family_names(text: str) -> list[str]:
    return sorted({m.lower() for m in FAMILY.findall(text)})


def test_parallel_names_no_model_family():
    """Each family declares its tensor-parallel plan beside its modules (model/*_tp.py); parallel/
    applies plans. tensor_parallel.py, where every family used to add its plan, is held to it."""
    parallel = Path(trainforge.__file__).parent / "parallel"
    naming = {p.relative_to(parallel).as_posix(): _family_names(p.read_text())
              for p in sorted(parallel.rglob("*.py"))}
    naming = {k: v for k, v in naming.items() if v}
    assert "tensor_parallel.py" in {p.relative_to(parallel).as_posix() for p in parallel.rglob("*.py")}
    new = {k: v for k, v in naming.items() if k not in NAMES_FAMILIES}
    assert not new, f"parallel/ files name a model family {new}: declare it as data in the family's model/*_tp.py"
    cleaned = sorted(set(NAMES_FAMILIES) - set(naming))
    assert not cleaned, f"{cleaned} no longer name a model family: drop them from NAMES_FAMILIES"


def test_the_family_check_sees_a_family_name():
    assert _family_names("sp = cfg.is_mla and not cfg.mtp_depth  # an hourglass level") == ["hourglass", "mla", "mtp"]
    assert _family_names("colwise, rowwise; the stream on a sequence shard; formula, complete") == []


# The tests of trainforge's code live in tests/ and import nothing from bench/: a benchmark script
# may change or go without breaking them. Tests of the benchmark scripts themselves (their parsers,
# tables, reduced runs, the Hugging Face reference a benchmark measures against) live beside them,
# in bench/tests/ (pytest's testpaths runs both).


def bench_importers(root: Path) -> list[str]:
    """The .py files under ``root`` (paths relative to its parent) with an import of ``bench``."""
    found = []
    for p in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(n == "bench" or n.startswith("bench.") for n in names):
                found.append(p.relative_to(root.parent).as_posix())
                break
    return found


def test_tests_do_not_import_bench():
    importers = bench_importers(REPO / "tests")
    assert not importers, f"{importers} import bench/: test trainforge's code here, a benchmark script's in bench/tests/"


def test_the_bench_check_finds_every_import_form(tmp_path):
    tests = tmp_path / "tests"
    (tests / "sub").mkdir(parents=True)
    (tests / "a.py").write_text("import bench.inference\n")
    (tests / "sub" / "b.py").write_text("def f():\n    from bench import tp2d\n")
    (tests / "c.py").write_text("from benchmarks import x\nimport trainforge.bench_like\nfrom . import bench\n")
    assert bench_importers(tests) == ["tests/a.py", "tests/sub/b.py"]
