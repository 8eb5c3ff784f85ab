"""sha256 manifests: the digest of every file a directory holds, recorded when it is
written (``meta.json``'s ``files``, ``manifest.json``'s shard entries) and checked when
it is read, so later damage (a torn copy, bit rot, an edit) names the file at fault."""

from __future__ import annotations

import hashlib
from pathlib import Path

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


def find_damage(root: Path, digests: dict[str, str]) -> tuple[Path, str] | None:
    """The first file listed in ``digests`` that is not intact under ``root``, with
    ``"missing"`` or ``"corrupt"`` (sha256 differs); None when all are intact."""
    for name, digest in digests.items():
        f = Path(root) / name
        if not f.is_file():
            return f, "missing"
        if sha256_file(f) != digest:
            return f, "corrupt"
    return None
