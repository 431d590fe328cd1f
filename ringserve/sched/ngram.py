"""Prompt lookup: propose a request's next tokens by finding the latest
earlier occurrence of its last few tokens in its own history (prompt and
output) and copying what followed. Pure Python over ints."""

from __future__ import annotations

# How many earlier occurrences of the last token are tried, newest first:
# bounds rank 0's work per request per pass on long, repetitive contexts.
SCAN_LIMIT = 64


class NgramIndex:
    """Where each token occurs in one request's history. Invariant:
    `positions[t]` lists, in increasing order, every index i < `indexed`
    with tokens[i] == t. A history only grows (prompt, then output), so the
    index is extended, never rebuilt."""

    def __init__(self) -> None:
        self.positions: dict[int, list[int]] = {}
        self.indexed = 0

    def _extend(self, tokens: list[int], upto: int) -> None:
        for i in range(self.indexed, upto):
            self.positions.setdefault(tokens[i], []).append(i)
        self.indexed = max(self.indexed, upto)

    def propose(self, tokens: list[int], n_max: int, n_min: int, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match (n_min to
        n_max tokens long, the newest among equals) of the history's suffix;
        [] when there is none."""
        last = len(tokens) - 1
        if k < 1 or last < n_min:
            return []
        self._extend(tokens, last)
        ends = self.positions.get(tokens[last])
        if not ends:
            return []
        best_len, best_end = 0, -1
        for end in reversed(ends[-SCAN_LIMIT:]):
            m = 1
            while m < n_max and end - m >= 0 and tokens[end - m] == tokens[last - m]:
                m += 1
            if m > best_len:
                best_len, best_end = m, end
                if m == n_max:
                    break
        if best_len < n_min:
            return []
        return tokens[best_end + 1 : best_end + 1 + k]
