"""Indexing speed and bytes on the wire: server-side embedding vs client-side embedding
(`[indexing] embed = "client"`), on a real codebase, each from a cold start (fresh server store,
fresh client keys, so nothing is reused from the embedding cache).

    pip download --no-deps --no-binary :all: rich==13.9.4 -d /tmp/dl
    tar xzf /tmp/dl/rich-13.9.4.tar.gz -C /tmp
    flock /tmp/codeplane-cpu.lock python bench/index_embed_modes.py /tmp/rich-13.9.4

Client and server share this machine (one process, loopback HTTP), so the same CPU embeds in
both modes: the difference is what crosses the wire (text vs 1.5 KB vectors) and where the
model runs, not more compute. On a team deployment the client's laptop CPU does the embedding in
client mode, the server's in server mode.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import LiveServer, free_port, make_settings
from indexkit import tenant_app

from codeplane.indexing.sync import sync


def run(mode: str, source: Path, scratch: Path) -> dict:
    home = scratch / mode
    server = LiveServer(tenant_app(make_settings(home / "server")), free_port()).start()
    try:
        root = home / "repo"
        shutil.copytree(source, root)
        cfg = make_settings(home / "client", server=server.url, indexing={"embed": mode})
        report = sync(root, cfg)
    finally:
        server.stop()
    return {"mode": mode, "files": report.files_scanned, "chunks": report.chunks_embedded,
            "seconds": report.seconds, "chunks_per_s": report.chunks_embedded / report.seconds,
            "mb_sent": report.bytes_sent / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="extracted sdist (e.g. /tmp/rich-13.9.4)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per mode")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for mode in ("server", "client"):
                rows.append(run(mode, args.source, Path(tmp) / f"{mode}{i}"))
                print("{mode:6} {files} files, {chunks} chunks in {seconds:.1f} s = "
                      "{chunks_per_s:.1f} chunks/s, {mb_sent:.2f} MB sent".format(**rows[-1]),
                      flush=True)
    for mode in ("server", "client"):
        mine = [r for r in rows if r["mode"] == mode]
        best = min(r["seconds"] for r in mine)
        print(f"{mode}: best {best:.1f} s ({mine[0]['chunks'] / best:.1f} chunks/s), "
              f"{mine[0]['mb_sent']:.2f} MB sent")


if __name__ == "__main__":
    main()
