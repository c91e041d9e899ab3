"""Ed25519 signatures over cache entries.

An entry's ``meta.json`` holds the sha256 and size of every file and the sha256 of its payload
(the manifest), so signing the canonical JSON of the meta (everything but the signature itself)
vouches for every byte of the entry. A :class:`Signer` signs at publish; :class:`TrustedKeys`
says why an entry may not be loaded (unsigned, signed by a key not trusted here, or a signature
that does not verify). Needs the ``cryptography`` package only where keys are configured.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from dsa_aot.cache.store import CacheError, EntryMeta, EntrySignature

__all__ = ["EntrySignature", "Signer", "SigningError", "TrustedKeys", "signed_bytes"]

ALGORITHM = "ed25519"


class SigningError(CacheError):
    """A key file cannot be used (missing, unreadable, not an Ed25519 key)."""


def signed_bytes(meta: EntryMeta) -> bytes:
    """What is signed: the canonical JSON of ``meta`` without its signature."""
    body = meta.model_dump(mode="json", exclude={"signature"})
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _key_id(public_raw: bytes) -> str:
    return hashlib.sha256(public_raw).hexdigest()[:16]


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SigningError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None


class Signer:
    """An Ed25519 private key that signs entry metas."""

    def __init__(self, private_key) -> None:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self._key = private_key
        self.public_pem = private_key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
        self.key_id = _key_id(private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))

    @classmethod
    def from_file(cls, path: Path) -> Signer:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        try:
            key = load_pem_private_key(_read(path, "signing key"), password=None)
        except (ValueError, TypeError) as exc:
            raise SigningError(f"{path} is not an unencrypted PEM private key: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise SigningError(f"{path} is a {type(key).__name__}, not an Ed25519 private key")
        return cls(key)

    @classmethod
    def generate(cls) -> Signer:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls(Ed25519PrivateKey.generate())

    def private_pem(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        return self._key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())

    def write(self, path: Path) -> tuple[Path, Path]:
        """Write the private key (mode 0600, refusing to overwrite) and ``<path>.pub``."""
        path = Path(path)
        pub = path.with_name(path.name + ".pub")
        for target in (path, pub):
            if target.exists():
                raise FileExistsError(f"{target} exists; not overwriting a key")
        for target, data, mode in ((path, self.private_pem(), 0o600), (pub, self.public_pem, 0o644)):
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
        return path, pub

    def sign(self, meta: EntryMeta) -> EntryMeta:
        """``meta`` with this key's signature."""
        value = base64.b64encode(self._key.sign(signed_bytes(meta))).decode()
        return meta.model_copy(update={"signature": EntrySignature(key_id=self.key_id, value=value)})


class TrustedKeys:
    """The public keys whose signatures this process accepts."""

    def __init__(self, keys: dict[str, object]) -> None:
        self._keys = keys

    @classmethod
    def from_paths(cls, paths: Iterable[Path]) -> TrustedKeys:
        """PEM public key files, or folders whose ``*.pub`` files are read."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_public_key

        keys: dict[str, object] = {}
        for path in paths:
            path = Path(path)
            files = sorted(path.glob("*.pub")) if path.is_dir() else [path]
            if not files:
                raise SigningError(f"trusted key folder {path} holds no *.pub file")
            for file in files:
                try:
                    key = load_pem_public_key(_read(file, "trusted key"))
                except (ValueError, TypeError) as exc:
                    raise SigningError(f"{file} is not a PEM public key: {exc}") from None
                if not isinstance(key, Ed25519PublicKey):
                    raise SigningError(f"{file} is a {type(key).__name__}, not an Ed25519 public key")
                keys[_key_id(key.public_bytes(Encoding.Raw, PublicFormat.Raw))] = key
        return cls(keys)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def reason(self, meta: EntryMeta) -> str | None:
        """Why ``meta`` is not trusted here, or None when its signature verifies."""
        from cryptography.exceptions import InvalidSignature

        where = f"{meta.fingerprint}/{meta.arch}/{meta.spec_id}"
        sig = meta.signature
        if sig is None:
            return f"{where} is not signed, and DSA_AOT_TRUSTED_KEYS requires a signature"
        key = self._keys.get(sig.key_id)
        if key is None:
            return (f"{where} is signed by key {sig.key_id}, which is not among the trusted keys "
                    f"({', '.join(self.key_ids)})")
        try:
            key.verify(base64.b64decode(sig.value, validate=True), signed_bytes(meta))
        except (InvalidSignature, ValueError):
            return f"{where}: the signature of key {sig.key_id} does not verify (meta.json altered or forged)"
        return None
