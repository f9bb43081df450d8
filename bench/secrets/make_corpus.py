"""Write the labelled secret-filter corpus (`corpus.jsonl`): synthetic secrets in realistic lines
and look-alikes that are not secrets.

Every secret value is random (seeded) and fake; formats follow the providers' published shapes.
Each sample is one small file: {"file", "text", "label" (1 secret / 0 look-alike), "kind",
"split"}. The split is by *context template*: templates marked holdout (a third of them, in
other languages and file types) were written with the rest but never looked at while the filter
was tuned, so the holdout measures new surroundings with new random values.

    python bench/secrets/make_corpus.py   # rewrites bench/secrets/corpus.jsonl
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import string
import uuid
from pathlib import Path

OUT = Path(__file__).with_name("corpus.jsonl")
ALNUM = string.ascii_letters + string.digits
URLSAFE = ALNUM + "-_"
B64 = ALNUM + "+/"
R = random.Random(1313)


def rand(alphabet: str, n: int) -> str:
    return "".join(R.choice(alphabet) for _ in range(n))


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt() -> str:
    header = b64url(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    claims = {"sub": str(R.randint(1000, 99999)), "name": R.choice(["Ana", "Bo", "Chen"]),
              "iat": R.randint(1_600_000_000, 1_800_000_000)}
    return f"{header}.{b64url(json.dumps(claims).encode())}.{b64url(R.randbytes(32))}"


def pem() -> str:
    kind = R.choice(["RSA ", "EC ", "OPENSSH ", "", "ENCRYPTED "])
    body = base64.b64encode(R.randbytes(R.choice([120, 240, 600]))).decode()
    lines = [body[i:i + 64] for i in range(0, len(body), 64)]
    return f"-----BEGIN {kind}PRIVATE KEY-----\n" + "\n".join(lines) + \
        f"\n-----END {kind}PRIVATE KEY-----"


def password() -> str:
    words = ["Summer", "dragon", "Falcon", "purple", "Orbit", "maple", "Tiger", "ocean"]
    return R.choice([
        lambda: R.choice(words) + str(R.randint(10, 9999)) + R.choice("!@#$%&*"),
        lambda: rand(ALNUM + "!@#%^&*", R.randint(12, 24)),
        lambda: R.choice(words).lower() + R.choice(["-", "_", "."]) + R.choice(words) +
        str(R.randint(1, 99)),
    ])()


# format -> (value generator, variable name, kind of value for templates)
SECRETS = {
    "aws_access_key": (lambda: "AKIA" + rand(string.ascii_uppercase + "234567", 16),
                       "AWS_ACCESS_KEY_ID"),
    "aws_secret_key": (lambda: rand(B64, 40), "AWS_SECRET_ACCESS_KEY"),
    "openai_project": (lambda: "sk-proj-" + rand(URLSAFE, 74) + "T3BlbkFJ" + rand(URLSAFE, 74),
                       "OPENAI_API_KEY"),
    "openai_plain": (lambda: "sk-proj-" + rand(URLSAFE, 156), "OPENAI_API_KEY"),
    "anthropic": (lambda: "sk-ant-api03-" + rand(URLSAFE, 93) + "AA", "ANTHROPIC_API_KEY"),
    "google_api": (lambda: "AIza" + rand(URLSAFE, 35), "GOOGLE_API_KEY"),
    "github_classic": (lambda: R.choice(["ghp_", "gho_", "ghs_"]) + rand(ALNUM, 36),
                       "GITHUB_TOKEN"),
    "github_fine": (lambda: "github_pat_" + rand(ALNUM, 22) + "_" + rand(ALNUM, 59), "GH_PAT"),
    "slack": (lambda: R.choice(["xoxb-", "xoxp-"]) + f"{R.randint(10**10, 10**11)}-"
              f"{R.randint(10**12, 10**13)}-" + rand(ALNUM, 24), "SLACK_BOT_TOKEN"),
    "stripe": (lambda: R.choice(["sk_live_", "rk_live_"]) + rand(ALNUM, 24 + R.randint(0, 75)),
               "STRIPE_SECRET_KEY"),
    "jwt": (jwt, "AUTH_TOKEN"),
    "gitlab": (lambda: "glpat-" + rand(URLSAFE, 20), "GITLAB_TOKEN"),
    "huggingface": (lambda: "hf_" + rand(ALNUM, 34), "HF_TOKEN"),
    "npm": (lambda: "npm_" + rand(ALNUM, 36), "NPM_TOKEN"),
    "sendgrid": (lambda: "SG." + rand(URLSAFE, 22) + "." + rand(URLSAFE, 43), "SENDGRID_API_KEY"),
    "generic_token": (lambda: rand(ALNUM, R.choice([24, 32, 40])), "API_TOKEN"),
    "password": (password, "DB_PASSWORD"),
    "django_secret": (lambda: rand(ALNUM + "!@#$%^&*(-_=+)", 50), "SECRET_KEY"),
}

# (file name, template, holdout?) - {name} is the variable, {value} the secret.
CONTEXTS = [
    (".env", "{name}={value}\n", False),
    ("settings.py", "import os\n\n{name} = \"{value}\"\nDEBUG = False\n", False),
    ("config.yaml", "service:\n  region: eu-west-1\n  {lname}: {value}\n", False),
    ("deploy.sh", "#!/bin/sh\nexport {name}={value}\n./run --prod\n", False),
    ("app.json", "{{\n  \"name\": \"billing\",\n  \"{lname}\": \"{value}\"\n}}\n", False),
    ("client.py", "client = Client(\n    {lname}=\"{value}\",\n    timeout=30,\n)\n", False),
    ("docker-compose.yml", "services:\n  api:\n    environment:\n      - {name}={value}\n",
     False),
    ("notes.md", "Use this for staging:\n\n    {name}: {value}\n", False),
    ("main.go", "package main\n\nconst {camel} = \"{value}\"\n", True),
    ("index.js", "const config = {{\n  {camel}: '{value}',\n  retries: 3,\n}};\n", True),
    ("main.tf", "provider \"x\" {{\n  {lname} = \"{value}\"\n}}\n", True),
    ("application.properties", "server.port=8080\n{dotted}={value}\n", True),
    ("call.sh", "curl -H \"Authorization: Bearer {value}\" https://api.example.com/v1\n", True),
    ("Config.java", "class Config {{\n  static final String {name} = \"{value}\";\n}}\n", True),
]

LOOKALIKES = {
    "sha256": lambda: (R.choice(["checksums.txt", "verify.py", "Cargo.toml"]),
                       R.choice(["sha256 = \"{h}\"\n", "EXPECTED_SHA256 = \"{h}\"\n",
                                 "{h}  dist/app.tar.gz\n", "checksum: {h}\n"]).format(
                           h=hashlib.sha256(R.randbytes(8)).hexdigest())),
    "git_sha": lambda: ("deps.toml", R.choice(["rev = \"{h}\"\n", "commit: {h}\n",
                                               "# fixed in {h}\n"]).format(
        h=hashlib.sha1(R.randbytes(8)).hexdigest())),
    "md5": lambda: ("cache.py", f"CACHE_KEY = \"{hashlib.md5(R.randbytes(8)).hexdigest()}\"  # md5 of the schema\n"),
    "integrity": lambda: ("package-lock.json", f"\"integrity\": \"sha512-{base64.b64encode(R.randbytes(64)).decode()}\"\n"),
    "uuid": lambda: (R.choice(["models.py", "fixtures.json", "app.yaml"]),
                     R.choice(["request_id = \"{u}\"\n", "\"id\": \"{u}\",\n",
                               "tenant_uuid: {u}\n", "DEFAULT_ORG = UUID(\"{u}\")\n"]).format(
                         u=uuid.UUID(int=R.getrandbits(128)))),
    "base64_blob": lambda: ("assets.py", f"ICON_PNG = \"iVBORw0KGgoAAAANSUhEUgAA{base64.b64encode(R.randbytes(48)).decode()}\"\n"),
    "data_uri": lambda: ("style.css", f".logo {{ background: url(data:image/png;base64,{base64.b64encode(R.randbytes(60)).decode()}); }}\n"
                         ),
    "placeholder": ([".env.example", "README.md", "config.yaml"], [
        "API_KEY=changeme\n", "password: <your-password>\n", "TOKEN=${{GITHUB_TOKEN}}\n",
        "SECRET_KEY=xxxxxxxxxxxxxxxxxxxx\n", "OPENAI_API_KEY=sk-...\n",
        "api_key = \"YOUR_API_KEY_HERE\"\n", "password = \"\"\n", "DB_PASSWORD=\n",
        "export STRIPE_SECRET_KEY=sk_live_your_key_here\n", "client_secret: REPLACE_ME\n",
        "AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE\n", "token: <token>\n",
        "ANTHROPIC_API_KEY=your-anthropic-key\n", "password: ********\n",
        "GITHUB_TOKEN=ghp_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n", "api_key: null\n",
        "SECRET_KEY={{{{ secret_key }}}}\n", "PASSWORD=%(DB_PASSWORD)s\n",
        "api_token = \"<insert token>\"\n", "password: example\n"]),
    "env_read": ("settings.py", [
        "password = os.environ[\"DB_PASSWORD\"]\n", "API_TOKEN = os.getenv(\"API_TOKEN\")\n",
        "secret_key = settings.SECRET_KEY\n", "token = request.headers.get(\"Authorization\")\n",
        "api_key: str | None = None\n", "password = getpass.getpass(\"Password: \")\n",
        "self.api_key = api_key or load_key(path)\n", "token = self._tokens.pop()\n",
        "client_secret=config.client_secret,\n", "password_hash = bcrypt.hash(password)\n",
        "SECRET_KEY = env(\"DJANGO_SECRET_KEY\")\n", "auth_token = await fetch_token(session)\n",
        "api_key = vault.read(\"kv/data/openai\")[\"key\"]\n", "const token = process.env.TOKEN;\n",
        "password: ${{DB_PASSWORD}}\n", "token = f\"{{prefix}}-{{suffix}}\"\n"]),
    "code_words": ("model.py", [
        "max_tokens = 4096\n", "token_type = \"bearer\"\n",
        "TOKEN_URL = \"https://oauth2.googleapis.com/token\"\n", "num_tokens = len(ids)\n",
        "password_min_length = 12\n", "def get_secret(name: str) -> str:\n",
        "SECRET_HEADER = \"X-Signature\"\n", "key = (tenant, workspace)\n",
        "api_key_header = APIKeyHeader(name=\"X-API-Key\")\n", "tokenizer = Tokenizer.from_file(p)\n",
        "private_key = load_pem_private_key(data, password=None)\n",
        "password_field = forms.CharField(widget=forms.PasswordInput)\n",
        "if not token:\n    raise Unauthorized()\n", "SECRET_KEY_LENGTH = 50\n",
        "keyfile = Path.home() / \".ssh\" / \"id_ed25519\"\n", "token_budget = Budget(limit=10_000)\n"]),
    "test_fixture": ("test_auth.py", [
        "assert check_password(\"hunter2\", stored) is False\n",
        "client.login(username=\"alice\", password=\"password\")\n",
        "headers = {\"Authorization\": \"Bearer test-token\"}\n",
        "API_KEY = \"fake-api-key\"\n", "token = \"dummy\"\n",
        "monkeypatch.setenv(\"OPENAI_API_KEY\", \"sk-test\")\n",
        "secret = \"not-a-real-secret\"\n", "password = \"test\"\n",
        "user = User(email=\"a@b.c\", password=\"secret\")\n", "API_TOKEN = \"test_token\"\n"]),
    "identifier": ("views.py", [
        "handler = AbstractSingletonProxyFactoryBeanResolver()\n",
        "ROUTE = \"/api/v2/organizations/{{org_id}}/repositories/{{repo_id}}/pulls\"\n",
        "i18n_key = \"checkout.payment.errors.card_declined_insufficient_funds\"\n",
        "PATTERN = r\"^[A-Za-z0-9_\\-]{{1,128}}$\"\n", "VERSION = \"2024.11.3-rc2+build.4471\"\n",
        "COLORS = [\"#1f77b4\", \"#ff7f0e\", \"#2ca02c\", \"#d62728\"]\n",
        "log.info(\"rotated %d keys for tenant %s\", count, tenant)\n"]),
    "random_seed": lambda: ("train.py", "SEED = {n}\nshuffle_key = \"{h}\"\n".format(
        n=R.randint(0, 2**31), h=rand("abcdef0123456789", 16))),
}


def secret_samples() -> list[dict]:
    out = []
    for kind, (make, name) in SECRETS.items():
        for i in range(15):
            file, template, holdout = CONTEXTS[(i + len(kind)) % len(CONTEXTS)]
            value = make()
            if kind == "openai_plain" and "T3BlbkFJ" in value:
                value = value.replace("T3BlbkFJ", "x3BlbkFJ")
            camel = "".join(p.title() for p in name.lower().split("_"))
            text = template.format(name=name, lname=name.lower(), camel=camel[0].lower() +
                                   camel[1:], dotted=name.lower().replace("_", "."),
                                   value=value)
            out.append({"file": file, "text": text, "label": 1, "kind": kind,
                        "split": "holdout" if holdout else "tune"})
    for i in range(20):  # PEM keys are multi-line: their own contexts
        key = pem()
        holdout = i % 3 == 2
        text = R.choice([f'DEPLOY_KEY = """{key}"""\n', "ssh_key: |\n  " +
                         key.replace("\n", "\n  ") + "\n"]) if not holdout else \
            f"const key = `{key}`;\nmodule.exports = key;\n"
        out.append({"file": "keys.py" if not holdout else "keys.js", "text": text, "label": 1,
                    "kind": "pem", "split": "holdout" if holdout else "tune"})
    for i in range(15):  # passwords inside connection strings
        holdout = i % 3 == 2
        url = (f"postgres://app:{password()}@db.internal:5432/prod" if not holdout else
               f"mongodb+srv://svc:{rand(ALNUM, 16)}@cluster0.example.net/app")
        out.append({"file": "db.py", "text": f'DATABASE_URL = "{url}"\n', "label": 1,
                    "kind": "connection_string", "split": "holdout" if holdout else "tune"})
    return out


def lookalike_samples() -> list[dict]:
    """Random look-alikes 20 times each; fixed lists (placeholders, code) once per item, with
    the file name drawn per item."""
    out = []
    for kind, make in LOOKALIKES.items():
        if callable(make):
            pairs = [make() for _ in range(20)]
        else:
            files, texts = make
            pairs = [(R.choice(files) if isinstance(files, list) else files,
                      text.replace("{{", "{").replace("}}", "}")) for text in texts]
        for i, (file, text) in enumerate(pairs):
            out.append({"file": file, "text": text, "label": 0, "kind": kind,
                        "split": "holdout" if i % 3 == 2 else "tune"})
    return out


def main() -> None:
    rows = secret_samples() + lookalike_samples()
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    secrets = [r for r in rows if r["label"]]
    print(f"{OUT}: {len(secrets)} secrets in {len({r['kind'] for r in secrets})} formats, "
          f"{len(rows) - len(secrets)} look-alikes; "
          f"{sum(r['split'] == 'holdout' for r in rows)} held out")


if __name__ == "__main__":
    main()
