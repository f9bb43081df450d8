"""Would tree-sitter symbols help file localisation? A probe, not production code (it did not
pay; docs/indexing.md has the numbers).

    python bench/search/symbols_probe.py

For every localisation request, each candidate file (in the dense or BM25 top 100 chunks) gets
a bonus `w` when its tree-sitter definitions (functions, classes, methods, module and class
attributes; not locals) include a name the request writes as code (`lookup_default()`,
`Sentinel.UNSET`). The fitted production file ranking (`indexing.rank`) is otherwise unchanged;
`w = 0` is the production ranking. A BM25 variant (the request's tokens against each file's
identifier-split definitions, an FTS5 table per workspace) was tried first and lowered MRR at
every weight (tuning 0.767 -> 0.746 at 0.05, held-out 0.749 -> 0.736).
"""

from __future__ import annotations

import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from corpus import EmbeddingCache, Snapshots
from evaluate import collect, metrics
from tree_sitter_language_pack import get_parser

from codeplane.core.languages import DEF_TYPES, code_language
from codeplane.indexing import rank
from codeplane.models.embed import OnnxEmbedder

NAME_TYPES = frozenset({"identifier", "type_identifier", "property_identifier", "constant",
                        "field_identifier", "name"})
WEIGHTS = [0.0, 0.1, 0.2, 0.4, 0.8]


def definitions(rel: str, text: str) -> set[str]:
    """Lower-cased names a file defines outside function bodies."""
    language = code_language(rel)
    if not language:
        return set()
    root = get_parser(language).parse(text.encode()).root_node
    return {n.lower() for n in _names(root, in_function=False)}


def _names(node, in_function: bool) -> list[str]:
    out: list[str] = []
    for child in node.children:
        if child.is_named and child.type in DEF_TYPES:
            name = child.child_by_field_name("name")
            if name is not None and name.type in NAME_TYPES:
                out.append(name.text.decode(errors="replace"))
            function = child.type != "decorated_definition" and "class" not in child.type
            out += _names(child, in_function or function)
        elif child.type == "assignment" and not in_function:
            left = child.child_by_field_name("left")
            if left is not None and left.type in NAME_TYPES:
                out.append(left.text.decode(errors="replace"))
        elif child.child_count:
            out += _names(child, in_function)
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        items = collect(["localisation"], EmbeddingCache(OnnxEmbedder()), Path(tmp))
    items = items["localisation"]
    snaps: dict[str, Snapshots] = {}
    defining: list[list[tuple[str, float]]] = []
    for r, c in items:
        s = snaps.setdefault(r["repo"], Snapshots(r["repo"]))
        files = s.files(r["parent"])
        names = {n.lower() for n in c.query.names}
        candidates = {k[0] for k, _ in c.dense} | {k[0] for k, _ in c.lexical}
        defining.append([(p, 1.0) for p in candidates if names and p in files and names
                         & definitions(p, s.blob(files[p]).decode("utf-8", "replace"))])
    print("| symbol bonus | tuning R@5 | tuning MRR@10 | held-out R@5 | held-out MRR@10 |")
    print("|---|---|---|---|---|")
    for bonus in WEIGHTS:
        rows: dict[str, list[dict]] = defaultdict(list)
        for (r, c), hits in zip(items, defining):
            w = rank.FILE_WEIGHTS[c.query.shape]
            fused = rank.fuse_chunks(c.query, c.dense, c.lexical, c.text.get, w)
            scores = {p: s for p, s, _ in rank.rank_files(c.query, fused, w)}
            for path, _ in hits:
                scores[path] = scores.get(path, 0.0) + bonus
            ranked = sorted(scores, key=lambda p: -scores[p])
            rows[r["split"]].append(metrics(ranked, c.gold))
        mean = {split: {k: sum(m[k] for m in ms) / len(ms) for k in ("R@5", "MRR@10")}
                for split, ms in rows.items()}
        print(f"| {bonus} | {mean['tuning']['R@5']:.3f} | {mean['tuning']['MRR@10']:.3f} | "
              f"{mean['held-out']['R@5']:.3f} | {mean['held-out']['MRR@10']:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
