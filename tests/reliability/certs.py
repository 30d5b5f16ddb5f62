"""Certificates a test makes with the openssl command line: a CA and a certificate it signs
for 127.0.0.1 / localhost, good for servers and clients (mutual TLS)."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pki:
    ca: str
    cert: str
    key: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(folder: Path, name: str = "easerve-test") -> Pki:
    """A fresh CA under `folder` and a leaf certificate it signs (SAN 127.0.0.1, localhost)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: the TLS tests make their certificates with it")
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name} CA",
             "-keyout", "ca.key", "-out", "ca.pem", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", "leaf.key",
             "-out", "leaf.csr", cwd=folder)
    (folder / "leaf.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                     "extendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "leaf.ext", "-out", "leaf.pem", cwd=folder)
    return Pki(str(folder / "ca.pem"), str(folder / "leaf.pem"), str(folder / "leaf.key"))
