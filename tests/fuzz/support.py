"""The fuzzers' budget and shared strategies.

Every fuzz test runs in the default test run with a small, fixed budget (``derandomize``: the
same examples every run, so CI never turns red on a new random draw). ``DANUBE_FUZZ_EXAMPLES=N``
runs each target for ``N`` examples with fresh random draws instead, to search longer locally
(docs/fuzzing.md).
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

#: Examples per target when set (a local, longer search); unset in CI.
EXAMPLES = int(os.environ.get("DANUBE_FUZZ_EXAMPLES") or 0)

#: Longest input the byte fuzzers draw: decoders must bound their allocations by the data, not
#: by a length field, so long inputs add nothing but time.
MAX_INPUT = 4096


def budget(examples: int, *, deadline_ms: int | None = 5_000) -> Any:
    """Hypothesis settings for one fuzz target: ``examples`` in CI, ``EXAMPLES`` if set.

    ``deadline_ms`` bounds one example (generous: CI's two cores are shared); a hang is caught
    by the test's own ``pytest.mark.timeout``.
    """
    return settings(
        max_examples=EXAMPLES or examples,
        deadline=deadline_ms,
        database=None,
        derandomize=not EXAMPLES,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture,
        ],
    )


#: Text with odd unicode: surrogates excluded only where the encoder needs UTF-8.
odd_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40
) | st.sampled_from(["", " ", "\x00", "\u200b", "\U0001f600" * 3, "a" * 300, "/", "../.."])

#: Integers at every width's edges.
edge_ints = (
    st.sampled_from(
        [0, 1, -1, 255, 256, 65_535, 65_536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32]
    )
    | st.sampled_from([(1 << 63) - 1, -(1 << 63), (1 << 64) - 1])
    | st.integers(min_value=-(1 << 64), max_value=1 << 64)
)

#: JSON-ish values: what a damaged or foreign metadata record or snapshot may hold.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | edge_ints
    | st.floats(allow_nan=True, allow_infinity=True)
    | odd_text,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            odd_text | st.sampled_from(["name", "id", "offset"]), children, max_size=4
        )
    ),
    max_leaves=12,
)
