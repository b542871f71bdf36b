"""Per-execution API keys: a key names its run and role and cannot be forged or reused elsewhere.

A key is ``gy-<payload>.<mac>``: the payload is the run id and role, the MAC an HMAC-SHA256
under a secret kept in the run directory (``proxy.secret``, mode 600). The proxy derives the
run from the key alone, so a harness can never write into another run's log.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path


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
        payload = _b64(json.dumps([run_id, role], separators=(",", ":")).encode())
        return f"gy-{payload}.{self._mac(payload)}"

    def verify(self, key: str) -> tuple[str, str] | None:
        """(run id, role) of a genuine key, else None."""
        if not key.startswith("gy-") or "." not in key:
            return None
        payload, mac = key[3:].rsplit(".", 1)
        if not hmac.compare_digest(mac, self._mac(payload)):
            return None
        run_id, role = json.loads(_unb64(payload))
        return run_id, role

    def _mac(self, payload: str) -> str:
        return _b64(hmac.new(self.secret, payload.encode(), hashlib.sha256).digest()[:18])
