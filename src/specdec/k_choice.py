"""The drafts of one step under ``num_speculative_tokens="auto"``: given each row's acceptance and the
step's cost model, the ``k_b`` per row that maximise predicted tokens per second (:func:`choose_ks`),
and what a given choice is predicted to gain (:func:`predicted_speedup`). :mod:`specdec.adaptive`
measures the inputs online and decides when to probe; this module only prices and chooses.

Terms (as in :mod:`specdec.adaptive`): ``rates[b][i]``, row ``b``'s conditional acceptance of draft
position ``i + 1``; ``S_bi``, the probability that position ``i`` is reached and kept (the product of
the rates up to it); ``proposing[b]``, the probability that row ``b``'s drafter proposes a draft at all
when asked; ``padded``, whether the target's forward pads every row to the widest draft
(``rows x (w + 1)`` tokens whatever each row drafts); ``max_step_ratio``, the most a drafting step may
be predicted to cost, in plain steps of the same rows (every row proposing its whole draft): a bound on
the worst inter-token gap speculation adds (``speculative_config["max_step_time_ratio"]``), where a
step that rejects every draft gives one token for the step's whole time; ``prompt_tokens``, the prompt
tokens the step feeds besides its rows (chunked prefill).

The queue's weight. A step that feeds ``P`` prompt tokens does that work whatever its rows draft, and
drafts that lengthen the step delay it. So a choice is priced as the step's work per second, its
expected emitted tokens and its prompt tokens alike: ``(tokens + P) / T(fed + P)`` against plain
decoding's ``(rows + P) / T(rows + P)``. The bound is relative to plain decoding of the rows alone, and a drafting
step's own time counts its prompt tokens: a drafting step beside a prompt chunk takes at most ``max_step_ratio``
plain steps of its rows, as any drafting step does. Bounded without them (until 2026-11-30), such a step could take
the prompt's share of a step and the bound's on top, longer than any step of plain decoding, whose longest are
those feeding prompts: at 64 streams at ``1b``, eagle's drafting steps beside the last prompt chunks at 61-63 rows
took 1.3-1.7 plain steps and were among a run's longest (``docs/lab-notes/2026-11-30-probes-within-the-bound.md``).
Where prompt tokens wait past the next step (a queue: the policy's
``prompt_backlog``, what is left after this step's chunks and as many again), auto k drafts nothing
(:meth:`specdec.adaptive.AdaptiveK.choose`): the prompts' tokens per step are then fixed (the prefill pacer's
share of plain decoding's step, or a token budget that the drafts take from), so the server's throughput is its
rate of feeding prompts, ``P / T``, and every draft lengthens ``T``. At 64 streams of the ``1b`` shape on a 2-core
CPU, drafting on such steps gave the running rows 1.1-1.9x their tokens per second and cost the server 6-21% of
plain decoding's throughput, its median time to first token rising up to 3x
(``docs/lab-notes/2026-11-30-queue-weight.md``). A prompt that the next step finishes is not a queue
(until 2026-11-30 it turned the step's drafts off too): drafting beside it gave eagle 1.09x the throughput at 4
streams at ``1b``, and suffix 1.02-1.07x at 4 to 64 streams (``docs/lab-notes/2026-11-30-queue-and-probes.md``).
"""

from __future__ import annotations

from specdec.step_cost import CostModel


def choose_ks(rates: list[list[float]], limits: list[int], cost: CostModel, padded: bool = False,
              proposing: list[float] | None = None, max_step_ratio: float | None = None,
              prompt_tokens: int = 0) -> tuple[list[int], float]:
    """The ``k_b`` per row maximising predicted tokens per second (emitted and ``prompt_tokens`` fed
    besides, see the module docstring), and the predicted speedup over a plain step of the same rows and
    prompt tokens.

    ``rates[b]`` is row ``b``'s conditional acceptance per position (at least ``limits[b]`` long);
    ``proposing[b]`` (1 where not given) the probability that row ``b``'s drafter proposes a draft at
    all when asked (an n-gram lookup finds no match on some steps): a row that proposes nothing emits
    its one token and, unpadded, feeds only it. So row ``b``'s position ``i`` is worth ``p_b S_bi``
    tokens (``S_bi``: the probability it is reached and kept) for ``p_b`` tokens fed in expectation.
    For each width ``w``, the best choice of expected tokens fed takes the positions (of positions
    ``<= w``) with the largest ``S_bi``, worth the most per token fed; ``S`` falls along a row, so this
    is a prefix of every row (the cost of a fractional number of tokens fed is interpolated between
    its neighbours). ``padded``: the target's forward costs ``rows x (w + 1)`` tokens whatever each row
    drafts (its grid pads rows to the longest, a row without a draft included), so at width ``w``
    every row drafts up to ``w``. ``max_step_ratio``: only choices whose step, every row proposing,
    is predicted at most this many plain steps of the rows alone are considered, the step's prompt tokens
    included (None: any).
    """
    rows = len(limits)
    proposing = proposing or [1.0] * rows
    if rows == 1:  # one row: its width is its count, so the widths are the only choices
        return _choose_k(rates[0], limits[0], cost, proposing[0], max_step_ratio, prompt_tokens)
    if padded:
        return _choose_width(rates, limits, cost, proposing, max_step_ratio, prompt_tokens)
    gains = []  # (minus the probability the token is kept if drafted, position, row)
    for b, limit in enumerate(limits):
        survive = 1.0
        for i in range(limit):
            survive *= rates[b][i]
            gains.append((-survive, i + 1, b))
    gains.sort()
    widest = max(limits, default=0)
    loaded = cost.target_curve(rows + prompt_tokens, rows * (widest + 1) + prompt_tokens)  # [tokens - rows - P]
    plain = (rows + prompt_tokens) / loaded[0]
    most = _most_seconds(cost.target_seconds(rows), max_step_ratio)  # the rows alone
    best, best_w, best_m = plain, 0, 0
    for w in range(1, widest + 1):
        tokens, fed, count, drafting = float(rows + prompt_tokens), 0.0, 0, cost.draft_fixed + cost.draft * w
        room = most / cost.drafting_scale - drafting  # the most the target's part may cost within the bound
        for gain, position, b in gains:
            if position > w:
                continue
            tokens -= gain * proposing[b]
            fed += proposing[b]
            count += 1
            if loaded[count] > room:  # every row proposing, with the prompt tokens: over the bound
                continue
            low = int(fed)  # the cost between those of its neighbouring whole numbers of tokens
            seconds = loaded[low] + (fed - low) * (loaded[min(low + 1, len(loaded) - 1)] - loaded[low])
            rate = tokens / ((seconds + drafting) * cost.drafting_scale)
            if rate > best:
                best, best_w, best_m = rate, w, count
    ks = [0] * rows
    taken = 0
    for _, position, b in gains:
        if taken == best_m:
            break
        if position <= best_w:
            ks[b] += 1
            taken += 1
    return ks, best / plain


def predicted_speedup(rates: list[list[float]], ks: list[int], cost: CostModel, padded: bool = False,
                      proposing: list[float] | None = None) -> float:
    """The predicted tokens per second of a step drafting ``ks[b]`` tokens on row ``b`` over a plain step
    of the same rows (1 where nothing is drafted), no prompt tokens fed besides; ``rates``, ``cost``,
    ``padded`` and ``proposing`` as in :func:`choose_ks`, whose choice this prices (a fractional number of
    tokens fed is interpolated)."""
    rows, width = len(ks), max(ks, default=0)
    if not width:
        return 1.0
    proposing = proposing or [1.0] * rows
    tokens, fed = float(rows), float(rows)
    for b, k in enumerate(ks):
        survive = 1.0
        for i in range(k):
            survive *= rates[b][i]
            tokens += proposing[b] * survive
        fed += proposing[b] * k
    if padded:
        fed = float(rows * (width + 1))
    low = int(fed)
    target = cost.target_seconds(low)
    target += (fed - low) * (cost.target_seconds(low + 1) - target)
    return tokens / cost.with_drafting(target, width) * cost.target_seconds(rows) / rows


def _most_seconds(plain: float, max_step_ratio: float | None) -> float:
    """The most seconds a drafting step may be predicted to take, a plain step taking ``plain``."""
    return float("inf") if max_step_ratio is None else max_step_ratio * plain


def _choose_width(rates: list[list[float]], limits: list[int], cost: CostModel, proposing: list[float],
                  max_step_ratio: float | None, prompt_tokens: int) -> tuple[list[int], float]:
    """:func:`choose_ks` on a padded grid of several rows: a step of width ``w`` costs the same whichever
    rows draft, so every row drafts up to ``w`` (each position adds tokens for nothing more) and only
    the width is chosen, in ``O(rows x width)``: width ``w`` adds ``sum_b p_b S_bw`` tokens."""
    rows, widest = len(limits), max(limits, default=0)
    added = [0.0] * (widest + 1)  # [w]: expected tokens position w adds over the rows
    for b, limit in enumerate(limits):
        survive, p, row = 1.0, proposing[b], rates[b]
        for i in range(limit):
            survive *= row[i]
            added[i + 1] += p * survive
    loaded = [cost.target_seconds(rows * (w + 1) + prompt_tokens) for w in range(widest + 1)]  # [w]: grid and prompts
    plain, most = (rows + prompt_tokens) / loaded[0], _most_seconds(cost.target_seconds(rows), max_step_ratio)
    best, best_w, tokens = plain, 0, float(rows + prompt_tokens)
    for w in range(1, widest + 1):
        tokens += added[w]
        seconds = cost.with_drafting(loaded[w], w)
        if seconds <= most and tokens / seconds > best:
            best, best_w = tokens / seconds, w
    return [min(best_w, limit) for limit in limits], best / plain


def _choose_k(rates: list[float], limit: int, cost: CostModel, proposing: float,
              max_step_ratio: float | None, prompt_tokens: int) -> tuple[list[int], float]:
    """:func:`choose_ks` for a single row (padded or not: one row's grid is its draft). With probability
    ``1 - proposing`` the step is plain whatever k is (nothing proposed)."""
    loaded = cost.target_curve(1 + prompt_tokens, limit + 1 + prompt_tokens)  # [tokens - 1 - P]
    plain, most = (1.0 + prompt_tokens) / loaded[0], _most_seconds(cost.target_seconds(1), max_step_ratio)
    best, best_k, survive, tokens = plain, 0, 1.0, 1.0 + prompt_tokens
    fixed, per_position, scale = cost.draft_fixed, cost.draft, cost.drafting_scale
    unproposed = (1.0 - proposing) * loaded[0]  # the expected seconds of the steps that stay plain
    for k in range(1, limit + 1):
        survive *= rates[k - 1]
        tokens += survive * proposing
        seconds = (loaded[k] + fixed + per_position * k) * scale  # the step when it proposes
        rate = tokens / (proposing * seconds + unproposed)
        if seconds <= most and rate > best:
            best, best_k = rate, k
    return [best_k], best / plain
