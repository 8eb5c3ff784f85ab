"""Helpers of the data-pipeline tests: prepared sets cut into many shards (no
tokenisation), and a local HTTP server."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np

def write_prepared(src: Path, dst: Path, train: list[np.ndarray], val: list[np.ndarray]) -> Path:
    """A prepared directory with ``src``'s tokenizer and manifest header and these shards."""
    manifest = json.loads((src / "manifest.json").read_text())
    dst.mkdir(parents=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    splits = {}
    for split, shards in (("train", train), ("val", val)):
        splits[split] = []
        for i, shard in enumerate(shards):
            name = f"{split}_{i:05d}.bin"
            raw = np.ascontiguousarray(shard, dtype="<u2").tobytes()
            (dst / name).write_bytes(raw)
            splits[split].append({"file": name, "tokens": len(shard), "sha256": hashlib.sha256(raw).hexdigest()})
    manifest["splits"] = splits
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dst


def reshard(src: Path, dst: Path, shard_tokens: int, train_shards: int, val_tokens: int = 4200) -> Path:
    """``src``'s token stream cut into ``train_shards`` shards of ``shard_tokens`` (+ 2 val shards)."""
    m = json.loads((src / "manifest.json").read_text())
    stream = lambda split: np.concatenate([np.fromfile(src / e["file"], dtype="<u2") for e in m["splits"][split]])
    train, val = stream("train"), stream("val")[:val_tokens]
    assert len(train) >= shard_tokens * train_shards
    return write_prepared(src, dst, [train[i * shard_tokens:(i + 1) * shard_tokens] for i in range(train_shards)],
                          [val[: val_tokens // 2], val[val_tokens // 2:]])


class _Handler(http.server.SimpleHTTPRequestHandler):
    delay_s: dict[str, float] = {}

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        name = self.path.rsplit("/", 1)[-1]
        if name in self.delay_s:
            time.sleep(self.delay_s[name])
        super().do_GET()


@contextlib.contextmanager
def serve(root: Path, delay_s: dict[str, float] | None = None):
    """Serve ``root`` over http://127.0.0.1:PORT/ in a thread; ``delay_s`` stalls named files."""
    handler = type("H", (_Handler,), {"delay_s": dict(delay_s or {})})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
