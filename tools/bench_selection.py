"""The rows and layouts the GPU bench tools (bench_cp_gpu.py, profile_cp_step.py,
dispatch_model.py) take from their command line: --configs, --mixes and --only, each checked
with an argparse error naming the flag, and the document rows every tool draws for them."""

import argparse
import re

import numpy as np

from bench_cp import capped_row, pack_rows, stdlib_lengths, web_row

# The document mixes a row is drawn from: the sample corpus, web-like lengths, and documents of
# at most a quarter of the row (MagiAttention's setting).
MIXES = {"stdlib": None, "web": web_row, "capped": capped_row}


def tokens_label(n):
    """A row's size as the tables write it: 32k, 128k; 512 below 1k."""
    return f"{n // 1024}k" if n >= 1024 else str(n)


def positive_int(text):
    """argparse type: an int >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_configs(p, text):
    """[(tokens, cp)] of a --configs value, each checked (argparse error naming the flag)."""
    configs = []
    for c in text.split(","):
        try:
            n, cp = (int(x) for x in c.split(":"))
        except ValueError:
            p.error(f"--configs: each entry is TOKENS:CP (e.g. 32768:4), got {c!r}")
        if n < 1 or cp < 1:
            p.error(f"--configs: tokens and cp must be positive, got {c!r}")
        if n % (2 * cp):
            p.error(f"--configs: tokens {n} must be divisible by 2*cp = {2 * cp}")
        configs.append((n, cp))
    return configs


def mix_rows(configs, samples, seed, mixes=("stdlib", "web")):
    """(mix, tokens, cp, [cu_seqlens of `samples` rows]) per mix and configuration: the rows
    every GPU tool and the dispatch model draw (same seed, same rows)."""
    std = stdlib_lengths()
    for mix in mixes:
        for n, cp in configs:
            rng = np.random.default_rng(seed)
            yield mix, n, cp, [pack_rows(std, n, rng) if mix == "stdlib" else MIXES[mix](n, rng)
                               for _ in range(samples)]


def parse_only(p, text, names):
    """The --only pattern (a Python regular expression searched in each layout's name; the
    ideal row always runs, every ratio is over it) checked against `names`: an argparse error
    naming the flag where it is not a pattern or selects none of them."""
    if text is None:
        return None
    try:
        pattern = re.compile(text)
    except re.error as e:
        p.error(f"--only: {text!r} is not a regular expression ({e})")
    if not any(pattern.search(name) for name in names if name != "ideal"):
        p.error(f"--only: {text!r} selects no layout; layouts: {', '.join(names)}")
    return pattern


def wanted(only, name):
    """Whether the layout `name` runs under the --only pattern `only` (None: all)."""
    return only is None or name == "ideal" or only.search(name) is not None


def parse_mixes(p, text):
    """The --mixes value as a list, each checked (argparse error naming the flag)."""
    mixes = text.split(",")
    if any(m not in MIXES for m in mixes):
        p.error(f"--mixes: {text!r}; each must be one of {', '.join(MIXES)}")
    return mixes
