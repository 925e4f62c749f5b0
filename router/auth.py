"""API key → tenant. With no key file the router runs open and every request is ``default``.

Key file: JSON object ``{"<api key>": "<tenant>", ...}``; clients send
``authorization: Bearer <api key>`` metadata. The tenant never comes from a request field.
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path
from typing import Optional, Sequence

from kvfleet.errors import Unauthenticated

DEFAULT_TENANT = "default"


class Authenticator:
    def __init__(self, keys: Optional[dict[str, str]] = None) -> None:
        self._keys = dict(keys or {})

    @classmethod
    def from_file(cls, path: Optional[str]) -> "Authenticator":
        """Raises ValueError if the file is not a JSON object of string → string."""
        if not path:
            return cls()
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in data.items()):
            raise ValueError(f"{path}: expected a JSON object mapping API keys to tenant names")
        return cls(data)

    @property
    def open(self) -> bool:
        return not self._keys

    def tenant(self, metadata: Sequence[tuple[str, str]]) -> str:
        """The tenant for a request's metadata. Raises Unauthenticated."""
        if self.open:
            return DEFAULT_TENANT
        auth = dict(metadata or ()).get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated("missing 'authorization: Bearer <api key>' metadata")
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                return tenant
        raise Unauthenticated("unknown API key")
