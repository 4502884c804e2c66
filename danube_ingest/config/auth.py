"""The ``auth`` section: who may call the broker, and what each caller may do.

Off by default (``make dev`` on loopback). Turned on, every RPC on the broker's gRPC port needs a
JWT bearer token or an API key (``danube_ingest.security``), and each request is checked
against ``auth.permissions``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from danube_ingest.config.values import (
    _OptionalPath,
    _OptionalSecret,
    _OptionalStr,
    _Path,
    _Seconds,
    _Section,
)
from danube_ingest.errors import ConfigError

Action = Literal["produce", "consume", "admin"]


class JwtConfig(_Section):
    """How bearer tokens (JWTs, as danube-client sends them) are verified."""

    hmac_secret: _OptionalSecret = Field(
        default=None,
        description=(
            "Shared secret for HS256/HS384/HS512 tokens (use `${ENV}`); null: HMAC tokens "
            "are refused unless `hmac_secret_file` is set."
        ),
    )
    hmac_secret_file: _OptionalPath = Field(
        default=None,
        description="File holding the HMAC secret (surrounding whitespace is stripped).",
    )
    public_key_files: list[_Path] = Field(
        default_factory=list,
        description=(
            "PEM public keys (RSA for RS256/RS384/RS512/PS256, EC for ES256/ES384) that may "
            "sign tokens; a token is accepted if any key of its algorithm's kind verifies it."
        ),
    )
    issuer: _OptionalStr = Field(
        default=None, description="Required `iss` claim; null: not checked."
    )
    audience: _OptionalStr = Field(
        default=None, description="Required `aud` claim; null: not checked."
    )
    clock_skew_seconds: _Seconds = Field(
        default=30.0,
        ge=0,
        description=(
            "Leeway when checking `exp` and `nbf` against this host's clock; a stream opened "
            "with a JWT ends (UNAUTHENTICATED) at its `exp` plus this."
        ),
    )
    principal_claim: str = Field(
        default="sub", description="Claim naming the principal (permissions refer to it)."
    )
    roles_claim: str = Field(
        default="roles",
        description="Claim with the principal's roles (a list of strings, or one string).",
    )


class PermissionRule(_Section):
    """One grant: a principal (or a role) may do ``actions`` on ``resource``."""

    principal: _OptionalStr = Field(
        default=None, description="Principal name the rule applies to; `*`: everyone."
    )
    role: _OptionalStr = Field(default=None, description="Role the rule applies to.")
    resource: str = Field(
        default="*",
        description=(
            "`*` (every topic), a namespace (`orders`), or a topic pattern (`/orders/*`, "
            "`/orders/eu-*`, `/orders/paid`); a topic's partitions (`-part-N`) are covered "
            "by the topic's pattern."
        ),
    )
    actions: list[Action] = Field(
        default_factory=list,
        description="Any of produce, consume, admin (admin includes the other two).",
    )

    @model_validator(mode="after")
    def _one_subject(self) -> PermissionRule:
        if (self.principal is None) == (self.role is None):
            raise ConfigError("a permission rule names exactly one of principal or role")
        if not self.actions:
            raise ConfigError("a permission rule needs at least one action")
        return self

    @field_validator("resource")
    @classmethod
    def _check_resource(cls, value: str) -> str:
        if not value or value.count("/") not in (0, 2) or value.endswith("/"):
            raise ConfigError(
                f"must be '*', a namespace or a /namespace/topic pattern (got {value!r})"
            )
        return value


class AuthConfig(_Section):
    """Authentication (JWT bearer tokens, API keys) and per-topic permissions."""

    enabled: bool = Field(
        default=False,
        description=(
            "Require a JWT or API key on every RPC and check `auth.permissions`. Off: every "
            "caller is anonymous and may do everything (for loopback development only)."
        ),
    )
    jwt: JwtConfig = Field(default_factory=JwtConfig, description="JWT verification.")
    api_keys_file: _OptionalPath = Field(
        default=None,
        description=(
            "File of API keys for service accounts, one per line: `PRINCIPAL "
            "sha256:HEX [ROLE,ROLE...]` (HEX: the SHA-256 of the key; `#` starts a comment). "
            "Keys are sent as `x-api-key: KEY` or `authorization: Bearer KEY`."
        ),
    )
    permissions: list[PermissionRule] = Field(
        default_factory=list,
        description=(
            "Grants (`principal` or `role`, `resource`, `actions`); what no rule grants is "
            "refused with PERMISSION_DENIED."
        ),
    )

    @model_validator(mode="after")
    def _can_authenticate(self) -> AuthConfig:
        jwt = self.jwt
        if self.enabled and not (
            jwt.hmac_secret or jwt.hmac_secret_file or jwt.public_key_files or self.api_keys_file
        ):
            raise ConfigError(
                "auth.enabled needs a way to authenticate: set auth.jwt.hmac_secret, "
                "auth.jwt.hmac_secret_file, auth.jwt.public_key_files or auth.api_keys_file"
            )
        return self
