"""Training the next-edit adapter (issue 34 item 4): replayed commits in, a GGUF LoRA out.

One loop for product and training: a case is cut from a repository's history by
`tab.replay.cases_of` (the benchmark's cutter), made into the very `NextRequest` the server
would receive, and its prompt is `tab.nextedit.prompt_parts` - the serve-time prompt builder,
in the route's default format (`tab.nextedit.DEFAULT_FORMAT`), tokenized piece by piece as
`tab.nextedit.predict` does (control pieces as control tokens, user text never). The target
is what the decode after that prompt should produce, `tab.nextedit.target` of that format,
then `<|file_sep|>` (an end token the decode stops on). A case is kept only when its target,
read as the product reads a decode (`tab.nextedit.rewrite_of`, then `parse`), is exactly
the commit's next state (or, when the next edit lies outside the window, into no suggestion:
the model learns to leave the window as it is), and when the target fits the decode's token
budget - so every example is one the product can answer right.

Supervised steps are `PolicyTrainer.imitate` (RL's warm start) on the torch copy of the base
model; the LoRA is written as llama.cpp's adapter (`models.lora.write_gguf_adapter`), which
`codeplane model add NAME --adapter FILE --base BASE` registers. A run's directory holds the
examples and the trainer's checkpoint: the same command run again resumes where it stopped.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from codeplane.config import Settings
from codeplane.models.lora import write_gguf_adapter
from codeplane.models.registry import gguf_summary
from codeplane.rl.commits import is_benchmark, repo_name
from codeplane.rl.types import DtypeName
from codeplane.tab.nextedit import (
    DEFAULT_FORMAT,
    NextRequest,
    answer_budget,
    parse,
    prompt_parts,
    rewrite_of,
    target,
    window_of,
)
from codeplane.tab.replay import Case, cases_of

FORMAT = DEFAULT_FORMAT  # the product's: the adapter learns the answer the route asks for
STOP = "<|file_sep|>"  # the answer's end: the next file's separator, one of the decode's stops
EXAMPLES = "examples.jsonl"
STEPS = "steps.jsonl"


@dataclass
class Example:
    """One training pair in token ids, with where it came from."""

    prompt_ids: list[int]
    completion_ids: list[int]
    changed: bool  # False: the next edit is outside the window, the answer copies it
    source: str  # repository name:commit:path


class NextEditError(ValueError):
    """Bad input to the training command; the message says what."""


def request_of(case: Case) -> NextRequest:
    """The request next-edit Tab would get for a case: the file after the first k hunks, the
    cursor at the end of hunk k, those hunks as the recent edits."""
    return NextRequest(path=case["path"], text=case["state"],
                       cursor={"line": case["line"], "character": 0}, edits=case["edits"],
                       format=FORMAT)


def answer_of(case: Case) -> tuple[str, bool] | None:
    """(the decode's expected output after the prompt's lead, whether it changes the window),
    or None when the product could not give this answer (the edit straddles the window's
    edge, changes the line the prompt already holds, or the parser reads it otherwise)."""
    req = request_of(case)
    start, window = window_of(case["state"], case["line"])
    end = start + len(window)
    lo, hi = case["target_lines"]
    state, after = case["state"].splitlines(keepends=True), case["target"].splitlines(
        keepends=True)
    if start <= lo and hi <= end:
        added = len(after) - len(state) + (hi - lo)
        updated = window[:lo - start] + after[lo:lo + added] + window[hi - start:]
    elif hi <= start or lo >= end:
        updated = window
    else:
        return None
    rest = target(req, updated)
    if rest is None:
        return None
    got = parse(rewrite_of(req, rest), FORMAT, req)
    changed = updated != window
    right = got.apply(case["state"]) == case["target"] if got else not changed
    return (rest, changed) if right else None


class Tokens:
    """The policy's tokenizer used as the engine uses llama.cpp's: no BOS, user text never
    read as control tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.stop = tokenizer.convert_tokens_to_ids(STOP)

    def __call__(self, text: str, control: bool = False) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False,
                              split_special_tokens=not control)["input_ids"]

    def example(self, case: Case, source: str, max_tokens: int) -> Example | None:
        """The case as token ids, or None when the product could not answer it or it is
        longer than `max_tokens` (prompt and answer)."""
        found = answer_of(case)
        if found is None:
            return None
        rest, changed = found
        req = request_of(case)
        parts, _, _ = prompt_parts(req, FORMAT)
        prompt = [t for text, control in parts for t in self(text, control)]
        completion = [*self(rest), self.stop]
        if len(completion) > answer_budget(req, self):
            return None  # the decode's budget would cut it ("length": nothing shown)
        if len(prompt) + len(completion) > max_tokens:
            return None
        return Example(prompt, completion, changed, source)


def check_repositories(specs: Iterable[str]) -> None:
    """NextEditError when a repository is one some benchmark measures on."""
    named = sorted(s for s in specs if is_benchmark(repo_name(s)))
    if named:
        raise NextEditError(f"{named} are benchmark repositories (rl/commits.py "
                            "BENCHMARK_REPOSITORIES): training reads only histories disjoint "
                            "from every benchmark")


def build_examples(gits: dict[str, Path], tokens: Tokens, cases: int, max_tokens: int,
                   seed: int) -> list[Example]:
    """Up to `cases` replayed cases per repository, those the product can answer, shuffled."""
    out: list[Example] = []
    for name, git in gits.items():
        for case in cases_of(git, cases):
            found = tokens.example(case, f"{name}:{case['commit'][:10]}:{case['path']}",
                                   max_tokens)
            if found is not None:
                out.append(found)
    random.Random(seed).shuffle(out)
    return out


@dataclass
class TrainSpec:
    """What one training run does (its directory keeps the examples and checkpoint)."""

    run: Path
    out: Path
    steps: int
    batch: int = 4
    lr: float = 2e-4
    rank: int = 16
    alpha: float = 32.0
    cases: int = 200
    max_tokens: int = 1536
    model: str = "code-small"
    seed: int = 0
    save_every: int = 5
    dtype: DtypeName = "float32"  # the frozen base's precision (`TrainerConfig.dtype`)


def load_examples(run: Path) -> list[Example]:
    path = run / EXAMPLES
    return [Example(**json.loads(line)) for line in path.read_text().splitlines()] \
        if path.is_file() else []


def save_examples(run: Path, examples: list[Example]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    staging = run / f".{EXAMPLES}.tmp"
    staging.write_text("".join(json.dumps(asdict(e)) + "\n" for e in examples))
    staging.replace(run / EXAMPLES)


def train(spec: TrainSpec, gits: dict[str, Path], settings: Settings,
          on_step: Callable[[dict], None] = lambda record: None) -> dict:
    """Build (or reload) the examples, take the supervised steps not yet taken, write the
    adapter. The examples are cut once per run directory, so a resumed run trains on the
    very batches the killed one would have."""
    from codeplane.rl.policy import model_weights
    from codeplane.rl.trainer import CHECKPOINT, PolicyTrainer, TrainerConfig
    from codeplane.rl.types import Sample

    config = TrainerConfig(model=spec.model, lr=spec.lr, lora_rank=spec.rank,
                           lora_alpha=spec.alpha, seed=spec.seed, dtype=spec.dtype)
    trainer = PolicyTrainer(config, settings)
    if (spec.run / CHECKPOINT).is_file():
        trainer.load(str(spec.run))
    examples = load_examples(spec.run)
    if not examples:
        examples = build_examples(gits, Tokens(trainer.policy.tokenizer), spec.cases,
                                  spec.max_tokens, spec.seed)
        if not examples:
            raise NextEditError("no usable next-edit case in these histories")
        save_examples(spec.run, examples)
    for step in range(trainer.version, spec.steps):
        at = step * spec.batch
        batch = [examples[i % len(examples)] for i in range(at, at + spec.batch)]
        metrics = trainer.imitate([Sample(e.prompt_ids, e.completion_ids,
                                          [0.0] * len(e.completion_ids), 0) for e in batch])
        record = {"step": step, **metrics}
        with (spec.run / STEPS).open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if (step + 1) % spec.save_every == 0 or step + 1 == spec.steps:
            trainer.save(str(spec.run))
        on_step(record)
    arch = gguf_summary(model_weights(spec.model, settings))["architecture"]
    spec.out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf_adapter(trainer.weights(), spec.out, arch, spec.alpha)
    return {"examples": len(examples), "changed": sum(e.changed for e in examples),
            "steps": trainer.version, "adapter": str(spec.out),
            "adapter_bytes": spec.out.stat().st_size}
