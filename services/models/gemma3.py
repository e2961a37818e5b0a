"""Gemma 3 (text) on the varlen token stream of ``CausalLM``.

Differences from Llama, all per token except the sliding window:

* the embedding is multiplied by ``sqrt(hidden_size)`` rounded to the model dtype;
* every RMSNorm scales by ``1 + weight`` (statistics and gain in float32);
* q and k get a per-head RMSNorm (QK-norm) before RoPE;
* four norms per layer: input, post-attention (on the attention output),
  pre-feedforward and post-feedforward (on the MLP output);
* the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``;
* the softmax scale is ``query_pre_attn_scalar ** -0.5``;
* sliding-window layers use RoPE base ``rope_local_theta`` (unscaled), global
  layers ``rope_theta`` with the checkpoint's scaling;
* optional final logit soft-capping; the LM head is tied to the embedding.

The sliding window itself (``ModelArchConfig.sliding_windows``) is the
attention backend's business: the model only picks each layer's RoPE table.
Parameters hold HF values (the raw norm weight ``w``, not ``1 + w``); GGUF
files store ``1 + w`` and ``gguf_file.iter_weights`` subtracts the 1.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from .base import AttentionFn
from .config import ModelArchConfig
from ..parallel.group import TPGroup
from .llama import _LAYER_MAP, CausalLM, DecoderLayer, _param
from .rope import RotaryCache, apply_rope


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with gain ``1 + weight``, in float32; result in ``x.dtype``."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    """Attention (fused qkv, GQA, QK-norm, RoPE) and GeGLU MLP, each sandwiched by two norms."""

    def __init__(self, arch: ModelArchConfig, layer_id: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        if arch.attention_bias:
            raise ModelLoadError("Gemma 3 with attention_bias=True is not supported")
        self.arch, self.layer_id = arch, layer_id
        self.window = arch.sliding_windows[layer_id] if arch.sliding_windows else None
        h, qkv = arch.hidden_size, arch.q_size + 2 * arch.kv_size
        p = lambda *s: _param(*s, dtype=dtype, device=device)  # noqa: E731
        self.input_norm = p(h)
        self.qkv_weight = p(qkv, h)
        self.q_norm = p(arch.head_dim)
        self.k_norm = p(arch.head_dim)
        self.o_weight = p(h, arch.q_size)
        self.post_attn_norm = p(h)
        self.pre_ffn_norm = p(h)
        self.gate_up_weight = p(2 * arch.intermediate_size, h)
        self.down_weight = p(h, arch.intermediate_size)
        self.post_ffn_norm = p(h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionFn) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``; cos/sin ``[T, 1, D]`` of this layer's RoPE, in x's dtype."""
        a, eps = self.arch, self.arch.rms_norm_eps
        t = x.shape[0]
        h = gemma_rms_norm(x, self.input_norm, eps)
        q, k, v = F.linear(h, self.qkv_weight).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = gemma_rms_norm(q.view(t, a.num_heads, a.head_dim), self.q_norm, eps)
        k = gemma_rms_norm(k.view(t, a.num_kv_heads, a.head_dim), self.k_norm, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn(self.layer_id, q, k, v.reshape(t, a.num_kv_heads, a.head_dim).contiguous())
        o = self.tp_reduce(F.linear(o.reshape(t, a.q_size), self.o_weight))
        x = x + gemma_rms_norm(o, self.post_attn_norm, eps)
        h = gemma_rms_norm(x, self.pre_ffn_norm, eps)
        gate, up = F.linear(h, self.gate_up_weight).chunk(2, dim=-1)
        h = self.tp_reduce(F.linear(F.gelu(gate, approximate="tanh") * up, self.down_weight))
        return x + gemma_rms_norm(h, self.post_ffn_norm, eps)

    tp = DecoderLayer.tp                  # tensor parallelism: as in llama.py
    tp_reduce = DecoderLayer.tp_reduce


_GEMMA3_LAYER_MAP = {
    **{k: v for k, v in _LAYER_MAP.items() if "bias" not in k},
    "post_attention_layernorm.weight": ("post_attn_norm", None),
    "pre_feedforward_layernorm.weight": ("pre_ffn_norm", None),
    "post_feedforward_layernorm.weight": ("post_ffn_norm", None),
}


class Gemma3CausalLM(CausalLM):
    """Gemma 3 text model; loads HF names like ``CausalLM`` (see the module docstring)."""

    layer_cls = Gemma3DecoderLayer
    takes_packed_weights = False     # its layers call F.linear (weight_quant.py)
    layer_map = _GEMMA3_LAYER_MAP

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup | None = None):
        if arch.arch != "gemma3":
            raise ModelLoadError(f"Gemma3CausalLM cannot build a {arch.arch!r} model")
        super().__init__(arch, dtype, device, tp)
        local = dataclasses.replace(arch, rope_theta=arch.rope_local_theta or arch.rope_theta,
                                    rope_scaling=None)
        self.rope_local = RotaryCache(local)
        # sqrt(hidden) rounded to the model dtype, as HF multiplies by a tensor of that dtype.
        self.embed_scale = float(torch.tensor(arch.hidden_size ** 0.5, dtype=dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionFn, num_positions: int | None = None) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` int64 -> final-normed hidden ``[T, hidden]``.

        Same contract as :meth:`CausalLM.forward`.
        """
        x = self.embed_tokens(input_ids) * self.embed_scale
        tables = {False: self.rope.lookup(positions, x.dtype, num_positions)}
        if self.arch.has_sliding_window:
            tables[True] = self.rope_local.lookup(positions, x.dtype, num_positions)
        for layer in self.layers:
            cos, sin = tables[layer.window is not None]
            x = layer(x, cos, sin, attn)
        return gemma_rms_norm(x, self.norm, self.arch.rms_norm_eps)

    def set_fused_kernels(self, enabled: bool) -> None:
        """Gemma 3's layers (four norms, GeGLU) have no fused path: the torch ops always run."""
        self.fused_kernels = False

    def set_cpu_layer_ops(self, enabled: bool) -> None:
        """Nor a C path: Gemma 3's norms scale by ``1 + w`` around each sublayer."""
        self.cpu_layer_ops = False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` -> float32 logits ``[N, vocab]``, soft-capped if configured."""
        logits = self.gather_vocab(F.linear(hidden, self.lm_head).float())
        cap = self.arch.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
