"""The host KV tier on against off, side by side in one run, on a multi-turn
chat workload whose live prefixes need 4x the device KV capacity.

Workload: C conversations sharing a system prompt; each turn sends the whole
conversation so far plus a new user message and gets a greedy answer; all C
conversations' turn k go in one batch, then turn k+1. The device holds a
quarter of what the last turn's conversations need; with the tier on the
host holds all of it.

Figures per mode: prefix-hit tokens of turns 2.. (out of the "history"
tokens those turns resend: what a perfect cache would hit), generated
tokens per second, the wall time of the whole workload and rank 0's CPU
time (the steadier figure on a shared machine; at pp 1 it is the whole
engine), best of alternating rounds; then the share
of the prefix tokens the tier-off run recomputes that the tier turned into
hits, and the speed ratio. Outputs must be equal in both modes. Usage:

    .venv/bin/python bench/tiers.py [--conversations 16] [--turns 4] [--model builtin|llama_100m]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ringserve import LLM, SamplingParams  # noqa: E402
from ringserve.models.builtin import builtin_model_dir  # noqa: E402
from ringserve.models.config import ModelConfig  # noqa: E402
from tests.model_factory import llama_100m  # noqa: E402


def model_path(name: str, root: Path) -> Path:
    if name == "builtin":
        return builtin_model_dir()
    path = root / "llama_100m"
    if not (path / "config.json").is_file():
        llama_100m(root)
    return path


class Chats:
    """C conversations; `turn(k)` are the prompts of turn k given the answers so far."""

    def __init__(self, n: int, vocab: int, system: int, user: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        shared = [rng.randrange(3, vocab) for _ in range(system)]
        self.history = [list(shared) for _ in range(n)]
        self.rng, self.vocab, self.user = rng, vocab, user

    def prompts(self) -> list[list[int]]:
        for h in self.history:
            h += [self.rng.randrange(3, self.vocab) for _ in range(self.user)]
        return [list(h) for h in self.history]

    def answered(self, answers: list[list[int]]) -> None:
        for h, a in zip(self.history, answers, strict=True):
            h += a


def run(path: Path, args: argparse.Namespace, device: int, host: int) -> dict[str, float]:
    vocab = ModelConfig.from_dir(path).vocab_size
    chats = Chats(args.conversations, vocab, args.system, args.user)
    params = SamplingParams(max_tokens=args.answer, temperature=0, ignore_eos=True)
    options = dict(kv_capacity_tokens=device, host_kv_tokens=host, max_batch=args.conversations)
    hits = history = generated = 0
    outputs: list[list[int]] = []
    with LLM(path, pp_size=args.pp, **options) as llm:
        began, cpu = time.perf_counter(), time.process_time()
        for turn in range(args.turns):
            prompts = chats.prompts()
            outs = llm.generate(prompts, params, use_tqdm=False)
            chats.answered([o.token_ids for o in outs])
            outputs += [o.token_ids for o in outs]
            generated += sum(len(o.token_ids) for o in outs)
            if turn:
                hits += sum(
                    min(o.cached_tokens, len(p)) for o, p in zip(outs, prompts, strict=True)
                )
                history += sum(len(p) - args.user for p in prompts)
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu
        cache = llm._ring.conductor.scheduler.cache
        moved = (getattr(cache, "spilled_tokens", 0), getattr(cache, "loaded_tokens", 0))
    return {
        "hits": hits,
        "history": history,
        "tok_s": generated / wall,
        "wall": wall,
        "cpu": cpu,
        "spilled": moved[0],
        "loaded": moved[1],
        "outputs": outputs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=32, help="shared system prompt tokens")
    p.add_argument("--user", type=int, default=24, help="tokens of each user message")
    p.add_argument("--answer", type=int, default=16, help="tokens of each answer")
    p.add_argument("--oversubscription", type=float, default=4.0)
    p.add_argument("--model", choices=["builtin", "llama_100m"], default="builtin")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="alternating off/on rounds; best kept")
    args = p.parse_args()
    last_turn = args.system + args.turns * (args.user + args.answer)
    live = args.conversations * last_turn
    device = max(int(live / args.oversubscription), last_turn + 1)
    host = 2 * live
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        print(
            f"{args.conversations} conversations x {args.turns} turns, live prefixes {live} "
            f"tokens, device KV {device} ({live / device:.1f}x oversubscribed), host KV {host}; "
            f"model {args.model}, pp {args.pp}"
        )
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):
            for mode, h in (("off", 0), ("on", host)):
                got = run(path, args, device, h)
                if mode not in best or got["tok_s"] > best[mode]["tok_s"]:
                    best[mode] = got
    off, on = best["off"], best["on"]
    assert on["outputs"] == off["outputs"], "the host tier changed the outputs"
    print(
        "| host tier | prefix hits (turns 2..) | tok/s | wall s | rank 0 CPU s | spilled | loaded |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, r in (("off", off), ("on", on)):
        share = r["hits"] / r["history"]
        print(
            f"| {mode} | {r['hits']} of {r['history']} ({share:.0%}) | {r['tok_s']:.0f} | "
            f"{r['wall']:.2f} | {r['cpu']:.2f} | {r['spilled']} | {r['loaded']} |"
        )
    recomputed = off["history"] - off["hits"]
    turned = (on["hits"] - off["hits"]) / recomputed if recomputed else float("nan")
    print(
        f"the tier turned {turned:.0%} of the {recomputed} prefix tokens the tier-off run "
        f"recomputes into hits (goal >= 50%); throughput {on['tok_s'] / off['tok_s']:.2f}x "
        f"(moonshot 1.5x); outputs equal"
    )


if __name__ == "__main__":
    main()
