"""Run multi-process ``torchrun`` jobs over a bandwidth-limited link (or a labelled simulation of one).

A gradient-compression benchmark needs communication to cost what it costs on a slow
network, not what it costs on a many-GB/s loopback. This harness gives it that:

    from bench.shaped_link import open_link, measure_throughput

    with open_link("100mbit") as link:             # ShapedLink, or SimulatedLink if no netns
        print(link.label)                          # "netns tbf 100mbit" / "simulated 100mbit ..."
        r = link.run([torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                      "--master-port", str(link.free_port()), "worker.py"],
                     env=link.torch_env(), timeout_s=300)

Real link (``ShapedLink``)
    A network namespace of the run's own making (``tf-bench-<pid>-<n>``). Its loopback is
    brought up and shaped with a token bucket: ``tc qdisc add dev lo root tbf rate R burst B
    limit L`` (``rate=None``: same kind of namespace, no qdisc, as the unshaped baseline).
    Every rank of the job runs inside it and talks over 127.0.0.1, so all gloo traffic
    crosses the shaped ``lo``. The namespace is deleted on exit, also on an exception or
    Ctrl-C inside the ``with`` block (and on SIGTERM while the block runs in the main thread);
    any process still inside it is killed first.

    What is modelled: ONE SHARED MEDIUM of rate R. Every packet any rank sends to any other
    rank, in either direction, is dequeued from the same ``lo`` token bucket, so the sum of
    all ranks' traffic is capped at R (a hub, not a switch with a full-duplex R per host).
    A ring all-reduce of ``nbytes`` on ``w`` ranks sends ``2 (w-1)/w * nbytes`` per rank, so
    on this link it takes about ``w * 2 (w-1)/w * nbytes * 8 / R = 2 (w-1) nbytes * 8 / R``
    seconds, ``w`` times the per-host-link figure ``2 (w-1)/w * nbytes * 8 / R``.

tbf parameters (see ``tbf_params``; measured on a 6.18 kernel, HZ=250, hrtimers, 2 vCPUs)
    burst = max(2 * 65,550 B, rate / HZ).
        The bucket must hold at least one whole packet: ``lo`` has MTU 65,536 and GSO skbs of
        up to 64 KiB + 14 B Ethernet header. Measured with burst = 32 KiB: every full-size
        segment is dropped (77 drops, 280 B sent) and TCP stalls for good, so ``tbf_params``
        refuses a burst below one packet. ``tc-tbf(8)`` asks for burst >= rate/HZ so that
        the rate is met when the qdisc watchdog fires late; with high-resolution timers
        (``/proc/net/psched`` clock = 1 GHz) it is precise, but tokens that overflow a small
        bucket during a late wake-up are lost: at 1gbit, burst = 1 packet gave 118 MB/s
        (0.95x), 2 packets 123 MB/s, rate/HZ = 500 kB 124-128 MB/s. At 100mbit rate/HZ
        (50 kB) is below one packet, so 2 packets (131 kB) it is: 12.5 MB/s (1.00x).
        A bigger bucket lets the first ``burst`` bytes after idle go at memory speed: the
        error for a transfer of S bytes is at most burst/S (1.6% for 8 MB at 100mbit, 6% for
        8 MB at 1gbit).
    limit = max(64 MiB, rate * 1 s) bytes of queue (tbf's ``latency``, expressed as bytes).
        tbf DROPS a packet that does not fit the queue. Over loopback one socket may keep up
        to ``net.ipv4.tcp_limit_output_bytes`` (4 MiB here) in the qdisc and gloo opens
        several sockets. Measured at 100mbit with limit = 50 ms of rate (756 kB): a 4 MB
        gloo all-reduce saw 220 drops; with 250 kB a single TCP stream saw 131. Timings were
        not visibly distorted in those runs (a qdisc drop of locally generated TCP is
        reported to the sender at once, which resends after a cwnd cut instead of waiting
        for a retransmit timeout), but that is luck of the local path, so the queue is made
        large enough that nothing is dropped (0 drops in every run with these settings).
        A large limit costs nothing: TCP's window, not the qdisc, bounds the standing queue.
        ``ShapedLink.qdisc_stats()["dropped"]`` lets a run check it saw none.

Fallback (``SimulatedLink``)
    When a namespace cannot be made (not root, no ``ip``/``tc``, no tbf, EPERM in a
    container), ``open_link`` says why on stderr and returns a ``SimulatedLink`` labelled
    "simulated". Its ``run`` runs the command on the host's own (unshaped) loopback, and
    the benchmark adds the link's cost by formula:

        simulated_step_s = measured_compute_s + n_collectives * latency_s + wire_bytes * 8 / rate_bps
        wire_bytes       = bytes_sent_per_rank * world_size   (medium="shared", as ShapedLink)
                         = bytes_sent_per_rank                (medium="per-rank": full-duplex NIC per host)

    where ``measured_compute_s`` is the step time measured with communication excluded, or
    with it running on the fast host loopback (that small cost then adds to the modelled
    wire time: a slight overestimate at 10-100 MB/s link rates), and ``bytes_sent_per_rank``
    is what one rank sends per step (e.g. ``ring_allreduce_bytes(nbytes, w)`` per all-reduce).
    Results must carry ``link.label`` so simulated figures are never mistaken for measured ones.

CLI: ``python -m bench.shaped_link [--rates 100mbit,1gbit,none] [--allreduce-mb 4]``
prints throughput and gloo all-reduce times for each rate.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

__all__ = [
    "NamespaceUnavailable", "ShapedLink", "SimulatedLink", "TbfParams", "kernel_hz", "measure_allreduce",
    "measure_throughput", "namespace_available", "open_link", "parse_rate", "remove_stale_namespaces",
    "ring_allreduce_bytes", "tbf_params", "wire_bytes",
]

NS_PREFIX = "tf-bench-"
LO_MAX_PACKET = 65536 + 14          # lo MTU / gso_max_size plus the Ethernet header tbf counts
LIMIT_FLOOR = 64 << 20              # bytes of tbf queue, at least
LIMIT_SECONDS = 1.0                 # ... or this many seconds of the rate, whichever is larger
PROBE_SCRIPT = Path(__file__).with_name("_link_probe.py")

_counter = itertools.count()
_available: tuple[bool, str] | None = None


class NamespaceUnavailable(RuntimeError):
    """A network namespace with a shaped loopback cannot be made here (the message says why)."""


# --------------------------------------------------------------------------------------- rates

_UNITS = {  # tc(8) units: SI multipliers; "bit" = bits/s, "bps" = BYTES/s
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}


def parse_rate(rate: str | int | float) -> int:
    """Bits per second from a tc-style rate ("100mbit", "1gbit", "12.5mbps") or a number (bits/s)."""
    if isinstance(rate, (int, float)):
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate!r}")
        return int(rate)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", rate)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot parse rate {rate!r}: use e.g. '100mbit', '1gbit', '500kbit', '12.5mbps'")
    bps = float(m.group(1)) * _UNITS[unit]
    if bps <= 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    return int(bps)


def _fmt_rate(bps: int) -> str:
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= mult and bps % mult == 0:
            return f"{bps // int(mult)}{unit}"
    return f"{bps}bit"


def kernel_hz(default: int = 100) -> int:
    """CONFIG_HZ of the running kernel (from /proc/config.gz or /boot/config-*), else ``default``."""
    for path in (Path("/proc/config.gz"), Path(f"/boot/config-{os.uname().release}")):
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        except OSError:
            continue
        m = re.search(rb"^CONFIG_HZ=(\d+)$", raw, re.M)
        if m:
            return int(m.group(1))
    return default


@dataclass(frozen=True)
class TbfParams:
    rate_bps: int
    burst_bytes: int
    limit_bytes: int

    def tc_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(self.burst_bytes), "limit", str(self.limit_bytes)]


def tbf_params(rate: str | int | float, *, burst: int | None = None, limit: int | None = None) -> TbfParams:
    """The tbf sizing this harness uses (module docstring explains the choice)."""
    bps = parse_rate(rate)
    rate_bytes = bps / 8
    if burst is None:
        burst = max(2 * LO_MAX_PACKET, int(rate_bytes / kernel_hz()))
    if burst < LO_MAX_PACKET:
        # Measured: with burst 32 KiB every 64 KiB loopback segment is dropped and TCP stalls for good.
        raise ValueError(f"tbf burst {burst} B is smaller than one loopback packet ({LO_MAX_PACKET} B): "
                         f"tbf would drop every full-size packet and TCP would stall")
    if limit is None:
        limit = max(LIMIT_FLOOR, int(rate_bytes * LIMIT_SECONDS))
    return TbfParams(bps, int(burst), int(limit))


# ------------------------------------------------------------------------- traffic accounting

def ring_allreduce_bytes(nbytes: int, world_size: int) -> float:
    """Bytes ONE rank sends in a ring all-reduce (reduce-scatter + all-gather) of ``nbytes``."""
    return 2 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def wire_bytes(bytes_sent_per_rank: float, world_size: int, medium: str = "shared") -> float:
    """Bytes that cross the bottleneck: all ranks' traffic on a shared medium (what ``ShapedLink``
    builds), one rank's on a per-host full-duplex link ("per-rank")."""
    if medium == "shared":
        return bytes_sent_per_rank * world_size
    if medium == "per-rank":
        return bytes_sent_per_rank
    raise ValueError(f"medium must be 'shared' or 'per-rank', got {medium!r}")


# --------------------------------------------------------------------------------- processes

def _run_group(argv: Sequence[str], env: Mapping[str, str] | None, timeout_s: float,
               cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(capture_output=True, text=True)``, but the command gets its own process
    group and the WHOLE group (torchrun and its workers) is ended on timeout or interrupt."""
    full_env = {**os.environ, **(env or {})}
    p = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=full_env, cwd=cwd, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except BaseException as exc:
        _kill_group(p)
        out, err = p.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise subprocess.TimeoutExpired(p.args, timeout_s, output=out, stderr=err) from None
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _kill_group(p: subprocess.Popen, grace_s: float = 5.0) -> None:
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _ip(*args: str, timeout_s: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s)


def _netns_names() -> set[str]:
    r = _ip("netns", "list")
    return {line.split()[0] for line in r.stdout.splitlines() if line.strip()} if r.returncode == 0 else set()


def _free_host_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- availability

def namespace_available(refresh: bool = False) -> tuple[bool, str]:
    """Whether ``ShapedLink`` can work here: (True, "") or (False, why not). Tries it for real
    (creates, shapes and deletes a probe namespace) once per process; ``refresh`` re-probes."""
    global _available
    if _available is not None and not refresh:
        return _available
    _available = _probe()
    return _available


def _probe() -> tuple[bool, str]:
    if sys.platform != "linux":
        return False, f"network namespaces need Linux (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) not found on PATH"
    euid = os.geteuid()
    name = f"{NS_PREFIX}{os.getpid()}-probe{next(_counter)}"
    try:
        r = _ip("netns", "add", name)
        if r.returncode != 0:
            hint = (f" (not root: euid={euid})" if euid != 0 else
                    " (root, but without CAP_SYS_ADMIN/CAP_NET_ADMIN: an unprivileged container?)")
            return False, f"`ip netns add` failed{hint}: {r.stderr.strip() or r.stdout.strip()}"
        steps = [["ip", "link", "set", "lo", "up"],
                 ["tc", "qdisc", "add", "dev", "lo", "root", *tbf_params("100mbit").tc_args()]]
        for step in steps:
            r = subprocess.run(["ip", "netns", "exec", name, *step], capture_output=True, text=True, timeout=20)
            if r.returncode != 0:
                return False, f"`{' '.join(step)}` in a namespace failed: {r.stderr.strip() or r.stdout.strip()}"
        return True, ""
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"namespace probe failed: {exc!r}"
    finally:
        _ip("netns", "delete", name)


def remove_stale_namespaces() -> list[str]:
    """Delete ``tf-bench-<pid>-*`` namespaces left behind by a process that no longer exists
    (e.g. one killed with SIGKILL, which no ``finally`` survives). Returns the names deleted."""
    gone = []
    for name in _netns_names():
        m = re.fullmatch(re.escape(NS_PREFIX) + r"(\d+)-\w+", name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue                                   # owner alive (or not ours to signal)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        if _ip("netns", "delete", name).returncode == 0:
            gone.append(name)
    return gone


# ---------------------------------------------------------------------------------- links

class ShapedLink:
    """A private network namespace whose loopback is shaped to ``rate`` (``None``: unshaped).

    ``with ShapedLink("100mbit") as link: link.run([...], env, timeout_s)`` runs commands inside
    it; the namespace exists only inside the ``with`` block. Raises ``NamespaceUnavailable``
    from ``__enter__`` when it cannot be built (use ``open_link`` to fall back instead).
    """

    simulated = False
    medium = "shared"

    def __init__(self, rate: str | int | float | None = "100mbit", *, burst: int | None = None,
                 limit: int | None = None, name: str | None = None):
        self.tbf = None if rate is None else tbf_params(rate, burst=burst, limit=limit)
        self.rate_bps = None if rate is None else self.tbf.rate_bps
        self.name = name or f"{NS_PREFIX}{os.getpid()}-{next(_counter)}"
        self.active = False
        self._old_sigterm = None

    @property
    def label(self) -> str:
        return f"netns tbf {_fmt_rate(self.rate_bps)}" if self.tbf else "netns unshaped"

    def __repr__(self) -> str:
        return f"ShapedLink({self.label!r}, name={self.name!r}, active={self.active})"

    # -- lifecycle
    def __enter__(self) -> "ShapedLink":
        if self.active:
            raise RuntimeError(f"{self!r} is already open")
        self._install_sigterm()
        try:
            self._create()
        except BaseException:
            self._destroy()
            self._restore_sigterm()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._destroy()
        finally:
            self._restore_sigterm()

    def _create(self) -> None:
        if shutil.which("ip") is None or (self.tbf and shutil.which("tc") is None):
            raise NamespaceUnavailable("`ip`/`tc` (iproute2) not found on PATH")
        r = _ip("netns", "add", self.name)
        if r.returncode != 0:
            raise NamespaceUnavailable(f"`ip netns add {self.name}` failed (euid={os.geteuid()}): "
                                       f"{r.stderr.strip()}")
        self.active = True
        self._check(["ip", "link", "set", "lo", "up"])
        if self.tbf:
            self._check(["tc", "qdisc", "add", "dev", "lo", "root", *self.tbf.tc_args()])

    def _check(self, cmd: list[str]) -> None:
        r = self._exec_raw(cmd, timeout_s=20)
        if r.returncode != 0:
            raise NamespaceUnavailable(f"`{' '.join(cmd)}` in {self.name} failed: {r.stderr.strip()}")

    def _destroy(self) -> None:
        if not self.active and self.name not in _netns_names():
            return
        # Whatever still runs in OUR namespace was started by this link: end it, by pid, so the
        # namespace really goes away (it lives on while a process holds it).
        r = _ip("netns", "pids", self.name)
        for pid in (int(p) for p in r.stdout.split() if p.isdigit()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        r = _ip("netns", "delete", self.name)
        self.active = False
        if r.returncode != 0 and self.name in _netns_names():
            raise RuntimeError(f"could not delete network namespace {self.name}: {r.stderr.strip()}")

    def _install_sigterm(self) -> None:
        # SIGTERM would skip every `finally`; while the link is open make it raise instead.
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def _raise(signum, frame):
                raise SystemExit(128 + signum)
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # -- use
    def _exec_raw(self, cmd: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.name, *cmd], capture_output=True, text=True,
                              timeout=timeout_s)

    def run(self, cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 600.0,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside the namespace (``ip netns exec NAME cmd``), output captured as text.
        ``env`` is layered over ``os.environ``. On timeout the command's whole process group is
        ended and ``subprocess.TimeoutExpired`` raised."""
        if not self.active:
            raise RuntimeError(f"{self!r} is not open: use it as a context manager")
        return _run_group(["ip", "netns", "exec", self.name, *cmd], env, timeout_s, cwd)

    def free_port(self) -> int:
        """A TCP port free on 127.0.0.1 inside the namespace (for --master-port)."""
        r = self.run([sys.executable, "-c", "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
                                            "print(s.getsockname()[1])"], timeout_s=30)
        if r.returncode != 0:
            raise RuntimeError(f"free_port failed in {self.name}: {r.stderr.strip()}")
        return int(r.stdout.strip())

    def torch_env(self, **extra: str) -> dict[str, str]:
        """Environment for torchrun/gloo inside the namespace: one thread per process, gloo on ``lo``."""
        return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo", **extra}

    def qdisc_stats(self) -> dict[str, int]:
        """Counters of the root qdisc on lo: sent_bytes, sent_packets, dropped, overlimits, requeues."""
        r = self._exec_raw(["tc", "-s", "qdisc", "show", "dev", "lo"], timeout_s=20)
        m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) requeues (\d+)\)", r.stdout)
        if not m:
            return {}
        keys = ("sent_bytes", "sent_packets", "dropped", "overlimits", "requeues")
        return dict(zip(keys, map(int, m.groups())))


class SimulatedLink:
    """The labelled stand-in used when no namespace can be made: commands run on the host's own
    (unshaped) loopback and the link cost is added by formula (``step_seconds``):

        simulated_step_s = compute_s + n_collectives * latency_s + wire_bytes * 8 / rate_bps
        wire_bytes = bytes_sent_per_rank * world_size   (medium "shared", like ShapedLink)
                   = bytes_sent_per_rank                (medium "per-rank")
    """

    simulated = True

    def __init__(self, rate: str | int | float | None = "100mbit", *, reason: str = "",
                 medium: str = "shared", latency_s: float = 0.0):
        wire_bytes(0, 1, medium)                       # validates medium
        self.rate_bps = None if rate is None else parse_rate(rate)
        self.reason = reason
        self.medium = medium
        self.latency_s = latency_s
        self.name = None
        self.active = False

    @property
    def label(self) -> str:
        if self.rate_bps is None:
            return "simulated unshaped (host loopback)"
        return f"simulated {_fmt_rate(self.rate_bps)} ({self.medium} medium)"

    def __repr__(self) -> str:
        return f"SimulatedLink({self.label!r}, reason={self.reason!r})"

    def __enter__(self) -> "SimulatedLink":
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False

    def transfer_seconds(self, bytes_sent_per_rank: float, world_size: int, n_collectives: int = 1) -> float:
        """Seconds the modelled link needs for this traffic (0 for an unshaped link)."""
        if self.rate_bps is None:
            return 0.0
        wire = wire_bytes(bytes_sent_per_rank, world_size, self.medium)
        return n_collectives * self.latency_s + wire * 8 / self.rate_bps

    def step_seconds(self, compute_s: float, bytes_sent_per_rank: float, world_size: int,
                     n_collectives: int = 1) -> float:
        """Simulated step time = measured compute time + modelled wire time."""
        return compute_s + self.transfer_seconds(bytes_sent_per_rank, world_size, n_collectives)

    def run(self, cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 600.0,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` on the HOST, unshaped: its timings exclude the link (add ``transfer_seconds``)."""
        return _run_group(list(cmd), env, timeout_s, cwd)

    def free_port(self) -> int:
        return _free_host_port()

    def torch_env(self, **extra: str) -> dict[str, str]:
        return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}

    def qdisc_stats(self) -> dict[str, int]:
        return {}


def open_link(rate: str | int | float | None = "100mbit", *, allow_simulated: bool = True,
              **shaped_kwargs) -> ShapedLink | SimulatedLink:
    """A ``ShapedLink`` if namespaces work here, else (saying why on stderr) a ``SimulatedLink``.
    Use the result as a context manager; check ``link.simulated`` / report ``link.label``."""
    ok, why = namespace_available()
    if ok:
        return ShapedLink(rate, **shaped_kwargs)
    if not allow_simulated:
        raise NamespaceUnavailable(why)
    print(f"[shaped_link] cannot build a shaped network namespace: {why}\n"
          f"[shaped_link] falling back to a SIMULATED link: results are measured compute time plus "
          f"wire_bytes*8/rate, and are labelled 'simulated'", file=sys.stderr)
    return SimulatedLink(rate, reason=why)


# ------------------------------------------------------------------------------ measurement

_TCP_PAIR = r"""
import json, socket, sys, threading, time
n, chunk = int(sys.argv[1]), 1 << 20
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
got = [0]
def receive():
    c, _ = srv.accept(); buf = memoryview(bytearray(chunk))
    while got[0] < n:
        k = c.recv_into(buf)
        if not k: break
        got[0] += k
    c.sendall(b"k"); c.close()
t = threading.Thread(target=receive); t.start()
s = socket.create_connection(srv.getsockname()); payload = memoryview(bytes(chunk))
t0 = time.perf_counter(); sent = 0
while sent < n:
    m = min(chunk, n - sent); s.sendall(payload[:m]); sent += m
s.recv(1); dt = time.perf_counter() - t0; t.join()
print(json.dumps({"bytes": got[0], "seconds": dt}))
"""


def measure_throughput(link: ShapedLink, nbytes: int = 8 << 20, timeout_s: float = 60.0) -> float:
    """Bytes/s one TCP stream achieves over 127.0.0.1 inside ``link`` (sender and receiver in one
    small Python process in the namespace; timed from the first byte sent to the receiver's ack
    of the last). Includes the tbf burst, an error of at most burst/nbytes."""
    if link.simulated:
        raise ValueError(f"{link.label}: a simulated link has no wire to measure "
                         f"(its rate is {link.rate_bps} bit/s by definition)")
    r = link.run([sys.executable, "-c", _TCP_PAIR, str(int(nbytes))], timeout_s=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"throughput probe failed in {link.name} (rc {r.returncode}): {r.stderr.strip()[-2000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if res["bytes"] != nbytes:
        raise RuntimeError(f"throughput probe received {res['bytes']} of {nbytes} bytes")
    return res["bytes"] / res["seconds"]


def measure_allreduce(link: ShapedLink | SimulatedLink, mbytes: float = 4.0, nproc: int = 2, iters: int = 5,
                      warmup: int = 1, timeout_s: float = 240.0) -> dict:
    """Time a gloo all-reduce of an fp32 tensor of ``mbytes`` MB on ``nproc`` torchrun ranks inside
    ``link``. Returns the probe's JSON (``seconds``: per-iteration times, ``median_s``) plus the
    link's expected time (``expected_s``: ring traffic over the link's medium; None if unshaped)."""
    port = link.free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), str(PROBE_SCRIPT),
           "--mbytes", str(mbytes), "--iters", str(iters), "--warmup", str(warmup)]
    before = link.qdisc_stats()
    r = link.run(cmd, env=link.torch_env(), timeout_s=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"all-reduce probe failed under {link.label} (rc {r.returncode}):\n"
                           f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1])
    after = link.qdisc_stats()
    res["qdisc_dropped"] = after.get("dropped", 0) - before.get("dropped", 0) if after else None
    nbytes = res["nbytes"]
    res["expected_s"] = (None if link.rate_bps is None else
                         wire_bytes(ring_allreduce_bytes(nbytes, nproc), nproc, link.medium) * 8 / link.rate_bps)
    res["label"] = link.label
    return res


def _main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="100mbit,1gbit,none", help="comma list; 'none' = unshaped namespace")
    ap.add_argument("--nbytes", type=int, default=16 << 20, help="bytes for the TCP throughput probe")
    ap.add_argument("--allreduce-mb", type=float, default=4.0, help="fp32 tensor size in MB (0: skip)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    ok, why = namespace_available()
    print(f"namespace available: {ok} {why}".rstrip())
    for rate in args.rates.split(","):
        rate = None if rate.strip().lower() == "none" else rate.strip()
        with open_link(rate) as link:
            if not link.simulated and link.tbf:
                print(f"[{link.label}] tbf: {' '.join(link.tbf.tc_args())}")
            if not link.simulated:
                tp = measure_throughput(link, args.nbytes)
                print(f"[{link.label}] TCP throughput: {tp / 1e6:.2f} MB/s"
                      + (f" ({tp * 8 / link.rate_bps:.2f} x rate)" if link.rate_bps else "")
                      + f"  qdisc {link.qdisc_stats()}")
            if args.allreduce_mb > 0:
                res = measure_allreduce(link, args.allreduce_mb, args.nproc, args.iters)
                exp = res["expected_s"]
                per_host = (None if link.rate_bps is None else
                            ring_allreduce_bytes(res["nbytes"], args.nproc) * 8 / link.rate_bps)
                print(f"[{link.label}] all-reduce {res['nbytes'] / 1e6:.2f} MB x{args.nproc}: median "
                      f"{res['median_s'] * 1e3:.1f} ms, all {[round(s * 1e3, 1) for s in res['seconds']]} ms"
                      + (f"; shared-medium model {exp * 1e3:.1f} ms, per-host-link model {per_host * 1e3:.1f} ms"
                         if exp else "") + f"; qdisc drops {res['qdisc_dropped']}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
