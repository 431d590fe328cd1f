"""Sampling on the last rank: turns a pass's logits into its `Output`.

Noise for each row comes from the request's seed and the position of the token
being drawn, so a pass re-run after a void draws the same token, and replicas
need no sampler state.
"""

from __future__ import annotations

import torch

from ringserve.engine import logits as processing
from ringserve.engine.grammar import apply_masks
from ringserve.kernels import ops
from ringserve.ring.messages import Output, SamplingSpec, TopLogprobs

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def noise_seed(seed: int, position: int) -> int:
    """One definition of the per-draw seed."""
    return (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) & _MASK


class Sampler:
    """Stateless apart from the device it draws noise on."""

    def __call__(
        self,
        pass_id: int,
        logits: torch.Tensor,
        specs: list[SamplingSpec],
        positions: list[int],
        histories: list[list[int] | None] | None = None,
        masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Output:
        """`positions[i]` is the position of row i's token being drawn (the
        length of its context); `histories[i]` the context's tokens where the
        row's logits processing needs them; `masks` the grammar masks of the
        constrained rows (rank 0's, engine/grammar.py). Logprobs are of the model's raw
        logits, as vLLM reports them."""
        logits = logits.float()
        if histories is None:
            histories = [None] * len(specs)
        shaped = processing.process(logits, specs, histories, positions)
        if masks is not None:
            shaped = apply_masks(shaped, *masks)
        if all(s.temperature == 0 or s.top_k == 1 for s in specs):
            tokens, fallback = self._greedy(shaped)
        else:
            tokens, fallback = self._sample(shaped, specs, positions)
        logprobs, top = self._logprobs(logits, tokens, specs)
        return Output(
            pass_id=pass_id,
            tokens=tokens.tolist(),
            logprobs=logprobs,
            top_logprobs=top,
            fallbacks=int(fallback.sum()),
        )

    def draw(
        self, logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row (float logits) and which rows fell back to argmax."""
        if all(s.temperature == 0 or s.top_k == 1 for s in specs):
            return self._greedy(logits)
        return self._sample(logits, specs, positions)

    @staticmethod
    def noise(
        spec: SamplingSpec, position: int, vocab: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The uniforms a sampled row at `position` draws with, made on
        `device` by its own generator seeded from (seed, position): the same
        on every run of that kind of device (a GPU's generator is not the
        CPU's; drawing a real vocabulary's noise on the CPU and copying it
        cost a GPU pass 20 ms at 32 rows)."""
        gen = torch.Generator(device=device).manual_seed(noise_seed(spec.seed or 0, position))
        return torch.rand(vocab, generator=gen, device=device)

    def logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, specs: list[SamplingSpec]
    ) -> tuple[list[float] | None, list[TopLogprobs] | None]:
        """Logprobs of `tokens` (one per row) and each row's top ones, as asked."""
        return self._logprobs(logits.float(), tokens, specs)

    @staticmethod
    def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # One pass finds both: a row's max is NaN exactly when the row holds
        # a NaN (max propagates it), and max(-1) is about three times cheaper
        # than argmax plus isnan(...).any on the CPU. Both pick the first
        # maximal index.
        top, tokens = logits.max(-1)
        bad = torch.isnan(top)
        if bool(bad.any()):
            tokens = torch.nan_to_num(logits, nan=float("-inf")).argmax(-1)
        return tokens, bad

    @staticmethod
    def _sample(
        logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dev = logits.device
        greedy = [s.temperature == 0 or s.top_k == 1 for s in specs]
        temperature = torch.tensor(
            [0.0 if g else s.temperature for s, g in zip(specs, greedy, strict=True)], device=dev
        )
        top_k = torch.tensor([s.top_k for s in specs], device=dev)
        top_p = torch.tensor([s.top_p for s in specs], device=dev)
        min_p = torch.tensor([s.min_p for s in specs], device=dev)
        vocab = logits.shape[-1]
        half = torch.full((vocab,), 0.5, device=dev)  # a greedy row's noise, never read
        noise = torch.stack(
            [
                half if g else Sampler.noise(spec, pos, vocab, dev)
                for spec, pos, g in zip(specs, positions, greedy, strict=True)
            ]
        )
        tokens, fallback = ops.sample(logits, temperature, top_k, top_p, min_p, noise)
        if any(greedy):  # a greedy row over NaN logits falls back to argmax too
            rows = torch.tensor([i for i, g in enumerate(greedy) if g], device=dev)
            fallback[rows] |= torch.isnan(logits[rows]).any(-1)
        return tokens, fallback

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, specs: list[SamplingSpec]
    ) -> tuple[list[float] | None, list[TopLogprobs] | None]:
        want = [s.logprobs for s in specs]
        if all(w is None for w in want):
            return None, None
        lp = torch.log_softmax(torch.nan_to_num(logits, nan=float("-inf")), -1)
        chosen = lp.gather(-1, tokens[:, None])[:, 0].tolist()
        k = max(w or 0 for w in want)
        vals, ids = lp.topk(k, -1) if k else (lp[:, :0], tokens[:, None][:, :0])
        top = [
            TopLogprobs(ids[i, : w or 0].tolist(), vals[i, : w or 0].tolist())
            for i, w in enumerate(want)
        ]
        return chosen, top
