"""Destinations for the registry's values, beside the JSONL file (``jsonl.py``).

- ``PrometheusSink``: a prometheus_client HTTP endpoint that renders the registry at
  each scrape (a custom collector, so a scrape sees exactly what the registry holds),
  bound to ``monitor.prometheus_host`` (127.0.0.1 by default); one port per rank
  (``prometheus_port + LOCAL_RANK``); at close, an optional push to a Pushgateway.
- ``TensorBoardSink``: one scalar per changed sample per record, at the record's step;
  the run's config as hparams; validation loss beside training loss on one chart.

A sink implements ``emit(step, samples)``, ``flush()`` and ``close()``.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

from trainforge.errors import ConfigError
from trainforge.log import get_logger
from trainforge.monitor.registry import Labels, Registry, Sample


class RegistryCollector:
    """prometheus_client collector rendering a ``Registry``."""

    def __init__(self, registry: Registry):
        self.registry = registry

    def describe(self):
        return []  # no names up front: families appear as records bring them

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        for fam in self.registry.families():
            names = list(fam.label_names)
            if fam.kind == "histogram":
                out = HistogramMetricFamily(fam.name, fam.help, labels=names)
                for labels, h in fam.hists.items():
                    out.add_metric(_values(labels, names), h.cumulative(), h.sum)
            else:
                cls = CounterMetricFamily if fam.kind == "counter" else GaugeMetricFamily
                out = cls(fam.name, fam.help, labels=names)
                for labels, v in fam.values.items():
                    out.add_metric(_values(labels, names), v)
            yield out


def _values(labels: Labels, names: list[str]) -> list[str]:
    d = dict(labels)
    return [d.get(n, "") for n in names]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class PrometheusSink:
    def __init__(self, registry: Registry, host: str, port: int, pushgateway_url: str = "",
                 pushgateway_job: str = "trainforge"):
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry, self.host, self.port = registry, host, port
        self.pushgateway_url, self.pushgateway_job = pushgateway_url, pushgateway_job
        self.collector_registry = CollectorRegistry(auto_describe=False)
        self.collector_registry.register(RegistryCollector(registry))
        self.server = self.thread = None
        if port:
            if port > 65535:
                raise ConfigError(f"config key 'monitor.prometheus_port': this rank would serve port {port} "
                                  "(prometheus_port + LOCAL_RANK), above 65535; pick a lower port")
            try:
                self.server, self.thread = start_http_server(port, addr=host, registry=self.collector_registry)
            except OSError as e:
                raise ConfigError(f"config key 'monitor.prometheus_port' = {port}: cannot listen on {host}:{port} "
                                  f"({e.strerror or e}); pick a free port, or 0 to turn the endpoint off") from None
            get_logger().info(f"metrics endpoint: http://{host}:{port}/metrics")
            if not is_loopback(host):
                get_logger().warning(f"metrics endpoint listens on {host}:{port}: reachable from the network "
                                     "(monitor.prometheus_host = 127.0.0.1 keeps it local)")

    @property
    def address(self) -> tuple[str, int] | None:
        """The address the endpoint is bound to (host, port), or None when off."""
        return self.server.server_address[:2] if self.server is not None else None

    def emit(self, step: int, samples: list[Sample]) -> None:
        pass  # scrapes read the registry directly

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.pushgateway_url:
            from prometheus_client import push_to_gateway

            try:
                push_to_gateway(self.pushgateway_url, job=self.pushgateway_job, registry=self.collector_registry,
                                grouping_key={"rank": self.registry.rank}, timeout=10)
            except OSError as e:  # the job's results are safe in metrics.jsonl; do not fail the run
                get_logger().warning(f"push to Pushgateway {self.pushgateway_url} failed: {e}")
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(timeout=5)
            self.server = None


class TensorBoardSink:
    """Tags are ``level/name`` plus the labels other than rank, e.g.
    ``model/trainforge_gradient_group_norm/group=layers.0``.

    TensorBoard draws one chart per tag, one line per run. So the validation loss is
    written twice: under its own tag, and under the training loss's tag in the ``val``
    sub-run (``tensorboard/val``), which puts train and validation loss on one chart
    (the way Keras writes ``train`` and ``validation`` runs).

    ``hparams`` (the run's config, ``section.key``) go to the HParams dashboard when the
    writer opens, with the training and validation loss as its metrics: the dashboard
    shows their last values, so a crashed run still lists its config. Written into this
    writer's own run through ``torch.utils.tensorboard.summary.hparams`` rather than
    ``SummaryWriter.add_hparams``, which opens a new sub-run per call."""

    def __init__(self, log_dir: Path, hparams: dict | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams as hparams_summary
        except ImportError:
            raise ConfigError("config key 'monitor.tensorboard' = true needs the tensorboard package: "
                              "pip install 'trainforge[tensorboard]', or set it to false") from None
        from trainforge.monitor.catalog import lookup

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.val_writer = SummaryWriter(log_dir=str(Path(log_dir) / VAL_RUN))
        train_spec, val_spec = lookup("loss")[0], lookup("val_loss")[0]
        self.loss_tag = f"{train_spec.level}/{train_spec.name}"
        self.val_loss_name = val_spec.name
        self._session_end = None
        if hparams:
            metrics = {self.loss_tag: 0.0, f"{val_spec.level}/{val_spec.name}": 0.0}  # names only: values are the scalars
            exp, start, self._session_end = hparams_summary(_hparam_values(hparams), metrics)
            for summary in (exp, start):
                self.writer.file_writer.add_summary(summary)

    @staticmethod
    def tag(s: Sample) -> str:
        level = s.spec.level if s.spec is not None else "other"
        rest = ",".join(f"{k}={v}" for k, v in s.labels if k != "rank")
        return f"{level}/{s.name}" + (f"/{rest}" if rest else "")

    def emit(self, step: int, samples: list[Sample]) -> None:
        for s in samples:
            self.writer.add_scalar(self.tag(s), s.value, global_step=step)
            if s.name == self.val_loss_name:
                self.val_writer.add_scalar(self.loss_tag, s.value, global_step=step)

    def flush(self) -> None:
        self.writer.flush()
        self.val_writer.flush()

    def close(self) -> None:
        if self._session_end is not None:
            self.writer.file_writer.add_summary(self._session_end)  # status: finished
        self.writer.close()
        self.val_writer.close()


VAL_RUN = "val"


def _hparam_values(params: dict) -> dict:
    """The hparams plugin takes numbers, strings and booleans."""
    return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in params.items()}


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports nothing listens on right now (for tests
    and examples; a distributed run serves ``port + LOCAL_RANK``).

    Drawn below the kernel's ephemeral range: a port the kernel handed out from that
    range (bind to 0) can be handed again to torchrun's store or a gloo connection
    before the trainer binds it, which CI hit once ('Address already in use')."""
    import random

    lo, _ = _ephemeral_range()
    top = min(lo, 65536) - count
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, max(top, 20001))
        socks = []
        try:
            for p in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host} between 20000 and {top}")


def read_exposition(text: str, drop_labels: tuple[str, ...] = ("rank",)) -> dict[str, float]:
    """A Prometheus text exposition (what ``/metrics`` serves) as ``{'name{k="v",...}': value}``,
    labels sorted and ``drop_labels`` left out (a scraper that knows it reads rank 0 alone).
    Parsed by prometheus_client's own parser; used by the serving soak and its tests."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in drop_labels)
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out
