"""Where Tab's model calls run: the embedded engine, or a llama.cpp server that batches.

The service builds token prompts (its cache-friendly layout needs the FIM control tokens and
the typed text's last token, to heal it) and needs each generated token's log-probability
(the show/hide decision). Both backends give exactly that:

* `LocalTab` - the server's own llama.cpp model, in its worker process (the engine job
  `tab.suggest`): per-file KV slots, healing as a logits mask, log-probabilities of the
  constrained distribution.
* `UpstreamTab` - llama.cpp's `llama-server` (`-np N -cb`: parallel slots, continuous
  batching) over its native API: `/tokenize` for tokens and pieces, `/completion` with a
  token prompt, `cache_prompt` (each slot keeps its KV cache; the server routes a prompt to
  the slot sharing most of it) and `n_probs`. Healing is a GBNF grammar that makes the output
  start with the backed-off text - a character constraint, so the first token may be longer
  than that text or a prefix of it, as with the mask. llama-server reports log-probabilities
  of the unconstrained distribution; under the constraint they are renormalised over the
  allowed tokens among the top `n_probs` (what the mask's capture reports, up to the tail).
  The OpenAI-style `/v1/completions` of a gateway deployment offers neither token prompts nor
  a grammar, hence the native API.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import httpx

from codeplane.models.engine import Decoding, LocalModel
from codeplane.tab.healing import HealingMask, VocabIndex
from codeplane.tab.slots import KVSlots

log = logging.getLogger(__name__)
TOP_N = 20  # alternatives per token from llama-server, to renormalise healed tokens
# A prefill evaluates its prompt in chunks of this many tokens and looks at its cancel event
# between two: a completion that arrives waits for one chunk at most (docs/tab.md).
PREFILL_CHUNK = 128


@dataclass
class Completion:
    text: str  # starts with the healed text when healing succeeded
    logprobs: list[float]  # one per generated token
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    restored: bool = False  # a saved KV slot was restored for the prompt (`slots.py`)
    prompt_ms: float = 0.0  # evaluating the prompt tokens the KV cache did not hold
    decode_ms: float = 0.0  # writing the answer


@dataclass
class Prefilled:
    """What a prefill did (picklable: it leaves the worker)."""

    prompt_tokens: int  # the prompt prefix to evaluate
    cached_tokens: int  # already in the KV cache (live or a restored slot) before it ran
    evaluated_tokens: int  # in the cache when it stopped (`cached_tokens` at least)
    yielded: bool  # stopped early: a completion arrived, or a newer prefill of the document
    restored: bool = False  # a saved KV slot of the tenant was restored first

    def to_json(self) -> dict:
        return dict(self.__dict__)


class UpstreamError(RuntimeError):
    """The upstream llama-server failed or is unreachable (the route answers 503)."""


class TabModel(Protocol):
    """What the Tab service needs from a model."""

    name: str

    def fim(self) -> tuple[int, int, int] | None: ...

    def tokenize(self, text: str, *, special: bool = False) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...

    def extends(self, text: bytes) -> bool: ...

    def uncached(self, tokens: list[int]) -> int:
        """How many of `tokens` a completion would evaluate (not in any KV cache)."""
        ...

    def complete(self, tokens: list[int], heal: str, max_tokens: int, stop: list[str],
                 cancel: threading.Event, on_text: Callable[[str], None] | None,
                 slot: str | None, code_next: bool = False) -> Completion: ...


class LocalTab:
    """The embedded model, in its worker process, serving one tenant's request (the KV
    slots it restores are that tenant's)."""

    def __init__(self, model: LocalModel, vocab: VocabIndex, slots: KVSlots,
                 tenant: str) -> None:
        self.model, self.vocab, self.slots, self.tenant = model, vocab, slots, tenant
        self.name = model.name

    def fim(self) -> tuple[int, int, int] | None:
        return self.model.fim_ids

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return self.model.tokenize(text, special=special)

    def piece(self, token: int) -> bytes:
        return self.model.vocab_pieces()[token]

    def extends(self, text: bytes) -> bool:
        return self.vocab.extends(text)

    def uncached(self, tokens: list[int]) -> int:
        return len(tokens) - self.slots.covered(self.model, tokens, self.tenant)

    def complete(self, tokens: list[int], heal: str, max_tokens: int, stop: list[str],
                 cancel: threading.Event, on_text: Callable[[str], None] | None,
                 slot: str | None, code_next: bool = False) -> Completion:
        """Decode after `tokens`; the KV cache is kept as `slot` of the document (None:
        not kept, a throwaway prompt such as Tab's short window for a cold document)."""
        restored = self.slots.prepare(self.model, tokens, self.tenant)
        mask = [HealingMask(self.vocab, self.model.vocab_pieces(), heal, len(tokens),
                            code_next)] if heal or code_next else []
        gen = self.model.generate(tokens, Decoding(max_tokens=max_tokens, logprobs=True,
                                                   stop=stop, processors=mask),
                                  cancel=cancel, on_text=on_text)
        if slot is not None:
            self.slots.finished(self.model, self.tenant, slot)
        return Completion(gen.text, gen.token_logprobs or [], gen.finish_reason,
                          gen.prompt_tokens, gen.cached_tokens, gen.completion_tokens,
                          restored, gen.prompt_seconds * 1000, gen.decode_seconds * 1000)

    def prefill(self, tokens: list[int], cancel: threading.Event, slot: str) -> Prefilled:
        """Evaluate `tokens` into the KV cache without decoding, chunk by chunk, stopping
        early when `cancel` is set; what was evaluated stays (a prefix still saves work)."""
        restored = self.slots.prepare(self.model, tokens, self.tenant)
        cached = done = self.model.cached_prefix(tokens)
        while done < len(tokens) and not cancel.is_set():
            done = min(len(tokens), done + PREFILL_CHUNK)
            self.model.kv.prefill(tokens[:done])
        self.slots.finished(self.model, self.tenant, slot)
        return Prefilled(len(tokens), cached, done, done < len(tokens), restored)


class UpstreamTab:
    """A llama-server serving the Tab model; thread-safe (one pooled HTTP client)."""

    def __init__(self, name: str, base_url: str, timeout_s: float) -> None:
        self.name = name
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s,
                                  trust_env=False)
        self._pieces: dict[int, bytes] = {}  # pieces of tokens this process has seen
        self._fim: tuple[int, int, int] | None = None
        self._vocab: VocabIndex | None = None  # for dynamic healing, read on first use
        self._lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    def fim(self) -> tuple[int, int, int] | None:
        if self._fim is None:
            ids = self.tokenize("<|fim_prefix|><|fim_suffix|><|fim_middle|>", special=True)
            self._fim = (ids[0], ids[1], ids[2]) if len(ids) == 3 else None
        return self._fim

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        body = {"content": text, "add_special": False, "parse_special": special,
                "with_pieces": True}
        out = []
        for tok in self._call("/tokenize", body)["tokens"]:
            piece = tok["piece"]
            self._pieces[tok["id"]] = piece.encode() if isinstance(piece, str) else bytes(piece)
            out.append(tok["id"])
        return out

    def piece(self, token: int) -> bytes:
        return self._pieces[token]  # every token the service asks about came from tokenize

    def extends(self, text: bytes) -> bool:
        return self._vocab_index().extends(text)

    def _vocab_index(self) -> VocabIndex:
        """The upstream's vocabulary, read once. llama-server has no endpoint that lists it,
        so one `/detokenize` call spells every token id followed by `<|fim_middle|>` (a
        special token Tab needs anyway) and the text is split there. Tokens that are only
        part of a UTF-8 character come back as U+FFFD: they cannot extend typed text, which
        is whole characters."""
        with self._lock:
            if self._vocab is None:
                self._vocab = VocabIndex([p.encode() for p in self._read_vocab()])
            return self._vocab

    def _read_vocab(self) -> list[str]:
        try:
            n = self._call("/v1/models", None)["data"][0]["meta"]["n_vocab"]
        except (KeyError, IndexError, TypeError):
            log.warning("Tab upstream %s does not report n_vocab: healing backs off one "
                        "token", self._http.base_url)
            return []
        sep_id = (self.fim() or (0, 0, 0))[2]
        sep = self._call("/detokenize", {"tokens": [sep_id]})["content"]
        ids = [t for i in range(n) for t in (i, sep_id)]
        parts = self._call("/detokenize", {"tokens": ids})["content"].split(sep)
        # the separator's own piece splits into two empty parts; one more ends the text
        return parts[:sep_id] + [sep] + parts[sep_id + 2:-1]

    def uncached(self, tokens: list[int]) -> int:
        """0: llama-server keeps its slots' prompts itself, out of Tab's sight, so Tab
        always sends the full window there."""
        return 0

    def complete(self, tokens: list[int], heal: str, max_tokens: int, stop: list[str],
                 cancel: threading.Event, on_text: Callable[[str], None] | None,
                 slot: str | None, code_next: bool = False) -> Completion:
        """One non-streamed completion: `cancel` and `on_text` are only honoured around it
        (a superseded answer is dropped by the service; multi-line output is cut after)."""
        body = {"prompt": tokens, "n_predict": max_tokens, "temperature": 0.0,
                "stop": stop, "n_probs": TOP_N, "cache_prompt": True,
                **({"grammar": healing_grammar(heal, code_next)} if heal or code_next else {})}
        reply = self._call("/completion", body)
        probs = reply.get("completion_probabilities") or []
        timings = reply.get("timings", {})
        return Completion(
            reply["content"], constrained_logprobs(probs, heal.encode()),
            "length" if reply.get("stop_type") == "limit" else "stop",
            reply.get("tokens_evaluated", len(tokens)), timings.get("cache_n", 0),
            reply.get("tokens_predicted", 0), prompt_ms=timings.get("prompt_ms", 0.0),
            decode_ms=timings.get("predicted_ms", 0.0))

    def _call(self, path: str, body: dict | None) -> dict:
        """POST `body` to `path` (GET when there is no body)."""
        try:
            reply = self._http.request("POST" if body is not None else "GET", path, json=body)
            reply.raise_for_status()
            return reply.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise UpstreamError(f"Tab upstream {self._http.base_url}{path}: {exc}") from None


def healing_grammar(heal: str, code_next: bool = False) -> str:
    """GBNF: the output starts with `heal`, then anything - with `code_next`, first a
    character that is not a blank (`healing.Healing.code_next`). Every character outside
    [A-Za-z0-9] is written as a \\U escape, so typed text can never change the grammar."""
    literal = "".join(ch if ch.isascii() and ch.isalnum() else f"\\U{ord(ch):08X}"
                      for ch in heal)
    parts = [f'"{literal}"'] if heal else []
    if code_next:  # the ASCII blanks, no-break and ideographic space (healing._blank_run)
        parts.append("[^ \\t\\r\\n\\x0B\\x0C\\u00A0\\u3000\\x00]")
    return f"root ::= {' '.join(parts)} [^\\x00]*"


def constrained_logprobs(probs: list[dict], heal: bytes) -> list[float]:
    """Per-token log-probabilities; while the healed bytes are being re-emitted, the chosen
    token's is renormalised over the tokens the grammar allowed among the alternatives
    (those consistent with the bytes still owed), like the local mask's capture."""
    out: list[float] = []
    emitted = b""
    for p in probs:
        lp = p["logprob"]
        owed = heal[len(emitted):]
        if owed:
            allowed = {a["id"]: a["logprob"] for a in p.get("top_logprobs", [])
                       if _consistent(bytes(a["bytes"]), owed)}
            allowed[p["id"]] = lp
            top = max(allowed.values())
            lp -= top + math.log(sum(math.exp(v - top) for v in allowed.values()))
        emitted += bytes(p.get("bytes", b""))
        out.append(lp)
    return out


def _consistent(piece: bytes, owed: bytes) -> bool:
    return bool(piece) and (piece.startswith(owed) or owed.startswith(piece))
