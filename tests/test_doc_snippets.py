"""Every fenced block marked to run in the README and the docs runs, as written, on the embedded pair.

A block is marked by an HTML comment on the line before its fence: ``<!-- run -->``, or
``<!-- run: server -->`` for a block that talks to ``specdec serve`` (started once here, on a free port
that replaces the block's ``127.0.0.1:8000``). ``specdec ...`` lines run in this process through
``specdec.cli.main`` (exit status 0 expected); other shell lines run in a shell; Python blocks are
executed. The docs keep their token counts small so that the whole module stays fast.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from specdec.cli import main

ROOT = Path(__file__).resolve().parent.parent
SKIP = ("lab-notes",)  # working notes: their commands are records, not examples
BLOCK = re.compile(r"<!-- run(?:: (?P<kind>server))? -->\n```(?P<lang>bash|python)\n(?P<code>.*?)```", re.S)
SHELL = set("|&;<>$`")
DEFAULT_URL = "127.0.0.1:8000"


def _files() -> list[Path]:
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md")) if not set(SKIP) & set(p.relative_to(ROOT).parts)]
    return [ROOT / "README.md", *docs]


def _snippets() -> list[tuple[str, str | None, str, str]]:
    found = []
    for path in _files():
        text = path.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 2
            found.append((f"{path.relative_to(ROOT)}:{line}", match["kind"], match["lang"], match["code"]))
    return found


SNIPPETS = _snippets()


def _commands(code: str) -> list[str]:
    """Logical lines of a shell block (backslash continuations joined as the shell joins them: the backslash and the
    line break go, the next line's indentation stays), comments and blank lines dropped."""
    joined = re.sub(r"\\\n", "", code)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _run_shell(command: str) -> None:
    words = shlex.split(command, comments=True)
    if words and words[0] == "specdec" and not SHELL & set(command.split("#")[0].replace("'", "").replace('"', "")):
        try:
            code = main(words[1:])
        except SystemExit as exc:  # --version, --help
            code = exc.code
        assert code == 0, f"{command!r} exited {code}"
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, f"{command!r}: {result.stderr[-2000:]}"
    assert result.stdout.strip(), f"{command!r} printed nothing"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--port", str(port), "--max-num-seqs",
                                "4"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"127.0.0.1:{port}"
    try:
        for _ in range(240):
            if process.poll() is not None:
                raise RuntimeError(f"specdec serve exited: {process.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://{url}/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("specdec serve did not come up in 120 s")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_the_docs_have_snippets_to_run():
    assert len(SNIPPETS) >= 10 and any(kind == "server" for _, kind, _, _ in SNIPPETS)


@pytest.mark.parametrize("where,kind,lang,code", SNIPPETS, ids=[s[0] for s in SNIPPETS])
def test_snippet_runs(where, kind, lang, code, request, tmp_path, monkeypatch):
    if kind == "server":
        code = code.replace(DEFAULT_URL, request.getfixturevalue("server_url"))
    monkeypatch.chdir(tmp_path)
    if lang == "python":
        exec(compile(code, where, "exec"), {"__name__": "__snippet__"})
    else:
        for command in _commands(code):
            _run_shell(command)
