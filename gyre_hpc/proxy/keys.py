"""Per-execution API keys: a key names its run and role and cannot be forged or reused elsewhere.

A key is ``gy-<payload>.<mac>``: the payload is the run id and role, the MAC an HMAC-SHA256
under a secret kept in the run directory (``proxy.secret``, mode 600). The proxy derives the
run from the key alone, so a harness can never write into another run's log. Run ids and roles
are names, not paths: letters, digits and ``._:-``, at most 128 characters, not starting with a
dot; anything else is refused when a key is minted and when one is presented.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

NAME = re.compile(r"[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,127}")


def check_name(what: str, value: str) -> str:
    """``value`` if it is a valid run id or role, else ValueError naming what is valid."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        valid = "letters, digits and ._:- (at most 128, no leading dot)"
        raise ValueError(f"{what} {value!r} is not valid: {valid}")
    return value


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class KeyRing:
    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    @classmethod
    def load(cls, path: Path) -> KeyRing:
        """The secret in ``path`` (the run directory's ``proxy.secret``), made on first use."""
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(secrets.token_bytes(32))
        return cls(path.read_bytes())

    def mint(self, run_id: str, role: str) -> str:
        check_name("run id", run_id)
        check_name("role", role)
        payload = _b64(json.dumps([run_id, role], separators=(",", ":")).encode())
        return f"gy-{payload}.{self._mac(payload)}"

    def verify(self, key: str) -> tuple[str, str] | None:
        """(run id, role) of a genuine key naming a valid run and role, else None."""
        if not key.isascii() or not key.startswith("gy-") or "." not in key:
            return None
        payload, mac = key[3:].rsplit(".", 1)
        if not hmac.compare_digest(mac, self._mac(payload)):
            return None
        try:
            run_id, role = json.loads(_unb64(payload))
            return check_name("run id", run_id), check_name("role", role)
        except (ValueError, TypeError):  # a genuine key for what is no longer a valid name
            return None

    def _mac(self, payload: str) -> str:
        return _b64(hmac.new(self.secret, payload.encode(), hashlib.sha256).digest()[:18])


def bearer_is(header: str, token: str) -> bool:
    """``header`` (an ``Authorization`` value) presents ``token``; compared in constant time."""
    return hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


def write_private_json(path: Path, data: Any) -> None:
    """``data`` as JSON in ``path``, mode 600, replaced whole: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)
