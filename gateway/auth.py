"""API keys and ephemeral client secrets, checked the way OpenAI's Realtime API does.

A request carries `Authorization: Bearer <key>`; a browser's WebSocket, which cannot set
headers, offers the key as a subprotocol `openai-insecure-api-key.<key>`. Keys are the
configured API keys, or `ek_` secrets minted by POST /v1/realtime/client_secrets: short-lived,
usable for new sessions until they expire, each carrying the session configuration it was
minted with. A secret is its own record, signed (HMAC-SHA256) with a key made at start-up and
shared by the service's gateway processes: any of them accepts what another minted, nothing is
stored, and a restart revokes them all.

GET /metrics has a token of its own (ScrapeAuth), apart from the API keys: a scraper holds
no key that opens calls.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.config import AuthConfig, MetricsConfig

logger = logging.getLogger(__name__)

SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
# a secret travels in a header (aiohttp takes fields up to 8 KiB): this leaves room for the rest
MAX_SECRET_CHARS = 6000


class AuthError(Exception):
    """401: the message says what was wrong, never echoing the key."""

    def __init__(self, message: str, code: str = "invalid_api_key") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Grant:
    """Who is calling: an API key holder, or a client secret with its session settings."""

    ephemeral: bool
    session: dict[str, Any] | None = None
    holder: str | None = None  # which key or secret (a digest of it), for per-key limits


def _holder(kind: str, key: str) -> str:
    return f"{kind}:{hashlib.sha256(key.encode()).hexdigest()[:16]}"


@dataclass
class ClientSecret:
    value: str
    expires_at: int  # unix seconds
    session: dict[str, Any]


class Authenticator:
    def __init__(
        self,
        config: AuthConfig,
        environ: Mapping[str, str] = os.environ,
        signing_key: bytes | None = None,
    ) -> None:
        """`signing_key`: signs client secrets; the gateway processes of one service share
        it (by default a fresh one: secrets from before a restart are refused)."""
        self.enabled = config.enabled
        self.open_on_network = config.allow_off_on_network
        self.signing_key = signing_key or secrets.token_bytes(32)
        self.default_ttl_s = config.client_secret_ttl_s
        keys = list(config.api_keys)
        if config.api_keys_env and environ.get(config.api_keys_env):
            keys += [k.strip() for k in environ[config.api_keys_env].split(",") if k.strip()]
        self._keys = [k.encode() for k in keys]
        if self.enabled and not self._keys:
            env = f" or in ${config.api_keys_env}" if config.api_keys_env else ""
            raise ValueError(
                f"gateway.auth is enabled but no API key is configured: put keys in "
                f"gateway.auth.api_keys{env}, or set gateway.auth.enabled: false for local use"
            )

    def announce(self, where: str) -> None:
        if not self.enabled:
            logger.warning(
                "AUTHENTICATION IS OFF (gateway.auth.enabled: false): anyone who can reach %s "
                "can open calls. %s",
                where,
                "gateway.auth.allow_off_on_network is true: it is served so on purpose"
                if self.open_on_network
                else "Only for local use.",
            )

    # -- checking --------------------------------------------------------------------------

    def check(self, request: web.Request, *, allow_ephemeral: bool = True) -> Grant:
        """The caller's grant; raises AuthError (401) for a missing, wrong or expired key."""
        if not self.enabled:
            return Grant(ephemeral=False)
        key = presented_key(request)
        if key is None:
            raise AuthError(
                "no API key: send 'Authorization: Bearer <key>' (or, from a browser "
                f"WebSocket, the subprotocol '{SUBPROTOCOL_PREFIX}<key>')",
                code="missing_api_key",
            )
        return self.check_key(key, request.path if not allow_ephemeral else None)

    def check_key(self, key: str, keys_only_at: str | None = None) -> Grant:
        """The grant of a key presented some other way (a phone stream's parameters);
        `keys_only_at`: the path that takes API keys, not client secrets."""
        if not self.enabled:
            return Grant(ephemeral=False)
        if key.startswith("ek_"):
            if keys_only_at is not None:
                raise AuthError(
                    f"a client secret (ek_) opens Realtime calls and sessions only: "
                    f"{keys_only_at} needs an API key"
                )
            secret = self._unseal(key)
            if secret.expires_at <= time.time():
                raise AuthError("the client secret has expired", code="expired_api_key")
            return Grant(ephemeral=True, session=secret.session, holder=_holder("secret", key))
        encoded = key.encode()
        # compare against every key, so the time taken says nothing about which matched
        if not any([hmac.compare_digest(encoded, k) for k in self._keys]):
            raise AuthError("incorrect API key provided")
        return Grant(ephemeral=False, holder=_holder("key", key))

    # -- minting ---------------------------------------------------------------------------

    def mint(self, session: dict[str, Any], ttl_s: int | None = None) -> ClientSecret:
        """A secret for new sessions with `session` settings; ValueError if the settings are
        too large to travel in a header."""
        expires_at = int(time.time()) + (ttl_s or self.default_ttl_s)
        record = json.dumps({"exp": expires_at, "session": session}, separators=(",", ":"))
        body = _b64(zlib.compress(record.encode()))
        value = f"ek_{body}.{self._sign(body)}"
        if len(value) > MAX_SECRET_CHARS:
            raise ValueError(
                f"the session settings are too large for a client secret ({len(value)} "
                f"characters signed, at most {MAX_SECRET_CHARS}): send them with session.update"
            )
        return ClientSecret(value, expires_at, session)

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self.signing_key, body.encode(), hashlib.sha256).digest())

    def _unseal(self, value: str) -> ClientSecret:
        body, _, signature = value[3:].partition(".")
        if not hmac.compare_digest(signature.encode(), self._sign(body).encode()):
            raise AuthError("invalid client secret")
        record = json.loads(
            zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        )
        return ClientSecret(value, int(record["exp"]), record["session"])


class ScrapeAuth:
    """GET /metrics: open, or only for scrapes that send the configured token."""

    def __init__(self, config: MetricsConfig, environ: Mapping[str, str] = os.environ) -> None:
        self._token: bytes | None = None
        if config.token_env is not None:
            token = environ.get(config.token_env, "").strip()
            if not token:
                raise ValueError(
                    f"gateway.metrics.token_env names ${config.token_env}, which is not set: "
                    "set it to the token scrapes send, or drop token_env to leave /metrics open"
                )
            self._token = token.encode()

    def check(self, request: web.Request) -> None:
        """Raises AuthError (401) for a scrape without the token, or with another."""
        if self._token is None:
            return
        key = presented_key(request)
        if key is None:
            raise AuthError(
                "no token: /metrics needs 'Authorization: Bearer <token>' "
                "(gateway.metrics.token_env)",
                code="missing_api_key",
            )
        if not hmac.compare_digest(key.encode(), self._token):
            raise AuthError("incorrect token for /metrics")


def presented_key(request: web.Request) -> str | None:
    """The bearer key of a request, or of a browser WebSocket's subprotocol."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    for proto in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        proto = proto.strip()
        if proto.startswith(SUBPROTOCOL_PREFIX):
            return proto[len(SUBPROTOCOL_PREFIX) :]
    return None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
