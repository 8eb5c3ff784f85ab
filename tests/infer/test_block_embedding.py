"""BlockEmbedding (a token embedding kept in Q8_0 / Q4_0 blocks) against formats.py's dequantisation,
alone and inside a model loaded from a GGUF file or a ``trainforge quantize`` checkpoint."""

from __future__ import annotations

import pytest
import torch

from trainforge.infer.cpu_kernels import formats
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.generate import SamplingParams
from trainforge.infer.prepare import prepare_model
from trainforge.infer.quantize import BlockEmbedding

from .helpers import argmax_loop

_DEQUANTIZE = {"q8_0": formats.dequantize_q8_0, "q4_0": formats.dequantize_q4_0}


def _table(mode: str, vocab: int = 50, dim: int = 96) -> tuple[BlockEmbedding, torch.Tensor]:
    """(a BlockEmbedding of a random table, formats.py's dequantisation of its blocks)."""
    w = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(0)) * 3
    emb = BlockEmbedding(vocab, dim, mode)
    emb.load_state_dict(BlockEmbedding.quantize_stored(w, mode), assign=True)
    return emb, _DEQUANTIZE[mode](emb.weight, emb.scales)


@pytest.mark.parametrize("kernels", ["c++", "torch"])  # the C++ block_gather_into op, and the torch ops without it
@pytest.mark.parametrize("mode", ["q8_0", "q4_0"])
def test_rows_equal_the_formats_dequantisation_exactly(mode, kernels, monkeypatch):
    from trainforge.infer.cpu_kernels import load_kernels
    from trainforge.infer.quantize import block_embedding

    if kernels == "c++" and load_kernels() is None:
        pytest.skip("the C++ kernels did not build here (warning says why)")
    if kernels == "torch":
        monkeypatch.setattr(block_embedding, "load_kernels", lambda: None)
    emb, ref = _table(mode)
    tokens = torch.tensor([[3, 0, 49], [7, 7, 12]])
    torch.testing.assert_close(emb(tokens), ref[tokens], atol=0, rtol=0)
    # The decode step's bound form writes the same bits, and reads the tokens when called.
    for out in (torch.empty(4, 96), torch.empty(4, 192)[:, :96]):  # its own buffer, and a strided view
        step = torch.tensor([5, 1, 49, 20])
        gather = emb.bind_gather(step, out)
        gather()
        torch.testing.assert_close(out, ref[step], atol=0, rtol=0)
        step.copy_(torch.tensor([0, 2, 3, 4]))
        gather()
        torch.testing.assert_close(out, ref[step], atol=0, rtol=0)


def test_bound_gather_refuses_a_token_out_of_range():
    from trainforge.infer.cpu_kernels import load_kernels

    if load_kernels() is None:
        pytest.skip("the C++ kernels did not build here (warning says why)")
    emb, _ = _table("q4_0")
    gather = emb.bind_gather(torch.tensor([3, 50]), torch.empty(2, 96))
    with pytest.raises(RuntimeError, match="token 50 out of range for 50 rows"):
        gather()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="not a multiple of 32"):
        BlockEmbedding(10, 48, "q8_0")
    with pytest.raises(ValueError, match="mode 'int8'"):
        BlockEmbedding(10, 64, "int8")


def _engine_tokens(model, prompt: list[int], n: int) -> list[int]:
    engine = Engine(model, EngineConfig(max_batch_size=1, max_queue=1, max_context=len(prompt) + n))
    return engine.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))[0].output_ids


@pytest.mark.parametrize("mode", ["q8_0", "q4_0"])
def test_gguf_model_with_block_embedding_decodes_the_plain_forwards_tokens(tmp_path, mode):
    gguf = pytest.importorskip("gguf")
    from trainforge.infer.loading import load_model
    from trainforge.model import build_model

    from .test_gguf_loading import CFG, write_gguf
    from .helpers import sharpen

    qtype = getattr(gguf.GGMLQuantizationType, mode.upper())
    model = sharpen(build_model(CFG, seed=3), 3).eval()
    m = load_model(write_gguf(tmp_path / "m.gguf", model, linear_type=qtype, embd_type=qtype)).model
    assert isinstance(m.tok_embeddings, BlockEmbedding)
    prompt = [5, 17, 42, 8]
    want = argmax_loop(m, prompt, 12)  # the plain forward of the loaded model (its block embedding)
    prepare_model(m)  # fusion and the C++ block kernels: the engine's fast decode step (bind_gather)
    assert m.tok_embeddings.weight.dtype != torch.float32  # still blocks after packing
    assert _engine_tokens(m, prompt, 12) == want


def test_quantize_checkpoint_keeps_an_untied_embedding_in_blocks(tmp_path):
    from trainforge.infer.loading import load_model
    from trainforge.infer.quantize import linear_names, quantize_state_dict, save_quantized
    from trainforge.model import build_model

    from .test_gguf_loading import CFG
    from .helpers import sharpen

    import dataclasses

    model = sharpen(build_model(CFG, seed=3), 3).eval()
    sd = model.state_dict()
    qsd, info = quantize_state_dict(sd, linear_names(model), "q8_0", embedding=True)
    assert info["embedding"] == "q8_0"
    out = save_quantized(tmp_path / "q", qsd, info, dataclasses.asdict(CFG))
    m = load_model(out).model
    ref = formats.dequantize_q8_0(*formats.quantize_q8_0(model.tok_embeddings.weight))
    torch.testing.assert_close(m.tok_embeddings.dequantize(), ref, atol=0, rtol=0)
    prompt = [5, 17, 42, 8]
    want = argmax_loop(m, prompt, 12)
    prepare_model(m)
    assert _engine_tokens(m, prompt, 12) == want
