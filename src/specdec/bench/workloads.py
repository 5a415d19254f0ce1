"""Benchmark workloads: questions (one or more user turns, a category) and how they become prompt ids.

Three sources:

- ``spec_bench``: the Spec-Bench question file (``question_id``, ``category``, ``turns``). Its
  eight MT-bench sub-categories (writing, roleplay, ...) form the category ``mt_bench``, as in
  Spec-Bench's own report, giving six categories: mt_bench, translation, summarization, qa,
  math_reasoning, rag. The default file ships in the package (``specdec/assets/spec_bench``,
  Apache-2.0, its ``LICENSE`` beside it).
- ``jsonl``: any JSONL file whose rows have a ``prompt`` string or a ``turns`` list (an optional
  ``category``, default ``"default"``, and an optional ``question_id``/``id``).
- ``code``: held-out code prompts from :func:`specdec.train.corpus.code_prompts`, category ``"code"``.
- ``code_repeat``: the same code prompts, then each asked again with a small change (category
  ``"code_again"``, see :func:`repeat_with_changes`): requests that repeat earlier outputs, as an
  agent's or a developer's do.

Multi-turn questions run as Spec-Bench runs them: turn 1 is generated, its answer appended to
the conversation, then turn 2 is generated (see :class:`PromptBuilder`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import SpecDecError
from specdec.jsonl import read_jsonl

WORKLOADS = ("code", "code_repeat", "spec_bench", "jsonl")
MT_BENCH_SUBCATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
SPEC_BENCH_FILE = Path(__file__).resolve().parents[1] / "assets" / "spec_bench" / "question.jsonl"
"""Spec-Bench's 480 questions (Apache-2.0, ``LICENSE`` beside it), shipped inside the package."""
TURN_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Question:
    """One benchmark item: an id, a category, its sub-category (or the category) and its user turns."""

    question_id: str
    category: str
    turns: tuple[str, ...]
    subcategory: str = ""


def default_spec_bench_path() -> Path:
    """The Spec-Bench question file shipped with specdec."""
    if not SPEC_BENCH_FILE.is_file():
        raise SpecDecError(f"the Spec-Bench question file is missing from the installation ({SPEC_BENCH_FILE}); "
                           "pass one with --data FILE")
    return SPEC_BENCH_FILE


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [row for _, row in read_jsonl(path, "data file")]


def _turns(row: dict[str, Any], where: str) -> tuple[str, ...]:
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise SpecDecError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        return tuple(turns)
    if isinstance(row.get("prompt"), str) and row["prompt"]:
        return (row["prompt"],)
    raise SpecDecError(f"{where}: a row needs a non-empty 'prompt' string or a 'turns' list")


def _select(
    questions: list[Question], categories: Sequence[str] | None, num_prompts: int | None
) -> list[Question]:
    """Keep the named categories (or sub-categories), then ``num_prompts`` questions of each category,
    taken in file order and evenly from its sub-categories; the result keeps file order."""
    if num_prompts is not None and num_prompts < 1:
        raise SpecDecError(f"the number of prompts must be at least 1, got {num_prompts}")
    if categories:
        known = {q.category for q in questions} | {q.subcategory for q in questions}
        unknown = sorted(set(categories) - known)
        if unknown:
            available = ", ".join(sorted({q.category for q in questions}))
            raise SpecDecError(f"unknown categories {unknown}; this workload has {available}")
        wanted = set(categories)
        questions = [q for q in questions if q.category in wanted or q.subcategory in wanted]
    if num_prompts is None:
        return questions
    # Within a category, alternate between its sub-categories so that a few prompts still cover them all.
    rank: dict[tuple[str, str], int] = {}
    ranked = []
    for index, question in enumerate(questions):
        group = (question.category, question.subcategory)
        rank[group] = rank.get(group, -1) + 1
        ranked.append((rank[group], index, question))
    taken: dict[str, int] = {}
    chosen = []
    for _, index, question in sorted(ranked, key=lambda item: (item[0], item[1])):
        if taken.get(question.category, 0) < num_prompts:
            taken[question.category] = taken.get(question.category, 0) + 1
            chosen.append((index, question))
    return [question for _, question in sorted(chosen, key=lambda item: item[0])]


def load_spec_bench(
    path: str | Path | None = None, categories: Sequence[str] | None = None, num_prompts: int | None = None
) -> list[Question]:
    """Spec-Bench questions (six categories; MT-bench sub-categories grouped as ``mt_bench``).

    ``num_prompts`` is per category (for ``mt_bench``, spread over its eight sub-categories).
    """
    path = Path(path) if path is not None else default_spec_bench_path()
    questions = []
    for number, row in enumerate(_read_jsonl(path), start=1):
        where = f"{path}:{number}"
        if "category" not in row or "question_id" not in row:
            raise SpecDecError(f"{where}: a Spec-Bench row needs 'question_id', 'category' and 'turns'")
        sub = str(row["category"])
        category = "mt_bench" if sub in MT_BENCH_SUBCATEGORIES else sub
        questions.append(Question(str(row["question_id"]), category, _turns(row, where), sub))
    return _select(questions, categories, num_prompts)


def load_jsonl(
    path: str | Path, categories: Sequence[str] | None = None, num_prompts: int | None = None
) -> list[Question]:
    """Questions from a JSONL file of ``prompt`` or ``turns`` rows; ``num_prompts`` is per category."""
    path = Path(path)
    questions = []
    for number, row in enumerate(_read_jsonl(path), start=1):
        qid = row.get("question_id", row.get("id", number))
        category = str(row.get("category", "default"))
        questions.append(Question(str(qid), category, _turns(row, f"{path}:{number}"), category))
    return _select(questions, categories, num_prompts)


def load_code(
    num_prompts: int, corpus_dirs: Sequence[str | Path] | None = None, seed: int = 0
) -> list[Question]:
    """``num_prompts`` held-out code prompts (category ``"code"``) from the training corpus split."""
    from specdec.train.corpus import code_prompts

    prompts = code_prompts(num_prompts, corpus_dirs=corpus_dirs, split="heldout", seed=seed)
    return [Question(f"code-{i}", "code", (prompt,), "code") for i, prompt in enumerate(prompts)]


_DEFINED_NAME = re.compile(r"^(\s*(?:async\s+)?(?:def|class)\s+)(\w+)", re.MULTILINE)


def repeat_with_changes(questions: Sequence[Question]) -> list[Question]:
    """``questions``, then each again (category ``"code_again"``, after all the first ones) with a small
    change: the first defined name gets the suffix ``_v2`` (``def call(`` -> ``def call_v2(``), or, in a
    prompt without a ``def``/``class``, a comment line ``# again`` comes first."""
    again = []
    for q in questions:
        turns = tuple(_DEFINED_NAME.sub(r"\1\2_v2", t, count=1) if _DEFINED_NAME.search(t) else "# again\n" + t
                      for t in q.turns)
        again.append(Question(f"{q.question_id}-again", "code_again", turns, "code_again"))
    return [*questions, *again]


def load_workload(
    kind: str,
    data: str | Path | None = None,
    categories: Sequence[str] | None = None,
    num_prompts: int | None = None,
) -> list[Question]:
    """Load a workload by name; ``data``: the question file (spec_bench, jsonl) or a corpus folder (code)."""
    if kind not in WORKLOADS:
        raise SpecDecError(f"unknown workload {kind!r}; choose one of {', '.join(WORKLOADS)}")
    if kind == "spec_bench":
        questions = load_spec_bench(data, categories, num_prompts)
    elif kind == "jsonl":
        if data is None:
            raise SpecDecError("the jsonl workload needs --data FILE")
        questions = load_jsonl(data, categories, num_prompts)
    else:
        if data is not None and not Path(data).is_dir():
            raise SpecDecError(
                f"the code workload's --data must be a corpus folder; {str(data)!r} is not one"
            )
        if kind == "code_repeat" and categories:
            raise SpecDecError(f"the code_repeat workload takes no categories, got {sorted(categories)}")
        if categories and set(categories) != {"code"}:
            raise SpecDecError(f"the code workload has the single category 'code', not {sorted(categories)}")
        questions = load_code(num_prompts or 10, [data] if data is not None else None)
        if kind == "code_repeat":
            questions = repeat_with_changes(questions)
    if not questions:
        raise SpecDecError("the workload selection holds no questions")
    return questions


class PromptBuilder:
    """Turns a conversation (user turns so far and the answers generated to the earlier ones) into ids.

    With a chat template, the conversation is rendered by ``apply_chat_template`` with a generation
    prompt and tokenized without adding special tokens again. Without one, turns and answers are
    joined with blank lines (``turn1\\n\\nanswer1\\n\\nturn2``) and tokenized as :class:`specdec.LLM`
    tokenizes a text prompt.
    """

    def __init__(self, tokenizer) -> None:
        if tokenizer is None:
            raise SpecDecError("the benchmark needs the target's tokenizer to turn questions into prompts")
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def build(self, turns: Sequence[str], answers: Sequence[str]) -> list[int]:
        """Prompt ids for the last of ``turns``; ``answers`` holds one answer per earlier turn."""
        if len(answers) != len(turns) - 1:
            raise SpecDecError(
                f"{len(turns)} turns need {len(turns) - 1} earlier answers, got {len(answers)}"
            )
        if self.chat:
            messages = []
            for i, turn in enumerate(turns):
                messages.append({"role": "user", "content": turn})
                if i < len(answers):
                    messages.append({"role": "assistant", "content": answers[i]})
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        parts = []
        for i, turn in enumerate(turns):
            parts.append(turn)
            if i < len(answers):
                parts.append(answers[i])
        return list(self.tokenizer(TURN_SEPARATOR.join(parts))["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """The answer text of generated ids, special tokens removed."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
