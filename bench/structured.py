"""Constrained decoding against the same workload unconstrained, side by side
in one run on one model: decode tokens per second at batch 1 and batch 32
with a JSON schema and without, interleaved and repeated (median); time to
first token of a request whose schema was never seen (compiled on the
spot), one whose schema is cached, and one with none; and the mask bytes a
pass carries per masked row.

The schema lets a random model write on (one long string field), so most
requests run to max_tokens in both arms and the batches stay full; the
rate is generated tokens over wall time either way. Usage:
    python bench/structured.py [--model DIR] [--new-tokens 48] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ringserve import LLM, SamplingParams, StructuredOutputsParams
from ringserve.engine.grammar import mask_words

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "notes": {"type": "string"}},
    "required": ["title", "notes"],
    "additionalProperties": False,
}


def prompts(n: int) -> list[str]:
    return [f"Record {i}: write it as JSON with a title and notes." for i in range(n)]


def rate(llm: LLM, batch: int, new: int, so: StructuredOutputsParams | None) -> tuple[float, float]:
    """(generated tokens per second, mean tokens per request)."""
    params = [
        SamplingParams(max_tokens=new, temperature=0.8, seed=i, structured_outputs=so)
        for i in range(batch)
    ]
    began = time.perf_counter()
    outs = llm.generate(prompts(batch), params, use_tqdm=False)
    elapsed = time.perf_counter() - began
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / elapsed, tokens / batch


def first_token_ms(llm: LLM, so: StructuredOutputsParams | None) -> float:
    began = time.perf_counter()
    llm.generate(["Start:"], SamplingParams(max_tokens=1, structured_outputs=so), use_tqdm=False)
    return (time.perf_counter() - began) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    schema = StructuredOutputsParams(json=SCHEMA)
    with LLM(args.model, device=args.device, dtype=args.dtype, max_batch=64) as llm:
        vocab = llm._ring.conductor.vocab_size  # noqa: SLF001 - the served model's
        rate(llm, 4, 8, schema)  # warm both paths: compile, first forwards
        rate(llm, 4, 8, None)
        print(f"vocab {vocab}: a masked row is {mask_words(vocab) * 4} bytes on every hop")
        print("batch  unconstrained tok/s  json-schema tok/s  ratio  tokens/request (free, json)")
        for batch in (1, 32):
            free, json_ = [], []
            for _ in range(args.repeats):  # interleaved, so drift hits both arms
                free.append(rate(llm, batch, args.new_tokens, None))
                json_.append(rate(llm, batch, args.new_tokens, schema))
            f = statistics.median(r for r, _ in free)
            j = statistics.median(r for r, _ in json_)
            per = (statistics.mean(n for _, n in free), statistics.mean(n for _, n in json_))
            print(f"{batch:5d}  {f:19.1f}  {j:17.1f}  {j / f:5.3f}  ({per[0]:.1f}, {per[1]:.1f})")
        cold, warm, none = [], [], []
        for i in range(args.repeats):
            fresh = {**SCHEMA, "properties": {**SCHEMA["properties"], f"k{i}": {"type": "integer"}}}
            cold.append(first_token_ms(llm, StructuredOutputsParams(json=fresh)))
            warm.append(first_token_ms(llm, schema))
            none.append(first_token_ms(llm, None))
        print(
            f"time to first token, median ms: cold schema {statistics.median(cold):.1f}, "
            f"cached schema {statistics.median(warm):.1f}, none {statistics.median(none):.1f}"
        )


if __name__ == "__main__":
    main()
