"""Adapt bge-small to code (issue 19): contrastive LoRA on docstring -> function pairs from PyPI
projects disjoint from the search benchmark, exported as the delta `models/embed_adapt.py`
merges into the int8 ONNX.

    python bench/search/finetune.py download     # the sdists of finetune_projects.txt (PyPI)
    python bench/search/finetune.py pairs        # -> WORK/pairs.jsonl (+ a 500-pair validation)
    nice -n 10 python bench/search/finetune.py train --minutes 40
    python bench/search/finetune.py export       # -> src/codeplane/models/bge_small_code_delta.npz

A pair is what the product would see: the query is a function docstring's first sentence
(`build.docstring_query`, the benchmark's rule); the document is the `Chunk.embed_text` of the
chunk holding that function, chunked by the production chunker from a file whose docstrings are
blanked (`corpus.blank_docstrings`, as the benchmark's corpus is). The torch model is the
wheel's int8 ONNX dequantized (`embed_adapt.dequantize`), so training starts from exactly the
weights the product runs.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import math
import random
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from build import docstring_query, is_test
from corpus import IGNORED, SKIP_DIRS, SKIP_PARTS, EmbeddingCache, blank_docstrings

from codeplane.indexing.chunker import chunk_text
from codeplane.models.embed import OnnxEmbedder, bge_files
from codeplane.models.embed_adapt import dequantize, linear_initializers

WORK = Path("/tmp/codeplane-finetune")
PROJECTS = HERE / "finetune_projects.txt"
DELTA = HERE.parents[1] / "src" / "codeplane" / "models" / "bge_small_code_delta.npz"
PER_PROJECT = 250  # cap: a few huge projects must not set the style, and each pair costs ~0.1 s of ONNX
VALIDATION = 500
QUERY_TOKENS, DOC_TOKENS = 64, 256
TARGETS = ["query", "key", "value", "dense"]  # every attention and FFN linear of BertLayer


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


def order(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def build_pairs() -> None:
    """All projects' pairs, deduplicated (a query seen twice is dropped, as build.py does; one
    pair per chunk text, so no in-batch negative is secretly a positive), capped per project,
    then a fixed validation split by hash."""
    rows: list[dict] = []
    for archive in sorted((WORK / "sdists").iterdir()):
        project = archive.name.rsplit("-", 1)[0]
        found = [dict(p, project=project) for path, text in sources(archive)
                 for p in file_pairs(path, text)]
        rows += sorted(found, key=lambda p: order(p["query"]))[:PER_PROJECT]
        print(f"{project}: {len(found)} pairs", file=sys.stderr)
    seen: dict[str, int] = {}
    for r in rows:
        seen[r["query"]] = seen.get(r["query"], 0) + 1
    unique: dict[str, dict] = {}
    for r in sorted(rows, key=lambda r: order(r["query"])):
        if seen[r["query"]] == 1:
            unique.setdefault(r["text"], r)
    pairs = list(unique.values())
    for name, part in (("validation", pairs[:VALIDATION]), ("pairs", pairs[VALIDATION:])):
        with (WORK / f"{name}.jsonl").open("w") as fh:
            fh.writelines(json.dumps(p) + "\n" for p in part)
    projects = {p["project"] for p in pairs}
    print(f"{len(pairs)} pairs from {len(projects)} projects "
          f"({len(pairs) - VALIDATION} train, {VALIDATION} validation)")


def embed_pairs() -> None:
    """Query and chunk vectors of every pair from the product's int8 ONNX (cached by text in
    corpus.EmbeddingCache, so an interrupted run resumes): the fixed document side of training."""
    cache = EmbeddingCache(OnnxEmbedder())
    out = {}
    for name in ("validation", "pairs"):
        rows = load_pairs(name)
        out[f"{name}_q"] = cache.vectors([r["query"] for r in rows])
        for i in range(0, len(rows), 500):
            cache.vectors([r["text"] for r in rows[i:i + 500]])
            print(f"{name}: {i + 500} chunks", file=sys.stderr, flush=True)
        out[f"{name}_d"] = cache.vectors([r["text"] for r in rows])
    np.savez(WORK / "vectors.npz", **out)


def train_query_map(args: argparse.Namespace) -> None:
    """A linear map W on query vectors (q -> normalise(q @ W), W from the identity), trained
    with InfoNCE against every training chunk at once (chunk vectors are fixed, so the whole
    corpus serves as negatives), with an L2 pull towards the identity; the epoch with the best
    validation MRR@10 is kept. Chunk vectors, and so every stored index, stay as they are."""
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = np.load(WORK / "vectors.npz")
    q, d = torch.from_numpy(data["pairs_q"]), torch.from_numpy(data["pairs_d"])
    vq, vd = torch.from_numpy(data["validation_q"]), torch.from_numpy(data["validation_d"])
    eye = torch.eye(q.shape[1])
    w = torch.nn.Parameter(eye.clone())
    optim = torch.optim.Adam([w], lr=args.lr)
    best, best_w = map_mrr(vq, vd, eye), eye.clone()
    print(f"epoch 0: validation MRR@10 {best:.3f}")
    for epoch in range(1, args.epochs + 1):
        for idx in torch.randperm(len(q)).split(args.batch):
            logits = torch.nn.functional.normalize(q[idx] @ w, dim=-1) @ d.T / args.temperature
            loss = torch.nn.functional.cross_entropy(logits, idx) + args.decay * (w - eye).pow(2).sum()
            optim.zero_grad()
            loss.backward()
            optim.step()
        score = map_mrr(vq, vd, w.detach())
        print(f"epoch {epoch}: loss {loss.item():.3f} validation MRR@10 {score:.3f}")
        if score > best:
            best, best_w = score, w.detach().clone()
    np.save(WORK / "query_map.npy", best_w.numpy().astype(np.float32))
    print(f"best validation MRR@10 {best:.3f}")


def map_mrr(q, d, w) -> float:
    """MRR@10 of each mapped query against all chunks of the set."""
    import torch

    mapped = torch.nn.functional.normalize(q @ w, dim=-1)
    sims = mapped @ d.T
    ranks = (sims > sims.diagonal().unsqueeze(1)).sum(-1)
    return float(torch.where(ranks < 10, 1.0 / (ranks + 1), 0.0).mean())


def torch_model():
    """bge-small as a transformers BertModel with the wheel's int8 weights dequantized: the
    embeddings and every MatMul weight from their quantized initializers, biases and LayerNorms
    as stored (fp32)."""
    import onnx
    import torch
    from onnx import numpy_helper
    from transformers import BertConfig, BertModel

    folder = bge_files()
    model = onnx.load(str(folder / "model.onnx"))
    arrays = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    state = {k: v for k, v in arrays.items() if k.endswith(("bias", "LayerNorm.weight"))}
    for table in ("word", "position", "token_type"):
        base = f"embeddings.{table}_embeddings.weight"
        state[base] = dequantize(arrays[f"{base}_quantized"], arrays[f"{base}_scale"],
                                 arrays[f"{base}_zero_point"])
    for linear, base in linear_initializers(model).items():
        state[f"{linear}.weight"] = dequantize(arrays[f"{base}_quantized"],
                                               arrays[f"{base}_scale"],
                                               arrays[f"{base}_zero_point"]).T
    config = BertConfig.from_pretrained(str(folder))
    bert = BertModel(config, add_pooling_layer=False)
    missing, unexpected = bert.load_state_dict(
        {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()}, strict=False)
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


class TorchEmbedder:
    """The torch model behind the product's Embedder interface, for evaluate.py's parity check
    (`--embedder torch`) of the dequantized weights against the int8 ONNX."""

    name, dim = "bge-small-torch-fp32", 384

    def __init__(self) -> None:
        self.model, self.tok = torch_model(), tokenizer(512)

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch

        order_ = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        with torch.inference_mode():
            for i in range(0, len(order_), 16):
                part = order_[i:i + 16]
                out[part] = encode(self.model, self.tok, [texts[j] for j in part]).numpy()
        return out


def load_pairs(name: str) -> list[dict]:
    return [json.loads(line) for line in (WORK / f"{name}.jsonl").open()]


def batches(pairs: list[dict], size: int, rng: random.Random) -> list[list[dict]]:
    """Shuffled batches, each drawn from a window of similar chunk lengths (less padding; the
    window is 16 batches wide so negatives stay varied)."""
    shuffled = pairs[:]
    rng.shuffle(shuffled)
    out = []
    window = size * 16
    for i in range(0, len(shuffled), window):
        part = sorted(shuffled[i:i + window], key=lambda p: len(p["text"]))
        out += [part[j:j + size] for j in range(0, len(part) - size + 1, size)]
    rng.shuffle(out)
    return out


def validate(model, qtok, dtok, pairs: list[dict]) -> float:
    """MRR@10 of each validation query against all validation chunks."""
    import torch

    model.eval()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        q = torch.cat([encode(model, qtok, [p["query"] for p in pairs[i:i + 64]])
                       for i in range(0, len(pairs), 64)])
        ranked = sorted(range(len(pairs)), key=lambda i: len(pairs[i]["text"]))
        d = torch.zeros_like(q)
        for i in range(0, len(ranked), 32):
            part = ranked[i:i + 32]
            d[part] = encode(model, dtok, [pairs[j]["text"] for j in part])
    model.train()
    ranks = (q @ d.T > (q * d).sum(-1, keepdim=True)).sum(-1)
    return float(torch.where(ranks < 10, 1.0 / (ranks + 1), 0.0).mean())


def train(args: argparse.Namespace) -> None:
    """Symmetric InfoNCE with in-batch negatives on LoRA adapters; the schedule is sized by
    time (`--minutes`) from the measured first steps; the best validation MRR is kept."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)
    model = get_peft_model(torch_model(), LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS))
    model.train()
    qtok, dtok = tokenizer(QUERY_TOKENS), tokenizer(DOC_TOKENS)
    pairs, held = load_pairs("pairs"), load_pairs("validation")
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    best = validate(model, qtok, dtok, held)
    print(f"step 0: validation MRR@10 {best:.3f}", flush=True)
    save(model, WORK / "best.npz")
    started, step, total = time.time(), 0, None
    deadline = started + 60 * args.minutes
    while time.time() < deadline:
        for batch in batches(pairs, args.batch, rng):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                q = encode(model, qtok, [p["query"] for p in batch])
                d = encode(model, dtok, [p["text"] for p in batch])
            logits = q @ d.T / args.temperature
            labels = torch.arange(len(batch))
            loss = (torch.nn.functional.cross_entropy(logits, labels)
                    + torch.nn.functional.cross_entropy(logits.T, labels)) / 2
            loss.backward()
            step += 1
            if total is None and step == 5:  # size the cosine schedule to the time budget
                total = max(10, int(60 * args.minutes / ((time.time() - started) / 5)))
                print(f"{(time.time() - started) / 5:.1f} s/step -> {total} steps", flush=True)
            for group in optim.param_groups:
                group["lr"] = args.lr * lr_factor(step, total)
            optim.step()
            optim.zero_grad()
            if step % 10 == 0:
                print(f"step {step} loss {loss.item():.3f} {time.time() - started:.0f} s",
                      flush=True)
            if step % args.every == 0 or time.time() >= deadline:
                score = validate(model, qtok, dtok, held)
                print(f"step {step}: validation MRR@10 {score:.3f}", flush=True)
                if score > best:
                    best = score
                    save(model, WORK / "best.npz")
            if time.time() >= deadline or (total and step >= total):
                break
        if total and step >= total:
            break
    print(f"best validation MRR@10 {best:.3f}")


def lr_factor(step: int, total: int | None) -> float:
    """Linear warm-up over 10 steps, then cosine decay to 0 at `total`."""
    if step <= 10 or total is None:
        return min(1.0, step / 10)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 10) / max(1, total - 10))))


def save(model, path: Path) -> None:
    """The delta as `<linear>.A` [r, in] and `<linear>.B` [out, r] with the LoRA scaling folded
    into B, fp16: what embed_adapt.merge_delta reads."""
    delta = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            linear = name.removeprefix("base_model.model.")
            delta[f"{linear}.A"] = module.lora_A["default"].weight.detach().numpy()
            delta[f"{linear}.B"] = (module.lora_B["default"].weight.detach().numpy()
                                    * module.scaling["default"])
    buf = io.BytesIO()
    np.savez_compressed(buf, **{k: v.astype(np.float16) for k, v in delta.items()})
    path.write_bytes(buf.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("step", choices=["download", "pairs", "vectors", "train", "map", "export"])
    parser.add_argument("--minutes", type=float, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--temperature", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--decay", type=float, default=1e-3, help="pull of W to the identity")
    parser.add_argument("--every", type=int, default=100, help="steps between validations")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if args.step == "download":
        download([line.split("#")[0].strip() for line in PROJECTS.read_text().splitlines()
                  if line.split("#")[0].strip()])
    elif args.step == "pairs":
        build_pairs()
    elif args.step == "vectors":
        embed_pairs()
    elif args.step == "map":
        train_query_map(args)
    elif args.step == "train":
        train(args)
    else:
        DELTA.write_bytes((WORK / "best.npz").read_bytes())
        print(f"{DELTA}: {DELTA.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
