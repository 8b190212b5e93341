"""Secrets out of what is shown: the password of a URL and fields named as secrets, masked.

Every resolved config a process logs, prints or writes to its run directory goes through
:func:`redact` first; a single URL goes through :func:`redact_url`. Only the shown copy is masked:
the services keep connecting with the real values. A field whose name ends in ``_env``
(e.g. a scorer's ``token_env``) names an environment variable, not a secret, and is shown as is.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
"""What a secret is replaced with."""

_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/\s?#]*:)[^/\s?#]*@")
"""``scheme://user:password@``; greedy up to the last ``@`` of the host part, as URL parsers split it."""

_SECRET_NAME = re.compile(r"(?:^|_)(?:password|passwd|secret|token|api_?key|private_key|access_key|credentials?)$")
"""Field names that hold a secret: ``password``, ``auth_token``, ``hmac_secret``, ``api_key`` (not ``token_env``)."""


def redact_url(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` in it replaced by ``***``."""
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", text)


def is_secret_name(name: str) -> bool:
    """Whether a field called ``name`` holds a secret (case-insensitive)."""
    return _SECRET_NAME.search(name.lower()) is not None


def redact(data: Any) -> Any:
    """A copy of ``data`` (dicts, lists, strings, as from ``model_dump(mode="json")``) safe to show:
    set values of secret-named fields become ``***``, passwords inside URL strings too."""
    if isinstance(data, dict):
        return {
            key: MASK if isinstance(key, str) and is_secret_name(key) and value not in (None, "") else redact(value)
            for key, value in data.items()
        }
    if isinstance(data, (list, tuple)):
        return [redact(item) for item in data]
    if isinstance(data, str):
        return redact_url(data)
    return data
