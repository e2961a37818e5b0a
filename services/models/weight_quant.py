"""GGUF block-quantized weights kept as codes for small CPU batches (``--quantization gguf``).

A GGUF checkpoint's Q4_0 / Q4_1 projection weights (and a Q8_0 or 4-bit LM head) are packed
once at load time for ``kernels/cpu/int4_linear.py``. A decode step of at most
``PACKED_MAX_ROWS`` sequences multiplies by the packed codes and reads about a quarter of the
bytes of a bf16 weight; other steps (any with a prompt in it) keep the dense bf16 GEMM, which is
faster there, over the dense copy the loader filled as before. The rule is the step's kind, not
its row count, so that a prompt's rows take the same arithmetic whether the prefix cache holds
most of it (a short extend) or not (greedy answers then match). The packed weights are exactly
the file's: the dense copy is checked against them when they are built. The LM head, which
runs on the sampled rows only, takes its codes for up to ``PACKED_MAX_ROWS`` rows.

The codes follow the model's fused parameters: ``qkv_weight`` = q, k, v rows (q and k in the
HF row order, see ``gguf_file.unpermute_rows``), ``gate_up_weight`` = gate, up rows. A fused
weight is packed only when every part is a 4-bit block type; the others stay dense.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nibble.kernels.cpu.int4_linear import (ROW_MULTIPLE, Int4Weight, Int8Weight, dequant_ref,
                                            int4_linear, int8_linear, pack_int4, pack_int8)

from ..errors import ModelLoadError
from . import gguf_file
from .gguf_file import BlockCodes, GGUFFile

log = logging.getLogger(__name__)

# Rows (tokens in a step) up to which the packed codes beat the dense bf16 GEMM on the CPU
# (docs/benchmarks.md, "GGUF weights on the CPU"): the int4 kernel's cost grows per row.
PACKED_MAX_ROWS = 8
_PARTS = {"qkv_weight": 3, "gate_up_weight": 2}

PackedWeight = Int4Weight | Int8Weight


@dataclass(frozen=True)
class PackSummary:
    """What :func:`pack_gguf_weights` packed."""
    packed: int          # fused weights packed (lm head included)
    dense: int           # projection weights left dense (a part of another type)
    nbytes: int          # bytes of the packed codes and group parameters


_DTYPES = (torch.float32, torch.bfloat16)


def use_packed(packed: PackedWeight | None, x: torch.Tensor, step_ok: bool = True) -> bool:
    """Whether ``x [M, K]`` goes through ``packed``: ``step_ok`` (the caller's rule, e.g. a
    decode step) and a float32 or bf16 CPU input of at most ``PACKED_MAX_ROWS`` rows."""
    return (step_ok and packed is not None and x.shape[0] <= PACKED_MAX_ROWS
            and x.dtype in _DTYPES and x.is_cpu)


def packed_linear(x: torch.Tensor, dense: torch.Tensor, packed: PackedWeight | None,
                  bias: torch.Tensor | None = None, step_ok: bool = True) -> torch.Tensor:
    """``F.linear(x, dense, bias)``, over the packed codes where :func:`use_packed` says so.

    The kernel multiplies bf16 rows: a float32 model's rows are rounded to bf16 on the way
    in and its products come back as float32 (a bf16 product widened; the LM head's two
    planes summed in float32)."""
    if not use_packed(packed, x, step_ok):
        return F.linear(x, dense, bias)
    xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    if isinstance(packed, Int8Weight):
        y = int8_linear(xb, packed, x.dtype)
    else:
        y = int4_linear(xb, packed)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y if bias is None else y + bias


def pack_gguf_weights(model: torch.nn.Module, f: GGUFFile) -> PackSummary:
    """Pack ``model``'s projection weights (and LM head) from the GGUF ``f`` it was loaded
    from: each layer's ``packed`` dict and the model's ``packed_lm_head``.

    Raises ``ModelLoadError`` if a packed weight differs from the dense parameter it
    stands for (a row order or a part boundary gone wrong).
    """
    arch = model.arch
    if not model.takes_packed_weights:
        log.info("%s runs its own layers: its GGUF weights stay dense", type(model).__name__)
        return PackSummary(0, 0, 0)
    if model.tp.size != 1:
        raise ModelLoadError("--quantization gguf runs on one rank (no tensor parallelism)")
    parts: dict[tuple[int, str], dict[int, BlockCodes]] = {}
    head: BlockCodes | None = None
    for t in f.tensors:
        name = gguf_file.hf_name(t.name, arch.arch)
        if name is None:
            continue
        tied = arch.tie_word_embeddings and name == "model.embed_tokens.weight"
        if name == "lm_head.weight" or tied:
            head = gguf_file.block_codes(t)
            continue
        target = _layer_target(model, name)
        if target is None:
            continue
        blocks = gguf_file.block_codes(t)
        if blocks is not None and (blocks.offset is not None):
            heads = {"q_proj": arch.num_heads, "k_proj": arch.num_kv_heads}
            n = next((h for p, h in heads.items() if f".{p}." in name), None)
            if arch.arch == "llama" and n is not None:
                blocks = _unpermute(blocks, n)
            parts.setdefault(target[:2], {})[target[2]] = blocks
        else:
            parts.setdefault(target[:2], {})
    packed = dense = nbytes = 0
    for (layer_id, attr), got in parts.items():
        rows = sum(b.codes.shape[0] for b in got.values())
        if len(got) != _PARTS.get(attr, 1) or rows % ROW_MULTIPLE:
            dense += 1
            continue
        merged = _concat([got[i] for i in sorted(got)])
        layer = model.layers[layer_id]
        _check_dense(merged, getattr(layer, attr), f"layers.{layer_id}.{attr}")
        layer.packed = {**layer.packed, attr: pack_int4(merged.codes, merged.scale, merged.offset)}
        packed += 1
        nbytes += layer.packed[attr].nbytes
    if head is not None and head.codes.shape[0] % ROW_MULTIPLE == 0:
        _check_dense(head, model.lm_head, "lm_head")
        model.packed_lm_head = (pack_int8(head.codes, head.scale) if head.offset is None
                                else pack_int4(head.codes, head.scale, head.offset))
        packed += 1
        nbytes += model.packed_lm_head.nbytes
    log.info("GGUF weights packed for the CPU: %d weights (%.1f MiB), %d left dense",
             packed, nbytes / 2**20, dense)
    return PackSummary(packed, dense, nbytes)


def _layer_target(model, name: str) -> tuple[int, str, int] | None:
    """``(layer, fused attribute, part)`` of a projection weight's HF name, else None."""
    prefix = "model.layers."
    if not name.startswith(prefix) or not name.endswith("_proj.weight"):
        return None
    layer, rest = name[len(prefix):].split(".", 1)
    attr, part = model.layer_map.get(rest, (None, None))
    if attr is None or int(layer) >= len(model.layers):
        return None
    return int(layer), attr, 0 if part is None else part


def _unpermute(b: BlockCodes, n_heads: int) -> BlockCodes:
    return BlockCodes(gguf_file.unpermute_rows(b.codes, n_heads),
                      gguf_file.unpermute_rows(b.scale, n_heads),
                      gguf_file.unpermute_rows(b.offset, n_heads))


def _concat(blocks: list[BlockCodes]) -> BlockCodes:
    if len(blocks) == 1:
        return blocks[0]
    return BlockCodes(torch.cat([b.codes for b in blocks]), torch.cat([b.scale for b in blocks]),
                      torch.cat([b.offset for b in blocks]))


def _check_dense(b: BlockCodes, dense: torch.Tensor, name: str) -> None:
    """A few rows of the codes, dequantized, must equal the dense parameter (rows 1 and n - 2
    move under llama.cpp's Q/K row order; the first and last do not)."""
    n = b.codes.shape[0]
    rows = sorted({0, 1, n // 3, n // 2 + 1, n - 2, n - 1} & set(range(n)))
    w = dequant_ref(b.codes[rows], b.scale[rows], None if b.offset is None else b.offset[rows])
    if tuple(b.codes.shape) != tuple(dense.shape) or not torch.equal(
            w.to(dense.dtype), dense.detach()[rows].cpu()):
        raise ModelLoadError(f"packed GGUF weight {name} does not match its dense parameter")


QUANTIZATIONS = ("auto", "none", "gguf")
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> list[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), where the bf16
    GEMMs that prefill runs beside the packed codes are fast."""
    return _has_native_bf16(cpu_flags())


def _has_native_bf16(flags: list[str]) -> bool:
    return any(flag in flags for flag in _BF16_FLAGS)


def cpu_has_vector_int4() -> bool:
    """Whether torch's CPU int4 kernel runs vectorized here: x86 with AVX2 (every CPU with
    hardware bf16 has it). Without hardware bf16 it converts the bf16 rows to float32 in
    registers, still about 3x the dense float32 step of the default model
    (docs/benchmarks.md); elsewhere (other architectures) it is not measured, so ``auto``
    keeps the dense weights."""
    flags = cpu_flags()
    return "avx2" in flags or _has_native_bf16(flags)


def has_4bit_blocks(path: str) -> bool:
    """Whether the GGUF file ``path`` holds any Q4_0 / Q4_1 tensor."""
    return any(gguf_file.is_4bit_block(t) for t in GGUFFile(path).tensors)


def resolve_quantization(requested: str, dtype: str, device: torch.device, tp_size: int,
                         gguf_path: str | None) -> tuple[str, str]:
    """``(quantization, dtype name)`` from ``--quantization`` and ``--dtype``.

    ``auto`` packs a GGUF checkpoint's 4-bit weights where that pays: one CPU rank, a CPU on
    which the int4 kernel is vectorized (AVX2 or hardware bf16), a float32 or bfloat16 model.
    ``gguf`` asks for it and raises ``ValueError`` (why) where it cannot run. The model dtype
    is left as it is: a float32 model keeps float32 activations, KV and prompt GEMMs, and
    rounds only a decode step's projection inputs to bf16 for the kernel.
    ``gguf_path`` is the checkpoint's GGUF file, None for other checkpoints.
    """
    if requested not in QUANTIZATIONS:
        raise ValueError(f"unknown --quantization {requested!r} (choices: {QUANTIZATIONS})")
    reasons = [why for bad, why in (
        (device.type != "cpu", f"it runs on the CPU, not {device.type}"),
        (tp_size != 1, "it runs on one rank (--tp-size 1)"),
        (dtype == "float16", "its kernel takes float32 or bfloat16 rows, not float16"),
        (gguf_path is None, "the checkpoint is not a GGUF file"),
    ) if bad]
    if requested == "gguf":
        if reasons:
            raise ValueError("--quantization gguf cannot run here: " + "; ".join(reasons))
        return "gguf", dtype
    if requested == "auto" and not reasons and cpu_has_vector_int4() and has_4bit_blocks(
            gguf_path):
        return "gguf", dtype
    return "none", dtype
