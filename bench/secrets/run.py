"""Recall and false-positive rate of the secret filter vs detect-secrets alone, on the labelled
corpus (`corpus.jsonl`, written by `make_corpus.py`), per split (tune / holdout).

"detect-secrets alone" is what `detect-secrets scan` reports for the sample written to a file
with its real name (default plugins and filters); "ours" is `codeplane.indexing.secretscan
.find_secret` on the file text (the whole file is withheld on a hit). Name-based ignores
(`.env`, `*.pem`, ...) are not counted here: they would only raise our recall.

    python bench/secrets/run.py [--misses]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from detect_secrets import SecretsCollection
from detect_secrets.settings import default_settings

from codeplane.indexing.secretscan import find_secret

CORPUS = Path(__file__).with_name("corpus.jsonl")


def detect_secrets_flags(samples: list[dict]) -> list[bool]:
    out = []
    with tempfile.TemporaryDirectory() as tmp, default_settings():
        for i, sample in enumerate(samples):
            path = Path(tmp) / str(i) / sample["file"]
            path.parent.mkdir()
            path.write_text(sample["text"])
            found = SecretsCollection()
            found.scan_file(str(path))
            out.append(bool(list(found)))
    return out


def rates(samples: list[dict], flags: list[bool]) -> tuple[float, float, int, int]:
    secrets = [f for s, f in zip(samples, flags) if s["label"]]
    decoys = [f for s, f in zip(samples, flags) if not s["label"]]
    return sum(secrets) / len(secrets), sum(decoys) / len(decoys), len(secrets), len(decoys)


def withheld_in_trees(roots: list[Path]) -> None:
    files = [f for root in roots for f in sorted(root.rglob("*")) if f.is_file()
             and f.suffix in {".py", ".js", ".ts", ".go", ".toml", ".yaml", ".yml", ".json", ".md"}]
    hits: dict[str, int] = defaultdict(int)
    for path in files:
        found = find_secret(path.read_text(errors="replace"))
        if found:
            hits[found] += 1
    print(f"real trees: {sum(hits.values())} of {len(files)} files withheld "
          f"({sum(hits.values()) / max(len(files), 1):.1%}): {dict(hits)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--misses", action="store_true",
                        help="list the kinds of missed secrets and flagged look-alikes")
    parser.add_argument("--tree", nargs="*", type=Path, default=[],
                        help="also count the files under these directories that would be "
                             "withheld (real code: every hit there is presumably a false alarm)")
    args = parser.parse_args()
    if args.tree:
        withheld_in_trees(args.tree)
    samples = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    started = time.perf_counter()
    ours = [find_secret(s["text"]) is not None for s in samples]
    ours_ms = (time.perf_counter() - started) * 1000 / len(samples)
    theirs = detect_secrets_flags(samples)
    print(f"corpus: {sum(s['label'] for s in samples)} secrets, "
          f"{sum(not s['label'] for s in samples)} look-alikes; ours {ours_ms:.2f} ms/sample")
    print(f"{'split':8} {'filter':16} {'recall':>7} {'FP rate':>8}  (secrets, look-alikes)")
    for split in ("tune", "holdout", "all"):
        chosen = [i for i, s in enumerate(samples) if split in ("all", s["split"])]
        part = [samples[i] for i in chosen]
        for name, flags in (("detect-secrets", theirs), ("ours", ours)):
            recall, fpr, n_pos, n_neg = rates(part, [flags[i] for i in chosen])
            print(f"{split:8} {name:16} {recall:7.3f} {fpr:8.3f}  ({n_pos}, {n_neg})")
    if args.misses:
        wrong: dict[str, int] = defaultdict(int)
        for sample, flag in zip(samples, ours):
            if flag != bool(sample["label"]):
                kind = "missed " if sample["label"] else "flagged "
                wrong[f"{kind}{sample['kind']} ({sample['split']}, {sample['file']})"] += 1
        for what, count in sorted(wrong.items()):
            print(f"  {count:3} {what}")


if __name__ == "__main__":
    main()
