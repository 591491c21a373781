"""gmmlsh: near-neighbour search for the generalized min-max (GMM) similarity.

The public API: :class:`Index` (open or create an index in LMDB or Redis, upsert,
query, delete), :class:`IndexConfig` (its parameters), and the math underneath —
:func:`sketch` (GCWS samples), :func:`gmm` / :func:`gmm_many` (exact GMM) and
:func:`nrff_features` (normalized random Fourier features).
"""

from gmmlsh.core.codes import bbit_codes
from gmmlsh.core.gcws import sketch
from gmmlsh.core.gmm import gmm, gmm_many
from gmmlsh.core.nrff import features as nrff_features
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index, UnknownIdError
from gmmlsh.index.records import StoredVector
from gmmlsh.index.search import Neighbor, QueryResult

__all__ = [
    "Index", "IndexConfig", "Neighbor", "QueryResult", "StoredVector", "UnknownIdError",
    "sketch", "bbit_codes", "gmm", "gmm_many", "nrff_features",
]
