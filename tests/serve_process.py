"""``specdec serve`` in a subprocess on a free loopback port, for tests that need a real process
(timing without the test's own threads sharing the GIL, signals)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


class ServeProcess:
    """``python -m specdec.cli serve ARGS`` on 127.0.0.1 (log level info: the bind is checked in the log);
    ``stop()`` sends SIGTERM and returns (status, log)."""

    def __init__(self, *args: str, start_timeout: float = 180.0, attempts: int = 3) -> None:
        for attempt in range(attempts):  # the free port may be taken by another process before it binds
            if self._start(args, start_timeout) or attempt == attempts - 1:
                break
        assert self.proc.poll() is None, f"the server exited: {self.output()[-3000:]}"

    def _start(self, args: tuple[str, ...], start_timeout: float) -> bool:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.root = f"http://127.0.0.1:{self.port}"
        # a file, not a pipe: a full pipe would block the server; closed with the object
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--host", "127.0.0.1",
                                      "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "SPECDEC_API_KEY": ""})
        deadline = time.monotonic() + start_timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, "the server did not start"
            try:  # ours, not another process on the same port: uvicorn logs its bind (log level info)
                bound = f"running on http://127.0.0.1:{self.port}" in self.output()
                if bound and httpx.get(self.root + "/health", timeout=1).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def stop(self, timeout: float = 60.0) -> tuple[int, str]:
        """SIGTERM, wait (then SIGKILL past ``timeout``); the exit status and everything it printed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode, self.output()

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()
