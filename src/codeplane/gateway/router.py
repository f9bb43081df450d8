"""The Gateway: model groups of deployments, routing, retries, fallbacks and admission.

A request names a model group. It is admitted by that group's priority gate, then tried on
the group's deployments one at a time (weighted by least outstanding requests and latency,
skipping open circuits) until one produces a response - or, for streams, a first chunk.
Failures before that point move on to the next deployment and then down the fallback chain;
failures after it end the stream with an explicit error event. Nothing is ever retried after
the client has seen a token, so no output is duplicated.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from codeplane.config import ConfigError, Settings, checked_models, where
from codeplane.config.gateway import DeploymentConfig, GatewayConfig
from codeplane.core.metrics import Metrics
from codeplane.core.principal import LOCAL_TENANT
from codeplane.events.log import EventLog
from codeplane.gateway.admission import PriorityGate, SharedBuckets, Shed
from codeplane.gateway.deployment import Deployment
from codeplane.gateway.keys import ApiKey, KeyStore
from codeplane.gateway.metrics import GatewayMetrics
from codeplane.gateway.providers import table
from codeplane.gateway.providers.base import (
    Call,
    ProviderServices,
    UpstreamError,
    Usage,
    json_bytes,
)
from codeplane.gateway.providers.local import LocalDeployment
from codeplane.models.embed import LOCAL_MODELS
from codeplane.models.registry import UnknownModel
from codeplane.storage.tables import rate_buckets

log = logging.getLogger("codeplane.gateway")
DEFAULT_LATENCY_S = 0.05


@dataclass
class Client:
    """Who is asking: resolved key (if any), address, class, request id."""

    priority: str
    ip: str
    key: ApiKey | None = None
    request_id: str = ""


class Unavailable(Exception):
    """Every deployment of a group is cooling down."""

    def __init__(self, retry_after: float, last_error: str) -> None:
        super().__init__(last_error)
        self.retry_after, self.last_error = retry_after, last_error


class Group:
    """One logical model: its deployments and the gate in front of them."""

    def __init__(self, name: str, admission: GatewayConfig) -> None:
        self.name = name
        self.deployments: list[Deployment] = []
        self.max_inflight = admission.max_inflight
        self.gate = PriorityGate(name, admission, self.capacity)

    def capacity(self) -> float:
        now = time.monotonic()
        return min(sum(d.capacity(now) for d in self.deployments), self.max_inflight)

    def down(self) -> Unavailable | None:
        now = time.monotonic()
        if self.deployments and all(d.cooling(now) for d in self.deployments):
            wait = min(d.open_until for d in self.deployments) - now
            last = next((d.last_error for d in self.deployments if d.last_error), "")
            return Unavailable(wait, last)
        return None

    def pick(self, tried: set[str]) -> Deployment | None:
        now = time.monotonic()
        ready = [d for d in self.deployments if d.id not in tried and d.available(now)]
        if len(ready) <= 1:
            return ready[0] if ready else None
        known = [d.latency for d in ready if d.latency]
        default = min(known) if known else DEFAULT_LATENCY_S
        weights = [d.weight(now, default) for d in ready]
        return random.choices(ready, weights)[0]


class Gateway:
    """Built by the composition root with the services its providers need (`services`: the
    engine, whose models it serves by name, its metrics, and the program's embedders)."""

    def __init__(self, settings: Settings, services: ProviderServices, metrics: Metrics,
                 keys: KeyStore | None = None, events: EventLog | None = None) -> None:
        self.settings, self.services, self.engine = settings, services, services.engine
        self.events = events  # usage per request goes to the event lake when there is one
        self.groups: dict[str, Group] = {}
        for index, dep in enumerate(checked_models(settings, table.PROVIDERS)):
            self._add(dep, dep.id or f"{dep.name}#{index}")
        for spec in self.engine.registry.all():
            self._add_local(spec.name)
        # Every local embedding model serves its own name; "default" (what private search's
        # embeddings endpoint accepted) is the one the index uses.
        embedder = services.embedders.local_name if services.embedders else None
        self.aliases = {"default": embedder} if embedder else {}
        if embedder:
            for name in LOCAL_MODELS:
                self._add_local(name)
        self._check_fallbacks()
        self.metrics = GatewayMetrics(metrics.registry, self.deployments)
        self.keys = keys or KeyStore.from_settings(settings)
        # keys' request rates and client addresses' limits: shared by every replica
        self.limits = SharedBuckets(self.keys.db, rate_buckets, rate_buckets.c.name)

    # -- set-up --------------------------------------------------------------------------

    def _add(self, dep: DeploymentConfig, dep_id: str) -> None:
        dep = dep.share(self.settings.serve.workers)
        provider = table.build(dep, self.services)
        group = self.groups.setdefault(dep.name, Group(dep.name, self.settings.gateway))
        group.deployments.append(Deployment(dep, provider, self.settings.router, dep_id,
                                            dep.timeouts()))

    def _add_local(self, name: str) -> None:
        """Built-in and registered local models serve their own name unless the file
        configures deployments for that name (then it lists `provider = "local"` itself)."""
        if name not in self.groups:
            self._add(LocalDeployment(name=name), f"local:{name}")

    def _check_fallbacks(self) -> None:
        for model, chain in self.settings.router.fallbacks.items():
            for name in [model, *chain]:
                if self.group(name) is None:
                    raise ConfigError(f"router.fallbacks{where(self.settings, 'router', 'fallbacks')}"
                                      f": unknown model {name!r}; "
                                      f"known: {', '.join(sorted(self.groups))}")

    def deployments(self) -> list[Deployment]:
        return [d for g in self.groups.values() for d in g.deployments]

    def group(self, name: str) -> Group | None:
        """A group by name, or a local model by alias, or one registered since start-up."""
        name = self.aliases.get(name, name)
        if name in self.groups:
            return self.groups[name]
        try:
            spec = self.engine.spec(name)
        except UnknownModel:
            return None
        self._add_local(spec.name)
        return self.groups[spec.name]

    async def aclose(self) -> None:
        self.keys.flush()
        for dep in self.deployments():
            await dep.provider.aclose()

    # -- admission -----------------------------------------------------------------------

    def admit(self, client: Client) -> None:
        """Per-key and per-IP request rates; raise Shed (429) naming when to retry. Tokens
        are reserved later, per call (`_reserve`), when the call's size is known."""
        key, gw = client.key, self.settings.gateway
        if key is not None and key.rpm:
            self._take(f"rpm:{key.id}", key.rpm, 1, client,
                       f"key {key.name!r} is over {key.rpm} requests/min")
        if gw.ip_rpm:
            self._take(f"ip_rpm:{client.ip}", gw.ip_rpm, 1, client,
                       f"client {client.ip} is over {gw.ip_rpm} requests/min")

    def _reserve(self, call: Call, client: Client) -> None:
        """Hold the call's most likely cost (prompt estimate + max_tokens); `_settle` swaps
        in the real count."""
        call.reserved = self.hold(client, estimate_tokens(call))

    def hold(self, client: Client, tokens: int) -> int:
        """Hold `tokens` against the client address's and the key's tokens per minute and
        the key's budget (all in the database: they hold across replicas) before a call
        starts; returns what is held, for `settle`. Each is one atomic step, and a later
        refusal gives back what earlier ones took. Routes that run a model themselves (Tab,
        apply) call this too, after `admit`: one set of limits for every model route."""
        key, gw = client.key, self.settings.gateway
        if gw.ip_tpm:
            self._take(f"ip_tpm:{client.ip}", gw.ip_tpm, tokens, client,
                       f"client {client.ip} is over {gw.ip_tpm} tokens/min")
        try:
            if key is not None and (wait := self.keys.take_rate(key, tokens)) > 0:
                self.metrics.shed.labels(client.priority, "rate_limit").inc()
                raise Shed(f"key {key.name!r} is over {key.tpm} tokens/min", wait)
            if key is not None and not self.keys.reserve(key, tokens):
                self.keys.adjust_rate(key, -tokens)
                raise Shed(f"key {key.name!r} has {key.budget_tokens - self.keys.used(key)} "
                           f"of its {key.budget_tokens} budget tokens left (some may be held "
                           f"by calls in flight); this call may need {tokens}", 0,
                           code="budget_exhausted", status=403)
        except Shed:
            if gw.ip_tpm:
                self.limits.spend(f"ip_tpm:{client.ip}", gw.ip_tpm, -tokens)
            raise
        return tokens

    def _settle(self, call: Call, client: Client, used: int) -> None:
        """Replace the call's reservation by the tokens it used; a second call is a no-op."""
        held, call.reserved = call.reserved, None
        if held is not None:
            self.settle(client, held, used)

    def settle(self, client: Client, held: int, used: int) -> None:
        """Replace what `hold` held by the tokens the call used (0: it ran nothing)."""
        if client.key is not None:
            self.keys.settle(client.key, held, used)
        if self.settings.gateway.ip_tpm:
            self.limits.spend(f"ip_tpm:{client.ip}", self.settings.gateway.ip_tpm, used - held)

    def _take(self, bucket: str, per_minute: int, cost: int, client: Client,
              message: str) -> None:
        """Take `cost` from a shared bucket, or count the shed and raise Shed (429)."""
        wait = self.limits.take(bucket, per_minute, cost)
        if wait > 0:
            self.metrics.shed.labels(client.priority, "rate_limit").inc()
            raise Shed(message, wait)

    # -- routing -------------------------------------------------------------------------

    def chain(self, model: str) -> list[Group]:
        first = self.group(model)
        if first is None:
            raise KeyError(model)
        names = [first.name, *self.settings.router.fallbacks.get(first.name, [])]
        return [g for g in map(self.group, names) if g is not None]

    async def complete(self, call: Call, client: Client) -> dict[str, Any]:
        """Non-streaming request: the first deployment that answers wins."""
        return await self._route(call, client)

    async def stream(self, call: Call,
                     client: Client) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]]:
        """Streaming request: (first chunk, the rest). Errors before the first chunk raise
        here; the rest ends with an error event if the upstream fails after it."""
        return await self._route(call, client)

    async def _route(self, call: Call, client: Client):
        self._reserve(call, client)
        try:
            return await self._route_groups(call, client)
        except BaseException:
            self._settle(call, client, 0)  # nothing reached the client: nothing to charge
            raise

    async def _route_groups(self, call: Call, client: Client):
        errors: list[UpstreamError] = []
        unavailable: list[Unavailable] = []
        for group in self.chain(call.raw["model"]):
            down = group.down()
            if down:
                unavailable.append(down)
                continue
            try:
                waited = await group.gate.acquire(client.priority, group.down)
            except Unavailable as exc:
                unavailable.append(exc)
                continue
            except Shed:
                self.metrics.shed.labels(client.priority, "queue").inc()
                raise
            self.metrics.queue_wait.labels(group.name, client.priority).observe(waited)
            result = await self._try_group(group, call, client, errors)
            if result is not None:
                return result
        raise _exhausted(call.raw["model"], errors, unavailable)

    async def _try_group(self, group: Group, call: Call, client: Client,
                         errors: list[UpstreamError]):
        held = time.monotonic()
        handed_off = False
        try:
            tried: set[str] = set()
            while (dep := group.pick(tried)) is not None:
                tried.add(dep.id)
                dep.begin()
                start = time.monotonic()
                try:
                    if call.stream:
                        first, it = await _first_chunk(dep, call)
                    else:
                        async with asyncio.timeout(dep.timeout_s):
                            reply = await dep.provider.request(call)
                except (UpstreamError, TimeoutError) as exc:
                    err = exc if isinstance(exc, UpstreamError) else _timed_out(dep, call)
                    dep.end()
                    self._failed(dep, err, client)
                    if not err.retryable:
                        raise err from None
                    errors.append(err)
                    continue
                except BaseException:
                    dep.end()  # cancelled (client gone): neither success nor failure
                    raise
                latency = time.monotonic() - start
                dep.healthy(latency)
                self.metrics.latency.labels(dep.id).observe(latency)
                self.metrics.requests.labels(dep.id, group.name, "ok").inc()
                if call.stream:
                    handed_off = True
                    relay = self._relay(first, it, dep, group, call, client, held)
                    # Started now, so its cleanup (slot release, upstream close) runs even if
                    # the response is never iterated: asyncio finalizes started generators.
                    return await anext(relay), relay
                dep.end(reply.usage.total_tokens if reply.usage else 0)
                self._done(dep, client, reply.usage, call, latency)
                return reply.body
            if not tried:
                errors.append(UpstreamError(
                    429, f"no deployment of {group.name!r} can take a request now (rpm/tpm "
                         "limits, parallel caps or a recovery probe in flight)",
                    retryable=True, retry_after=1.0))
            return None
        finally:
            if not handed_off:
                group.gate.release(client.priority, time.monotonic() - held)

    def _failed(self, dep: Deployment, err: UpstreamError, client: Client) -> None:
        if err.retryable:
            dep.unhealthy(err)
            outcome = "error"
        else:
            dep.healthy(None)  # the request was bad, not the deployment
            outcome = "client_error"
        self.metrics.requests.labels(dep.id, dep.cfg.name, outcome).inc()
        log.warning("request_id=%s deployment=%s status=%s retryable=%s error=%s",
                    client.request_id, dep.id, err.status, err.retryable, err.message[:200])

    def _done(self, dep: Deployment, client: Client, usage: Usage | None, call: Call,
              seconds: float) -> None:
        usage = usage or Usage()
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        if prompt:
            self.metrics.tokens.labels(dep.id, "in").inc(prompt)
        if completion:
            self.metrics.tokens.labels(dep.id, "out").inc(completion)
        # An upstream that reports no usage is charged what was held (an upper bound).
        self._settle(call, client, usage.total_tokens or prompt + completion or call.reserved or 0)
        if self.events is not None:
            key = client.key
            self.events.record("gateway_usage", key.tenant if key else LOCAL_TENANT, {
                "model": dep.cfg.name, "deployment": dep.id, "key_id": key.id if key else None,
                "kind": call.kind, "status": 200, "latency_ms": seconds * 1000,
                "prompt_tokens": prompt, "completion_tokens": completion,
                "adapter": usage.adapter})
        log.info("request_id=%s model=%s deployment=%s kind=%s stream=%s priority=%s "
                 "tokens=%s seconds=%.4f", client.request_id, call.raw.get("model"), dep.id,
                 call.kind, call.stream, client.priority, prompt + completion, seconds)

    async def _relay(self, first: dict, it: AsyncIterator[dict | Usage], dep: Deployment,
                     group: Group, call: Call, client: Client,
                     held: float) -> AsyncIterator[dict[str, Any]]:
        ok = False
        usage: Usage | None = None
        try:
            yield first
            while True:
                try:
                    async with asyncio.timeout(dep.idle_s):
                        chunk = await anext(it)
                except StopAsyncIteration:
                    break
                except (UpstreamError, TimeoutError) as exc:
                    err = exc if isinstance(exc, UpstreamError) else UpstreamError(
                        504, f"upstream stalled for {dep.idle_s:g}s mid-stream",
                        retryable=True)
                    dep.unhealthy(err)
                    self.metrics.stream_errors.labels(dep.id).inc()
                    log.warning("request_id=%s deployment=%s stream broke after first "
                                "token: %s", client.request_id, dep.id, err.message[:200])
                    yield {"error": {"message": f"stream interrupted: {err.message}",
                                     "type": "server_error", "param": None,
                                     "code": "stream_interrupted"}}
                    return
                if isinstance(chunk, Usage):
                    usage = chunk  # for the limits, not the client
                    continue
                yield chunk
            ok = True
        finally:
            await it.aclose()
            dep.end(usage.total_tokens if usage else 0)
            group.gate.release(client.priority, time.monotonic() - held)
            if ok:
                self._done(dep, client, usage, call, time.monotonic() - held)
            else:  # cut short after tokens reached the client: keep what was held, unless
                # the upstream said what it used
                self._settle(call, client, (usage and usage.total_tokens) or call.reserved or 0)

    # -- status --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"models": [{"name": g.name, **g.gate.snapshot(),
                            "deployments": [d.status(now) for d in g.deployments]}
                           for g in self.groups.values()],
                "fallbacks": self.settings.router.fallbacks}


DEFAULT_RESERVE = 1024  # completion tokens held for a chat request that names no max_tokens
COMPLETIONS_DEFAULT = 16  # /v1/completions' own default max_tokens (OpenAI's, and ours)
BYTES_PER_TOKEN = 3  # a cautious guess (English ~4, code ~3): reservations err high


def estimate_tokens(call: Call) -> int:
    """Upper-bound guess of a call's tokens before it runs: prompt bytes / 3 plus the
    completion it may produce (`max_completion_tokens`, `max_tokens`, else a default; times
    the number of prompts for /v1/completions). Embeddings generate nothing. Reads only the
    raw body, so in-process callers need no parsed request."""
    raw = call.raw
    if call.kind == "embeddings":
        return 1 + _size(raw.get("input")) // BYTES_PER_TOKEN
    if call.kind == "completions":
        prompt = raw.get("prompt")
        outputs = len(prompt) if isinstance(prompt, list) and prompt else 1
        default = COMPLETIONS_DEFAULT
    else:
        prompt, outputs, default = [raw.get("messages"), raw.get("tools")], 1, DEFAULT_RESERVE
    asked = raw.get("max_completion_tokens") or raw.get("max_tokens") or default
    return 1 + _size(prompt) // BYTES_PER_TOKEN + int(asked) * outputs


def _size(value: Any) -> int:
    return len(json_bytes(value))


async def _first_chunk(dep: Deployment,
                       call: Call) -> tuple[dict, AsyncIterator[dict | Usage]]:
    """The stream's first chunk for the client (a usage report before it counts for nothing:
    the stream has not started)."""
    it = aiter(dep.provider.stream(call))
    try:
        async with asyncio.timeout(dep.first_token_s):
            while isinstance(first := await anext(it), Usage):
                pass
            return first, it
    except StopAsyncIteration:
        raise UpstreamError(502, "upstream stream ended before any chunk",
                            retryable=True) from None
    except BaseException:
        await it.aclose()
        raise


def _timed_out(dep: Deployment, call: Call) -> UpstreamError:
    limit = dep.first_token_s if call.stream else dep.timeout_s
    what = "first token" if call.stream else "response"
    return UpstreamError(504, f"deployment {dep.id} sent no {what} within {limit:g}s",
                         retryable=True)


def _exhausted(model: str, errors: list[UpstreamError],
               unavailable: list[Unavailable]) -> UpstreamError:
    """Every deployment and fallback failed or is cooling down: report why, and when to
    come back."""
    waits = [u.retry_after for u in unavailable] + [e.retry_after for e in errors
                                                     if e.retry_after is not None]
    retry_after = max(1.0, math.ceil(min(waits))) if waits else None
    if errors:
        last = errors[-1]
        if all(e.status == 429 for e in errors) and not unavailable:
            status, kind = 429, "rate_limit_error"
        else:
            status, kind = last.status, last.type
        return UpstreamError(status, last.message, retryable=False, code=last.code,
                             retry_after=retry_after, type=kind)
    last = next((u.last_error for u in unavailable if u.last_error), "")
    return UpstreamError(503, f"every deployment of {model!r} is cooling down after "
                              f"failures (last: {last or 'unknown'})", retryable=False,
                         retry_after=retry_after or 1.0, code="model_unavailable")
