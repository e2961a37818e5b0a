"""values.schema.json against the values files and against `nibble serve`'s real flags."""

from __future__ import annotations

import argparse
import copy
import json
import re

import jsonschema
import pytest
import yaml

from nibble.services.cli import build_parser
from nibble.services.config import flag_aliases

from .helpers import CHART

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
FLAGS = SCHEMA["properties"]["serve"]["properties"]["flags"]["properties"]
# Flags the chart sets itself (from other values); users cannot set them in serve.flags.
CHART_MANAGED = {"host", "port", "grpc-port", "disaggregate", "prefill-workers", "decode-workers",
                 "ray-address", "enable-hierarchical-cache", "hicache-storage-backend",
                 "hicache-storage-url", "hicache-storage-password-file", "api-key",
                 "admin-api-key", "api-key-file", "admin-api-key-file", "kv-secret-file",
                 "allow-unauthenticated", "graceful-shutdown-timeout", "ssl-keyfile",
                 "ssl-certfile", "ssl-ca-certs", "kv-transfer-ssl-certfile",
                 "kv-transfer-ssl-keyfile", "kv-transfer-ssl-ca-certs", "prefill-tp-size",
                 "decode-tp-size"}
# SGLang's names for Nibble's flags: serve.flags takes Nibble's names only (one key per setting).
ALIASES = {alias[2:]: own[2:] for alias, own in flag_aliases().items()}


def serve_options() -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {opt[2:]: action for action in sub.choices["serve"]._actions
            for opt in action.option_strings if opt.startswith("--") and opt != "--help"}


def merged(*files) -> dict:
    out: dict = {}

    def merge(dst, src):
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(dst.get(k), dict):
                merge(dst[k], v)
            else:
                dst[k] = copy.deepcopy(v)

    for f in files:
        merge(out, yaml.safe_load(f.read_text()))
    return out


@pytest.mark.parametrize("files", [("values.yaml",), ("values.yaml", "values-gpu.yaml")],
                         ids=["default", "with-gpu-values"])
def test_values_files_match_the_schema(files):
    values = merged(*(CHART / f for f in files))
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    errors = [f"{list(e.path)}: {e.message}" for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(values)]
    assert not errors, errors


def test_every_schema_flag_is_a_nibble_serve_flag_with_the_same_choices():
    options = serve_options()
    for flag, schema in FLAGS.items():
        assert flag in options, f"serve.flags.{flag} is not a `nibble serve` flag"
        action = options[flag]
        if action.choices and "enum" in schema:
            assert sorted(c for c in schema["enum"] if c is not None) == sorted(action.choices), flag
        elif action.choices:      # an open registry (KV formats): a pattern that admits them all
            assert all(re.fullmatch(schema["pattern"], c) for c in action.choices), flag
        if action.nargs == 0:
            assert "boolean" in schema["type"], f"{flag} is a bare flag: boolean in the schema"
        elif action.type is int:
            assert "integer" in schema["type"], flag


def test_every_nibble_serve_flag_is_settable_or_set_by_the_chart():
    """A new `nibble serve` flag needs a line in values.schema.json (serve.flags) or the chart."""
    options = set(serve_options())
    assert CHART_MANAGED <= options, CHART_MANAGED - options
    missing = options - set(FLAGS) - CHART_MANAGED - set(ALIASES)
    assert not missing, f"add these flags to serve.flags in values.schema.json: {sorted(missing)}"
    assert not CHART_MANAGED & set(FLAGS)


def test_sglang_aliases_are_flags_but_not_chart_values():
    options = serve_options()
    assert {"hicache-storage-prefetch-policy", "disaggregation-mode",
            "disaggregation-transfer-backend"} <= set(ALIASES)
    for alias, own in ALIASES.items():
        assert alias in options and own in options, alias
        assert alias not in FLAGS and alias not in CHART_MANAGED, alias


def test_schema_rejects_what_the_chart_must_not_accept():
    validator = jsonschema.Draft7Validator(SCHEMA)
    base = merged(CHART / "values.yaml")

    def bad(path, value):
        values = copy.deepcopy(base)
        node = values
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        return list(validator.iter_errors(values))

    assert bad(["serve", "flags", "api-key"], "inline-key-123")        # keys belong in the Secret
    assert bad(["serve", "flags", "mem-fraction-static"], 1.5)
    assert bad(["auth", "apiKeys"], ["short"])
    assert bad(["auth", "apiKeys"], ["has space in it"])
    assert bad(["redis", "external", "url"], "http://not-redis:6379")
    assert bad(["ray", "prefill", "rayStartParams"], {"num-cpus": 4})     # KubeRay wants strings
    assert bad(["ray", "decode", "rayStartParams"], {"labels": "a=b"})    # refused by KubeRay
    assert bad(["containerSecurityContext", "allowPrivilegeEscalation"], True)
    assert bad(["ray", "prefill", "tpSize"], 0)
    assert bad(["ray", "decode", "tpSize"], "2")
    assert bad(["serve", "flags", "decode-tp-size"], 2)                  # ray.decode.tpSize
    assert not bad(["ray", "decode", "tpSize"], 4)
    assert not bad(["serve", "flags", "device"], None)                    # null unsets a default


def test_chart_versions_follow_the_project():
    """The image tag comes from appVersion, and the RayCluster's rayVersion must equal the
    Ray that pyproject.toml installs into the image."""
    pyproject = (CHART.parents[1] / "pyproject.toml").read_text()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    ray_pin = re.search(r'"ray\[default\]==([^"]+)"', pyproject).group(1)
    assert values["ray"]["version"] == ray_pin
