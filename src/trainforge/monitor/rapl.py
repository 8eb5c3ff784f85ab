"""CPU and DRAM energy from the kernel's RAPL counters (``/sys/class/powercap``).

Linux exposes Intel's and AMD's Running Average Power Limit energy counters through the
powercap framework, both under the ``intel-rapl`` driver's names (``intel-rapl:0`` =
``package-0``, ``intel-rapl:0:0`` = ``core``, ``dram``, ``uncore``, ``psys``; AMD Zen
exposes ``package`` and ``core``, no ``dram``). Each zone has ``energy_uj``, a counter in
microjoules that wraps at ``max_energy_range_uj``. Hand-written: no kept library reads
powercap without also wanting to set power limits (psutil does not read it), and the
reading is a few files.

A zone is used only when its ``energy_uj`` can be read now: since Linux 5.10 the file is
root-only (CVE-2020-8694), and virtual machines usually expose no powercap at all. A
domain without a readable zone is absent from the readings, never zero. ``*-mmio`` zones
are left out: on Intel client parts they repeat the package counter through MMIO.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

POWERCAP = Path("/sys/class/powercap")


@dataclass(frozen=True)
class RaplZone:
    path: Path  # .../intel-rapl:0
    domain: str  # package, dram, core, uncore, psys
    max_range_uj: int  # the counter wraps from this back to 0

    def read_uj(self) -> int:
        return int((self.path / "energy_uj").read_text())


def _domain(name: str) -> str:
    """``package-0`` -> ``package`` (sockets add up); other zone names as they are."""
    return re.sub(r"-\d+$", "", name.strip())


def find_zones(root: Path = POWERCAP) -> list[RaplZone]:
    """Every readable RAPL zone under ``root``, sorted by path; [] when there is none."""
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    zones = []
    for entry in entries:
        if ":" not in entry.name or "mmio" in entry.name:  # "intel-rapl" itself is the control type
            continue
        try:
            zone = RaplZone(entry, _domain((entry / "name").read_text()),
                            int((entry / "max_energy_range_uj").read_text()))
            zone.read_uj()  # PermissionError for a non-root reader on Linux >= 5.10
        except (OSError, ValueError):
            continue
        if zone.max_range_uj > 0:
            zones.append(zone)
    return zones


def wrapped_delta(before: int, after: int, max_range: int) -> int:
    """Increase of a counter that counts up to ``max_range`` and restarts at 0 (at most
    one wrap between the two reads: a logging window far shorter than the ~hour a 262 kJ
    range lasts at a few hundred watts)."""
    return after - before if after >= before else max_range - before + after


class RaplMeter:
    """Joules per domain since this meter was made, summed over its zones (sockets),
    wrap-arounds included. ``read()`` returns {} when no zone is readable."""

    def __init__(self, root: Path = POWERCAP):
        self.zones = find_zones(root)
        self._last: dict[Path, int] = {}
        self._total_uj: dict[Path, int] = {}
        for z in self.zones:
            self._last[z.path], self._total_uj[z.path] = z.read_uj(), 0

    @property
    def domains(self) -> list[str]:
        return sorted({z.domain for z in self.zones})

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for z in self.zones:
            try:
                now = z.read_uj()
            except (OSError, ValueError):  # the zone went away: its domain is absent from now on
                continue
            self._total_uj[z.path] += wrapped_delta(self._last[z.path], now, z.max_range_uj)
            self._last[z.path] = now
            out[z.domain] = out.get(z.domain, 0.0) + self._total_uj[z.path] / 1e6
        return out
