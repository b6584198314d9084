"""URLs as they may be shown: in a log line, an error message, ``/admin/state`` or a trace.

A URL from the configuration (a backend's, the shared state's Redis) can carry credentials:
``http://user:secret@host:8000``, ``redis://:secret@host:6379/0``, a signed query. The one
function here, :func:`redact_url`, follows OpenTelemetry's HTTP semantic conventions for
``url.full``: userinfo becomes ``REDACTED:REDACTED`` and the values of the sensitive query
keys become ``REDACTED`` (the keys stay). A URL with nothing to hide comes back as written.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

__all__ = ["REDACTED", "SENSITIVE_QUERY_KEYS", "redact_url"]

REDACTED = "REDACTED"

# Matched case-sensitively, as the conventions say.
SENSITIVE_QUERY_KEYS = frozenset({
    # The semantic conventions' current list for url.full and url.query...
    "X-Amz-Signature", "X-Amz-Credential", "X-Amz-Security-Token", "sig", "X-Goog-Signature",
    # ...and the keys of its earlier versions, still in use by older signing schemes.
    "AWSAccessKeyId", "Signature",
    # redis-py reads a password from the query (unix:///path/to/socket?password=...).
    "password",
})


def redact_url(url: str) -> str:
    """``url`` without its credentials: userinfo replaced by ``REDACTED:REDACTED``, the value
    of each sensitive query key by ``REDACTED``. A URL that cannot be parsed is shown as
    ``REDACTED`` alone (whatever it holds stays hidden)."""
    if "@" not in url and "?" not in url:
        return url  # neither userinfo nor a query: nothing to hide (the common case)
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    netloc = parts.netloc
    if parts.username is not None:  # "user@", ":password@" or both
        # The host and port are what follows the last "@", as urllib reads them itself.
        netloc = f"{REDACTED}:{REDACTED}@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(key in SENSITIVE_QUERY_KEYS for key, _ in pairs):
            query = urlencode([(key, REDACTED if key in SENSITIVE_QUERY_KEYS else value)
                               for key, value in pairs], quote_via=quote)
    if netloc == parts.netloc and query == parts.query:
        return url  # as written: urlunsplit would shorten unix:///path to unix:/path
    return urlunsplit(parts._replace(netloc=netloc, query=query))
