"""What the benchmark runs: the method catalogue (specdec plain decoding, one method per registered
drafter, transformers' ``generate`` peers) and the :class:`Runner` interface every method implements.

specdec's speculative methods are derived from the drafter registry
(:data:`specdec.drafters.DRAFTERS`): a drafter registered there is benchmarked with no change
here. Its entry takes the drafter's ``description`` and needs a draft model when the drafter
class says ``needs_model``. The catalogue is built on first use, since importing the drafters
imports torch and transformers (the CLI must start without them).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import TYPE_CHECKING, Any

from specdec.errors import SpecDecError

if TYPE_CHECKING:
    from specdec.metrics import RequestMetrics

REFERENCE = "plain"
"""specdec's plain decoding: the reference of every speedup and greedy check."""

DETERMINISTIC_MODES: dict[str, tuple[bool, ...]] = {"off": (False,), "on": (True,), "both": (False, True)}
"""``bench --deterministic MODE``: the modes every specdec method runs in (transformers peers run in the
default mode only). ``both`` runs each in both, side by side, as two variants."""
DETERMINISTIC_SUFFIX = " det"
"""What a deterministic variant's label ends with (``plain det``, ``draft_model k=4 det``)."""


@dataclass(frozen=True)
class MethodKind:
    """What a method is: run once per k (``speculative``), needs a draft model, is a transformers peer,
    runs only as a ``--method-config`` (``needs_config``: a staged method such as cascade needs its stages, a
    method whose ``model`` is a folder of heads, such as eagle3, needs its folder)."""

    description: str
    speculative: bool = False
    needs_draft: bool = False
    peer: bool = False
    needs_config: bool = False


PEERS: dict[str, MethodKind] = {
    "hf": MethodKind("transformers generate", peer=True),
    "hf_assisted": MethodKind(
        "transformers generate, assistant_model with num_assistant_tokens=k, constant schedule, "
        "assistant_confidence_threshold=0 (set on the assistant's generation_config)",
        speculative=True,
        needs_draft=True,
        peer=True,
    ),
    "hf_assisted_default": MethodKind(
        "transformers generate, assistant_model with its generation_config as loaded; unset fields take "
        "transformers' defaults (5.x: 20 tokens, constant schedule, confidence threshold 0.4)",
        needs_draft=True,
        peer=True,
    ),
    "hf_prompt_lookup": MethodKind(
        "transformers generate, prompt_lookup_num_tokens=k, max_matching_ngram_size=prompt_lookup_max",
        speculative=True,
        peer=True,
    ),
}
"""transformers' ``generate`` configurations, benchmarked beside specdec (batch 1 only)."""


@cache
def methods() -> dict[str, MethodKind]:
    """Every benchmarkable method by name: ``plain``, the registered drafters, then :data:`PEERS`."""
    from specdec.drafters import DRAFTERS

    catalogue = {REFERENCE: MethodKind("specdec plain decoding (the reference)")}
    for name, drafter in DRAFTERS.items():
        catalogue[name] = MethodKind(  # a staged method's stages default to the run's draft
            f"specdec, {drafter.description}", speculative=True, needs_draft=drafter.draft_lm or drafter.staged,
            needs_config=drafter.staged or (drafter.needs_model and not drafter.draft_lm),  # a folder of heads
        )
    clash = sorted(set(catalogue) & set(PEERS))
    if clash:
        raise SpecDecError(f"drafters {clash} reuse the names of transformers peers in the benchmark")
    return {**catalogue, **PEERS}


@dataclass(frozen=True)
class MethodSpec:
    """One benchmarked configuration: a method name and, for speculative methods, its k; ``name``: its
    label when it is not the method's (a second configuration of a method), ``overrides``: fields of
    its ``speculative_config`` set by ``bench --method-config``; ``deterministic``: runs in deterministic mode
    (batch-invariant kernels, see ``docs/determinism.md``), its label ending with :data:`DETERMINISTIC_SUFFIX`."""

    method: str
    k: int | str | None = None
    name: str | None = None
    overrides: dict[str, Any] | None = field(default=None, compare=False)
    deterministic: bool = False

    def __post_init__(self) -> None:
        catalogue = methods()
        if self.method not in catalogue:
            raise SpecDecError(f"unknown method {self.method!r}; choose from {', '.join(catalogue)}")
        if catalogue[self.method].speculative != (self.k is not None):
            raise SpecDecError(f"method {self.method!r} {'needs' if self.k is None else 'takes no'} k")
        if self.deterministic and catalogue[self.method].peer:
            raise SpecDecError(f"{self.method!r} runs transformers' generate, which has no deterministic mode")

    @property
    def label(self) -> str:
        name = self.name or self.method
        label = name if self.k is None else f"{name} k={self.k}"
        return label + DETERMINISTIC_SUFFIX if self.deterministic else label

    @property
    def default_twin(self) -> str | None:
        """A deterministic variant's label in the default mode (what its deterministic cost compares it
        with); None for a default-mode spec."""
        return replace(self, deterministic=False).label if self.deterministic else None

    @property
    def kind(self) -> MethodKind:
        return methods()[self.method]


def expand_methods(names: Sequence[str], ks: Sequence[int],
                   configs: dict[str, dict[str, Any]] | None = None) -> list[MethodSpec]:
    """One spec per non-speculative method and one per (speculative method, k); ``plain`` always first.

    ``configs`` (``bench --method-config NAME=JSON``): for a speculative method of ``names``, fields
    that override its ``speculative_config``; for any other NAME, a further configuration labelled
    NAME whose JSON names its ``method`` (a registered drafter), run per k after the named methods.
    A configuration whose fields set ``num_speculative_tokens`` runs once, at that k, instead of per k.
    The fields are validated where every speculative_config is (when the run builds its ``LLM``)."""
    from specdec.adaptive import AUTO
    from specdec.drafters.base import MAX_SPECULATIVE_TOKENS

    catalogue = methods()
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        raise SpecDecError(f"unknown methods {unknown}; choose from {', '.join(catalogue)}")
    if not ks:
        raise SpecDecError("give at least one k")
    bad = [k for k in ks if k != AUTO and not (isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS)]
    if bad:
        raise SpecDecError(f"k must be in 1..{MAX_SPECULATIVE_TOKENS}, got {bad}")
    configs = configs or {}
    specs = [MethodSpec(REFERENCE)]
    for name in dict.fromkeys(names):
        if name == REFERENCE:
            continue
        if catalogue[name].peer and catalogue[name].speculative:  # transformers has no auto k: integer ks only
            fixed = [k for k in ks if k != AUTO]
            if not fixed:
                raise SpecDecError(f"{name} runs transformers at a fixed k and has no 'auto'; give an integer "
                                   "--k beside auto (e.g. --k 4 auto), or use hf_assisted_default")
            specs.extend(MethodSpec(name, k) for k in fixed)
        elif catalogue[name].speculative:
            specs.extend(MethodSpec(name, k, overrides=configs.get(name)) for k in _ks_of(configs.get(name), ks))
        else:
            specs.append(MethodSpec(name))
    for name, config in configs.items():
        if name in catalogue:
            if name not in names or not catalogue[name].speculative or catalogue[name].peer:
                raise SpecDecError(f"--method-config {name}: {name!r} is not a speculative method of --methods")
            if config.get("method", name) != name:
                raise SpecDecError(f"--method-config {name}: its 'method' must be {name!r}, or a new label")
            continue
        method = config.get("method")
        if not isinstance(method, str) or method not in catalogue or not catalogue[method].speculative \
                or catalogue[method].peer:
            raise SpecDecError(f"--method-config {name}: a new label needs a 'method' naming a speculative method "
                               f"of specdec, got {method!r}")
        fields = {key: value for key, value in config.items() if key != "method"}
        specs.extend(MethodSpec(method, k, name=name, overrides=fields) for k in _ks_of(fields, ks))
    return specs


def deterministic_modes(mode: str | None) -> tuple[bool, ...]:
    """The modes of ``bench --deterministic MODE`` (:data:`DETERMINISTIC_MODES`; None: off), as values of
    :attr:`MethodSpec.deterministic`."""
    if mode is None:
        return DETERMINISTIC_MODES["off"]
    if mode not in DETERMINISTIC_MODES:
        raise SpecDecError(f"--deterministic takes {', '.join(DETERMINISTIC_MODES)} (alone: on), got {mode!r}")
    return DETERMINISTIC_MODES[mode]


def in_modes(specs: Sequence[MethodSpec], modes: Sequence[bool]) -> list[MethodSpec]:
    """``specs`` with each specdec method once per mode of ``modes`` (see :func:`deterministic_modes`), its
    variants next to each other so that the bench's rotation keeps them side by side; transformers peers
    once, in the default mode."""
    return [variant for spec in specs
            for variant in ([spec] if spec.kind.peer else [replace(spec, deterministic=d) for d in modes])]


def reference_label(deterministic: bool, labels: Collection[str]) -> str:
    """The label of the plain decoding a variant in that mode is compared with, among the ``labels`` that
    ran: plain decoding in the same mode, else (a transformers peer in a deterministic-only run) the
    one that ran."""
    same = MethodSpec(REFERENCE, deterministic=deterministic).label
    return same if same in labels else MethodSpec(REFERENCE, deterministic=not deterministic).label


def _ks_of(config: dict[str, Any] | None, ks: Sequence[int | str]) -> list[int | str]:
    """The ks a configuration runs at: its own ``num_speculative_tokens`` where it sets one, else each of ``ks``."""
    if config is not None and "num_speculative_tokens" in config:
        return [config["num_speculative_tokens"]]
    return list(dict.fromkeys(ks))


@dataclass
class RunOutput:
    """One generate call over a batch of prompts: per prompt its generated ids and metrics (None for
    transformers peers, which expose none), and ``seconds``, the wall-clock time of the whole call."""

    token_ids: list[list[int]]
    seconds: float
    metrics: list[RequestMetrics | None]


class Runner(ABC):
    """Generates for one method; ``spec`` names the method and its k, ``max_batch_size`` is the
    largest number of prompts one :meth:`run` call takes."""

    spec: MethodSpec
    max_batch_size: int = 1

    @abstractmethod
    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float, seed: int) -> RunOutput:
        """Generate exactly ``max_tokens`` tokens after each of ``prompts`` (at most ``max_batch_size``
        of them) in one call; every request is seeded with ``seed``."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """The method's settings, for the JSON report."""

    def forget(self) -> None:  # noqa: B027 - only methods that learn across requests keep anything
        """Forget what earlier calls taught (called after the warm-up)."""


def runnable_by_default(specs: Sequence[MethodSpec], target) -> list[MethodSpec]:
    """``specs`` less the configurations that cannot run on ``target`` (a loaded transformers model) with no
    ``model`` given (heads trained for another target, none found), each skipped with one line on stderr: what a
    run of the default method list does, where a method the user named raises its error instead."""
    from specdec.drafters import DRAFTERS

    kept, skipped = [], {}
    for spec in specs:
        kind = methods()[spec.method]
        reason = None
        if kind.speculative and not kind.peer and "model" not in (spec.overrides or {}):
            reason = skipped.get(spec.method) or DRAFTERS[spec.method].unavailable_without_model(target)
        if reason is None:
            kept.append(spec)
        elif spec.method not in skipped:
            skipped[spec.method] = reason
            print(f"specdec bench: skipping {spec.method}: {reason}", file=sys.stderr)
    return kept
