"""Where prepared shards come from (the cache's last tier): a local directory or any
fsspec URL (``file://``, ``http(s)://``, ``s3://`` ... once its backend is installed).

Every read is bounded by ``timeout_s``: a hung NFS mount or a stalled HTTP server
raises ``SourceTimeoutError`` naming the file and the key to change, instead of
hanging the run. fsspec is imported only when a URL is used, and nothing is fetched
before the trainer asks for it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Protocol, TypeVar

from trainforge.errors import ConfigError, DataError

T = TypeVar("T")


class SourceTimeoutError(DataError):
    """The source did not answer within ``data.timeout_s``."""


class SourceReadError(DataError):
    """The source answered with an error (connection refused, HTTP 5xx, permission denied)."""


class ShardSource(Protocol):
    name: str  # for messages: the directory or URL

    def read(self, file: str) -> bytes:
        """The whole file; FileNotFoundError if absent, SourceTimeoutError if too slow."""
        ...


def is_url(path: str) -> bool:
    return "://" in path


def check_url(url: str) -> None:
    """Fail at config time when ``url``'s protocol has no installed fsspec backend."""
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"config key 'data.path' = {url!r}: reading URLs needs fsspec (pip install fsspec)") \
            from None
    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ConfigError(f"config key 'data.path' = {url!r}: fsspec knows no protocol {protocol!r}") from None
    except ImportError as e:
        raise ConfigError(f"config key 'data.path' = {url!r}: the {protocol}:// backend is not installed ({e}); "
                          "install it (e.g. pip install 'trainforge[http]' or s3fs)") from None


def with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``fn`` in a daemon thread and wait at most ``timeout_s``. A read that never
    returns leaves its thread blocked (Python cannot cancel a blocking read), but the
    caller gets a clear error and the process can still exit."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="trainforge-source-read", daemon=True)
    t.start()
    t.join(timeout_s)
    # The backend's own timeout (aiohttp's) may fire first: same error for the user.
    if t.is_alive() or isinstance(box.get("error"), TimeoutError):
        raise SourceTimeoutError(f"{what} did not arrive within data.timeout_s = {timeout_s:g} s; the source is "
                                 "hung or too slow (raise data.timeout_s, or check the server/mount)")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


class LocalSource:
    """A directory on a local or mounted filesystem."""

    def __init__(self, root: str | Path, timeout_s: float):
        self.root, self.timeout_s = Path(root), timeout_s
        self.name = str(self.root)

    def read(self, file: str) -> bytes:
        path = self.root / file
        return with_timeout(path.read_bytes, self.timeout_s, f"{path}")


class FsspecSource:
    """Any fsspec URL. HTTP also gets aiohttp's own total timeout so a stalled request
    is torn down, not just abandoned."""

    def __init__(self, url: str, timeout_s: float):
        import fsspec

        check_url(url)
        self.name, self.timeout_s = url.rstrip("/"), timeout_s
        protocol = url.split("://", 1)[0]
        options: dict = {}
        if protocol in ("http", "https"):
            import aiohttp

            # Block size 0: one GET per file; fsspec's default random-access reader would
            # probe with HEAD and range requests we do not need for whole shards.
            options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=timeout_s)}, "block_size": 0}
        self.fs, self.root = fsspec.core.url_to_fs(url, **options)
        self._join = (lambda f: f"{self.name}/{f}") if protocol in ("http", "https") else \
            (lambda f: f"{self.root.rstrip('/')}/{f}")

    def read(self, file: str) -> bytes:
        target = self._join(file)

        def cat() -> bytes:
            try:
                return self.fs.cat_file(target)
            except FileNotFoundError:
                raise
            except OSError as e:
                if "404" in str(e) or "Not Found" in str(e):
                    raise FileNotFoundError(target) from None
                raise

        try:
            return with_timeout(cat, self.timeout_s, f"{self.name}/{file}")
        except (FileNotFoundError, DataError):
            raise
        except Exception as e:  # the backend's own types (aiohttp, botocore...): one line naming the file
            detail = " ".join(str(e).split()) or type(e).__name__
            raise SourceReadError(f"{self.name}/{file} could not be fetched ({detail}); check the URL and that "
                                  "the server is reachable") from None


def open_source(path: str, timeout_s: float) -> ShardSource:
    return FsspecSource(path, timeout_s) if is_url(path) else LocalSource(path, timeout_s)
