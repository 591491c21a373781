"""Service settings, read from ``GMMLSH_*`` environment variables (pydantic-settings).

Environment variables are the one channel that reaches every uvicorn worker
process (workers are spawned, not forked, and rebuild the app from the import
string), so everything the app needs is a field here; :func:`Settings.to_env`
turns a settings object back into that environment for :mod:`gmmlsh.service.server`.

Index *creation* parameters (``dim``, ``samples``, ``bits``, ...) are used only when
the index does not exist yet; unset, they take :class:`~gmmlsh.index.config.IndexConfig`'s
defaults (the one place those are written). An existing index always keeps its
stored parameters. A new index needs ``dim``: without it the server refuses to
start and says so (a dimension guessed from the first insert is a trap: one stray
short vector would fix it for good). Search parameters (``candidates``, ``probes``,
...) override what the index tuned for itself.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, get_type_hints

from pydantic import Field, SecretStr, ValidationInfo, create_model, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gmmlsh.index.config import CREATION_FIELDS, DEFAULT_K, MAX_CANDIDATES, MAX_K, RANK_BITS_MAX, IndexConfig, describe
from gmmlsh.index.mirror import DEFAULT_CACHE_DIR
from gmmlsh.index.monitor import BUDGET
from gmmlsh.index.store.location import DEFAULT_PREFIX, WAIT_TIMEOUT, scrub
from gmmlsh.index.store.location import describe as describe_location
from gmmlsh.index.store.registry import DEFAULT_COLLECTION, check_name

MiB = 1024 * 1024
#: What every setting's environment variable starts with.
ENV_PREFIX = "GMMLSH_"
#: Search parameters an operator may fix for every query (see SearchParams).
SEARCH_FIELDS = ("candidates", "probes", "shortlist", "rank_bits", "rare")


class EnvSettings(BaseSettings):
    """How every ``GMMLSH_*`` variable is read, by the server and the command line alike: the
    prefix, and an empty value meaning unset."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_none(cls, v: object, info: ValidationInfo) -> object:
        """An empty value (``GMMLSH_SAMPLES=``, as compose files pass a variable left unset)
        means unset, for every setting that may be unset (its default then applies)."""
        if isinstance(v, str) and not v.strip() and cls.model_fields[info.field_name].default is None:
            return None
        return v


def from_env(types: dict[str, type]) -> dict[str, Any]:
    """The ``GMMLSH_<NAME>`` variables set for these names, read as :class:`EnvSettings` reads
    (``types``: ``str`` for text an option converts itself, ``bool`` for a flag): the command
    line's option defaults. A value that is no such type raises pydantic's ValidationError,
    located at the variable's name."""
    names = list(types)
    fields = {f"o{i}": (types[n] | None, Field(None, validation_alias=ENV_PREFIX + n.upper()))
              for i, n in enumerate(names)}
    got = create_model("OptionEnv", __base__=EnvSettings, **fields)().model_dump()
    return {n: got[f"o{i}"] for i, n in enumerate(names) if got[f"o{i}"] is not None}


class Where(EnvSettings):
    """Where the index lives and how its store is opened — ``GMMLSH_INDEX``, ``GMMLSH_REDIS_URL``,
    ``GMMLSH_PREFIX``, ``GMMLSH_COLLECTION``, ``GMMLSH_CACHE_DIR``, ``GMMLSH_REDIS_WAIT``: the
    server's :class:`Settings` extend it and the command line fills it from its options (an
    option given wins over the environment; Redis wins over a directory)."""

    index: str | None = Field(None, description="LMDB directory (when no redis_url)")
    redis_url: str | None = Field(None, description="redis:// URL; when set, Redis is used")
    prefix: str = Field(DEFAULT_PREFIX, description="key prefix naming the index inside Redis")
    collection: str = Field(DEFAULT_COLLECTION, description="the collection the routes without "
                            f"/collections/{{name}} use ({DEFAULT_COLLECTION!r}: the index itself)")
    cache_dir: str | None = Field(None, description="where a Redis index's search mirror lives on this machine "
                                  f"(default {DEFAULT_CACHE_DIR})")
    redis_wait: int = Field(0, ge=0, le=64, description="replicas of a Redis master that must hold a write before it "
                            "is acknowledged (Redis WAIT); 0: Redis' asynchronous replication, whose failover may "
                            "lose the writes acknowledged last")
    redis_wait_timeout: float = Field(WAIT_TIMEOUT, gt=0, description="seconds a write waits for those replicas; "
                                      "past it the write fails (503, not acknowledged) and may be sent again")

    @field_validator("collection")
    @classmethod
    def _collection_name(cls, v: str) -> str:
        return v if v == DEFAULT_COLLECTION else check_name(v)

    @property
    def location(self) -> str | None:
        """What :meth:`Index.open` gets: the Redis URL if any, else the LMDB directory."""
        return self.redis_url or self.index

    @property
    def store_options(self) -> dict:
        """What ``Index.open`` gets beyond the location for the store: the prefix, and for Redis
        the mirror's place and the replicas a write waits for."""
        opts: dict = {"prefix": self.prefix}
        if self.redis_url:
            if self.cache_dir:
                opts["cache_dir"] = self.cache_dir
            if self.redis_wait:
                opts.update(wait=self.redis_wait, wait_timeout=self.redis_wait_timeout)
        return opts

    @property
    def safe_location(self) -> str:
        """:attr:`location` fit for logs and messages: a Redis password is masked."""
        return describe_location(str(self.location), self.prefix)

    def scrub(self, text: str) -> str:
        """``text`` with the Redis password (as given, and URL-decoded) replaced by ``***``."""
        return scrub(text, self.redis_url)


def _creation_settings() -> type[BaseSettings]:
    """A settings base with one optional field per :data:`CREATION_FIELDS` entry, typed as
    :class:`IndexConfig` types it and described by :func:`describe` (which shows the real
    default). Generated, so a creation parameter added to or renamed in IndexConfig is a
    setting (and ``GMMLSH_*`` variable) at once; its bounds are IndexConfig's own checks
    (see ``Settings._creation_valid``)."""
    hints = get_type_hints(IndexConfig)
    fields = {name: (hints[name] | None, Field(None, description=describe(name))) for name in CREATION_FIELDS}
    return create_model("CreationSettings", __base__=Where, **fields)


class Settings(_creation_settings()):
    """Everything the server needs; each field ``x`` is also env var ``GMMLSH_X``.

    Creation fields (``dim``, ``samples``, ...: :data:`CREATION_FIELDS`) come from the
    generated base; unset, a new index takes IndexConfig's defaults.
    """

    # --- where the index lives (and the fields of Where) -----------------------------
    index: str = Field("./gmmlsh-index", description="LMDB directory (when no redis_url)")
    open_collections: int = Field(32, ge=1, description="named collections a worker keeps open (the one open "
                                  "longest is closed beyond it; each LMDB one maps 1 TiB of address space)")

    # --- sharded search (a search node behind `gmmlsh route`, and the router) ----------------
    group: str | None = Field(None, pattern=r"^\d+/\d+$", description="search node: serve group g of G of the "
                              "index's id-shards (those with s mod G = g), written g/G; Redis only")
    advertise: str | None = Field(None, description="search node: the URL the router reaches it at (default "
                                  "http://HOST:PORT)")
    snapshots: str | None = Field(None, description="search node: a directory shared by the nodes (a volume) where "
                                  "the builder of each group (a lease in Redis) publishes its mirror, and from which a "
                                  "node with an empty mirror starts")
    snapshot_every: float = Field(60.0, gt=0, description="search node: seconds between the builder's looks for "
                                  "something new to publish")
    populate_vectors: bool | None = Field(None, description="map the vectors column (most of the mirror) into RAM "
                                          "at start; off, only the hot set is, and an answer reads the few vectors "
                                          "it reranks from disk (default: on, except on a search node of a group)")
    route_groups: int | None = Field(None, ge=1, le=1024, description="router: answer through the layout of this "
                                     "many groups (default: the largest one every group of which has a live node)")
    hedge_after: float | None = Field(None, gt=0, description="router: seconds before a second replica of a group "
                                      "is asked too (default: that group's 95th percentile latency)")
    node_timeout: float = Field(10.0, gt=0, description="router: seconds a search node may take to answer")
    route_window: float = Field(0.0005, ge=0, le=0.05, description="router: seconds queries arriving together "
                                "wait to travel to the nodes in one call")

    # --- search parameters (unset: what the index tuned for itself) ------------------------
    candidates: int | None = Field(None, ge=1, le=MAX_CANDIDATES,
                                   description="rerank budget: rows reranked by GMM per query (postings: "
                                   "exactly; sketch: on coarse copies, the best k + max(k, 10) exactly)")
    probes: int | None = Field(None, ge=0, description="inverted lists scanned per query (0: all)")
    shortlist: int | None = Field(None, ge=1, description="rows ranked on every sample per query")
    rank_bits: int | None = Field(None, ge=1, le=RANK_BITS_MAX, description="bits per code in that ranking")
    rare: float | None = Field(None, ge=0, le=1, description="postings search on sparse rows: share of the rows a "
                               "coordinate read is held by at most (0: the sketch search)")

    # --- the recall monitor (gmmlsh.index.monitor) -------------------------------------------
    monitor_budget: float = Field(BUDGET, ge=0, le=1,
                                  description="share of the served searches' CPU time the recall monitor's exact "
                                  "re-runs of a sample of them may take (0: no monitor)")
    monitor_share: float | None = Field(None, ge=0, le=1,
                                        description="share of the served queries the recall monitor checks, fixed "
                                        "(unset: derived from monitor_budget)")

    # --- request limits -----------------------------------------------------------
    max_body_bytes: int = Field(64 * MiB, ge=1024, description="larger bodies get 413")
    max_batch: int = Field(10_000, ge=1, description="vectors or queries per request")
    max_k: int = Field(MAX_K, ge=1, le=MAX_K)
    default_k: int = Field(DEFAULT_K, ge=1, le=MAX_K)
    max_metadata_bytes: int = Field(
        64 * 1024, ge=2, description="largest metadata of one vector, as JSON (it comes back with every hit)"
    )
    body_timeout: float = Field(
        120.0, gt=0, description="seconds a client may take to send a request body; slower ones get 408"
    )

    # --- security -----------------------------------------------------------------
    api_key: SecretStr | None = Field(None, description="when set, required in X-API-Key")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="allowed CORS origins; empty: CORS off"
    )

    # --- server ---------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(1, ge=1)
    threads: int = Field(8, ge=1, description="threads per worker process running index calls")
    log_level: str = "info"
    access_log: bool = Field(True, description="one log line per request (GET vectors make long lines)")

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, v: object) -> object:
        """Accept a JSON list or a comma-separated string (friendlier in compose files)."""
        if isinstance(v, str):
            s = v.strip()
            if s.startswith("["):
                return json.loads(s)
            return [o.strip() for o in s.split(",") if o.strip()]
        return v

    @model_validator(mode="after")
    def _creation_valid(self) -> Settings:
        """Creation parameters are checked by IndexConfig (the one place their bounds live), so a
        bad ``GMMLSH_BITS`` stops the server at start with IndexConfig's words, not at first use.
        Without ``dim`` the others are checked against a stand-in dimension."""
        given = self.creation_given
        if given:
            IndexConfig(**{"dim": 1, **given})
        if self.default_k > self.max_k:
            raise ValueError(f"default_k ({self.default_k}) is over max_k ({self.max_k})")
        if self.group is not None:
            g, G = self.group_pair  # type: ignore[misc]
            if not 0 <= g < G:
                raise ValueError(f"group: expected g/G with 0 ≤ g < G, got {self.group}")
        return self

    @property
    def group_pair(self) -> tuple[int, int] | None:
        """:attr:`group` as ``(g, G)``."""
        if self.group is None:
            return None
        g, G = self.group.split("/")
        return int(g), int(G)

    @property
    def vectors_in_ram(self) -> bool:
        """:attr:`populate_vectors`, or its default."""
        return self.populate_vectors if self.populate_vectors is not None else self.group is None

    @property
    def advertised(self) -> str:
        """The URL a router reaches this node at."""
        if self.advertise:
            return self.advertise.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):  # listening everywhere: this machine's own address (a container's)
            import socket

            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    @property
    def creation_given(self) -> dict:
        """The creation parameters set here (environment or arguments)."""
        return {f: getattr(self, f) for f in CREATION_FIELDS if getattr(self, f) is not None}

    def creation_config(self) -> IndexConfig:
        """The configuration of a new index: the fields set here, IndexConfig's defaults for the rest."""
        return IndexConfig(**self.creation_given)

    @property
    def search_overrides(self) -> dict:
        """Search parameters fixed by the operator (they override the index's tuning)."""
        return {f: getattr(self, f) for f in SEARCH_FIELDS if getattr(self, f) is not None}

    @property
    def backend(self) -> str:
        return "redis" if self.redis_url else "lmdb"

    @property
    def batch_threads(self) -> int:
        """numba threads for one request's batch of queries: the machine's cores shared among
        the workers (more only makes the workers' parallel kernels wait on each other)."""
        return max(1, (os.cpu_count() or 1) // self.workers)

    @property
    def max_readers(self) -> int:
        """LMDB reader slots: every thread of every worker may hold a read txn, plus
        the event loop, plus headroom for CLI processes (``gmmlsh info/query``)."""
        return max(1024, self.workers * (self.threads + 4) + 64)

    def to_env(self) -> dict[str, str]:
        """The ``GMMLSH_*`` variables that rebuild these settings in another process."""
        env: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, list):
                value = json.dumps(value)
            env[f"{ENV_PREFIX}{name.upper()}"] = str(value)
        return env
