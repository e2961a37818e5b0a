"""Constrained decoding: a grammar per request masks the tokens the sampler may pick.

``GrammarSpec`` (on ``SamplingParams``) names what the output must match: any JSON object,
a JSON schema, a regex or an EBNF grammar. A ``GrammarBackend`` (registered by name,
``--grammar-backend``) compiles a spec once per (backend, spec) and gives each request a
``Matcher``: the sampler asks it for the allowed tokens of the next step (a bitmask row) and
tells it the token that was picked. ``xgrammar`` is the implementation; ``none`` refuses
every grammar with a clear error.

Compilation is cached by spec (LRU) and normally happens on the frontend's threads while the
request is prepared, so the engine thread finds it compiled; a spec that does not compile is
a 400 with the compiler's message (``GrammarError``).
"""

from __future__ import annotations

import abc
import threading
from collections import OrderedDict
from typing import Any, Callable, ClassVar

import torch

from ..errors import InvalidRequestError
from .grammar_spec import GRAMMAR_KINDS, GrammarSpec

CACHE_SIZE = 256
# the error code of a grammar that does not compile: no request schema can rule it out
GRAMMAR_COMPILE_ERROR = "grammar_compile_error"


class GrammarError(InvalidRequestError):
    """A grammar that cannot be used: it does not compile, or no backend is enabled."""


class Matcher(abc.ABC):
    """One request's position in its grammar."""

    @abc.abstractmethod
    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``mask`` (the backend's layout)."""

    @abc.abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar does not allow it."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The output is complete (only a stop token may follow)."""


class GrammarBackend(abc.ABC):
    """Compiles specs for one tokenizer and vocabulary width (the logits' columns)."""

    name: ClassVar[str]

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec`` (cached); GrammarError when it does not compile."""
        if spec.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {spec.kind!r}", param="response_format")
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    @abc.abstractmethod
    def _compile(self, spec: GrammarSpec) -> Any: ...

    @abc.abstractmethod
    def matcher(self, spec: GrammarSpec) -> Matcher: ...

    @abc.abstractmethod
    def new_mask(self, rows: int) -> torch.Tensor:
        """An all-allowed mask of ``rows`` rows (host memory)."""

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``logits`` float32 ``[N, V]`` with the tokens ``mask`` (``N`` rows) disallows at
        -inf, in place on the logits' device."""


GRAMMAR_BACKENDS: dict[str, Callable[[Any, int], GrammarBackend] | None] = {"none": None}


def register_grammar_backend(name: str, factory: Callable[[Any, int], GrammarBackend]) -> None:
    GRAMMAR_BACKENDS[name] = factory


def create_grammar_backend(name: str, tokenizer: Any, vocab_size: int) -> GrammarBackend | None:
    """The backend ``name`` for ``tokenizer`` (None for ``none``)."""
    if name not in GRAMMAR_BACKENDS:
        raise GrammarError(f"unknown grammar backend {name!r}; known: {sorted(GRAMMAR_BACKENDS)}")
    factory = GRAMMAR_BACKENDS[name]
    return None if factory is None else factory(tokenizer, vocab_size)


def grammar_backend_names() -> list[str]:
    from . import grammar_xgrammar  # noqa: F401  registers itself when xgrammar imports
    return sorted(GRAMMAR_BACKENDS)


_SHARED: dict[int, GrammarBackend | None] = {}
_SHARED_LOCK = threading.Lock()


def share_backend(tokenizer: Any, backend: GrammarBackend | None) -> None:
    """Make ``backend`` the one the frontend uses for ``tokenizer`` (the engine's own, so a
    grammar compiled while a request is prepared is found compiled by the engine)."""
    with _SHARED_LOCK:
        _SHARED[id(tokenizer)] = backend


def backend_for(tokenizer: Any) -> GrammarBackend | None:
    """The engine's backend for ``tokenizer``; where this process has no engine (the
    disaggregated gateway), an xgrammar backend made for checking specs, if xgrammar imports."""
    with _SHARED_LOCK:
        if id(tokenizer) in _SHARED:
            return _SHARED[id(tokenizer)]
    backend = None
    if "xgrammar" in grammar_backend_names():
        try:
            backend = create_grammar_backend("xgrammar", tokenizer, tokenizer.vocab_size)
        except GrammarError:
            backend = None          # a tokenizer without a vocabulary: grammars are off
    share_backend(tokenizer, backend)
    return backend

