"""Greedy decoding with the original text as the draft ("speculative edits").

A rewrite of a code region is mostly a copy of that region, so the prompt itself is an
excellent draft: find where the output currently is in the original (prompt-lookup style),
propose the next K original tokens, and let one forward pass check them all. Every position of
that batch needs logits, which `Llama.eval` only keeps with `logits_all=True` (the engine's
models are created without it, and re-creating them would cost a second copy of the weights),
so this module verifies through the model's KV cache (`models/kv.py`, which drives
llama.cpp's batch API on the shared `Llama`): eval [last token, draft...] with logits on
every row, commit the longest prefix the model agrees with, drop the rest. With greedy
verification the output is exactly what plain greedy decoding would produce; only the number
of passes changes. `KVCache` keeps the cache's record the way `Llama.generate` expects, so
the engine's prefix reuse stays correct for whoever uses the model next.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from codeplane.models.engine import ContextOverflow, LocalModel

NGRAM_MAX = 4  # lookup keys: the output's last 1..4 tokens
MATCH_CAP = 48  # how far back a candidate's agreement with the output is measured
PIECE_TRUST = 6  # an edit piece followed from its start for this many tokens wins
# Below MIN_AGREE tokens of agreement the output is new text (the model writes the edit): one
# token per pass, the cheapest. Otherwise at most DRAFT_PER_AGREE draft tokens per agreed one.
MIN_AGREE, DRAFT_PER_AGREE = 3, 4
# Cost of one forward pass by its rows (logits on every row), in one-row passes, measured
# with bench/spec_ceiling.py on code-small (docs/apply.md, "The ceiling, measured";
# code-medium's rows cost relatively more, so for it the table favours long drafts a little).
# llama.cpp's CPU kernels take rows in tiles of 4: a 4k+1-row pass pays a whole one-row pass
# for its last row, so drafts are sized to fill tiles (3, 7, 11, ... tokens).
PASS_COST = {1: 1.0, 2: 1.7, 3: 2.15, 4: 2.45, 8: 4.0, 12: 5.2, 16: 6.1, 24: 8.6, 32: 10.6,
             48: 15.2, 64: 20.0}
# Draft acceptance is estimated per decode from recent drafts (older ones weigh DECAY times
# less per draft), starting from PRIOR_ACCEPT worth PRIOR_WEIGHT draft tokens.
PRIOR_ACCEPT, PRIOR_WEIGHT, DECAY = 0.97, 10.0, 0.9
_END = re.compile(r"(^|\n)[ \t]*```")


@dataclass
class Decoded:
    text: str  # output up to (not including) the closing fence
    finish_reason: str  # "stop" | "length" | "rejected" (the guide refused a line)
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    prompt_seconds: float
    decode_seconds: float
    forward_passes: int
    drafted: int
    accepted: int
    forced: int  # output tokens the guide forced (evaluated, not chosen by the model)
    trace: list[tuple[int, int, float]] = field(default_factory=list)  # rows, agreed, s
    logprobs: list[float] = field(default_factory=list)  # per output token, when asked

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


class Drafter:
    """Prompt lookup over several sources: the original region first, then the edit's
    pieces. The output is the region with the pieces spliced in, so the source to follow is
    the one that agrees with the output furthest back; a piece that the output has followed
    from its first token is preferred over the region (that is how the drafts run through the
    changed lines instead of missing at each). A draft never crosses a source's end."""

    def __init__(self, sources: list[list[int]]) -> None:
        self.tokens: list[int] = []
        self.starts: list[int] = []  # start of the source each position belongs to
        self.piece: list[bool] = []
        for number, source in enumerate(sources):
            begin = len(self.tokens)
            self.tokens += [*source, -1]  # -1 ends a source: no match or draft crosses it
            self.starts += [begin] * (len(source) + 1)
            self.piece += [number > 0] * (len(source) + 1)
        self.ends: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for n in range(1, NGRAM_MAX + 1):
            for end in range(n, len(self.tokens) + 1):
                key = tuple(self.tokens[end - n:end])
                if -1 not in key:
                    self.ends[key].append(end)
        self.expect = 0  # where the next output token probably comes from

    def propose(self, context: list[int], size: int) -> tuple[list[int], int]:
        """Up to `size` draft tokens continuing `context`, and how many tokens of `context`
        the chosen place agrees with (the evidence for the draft)."""
        for n in range(min(NGRAM_MAX, len(context)), 0, -1):
            # A place with nothing after it (a piece's end) proposes nothing: look further.
            ends = [e for e in self.ends.get(tuple(context[-n:]), ()) if self.tokens[e] != -1]
            if ends:
                break
        else:
            return [], 0
        end, agree = max(((e, self._agreement(context, e)) for e in ends),
                         key=lambda c: (c[1], c[0] == self.expect, -abs(c[0] - self.expect)))
        self.expect = end
        draft = self.tokens[end:end + size]
        if -1 in draft:
            draft = draft[:draft.index(-1)]
        return draft, min(agree, MATCH_CAP)

    def _agreement(self, context: list[int], end: int) -> int:
        """How many trailing tokens of `context` equal the source before `end`; a piece
        followed from its very start counts as full agreement."""
        k, limit = 0, min(MATCH_CAP, len(context), end - self.starts[end - 1])
        while k < limit and self.tokens[end - 1 - k] == context[-1 - k]:
            k += 1
        if self.piece[end - 1] and k == end - self.starts[end - 1] and k >= PIECE_TRUST:
            return MATCH_CAP + 1
        return k

    def advance(self, accepted: int) -> None:
        self.expect += accepted + 1


class Guide(Protocol):
    """What `decode` asks about the output, line by line (see `rewrite.Watch`)."""

    def feed(self, line: str) -> bool:
        """Take one completed output line; False: the output can no longer be used."""

    def force(self, stopping: bool) -> str | None:
        """Lines that must come next (ending in a newline), or None to let the model go on;
        `stopping`: the model is about to end its answer."""

    def repair(self, line: str) -> str | None:
        """Lines that replace a refused `line` and the pending blank lines before it, or
        None: the output can no longer be used."""

    @property
    def blanks(self) -> list[str]:
        """Blank lines read but not yet taken (they wait for the next line)."""


def decode(model: LocalModel, prompt: list[int], sources: list[list[int]], max_tokens: int,
           speculative: bool = True, guide: Guide | None = None,
           logprobs: bool = False) -> Decoded:
    """Greedy decode after `prompt` until a closing ``` fence, an end token or `max_tokens`.
    `sources` are the drafts (the original region, then the edit's pieces);
    `speculative=False` is the plain baseline through the very same loop, one token per
    forward pass. A `guide` sees every completed line and may stop the decode (an output
    that can no longer be used costs no more tokens) or force the next lines, which are
    then evaluated as one batch like an accepted draft. `logprobs` also records each
    chosen token's log-probability (next-edit Tab's show/hide signals; forced tokens get 0),
    a log-softmax over the vocabulary per kept row that apply does not pay for."""
    kv = model.kv
    if len(prompt) + 1 > model.n_ctx:
        raise ContextOverflow(len(prompt), model.n_ctx)
    budget = min(max_tokens, model.n_ctx - len(prompt) - 1)
    start = time.perf_counter()
    cached = kv.prefill(prompt)
    pending = int(np.argmax(kv.last_logits()))
    lps: list[float] = []
    pending_lp = kv.last_logprob() if logprobs else 0.0
    prompt_done = time.perf_counter()
    drafter = Drafter(sources)
    history = prompt[-MATCH_CAP:]  # the pre-filled head lines are part of the copy
    acceptance = _Acceptance()
    out: list[int] = []
    trace: list[tuple[int, int, float]] = []
    drafted = accepted = forced = 0
    lines = _Lines(model, guide)
    finish = "length"
    fresh = 1  # tokens added since the last look at the output
    while True:
        committed = len(out)  # `pending` is not in the KV cache yet
        stopping = pending in model.stop_ids
        if not stopping:
            out.append(pending)
            lps.append(pending_lp)
            stopping = bool(_END.search(model.detokenize(out[-(fresh + 64):])))
        verdict = lines.check(out, stopping)
        if verdict is False:
            finish = "rejected"
            break
        if verdict is not True:  # forced lines replace everything after out[:keep]
            keep, tokens = verdict
            base = min(keep, committed)
            if keep + len(tokens) >= budget or keep - base + len(tokens) >= kv.n_batch:
                break  # no room for the forced lines: truncated ("length")
            began = time.perf_counter()
            kv.truncate(kv.n_past - (committed - base))
            batch = out[base:keep] + tokens
            preds = kv.verify(batch)
            kv.commit(batch)
            trace.append((len(batch), len(batch) - 1, time.perf_counter() - began))
            out = out[:keep] + tokens
            lps = lps[:keep] + [0.0] * len(tokens)
            forced += len(tokens)
            pending_lp = 0.0
            pending, fresh = int(preds[-1]), len(tokens) + 1
            continue
        if stopping or len(out) >= budget:
            finish = "stop" if stopping else "length"
            break
        room = min(budget - len(out), model.n_ctx - kv.n_past - 1, kv.n_batch - 1)
        draft = _draft(drafter, history + out, room, acceptance.rate) if speculative else []
        began = time.perf_counter()
        preds = kv.verify([pending, *draft])
        agreed = _agreement(draft, preds, model.stop_ids)
        if logprobs:
            *kept, pending_lp = kv.chosen_logprobs(agreed + 1)
            lps.extend(kept)
        kv.commit([pending, *draft[:agreed]])
        trace.append((len(draft) + 1, agreed, time.perf_counter() - began))
        drafted, accepted = drafted + len(draft), accepted + agreed
        out.extend(draft[:agreed])
        drafter.advance(agreed)
        acceptance.add(len(draft), agreed)
        pending, fresh = int(preds[agreed]), agreed + 1
    text = model.detokenize(out)
    fence = _END.search(text)
    if fence:
        text = text[:fence.start() + len(fence.group(1))]
    end = time.perf_counter()
    return Decoded(text, finish, len(prompt), cached, len(out), prompt_done - start,
                   end - prompt_done, len(trace), drafted, accepted, forced, trace,
                   lps if logprobs else [])


class _Lines:
    """Hands each newly completed output line to the guide, once, and turns the lines it
    forces into tokens."""

    def __init__(self, model: LocalModel, guide: Guide | None) -> None:
        self.model, self.guide, self.fed, self.tokens = model, guide, 0, 0

    def check(self, out: list[int], stopping: bool) -> bool | tuple[int, list[int]]:
        """True: go on; False: the guide refused a line; (keep, tokens): replace the output
        after out[:keep] by these forced tokens."""
        if self.guide is None or not stopping and "\n" not in self.model.detokenize(
                out[self.tokens:]):
            return True
        text = self.model.detokenize(out)
        if stopping:
            fence = _END.search(text)
            text = text[:fence.start() + len(fence.group(1))] if fence else text + "\n"
        complete = text.split("\n")[:-1]
        self.tokens = len(out)
        more = None
        for line in complete[self.fed:]:
            if not self.guide.feed(line):
                blanks = len(self.guide.blanks)
                more = self.guide.repair(line)
                if more is None:
                    return False
                complete = complete[:self.fed - blanks]
                self.fed -= blanks
                break
            self.fed += 1
        more = more if more is not None else self.guide.force(stopping)
        if more is None:
            return True
        done = "".join(line + "\n" for line in complete)
        keep = len(out)
        while keep and not done.startswith(self.model.detokenize(out[:keep])):
            keep -= 1
        self.tokens = keep
        return keep, self.model.tokenize(done[len(self.model.detokenize(out[:keep])):] + more)


def _draft(drafter: Drafter, context: list[int], room: int, accept: float = PRIOR_ACCEPT
           ) -> list[int]:
    """The draft worth its pass: the longer the output has agreed with its source, the
    longer it may be; its length maximises the expected tokens per unit of pass cost when
    each draft token is accepted with probability `accept` (a draft stops at its first
    rejected token)."""
    draft, agree = drafter.propose(context, min(room, max(PASS_COST) - 1))
    if agree < MIN_AGREE:
        return []
    draft = draft[:DRAFT_PER_AGREE * agree]
    best, size = 1.0, 0
    for rows, cost in PASS_COST.items():
        if rows - 1 > len(draft):
            break
        expected = sum(accept ** i for i in range(rows))  # 1 + p + ... + p^(rows-1)
        if expected / cost > best:
            best, size = expected / cost, rows - 1
    return draft[:size]


class _Acceptance:
    """Recent share of draft tokens the model accepted (a draft's tokens after its first
    rejected one are not counted: they were never tested)."""

    def __init__(self) -> None:
        self.hits, self.tries = PRIOR_ACCEPT * PRIOR_WEIGHT, PRIOR_WEIGHT

    def add(self, drafted: int, agreed: int) -> None:
        if drafted:
            self.hits = self.hits * DECAY + agreed
            self.tries = self.tries * DECAY + agreed + (agreed < drafted)

    @property
    def rate(self) -> float:
        return self.hits / self.tries


def _agreement(draft: list[int], preds: np.ndarray, stop_ids: set[int]) -> int:
    agreed = 0
    while agreed < len(draft) and preds[agreed] == draft[agreed] \
            and draft[agreed] not in stop_ids:
        agreed += 1
    return agreed
