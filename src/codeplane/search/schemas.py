"""Bounded request bodies of `/v1/index/*`: anything malformed is a 400 before the service runs.

Every string the server stores or puts into a LanceDB filter has a pattern (encrypted paths,
HMAC tokens), every list and text a size cap, every number a range. Text fields refuse NUL and
lone surrogates (JSON `\\ud800` decodes to one; the tokenizer and SQLite cannot encode it).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from codeplane.models.embed import MAX_TEXT_CHARS

ENC_PATH = r"^[A-Za-z0-9_\-/]*$"  # base64url segments joined by '/'
TOKEN = r"^[A-Za-z0-9_\-]{1,128}$"  # workspace ids, HMAC'd cache keys, chunk ids, node hashes
VECTOR_B64 = r"^[A-Za-z0-9+/]*={0,2}$"
MAX_LINE = 10_000_000
MAX_CHUNKS_PER_REQUEST = 5_000


def _clean_text(value: str) -> str:
    """Refuse text that cannot be encoded as UTF-8 or carries NUL (binary, not code)."""
    if "\0" in value:
        raise ValueError("text must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return value


Token = Annotated[str, Field(pattern=TOKEN)]
EncPath = Annotated[str, Field(pattern=ENC_PATH, max_length=4096)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS), AfterValidator(_clean_text)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class UploadChunk(Strict):
    id: Token
    key: Token
    start: int = Field(ge=1, le=MAX_LINE)
    end: int = Field(ge=1, le=MAX_LINE)
    text: Text | None = None
    vector: str | None = Field(None, pattern=VECTOR_B64, max_length=16_384,
                               description="client-side embedding mode: base64 of the rotated "
                                           "little-endian float32 vector, instead of text")

    @model_validator(mode="after")
    def _consistent(self) -> UploadChunk:
        if self.end < self.start:
            raise ValueError("end must not be before start")
        if self.text is not None and self.vector is not None:
            raise ValueError("send text or vector, not both")
        return self


class UploadFile(Strict):
    path: EncPath
    leaf: Token
    chunks: list[UploadChunk] = Field(default_factory=list, max_length=MAX_CHUNKS_PER_REQUEST)


class UploadRequest(Strict):
    files: list[UploadFile] = Field(max_length=1000)

    @model_validator(mode="after")
    def _bounded(self) -> UploadRequest:
        if sum(len(f.chunks) for f in self.files) > MAX_CHUNKS_PER_REQUEST:
            raise ValueError(f"at most {MAX_CHUNKS_PER_REQUEST} chunks per request")
        return self


class Node(Strict):
    path: EncPath
    hash: Token


class TreeRequest(Strict):
    paths: list[EncPath] = Field(max_length=1000)


class NodesRequest(Strict):
    nodes: list[Node] = Field(max_length=100_000)


class PathsRequest(Strict):
    paths: list[EncPath] = Field(max_length=10_000)


class KeysRequest(Strict):
    keys: list[Token] = Field(max_length=10_000)


class SearchRequest(Strict):
    query: Annotated[str, Field(min_length=1, max_length=8000),
                     AfterValidator(_clean_text)] | None = None
    vector: str | None = Field(None, pattern=VECTOR_B64, max_length=16_384,
                               description="client-side embedding mode: the rotated query "
                                           "vector, so the query text stays on the client")
    limit: int = Field(10, ge=1, le=200)
    prefix: EncPath | None = None

    @model_validator(mode="after")
    def _one_query(self) -> SearchRequest:
        if (self.query is None) == (self.vector is None):
            raise ValueError("send exactly one of query or vector")
        return self
