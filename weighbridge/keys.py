"""API keys as the config holds them: reduced to a sha256 digest at load time, so the secret
itself is never kept, logged or written back out.

A key is configured as ``sha256:<64 hex>`` (the digest, the form to store), ``env:VAR`` (an
environment variable holding the raw key, read once at load) or ``plain:<key>`` (tests and
demos; the sidecar warns). ``weighbridge hash-key`` prints the stored form of a raw key.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import PlainSerializer, PlainValidator, ValidationInfo
from pydantic_core import PydanticCustomError

__all__ = ["ApiKey", "ApiKeyField", "KeySource", "hash_api_key", "key_digest"]

KeySource = Literal["sha256", "env", "plain"]

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_ENV_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def key_digest(key: str) -> str:
    """The lowercase sha256 hex of a raw key: what a configured key is kept as."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def hash_api_key(key: str) -> str:
    """The form to store in the config for a raw API key: ``sha256:<64 hex>``."""
    return "sha256:" + key_digest(key)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A configured key, reduced to its digest at load time so the secret is not kept."""

    source: KeySource
    digest: str  # lowercase sha256 hex of the raw key
    label: str  # safe to print or log; never contains the key

    def __str__(self) -> str:
        return self.label


def _key_error(message: str) -> PydanticCustomError:
    return PydanticCustomError("api_key", message)


def _parse_api_key(value: Any, info: ValidationInfo) -> ApiKey:
    if isinstance(value, ApiKey):
        return value
    if not isinstance(value, str):
        raise _key_error("API key must be a string: 'sha256:<64 hex>', 'env:VAR' or 'plain:<key>'")
    scheme, _, rest = value.partition(":")
    if scheme == "sha256":
        if not _HEX64.fullmatch(rest):
            raise _key_error("sha256 key must be 'sha256:' followed by 64 hex digits")
        digest = rest.lower()
        return ApiKey("sha256", digest, f"sha256:{digest[:8]}…")
    if scheme == "env":
        if not _ENV_VAR.fullmatch(rest):
            raise _key_error("env key must name an environment variable, e.g. 'env:ACME_KEY'")
        # The variable holds the raw key (e.g. from a Kubernetes secret), read once at load.
        environ: Mapping[str, str] = (info.context or {}).get("environ", os.environ)
        secret = environ.get(rest)
        if not secret:
            raise PydanticCustomError(
                "api_key_env", "environment variable {var} is not set or empty", {"var": rest}
            )
        return ApiKey("env", key_digest(secret), f"env:{rest}")
    if scheme == "plain":
        if not rest:
            raise _key_error("plain key must not be empty")
        return ApiKey("plain", key_digest(rest), "plain:<redacted>")
    # Never echo the value: a raw key pasted without a prefix would end up in logs.
    raise _key_error("API key must start with 'sha256:', 'env:' or 'plain:'")


def _serialize_api_key(key: ApiKey) -> str:
    # Dumping a config must not write secrets back out: plain keys become their digest.
    return key.label if key.source == "env" else f"sha256:{key.digest}"


ApiKeyField = Annotated[
    ApiKey,
    PlainValidator(_parse_api_key, json_schema_input_type=str),
    PlainSerializer(_serialize_api_key, return_type=str),
]
