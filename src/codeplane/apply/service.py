"""`apply_edit`: the one entry point for CLI, HTTP route and the agent's `edit_file` tool.

Deterministic merge first (exact, fast, explainable); the local model only when that declines
and an engine is given: to rank the two readings of a tie (`rank.py`, scoring only), else to
rewrite the affected windows (`rewrite.py`). Every result is validated before it is called ok.
"""

from __future__ import annotations

import ast
import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from codeplane.apply.formats import join_lines, parse_edit, split_lines
from codeplane.apply.merge import guard_sketch_merge, merge
from codeplane.apply.validate import validate
from codeplane.core.languages import first_error_line, language_for
from codeplane.gateway.router import BYTES_PER_TOKEN
from codeplane.models.engine import ContextOverflow

if TYPE_CHECKING:
    from codeplane.models.engine import Engine

Method = Literal["auto", "deterministic", "model"]


@dataclass
class ApplyResult:
    ok: bool
    merged: str | None
    method: str  # "deterministic" | "model": the path that produced `merged` (or tried last)
    diagnostics: list[str] = field(default_factory=list)
    seconds: float = 0.0
    output_tokens: int = 0
    tokens_per_second: float = 0.0
    format: str = ""  # "sketch" | "search_replace" | "unified_diff" | "whole"
    stats: dict = field(default_factory=dict)  # model path: prompt/decode split, drafts

    def model_tokens(self) -> int:
        """What the model read and wrote: rewritten windows' prompts and output, plus the
        tokens scored to rank two readings (what a key is charged)."""
        ranking = self.stats.get("ranking") or {}
        return self.output_tokens + self.stats.get("prompt_tokens", 0) + \
            ranking.get("tokens", 0)

    def to_json(self, include_merged: bool = True) -> dict:
        data = asdict(self)
        if not include_merged:
            data.pop("merged")
        return data


def estimated_tokens(original: str, edit: str) -> int:
    """An upper-bound guess of a model merge's tokens, held against a key before it runs:
    the file and the edit as prompt, the file again as output."""
    return 1 + (2 * len(original) + len(edit)) // BYTES_PER_TOKEN


def apply_edit(original: str, edit: str, path: str, engine: Engine | None = None,
               model: str = "code-small", *, method: Method = "auto",
               speculative: bool = True) -> ApplyResult:
    """Merge `edit` (sketch, SEARCH/REPLACE, unified diff or whole file) into `original`.
    With `engine=None` only the deterministic path runs. `method="model"` skips the
    deterministic path (benchmarks); `speculative=False` decodes plainly (baseline)."""
    start = time.perf_counter()
    lines, newline, final = split_lines(original)
    parsed = parse_edit(edit, lines)
    if parsed.final_newline is not None:
        final = parsed.final_newline
    result = ApplyResult(False, None, "deterministic", format=parsed.kind)

    def join(merged: list[str]) -> str:
        return join_lines(merged, newline, final)

    if method != "model":
        outcome = merge(lines, parsed, _breaks(original, path, join))
        result.diagnostics.extend(outcome.notes)
        if outcome.merged is not None:
            _accept(result, original, join(outcome.merged), path)
        else:
            result.diagnostics.extend(f"deterministic merge declined: {r}"
                                      for r in outcome.reasons)
            if len(outcome.readings) == 2 and engine is not None and method != "deterministic":
                _pick_reading(result, engine, model, outcome.readings, path, join, original)
    if not result.ok and engine is not None and method != "deterministic":
        _model_path(result, engine, model, lines, parsed, path, speculative, join, original)
    result.seconds = time.perf_counter() - start
    return result


def _breaks(original: str, path: str, join: Callable[[list[str]], str]
            ) -> Callable[[list[str]], bool] | None:
    """Whether merged lines no longer parse while the original did; None for languages
    without a grammar. Python is also compiled by Python's own parser: tree-sitter's
    grammar recovers from some code Python rejects without an error node (a top-level
    `try:` right before a `def` as deep, pyjwt e1e4d02c5d in docs/apply.md). Lazy: only a
    declined sketch asks, so most applies parse nothing."""
    language = language_for(path)
    if language is None:
        return None
    checks = [lambda text: first_error_line(text, language) is None]
    if language == "python":
        checks.append(_compiles)
    before = functools.cache(lambda: [check(original) for check in checks])

    def breaks(merged: list[str]) -> bool:
        text = join(merged)
        return any(ok and not check(text) for ok, check in zip(before(), checks))
    return breaks


def _compiles(source: str) -> bool:
    try:
        compile(source, "<apply>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True


def _accept(result: ApplyResult, original: str, merged: str, path: str) -> None:
    problems = validate(original, merged, path)
    if problems:
        result.diagnostics.extend(f"{result.method} result rejected: {p}" for p in problems)
        return
    result.ok, result.merged = True, merged


def _pick_reading(result: ApplyResult, engine: Engine, model: str, readings: list[list[str]],
                  path: str, join, original: str) -> None:
    """A tie between two placements: the model scores both (no decoding) and the likelier
    one is taken when it is clearly likelier (`rank.MIN_MARGIN`)."""
    from codeplane.apply.rank import MIN_MARGIN

    try:
        ranking = engine.run_sync(model, "apply.rank", readings[0], readings[1])
    except ContextOverflow as exc:
        result.diagnostics.append(f"model ranking of the two readings skipped: {exc}")
        return
    result.stats["ranking"] = {"model": model, "scores": list(ranking.scores),
                               "tokens": ranking.tokens, "seconds": ranking.seconds}
    if ranking.margin < MIN_MARGIN:
        result.diagnostics.append(
            f"model ranking of the two readings is too close to call ({model}: "
            f"{ranking.margin:.1f} nats, needs {MIN_MARGIN})")
        return
    result.method = "model"
    result.diagnostics.append(
        f"the two readings were ranked by {model}: reading {ranking.best + 1} is "
        f"{ranking.margin:.1f} nats likelier ({ranking.tokens} tokens scored)")
    _accept(result, original, join(readings[ranking.best]), path)


def _model_path(result: ApplyResult, engine: Engine, model: str, lines: list[str], parsed,
                path: str, speculative: bool, join, original: str) -> None:
    result.method = "model"
    try:
        done = engine.run_sync(model, "apply.rewrite", lines, parsed, path, speculative)
    except ContextOverflow as exc:
        result.diagnostics.append(f"model path failed: {exc}")
        return
    decode_seconds = sum(r.decode_seconds for r in done.runs)
    result.output_tokens = sum(r.output_tokens for r in done.runs)
    result.tokens_per_second = result.output_tokens / decode_seconds if decode_seconds else 0.0
    result.stats |= {
        "model": model, "speculative": speculative, "windows": len(done.runs),
        "prompt_tokens": sum(r.prompt_tokens for r in done.runs),
        "cached_tokens": sum(r.cached_tokens for r in done.runs),
        "prompt_seconds": sum(r.prompt_seconds for r in done.runs),
        "decode_seconds": decode_seconds,
        "forward_passes": sum(r.forward_passes for r in done.runs),
        "drafted": sum(r.drafted for r in done.runs),
        "accepted": sum(r.accepted for r in done.runs),
    }
    if done.merged is None:
        result.diagnostics.extend(f"model path declined: {r}" for r in done.reasons)
        return
    guarded = guard_sketch_merge(lines, parsed, done.merged)
    result.diagnostics.extend(guarded.notes)
    if guarded.merged is None:
        result.diagnostics.extend(f"model result rejected: {r}" for r in guarded.reasons)
        return
    breaks = _breaks(original, path, join)
    if breaks is not None and breaks(guarded.merged):
        # Python's own parser too, not only tree-sitter (in `_accept`): the model may keep a
        # deleted function's body under a new `try:`, which tree-sitter's grammar recovers
        # from without an error node (pyjwt e1e4d02c5d, docs/apply.md).
        result.diagnostics.append("model result rejected: it does not compile (or parse), "
                                  "while the original did")
        return
    if guarded.merged == lines:
        # The deterministic path merges an edit that changes nothing by itself; one that
        # reached the model differs from the file somewhere (a re-indent the alignment,
        # which collapses whitespace, cannot place), so an unchanged file is a failure.
        result.diagnostics.append("model result rejected: it is the original file "
                                  "unchanged, but the edit differs from it")
        return
    _accept(result, original, join(guarded.merged), path)
