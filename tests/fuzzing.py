"""Property-based fuzzing of a running server against its own
`/openapi.json` (schemathesis): every operation gets generated requests
that the description admits, and each answer must be no 5xx, a status the
description lists and a body its schema describes. Used by the test suite
with a short budget and by `bench/fuzz.py` with a long one."""

from __future__ import annotations

from dataclasses import dataclass, field

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance]


@dataclass(slots=True)
class FuzzReport:
    """Cases sent and answered 2xx per operation, and what failed (empty
    when all passed)."""

    cases: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.cases.values())


def fuzz(url: str, examples: int, *, derandomize: bool = True, shrink: bool = False) -> FuzzReport:
    """Up to `examples` generated cases per operation of the server at
    `url`; `derandomize` makes the cases the same on every run."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    report = FuzzReport()
    phases = [Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])]
    for result in schema.get_all_operations():
        operation = result.ok()
        label = operation.label
        report.cases[label] = report.accepted[label] = 0

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=derandomize,
            phases=phases,
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
        )
        @given(case=operation.as_strategy())
        def check(case: schemathesis.Case) -> None:
            response = case.call_and_validate(checks=CHECKS, timeout=60)
            report.cases[case.operation.label] += 1
            report.accepted[case.operation.label] += response.status_code < 300

        try:
            check()
        except Exception as exc:  # a finding: schemathesis says what and how to reproduce
            report.findings.append(f"{label}: {exc}")
    return report
