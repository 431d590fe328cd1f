"""The read-only routes: `/health`, `/metrics`, `/v1/models` (and one
model's card), `/v1/plan`, `/openapi.json`; each also answers HEAD.

`/health` is liveness of the work, not of the socket (DESIGN §9.7): 200
only while no message the ring owes rank 0 is overdue and the ring has not
failed; 503 with the reason otherwise.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from ringserve.http import prometheus
from ringserve.http.errors import ApiError
from ringserve.http.openapi import OPENAPI
from ringserve.http.responses import Health, ModelCard, ModelList, json_response
from ringserve.http.served import SERVED, ServedModel


async def health(request: web.Request) -> web.Response:
    conductor = request.app[SERVED].conductor
    if conductor.health.healthy and conductor.failure is None:
        return json_response(Health("ok"))
    reason = conductor.health.reason or conductor.failure
    return json_response(Health("unhealthy", reason), status=503)


async def metrics(request: web.Request) -> web.Response:
    body = prometheus.exposition(request.app)
    return web.Response(body=body, headers={"Content-Type": prometheus.CONTENT_TYPE})


async def models(request: web.Request) -> web.Response:
    return json_response(ModelList([_card(request.app[SERVED])]))


async def model(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    served.check_model(request.match_info["model"])
    return json_response(_card(served))


def _card(served: ServedModel) -> ModelCard:
    return ModelCard(served.name, served.created, served.max_model_len)


async def plan(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    if served.plan is None:
        raise ApiError(404, "this server was started without a memory plan", code="not_found")
    return json_response(served.plan)


async def openapi(request: web.Request) -> web.Response:
    spec = request.app[OPENAPI]
    return web.Response(body=msgspec.json.encode(spec), content_type="application/json")
