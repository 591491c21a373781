"""Which search answers a query, and with what parameters.

A query's options are checked here (the one place their bounds live: the router calls
:func:`check_options` too, before any fan-out); its parameters are the index's tuned ones (the lists
probed scaled to the lists there are, where a new fit has more or fewer than the tuning saw),
then the operator's, then the query's; and for ``auto`` the search is the one the tuner found
cheapest — brute force (unless the query set knobs), the postings search (unless it set
``probes``, a knob of the sketch search) or the sketch search. An index never tuned answers by
exact search while it is small and is tuned before its first answer otherwise
(:class:`Untuned`): no answer comes from an untuned search.
"""

from __future__ import annotations

import math

import numpy as np

from gmmlsh.core.validate import VectorError
from gmmlsh.index import tuner
from gmmlsh.index.config import MAX_CANDIDATES, MAX_K, SearchParams
from gmmlsh.index.filters import Filter, compile_filter
from gmmlsh.index.mirror import View
from gmmlsh.index.search import MODE_ALIASES, MODES


class Untuned(Exception):
    """The index was never tuned and is too big for exact search to be the cheap answer."""


def check_options(k, mode, min_similarity, candidates, probes) -> tuple[int, str, float]:
    """A query's ``k``, ``mode`` (an alias as the mode it names) and ``min_similarity``, checked
    with its ``candidates`` and ``probes``; a :class:`VectorError` names the field at fault."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 1 <= k <= MAX_K:
        raise VectorError("k", f"must be an integer between 1 and {MAX_K}, got {k!r}")
    mode = MODE_ALIASES.get(mode, mode)
    if mode not in MODES:
        raise VectorError("mode", f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if not (isinstance(min_similarity, int | float) and math.isfinite(min_similarity)):
        raise VectorError("min_similarity", "must be a finite number")
    if candidates is not None and not 1 <= candidates <= MAX_CANDIDATES:
        raise VectorError("candidates", f"must be between 1 and {MAX_CANDIDATES}, got {candidates}")
    if probes is not None and probes < 0:
        raise VectorError("probes", f"must be ≥ 0 (0: every list), got {probes}")
    return int(k), mode, float(min_similarity)


def as_filter(spec: dict | Filter | None) -> Filter | None:
    """A filter compiled (its shape checked), or None for none."""
    return spec if spec is None or isinstance(spec, Filter) else compile_filter(spec)


def tuned_params(view: View, overrides: dict) -> SearchParams:
    """The view's tuned parameters, the lists probed scaled to its fit, then ``overrides``."""
    params = view.search
    if params.probes and view.tuned_lists and view.list_count != view.tuned_lists:
        params = params.with_overrides(probes=max(1, round(params.probes * view.list_count / view.tuned_lists)))
    return params.with_overrides(**overrides) if overrides else params


def search_of(view: View, params: SearchParams, mode: str, knobs: bool, probes: int | None,
              tune_tried: bool) -> str:
    """The search that answers (see the module docstring): ``mode`` unless ``auto``; ``knobs``:
    the query set ``candidates`` or ``probes``; ``tune_tried``: a tuning was attempted (an index
    whose tuning failed answers exactly rather than not at all)."""
    if mode != "auto":
        return mode
    if not view.tuned_rows:  # never tuned: exact search where the index is small, else tune first
        if view.live < tuner.MIN_ROWS or tune_tried:
            return "exact"
        raise Untuned()
    if params.exact and not knobs:
        return "exact"
    if params.rare > 0 and probes is None:
        return "postings"
    return "sketch"
