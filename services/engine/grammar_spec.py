"""``GrammarSpec``: what a request's output must match (kept apart from ``grammar.py`` so the
request types stay free of the grammar engine)."""

from __future__ import annotations

from dataclasses import dataclass

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match."""

    kind: str                    # one of GRAMMAR_KINDS
    source: str = ""             # the schema (JSON text), regex, EBNF or structural tag (JSON
                                 # text: tool calls); "" for json_object
    strict: bool = True          # json_schema: no properties beyond the schema's
