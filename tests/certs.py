"""Test certificates made on the spot: a CA, a server certificate and a client certificate."""

from __future__ import annotations

import datetime
from pathlib import Path


def make_certs(d: Path, names: tuple[str, ...] = ("localhost",)) -> dict[str, Path]:
    """A CA, a server certificate for ``names`` and 127.0.0.1, and a client certificate, all signed by the CA."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = key()
    ca = (x509.CertificateBuilder().subject_name(name("specrec-test-ca")).issuer_name(name("specrec-test-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))

    def leaf(cn, server: bool):
        k = key()
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject).public_key(k.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
             .not_valid_after(now + datetime.timedelta(days=1)))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName([*(x509.DNSName(n) for n in names),
                                                             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        return k, b.sign(ca_key, hashes.SHA256())

    out = {}

    def write(stem, k, cert):
        out[f"{stem}.key"] = d / f"{stem}.key"
        out[f"{stem}.crt"] = d / f"{stem}.crt"
        if k is not None:
            out[f"{stem}.key"].write_bytes(
                k.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
        out[f"{stem}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    write("ca", None, ca)
    write("server", *leaf("localhost", True))
    write("client", *leaf("specrec-client", False))
    return out
