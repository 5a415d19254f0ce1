"""A model named by a Hugging Face Hub id that is not cached: refused at once, in one line, where the Hub cannot
be reached; left to transformers where it answers, where the id is cached, or under ``HF_HUB_OFFLINE``."""

import http.server
import threading
import time

import pytest
import torch
from huggingface_hub import constants

from specdec import SpecDecError
from specdec.cli import main
from specdec.models import hub
from specdec.models.loader import load_hf_model, load_tokenizer

NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once


@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    """No id cached, and the Hub's own offline switch off."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def answering_hub():
    """A local server that answers every request 404, as the Hub does for an id it does not know."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 - the handler's protocol
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_id_the_hub_cannot_be_reached_for_is_refused_at_once(monkeypatch, empty_cache):
    monkeypatch.setattr(constants, "ENDPOINT", NOWHERE)
    start = time.monotonic()
    with pytest.raises(SpecDecError, match=r"^model 'some-org/missing' is not a local folder and not in the Hugging "
                                           r"Face cache, and the Hub \(http://127.0.0.1:9\) cannot be reached: .+"):
        load_hf_model("some-org/missing", "float32", torch.device("cpu"))
    with pytest.raises(SpecDecError, match=r"^tokenizer 'some-org/missing' is not a local folder"):
        load_tokenizer("some-org/missing", required=False)
    assert time.monotonic() - start < 2 * hub.PROBE_SECONDS


def test_an_id_is_left_to_transformers_where_the_hub_answers_or_it_is_cached(monkeypatch, empty_cache, tmp_path,
                                                                             answering_hub):
    monkeypatch.setattr(constants, "ENDPOINT", answering_hub)
    hub.check_hub_id("some-org/missing", "model")  # answered (404): transformers says what is wrong
    monkeypatch.setattr(constants, "ENDPOINT", NOWHERE)
    with pytest.raises(SpecDecError):
        hub.check_hub_id("some-org/missing", "model")
    snapshot = tmp_path / "hub" / "models--some-org--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--some-org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--some-org--cached" / "refs" / "main").write_text("0" * 40)
    hub.check_hub_id("some-org/cached", "model")  # cached: transformers reads the cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.check_hub_id("some-org/missing", "model")  # offline: transformers reads the cache alone, failing at once


def test_the_cli_says_so_in_one_line(monkeypatch, empty_cache, capsys):
    monkeypatch.setattr(constants, "ENDPOINT", NOWHERE)
    assert main(["generate", "hi", "--model", "some-org/missing"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "some-org/missing" in err and "cannot be reached" in err
