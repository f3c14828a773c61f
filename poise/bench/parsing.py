"""Small parsers the benchmark's flags and configs share: number lists, class priorities and
the API / server roots of a URL."""

from __future__ import annotations

from urllib.parse import urlsplit


def int_list(text: str) -> tuple[int, ...]:
    """``8,16,32`` -> (8, 16, 32)."""
    return tuple(int(x) for x in text.split(",") if x.strip())


def float_list(text: str) -> tuple[float, ...]:
    """``0,0.25,inf`` -> (0.0, 0.25, inf)."""
    return tuple(float(x) for x in text.split(",") if x.strip())


def class_priorities(text: str) -> dict[str, int]:
    """``short=0,long=1`` -> {"short": 0, "long": 1}."""
    out: dict[str, int] = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, eq, value = item.partition("=")
        try:
            if not eq or not name.strip():
                raise ValueError
            out[name.strip()] = int(value)
        except ValueError:
            raise ValueError(f"--priority: {item!r} is not CLASS=INTEGER") from None
    return out


def api_root(url: str) -> str:
    """The OpenAI API root of a server URL: ``http://h:8000`` and ``http://h:8000/v1`` both give
    ``http://h:8000/v1``; a URL with another path (``http://h/openai/v1``, ``http://h/api``) is
    kept as given, since some servers mount the API elsewhere."""
    root = url.rstrip("/")
    return root + "/v1" if urlsplit(root).path in ("", "/") else root


def server_root(url: str) -> str:
    """The server's root (where /metrics, /health live): the API root without its ``/v1``."""
    root = api_root(url)
    return root[: -len("/v1")] if root.endswith("/v1") else root
