"""CPU memory traffic from the memory controllers' uncore counters, through perf_event_open.

Intel's integrated memory controllers appear in sysfs as perf PMUs
(``/sys/bus/event_source/devices/uncore_imc_N``) with named events: ``cas_count_read`` /
``cas_count_write`` (one count per 64-byte line, the ``.scale`` file converts to the
``.unit``, MiB) or, on newer parts, the free-running ``data_read`` / ``data_write``. Each
event's text (``event=0x04,umask=0x03``) is turned into the ``config`` bits its PMU's
``format/`` files name. The counters count the whole machine, so opening them needs
``perf_event_paranoid <= 0`` or ``CAP_PERFMON`` (root has it), and a host that passes the
PMU through: virtual machines usually do not, and AMD's data-fabric PMU names no DRAM events
in sysfs, so there the bandwidth is the monitor's estimate. Hand-written: the Python perf
bindings are not packaged on PyPI; the syscall and the sysfs parsing are a few lines.
"""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path
from typing import Callable

DEVICES = Path("/sys/bus/event_source/devices")
EVENTS = {"cas_count_read": "read", "cas_count_write": "write", "data_read": "read", "data_write": "write"}
UNIT_BYTES = {"MiB": 2 ** 20, "KiB": 2 ** 10, "B": 1, "Bytes": 1, "": 1}
_SYSCALL = {"x86_64": 298, "aarch64": 241}


def parse_config(event_text: str, formats: dict[str, str]) -> dict[str, int]:
    """``"event=0x04,umask=0x03"`` and ``{"event": "config:0-7", "umask": "config:8-15"}``
    -> ``{"config": 0x0304}``; a term without a value means 1; a format may name
    several ranges (``config:0-7,32-35``)."""
    out: dict[str, int] = {}
    for term in event_text.strip().split(","):
        name, _, value = term.partition("=")
        val = int(value, 0) if value else 1
        field, _, ranges = formats[name.strip()].strip().partition(":")
        shift = 0
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            lo_i, hi_i = int(lo), int(hi or lo)
            width = hi_i - lo_i + 1
            out[field] = out.get(field, 0) | (((val >> shift) & ((1 << width) - 1)) << lo_i)
            shift += width
    return out


class _Attr(ctypes.Structure):  # perf_event_attr up to config2 (PERF_ATTR_SIZE_VER1 = 72 bytes)
    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
                ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64), ("wakeup_events", ctypes.c_uint32),
                ("bp_type", ctypes.c_uint32), ("config1", ctypes.c_uint64), ("config2", ctypes.c_uint64)]


def perf_event_open(pmu_type: int, config: dict[str, int], pid: int, cpu: int) -> int:
    """A counting perf event's file descriptor (enabled now); OSError when refused."""
    nr = _SYSCALL.get(platform.machine())
    if nr is None:
        raise OSError(f"perf_event_open: no syscall number known for {platform.machine()}")
    attr = _Attr(type=pmu_type, size=ctypes.sizeof(_Attr), config=config.get("config", 0),
                 config1=config.get("config1", 0), config2=config.get("config2", 0))
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(nr, ctypes.byref(attr), pid, cpu, -1, 0)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"perf_event_open: {os.strerror(err)}")
    return fd


def read_count(fd: int) -> int:
    return int.from_bytes(os.read(fd, 8), "little")


class UncoreMeter:
    """Bytes read and written by the memory controllers since the meter was made, summed
    over every IMC PMU; ``read()`` returns {} when none could be opened. ``opener``:
    ``perf_event_open``'s stand-in in tests."""

    def __init__(self, devices: Path = DEVICES, opener: Callable[..., int] = perf_event_open,
                 reader: Callable[[int], int] = read_count):
        self.reader = reader
        self.events: list[tuple[int, str, float, int]] = []  # fd, read|write, bytes per count, first count
        try:
            pmus = sorted(p for p in devices.iterdir() if p.name.startswith("uncore_imc"))
        except OSError:
            pmus = []
        for pmu in pmus:
            try:
                pmu_type = int((pmu / "type").read_text())
                formats = {f.name: f.read_text() for f in (pmu / "format").iterdir()}
                cpu = int((pmu / "cpumask").read_text().split(",")[0].split("-")[0]) if (pmu / "cpumask").exists() else 0
            except (OSError, ValueError):
                continue
            for name, direction in EVENTS.items():
                path = pmu / "events" / name
                if not path.exists():
                    continue
                try:
                    scale = float(_read(pmu / "events" / f"{name}.scale") or 1.0)
                    unit = UNIT_BYTES.get(_read(pmu / "events" / f"{name}.unit"), 1)
                    fd = opener(pmu_type, parse_config(path.read_text(), formats), -1, cpu)
                except (OSError, ValueError, KeyError):
                    continue  # refused (paranoid, no capability) or not understood: this event is absent
                self.events.append((fd, direction, scale * unit, reader(fd)))

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for fd, direction, bytes_per_count, first in self.events:
            try:
                out[direction] = out.get(direction, 0.0) + (self.reader(fd) - first) * bytes_per_count
            except OSError:
                continue
        return out

    def close(self) -> None:
        for fd, *_ in self.events:
            try:
                os.close(fd)
            except OSError:
                pass
        self.events = []


def _read(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""
