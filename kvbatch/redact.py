"""Credentials out of messages: the password (or token) in a URL's userinfo is masked, in one
URL or anywhere in a text. Plain string work that never raises, so an error handler can call
it on a URL no parser accepts ('redis://user:secret@[::1:1/9' makes kombu's sanitize_url and
urllib raise)."""

from __future__ import annotations

import re

_SCHEME_PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/*")
# scheme://userinfo@ inside a text; userinfo stops at whitespace, quotes and '/'
_USERINFO_IN_TEXT = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^\s/@\"'<>]+)@")


def redact_url(url: str) -> str:
    """`url` with the password (or token) before its '@' hidden, typos included
    ('amqp://admin:***@host//', 'redis:/admin:***@host'): error messages never echo it."""
    at = url.rfind("@")
    if at < 0:
        return url
    scheme = _SCHEME_PREFIX.match(url)
    start = scheme.end() if scheme else 0
    return f"{url[:start]}{_masked(url[start:at])}{url[at:]}"


def redact_urls(text: str, *urls: str | None) -> str:
    """`text` with every URL's credentials masked: those of `urls` wherever they appear
    whole (a malformed one too), and any `scheme://user:password@` in it."""
    for url in urls:
        if url and "@" in url:
            text = text.replace(url, redact_url(url))
    return _USERINFO_IN_TEXT.sub(lambda m: f"{m['scheme']}{_masked(m['info'])}@", text)


def _masked(userinfo: str) -> str:
    """'user:***' for 'user:password', '***' for a lone token (it may be the secret)."""
    if userinfo.endswith(":***") or userinfo == "***":
        return userinfo
    return userinfo.split(":", 1)[0] + ":***" if ":" in userinfo else "***"
