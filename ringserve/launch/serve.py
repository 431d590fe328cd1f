"""Rank 0 as the serving process: the conductor and the HTTP API on one
event loop. With one rank there is no ring; with more, rank 0 joins the gloo
group, opens its links and waits for READY to come round before serving."""

from __future__ import annotations

from pathlib import Path

import structlog

from ringserve.config import EngineConfig, layer_range
from ringserve.engine.conductor import Conductor
from ringserve.engine.desk import RequestDesk
from ringserve.engine.grammar import Grammars, StructuredOutputsConfig
from ringserve.http.app import create_app
from ringserve.http.options import HttpOptions
from ringserve.http.server import serve
from ringserve.launch.boot import (
    build_drafter,
    build_rank_zero,
    build_stage,
    hidden_announcement,
    report_loaded,
)
from ringserve.launch.processes import EXIT_LINK_FAILED, exit_now_if_stuck
from ringserve.models.config import ModelConfig
from ringserve.ring.faults import FaultPlan
from ringserve.ring.topology import announce_ready, open_links

log = structlog.get_logger(__name__)


def build_conductor(config: EngineConfig, world: int = 1, ends=None) -> Conductor:
    """Rank 0's conductor: the whole model with no ring (`world` 1), or rank
    0's slice of a ring whose links are open (`ring/topology.open_links`).
    Build it on the loop that will run it."""
    cfg = ModelConfig.from_dir(config.model_dir)
    layers = range(cfg.num_layers) if world == 1 else layer_range(list(config.layer_split or ()), 0)
    stage = build_stage(config, cfg, layers, rank=0)
    zero = build_rank_zero(config, cfg, world=world)
    tokenizer_json = config.model_dir / "tokenizer.json"
    grammars = Grammars(
        tokenizer_json if tokenizer_json.exists() else None,
        cfg.vocab_size,
        sorted(zero.new_request.eos_ids),
        StructuredOutputsConfig.parse(config.structured_outputs_config),
    )
    desk = RequestDesk(
        zero.scheduler,
        zero.tokenizer,
        zero.new_request,
        cfg.vocab_size,
        max_waiting=config.waiting_limit,
        queue_timeout_s=config.queue_timeout_s,
        grammars=grammars,
    )
    return Conductor(
        zero.scheduler,
        stage,
        desk,
        ring=ends,
        wedge_timeout_s=config.wedge_timeout_s,
        heartbeat_s=config.heartbeat_s,
        drafter=build_drafter(config, cfg),
    )


async def run_rank_zero(
    spec, config: EngineConfig, http: HttpOptions, ready_file: str | None
) -> int:
    """The serving rank 0 process: build, wait for the ring, serve, and shut
    the ring down on the way out. Returns the process exit code."""
    ends = None
    if spec.world > 1:
        expect = hidden_announcement(config, ModelConfig.from_dir(config.model_dir))
        ends = open_links(spec, FaultPlan.from_env(0), expect)
        conductor = build_conductor(config, spec.world, ends)
        report_loaded(conductor.stage)
        await announce_ready(ends, timeout_s=600.0)
    else:
        conductor = build_conductor(config)
        report_loaded(conductor.stage)
    app = create_app(conductor, http, plan=config.plan, model_dir=config.model_dir)
    ready = Path(ready_file) if ready_file else None
    reason = await serve(conductor, app, http, ready)
    if ends is not None:
        await ends.send.close(timeout_s=5.0)
        if conductor.failure is None:
            await ends.recv.close(timeout_s=5.0)
    conductor.executor.shutdown(wait=False, cancel_futures=True)
    conductor.mask_executor.shutdown(wait=False, cancel_futures=True)
    code = 0
    if conductor.failure is not None:
        log.error("server.stopped", reason=reason)
        code = EXIT_LINK_FAILED
    if ends is not None:
        exit_now_if_stuck(ends, code)
    return code
