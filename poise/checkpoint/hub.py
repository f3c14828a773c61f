"""Hugging Face Hub ids (``Qwen/Qwen2.5-7B-Instruct``) resolved in the local cache only.

poise never downloads weights: a Hub id is looked up with ``huggingface_hub`` in its cache
(``HF_HOME`` / ``HF_HUB_CACHE``), as ``HF_HUB_OFFLINE=1`` would, and a model that is not there
is a ``ValueError`` that says how to fetch it.
"""

from __future__ import annotations

import re
from pathlib import Path

# owner/name, optionally @revision; an existing local path is never taken for a Hub id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(@[\w.\-/]+)?$")


def looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and not Path(text).expanduser().exists()


def cached_snapshot(repo_id: str) -> Path:
    """The local snapshot directory of ``repo_id`` (``owner/name[@revision]``)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    name, _, revision = repo_id.partition("@")
    try:
        path = snapshot_download(name, revision=revision or None, local_files_only=True)
    except LocalEntryNotFoundError:
        raise ValueError(
            f"model: {repo_id!r} is not in the local Hugging Face cache and poise does not "
            f"download; fetch it first (`huggingface-cli download {name}`) or give a local path"
        ) from None
    return Path(path)
