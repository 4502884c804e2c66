"""Authorization: may this principal produce, consume or administer this topic?

Rules come from ``auth.permissions``; what no rule grants is refused. ``admin`` includes
``produce`` and ``consume``. A rule's resource is ``*`` (every topic and the cluster itself), a
namespace (``orders``: every topic of ``/orders``), or a ``/namespace/topic`` glob pattern
(``/orders/*``, ``/orders/paid``); a pattern that covers a topic covers its partitions
(``/orders/paid-part-3``). Cluster-wide actions (``resource=None``: the schema registry's
subjects) are granted only by rules on ``*``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fnmatch import fnmatchcase

from danube_ingest.config.auth import Action, PermissionRule
from danube_ingest.security.authn import Principal
from danube_ingest.security.errors import PermissionDeniedError

_PARTITION = re.compile(r"-part-\d+$")
#: Decisions remembered (principal, action, topic) -> allowed; emptied when full.
DECISION_CACHE_SIZE = 16384


def resource_matches(pattern: str, topic: str | None) -> bool:
    """Whether a rule's ``pattern`` covers ``topic`` (``None``: the whole cluster)."""
    if pattern == "*":
        return True
    if topic is None:
        return False
    if "/" not in pattern:
        parts = topic.split("/")
        return len(parts) == 3 and fnmatchcase(parts[1], pattern)
    return fnmatchcase(topic, pattern) or fnmatchcase(_PARTITION.sub("", topic), pattern)


class Authorizer:
    """Checks actions against ``auth.permissions`` (see the module docstring)."""

    def __init__(self, rules: Sequence[PermissionRule]) -> None:
        self._rules = tuple(rules)
        self._decisions: dict[tuple[Principal, str, str | None], bool] = {}

    def allowed(self, principal: Principal, action: Action, topic: str | None) -> bool:
        """Whether some rule grants ``action`` on ``topic`` to ``principal`` or one of its
        roles."""
        key = (principal, action, topic)
        decision = self._decisions.get(key)
        if decision is None:
            decision = any(
                (rule.principal in (principal.name, "*") or rule.role in principal.roles)
                and (action in rule.actions or "admin" in rule.actions)
                and resource_matches(rule.resource, topic)
                for rule in self._rules
            )
            if len(self._decisions) >= DECISION_CACHE_SIZE:
                self._decisions.clear()
            self._decisions[key] = decision
        return decision

    def check(self, principal: Principal, action: Action, topic: str | None) -> None:
        """Raise :class:`PermissionDeniedError` naming principal, action and resource unless
        :meth:`allowed`."""
        if not self.allowed(principal, action, topic):
            resource = topic if topic is not None else "the cluster (resource '*')"
            raise PermissionDeniedError(
                f"principal {principal.name!r} may not {action} {resource}: no auth.permissions "
                f"rule grants it; ask an operator for a rule"
            )
