"""Load benchmark: `ringserve bench` (streaming requests at a Poisson rate,
vLLM's report) against a server this script launches, or an existing one.

    .venv/bin/python bench/load.py                 # launches the built-in model, pp 1
    .venv/bin/python bench/load.py --pp 3          # ... as a 3-rank ring
    .venv/bin/python bench/load.py --url http://127.0.0.1:8000   # an existing server
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.request

from ringserve.cli import main as ringserve
from ringserve.launch.processes import free_port


def launch(pp: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ringserve", "launch", "--pp", str(pp), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise SystemExit("the server did not come up")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args, more = ap.parse_known_args()  # anything else goes to `ringserve bench`
    proc, url = (None, args.url) if args.url else launch(args.pp)
    try:
        code = ringserve(
            ["bench", "--base-url", url, "--num-prompts", str(int(args.rate * args.duration)),
             "--request-rate", str(args.rate), "--random-prefix-len", "32",
             "--random-input-len", "16", "--random-output-len", str(args.max_tokens),
             "--ignore-eos", "--seed", str(args.seed), "--disable-tqdm", *more]
        )  # fmt: skip
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(15)
    sys.exit(code)


if __name__ == "__main__":
    main()
