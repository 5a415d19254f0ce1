"""Lookahead decoding's per-sequence state: the Jacobi window and its trajectory, the n-gram pool,
and the tree one step proposes. Pure host-side structures (lists of token ids), no tensors.

Positions are *aligned*: entry ``j`` of every trajectory level guesses the token at context index
``start + j``, ``start`` being the index right after the pending token (``len(token_ids)``). The
window is the newest level; the target is fed ``[pending, w_0, .., w_{n-1}]`` as one chain, and its
argmax after the pending token and after each ``w_i`` (``out`` ``[n+1]``) guesses indices
``start .. start + n``: the Jacobi update, which becomes the next level.

N-grams come from the trajectory's diagonals: ``out[j + N - 1]`` is the target's argmax after
``level_{-1}[j + N - 2]``, which was its argmax after ``level_{-2}[j + N - 3]`` one iteration
earlier, and so on; so ``(level_{-(N-1)}[j], level_{-(N-2)}[j+1], .., level_{-1}[j+N-2],
out[j+N-1])`` is a chain of the target's own next-token guesses (each in a context of earlier
guesses), the n-gram lookahead decoding collects.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


class NgramPool:
    """N-grams of one sequence keyed by their first token: ``key -> [continuation, ...]`` of ``n - 1``
    tokens each, most recently added first, at most ``per_key`` per key (the oldest dropped). Adding a
    continuation already there moves it to the front."""

    def __init__(self, n: int, per_key: int) -> None:
        self.n, self.per_key = n, per_key
        self.table: dict[int, list[tuple[int, ...]]] = {}

    def add(self, gram: Sequence[int]) -> None:
        """Add one n-gram (``n`` tokens)."""
        key, continuation = gram[0], tuple(gram[1:])
        found = self.table.setdefault(key, [])
        if continuation in found:
            found.remove(continuation)
        found.insert(0, continuation)
        del found[self.per_key :]

    def add_context(self, tokens: Sequence[int], first_end: int = 0) -> None:
        """Add every n-gram of ``tokens`` that ends at an index ``>= first_end`` (in order, so the
        last one is the most recent)."""
        for end in range(max(first_end, self.n - 1), len(tokens)):
            self.add(tokens[end - self.n + 1 : end + 1])

    def candidates(self, key: int, count: int) -> list[tuple[int, ...]]:
        """Up to ``count`` continuations of ``key``, most recent first."""
        return self.table.get(key, [])[:count]


class JacobiWindow:
    """The Jacobi window of one sequence: ``levels`` (oldest first, at most ``num_levels``), each a
    list of guessed tokens aligned at ``start``; the newest is the window fed next (``width``
    tokens). Older levels may be shorter (their tails fell off when the window shifted). ``rng``
    (seeded per sequence) picks refill tokens from the context."""

    def __init__(self, width: int, num_levels: int, context: Sequence[int], seed: int = 0) -> None:
        self.width, self.num_levels = width, num_levels
        self.rng = random.Random(seed)
        self.start = len(context)
        self.levels: list[list[int]] = [self._fill([], context)]

    @property
    def window(self) -> list[int]:
        """The guesses fed next: ``[width]`` tokens for indices ``start .. start + width - 1``."""
        return self.levels[-1][: self.width]

    def _fill(self, level: list[int], context: Sequence[int]) -> list[int]:
        """``level`` extended to ``width`` tokens with tokens drawn from ``context``."""
        return level + [context[self.rng.randrange(len(context))] for _ in range(self.width - len(level))]

    def update(self, out: Sequence[int]) -> list[list[int]]:
        """One Jacobi iteration: ``out`` ``[n+1]`` is the target's argmax after the pending token and
        after each of the first ``n`` window tokens (``n <= width``, those fed). Returns the n-grams
        (``num_levels + 1`` tokens each) of the trajectory's diagonals that end in ``out``; the new
        level is ``out`` followed by the unfed guesses."""
        grams = []
        if len(self.levels) == self.num_levels:
            for j in range(len(out) - self.num_levels):
                gram = [level[j + i] for i, level in enumerate(self.levels) if j + i < len(level)]
                if len(gram) == self.num_levels:
                    grams.append([*gram, out[j + self.num_levels]])
        self.levels.append(list(out) + self.levels[-1][len(out) :])
        del self.levels[: -self.num_levels]
        return grams

    def advance(self, context: Sequence[int]) -> None:
        """The context grew to ``context`` (committed tokens): drop every level's entries before the
        new ``start`` and refill the window's tail from the context."""
        shift = len(context) - self.start
        self.start = len(context)
        self.levels = [level[shift:] for level in self.levels]
        self.levels[-1] = self._fill(self.levels[-1][: self.width], context)


def lookahead_tree(candidates: Sequence[Sequence[int]], window: Sequence[int], budget: int
                   ) -> tuple[list[int], list[int], list[int]]:
    """One step's tree in at most ``budget`` nodes: the trie of the verification ``candidates`` (best
    first, shared prefixes merged, siblings in candidate order) as the first branches from the root,
    then the ``window`` as one chain from the root. The window keeps ``min(len(window), ceil(budget /
    2))`` nodes when the candidates need more than the rest, more when they need fewer.

    Returns ``(tokens, parents, window_nodes)``: the tree in the form of :mod:`specdec.tree` and the
    node index of each window token fed (a prefix of the window)."""
    reserved = min(len(window), -(-budget // 2))
    tokens: list[int] = []
    parents: list[int] = []
    nodes: dict[tuple[int, int], int] = {}
    for continuation in candidates:
        parent = -1
        for token in continuation:
            node = nodes.get((parent, token))
            if node is None:
                if len(tokens) >= budget - reserved:
                    break
                node = nodes[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node
    window_nodes = []
    for token in window[: budget - len(tokens)]:
        parents.append(window_nodes[-1] if window_nodes else -1)
        window_nodes.append(len(tokens))
        tokens.append(token)
    return tokens, parents, window_nodes
