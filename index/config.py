"""Index parameters and limits: the one place each default is defined.

:class:`IndexConfig` fixes how vectors are hashed; it is stored with the index, so
every process and machine hashes the same way, and opening an index with other
values is an error. The server's settings, the command line and the docs read
their defaults from here. :class:`SearchParams` are query-time knobs: an index
chooses them from its own data (:mod:`gmmlsh.index.tuner`) and a query may
override any of them.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field, fields, replace

from gmmlsh.core.rng import GENERATOR_VERSION

#: Bump when the stored layout changes; an index of another version is refused.
FORMAT_VERSION = 3
#: Largest ``k`` (neighbours) a query may ask for.
MAX_K = 1000
#: Neighbours a query returns when it does not say.
DEFAULT_K = 10
#: Largest rerank budget (rows reranked by GMM per query, see :class:`SearchParams`).
MAX_CANDIDATES = 100_000
#: Most bits per code the rank pass of a sketch search reads (the bit planes a segment keeps
#: in list order; more ranked no better: docs/tuning.md).
RANK_BITS_MAX = 4
#: A filtered query whose condition leaves at most this many rows scores them all by exact GMM
#: (the exact filtered answer); above it, the sketch search runs with its scan widened.
FILTER_EXACT_ROWS = 4096
#: Above it, up to this share of the rows passing: the sketch search runs over the passing rows
#: alone (gathered once per filter); a larger share: over every row, the others masked out.
FILTER_SUBSET_SHARE = 0.5
#: Bytes of such gathered rows a process keeps for filters used again (most recent first).
FILTER_SUBSET_BYTES = 256 << 20
#: Largest page of a scroll (ids with their metadata).
MAX_SCROLL_LIMIT = 10_000
#: Share of the rows a rare coordinate is held by at most, for a postings search the tuner did
#: not set (``mode=postings`` asked for by a query; see :class:`SearchParams`).
DEFAULT_RARE = 1 / 128
#: Creation parameters a user may set (the rest are fixed by the release or given at creation).
CREATION_FIELDS = ("dim", "samples", "bits", "seed", "t_bits", "nrff_k", "gamma")
#: Fields that fix how vectors are hashed and stored.
_IDENTITY = ("dim", "samples", "bits", "seed", "t_bits", "nrff_k", "gamma", "center", "format_version",
             "generator_version")
_HELP = {
    "dim": "dimension of the vectors (required to create an index)",
    "samples": "GCWS samples per vector (the sketch)",
    "bits": "bits kept per sample (b-bit codes, 1-16)",
    "seed": "seed of the hash functions",
    "t_bits": "bits of t* mixed into each code (0: the 0-bit scheme, i* only)",
    "nrff_k": "NRFF features stored per vector (0: no nrff mode)",
    "gamma": "RBF kernel parameter of the NRFF features",
}


@dataclass(frozen=True)
class IndexConfig:
    """Everything that fixes an index's layout (see the field help in :func:`describe`)."""

    dim: int
    samples: int = 512
    bits: int = 8
    seed: int = 0
    t_bits: int = 0
    nrff_k: int = 0
    gamma: float = 1.0
    center: tuple[float, ...] | None = None
    #: Random name given at creation: a search mirror made for another index is not reused.
    uid: str = field(default_factory=lambda: uuid.uuid4().hex, compare=False)
    format_version: int = FORMAT_VERSION
    generator_version: int = GENERATOR_VERSION

    def __post_init__(self):
        problems = []
        for name, low in (("dim", 1), ("samples", 1), ("nrff_k", 0), ("t_bits", 0), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                problems.append(f"{name}: must be an integer ≥ {low}, got {value!r}")
        if not (isinstance(self.bits, int) and 1 <= self.bits <= 16):
            problems.append(f"bits: must be between 1 and 16, got {self.bits!r}")
        if isinstance(self.t_bits, int) and self.t_bits > 16:
            problems.append(f"t_bits: must be between 0 and 16, got {self.t_bits}")
        if not (isinstance(self.gamma, int | float) and self.gamma > 0):
            problems.append(f"gamma: must be > 0, got {self.gamma!r}")
        if self.center is not None and len(self.center) != self.dim:
            problems.append(f"center: expected {self.dim} values, got {len(self.center)}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def sketch_bytes(self) -> int:
        """Bytes of one stored sketch: ``samples`` codes of ``bits`` bits."""
        return (self.samples * self.bits + 7) // 8

    def to_dict(self) -> dict:
        d = asdict(self)
        d["center"] = list(self.center) if self.center is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> IndexConfig:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if kw.get("center") is not None:
            kw["center"] = tuple(float(x) for x in kw["center"])
        return cls(**kw)

    def conflicts(self, stored: IndexConfig) -> list[str]:
        """Human-readable differences from a stored configuration in the fields that fix the layout."""
        return [f"{name}: index has {getattr(stored, name)!r}, asked for {getattr(self, name)!r}"
                for name in _IDENTITY if getattr(self, name) != getattr(stored, name)]


def describe(name: str) -> str:
    """One line of help for a creation field, with its default: what ``--help`` and the docs show."""
    default = {f.name: f.default for f in fields(IndexConfig)}[name]
    shown = "" if name == "dim" else f" (default {default})"
    return _HELP[name] + shown


def creation_defaults() -> dict:
    """Default of every creation field but ``dim``."""
    return {f.name: f.default for f in fields(IndexConfig) if f.name in CREATION_FIELDS and f.name != "dim"}


@dataclass(frozen=True)
class SearchParams:
    """How the default (``auto``) query searches: the knobs that trade recall for speed.

    ``probes``: inverted lists scanned (all: 0); ``shortlist``: rows ranked on every
    sample; ``rank_bits``: bits per code in that ranking (at most :data:`RANK_BITS_MAX`);
    ``candidates``: rows ranked by GMM on their coarse copies, of which the best
    ``k + max(k, 10)`` are scored exactly (the rerank budget). ``rare`` > 0 searches sparse rows through postings
    instead of sketches (:mod:`gmmlsh.core.postings`): coordinates held by at most this
    share of the rows are read, the commonest from head columns, the rest skipped, and the
    best ``candidates`` scored exactly. ``exact`` answers by brute force instead. The tuner
    chooses among them by what reaches the recall asked at the least cost.
    """

    probes: int = 0
    shortlist: int = 2000
    rank_bits: int = RANK_BITS_MAX
    candidates: int = 200
    rare: float = 0.0
    exact: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SearchParams:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def with_overrides(self, **given) -> SearchParams:
        """These parameters with the non-None values of ``given`` replacing theirs."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})
