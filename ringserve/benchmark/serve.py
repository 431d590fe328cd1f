"""`ringserve bench`: drive a running OpenAI-compatible server with
`vllm bench serve`'s flags and print its report (or `--json`).

    ringserve bench --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --request-rate 8 --random-input-len 512 --random-output-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from tqdm import tqdm

from ringserve.benchmark.datasets import SampleRequest, random_requests, sharegpt_requests
from ringserve.benchmark.request import RequestResult, Target, send
from ringserve.benchmark.results import METRICS, parse_goodput, report, summarise
from ringserve.config import UserError
from ringserve.http.options import http_url
from ringserve.models.tokenizer import Tokenizer


def run(args: argparse.Namespace) -> int:
    _check(args)
    summary = asyncio.run(benchmark(args))
    if args.result_filename:
        Path(args.result_filename).write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary))
    else:
        print(report(summary, max_concurrency=args.max_concurrency, request_rate=args.request_rate))
    return 0 if summary["completed"] else 1


def _check(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise UserError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UserError("--max-concurrency must be at least 1")
    if not args.request_rate > 0 or not args.burstiness > 0:
        raise UserError("--request-rate and --burstiness must be > 0")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise UserError("--dataset-name sharegpt needs --dataset-path FILE.json")
    unknown = set(args.percentile_metrics.split(",")) - set(METRICS)
    if unknown:
        raise UserError(f"--percentile-metrics: unknown {sorted(unknown)}; known {list(METRICS)}")
    _percentiles(args.metric_percentiles)
    parse_goodput(args.goodput)
    if args.dataset_name == "random" and (args.random_input_len < 1 or args.random_output_len < 1):
        raise UserError("--random-input-len and --random-output-len must be at least 1")
    if args.random_prefix_len < 0:
        raise UserError("--random-prefix-len must be at least 0")
    if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
        raise UserError("--sharegpt-output-len must be at least 1")
    if args.base_url is None and not 0 < args.port < 1 << 16:
        raise UserError(f"--port {args.port} is not a TCP port (1-65535)")
    if args.result_filename:  # found unwritable now, not after the run
        try:
            with Path(args.result_filename).open("a"):
                pass
        except OSError as exc:
            raise UserError(f"--result-filename {args.result_filename}: {exc.strerror}") from None


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        raise UserError(f"--metric-percentiles {text!r}: give numbers, e.g. 50,90,99") from None
    if not all(0 < p <= 100 for p in values):
        raise UserError(f"--metric-percentiles {text!r}: each must be in (0, 100]")
    return values


async def benchmark(args: argparse.Namespace) -> dict:
    base = args.base_url or http_url(args.host, args.port)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await _first_model(session, base, args.api_key)
        requests = _requests(args, _tokenizer(args.tokenizer, model))
        target = Target(base, args.endpoint, model, args.api_key, args.temperature, args.ignore_eos)
        results = await _drive(session, target, requests, args)
    duration, results = results
    return {
        "base_url": base,
        "model": model,
        "endpoint": args.endpoint,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **summarise(
            results,
            duration,
            percentiles=_percentiles(args.metric_percentiles),
            slos=parse_goodput(args.goodput),
            metrics=args.percentile_metrics.split(","),
        ),
    }


async def _drive(
    session: aiohttp.ClientSession,
    target: Target,
    requests: list[SampleRequest],
    args: argparse.Namespace,
) -> tuple[float, list[RequestResult]]:
    """Send every request on its arrival time, at most `max_concurrency`
    at once; returns the wall time from the first send to the last reply."""
    bar = tqdm(total=len(requests), disable=args.disable_tqdm or args.json, file=sys.stderr)
    cap = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def one(req: SampleRequest) -> RequestResult:
        if cap is None:
            result = await send(session, target, req)
        else:
            async with cap:
                result = await send(session, target, req)
        bar.update(1)
        return result

    began = time.perf_counter()
    tasks = []
    async for req in _arrivals(requests, args.request_rate, args.burstiness, args.seed):
        tasks.append(asyncio.create_task(one(req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - began
    bar.close()
    return duration, list(results)


async def _arrivals(
    requests: list[SampleRequest], rate: float, burstiness: float, seed: int
) -> AsyncIterator[SampleRequest]:
    """vLLM's arrival process: gaps drawn from a gamma distribution of mean
    1/rate (shape `burstiness`; 1 is a Poisson process), none at rate inf."""
    rng = random.Random(seed)
    for req in requests:
        yield req
        if rate != float("inf"):
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


async def _first_model(session: aiohttp.ClientSession, base: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(base.rstrip("/") + "/v1/models", headers=headers) as resp:
            status = resp.status
            models = (await resp.json())["data"] if status == 200 else None
    except (aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
        raise UserError(f"cannot list the models of {base} ({exc}); is the server up?") from None
    if status == 401:
        raise UserError(f"{base} refused the model list (401): give its --api-key")
    if models is None:
        raise UserError(f"cannot list the models of {base} (HTTP {status})")
    if not models:
        raise UserError(f"{base} serves no model")
    return models[0]["id"]


def _tokenizer(given: str | None, model: str) -> Tokenizer | None:
    """The tokenizer named by --tokenizer (an error when it cannot be had),
    else the served model's when its files are here (a directory, the Hub
    cache, or the built-in model, served under its directory's name);
    without one, prompts are counted in words, and that is said."""
    from ringserve.models.builtin import BUILTIN_VERSION, builtin_model_dir
    from ringserve.models.hub import resolve_model

    try:
        if given is None and model == BUILTIN_VERSION:
            return Tokenizer.from_dir(builtin_model_dir())
        return Tokenizer.from_dir(resolve_model(given or model, local_files_only=True))
    except (UserError, OSError, ValueError) as exc:
        if given is not None:
            raise UserError(f"--tokenizer {given}: {exc}") from None
        print(
            f"ringserve bench: no tokenizer of {model!r} here: prompt lengths are counted "
            "in words (give --tokenizer DIR or a Hub id for token counts)",
            file=sys.stderr,
        )
        return None


def _requests(args: argparse.Namespace, tokenizer: Tokenizer | None) -> list[SampleRequest]:
    if args.dataset_name == "sharegpt":
        return sharegpt_requests(
            args.dataset_path,
            args.num_prompts,
            output_len=args.sharegpt_output_len,
            tokenizer=tokenizer,
            seed=args.seed,
        )
    return random_requests(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        range_ratio=args.random_range_ratio,
        prefix_len=args.random_prefix_len,
        tokenizer=tokenizer,
        seed=args.seed,
    )
