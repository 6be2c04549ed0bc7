#!/usr/bin/env python3
"""Print the per-iteration training losses of several runs side by side, from their
`--metrics-file` JSON lines, and check that they agree.

    python tools/loss_table.py cp1=runs/m_cp1.jsonl ring=runs/m_ring.jsonl ... \
        [--tolerance 1e-5]

The first run is the reference: the last column is the largest relative difference of any
other run from it at that iteration. Exits 1 when a run differs by more than --tolerance
(relative) at any iteration, has a NaN or Inf loss, or has a different number of
iterations; 2 on a bad argument or a malformed line (named by file and line).
"""

import argparse
import json
import math
import sys


def read_losses(path):
    """{iteration: lm_loss} of the training records (validation records are skipped); a
    resumed run that appended to the same file keeps the last value of each iteration."""
    losses = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); "
                         f"is it a --metrics-file?") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not a JSON line ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: not a --metrics-file record (a JSON object)")
        if record.get("kind", "train") != "train" or "lm_loss" not in record:
            continue
        iteration, loss = record.get("iteration"), record["lm_loss"]
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            raise ValueError(f"{path}:{number}: \"iteration\" must be an integer, got "
                             f"{iteration!r}")
        if isinstance(loss, bool) or not isinstance(loss, (int, float)):
            raise ValueError(f"{path}:{number}: \"lm_loss\" must be a number, got {loss!r}")
        losses[iteration] = float(loss)
    if not losses:
        raise ValueError(f"{path}: no training iterations (was it written by --metrics-file?)")
    return losses


def parse_run(text):
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=parse_run, metavar="NAME=PATH")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest relative difference from the first run (default 1e-5)")
    args = parser.parse_args(argv)
    try:
        table = [(name, read_losses(path)) for name, path in args.runs]
    except (OSError, ValueError) as error:
        parser.error(str(error))
    if not math.isfinite(args.tolerance) or args.tolerance < 0:
        parser.error(f"--tolerance must be a finite number >= 0, got {args.tolerance}")
    reference = table[0][1]
    iterations = sorted(set().union(*(losses for _, losses in table)))
    width = max(12, *(len(name) + 2 for name, _ in table))
    print("iteration" + "".join(f"{name:>{width}}" for name, _ in table) + f"{'max rel diff':>14}")
    worst, complete = 0.0, True
    for it in iterations:
        cells, diff = [], 0.0
        for name, losses in table:
            value = losses.get(it)
            cells.append(f"{value:>{width}.6f}" if value is not None else f"{'-':>{width}}")
            if value is None or it not in reference:
                complete = False
            elif not (math.isfinite(value) and math.isfinite(reference[it])):
                diff = math.inf  # a diverged run (NaN or Inf loss) agrees with nothing
            else:
                diff = max(diff, abs(value - reference[it]) / max(abs(reference[it]), 1e-30))
        worst = max(worst, diff)
        print(f"{it:>9}" + "".join(cells) + f"{diff:>14.1e}")
    ok = complete and worst <= args.tolerance
    others = ", ".join(name for name, _ in table[1:]) or "(none)"
    print(f"largest relative difference of {others} from {table[0][0]}: {worst:.1e} "
          f"({'within' if ok else 'NOT within'} {args.tolerance:g}"
          f"{'' if complete else '; some runs miss iterations'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
