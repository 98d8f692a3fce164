"""The agent's client runs where Django cannot even be imported: a subprocess whose
import system refuses ``django`` imports ``workflow_delivery.client``, makes a signed
request to a stdlib HTTP server, and the server's checks accept the signature."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from workflow_delivery.api import nip98

ROOT = Path(__file__).resolve().parents[2]

# The client's whole world: the package, its values and their wire form, its keys.
ALLOWED = {
    "workflow_delivery",
    "workflow_delivery.client",
    "workflow_delivery.exceptions",
    "workflow_delivery.keys",
    "workflow_delivery.protocol",
    "workflow_delivery.wire",
}

SCRIPT = """
import json, sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer

class NoDjango:
    def find_spec(self, name, path=None, target=None):
        if name == "django" or name.startswith("django."):
            raise ImportError(f"{name} is not importable in this test")

sys.meta_path.insert(0, NoDjango())
try:
    import django
except ImportError:
    pass
else:
    raise SystemExit("django was importable")

from workflow_delivery.client import AgentClient

seen = {}

class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        seen["authorization"] = self.headers["Authorization"]
        seen["body"] = self.rfile.read(int(self.headers["Content-Length"])).decode()
        seen["path"] = self.path
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass

server = HTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
port = server.server_address[1]
with AgentClient(f"http://alpha.example:{port}/agents/", "00" * 31 + "01",
                 connect_to=("127.0.0.1", port)) as client:
    assert client.claim(lease_seconds=30) is None
server.shutdown()
seen["port"] = port
seen["pubkey"] = client.pubkey.hex()
seen["modules"] = sorted(m for m in sys.modules if m.startswith("workflow_delivery"))
seen["django"] = sorted(m for m in sys.modules if m == "django" or m.startswith("django."))
print(json.dumps(seen))
"""


def test_the_client_imports_and_signs_without_django():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["django"] == []
    assert set(seen["modules"]) <= ALLOWED, set(seen["modules"]) - ALLOWED
    assert seen["pubkey"] == "79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798"
    # What it sent is a request the server's own checks accept.
    event = nip98.parse_authorization(seen["authorization"])
    url = f"http://alpha.example:{seen['port']}{seen['path']}"
    nip98.check_request(event, url=url, method="POST", body=seen["body"].encode())
    assert nip98.verify_event(event).hex() == seen["pubkey"]
    assert json.loads(seen["body"]) == {"lease_seconds": 30}
