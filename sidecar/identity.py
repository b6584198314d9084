"""Who sent a request through a gateway: the tenant as the sources the picker trusts name it.

Behind a gateway the client's credential may be the gateway's own (a JWT its ``jwt_authn``
filter checks, an API key its auth policy holds), not a weighbridge key. The gateway's auth
then says who the caller is, in a request header it sets or in Envoy's dynamic metadata, and
the picker reads the tenant there (docs/deploy-kubernetes.md, "Identity from the gateway").

A client never chooses its tenant: only the sources ``weighbridge epp --tenant-from`` names
are read, in the order named, and the first one present decides. Each kind's trust:

- ``key``: the bearer key, as ``weighbridge sidecar`` reads it (the default, alone).
- ``metadata:NAMESPACE/KEY[/KEY...]``: a string in the request's dynamic metadata, which
  only the gateway's filters write (``jwt_authn``'s ``payload_in_metadata``, ``ext_authz``'s
  ``dynamic_metadata``), never a client; Envoy forwards the namespace to the picker when its
  ext_proc filter lists it in ``forwarding_namespaces``.
- ``header:NAME``: a request header, which a client can send too: name one only where the
  gateway removes the client's copy before its auth sets it (docs/deploy-kubernetes.md).

A source present with a value that names no tenant is a 401, never a fall-through to the
next source: a gateway that vouched for a caller the configuration does not know must not
let the caller's own key decide instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["KEY", "IdentitySource", "TrustedSources"]

KEY = "key"
HEADER = "header"
METADATA = "metadata"
# An HTTP field name (RFC 9110's token), lower-cased as the picker reads headers.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")
# Headers no gateway's auth writes for a tenant: a client or the protocol sets them.
_RESERVED = frozenset({"authorization", "host", "content-length", "content-type",
                       "x-gateway-destination-endpoint"})


@dataclass(frozen=True, slots=True)
class IdentitySource:
    """One place a request's tenant may be read: the bearer key, a header the gateway sets,
    or a string in dynamic metadata at ``namespace`` / ``path``."""

    kind: str
    name: str = ""  # the header (lower case) or the metadata namespace
    path: tuple[str, ...] = ()  # the keys within the metadata namespace

    @classmethod
    def parse(cls, text: str) -> IdentitySource:
        """``key``, ``header:NAME`` or ``metadata:NAMESPACE/KEY[/KEY...]``; ValueError
        otherwise, saying what is wrong."""
        kind, sep, rest = text.strip().partition(":")
        if kind == KEY and not sep:
            return cls(KEY)
        if kind == HEADER and sep:
            name = rest.strip().lower()
            if not _TOKEN.fullmatch(name) or name.startswith(":"):
                raise ValueError(f"{text!r}: not an HTTP header name")
            if name in _RESERVED:
                raise ValueError(f"{text!r}: {name} is not a header a gateway sets for "
                                 "identity")
            return cls(HEADER, name)
        if kind == METADATA and sep:
            namespace, *path = rest.strip().split("/")
            if not namespace or not path or not all(path):
                raise ValueError(f"{text!r}: give metadata:NAMESPACE/KEY[/KEY...]")
            return cls(METADATA, namespace, tuple(path))
        raise ValueError(f"{text!r}: a source is key, header:NAME or "
                         "metadata:NAMESPACE/KEY[/KEY...]")

    def __str__(self) -> str:
        if self.kind == KEY:
            return KEY
        if self.kind == HEADER:
            return f"{HEADER}:{self.name}"
        return f"{METADATA}:{self.name}/{'/'.join(self.path)}"


# A request's dynamic metadata: each namespace's values, nested as JSON's (a protobuf Struct
# reads as one), or None when the request carries none in it.
Metadata = Callable[[str], Mapping[str, Any] | None]


class TrustedSources:
    """The sources the configuration names, in order; the first present names the caller."""

    def __init__(self, sources: Sequence[IdentitySource] = (IdentitySource(KEY),)) -> None:
        if not sources:
            raise ValueError("name at least one identity source")
        if len(set(sources)) != len(sources):
            raise ValueError("an identity source is named twice")
        self.sources = tuple(sources)
        # The headers that carry identity: taken off before the backend sees the request.
        self.headers = tuple(s.name for s in sources if s.kind == HEADER)
        self.namespaces = tuple(dict.fromkeys(s.name for s in sources if s.kind == METADATA))

    def claimed(self, headers: Mapping[str, str], metadata: Metadata
                ) -> tuple[IdentitySource, str | None] | None:
        """The first named source present on the request, and the tenant it names (None
        for ``key``: the ingress reads the key itself); None when none is present."""
        for source in self.sources:
            if source.kind == KEY:
                if "authorization" in headers:
                    return source, None
                continue
            value = (headers.get(source.name) if source.kind == HEADER
                     else _metadata_value(metadata(source.name), source.path))
            if value is None:
                continue
            return source, value.strip()
        return None


def _metadata_value(namespace: Mapping[str, Any] | None, path: tuple[str, ...]) -> str | None:
    """The string at ``path`` in a namespace's values; None if any step is missing or the
    value is not a string (a number or a list names no tenant)."""
    value: Any = namespace
    for key in path:
        if value is None or not hasattr(value, "keys") or key not in value:
            return None
        value = value[key]
    return value if isinstance(value, str) else None
