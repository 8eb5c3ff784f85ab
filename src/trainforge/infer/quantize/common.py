"""What int8 and int4 linears share: the stored form, the kernel hand-off, and the choice
of kernel per device by measurement.

A ``QuantLinear`` holds its weights in the *stored form* (the tensors written to
safetensors by the offline transform, e.g. ``weight`` int8 + ``scales``) until ``pack``
turns them into the chosen kernel's form (fbgemm's packed matrix, the int4 tile layout,
a torchao tensor). Packing releases the stored tensors, so weights are held once;
a packed module is for inference only (its ``state_dict`` refuses). Layers concatenate
(``cat``, used by the fusion pass) only in the stored form.

``choose_kernel`` picks the kernel for a (mode, device): by default the first available
entry of ``PREFERENCE`` (the order measured on each device, numbers in ``int8.py`` /
``int4.py``); with ``measure=True`` it times every available kernel on a batch-1
4096 x 4096 layer, interleaved, and caches the winner in ``$TRAINFORGE_CACHE/infer_kernels.json``.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from trainforge.infer.cpu_kernels.formats import cat_rows
from trainforge.json_cache import read_json_cache, write_json_cache

# Kernel preference per (mode, device type), fastest first, from the measurements in the
# docstrings of int8.py and int4.py. "reference" (dequantise every call) always works.
PREFERENCE: dict[tuple[str, str], tuple[str, ...]] = {
    ("int8", "cpu"): ("fbgemm", "int8pack", "reference"),
    ("int8", "cuda"): ("torchao", "int8pack", "reference"),
    ("int4", "cpu"): ("blocks", "int4pack_cpu", "reference"),
    ("int4", "cuda"): ("torchao", "int4pack_cuda", "reference"),
    ("q8_0", "cpu"): ("blocks", "dequant", "reference"),
    ("q8_0", "cuda"): ("dequant", "reference"),
    ("q4_0", "cpu"): ("blocks", "dequant", "reference"),
    ("q4_0", "cuda"): ("dequant", "reference"),
}

Kernel = Callable[[torch.Tensor], torch.Tensor]  # (M, K) activations -> (M, N)


class QuantLinear(nn.Module):
    """Base of ``Int8Linear`` / ``Int4Linear``: y = x W^T for a quantised W, bias-free.

    Subclasses name their stored tensors in ``STORED`` (registered as buffers, so
    ``load_state_dict(assign=True)`` fills them) and implement ``build_kernel`` and ``dequantize``."""

    MODE = ""
    STORED: tuple[str, ...] = ()
    _KINDS: dict[str, type[QuantLinear]] = {}  # MODE -> subclass, filled as subclasses are defined

    def __init_subclass__(cls, **kwargs):
        # Kinds register themselves, so this file needs no import of int8.py / int4.py
        # (which import it): no import cycle. The package __init__ imports both kinds.
        super().__init_subclass__(**kwargs)
        if cls.MODE:
            QuantLinear._KINDS[cls.MODE] = cls

    def __init__(self, in_features: int, out_features: int, kernel: str = "auto"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.kernel = kernel
        self._impl: Kernel | None = None
        # A kernel with an out= form (the C++ block ops) sets (op, *its weight arguments): the
        # decode step then binds op(x, *args, out) with no Python frame between (``bind_into``).
        self._into: tuple | None = None
        self.kernel_name: str | None = None  # the kernel actually used, after pack()
        self.weight_bytes = 0  # set by pack()

    # -- stored form ------------------------------------------------------------------------

    def stored(self) -> dict[str, torch.Tensor]:
        if self._impl is not None and self.kernel_name != "reference":
            raise RuntimeError(f"{type(self).__name__} is packed for the {self.kernel_name} kernel; its stored "
                               "tensors were released (quantise the state dict offline to keep them)")
        return {name: getattr(self, name) for name in self.STORED}

    @classmethod
    def from_stored(cls, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                    **kw) -> "QuantLinear":
        mod = cls(in_features, out_features, **kw)
        for name in cls.STORED:
            setattr(mod, name, tensors[name])
        return mod

    @classmethod
    def probe_layer(cls, device: torch.device, **kw) -> "QuantLinear":
        """A 64 x 256 layer on ``device`` for ``kernel_works`` to build and run a kernel on."""
        return cls.quantize(torch.randn(64, 256, device=device), **kw)

    @classmethod
    def cat(cls, mods: list["QuantLinear"]) -> "QuantLinear":
        """One layer computing the concatenated outputs of ``mods`` (same input), stored form."""
        first = mods[0]
        parts = [m.stored() for m in mods]
        tensors = {name: cat_rows([p[name] for p in parts]) for name in cls.STORED}
        return cls.from_stored(tensors, first.in_features, sum(m.out_features for m in mods),
                               **first._init_kwargs())

    def _init_kwargs(self) -> dict:
        return {"kernel": self.kernel}

    def _kernel_kwargs(self) -> dict:
        """Arguments of ``quantize`` that shape the kernel (int4: the group size)."""
        return {}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.stored()  # raises when packed
        super()._save_to_state_dict(destination, prefix, keep_vars)

    # -- kernels ----------------------------------------------------------------------------

    def build_kernel(self, name: str) -> Kernel:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The float weight (N, K) this layer stands for (fp32)."""
        raise NotImplementedError

    def supports(self, name: str) -> str | None:
        """None if kernel ``name`` takes this layer's shape, else why not."""
        return None

    def pack(self, kernel: str | None = None) -> str:
        """Build the kernel form (``kernel`` overrides ``self.kernel``; "auto" = ``choose_kernel``'s
        measured preference, "measure" = measure here, cached) and release the stored tensors. Falls back to "reference" for a shape the kernel cannot
        take. Returns the kernel used."""
        if self._impl is not None:
            return self.kernel_name
        name = kernel or self.kernel
        device = next(iter(self.buffers())).device
        if name in ("auto", "measure"):
            name = choose_kernel(self.MODE, device, measure=name == "measure", **self._kernel_kwargs())
            if self.supports(name) is not None:  # the device's kernel does not take this layer: the next one that does
                cls, kw = type(self), self._kernel_kwargs()
                name = next((k for k in _candidates(self.MODE, device) if k == "reference" or (
                    self.supports(k) is None and kernel_works(cls, k, device, **kw))), "reference")
        if self.supports(name) is not None:
            name = "reference"
        # Bytes a forward pass reads: the codes and their scales (the kernel forms are the same size).
        self.weight_bytes = sum(t.nbytes for t in self.stored().values())
        self._impl = self.build_kernel(name)
        self.kernel_name = name
        if name != "reference":
            for buf in self.STORED:  # held once: the kernel form now owns the weights
                setattr(self, buf, torch.empty(0, device=device))
        return name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._impl is None:
            self.pack()
        shape = x.shape
        y = self._impl(x.reshape(-1, shape[-1]))
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x: (M, K) -> out (M, N). The kernels have no ``out=`` form, so this allocates
        their result once and copies it (the only allocation of a quantised decode step)."""
        if self._impl is None:
            self.pack()
        out.copy_(self._impl(x))

    def bind_into(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        """A no-argument call writing this layer of ``x`` into ``out`` (the decode step's form)."""
        if self._impl is None:
            self.pack()
        if self._into is not None and out.is_contiguous() and x.dtype == torch.float32:
            op, *args = self._into
            return functools.partial(op, x, *args, out)
        # The copying form of this base class, never a subclass's forward_into: a subclass may
        # define forward_into through bind_into (the block kinds), which would recurse here.
        return functools.partial(QuantLinear.forward_into, self, x, out)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dequantize().to(x.dtype).t()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernel={self.kernel_name or self.kernel}")


# -- kernel choice ----------------------------------------------------------------------------

def torchao_available() -> bool:
    import importlib

    try:
        importlib.import_module("torchao")
    except Exception:  # ImportError, or a torchao built against another torch
        return False
    return True


def _cache_file() -> Path:
    root = Path(os.environ.get("TRAINFORGE_CACHE", Path.home() / ".cache" / "trainforge"))
    return root / "infer_kernels.json"


def _device_key(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu-{os.cpu_count()}cores-{torch.get_num_threads()}threads"
    return f"{name}|torch-{torch.__version__}"


def _candidates(mode: str, device: torch.device) -> tuple[str, ...]:
    return PREFERENCE.get((mode, device.type), ("reference",))


def kernel_works(cls: type[QuantLinear], name: str, device: torch.device, **kw) -> bool:
    """Whether kernel ``name`` builds and runs here (on ``cls.probe_layer``'s small layer)."""
    try:
        mod = cls.probe_layer(device, kernel=name, **kw)
        mod.pack(name)
        mod(torch.ones(2, 256, device=device))
        return mod.kernel_name == name
    except Exception:
        return False


def choose_kernel(mode: str, device: torch.device | str, measure: bool = False, **kw) -> str:
    """The kernel for ``mode`` ("int8" / "int4") on ``device``: the first that works in the
    measured preference order, or with ``measure`` the fastest in a fresh measurement
    (cached per device and torch version)."""
    device = torch.device(device)
    cls = _mode_class(mode)
    if not measure:
        for name in _candidates(mode, device):
            if name == "reference" or kernel_works(cls, name, device, **kw):
                return name
        return "reference"
    key = f"{mode}|{_device_key(device)}"
    cache = read_json_cache(_cache_file())
    if key in cache:
        return cache[key]["kernel"]
    timings = measure_kernels(mode, device, **kw)
    best = min(timings, key=timings.get)
    cache[key] = {"kernel": best, "ms_per_call": timings}
    write_json_cache(_cache_file(), cache)
    return best


def measure_kernels(mode: str, device: torch.device | str, n: int = 4096, k: int = 4096, rounds: int = 5,
                    calls: int = 10, **kw) -> dict[str, float]:
    """Best ms per call of y = x W^T, x (1, k), W (n, k), for every kernel that works here,
    the candidates interleaved round by round so drift hits all alike. Includes plain fp32."""
    device = torch.device(device)
    cls = _mode_class(mode)
    w = torch.randn(n, k, device=device) * 0.02
    x = torch.randn(1, k, device=device)
    fns: dict[str, Callable] = {"fp32": lambda: x @ w.t()}
    for name in _candidates(mode, device):
        if name == "reference" or not kernel_works(cls, name, device, **kw):
            continue
        mod = cls.quantize(w, kernel=name, **kw)
        mod.pack(name)
        fns[name] = (lambda m: lambda: m(x))(mod)
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e3)
    return best


def _mode_class(mode: str) -> type[QuantLinear]:
    classes = QuantLinear._KINDS
    if mode not in classes:
        raise ValueError(f"quantization mode {mode!r}: use one of {sorted(classes)}")
    return classes[mode]


def torchao_linear(weight: torch.Tensor, config) -> nn.Module:
    """An ``nn.Linear`` holding ``weight`` quantised in place by ``torchao.quantization.quantize_``
    with ``config`` (re-quantising our dequantised weight reproduces our integers: the same
    absmax / min-max per row or group maps back to the same scale)."""
    from torchao.quantization import quantize_

    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
    quantize_(lin, config)
    return lin
