"""Secrets travel in the environment, never in command lines or Serve application args.

Two secrets reach kvfleet's processes: the Redis password and the OTLP exporter headers (an
API token for a hosted collector). Command lines are readable by every local user (``ps``),
and a Serve application's ``args`` are stored in Ray's GCS and shown by ``serve status`` and
the dashboard, so both carry the Redis URL *without* its password and no OTLP headers; each
process reads them from its environment instead:

- ``KVFLEET_REDIS_PASSWORD``: merged into a password-less Redis URL (:func:`redis_url_from_env`);
  on Kubernetes a ``secretKeyRef`` of the Redis Secret, locally set by ``kvfleet up`` for the
  processes it starts;
- ``OTEL_EXPORTER_OTLP_HEADERS``: the standard OTel variable (kvfleet.telemetry reads it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional
from urllib.parse import quote, unquote, urlsplit, urlunsplit

if TYPE_CHECKING:
    from kvfleet.telemetry import TelemetryConfig

REDIS_PASSWORD_ENV = "KVFLEET_REDIS_PASSWORD"
OTLP_HEADERS_ENV = "OTEL_EXPORTER_OTLP_HEADERS"


def split_redis_password(url: str) -> tuple[str, Optional[str]]:
    """``redis://user:pw@host:port/db`` → (``redis://user@host:port/db``, ``"pw"``); a URL
    without a password comes back unchanged with None. The password is URL-decoded."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    user = quote(unquote(parts.username), safe="") if parts.username else ""
    host = parts.netloc.rsplit("@", 1)[1]
    netloc = f"{user}@{host}" if user else host
    return urlunsplit(parts._replace(netloc=netloc)), unquote(parts.password)


def with_redis_password(url: str, password: Optional[str]) -> str:
    """``url`` with ``password`` in it (URL-encoded); unchanged when ``password`` is empty or
    the URL already holds one."""
    parts = urlsplit(url)
    if not password or parts.password is not None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    netloc = f"{user}:{quote(password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def redis_url_from_env(url: Optional[str], env: Mapping[str, str]) -> Optional[str]:
    """``url`` with the password of ``env[KVFLEET_REDIS_PASSWORD]`` merged in (None stays None)."""
    if url is None:
        return None
    return with_redis_password(url, env.get(REDIS_PASSWORD_ENV, ""))


def secret_env(redis_password: Optional[str], otlp_headers: str = "") -> dict[str, str]:
    """The environment variables that carry these secrets to a child process (empty ones
    left out)."""
    env = {}
    if redis_password:
        env[REDIS_PASSWORD_ENV] = redis_password
    if otlp_headers:
        env[OTLP_HEADERS_ENV] = otlp_headers
    return env


def split_telemetry_secrets(telemetry: "TelemetryConfig") -> tuple["TelemetryConfig", dict[str, str]]:
    """(``telemetry`` without any OTLP headers, the ``OTEL_*_HEADERS`` variables that carry
    them): the first may be written into args, the second goes in the environment."""
    from dataclasses import replace

    env = {k: v for k, v in telemetry.to_env().items()
           if k.startswith("OTEL_") and k.endswith("_HEADERS")}
    clean = replace(telemetry, otlp_headers=(),
                    extra_env=tuple((k, v) for k, v in telemetry.extra_env if k not in env))
    return clean, env


def telemetry_secrets_from_env(telemetry: "TelemetryConfig",
                               env: Mapping[str, str]) -> "TelemetryConfig":
    """``telemetry`` with the OTLP headers of ``env`` (see :func:`split_telemetry_secrets`)
    where it has none. Raises ValueError for a malformed ``OTEL_EXPORTER_OTLP_HEADERS``."""
    from dataclasses import replace

    from kvfleet.telemetry import TelemetryConfig

    headers = {k: v for k, v in env.items() if k.startswith("OTEL_") and k.endswith("_HEADERS")}
    if not headers:
        return telemetry
    parsed = TelemetryConfig.from_env(headers)
    extra = dict(telemetry.extra_env)
    for k, v in parsed.extra_env:
        extra.setdefault(k, v)
    return replace(telemetry, otlp_headers=telemetry.otlp_headers or parsed.otlp_headers,
                   extra_env=tuple(sorted(extra.items())))
