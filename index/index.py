"""The GMM index: GCWS sketches, LSH banding, candidate ranking and exact rerank.

Query (mode ``lsh``): sketch the query → read its L buckets in one store call →
the distinct members are the candidates → keep the ``candidates`` (C) with the
highest sketch agreement over all k samples → exact GMM on those → top k.
Ranking is what makes this fast on real data: random Fashion-MNIST pairs have
GMM ≈ 0.32, so banding alone touches a large share of the index, but agreement
over k samples estimates GMM with variance GMM(1−GMM)/k, sharp enough that the
true top 10 sit among the best 200 (see bench/RESULTS.md).

Records under an internal id never change (see :mod:`index.store`), so each
process keeps read caches indexed by iid — 2-bit ranking codes and dense
vectors — filled on demand or by :meth:`Index.warm`: ranking and rerank then
need no store round trip per candidate, and bucket reads stay fresh.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np
import orjson
import scipy.sparse as sp
from gmmlsh.core import gcws, nrff
from gmmlsh.core.agreement import SAMPLES_PER_WORD, agreement2, first_words, pack2, top_by_agreement
from gmmlsh.core.gmm import l1_norms, score_rows
from gmmlsh.core.parallel import PARALLEL_LOCK
from gmmlsh.core.query_kernel import (
    best_by_score,
    rank_dense_queries_parallel,
    rank_dense_queries_serial,
    rank_dense_query,
)
from gmmlsh.core.validate import (
    NonFiniteError,
    VectorError,
    ZeroVectorError,
    check_batch,
    check_dense,
    check_sparse,
    dense_float32_or_none,
)
from gmmlsh.index import codec
from gmmlsh.index.answer_cache import AnswerCache
from gmmlsh.index.banding import Banding
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.store.base import ConfigConflict, RecordBatch, Store
from numba import njit

MODES = ("lsh", "exact", "nrff")
#: Largest k a query may ask for.
MAX_K = 10_000
#: Default rerank budget: candidates scored exactly per query (see bench/RESULTS.md).
DEFAULT_CANDIDATES = 200
#: Default per-process vector cache (bytes); beyond it the rerank reads the store.
DEFAULT_CACHE_BYTES = 1 << 30
#: Records per read when :meth:`Index.warm` loads names and metadata.
_WARM_NAMES_CHUNK = 4096


def _ranked(iids: np.ndarray, sims: np.ndarray, min_similarity: float):
    """(iids, sims) at or above ``min_similarity``, and their order best first (ties by position)."""
    keep = sims >= min_similarity
    iids, sims = iids[keep], sims[keep]
    return iids, sims, np.argsort(-sims, kind="stable")


class UnknownIdError(KeyError):
    """No vector is stored under this external id (the service answers 404)."""

    def __init__(self, ext_id: str):
        super().__init__(ext_id)
        self.ext_id = ext_id

    def __str__(self) -> str:
        return f"id: no vector with id {self.ext_id!r}"


@dataclass
class Neighbor:
    id: str
    similarity: float
    metadata: dict | None = None


@dataclass
class QueryResult:
    mode: str
    k: int
    candidates: int  # how many vectors were scored exactly
    neighbors: list[Neighbor] = field(default_factory=list)


@dataclass
class StoredVector:
    id: str
    values: np.ndarray  # dense float32 (storage "dense") or the sparse values
    indices: np.ndarray | None  # sparse indices, or None for dense storage
    metadata: dict | None


@njit(nogil=True, cache=True)
def _count_hits(members, counts):
    """Distinct members and how often each occurs; ``counts`` is zero on entry and on exit."""
    uniq = np.empty(members.shape[0], dtype=np.int64)
    n = 0
    for m in members:
        if counts[m] == 0:
            uniq[n] = m
            n += 1
        counts[m] += 1
    hits = np.empty(n, dtype=np.int32)
    for t in range(n):
        hits[t] = counts[uniq[t]]
        counts[uniq[t]] = 0
    return uniq[:n], hits


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest scores, best first (stable for ties)."""
    if scores.shape[0] > k:
        part = np.argpartition(-scores, k - 1)[:k]
    else:
        part = np.arange(scores.shape[0])
    return part[np.argsort(-scores[part], kind="stable")]


class _RowCache:
    """iid-indexed copy of fixed-size rows (dense vectors or sketches), filled on first use.

    Safe because a record under an iid never changes. Shared by threads: growth
    swaps in bigger arrays under a lock; fills of distinct rows do not conflict.
    """

    def __init__(self, field: str, width: int, dtype, decode, max_bytes: int):
        self.field, self.width, self.dtype, self._decode = field, width, np.dtype(dtype), decode
        self.max_rows = max(0, max_bytes // (width * self.dtype.itemsize + 9))
        self.values = np.zeros((0, width), dtype=self.dtype)
        self.norms = np.zeros(0)
        self.have = np.zeros(0, dtype=bool)
        self._lock = threading.Lock()

    def _grow(self, need: int) -> None:
        cap = min(self.max_rows, max(need, 2 * self.values.shape[0], 1024))
        values = np.zeros((cap, self.width), dtype=self.dtype)
        norms = np.zeros(cap)
        have = np.zeros(cap, dtype=bool)
        n = self.values.shape[0]
        values[:n], norms[:n], have[:n] = self.values, self.norms, self.have
        self.values, self.norms, self.have = values, norms, have

    def put(self, iids: np.ndarray, blobs: list[bytes]) -> int:
        """Fill rows for these iids from their blobs (those within the budget); returns how many."""
        keep = iids < self.max_rows
        if not keep.shape[0] or not keep.any():
            return 0
        iids = iids[keep]
        values, norms = self._decode([b for b, k in zip(blobs, keep, strict=True) if k])
        with self._lock:
            if int(iids.max()) >= self.values.shape[0]:
                self._grow(int(iids.max()) + 1)
            self._fill(iids, values, norms)
            self.have[iids] = True
        return int(iids.shape[0])

    def _fill(self, iids: np.ndarray, values: np.ndarray, norms: np.ndarray) -> None:
        """Write decoded rows (under the lock); subclasses keeping derived arrays extend it."""
        self.values[iids], self.norms[iids] = values, norms

    def scoring_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values, norms, have) as one consistent triple (a concurrent grow swaps all three)."""
        with self._lock:
            return self.values, self.norms, self.have

    def rows(self, iids: np.ndarray, store: Store):
        """(live iids, values, norms, rows): row ``rows[t]`` of ``values`` belongs to ``live[t]``.

        Cached iids cost nothing; misses are fetched in one store call. iids past
        the cache's budget are fetched into a temporary array instead.
        """
        if iids.shape[0] == 0 or int(iids.max()) >= self.max_rows:
            blobs = store.fetch(iids, self.field)
            ok = np.array([b is not None for b in blobs], dtype=bool)
            values, norms = self._decode([b for b in blobs if b is not None])
            return iids[ok], values, norms, np.arange(values.shape[0], dtype=np.int64)
        with self._lock:
            have = self.have if self.have.shape[0] > int(iids.max()) else None
        missing = iids if have is None else iids[~have[iids]]
        if missing.shape[0]:
            blobs = store.fetch(missing, self.field)
            ok = np.array([b is not None for b in blobs], dtype=bool)
            self.put(missing[ok], [b for b in blobs if b is not None])
            if not ok.all():  # retired between the candidate read and now
                iids = iids[~np.isin(iids, missing[~ok])]
        with self._lock:
            values, norms = self.values, self.norms
        live = iids.astype(np.int64)
        return live, values, norms, live


class _SketchCache(_RowCache):
    """The 2-bit ranking codes, plus their first-stage words kept word-major for the scan.

    ``first[:, iid]`` holds ``values[iid, :FIRST_WORDS]`` as bit planes
    (:func:`core.agreement.first_words`): the scan reads that contiguous array
    instead of every other cache line of ``values``.
    """

    def __init__(self, field: str, width: int, dtype, decode, max_bytes: int):
        super().__init__(field, width, dtype, decode, max_bytes)
        self.first = first_words(self.values)
        self.max_rows = max(0, max_bytes // ((width + self.first.shape[0]) * self.dtype.itemsize + 9))

    def _grow(self, need: int) -> None:
        super()._grow(need)
        first = np.zeros((self.first.shape[0], self.values.shape[0]), dtype=self.dtype)
        first[:, : self.first.shape[1]] = self.first
        self.first = first

    def _fill(self, iids: np.ndarray, values: np.ndarray, norms: np.ndarray) -> None:
        super()._fill(iids, values, norms)
        self.first[:, iids] = first_words(values)

    def scan_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values, first, have) as one consistent triple."""
        with self._lock:
            return self.values, self.first, self.have


def is_redis(location) -> bool:
    """Whether a location names a Redis server rather than an LMDB directory."""
    return str(location).startswith(("redis://", "rediss://", "unix://"))


def open_store(location, *, prefix: str = "gmmlsh", **options) -> Store:
    """A directory → LMDB; a ``redis://`` / ``rediss://`` URL → Redis."""
    loc = str(location)
    if is_redis(loc):
        from gmmlsh.index.store.redis import RedisStore

        return RedisStore(loc, prefix=prefix, **options)
    from gmmlsh.index.store.lmdb import LmdbStore

    return LmdbStore(loc, **options)


class Index:
    """An opened index. One instance per process (never share one across fork); thread-safe."""

    def __init__(
        self,
        store: Store,
        config: IndexConfig,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        default_candidates: int | None = None,
    ):
        self.store = store
        self.config = config
        self.banding = Banding(config.bands, config.rows, config.bits)
        self.default_candidates = int(default_candidates or config.extra.get("candidates", DEFAULT_CANDIDATES))
        self._center = np.asarray(config.center, dtype=np.float64) if config.center is not None else None
        dim = config.dim
        self._cache = (
            _RowCache("vector", dim, np.float32, lambda b: codec.decode_dense(b, dim), cache_bytes)
            if config.storage == "dense"
            else None
        )
        # 2-bit ranking codes (k/4 bytes a vector, padded to whole 8-word AVX-512 registers).
        self._rank_words = -(-config.k // (8 * SAMPLES_PER_WORD)) * 8
        self._sketches = _SketchCache("sketch", self._rank_words, np.uint64, self._decode_sketches, cache_bytes // 4)
        self._scratch = threading.local()
        # Scan state: every iid the store allocated up to _token has its sketch in
        # self._sketches, or is retired, or is in _holes: absent when last fetched, kept
        # for a while because a Redis writer allocates iids before it commits them.
        # Rows below _scan_n are scanned.
        self._token: object | None = None
        self._scan_n = 0
        self._holes = np.zeros(0, dtype=np.int64)
        self._holes_since = np.zeros(0)
        self._holes_checked = 0.0
        self._refresh_lock = threading.Lock()
        self._answers = AnswerCache()

    def _decode_sketches(self, blobs: list[bytes]):
        packed = np.frombuffer(b"".join(blobs), np.uint8).reshape(len(blobs), -1)
        return pack2(gcws.unpack_codes(packed, self.config.k, self.config.bits), self._rank_words), np.zeros(len(blobs))

    # --- opening ------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        location,
        config: IndexConfig | None = None,
        *,
        prefix: str = "gmmlsh",
        create: bool = True,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        **store_options,
    ) -> Index:
        """Open (or create, given a config) the index at a directory or Redis URL."""
        loc = str(location)
        shown = loc
        if is_redis(loc):
            from gmmlsh.index.store.redis import mask_url

            shown = mask_url(loc)  # error messages never carry a password
        elif config is None and not (Path(loc) / "data.mdb").exists():
            raise FileNotFoundError(f"index: no index at {shown}; create one by giving its parameters (dim, ...)")
        store = open_store(loc, prefix=prefix, **store_options)
        try:
            stored = store.read_config()
            if stored is None:
                if config is None or not create:
                    raise FileNotFoundError(f"index: no index at {shown} (prefix {prefix!r})")
                stored = store.init_config(config.to_dict())
            found = IndexConfig.from_dict(stored)
            if config is not None:
                diffs = config.conflicts(found)
                if diffs:
                    raise ConfigConflict(f"index at {shown} has other parameters: " + "; ".join(diffs))
        except BaseException:
            store.close()
            raise
        return cls(store, found, cache_bytes=cache_bytes)

    # --- vector preparation ---------------------------------------------------------
    def _as_stored(self, X, field_name: str = "vectors"):
        """Validate a batch and round it to what is stored: float32, dense or CSR per config."""
        cfg = self.config
        X = check_batch(X, cfg.dim, field=field_name)
        with np.errstate(over="ignore"):
            if cfg.storage == "dense":
                X32 = (X.toarray() if sp.issparse(X) else X).astype(np.float32)
                values, rows_nonzero = X32, X32.any(axis=1)
            else:
                X32 = sp.csr_matrix(X, dtype=np.float32)
                X32.sort_indices()
                values = X32.data
                row_of = np.repeat(np.arange(X32.shape[0]), np.diff(X32.indptr))
                rows_nonzero = np.bincount(row_of[values != 0], minlength=X32.shape[0]) > 0
        # What float32 storage did to valid float64 input: overflow to inf, underflow to 0.
        finite = np.isfinite(values)
        if not finite.all():
            pos = int(np.flatnonzero(~finite.ravel())[0])
            bad = np.searchsorted(X32.indptr, pos, "right") - 1 if sp.issparse(X32) else pos // cfg.dim
            raise NonFiniteError(f"{field_name}[{int(bad)}]", "a value overflows float32, the stored precision")
        if not rows_nonzero.all():
            raise ZeroVectorError(f"{field_name}[{int(np.flatnonzero(~rows_nonzero)[0])}]",
                                  "all values underflow to 0 in float32, the stored precision")
        return X32

    def _hashable(self, X32):
        """Stored values as sketches and norms see them: the centre subtracted, if any."""
        if sp.issparse(X32) or self._center is None:
            return X32  # the kernels widen float32 to float64 themselves
        X = X32.astype(np.float64) - self._center
        empty = np.flatnonzero(~X.any(axis=1))
        if empty.size:
            raise ZeroVectorError(f"vectors[{int(empty[0])}]", "equals the index centre: nothing to sample")
        return X

    def _codes(self, Xh) -> np.ndarray:
        cfg = self.config
        if cfg.t_bits:
            istar, tstar = gcws.sketch(Xh, cfg.k, cfg.seed, return_t=True, check=False)
        else:
            istar, tstar = gcws.sketch(Xh, cfg.k, cfg.seed, check=False), None
        return gcws.bbit_codes(istar, cfg.bits, cfg.seed, tstar, cfg.t_bits)

    # --- writes ---------------------------------------------------------------------
    def upsert(self, ids: Sequence[str], X, metadata: Sequence[dict | None] | None = None) -> int:
        """Insert or replace vectors by id. Validates all rows first; writes all or nothing."""
        return self.write(self.prepare(ids, X, metadata))

    def write(self, batch: RecordBatch) -> int:
        """Store a batch made by this index's :meth:`prepare` (all or nothing); returns its rows.

        The batch's band keys follow this index's configuration: one prepared by an index
        with other parameters would file its vectors in the wrong buckets.

        Split from :meth:`prepare` so that a bulk load can hash the next batch on
        other cores while this one is written (see :mod:`index.build`).
        """
        if len(batch):
            self.store.upsert(batch, self.banding.keys_from_sketches)
        return len(batch)

    def prepare(self, ids: Sequence[str], X, metadata: Sequence[dict | None] | None = None) -> RecordBatch:
        """Validate and hash rows into the records :meth:`write` stores; touches no store.

        Raises :class:`VectorError` naming the first bad field (``ids[i]``, ``metadata[i]``,
        a row of ``X``).
        """
        ids = [self._check_id(i, f"ids[{n}]") for n, i in enumerate(ids)]
        n = X.shape[0] if hasattr(X, "shape") and np.ndim(X) == 2 else len(X)
        if len(ids) != n:
            raise VectorError("ids", f"{len(ids)} ids for {n} vectors")
        if metadata is not None and len(metadata) != n:
            raise VectorError("metadata", f"{len(metadata)} entries for {n} vectors")
        if n == 0:
            return RecordBatch(ids=[], vectors=[], sketches=np.zeros((0, 0), np.uint8),
                               band_keys=np.zeros((0, 0, 0), np.uint8))
        X32 = self._as_stored(X)
        meta = None
        if metadata is not None:
            meta = []
            for j, m in enumerate(metadata):
                if m is not None and not isinstance(m, dict):
                    raise VectorError(f"metadata[{j}]", "must be a JSON object or null")
                try:
                    meta.append(orjson.dumps(m) if m is not None else None)
                except TypeError as exc:
                    raise VectorError(f"metadata[{j}]", f"not JSON-serialisable ({exc})") from None
        Xh = self._hashable(X32)
        codes = self._codes(Xh)
        norms = l1_norms(Xh)
        vectors = codec.encode_dense(X32, norms) if self.config.storage == "dense" else codec.encode_sparse(X32, norms)
        feats = None
        if self.config.nrff_k:
            feats = nrff.features(
                X32.astype(np.float64) if not sp.issparse(X32) else X32,
                self.config.nrff_k,
                self.config.gamma,
                self.config.seed,
            ).astype(np.float32)
        batch = RecordBatch(
            ids=ids,
            vectors=vectors,
            sketches=gcws.pack_codes(codes, self.config.bits),
            band_keys=self.banding.keys_from_codes(codes),
            nrff=feats,
            meta=meta,
        )
        return batch

    def delete(self, ids: Sequence[str]) -> int:
        """Remove these ids everywhere; returns how many existed."""
        ids = [self._check_id(i, f"ids[{n}]") for n, i in enumerate(ids)]
        return self.store.delete(ids, self.banding.keys_from_sketches) if ids else 0

    @staticmethod
    def _check_id(ext_id, field_name: str = "id") -> str:
        if not isinstance(ext_id, str):
            raise VectorError(field_name, f"ids are strings, got {type(ext_id).__name__}")
        if not ext_id or len(ext_id.encode()) > 511:
            raise VectorError(field_name, "ids must be 1 to 511 bytes of UTF-8 (LMDB's key limit)")
        return ext_id

    # --- reads ----------------------------------------------------------------------
    def count(self) -> int:
        return self.store.count()

    def contains(self, ext_id: str) -> bool:
        return bool(self.store.lookup([ext_id])[0] >= 0)

    def _iid(self, ext_id: str) -> int:
        iid = int(self.store.lookup([self._check_id(ext_id)])[0])
        if iid < 0:
            raise UnknownIdError(ext_id)
        return iid

    def _decode(self, blobs: list[bytes]):
        """Vector blobs → (rows, L1 norms): float32 dense rows or a CSR matrix, per the storage."""
        if self.config.storage == "dense":
            return codec.decode_dense(blobs, self.config.dim)
        return codec.decode_sparse(blobs, self.config.dim)

    def _fetch_vectors(self, iids: np.ndarray):
        """(live iids, rows, norms) of these iids, in one store call; retired ones are dropped."""
        blobs = self.store.fetch(iids, "vector")
        ok = np.array([b is not None for b in blobs], dtype=bool)
        X, norms = self._decode([b for b in blobs if b is not None])
        return iids[ok], X, norms

    def _read(self, ext_id: str, with_meta: bool):
        """(iid, vector blob, metadata blob) of an id, all of one version.

        A record under an iid never changes, so its blobs cannot mix versions — unless
        the id is replaced (its iid retired) between the reads; then read again.
        """
        for _ in range(8):
            iid = self._iid(ext_id)
            at = np.array([iid], dtype=np.int64)
            blob = self.store.fetch(at, "vector")[0]
            meta = self.store.fetch(at, "meta")[0] if with_meta else None
            if blob is not None and (not with_meta or meta is not None or int(self.store.lookup([ext_id])[0]) == iid):
                return iid, blob, meta
        raise UnknownIdError(ext_id)

    def get(self, ext_id: str) -> StoredVector:
        """The stored vector (float32 values) and metadata of an id."""
        _, blob, meta = self._read(ext_id, with_meta=True)
        X, _ = self._decode([blob])
        meta = orjson.loads(meta) if meta else None
        if self.config.storage == "dense":
            return StoredVector(ext_id, X[0].copy(), None, meta)
        return StoredVector(ext_id, X.data.copy(), X.indices.astype(np.int64), meta)

    def _query_vector(self, vector):
        """An ad-hoc query, validated and rounded to stored precision (1-D or 1-row CSR)."""
        dim = self.config.dim
        if self.config.storage == "dense":
            fast = dense_float32_or_none(vector, dim)
            if fast is not None:
                return fast
        if isinstance(vector, tuple) and len(vector) == 2:
            idx, val = check_sparse(vector[0], vector[1], dim, field="vector")
            vector = sp.csr_matrix((val, idx, [0, idx.size]), shape=(1, dim))
        elif not sp.issparse(vector):
            vector = check_dense(vector, dim, field="vector")
        X32 = self._as_stored(vector if sp.issparse(vector) else vector[None, :], "vector")
        return X32 if sp.issparse(X32) else X32[0]

    def _stored_query(self, ext_id: str):
        """(iid, stored vector as a query: 1-D float32, or a 1-row CSR) of one version of an id."""
        iid, blob, _ = self._read(ext_id, with_meta=False)
        X, _ = self._decode([blob])
        return iid, (X if sp.issparse(X) else X[0].copy())

    # --- query ----------------------------------------------------------------------
    def query(
        self,
        vector=None,
        *,
        id: str | None = None,
        k: int = 10,
        mode: str = "lsh",
        min_similarity: float = 0.0,
        candidates: int | None = None,
        bands: int | None = None,
    ) -> QueryResult:
        """Nearest neighbours of a vector or of a stored id (which is then left out)."""
        if (vector is None) == (id is None):
            raise VectorError("vector", "give exactly one of a vector or an id")
        opts = self._check_options(k, mode, min_similarity, candidates, bands)
        exclude = -1
        if id is not None:
            exclude, q = self._stored_query(id)
        else:
            q = self._query_vector(vector)
        qh = self._hashable(q if sp.issparse(q) else q[None, :])
        k, _, min_similarity, budget, bands = opts
        if mode == "lsh" and bands is None and self._fused_applies(qh):
            # speculative first; again after a refresh if another process allocated iids since
            for speculative in (True, False):
                found = self._lsh_fused(qh[0], exclude, budget, speculative)
                if found is None:
                    break
                result = self._result(mode, k, *found, min_similarity, id)
                if result is not None:
                    return result
        codes = self._codes(qh) if mode == "lsh" else None
        return self._answer(q, qh, codes, exclude, *opts, exclude_id=id)

    def query_batch(
        self,
        X,
        *,
        k: int = 10,
        mode: str = "lsh",
        min_similarity: float = 0.0,
        candidates: int | None = None,
        bands: int | None = None,
    ) -> list[QueryResult]:
        """One query per row of ``X`` (dense 2-D or CSR); the batch is hashed in one kernel call."""
        opts = self._check_options(k, mode, min_similarity, candidates, bands)
        Q = self._as_stored(X, "vectors")
        Qh = self._hashable(Q)
        k, _, min_similarity, budget, bands = opts
        if mode == "lsh" and bands is None and Q.shape[0] and self._fused_applies(Qh):
            for speculative in (True, False):
                found = self._lsh_fused_batch(Qh, budget, speculative)
                if found is None:
                    break
                results = self._results_batch(mode, k, *found, min_similarity)
                if results is not None:
                    return results
        codes = self._codes(Qh) if mode == "lsh" else None
        return [
            self._answer(
                Q[i] if sp.issparse(Q) else Q[i],
                Qh[i] if sp.issparse(Qh) else Qh[i : i + 1],
                None if codes is None else codes[i : i + 1],
                -1,
                *opts,
            )
            for i in range(Q.shape[0])
        ]

    def _check_options(self, k, mode, min_similarity, candidates, bands):
        k = self._check_k(k)
        if mode not in MODES:
            raise VectorError("mode", f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        if not (isinstance(min_similarity, int | float) and math.isfinite(min_similarity)):
            raise VectorError("min_similarity", "must be a finite number")
        budget = self.default_candidates if candidates is None else int(candidates)
        if budget < 1:
            raise VectorError("candidates", f"must be ≥ 1, got {budget}")
        if bands is not None and not 1 <= bands <= self.config.bands:
            raise VectorError("bands", f"must be between 1 and {self.config.bands}, got {bands}")
        return k, mode, min_similarity, budget, bands

    def _answer(self, q, qh, codes, exclude, k, mode, min_similarity, budget, bands,
                exclude_id: str | None = None) -> QueryResult:
        q64 = qh if sp.issparse(qh) else qh[0]
        if mode == "lsh":
            iids, sims = self._lsh(q64, codes, exclude, budget, bands)
        elif mode == "exact":
            iids, sims = self._exact(q64, exclude)
        else:
            iids, sims = self._nrff(q, exclude, budget)
        return self._result(mode, k, iids, sims, None, min_similarity, exclude_id)

    @staticmethod
    def _check_k(k) -> int:
        if isinstance(k, bool) or not isinstance(k, int | np.integer):
            raise VectorError("k", f"must be an integer, got {k!r}")
        if not 1 <= k <= MAX_K:
            raise VectorError("k", f"must be between 1 and {MAX_K}, got {k}")
        return int(k)

    def _counts(self, bound: int) -> np.ndarray:
        counts = getattr(self._scratch, "counts", None)
        if counts is None or counts.shape[0] < bound:
            counts = np.zeros(max(bound, 1024) * 2, dtype=np.int32)
            self._scratch.counts = counts
        return counts

    def candidates(self, codes: np.ndarray, bands: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Distinct bucket members for a query's codes, with their band-hit counts."""
        keys = self.banding.key_list(self.banding.keys_from_codes(codes)[0], bands)
        members = self.store.bucket_members(keys)
        if members.shape[0] == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        return _count_hits(members, self._counts(int(members.max()) + 1))

    def _lsh(self, q64, codes: np.ndarray, exclude: int, budget: int, bands: int | None):
        """Candidates → best ``budget`` by full-sketch agreement → exact GMM.

        Agreement over all k samples (2-bit codes, :mod:`core.agreement`) is a far
        sharper ranking than the count of whole bands hit. Where this process holds
        every sketch of the index (it fits the cache), the candidates are *all*
        vectors and the ranking is one contiguous scan: measured on Fashion-MNIST,
        that costs less than reading the buckets, which touch ~27 % of the index on
        such data. Otherwise, or when ``bands`` is given, the candidates are the
        members of the query's buckets.
        """
        if bands is None and self._refresh_sketches() >= 0:
            S, F, have = self._sketches.scan_arrays()
            q = pack2(codes, self._rank_words)[0]
            rows, scores = top_by_agreement(q, S, F, have, min(self._scan_n, S.shape[0]), budget + 1)
            # exclude: the query's own vector, when it is asked for by id
            return self._score(q64, best_by_score(rows, scores, exclude, budget))
        iids, _ = self.candidates(codes, bands)
        if exclude >= 0:
            iids = iids[iids != exclude]
        if iids.shape[0] > budget:
            live, S, _, rows = self._sketches.rows(iids, self.store)
            agree = agreement2(pack2(codes, self._rank_words)[0], S, rows)
            iids = live[_top(agree.astype(np.float64), budget)]
        return self._score(q64, iids)

    def _fused_applies(self, qh) -> bool:
        """Whether :func:`core.query_kernel.rank_dense_query` can answer: dense float32 rows
        and query, no centre, i* codes only, and a constant table that fits."""
        cfg = self.config
        return (self._cache is not None and self._center is None and not cfg.t_bits
                and not sp.issparse(qh) and qh.dtype == np.float32 and gcws.table_fits(cfg.dim, cfg.k))

    def _lsh_fused(self, q32: np.ndarray, exclude: int, budget: int, speculative: bool = False):
        """The default lsh query in one compiled call: (rows, sims, unconfirmed), or None
        when the scan cannot hold the index.

        With ``speculative`` the sketch cache is scanned as it is, without first asking
        the store for new iids (a round trip on Redis), and ``unconfirmed`` is the
        allocation token the cache was current at: the answer's own read then checks
        it (see :meth:`_result`). Otherwise the cache is refreshed first and
        ``unconfirmed`` is None. Not speculative before the first refresh or while
        some iids wait to be re-fetched (a writer was mid-commit).
        """
        inputs = self._fused_inputs(speculative)
        if inputs is None:
            return None
        unconfirmed, (table, walk_e, walk_c, k, bits, seed, words, S, F, have, n), (values, norms, cached) = inputs
        rows, sims, complete = rank_dense_query(
            q32, table, walk_e, walk_c, k, bits, seed, words, S, F, have, n, budget, exclude, values, norms, cached,
            float(np.abs(q32.astype(np.float64)).sum()))
        if not complete:  # some chosen rows are not cached yet: fetch and score them
            return (*self._score(q32, rows), unconfirmed)
        return rows, sims, unconfirmed

    def _fused_inputs(self, speculative: bool):
        """(unconfirmed token, the scan's arrays, the vector cache's arrays) for the fused
        kernels, after a refresh unless ``speculative`` (see :meth:`_lsh_fused`); None when
        the scan cannot hold the index."""
        unconfirmed = self._token if speculative and not self._holes.shape[0] else None
        if (unconfirmed is None or self._scan_n > self._sketches.max_rows) and self._refresh_sketches() < 0:
            return None
        cfg = self.config
        S, F, have = self._sketches.scan_arrays()
        table = gcws.constant_table(2 * cfg.dim, cfg.k, cfg.seed)
        walk_e, walk_c = gcws.walk_table(2 * cfg.dim, cfg.k, cfg.seed)
        scan = (table, walk_e, walk_c, cfg.k, cfg.bits, np.uint64(cfg.seed), self._rank_words, S, F, have,
                min(self._scan_n, S.shape[0]))
        return unconfirmed, scan, self._cache.scoring_arrays()

    def _lsh_fused_batch(self, Q32: np.ndarray, budget: int, speculative: bool):
        """:meth:`_lsh_fused` for every row of ``Q32`` in one kernel call: ([(rows, sims)], unconfirmed),
        or None when the scan cannot hold the index."""
        inputs = self._fused_inputs(speculative)
        if inputs is None:
            return None
        unconfirmed, scan, scoring = inputs
        m = Q32.shape[0]
        rows = np.empty((m, budget), dtype=np.int64)
        sims = np.empty((m, budget))
        counts = np.empty(m, dtype=np.int64)
        complete = np.empty(m, dtype=np.bool_)
        qn = np.abs(Q32.astype(np.float64)).sum(axis=1)
        if numba.get_num_threads() > 1 and m > 1:
            with PARALLEL_LOCK:
                rank_dense_queries_parallel(Q32, qn, *scan, budget, *scoring, rows, sims, counts, complete)
        else:
            rank_dense_queries_serial(Q32, qn, *scan, budget, *scoring, rows, sims, counts, complete)
        found = []
        for i, (c, ok) in enumerate(zip(counts.tolist(), complete.tolist(), strict=True)):
            found.append((rows[i, :c], sims[i, :c]) if ok else self._score(Q32[i], rows[i, :c]))
        return found, unconfirmed

    def _refresh_sketches(self) -> int:
        """Bring the sketch cache up to date with the store; −1 if it cannot hold them all.

        New iids (from this or any other process) come from the store's allocation
        feed and are fetched in one call per 16,384; iids absent then are re-fetched
        for two minutes (a Redis writer's commit may still be on its way), at most
        every half second. Returns how many sketches were loaded.
        """
        if self._scan_n > self._sketches.max_rows:
            return -1
        now = time.monotonic()
        with self._refresh_lock:
            new, token = self.store.allocated_since(self._token)
            if new.shape[0] and int(new.max()) >= self._sketches.max_rows:
                self._scan_n = int(new.max()) + 1  # too big to scan: buckets from now on
                return -1
            loaded = 0
            if self._holes.shape[0] and now - self._holes_checked > 0.5:
                self._holes_checked = now
                keep = now - self._holes_since < 120.0
                holes, since = self._holes[keep], self._holes_since[keep]
                got, filled = self._load_sketches(holes)
                loaded += got
                self._holes, self._holes_since = holes[~filled], since[~filled]
            for lo in range(0, new.shape[0], 16_384):
                iids = new[lo : lo + 16_384]
                got, filled = self._load_sketches(iids)
                loaded += got
                self._holes = np.concatenate([self._holes, iids[~filled]])
                self._holes_since = np.concatenate([self._holes_since, np.full(int((~filled).sum()), now)])
            if new.shape[0]:
                self._scan_n = max(self._scan_n, int(new.max()) + 1)
            self._token = token
            return loaded

    def _load_sketches(self, iids: np.ndarray) -> tuple[int, np.ndarray]:
        if iids.shape[0] == 0:
            return 0, np.zeros(0, dtype=bool)
        blobs = self.store.fetch(iids, "sketch")
        filled = np.array([b is not None for b in blobs], dtype=bool)
        if filled.any():
            self._sketches.put(iids[filled], [b for b in blobs if b is not None])
        return int(filled.sum()), filled

    def _score(self, q64, iids: np.ndarray):
        """Exact GMM of the query against these iids (those still present)."""
        if iids.shape[0] == 0:
            return iids.astype(np.int64), np.zeros(0)
        if self._cache is not None:
            live, values, norms, rows = self._cache.rows(iids, self.store)
            if self._center is not None:
                return live, score_rows(q64, self._centred(values[rows]), None, norms[rows])
            return live, score_rows(q64, values, rows, norms)
        live, X, norms = self._fetch_vectors(iids)
        return live, score_rows(q64, X, None, norms)

    def _centred(self, X):
        if self._center is None or sp.issparse(X):
            return X
        return X.astype(np.float64) - self._center

    def _exact(self, q64, exclude: int):
        """Brute force over every stored vector: the ground truth."""
        all_iids, all_sims = [], []
        for iids, blobs in self.store.scan("vector"):
            X, norms = self._decode(blobs)
            all_iids.append(iids)
            all_sims.append(score_rows(q64, self._centred(X), None, norms))
        if not all_iids:
            return np.zeros(0, np.int64), np.zeros(0)
        iids, sims = np.concatenate(all_iids), np.concatenate(all_sims)
        keep = iids != exclude
        return iids[keep], sims[keep]

    def _nrff(self, q, exclude: int, budget: int):
        """Scan stored NRFF features, then score the best ``budget`` by the exact RBF."""
        cfg = self.config
        if not cfg.nrff_k:
            raise VectorError("mode", "this index stores no NRFF features (created with nrff_k=0)")
        f = nrff.features(q if sp.issparse(q) else q.astype(np.float64), cfg.nrff_k, cfg.gamma, cfg.seed)
        f = np.asarray(f, dtype=np.float32).reshape(-1)
        all_iids, all_est = [], []
        for iids, blobs in self.store.scan("nrff"):
            F = np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(blobs), cfg.nrff_k)
            all_iids.append(iids)
            all_est.append(F @ f)
        if not all_iids:
            return np.zeros(0, np.int64), np.zeros(0)
        iids, est = np.concatenate(all_iids), np.concatenate(all_est).astype(np.float64)
        keep = iids != exclude
        iids, est = iids[keep], est[keep]
        top = iids[_top(est, min(budget, iids.shape[0]))]
        return self._rbf(q, top)

    def _rbf(self, q, iids: np.ndarray):
        """Exact RBF on the correlation, exp(−γ(1 − ρ)), of the query against these iids."""
        live, X, _ = self._fetch_vectors(iids)
        X = X.astype(np.float64)
        if not sp.issparse(X):
            qv = np.asarray(q, dtype=np.float64)
            dots = X @ qv
            xn = np.linalg.norm(X, axis=1)
            qn = np.linalg.norm(qv)
        else:
            qs = sp.csr_matrix(q, dtype=np.float64)
            dots = np.asarray((X @ qs.T).todense()).ravel()
            xn = np.sqrt(np.asarray(X.multiply(X).sum(axis=1)).ravel())
            qn = math.sqrt(float(qs.multiply(qs).sum()))
        rho = np.clip(dots / (xn * qn), -1.0, 1.0)
        return live, np.exp(-self.config.gamma * (1.0 - rho))

    def _result(self, mode: str, k: int, iids: np.ndarray, sims: np.ndarray, unconfirmed: object | None,
                min_similarity: float, exclude_id: str | None = None) -> QueryResult | None:
        """The best k scored candidates that are still live, with their ids and metadata.

        A candidate can be a retired version (replaced or deleted since this process
        cached it): it has no id any more. Such iids are skipped — the window widens
        until k live ones are found — and forgotten, so they stop taking rerank slots.
        ``exclude_id`` (a query by id) is left out by name too: the id may have been
        replaced by a new version since its iid was looked up. ``unconfirmed``: the
        allocation token a speculative scan used (None: nothing to confirm); the first
        read also asks whether iids were allocated since, and if so the answer may miss
        them: None is returned and the caller answers again after a refresh.

        Names already read come from :class:`index.answer_cache.AnswerCache`: when every
        neighbour's is cached, one read of the allocation counter and the store's epoch
        (``Store.news_and_epoch``) replaces reading the records, as long as the epoch
        still equals the one the names were read at (no iid retired since).
        """
        scored = int(iids.shape[0])
        iids, sims, order = _ranked(iids, sims, min_similarity)
        epoch, known = self._answers.snapshot()
        if epoch is not None:
            cached = self._cached_neighbors(iids, sims, order, k, known, exclude_id)
            if cached is not None:  # every neighbour's name is known: one counter read confirms
                news, now = self.store.news_and_epoch(unconfirmed)
                if news and unconfirmed is not None:
                    return None
                if now == epoch:
                    return QueryResult(mode=mode, k=k, candidates=scored, neighbors=cached)
                unconfirmed = None  # no news; names must be read again (some may have died)
        neighbors: list[Neighbor] = []
        start, window = 0, k
        first = True
        # an unconfirmed answer reads at least once, even with nothing to name
        while (len(neighbors) < k and start < order.shape[0]) or unconfirmed is not None:
            sel = order[start : start + window]
            sel_iids = iids[sel].tolist()
            if first and (unconfirmed is not None or epoch is not None):
                names, metas, news, now = self.store.ids_fetch_and_news(iids[sel], "meta", unconfirmed)
                if news and unconfirmed is not None:
                    return None
                unconfirmed = None
                self._answers.add(now, sel_iids, names, metas)
            else:
                names, metas = self.store.ids_and_fetch(iids[sel], "meta")
            first = False
            for iid, s, name, m in zip(sel_iids, sims[sel].tolist(), names, metas, strict=True):
                if name is None:
                    self._forget(iid)
                elif len(neighbors) < k and name != exclude_id:
                    neighbors.append(Neighbor(name, float(s), orjson.loads(m) if m else None))
            start, window = start + window, window * 4
        return QueryResult(mode=mode, k=k, candidates=scored, neighbors=neighbors)

    def _results_batch(self, mode: str, k: int, found: list[tuple[np.ndarray, np.ndarray]],
                       unconfirmed: object | None, min_similarity: float) -> list[QueryResult] | None:
        """:meth:`_result` for a batch of queries with one store read for all of them: the
        names of every query's top k not cached yet, or (all cached) the epoch alone. Where
        that is not enough (no epoch, retired or filtered neighbours), a query reads alone."""
        epoch, known = self._answers.snapshot()
        if epoch is None:
            results = []
            for i, (iids, sims) in enumerate(found):
                result = self._result(mode, k, iids, sims, unconfirmed if i == 0 else None, min_similarity)
                if result is None:
                    return None
                results.append(result)
            return results
        ranked = [_ranked(iids, sims, min_similarity) for iids, sims in found]
        tops = np.unique(np.concatenate([iids[order[:k]] for iids, _, order in ranked] + [np.zeros(0, np.int64)]))
        missing = np.array([i for i in tops.tolist() if i not in known], dtype=np.int64)
        if missing.shape[0]:
            names, metas, news, now = self.store.ids_fetch_and_news(missing, "meta", unconfirmed)
            self._answers.add(now, missing.tolist(), names, metas)
        else:
            news, now = self.store.news_and_epoch(unconfirmed)
        if news and unconfirmed is not None:
            return None
        epoch, known = self._answers.snapshot()
        results = []
        for (iids, sims, order), (all_iids, all_sims) in zip(ranked, found, strict=True):
            cached = self._cached_neighbors(iids, sims, order, k, known, None) if epoch == now else None
            if cached is None:
                results.append(self._result(mode, k, all_iids, all_sims, None, min_similarity))
            else:
                results.append(QueryResult(mode=mode, k=k, candidates=int(all_iids.shape[0]), neighbors=cached))
        return results

    @staticmethod
    def _cached_neighbors(iids: np.ndarray, sims: np.ndarray, order: np.ndarray, k: int,
                          known: dict, exclude_id: str | None) -> list[Neighbor] | None:
        """The answer from cached names (best first, ``exclude_id`` left out), or None as
        soon as a candidate it needs is not cached."""
        out: list[Neighbor] = []
        for p in order.tolist():
            entry = known.get(int(iids[p]))
            if entry is None:
                return None
            name, m = entry
            if name != exclude_id:
                out.append(Neighbor(name, float(sims[p]), orjson.loads(m) if m else None))
                if len(out) == k:
                    break
        return out

    def _forget(self, iid: int) -> None:
        """Drop a retired iid from this process's caches (it will never come back)."""
        for cache in (self._sketches, self._cache):
            if cache is not None and iid < cache.have.shape[0]:
                cache.have[iid] = False
        self._answers.forget(iid)

    # --- housekeeping ---------------------------------------------------------------
    def sketch_stored(self, blobs: list[bytes]) -> np.ndarray:
        """Packed sketches of stored vector blobs: exactly what an upsert stored for them."""
        X, _ = self._decode(blobs)
        return gcws.pack_codes(self._codes(self._hashable(X)), self.config.bits)

    def warm(self, vectors: bool = True, names: bool = True) -> int:
        """Load every stored sketch (and dense vector, within the cache budget) into this process,
        and the names and metadata of the vectors it holds (when they fit half the answer cache).

        A fresh reader otherwise fetches candidates' sketches on its first
        queries, and reads its neighbours' records until it has seen them; the
        service warms each worker at start. Returns rows loaded.
        """
        n = self._refresh_sketches()
        cfg = self.config
        if cfg.storage == "dense" and gcws.table_fits(cfg.dim, cfg.k):
            gcws.walk_table(2 * cfg.dim, cfg.k, cfg.seed)  # and the constant table it is built from
        if vectors and self._cache is not None:
            for iids, blobs in self.store.scan("vector"):
                self._cache.put(iids, blobs)
        if names and n >= 0:
            live = np.flatnonzero(self._sketches.scan_arrays()[2])
            if live.shape[0] <= self._answers.max_entries // 2:
                for lo in range(0, live.shape[0], _WARM_NAMES_CHUNK):
                    part = live[lo : lo + _WARM_NAMES_CHUNK]
                    ids, metas, _, epoch = self.store.ids_fetch_and_news(part, "meta", None)
                    self._answers.add(epoch, part.tolist(), ids, metas)
        return n

    def check(self):
        """Full integrity check (see :mod:`index.check`); returns a report with ``.ok``."""
        from gmmlsh.index.check import check_index

        return check_index(self)

    def stats(self) -> dict:
        return {
            "count": self.count(),
            "config": self.config.to_dict(),
            "default_candidates": self.default_candidates,
            "store": self.store.info(),
            "pid": os.getpid(),
        }

    def ping(self) -> None:
        self.store.ping()

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def snapshot(self, dest) -> Path:
        """A consistent hot copy of the index in a new directory (LMDB); restore by serving it.

        Redis has its own persistence (BGSAVE / the AOF): there is nothing for
        gmmlsh to copy consistently from outside the server, so it refuses.
        """
        snap = getattr(self.store, "snapshot", None)
        if snap is None:
            raise NotImplementedError(
                "snapshot: this backend keeps its own backups; for Redis run BGSAVE and copy "
                "dump.rdb (or copy the AOF directory), see the README's 'Backups' section"
            )
        return snap(dest)
