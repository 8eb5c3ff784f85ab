"""The parts of ``bench/cpu_decode_peer.py`` that turn the two engines' output into figures, on
canned output (no llama.cpp, no model): a misread here would put a wrong number in docs/benchmarks.md."""

import json
import struct
from pathlib import Path

import pytest

from bench.cpu_decode_peer import SESSION_MAGIC, agreed_prefix, ours_tok_s, paired, parse_llama_bench, \
    parse_stats, session_ids


def _bench_line(n_prompt: int, n_gen: int, avg_ts: float, threads: int = 2) -> str:
    return json.dumps({"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "n_threads": threads,
                       "type_k": "f16", "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": 0,
                       "avg_ns": 1e9 * (n_prompt + n_gen) / avg_ts, "avg_ts": avg_ts, "stddev_ts": 0.0})


def test_llama_bench_jsonl_gives_the_test_and_its_rate():
    pp = parse_llama_bench("main: loading\n" + _bench_line(512, 0, 684.1) + "\n")
    tg = parse_llama_bench(_bench_line(0, 128, 90.6, threads=1))
    assert (pp["test"], pp["tok_s"], pp["n_threads"]) == ("pp", 684.1, 2)
    assert (tg["test"], tg["tok_s"], tg["n_threads"]) == ("tg", 90.6, 1)
    assert pp["build"] == "0c1e570 (build 1)"


def test_llama_bench_output_with_both_tests_or_none_is_refused():
    with pytest.raises(ValueError, match="one llama-bench result"):
        parse_llama_bench(_bench_line(512, 0, 1.0) + "\n" + _bench_line(0, 128, 1.0))
    with pytest.raises(ValueError, match="one llama-bench result"):
        parse_llama_bench("error: failed to load model\n")
    with pytest.raises(ValueError, match="not a pp or a tg"):
        parse_llama_bench(_bench_line(512, 128, 1.0))


def test_our_rates_come_from_the_last_stats_line():
    stats = {"prompt_tokens": 512, "prefill_s": 0.8, "decode_steps": 128, "decode_s": 2.0, "kv_pool_bytes": 4096}
    stderr = "UserWarning: something\n{\"not\": \"this\"}\n" + json.dumps(stats) + "\n"
    parsed = parse_stats(stderr)
    assert ours_tok_s(parsed, "pp") == pytest.approx(640.0)
    assert ours_tok_s(parsed, "tg") == pytest.approx(64.0)
    with pytest.raises(ValueError, match="no --stats JSON"):
        parse_stats("Traceback (most recent call last):\n")


def test_session_file_ids(tmp_path):
    ids = [1, 8191, 0, 42]
    f = tmp_path / "s.bin"
    f.write_bytes(struct.pack("<III", SESSION_MAGIC, 10, len(ids)) + struct.pack("<4i", *ids) + b"\x07" * 64)
    assert session_ids(f) == ids
    f.write_bytes(struct.pack("<III", 0x46554747, 3, 0))  # a GGUF header, not a session
    with pytest.raises(ValueError, match="not a llama.cpp session"):
        session_ids(f)


def test_ratios_are_paired_per_round_and_agreement_stops_at_the_first_difference():
    # Round 2 is slow for both sides: its pair still says 0.6, the median of the paired ratios is
    # 0.6, where the ratio of the two medians (50 / 100) would say 0.5.
    s = paired(llama=[100.0, 50.0, 110.0], ours=[60.0, 30.0, 50.0])
    assert s["ratio"] == pytest.approx(0.6)
    assert (s["ratio_min"], s["ratio_max"]) == (pytest.approx(50 / 110), pytest.approx(0.6))
    assert (s["llama_cpp"], s["ours"]) == (100.0, 50.0)
    assert agreed_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert agreed_prefix([1, 2], [1, 2]) == 2


def test_the_memory_checks_large_model_is_the_90m_models_vocabulary_at_3x_the_weights():
    from bench.cpu_decode_peer import large_config
    from bench.inference import SIZES

    cfg, small = large_config(), SIZES["90m"]
    assert cfg.vocab_size == small.vocab_size and not cfg.tie_embeddings
    assert round(cfg.num_params() / 1e6, 1) == 287.4
    assert cfg.num_params() > 3 * small.num_params()


def test_the_avx2_setting_holds_aten_and_our_kernels_to_avx2():
    """``--isa avx2`` stands an AVX-512 machine in for an AVX2-only one: a process under its
    environment must dispatch ATen and our kernels to AVX2, and llama.cpp is built without AVX-512."""
    import os
    import subprocess
    import sys

    from bench._llama_cpp import ISA_FLAGS, LlamaCpp
    from bench.cpu_decode_peer import ISA_ENV
    from trainforge.infer.cpu_kernels.build import load_kernels

    if load_kernels() is None:
        pytest.skip("the C++ kernels did not build here (no compiler)")
    code = ("import torch; from trainforge.infer.cpu_kernels.build import load_kernels; "
            "print(torch.backends.cpu.get_cpu_capability(), load_kernels().isa())")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **ISA_ENV["avx2"]}, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["AVX2", "avx2"]
    assert "-DGGML_AVX512=OFF" in ISA_FLAGS["avx2"] and "-DGGML_NATIVE=OFF" in ISA_FLAGS["avx2"]
    assert LlamaCpp(Path("/x"), "avx2").bin != LlamaCpp(Path("/x")).bin


def test_avx512_build_has_no_amx_and_runs_our_avx512_path():
    """``--isa avx512``: llama.cpp with AVX-512 but without AMX (a guest that lists AMX may not
    run it), in its own build directory; ours on the AVX-512 kernels where the CPU has them."""
    from bench._llama_cpp import ISA_FLAGS, LlamaCpp
    from bench.cpu_decode_peer import ISA_ENV

    flags = ISA_FLAGS["avx512"]
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON"} <= set(flags)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert len({LlamaCpp(Path("/x"), isa).bin for isa in ("native", "avx2", "avx512")}) == 3
    assert ISA_ENV["avx512"]["TRAINFORGE_CPU_ISA"] == "avx512"
