"""What the secret rotation of stored vectors does and does not protect, measured.

An attacker holds a workspace's stored (rotated) vectors but not its key - a stolen disk or
bucket, or the server itself in client-side embedding mode. Two attacks on real code chunks:

1. Known plaintext: the attacker knows k chunk texts and which stored rows they are (vendored
   files, licence headers, boilerplate). Orthogonal Procrustes on k pairs estimates the rotation;
   we report how well the remaining rows are then un-rotated (mean cosine to the true plain
   embedding) and re-identified (top-1 among the embeddings of all remaining candidate texts).
2. Linkability: rotation keeps every pairwise cosine, so the same files stored under two keys
   give identical cosine fingerprints (the largest difference is printed).

    flock /tmp/codeplane-cpu.lock python bench/rotation_attack.py /tmp/rich-13.9.4 [--chunks 800]
"""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path

import numpy as np

from codeplane.indexing.chunker import chunk_text
from codeplane.models.embed import rotation
from codeplane.models.embedders import Embedders


def chunks(root: Path, limit: int) -> list[str]:
    texts = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        texts += [c.embed_text(rel) for c in chunk_text(rel, path.read_text(errors="replace"))]
    rng = np.random.default_rng(0)
    return [texts[i] for i in rng.permutation(len(texts))[:limit]]


def procrustes(plain: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """The orthogonal M minimising ||plain @ M - stored||."""
    u, _, vt = np.linalg.svd(plain.T @ stored)
    return u @ vt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("--chunks", type=int, default=800)
    args = parser.parse_args()
    texts = chunks(args.source, args.chunks)
    plain = Embedders().index().embed(texts)
    dim = plain.shape[1]
    stored = plain @ rotation(secrets.token_urlsafe(32), dim).T
    print(f"{len(texts)} chunks of {args.source.name}, {dim} dims")
    print(f"{'known pairs':>11} {'mean cos(recovered, true)':>26} {'re-identified top-1':>20}")
    rng = np.random.default_rng(1)
    for k in (10, 25, 50, 100, 200, 384, 500):
        if k >= len(texts) - 50:
            break
        order = rng.permutation(len(texts))
        known, rest = order[:k], order[k:]
        m = procrustes(plain[known], stored[known])
        recovered = stored[rest] @ m.T
        cos = np.sum(recovered * plain[rest], axis=1) / (
            np.linalg.norm(recovered, axis=1) * np.linalg.norm(plain[rest], axis=1))
        hits = np.argmax(recovered @ plain[rest].T, axis=1) == np.arange(len(rest))
        print(f"{k:>11} {cos.mean():>26.3f} {hits.mean():>20.3f}")
    other = plain @ rotation(secrets.token_urlsafe(32), dim).T
    drift = np.abs(stored @ stored.T - other @ other.T).max()
    print(f"linkability: max |cosine under key A - cosine under key B| = {drift:.2e}")


if __name__ == "__main__":
    main()
