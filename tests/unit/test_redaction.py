"""``weighbridge.redaction.redact_url``: a URL as it may be shown, credentials hidden as the
OpenTelemetry HTTP semantic conventions hide them in ``url.full``; and the configuration's
own messages, which show a backend URL through it."""

from __future__ import annotations

from urllib.parse import quote, urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.redaction import REDACTED, SENSITIVE_QUERY_KEYS, redact_url
from weighbridge.sidecar.config import ConfigError, parse_config


@pytest.mark.parametrize(("url", "shown"), [
    ("http://user:secret@host:8000/v1/completions",
     "http://REDACTED:REDACTED@host:8000/v1/completions"),
    # A user alone (a token as the user name) and a password alone are userinfo too.
    ("http://token@host/", "http://REDACTED:REDACTED@host/"),
    ("redis://:secret@redis.internal:6379/0", "redis://REDACTED:REDACTED@redis.internal:6379/0"),
    ("rediss://default:secret@redis.internal:6380", "rediss://REDACTED:REDACTED@redis.internal:6380"),
    # An "@" in the password: the host is what follows the last one, as urllib reads it.
    ("http://u:p@ss@[::1]:8000/x", "http://REDACTED:REDACTED@[::1]:8000/x"),
    # The conventions' sensitive query keys: values hidden, keys and the rest kept.
    ("https://bucket.example/o?X-Amz-Credential=AKIA&X-Amz-Signature=abc&X-Amz-Security-Token=t"
     "&part=2", "https://bucket.example/o?X-Amz-Credential=REDACTED&X-Amz-Signature=REDACTED"
     "&X-Amz-Security-Token=REDACTED&part=2"),
    ("https://h/p?q=OpenTelemetry&sig=abc#frag", "https://h/p?q=OpenTelemetry&sig=REDACTED#frag"),
    ("https://h/p?AWSAccessKeyId=AKIA&Signature=abc&X-Goog-Signature=def",
     "https://h/p?AWSAccessKeyId=REDACTED&Signature=REDACTED&X-Goog-Signature=REDACTED"),
    ("https://h/p?sig", "https://h/p?sig=REDACTED"),
    # Matching is case-sensitive, as the conventions say.
    ("https://h/p?SIG=upper&Sig=mixed", "https://h/p?SIG=upper&Sig=mixed"),
])
def test_credentials_are_redacted(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000", "http://engine-0:8000/v1/chat/completions",
    "http://h/a@b",  # an "@" in the path is no userinfo
    "https://h/p?a=b%20c&model=x/y", "redis://127.0.0.1:6379/0", "unix:///run/redis.sock?db=1",
])
def test_a_url_without_credentials_is_kept_as_written(url: str) -> None:
    assert redact_url(url) == url


def test_a_password_in_a_unix_socket_url_s_query_is_redacted() -> None:
    # redis-py's form: a unix socket has no userinfo to hold the password.
    shown = redact_url("unix:///run/redis.sock?db=0&password=secret")
    assert "secret" not in shown
    parts = urlsplit(shown)  # urlunsplit may write unix:/path: the same URL
    assert (parts.scheme, parts.path, parts.query) == ("unix", "/run/redis.sock",
                                                       "db=0&password=REDACTED")


def test_an_unparseable_url_shows_nothing_of_itself() -> None:
    assert redact_url("http://user:secret@[::1/x") == REDACTED


_SECRET = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,;=%",
                  min_size=1, max_size=30).map(lambda s: "S3CRET" + s)


@given(user=_SECRET, password=_SECRET, key=st.sampled_from(sorted(SENSITIVE_QUERY_KEYS)),
       value=_SECRET)
def test_no_secret_survives(user: str, password: str, key: str, value: str) -> None:
    url = (f"http://{quote(user, safe='')}:{quote(password, safe='')}@engine:8000/v1/x"
           f"?a=1&{key}={quote(value, safe='')}")
    shown = redact_url(url)
    assert "S3CRET" not in shown
    assert shown.startswith("http://REDACTED:REDACTED@engine:8000/v1/x?a=1&")


def test_a_duplicate_backend_url_is_reported_without_its_credentials() -> None:
    url = "http://ops:hunter2-pw@engine:8000"
    with pytest.raises(ConfigError) as error:
        parse_config({"backends": [{"url": url, "name": "a"}, {"url": url, "name": "b"}]})
    message = str(error.value)
    assert "backends.1.url" in message and "REDACTED:REDACTED@engine:8000" in message
    assert "hunter2" not in message and "ops" not in message


def test_weighbridge_reload_names_an_unreachable_sidecar_without_its_credentials() -> None:
    from typer.testing import CliRunner

    from weighbridge.app.cli import app

    result = CliRunner().invoke(app, ["reload", "--url", "http://ops:hunter2-pw@127.0.0.1:1",
                                      "--admin-key", "sk-admin"])
    assert result.exit_code == 1
    assert "weighbridge reload: http://REDACTED:REDACTED@127.0.0.1:1:" in result.output
    assert "hunter2" not in result.output
