"""The secret filter: provider formats, unquoted `KEY=VALUE`, placeholders and code that only
look like secrets, its recall on the labelled corpus, and the files never read by default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from indexkit import write

from codeplane.indexing.scan import scan
from codeplane.indexing.secretscan import find_secret

CORPUS = Path(__file__).parents[1] / "bench" / "secrets" / "corpus.jsonl"
# Synthetic values, assembled so no scanner reading this file sees a whole one.
FORMATS = {
    "OpenAI API Key": "OPENAI_API_KEY=sk-proj-" + "Ab3dE5fG7h" * 8,
    "Anthropic API Key": "key = 'sk-ant-api03-" + "Zx9_Yw8-Vu7t" * 8 + "AA'",
    "Google API Key": "const maps = \"AIza" + "SyB4c5D6e7F8g9H0i1J2k3L4m5N6o7P8q9R" + "\";",
    "GitHub Token": "token: ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8",
    "AWS Access Key": "aws_access_key_id = AKIA" + "QYLPMN5HHHFPZAM2",
    "Slack Token": "SLACK=xoxb-" + "2039485761-1029384756102-aB3dE5fG7h9JkL1mN3pQ5rS7",
    "Stripe Key": "stripe.api_key = 'sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc'",
    "JSON Web Token": "auth = 'eyJhbGciOiJIUzI1NiJ9." + "eyJzdWIiOiIxMjM0NTY3ODkwIn0."
                      + "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U'",
    "Private Key": "-----BEGIN ENCRYPTED " + "PRIVATE KEY-----\nMIIFHDBOBgkqhkiG9w0BBQ0w\n",
    "Secret Assignment": "API_TOKEN=" + "q8Zr2LkP0vXw7NmB4cTy6HsJ",
}
UNQUOTED = ["password: " + "Tr0ub4dor&3xQ", "export DB_PASSWORD=" + "maple.Tiger42",
            "db.password=" + "s3cr3t-Ocean-88", "clientSecret: '" + "9fK2-xLq7_Vb3Nz0" + "'"]
HARMLESS = ["API_KEY=changeme", "password: <your-password>", "TOKEN=${GITHUB_TOKEN}",
            "AWS_ACCESS_KEY_ID=AKIA" + "IOSFODNN7EXAMPLE", "GITHUB_TOKEN=ghp_" + "x" * 36,
            "password = os.environ['DB_PASSWORD']", "secret_key = settings.SECRET_KEY",
            "api_key: str | None = None", "max_tokens = 4096", "token = b64(self.key(name))",
            'sha256 = "68807e3ff2abb83cdd708d8243fd398246e397bfee2ba611c2bad728e27df743"',
            'request_id = "550e8400-e29b-41d4-a716-446655440000"',
            "SECRET_KEY = 'AWS_SECRET_ACCESS_KEY'",
            'ClientRequestToken: "1d2129a1-3d38-460a-9756-e5b91fddb951"',
            'headers = {"Authorization": "Bearer test-token"}']


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_each_provider_format_is_caught(kind: str) -> None:
    assert find_secret(f"import os\n\n{FORMATS[kind]}\n") is not None


@pytest.mark.parametrize("line", UNQUOTED)
def test_unquoted_and_config_style_assignments_are_caught(line: str) -> None:
    assert find_secret(line + "\n") == "Secret Assignment"


@pytest.mark.parametrize("line", HARMLESS)
def test_placeholders_and_code_are_not_secrets(line: str) -> None:
    assert find_secret(line + "\n") is None


def test_recall_and_false_positives_on_the_labelled_corpus() -> None:
    """The bench corpus (bench/secrets/run.py prints the full table): recall >= 0.98 on every
    split, no more than 2% of look-alikes flagged."""
    rows = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    assert sum(r["label"] for r in rows) >= 200 and sum(not r["label"] for r in rows) >= 200
    assert len({r["kind"] for r in rows if r["label"]}) >= 10
    for split in ("tune", "holdout"):
        part = [r for r in rows if r["split"] == split]
        flags = [find_secret(r["text"]) is not None for r in part]
        secrets = [f for r, f in zip(part, flags) if r["label"]]
        decoys = [f for r, f in zip(part, flags) if not r["label"]]
        assert sum(secrets) / len(secrets) >= 0.98, split
        assert sum(decoys) / len(decoys) <= 0.02, split


def test_secret_files_are_never_read_by_default(tmp_path: Path) -> None:
    names = [".env", ".env.production", "certs/server.pem", "certs/tls.key", "id_rsa",
             "keys/id_ed25519.pub", "store.p12", "store.pfx", ".aws/credentials", ".netrc",
             "infra/terraform.tfstate", "deploy/prod.tfvars", ".npmrc", "app.py"]
    write(tmp_path, {name: "x = 1\n" for name in names})
    assert sorted(scan(tmp_path).files) == ["app.py"]
    write(tmp_path, {".gitignore": "!.env.example\n", ".env.example": "API_KEY=changeme\n"})
    assert ".env.example" in scan(tmp_path).files


@pytest.mark.parametrize("offset", [0, 3580, 4090, 7160, 50_000])
def test_a_secret_inside_a_long_minified_line_is_found(offset: int) -> None:
    """Long lines are scanned in overlapping windows (bounded regex work); a key straddling a
    window edge must still be whole in one of them."""
    line = "var a=1;" * 12_500
    key = FORMATS["GitHub Token"].split(" ")[1]
    assert find_secret(line[:offset] + f'var t="{key}";' + line[offset:]) == "GitHub Token"
