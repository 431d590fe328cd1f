"""The read-only routes: `/health`, `/metrics`, `/v1/models`, `/v1/plan`,
`/openapi.json`.

`/health` is liveness of the work, not of the socket (DESIGN §9.7): 200
only while no message the ring owes rank 0 is overdue and the ring has not
failed; 503 with the reason otherwise.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from ringserve.cache.tier_figures import tier_gauges
from ringserve.http.errors import ApiError
from ringserve.http.openapi import OPENAPI
from ringserve.http.responses import Health, ModelCard, ModelList, json_response
from ringserve.http.served import SERVED, ServedModel

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def health(request: web.Request) -> web.Response:
    conductor = request.app[SERVED].conductor
    if conductor.health.healthy and conductor.failure is None:
        return json_response(Health("ok"))
    reason = conductor.health.reason or conductor.failure
    return json_response(Health("unhealthy", reason), status=503)


async def metrics(request: web.Request) -> web.Response:
    conductor = request.app[SERVED].conductor
    text = conductor.metrics.render(gauges(request.app[SERVED]), conductor.counters())
    return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_TYPE})


def gauges(served: ServedModel) -> dict[str, tuple[float, str]]:
    conductor = served.conductor
    scheduler = conductor.scheduler
    allocator = scheduler.allocator
    return {
        "queue_depth": (len(scheduler.waiting), "requests waiting to be scheduled"),
        "requests_running": (len(scheduler.running), "requests admitted and generating"),
        "passes_in_flight": (len(scheduler.in_flight), "passes sent and not yet returned"),
        "kv_slots_free": (allocator.available, "KV slots free"),
        "kv_slots_used": (allocator.used, "KV slots allocated (running or cached)"),
        "kv_slots_cached": (scheduler.cache.total_size, "KV slots held by the prefix cache"),
        "kv_slots_capacity": (allocator.capacity - 1, "usable KV slots"),
        "healthy": (int(conductor.health.healthy), "1 while the ring makes progress"),
        **tier_gauges(scheduler.cache),
    }


async def models(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    return json_response(ModelList([ModelCard(served.name, served.created, served.max_model_len)]))


async def plan(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    if served.plan is None:
        raise ApiError(404, "this server was started without a memory plan", code="not_found")
    return json_response(served.plan)


async def openapi(request: web.Request) -> web.Response:
    spec = request.app[OPENAPI]
    return web.Response(body=msgspec.json.encode(spec), content_type="application/json")
