"""The one configuration tree: frozen dataclasses built once from CLI flags.

Flag names follow SGLang/vLLM (SGLang's own names are accepted where they
differ). Each component receives only its own slice (``cfg.cache``,
``cfg.scheduler`` ...); nothing reads a global.

* :mod:`.tree`: the slices; every field declared once, with its flag.
* :mod:`.flags`: the declaration helper and the generic argparse/namespace code.
* :mod:`.validate`: checks across fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping

from ..errors import ConfigError
from .flags import Alias, Choices, FlagSpec, add_slice_args, alias_flags, build_slice, flag, specs
from .tree import (DEFAULT_GRPC_PORT, DEFAULT_PORT, EXPERIMENTAL_FLAG, CacheConfig, DeviceConfig, SamplingConfig,
                   DisaggConfig, HiCacheConfig, ModelConfig, NibbleConfig, SchedulerConfig,
                   ServerConfig)
from .validate import validate

__all__ = ["DEFAULT_GRPC_PORT", "DEFAULT_PORT", "EXPERIMENTAL_FLAG", "Alias", "CacheConfig", "SamplingConfig",
           "Choices", "ConfigError", "DeviceConfig", "DisaggConfig", "FlagSpec", "HiCacheConfig",
           "ModelConfig", "NibbleConfig", "SchedulerConfig", "ServerConfig", "add_engine_args",
           "add_server_args", "config_from_args", "flag", "flag_aliases", "slices", "specs",
           "validate"]


def slices(args: str | None = None) -> list[tuple[str, type, str]]:
    """``(name, slice class, group title)`` of the tree, in order; ``args`` "engine" or
    "server" keeps that part only."""
    return [(f.name, f.default_factory, f.metadata["title"])
            for f in dataclasses.fields(NibbleConfig)
            if args is None or f.metadata["args"] == args]


def flag_aliases() -> dict[str, str]:
    """SGLang's flag names Nibble accepts -> Nibble's flag for the same setting."""
    return alias_flags(cls for _, cls, _ in slices())


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Register the engine flags (shared by ``serve`` and the benchmarks)."""
    for _, cls, title in slices("engine"):
        add_slice_args(p, cls, title)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Register the server flags (``serve``)."""
    for _, cls, title in slices("server"):
        add_slice_args(p, cls, title)


def config_from_args(ns: argparse.Namespace, env: Mapping[str, str] | None = None
                     ) -> NibbleConfig:
    """Build and validate the config tree from parsed flags; a flag the parser lacks (the
    server flags, for a benchmark) keeps its default.

    ``env`` (default ``os.environ``) supplies the keys of ``$NIBBLE_API_KEY`` and
    ``$NIBBLE_ADMIN_API_KEY``; key files are read here, once."""
    env = os.environ if env is None else env
    cfg = NibbleConfig(**{name: build_slice(cls, ns, env) for name, cls, _ in slices()})
    validate(cfg)
    return cfg
