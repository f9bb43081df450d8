"""The local inference engine: llama.cpp models kept resident, one thread per model.

Why one thread per model: a llama.cpp context is not thread-safe, and its KV cache is the
latency budget (a 1,200-token prompt costs ~9 s cold and ~0.2 s when its prefix is cached on
2 cores). A single worker per model serializes access and keeps the cache warm for whichever
request comes next; `Llama.generate` reuses the longest common token prefix by itself, so
callers that keep prompt layouts stable (Tab, agent turns) get the speed for free.

Compartments use `Engine.run(name, fn)` to execute `fn(model)` on that thread.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from codeplane.config import Settings
from codeplane.models.kv import KVCache
from codeplane.models.lora import LoraSlot
from codeplane.models.pull import ensure_weights
from codeplane.models.registry import ModelRegistry, ModelSpec
from codeplane.models.toolcalls import tools_system_note

log = logging.getLogger("codeplane.engine")
T = TypeVar("T")
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


class Unsupported(ValueError):
    """The model lacks a capability (e.g. FIM tokens)."""


@dataclass
class Sampling:
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


class LocalModel:
    """One loaded GGUF. Every method must run on the model's own worker thread."""

    def __init__(self, spec: ModelSpec, settings: Settings) -> None:
        from llama_cpp import Llama  # heavy import: only when a model is really loaded

        path = ensure_weights(spec, settings)
        cfg = settings.engine
        start = time.perf_counter()
        # llama-cpp-python defaults decode to half the cores (assuming hyperthreads); on the
        # 2-vCPU machines we measured 46 tok/s with both cores vs 27 with one.
        threads = cfg.n_threads or os.cpu_count() or 1
        self.llama = Llama(model_path=str(path), n_ctx=cfg.n_ctx, n_batch=cfg.n_batch,
                           n_threads=threads, n_threads_batch=threads, verbose=False)
        self.load_seconds = time.perf_counter() - start
        self.spec = spec
        self.name = spec.name
        self.n_ctx = self.llama.n_ctx()
        self.kv = KVCache(self.llama)  # prefix reuse, batch verify, scoring, save/restore
        self.lora = LoraSlot(self.llama, self.kv)  # RL swaps in each new policy's adapter
        self.metadata = dict(self.llama.metadata)
        self.chat_template = self.metadata.get("tokenizer.chat_template")
        self._template = compile_chat_template(self.chat_template) if self.chat_template else None
        self.stop_ids = self._stop_ids()
        self.fim_ids = self._fim_ids()
        self._pieces: list[bytes] | None = None

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
        model: token healing looks for the tokens that start with a backed-off text."""
        if self._pieces is None:
            self._pieces = [self.llama.detokenize([i]) for i in range(self.llama.n_vocab())]
        return self._pieces

    # -- generation ----------------------------------------------------------------------

    def cached_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` are already in the KV cache."""
        return self.kv.shared_prefix(tokens)

    def generate(self, tokens: list[int], sampling: Sampling,
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


class Engine:
    """Loads local models on first use and runs work for each on its own thread."""

    def __init__(self, settings: Settings, registry: ModelRegistry | None = None) -> None:
        self.settings = settings
        self.registry = registry or ModelRegistry(settings)
        self._models: dict[str, LocalModel] = {}
        self._workers: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def spec(self, name: str) -> ModelSpec:
        return self.registry.get(name)

    def loaded(self) -> list[str]:
        return list(self._models)

    async def run(self, name: str, fn: Callable[[LocalModel], T]) -> tuple[T, float]:
        """Run `fn(model)` on the model's worker; return (result, seconds waited in queue)."""
        spec = self.registry.get(name)
        worker = self._worker(spec.name)
        submitted = time.perf_counter()
        waited = 0.0

        def job() -> T:
            nonlocal waited
            waited = time.perf_counter() - submitted
            return fn(self._load(spec))

        result = await asyncio.get_running_loop().run_in_executor(worker, job)
        return result, waited

    def run_sync(self, name: str, fn: Callable[[LocalModel], T]) -> T:
        """Blocking variant for CLI commands and benchmarks (same worker, same cache)."""
        spec = self.registry.get(name)
        return self._worker(spec.name).submit(lambda: fn(self._load(spec))).result()

    def _worker(self, name: str) -> ThreadPoolExecutor:
        with self._lock:
            if name not in self._workers:
                self._workers[name] = ThreadPoolExecutor(1, thread_name_prefix=f"model-{name}")
            return self._workers[name]

    def _load(self, spec: ModelSpec) -> LocalModel:
        # Only ever called on the model's own worker thread, so no lock is needed per model.
        if spec.name not in self._models:
            log.info("loading model %s", spec.name)
            self._models[spec.name] = LocalModel(spec, self.settings)
        return self._models[spec.name]

    def close(self) -> None:
        for worker in self._workers.values():
            worker.shutdown(wait=True, cancel_futures=True)
        for model in self._models.values():
            model.llama.close()
        self._models.clear()
        self._workers.clear()


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
