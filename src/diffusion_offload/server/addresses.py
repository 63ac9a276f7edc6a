"""What ``serve`` accepts for its API key, bound host and allowed hosts and origins: each
checked and put in the form the middleware compares (``middleware``)."""

from __future__ import annotations

__all__ = ["check_api_key", "normalize_host", "normalize_origin"]


def check_api_key(key: str) -> None:
    """An API key must be printable ASCII without spaces (what every HTTP client sends
    byte for byte in ``Authorization: Bearer KEY``).

    Raises:
        ValueError: empty, or a character outside ``!`` .. ``~`` (named with its position).
    """
    if not key:
        raise ValueError("--api-key must not be empty")
    for i, ch in enumerate(key):
        if not "!" <= ch <= "~":
            raise ValueError(
                f"--api-key: character {i + 1} ({ch!r}) cannot be sent in an HTTP header, so the "
                "key could never match; use printable ASCII without spaces (e.g. from "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )


def normalize_host(host: str, flag: str = "--host") -> str:
    """A host name as compared with the ``Host`` header: lower case, no port, IPv6
    without brackets.

    Raises:
        ValueError: empty or containing ``/`` or spaces.
    """
    text = host.strip().lower()
    if text.startswith("[") and "]" in text:
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]
    if not text or any(c in text for c in "/ \t@"):
        raise ValueError(f"{flag}: {host!r} is not a host name (e.g. myhost.lan or 10.0.0.5)")
    return text


def normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` in lower case, without a trailing slash.

    Raises:
        ValueError: not an http(s) origin (named with the flag ``--allowed-origins``).
    """
    from urllib.parse import urlsplit

    text = origin.strip().rstrip("/").lower()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise ValueError(
            f"--allowed-origins: {origin!r} is not an origin; write scheme://host[:port], "
            "e.g. http://localhost:3000"
        )
    return f"{parts.scheme}://{parts.netloc}"
