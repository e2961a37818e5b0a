"""Model side of Nibble: architecture configs, the transformer, tokenizer and loaders."""

from .base import AttentionFn
from .config import ModelArchConfig
from .gemma3 import Gemma3CausalLM
from .llama import CausalLM
from .loader import LoadedModel, default_model_path, load_model, new_model
from .tokenizer import Tokenizer

__all__ = ["AttentionFn", "CausalLM", "Gemma3CausalLM", "LoadedModel", "ModelArchConfig",
           "Tokenizer", "default_model_path", "load_model", "new_model"]
