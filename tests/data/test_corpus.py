"""The built-in corpus's file list: the pruned walk gives exactly what a filtered
``rglob`` gave (the list, hence the prepared-data cache key, must not change), and
never descends into the excluded directories."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from trainforge.data import corpus
from trainforge.data.corpus import default_corpus_files, fingerprint

EXCLUDED = ("site-packages", "dist-packages", "test", "tests", "idle_test")


def rglob_files(root: Path) -> list[Path]:
    """The previous implementation: every .py under root, then filtered."""
    return [f for f in sorted(root.rglob("*.py"))
            if not any(part in EXCLUDED for part in f.relative_to(root).parts)]


def test_built_in_corpus_is_the_filtered_rglob_list_in_the_same_order():
    files = default_corpus_files()
    want = rglob_files(Path(sysconfig.get_paths()["stdlib"]))
    assert files == want
    assert fingerprint(files) == fingerprint(want)
    assert len(files) > 500 and any(f.name == "argparse.py" for f in files)


def test_pruned_walk_matches_rglob_on_awkward_trees(tmp_path, monkeypatch):
    """Excluded names at any depth, a .py-named directory, a symlinked directory (not
    followed, as rglob does not), names that sort differently as strings and as paths."""
    root = tmp_path / "lib"
    for rel in ("a.py", "a-b.py", "a/b.py", "a/tests/x.py", "test/y.py", "pkg/site-packages/z.py",
                "pkg/idle_test/w.py", "pkg/testing/v.py", "pkg/x.py/inner.py", "deep/er/est/u.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("pass\n")
    (root / "pkg" / "x.py").mkdir(exist_ok=True)  # a directory whose name matches *.py
    (root / "linked").symlink_to(root / "a", target_is_directory=True)
    monkeypatch.setattr(corpus.sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    got = default_corpus_files()
    assert got == rglob_files(root)
    names = {str(f.relative_to(root)) for f in got}
    assert {"a.py", "a-b.py", "a/b.py", "pkg/testing/v.py", "pkg/x.py", "pkg/x.py/inner.py"} <= names
    assert not names & {"a/tests/x.py", "test/y.py", "pkg/site-packages/z.py", "pkg/idle_test/w.py"}
    assert not any(n.startswith("linked/") for n in names)
