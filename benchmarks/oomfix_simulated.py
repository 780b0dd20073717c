"""Benchmark: ``%oomfix``'s batch search on 10,000 simulated steps that span where users are.

The world is ``tests/oomfix/world.py`` (what it draws is in its docstring): every run is played through
the project's model of PyTorch's caching allocator, so rounding, segments, fragments and a workspace that
another algorithm sizes otherwise between runs are in it. Halving from the same start, with the same
jitter between runs, is the peer. Runs on CPU, on every core (``world.many_cases``).

    python benchmarks/oomfix_simulated.py            # writes benchmarks/results/oomfix_simulated.json
    python benchmarks/oomfix_simulated.py --models 500 --out /tmp/x.json

The result: ``models``, ``met_goal`` and ``worse_than_halving`` (counts), the same by regime (largest
fitting batch <= 10, 11-64, 65-1000, > 1000; batch-independent share under or over half of the card)
with the minimum and median of found/largest, the same without the allocator's history (the line
alone, as on a torch that cannot record), and the same on steps whose memory grows with the square of
the batch (``tests/oomfix/superlinear.py``: contrastive losses, attention across the batch), and
(``told``) how often searches told the answer (halving's own end, or the largest batch that fits) still end
below halving, their runs drawing their workspaces as the search's do.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.oomfix import superlinear, world  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "oomfix_simulated.json"
SEED = 2026


def _row(c: world.Case) -> dict:
    return {"largest": c.largest, "start": c.start, "found": c.found, "reruns": c.reruns, "halving": c.halving,
            "fixed_share": round(c.fixed_share, 4), "built_in_cell": c.step.built_in_cell,
            "training": c.step.training, "met_goal": c.met_goal, "worse_than_halving": c.worse_than_halving}


def regime(case: dict) -> str:
    largest = case["largest"]
    size = "<=10" if largest <= 10 else "11-64" if largest <= 64 else "65-1000" if largest <= 1000 else ">1000"
    return f"largest {size}, fixed {'>=' if case['fixed_share'] >= 0.5 else '<'} 0.5"


def summary(cases: list[dict]) -> dict:
    groups: dict[str, list[dict]] = {}
    for case in cases:
        groups.setdefault(regime(case), []).append(case)
    def stats(group: list[dict]) -> dict:
        ratios = [c["found"] / c["largest"] for c in group]
        return {"models": len(group), "met_goal": sum(c["met_goal"] for c in group),
                "worse_than_halving": sum(c["worse_than_halving"] for c in group),
                # Of those, the ones where halving's batch lands between the goal and the largest batch by
                # the luck of the start (a start near a power of two times it).
                "worse_than_halving_within_goal": sum(c["worse_than_halving"] and c["met_goal"] for c in group),
                # Not counted: below halving's end where that is above the largest batch that keeps fitting
                # without the jitter between runs (halving's runs drew smaller workspaces than the truth's).
                "below_halving_above_largest": sum(c["halving"] is not None and c["found"] < c["halving"]
                                                   and c["halving"] > c["largest"] for c in group),
                "min": round(min(ratios), 4), "median": round(statistics.median(ratios), 4),
                "max_reruns": max(c["reruns"] for c in group)}
    return {**stats(cases), "regimes": {name: stats(groups[name]) for name in sorted(groups)}}


def superlinear_summary(cases: list[superlinear.Case]) -> dict:
    """The same counts on steps whose memory grows with the square of the batch (``tests/oomfix/superlinear.py``)."""
    def stats(group: list[superlinear.Case]) -> dict:
        ratios = [c.found / c.largest for c in group]
        return {"models": len(group), "met_goal": sum(c.met_goal for c in group),
                "worse_than_halving": sum(c.worse_than_halving for c in group),
                "min": round(min(ratios), 4), "median": round(statistics.median(ratios), 4),
                "max_reruns": max(c.reruns for c in group)}
    groups: dict[str, list[superlinear.Case]] = {}
    for case in cases:
        size = "<=10" if case.largest <= 10 else "11-64" if case.largest <= 64 else "65-1000" if case.largest <= 1000 else ">1000"
        groups.setdefault(f"largest {size}", []).append(case)
    return {**stats(cases), "regimes": {name: stats(groups[name]) for name in sorted(groups)}}


def told_summary(told: list[world.Told], searched: list[dict]) -> dict:
    """How often searches told the answer end below halving on the same models (``world.told``): what
    "none below halving" asks of a search that cannot see the workspace its next run draws."""
    return {
        "models": len(told),
        "halving_above_largest": sum(t.halving > t.largest for t in told),
        "told_halving_end_below_halving": sum(world.below_halving(t.given_halving, t.halving, t.largest) for t in told),
        "told_largest_below_halving": sum(world.below_halving(t.given_largest, t.halving, t.largest) for t in told),
        "search_below_halving": sum(c["worse_than_halving"] for c in searched),
        "how": "told_halving_end: tries halving's own end up to three times; told_largest: tries the largest "
               "batch that fits without the jitter between runs twice, then the largest that fits with the "
               "largest workspace; each with the same jitter between runs as the search and halving",
    }


def run(models: int, recorded: bool) -> list[dict]:
    return [_row(case) for case in world.many_cases(models, SEED, recorded=recorded)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=10_000)
    parser.add_argument("--line-models", type=int, default=2_000, help="models for the run without the history")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    replayed = run(args.models, recorded=True)
    line = run(args.line_models, recorded=False)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} CPU (the world is simulated)",
        "versions": {"python": platform.python_version()},
        "goal": "found >= largest - 1 where largest <= 10, else >= 0.90 x largest; at most 3 reruns",
        "models": len(replayed),
        **{key: value for key, value in summary(replayed).items()},
        "without_history": summary(line),
        "told": told_summary(world.many_told(args.models, SEED), replayed),
        "superlinear": superlinear_summary(superlinear.cases(args.models, SEED)),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "regimes"}, indent=1))


if __name__ == "__main__":
    main()
