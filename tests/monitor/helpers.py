"""Shared by the monitor tests: where Prometheus/promtool are, a monitored debug run."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def find_tool(name: str) -> Path | None:
    """PROMETHEUS_BIN / PROMTOOL_BIN, then .prometheus/ (make prometheus), then PATH."""
    env = os.environ.get(f"{name.upper()}_BIN")
    for cand in (env, REPO / ".prometheus" / "usr" / "bin" / name, shutil.which(name)):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return Path(cand)
    return None


def missing_tool_reason(name: str) -> str:
    return (f"{name} binary not found (set {name.upper()}_BIN, or run `make prometheus` / .ci/fetch_prometheus.sh "
            "to unpack Debian's prometheus package into .prometheus/)")


def promtool_check(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(find_tool("promtool")), "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine other than 127.x (from the interfaces, no traffic sent)."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    for addr in out:
        try:
            socket.inet_aton(addr)
        except OSError:
            continue
        if not addr.startswith("127."):
            return addr
    return None


FULL_MONITOR = ["--monitor.activation_stats", "true", "--monitor.profile_every", "4", "--monitor.interval_steps", "3",
                "--training.threads", "1"]
