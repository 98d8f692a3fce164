"""An agent's keys: known vectors, the signed request the server accepts, the
``agent_keys`` command, and a clear error without coincurve."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from workflow_delivery import keys
from workflow_delivery.api import nip98
from workflow_delivery.exceptions import ProtocolError

ROOT = Path(__file__).resolve().parents[2]
# secp256k1's generator G: the public key of the secret 1 (its x coordinate).
G_X = "79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798"
# BIP-340 test vector 0: secret 3, message and auxiliary randomness all zero.
VECTOR_PUBLIC = "f9308a019258c31049344f85f89d5229b531c845836f99b08601f113bce036f9"
VECTOR_SIGNATURE = bytes.fromhex(
    "e907831f80848d1069a5371b402410364bdf1c5f8307b0084c55f1ce2dca8215"
    "25f66a4a85ea8b71e482a74f382d2ce5ebeee8fdb2172f477df4900d310536c0"
)
ONE = "00" * 31 + "01"


def test_the_public_key_of_secret_one_is_the_generator_x():
    assert keys.public_key(ONE) == G_X
    assert keys.public_key(bytes.fromhex(ONE)) == G_X
    assert keys.public_key(ONE.upper()) == G_X
    assert keys.public_key_bytes(ONE) == bytes.fromhex(G_X)


def test_bip340_vector_zero():
    assert keys.public_key((3).to_bytes(32, "big")) == VECTOR_PUBLIC
    public = bytes.fromhex(VECTOR_PUBLIC)
    assert keys.verify_signature(public, bytes(32), VECTOR_SIGNATURE)
    assert not keys.verify_signature(public, b"\x01" * 32, VECTOR_SIGNATURE)
    # A key that is not on the curve is a refusal, not an exception.
    assert not keys.verify_signature(b"\xff" * 32, bytes(32), VECTOR_SIGNATURE)


def test_a_new_key_pair_signs_what_its_public_key_verifies():
    secret, public = keys.new_key_pair()
    assert len(secret) == 64 and keys.public_key(secret) == public
    assert keys.new_key_pair()[0] != secret
    digest = keys.event_id(bytes.fromhex(public), 1700000000, 1, [["t", "x"]], "hi")
    assert keys.verify_signature(bytes.fromhex(public), digest, keys.sign(secret, digest))


def test_a_signed_request_is_one_the_server_accepts():
    secret, public = keys.new_key_pair()
    url = "http://alpha.example/agents/v1/claim"
    header = keys.sign_request(secret, url=url, method="POST", body=b"{}", host="alpha.example")
    event = nip98.parse_authorization(header)
    nip98.check_request(event, url=url, method="POST", body=b"{}")
    nip98.check_host(event, "alpha.example", required=True)
    assert nip98.verify_event(event) == bytes.fromhex(public)
    # The server's checks run on the functions of keys, not copies of them.
    assert nip98.event_id is keys.event_id and nip98.sign_request is keys.sign_request
    document = json.loads(base64.b64decode(header.split(" ", 1)[1]))
    assert document["kind"] == keys.HTTP_AUTH_KIND


def test_a_signing_key_derives_the_same_key_and_signs_what_the_server_accepts():
    signer = keys.SigningKey(ONE)
    assert signer.pubkey == bytes.fromhex(G_X)
    assert keys.SigningKey((3).to_bytes(32, "big")).pubkey.hex() == VECTOR_PUBLIC
    # Odd-y points too: the x-only key whatever the parity of the full point.
    for _ in range(8):
        secret, public = keys.new_key_pair()
        assert keys.SigningKey(secret).pubkey.hex() == public
    url = "http://alpha.example/agents/v1/claim"
    first = signer.sign_request(url=url, method="POST", body=b"{}", host="alpha.example")
    second = signer.sign_request(url=url, method="POST", body=b"{}", host="alpha.example")
    for header in (first, second):
        event = nip98.parse_authorization(header)
        nip98.check_request(event, url=url, method="POST", body=b"{}")
        nip98.check_host(event, "alpha.example", required=True)
        assert nip98.verify_event(event) == signer.pubkey
    assert nip98.parse_authorization(first).id != nip98.parse_authorization(second).id
    assert ONE not in repr(signer) and G_X in repr(signer)


@pytest.mark.parametrize("bad", ["00" * 32, "ff" * 32, "zz" * 32, b"short"])
def test_a_signing_key_refuses_a_bad_secret_by_name(bad):
    with pytest.raises(ProtocolError, match="secret_key"):
        keys.SigningKey(bad)


@pytest.mark.parametrize("bad", ["", "zz" * 32, "ab" * 31, b"short", 7, None])
def test_a_bad_secret_is_named_and_never_quoted(bad):
    with pytest.raises(ProtocolError, match="secret_key") as caught:
        keys.public_key(bad)
    if isinstance(bad, str) and bad:
        assert bad not in str(caught.value)


@pytest.mark.parametrize("bad", ["00" * 32, "ff" * 32])
def test_a_secret_outside_the_curve_order_is_refused(bad):
    with pytest.raises(ProtocolError, match="not a valid secp256k1 secret key"):
        keys.public_key(bad)


def test_the_command_prints_a_new_key_pair():
    out = io.StringIO()
    call_command("agent_keys", stdout=out)
    lines = dict(line.split(" ", 1) for line in out.getvalue().splitlines())
    assert set(lines) == {"secret", "public"}
    assert keys.public_key(lines["secret"]) == lines["public"]


def test_the_command_derives_the_public_key_of_a_secret_from_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(ONE + "\n"))
    out = io.StringIO()
    call_command("agent_keys", "--public", stdout=out)
    assert out.getvalue().strip() == G_X


def test_the_command_reads_the_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv("AGENT_SECRET", ONE)
    out = io.StringIO()
    call_command("agent_keys", "--public", "--secret-env", "AGENT_SECRET", stdout=out)
    assert out.getvalue().strip() == G_X


def test_the_command_refuses_bad_input_without_echoing_it(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("0123 not a key\n"))
    with pytest.raises(CommandError, match="secret_key") as caught:
        call_command("agent_keys", "--public")
    assert "0123" not in str(caught.value)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    with pytest.raises(CommandError, match="stdin"):
        call_command("agent_keys", "--public")
    monkeypatch.delenv("UNSET_AGENT_SECRET", raising=False)
    with pytest.raises(CommandError, match="UNSET_AGENT_SECRET"):
        call_command("agent_keys", "--public", "--secret-env", "UNSET_AGENT_SECRET")
    with pytest.raises(CommandError, match="--secret-env goes with --public"):
        call_command("agent_keys", "--secret-env", "X")


BLOCK_COINCURVE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "coincurve" or name.startswith("coincurve."):
            raise ImportError("coincurve is blocked for this test")
sys.meta_path.insert(0, Block())
from workflow_delivery import keys
assert keys.event_id(bytes(32), 0, 1, [], "") is not None
try:
    keys.public_key("00" * 31 + "01")
except keys.KeysUnavailable as exc:
    print(exc)
"""


def test_without_coincurve_the_module_imports_and_names_the_extra():
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_COINCURVE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "buzz-workflow-delivery[client]" in result.stdout and "coincurve" in result.stdout
