"""Streaming text assembly in the engine and the chat stream, and the thread count it
fits to the machine, without a model."""

import subprocess
import sys
from pathlib import Path

from codeplane.models.engine import _StopDecoder, free_cores


def test_utf8_split_across_tokens_is_not_mangled():
    decoder = _StopDecoder([])
    pieces = [b"caf", "é".encode()[:1], "é".encode()[1:], b" ", "日本".encode()[:4],
              "日本".encode()[4:]]
    shown = "".join(decoder.feed(p)[0] for p in pieces) + decoder.flush()
    assert shown == decoder.text == "café 日本"


def test_stop_string_spanning_pieces_is_withheld_and_cut():
    decoder = _StopDecoder(["\n\n"])
    deltas = [decoder.feed(p) for p in (b"return x", b"\n", b"\nprint(1)")]
    assert "".join(d for d, _ in deltas) == "return x"
    assert deltas[-1][1] is True and decoder.text == "return x"


def test_chat_stream_shows_prose_and_holds_back_a_possible_tool_call():
    from codeplane.models.local_openai import _ChatStream

    chunks: list[dict] = []
    stream = _ChatStream(chunks.append, "id", 0, "m", holdback=True)
    for piece in ["I will ", "call it: <tool", "_call>", '{"name": "f"}', " more"]:
        stream.text(piece)
    shown = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert shown == "I will call it: "
    stream.text("``")  # held: nothing after the opener is shown until `finish`
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == shown


def test_free_cores_leave_out_a_busy_process():
    """A process spinning on a core is seen: the model runs on one core fewer (llama.cpp's
    threads would otherwise wait at every barrier for the one it descheduled)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        stat = Path(f"/proc/{spinner.pid}/stat")
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "R":
            pass  # until the spinner is runnable (it spins from then on)
        assert free_cores(2) == 1
        assert free_cores(64) <= 63
        assert free_cores(1) == 1  # never fewer than one
    finally:
        spinner.kill()
        spinner.wait()
