"""The inference engine serves mixture-of-experts models through the model's own forward:
greedy tokens of the engine (prefill, paged decode, continuous batching, fused or not)
equal the training forward's argmax loop; int8 / int4 expert weights match their
dequantised float reference; a trained moe-debug checkpoint goes through
``trainforge quantize`` -> ``generate``, and the server answers for it."""

from __future__ import annotations

import copy
import subprocess
import sys

import httpx
import pytest
import torch
from torch import nn

from conftest import debug_config, train_to
from tests.infer.helpers import MOE_SHAPES, argmax_loop, model_for
from trainforge.data.tokenizer import eos_id, load_tokenizer
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.loading import load_model
from trainforge.infer.prepare import describe_model, prepare_model
from trainforge.infer.quantize import (Int4Experts, Int8Experts, QuantExperts, QuantLinear, expert_names,
                                       quantize_model, quantize_state_dict, swap_quantized_linears)
from trainforge.infer.sampling import SamplingParams
from trainforge.infer.server import ServerConfig
from trainforge.model.moe import GroupedExperts, Router
from trainforge.model.preflight import inference_estimate

CFG = MOE_SHAPES["moe"]
N_NEW = 32
GREEDY = SamplingParams(max_new_tokens=N_NEW, temperature=0)
PROMPTS = [[5, 17, 300, 42], list(range(1, 38)), [7], [99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89], [1, 2]]


def moe_model(seed: int = 0) -> nn.Module:
    return model_for("moe", seed)


@torch.no_grad()
def dequantised(model: nn.Module) -> nn.Module:
    """A float copy of a (not yet packed) quantised model: every quantised module replaced by
    the float module its dequantised weights stand for."""
    ref = copy.deepcopy(model)
    for parent in list(ref.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantExperts):
                g = GroupedExperts(child.n, child.dim, child.hidden)
                g.w1.data, g.w2.data, g.w3.data = child.dequantize()
                setattr(parent, name, g)
            elif isinstance(child, QuantLinear):
                lin = nn.Linear(child.in_features, child.out_features, bias=False)
                lin.weight.data = child.dequantize()
                setattr(parent, name, lin)
    return ref


def quantize_experts(model: nn.Module, mode: str, group_size: int = 32) -> dict:
    """Quantise only the routed experts (the linears stay float): the offline transform and swap."""
    names = expert_names(model)
    sd = {f"{n}.{p}": getattr(model.get_submodule(n), p) for n in names for p in ("w1", "w2", "w3")}
    qsd, info = quantize_state_dict(sd, [], mode, group_size, names)
    swap_quantized_linears(model, info)
    model.load_state_dict(qsd, strict=False, assign=True)
    return info


# -- float: the engine equals the training forward --------------------------------------------

@pytest.mark.parametrize("fuse,step", [(False, "forward"), (False, "fast"), (True, "fast")])
def test_engine_greedy_equals_the_training_forward(fuse, step):
    """Five prompts of 1..37 tokens, three batch rows: requests join as others finish
    (continuous batching), prefill + paged decode, 32 tokens each. ``step``: the decode step
    through the model's plain forward, or the fast path (MoE's call is its forward)."""
    want = [argmax_loop(moe_model(), p, N_NEW) for p in PROMPTS]
    model = prepare_model(moe_model(), fuse=fuse)
    if fuse:  # MoE blocks: attention, norms and shared experts fused; routed experts untouched
        assert describe_model(model)["fusions"] == {"qkv": 3, "gate_up": 3, "add_norm": 3}
        assert all(type(m.gate) is nn.Linear for m in model.modules() if isinstance(m, Router))
    engine = Engine(model, EngineConfig(max_batch_size=3, block_size=8, max_context=128))
    assert engine.runner.decoder is not None  # every module of a MoE block has decode_calls
    if step == "forward":
        engine.runner.decoder = None
    got = engine.generate(PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == want
    assert engine.stats()["peak_batch"] == 3 and engine.pool.utilisation()["blocks_used"] == 0


# -- quantised experts ------------------------------------------------------------------------

# Relative to the output's scale. int8pack keeps the activations in fp32: equal to the
# dequantised weights up to float rounding. int8pack_bf16 and int4pack_cpu take bf16
# activations (8-bit mantissa); fbgemm quantises them to 7 bits per tensor.
TOL = {"int8pack": 1e-5, "int8pack_bf16": 2e-2, "int4pack_cpu": 2e-2, "fbgemm": 5e-2}
DEFAULT_KERNEL = {"int8": "int8pack_bf16", "int4": "int4pack_cpu"}


@pytest.mark.parametrize("mode,kernel", [("int8", "auto"), ("int8", "int8pack"), ("int8", "fbgemm"),
                                         ("int4", "auto")])
def test_quantised_experts_match_their_dequantised_weights(mode, kernel):
    """Module level, GroupedExperts' contract (x sorted by expert, counts; one expert idle)."""
    torch.manual_seed(0)
    g = GroupedExperts(8, 64, 48)  # hidden 48: int4 pads it to 64 (group 32)
    for w in (g.w1, g.w2, g.w3):
        nn.init.normal_(w, std=0.1)
    counts = torch.tensor([3, 0, 1, 5, 2, 1, 4, 2])
    x = torch.randn(int(counts.sum()), 64)
    kind = {"int8": Int8Experts, "int4": Int4Experts}[mode]
    kw = {"group_size": 32} if mode == "int4" else {}
    q = kind(8, 64, 48, kernel=kernel, **kw)
    for name, t in kind.quantize_stored(g.w1, g.w2, g.w3, **kw).items():
        setattr(q, name, t)
    ref = GroupedExperts(8, 64, 48)
    ref.w1.data, ref.w2.data, ref.w3.data = q.dequantize()
    with torch.no_grad():
        want, got = ref(x, counts), q(x, counts)
    used = DEFAULT_KERNEL[mode] if kernel == "auto" else kernel
    assert q.kernel_name == used
    assert (got - want).abs().max() <= TOL[used] * want.abs().max()
    with torch.no_grad():  # and the quantisation itself is near the float experts (16 levels for int4)
        assert (want - g(x, counts)).abs().max() <= {"int8": 0.02, "int4": 0.25}[mode] * want.abs().max()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantised_experts_model_greedy_equals_the_dequantised_model(mode):
    model = moe_model()
    info = quantize_experts(model, mode)
    assert info["experts"] == ["layers.1.feed_forward.experts", "layers.2.feed_forward.experts"]
    ref = dequantised(model)
    x = torch.tensor([PROMPTS[1]])
    prepare_model(model)
    assert describe_model(model)["quant_kernels"] == {f"{DEFAULT_KERNEL[mode]} (experts)": 2}
    with torch.no_grad():
        got, want = model(x), ref(x)
    # Per position, relative to the logits' scale (a routing flip would exceed it).
    assert ((got - want).abs().amax(-1) <= TOL[DEFAULT_KERNEL[mode]] * want.abs().amax(-1)).all()
    want_ids = [argmax_loop(ref, p, N_NEW) for p in PROMPTS[:3]]
    got_ids = Engine(model, EngineConfig(max_batch_size=2, block_size=8, max_context=128)).generate(
        PROMPTS[:3], GREEDY)
    assert [r.output_ids for r in got_ids] == want_ids


def test_whole_model_quantisation_keeps_the_router_float():
    model = moe_model()
    info = quantize_model(model, "int8", pack=False)
    assert not any(n.endswith("router.gate") for n in info["layers"]) and len(info["experts"]) == 2
    assert all(type(m.gate) is nn.Linear for m in model.modules() if isinstance(m, Router))


def test_memory_estimate_counts_quantised_experts():
    """Experts are most of a MoE model's weights: int4 takes ~1/8 of their fp32 bytes."""
    f32 = inference_estimate(CFG, 4, 0, 4).parts["weights"]
    i4 = inference_estimate(CFG, 4, 0, 4, quantized_bytes=0.5 + 8 / 32).parts["weights"]  # group 32
    experts = CFG.n_moe_layers * 3 * CFG.n_routed_experts * CFG.dim * CFG.moe_inter_dim
    assert f32 - i4 >= experts * 3.2
    model = moe_model()
    quantize_model(model, "int4", group_size=32, pack=False)
    stored = sum(t.nbytes for t in model.state_dict().values())
    assert i4 <= stored <= i4 * 1.2  # dense layer 0's w2 (in 176, not groupable by 32) stays float


# -- a trained checkpoint through the CLI and the server -----------------------------------------

@pytest.fixture(scope="module")
def moe_run(small_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe") / "run"
    cfg = debug_config(small_data, "--model.flavor", "moe-debug", "--training.steps", "6", "--training.val_interval",
                       "0")
    return train_to(cfg, run_dir)


def tf(*args):
    r = subprocess.run([sys.executable, "-m", "trainforge", *args], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_quantize_then_generate_a_trained_moe_checkpoint(moe_run, tmp_path):
    out = tf("quantize", "--checkpoint", str(moe_run), "--output", str(tmp_path / "q4"), "--mode", "int4",
             "--group_size", "32")
    assert "and 2 layers of routed experts to int4" in out
    loaded = load_model(tmp_path / "q4")
    assert [type(loaded.model.layers[str(i)].feed_forward.experts) for i in (1, 2)] == [Int4Experts] * 2
    ids = tf("generate", "--checkpoint", str(tmp_path / "q4"), "--prompt_ids", "5,6,7", "--print_ids",
             "--temperature", "0", "--max_new_tokens", "8", "--ignore_eos")
    want = Engine(prepare_model(loaded.model), EngineConfig(max_batch_size=1, max_context=16)).generate(
        [[5, 6, 7]], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))[0].output_ids
    assert ids.strip() == ",".join(map(str, want))


def test_server_answers_for_a_moe_model(moe_run, small_data):
    from tests.infer.test_server import serving

    tok = load_tokenizer(small_data / "tokenizer.json")
    loaded = load_model(moe_run)
    quantize_model(loaded.model, "int8", pack=False)
    engine = Engine(prepare_model(loaded.model), EngineConfig(max_batch_size=2, max_context=64), tokenizer=tok,
                    eos_ids=(eos_id(tok),))
    with serving(engine, tok, ServerConfig(model_name="moe")) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "def ", "max_tokens": 4, "temperature": 0},
                       timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "moe"
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_bfloat16_keeps_the_router_fp32(moe_run):
    """Loaded in bf16, the routers' gates stay fp32 (top-k over near-ties); the engine runs it."""
    model = load_model(moe_run, dtype="bfloat16").model
    assert [m.gate.weight.dtype for m in model.modules() if isinstance(m, Router)] == [torch.float32] * 2
    assert model.layers["1"].feed_forward.experts.w1.dtype == torch.bfloat16
    out = Engine(prepare_model(model), EngineConfig(max_batch_size=2, max_context=64)).generate(
        PROMPTS[:2], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    assert [len(r.output_ids) for r in out] == [8, 8]


def test_a_loaded_moe_model_counts_its_routing(moe_run):
    """The routers' load counters are not in the checkpoint: loading makes them real zeros
    (left on meta, every count would silently go nowhere)."""
    model = load_model(moe_run).model
    assert not any(b.is_meta for b in model.buffers())
    model(torch.tensor([[5, 17, 300, 42]]))
    routers = [m for m in model.modules() if isinstance(m, Router)]
    assert routers and all(r.eval_load.sum().item() == 4 * r.k for r in routers)
