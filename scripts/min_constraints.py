"""Pin every dependency of pyproject.toml to its declared minimum, as a pip constraints file.

    python scripts/min_constraints.py --extras test --override torch==2.13.0 > constraints.txt
    pip install -c constraints.txt -e ".[test]"

Each requirement must carry a ``>=`` lower bound that is a real release: ``name>=X`` becomes ``name==X``,
so pip installs exactly the version we declare and fails when it does not exist. ``--override`` replaces
one package's pin (torch: no CPU build of our torch minimum exists for every Python we support).
``--check`` instead compares what is installed with those pins and exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")
_LOWER_BOUND = re.compile(r">=\s*([0-9][0-9A-Za-z.+!-]*)")
# Not ours to pin, but what the minimums ran with is worth a line in the log.
_REPORTED_TOO = ("numpy", "comm", "jupyter-client")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def minimum_pins(pyproject: Path, extras: list[str]) -> dict[str, str]:
    """``{canonical name: minimum version}`` for the dependencies and the named extras."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"no extra {extra!r} in {pyproject}; it has {', '.join(optional) or 'none'}")
        requirements.extend(optional[extra])
    pins: dict[str, str] = {}
    for requirement in requirements:
        match = _REQUIREMENT.match(requirement)
        bound = _LOWER_BOUND.search(match.group(3)) if match else None
        if match is None or bound is None:
            raise SystemExit(f"{requirement!r} has no '>=' minimum: declare one so it can be tested")
        pins[canonical(match.group(1))] = bound.group(1)
    return pins


def apply_overrides(pins: dict[str, str], overrides: list[str]) -> dict[str, str]:
    result = dict(pins)
    for override in overrides:
        name, separator, version = override.partition("==")
        if not separator or not version:
            raise SystemExit(f"--override takes NAME==VERSION, got {override!r}")
        result[canonical(name)] = version
    return result


def mismatches(pins: dict[str, str]) -> list[str]:
    """Installed versions that differ from the pins (compared as releases: 8.12 == 8.12.0)."""

    def release(version: str) -> tuple[int, ...]:
        numbers = [int(part) for part in re.findall(r"\d+", version.split("+")[0])]
        while numbers and numbers[-1] == 0:
            numbers.pop()
        return tuple(numbers)

    problems = []
    for name, version in sorted(pins.items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name}: not installed (want {version})")
            continue
        if release(installed) != release(version):
            problems.append(f"{name}: {installed} installed, want {version}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parent.parent / "pyproject.toml")
    parser.add_argument("--extras", default="", help="comma-separated extras to pin as well, e.g. test")
    parser.add_argument("--override", action="append", default=[], metavar="NAME==VERSION")
    parser.add_argument("--check", action="store_true", help="compare the installed versions with the pins")
    args = parser.parse_args(argv)
    extras = [extra.strip() for extra in args.extras.split(",") if extra.strip()]
    pins = apply_overrides(minimum_pins(args.pyproject, extras), args.override)
    if args.check:
        problems = mismatches(pins)
        for problem in problems:
            print(f"minimum versions: {problem}", file=sys.stderr)
        if not problems:
            installed = [f"{name} {metadata.version(name)}" for name in sorted(pins)]
            for name in _REPORTED_TOO:
                try:
                    installed.append(f"({name} {metadata.version(name)})")
                except metadata.PackageNotFoundError:
                    pass
            print("minimum versions installed: " + ", ".join(installed))
        return 1 if problems else 0
    for name, version in sorted(pins.items()):
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
