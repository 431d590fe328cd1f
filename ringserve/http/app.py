"""The HTTP API of rank 0: an aiohttp application over the conductor, on
the conductor's event loop (DESIGN §8).

Routes are listed once, in ROUTES: the app registers them and the OpenAPI
description is built from them.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from aiohttp import web

from ringserve.engine.conductor import Conductor
from ringserve.http import chat, completions, info, native, prometheus, tokenize
from ringserve.http.middleware import auth_middleware, error_middleware
from ringserve.http.openapi import OPENAPI, Route, openapi_spec
from ringserve.http.options import HttpOptions
from ringserve.http.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    Generation,
    GenerationChunk,
    Health,
    MemoryPlan,
    ModelCard,
    ModelList,
)
from ringserve.http.schemas import ChatRequest, CompletionRequest, GenerateRequest
from ringserve.http.served import SERVED, ServedModel

ROUTES = (
    Route(
        "POST",
        "/v1/completions",
        completions.create_completion,
        "OpenAI text completion",
        CompletionRequest,
        Completion,
        events=Completion,
    ),
    Route(
        "POST",
        "/v1/chat/completions",
        chat.create_chat_completion,
        "OpenAI chat completion, rendered with the model's chat template",
        ChatRequest,
        ChatCompletion,
        events=ChatCompletionChunk,
    ),
    Route(
        "POST",
        "/generate",
        native.generate,
        "native generation: token ids in, token ids and text out",
        GenerateRequest,
        Generation,
        events=GenerationChunk,
    ),
    Route(
        "POST",
        "/tokenize",
        tokenize.tokenize,
        "a prompt or a conversation to token ids, as vLLM's /tokenize",
        tokenize.TokenizeRequest,
        tokenize.TokenizeResponse,
    ),
    Route(
        "POST",
        "/detokenize",
        tokenize.detokenize,
        "token ids to text, as vLLM's /detokenize",
        tokenize.DetokenizeRequest,
        tokenize.DetokenizeResponse,
    ),
    Route("GET", "/v1/models", info.models, "the served model", answer=ModelList),
    Route(
        "GET",
        "/v1/models/{model}",
        info.model,
        "the served model's card, by its name (404 for another)",
        answer=ModelCard,
        match="/v1/models/{model:.+}",  # a Hub id has a slash
    ),
    Route(
        "GET", "/health", info.health, "200 while the ring makes progress", answer=Health, open=True
    ),
    Route("GET", "/metrics", info.metrics, "Prometheus metrics", media="text/plain", open=True),
    Route(
        "GET",
        "/v1/plan",
        info.plan,
        "the memory plan: layer split and KV capacity",
        answer=MemoryPlan,
    ),
    Route("GET", "/openapi.json", info.openapi, "this description", answer=dict[str, Any]),
)


def create_app(
    conductor: Conductor,
    options: HttpOptions,
    plan: dict[str, Any] | None = None,
    *,
    model_dir: Path | None = None,
) -> web.Application:
    """The API over `conductor`. The served model's name is
    `options.model_name`, else `model_dir`'s name, else "ringserve"."""
    open_paths = frozenset(r.path for r in ROUTES if r.open)
    app = web.Application(
        client_max_size=options.max_body_bytes,
        middlewares=[
            error_middleware(options.max_body_bytes),
            auth_middleware(options.api_key, open_paths),
        ],
    )
    app[SERVED] = ServedModel.build(conductor, options, plan, model_dir)
    app[prometheus.REGISTRY] = prometheus.registry(conductor, app[SERVED].name)
    secured = options.api_key is not None
    app[OPENAPI] = openapi_spec(ROUTES, _version(), secured, app[SERVED].constraints)
    for route in ROUTES:
        path = route.match or route.path
        if route.method == "GET":  # and HEAD, which health checkers send
            app.router.add_get(path, route.handler, allow_head=True)
        else:
            app.router.add_route(route.method, path, route.handler)
    return app


def _version() -> str:
    try:
        return version("ringserve")
    except PackageNotFoundError:
        return "0"
