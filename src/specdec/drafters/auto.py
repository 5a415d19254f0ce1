"""``method="auto"``: several configured drafters, and per request the one that yields the most tokens
per second, learned online.

The composite holds one drafter per ``candidates`` config. Every candidate sees ``add``, ``observe``
and ``release`` of every sequence, so each can draft for any row at any step. Per step a bandit
(:class:`ThroughputBandit`) picks a candidate per row; rows are grouped by their candidate, each
candidate proposes for its rows, and the drafts are merged into one :class:`DraftBatch` (ragged
chains padded to the widest; when one candidate returns the draft distributions and another is
deterministic, the deterministic rows get one-hot distributions, which is how verification treats a
deterministic draft anyway, so each row is verified exactly as its candidate alone would be).
Verification never depends on which candidate drafted: any choice made before the step keeps the
output lossless.

The measured reward of a row's step is the tokens it emitted (accepted drafts plus one) over its
share of the step's time: its candidate's ``propose`` time split over that candidate's rows, plus
the target's forward, verification and commit (from the end of drafting to ``observe``) split over
the rows in proportion to the tokens each fed. Times come from a :class:`~specdec.metrics.StageClock`
(CUDA events on a GPU). A candidate that did not draft a row's previous step first catches up on
the tokens it has not seen (a draft model's forward over them): a switch is therefore not measured,
and the row stays on the new candidate for one more step, which is.

A candidate whose drafts are lookups (``shadow_drafts``: ngram, suffix) is also measured on the rows it
did not draft for: each step it is asked, on the host, for the chain it would have drafted there, and
that *shadow draft* is scored against the tokens the step emitted. For a deterministic draft the number
of tokens verification keeps is distributed exactly as its longest common prefix with the emitted
tokens: each emitted token is an exact sample of the target, equal to the draft's token with the
probability that verification accepts it, under greedy decoding and sampling alike (the prefix is cut
at the emitted tokens, so the score is a lower bound where the draft matched them all). Its seconds are
the row's share of the step's target time plus its own lookup's. So such candidates get a measurement
every step instead of one per exploration: measured only when explored, a lookup's per-step reward
(1 to k + 1 tokens) was too noisy for ten to twenty samples to rank it, and the bandit stayed on a
slower candidate (an offline replay of ten code prompts: the auto method at 2.05x of plain decoding
on average over seeds, its best candidate alone 2.19x; with shadow drafts 2.20x).

Candidates must propose chains without the target's hidden states: tree drafters
(``num_candidates > 1``, ``lookahead``) and drafters that run the target's own layers (``layer_skip``) are
rejected by validation.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from specdec.adaptive import AUTO
from specdec.drafters.base import (
    DRAFTERS,
    DraftBatch,
    Drafter,
    LoadOptions,
    SpeculativeConfig,
    create_drafter,
    register_drafter,
)
from specdec.errors import SpecDecError
from specdec.metrics import BatchMetrics, StageClock
from specdec.models.base import CausalLM, to_device
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.verify import common_prefix

EXPLORATION = 0.05  # probability that a row's step goes to a uniformly random candidate
SWITCH_MARGIN = 0.05  # a request leaves its candidate for one estimated at least this much faster
REQUEST_DECAY = 0.9  # per-request throughput sums decay by this per update of the same candidate
POOL_DECAY = 0.99  # the engine-wide sums (the prior of every request) decay slower
MAX_AUTO_CANDIDATES = 8


@dataclass
class Throughput:
    """Decayed sums of emitted tokens, seconds and steps of one candidate."""

    tokens: float = 0.0
    seconds: float = 0.0
    count: float = 0.0

    def add(self, tokens: float, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.count = self.count * decay + 1.0


class ThroughputBandit:
    """Per-request epsilon-greedy choice among ``num_arms`` candidates by measured tokens per second.

    A request's estimate of an arm is its own decayed sums plus one pseudo-step of the engine-wide
    average of that arm (the pool: what other requests measured). An arm nobody has measured yet
    is tried first (arms in order); otherwise the best estimate wins, except with probability
    ``exploration``, when a uniformly random arm is drafted with instead. A request that drafted with
    ``current`` last stays with it unless another arm's estimate beats it by ``SWITCH_MARGIN`` (a switch
    costs a catch-up step, which noise between near-equal arms should not buy). ``rng`` drives the
    exploration only (never a request's own generator, so sampled tokens are untouched).
    """

    def __init__(self, num_arms: int, exploration: float = EXPLORATION, rng: random.Random | None = None) -> None:
        self.num_arms, self.exploration = num_arms, exploration
        self.rng = rng if rng is not None else random.Random(0)
        self.pool = [Throughput() for _ in range(num_arms)]
        self.requests: dict[str, list[Throughput]] = {}

    def rate(self, key: str, arm: int) -> float:
        """Estimated tokens per second of ``arm`` for request ``key`` (``inf`` while unmeasured)."""
        pool = self.pool[arm]
        if pool.count == 0:
            return math.inf
        tokens, seconds = pool.tokens / pool.count, pool.seconds / pool.count
        own = self.requests.get(key)
        if own is not None:
            tokens, seconds = tokens + own[arm].tokens, seconds + own[arm].seconds
        return tokens / max(seconds, 1e-12)

    def choose(self, key: str, current: int | None = None) -> int:
        """The arm request ``key`` drafts with this step (``current``: the one it drafted with last)."""
        if self.num_arms > 1 and self.rng.random() < self.exploration:
            return self.rng.randrange(self.num_arms)
        rates = [self.rate(key, arm) for arm in range(self.num_arms)]
        best = max(range(self.num_arms), key=rates.__getitem__)
        if current is not None and rates[best] < (1 + SWITCH_MARGIN) * rates[current]:
            return current
        return best

    def update(self, key: str, arm: int, tokens: float, seconds: float) -> None:
        """Request ``key`` emitted ``tokens`` in ``seconds`` (its share of a step) drafting with ``arm``."""
        self.pool[arm].add(tokens, seconds, POOL_DECAY)
        own = self.requests.setdefault(key, [Throughput() for _ in range(self.num_arms)])
        own[arm].add(tokens, seconds, REQUEST_DECAY)

    def release(self, key: str) -> None:
        self.requests.pop(key, None)

    def forget(self) -> None:
        """Drop every measurement (the pool included)."""
        self.pool = [Throughput() for _ in range(self.num_arms)]
        self.requests.clear()


def candidate_labels(configs: list[SpeculativeConfig]) -> list[str]:
    """One label per candidate for the metrics: its method, ``method#i`` when a method is listed twice."""
    methods = [c.method for c in configs]
    return [m if methods.count(m) == 1 else f"{m}#{i}" for i, m in enumerate(methods)]


def merge_drafts(parts: list[tuple[list[int], DraftBatch]], batch: int, device: torch.device) -> DraftBatch:
    """One chain batch of ``batch`` rows from per-candidate batches ``(rows, draft)`` (``draft`` holds
    rows ``rows`` in order; rows in no part draft nothing). ``tokens`` ``[B, K]`` with ``K`` the widest
    part; ``probs`` ``[B, K, V]`` when any part has them, one-hot on the tokens of deterministic parts
    (zeros in padding columns, which verification never reads), else None."""
    if len(parts) == 1 and parts[0][0] == list(range(batch)):
        return parts[0][1]
    width = max((d.tokens.shape[1] for _, d in parts), default=0)
    tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
    num_draft = [0] * batch
    sampled = [d.probs for _, d in parts if d.probs is not None]
    probs = None
    if sampled:
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in sampled) else sampled[0].dtype
        probs = sampled[0].new_zeros(batch, width, sampled[0].shape[-1], dtype=dtype)
    for rows, draft in parts:
        w = draft.tokens.shape[1]
        index = to_device(rows, device)
        tokens[index, :w] = draft.tokens
        for b, n in zip(rows, draft.num_draft):
            num_draft[b] = n
        if probs is not None:
            q = draft.probs if draft.probs is not None else torch.nn.functional.one_hot(draft.tokens, probs.shape[-1])
            probs[index, :w] = q.to(probs.dtype)
    return DraftBatch(tokens, num_draft, probs)


@register_drafter
class AutoDrafter(Drafter):
    """``{"method": "auto", "candidates": [config, ...]}``: per request and step, the candidate with the
    most measured tokens per second (see the module docstring). The auto config's
    ``num_speculative_tokens`` (fixed or ``"auto"``) bounds every step; a candidate drafts at most its
    own ``num_speculative_tokens``."""

    method = "auto"
    description = "several drafters; per request the one with the most tokens per second, learned online"
    composite = True

    def __init__(self, candidates: list[Drafter], labels: list[str], max_ks: list[int], device: torch.device) -> None:
        self.candidates, self.labels, self.max_ks, self.device = candidates, labels, max_ks, device
        self.bandit = ThroughputBandit(len(candidates))
        self.clock = StageClock(device)  # tests replace it with synthetic timings
        # Union of the candidates' hidden layers, in first-seen order; each gets its own slice.
        self.hidden_layers = tuple(dict.fromkeys(layer for c in candidates for layer in c.hidden_layers))
        self.metrics: BatchMetrics | None = None
        # The last proposal: request id -> (candidate, tokens drafted, whether the step is measured), the
        # candidates' group sizes and the tokens the step feeds the target (every row's pending token and drafts).
        self.pending: dict[str, tuple[int, int, bool]] = {}
        self.last_arm: dict[str, int] = {}  # the candidate of each request's last drafting step
        self.switched: set[str] = set()  # requests whose last drafting step switched candidate
        self.group_sizes: dict[int, int] = {}
        self.fed = 0
        self.shadows: dict[str, list[tuple[int, list[int]]]] = {}  # request id -> (candidate, shadow draft)
        self.shadow_sizes: dict[int, int] = {}  # rows each shadowing candidate drafted for

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        candidates = config.candidates
        if not candidates:
            raise SpecDecError("speculative method 'auto' needs 'candidates': a non-empty list of speculative configs")
        if len(candidates) > MAX_AUTO_CANDIDATES:
            raise SpecDecError(f"speculative method 'auto' takes at most {MAX_AUTO_CANDIDATES} candidates, "
                               f"got {len(candidates)}")
        if config.model is not None or config.draft_confidence_threshold is not None:
            raise SpecDecError("speculative method 'auto' takes no 'model' or 'draft_confidence_threshold' of its "
                               "own: give them to its candidates")
        for i, c in enumerate(candidates):
            kind = DRAFTERS[c.method]
            if kind.composite:
                raise SpecDecError(f"auto candidate {i} is {c.method!r}: candidates cannot be composite methods")
            if c.num_speculative_tokens == AUTO:
                raise SpecDecError(f"auto candidate {i} ({c.method}): set num_speculative_tokens 'auto' on the auto "
                                   "config itself, a candidate takes a fixed k")
            if c.num_candidates > 1:
                raise SpecDecError(f"auto candidate {i} ({c.method}) drafts trees (num_candidates > 1): auto combines "
                                   "chain drafters only")
            if kind.wants_node_argmax:
                raise SpecDecError(f"auto candidate {i} ({c.method}) drafts trees that read the target's argmax at "
                                   "every node: auto combines chain drafters only")
            if kind.bind_target_cache is not Drafter.bind_target_cache:
                raise SpecDecError(f"auto candidate {i} ({c.method}) runs the target's own layers, which cannot share "
                                   "a verification step with other drafters")

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: CausalLM, options: LoadOptions) -> AutoDrafter:
        configs: list[SpeculativeConfig] = config.candidates
        drafters = [create_drafter(c, target, options) for c in configs]
        return cls(drafters, candidate_labels(configs), [c.max_k for c in configs], options.device)

    def bind_metrics(self, metrics: BatchMetrics) -> None:
        self.metrics = metrics

    def add(self, seqs: list[Sequence]) -> None:
        for c in self.candidates:
            c.add(seqs)

    def observe_hidden(self, seqs: list[Sequence], hidden: list[torch.Tensor]) -> None:
        """Each candidate gets its own ``hidden_layers`` out of the union: ``[n_b, len(its layers), H]``."""
        for c in self.candidates:
            if c.hidden_layers:
                columns = [self.hidden_layers.index(layer) for layer in c.hidden_layers]
                c.observe_hidden(seqs, [h[:, columns] for h in hidden])

    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        self.clock.start()
        arms = [self._choose(s.request_id) if k > 0 else -1 for s, k in zip(seqs, ks)]
        parts = []
        self.pending, self.group_sizes = {}, {}
        for arm, drafter in enumerate(self.candidates):
            rows = [b for b, a in enumerate(arms) if a == arm]
            if not rows:
                continue
            group = [seqs[b] for b in rows]
            subset = sampling if len(rows) == len(seqs) else sampling.select(rows)
            draft = drafter.propose(group, [min(ks[b], self.max_ks[arm]) for b in rows], subset)
            self.clock.lap(f"draft{arm}")
            parts.append((rows, draft))
            self.group_sizes[arm] = len(rows)
            label = self.labels[arm]
            for s, n in zip(group, draft.num_draft):
                self.pending[s.request_id] = (arm, n, s.request_id not in self.switched)
                s.metrics.drafter_choices[label] = s.metrics.drafter_choices.get(label, 0) + 1
            if self.metrics is not None:
                self.metrics.drafter_choices[label] = self.metrics.drafter_choices.get(label, 0) + len(rows)
        self._shadow(seqs, ks, arms)
        merged = merge_drafts(parts, len(seqs), self.device)
        self.fed = len(seqs) + sum(merged.num_draft)
        return merged

    def _shadow(self, seqs: list[Sequence], ks: list[int], arms: list[int]) -> None:
        """Ask each lookup candidate for the chain it would draft on the rows another candidate drafts for."""
        self.shadows, self.shadow_sizes = {}, {}
        for arm, drafter in enumerate(self.candidates):
            if not drafter.shadow_drafts:
                continue
            rows = [b for b, a in enumerate(arms) if a not in (-1, arm)]
            if not rows:
                continue
            drafts = drafter.shadow([seqs[b] for b in rows], [min(ks[b], self.max_ks[arm]) for b in rows])
            self.clock.lap(f"shadow{arm}")
            self.shadow_sizes[arm] = len(rows)
            for b, draft in zip(rows, drafts):
                self.shadows.setdefault(seqs[b].request_id, []).append((arm, draft))

    def _choose(self, key: str) -> int:
        """The bandit's choice for request ``key``, or its last candidate right after a switch."""
        last = self.last_arm.get(key)
        if key in self.switched:
            self.switched.discard(key)
            return last
        arm = self.bandit.choose(key, last)
        if last is not None and arm != last:
            self.switched.add(key)
        self.last_arm[key] = arm
        return arm

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        if self.pending:
            self.clock.lap("target")
            self._reward(seqs, num_accepted, self.clock.read())
            self.pending, self.shadows = {}, {}
        for c in self.candidates:
            c.observe(seqs, num_accepted)

    def _reward(self, seqs: list[Sequence], num_accepted: list[int], times: dict[str, float]) -> None:
        """Credit each proposed row that goes on with its tokens over its share of the step's time, and
        each of its shadow drafts with the tokens it shares with the emitted ones (see the module docstring)."""
        for s, a in zip(seqs, num_accepted):
            if s.request_id not in self.pending:
                continue
            arm, n, measured = self.pending[s.request_id]
            target = times["target"] * (1 + n) / self.fed
            if measured:
                self.bandit.update(s.request_id, arm, a + 1, times[f"draft{arm}"] / self.group_sizes[arm] + target)
            shadows = self.shadows.get(s.request_id, ())
            emitted = s.token_ids[len(s.token_ids) - a - 1 :] if shadows else []
            for other, draft in shadows:
                self.bandit.update(s.request_id, other, common_prefix(draft, emitted) + 1,
                                   times[f"shadow{other}"] / self.shadow_sizes[other] + target)

    def kv_pools(self) -> list:
        return [pool for c in self.candidates for pool in c.kv_pools()]

    def release(self, seq: Sequence) -> None:
        self.bandit.release(seq.request_id)
        self.pending.pop(seq.request_id, None)
        self.shadows.pop(seq.request_id, None)
        self.last_arm.pop(seq.request_id, None)
        self.switched.discard(seq.request_id)
        for c in self.candidates:
            c.release(seq)

    def forget(self) -> None:
        self.bandit.forget()
        for c in self.candidates:
            c.forget()
