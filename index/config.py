"""Index parameters, stored with the index so that every reader hashes the same way."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from gmmlsh.core.gcws import packed_bytes
from gmmlsh.core.rng import GENERATOR_VERSION

#: Bump when the stored layout changes; an index of another version is refused.
FORMAT_VERSION = 1

#: Fields that define how vectors are hashed and stored: reopening with a
#: different value would silently corrupt answers, so it is an error.
_IDENTITY = ("dim", "bands", "rows", "bits", "seed", "t_bits", "nrff_k", "gamma", "center", "storage")


@dataclass(frozen=True)
class IndexConfig:
    """Everything that fixes an index's layout. ``k = bands · rows`` GCWS samples."""

    dim: int
    bands: int = 80
    rows: int = 6
    bits: int = 8
    seed: int = 0
    t_bits: int = 0
    nrff_k: int = 0  # 0: no NRFF features stored
    gamma: float = 1.0
    center: tuple[float, ...] | None = None
    storage: str = "dense"  # "dense" (float32 rows) or "sparse" (indices + values)
    format_version: int = FORMAT_VERSION
    generator_version: int = GENERATOR_VERSION
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        problems = []
        if self.dim < 1:
            problems.append(f"dim: must be ≥ 1, got {self.dim}")
        if self.bands < 1:
            problems.append(f"bands: must be ≥ 1, got {self.bands}")
        if self.rows < 1:
            problems.append(f"rows: must be ≥ 1, got {self.rows}")
        if not 1 <= self.bits <= 16:
            problems.append(f"bits: must be between 1 and 16, got {self.bits}")
        if not 0 <= self.t_bits <= 16:
            problems.append(f"t_bits: must be between 0 and 16, got {self.t_bits}")
        if self.nrff_k < 0:
            problems.append(f"nrff_k: must be ≥ 0, got {self.nrff_k}")
        if not self.gamma > 0:
            problems.append(f"gamma: must be > 0, got {self.gamma}")
        if self.storage not in ("dense", "sparse"):
            problems.append(f"storage: must be 'dense' or 'sparse', got {self.storage!r}")
        if self.center is not None and len(self.center) != self.dim:
            problems.append(f"center: expected {self.dim} values, got {len(self.center)}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def k(self) -> int:
        return self.bands * self.rows

    @property
    def sketch_bytes(self) -> int:
        return packed_bytes(self.k, self.bits)

    @property
    def band_key_bytes(self) -> int:
        """Band number (2 bytes) + the band's packed codes."""
        return 2 + packed_bytes(self.rows, self.bits)

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

    def conflicts(self, other: IndexConfig) -> list[str]:
        """Human-readable differences in the fields that fix the layout."""
        out = []
        for name in _IDENTITY + ("format_version", "generator_version"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name}: index has {b!r}, asked for {a!r}")
        return out
