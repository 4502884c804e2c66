"""Authentication: who is calling, from the credentials in a call's gRPC metadata.

Accepted credentials (when ``auth.enabled``):

* ``authorization: Bearer <JWT>`` — what danube-client's ``with_token`` sends. HS256/384/512
  tokens are verified with ``auth.jwt.hmac_secret``; RS*/PS* and ES* tokens with the RSA or EC
  keys of ``auth.jwt.public_key_files``. ``exp`` and the principal claim are required; ``exp``
  and ``nbf`` are checked with ``clock_skew_seconds`` of leeway; ``iss``/``aud`` when configured.
  The ``none`` algorithm is never accepted.
* ``x-api-key: <key>``, or ``authorization: Bearer <key>`` with a key that is not a JWT: looked up
  by its SHA-256 in ``auth.api_keys_file`` (only hashes are stored).

Guarantees: every refusal is an :class:`UnauthenticatedError` whose message says what was wrong
(missing, malformed, expired, bad signature, unknown key) and never echoes the credential. A
verified token is cached until it expires, so a call costs one dictionary lookup after the first.
With ``auth.enabled`` off every caller is :data:`ANONYMOUS`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from danube_ingest.config.auth import AuthConfig, JwtConfig
from danube_ingest.errors import ConfigError
from danube_ingest.security.errors import TOKEN_EXPIRED, TokenExpiredError, UnauthenticatedError

log = logging.getLogger(__name__)

#: Verified tokens kept (token -> principal); the cache is emptied when it is full, which only
#: costs one verification per token again.
TOKEN_CACHE_SIZE = 4096

_HMAC_ALGORITHMS = frozenset({"HS256", "HS384", "HS512"})
_RSA_ALGORITHMS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"})
_EC_ALGORITHMS = frozenset({"ES256", "ES384", "ES512"})

_HOW_TO = "send 'authorization: Bearer <JWT>' (danube-client with_token) or 'x-api-key: <key>'"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller."""

    name: str
    """The principal's name (the JWT's principal claim, or the API key's account)."""
    roles: frozenset[str] = frozenset()
    """Roles that permission rules may name."""
    method: str = "anonymous"
    """How it authenticated: ``jwt``, ``api_key`` or ``anonymous`` (auth off)."""


#: Every caller while ``auth.enabled`` is off.
ANONYMOUS = Principal("anonymous")


def hash_api_key(key: str) -> str:
    """The form an API key is stored in: ``sha256:`` and the hex SHA-256 of its UTF-8 bytes
    (the same as ``printf %s KEY | sha256sum``)."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def load_api_keys(path: Path) -> dict[str, Principal]:
    """The API keys file (see ``auth.api_keys_file``) as stored hash -> principal; raises
    ``ConfigError`` naming the file and line of anything malformed."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"auth.api_keys_file: cannot read {path}: {exc.strerror}") from None
    keys: dict[str, Principal] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) not in (2, 3) or not fields[1].startswith("sha256:"):
            raise ConfigError(
                f"auth.api_keys_file {path}:{number}: expected 'PRINCIPAL sha256:HEX "
                f"[ROLE,ROLE...]'"
            )
        digest = fields[1].lower()
        if len(digest) != len("sha256:") + 64:
            raise ConfigError(f"auth.api_keys_file {path}:{number}: sha256 must be 64 hex digits")
        roles = frozenset(r for r in fields[2].split(",") if r) if len(fields) == 3 else frozenset()
        keys[digest] = Principal(fields[0], roles, "api_key")
    return keys


def _read_secret(config: AuthConfig) -> bytes | None:
    jwt_config = config.jwt
    if jwt_config.hmac_secret is not None:
        return jwt_config.hmac_secret.get_secret_value().encode()
    if jwt_config.hmac_secret_file is not None:
        try:
            return jwt_config.hmac_secret_file.read_bytes().strip()
        except OSError as exc:
            raise ConfigError(
                f"auth.jwt.hmac_secret_file: cannot read {jwt_config.hmac_secret_file}: "
                f"{exc.strerror}"
            ) from None
    return None


def _read_public_keys(paths: Iterable[Path]) -> tuple[list[Any], list[Any]]:
    """(RSA keys, EC keys) from PEM files."""
    rsa_keys: list[Any] = []
    ec_keys: list[Any] = []
    for path in paths:
        try:
            key = load_pem_public_key(path.read_bytes())
        except OSError as exc:
            raise ConfigError(
                f"auth.jwt.public_key_files: cannot read {path}: {exc.strerror}"
            ) from None
        except ValueError as exc:
            raise ConfigError(
                f"auth.jwt.public_key_files: {path} is not a PEM public key: {exc}"
            ) from None
        if isinstance(key, rsa.RSAPublicKey):
            rsa_keys.append(key)
        elif isinstance(key, ec.EllipticCurvePublicKey):
            ec_keys.append(key)
        else:
            raise ConfigError(
                f"auth.jwt.public_key_files: {path} is neither an RSA nor an EC public key"
            )
    return rsa_keys, ec_keys


def _metadata_value(metadata: Iterable[tuple[str, Any]], name: str) -> str | None:
    for key, value in metadata:
        if key == name:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


class Authenticator:
    """Turns a call's metadata into a :class:`Principal` (see the module docstring)."""

    def __init__(self, config: AuthConfig, clock: Callable[[], float] = time.time) -> None:
        """Reads the secret, key files and API keys once; ``ConfigError`` naming what cannot
        be read. ``clock``: seconds since the epoch (tests move it)."""
        self.enabled = config.enabled
        self._config = config.jwt
        self._clock = clock
        self._secret = _read_secret(config) if config.enabled else None
        self._rsa, self._ec = (
            _read_public_keys(config.jwt.public_key_files) if config.enabled else ([], [])
        )
        self._api_keys = (
            load_api_keys(config.api_keys_file)
            if config.enabled and config.api_keys_file is not None
            else {}
        )
        self._verified: dict[str, tuple[Principal, float]] = {}

    def authenticate(self, metadata: Iterable[tuple[str, Any]]) -> Principal:
        """The caller's principal; raises :class:`UnauthenticatedError` saying what is wrong."""
        return self.identify(metadata)[0]

    def identify(self, metadata: Iterable[tuple[str, Any]]) -> tuple[Principal, float | None]:
        """The caller's principal and when its credentials stop being accepted: a JWT's
        ``exp`` plus ``clock_skew_seconds`` (seconds since the epoch); ``None`` for credentials
        that do not expire (API keys, auth off). Raises as :meth:`authenticate` does."""
        if not self.enabled:
            return ANONYMOUS, None
        metadata = tuple(metadata)
        api_key = _metadata_value(metadata, "x-api-key")
        if api_key is not None:
            return self._api_key(api_key), None
        header = _metadata_value(metadata, "authorization")
        if header is None:
            raise UnauthenticatedError(f"no credentials: {_HOW_TO}")
        scheme, _, credential = header.strip().partition(" ")
        credential = credential.strip()
        if scheme.lower() != "bearer" or not credential:
            raise UnauthenticatedError(
                f"authorization header is not 'Bearer <token>' (scheme {scheme[:20]!r}): {_HOW_TO}"
            )
        if credential.count(".") == 2:
            return self._jwt(credential)
        return self._api_key(credential), None

    def _api_key(self, key: str) -> Principal:
        principal = self._api_keys.get(hash_api_key(key))
        if principal is None:
            raise UnauthenticatedError(
                "unknown API key: it is not in auth.api_keys_file (or that file is not set)"
            )
        return principal

    def _jwt(self, token: str) -> tuple[Principal, float]:
        now = self._clock()
        skew = self._config.clock_skew_seconds
        cached = self._verified.get(token)
        if cached is not None:
            principal, expires = cached
            if now <= expires + skew:
                return principal, expires + skew
            del self._verified[token]
            raise TokenExpiredError(
                f"{TOKEN_EXPIRED} at {_iso(expires)} (now {_iso(now)}): get a new token"
            )
        claims = self._verify(token, now)
        name = claims.get(self._config.principal_claim)
        if not isinstance(name, str) or not name:
            raise UnauthenticatedError(
                f"token has no principal: claim {self._config.principal_claim!r} "
                f"(auth.jwt.principal_claim) must be a non-empty string"
            )
        roles = claims.get(self._config.roles_claim, ())
        if isinstance(roles, str):
            roles = (roles,)
        principal = Principal(name, frozenset(r for r in roles if isinstance(r, str)), "jwt")
        if len(self._verified) >= TOKEN_CACHE_SIZE:
            self._verified.clear()
        expires = float(claims["exp"])
        self._verified[token] = (principal, expires)
        return principal, expires + skew

    def _verify(self, token: str, now: float) -> dict[str, Any]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise UnauthenticatedError(
                "malformed token: not a JWT (header.payload.signature)"
            ) from None
        algorithm = header.get("alg")
        keys: list[Any]
        if algorithm in _HMAC_ALGORITHMS:
            keys, source = ([self._secret] if self._secret else []), "auth.jwt.hmac_secret"
        elif algorithm in _RSA_ALGORITHMS:
            keys, source = self._rsa, "an RSA key in auth.jwt.public_key_files"
        elif algorithm in _EC_ALGORITHMS:
            keys, source = self._ec, "an EC key in auth.jwt.public_key_files"
        else:
            raise UnauthenticatedError(
                f"token algorithm {str(algorithm)[:20]!r} is not accepted: use HS256, RS256 "
                f"or ES256"
            )
        if not keys:
            raise UnauthenticatedError(
                f"{algorithm} tokens are not accepted here: the broker has no {source}"
            )
        config = self._config
        for key in keys:
            try:
                claims: dict[str, Any] = jwt.decode(
                    token,
                    key,
                    algorithms=[algorithm],
                    issuer=config.issuer,
                    audience=config.audience,
                    leeway=config.clock_skew_seconds,
                    options={
                        "require": ["exp"],
                        "verify_aud": config.audience is not None,
                        "verify_iss": config.issuer is not None,
                    },
                )
                return claims
            except jwt.InvalidSignatureError:
                continue
            except jwt.ExpiredSignatureError:
                exp = jwt.decode(token, options={"verify_signature": False}).get("exp", 0)
                raise TokenExpiredError(
                    f"{TOKEN_EXPIRED} at {_iso(float(exp))} (now {_iso(now)}): get a new token"
                ) from None
            except jwt.MissingRequiredClaimError as exc:
                raise UnauthenticatedError(_missing_claim(exc.claim, config)) from None
            except jwt.ImmatureSignatureError:
                raise UnauthenticatedError(
                    "token is not valid yet (nbf/iat in the future)"
                ) from None
            except jwt.InvalidIssuerError:
                raise UnauthenticatedError(
                    f"token issuer is not {config.issuer!r} (auth.jwt.issuer)"
                ) from None
            except jwt.InvalidAudienceError:
                raise UnauthenticatedError(
                    f"token audience is not {config.audience!r} (auth.jwt.audience)"
                ) from None
            except jwt.InvalidTokenError as exc:
                raise UnauthenticatedError(f"invalid token: {exc}") from None
        raise UnauthenticatedError(
            f"token signature does not verify with {source} ({algorithm}): it was signed "
            f"with another key or altered"
        )


def _missing_claim(claim: str, config: JwtConfig) -> str:
    """What is wrong with a token that lacks ``claim`` (``exp``, or ``aud``/``iss`` when
    configured)."""
    if claim == "aud":
        return (
            f"token has no 'aud' claim: auth.jwt.audience requires {config.audience!r}; get a "
            f"token issued for that audience"
        )
    if claim == "iss":
        return (
            f"token has no 'iss' claim: auth.jwt.issuer requires {config.issuer!r}; get a "
            f"token from that issuer"
        )
    return f"token has no {claim!r} claim: tokens must expire (set 'exp')"


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")
