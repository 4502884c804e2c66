"""Permission rules (``auth.permissions``) and the ``auth`` configuration's checks."""

from __future__ import annotations

import pytest

from danube_ingest.config import load_config
from danube_ingest.config.auth import PermissionRule
from danube_ingest.errors import ConfigError
from danube_ingest.security import Authorizer, PermissionDeniedError, Principal, resource_matches


@pytest.mark.parametrize(
    ("pattern", "topic", "covered"),
    [
        ("*", "/any/thing", True),
        ("*", None, True),
        ("shop", "/shop/orders", True),
        ("shop", "/shopping/orders", False),
        ("shop", None, False),
        ("/shop/*", "/shop/orders", True),
        ("/shop/orders", "/shop/orders", True),
        ("/shop/orders", "/shop/orders-part-3", True),
        ("/shop/orders", "/shop/orders2", False),
        ("/shop/eu-*", "/shop/us-orders", False),
    ],
)
def test_resource_patterns(pattern: str, topic: str | None, covered: bool) -> None:
    assert resource_matches(pattern, topic) is covered


def test_rules_grant_by_principal_or_role_and_admin_includes_the_rest() -> None:
    authorizer = Authorizer(
        [
            PermissionRule(principal="alice", resource="shop", actions=["produce"]),
            PermissionRule(role="readers", resource="/shop/paid", actions=["consume"]),
            PermissionRule(role="ops", resource="*", actions=["admin"]),
        ]
    )
    alice = Principal("alice", frozenset({"readers"}), "jwt")
    assert authorizer.allowed(alice, "produce", "/shop/orders")
    assert authorizer.allowed(alice, "consume", "/shop/paid")
    assert not authorizer.allowed(alice, "consume", "/shop/orders")
    assert not authorizer.allowed(alice, "produce", "/other/orders")
    ops = Principal("bob", frozenset({"ops"}), "jwt")
    assert authorizer.allowed(ops, "consume", "/other/orders")
    assert authorizer.allowed(ops, "admin", None)
    with pytest.raises(PermissionDeniedError) as denied:
        authorizer.check(alice, "consume", "/shop/orders")
    assert "'alice'" in str(denied.value) and "consume /shop/orders" in str(denied.value)


def test_auth_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="needs a way to authenticate"):
        load_config(None, {"auth.enabled": True})
    with pytest.raises(ConfigError, match="exactly one of principal or role"):
        load_config(None, {"auth.permissions": [{"resource": "shop", "actions": ["produce"]}]})
    with pytest.raises(ConfigError, match="resource"):
        load_config(
            None,
            {"auth.permissions": [{"principal": "a", "resource": "/a/", "actions": ["admin"]}]},
        )
