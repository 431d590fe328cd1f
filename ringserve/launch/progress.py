"""Progress a person can watch: each rank's weight loading, as lines on the
launcher's console (rank processes share its stderr), and vLLM's tqdm bar
over `LLM.generate`."""

from __future__ import annotations

import time
from collections.abc import Callable

from tqdm import tqdm

from ringserve import logs
from ringserve.params import RequestOutput

LOAD_REPORT_EVERY_S = 2.0  # a rank that loads faster than this prints no progress line


class LoadProgress:
    """`progress(read, total)` for `models.loader.load_model`: one line per
    `every_s` while a rank reads its weights, none for a load shorter than
    that, so a console never floods (the line after loading is
    `boot.report_loaded`'s)."""

    def __init__(self, rank: int, every_s: float = LOAD_REPORT_EVERY_S) -> None:
        self.rank, self.every_s = rank, every_s
        self.began = self.last = time.monotonic()

    def __call__(self, read: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s or read >= total:
            return
        self.last = now
        rate = read / max(now - self.began, 1e-9)
        logs.say(
            f"rank {self.rank} loading weights {100 * read / total:.0f}% "
            f"({read / 2**30:.2f} of {total / 2**30:.2f} GiB, {rate / 2**20:.0f} MiB/s)"
        )


class GenerateBar:
    """vLLM's bar over `LLM.generate`: prompts done of all, with the input
    and output tokens per second so far. Told of each finished request, a
    prompt's `n` choices being requests of their own: a prompt is done with
    its last choice. `use_tqdm` turns it on or off, or is the bar's factory
    (a tqdm class or a function taking tqdm's keywords), as vLLM's
    `use_tqdm` may be."""

    def __init__(self, choices: list[int], use_tqdm: bool | Callable[..., tqdm]) -> None:
        """`choices[p]`: how many requests prompt p runs as, in request order."""
        factory = use_tqdm if callable(use_tqdm) else tqdm
        options = {"total": len(choices), "desc": "Processed prompts", "dynamic_ncols": True}
        if not callable(use_tqdm):
            options["disable"] = not use_tqdm
        self.bar = factory(**options)
        self.began = time.monotonic()
        self.prompt_tokens = self.output_tokens = 0
        self.prompt_of = [p for p, n in enumerate(choices) for _ in range(n)]
        self.left = list(choices)

    def done(self, request: int, out: RequestOutput) -> None:
        if getattr(self.bar, "disable", False):
            return
        self.prompt_tokens += len(out.prompt_token_ids)
        self.output_tokens += len(out.token_ids)
        elapsed = max(time.monotonic() - self.began, 1e-9)
        self.bar.set_postfix_str(
            f"est. speed input: {self.prompt_tokens / elapsed:.2f} toks/s, "
            f"output: {self.output_tokens / elapsed:.2f} toks/s",
            refresh=False,
        )
        prompt = self.prompt_of[request]
        self.left[prompt] -= 1
        if self.left[prompt] == 0:
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
