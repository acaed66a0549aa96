"""The test control plane's key material: a CA, the apiserver's serving certificate, the
service-account signing key, and the static tokens of the users the tests act as.

Everything is made fresh per test session with `cryptography` (no openssl CLI needed) and written
under one private directory; nothing outside it is trusted or touched.
"""
from __future__ import annotations

import datetime
import ipaddress
import pathlib
import secrets
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

VALID_FOR = datetime.timedelta(days=2)


@dataclass(frozen=True)
class Pki:
    """Paths of the files the control plane's processes are started with."""

    ca_cert: pathlib.Path
    ca_key: pathlib.Path
    serving_cert: pathlib.Path
    serving_key: pathlib.Path
    sa_key: pathlib.Path          # signs service-account tokens (apiserver, controller-manager)
    sa_pub: pathlib.Path          # verifies them (apiserver)
    token_file: pathlib.Path      # --token-auth-file
    admin_token: str              # user "admin", group system:masters


def _write_key(path: pathlib.Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, public_key, issuer: x509.Name, signer, *, ca: bool,
                 sans: list[x509.GeneralName] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID_FOR)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def make_pki(directory: pathlib.Path) -> Pki:
    """Writes a fresh CA, a serving certificate for 127.0.0.1/localhost, the service-account key
    pair and a token file with one cluster-admin user."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate("deepseek-pd-test-ca", ca_key.public_key(), _name("deepseek-pd-test-ca"),
                           ca_key, ca=True)
    serving_key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName("localhost"), x509.DNSName("kubernetes.default.svc"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    serving_cert = _certificate("kube-apiserver", serving_key.public_key(), ca_cert.subject, ca_key,
                                ca=False, sans=sans)
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    pki = Pki(ca_cert=directory / "ca.crt", ca_key=directory / "ca.key",
              serving_cert=directory / "apiserver.crt", serving_key=directory / "apiserver.key",
              sa_key=directory / "sa.key", sa_pub=directory / "sa.pub",
              token_file=directory / "tokens.csv", admin_token=secrets.token_hex(24))
    pki.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.ca_key, ca_key)
    pki.serving_cert.write_bytes(serving_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.serving_key, serving_key)
    _write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    # token,user,uid,"groups": the admin is the only static user; everyone else gets a
    # service-account token from the TokenRequest API (what a pod would mount).
    pki.token_file.write_text(f'{pki.admin_token},admin,admin-uid,"system:masters"\n')
    pki.token_file.chmod(0o600)
    return pki
