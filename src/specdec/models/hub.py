"""A model or tokenizer named by a Hugging Face Hub id: refused at once where it cannot load.

transformers reads a hub id from the local cache or downloads it. Where the id is not cached and the Hub
cannot be reached (a machine offline, a firewall, a wrong ``HF_ENDPOINT``), each file it asks for is retried
with back-off: ``specdec generate --model some-org/missing`` on a machine without internet took 31 s and logged
eleven warnings before its error (until 2026-12-01; now 7 s, its imports). :func:`check_hub_id` asks the Hub
once, with a short timeout, and refuses such an id with one line that says why. A cached id, or
``HF_HUB_OFFLINE=1`` (where transformers reads the cache alone and fails at once), is left to transformers.
"""

from __future__ import annotations

from specdec.errors import SpecDecError

PROBE_SECONDS = 5.0
"""How long the one request that checks the Hub waits (connecting and reading)."""

CACHED_FILES = ("config.json", "tokenizer_config.json")
"""Files whose presence in the local cache means the id was downloaded before."""


def check_hub_id(name: str, what: str) -> None:
    """Raise :class:`SpecDecError` naming ``what`` (``"model"``, ``"tokenizer"``) and ``name`` where the hub id
    ``name`` is neither in the local Hugging Face cache nor on a Hub that answers."""
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE:
        return
    if any(isinstance(try_to_load_from_cache(name, file), str) for file in CACHED_FILES):
        return
    reason = _unreachable(constants.ENDPOINT, name)
    if reason is not None:
        raise SpecDecError(f"{what} {name!r} is not a local folder and not in the Hugging Face cache, and the Hub "
                           f"({constants.ENDPOINT}) cannot be reached: {reason}. Pass a local folder, or download "
                           "the model where the Hub can be reached")


def _unreachable(endpoint: str, name: str) -> str | None:
    """Why the Hub at ``endpoint`` did not answer a request for ``name`` (None: it answered, whatever it said)."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(f"{endpoint}/api/models/{name}", timeout=PROBE_SECONDS, follow_redirects=True)
    except Exception as exc:  # noqa: BLE001 - any failure to get an answer (DNS, refused, timeout, TLS, proxy)
        return " ".join(str(exc).split()) or type(exc).__name__
    return None
