"""sha256 manifests: the digest of every file a directory holds, recorded when it is
written (``meta.json``'s ``files``, ``manifest.json``'s shard entries) and checked when
it is read, so later damage (a torn copy, bit rot, an edit) names the file at fault."""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath

_CHUNK = 1 << 22  # 4 MiB reads: hashing runs at disk speed without holding a shard in memory


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_files(root: Path) -> dict[str, str]:
    """``{relative posix path: sha256}`` of every file under ``root``, sorted by path."""
    root = Path(root)
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return {name: sha256_file(root / name) for name in names}


def contained(root: Path, name: object) -> Path | None:
    """``root / name`` when ``name``, a path read from a file (a manifest key, DCP's
    ``relative_path``), is relative and stays inside ``root``, symlinks resolved; else None.
    An absolute path, a ``..`` or a link out of ``root`` would have the reader open (and hash,
    or unpickle) whatever file the writer of the manifest chose."""
    if not isinstance(name, str) or not name or "\0" in name:
        return None
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts:
        return None
    path = Path(root) / name
    try:
        if not path.resolve().is_relative_to(Path(root).resolve()):
            return None
    except (OSError, RuntimeError):  # a symlink loop
        return None
    return path


def find_damage(root: Path, digests: dict[str, str]) -> tuple[Path, str] | None:
    """The first file listed in ``digests`` that is not intact under ``root``, with
    ``"missing"``, ``"corrupt"`` (sha256 differs) or ``"outside"`` (the name leads out of
    ``root``: never opened); None when all are intact."""
    for name, digest in digests.items():
        f = contained(root, name)
        if f is None:
            return Path(str(name)[:200]), "outside"  # the name as listed
        if not f.is_file():
            return f, "missing"
        if sha256_file(f) != digest:
            return f, "corrupt"
    return None
