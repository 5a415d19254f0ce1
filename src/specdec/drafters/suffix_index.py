"""A suffix index over token documents: find where the end of a context occurred before and
what followed it, with a memory cap that evicts the oldest documents.

:class:`TokenIndex` keeps documents (lists of token ids) back to back in one list, each
followed by a separator, and for each key length ``n`` in :data:`KEY_LENGTHS` a *hash chain*:
every n-gram that has a following token maps to the absolute positions of those followers,
oldest first (as LZ77 compressors find matches). A lookup takes the chain of the context's
last ``n`` tokens, longest ``n`` first, and extends each of its (most recent) candidates
backwards token by token to the full matched suffix length, up to :data:`MAX_MATCH`.

Why not a suffix tree: a depth-``D`` suffix trie holds up to ``D`` nodes per token, too much
memory for Python objects; the chains hold ``len(KEY_LENGTHS)`` integers per token and give
the same answer (the occurrences of the longest matched suffix and their continuations) for
matches a key length finds, within the most recent :data:`MAX_CANDIDATES` occurrences.

Eviction removes the oldest document: its positions are the oldest of every chain they are
in, so each is a ``popleft``. Positions are absolute (they never shift); the token list is
trimmed of evicted tokens once they are half of it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass

KEY_LENGTHS = (1, 3, 8)
"""n-gram lengths with a chain, shortest first: 1 finds any match; 8 finds long repeats among
many occurrences of their short suffixes."""
MAX_MATCH = 64
"""The longest suffix match measured (longer matches count as this long)."""
MAX_CANDIDATES = 64
"""Occurrences of a key examined per lookup, most recent first."""
SEPARATOR = -1
"""Ends every document; never equal to a token id, so no match crosses a document boundary."""


@dataclass(frozen=True)
class Candidate:
    """An earlier occurrence of the context's suffix: ``match`` tokens long, followed by
    ``continuation`` (its next tokens in its own document, possibly empty)."""

    match: int
    continuation: list[int]


class TokenIndex:
    """Documents of token ids, oldest first, with hash chains of their n-grams.

    ``num_tokens``: live tokens (separators excluded). The last document may stay *open*
    (``extend`` appends to it: a running sequence's context); ``add`` appends a closed one.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.base = 0  # absolute position of tokens[0]
        self.docs: deque[list[int]] = deque()  # [start, end) absolute; end grows while the doc is open
        self.chains: dict[int, dict[tuple[int, ...], deque[int]]] = {n: {} for n in KEY_LENGTHS}
        self.num_tokens = 0
        self.open = False

    # ------------------------------------------------------------------ building
    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the open document (opening one if none is), indexing every
        position that now has a follower."""
        if not self.open:
            start = self.base + len(self.tokens)
            self.docs.append([start, start])
            self.open = True
        doc = self.docs[-1]
        old_end = doc[1]
        self.tokens.extend(tokens)
        doc[1] = old_end + len(tokens)
        self.num_tokens += len(tokens)
        self._index(doc[0], old_end, doc[1])

    def close(self) -> None:
        """End the open document (its separator is appended)."""
        if self.open:
            self.tokens.append(SEPARATOR)
            self.open = False

    def add(self, tokens: list[int]) -> None:
        """Append a closed document."""
        self.close()
        self.extend(tokens)
        self.close()

    def _index(self, doc_start: int, first: int, end: int) -> None:
        """Chain the followers at absolute positions ``first..end-1`` of the document starting at ``doc_start``."""
        tokens, base = self.tokens, self.base
        for n, chains in self.chains.items():
            for p in range(max(first, doc_start + n), end):
                key = tuple(tokens[p - n - base : p - base])
                chain = chains.get(key)
                if chain is None:
                    chains[key] = deque((p,))
                else:
                    chain.append(p)

    def evict_oldest(self) -> None:
        """Remove the oldest (closed) document and its chain entries."""
        start, end = self.docs.popleft()
        tokens, base = self.tokens, self.base
        for n, chains in self.chains.items():
            for p in range(start + n, end):
                key = tuple(tokens[p - n - base : p - base])
                chain = chains[key]
                chain.popleft()
                if not chain:
                    del chains[key]
        self.num_tokens -= end - start
        live = self.docs[0][0] if self.docs else self.base + len(self.tokens)
        dead = live - self.base
        if 2 * dead >= len(self.tokens):
            del self.tokens[:dead]
            self.base = live

    # ------------------------------------------------------------------ lookup
    def candidates(self, context: list[int], length: int) -> list[Candidate]:
        """Earlier occurrences of the longest suffix of ``context`` that a key finds (most recent
        first), each with up to ``length`` following tokens; empty when no key matches."""
        for n in reversed(KEY_LENGTHS):
            if len(context) < n:
                continue
            chain = self.chains[n].get(tuple(context[-n:]))
            if chain:
                return self._extend_matches(context, chain, n, length)
        return []

    def _extend_matches(self, context: list[int], chain: deque[int], n: int, length: int) -> list[Candidate]:
        tokens, base = self.tokens, self.base
        limit = min(MAX_MATCH, len(context))
        found = []
        for i, p in enumerate(reversed(chain)):
            if i == MAX_CANDIDATES:
                break
            m = n
            # Walk back while the tokens agree; the separator (or the list's start) stops it.
            while m < limit and p - m - 1 >= base and tokens[p - m - 1 - base] == context[-m - 1]:
                m += 1
            follow = tokens[p - base : p - base + length]
            if SEPARATOR in follow:
                follow = follow[: follow.index(SEPARATOR)]
            found.append(Candidate(m, follow))
        return found

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Assert the structure's invariants (tests): every chain entry is a live follower whose
        preceding n tokens are its key, chains are increasing, and nothing else is indexed."""
        live = {p for start, end in self.docs for p in range(start, end)}
        assert self.num_tokens == len(live)
        for start, end in self.docs:
            assert self.base <= start <= end <= self.base + len(self.tokens)
        for n, chains in self.chains.items():
            expected = sum(max(0, end - start - n) for start, end in self.docs)
            assert sum(len(c) for c in chains.values()) == expected
            for key, chain in chains.items():
                assert chain and list(chain) == sorted(set(chain))
                for p in chain:
                    assert p in live and p - n in live
                    assert tuple(self.tokens[p - n - self.base : p - self.base]) == key


def propose(candidates: list[Candidate], budget: int, factor: float, min_prob: float) -> list[int]:
    """The most frequent continuation after the longest match among ``candidates``, at most ``budget``
    tokens: :func:`propose_tree` with one child per node (a chain)."""
    return propose_tree(candidates, budget, factor, min_prob, 1)[0]


def propose_tree(candidates: list[Candidate], budget: int, factor: float, min_prob: float,
                 width: int) -> tuple[list[int], list[int]]:
    """``(tokens, parents)``: the most frequent continuations after the longest match among
    ``candidates`` as a tree of at most ``budget`` nodes (parents before children, ``-1`` the root;
    siblings most frequent first).

    Only the candidates with the longest match vote. A node at depth ``d`` (1-based) is a token that
    ``count_d`` of the voters agreeing with its parent's path continue with; each node keeps its
    ``width`` most frequent children (ties: the most recent), those with ``count_d / count_0 >= min_prob``
    and ``d <= factor * match * (1 + log2(count_d))`` (a draft grows with the match length and with how
    often the continuation was seen). Nodes are taken best first by ``count_d`` (the path's empirical
    probability), ties in the order they were found, until ``budget``. With ``width`` 1 it is the chain
    of the most frequent token at each depth.
    """
    if not candidates or budget <= 0:
        return [], []
    match = max(c.match for c in candidates)
    voters = [c.continuation for c in candidates if c.match == match]
    total = len(voters)
    tokens: list[int] = []
    parents: list[int] = []
    order = itertools.count()
    # (-count, order found, depth - 1, parent node, token, the voters that agree with the node's path)
    frontier: list[tuple[int, int, int, int, int, list[list[int]]]] = []

    def push_children(parent: int, depth: int, group: list[list[int]]) -> None:
        votes: dict[int, list[list[int]]] = {}
        for cont in group:  # most recent first, so a stable sort keeps the most recent first on ties
            if len(cont) > depth:
                votes.setdefault(cont[depth], []).append(cont)
        for token, agree in sorted(votes.items(), key=lambda item: -len(item[1]))[:width]:
            count = len(agree)
            if count >= min_prob * total and depth + 1 <= factor * match * (1 + math.log2(count)):
                heapq.heappush(frontier, (-count, next(order), depth, parent, token, agree))

    push_children(-1, 0, voters)
    while frontier and len(tokens) < budget:
        _, _, depth, parent, token, agree = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        push_children(len(tokens) - 1, depth + 1, agree)
    return tokens, parents
