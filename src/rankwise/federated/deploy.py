"""Helpers for a real Flower deployment on one machine (loopback): TLS material, SuperNode
keys, the Flower app folder and the ``flwr`` connection config. The recipe that uses them is
in ``docs/federated.md``; ``tests/federated/test_deploy.py`` runs it.

Certificates are generated with the ``cryptography`` package (a Flower dependency): a private
CA, and a server certificate for ``127.0.0.1``/``localhost`` signed by it.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from rankwise.federated import keys


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


def make_tls(folder: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 7) -> dict[str, Path]:
    """Create ``ca.crt``, ``server.pem`` and ``server.key`` in ``folder``.

    Args:
        folder: Where to write (created).
        hosts: Subject alternative names of the server certificate (IPs or DNS names).
        days: Validity.

    Returns:
        ``{"ca": ..., "cert": ..., "key": ...}`` paths.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rankwise test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP384R1())
    sans = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return {
        "ca": _write(folder / "ca.crt", ca.public_bytes(pem)),
        "cert": _write(folder / "server.pem", cert.public_bytes(pem)),
        "key": _write(folder / "server.key", key.private_bytes(
            pem, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()), private=True),
    }


def make_node_keys(folder: Path, name: str) -> dict[str, Path]:
    """Create a SuperNode's EC (NIST P-384) key pair in OpenSSH format.

    Returns:
        ``{"private": <name>, "public": <name>.pub}`` paths.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return {"private": _write(folder / name, private, private=True),
            "public": _write(folder / f"{name}.pub", public + b"\n")}


def write_app(folder: Path, config_path: Path, out: Path) -> Path:
    """Write a Flower app folder (``pyproject.toml``) whose apps are rankwise's.

    The ServerApp and ClientApp are imported from the installed ``rankwise`` package; the run
    config and run folder are passed as ``[tool.flwr.app.config]`` values.

    Returns:
        The app folder.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "rankwise-federated"
version = "0.1.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "rankwise"

[tool.flwr.app.components]
serverapp = "rankwise.federated.server_app:app"
clientapp = "rankwise.federated.client_app:app"

[tool.flwr.app.config]
{keys.RUN_CONFIG_FILE} = "{Path(config_path).resolve()}"
{keys.RUN_OUT} = "{Path(out).resolve()}"
""")
    return folder


def write_connection(flwr_home: Path, name: str, address: str, ca: Path) -> Path:
    """Write ``$FLWR_HOME/config.toml`` with one TLS SuperLink connection, the default.

    Returns:
        The config file.
    """
    home = Path(flwr_home)
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.toml"
    path.write_text(f"""[superlink]
default = "{name}"

[superlink.{name}]
address = "{address}"
root-certificates = "{Path(ca).resolve()}"
""")
    return path
