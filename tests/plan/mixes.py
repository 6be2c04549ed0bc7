"""Document-length mixes for planner tests: rows of `s` tokens cut into documents.

Every row is cut independently (a row boundary is a document boundary), so `cu_seqlens` over
b rows looks like the one `build_doc_layout` makes. The mixes cover what the planner must
survive: web-like lognormal, heavy-tailed, 1-7-token documents, a few documents longer than
a rank's share, uniform lengths, rows without any EoD, and mixtures of these.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

def examples(ci: int) -> int:
    """Examples for a property: `ci` under the CI profile, scaled with the loaded profile."""
    return ci * settings.default.max_examples // 100


MIXES = ("web", "heavy", "tiny", "long", "uniform", "no_eod", "mixed")


def _lengths(mix: str, s: int, share: int, rng: np.random.Generator) -> np.ndarray:
    """Document lengths that fill at least s tokens (the caller cuts at s)."""
    if mix == "web":
        return np.maximum(1, rng.lognormal(np.log(600), 1.0, s // 50 + 8)).astype(np.int64)
    if mix == "heavy":
        return np.maximum(1, rng.pareto(1.1, s // 20 + 8) * 40).astype(np.int64)
    if mix == "tiny":
        return rng.integers(1, 8, s + 1)
    if mix == "long":  # a few documents longer than a rank's share, short ones between
        out = []
        for _ in range(int(rng.integers(1, 4))):
            out.append(int(rng.integers(share + 1, 4 * share + 2)))
            out.extend(rng.integers(1, max(2, share // 4), int(rng.integers(0, 6))).tolist())
        return np.array(out + [s], dtype=np.int64)
    if mix == "uniform":
        return np.full(s + 1, int(rng.integers(1, max(2, min(s, 4096)))), dtype=np.int64)
    if mix == "no_eod":
        return np.array([s], dtype=np.int64)
    parts = [_lengths(m, s, share, rng) for m in rng.choice(MIXES[:-1], 3)]
    out = np.concatenate([p[: max(1, p.size // 3)] for p in parts] + [parts[0]])
    return out


def row_cuts(mix: str, s: int, share: int, rng: np.random.Generator) -> np.ndarray:
    """Document starts inside one row of s tokens (0 first)."""
    lengths = _lengths(mix, s, share, rng)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return starts[starts < s]


def make_cu_seqlens(mix: str, b: int, s: int, cp: int, seed: int) -> np.ndarray:
    """cu_seqlens over b rows of s tokens (int64), documents from `mix`."""
    rng = np.random.default_rng(seed)
    share = max(1, b * s // cp)
    cuts = [row * s + row_cuts(mix, s, share, rng) for row in range(b)]
    return np.concatenate(cuts + [[b * s]]).astype(np.int64)


def cp_sizes(max_cp: int = 128):
    """CP sizes up to max_cp: the powers of two as often as all the others."""
    powers = [2 ** i for i in range(1, max_cp.bit_length()) if 2 ** i <= max_cp]
    return st.one_of(st.sampled_from(powers), st.integers(2, max_cp))


def simulated_max_cp() -> int:
    """Largest CP for properties that simulate every group's ring steps (cost ~ CP^2): 32
    under the CI profile, 128 under the long one."""
    return 128 if settings.default.max_examples > 100 else 32


@st.composite
def plan_inputs(draw, max_log2_tokens=20, max_cp=128):
    """(cu_seqlens, cp, algo, ulysses_degree, mix): b*s <= 2**max_log2_tokens tokens."""
    cp = draw(cp_sizes(max_cp))
    b = draw(st.integers(1, 4))
    # Sizes spread evenly over powers of two, so large streams are drawn as often as small.
    top = max(0, max_log2_tokens - int(np.ceil(np.log2(b * cp))))
    log2_per_row = draw(st.integers(0, top))
    m = draw(st.integers(1 << max(0, log2_per_row - 1), 1 << log2_per_row))  # s = cp * m
    algo = draw(st.sampled_from(["ring", "hybrid", "ring", "hybrid", "ulysses"]))
    degree = None
    if algo == "hybrid":
        degree = draw(st.sampled_from([u for u in range(1, cp + 1) if cp % u == 0]))
    mix = draw(st.sampled_from(MIXES))
    seed = draw(st.integers(0, 2**32 - 1))
    return make_cu_seqlens(mix, b, cp * m, cp, seed), cp, algo, degree, mix


@st.composite
def packing_inputs(draw):
    """Streams where the packer runs: up to 32 groups and 2,048 documents."""
    groups = draw(st.integers(2, 32))
    b = draw(st.integers(1, 4))
    s = groups * draw(st.integers(64, 32768 // groups))
    mix = draw(st.sampled_from(["web", "heavy", "mixed", "long", "uniform"]))
    return make_cu_seqlens(mix, b, s, groups, draw(st.integers(0, 2**32 - 1))), groups
