"""The local inference engine: llama.cpp models kept resident, each in its own worker process.

Why a process per model: native code that crashes (llama.cpp's AMX kernels segfault on some
Xeons, issue #30) must take down one model's worker, never the server (`models/worker.py`).
Why one at a time: a llama.cpp context is not thread-safe, and its KV cache is the latency
budget (a cold prompt costs many times one whose prefix is cached). Each model's jobs queue
in the server and run one by one in its worker, which keeps
the cache warm for whichever request comes next; `Llama.generate` reuses the longest common
token prefix by itself, so callers that keep prompt layouts stable (Tab, agent turns) get the
speed for free.

Compartments call `Engine.run(name, job, *args)`: `job` names a function of the table in
`models/jobs.py`, which runs in the worker with the loaded `LocalModel`, so the boundary is
crossed once per request, never per token. An adapter model (a LoRA adapter registered on a
base model, `registry.py`) runs on its base's worker: each job carries the adapter it needs and
the worker swaps it in first (`lora.py`), so no caller knows adapters exist.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import ctypes
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from codeplane.config import Settings
from codeplane.models.kv import KVCache
from codeplane.models.lora import Adapter, LoraSlot
from codeplane.models.pull import ensure_weights
from codeplane.models.registry import ModelRegistry, ModelSpec
from codeplane.models.toolcalls import tools_system_note
from codeplane.models.worker import Worker, WorkerDied, WorkerTarget

log = logging.getLogger("codeplane.engine")
TOP_K = 40  # candidates kept when sampling with temperature

# FIM dialects by token text; the first whose three tokens all exist in the vocab wins.
FIM_DIALECTS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder family
    ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"),  # DeepSeek-Coder
)
# Token texts that end a completion in addition to the vocab's end-of-generation tokens:
# a FIM model that starts a new file or repo section has finished the hole.
EXTRA_STOP_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|file_sep|>", "<|repo_name|>",
                     "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>")


class ContextOverflow(ValueError):
    def __init__(self, prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(f"prompt is {prompt_tokens} tokens; this model's context window is "
                         f"{n_ctx} tokens (prompt plus at least one generated token)")
        self.prompt_tokens, self.n_ctx = prompt_tokens, n_ctx

    def __reduce__(self):  # raised in a worker, re-raised in the server: rebuilt from fields
        return ContextOverflow, (self.prompt_tokens, self.n_ctx)


class Unsupported(ValueError):
    """The model lacks a capability (e.g. FIM tokens)."""


class EngineCrashed(RuntimeError):
    """A model's worker process died (or is backing off after dying) instead of answering.
    Routes answer 503 `engine_crashed`; `retry_after` is the back-off still to wait, if any."""

    def __init__(self, model: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.model, self.retry_after = model, retry_after


class JobDropped(RuntimeError):
    """The job's cancel event was set before its turn came: it never reached the model."""


@dataclass
class Decoding:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None  # None: TOP_K when sampling, greedy at 0; 0: the full vocabulary
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    seed: int | None = None
    grammar: str | None = None  # GBNF, to constrain output
    # Logits processors run before logprob capture and grammar (Tab's token healing mask), so
    # captured logprobs are those of the constrained distribution.
    processors: list[Callable[[np.ndarray, np.ndarray], np.ndarray]] = field(
        default_factory=list)


@dataclass(frozen=True)
class LogitScale:
    """Logits processor that divides by a temperature. Unlike `Decoding.temperature` (applied
    by llama.cpp's sampler after the processors) it runs before logprob capture, so captured
    logprobs are those of the tempered distribution, as RL's importance ratios need. A
    module-level class, so a `Decoding` holding it crosses to the worker process."""

    factor: float

    def __call__(self, _ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        return scores * self.factor


@dataclass
class Generation:
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV entries were reused
    completion_tokens: int
    token_logprobs: list[float] | None
    prompt_seconds: float
    decode_seconds: float
    # What RL trains on: the sampled ids, plus the end-of-turn token that stopped decoding and
    # its logprob (the policy must learn to stop; `text` and `token_logprobs` omit it).
    token_ids: list[int] = field(default_factory=list)
    stop_token: int | None = None
    stop_logprob: float | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the server knows of a model loaded in its worker."""

    name: str
    n_ctx: int
    metadata: dict[str, str]
    load_seconds: float
    extra_buffer_types: bool  # llama.cpp's `use_extra_bufts` as the model was loaded


class LocalModel:
    """One loaded GGUF. Product code uses it only inside the model's worker process (one
    thread at a time); tests and benchmarks of its own logic may load one in-process."""

    def __init__(self, spec: ModelSpec, settings: Settings) -> None:
        from llama_cpp import Llama  # heavy import: only when a model is really loaded

        path = ensure_weights(spec, settings)
        cfg = settings.engine
        start = time.perf_counter()
        # llama-cpp-python defaults decode to half the cores (assuming hyperthreads); on vCPUs
        # all of them decode faster (docs/models-and-server.md, "Numbers behind the code's
        # comments").
        self.threads = cfg.n_threads or os.cpu_count() or 1
        with _model_params(use_extra_bufts=cfg.extra_buffer_types):
            self.llama = Llama(model_path=str(path), n_ctx=cfg.n_ctx, n_batch=cfg.n_batch,
                               n_threads=self.threads, n_threads_batch=self.threads,
                               verbose=False)
        self.threads_now = self.threads
        self.load_seconds = time.perf_counter() - start
        self.spec = spec
        self.name = spec.name
        self.n_ctx = self.llama.n_ctx()
        self.kv = KVCache(self.llama)  # prefix reuse, batch verify, scoring, save/restore
        self.lora = LoraSlot(self.llama, self.kv)  # adapter models; RL's current policy
        self.metadata = dict(self.llama.metadata)
        self.chat_template = self.metadata.get("tokenizer.chat_template")
        self._template = compile_chat_template(self.chat_template) if self.chat_template else None
        self.stop_ids = self._stop_ids()
        self.fim_ids = self._fim_ids()
        self._pieces: list[bytes] | None = None

    def fit_threads(self) -> int:
        """Run on the cores no other process is using now, up to `threads`; returns the
        count. llama.cpp's threads meet at a barrier after every operation, so one thread
        descheduled by another busy process stalls them all: on a 2-core machine beside
        one busy process, 2 threads decoded ~20x slower than 1 (docs/models-and-server.md,
        "Threads on a shared machine"). The worker calls it before each job."""
        import llama_cpp

        wanted = min(self.threads, free_cores(os.cpu_count() or 1))
        if wanted != self.threads_now:
            llama_cpp.llama_set_n_threads(self.llama._ctx.ctx, wanted, wanted)
            self.threads_now = wanted
        return wanted

    def info(self) -> ModelInfo:
        return ModelInfo(self.name, self.n_ctx, self.metadata, self.load_seconds,
                         bool(self.llama.model_params.use_extra_bufts))

    # -- tokens --------------------------------------------------------------------------

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Tokenize without BOS. `special=False` keeps user text from forging control tokens."""
        return self.llama.tokenize(text.encode(), add_bos=False, special=special)

    def detokenize(self, tokens: list[int]) -> str:
        return self.llama.detokenize(tokens).decode("utf-8", errors="replace")

    def _single_id(self, text: str) -> int | None:
        ids = self.llama.tokenize(text.encode(), add_bos=False, special=True)
        return ids[0] if len(ids) == 1 else None

    def _stop_ids(self) -> set[int]:
        import llama_cpp

        vocab = self.llama._model.vocab
        ids = {t for t in range(self.llama.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}
        ids |= {i for i in map(self._single_id, EXTRA_STOP_TOKENS) if i is not None}
        return ids

    def _fim_ids(self) -> tuple[int, int, int] | None:
        for dialect in FIM_DIALECTS:
            ids = [self._single_id(t) for t in dialect]
            if all(i is not None for i in ids):
                return ids[0], ids[1], ids[2]  # type: ignore[return-value]
        return None

    # -- prompts -------------------------------------------------------------------------

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """Render with the model's own chat template from its GGUF metadata."""
        if self._template is None or self.chat_template is None:
            raise Unsupported(f"model {self.name} has no chat template in its GGUF metadata")
        return render_chat_template(
            self._template, self.chat_template, messages, tools,
            bos_token=self._token_text(self.llama.token_bos()),
            eos_token=self._token_text(self.llama.token_eos()),
            add_generation_prompt=add_generation_prompt,
        )

    def chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict] | None = None
                    ) -> list[int]:
        return self.tokenize(self.render_chat(messages, tools), special=True)

    def fim_tokens(self, prefix: str, suffix: str, preamble: str = "") -> list[int]:
        """Prefix-suffix-middle prompt. Pieces are tokenized separately, so an edit in one
        piece never changes the tokens of the pieces before it (stable KV-cache prefix)."""
        if self.fim_ids is None:
            raise Unsupported(f"model {self.name} has no fill-in-the-middle tokens")
        pre, suf, mid = self.fim_ids
        head = self.tokenize(preamble, special=True) if preamble else []
        return [*head, pre, *self.tokenize(prefix), suf, *self.tokenize(suffix), mid]

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self.llama.detokenize([token], special=True).decode("utf-8", errors="replace")

    # -- token-level helpers (Tab's token healing) ----------------------------------------

    def vocab_pieces(self) -> list[bytes]:
        """The bytes every token id decodes to (b"" for control tokens), computed once per
        model: token healing looks for the tokens that start with a backed-off text. Read
        with one buffer, not `Llama.detokenize`: that returns b"" for every token over 32
        bytes (a run of 40 spaces) and allocates per call - 151,936 calls before the first
        Tab request (docs/tab.md, "The first suggestion in a file")."""
        if self._pieces is None:
            import llama_cpp

            vocab, size = self.llama._model.vocab, 256
            buffer = ctypes.create_string_buffer(size)
            pieces = []
            for token in range(self.llama.n_vocab()):
                n = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, False)
                if n < 0:  # longer than the buffer: -n bytes
                    size = -n
                    buffer = ctypes.create_string_buffer(size)
                    n = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, False)
                pieces.append(buffer.raw[:n])
            self._pieces = pieces
        return self._pieces

    # -- generation ----------------------------------------------------------------------

    def cached_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` are already in the KV cache."""
        return self.kv.shared_prefix(tokens)

    def generate(self, tokens: list[int], sampling: Decoding,
                 cancel: threading.Event | None = None,
                 on_text: Callable[[str], None] | None = None) -> Generation:
        """Decode from `tokens`. `on_text` receives text deltas that are safe to show
        (never part of a stop string); `cancel` stops between tokens."""
        if len(tokens) + 1 > self.n_ctx:
            raise ContextOverflow(len(tokens), self.n_ctx)
        budget = min(sampling.max_tokens, self.n_ctx - len(tokens))
        cached = self.cached_prefix(tokens)
        if sampling.seed is not None:
            self.llama.set_seed(sampling.seed)
        capture = _LogitCapture() if sampling.logprobs else None
        top_k = sampling.top_k if sampling.top_k is not None else (
            TOP_K if sampling.temperature > 0 else 1)  # 1: greedy
        processors = [*sampling.processors, *([capture] if capture else [])]
        if sampling.grammar:
            from codeplane.models.grammar import GrammarGate  # imports llama_cpp

            processors.append(GrammarGate(self.llama, sampling.grammar, len(tokens), top_k))
        decoder = _StopDecoder(sampling.stop)
        out: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        stop_token: int | None = None
        start = time.perf_counter()
        first_token_at = None
        for token in self.llama.generate(
            tokens, temp=sampling.temperature, top_p=sampling.top_p, top_k=top_k, min_p=0.0,
            repeat_penalty=1.0,
            logits_processor=processors or None,
        ):
            first_token_at = first_token_at or time.perf_counter()
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            if token in self.stop_ids:
                finish, stop_token = "stop", token
                break
            out.append(token)
            if capture is not None:
                logprobs.append(capture.logprob(token))
            delta, stopped = decoder.feed(self.llama.detokenize([token]))
            if delta and on_text:
                on_text(delta)
            if stopped:
                finish = "stop"
                break
            if len(out) >= budget:
                break
        tail = decoder.flush() if finish != "stop" or not decoder.stopped else ""
        if tail and on_text:
            on_text(tail)
        end = time.perf_counter()
        first_token_at = first_token_at or end
        return Generation(
            text=decoder.text, finish_reason=finish, prompt_tokens=len(tokens),
            cached_tokens=cached, completion_tokens=len(out),
            token_logprobs=logprobs if capture else None,
            prompt_seconds=first_token_at - start, decode_seconds=end - first_token_at,
            token_ids=out, stop_token=stop_token,
            stop_logprob=capture.logprob(stop_token) if capture and stop_token is not None
            else None,
        )


def free_cores(cores: int, samples: int = 3) -> int:
    """Cores no other thread is running on, at least 1: `cores` less the runnable threads
    of the whole machine (`procs_running` in /proc/stat, the calling one excepted), the
    least of a few reads a millisecond apart (a thread woken for a moment is not a load)."""
    busy = []
    for i in range(samples):
        try:
            with open("/proc/stat") as stat:
                busy += [int(line.split()[1]) - 1 for line in stat
                         if line.startswith("procs_running")]
        except OSError:  # not Linux: assume the machine is ours
            return cores
        if i + 1 < samples:
            time.sleep(0.001)
    return max(1, cores - min(busy, default=0))


BACKOFF_S = 1.0  # after a second crash in a row the next start waits this long, ...
BACKOFF_MAX_S = 60.0  # ... doubling with every further crash, up to this


@dataclass(frozen=True)
class WorkerStatus:
    """One model's worker, for /metrics and operators."""

    pid: int | None  # None: not running (not started yet, or dead and not restarted)
    job: str | None  # the job in flight
    waiting: int  # jobs queued behind it
    restarts: int  # workers started after a crash
    crashes: dict[str, int]  # by cause: "SIGSEGV", "SIGKILL", "exit code 1", ...


class Engine:
    """Starts each local model's worker process on first use and runs named jobs on it
    (`models/jobs.py`), one at a time per model, first come first served."""

    def __init__(self, settings: Settings, registry: ModelRegistry | None = None) -> None:
        self.settings = settings
        self.registry = registry or ModelRegistry(settings)
        self._models: dict[str, _Supervisor] = {}
        self._hosted: dict[str, WorkerTarget] = {}  # worker targets outside the registry
        self._lock = threading.Lock()

    def spec(self, name: str) -> ModelSpec:
        return self.registry.get(name)

    def weights_of(self, spec: ModelSpec) -> ModelSpec:
        """The model whose weights (and worker) serve `spec`: its base for an adapter model."""
        return self.registry.get(spec.base) if spec.base else spec

    def host(self, target: WorkerTarget) -> str:
        """Run jobs for `target`, something native outside the model registry (the local
        embedder, `embed_worker.py`), in a worker of its own under this engine: started,
        restarted and counted in `/metrics` as a model's. Returns the name jobs take."""
        with self._lock:
            self._hosted.setdefault(target.name, target)
        return target.name

    def loaded(self) -> list[str]:
        """Models whose worker is running (base models: adapter models run on theirs)."""
        return [name for name, sup in list(self._models.items()) if sup.worker is not None]

    def info(self, name: str) -> ModelInfo:
        """The loaded model's facts; starts its worker if needed (benchmarks call it to load
        a model outside their timings)."""
        sup, _ = self._supervisor(name)
        return sup.submit(lambda: sup.ensure().info).result()

    async def run(self, model: str | ModelSpec, job: str, *args: Any,
                  on_event: Callable[[Any], None] | None = None,
                  cancel: threading.Event | None = None) -> tuple[Any, float]:
        """Run `job(*args)` in the model's worker; return (result, seconds waited in the
        queue). `model` is a name, or a spec the caller resolved (it runs with that spec's
        adapter version even if the name is registered again meanwhile). `on_event` gets the
        job's streamed events on a thread of the engine's; setting `cancel` stops the job
        between two tokens, or drops it before it starts (JobDropped). Raises what the job
        raised, or EngineCrashed."""
        sup, adapter = self._supervisor(model)
        _known(job)
        submitted = time.perf_counter()
        waited = 0.0

        def call() -> Any:
            nonlocal waited
            waited = time.perf_counter() - submitted
            return sup.call(job, args, on_event, cancel, adapter)

        result = await asyncio.wrap_future(sup.submit(call))
        return result, waited

    def run_sync(self, model: str | ModelSpec, job: str, *args: Any,
                 on_event: Callable[[Any], None] | None = None,
                 cancel: threading.Event | None = None) -> Any:
        """Blocking variant for CLI commands, benchmarks and sync routes (same queue)."""
        return self.submit(model, job, *args, on_event=on_event, cancel=cancel).result()

    def submit(self, model: str | ModelSpec, job: str, *args: Any,
               on_event: Callable[[Any], None] | None = None,
               cancel: threading.Event | None = None) -> Future:
        """Queue `job(*args)` and return at once: the future of its result, for work nobody
        waits on (Tab's background prefill of a cold document). Same queue as `run`."""
        sup, adapter = self._supervisor(model)
        _known(job)
        return sup.submit(lambda: sup.call(job, args, on_event, cancel, adapter))

    def status(self) -> dict[str, WorkerStatus]:
        return {name: sup.status() for name, sup in list(self._models.items())}

    def close(self) -> None:
        """Stop every worker; calls in flight fail with EngineCrashed, queued ones too."""
        with self._lock:
            supervisors = list(self._models.values())
            self._models.clear()
        for sup in supervisors:
            sup.close()

    def _supervisor(self, model: str | ModelSpec) -> tuple[_Supervisor, Adapter | None]:
        """The worker's supervisor for a model (or a hosted target), and the adapter its
        jobs run with."""
        if isinstance(model, str) and model in self._hosted:
            target: WorkerTarget = self._hosted[model]
            adapter = None
        else:
            spec = self.registry.get(model) if isinstance(model, str) else model
            target, adapter = self.weights_of(spec), spec.adapter
        with self._lock:
            if target.name not in self._models:
                self._models[target.name] = _Supervisor(target, self.settings)
            return self._models[target.name], adapter


def _known(job: str) -> None:
    from codeplane.models.jobs import JOBS

    if job not in JOBS:
        raise ValueError(f"no engine job {job!r} (models/jobs.py)")


class _Supervisor:
    """One model's worker over time: started on first use, started afresh after a crash
    (at once the first time, then with a back-off doubling per crash in a row, so a model
    that crashes on every load or decode never spins), fed one job at a time by `queue`,
    whose one thread waits on the worker's socket."""

    def __init__(self, target: WorkerTarget, settings: Settings) -> None:
        self.target, self.settings = target, settings
        self.queue = ThreadPoolExecutor(1, thread_name_prefix=f"model-{target.name}")
        self.waiting = 0  # submitted, not started
        self._count = threading.Lock()  # for `waiting`
        self.worker: Worker | None = None
        self.failures = 0  # crashes in a row: the back-off's exponent
        self.not_before = 0.0  # monotonic time before which no worker starts
        self.restarts = 0
        self.crashes: Counter[str] = Counter()
        self.closing = False

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue `fn` for the queue's thread."""
        self._wait(+1)

        def started() -> Any:
            self._wait(-1)
            return fn()

        future = self.queue.submit(started)
        future.add_done_callback(lambda f: f.cancelled() and self._wait(-1))
        return future

    def _wait(self, change: int) -> None:
        with self._count:
            self.waiting += change

    def call(self, job: str, args: tuple, on_event: Callable[[Any], None] | None,
             cancel: threading.Event | None, adapter: Adapter | None) -> Any:
        """Runs on the queue's thread."""
        if cancel is not None and cancel.is_set():
            raise JobDropped(f"{job} was cancelled before it reached {self.target.name}")
        worker = self.ensure()
        try:
            result = worker.call(job, args, on_event, cancel, adapter)
        except WorkerDied as died:
            raise self._died(died, f"running {job}") from None
        self.failures = 0
        return result

    def ensure(self) -> Worker:
        """The running worker, started if there is none (on the queue's thread). A worker
        that died between two jobs counts as a crash, but fails no request."""
        if self.worker is not None:
            if self.worker.alive():
                return self.worker
            self._died(self.worker.died(), "idle")
        name = self.target.name
        if self.closing:
            raise self._closed()
        wait = self.not_before - time.monotonic()
        if wait > 0:
            raise EngineCrashed(name, f"model {name}'s worker process crashed "
                                      f"{self.failures} times in a row; it restarts in "
                                      f"{wait:.1f} s", retry_after=wait)
        if self.crashes:
            self.restarts += 1
        log.info("model %s: starting its worker process", name)
        try:
            self.worker = Worker(self.target, self.settings)
        except WorkerDied as died:
            raise self._died(died, "loading the model") from None
        if self.closing:  # the engine shut down while the model loaded
            self.worker.close()
            self.worker = None
            raise self._closed()
        log.info("model %s: loaded in %.1f s by worker %d", name,
                 self.worker.info.load_seconds, self.worker.pid)
        return self.worker

    def _died(self, died: WorkerDied, during: str) -> EngineCrashed:
        self.worker = None
        name = self.target.name
        if self.closing:
            return self._closed()
        self.failures += 1
        self.crashes[died.cause] += 1
        delay = 0.0 if self.failures == 1 else min(BACKOFF_MAX_S,
                                                   BACKOFF_S * 2 ** (self.failures - 2))
        self.not_before = time.monotonic() + delay
        log.error("model %s: worker %d died (%s) while %s; %s. Its last output:\n%s", name,
                  died.pid, died.cause, during,
                  f"no new worker for {delay:g} s ({self.failures} crashes in a row)" if delay
                  else "the next request starts a new one", "\n".join(died.tail) or "(none)")
        return EngineCrashed(name, f"model {name}'s worker process crashed ({died.cause}) "
                                   f"while {during}", retry_after=delay or None)

    def _closed(self) -> EngineCrashed:
        return EngineCrashed(self.target.name, f"model {self.target.name} is unavailable: the "
                                             "engine is shut down")

    def status(self) -> WorkerStatus:
        worker = self.worker
        return WorkerStatus(worker.pid if worker else None, worker.job if worker else None,
                            self.waiting, self.restarts, dict(self.crashes))

    def close(self) -> None:
        self.closing = True
        if (worker := self.worker) is not None:
            worker.stop()  # a call in flight reads EOF and fails
        self.queue.shutdown(wait=True, cancel_futures=True)
        if (worker := self.worker) is not None:
            worker.close()
            self.worker = None


@contextlib.contextmanager
def _model_params(**fields: Any) -> Iterator[None]:
    """Load with llama.cpp model parameters that llama-cpp-python's `Llama()` takes no
    argument for (0.3.36: `use_extra_bufts`). `Llama()` starts from
    `llama_model_default_params()`, so that function is wrapped for the one load; the lock
    keeps two loads in one process from seeing each other's wrapper."""
    import llama_cpp.llama_cpp as native

    with _PARAMS_LOCK:
        default = native.llama_model_default_params

        def params():  # a ctypes struct
            value = default()
            for key, setting in fields.items():
                setattr(value, key, setting)
            return value

        native.llama_model_default_params = params
        try:
            yield
        finally:
            native.llama_model_default_params = default


_PARAMS_LOCK = threading.Lock()


class _LogitCapture:
    """Logits processor that keeps the log-softmax of the distribution a token came from."""

    def __init__(self) -> None:
        self._last: np.ndarray | None = None

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        self._last = scores.copy()
        return scores

    def logprob(self, token: int) -> float:
        if self._last is None:
            return 0.0
        scores = self._last.astype(np.float64)
        top = scores.max()
        return float(scores[token] - top - np.log(np.exp(scores - top).sum()))


class _StopDecoder:
    """Accumulates text and withholds any tail that could still become a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self._shown = 0
        self.stopped = False
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> tuple[str, bool]:
        # Incremental: one character's UTF-8 bytes may be split across two tokens.
        before = len(self.text)
        self.text += self._utf8.decode(piece)
        for stop in self.stops:  # only where the new piece could complete a stop string
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                return self._release(len(self.text)), True
        hold = max((_overlap(self.text, s) for s in self.stops), default=0)
        return self._release(len(self.text) - hold), False

    def flush(self) -> str:
        self.text += self._utf8.decode(b"", final=True)
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        delta = self.text[self._shown:upto] if upto > self._shown else ""
        self._shown = max(self._shown, upto)
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for size in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0


def render_chat_template(template: Any, source: str, messages: list[dict[str, Any]],
                         tools: list[dict] | None, *, bos_token: str, eos_token: str,
                         add_generation_prompt: bool = True) -> str:
    """OpenAI messages and tools -> prompt text through a compiled chat template (`source` is
    its text). Shared by the llama.cpp engine and the RL torch policy, so both prompt the
    model with the same tool format."""
    messages = [_template_message(m) for m in messages]
    if tools and "tools" not in source:
        messages = _with_system_note(messages, tools_system_note(tools))
        tools = None
    return template.render(
        messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
        bos_token=bos_token, eos_token=eos_token,
    )


def compile_chat_template(source: str):
    """Jinja environment matching Hugging Face's chat-template conventions."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise Unsupported(f"chat template rejected the messages: {message}")

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI message -> the shape HF templates expect (text content, dict arguments)."""
    msg = dict(message)
    content = msg.get("content")
    if isinstance(content, list):
        msg["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    elif content is None:
        msg["content"] = ""
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = dict(call.get("function", call))
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
        calls.append({**call, "function": fn})
    if calls:
        msg["tool_calls"] = calls
    return msg


def _with_system_note(messages: list[dict], note: str) -> list[dict]:
    if messages and messages[0].get("role") == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]
