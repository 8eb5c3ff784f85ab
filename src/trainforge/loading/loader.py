"""Load a model (for inference, or as a training run's starting weights) from a trainforge checkpoint (float or quantised by
``trainforge quantize``) or a Hugging Face directory (``config.json`` + ``*.safetensors``,
sharded or not) in the ``LlamaForCausalLM`` layout (``model/hf.py``) or, when config.json's
``model_type`` is ``deepseek_v3``, the ``DeepseekV3ForCausalLM`` one (``model/hf_deepseek.py``;
its MTP layers are kept), or for ``glm4_moe`` / ``mixtral`` ``Glm4MoeForCausalLM`` /
``MixtralForCausalLM`` (``model/hf_moe.py``). Safetensors only: no pickle is ever loaded.

The model is built on the meta device (no memory, no random init), quantised layers are
swapped in on meta too, and the tensors read from the file become the parameters by
assignment (``load_state_dict(assign=True)``): each weight is read once into its final
memory and never copied again (a float cast to ``dtype`` is the only extra copy, and only
when the file's dtype differs). Rotary tables are recomputed on the device. On CUDA each
tensor is read into pinned host memory and copied asynchronously, so the copy of one
overlaps the read of the next; the weights then stay resident on the device.

Quantised checkpoints (``trainforge quantize``, compressed-tensors int8/int4, GGUF Q8_0/Q4_0)
are read here too, but the modules that hold their stored form are the engine's kernels
(``infer/quantize/``), which this package sits below: the caller passes ``swap_quantized``
(``infer/loading.py`` does). A reader without one (``model.init_from``: training starts from
float weights) gets ``QuantizedCheckpointError`` before any module is built.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from trainforge.errors import CheckpointError, TrainforgeError
from trainforge.loading.ema_weights import STATE_FILE as EMA_STATE_FILE
from trainforge.loading.ema_weights import check_weights_choice, read_ema_weights
from trainforge.model.config import ModelConfig
from trainforge.model import hf as hf_llama
from trainforge.model.hf import model_config_from_hf
from trainforge.model.llama import Transformer
from trainforge.model.rope import model_rope_tables
from trainforge.model.moe import routers
from trainforge.model.preflight import check_inference
from trainforge.safe_unpickle import error_detail
from trainforge.storage.checkpoint_dirs import is_hf_dir
from trainforge.storage.safetensors_stream import map_safetensors

# The KV pool a caller will allocate, in token slots, given the model's config.
KVSlots = Callable[[ModelConfig], int]
# Replaces, in place, the layers a quantised checkpoint stores quantised (its quantization info)
# with modules holding the stored form, on the meta-device model, given the float dtype of the rest.
SwapQuantized = Callable[[Transformer, dict[str, Any], torch.dtype], None]


class QuantizedCheckpointError(CheckpointError):
    """A quantised checkpoint given to a reader of float weights (no ``swap_quantized``)."""

    def __init__(self, message: str, mode: str | None):
        super().__init__(message)
        self.mode = mode


@dataclass
class LoadedModel:
    model: Transformer
    _tokenizer: Any  # see ``tokenizer``
    eos_ids: tuple[int, ...]
    name: str  # for /v1/models: the directory's name
    source: str  # "trainforge", "huggingface" or "gguf"
    quantization: dict[str, Any] | None
    path: Path
    # Builds the tokenizer on first use (a GGUF file's, from its metadata), or None: built already.
    _build_tokenizer: Callable[[], Any] | None = field(default=None, repr=False)

    @property
    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer``, or None when the checkpoint has none. A GGUF file's is
        built from its metadata on first read, so a caller that neither reads nor writes text
        (``generate --prompt_ids --print_ids``) never pays for it: the library's code and the
        vocabulary's objects, ~6 MiB of a 90M-parameter q4_0 model's process (issue 24)."""
        if self._build_tokenizer is not None:
            self._tokenizer, self._build_tokenizer = self._build_tokenizer(), None
        return self._tokenizer


def _read_safetensors(files: list[Path], device: torch.device, mapped: bool = False
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of ``files`` on ``device`` (pinned staging on CUDA) and the first file's
    metadata. ``mapped`` (CPU): views of the files' pages, read when touched (``map_safetensors``)."""
    from safetensors import safe_open  # here, not at the top: a GGUF load never maps its library
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for i, f in enumerate(files):
        try:
            if mapped and device.type == "cpu":
                tensors.update(map_safetensors(f))
                continue
            if i == 0:
                with safe_open(str(f), framework="pt") as fh:
                    metadata = fh.metadata() or {}
            if device.type == "cuda":
                with safe_open(str(f), framework="pt", device="cpu") as fh:
                    for key in fh.keys():
                        tensors[key] = fh.get_tensor(key).pin_memory().to(device, non_blocking=True)
            else:
                tensors.update(load_file(str(f), device=str(device)))
        except Exception as e:  # SafetensorError, OSError, and others on a crafted header
            raise CheckpointError(f"weights file {f} could not be read: not a safetensors file, or damaged "
                                  f"({error_detail(e)})") from None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return tensors, metadata


@contextlib.contextmanager
def _no_init():
    """Module constructors without their random init, for a model built on the meta device to
    be loaded by assignment: ``nn.Embedding``'s ``normal_`` on meta runs torch's Python
    reference kernel, whose first call imports ``torch._dynamo`` (2-4 s of every start,
    measured with ``python -X importtime``), for values that are replaced."""
    names = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "zeros_", "ones_", "constant_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def _materialise(cfg: ModelConfig, sd: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 quantization: dict[str, Any] | None, what: str, kv_slots: KVSlots | None = None,
                 swap_quantized: SwapQuantized | None = None) -> Transformer:
    """The model of ``cfg`` holding ``sd``. With the caller's KV pool (``kv_slots``), the rotary
    tables stop at its size: no sequence in a pool of that many slots reaches a later position,
    and ``generate``'s pool is its prompt and new tokens (the 90m model's full tables are 1 MiB,
    issue 24's memory bound)."""
    if quantization and swap_quantized is None:
        mode = quantization.get("mode") if isinstance(quantization, dict) else None
        raise QuantizedCheckpointError(f"{what} is quantised ({mode}); this reader takes float weights", mode)
    with torch.device("meta"), _no_init():
        model = Transformer(cfg)
    if quantization:
        try:
            swap_quantized(model, quantization, dtype)
        except Exception as e:  # meta.json's quantization info is input too: KeyError, TypeError, ValueError
            raise CheckpointError(f"{what}: the quantization info in meta.json does not fit the model "
                                  f"({error_detail(e)})") from None
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    # MoE routers stay fp32 whatever ``dtype`` (as training's precision rule keeps ``*.gate``):
    # top-k over near-tied scores would flip with bf16 weights.
    params -= {f"{name}.{p}" for name, r in routers(model) for p, _ in r.named_parameters()}
    sd = {k: (v.to(dtype) if k in params and v.is_floating_point() and v.dtype != dtype else v) for k, v in sd.items()}
    if cfg.tie_embeddings and "output.weight" in params:  # stored once; the tied module wants both names
        shared = sd.get("tok_embeddings.weight", sd.get("output.weight"))
        sd.setdefault("tok_embeddings.weight", shared)
        sd.setdefault("output.weight", shared)
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"{what} does not fit the model config ({error_detail(e)})") from None
    if cfg.tie_embeddings and "output.weight" in params:
        model.output.weight = model.tok_embeddings.weight
    cos, sin = model_rope_tables(cfg, device=device, positions=kv_slots(cfg) if kv_slots is not None else None)
    model.rope_cos, model.rope_sin = cos, sin
    # Other non-persistent buffers (a MoE router's load counters) are not in the file: zeros,
    # or they would stay on meta and every count would silently go nowhere.
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                setattr(module, name, torch.zeros(buf.shape, dtype=buf.dtype, device=device))
    return model.eval().requires_grad_(False)


def _default_dtype(device: torch.device, dtype: torch.dtype | str | None) -> torch.dtype:
    if isinstance(dtype, str):
        try:
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        except KeyError:
            raise ValueError(f"--dtype {dtype}: use float32, bfloat16 or float16") from None
    return dtype or torch.float32


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = None, kv_slots: KVSlots | None = None,
               mapped: bool = False, verify: bool = True, quantize_to: dict[str, Any] | None = None,
               swap_quantized: SwapQuantized | None = None, weights: str = "final") -> LoadedModel:
    """A model ready for inference from ``path``: a trainforge checkpoint directory, a run
    directory (newest checkpoint), a Hugging Face directory (Llama, DeepSeek-V3, Glm4Moe, Mixtral;
    float or compressed-tensors int8/int4), or a llama.cpp ``.gguf`` file (Llama; ``gguf.py``). ``dtype`` is the float
    dtype of the parameters (default float32). Raises ``CheckpointError`` naming the file.

    Before any weight is read, the shape is validated and the memory of the weights, the
    rotary tables and the caller's KV pool (``kv_slots(cfg)`` token slots, in ``dtype``)
    is checked against what ``device`` has (``model/preflight.py``).

    ``mapped`` (CPU, a one-pass reader such as ``trainforge export``): the weights are views
    of the files' pages, read from disk when touched and reclaimable by the kernel after, so a
    model larger than RAM can be read through; the memory check is then skipped. ``verify=False``
    skips the sha256 check of a trainforge checkpoint's files, for a caller that checks them
    itself (``trainforge export`` hashes them beside the conversion and commits nothing on a
    mismatch). A caller that quantises the float weights after loading (``--quantize``) passes
    ``quantize_to`` (``{"mode", "group_size"}``): the memory check then counts the weights at that
    size, and runs for a mapped load that has a KV pool (``kv_slots``) to hold. ``swap_quantized``
    builds the modules of a quantised checkpoint's layers (the engine's: ``infer/loading.py``);
    without it a quantised checkpoint raises ``QuantizedCheckpointError``. ``weights``: ``final``
    (the weights the run ended with) or ``ema`` (the moving average a run trained with ``[ema]``
    kept, ``ema_weights.py``; trainforge checkpoints only)."""
    path = Path(path)
    device = torch.device(device)
    dtype = _default_dtype(device, dtype)
    mapped = mapped and device.type == "cpu"
    check_weights_choice(weights)
    if weights == "ema" and (path.suffix == ".gguf" or is_hf_dir(path)):
        kind = "GGUF file" if path.suffix == ".gguf" else "Hugging Face directory"
        raise CheckpointError(f"--weights ema: {path} is a {kind}; only a trainforge checkpoint of a run trained "
                              "with [ema] holds a weight average (use --weights final)")
    if path.suffix == ".gguf":  # llama.cpp's single-file format (gguf.py)
        return _load_gguf(path, device, dtype, kv_slots, swap_quantized)
    if is_hf_dir(path):
        return _load_hf(path, device, dtype, kv_slots, mapped, quantize_to, swap_quantized)
    return _load_trainforge(path, device, dtype, kv_slots, mapped, verify, quantize_to, swap_quantized, weights)


def _preflight(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, kv_slots: KVSlots | None,
               quantization: dict[str, Any] | None, positions_key: str, where: str) -> None:
    if device.type == "meta":
        return
    qbytes = None
    if quantization:  # codes + their scales (int4: fp32 scale and zero per group; int8: one per row;
        # q8_0 / q4_0: one fp16 scale per 32 values)
        mode = quantization.get("mode")
        qbytes = {"int4": 0.5 + 8 / quantization.get("group_size", 128), "q8_0": 1 + 2 / 32,
                  "q4_0": 0.5 + 2 / 32}.get(mode, 1.0)
    elem = torch.empty((), dtype=dtype).element_size()
    check_inference(cfg, device, elem, kv_slots(cfg) if kv_slots is not None else 0, elem,
                    positions_key=positions_key, where=where, quantized_bytes=qbytes, error=CheckpointError)


def trainforge_model_config(path: Path, verify: bool = False) -> tuple[Path, dict[str, Any], ModelConfig]:
    """(checkpoint directory, its meta.json, its ModelConfig) of a checkpoint or run directory
    (the newest complete checkpoint); no weight is read unless ``verify`` (every file's sha256
    checked against meta.json). Raises ``CheckpointError`` naming the file."""
    from trainforge.storage import checkpoint_format as ckpt
    from trainforge.storage.checkpoint_dirs import resolve_checkpoint

    ck = resolve_checkpoint(path)
    meta = ckpt.read_meta(ck, verify=verify)
    try:
        cfg = ModelConfig(**meta["model_config"])
    except TypeError as e:
        raise CheckpointError(f"{ck / ckpt.META}: model_config does not fit this trainforge version ({e})") from None
    except CheckpointError:
        raise
    except TrainforgeError as e:  # a shape check_shape refused
        raise CheckpointError(f"{ck / ckpt.META}: {e}") from None
    return ck, meta, cfg


def _load_trainforge(path: Path, device: torch.device, dtype: torch.dtype, kv_slots: KVSlots | None,
                     mapped: bool = False, verify: bool = True, quantize_to: dict[str, Any] | None = None,
                     swap_quantized: SwapQuantized | None = None, which: str = "final") -> LoadedModel:
    from trainforge.data.tokenizer import eos_id, load_tokenizer
    from trainforge.storage import checkpoint_format as ckpt

    ck, meta, cfg = trainforge_model_config(path, verify=verify)
    if not mapped or kv_slots is not None:
        _preflight(cfg, device, dtype, kv_slots, meta.get("quantization") or quantize_to, "model_config.max_seq_len",
                   str(ck))
    weights = ck / ckpt.MODEL_FILE
    quantization = meta.get("quantization")
    if which == "ema":  # the average, in model.safetensors' layout; memory-mapped, on the CPU
        sd = {k: v.to(device) for k, v in read_ema_weights(ck).items()}
        weights = ck / EMA_STATE_FILE
    elif not weights.is_file():
        raise CheckpointError(f"{weights} is missing (a multi-process checkpoint? load it with `trainforge train "
                              f"--resume` on 1 process and let it save, or use a single-process checkpoint)")
    else:
        sd, _ = _read_safetensors([weights], device, mapped)
    model = _materialise(cfg, sd, device, dtype, quantization, str(weights), kv_slots, swap_quantized)
    tok, eos = None, ()
    tok_file = ck / ckpt.TOKENIZER_FILE
    if tok_file.is_file():
        tok = load_tokenizer(tok_file)
        eos = (eos_id(tok, tok_file),)
    name = ck.parent.parent.name if ck.parent.name == "checkpoints" else ck.name
    return LoadedModel(model, tok, eos, name, "trainforge", quantization, ck)


def _load_gguf(path: Path, device: torch.device, dtype: torch.dtype, kv_slots: KVSlots | None,
               swap_quantized: SwapQuantized | None = None) -> LoadedModel:
    from trainforge.loading import gguf as gg

    header, cfg, mode = gg.open_gguf(path)
    build_tok, eos = gg.gguf_tokenizer(header, path, cfg.vocab_size)  # before any weight is read: a refusal costs nothing
    _preflight(cfg, device, dtype, kv_slots, {"mode": mode} if mode else None, "GGUF key 'llama.context_length'",
               str(path))
    sd, quantization = gg.read_gguf(header.tensors, cfg, path)
    model = _materialise(cfg, {k: v.to(device) for k, v in sd.items()}, device, dtype, quantization, str(path),
                         kv_slots, swap_quantized)
    return LoadedModel(model, None, eos, path.stem, "gguf", quantization, path, build_tok)


def _has_layer(files: list[Path], layer: Any) -> bool:
    """Whether any of ``files`` holds a tensor of ``model.layers.{layer}`` (names only are read)."""
    from safetensors import safe_open

    prefix = f"model.layers.{layer}."
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                if any(k.startswith(prefix) for k in fh.keys()):
                    return True
        except Exception as e:  # as _read_safetensors: a damaged header
            raise CheckpointError(f"weights file {f} could not be read: not a safetensors file, or damaged "
                                  f"({error_detail(e)})") from None
    return False


def _split_compressed(sd: dict[str, torch.Tensor], cfg: ModelConfig, hf_config: dict[str, Any], layout: Any,
                      where: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
    """A compressed-tensors directory's tensors (HF names) -> (the float tensors, with a meta
    placeholder ``P.weight`` of the right shape for every quantised module so the family's
    renaming applies unchanged; the quantization info ``swap_quantized_linears`` takes; each
    quantised layer's stored form under our names, rows back in our order)."""
    from trainforge.quant_formats import compressed_tensors as ct
    from trainforge.quant_formats.layers import expert_buffer_name

    mode, group_size = ct.read_quantization_config(hf_config["quantization_config"], f"{where}")
    # int4: a module named by a config group of its own has that group size (the per-layer fallback).
    by_target = ct.group_sizes_by_target(hf_config["quantization_config"]) if mode == "int4" else {}
    group_sizes: dict[str, int] = {}  # our layer / experts module -> its group size, where not group_size
    expert_group: dict[str, int] = {}
    inverse = {theirs: ours for ours, theirs in layout.key_map(cfg).items()}
    expert_keys = layout.expert_key_map(cfg) if cfg.is_moe and hasattr(layout, "expert_key_map") else {}
    expert_of = {k: (stacked, e) for stacked, keys in expert_keys.items() for e, k in enumerate(keys)}
    sd = dict(sd)
    stored: dict[str, torch.Tensor] = {}
    layers: list[str] = []
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}  # our stacked key -> expert -> stored form
    for prefix in ct.ct_prefixes(list(sd)):
        key = f"{prefix}.weight"
        if key not in inverse and key not in expert_of:
            raise CheckpointError(f"{where}: quantised module {prefix} is not a layer trainforge quantises "
                                  "(routers and kv_b_proj stay float); keep it float")
        mine = {s: sd.pop(f"{prefix}.{s}") for s in ("weight", "weight_packed", "weight_scale", "weight_zero_point",
                                                       "weight_shape") if f"{prefix}.{s}" in sd}
        t = ct.from_ct(mode, mine, f"{where}: {prefix}")
        expected = by_target.get(prefix, group_size)
        if mode == "int4" and t["weight"].shape[1] * 2 != t["scales"].shape[1] * expected:
            raise CheckpointError(f"{where}: {prefix} has {t['scales'].shape[1]} groups per row, not the "
                                  f"group_size {expected} of quantization_config")
        n, k = t["weight"].shape[0], t["weight"].shape[1] * (2 if mode == "int4" else 1)
        sd[key] = torch.empty(n, k, device="meta")  # the family's renaming and stacking run on it
        if key in expert_of:
            stacked, e = expert_of[key]
            experts.setdefault(stacked, {})[e] = t
            module = stacked.rsplit(".", 1)[0]
            if expert_group.setdefault(module, expected) != expected:
                raise CheckpointError(f"{where}: {prefix} has group_size {expected}, another expert of the same "
                                      f"layer {expert_group[module]}; trainforge reads one group size per layer's "
                                      "experts")
            if expected != group_size:
                group_sizes[module] = expected
            continue
        ours = inverse[key]
        name = ours[: -len(".weight")]
        if expected != group_size:
            group_sizes[name] = expected
        # Row permutations (a 1-D per-row tensor, int8's scales, goes through as a column).
        try:
            stored.update({f"{name}.{s}": layout.rows_from_hf(cfg, ours, v if v.dim() > 1 else v[:, None], hf_config)
                           .reshape(v.shape) for s, v in t.items()})
        except (RuntimeError, ValueError, IndexError) as e:  # rows that do not fit the heads: no permutation
            raise CheckpointError(f"{where}: quantised {prefix} has {n} x {k} weights, which do not fit the model "
                                  f"of config.json ({error_detail(e)})") from None
        layers.append(name)
    modules: dict[str, set[str]] = {}
    for stacked, per in experts.items():
        if len(per) != len(expert_keys[stacked]):
            raise CheckpointError(f"{where}: {len(per)} of the {len(expert_keys[stacked])} experts behind {stacked} "
                                  "are quantised; trainforge reads all of a layer's experts quantised, or none")
        module, proj = stacked.rsplit(".", 1)
        for s in per[0]:
            stored[f"{module}.{expert_buffer_name(proj, s)}"] = torch.stack([per[e][s] for e in range(len(per))])
        modules.setdefault(module, set()).add(proj)
    partial = [m for m, projs in modules.items() if projs != {"w1", "w2", "w3"}]
    if partial:
        raise CheckpointError(f"{where}: experts {partial[0]} have only {sorted(modules[partial[0]])} quantised; "
                              "trainforge reads w1, w2 and w3 (gate, down, up) quantised together")
    if not layers and not modules:
        raise CheckpointError(f"{where}: quantization_config is set but no tensor is quantised (no *.weight_scale)")
    info: dict[str, Any] = {"mode": mode, "layers": layers, "experts": sorted(modules), "skipped": {},
                            "format": ct.QUANT_METHOD}
    if mode == "int4":
        info["group_size"], info["group_sizes"] = group_size, group_sizes
    return sd, info, stored


# Hugging Face configs nest ~5 levels (quantization_config.config_groups.group_0.weights.observer_kwargs).
MAX_CONFIG_DEPTH = 32


def json_depth(value: Any) -> int:
    """How deep ``value`` (decoded JSON) nests; iterative, so any depth is measured."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        deepest = max(deepest, d)
        if isinstance(v, dict):
            todo.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            todo.extend((x, d + 1) for x in v)
    return deepest


def hf_model_config(path: Path) -> tuple[dict[str, Any], ModelConfig, list[Path]]:
    """(config.json dict, its ModelConfig, the *.safetensors files) of a Hugging Face directory
    (Llama, DeepSeek-V3, Glm4Moe or Mixtral by ``model_type``); only tensor names are read. Raises
    ``CheckpointError`` naming the file or config.json key."""
    config_file = path / "config.json"
    try:
        hf_config = json.loads(config_file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{config_file} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                              f"{e.start}); config.json must be UTF-8 JSON") from None
    except (OSError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested past Python's stack
        raise CheckpointError(f"{config_file} could not be read: not a JSON config ({error_detail(e)})") from None
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{config_file} holds {type(hf_config).__name__}, not a JSON object")
    depth = json_depth(hf_config)
    if depth > MAX_CONFIG_DEPTH:  # every later reader (repr in a message included) would recurse that deep
        raise CheckpointError(f"{config_file} nests {depth} levels deep; a model config nests a few "
                              f"(at most {MAX_CONFIG_DEPTH} read)")
    from trainforge.model import hf_deepseek, hf_moe  # here: only a Hugging Face directory needs them

    files = sorted(path.glob("*.safetensors"))
    deepseek, moe = hf_deepseek.is_deepseek_v3(hf_config), hf_moe.is_hf_moe(hf_config)
    try:
        if deepseek or moe:
            # transformers' save_pretrained drops the MTP layers but keeps num_nextn_predict_layers:
            # the files say whether there are MTP modules to build.
            cfg = (hf_deepseek if deepseek else hf_moe).model_config_from_hf(hf_config, mtp_weights=_has_layer(
                files, hf_config.get("num_hidden_layers")))
        else:
            cfg = model_config_from_hf(hf_config)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (TypeError, ValueError, AttributeError) as e:  # a value of the wrong type
        kind = "DeepSeek-V3" if deepseek else hf_config.get("model_type") if moe else "Llama"
        raise CheckpointError(f"{config_file} does not describe a {kind} model "
                              f"({error_detail(e)})") from None
    return hf_config, cfg, files


def _load_hf(path: Path, device: torch.device, dtype: torch.dtype, kv_slots: KVSlots | None,
             mapped: bool = False, quantize_to: dict[str, Any] | None = None,
             swap_quantized: SwapQuantized | None = None) -> LoadedModel:
    config_file = path / "config.json"
    from trainforge.model import hf_deepseek, hf_moe

    hf_config, cfg, files = hf_model_config(path)
    deepseek, moe = hf_deepseek.is_deepseek_v3(hf_config), hf_moe.is_hf_moe(hf_config)
    if not mapped or kv_slots is not None:
        _preflight(cfg, device, dtype, kv_slots, quantize_to, "config.json key 'max_position_embeddings'", str(path))
    if not files:
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        raise CheckpointError(f"{path}: no *.safetensors weights" + (f" (found {found}: pickle formats are not "
                              "loaded; convert them with transformers' save_pretrained(safe_serialization=True))"
                              if found else ""))
    sd, _ = _read_safetensors(files, device, mapped)
    layout = hf_deepseek if deepseek else hf_moe if moe else hf_llama
    quantization, stored = None, {}
    if hf_config.get("quantization_config") is not None:
        sd, quantization, stored = _split_compressed(sd, cfg, hf_config, layout, str(config_file))
    try:
        if deepseek:
            sd = hf_deepseek.from_hf_state_dict(sd, cfg, rope_interleave=bool(hf_config.get("rope_interleave", True)))
        else:
            sd = layout.from_hf_state_dict(sd, cfg)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    sd.update(stored)  # the quantised layers' stored form replaces their placeholders
    model = _materialise(cfg, sd, device, dtype, quantization, str(path), kv_slots, swap_quantized)
    tok, eos = None, []
    eos_cfg = hf_config.get("eos_token_id")
    if eos_cfg is not None:
        ids = eos_cfg if isinstance(eos_cfg, list) else [eos_cfg]
        if not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < cfg.vocab_size for e in ids):
            raise CheckpointError(f"{config_file}: eos_token_id {eos_cfg!r:.80} is not a token id (0 to "
                                  f"{cfg.vocab_size - 1}) or list of them")
        eos = list(ids)
    tok_file = path / "tokenizer.json"
    if tok_file.is_file():
        from tokenizers import Tokenizer

        from trainforge.data.tokenizer import _EOS_CANDIDATES

        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises plain Exception subclasses on bad JSON
            raise CheckpointError(f"tokenizer file {tok_file} could not be read ({error_detail(e)})") from None
        eos += [i for i in (tok.token_to_id(t) for t in _EOS_CANDIDATES) if i is not None and i not in eos]
    return LoadedModel(model, tok, tuple(eos), path.name, "huggingface", quantization, path)
