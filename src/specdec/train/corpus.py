"""Training corpora: folders of text/code files, a by-module split, token blocks and code prompts.

A corpus is one or more folders. Without folders the corpus is the running interpreter's standard
library (``.py`` files, ``site-packages`` excluded, the ``test`` package included).

Files are split into a train and a held-out part by *module*: the module key of a file is its
top-level module or package name relative to its corpus folder (``json/decoder.py`` -> ``json``).
Files under a top-level ``test``/``tests`` package are keyed by the module they test
(``test/test_json/test_dump.py`` -> ``json``, ``test/test_os.py`` -> ``os``), so a held-out module's
tests are held out too. A module is held out when a SHA-256 hash of its key falls in the lowest
``HELDOUT_PERMILLE`` of the hash range; the split therefore does not depend on which other files
exist, on the order of listing, or on the machine.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import sysconfig
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from specdec.errors import SpecDecError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Split = Literal["train", "heldout"]

HELDOUT_PERMILLE = 50
"""Modules whose key hashes into the lowest 50 of 1000 buckets (about 5 %) are held out."""

TEXT_SUFFIXES = frozenset(
    {
        ".py",
        ".pyi",
        ".txt",
        ".md",
        ".rst",
        ".c",
        ".h",
        ".cc",
        ".cpp",
        ".hpp",
        ".rs",
        ".go",
        ".java",
        ".js",
        ".ts",
        ".sh",
        ".toml",
        ".cfg",
        ".ini",
        ".json",
        ".yaml",
        ".yml",
        ".html",
        ".css",
        ".sql",
    }
)
"""File suffixes read from user-given corpus folders."""

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", ".git", "node_modules"})
_TEST_PACKAGES = frozenset({"test", "tests"})
_PROMPT_MIN_CHARS = 40
_PROMPT_MAX_CHARS = 600


@dataclass(frozen=True)
class CorpusFile:
    """One text file of a corpus: its path and the module key that decides its split."""

    path: Path
    module: str


def default_corpus_dirs() -> list[Path]:
    """The default corpus: the running interpreter's standard library folder."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def _module_key(relative: Path) -> str:
    parts = relative.parts
    top = Path(parts[0]).stem if len(parts) == 1 else parts[0]
    if top in _TEST_PACKAGES and len(parts) > 1:
        tested = Path(parts[1]).stem if len(parts) == 2 else parts[1]
        tested = tested.removeprefix("test_")
        return tested or top
    return top


def list_files(corpus_dirs: Sequence[str | os.PathLike[str]] | None = None) -> list[CorpusFile]:
    """All text files of the corpus, sorted by path.

    For the default corpus (``corpus_dirs=None``) only ``.py`` files are listed; for user folders,
    every file whose suffix is in :data:`TEXT_SUFFIXES`. Raises :class:`SpecDecError` for a folder
    that does not exist or that holds no text file.
    """
    suffixes = frozenset({".py"}) if corpus_dirs is None else TEXT_SUFFIXES
    dirs = default_corpus_dirs() if corpus_dirs is None else [Path(d) for d in corpus_dirs]
    if not dirs:
        raise SpecDecError("empty corpus: no corpus folder given")
    files: list[CorpusFile] = []
    for root in dirs:
        if not root.is_dir():
            raise SpecDecError(f"corpus folder {str(root)!r} does not exist or is not a folder")
        found = 0
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
            for name in sorted(filenames):
                path = Path(dirpath) / name
                if path.suffix in suffixes and path.is_file():
                    files.append(CorpusFile(path, _module_key(path.relative_to(root))))
                    found += 1
        if found == 0:
            kinds = ", ".join(sorted(suffixes))
            raise SpecDecError(f"corpus folder {str(root)!r} holds no text files ({kinds})")
    files.sort(key=lambda f: str(f.path))
    return files


def _bucket(module: str) -> int:
    return int.from_bytes(hashlib.sha256(module.encode("utf-8")).digest()[:8], "big") % 1000


def heldout_modules(modules: Sequence[str]) -> set[str]:
    """The held-out subset of ``modules``.

    With at least two modules, the result is never empty and never all of them: when no module
    hashes into the held-out range, the one with the lowest hash is held out; when all do, only the
    one with the lowest hash is. Raises :class:`SpecDecError` for fewer than two modules.
    """
    unique = sorted(set(modules))
    if len(unique) < 2:
        raise SpecDecError(
            f"corpus has {len(unique)} top-level module(s); a train/held-out split needs at least two"
        )
    held = {m for m in unique if _bucket(m) < HELDOUT_PERMILLE}
    if not held or len(held) == len(unique):
        held = {min(unique, key=lambda m: (_bucket(m), m))}
    return held


def split_files(corpus_dirs: Sequence[str | os.PathLike[str]] | None = None) -> dict[str, list[CorpusFile]]:
    """The corpus files split by module: ``{"train": [...], "heldout": [...]}``, each sorted by path."""
    files = list_files(corpus_dirs)
    held = heldout_modules([f.module for f in files])
    return {
        "train": [f for f in files if f.module not in held],
        "heldout": [f for f in files if f.module in held],
    }


def read_text(path: Path) -> str | None:
    """The file's text decoded as UTF-8, or ``None`` when it is not valid UTF-8 or is empty."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text or None


def iter_texts(files: Sequence[CorpusFile]) -> list[str]:
    """The texts of ``files`` in order, skipping empty and non-UTF-8 files."""
    texts = [read_text(f.path) for f in files]
    return [t for t in texts if t is not None]


def _cache_key(files: Sequence[CorpusFile], tokenizer: PreTrainedTokenizerBase) -> str:
    digest = hashlib.sha256()
    digest.update(repr(sorted(tokenizer.get_vocab().items())).encode("utf-8"))
    digest.update(repr(tokenizer.eos_token_id).encode("utf-8"))
    for f in files:
        stat = f.path.stat()
        digest.update(f"{f.path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def default_cache_dir() -> Path:
    """``$SPECDEC_CACHE`` or ``$XDG_CACHE_HOME/specdec`` (default ``~/.cache/specdec``)."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdec"


def token_stream(
    files: Sequence[CorpusFile],
    tokenizer: PreTrainedTokenizerBase,
    cache_dir: str | os.PathLike[str] | None = None,
) -> np.ndarray:
    """The files tokenized and concatenated, with the EOS token after every file.

    Returns a 1-D integer array of shape ``(n_tokens,)`` (``uint16`` when the vocabulary fits,
    else ``int32``). The array is cached as ``tokens-<key>.npy`` in ``cache_dir`` (default
    :func:`default_cache_dir`), keyed by the vocabulary and the files' paths, sizes and mtimes, so a
    rerun does not tokenize again.
    """
    if tokenizer.eos_token_id is None:
        raise SpecDecError("tokenizer has no EOS token; it is needed to separate files")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_file = cache / f"tokens-{_cache_key(files, tokenizer)}.npy"
    if cache_file.is_file():
        return np.load(cache_file)
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32
    texts = iter_texts(files)
    if not texts:
        raise SpecDecError("empty corpus: none of its files holds UTF-8 text")
    from tqdm.auto import tqdm

    eos = tokenizer.eos_token_id
    pieces: list[np.ndarray] = []
    batch = 64
    for start in tqdm(range(0, len(texts), batch), desc="tokenizing corpus", unit="batch"):
        encoded = tokenizer(texts[start : start + batch], add_special_tokens=False)["input_ids"]
        for ids in encoded:
            pieces.append(np.asarray([*ids, eos], dtype=dtype))
    stream = np.concatenate(pieces)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_name(f"{cache_file.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, stream)
    os.replace(tmp, cache_file)
    return stream


class TokenBlocks:
    """A token stream cut into non-overlapping blocks of ``block_size`` tokens.

    ``blocks[i]`` is an ``int64`` array of shape ``(block_size,)``; :meth:`batch` draws a batch of
    shape ``(batch_size, block_size)`` for a micro-step index deterministically: epoch ``e`` visits
    the blocks in a permutation seeded by ``(seed, e)``, so a resumed run sees the same data.
    """

    def __init__(self, stream: np.ndarray, block_size: int, seed: int = 0) -> None:
        n = len(stream) // block_size
        if n == 0:
            raise SpecDecError(
                f"corpus split has {len(stream)} tokens, fewer than one block of {block_size} tokens"
            )
        self.blocks = stream[: n * block_size].reshape(n, block_size)
        self.block_size = block_size
        self.seed = seed

    def __len__(self) -> int:
        return len(self.blocks)

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.blocks))

    def batch(self, index: int, batch_size: int) -> np.ndarray:
        """The ``index``-th batch of the endless shuffled stream: shape ``(batch_size, block_size)``."""
        start = index * batch_size
        rows = []
        for pos in range(start, start + batch_size):
            epoch, offset = divmod(pos, len(self.blocks))
            rows.append(self._order(epoch)[offset] if len(self.blocks) > 1 else 0)
        return self.blocks[np.asarray(rows)].astype(np.int64)

    def first(self, n: int) -> np.ndarray:
        """The first ``min(n, len(self))`` blocks in corpus order: shape ``(m, block_size)``."""
        return self.blocks[:n].astype(np.int64)


def _prompt_end_line(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int | None:
    """The last (1-based) line of the header plus docstring, or ``None`` for one-line definitions."""
    first = node.body[0]
    if first.lineno == node.lineno:
        return None
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    if is_doc and isinstance(first.value.value, str):
        return first.end_lineno
    return first.lineno - 1


def _file_prompts(text: str) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            return []
    lines = text.splitlines(keepends=True)
    prompts = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        end = _prompt_end_line(node)
        if end is None:
            continue
        chunk = lines[node.lineno - 1 : end]
        while chunk and (not chunk[-1].strip() or chunk[-1].lstrip().startswith("#")):
            chunk.pop()
        prompt = "".join(chunk)
        if not prompt.endswith("\n"):
            prompt += "\n"
        if _PROMPT_MIN_CHARS <= len(prompt) <= _PROMPT_MAX_CHARS:
            prompts.append(prompt)
    return prompts


def code_prompts(
    n: int,
    corpus_dirs: Sequence[str | os.PathLike[str]] | None = None,
    split: Split = "heldout",
    seed: int = 0,
) -> list[str]:
    """Up to ``n`` code prompts from one split of a corpus (default: the held-out stdlib modules).

    Each prompt is the exact text of a ``.py`` file from the ``def``/``class`` line of a top-level
    definition through its signature and, if present, its docstring, ending in a newline, e.g.
    ``'def quicksort(arr):\\n    \"\"\"Sort arr.\"\"\"\\n'``. Prompts are 40-600 characters long,
    deduplicated, and chosen by a ``random.Random(seed)`` shuffle of all candidates in path order,
    so the same arguments give the same list. Fewer than ``n`` are returned when the split holds
    fewer; none at all raises :class:`SpecDecError`.
    """
    if n < 1:
        raise SpecDecError(f"number of prompts must be at least 1, got {n}")
    if split not in ("train", "heldout"):
        raise SpecDecError(f"split must be 'train' or 'heldout', got {split!r}")
    files = [f for f in split_files(corpus_dirs)[split] if f.path.suffix == ".py"]
    seen: set[str] = set()
    candidates: list[str] = []
    for text in iter_texts(files):
        for prompt in _file_prompts(text):
            if prompt not in seen:
                seen.add(prompt)
                candidates.append(prompt)
    if not candidates:
        raise SpecDecError(
            f"the {split} split of the corpus holds no top-level Python def/class to prompt with"
        )
    random.Random(seed).shuffle(candidates)
    return candidates[:n]
