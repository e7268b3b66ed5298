"""mTLS for peer links: a small cluster CA, per-service certificates, gRPC credentials.

Every service (core, gateway, each expert worker) gets one key pair signed by the
cluster's CA, valid both as a server and as a client (core serves the gateway and
calls the workers). Servers require a client certificate from the same CA, so a peer
without one, or with one from another CA, fails the handshake before any RPC runs.

Files in the TLS folder: `ca.pem` (+ `ca-key.pem`, needed only to issue more
certificates: keep it off the serving hosts), `<name>.pem` and `<name>-key.pem`.
Certificates name every host the service is reached by (IP or DNS SANs) plus
localhost, so hostname verification stays on.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

CA_DAYS = 3650
LEAF_DAYS = 825


class TlsError(ValueError):
    """A TLS file is missing or unreadable: the message names it."""


@dataclass(frozen=True)
class TlsFiles:
    """The CA certificate plus this service's certificate chain and private key (PEM paths)."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: Path, name: str) -> TlsFiles:
        directory = Path(directory)
        return cls(directory / "ca.pem", directory / f"{name}.pem", directory / f"{name}-key.pem")

    def read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for path in (self.ca, self.cert, self.key):
            try:
                out.append(Path(path).read_bytes())
            except OSError as error:
                raise TlsError(
                    f"TLS file {path} is unreadable ({error.strerror}); make it with `moe-mesh certs`"
                ) from None
        return out[0], out[1], out[2]


def reloadable_server_credentials(files: TlsFiles):
    """(credentials, reload): server mTLS whose certificate `reload()` re-reads from the files;
    handshakes from then on use it, connections already open keep theirs (no stream drops).
    reload() raises TlsError, keeping the current certificate, when the files are unreadable or
    the key does not match the certificate (caught mid-rotation)."""
    pending: list = []

    def configuration():
        ca, cert, key = files.read()
        _check_pair(files, cert, key)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch():  # gRPC calls this before each new handshake; None keeps the current one
        return pending.pop() if pending else None

    def reload() -> None:
        config = configuration()
        pending[:] = [config]

    credentials = grpc.dynamic_ssl_server_credentials(
        configuration(), fetch, require_client_authentication=True
    )
    return credentials, reload


def _check_pair(files: TlsFiles, cert_pem: bytes, key_pem: bytes) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as error:
        raise TlsError(f"{files.cert} or {files.key} is not a PEM certificate / key: {error}") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(serialization.Encoding.DER, public) != key.public_key().public_bytes(
        serialization.Encoding.DER, public
    ):
        raise TlsError(f"{files.key} is not the key of {files.cert}")


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client side of mTLS: verify the server against our CA and present our certificate."""
    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


# ---- issuing (moe-mesh certs) ---------------------------------------------------------------


def ensure_ca(directory: Path, common_name: str = "moe-mesh cluster CA"):
    """Load the CA in `directory`, or create it. Returns (certificate, private key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "ca.pem", directory / "ca-key.pem"
    if cert_path.exists() and key_path.exists():
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        return cert, key
    if cert_path.exists() or key_path.exists():
        # A new CA would silently invalidate every certificate the cluster already holds.
        present, missing = (cert_path, key_path) if cert_path.exists() else (key_path, cert_path)
        raise TlsError(
            f"{present} exists but {missing.name} does not: certificates are signed with the CA's key; "
            f"put {missing.name} back into {directory} (or pass --out pointing at the folder holding both)"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(key_path, _key_pem(key))
    _replace(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def issue_certificate(directory: Path, name: str, hosts: list[str]) -> TlsFiles:
    """Sign a server+client certificate for service `name`, valid for `hosts` and localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert, ca_key = ensure_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*hosts, "localhost", "127.0.0.1", "::1"]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles.in_dir(directory, name)
    # each file replaced whole: a service reloading meanwhile reads the old pair or the new one
    _write_private(files.key, _key_pem(key))
    _replace(files.cert, cert.public_bytes(serialization.Encoding.PEM))
    return files


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write_private(path: Path, data: bytes) -> None:
    """Private keys are created 0600, never world-readable even for an instant."""
    _replace(path, data, mode=0o600)


def _replace(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` beside `path`, then rename it over `path` in one step."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.unlink(missing_ok=True)
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(staging, path)
