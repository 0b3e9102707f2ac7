"""Throwaway X.509 material for TLS tests, made with the `openssl` command line.

EC P-256 keys keep generation fast. Everything is valid for one day and lives in the
directory the caller passes (a pytest tmp dir).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"


@dataclass(frozen=True)
class Pair:
    """A certificate and its private key, both PEM files."""

    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes]:
        """(private key, certificate chain) bytes, as grpc's credential calls take them."""
        return self.key.read_bytes(), self.cert.read_bytes()


def _openssl(*args: str | Path, cwd: Path) -> None:
    result = subprocess.run(
        [OPENSSL, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(map(str, args))} failed:\n{result.stderr}")


def make_ca(directory: Path, name: str) -> Pair:
    """A self-signed CA certificate allowed to sign others."""
    pair = Pair(directory / f"{name}.pem", directory / f"{name}.key")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        pair.key,
        "-out",
        pair.cert,
        "-days",
        "1",
        "-subj",
        f"/CN=prefixcache test {name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )
    return pair


def make_leaf(directory: Path, name: str, ca: Pair, *, server: bool) -> Pair:
    """A certificate signed by ``ca``: for a server (SAN localhost, 127.0.0.1) or a client."""
    pair = Pair(directory / f"{name}.pem", directory / f"{name}.key")
    csr = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    lines = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
    ]
    if server:
        lines += ["extendedKeyUsage=serverAuth", "subjectAltName=DNS:localhost,IP:127.0.0.1"]
    else:
        lines += ["extendedKeyUsage=clientAuth"]
    ext.write_text("\n".join(lines) + "\n")
    _openssl(
        "req",
        "-new",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        pair.key,
        "-out",
        csr,
        "-subj",
        f"/CN={name}",
        cwd=directory,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca.cert,
        "-CAkey",
        ca.key,
        "-CAcreateserial",
        "-out",
        pair.cert,
        "-days",
        "1",
        "-sha256",
        "-extfile",
        ext,
        cwd=directory,
    )
    return pair


@dataclass(frozen=True)
class PKI:
    """A CA with a server and a client certificate, plus an unrelated CA and client."""

    ca: Pair
    server: Pair
    client: Pair
    other_ca: Pair
    other_client: Pair


def make_pki(directory: Path) -> PKI:
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory, "ca")
    other_ca = make_ca(directory, "other-ca")
    return PKI(
        ca=ca,
        server=make_leaf(directory, "server", ca, server=True),
        client=make_leaf(directory, "client", ca, server=False),
        other_ca=other_ca,
        other_client=make_leaf(directory, "other-client", other_ca, server=False),
    )
