"""Property-based fuzzing of every route in `/openapi.json` (schemathesis): no input, valid or
not, may produce a 5xx. Runs against the real gateway over HTTP with the Core double behind it.

Driven through hypothesis directly rather than schemathesis' pytest plugin, whose fixture loader
does not work with pytest 9.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from .conftest import GatewayThread
from .core_double import CoreDouble

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

EXAMPLES_PER_OPERATION = {GenerationMode.POSITIVE: 10, GenerationMode.NEGATIVE: 8}


@pytest.mark.parametrize("mode", list(EXAMPLES_PER_OPERATION), ids=lambda mode: mode.value)
def test_no_input_gives_a_server_error(
    gateway: GatewayThread, core: CoreDouble, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(gateway.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8

    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES_PER_OPERATION[mode],
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=[not_a_server_error], timeout=10)

        try:
            check()
        except Unsatisfiable:
            # Negative mode has nothing to break in an operation without a body: no input at all
            # (GET /health) or a free-form string (GET /v1/models/{model_id}).
            assert mode is GenerationMode.NEGATIVE and not operation.body
