"""The API keeps its own description: schemathesis generates requests from
a launched server's `/openapi.json` and every answer must be no 5xx, a
status the description lists and a body its schema describes (tests/fuzzing.py;
`bench/fuzz.py` runs the same with a long budget)."""

from __future__ import annotations

import pytest

from tests.fuzzing import fuzz
from tests.launched import Launched

pytestmark = pytest.mark.timeout(240)
EXAMPLES = 25  # per operation; cases are the same on every run


def test_generated_requests_get_the_answers_the_description_promises():
    # Long enough for generated conversations rendered with their tools.
    with Launched("--max-model-len", "1024", "--wedge-timeout-s", "10") as server:
        report = fuzz(server.url, EXAMPLES)
        assert server.proc.poll() is None, server.output()
    assert not report.findings, "\n\n".join(report.findings)
    generating = [op for op in report.cases if op.startswith("POST")]
    assert len(generating) == 5 and len(report.cases) >= 9, report.cases
    assert all(report.cases[op] == EXAMPLES for op in generating), report.cases
    # The description admits what the server accepts: most cases are served.
    assert all(report.accepted[op] >= EXAMPLES // 2 for op in generating), report.accepted
