"""Fuzz benchmark: schemathesis sends generated requests to every operation
of a server's `/openapi.json` and checks each answer (no 5xx, a documented
status, a body its schema describes), with a long budget and fresh random
cases each run (tests/test_fuzz.py runs the same briefly, derandomized).

    .venv/bin/python bench/fuzz.py                     # launches the built-in model, pp 1
    .venv/bin/python bench/fuzz.py --pp 3 --examples 500
    .venv/bin/python bench/fuzz.py --url http://127.0.0.1:8000   # an existing server

Exits 1 when there is a finding, printing how to reproduce it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests/

from tests.fuzzing import fuzz  # noqa: E402
from tests.launched import Launched  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="fuzz this server instead of launching one")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--examples", type=int, default=300, help="cases per operation")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--shrink", action="store_true", help="shrink each finding to a small case")
    args = p.parse_args()
    began = time.monotonic()
    if args.url is not None:
        report = fuzz(args.url, args.examples, derandomize=False, shrink=args.shrink)
    else:
        opts = ("--pp", str(args.pp), "--max-model-len", str(args.max_model_len))
        with Launched(*opts, "--wedge-timeout-s", "10") as server:
            report = fuzz(server.url, args.examples, derandomize=False, shrink=args.shrink)
    took = time.monotonic() - began
    for op, n in report.cases.items():
        print(f"{op:28} {n:5} cases, {report.accepted[op]:5} answered 2xx")
    print(f"{report.total} cases, {len(report.findings)} findings in {took:.0f} s")
    for finding in report.findings:
        print("\n" + finding)
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
