"""GGUF files (llama.cpp) through ``load_model``: tiny files written with gguf-py's own writer and
quantiser from a random trainforge model, laid out as llama.cpp's converter lays out an HF Llama."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from trainforge.errors import CheckpointError  # noqa: E402
from trainforge.infer.generate import SamplingParams, generate  # noqa: E402
from trainforge.infer.loading import load_model  # noqa: E402
from trainforge.model import ModelConfig, build_model  # noqa: E402
from trainforge.model.hf import to_hf_state_dict  # noqa: E402

from .helpers import argmax_loop, sharpen  # noqa: E402

Q = gguf.GGMLQuantizationType
CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_hidden_dim=128, max_seq_len=64,
                  norm_eps=1e-6, rope_theta=50000.0)


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model, linear_type=Q.F32, embd_type=Q.F32, overrides=None, arch="llama", truncate=0,
               tokenizer=None, tokenizer_model="gpt2"):
    """The converter's tensor names and q/k permutation over the HF export of ``model``."""
    cfg = model.cfg
    hf = {k: v.detach().float().numpy() for k, v in to_hf_state_dict(model.state_dict(), cfg).items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_hidden_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(3)
    if tokenizer is not None:  # as the converter writes a byte-level BPE: tokens by id, merges, types
        import json

        bpe = json.loads(tokenizer.to_str())["model"]
        vocab = sorted(bpe["vocab"].items(), key=lambda kv: kv[1])
        w.add_tokenizer_model(tokenizer_model)
        w.add_token_list([t for t, _ in vocab])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
        w.add_token_types([3 if t.startswith("<|") else 1 for t, _ in vocab])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    hf_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.down_proj": "ffn_down",
                "mlp.up_proj": "ffn_up", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg.n_layers):
        names.update({f"model.layers.{i}.{h}.weight": f"blk.{i}.{g}.weight" for h, g in hf_layer.items()})
    if cfg.tie_embeddings:
        del hf["lm_head.weight"]
    for key, a in hf.items():
        name = names[key]
        if name.endswith(("attn_q.weight",)):
            a = llama_cpp_permute(a, cfg.n_heads, cfg.n_heads)
        elif name.endswith("attn_k.weight"):
            a = llama_cpp_permute(a, cfg.n_heads, cfg.n_kv_heads)
        qtype = Q.F32 if a.ndim == 1 else embd_type if name == "token_embd.weight" else linear_type
        qtype = (overrides or {}).get(name, qtype)
        if qtype == Q.Q6_K:  # gguf-py has no Q6_K encoder: random codes, finite scales (256-value blocks of 210 B)
            b = np.random.default_rng(0).integers(0, 256, (a.shape[0], a.shape[1] // 256, 210), dtype=np.uint8)
            b[..., 208:] = np.array([0.01], dtype=np.float16).view(np.uint8)
            b[..., 192:208] = np.random.default_rng(1).integers(-8, 8, (16,), dtype=np.int8).view(np.uint8)
            w.add_tensor(name, b.reshape(a.shape[0], -1), raw_dtype=qtype)
        elif qtype == Q.F32:
            w.add_tensor(name, a.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[:-truncate])
    return path


@pytest.fixture(scope="module")
def model():
    return sharpen(build_model(CFG, seed=3), 3).eval()


def test_f32_gguf_matches_the_model_and_greedy_tokens(tmp_path, model):
    loaded = load_model(write_gguf(tmp_path / "m.gguf", model))
    assert loaded.source == "gguf" and loaded.quantization is None and loaded.eos_ids == (3,)
    assert loaded.model.cfg == CFG  # every llama.* key mapped back
    x = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), model(x), atol=1e-5, rtol=1e-5)
    prompt = [5, 17, 42, 8]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    ours = generate(loaded.model, prompt, params).output_ids
    assert ours == generate(model, prompt, params).output_ids == argmax_loop(model, prompt, 12)


def test_tied_embeddings_when_no_output_tensor(tmp_path):
    import dataclasses

    m = sharpen(build_model(dataclasses.replace(CFG, tie_embeddings=True), seed=4), 4).eval()
    loaded = load_model(write_gguf(tmp_path / "t.gguf", m))
    assert loaded.model.cfg.tie_embeddings and loaded.model.output.weight is loaded.model.tok_embeddings.weight
    x = torch.randint(0, CFG.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), m(x), atol=1e-5, rtol=1e-5)


def _gguf_dequantised(path, name):
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == name)
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), -1).copy())


@pytest.mark.parametrize("qtype,mode", [(Q.Q8_0, "q8_0"), (Q.Q4_0, "q4_0")])
def test_block_types_load_byte_for_byte(tmp_path, model, qtype, mode):
    from trainforge.loading.gguf import _unpermute

    path = write_gguf(tmp_path / f"{mode}.gguf", model, linear_type=qtype, embd_type=qtype)
    loaded = load_model(path)
    info = loaded.quantization
    assert info["mode"] == mode and info["skipped"] == {} and info["experts"] == []
    assert set(info["layers"]) == {f"layers.{i}.{p}" for i in range(2) for p in (
        "attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
        "feed_forward.w3")} | {"output"}
    m = loaded.model
    for ours, theirs, heads in (("layers.1.attention.wv", "blk.1.attn_v.weight", None),
                                ("layers.0.attention.wq", "blk.0.attn_q.weight", CFG.n_heads),
                                ("layers.1.attention.wk", "blk.1.attn_k.weight", CFG.n_kv_heads),
                                ("output", "output.weight", None)):
        ref = _gguf_dequantised(path, theirs)
        ref = torch.from_numpy(_unpermute(ref.numpy(), heads)) if heads else ref
        torch.testing.assert_close(m.get_submodule(ours).dequantize(), ref, atol=0, rtol=0)
    # The embedding keeps the file's blocks (BlockEmbedding): its rows are gguf-py's decoding of them.
    assert info["embedding"] == mode and m.tok_embeddings.weight.dtype != torch.float32
    torch.testing.assert_close(m.tok_embeddings.dequantize(), _gguf_dequantised(path, "token_embd.weight"),
                               atol=0, rtol=0)
    # And it still computes the model, within the format's error (logits of the sharpened model are O(100));
    # seeded: q4_0's error on some unseeded draws came over 0.3.
    x = torch.randint(0, CFG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = model(x), m(x)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < (0.05 if mode == "q8_0" else 0.3), rel


def test_unpermute_inverts_llama_cpp_permute():
    from trainforge.loading.gguf import _unpermute

    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)  # 8 heads of head_dim 16
    for n_head, n_kv in ((8, 8), (8, 2)):
        rows = w[: (n_kv * 16)]
        p = llama_cpp_permute(rows, n_head, n_kv).copy()
        np.testing.assert_array_equal(_unpermute(p, n_kv), rows)


def test_mixed_block_types_dequantise_the_minority(tmp_path, model):
    path = write_gguf(tmp_path / "mix.gguf", model, linear_type=Q.Q4_0, overrides={"output.weight": Q.Q8_0,
                                                                                     "blk.0.ffn_up.weight": Q.F16,
                                                                                     "blk.1.attn_v.weight": Q.BF16})
    info = load_model(path).quantization
    assert info["mode"] == "q4_0" and "output" not in info["layers"]
    assert "Q8_0" in info["skipped"]["output"] and "F16" in info["skipped"]["layers.0.feed_forward.w3"]
    assert "BF16" in info["skipped"]["layers.1.attention.wv"]
    m = load_model(path).model
    torch.testing.assert_close(m.output.weight, _gguf_dequantised(path, "output.weight"), atol=0, rtol=0)
    torch.testing.assert_close(m.layers["1"].attention.wv.weight, model.layers["1"].attention.wv.weight.bfloat16()
                               .float(), atol=0, rtol=0)


def test_f16_file_holds_the_weights_rounded_to_fp16(tmp_path, model):
    m = load_model(write_gguf(tmp_path / "h.gguf", model, linear_type=Q.F16, embd_type=Q.F16)).model
    for name in ("tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.1.attention.wk.weight", "output.weight"):
        want = model.get_parameter(name).half().float()
        torch.testing.assert_close(m.get_parameter(name), want, atol=0, rtol=0, msg=name)


def test_unsupported_type_is_refused_naming_the_tensor(tmp_path, model):
    path = write_gguf(tmp_path / "k.gguf", model, overrides={"blk.1.ffn_down.weight": Q.Q5_0})
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_down\.weight is of GGUF type Q5_0.*Q8_0, Q4_0"):
        load_model(path)


def test_non_llama_architecture_is_refused(tmp_path, model):
    path = write_gguf(tmp_path / "q.gguf", model, arch="qwen2")
    with pytest.raises(CheckpointError, match="architecture is 'qwen2'.*'llama'"):
        load_model(path)


def test_truncated_file_is_refused(tmp_path, model):
    path = write_gguf(tmp_path / "cut.gguf", model, truncate=1000)
    with pytest.raises(CheckpointError, match="cut.gguf could not be read as a GGUF file"):
        load_model(path)


def _bpe(vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat, the hat; that's that."] * 20, trainer)
    return tok


def test_gpt2_tokenizer_is_rebuilt_from_metadata(tmp_path):
    import dataclasses

    tok = _bpe(300)
    n = tok.get_vocab_size()
    m = build_model(dataclasses.replace(CFG, vocab_size=n), seed=5).eval()
    loaded = load_model(write_gguf(tmp_path / "tok.gguf", m, tokenizer=tok))
    text = "the cat's hat sat on that mat<|endoftext|> 123 ünïcode"
    assert loaded.tokenizer.encode(text).ids == tok.encode(text).ids
    assert loaded.tokenizer.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_generate_with_ids_in_and_out_builds_no_tokenizer(tmp_path, monkeypatch, capsys):
    """``generate --prompt_ids --print_ids`` on a GGUF file with a tokenizer never builds it (the
    issue's memory bound: its library and vocabulary are ~6 MiB of a small model's process); a
    text prompt on the same file still does, and prints text."""
    import dataclasses

    from trainforge.cli import main
    from trainforge.loading import gguf as gguf_loading

    tok = _bpe(300)
    m = build_model(dataclasses.replace(CFG, vocab_size=tok.get_vocab_size()), seed=5).eval()
    path = str(write_gguf(tmp_path / "tok.gguf", m, tokenizer=tok))
    built = []
    real = gguf_loading._bpe_tokenizer
    monkeypatch.setattr(gguf_loading, "_bpe_tokenizer", lambda *a: built.append(1) or real(*a))
    common = ["generate", "--checkpoint", path, "--max_new_tokens", "4", "--temperature", "0", "--ignore_eos"]
    assert main([*common, "--prompt_ids", "5,6,7", "--print_ids"]) == 0
    assert len(capsys.readouterr().out.strip().split(",")) == 4 and built == []
    assert main([*common, "--prompt", "the cat"]) == 0
    assert capsys.readouterr().out.startswith("the cat") and built == [1]
    assert main([*common, "--prompt_ids", "5,6,7", "--print_ids", "--stop", "zz"]) == 0  # stop strings need it
    assert built == [1, 1]


def test_sentencepiece_tokenizer_is_refused_with_the_way_round(tmp_path):
    import dataclasses

    tok = _bpe(300)
    m = build_model(dataclasses.replace(CFG, vocab_size=tok.get_vocab_size()), seed=5).eval()
    path = write_gguf(tmp_path / "sp.gguf", m, tokenizer=tok, tokenizer_model="llama")
    with pytest.raises(CheckpointError, match="tokenizer.ggml.model is 'llama'.*Hugging Face directory"):
        load_model(path)


def _q8_0_reference(model):
    """``model`` with the block kernels' Q8_0 arithmetic in its plain forward: every linear's weight
    is the file's Q8_0 values (gguf-py's quantiser, dequantised) and its input goes through the
    kernels' activation quantiser (``formats.quantize_activations``). Where the kernels do not
    build, the layers run the fallback, float products of those weights: no activation quantiser."""
    import copy

    from trainforge.infer.cpu_kernels import load_kernels
    from trainforge.infer.cpu_kernels.formats import quantize_activations

    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, torch.nn.Linear):
            w = m.weight.detach().numpy().astype(np.float32)
            m.weight.data = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q8_0), Q.Q8_0).copy())
            if load_kernels() is not None:
                m.register_forward_pre_hook(lambda _, args: (quantize_activations(
                    args[0].reshape(-1, args[0].shape[-1])).view(args[0].shape),))
    return ref


def test_trainforge_generate_reads_a_gguf_file(tmp_path, model, capsys):
    """The CLI path (prepare_model: fusion, the Q8_0 block kernels): F32 gives the original model's
    greedy tokens, Q8_0 those of the model in the kernels' Q8_0 arithmetic (``_q8_0_reference``: the
    same integers and scales, only the fp32 summation order differs). Q8_0 against the float model
    would hang on its near-ties: a top-2 gap of 0.0035 at the 5th token, logits ~1.8."""
    from trainforge.cli import main

    prompt = [5, 17, 42, 8]
    for qtype, ref in ((Q.F32, model), (Q.Q8_0, _q8_0_reference(model))):
        with torch.no_grad():
            want = argmax_loop(ref, prompt, 12)
        path = write_gguf(tmp_path / f"{qtype.name}.gguf", model, linear_type=qtype)
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(path), "--prompt_ids", ",".join(map(str, prompt)),
                     "--max_new_tokens", "12", "--temperature", "0", "--ignore_eos", "--print_ids"]) == 0
        got = [int(t) for t in capsys.readouterr().out.strip().splitlines()[-1].split(",")]
        assert got == want, qtype.name


def test_q6_k_output_of_a_q4_0_preset_loads_as_float(tmp_path):
    """llama-quantize's Q4_0 preset keeps output.weight in Q6_K: decoded to float (gguf-py's decoder),
    the linears still byte for byte; Q6_K in a linear is refused."""
    import dataclasses

    m = build_model(dataclasses.replace(CFG, dim=256, n_heads=8, n_kv_heads=2), seed=6).eval()
    path = write_gguf(tmp_path / "p.gguf", m, linear_type=Q.Q4_0, embd_type=Q.Q4_0,
                      overrides={"output.weight": Q.Q6_K})
    loaded = load_model(path)
    assert loaded.quantization["mode"] == "q4_0" and "Q6_K" in loaded.quantization["skipped"]["output"]
    torch.testing.assert_close(loaded.model.output.weight, _gguf_dequantised(path, "output.weight"), atol=0, rtol=0)
    bad = write_gguf(tmp_path / "b.gguf", m, linear_type=Q.Q4_0, overrides={"blk.0.ffn_gate.weight": Q.Q6_K})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_gate\.weight is of GGUF type Q6_K"):
        load_model(bad)


def test_file_cut_after_its_header_was_read_names_the_tensor(tmp_path, model):
    """The weights are read after the reader is dropped (``FileTensor``): a file cut in between
    (a copy still being written) is refused naming the tensor, not read as zeros."""
    from trainforge.loading import gguf as gg

    path = write_gguf(tmp_path / "late.gguf", model)
    header, cfg, _ = gg.open_gguf(path)
    tensors = header.tensors
    last = max(tensors, key=lambda t: t.data_offset)
    with open(path, "r+b") as f:
        f.truncate(last.data_offset + last.n_bytes // 2)
    with pytest.raises(CheckpointError, match=rf"late.gguf: tensor {last.name} needs .* truncated"):
        gg.read_gguf(tensors, cfg, path)


def test_a_load_imports_only_the_reader_and_gguf_stays_whole_for_later_users(tmp_path, model):
    """In a fresh process (nothing imported gguf yet) a load imports gguf's reader, constants and
    quants, not its writer, tensor-name tables or yaml (``loading/gguf.py``'s ``_gguf``); a later
    ``import gguf`` then still sees the whole package."""
    import subprocess
    import sys
    import textwrap

    path = write_gguf(tmp_path / "q.gguf", model, linear_type=Q.Q4_0, embd_type=Q.Q4_0)
    code = textwrap.dedent(f"""
        import sys
        from trainforge.infer.loading import load_model
        loaded = load_model({str(path)!r})
        assert loaded.quantization["mode"] == "q4_0"
        heavy = sorted(m for m in sys.modules if m in ("yaml", "gguf.gguf_writer", "gguf.tensor_mapping",
                                                       "gguf.vocab", "gguf.metadata"))
        assert heavy == [], heavy
        import gguf
        from gguf import GGUFWriter, TensorNameMap
        assert gguf.GGMLQuantizationType.Q4_0 is gguf.constants.GGMLQuantizationType.Q4_0
        assert "yaml" in sys.modules and GGUFWriter.__module__ == "gguf.gguf_writer"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
