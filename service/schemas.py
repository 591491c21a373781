"""Request and response bodies of the REST API (pydantic v2).

Request bodies are parsed by :data:`UPSERT_BODY` / :data:`SEARCH_BODY`
(``TypeAdapter.validate_json``: one pass from bytes, in a worker thread, so a
64 MiB batch never blocks the event loop). Shape checks live here; the vector
checks that need the index (dimension, finiteness, zero vectors, sparse index
order) are the index's own, so the API and the library refuse bad vectors with
the same words.

A vector has one shape everywhere — insert, query, read-back: dense ``values``, or
sparse ``indices`` + ``values``. An id is a string; a JSON integer is taken as its
decimal string (the ids ``gmmlsh build`` gives are row numbers).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_type_hints

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    WithJsonSchema,
    create_model,
)

from gmmlsh.index.config import CREATION_FIELDS, MAX_SCROLL_LIMIT, IndexConfig, describe
from gmmlsh.index.search import MODE_ALIASES, MODES
from gmmlsh.index.store.base import MAX_ID_BYTES
from gmmlsh.index.store.registry import NAME_RE

#: A mode a query may ask for (``lsh``: ``auto``'s former name), and the searches an answer names.
Mode = Literal[(*MODES, *MODE_ALIASES)]
AnswerMode = Literal[tuple(m for m in MODES if m != "auto")]
MODE_HELP = ("auto (default: the search the index tuned for itself), sketch (inverted lists over the sketches), "
             "postings (sparse rows through postings), exact (brute force) or nrff (RBF features); lsh: auto")


def _as_id(v: Any) -> Any:
    """A JSON integer id is its decimal string; the length limit is the store's, in bytes."""
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if isinstance(v, str) and len(v.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise ValueError(f"ids are at most {MAX_ID_BYTES} bytes of UTF-8")
    return v


_ID_HELP = f"a string of 1 to {MAX_ID_BYTES} bytes of UTF-8, or an integer (taken as its decimal string)"
Id = Annotated[str, BeforeValidator(_as_id), Field(min_length=1, description=_ID_HELP),
               WithJsonSchema({"anyOf": [{"type": "string", "minLength": 1}, {"type": "integer"}],
                               "description": _ID_HELP})]

#: Tags of the tagged unions below; they appear in pydantic error locations and
#: are stripped from the ``field`` reported to clients.
UNION_TAGS = frozenset({"single", "batch"})


#: A sparse index as sent: any 64-bit integer (range and order are checked against the
#: index's dimension later, with a precise message). Beyond int64, numpy cannot hold it.
Index = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Strict(BaseModel):
    """Unknown fields are errors: a misspelt ``indicies`` must not silently mean dense.

    Strict types: ``true`` or ``"3"`` is not a number, as the schema says (JSON
    integers still count as numbers).
    """

    model_config = ConfigDict(extra="forbid", strict=True)


# --- vectors -----------------------------------------------------------------------


class VectorIn(_Strict):
    """One vector: dense (``values`` only) or sparse (``indices`` + ``values``)."""

    id: Id
    values: list[float] = Field(description="dense values, or the nonzero values if sparse")
    indices: list[Index] | None = Field(
        None, description="sparse: strictly increasing positions in [0, dim), one per value"
    )
    metadata: dict[str, Any] | None = Field(None, description="any JSON object, returned with hits")


class VectorBatch(_Strict):
    vectors: list[VectorIn] = Field(min_length=1, description="upserted in one atomic batch")


def _pick(key: str):
    def disc(v: Any) -> str:
        return "batch" if (isinstance(v, dict) and key in v) or hasattr(v, key) else "single"

    return disc


UpsertBody = Annotated[
    Annotated[VectorBatch, Tag("batch")] | Annotated[VectorIn, Tag("single")],
    Discriminator(_pick("vectors")),
]
UPSERT_BODY: TypeAdapter = TypeAdapter(UpsertBody)


class UpsertResponse(BaseModel):
    upserted: int = Field(description="ids written; an id given twice in one batch counts once (its last "
                          "vector is the one stored)")
    replaced: int = Field(description="of those, ids that held a vector before (now replaced)")
    count: int = Field(description="vectors in the index after the write")


class VectorOut(BaseModel):
    id: str
    values: list[float]
    indices: list[int] | None = None
    metadata: dict[str, Any] | None = None


class DeleteResponse(BaseModel):
    deleted: int
    count: int


# --- queries ------------------------------------------------------------------------

FILTER_HELP = (
    "only neighbours whose metadata pass this filter (Qdrant's shape): {\"must\": [...], \"should\": [...], "
    "\"must_not\": [...]} of conditions {\"key\": \"label\", \"match\": {\"value\": 3}}, "
    "{\"key\": k, \"match\": {\"any\": [...]}}, {\"key\": k, \"range\": {\"gte\": 1, \"lt\": 5}}, "
    "{\"key\": k, \"exists\": true}, or nested filters")


class QueryParams(_Strict):
    """Knobs shared by every query; in a batch, per-query values override the batch's."""

    k: int | None = Field(None, ge=1, description="neighbours (default: default_k)")
    mode: Mode | None = Field(None, description=MODE_HELP)
    min_similarity: float | None = Field(None, ge=0.0, le=1.0)
    candidates: int | None = Field(None, ge=1,
                                   description="rerank budget: rows reranked by GMM (postings: exactly; sketch: on "
                                   "coarse copies, the best k + max(k, 10) exactly)")
    probes: int | None = Field(None, ge=0, description="inverted lists scanned (sketch search; 0: all)")
    filter: dict[str, Any] | None = Field(None, description=FILTER_HELP)


class UrlParams(QueryParams):
    """The knobs as query-string parameters: text, converted (``k=10``); ``filter`` is JSON text;
    unknown parameters are ignored (a cache-buster must not fail a request)."""

    model_config = ConfigDict(extra="ignore", strict=False)

    filter: str | None = Field(None, description="a metadata filter as JSON (see POST /neighbors/search)")


class NeighborsParams(UrlParams):
    """``GET /neighbors``: exactly one of ``id`` or ``vector``, and the knobs."""

    id: Id | None = Field(None, description="id of a stored vector (left out of its own neighbours)")
    vector: str | None = Field(None, description="dense query, comma-separated numbers: 0.1,0,-2.5,...")


class SearchQuery(QueryParams):
    """Exactly one of: ``id`` (a stored vector), ``values`` (dense), ``indices`` + ``values`` (sparse)."""

    id: Id | None = None
    indices: list[Index] | None = None
    values: list[float] | None = None


class SearchBatch(QueryParams):
    queries: list[SearchQuery] = Field(min_length=1)


SearchBody = Annotated[
    Annotated[SearchBatch, Tag("batch")] | Annotated[SearchQuery, Tag("single")],
    Discriminator(_pick("queries")),
]
SEARCH_BODY: TypeAdapter = TypeAdapter(SearchBody)


class NeighborOut(BaseModel):
    id: str
    similarity: float = Field(description="exact similarity under the mode's kernel")
    metadata: dict[str, Any] | None = None


class NeighborsResponse(BaseModel):
    mode: AnswerMode = Field(description="the search that answered")
    k: int
    candidates: int = Field(description="vectors scored exactly for this query")
    neighbors: list[NeighborOut]


class SearchBatchResponse(BaseModel):
    results: list[NeighborsResponse]


# --- collections, scroll, batch delete ------------------------------------------------


def _creation_base() -> type[BaseModel]:
    """One optional field per creation parameter, typed and described by IndexConfig."""
    hints = get_type_hints(IndexConfig)
    fields = {n: (hints[n] | None, Field(None, description=describe(n))) for n in CREATION_FIELDS}
    return create_model("CollectionParams", __base__=_Strict, **fields)


class CollectionCreate(_creation_base()):
    """A new collection: its name, its parameters (IndexConfig's defaults for those left out;
    ``dim`` may come from ``sample`` instead) and the metadata fields to index."""

    name: str = Field(pattern=NAME_RE.pattern, description="1-48 letters, digits, _ or -")
    indexed_fields: list[str] = Field(default_factory=list, description="metadata fields kept indexed "
                                      "(value → ids lists; filters on them are cheapest)")
    sample: list[list[float]] | None = Field(None, min_length=1, description="dense sample rows of the "
                                             "data: the dimension is read from them (and checked)")


class CollectionOut(BaseModel):
    name: str
    dim: int | None = None
    indexed_fields: list[str] = []
    created: float | None = None


class CollectionList(BaseModel):
    collections: list[CollectionOut]


class ScrollRequest(_Strict):
    cursor: Id | None = Field(None, description="the next_cursor of the previous page (none: from the start)")
    limit: int = Field(100, ge=1, le=MAX_SCROLL_LIMIT, description="ids per page")
    filter: dict[str, Any] | None = Field(None, description=FILTER_HELP)


class ScrollItem(BaseModel):
    id: str
    metadata: dict[str, Any] | None = None


class ScrollResponse(BaseModel):
    items: list[ScrollItem]
    next_cursor: str | None = Field(description="give it as cursor for the next page; null: the last page")


class BatchDelete(_Strict):
    """Exactly one of ``ids`` or ``filter``."""

    ids: list[Id] | None = Field(None, min_length=1, description="ids to delete (unknown ones are skipped)")
    filter: dict[str, Any] | None = Field(None, description="delete every vector whose metadata pass it")


class BatchDeleteResponse(BaseModel):
    deleted: int
    count: int


COLLECTION_BODY: TypeAdapter = TypeAdapter(CollectionCreate)
SCROLL_BODY: TypeAdapter = TypeAdapter(ScrollRequest)
DELETE_BODY: TypeAdapter = TypeAdapter(BatchDelete)


# --- housekeeping -----------------------------------------------------------------


class HealthResponse(BaseModel):
    """The server is alive and its store answers (reads work); ``writable`` says whether writes
    are taken now, and ``problem`` why not (a full disk or Redis, an evicting Redis);
    ``search_current`` whether answers cover every acknowledged write, and ``search_problem``
    why not (this machine's search mirror has no space left for the latest)."""

    status: Literal["ok"]
    backend: str
    writable: bool
    problem: str | None = None
    search_current: bool = True
    search_problem: str | None = None


class StatsResponse(BaseModel):
    """``Index.stats()`` (server file paths left out) and the service's own limits."""

    model_config = ConfigDict(extra="allow")

    count: int = Field(description="vectors in the index")
    backend: Literal["lmdb", "redis"]
    pid: int = Field(description="the worker process that answered")
    config: dict[str, Any] = Field(description="the index's creation parameters (fixed when it was created)")
    search: dict[str, Any] = Field(description="the search in use: tuned, with the operator's overrides")
    mirror: dict[str, Any] = Field(description="this machine's search mirror: rows, lists, disk use")
    store: dict[str, Any] = Field(description="the store (Redis URL with its password masked)")
    service: dict[str, Any] = Field(description="this server's request limits")


# --- errors -------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    field: str | None = Field(None, description="the offending field, e.g. vectors[3].values")
    message: str
    type: str | None = None


class ErrorBody(BaseModel):
    status: int
    code: str = Field(description="machine-readable: invalid_request, not_found, unavailable, ...")
    field: str | None = Field(None, description="the first offending field, if any")
    message: str
    details: list[ErrorDetail] | None = Field(None, description="every problem found (422); on a 507 that stored "
                                              "part of a batch, each id stored (type `stored`, the id in message)")


class ErrorResponse(BaseModel):
    """The one error shape of every 4xx/5xx answer."""

    error: ErrorBody


def body_schema(name: str) -> dict:
    """The ``openapi_extra`` of a route that parses its own body: the body's schema by name
    (one of :func:`request_schemas`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def request_schemas() -> dict[str, dict]:
    """JSON schemas of the request bodies, for the OpenAPI document's components."""
    out: dict[str, dict] = {}
    for name, adapter in (("UpsertRequest", UPSERT_BODY), ("SearchRequest", SEARCH_BODY),
                          ("CollectionRequest", COLLECTION_BODY), ("ScrollRequest", SCROLL_BODY),
                          ("DeleteRequest", DELETE_BODY)):
        schema = adapter.json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[name] = schema
    return out
