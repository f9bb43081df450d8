"""Adapt bge-small to code (issue 19): docstring -> function pairs from PyPI projects disjoint
from the search benchmark, and LoRA training: the query side against fixed chunk vectors, or
one shared encoder for both (`--side both`: how the shipped bge-small-code was made).

    python bench/search/finetune.py download     # the sdists of finetune_projects.txt (PyPI)
    python bench/search/finetune.py pairs        # -> WORK/pairs.jsonl + 500-pair validation.jsonl
    nice -n 10 python bench/search/finetune.py vectors --minutes 20   # int8 ONNX vectors
    nice -n 10 python bench/search/finetune.py train --minutes 25     # -> WORK/query_delta.npz
    python bench/search/finetune.py build        # -> WORK/query.onnx (the delta merged, int8)
    python bench/search/evaluate.py --fit --query-embedder /tmp/codeplane-finetune/query.onnx
    python bench/search/finetune.py train --side both --minutes 45 --batch 32 --lr 2e-4 --every 40
    python bench/search/finetune.py build --delta both_delta.npz   # -> WORK/both.onnx

A pair is what the product would see: the query is a function docstring's first sentence
(`build.docstring_query`, the benchmark's rule); the document is the `Chunk.embed_text` of the
chunk holding that function, chunked by the production chunker from a file whose docstrings are
blanked (`corpus.blank_docstrings`, as the benchmark's corpus is). The torch model is the
wheel's int8 ONNX dequantized (`onnx_delta.torch_state`), so training starts from exactly the
weights the unadapted model runs. Results: docs/search.md, "Adapting the embedder to code"
(query side) and "Two-tower adaptation" (both sides, shipped).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from build import docstring_query, is_test, order
from corpus import IGNORED, SKIP_DIRS, SKIP_PARTS, EmbeddingCache, blank_docstrings

from codeplane.indexing.chunker import chunk_text
from codeplane.models.embed import OnnxEmbedder, bge_files
from codeplane.models.onnx_delta import build_adapted, torch_state

WORK = Path("/tmp/codeplane-finetune")
PROJECTS = HERE / "finetune_projects.txt"
PER_PROJECT = 250  # a few huge projects must not set the style; a pair costs ~0.1 s of ONNX
VALIDATION = 500
QUERY_TOKENS = 64
TARGETS = ["query", "key", "value", "dense"]  # every attention and FFN linear of BertLayer


def listed(path: Path) -> list[str]:
    """The entries of a project list: one a line, `#` starts a comment."""
    return [entry for line in path.read_text().splitlines() if (entry := line.split("#")[0].strip())]


def download(names: list[str]) -> None:
    """pip's own client fetches each pinned sdist (PyPI only, no dependencies, no wheels)."""
    (WORK / "sdists").mkdir(parents=True, exist_ok=True)
    for spec in names:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", spec, "-d", str(WORK / "sdists")], check=True)


def sources(archive: Path) -> Iterator[tuple[str, str]]:
    """(path inside the project, text) of the .py files the indexer would see, minus tests and
    docs as the benchmark's corpus (corpus.Snapshots.files) leaves them out."""
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            members = [(n, lambda n=n: zf.read(n)) for n in zf.namelist()]
            yield from _filtered(members)
    else:
        with tarfile.open(archive) as tf:
            members = [(m.name, lambda m=m: tf.extractfile(m).read())
                       for m in tf.getmembers() if m.isfile()]
            yield from _filtered(members)


def _filtered(members: list) -> Iterator[tuple[str, str]]:
    for name, read in members:
        path = name.split("/", 1)[-1]
        if not path.endswith(".py") or path.startswith(SKIP_DIRS) or is_test(path) or \
                IGNORED.match_file(path) or SKIP_PARTS & set(path.split("/")[:-1]):
            continue
        yield path, read().decode("utf-8", errors="replace")


def file_pairs(path: str, text: str) -> list[dict]:
    """query -> embed_text of the chunk holding each documented function of one file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    queries = [(q, node.lineno) for node in ast.walk(tree) if (q := docstring_query(node))]
    if not queries:
        return []
    chunks = chunk_text(path, blank_docstrings(path, text))
    out = []
    for query, line in queries:
        chunk = next((c for c in chunks if c.start_line <= line <= c.end_line), None)
        if chunk is not None:
            out.append({"query": query, "text": chunk.embed_text(path)})
    return out


def build_pairs() -> None:
    """All projects' pairs, capped per project, deduplicated (`unique_pairs`; a query seen
    twice is dropped, as build.py does), then a fixed validation split by hash."""
    rows: list[dict] = []
    for archive in sorted((WORK / "sdists").iterdir()):
        project = archive.name.rsplit("-", 1)[0]
        found = [dict(p, project=project) for path, text in sources(archive)
                 for p in file_pairs(path, text)]
        rows += sorted(found, key=lambda p: order(p["query"]))[:PER_PROJECT]
        print(f"{project}: {len(found)} pairs", file=sys.stderr)
    write_split(unique_pairs(sorted(rows, key=lambda r: order(r["query"]))), "", VALIDATION)


def unique_pairs(rows: list[dict]) -> list[dict]:
    """`rows` in their order without queries seen twice, and one pair per chunk text (so no
    in-batch negative is secretly a positive)."""
    seen: dict[str, int] = {}
    for r in rows:
        seen[r["query"]] = seen.get(r["query"], 0) + 1
    unique: dict[str, dict] = {}
    for r in rows:
        if seen[r["query"]] == 1:
            unique.setdefault(r["text"], r)
    return list(unique.values())


def write_split(pairs: list[dict], prefix: str, validation: int) -> None:
    """The first `validation` pairs to WORK/{prefix}validation.jsonl, the rest to
    WORK/{prefix}pairs.jsonl."""
    WORK.mkdir(parents=True, exist_ok=True)
    for name, part in (("validation", pairs[:validation]), ("pairs", pairs[validation:])):
        with (WORK / f"{prefix}{name}.jsonl").open("w") as fh:
            fh.writelines(json.dumps(p) + "\n" for p in part)
    projects = {p["project"] for p in pairs}
    print(f"{len(pairs)} pairs from {len(projects)} projects "
          f"({len(pairs) - validation} train, {validation} validation)")


def embed_pairs(minutes: float) -> None:
    """Query and chunk vectors of the pairs from the wheel's int8 ONNX (cached by text in
    corpus.EmbeddingCache, so a re-run resumes), training chunks in blocks of 256 until the
    time budget is spent: the pairs are hash-ordered, so the embedded prefix spans the projects
    (the capped big ones, whose kept pairs are their lowest hashes, are over-represented)."""
    cache = EmbeddingCache(OnnxEmbedder(name="bge-small"))  # what torch_model() starts from
    deadline = time.time() + 60 * minutes
    out = {}
    for name in ("validation", "pairs"):
        rows = load_pairs(name)
        done = 0
        while done < len(rows) and (name == "validation" or time.time() < deadline):
            cache.vectors([r["text"] for r in rows[done:done + 256]])
            done = min(len(rows), done + 256)
            print(f"{name}: {done} chunks", file=sys.stderr, flush=True)
        out[f"{name}_q"] = cache.vectors([r["query"] for r in rows[:done]])
        out[f"{name}_d"] = cache.vectors([r["text"] for r in rows[:done]])
    np.savez(WORK / "vectors.npz", **out)
    print(f"{len(out['pairs_q'])} training pairs embedded")


def torch_model(dropout: bool = True):
    """bge-small as a transformers BertModel with the wheel's int8 weights dequantized
    (`onnx_delta.torch_state`), so training starts from exactly what the product runs.
    `dropout=False` drops BERT's dropout: on CPU it costs half the forward pass (Bernoulli
    masks, and attention dropout forces SDPA's slow math path)."""
    import onnx
    import torch
    from transformers import BertConfig, BertModel

    folder = bge_files()
    state = torch_state(onnx.load(str(folder / "model.onnx")))
    config = BertConfig.from_pretrained(str(folder))
    if not dropout:
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    bert = BertModel(config, add_pooling_layer=False)
    missing, unexpected = bert.load_state_dict(
        {k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    if [m for m in missing if "position_ids" not in m] or unexpected:
        raise RuntimeError(f"weights do not fit BertModel: {missing} {unexpected}")
    return bert.eval()


def tokenizer(max_tokens: int):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bge_files() / "tokenizer.json"))
    tok.enable_truncation(max_tokens)
    tok.enable_padding()
    return tok


def encode(model, tok, texts: list[str]):
    """CLS vectors, L2-normalised (the product's pooling)."""
    import torch

    batch = tok.encode_batch(texts)
    ids = torch.tensor([e.ids for e in batch])
    mask = torch.tensor([e.attention_mask for e in batch])
    cls = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
    return torch.nn.functional.normalize(cls.float(), dim=-1)


def load_pairs(name: str) -> list[dict]:
    return [json.loads(line) for line in (WORK / f"{name}.jsonl").open()]


def fixed_vectors() -> dict:
    data = np.load(WORK / "vectors.npz")
    return {k: data[k] for k in data.files}


def query_mrr(model, tok, queries: list[str], docs) -> float:
    """MRR@10 of each validation query (encoded by the model in training) against all
    validation chunks (fixed vectors)."""
    import torch

    model.eval()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        q = torch.cat([encode(model, tok, queries[i:i + 64]) for i in range(0, len(queries), 64)])
    model.train()
    sims = q @ docs.T
    ranks = (sims > sims.diagonal().unsqueeze(1)).sum(-1)
    return float(torch.where(ranks < 10, 1.0 / (ranks + 1), 0.0).mean())


def lora_model(args: argparse.Namespace, dropout: bool):
    """bge-small with a LoRA (rank `--rank`, alpha 2x) on every attention/FFN linear: fresh, or
    `--init`'s saved delta to continue a run (its rank must match)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = get_peft_model(torch_model(dropout), LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS))
    if args.init:
        load(model, Path(args.init))
    return model.train()


def train(args: argparse.Namespace) -> None:
    """LoRA on the query side only: each batch of queries is encoded by the adapted model and
    scored (InfoNCE, temperature 0.05) against the fixed int8-ONNX vectors of *every* training
    chunk, so the whole corpus is the negatives and no chunk is re-encoded (a chunk costs ~10x a
    query, and stored indexes stay valid). The schedule is sized by time (`--minutes`); the
    best validation MRR@10 is kept."""
    import torch

    model = lora_model(args, dropout=True)
    tok = tokenizer(QUERY_TOKENS)
    vectors = fixed_vectors()
    queries = [p["query"] for p in load_pairs("pairs")][:len(vectors["pairs_d"])]
    held = [p["query"] for p in load_pairs("validation")]
    docs = torch.from_numpy(vectors["pairs_d"])
    held_docs = torch.from_numpy(vectors["validation_d"])
    print(f"{len(queries)} training pairs")

    def batches() -> list:
        return list(torch.randperm(len(queries)).split(args.batch))

    def loss_of(idx):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q = encode(model, tok, [queries[i] for i in idx])
        return torch.nn.functional.cross_entropy(q @ docs.T / args.temperature, idx)

    def validate() -> tuple[float, str]:
        score = query_mrr(model, tok, held, held_docs)
        return score, f"{score:.3f}"

    optimise(model, args, batches, loss_of, validate, WORK / "query_delta.npz")


def project_batches(pairs: list[dict], size: int, generator) -> list[list[int]]:
    """Batches of pairs from one project each (the leftovers mixed): the benchmark ranks a
    query among its own repository's chunks, so in-batch negatives from the same project are
    the ones that teach; random batches mix 71 projects and are mostly easy."""
    import torch

    by_project: dict[str, list[int]] = {}
    for i, p in enumerate(pairs):
        by_project.setdefault(p["project"], []).append(i)
    batches, rest = [], []
    for members in by_project.values():
        shuffled = [members[i] for i in torch.randperm(len(members), generator=generator)]
        full = len(shuffled) // size * size
        batches += [shuffled[i:i + size] for i in range(0, full, size)]
        rest += shuffled[full:]
    rest = [rest[i] for i in torch.randperm(len(rest), generator=generator)]
    batches += [rest[i:i + size] for i in range(0, len(rest), size) if len(rest[i:i + size]) > 1]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator)]


def both_mrr(model, query_tok, chunk_tok, held: list[dict]) -> tuple[float, float]:
    """Validation MRR@10 with both sides encoded by the model in training: among all 500
    validation chunks, and among the chunks of the query's own project (~8 each, so it
    saturates near 0.94: reported, not used to pick)."""
    import torch

    model.eval()
    with torch.inference_mode():
        q = torch.cat([encode(model, query_tok, [p["query"] for p in held[i:i + 64]])
                       for i in range(0, len(held), 64)])
        d = torch.cat([encode(model, chunk_tok, [p["text"] for p in held[i:i + 32]])
                       for i in range(0, len(held), 32)])
    model.train()
    sims = q @ d.T
    own = torch.tensor([[a["project"] == b["project"] for b in held] for a in held])
    out = []
    for s in (sims, sims.masked_fill(~own, -2.0)):
        ranks = (s > s.diagonal().unsqueeze(1)).sum(-1)
        out.append(float(torch.where(ranks < 10, 1.0 / (ranks + 1), 0.0).mean()))
    return out[0], out[1]


def train_both(args: argparse.Namespace) -> None:
    """LoRA on one shared encoder for queries and chunks (a symmetric bi-encoder, as bge was
    trained): InfoNCE both ways over same-project batches. Every chunk is re-encoded each step,
    so this costs ~10x the query-side run per pair; the chunk side is where the query-side run
    suggested the bottleneck is. Writes WORK/`--out` (best validation MRR@10) for
    `build --delta`. `--init` with another `--seed` continues a run on a fresh batch order;
    `--extra` mixes in another pair set and picks by the mean of both validations."""
    import torch

    model = lora_model(args, dropout=False)
    query_tok, chunk_tok = tokenizer(QUERY_TOKENS), tokenizer(args.chunk_tokens)
    pairs, held = load_pairs("pairs"), load_pairs("validation")[:args.validation]
    extra_held = []
    if args.extra:
        pairs += load_pairs(f"{args.extra}_pairs")
        extra_held = load_pairs(f"{args.extra}_validation")[:args.validation]
    print(f"{len(pairs)} training pairs")
    generator = torch.Generator().manual_seed(args.seed)

    def loss_of(batch: list[int]):
        q = encode(model, query_tok, [pairs[i]["query"] for i in batch])
        d = encode(model, chunk_tok, [pairs[i]["text"] for i in batch])
        logits = q @ d.T / args.temperature
        labels = torch.arange(len(batch))
        return (torch.nn.functional.cross_entropy(logits, labels)
                + torch.nn.functional.cross_entropy(logits.T, labels)) / 2

    def validate() -> tuple[float, str]:
        mixed, own = both_mrr(model, query_tok, chunk_tok, held)
        if not extra_held:
            return mixed, f"{mixed:.3f} own-project {own:.3f}"
        extra, _ = both_mrr(model, query_tok, chunk_tok, extra_held)
        mean = (mixed + extra) / 2
        return mean, f"{mean:.3f} (docstring {mixed:.3f}, {args.extra} {extra:.3f})"

    optimise(model, args, lambda: project_batches(pairs, args.batch, generator), loss_of,
             validate, WORK / args.out)


def optimise(model, args: argparse.Namespace, batches: Callable[[], list],
             loss_of: Callable, validate: Callable[[], tuple[float, str]], delta: Path) -> None:
    """The loop both sides share: AdamW, the cosine schedule sized to `--minutes` from the
    first five steps, validation every `--every` steps, the best validation's delta kept."""
    import torch

    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                              weight_decay=0.01)
    best, shown = validate()
    print(f"step 0: validation MRR@10 {shown}", flush=True)
    save(model, delta)
    started, step, total = time.time(), 0, None
    while total is None or step < total:
        for batch in batches():
            loss = loss_of(batch)
            loss.backward()
            step += 1
            if total is None and step == 5:  # size the cosine schedule to the time budget
                per_step = (time.time() - started) / 5
                total = max(10, int(60 * args.minutes / per_step))
                print(f"{per_step:.1f} s/step -> {total} steps", flush=True)
            for group in optim.param_groups:
                group["lr"] = args.lr * lr_factor(step, total)
            optim.step()
            optim.zero_grad()
            if step % args.every == 0 or step == total:
                score, shown = validate()
                print(f"step {step}: loss {loss.item():.3f} validation MRR@10 {shown} "
                      f"{time.time() - started:.0f} s", flush=True)
                if score > best:
                    best = score
                    save(model, delta)
            if step == total:
                break
    print(f"best validation MRR@10 {best:.3f}")


def lr_factor(step: int, total: int | None) -> float:
    """Linear warm-up over 10 steps, then cosine decay to 0 at `total`."""
    if step <= 10 or total is None:
        return min(1.0, step / 10)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 10) / max(1, total - 10))))


def lora_modules(model) -> Iterator[tuple[str, object]]:
    """(the linear's name in BertModel, its peft LoRA wrapper) for every adapted linear."""
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            yield name.removeprefix("base_model.model."), module


def load(model, path: Path) -> None:
    """The inverse of `save`: a delta's A and B (scaling divided out) into the LoRA weights."""
    import torch

    delta = np.load(path)
    with torch.no_grad():
        for linear, module in lora_modules(model):
            module.lora_A["default"].weight.copy_(torch.from_numpy(
                delta[f"{linear}.A"].astype(np.float32)))
            module.lora_B["default"].weight.copy_(torch.from_numpy(
                delta[f"{linear}.B"].astype(np.float32) / module.scaling["default"]))


def save(model, path: Path) -> None:
    """The delta as `<linear>.A` [r, in] and `<linear>.B` [out, r] with the LoRA scaling folded
    into B, fp16: what onnx_delta.merge_delta reads."""
    delta = {}
    for linear, module in lora_modules(model):
        delta[f"{linear}.A"] = module.lora_A["default"].weight.detach().numpy()
        delta[f"{linear}.B"] = (module.lora_B["default"].weight.detach().numpy()
                                * module.scaling["default"])
    np.savez_compressed(path, **{k: v.astype(np.float16) for k, v in delta.items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("step", choices=["download", "pairs", "vectors", "train", "build"])
    parser.add_argument("--side", choices=["query", "both"], default="query",
                        help="train: the query side against fixed chunk vectors, or one "
                        "shared encoder for both")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--validation", type=int, default=VALIDATION,
                        help="validation pairs scored every --every steps (both sides)")
    parser.add_argument("--delta", default="query_delta.npz", help="build: the delta in WORK")
    parser.add_argument("--init", help="train: start the LoRA from this saved delta")
    parser.add_argument("--out", default="both_delta.npz", help="train --side both: in WORK")
    parser.add_argument("--extra", help="train --side both: also WORK/EXTRA_pairs.jsonl, "
                        "validated on WORK/EXTRA_validation.jsonl (commit_pairs.py: commit)")
    parser.add_argument("--seed", type=int, default=0, help="train --side both: batch order")
    parser.add_argument("--minutes", type=float, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--temperature", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--every", type=int, default=25, help="steps between validations")
    args = parser.parse_args()
    if args.extra and (args.step, args.side) != ("train", "both"):
        parser.error("--extra needs `train --side both`")
    if args.extra and not (WORK / f"{args.extra}_pairs.jsonl").exists():
        parser.error(f"--extra {args.extra}: no {WORK / args.extra}_pairs.jsonl "
                     "(commit_pairs.py writes commit_pairs.jsonl)")
    WORK.mkdir(parents=True, exist_ok=True)
    if args.step == "download":
        download(listed(PROJECTS))
    elif args.step == "pairs":
        build_pairs()
    elif args.step == "vectors":
        embed_pairs(args.minutes)
    elif args.step == "train":
        (train_both if args.side == "both" else train)(args)
    else:
        target = WORK / args.delta.replace("_delta.npz", ".onnx")
        build_adapted(bge_files() / "model.onnx", WORK / args.delta, target)
        print(target)


if __name__ == "__main__":
    main()
