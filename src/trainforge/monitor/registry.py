"""The registry: current value of every metric, fed only by metrics records.

A record (the dict the trainer writes at each logging interval, per validation, per
checkpoint) goes through ``Registry.ingest``; every sink then reads the registry, so
Prometheus, TensorBoard and the JSONL file cannot disagree. Types, names and update
rules come from ``catalog.py``. Thread-safe: the Prometheus exporter reads it from its
own thread while the training loop writes.

Hand-written rather than prometheus_client's own metric objects because those cannot
*set* a counter (records carry running totals such as ``tokens``) and hold no per-key
documentation; exposition still goes through prometheus_client (``sinks.py``).
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple

from trainforge.monitor.catalog import DTYPE_BYTES, IGNORED_KEYS, UNKNOWN_NAME, MetricSpec, lookup

Labels = tuple[tuple[str, str], ...]


class Sample(NamedTuple):
    """One value an ingest changed: for gauges and counters the value now held, for
    histograms the observation just added."""
    name: str
    labels: Labels
    value: float
    spec: MetricSpec | None  # None: an undocumented record key


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int]  # per bucket, not cumulative; the last is +Inf
    sum: float = 0.0
    count: int = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            total += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), total))
        return out


@dataclass
class Family:
    name: str
    kind: str
    help: str
    label_names: tuple[str, ...]
    spec: MetricSpec | None
    values: dict[Labels, float] = field(default_factory=dict)
    hists: dict[Labels, Histogram] = field(default_factory=dict)


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


class Registry:
    def __init__(self, rank: int = 0):
        self.rank = str(rank)
        self._lock = threading.Lock()
        self._families: dict[str, Family] = {}
        self._window_of: dict[tuple[str, Labels], int] = {}

    # -- writing -----------------------------------------------------------------------

    def ingest(self, record: dict[str, Any], window: int | None = None) -> list[Sample]:
        """Update every metric the record's keys map to. ``window`` identifies the
        logging window the record belongs to (``window`` counters add once per window).
        Returns the samples changed, in record order."""
        changed: list[Sample] = []
        with self._lock:
            for key, value in record.items():
                if key in IGNORED_KEYS or value is None or isinstance(value, str):
                    continue
                spec, captured = lookup(key)
                if spec is None:
                    changed += self._unknown(key, value)
                    continue
                for labels, v in self._items(spec, captured, value):
                    changed += self._update(spec, labels, v, window)
        return changed

    def _items(self, spec: MetricSpec, captured: dict[str, str], value: Any) -> Iterator[tuple[Labels, float]]:
        base = [("rank", self.rank), *spec.const_labels, *((n, captured[n]) for n in spec.labels if n in captured)]
        free = [n for n in spec.labels if n not in captured]
        if spec.encode == "dtype_bytes":
            for group, dtype in (value.items() if isinstance(value, dict) else ()):
                width = DTYPE_BYTES.get(str(dtype).lower())
                if width is not None:
                    yield (*base, (free[0], str(group)), ("dtype", str(dtype))), float(width)
            return
        num, k = _number(value), spec.scale
        if num is not None and not free:
            yield tuple(base), num * k
        elif isinstance(value, dict) and free:
            for key, v in value.items():
                if (n := _number(v)) is not None:
                    yield (*base, (free[0], str(key))), n * k
        elif isinstance(value, (list, tuple)) and free:
            for i, v in enumerate(value):
                if (n := _number(v)) is not None:
                    yield (*base, (free[0], str(i))), n * k
                elif isinstance(v, (list, tuple)) and len(free) > 1:  # a table: two labels
                    for j, w in enumerate(v):
                        if (n := _number(w)) is not None:
                            yield (*base, (free[0], str(i)), (free[1], str(j))), n * k

    def _family(self, spec: MetricSpec | None) -> Family:
        name = spec.name if spec is not None else UNKNOWN_NAME
        fam = self._families.get(name)
        if fam is None:
            if spec is None:
                fam = Family(name, "gauge", "numeric metrics-record key without a catalog entry (see catalog.py)",
                             ("rank", "key"), None)
            else:
                fam = Family(name, spec.kind, spec.help, spec.label_names, spec)
            self._families[name] = fam
        return fam

    def _update(self, spec: MetricSpec, labels: Labels, v: float, window: int | None) -> list[Sample]:
        fam = self._family(spec)
        how = spec.how_updated
        if how == "observe":
            if not math.isfinite(v):
                return []
            fam.hists.setdefault(labels, Histogram(spec.buckets, [0] * (len(spec.buckets) + 1))).observe(v)
            return [Sample(spec.name, labels, v, spec)]
        if how == "window":
            if window is not None:
                if self._window_of.get((spec.name, labels)) == window:
                    return []
                self._window_of[(spec.name, labels)] = window
            v = fam.values.get(labels, 0.0) + v
        # "set" and "cumulative" both hold the record's value; a smaller cumulative value
        # is a counter reset (resume from an earlier checkpoint), which rate() handles.
        fam.values[labels] = v
        return [Sample(spec.name, labels, v, spec)]

    def _unknown(self, key: str, value: Any) -> list[Sample]:
        if isinstance(value, dict):
            flat = [(f"{key}.{k}", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            flat = [(f"{key}.{i}", v) for i, v in enumerate(value)]
        else:
            flat = [(key, value)]
        fam = self._family(None)
        out = []
        for k, v in flat:
            n = _number(v)
            if n is None:
                continue
            labels = (("rank", self.rank), ("key", k))
            fam.values[labels] = n
            out.append(Sample(fam.name, labels, n, None))
        return out

    # -- reading -----------------------------------------------------------------------

    def families(self) -> list[Family]:
        """A consistent copy of every family (for exposition)."""
        with self._lock:
            return [Family(f.name, f.kind, f.help, f.label_names, f.spec, dict(f.values),
                           {k: Histogram(h.bounds, list(h.counts), h.sum, h.count) for k, h in f.hists.items()})
                    for f in self._families.values()]

    def value(self, name: str, **labels: str) -> float | None:
        """The value of one gauge/counter sample (histograms: use ``histogram``)."""
        with self._lock:
            fam = self._families.get(name)
            if fam is None:
                return None
            want = {"rank": self.rank, **labels}
            for key, v in fam.values.items():
                if dict(key) == want:
                    return v
        return None

    def histogram(self, name: str, **labels: str) -> Histogram | None:
        with self._lock:
            fam = self._families.get(name)
            want = {"rank": self.rank, **labels}
            for key, h in (fam.hists.items() if fam else ()):
                if dict(key) == want:
                    return Histogram(h.bounds, list(h.counts), h.sum, h.count)
        return None
