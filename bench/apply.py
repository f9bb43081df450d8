"""Apply benchmark: exact-match rate and speed of merging sketched edits into real files.

Data set (the `tune` set of bench/apply/sets.py, built from the projects' git histories into a
cache on first use): real commits of public Python projects. Each case is (original file,
expected file) = (parent, commit) versions of one modified file; the edits given to
`apply_edit` are derived from the real diff in several styles a model would write:

  markers    changed hunks with 3 context lines, `# ... existing code ...` between them
  tight      the same with only 1 context line (less to anchor on)
  dedented   markers style, each segment shifted to column 0, trailing spaces dropped
  search     SEARCH/REPLACE blocks (2 context lines)
  udiff      unified diff whose line numbers are off by 7 (models miscount)

Usage:
  python bench/apply/sets.py build tune                      # build the data set (cached)
  python bench/apply.py                                      # deterministic path, all cases
  python bench/apply.py --model code-small --model-cases 8   # + model path, spec vs plain

Wrap runs that use a model in `flock /tmp/codeplane-cpu.lock` on shared machines.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from codeplane.apply.align import clear_cache
from codeplane.apply.service import apply_edit


def _sets():
    """bench/apply/sets.py (the case sets, built from git histories), imported by path: the
    `bench/apply/` folder and this file share a name."""
    spec = importlib.util.spec_from_file_location(
        "bench_apply_sets", Path(__file__).with_name("apply") / "sets.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SETS = _sets()
BUCKETS, bucket_of = SETS.BUCKETS, SETS.bucket_of
STYLES = ("markers", "tight", "dedented", "search", "udiff")
MARKER = "# ... existing code ..."
_TRAILING_COMMA = re.compile(r",(?=[)\]}])")


# -- deriving edits from the real diff -------------------------------------------------------

def hunks(old: list[str], new: list[str], context: int):
    return list(difflib.SequenceMatcher(None, old, new, autojunk=False)
                .get_grouped_opcodes(context))


def sketch(old: list[str], new: list[str], context: int, dedent: bool = False) -> str:
    out: list[str] = []
    groups = hunks(old, new, context)
    for k, group in enumerate(groups):
        j1, j2 = group[0][3], group[-1][4]
        i1, i2 = group[0][1], group[-1][2]
        segment = new[j1:j2]
        if dedent:
            segment = _dedent([line.rstrip() for line in segment])
        if i1 > 0 or k > 0:
            out.append(_marker_like(segment))
        out.extend(segment)
        if k == len(groups) - 1 and i2 < len(old):
            out.append(_marker_like(segment))
    return "\n".join(out) + "\n"


def _marker_like(segment: list[str]) -> str:
    first = next((line for line in segment if line.strip()), "")
    return first[: len(first) - len(first.lstrip())] + MARKER


def _dedent(lines: list[str]) -> list[str]:
    width = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)
    return [x[width:] if x.strip() else x for x in lines]


def search_replace(old: list[str], new: list[str]) -> str:
    out = []
    for group in hunks(old, new, 2):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out += ["<<<<<<< SEARCH", *old[i1:i2], "=======", *new[j1:j2], ">>>>>>> REPLACE", ""]
    return "\n".join(out)


def udiff(old: list[str], new: list[str], drift: int = 7, old_final: bool = True,
          new_final: bool = True) -> str:
    """As `diff -u` writes it, `\\ No newline at end of file` included."""
    out = ["--- a/file.py", "+++ b/file.py"]
    eof = "\\ No newline at end of file"
    for group in hunks(old, new, 3):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{i1 + 1 + drift},{i2 - i1} +{j1 + 1 + drift},{j2 - j1} @@")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal" and (a2 < len(old) or old_final == new_final):
                out += [" " + x for x in old[a1:a2]]
                out += [eof] if a2 == len(old) and not old_final else []
                continue
            out += ["-" + x for x in old[a1:a2]]
            out += [eof] if a2 == len(old) and a2 > a1 and not old_final else []
            out += ["+" + x for x in new[b1:b2]]
            out += [eof] if b2 == len(new) and b2 > b1 and not new_final else []
    return "\n".join(out) + "\n"


def lines_of(text: str) -> list[str]:
    return (text.removesuffix("\n")).split("\n")


def edit_for(case: dict, style: str) -> str:
    old, new = lines_of(case["original"]), lines_of(case["expected"])
    return {
        "markers": lambda: sketch(old, new, 3),
        "tight": lambda: sketch(old, new, 1),
        "dedented": lambda: sketch(old, new, 3, dedent=True),
        "search": lambda: search_replace(old, new),
        "udiff": lambda: udiff(old, new, old_final=case["original"].endswith("\n"),
                               new_final=case["expected"].endswith("\n")),
    }[style]()


def final_newline_changes(case: dict) -> bool:
    """The commit adds or removes the file's final newline (a sketch cannot say so)."""
    return case["original"].endswith("\n") != case["expected"].endswith("\n")


def layout_changes(case: dict) -> bool:
    """The commit changes only the layout of some lines besides its real changes: blank
    lines added or removed where the code above and below them is unchanged, whitespace
    changed within lines (trailing whitespace stripped, a statement re-wrapped, with or
    without a trailing comma before its closing bracket). A sketch shows such lines as
    context, and context keeps the file's layout (docs/apply.md: a model redraws the blank
    lines and whitespace of context at will), so it cannot say that. Blank lines added or
    removed next to a changed line are the change's. (The product's rule,
    `guard.restore_layout`, restated here so that the benchmark's cases do not depend on
    the code it measures.)"""
    old, new = lines_of(case["original"]), lines_of(case["expected"])
    ops = difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
    layout = [op for op in ops if op[0] != "equal" and _layout_only(old[op[1]:op[2]],
                                                                    new[op[3]:op[4]])]
    real = [op for op in ops if op[0] != "equal" and op not in layout]
    if not real:
        return False  # a commit that only changes layout: the sketch's layout is the edit
    changed_old = {i for op in real for i in range(op[1], op[2])}
    changed_new = {j for op in real for j in range(op[3], op[4])}
    for _, i1, i2, j1, j2 in layout:
        if any(line.strip() for line in old[i1:i2] + new[j1:j2]):
            return True  # whitespace changed within lines of code
        near = [_nearest_code(old, i1 - 1, -1) in changed_old,
                _nearest_code(old, i2, 1) in changed_old,
                _nearest_code(new, j1 - 1, -1) in changed_new,
                _nearest_code(new, j2, 1) in changed_new]
        if not any(near):
            return True
    return False


def _layout_only(old: list[str], new: list[str]) -> bool:
    """Only whitespace differs, or a trailing comma before a closing bracket (a statement
    re-wrapped: `f(a)` split into `f(\n    a,\n)`, which the product reads as the same
    statement), and no line of code is re-indented (a block wrapped in a new one, or
    unwrapped: the sketch shows that, and the merge writes it). Code lines are compared
    without the blank lines around them: a line re-indented and the blank lines after it
    removed is a change, not layout."""
    if _tokens(old) != _tokens(new):
        return False
    code_old = [line for line in old if line.strip()]
    code_new = [line for line in new if line.strip()]
    return len(code_old) != len(code_new) or all(
        len(a) - len(a.lstrip()) == len(b) - len(b.lstrip()) for a, b in zip(code_old, code_new))


def _tokens(lines: list[str]) -> str:
    """The lines' text without whitespace, and without a trailing comma before a closing
    bracket."""
    return _TRAILING_COMMA.sub("", "".join("".join(lines).split()))


def _nearest_code(lines: list[str], at: int, step: int) -> int | None:
    while 0 <= at < len(lines) and not lines[at].strip():
        at += step
    return at if 0 <= at < len(lines) else None


def well_posed(case: dict, style: str) -> bool:
    """Whether the style can say what the commit did (one right answer). A sketch cannot
    remove or add the file's final newline (the merge keeps the file's), nor change only
    the layout of lines it shows as context (`layout_changes`), and `dedented` strips
    trailing whitespace, so a commit whose new lines carry some (a whitespace-only line in
    a docstring) has no right answer there. Such (case, style) pairs are dropped and
    counted, not scored as misses."""
    if style in ("markers", "tight", "dedented") and (final_newline_changes(case)
                                                     or layout_changes(case)):
        return False
    if style == "dedented":
        old, new = lines_of(case["original"]), lines_of(case["expected"])
        return not any(line != line.rstrip() for group in hunks(old, new, 0)
                       for tag, _, _, j1, j2 in group if tag != "equal"
                       for line in new[j1:j2])
    return True


# -- running ---------------------------------------------------------------------------------

def load() -> list[dict]:
    return SETS.load("tune")


HALVES = ({"pallets+click", "psf+requests", "pallets+flask"},
          {"python+typing_extensions", "python-attrs+attrs", "Textualize+rich"})


def kind_of(result, case: dict, failed: str = "declined") -> str:
    """exact, wrong (reported ok but not the commit's file: the worst outcome), or `failed`."""
    if not result.ok:
        return failed
    return "exact" if result.merged == case["expected"] else "wrong"


def run_deterministic(cases: list[dict], verbose: bool = False) -> None:
    """Every case in every style: exact, wrong but reported ok (the worst outcome: a wrong
    file the user may write), or declined. Thresholds were tuned on all cases, so the
    halves split by repository show whether that tuning carries over."""
    outcome: dict[tuple[str, int], list[str]] = defaultdict(list)  # (style, half) -> kinds
    by_bucket: dict[int, list[bool]] = defaultdict(list)
    times: dict[int, list[float]] = defaultdict(list)
    misses = []
    dropped: dict[str, int] = defaultdict(int)  # ill-posed (case, style) pairs: `well_posed`
    for case in cases:
        bucket = bucket_of(len(case["original"].splitlines()))
        half = 0 if case["repo"] in HALVES[0] else 1
        for style in STYLES:
            if not well_posed(case, style):
                dropped[style] += 1
                continue
            clear_cache()  # time every apply cold, as a first apply is
            result = apply_edit(case["original"], edit_for(case, style), case["path"])
            kind = kind_of(result, case)
            exact = kind == "exact"
            outcome[style, half].append(kind)
            by_bucket[bucket].append(exact)
            times[bucket].append(result.seconds)
            if not exact:
                misses.append((kind, case["repo"], case["commit"][:10], case["path"], style,
                               "" if result.ok else result.diagnostics[-1][:110]))
    every = [k for kinds in outcome.values() for k in kinds]
    print(f"deterministic: {len(cases)} real edits x {len(STYLES)} styles = {len(every)} "
          f"applies: {_shares(every)}")
    print(f"  {'style':9s} {'exact':>6s} {'wrong':>6s} {'declined':>8s}   "
          f"half A (click, requests, flask) / half B (typing_ext, attrs, rich) exact")
    for style in STYLES:
        kinds = outcome[style, 0] + outcome[style, 1]
        a, b = (_pct(outcome[style, h], "exact") for h in (0, 1))
        print(f"  {style:9s} {_pct(kinds, 'exact'):6.1f}% {_pct(kinds, 'wrong'):5.1f}% "
              f"{_pct(kinds, 'declined'):7.1f}%   {a:5.1f}% / {b:5.1f}%  ({len(kinds)}, "
              f"{dropped[style]} ill-posed dropped)")
    realistic = [k for (style, _), v in outcome.items() if style != "tight" for k in v]
    print(f"  realistic styles (all but tight), {len(realistic)} applies: {_shares(realistic)}")
    for half in (0, 1):
        kinds = [k for (_, h), v in outcome.items() if h == half for k in v]
        print(f"  half {'AB'[half]}: {_shares(kinds)}")
    for bucket, values in sorted(by_bucket.items()):
        lo, hi = BUCKETS[bucket]
        label = f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+"
        ms = sorted(1000 * t for t in times[bucket])
        print(f"  lines {label:9s} exact {100 * sum(values) / len(values):5.1f}%  "
              f"({len(values)})  median {statistics.median(ms):.1f} ms, "
              f"p95 {ms[int(0.95 * (len(ms) - 1))]:.1f} ms, max {ms[-1]:.1f} ms")
    for miss in sorted(misses, key=lambda m: m[0] != "wrong"):
        if miss[0] == "wrong" or verbose:
            print("  ", *miss)


def _pct(kinds: list[str], kind: str) -> float:
    return 100 * kinds.count(kind) / max(1, len(kinds))


def _shares(kinds: list[str]) -> str:
    return ", ".join(f"{kind} {_pct(kinds, kind):.1f}%" for kind in ("exact", "wrong",
                                                                       "declined"))


def model_cases(cases: list[dict], count: int, max_window: int) -> list[tuple[dict, int]]:
    """`count` cases whose edit fits one model window of at most `max_window` lines (original
    and edit), spread evenly over the window sizes, with their window size."""
    from codeplane.apply.formats import parse_edit
    from codeplane.apply.rewrite import open_edge, pieces_of, plan_windows

    picked = []
    for case in sorted(cases, key=lambda c: (c["commit"], c["path"])):
        lines = case["original"].split("\n")
        parsed = parse_edit(edit_for(case, "markers"), lines)
        windows = plan_windows(lines, pieces_of(parsed))
        if not isinstance(windows, list) or len(windows) != 1 or open_edge(lines, parsed):
            continue
        size = max(windows[0].end - windows[0].start, sum(map(len, windows[0].pieces)))
        if size <= max_window:
            picked.append((case, windows[0].end - windows[0].start))
    picked.sort(key=lambda p: p[1])
    if len(picked) <= count:
        return picked
    return [picked[round(i * (len(picked) - 1) / (count - 1))] for i in range(count)] \
        if count > 1 else picked[:1]


@dataclass
class ModelRun:
    """One case decoded three ways: speculative, the same loop one token per pass, and the
    engine's own greedy decoding (`LocalModel.generate`, llama.cpp's eval loop)."""
    path: str
    window: int
    exact: bool
    ok: bool
    why: str
    tokens: int
    prompt_seconds: float
    seconds: dict[str, float]  # decode seconds for tokens 2..n, per method
    passes: int
    drafted: int
    accepted: int
    same: bool  # all three produced the same tokens
    verify_seconds: float  # speculative: time inside forward passes


def decode_rate(runs: list[ModelRun], method: str) -> float:
    return sum(r.tokens - 1 for r in runs) / max(1e-9, sum(r.seconds[method] for r in runs))


def run_case(engine, model: str, case: dict, window: int, repeats: int) -> ModelRun:
    """Exactness from the product's model path (guided decoding, as `apply_edit` runs it);
    speed from unguided greedy decoding of the same windows, `repeats` times each way,
    interleaved, keeping each way's fastest decode (other jobs on a shared 2-core box only
    ever add time). Unguided, so all three ways must give the very same tokens."""
    from codeplane.apply.formats import join_lines, parse_edit, split_lines
    from codeplane.apply.rewrite import jobs, rewrite
    from codeplane.models.engine import Decoding
    from codeplane.models.speculative import decode

    lines, newline, final = split_lines(case["original"])
    parsed = parse_edit(edit_for(case, "markers"), lines)
    product = engine.run_sync(model, lambda m: rewrite(m, lines, parsed, case["path"]))
    prefill = sum(r.prompt_seconds for r in product.runs)  # the uncached prefill

    def ways(m):
        planned = jobs(m, lines, parsed, case["path"])
        spec = [decode(m, job.prompt, job.sources, job.budget) for job in planned]
        # The same prompts and token counts, one token per pass, then the engine's own.
        plain = [decode(m, job.prompt, job.sources, run.output_tokens, speculative=False)
                 for job, run in zip(planned, spec)]
        gens = [m.generate(job.prompt, Decoding(max_tokens=run.output_tokens))
                for job, run in zip(planned, spec)]
        return spec, plain, gens

    best: dict[str, float] = {}
    for _ in range(repeats):
        spec, plain, gens = engine.run_sync(model, ways)
        for method, seconds in (("spec", sum(r.decode_seconds for r in spec)),
                                ("loop", sum(r.decode_seconds for r in plain)),
                                ("engine", sum(g.decode_seconds for g in gens))):
            best[method] = min(best.get(method, seconds), seconds)
        if best["spec"] == sum(r.decode_seconds for r in spec):
            verify = sum(t for r in spec for _, _, t in r.trace)
    merged = join_lines(product.merged, newline, final) if product.merged is not None \
        else None
    return ModelRun(
        case["path"], window, merged == case["expected"], merged is not None,
        "; ".join(product.reasons), sum(r.output_tokens for r in spec), prefill, best,
        sum(r.forward_passes for r in spec), sum(r.drafted for r in spec),
        sum(r.accepted for r in spec),
        all(s.text == p.text and g.text.startswith(s.text)
            for s, p, g in zip(spec, plain, gens)), verify)


def run_model(cases: list[dict], model: str, count: int, max_window: int,
              repeats: int) -> None:
    from codeplane.config import load_settings
    from codeplane.models.engine import Engine

    engine = Engine(load_settings())
    engine.run_sync(model, lambda m: None)  # load outside the timings
    runs: list[ModelRun] = []
    for case, window in model_cases(cases, count, max_window):
        run = run_case(engine, model, case, window, repeats)
        runs.append(run)
        rate = {k: (run.tokens - 1) / max(v, 1e-9) for k, v in run.seconds.items()}
        print(f"  {run.path:34s} window {run.window:3d} lines  exact={run.exact!s:5s} "
              f"out={run.tokens:4d} tok  prefill {run.prompt_seconds:4.1f}s  tok/s spec "
              f"{rate['spec']:5.1f} loop {rate['loop']:5.1f} engine {rate['engine']:5.1f}  "
              f"passes={run.passes} accepted={run.accepted}/{run.drafted}"
              f"{'' if run.same else '  OUTPUTS DIFFER'}"
              f"{'' if run.ok else '  ' + run.why}", flush=True)
    engine.close()
    print_model_summary(runs, model)


def print_model_summary(runs: list[ModelRun], model: str) -> None:
    spec, loop, native = (decode_rate(runs, m) for m in ("spec", "loop", "engine"))
    tokens = sum(r.tokens for r in runs)
    print(f"model path ({model}, {len(runs)} cases, one window of "
          f"{min(r.window for r in runs)}-{max(r.window for r in runs)} lines, 'markers' "
          f"sketches, forced):")
    print(f"  exact match {sum(r.exact for r in runs)}/{len(runs)}, output accepted by the "
          f"checks {sum(r.ok for r in runs)}/{len(runs)}")
    print(f"  identical tokens spec = loop = engine: {sum(r.same for r in runs)}/{len(runs)}")
    print(f"  decode tokens/s (all {tokens} tokens): speculative {spec:.1f}, plain loop "
          f"{loop:.1f}, engine generate {native:.1f}; speedup {spec / loop:.2f}x over the "
          f"loop, {spec / native:.2f}x over the engine")
    same = [r for r in runs if r.same]
    if same:  # where the ways' tokens differ (near-ties, see docs), their times are not alike
        rate = {m: decode_rate(same, m) for m in ("spec", "loop", "engine")}
        print(f"  on the {len(same)} cases with identical tokens: speculative "
              f"{rate['spec']:.1f}, loop {rate['loop']:.1f}, engine {rate['engine']:.1f} "
              f"tokens/s; speedup {rate['spec'] / rate['loop']:.2f}x over the loop, "
              f"{rate['spec'] / rate['engine']:.2f}x over the engine")
    for base in ("loop", "engine"):
        ratios = sorted(r.seconds[base] / max(r.seconds["spec"], 1e-9) for r in runs
                        if r.tokens > 1)
        print(f"  per-case speedup over {base:6s}: mean {statistics.mean(ratios):.2f}x, "
              f"median {statistics.median(ratios):.2f}x, min {ratios[0]:.2f}x, "
              f"max {ratios[-1]:.2f}x")
    verify = sum(r.verify_seconds for r in runs)
    total = sum(r.seconds["spec"] for r in runs)
    print(f"  speculative: {sum(r.passes for r in runs)} forward passes for {tokens} tokens, "
          f"{sum(r.accepted for r in runs)}/{sum(r.drafted for r in runs)} draft tokens "
          f"accepted, {100 * verify / max(total, 1e-9):.0f}% of decode time in forward passes")
    print(f"  prefill (identical for all three): {sum(r.prompt_seconds for r in runs):.1f}s "
          f"for the {len(runs)} prompts")


RESCUE_STYLES = ("markers", "tight", "dedented", "search", "udiff")


def deterministic_outcomes(cases: list[dict]) -> dict[tuple[int, str], str]:
    """(case index, style) -> exact | wrong | declined for the deterministic path, cached in
    /tmp by the content of the deterministic code and the data set (it takes a minute)."""
    import hashlib

    source = Path(__file__).parents[1] / "src" / "codeplane" / "apply"
    key = hashlib.sha256((SETS.MANIFESTS / "tune.txt").read_bytes())
    for name in ("align.py", "merge.py", "formats.py", "validate.py", "service.py"):
        key.update((source / name).read_bytes())
    cache = Path(f"/tmp/codeplane-apply-det-{key.hexdigest()[:16]}.json")
    if cache.exists():
        return {(int(k.split(":")[0]), k.split(":")[1]): v
                for k, v in json.loads(cache.read_text()).items()}
    out = {}
    for index, case in enumerate(cases):
        for style in RESCUE_STYLES:
            result = apply_edit(case["original"], edit_for(case, style), case["path"])
            out[index, style] = kind_of(result, case)
    cache.write_text(json.dumps({f"{i}:{s}": v for (i, s), v in out.items()}))
    return out


def rescue_cases(cases: list[dict], outcomes: dict[tuple[int, str], str], count: int,
                 max_window: int) -> tuple[list[tuple[int, str, int]], dict[str, int]]:
    """`count` (case, style, window lines) the deterministic path declines and whose windows
    (all of them) total at most `max_window` lines, taken round-robin over the styles and
    evenly spaced over the window sizes within a style; plus how many declines fit, per
    style."""
    from codeplane.apply.formats import parse_edit
    from codeplane.apply.rewrite import pieces_of, plan_windows

    fitting: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
    for (index, style), kind in sorted(outcomes.items()):
        if kind != "declined":
            continue
        case = cases[index]
        lines = case["original"].split("\n")
        parsed = parse_edit(edit_for(case, style), lines)
        windows = plan_windows(lines, pieces_of(parsed)) if not parsed.problems else "bad"
        if isinstance(windows, list):
            size = sum(w.end - w.start for w in windows)
            if size <= max_window:
                fitting[style].append((index, style, size))
    pools = {style: sorted(found, key=lambda f: (f[2], f[0])) for style, found in
             fitting.items()}
    share = dict.fromkeys(pools, 0)
    for _ in range(count):
        open_styles = [s for s in RESCUE_STYLES if share.get(s, 0) < len(pools.get(s, ()))]
        if not open_styles:
            break
        share[min(open_styles, key=lambda s: share[s])] += 1
    picked = []
    for style, pool in pools.items():
        n = share[style]
        picked += [pool[round(i * (len(pool) - 1) / max(1, n - 1))] for i in range(n)] \
            if n > 1 else pool[len(pool) // 2:len(pool) // 2 + n]
    return picked, {style: len(pool) for style, pool in pools.items()}


def run_rescue(cases: list[dict], model: str, count: int, max_window: int) -> None:
    """The real pipeline on what the deterministic path declines: `apply_edit` with the
    engine (deterministic first, then the model path), as the product runs it."""
    from codeplane.config import load_settings
    from codeplane.models.engine import Engine

    start = time.perf_counter()
    outcomes = deterministic_outcomes(cases)
    picked, fits = rescue_cases(cases, outcomes, count, max_window)
    print(f"rescue ({model}): deterministic outcomes in {time.perf_counter() - start:.0f} s; "
          f"{len(picked)} declined cases whose windows total <= {max_window} lines", flush=True)
    engine = Engine(load_settings())
    engine.run_sync(model, lambda m: None)  # load outside the timings
    kinds: dict[str, list[str]] = defaultdict(list)
    seconds: dict[str, list[float]] = defaultdict(list)
    for index, style, size in picked:
        case = cases[index]
        result = apply_edit(case["original"], edit_for(case, style), case["path"], engine,
                            model)
        kind = kind_of(result, case, failed="rejected")
        kinds[style].append(kind)
        seconds[style].append(result.seconds)
        why = "" if result.ok else result.diagnostics[-1][:100]
        print(f"  {style:8s} {case['repo'][:16]:16s} {case['path'][-30:]:30s} window {size:3d} "
              f"{kind:8s} {result.seconds:5.1f}s out={result.output_tokens:4d} {why}",
              flush=True)
    engine.close()
    print_rescue_summary(cases, outcomes, kinds, seconds, fits)


def print_rescue_summary(cases: list[dict], outcomes: dict[tuple[int, str], str],
                         kinds: dict[str, list[str]], seconds: dict[str, list[float]],
                         fits: dict[str, int]) -> None:
    """Per style: what the model path did with the sample, and the pipeline estimate
    (deterministic exact + declined share x fitting share x rescue rate)."""
    print(f"  {'style':9s} {'n':>3s} {'exact':>5s} {'rejected':>8s} {'wrong':>5s} "
          f"{'s/case':>6s} | deterministic exact/wrong/declined (windows fit) | "
          f"pipeline exact / wrong (estimate)")
    for style in RESCUE_STYLES:
        det = [v for (_, s), v in outcomes.items() if s == style]
        declined = det.count("declined")
        got = kinds.get(style, [])
        if not got:
            continue
        rate = {k: got.count(k) / len(got) for k in ("exact", "rejected", "wrong")}
        fit = fits.get(style, 0) / max(1, declined)
        pct = {k: 100 * det.count(k) / len(det) for k in ("exact", "wrong", "declined")}
        exact = pct["exact"] + pct["declined"] * fit * rate["exact"]
        wrong = pct["wrong"] + pct["declined"] * fit * rate["wrong"]
        print(f"  {style:9s} {len(got):3d} {got.count('exact'):5d} {got.count('rejected'):8d} "
              f"{got.count('wrong'):5d} {statistics.mean(seconds[style]):6.1f} | "
              f"{pct['exact']:5.1f}% / {pct['wrong']:4.1f}% / {pct['declined']:4.1f}% "
              f"({100 * fit:3.0f}%) | {exact:5.1f}% / {wrong:4.1f}%")
    every = [k for v in kinds.values() for k in v]
    print(f"  all {len(every)}: exact {every.count('exact')}, rejected "
          f"{every.count('rejected')}, wrong {every.count('wrong')}; "
          f"{statistics.mean([t for v in seconds.values() for t in v]):.1f} s per case")


def run_ties(cases: list[dict], model: str) -> None:
    """The product pipeline (`apply_edit` with the engine) on every deterministic decline that
    is a two-place tie: the model ranks the two readings (`apply/rank.py`); when that is too
    close to call, the model path runs as usual. Then the pipeline's exact rate per style."""
    from codeplane.apply.formats import parse_edit, split_lines
    from codeplane.apply.merge import merge
    from codeplane.config import load_settings
    from codeplane.models.engine import Engine

    outcomes = deterministic_outcomes(cases)
    ties = []
    for (index, style), kind in sorted(outcomes.items()):
        lines = split_lines(cases[index]["original"])[0]
        if kind == "declined" and len(merge(lines, parse_edit(
                edit_for(cases[index], style), lines)).readings) == 2:
            ties.append((index, style))
    print(f"ties ({model}): {len(ties)} of {list(outcomes.values()).count('declined')} "
          f"deterministic declines are two-place ties", flush=True)
    engine = Engine(load_settings())
    engine.run_sync(model, lambda m: None)  # load outside the timings
    gained: dict[str, list[str]] = defaultdict(list)
    for index, style in ties:
        case = cases[index]
        result = apply_edit(case["original"], edit_for(case, style), case["path"], engine,
                            model)
        kind = kind_of(result, case)
        gained[style].append(kind)
        ranking = result.stats.get("ranking", {})
        margin = abs(ranking["scores"][0] - ranking["scores"][1]) if ranking else 0.0
        print(f"  {style:8s} {case['repo'][:16]:16s} {case['commit'][:10]} "
              f"{case['path'][-30:]:30s} {kind:8s} margin {margin:5.1f} nats, "
              f"{ranking.get('tokens', 0):4d} tokens scored in {ranking.get('seconds', 0):4.1f} s"
              f" (apply {result.seconds:4.1f} s)", flush=True)
    engine.close()
    print(f"  {'style':9s} deterministic exact/wrong -> with the ranking exact/wrong")
    for style in RESCUE_STYLES:
        det = [v for (_, s), v in outcomes.items() if s == style]
        exact, wrong = det.count("exact"), det.count("wrong")
        more = gained.get(style, [])
        print(f"  {style:9s} {100 * exact / len(det):5.1f}% / {100 * wrong / len(det):3.1f}% -> "
              f"{100 * (exact + more.count('exact')) / len(det):5.1f}% / "
              f"{100 * (wrong + more.count('wrong')) / len(det):3.1f}%")
    for label, keep in (("realistic styles (all but tight)", lambda s: s != "tight"),
                        ("all styles", lambda s: True)):
        det = [v for (_, s), v in outcomes.items() if keep(s)]
        more = [k for s, v in gained.items() if keep(s) for k in v]
        print(f"  {label}: {100 * (det.count('exact') + more.count('exact')) / len(det):.1f}% "
              f"exact, {100 * (det.count('wrong') + more.count('wrong')) / len(det):.1f}% "
              f"wrong ({len(det)} applies)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="also run the model path with this local model")
    parser.add_argument("--model-cases", type=int, default=8)
    parser.add_argument("--max-window", type=int, default=80)
    parser.add_argument("--verbose", action="store_true", help="also list every decline")
    parser.add_argument("--model-only", action="store_true",
                        help="skip the deterministic run (with --model)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="model path: decode each case this often, keep the fastest")
    parser.add_argument("--rescue", type=int, default=0, metavar="N",
                        help="with --model: run the pipeline on N cases the deterministic "
                             "path declines (windows total <= --max-window lines)")
    parser.add_argument("--ties", action="store_true",
                        help="with --model: the pipeline on every deterministic decline that "
                             "is a two-place tie (the model ranks the two readings)")
    args = parser.parse_args()
    try:
        cases = load()
    except SETS.SetError as exc:
        parser.exit(2, f"error: {exc}\n")
    if not (args.model and args.model_only):
        start = time.perf_counter()
        run_deterministic(cases, args.verbose)
        print(f"  ({time.perf_counter() - start:.1f} s total)")
    if args.model and args.ties:
        run_ties(cases, args.model)
    elif args.model and args.rescue:
        run_rescue(cases, args.model, args.rescue, args.max_window)
    elif args.model:
        run_model(cases, args.model, args.model_cases, args.max_window, args.repeats)


if __name__ == "__main__":
    main()
