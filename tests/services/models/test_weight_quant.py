"""``--quantization gguf``: the default model's Q4_1 / Q8_0 codes packed for small CPU steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nibble.kernels.cpu.int4_linear import Int4Weight, Int8Weight
from nibble.services.config import DeviceConfig, ModelConfig, NibbleConfig
from nibble.services.engine.builder import resolve_weights
from nibble.services.errors import ConfigError, ModelLoadError
from nibble.services.models import default_model_path, load_model
from nibble.services.models import weight_quant
from nibble.services.models.gguf_file import GGUFFile, block_codes

from .conftest import VarlenCausalAttention

try:
    GGUF_PATH = default_model_path()
except ModelLoadError as e:
    pytest.skip(f"embedded model not installed: {e}", allow_module_level=True)

CPU = torch.device("cpu")


class _Step:
    """An ``AttentionFn`` stand-in that states the step's kind (models/base.is_decode_step)."""

    def __init__(self, decode_only: bool, inner=None):
        self.decode_only, self.inner = decode_only, inner

    def __call__(self, *args):
        return self.inner(*args)


DECODE, PROMPT = _Step(True), _Step(False)
ATTRS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


@pytest.fixture(scope="module")
def packed():
    return load_model(None, torch.bfloat16, CPU, quantization="gguf")


@pytest.fixture(scope="module")
def fp32():
    return load_model(None, torch.float32, CPU)


def test_every_projection_and_the_head_packed(packed, fp32):
    m = packed.model
    for layer in m.layers:
        assert sorted(layer.packed) == sorted(ATTRS)
        assert all(isinstance(w, Int4Weight) for w in layer.packed.values())
    assert isinstance(m.packed_lm_head, Int8Weight)            # the tied Q8_0 embedding
    assert m.layers[0].packed["qkv_weight"].out_features == 576 + 2 * 192
    # other arithmetic, other KV: the cache namespace differs from the dense model's
    dense_bf16 = load_model(None, torch.bfloat16, CPU)
    assert packed.fingerprint != dense_bf16.fingerprint


def test_block_codes_are_the_files_values():
    f = GGUFFile(GGUF_PATH)
    for t in f.tensors[:6]:
        b = block_codes(t)
        if b is None:
            continue
        n, k = b.codes.shape
        w = b.codes.float().view(n, k // 32, 32) * b.scale[..., None]
        if b.offset is not None:
            w = w + b.offset[..., None]
        assert torch.equal(w.view(n, k), f.dequantize(t)), t.name


def _layer_errors(packed, fp32, attr, layer_id):
    torch.manual_seed(layer_id)
    exact = getattr(fp32.model.layers[layer_id], attr)
    x = torch.randn(3, exact.shape[1]).to(torch.bfloat16)
    ref = x.float() @ exact.t()
    y = packed.model.layers[layer_id]._linear(x, attr, DECODE).float()
    dense = F.linear(x, getattr(packed.model.layers[layer_id], attr)).float()
    return (y - ref).norm() / ref.norm(), (dense - ref).norm() / ref.norm()


@pytest.mark.parametrize("attr", ATTRS)
def test_packed_products_as_close_as_bf16_weights(packed, fp32, attr):
    for layer_id in (0, 29):
        err, dense_err = _layer_errors(packed, fp32, attr, layer_id)
        # bf16 group parameters cost about what bf16 weights do; a row or part out of
        # order would be off by the whole product (error ~1)
        assert err < 3 * dense_err + 1e-3, (layer_id, err, dense_err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_of_a_short_prompt(packed, fp32, dtype):
    lm = packed if dtype == torch.bfloat16 else load_model(None, dtype, CPU, quantization="gguf")
    ids = torch.tensor([1, 9690, 198, 2683, 359, 253])      # 6 rows, stated a decode step
    pos = torch.arange(6)
    attn = VarlenCausalAttention(lm.arch.sm_scale)
    with torch.no_grad():
        hidden = lm.model(ids, pos, _Step(True, attn))
        q = lm.model.compute_logits(hidden)
        r = fp32.model.compute_logits(fp32.model(ids, pos, attn))
    assert hidden.dtype == dtype
    assert (q.argmax(-1) == r.argmax(-1)).float().mean() >= 5 / 6
    assert 0 < (q - r).abs().max() / r.abs().max() < 0.05      # the codes ran, and closely


def test_prompts_and_large_steps_use_the_dense_weight(packed):
    layer = packed.model.layers[3]
    x = torch.randn(weight_quant.PACKED_MAX_ROWS + 1, 576).to(torch.bfloat16)
    assert torch.equal(layer._linear(x, "o_weight", DECODE), F.linear(x, layer.o_weight))
    small = x[:2]
    assert torch.equal(layer._linear(small, "o_weight", PROMPT), F.linear(small, layer.o_weight))
    assert not torch.equal(layer._linear(small, "o_weight", DECODE),
                           F.linear(small, layer.o_weight))


def test_a_wrong_row_order_is_refused(monkeypatch):
    monkeypatch.setattr(weight_quant, "_unpermute", lambda b, n: b)
    with pytest.raises(ModelLoadError, match="does not match"):
        load_model(None, torch.bfloat16, CPU, quantization="gguf")


def test_load_refuses_what_it_cannot_pack():
    with pytest.raises(ModelLoadError, match="float32 or bf16 models on the CPU"):
        load_model(None, torch.float16, CPU, quantization="gguf")
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_model(None, torch.bfloat16, CPU, quantization="int3")


def test_resolution(monkeypatch):
    resolve = weight_quant.resolve_quantization
    monkeypatch.setattr(weight_quant, "cpu_has_native_bf16", lambda: True)
    assert resolve("auto", "auto", CPU, 1, GGUF_PATH) == ("gguf", "auto")
    assert resolve("auto", "float32", CPU, 1, GGUF_PATH) == ("gguf", "float32")
    assert resolve("auto", "float16", CPU, 1, GGUF_PATH) == ("none", "float16")
    assert resolve("auto", "auto", CPU, 2, GGUF_PATH) == ("none", "auto")
    assert resolve("auto", "auto", CPU, 1, None) == ("none", "auto")
    assert resolve("none", "auto", CPU, 1, GGUF_PATH) == ("none", "auto")
    assert resolve("gguf", "bfloat16", CPU, 1, GGUF_PATH) == ("gguf", "bfloat16")
    monkeypatch.setattr(weight_quant, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(weight_quant, "cpu_flags", lambda: ["fma", "avx2"])
    assert resolve("auto", "auto", CPU, 1, GGUF_PATH) == ("gguf", "auto")    # AVX2 EPYC
    monkeypatch.setattr(weight_quant, "cpu_flags", lambda: ["asimd"])       # not measured
    assert resolve("auto", "auto", CPU, 1, GGUF_PATH) == ("none", "auto")
    assert resolve("gguf", "auto", CPU, 1, GGUF_PATH) == ("gguf", "auto")   # asked for
    for args, why in [(("float16", CPU, 1, GGUF_PATH), "not float16"),
                      (("auto", torch.device("cuda"), 1, GGUF_PATH), "not cuda"),
                      (("auto", CPU, 2, GGUF_PATH), "one rank"),
                      (("auto", CPU, 1, None), "not a GGUF")]:
        with pytest.raises(ValueError, match=why):
            resolve("gguf", *args)


def test_the_config_flag_reaches_the_loader():
    cfg = NibbleConfig(model=ModelConfig(quantization="gguf", dtype="float16"),
                       device=DeviceConfig(device="cpu"))
    with pytest.raises(ConfigError, match="not float16"):
        resolve_weights(cfg, CPU)
    cfg = NibbleConfig(model=ModelConfig(quantization="none"), device=DeviceConfig(device="cpu"))
    assert resolve_weights(cfg, CPU) == ("none", torch.float32)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_without_hardware_bf16_is_warned_about(native, monkeypatch, caplog):
    monkeypatch.setattr(weight_quant, "cpu_has_native_bf16", lambda: native)
    cfg = NibbleConfig(model=ModelConfig(quantization="none", dtype="bfloat16"),
                       device=DeviceConfig(device="cpu"))
    with caplog.at_level("WARNING", logger="nibble.services.engine.builder"):
        assert resolve_weights(cfg, CPU) == ("none", torch.bfloat16)
    assert ("50x slower" in caplog.text) is not native


def test_gemma_keeps_dense_weights():
    from nibble.services.models.gemma3 import Gemma3CausalLM

    from ..engine.conftest import tiny_arch
    model = Gemma3CausalLM(tiny_arch("gemma3", qk_norm=True))
    assert weight_quant.pack_gguf_weights(model, GGUFFile(GGUF_PATH)).packed == 0
    assert model.packed_lm_head is None


def test_float32_decode_step_on_the_c_ops_hands_bf16_rows_over(monkeypatch):
    """A float32 model's decode step on the C layer ops: each op before a packed projection
    writes its bf16 input and each op after it reads the bf16 product: bit for bit what the
    same C ops give on float32 rows converted around each projection. Prompts keep float32
    rows throughout; the torch layers give the same tokens."""
    from nibble.kernels.cpu import layer_ops
    from nibble.services.models.llama import DecoderLayer
    lm = load_model(None, torch.float32, CPU, quantization="gguf")
    ids, pos = torch.tensor([1, 9690, 198, 2683, 359, 253]), torch.arange(6)
    attn = VarlenCausalAttention(lm.arch.sm_scale)
    seen = []
    real = layer_ops.silu_mul
    monkeypatch.setattr(layer_ops, "silu_mul",
                        lambda *a, **k: seen.append(k.get("out_dtype")) or real(*a, **k))
    with torch.no_grad():
        ref = lm.model(ids, pos, _Step(True, attn))                 # the torch layers
        lm.model.set_cpu_layer_ops(True)
        got = lm.model(ids, pos, _Step(True, attn))
        assert set(seen) == {torch.bfloat16} and len(seen) == lm.arch.num_layers
        seen.clear()
        lm.model(ids, pos, _Step(False, attn))
        assert set(seen) == {None}
        with monkeypatch.context() as m:          # float32 rows, converted by packed_linear
            m.setattr(DecoderLayer, "_packed_rows", lambda *a: None)
            converted = lm.model(ids, pos, _Step(True, attn))
        assert torch.equal(got, converted)
        lm.model.set_cpu_layer_ops(False)
        rl, gl = lm.model.compute_logits(ref), lm.model.compute_logits(got)
    assert got.dtype == torch.float32
    # against the torch layers: the C norm's summation order can move a bf16 rounding by one
    # unit (0.4%), which the layers after it carry: measured 0.43% of the largest value
    assert (got - ref).abs().max() / ref.abs().max() < 1e-2
    assert torch.equal(rl.argmax(-1), gl.argmax(-1))
