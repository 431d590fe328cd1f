"""Rank 0's engine on one process, stepped synchronously one pass at a time
(the offline API with one rank). The ring runs the same scheduler and stage
from `engine/conductor.py`."""

from __future__ import annotations

import structlog

from ringserve.engine.boot import EngineConfig, build_rank_zero, build_stage
from ringserve.engine.params import SamplingParams
from ringserve.engine.request import Request
from ringserve.engine.stage import PassFailed
from ringserve.models.config import ModelConfig
from ringserve.ring.messages import Void

log = structlog.get_logger(__name__)


class Engine:
    """Single-rank engine: schedule a pass, run it, take its terminal."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = cfg = ModelConfig.from_dir(config.model_dir)
        self.stage = build_stage(config, cfg, range(cfg.num_layers), rank=0)
        zero = build_rank_zero(config, cfg, world=1)
        self.scheduler, self.tokenizer, self.new_request = (
            zero.scheduler,
            zero.tokenizer,
            zero.new_request,
        )

    def submit(self, prompt: list[int], params: SamplingParams) -> Request:
        req = self.new_request(prompt, params)
        self.scheduler.add(req)
        return req

    def step(self) -> list[Request]:
        """Run one pass; returns the requests it touched (empty when idle)."""
        decision = self.scheduler.schedule()
        if decision is None:
            return []
        rows = self.stage.apply(decision)
        try:
            out = self.stage.compute(decision, rows, None)
        except PassFailed as exc:
            return self.scheduler.on_void(Void(decision.pass_id, 0, str(exc)))
        return self.scheduler.on_output(out)
