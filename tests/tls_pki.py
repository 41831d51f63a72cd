"""Certificates for the TLS tests, made on the spot: a CA from trustme, server certificates
from trustme, and client certificates with an exact subject and validity (cryptography: a
trustme leaf always carries its own O and OU)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

PAST = (dt.datetime(2020, 1, 1, tzinfo=dt.UTC), dt.datetime(2021, 1, 1, tzinfo=dt.UTC))


@dataclass(frozen=True)
class Pair:
    """A certificate and its private key, as PEM files."""

    cert: str
    key: str


class Pki:
    """One CA; its PEM file is `ca_path`."""

    def __init__(self, directory: Path, name: str = "ca"):
        self.dir = directory
        self.name = name
        self.ca = trustme.CA()
        self.ca_path = str(directory / f"{name}.pem")
        self.ca.cert_pem.write_to_path(self.ca_path)
        self._ca_cert = x509.load_pem_x509_certificate(self.ca.cert_pem.bytes())
        self._ca_key = serialization.load_pem_private_key(self.ca.private_key_pem.bytes(), password=None)

    def server(self, *hosts: str, name: str = "server", expired: bool = False) -> Pair:
        before, after = PAST if expired else (None, None)
        leaf = self.ca.issue_cert(*(hosts or ("127.0.0.1", "localhost")), not_before=before, not_after=after)
        pair = Pair(str(self.dir / f"{self.name}-{name}.crt"), str(self.dir / f"{self.name}-{name}.key"))
        leaf.cert_chain_pems[0].write_to_path(pair.cert)
        leaf.private_key_pem.write_to_path(pair.key)
        return pair

    def client(self, subject: str, name: str, expired: bool = False) -> Pair:
        """A client certificate whose subject is exactly `subject` (an RFC 4514 string)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        before, after = PAST if expired else (now - dt.timedelta(hours=1), now + dt.timedelta(days=1))
        ca_ski = self._ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name.from_rfc4514_string(subject))
            .issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(before)
            .not_valid_after(after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(self._ca_key, hashes.SHA256())
        )
        pair = Pair(str(self.dir / f"{self.name}-{name}.crt"), str(self.dir / f"{self.name}-{name}.key"))
        Path(pair.cert).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        Path(pair.key).write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return pair
