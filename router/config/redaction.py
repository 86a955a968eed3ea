"""Secrets kept out of what the router and the agents print: config errors, start-up and warning log lines.

A URL may carry credentials in its userinfo (`redis://:secret@redis:6379/0`, `http://user:pass@engine:8000`,
a `$REDIS_URL` from a Secret): wherever such a string is echoed, the userinfo becomes `***`. Everything up to
the last `@` is hidden, so a password that itself contains `@` or `/` (unencoded) is hidden whole too; the
price is that an `@` later in a path hides a little more than it needs to, which only costs detail.
"""

from __future__ import annotations

HIDDEN = "***"


def redact_url(text: str) -> str:
    """`text` with a URL's userinfo (or a `user:password@host:port` address's) replaced by `***`."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    userinfo, at, host = rest.rpartition("@")
    if not at or (not sep and ":" not in userinfo):  # no credentials: a bare `name@host` is not an address
        return text
    return f"{scheme}{sep}{HIDDEN}@{host}"
