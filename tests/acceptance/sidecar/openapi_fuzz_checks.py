"""schemathesis hooks for tests/acceptance/sidecar/test_openapi_fuzz.py (loaded by the `st`
command through ``SCHEMATHESIS_HOOKS``).

schemathesis's own ``positive_data_acceptance`` check wants every schema-valid request
answered 2xx. The description promises less, and says so (sidecar/openapi.yaml): the sidecar
validates the fields it reads and passes the rest to the backend, whose own 4xx answers (a
prompt over the model's context, a content part a text model cannot take) come back
unchanged, without the ``x-weighbridge-reject-reason`` header. So the run replaces that
check with this one, which holds the sidecar to exactly its promise: a schema-valid request
is never refused by the sidecar itself for being malformed, but for the rules between
fields that JSON Schema cannot state, whose reasons an operation lists in
``x-weighbridge-refused-beyond-schema`` (a score's sides must be 1:1, 1:N or N:N).
"""

from __future__ import annotations

import schemathesis

# Refusals that are not about the request's form: credentials, permission, rate, queue.
_NOT_ABOUT_FORM = {401, 403, 404, 409, 429}


@schemathesis.check
def sidecar_accepts_what_it_describes(ctx: schemathesis.CheckContext,
                                      response: schemathesis.Response,
                                      case: schemathesis.Case) -> bool | None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    status = response.status_code
    reason = response.headers.get("x-weighbridge-reject-reason")
    beyond_schema = case.operation.definition.raw.get("x-weighbridge-refused-beyond-schema", ())
    if 400 <= status < 500 and status not in _NOT_ABOUT_FORM and reason \
            and reason[0] not in beyond_schema:
        raise AssertionError(f"the sidecar refused schema-valid data: {status} {reason[0]}")
    return None
