"""Decoder-only transformer for Llama, Qwen2 and Qwen3 checkpoints.

Runs on a flattened varlen token stream: ``T`` tokens from any number of
sequences back to back, each with its own position. Everything except
attention is per token, so sequence boundaries only matter inside the
``AttentionFn`` the caller passes in.

Weights are fused at load time: q/k/v into one ``[Hq*D + 2*Hkv*D, H]``
matrix and gate/up into one ``[2*I, H]`` matrix, so a layer runs four GEMMs.
Parameters use HF checkpoint names only at the ``load_weights`` boundary.

With fused kernels on (:meth:`CausalLM.set_fused_kernels`, the engine's default on
CUDA) a layer runs the Triton kernels of ``kernels/triton/layer_ops.py``: the
residual add rides with the next RMSNorm (a layer returns its output and the
residual separately) and SwiGLU's ``silu(gate) * up`` is one launch; the attention
callable may take the QKV output whole (``AttentionFn.fused``: QK-norm, RoPE, the K
recipe and the KV store in one kernel). A decode step then runs ten kernels per
layer. On the CPU (:meth:`CausalLM.set_cpu_layer_ops`, the engine's default there) the same
fused forward runs each residual add + RMSNorm and SiLU-and-mul as one C call
(``kernels/cpu/layer_ops.py``); off, the torch ops below run unchanged. Either way the attention
callable may take the QKV output whole (the CPU decode kernel of ``kernels/cpu`` does RoPE
itself), and declines (None) where it does not. With ``--quantization gguf`` a decode step's
projections multiply by the GGUF's 4-bit codes (``weight_quant.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from ..parallel.group import SingleGroup, TPGroup
from ..parallel.partition import TPPartition, shard_arch, shard_tensor
from .base import AttentionFn, QKVInput, fused_attention, is_decode_step
from .config import ModelArchConfig
from .rope import RotaryCache, apply_rope
from .weight_quant import PackedWeight, packed_linear, use_packed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in float32, result in ``x.dtype`` (HF semantics)."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """One pre-norm block: attention (fused qkv, GQA, RoPE) then SwiGLU MLP."""

    def __init__(self, arch: ModelArchConfig, layer_id: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.arch, self.layer_id = arch, layer_id
        h, qkv = arch.hidden_size, arch.q_size + 2 * arch.kv_size
        p = lambda *s: _param(*s, dtype=dtype, device=device)  # noqa: E731
        self.input_norm = p(h)
        self.qkv_weight = p(qkv, h)
        self.qkv_bias = p(qkv) if arch.attention_bias else None
        self.q_norm = p(arch.head_dim) if arch.qk_norm else None
        self.k_norm = p(arch.head_dim) if arch.qk_norm else None
        self.o_weight = p(h, arch.q_size)
        self.o_bias = p(h) if arch.o_bias else None
        self.post_norm = p(h)
        self.gate_up_weight = p(2 * arch.intermediate_size, h)
        self.down_weight = p(h, arch.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionFn) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``; cos/sin ``[T, 1, D]`` in x's dtype."""
        a = self.arch
        t = x.shape[0]
        h = rms_norm(x, self.input_norm, a.rms_norm_eps)
        o = self._attend(self._linear(h, "qkv_weight", attn, self.qkv_bias), cos, sin, attn)
        x = x + self.tp_reduce(self._linear(o.reshape(t, a.q_size), "o_weight", attn,
                                            self.o_bias_0))
        h = rms_norm(x, self.post_norm, a.rms_norm_eps)
        gate, up = self._gate_up(h, attn)
        return x + self.tp_reduce(self._linear(F.silu(gate) * up, "down_weight", attn))

    # GGUF codes of the projection weights (``weight_quant.py``, ``--quantization gguf``):
    # parameter name -> packed weight; small CPU decode steps multiply by these
    packed: dict[str, PackedWeight] = {}

    def _linear(self, x: torch.Tensor, attr: str, attn: AttentionFn,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return packed_linear(x, getattr(self, attr), self.packed.get(attr), bias,
                             is_decode_step(attn))

    # tensor parallelism (services/parallel): row-parallel outputs are summed over the ranks,
    # and a bias is added by rank 0 only; with one rank both are free
    tp = SingleGroup()

    def tp_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp.size == 1 else self.tp.all_reduce(x)

    @property
    def o_bias_0(self) -> torch.Tensor | None:
        return self.o_bias if self.tp.rank == 0 else None

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, attn: AttentionFn, cpu_ops: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` on the fused kernels: ``(x, residual)`` ``[T, H]`` -> the MLP's
        output and the residual before it (their sum is what :meth:`forward` returns);
        ``residual`` None in the first layer. The Triton kernels, or with ``cpu_ops`` the C
        ops of ``kernels/cpu/layer_ops.py`` (:meth:`_forward_cpu`)."""
        if cpu_ops:
            return self._forward_cpu(x, residual, cos, sin, attn)
        from nibble.kernels.triton.layer_ops import add_rms_norm, silu_mul
        a = self.arch
        t = x.shape[0]
        h, residual = add_rms_norm(x, residual, self.input_norm, a.rms_norm_eps)
        o = self._attend(self._linear(h, "qkv_weight", attn, self.qkv_bias), cos, sin, attn)
        o = self.tp_reduce(self._linear(o.reshape(t, a.q_size), "o_weight", attn,
                                        self.o_bias_0))
        h, residual = add_rms_norm(o, residual, self.post_norm, a.rms_norm_eps)
        return self.tp_reduce(F.linear(silu_mul(F.linear(h, self.gate_up_weight)),
                                       self.down_weight)), residual

    def _forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                     sin: torch.Tensor, attn: AttentionFn) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_fused` on the CPU's C ops. Where a projection multiplies the GGUF
        codes (bf16 rows, ``weight_quant.py``), the op before it writes bf16 and the op after
        it reads the bf16 product: in a float32 model these are the values that converting
        around the projection gives, without the conversions (and the residual stays float32).
        """
        from nibble.kernels.cpu.layer_ops import add_rms_norm, silu_mul
        a = self.arch
        t = x.shape[0]
        dec = is_decode_step(attn)
        bf16 = lambda attr: self._packed_rows(attr, x, dec)  # noqa: E731
        h, residual = add_rms_norm(x, residual, self.input_norm, a.rms_norm_eps,
                                   out_dtype=bf16("qkv_weight"))
        o = self._attend(self._linear(h, "qkv_weight", attn, self.qkv_bias), cos, sin, attn,
                         bf16("o_weight"))
        o = self.tp_reduce(self._linear(o.reshape(t, a.q_size), "o_weight", attn,
                                        self.o_bias_0))
        h, residual = add_rms_norm(o, residual, self.post_norm, a.rms_norm_eps,
                                   out_dtype=bf16("gate_up_weight"))
        gate, up = self._gate_up(h, attn)
        act = silu_mul(gate, up, out_dtype=bf16("down_weight"))
        return self.tp_reduce(self._linear(act, "down_weight", attn)), residual

    def _packed_rows(self, attr: str, x: torch.Tensor, decode: bool) -> torch.dtype | None:
        """bf16 where ``attr``'s projection multiplies its packed codes for ``x``'s rows (so
        the op before it may write bf16), else None: the model's dtype. One rank only: a
        tensor-parallel sum stays in the model's dtype."""
        if self.tp.size == 1 and use_packed(self.packed.get(attr), x, decode):
            return torch.bfloat16
        return None

    def _gate_up(self, h: torch.Tensor, attn: AttentionFn) -> tuple[torch.Tensor, torch.Tensor]:
        """``silu``'s and ``up``'s inputs ``[T, I]`` from ``h [T, H]``. A small CPU batch (a
        decode step) runs them as two GEMMs over the fused weight's halves: BLAS runs the
        ``[I, H]`` shape at 8 rows about 1.3x faster per byte than the ``[2I, H]`` one (the
        values are the same, bit for bit, as those of the fused GEMM's halves)."""
        if use_packed(self.packed.get("gate_up_weight"), h, is_decode_step(attn)):
            return self._linear(h, "gate_up_weight", attn).chunk(2, dim=-1)
        if h.device.type == "cpu" and h.shape[0] <= 64:
            i = self.arch.intermediate_size
            return F.linear(h, self.gate_up_weight[:i]), F.linear(h, self.gate_up_weight[i:])
        return F.linear(h, self.gate_up_weight).chunk(2, dim=-1)

    def _attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionFn, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[T, Hq, D]`` attention output from the QKV projection's output: the attention's
        fused entry where it takes the step (the Triton kernels on CUDA, the C decode on CPU;
        it may honour ``out_dtype``), else the torch QK-norm and RoPE below and ``attn`` in
        the model's dtype (``qkv`` may be a bf16 product in a float32 model)."""
        a = self.arch
        o = fused_attention(attn, self.layer_id, QKVInput(
            qkv, a.num_heads, a.num_kv_heads, a.head_dim, cos, sin, self.q_norm, self.k_norm,
            a.rms_norm_eps, out_dtype))
        if o is not None:
            return o
        return self._attention(qkv if qkv.dtype == cos.dtype else qkv.to(cos.dtype), cos, sin,
                               attn)

    def _attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attn: AttentionFn) -> torch.Tensor:
        """The unfused attention inputs (torch QK-norm and RoPE) from ``qkv``, then ``attn``."""
        a = self.arch
        t = qkv.shape[0]
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = q.view(t, a.num_heads, a.head_dim)
        k = k.view(t, a.num_kv_heads, a.head_dim)
        v = v.view(t, a.num_kv_heads, a.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, a.rms_norm_eps)
            k = rms_norm(k, self.k_norm, a.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return attn(self.layer_id, q, k, v.contiguous())


# HF checkpoint name -> (our parameter path, fused part index or None).
_LAYER_MAP = {
    "input_layernorm.weight": ("input_norm", None),
    "post_attention_layernorm.weight": ("post_norm", None),
    "self_attn.q_proj.weight": ("qkv_weight", 0),
    "self_attn.k_proj.weight": ("qkv_weight", 1),
    "self_attn.v_proj.weight": ("qkv_weight", 2),
    "self_attn.q_proj.bias": ("qkv_bias", 0),
    "self_attn.k_proj.bias": ("qkv_bias", 1),
    "self_attn.v_proj.bias": ("qkv_bias", 2),
    "self_attn.q_norm.weight": ("q_norm", None),
    "self_attn.k_norm.weight": ("k_norm", None),
    "self_attn.o_proj.weight": ("o_weight", None),
    "self_attn.o_proj.bias": ("o_bias", None),
    "mlp.gate_proj.weight": ("gate_up_weight", 0),
    "mlp.up_proj.weight": ("gate_up_weight", 1),
    "mlp.down_proj.weight": ("down_weight", None),
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 causal LM with parameters allocated (uninitialized) up front.

    Build with ``CausalLM(arch, dtype, device)``, then ``load_weights`` with HF
    names and ``finish_loading`` (checks completeness, ties the LM head).
    Subclasses for other families (``gemma3.py``) swap ``layer_cls`` and
    ``layer_map`` (HF name in a layer -> parameter, fused part).
    """

    layer_cls: type[nn.Module] = DecoderLayer
    layer_map: dict[str, tuple[str, int | None]] = _LAYER_MAP
    takes_packed_weights = True      # its layers multiply through weight_quant.packed_linear

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup | None = None):
        super().__init__()
        device = torch.device(device)
        self.tp = tp or SingleGroup()
        self.partition = TPPartition(arch, self.tp.size, self.tp.rank)
        arch = shard_arch(self.partition)          # this rank's heads and MLP channels
        self.arch, self.dtype = arch, dtype
        rows = self.partition.vocab_per_rank       # the last rank's padding rows stay zero
        self.embed = _param(rows, arch.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(self.layer_cls(arch, i, dtype, device)
                                    for i in range(arch.num_layers))
        for layer in self.layers:
            layer.tp = self.tp
        self.norm = _param(arch.hidden_size, dtype=dtype, device=device)
        self.lm_head = (self.embed if arch.tie_word_embeddings
                        else _param(rows, arch.hidden_size, dtype=dtype, device=device))
        if self.tp.size > 1:
            with torch.no_grad():
                self.embed.zero_()
                self.lm_head.zero_()
        self.rope = RotaryCache(arch)
        self.fused_kernels = False
        self.cpu_layer_ops = False
        self.packed_lm_head: PackedWeight | None = None   # weight_quant.py
        self._loaded: set[tuple[str, int | None]] = set()

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def reserve_positions(self, length: int) -> None:
        """Grow every RoPE table of the model to cover positions ``[0, length)`` on its
        device now (before CUDA graphs capture lookups into them)."""
        for table in vars(self).values():
            if isinstance(table, RotaryCache):
                table.ensure(length, self.device)

    def set_fused_kernels(self, enabled: bool) -> None:
        """Run the layers on the fused Triton kernels (see the module docstring); they run
        on CUDA, and on CPU only under Triton's interpreter (tests)."""
        self.fused_kernels = enabled

    def set_cpu_layer_ops(self, enabled: bool) -> None:
        """Run a CPU model's residual adds and RMSNorms as one C call each
        (``kernels/cpu/layer_ops.py``, the engine's CPU default), where the C library builds
        and the dtype is float32 or bfloat16."""
        from nibble.kernels.cpu import layer_ops
        self.cpu_layer_ops = bool(enabled and self.device.type == "cpu" and self.dtype in (
            torch.float32, torch.bfloat16) and layer_ops.available())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionFn, num_positions: int | None = None) -> torch.Tensor:
        """Run all layers on a varlen token stream.

        Args:
            input_ids: ``[T]`` int64 token ids, sequences back to back.
            positions: ``[T]`` int64 position of each token within its sequence.
            attn: attention callable (see ``AttentionFn``).
            num_positions: a host-known bound (exclusive) on ``positions``: the RoPE tables
                are sized from it, not by reading ``positions`` back (a device sync).

        Returns:
            ``[T, hidden]`` final-normed hidden states in the model dtype; feed
            the rows to sample from into ``compute_logits``.
        """
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope.lookup(positions, x.dtype, num_positions)
        if self.fused_kernels or self.cpu_layer_ops:
            cpu_ops = not self.fused_kernels
            if cpu_ops:
                from nibble.kernels.cpu.layer_ops import add_rms_norm
            else:
                from nibble.kernels.triton.layer_ops import add_rms_norm
            residual = None
            for layer in self.layers:
                x, residual = layer.forward_fused(x, residual, cos, sin, attn, cpu_ops)
            return add_rms_norm(x, residual, self.norm, self.arch.rms_norm_eps)[0]
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return rms_norm(x, self.norm, self.arch.rms_norm_eps)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden]``; over TP, each rank looks up its vocabulary rows
        (zeros elsewhere) and the ranks sum."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed)
        start = self.partition.vocab.start
        local = input_ids - start
        mine = (local >= 0) & (local < len(self.partition.vocab))
        x = F.embedding(local.clamp(0, self.embed.shape[0] - 1), self.embed)
        return self.tp.all_reduce(x * mine.unsqueeze(1).to(x.dtype))

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Each rank's ``[N, vocab/size]`` logits -> the full ``[N, vocab]`` on every rank."""
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits.contiguous())[:, :self.arch.vocab_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden]`` (from ``forward``) -> logits ``[N, vocab]`` float32."""
        return self.gather_vocab(packed_linear(hidden, self.lm_head, self.packed_lm_head).float())

    # ----------------------------------------------------------------- loading

    def _target(self, name: str) -> tuple[nn.Parameter | None, int | None, str]:
        if name == "model.embed_tokens.weight":
            return self.embed, None, "embed"
        if name == "model.norm.weight":
            return self.norm, None, "norm"
        if name == "lm_head.weight":
            return (None if self.arch.tie_word_embeddings else self.lm_head), None, "lm_head"
        m = _LAYER_RE.fullmatch(name)
        if m and int(m.group(1)) < self.arch.num_layers and m.group(2) in self.layer_map:
            attr, part = self.layer_map[m.group(2)]
            param = getattr(self.layers[int(m.group(1))], attr)
            if param is not None:
                return param, part, f"layers.{m.group(1)}.{attr}"
        raise ModelLoadError(f"unexpected tensor {name!r} for a {self.arch.arch} model")

    def _part_slice(self, key: str, part: int | None, size: int) -> slice:
        a = self.arch
        if key in ("embed", "lm_head"):
            return slice(0, len(self.partition.vocab))
        if part is None:
            return slice(0, size)
        if key.endswith("gate_up_weight"):
            return slice(part * a.intermediate_size, (part + 1) * a.intermediate_size)
        starts = (0, a.q_size, a.q_size + a.kv_size, a.q_size + 2 * a.kv_size)
        return slice(starts[part], starts[part + 1])

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters, casting to the model dtype.

        A tied ``lm_head.weight`` is skipped; rotary ``inv_freq`` buffers are ignored.
        Raises ``ModelLoadError`` for an unknown name or a shape mismatch.
        """
        for name, tensor in weights:
            if _IGNORED.fullmatch(name):
                continue
            param, part, key = self._target(name)
            if param is None:
                continue
            tensor = shard_tensor(self.partition, key, part, tensor)
            sl = self._part_slice(key, part, param.shape[0])
            dst = param[sl]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            self._loaded.add((key, part))

    def finish_loading(self) -> None:
        """Check every parameter (and every fused part) was loaded; release the tracking set."""
        missing = []
        for key, _ in self.named_parameters():  # a tied lm_head is listed once, as "embed"
            parts = (0, 1, 2) if "qkv" in key else (0, 1) if "gate_up" in key else (None,)
            missing += [f"{key}[{p}]" if p is not None else key
                        for p in parts if (key, p) not in self._loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors: {shown}")
        self._loaded.clear()
        self.eval()
