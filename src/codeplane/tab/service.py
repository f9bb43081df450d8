"""Server side of Tab: one suggestion per keystroke, almost never recomputing the prompt.

On CPU a cold FIM prompt costs seconds and each new token a small fraction of that
(docs/tab.md, "How it stays fast"), so:

* Stable layout ("anchor"): the prompt is `[context][<fim_prefix> P0 <fim_suffix> S
  <fim_middle>] T`, where P0 is the prefix up to the start of the line where the session
  started typing, S the suffix then, and T what was typed since, fed as already-written
  middle. Typing only appends to T (inserting at the cursor never changes S), so every
  keystroke reuses the whole KV cache except the last token or two. The anchor moves only
  when the cursor jumps, the suffix changes, or T grows too long.
* Fast paths before the model: an exact-key LRU cache, and typed-ahead reuse (the user typed
  the start of a suggestion: serve the rest). Both are checked before any queueing.
* Per-session slots: a newer request from the same `cursor_id` cancels the older one between
  tokens, and a request still queued behind the model is dropped before it starts.
* Per-file KV slots (`slots.py`): jumping back to a file restores its saved KV cache.
* Show/hide: the decision's P(exact line) (`decision.py`) must reach a threshold.
* Model calls go to the embedded engine or, with `upstream`, to a llama-server that batches
  (`backend.py`); the caches, sessions and typed-ahead stay here either way.
* Tenants: the cache and the sessions are keyed by tenant as well, so one tenant never gets
  another's suggestion nor cancels another's request with the same `cursor_id`.

On the embedded engine the model path (`answer`: prompt layout, decode, post-processing,
decision) runs in the model's worker process as the engine job `tab.suggest`, with the
anchors, KV slots and vocabulary index it needs kept there; one round trip per model call.

Nothing is persisted: the cache and sessions are in-memory and bounded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field, model_validator

from codeplane.config import TabSettings
from codeplane.core.principal import LOCAL_TENANT
from codeplane.models.engine import Decoding, Engine, JobDropped, Unsupported
from codeplane.models.jobs import JobContext
from codeplane.tab import decision, kinds, postprocess
from codeplane.tab.backend import LocalTab, Prefilled, TabModel, UpstreamTab
from codeplane.tab.feedback import ShownLog
from codeplane.tab.healing import Healing, VocabIndex, back_off
from codeplane.tab.postprocess import Mode
from codeplane.tab.slots import KVSlots

if TYPE_CHECKING:
    from codeplane.tab.nextedit import NextRequest

log = logging.getLogger(__name__)
MAX_TYPED_CHARS = 1500  # beyond this T is long enough that re-anchoring is cheaper overall
WARM_UP = ("", "warm-up")  # the warm-up's key among the yielding background work (no tenant)


class Snippet(BaseModel):
    path: str = Field(max_length=4096)
    text: str = Field(max_length=64_000)


class TabRequest(BaseModel):
    path: str = Field(max_length=4096)
    prefix: str = Field(max_length=400_000)
    suffix: str = Field("", max_length=400_000)
    language: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9_+#.-]*$")
    context: list[Snippet] = Field(default_factory=list, max_length=64)
    cursor_id: str = Field("default", max_length=200,
                           description="session key: one editor cursor; newer requests "
                                       "cancel older ones")
    request_id: str | None = Field(None, max_length=200)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=512)
    min_confidence: float | None = Field(None, ge=0.0, le=1.0)
    fast_only: bool = Field(False, description="answer from cache/typed-ahead only; "
                                               "source 'miss' means the model is needed")


class PrefillRequest(BaseModel):
    """`POST /v1/tab/prefill`: a document the editor opened or paused in. `text` is what a
    completion at `cursor` would send as prefix + suffix (the client's window), so the
    prompt evaluated here is the one the next `/v1/tab` in that file starts with."""

    model_config = {"extra": "forbid"}
    path: str = Field(max_length=4096)
    text: str = Field(max_length=400_000)
    cursor: int | None = Field(None, ge=0, description="offset in `text`; default its end")
    language: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9_+#.-]*$")
    context: list[Snippet] = Field(default_factory=list, max_length=64)
    cursor_id: str = Field("default", max_length=200)
    model: str | None = None

    @model_validator(mode="after")
    def _cursor_inside(self) -> PrefillRequest:
        if self.cursor is not None and self.cursor > len(self.text):
            raise ValueError(f"cursor {self.cursor} is past the end of text "
                             f"({len(self.text)} characters)")
        return self

    def as_tab(self) -> TabRequest:
        """The completion request at the cursor whose prompt this prefills."""
        at = len(self.text) if self.cursor is None else self.cursor
        return TabRequest(path=self.path, prefix=self.text[:at], suffix=self.text[at:],
                          language=self.language, context=self.context,
                          cursor_id=self.cursor_id, model=self.model)


@dataclass
class TabResult:
    text: str
    latency_ms: float
    cached: bool  # served without a model call (LRU cache or typed-ahead)
    source: str  # "cache" | "typed_ahead" | "model" | "skipped" | "cancelled" | "miss"
    shown: bool
    confidence: float | None = None
    request_id: str | None = None
    reason: str | None = None  # why nothing is shown: low_confidence, mid_line, empty, stale
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    model_ms: float = 0.0  # the model path in the worker: prompt building, decode, scoring
    prompt_ms: float = 0.0  # of it, evaluating the prompt tokens the KV cache did not hold
    decode_ms: float = 0.0  # of it, writing the answer
    window: str = "full"  # "short": a cold document's first answer (`cold_prompt_tokens`)
    prefill_tokens: int = 0  # the full window left to prefill in the background: charged too
    id: str | None = None  # the shown suggestion's id, for feedback; kept by typed-ahead
    signals: dict | None = None  # what the show/hide decision read (tab/decision.py)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class _Entry:
    text: str  # post-processed suggestion (also kept when hidden: no second model call)
    confidence: float
    shown: bool
    id: str  # one id per model answer: its typed-ahead rest is the same suggestion
    signals: dict | None = None


@dataclass
class _Anchor:
    key: str  # path + context digest: a different file or context means a new layout
    prefix: str
    suffix: str
    before: list[int]  # the stable head the typed text T follows ...
    after: list[int]  # ... and what follows T (both per `TabSettings.layout`)


@dataclass
class _Session:
    seq: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class Answer:
    """What the model path returns for one request (picklable: it leaves the worker)."""

    text: str  # post-processed suggestion
    confidence: float
    signals: dict
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    model_ms: float
    restored: bool  # a saved KV slot was restored for it
    prompt_ms: float = 0.0  # evaluating the prompt tokens the KV cache did not hold
    decode_ms: float = 0.0  # writing the answer
    deferred: int = 0  # answered from the short window: the full one's tokens still to prefill


SessionKey = tuple[str, str]  # (tenant, cursor_id)


class TabService:
    def __init__(self, engine: Engine, settings: TabSettings) -> None:
        self.engine = engine
        self.settings = settings
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._sessions: OrderedDict[SessionKey, _Session] = OrderedDict()
        self._lock = threading.Lock()
        self.upstream = UpstreamTab(settings.model, settings.upstream,
                                    settings.upstream_timeout_s) if settings.upstream else None
        # upstream calls block on HTTP: a pool as wide as the upstream's parallel slots
        self._pool = ThreadPoolExecutor(settings.upstream_parallel, "tab-upstream") \
            if settings.upstream else None
        self._anchors = Anchors(settings.sessions)  # the upstream's (the engine's: in its worker)
        self.shown = ShownLog()  # for accept/reject feedback (tab/feedback.py)
        # prefills (and the warm-up, WARM_UP) queued or running, by (tenant, path): each
        # yields to any completion
        self._prefills: dict[tuple[str, str], threading.Event] = {}
        self.stats = {"requests": 0, "model_calls": 0, "cache_hits": 0, "typed_ahead": 0,
                      "skipped": 0, "cancelled": 0, "prompt_tokens": 0, "cached_tokens": 0,
                      "slot_restores": 0, "prefills": 0, "prefills_yielded": 0,
                      "next_calls": 0, "next_prompt_tokens": 0, "next_cached_tokens": 0,
                      "next_prefills": 0}

    # -- public --------------------------------------------------------------------------

    def next_model(self, requested: str | None) -> str:
        """The model a next-edit request runs on: the request's, else `[tab] next_model`,
        else FIM's `[tab] model`."""
        return requested or self.settings.next_model or self.settings.model

    def remote(self, model: str | None) -> bool:
        """True when `model`'s Tab calls go to the configured upstream, not the engine."""
        return self.upstream is not None and (model or self.settings.model) == self.upstream.name

    def close(self) -> None:
        if self.upstream is not None:
            self._pool.shutdown(cancel_futures=True)
            self.upstream.close()

    def lookup(self, req: TabRequest, tenant: str) -> TabResult | None:
        """Fast paths only (cache, typed-ahead, mid-line skip); None means ask the model."""
        start = time.perf_counter()
        hit = self._lookup(req, tenant)
        if hit is not None:
            source, entry = hit
            self.stats["cache_hits" if source == "cache" else "typed_ahead"] += 1
            return self._result(req, start, entry, source)
        if postprocess.mid_line_blocked(req.suffix, self.settings.mid_line_chars):
            self.stats["skipped"] += 1
            return TabResult("", _ms(start), False, "skipped", False, None, req.request_id,
                             "mid_line")
        return None

    def begin(self, req: TabRequest, tenant: str) -> tuple[_Session, int, threading.Event]:
        """Claim the session slot: cancel the previous request of this tenant's cursor."""
        with self._lock:
            session = self._sessions.pop((tenant, req.cursor_id), None) or _Session()
            self._sessions[tenant, req.cursor_id] = session
            while len(self._sessions) > self.settings.sessions:
                self._sessions.popitem(last=False)
            session.cancel.set()
            session.seq += 1
            session.cancel = threading.Event()
            for prefill in self._prefills.values():  # a prefill never delays a completion
                prefill.set()
            return session, session.seq, session.cancel

    def pending_prefills(self) -> int:
        """Prefills queued or running (a cold document's background one among them, and the
        warm-up)."""
        with self._lock:
            return len(self._prefills)

    async def warm(self) -> bool:
        """Load the Tab model and build what every request needs in its worker (the job
        `tab.state`: found done when `codeplane serve` started it, `tab/preload.py`), then
        decode once, so the first request after the server starts pays for none of it. The
        decode is a job of its own that yields to every completion that begins from now
        on, as a prefill does - dropped while it waits, or skipped when it starts - so a
        request that arrives during the warm-up waits only for what it needs itself.
        Returns whether the warm-up decoded (False: a request came first and pays for its
        own first decode)."""
        if self.remote(None):
            return False
        cancel = self._yielding(WARM_UP)
        try:
            await self.engine.run(self.settings.model, "tab.state", self.settings)
            decoded, _ = await self.engine.run(self.settings.model, "tab.warm", self.settings,
                                               cancel=cancel)
            return decoded
        except JobDropped:
            return False
        finally:
            self._release(WARM_UP, cancel)

    async def prefill(self, req: PrefillRequest, tenant: str) -> Prefilled:
        """Evaluate the prompt a completion at `req.cursor` would start with into the KV
        cache (kept per document and tenant by `slots.py`), so the next completion in that
        document reuses it. It yields: a completion that needs the model stops it between
        two chunks (or drops it while queued), as does a newer prefill of the same document.
        On an upstream there is nothing to do here (llama-server caches prompts itself)."""
        tab = req.as_tab()
        if self.remote(tab.model):
            return Prefilled(0, 0, 0, False)
        return await self._prefill(tenant, req.path, tab.model or self.settings.model,
                                   "tab.prefill", tab)

    async def prefill_next(self, req: NextRequest, tenant: str) -> Prefilled:
        """`prefill` for a next-edit request: its prompt, into the tenant's next-edit slot
        of the document (the job `tab.next_prefill`). A request that a kind of change will
        answer without the model (`tab/kinds.py`) needs no prompt: nothing is evaluated."""
        if kinds.propose(req.text, req.cursor.line, req.edits):
            return Prefilled(0, 0, 0, False)
        got = await self._prefill(tenant, req.path, self.next_model(req.model),
                                  "tab.next_prefill", req)
        self.stats["next_prefills"] += 1
        return got

    async def _prefill(self, tenant: str, path: str, model: str, job: str,
                       req: BaseModel) -> Prefilled:
        """Run the prefill `job`, yielding to completions and to a newer prefill of the
        same document."""
        try:
            return await asyncio.wrap_future(self._start_prefill(tenant, path, model, job, req))
        except JobDropped:
            return Prefilled(0, 0, 0, True)

    def _start_prefill(self, tenant: str, path: str, model: str, job: str,
                       req: BaseModel) -> Future:
        """Queue the prefill `job` (superseding one of the same document still queued or
        running) and return its future without waiting: a cold document's full window is
        prefilled this way after its short-window answer."""
        key = (tenant, path)
        cancel = self._yielding(key)

        def done(future: Future) -> None:
            self._release(key, cancel)
            failed = future.exception()
            if failed is None or isinstance(failed, JobDropped):
                self.stats["prefills"] += 1
                self.stats["prefills_yielded"] += failed is not None or future.result().yielded
            else:  # a background prefill has no caller to raise to: say it here
                log.warning("a Tab prefill failed: %s", failed)  # no path: clients own them

        future = self.engine.submit(model, job, self.settings, req, tenant, cancel=cancel)
        future.add_done_callback(done)
        return future

    def _yielding(self, key: tuple[str, str]) -> threading.Event:
        """The cancel event of background work under `key` (a document's prefill, the
        warm-up) that every completion from now on sets (`begin`); it supersedes the older
        work under the same key."""
        cancel = threading.Event()
        with self._lock:
            if (older := self._prefills.pop(key, None)) is not None:
                older.set()
            self._prefills[key] = cancel
        return cancel

    def _release(self, key: tuple[str, str], cancel: threading.Event) -> None:
        with self._lock:
            if self._prefills.get(key) is cancel:
                del self._prefills[key]

    async def complete(self, req: TabRequest, tenant: str) -> TabResult:
        start = time.perf_counter()
        fast = self._answer_fast(req, tenant, start)
        if fast is not None:
            return fast
        session, seq, cancel = self.begin(req, tenant)
        if self.remote(req.model):
            result = await asyncio.get_running_loop().run_in_executor(
                self._pool, self.generate, req, tenant, session, seq, cancel)
        else:
            began = time.perf_counter()
            try:
                got, _ = await self.engine.run(*self._job(req, tenant), cancel=cancel)
            except JobDropped:
                got = None
            result = self._settle(req, tenant, session, seq, got, began)
        result.latency_ms = _ms(start)
        return result

    def complete_sync(self, req: TabRequest, tenant: str = LOCAL_TENANT) -> TabResult:
        """Blocking variant for benchmarks and scripts (same worker, same KV cache)."""
        start = time.perf_counter()
        fast = self._answer_fast(req, tenant, start)
        if fast is not None:
            return fast
        session, seq, cancel = self.begin(req, tenant)
        result = self.generate(req, tenant, session, seq, cancel)
        result.latency_ms = _ms(start)
        return result

    def generate(self, req: TabRequest, tenant: str, session: _Session, seq: int,
                 cancel: threading.Event) -> TabResult:
        """The model path of a request that has claimed its session (blocking): on the
        upstream, or on the engine. A request superseded before its turn is dropped."""
        start = time.perf_counter()
        try:
            if cancel.is_set():
                raise JobDropped("superseded")
            if self.remote(req.model):
                got = answer(self.upstream, self.settings, req, self._anchors,
                             (tenant, req.cursor_id), cancel)
            else:
                got = self.engine.run_sync(*self._job(req, tenant), cancel=cancel)
        except JobDropped:
            got = None
        return self._settle(req, tenant, session, seq, got, start)

    def _job(self, req: TabRequest, tenant: str) -> tuple:
        """(model, job, args) of the engine call for `req`."""
        return req.model or self.settings.model, "tab.suggest", self.settings, req, tenant

    def _answer_fast(self, req: TabRequest, tenant: str, start: float) -> TabResult | None:
        """The fast-path answer, a `miss` for fast-only requests, or None: ask the model."""
        fast = self.lookup(req, tenant)
        if fast is not None or not req.fast_only:
            self.stats["requests"] += 1  # a fast-only miss is counted by its follow-up
        if fast is None and req.fast_only:
            return TabResult("", _ms(start), False, "miss", False, None, req.request_id, "miss")
        return fast

    def _settle(self, req: TabRequest, tenant: str, session: _Session, seq: int,
                got: Answer | None, start: float) -> TabResult:
        """Count the model's answer (None: dropped before it ran) and cache it, unless a
        newer keystroke of the session made it stale."""
        if got is not None:
            self.stats["model_calls"] += 1
            self.stats["prompt_tokens"] += got.prompt_tokens
            self.stats["cached_tokens"] += got.cached_tokens
            self.stats["slot_restores"] += got.restored
        if got is not None and got.deferred:  # the next request in this document finds it
            self._start_prefill(tenant, req.path, req.model or self.settings.model,
                                "tab.prefill", req)
        if got is None or session.seq != seq:
            self.stats["cancelled"] += 1
            stale = TabResult("", _ms(start), False, "cancelled", False, None, req.request_id,
                              "stale")
            if got is not None:
                _spent(stale, got)
            return stale
        min_conf = self.settings.min_confidence if req.min_confidence is None \
            else req.min_confidence
        entry = _Entry(got.text, got.confidence, bool(got.text) and got.confidence >= min_conf,
                       f"t{secrets.token_hex(8)}", got.signals)
        self._store(self._key(tenant, req, req.prefix), entry)
        result = self._result(req, start, entry, "model")
        _spent(result, got)
        result.window, result.prefill_tokens = ("short" if got.deferred else "full"), got.deferred
        return result

    # -- cache ---------------------------------------------------------------------------

    def _key(self, tenant: str, req: TabRequest, prefix: str) -> str:
        ctx = [f"{s.path}\0{s.text}" for s in req.context]
        return _digest(tenant, req.cursor_id, req.model or self.settings.model, req.path,
                       prefix, req.suffix, *ctx)

    def _store(self, key: str, entry: _Entry) -> None:
        if self.settings.cache_size == 0:
            return
        with self._lock:
            self._cache[key] = entry
            self._cache.move_to_end(key)
            while len(self._cache) > self.settings.cache_size:
                self._cache.popitem(last=False)

    def _get(self, key: str) -> _Entry | None:
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
            return entry

    def _lookup(self, req: TabRequest, tenant: str) -> tuple[str, _Entry] | None:
        exact = self._get(self._key(tenant, req, req.prefix))
        if exact is not None:
            return "cache", exact
        scan = min(self.settings.typed_ahead_chars, len(req.prefix))
        for back in range(1, scan + 1):
            entry = self._get(self._key(tenant, req, req.prefix[:-back]))
            if entry is None or not entry.shown:
                continue
            typed = req.prefix[-back:]
            if entry.text.startswith(typed) and len(entry.text) > back:
                rest = _Entry(entry.text[back:], entry.confidence, True, entry.id,
                              entry.signals)
                self._store(self._key(tenant, req, req.prefix), rest)
                return "typed_ahead", rest
            return None  # the user typed something else: the old suggestion is dead
        return None

    def _result(self, req: TabRequest, start: float, entry: _Entry, source: str) -> TabResult:
        reason = None if entry.shown else ("empty" if not entry.text else "low_confidence")
        return TabResult(entry.text if entry.shown else "", _ms(start), source != "model",
                         source, entry.shown, round(entry.confidence, 4), req.request_id,
                         reason, id=entry.id if entry.shown else None, signals=entry.signals)


class Anchors:
    """The prompt layout of each recent session, by (tenant, cursor): kept where the model
    runs (the engine's worker, or the service for an upstream), bounded like the sessions."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._anchors: OrderedDict[SessionKey, _Anchor] = OrderedDict()
        self._lock = threading.Lock()  # upstream calls run on a pool

    def get(self, key: SessionKey) -> _Anchor | None:
        with self._lock:
            return self._anchors.get(key)

    def put(self, key: SessionKey, anchor: _Anchor) -> None:
        with self._lock:
            self._anchors[key] = anchor
            self._anchors.move_to_end(key)
            while len(self._anchors) > self.size:
                self._anchors.popitem(last=False)


# -- the model path (in the model's worker for the engine, on the pool for an upstream) ------


def suggest(ctx: JobContext, settings: TabSettings, req: TabRequest, tenant: str) -> Answer:
    """The engine job `tab.suggest`: `answer` on the worker's model, with the anchors, KV
    slots and vocabulary index kept in the worker."""
    return answer(local_tab(ctx, settings, tenant), settings, req, _anchors(ctx, settings),
                  (tenant, req.cursor_id), ctx.cancel)


def prefill(ctx: JobContext, settings: TabSettings, req: TabRequest, tenant: str
            ) -> Prefilled:
    """The engine job `tab.prefill`: the prompt `suggest` would build for `req` (anchoring
    its session there), evaluated into the KV cache without decoding."""
    model = local_tab(ctx, settings, tenant)
    heal, slot = _prompt(model, settings, req, _anchors(ctx, settings),
                         (tenant, req.cursor_id))
    return model.prefill(heal.tokens, ctx.cancel, slot)


def state(ctx: JobContext, settings: TabSettings) -> None:
    """The engine job `tab.state`: build what every Tab request needs in the worker - the
    vocabulary index token healing reads (~2 s on a loaded 2-core machine) and the KV
    slots - before the first request does."""
    local_tab(ctx, settings, LOCAL_TENANT)


def warm(ctx: JobContext, settings: TabSettings) -> bool:
    """The engine job `tab.warm`: decode one token of a tiny FIM prompt (llama.cpp's first
    decode allocates its compute buffers), unless a request is already waiting
    (`ctx.cancel`): it pays for them itself. Returns whether it decoded."""
    fim = ctx.model.fim_ids
    if fim is None or ctx.cancel.is_set():
        return False
    ctx.model.generate([fim[0], *ctx.model.tokenize("x = 1\n"), fim[1], fim[2]],
                       Decoding(max_tokens=1), ctx.cancel)
    return True


def local_tab(ctx: JobContext, settings: TabSettings, tenant: str) -> LocalTab:
    """The worker's model as Tab uses it, for one tenant's request."""
    vocab = ctx.resident("tab.vocab", lambda: VocabIndex(ctx.model.vocab_pieces()))
    return LocalTab(ctx.model, vocab, worker_slots(ctx, settings), tenant)


def worker_slots(ctx: JobContext, settings: TabSettings) -> KVSlots:
    """The per-document, per-tenant KV slots of the worker's model: FIM's and next edit's
    (`nextedit.predict`), so neither's request throws away the other's prompt."""
    return ctx.resident("tab.slots", lambda: KVSlots(settings.kv_slots))


def _anchors(ctx: JobContext, settings: TabSettings) -> Anchors:
    return ctx.resident("tab.anchors", lambda: Anchors(settings.sessions))


def answer(model: TabModel, settings: TabSettings, req: TabRequest, anchors: Anchors,
           session: SessionKey, cancel: threading.Event) -> Answer:
    """Prompt, decode, post-process and score one suggestion."""
    start = time.perf_counter()
    mode = postprocess.choose_mode(req.prefix, req.suffix, settings.max_lines)
    heal, slot = _prompt(model, settings, req, anchors, session)
    uncached = model.uncached(heal.tokens)
    short = 0 < settings.cold_prompt_tokens < uncached
    if short:  # a cold document: not the seconds its full window costs (docs/tab.md)
        heal = _healed(model, settings, req, _short_anchor(model, settings, req,
                                                           anchors.get(session)))
    budget = req.max_tokens or (settings.max_tokens_multiline if mode.multiline
                                else settings.max_tokens)
    gen = model.complete(heal.tokens, heal.text, budget, [] if mode.multiline else ["\n"],
                         cancel, _line_guard(mode, req.prefix[:-len(heal.text) or None], cancel),
                         None if short else slot, heal.code_next)
    raw = gen.text[len(heal.text):] if gen.text.startswith(heal.text) else ""
    text = postprocess.clean(raw, req.prefix, req.suffix, mode)
    kept = len(model.tokenize(heal.text + text)) if text else 0
    sig = decision.signals(text, req.prefix, gen.logprobs[:kept], gen.finish_reason == "length")
    return Answer(text, decision.probability(sig), sig.to_json(), gen.prompt_tokens,
                  gen.cached_tokens, gen.completion_tokens, _ms(start), gen.restored,
                  round(gen.prompt_ms, 2), round(gen.decode_ms, 2), uncached if short else 0)


def _prompt(model: TabModel, settings: TabSettings, req: TabRequest, anchors: Anchors,
            session: SessionKey) -> tuple[Healing, str]:
    """The healed prompt and its KV slot key; moves the session's anchor if needed."""
    key = _digest(model.name, req.path, *(f"{s.path}\0{s.text}" for s in req.context))
    anchor = anchors.get(session)
    if not (anchor and anchor.key == key and anchor.suffix == req.suffix
            and req.prefix.startswith(anchor.prefix)
            and len(req.prefix) - len(anchor.prefix) <= MAX_TYPED_CHARS):
        cut = req.prefix.rfind("\n") + 1
        anchor = _anchor(model, settings, req, key, req.prefix[:cut], req.suffix)
        anchors.put(session, anchor)
    return _healed(model, settings, req, anchor), anchor.key


def _healed(model: TabModel, settings: TabSettings, req: TabRequest, anchor: _Anchor
            ) -> Healing:
    """The prompt of `req` on `anchor`: its stable pieces around the typed text, healed."""
    rest = req.prefix[len(anchor.prefix):]
    typed = model.tokenize(rest) if rest else []
    if settings.layout != "anchor":  # T ends the prefix: no token boundary to heal
        return Healing(anchor.before + typed + anchor.after, "")
    tokens = anchor.before + anchor.after + typed
    heal = back_off(tokens, typed, model.piece, model.extends)
    line = req.prefix.rsplit("\n", 1)[-1]
    return replace(heal, code_next=bool(line) and not line.strip())


def _anchor(model: TabModel, settings: TabSettings, req: TabRequest, key: str, prefix: str,
            suffix: str) -> _Anchor:
    """The stable pieces of the prompt around the typed text T, trimmed from the far
    ends (whole lines) to the token budget. `anchor`: [ctx] <pre> P0 <suf> S <mid> T;
    `psm`: [ctx] <pre> P0 T <suf> S <mid>; `spm`: [ctx] <suf> S <pre> P0 T <mid>."""
    fim = model.fim()
    if fim is None:
        raise Unsupported(f"model {model.name} has no fill-in-the-middle tokens")
    start = prefix  # the anchor's text; only its tokens are trimmed
    head = _context_tokens(model, req)
    limit = settings.max_prompt_tokens - MAX_TYPED_CHARS // 3 - len(head) - 3
    while True:
        p, s = model.tokenize(prefix), model.tokenize(suffix)
        if len(p) + len(s) <= limit or (not prefix and not suffix):
            break
        if len(prefix) >= len(suffix):
            lines = prefix.split("\n")
            prefix = "\n".join(lines[max(1, len(lines) // 4):])
        else:
            lines = suffix.split("\n")
            suffix = "\n".join(lines[: len(lines) * 3 // 4])
    return _laid_out(settings, fim, _Anchor(key, start, req.suffix, [], []), head, p, s)


def _short_anchor(model: TabModel, settings: TabSettings, req: TabRequest, anchor: _Anchor
                  ) -> _Anchor:
    """A cold document's window: whole lines of the anchor's text around the cursor within
    `cold_prompt_tokens` with the typed text, at most a quarter of them after the cursor,
    and no workspace context (that comes with the full window, prefilled meanwhile)."""
    typed = len(model.tokenize(req.prefix[len(anchor.prefix):]))
    limit = max(0, settings.cold_prompt_tokens - typed - 3)
    s = _lines_within(model, anchor.suffix.split("\n"), limit // 4, from_start=True)
    p = _lines_within(model, anchor.prefix.split("\n"), limit - len(s), from_start=False)
    return _laid_out(settings, model.fim(), replace(anchor, before=[], after=[]), [], p, s)


def _lines_within(model: TabModel, lines: list[str], limit: int, from_start: bool
                  ) -> list[int]:
    """Tokens of the most whole lines, from the start or from the end of `lines`, that fit
    in `limit` tokens (a binary search: a few tokenizer calls)."""
    def tokens(n: int) -> list[int]:
        return model.tokenize("\n".join(lines[:n] if from_start else lines[len(lines) - n:]))

    low, high = 0, len(lines)
    while low < high:
        middle = (low + high + 1) // 2
        if len(tokens(middle)) <= limit:
            low = middle
        else:
            high = middle - 1
    return tokens(low)


def _laid_out(settings: TabSettings, fim: tuple[int, int, int], anchor: _Anchor,
              head: list[int], p: list[int], s: list[int]) -> _Anchor:
    """`anchor` with its token pieces around T in the configured layout."""
    pre, suf, mid = fim
    if settings.layout == "spm":
        return replace(anchor, before=[*head, suf, *s, pre, *p], after=[mid])
    return replace(anchor, before=[*head, pre, *p], after=[suf, *s, mid])


def _context_tokens(model: TabModel, req: TabRequest) -> list[int]:
    if not req.context:
        return []
    repo = model.tokenize("<|repo_name|>", special=True)
    sep = model.tokenize("<|file_sep|>", special=True)
    if len(repo) != 1 or len(sep) != 1:  # not a Qwen-style vocab: plain comments
        text = "".join(f"# {s.path}\n{s.text}\n" for s in req.context)
        return model.tokenize(f"{text}# {req.path}\n")
    out = [*repo, *model.tokenize("workspace\n")]
    for s in req.context:  # snippet text is user data: never tokenized as control tokens
        out += [*sep, *model.tokenize(f"{s.path}\n{s.text}\n")]
    return out + [*sep, *model.tokenize(f"{req.path}\n")]


def _line_guard(mode: Mode, prefix: str, stop: threading.Event):
    """Stop decoding as soon as a multi-line suggestion has passed its block boundary."""
    if not mode.multiline:
        return None
    seen: list[str] = []

    def on_text(delta: str) -> None:
        seen.append(delta)
        if "\n" in delta and postprocess.complete_lines_done("".join(seen), prefix, mode):
            stop.set()

    return on_text


def _spent(result: TabResult, got: Answer) -> None:
    """Copy what the model call cost (tokens, time) onto the answer."""
    result.prompt_tokens, result.cached_tokens = got.prompt_tokens, got.cached_tokens
    result.completion_tokens, result.model_ms = got.completion_tokens, got.model_ms
    result.prompt_ms, result.decode_ms = got.prompt_ms, got.decode_ms


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0\1")
    return h.hexdigest()


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 2)
