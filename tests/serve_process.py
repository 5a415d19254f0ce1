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
    """``python -m specdec.cli serve ARGS`` on 127.0.0.1; ``stop()`` sends SIGTERM and returns (status, log)."""

    def __init__(self, *args: str, start_timeout: float = 180.0) -> None:
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
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited: {self.output()}")
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(self.root + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

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
