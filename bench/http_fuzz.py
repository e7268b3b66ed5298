"""Schemathesis over every route of the gateway's `/openapi.json`, at volume: no input, valid or
not, may produce a 5xx. The gateway runs for real over HTTP with the Core double behind it (as
tests/gateway/test_gateway_schemathesis.py, which runs a few cases per route in CI).

    python bench/http_fuzz.py --cases 10000     # spread evenly over the routes and both modes

Prints one JSON object: cases per route and mode, and every failure (status and request)."""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def fuzz(total_cases: int, seed: int) -> dict:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error

    from tests.gateway.conftest import GatewayThread
    from tests.gateway.core_double import CoreDoubleServer

    folder = Path(tempfile.mkdtemp(prefix="mm-httpfuzz-"))
    core = CoreDoubleServer(f"unix://{folder / 'core.sock'}").start()
    gateway = GatewayThread(core.target, model_name_hint="tiny-moe").start()
    try:
        schema = schemathesis.openapi.from_url(gateway.url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
        per_run = math.ceil(total_cases / (len(operations) * len(modes)))
        cases: Counter = Counter()
        failures: list[dict] = []
        started = time.monotonic()

        def run(operation, mode, run_seed: int) -> None:
            key = f"{operation.method.upper()} {operation.path} {mode.value}"

            @hypothesis_seed(run_seed)
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=per_run, deadline=None, database=None, suppress_health_check=list(HealthCheck)
            )
            def check(case) -> None:
                cases[key] += 1
                core.double.reset()
                try:
                    case.call_and_validate(checks=[not_a_server_error], timeout=10)
                except Exception as error:  # noqa: BLE001 - every failure is recorded, then the next case
                    if len(failures) < 50:
                        failures.append({"route": key, "error": str(error)[:500]})

            try:
                check()
            except Unsatisfiable:
                pass  # negative mode has nothing to break without a body (GET /health)

        # Routes without inputs give one case a pass: passes with new seeds until the total is met.
        passes = 0
        while sum(cases.values()) < total_cases and passes < 20:
            for operation in operations:
                for mode in modes:
                    run(operation, mode, seed + passes)
            passes += 1
            print(f"[http_fuzz] pass {passes}: {sum(cases.values())} cases", file=sys.stderr, flush=True)
        return {
            "routes": len(operations),
            "cases": sum(cases.values()),
            "cases_by_route": dict(cases),
            "failures": failures,
            "seconds": round(time.monotonic() - started, 1),
        }
    finally:
        gateway.stop()
        core.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000, help="cases in all, over every route and mode")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from services.common.logging import configure_logging

    configure_logging("bench", "critical")  # every refused request logs by design
    result = {
        "bench": "http_fuzz",
        "machine": f"{platform.system()} {platform.machine()}",
        "command": "python bench/http_fuzz.py " + " ".join(sys.argv[1:]),
        **fuzz(args.cases, args.seed),
    }
    print(json.dumps(result, indent=1))
    sys.exit(0 if not result["failures"] else 1)


if __name__ == "__main__":
    main()
