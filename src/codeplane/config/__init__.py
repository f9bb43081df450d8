"""Settings: `codeplane.toml`, overridden by `CODEPLANE_*` environment variables.

Precedence (highest first): explicit arguments, environment, the TOML file, defaults.
The TOML file is `$CODEPLANE_HOME/codeplane.toml` unless a command names another with
`--config`. Nested groups use `__` in environment names: `CODEPLANE_SERVE__PORT=9000`.

Every section is a typed model, checked when settings load: a bad value or an unknown key fails
then, named with its line (the one table left raw, `[indexing] embedder`, is checked by its row
of `models/embedders.py` when a program builds its embedders; a `[[models]]` entry's
provider-specific keys, by its provider's row, which the program's composition root hands to
`load_settings`). The gateway's sections (`[[models]]`, `[router]`, `[gateway]`) are in
`config/gateway.py`, the rest here: settings only, below every compartment that reads them,
so that this package imports none.

`CODEPLANE_HOME` splits into `models/` (weights), `server/` (every byte the server persists) and
`client/` (every byte the client persists), so the privacy boundary is visible on disk too.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal, get_origin

from pydantic import (
    BaseModel,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from codeplane.config.gateway import (
    DeploymentConfig,
    GatewayConfig,
    ProviderTable,
    RouterConfig,
    deployment_type,
)

DEFAULT_SERVER_URL = "http://127.0.0.1:8300"


class ConfigError(Exception):
    """A settings file or variable is invalid; the message names the key (and line)."""


class ServeSettings(BaseModel):
    """Where `codeplane serve` listens, and what requests may ask of it (server policy: a
    request can never widen these)."""

    model_config = {"extra": "forbid"}
    host: str = "127.0.0.1"
    port: int = Field(8300, ge=1, le=65535)
    workers: int = Field(1, ge=1, le=64, description="server processes on one port; each "
                                                     "deployment's max_parallel/rpm/tpm is "
                                                     "split between them (docs/gateway.md)")
    workspace_roots: list[Path] = Field(
        default_factory=list,
        description="directories under which agent runs and sandboxes may work; empty: none "
                    "(server-side runs refused until an operator names a root). Every "
                    "tenant's roots while tenant_roots is empty; once it names a tenant, the "
                    "keyless local tenant's only")
    tenant_roots: dict[str, list[Path]] = Field(
        default_factory=dict,
        description="tenant -> its own workspace roots (docs/fleet.md); a tenant it does not "
                    "name has none")
    allow_unsandboxed: bool = Field(False, description="may a request ask for sandbox=false")
    allow_network: bool = Field(False, description="may a request ask for network=true")
    repo_urls: list[str] = Field(
        default_factory=list,
        description="URL prefixes (https, http or git) sandboxes and background agents may "
                    "fetch repositories from; empty: none (docs/fleet.md)")
    backends: list[str] = Field(
        default_factory=lambda: ["bwrap", "pool"],
        description="workspace backends an agent run may ask for by name (`host` also needs "
                    "allow_unsandboxed)")
    max_runs_per_tenant: int = Field(4, ge=1, description="concurrent agent runs per tenant")
    max_body_bytes: int = Field(32 << 20, ge=1024, description="larger request bodies get 413")
    # the HTTP edge (server/edge.py, docs/deployment.md): slow and greedy clients
    header_timeout_s: float = Field(10.0, gt=0, description="a request's line and headers "
                                    "must arrive within this many seconds, else 408")
    max_header_bytes: int = Field(64 << 10, ge=1024, description="larger request headers "
                                                                 "get 431")
    max_connections: int = Field(4096, ge=1, description="open connections per server "
                                 "process (lowered to fit the file-descriptor limit); past "
                                 "it new ones get 503")
    max_connections_per_ip: int = Field(256, ge=1, description="open connections per client "
                                        "address (trusted proxies excepted); past it 503")
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="addresses or networks (CIDR) of reverse proxies believed about the "
                    "client (through proxy_header); a request relayed by any other proxy "
                    "counts as remote")
    proxy_header: Literal["x-forwarded-for", "x-real-ip", "forwarded"] | None = Field(
        None, description="the one header the trusted proxies set to the client's address: "
                          "its right-most entry is believed, every other forwarded header "
                          "ignored (docs/deployment.md); required with trusted_proxies")
    ui_session_hours: float = Field(12.0, gt=0, description="how long a web-UI sign-in "
                                    "lasts (sign-out and revoking the key end it sooner)")
    public_metrics: bool = Field(False, description="serve /metrics without an API key (for a "
                                                    "Prometheus scraper); otherwise it is gated")

    @field_validator("trusted_proxies")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is not an IP address or network") from None
        return value

    @model_validator(mode="after")
    def _proxy_header_named(self) -> ServeSettings:
        """A proxy passes on the forwarded headers it does not set itself, as the client
        wrote them: which one it sets cannot be guessed, so the operator names it."""
        if self.trusted_proxies and self.proxy_header is None:
            raise ValueError("trusted_proxies needs proxy_header: the header your proxy sets "
                             "to the client's address (\"x-forwarded-for\", \"x-real-ip\" or "
                             "\"forwarded\")")
        return self


class EngineSettings(BaseModel):
    """Local llama.cpp engine knobs (per process, shared by every local model)."""

    model_config = {"extra": "forbid"}
    default_model: str = "code-small"
    n_ctx: int = Field(8192, ge=256, description="context window allocated per loaded model")
    n_threads: int | None = Field(None, ge=1, description="CPU threads; default: all cores")
    n_batch: int = Field(512, ge=32)
    extra_buffer_types: bool = Field(
        False, description="let llama.cpp repack weights into its extra CPU buffer types "
                           "(AMX, CPU_REPACK): faster on some CPUs, but its AMX path crashes "
                           "on some Xeons (docs/models-and-server.md)")


class StorageSettings(BaseModel):
    """Where the server keeps shared state. The database holds every durable row (keys and
    usage, search metadata, runs); the object store holds files several replicas must see (the
    event lake, LanceDB tables): a local directory by default, `s3://bucket/prefix` for teams,
    with credentials from the standard `AWS_*` variables (never from this file). A team runs
    any number of replicas on one PostgreSQL and one bucket (docs/deployment.md)."""

    model_config = {"extra": "forbid"}
    database: str = Field(
        "", description="sqlite:///PATH or postgresql://USER@HOST:PORT/DB (password: PGPASSWORD "
                        "or CODEPLANE_STORAGE__DATABASE); empty: "
                        "$CODEPLANE_HOME/server/codeplane.db")
    lease_seconds: float = Field(
        30.0, ge=1.0, description="a replica silent this long is presumed dead: its runs are "
                                  "marked interrupted and its budget holds given back")
    objects: str = Field(
        "", description="object store: a directory or s3://bucket/prefix; empty: "
                        "$CODEPLANE_HOME/server/objects")
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (http[s]://host:port) for MinIO, SeaweedFS, "
                          "Ceph...; default: AWS_ENDPOINT_URL or Amazon S3")
    region: str | None = Field(None, description="S3 region; default: AWS_REGION")
    compact_events_hours: float = Field(
        0.0, ge=0.0, description="compact the event lake's closed days this often in `serve` "
                                 "(0: off; `codeplane events compact` does it on demand)")


class FleetSettings(BaseModel):
    """`[fleet]` in codeplane.toml: how the server's sandboxes (`sandbox/fleet.py`) are
    made, pooled and bounded."""

    model_config = {"extra": "forbid"}
    strategy: str = Field("auto", description="overlay | reflink | git-shared | copy | auto "
                                              "(the first that works, in measured order)")
    pool_size: int = Field(2, ge=0, le=64, description="warm sandboxes kept per (repo, commit) "
                                                      "once it has been asked for")
    max_sandboxes: int = Field(128, ge=1, description="sandboxes on this host, pools included")
    max_per_tenant: int = Field(16, ge=1, description="sandboxes one tenant may hold")
    disk_per_tenant: int = Field(4 << 30, ge=1 << 20,
                                 description="bytes a tenant's sandboxes may add to the disk")
    cpu_seconds: int = Field(300, ge=1, description="per process of a command")
    memory_bytes: int = Field(4 << 30, ge=64 << 20,
                              description="per sandbox: all its processes and its /tmp "
                                          "together (a memory cgroup; where the host has "
                                          "none, per process); also each process's "
                                          "address space")
    processes: int = Field(256, ge=16, description="processes and threads per sandbox (a "
                                                   "pids cgroup)")
    max_execs_per_tenant: int = Field(4, ge=1, description="commands one tenant may run at "
                                                           "once through the API; more get 429")
    exec_workers: int = Field(32, ge=1, description="commands running at once through the "
                                                    "API on this host (every tenant); more "
                                                    "wait for a free worker")
    max_timeout: float = Field(600.0, gt=0, description="longest wall clock a command may ask")
    max_file_bytes: int = Field(8 << 20, ge=1024, description="largest file read or written "
                                                              "through the API")
    fetch_bytes: int = Field(1 << 30, ge=1 << 16, description="largest repository fetched "
                                                             "by URL (its pack file)")
    fetch_timeout: float = Field(300.0, gt=0, description="longest a fetch by URL may take")
    fetch_ttl: float = Field(60.0, ge=0, description="seconds a fetched repository is used "
                                                     "as it is before it is fetched again")


class BackgroundSettings(BaseModel):
    """`[background]` in codeplane.toml: what one background run (`background/service.py`)
    may store in the server database."""

    model_config = {"extra": "forbid"}
    diff_bytes: int = Field(4 << 20, ge=0, description="bytes of `diff` events one run stores; "
                                                       "past them, a summary (diffstat) per "
                                                       "change")
    patch_bytes: int = Field(16 << 20, ge=0, description="largest result patch stored; a "
                                                         "larger result is kept as its branch "
                                                         "bundle only")


class AgentSettings(BaseModel):
    """`[agent]` in codeplane.toml: the models the coding agent uses unless told otherwise."""

    model_config = {"extra": "forbid"}
    model: str = Field("code-medium", min_length=1,
                       description="chat model of `codeplane agent` without --model")
    apply_model: str = Field("code-small", min_length=1,
                             description="the model that merges a code_edit sketch the "
                                         "deterministic merge declines, in a server's runs "
                                         "(the model /v1/apply defaults to)")


EmbedMode = Literal["server", "client"]


class IndexingSettings(BaseModel):
    """`[indexing]` in codeplane.toml: the client-side indexer (`indexing/`: scan, sync,
    search) and the server's private search (`search/`) read their knobs here."""

    model_config = {"extra": "forbid"}
    sync_interval: float = Field(180.0, gt=0, description="seconds between periodic syncs "
                                                          "under `codeplane index --watch`")
    max_file_bytes: int = Field(1_000_000, ge=1, description="larger files are not indexed")
    batch_chunks: int = Field(256, ge=1, description="chunks per upload request: the server "
                              "length-sorts a request's texts into embedding batches, so bigger "
                              "ones pad less; smaller ones show dense results sooner")
    key_file: Path | None = Field(None, description="a workspace key shared by a team; "
                                                    "default: one per workspace")
    fusion: Literal["hybrid", "dense"] = Field(
        "hybrid", description="hybrid: the server's dense hits fused with the client's BM25; "
                              "dense: the server's ranking alone")
    embed: EmbedMode = Field("server", description="client: embed on the client and send "
                                                   "only rotated vectors")
    embedder: dict[str, Any] = Field(
        default_factory=dict,
        description="the embedder table (`kind` and its keys), validated by its row in "
                    "models/embedders.py when a program builds its embedders; empty: local")
    lancedb_uri: str = Field("", description="server: where the vectors live; empty: "
                                             "search/lancedb in the object store")
    ann_min_rows: int = Field(20_000, ge=1, description="server: rows of a workspace before "
                                                        "an IVF-PQ index is built")
    max_workspaces_per_tenant: int = Field(100, ge=1, description="server: workspaces one "
                                                                  "tenant may hold")
    embed_concurrency: int = Field(2, ge=1, description="server: embedding calls at once")
    embed_wait: float = Field(60.0, gt=0, description="server: seconds a request waits for an "
                                                      "embedding slot before a 503")


class TabSettings(BaseModel):
    """`[tab]` in codeplane.toml: Tab and next edit (`tab/service.py`, `tab/nextedit.py`)."""

    model_config = {"extra": "forbid"}
    model: str = "code-small"
    next_model: str | None = Field(
        None, description="the model next-edit Tab runs on, e.g. a next-edit adapter "
                          "(`codeplane rl train-next-edit`); unset: `model`")
    max_tokens: int = Field(16, ge=1, le=256, description="single-line suggestion budget")
    max_tokens_multiline: int = Field(40, ge=1, le=512)
    max_lines: int = Field(6, ge=1, le=50)
    # A threshold on tab/decision.py's P(exact line), picked by `bench/tab.py --fit` on the
    # pooled tuning positions (docs/tab.md, "Session 9"): the highest threshold at
    # which Tab leads the plain FIM call by a safety margin, in-sample and leaving each
    # project out. That is 0 - nothing hidden: a hidden answer scores nothing, most wrong
    # ones a near miss. Every answer carries its `confidence`; clients wanting fewer, surer
    # suggestions filter on it (per request, or `codeplane lsp --min-confidence`).
    min_confidence: float = Field(0.0, ge=0.0, le=1.0,
                                  description="hide suggestions less likely right than this")
    max_prompt_tokens: int = Field(3072, ge=64)
    cold_prompt_tokens: int = Field(
        256, ge=0, description="a request whose prompt has more tokens than this outside "
                               "the KV cache (a document not prefilled) is answered from a "
                               "window of this many tokens around the cursor, and the full "
                               "window is prefilled in the background; 0: always the full "
                               "window (docs/tab.md, 'The first suggestion in a file')")
    cache_size: int = Field(1000, ge=0)
    sessions: int = Field(256, ge=1)
    typed_ahead_chars: int = Field(128, ge=0, description="how far back typed-ahead looks")
    mid_line_chars: int = Field(8, ge=0, description="skip when more code is right of cursor")
    kv_slots: int = Field(6, ge=0, le=64, description="per-file KV caches kept in memory")
    layout: Literal["anchor", "psm", "spm"] = Field(
        "anchor", description="where the typed part of the line goes (see docs/tab.md)")
    upstream: str | None = Field(
        None, pattern=r"^https?://",
        description="base URL of a llama.cpp llama-server serving `model` (parallel slots, "
                    "continuous batching): Tab's model calls go there instead of the "
                    "embedded engine")
    upstream_parallel: int = Field(4, ge=1, le=256,
                                   description="concurrent calls to the upstream (its -np)")
    upstream_timeout_s: float = Field(30.0, gt=0)
    preload: bool = Field(True, description="load the Tab model when the server starts "
                                            "(with a [tab] section in codeplane.toml)")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CODEPLANE_", env_nested_delimiter="__", extra="forbid"
    )

    home: Path = Field(default_factory=lambda: Path("~/.codeplane").expanduser())
    server: str = Field(DEFAULT_SERVER_URL, description="URL client commands talk to")
    serve: ServeSettings = Field(default_factory=ServeSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)  # sandbox/fleet.py
    background: BackgroundSettings = Field(default_factory=BackgroundSettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)
    indexing: IndexingSettings = Field(default_factory=IndexingSettings)
    # each entry typed by its provider's settings model (config/gateway.py, load_settings)
    models: list[DeploymentConfig] = Field(default_factory=list)
    router: RouterConfig = Field(default_factory=RouterConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    tab: TabSettings = Field(default_factory=TabSettings)

    config_file: Path | None = Field(None, exclude=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    @field_validator("models")
    @classmethod
    def _ids_unique(cls, models: list[DeploymentConfig]) -> list[DeploymentConfig]:
        ids = [d.id for d in models if d.id]
        if len(ids) != len(set(ids)):
            raise ValueError("duplicate deployment id in [[models]]")
        return models

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def server_dir(self) -> Path:
        return self.home / "server"

    @property
    def client_dir(self) -> Path:
        return self.home / "client"


def default_home() -> Path:
    return Path(os.environ.get("CODEPLANE_HOME") or "~/.codeplane").expanduser()


def load_settings(config_file: Path | None = None, *, providers: ProviderTable | None = None,
                  **overrides: Any) -> Settings:
    """Load settings; raise ConfigError naming the offending key and line on bad input.

    `providers` is the gateway's provider table, handed over by the program's composition
    root (this package sits below the gateway): each `[[models]]` entry is validated by the
    settings model of the kind it names. Without it the entries are `UncheckedDeployment`s,
    which the gateway checks against the same table before it builds them."""
    home = Path(overrides.get("home") or default_home()).expanduser()
    path = config_file or home / "codeplane.toml"
    if config_file is not None and not config_file.is_file():
        raise ConfigError(f"config file not found: {config_file}")
    if path.is_file():
        try:
            tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    entry = deployment_type(providers)

    class _FromFile(Settings):
        model_config = SettingsConfigDict(toml_file=path)
        models: list[entry] = Field(default_factory=list)  # type: ignore[valid-type]

    try:
        settings = _FromFile(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path, providers or {})) from exc
    return Settings.model_construct(**{**settings.__dict__, "config_file": path})


def checked_models(settings: Settings, providers: ProviderTable) -> list[DeploymentConfig]:
    """`settings.models`, each entry validated by the settings model of its kind's row, the
    way settings load does when it is given the table; a bad key raises the ConfigError a
    load would have (key and line). For settings loaded without the table; an entry already
    checked comes out equal."""
    entries = [{**dep.model_dump(exclude_unset=True), "provider": dep.provider}
               for dep in settings.models]
    try:
        return TypeAdapter(list[deployment_type(providers)]).validate_python(entries)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, settings.config_file, providers, "models")) from None


def where(settings: Settings, *loc: str) -> str:
    """` (line N)` for the key at `loc` (`"router", "fallbacks"`) in the settings file, for
    checks that can only be made after settings load (a fallback naming an unknown model)."""
    path = settings.config_file
    line = _locate(path.read_text().splitlines() if path and path.is_file() else [], list(loc))
    return f" (line {line})" if line else ""


def _describe(exc: ValidationError, path: Path | None, providers: ProviderTable,
              *section: str) -> str:
    """The error message of a validation of the settings (or of one `section` of them),
    one line per error, each naming its key and line."""
    text = path.read_text().splitlines() if path and path.is_file() else []
    errors = [(err, [*section, *(str(p) for p in err["loc"])]) for err in exc.errors()]
    sections = ", ".join(dict.fromkeys(_spelled(loc[0]) for _, loc in errors if loc))
    named = f" in {sections}" if sections else ""
    lines = [f"invalid settings{named} ({path} or CODEPLANE_* environment):"]
    for err, loc in errors:
        if loc[:1] == ["models"] and len(loc) > 2 and loc[2] in providers:
            del loc[2]  # the union's tag: the entry's own `provider` already says it
        line = _locate(text, loc)
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {'.'.join(loc)}{f' (line {line})' if line else ''}: {msg}")
    return "\n".join(lines)


def _spelled(name: str) -> str:
    """A top-level key as the file writes it: `[serve]`, `[[models]]`, or `server`."""
    field = Settings.model_fields.get(name)
    if field is None:
        return name
    if get_origin(field.annotation) is list:
        return f"[[{name}]]"
    is_table = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    return f"[{name}]" if is_table else name


def _locate(text: list[str], loc: list[str]) -> int | None:
    """The line of the key at `loc`: looked up inside its table (`[serve]`, the n-th
    `[[models]]`) where the file has one, so a key two sections share is found in the right
    one; else the last part of `loc` the file sets anywhere (inline tables, dotted keys)."""
    if not loc:
        return None
    headers = [i for i, line in enumerate(text)
               if re.match(rf"^\s*\[+\s*{re.escape(loc[0])}\s*\]+", line)]
    nth, rest = (int(loc[1]), loc[2:]) if len(loc) > 1 and loc[1].isdigit() else (0, loc[1:])
    if nth < len(headers):
        start = headers[nth]
        end = next((i for i, line in enumerate(text[start + 1:], start + 1)
                    if re.match(r"^\s*\[", line)), len(text))
        key = next((part for part in reversed(rest) if not part.isdigit()), None)
        found = _line_of(text[start:end], key) if key else None
        return start + found if found else start + 1
    found = None
    for part in loc:
        found = _line_of(text, part) or found
    return found


def _line_of(text: list[str], key: str) -> int | None:
    pattern = re.compile(rf"^\s*\"?{re.escape(key)}\"?\s*=|^\s*\[+\s*{re.escape(key)}\s*\]+")
    for number, line in enumerate(text, start=1):
        if pattern.search(line):
            return number
    return None
