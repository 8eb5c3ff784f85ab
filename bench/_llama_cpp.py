"""Locate and build the llama.cpp peer for the CPU decode comparison (issue 24).

llama.cpp comes from the ``llama-cpp-python`` source distribution, which vendors it
under ``vendor/llama.cpp``, so one PyPI version string pins the peer's version. Only
the CLI tools the comparison needs get built, once, into
``$XDG_CACHE_HOME/trainforge/llama.cpp/<version>/`` (default ``~/.cache``). The build
is the one slow step: about 3 min with ``-j2`` on a quiet 2-core EPYC, up to 10 min
on a busier machine. So it runs only when asked; otherwise callers print
``build_hint()``.

    python -m bench._llama_cpp            # is it built? where?
    python -m bench._llama_cpp --build [--sdist PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# llama-bench: pp/tg tok/s. llama-quantize: f32 GGUF -> q8_0/q4_0. llama-completion: greedy
# text to compare tokens. llama-tokenize: token ids for the same text.
TOOLS = ("llama-bench", "llama-quantize", "llama-completion", "llama-tokenize")
# "native": GGML_NATIVE, this CPU's best SIMD, as our kernels choose theirs. "avx2": the code an
# AVX2-only CPU (Zen 3, Haswell to Comet Lake) runs, built on any x86 machine, so an AVX-512 machine
# can run both engines as an AVX2 machine would (bench/cpu_decode_peer.py --isa avx2). No AVX-VNNI:
# Zen 3 lacks it, and our AVX2 path does not use it either. "avx512": AVX-512 with VNNI and BF16
# but no AMX, as on Zen 4 or an Intel guest whose AMX the hypervisor leaves off: on a 2-vCPU
# Emerald Rapids KVM guest that lists amx_tile, the native build's first tileloadd (q8_0 prompt
# processing) died of SIGILL although arch_prctl(ARCH_REQ_XCOMP_PERM) succeeded.
BUILD_DIRS = {"native": "build", "avx2": "build-avx2", "avx512": "build-avx512"}


def _fixed_isa(avx512: bool) -> list[str]:
    """A build for a named instruction set rather than this CPU's: AVX2 / FMA / F16C / BMI2 always,
    the AVX-512 family (and AVX-VNNI) only with ``avx512``, AMX never."""
    on = "ON" if avx512 else "OFF"
    return (["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON"]
            + [f"-DGGML_{f}={on}" for f in ("AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16")]
            + [f"-DGGML_{f}=OFF" for f in ("AMX_TILE", "AMX_INT8", "AMX_BF16")])


ISA_FLAGS = {"native": ["-DGGML_NATIVE=ON"], "avx2": _fixed_isa(avx512=False), "avx512": _fixed_isa(avx512=True)}


@dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp build: ``src`` is the vendored tree (it holds convert_hf_to_gguf.py and
    gguf-py), ``bin`` holds the tools."""

    root: Path
    isa: str = "native"

    @property
    def src(self) -> Path:
        return self.root / "src" / "vendor" / "llama.cpp"

    @property
    def bin(self) -> Path:
        return self.root / BUILD_DIRS[self.isa] / "bin"

    def tool(self, name: str) -> Path:
        return self.bin / name

    def is_built(self) -> bool:
        return all(self.tool(t).is_file() for t in TOOLS) and (self.src / "convert_hf_to_gguf.py").is_file()


def cache_root(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "trainforge" / "llama.cpp" / version


def build_hint(version: str = LLAMA_CPP_PYTHON_VERSION, isa: str = "native") -> str:
    return (f"llama.cpp ({isa}) is not built in {cache_root(version) / BUILD_DIRS[isa]}. Build it once (3-10 min on "
            f"2 cores) with\n  flock /tmp/cpu.lock python -m bench._llama_cpp --build --isa {isa} "
            f"[--sdist llama_cpp_python-{version}.tar.gz]\n"
            f"(without --sdist, pip downloads the llama-cpp-python=={version} source distribution).")


def _sdist(version: str, sdist: Path | None, workdir: Path) -> Path:
    if sdist is not None:
        if not sdist.is_file():
            raise ValueError(f"--sdist {sdist} does not exist; pass the llama_cpp_python-{version}.tar.gz path")
        return sdist
    # --no-binary stops pip picking a wheel, which would not contain the llama.cpp sources.
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
                    "--no-binary", ":all:", "-d", str(workdir)], check=True)
    (found,) = workdir.glob("llama_cpp_python-*.tar.gz")
    return found


def build(version: str = LLAMA_CPP_PYTHON_VERSION, sdist: Path | None = None, jobs: int = 2,
          isa: str = "native") -> LlamaCpp:
    """Extract the sdist (once) and build ``TOOLS``: Release, static, without network libraries,
    with ``ISA_FLAGS[isa]`` (native: this CPU's SIMD, just as our kernels choose)."""
    root = cache_root(version)
    peer = LlamaCpp(root, isa)
    root.mkdir(parents=True, exist_ok=True)
    if not (peer.src / "CMakeLists.txt").is_file():
        tmp = root / "download"
        tmp.mkdir(exist_ok=True)
        with tarfile.open(_sdist(version, sdist, tmp)) as tar:
            top = tar.getnames()[0].split("/")[0]
            tar.extractall(root, filter="data")
        shutil.rmtree(root / "src", ignore_errors=True)
        (root / top).rename(root / "src")
        shutil.rmtree(tmp, ignore_errors=True)
    build_dir = peer.bin.parent
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(peer.src), "-B", str(build_dir), *gen,
                    "-DCMAKE_BUILD_TYPE=Release", *ISA_FLAGS[isa], "-DBUILD_SHARED_LIBS=OFF",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TOOLS], check=True)
    if not peer.is_built():
        raise RuntimeError(f"the llama.cpp build in {build_dir} finished without all of {TOOLS}")
    return peer


# Run by ``convert_hf`` in a fresh interpreter. Two workarounds, both for a locally trained
# tokenizer: the converter picks a pre-tokenizer by hashing known published vocabularies, so
# ours (plain byte-level BPE, which is GPT-2's regex) is named "gpt-2" outright; and it imports
# sentencepiece before it checks for tokenizer.model, so without one that step is skipped the way
# the converter skips it when the file is missing (FileNotFoundError) and sentencepiece is installed.
_CONVERT = r"""
import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
sentencepiece = base.TextModel._set_vocab_sentencepiece
def no_spm(self, *a, **k):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return sentencepiece(self, *a, **k)
base.TextModel._set_vocab_sentencepiece = no_spm
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_hf(peer: LlamaCpp, hf_dir: Path, out: Path) -> Path:
    """An f32 GGUF of a ``trainforge export`` directory, by llama.cpp's own converter."""
    proc = subprocess.run([sys.executable, "-c", _CONVERT, str(peer.src), str(hf_dir), "--outtype", "f32",
                           "--outfile", str(out)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{proc.stderr[-3000:]}")
    return out


def quantize_gguf(peer: LlamaCpp, f32: Path, out: Path, kind: str) -> Path:
    """``kind`` (q8_0, q4_0) for every linear weight, output and embedding included
    (``--pure``: llama-quantize otherwise keeps the output in Q6_K / Q8_0)."""
    proc = subprocess.run([str(peer.tool("llama-quantize")), "--pure", str(f32), str(out), kind.upper(), "1"],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"llama-quantize {kind} failed on {f32}:\n{proc.stderr[-3000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench._llama_cpp", description="Check for or build the llama.cpp peer.")
    p.add_argument("--build", action="store_true", help="build it if absent (takes minutes; run under flock /tmp/cpu.lock)")
    p.add_argument("--sdist", type=Path, default=None, help="a llama_cpp_python sdist already downloaded")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    p.add_argument("--isa", choices=sorted(BUILD_DIRS), default="native",
                   help="native: this CPU's SIMD; avx2: what an AVX2-only CPU runs; avx512: AVX-512 without AMX")
    a = p.parse_args(argv)
    peer = LlamaCpp(cache_root(), a.isa)
    if not peer.is_built():
        if not a.build:
            print(build_hint(isa=a.isa), file=sys.stderr)
            return 1
        peer = build(sdist=a.sdist, jobs=a.jobs, isa=a.isa)
    print(f"llama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}, {a.isa}) built: {peer.bin}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
