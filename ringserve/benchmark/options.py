"""The flags of `ringserve bench`, named as `vllm bench serve` names them.
Kept apart from the driver so the command line parses without loading it."""

from __future__ import annotations

import argparse
import os

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    p.add_argument("--model", default=None, help="model to ask for (default: the server's first)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer directory or Hub id (default: --model's)"
    )
    p.add_argument("--dataset-name", default="random", choices=("random", "sharegpt"))
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--goodput", nargs="+", default=None, help="SLOs in ms, e.g. ttft:200 tpot:50 e2el:3000"
    )
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--result-filename", default=None, help="also write the JSON result here")
