"""Schemathesis hooks for tests/e2e/test_schemathesis.py (loaded through SCHEMATHESIS_HOOKS).

One check replaces schemathesis' ``positive_data_acceptance``: a schema-valid
request must be accepted, except for the 400s that no schema can rule out: a
prompt plus max_tokens longer than the model's context (it depends on how the
prompt tokenizes), marked ``code: context_length_exceeded``, and a regex, EBNF
grammar or JSON schema that does not compile, marked ``code: grammar_compile_error``,
and a logit_bias key beyond the vocabulary, ``code: token_id_out_of_range`` (prompt
token ids are capped in the served schema); and tool fields that contradict each other or
the history (tool_choice without tools or naming another function, duplicate function
names, a call's arguments that are no JSON object), ``code: invalid_tools``, which OpenAI
refuses too and no JSON schema can state.
Any other 400 on schema-valid input is still a mismatch.
"""

from __future__ import annotations

import json

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

MODEL_DEPENDENT_CODES = {"context_length_exceeded", "grammar_compile_error",
                         "token_id_out_of_range", "invalid_tools"}


def _error_code(body: bytes) -> str | None:
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return err.get("code") if isinstance(err, dict) else None


@schemathesis.check
def positive_data_acceptance_within_context(ctx, response, case):
    if response.status_code == 400 and _error_code(response.content) in MODEL_DEPENDENT_CODES:
        return None
    return positive_data_acceptance(ctx, response, case)
