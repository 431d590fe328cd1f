"""Rank 0 collects a request's prompt logprobs from the Outputs of its
prefill passes, in pass order. Only an applied Output adds to them, so a
voided pass adds nothing; a record overwrites from its `start` on, so a
request re-prefilled after a retraction writes the same positions again
instead of appending them twice. Pure Python."""

from __future__ import annotations

from ringserve.ring.messages import Output
from ringserve.sched.request import Request


def take_prompt_logprobs(reqs: list[Request], out: Output) -> None:
    """Add the records of `out` to the requests of its pass (`reqs`)."""
    if out.prompt_logprobs is None:
        return
    by_id = {r.req_id: r for r in reqs}
    for rec in out.prompt_logprobs:
        got = by_id[rec.req_id].prompt_logprobs
        if rec.start > len(got):
            raise ValueError(
                f"request {rec.req_id}: prompt logprobs from token {rec.start} "
                f"but only {len(got)} collected"
            )
        del got[rec.start :]
        prompt = by_id[rec.req_id].prompt
        for i, (lp, top) in enumerate(zip(rec.logprobs, rec.top, strict=True)):
            entry = dict(zip(top.token_ids, top.logprobs, strict=True))
            entry[prompt[rec.start + i]] = lp
            got.append(entry)
