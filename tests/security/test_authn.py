"""The authenticator on its own: API key files, claims, caching of verified tokens."""

from __future__ import annotations

import time
from pathlib import Path

import jwt
import pytest

from danube_ingest.config.auth import AuthConfig
from danube_ingest.errors import ConfigError
from danube_ingest.security import (
    ANONYMOUS,
    Authenticator,
    UnauthenticatedError,
    hash_api_key,
)

SECRET = "unit-test-secret-0123456789abcdef01"


def authenticator(**values: object) -> Authenticator:
    config = {"enabled": True, "jwt": {"hmac_secret": SECRET}, **values}
    return Authenticator(AuthConfig.model_validate(config))


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def test_auth_off_makes_everyone_anonymous() -> None:
    assert Authenticator(AuthConfig()).authenticate([]) == ANONYMOUS


def test_roles_and_principal_come_from_the_claims() -> None:
    token = jwt.encode(
        {"sub": "alice", "roles": ["ops", 7], "exp": time.time() + 60}, SECRET, algorithm="HS256"
    )
    principal = authenticator().authenticate(bearer(token))
    assert (principal.name, principal.roles, principal.method) == ("alice", {"ops"}, "jwt")
    nameless = jwt.encode({"exp": time.time() + 60}, SECRET, algorithm="HS256")
    with pytest.raises(UnauthenticatedError, match="no principal"):
        authenticator().authenticate(bearer(nameless))


def test_issuer_and_audience_are_checked_when_configured() -> None:
    auth = authenticator(jwt={"hmac_secret": SECRET, "issuer": "idp", "audience": "danube"})
    claims = {"sub": "a", "exp": time.time() + 60, "iss": "idp", "aud": "danube"}
    assert auth.authenticate(bearer(jwt.encode(claims, SECRET, algorithm="HS256"))).name == "a"
    for wrong, says in (({"iss": "other"}, "issuer"), ({"aud": "other"}, "audience")):
        token = jwt.encode({**claims, **wrong}, SECRET, algorithm="HS256")
        with pytest.raises(UnauthenticatedError, match=says):
            auth.authenticate(bearer(token))


def test_missing_aud_iss_or_exp_says_which_claim_and_what_to_do() -> None:
    """A token without ``aud`` (or ``iss``) where one is configured is refused naming the
    setting that requires it, not with the text about expiry."""
    auth = authenticator(jwt={"hmac_secret": SECRET, "issuer": "idp", "audience": "danube"})
    claims = {"sub": "a", "exp": time.time() + 60, "iss": "idp", "aud": "danube"}
    for missing, says in (
        ("aud", "no 'aud' claim: auth.jwt.audience requires 'danube'"),
        ("iss", "no 'iss' claim: auth.jwt.issuer requires 'idp'"),
        ("exp", "no 'exp' claim: tokens must expire"),
    ):
        token = jwt.encode(
            {k: v for k, v in claims.items() if k != missing}, SECRET, algorithm="HS256"
        )
        with pytest.raises(UnauthenticatedError) as refused:
            auth.authenticate(bearer(token))
        assert says in str(refused.value)
        if missing != "exp":
            assert "expire" not in str(refused.value)


def test_none_algorithm_is_refused() -> None:
    token = jwt.encode({"sub": "a", "exp": time.time() + 60}, None, algorithm="none")
    with pytest.raises(UnauthenticatedError, match="not accepted"):
        authenticator().authenticate(bearer(token))


def test_a_cached_token_still_expires() -> None:
    now = [time.time()]
    auth = Authenticator(
        AuthConfig.model_validate(
            {"enabled": True, "jwt": {"hmac_secret": SECRET, "clock_skew_seconds": 0}}
        ),
        clock=lambda: now[0],
    )
    token = jwt.encode({"sub": "a", "exp": int(now[0]) + 60}, SECRET, algorithm="HS256")
    assert auth.authenticate(bearer(token)).name == "a"
    now[0] += 120
    with pytest.raises(UnauthenticatedError, match="expired"):
        auth.authenticate(bearer(token))


def test_api_keys_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# accounts\nsvc {hash_api_key('k1')} writers,ops  # comment\n\n")
    auth = authenticator(api_keys_file=str(keys))
    principal = auth.authenticate([("x-api-key", "k1")])
    assert (principal.name, principal.roles, principal.method) == (
        "svc",
        {"writers", "ops"},
        "api_key",
    )
    assert auth.authenticate(bearer("k1")) == principal
    with pytest.raises(UnauthenticatedError, match="unknown API key"):
        auth.authenticate([("x-api-key", "k2")])
    keys.write_text("svc plaintext-key\n")
    with pytest.raises(ConfigError, match=f"{keys}:1"):
        authenticator(api_keys_file=str(keys))
    with pytest.raises(ConfigError, match="cannot read"):
        authenticator(api_keys_file=str(tmp_path / "missing"))
