"""Execute tutorial notebooks headless in a real kernel and print what each cell showed.

    python scripts/run_notebook.py notebooks/00_quickstart.ipynb [more.ipynb ...] [--write-back | --output DIR]
    python scripts/run_notebook.py --write-back --quiet --log notebook-run.log   # every notebook, in place

Without a notebook named, every ``notebooks/*.ipynb`` runs, in order. ``--log FILE`` appends one line per
notebook as it finishes (its name, ok or failed, seconds, the first line of an unexpected error) and one for
the whole run. ``--jobs N`` runs N notebooks at once, each in a process of its own (the notebooks' outputs
then show the others' processes on the card; 1, the default, keeps each alone on it).

Cells tagged ``raises-exception`` may fail (an out-of-memory error on purpose) and the run goes on; any other
error stops that notebook and the exit status is 1. Cells tagged ``skip-execution`` are not run (the quick
start's install cell). ``--write-back`` saves each executed notebook over its source (what gets committed);
``--output DIR`` saves them in DIR instead. Expected errors keep only their last line and library warnings
lose their ``site-packages`` prefix, so no path of this machine is saved. Without a CUDA device the cells tagged
``gpu`` are left out (and nothing is saved back), so ``make demo`` works on any machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.notebook_runner import execute_notebook  # noqa: E402

NOTEBOOK_BUDGET_S = 90  # each tutorial should run top to bottom in about a minute and a half on one GPU


def cell_text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text.rstrip("\n"))
        elif output.output_type in ("execute_result", "display_data"):
            if "text/plain" in output.data:
                parts.append(output.data["text/plain"])
            elif "image/png" in output.data:
                parts.append("[image]")
            else:
                parts.append("[widget]" if "application/vnd.jupyter.widget-view+json" in output.data else "[rich output]")
        elif output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}")
    return "\n".join(parts)


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def log_line(args: argparse.Namespace, line: str) -> None:
    if args.log is not None:
        with open(args.log, "a") as log:
            log.write(line + "\n")


def run_one(path: Path, args: argparse.Namespace, gpu: bool) -> bool:
    import nbformat

    notebook, error, seconds = execute_notebook(path, timeout=args.timeout, without_tag=None if gpu else "gpu")
    first_error = "" if error is None else f": {str(error).strip().splitlines()[-1][:200]}"
    log_line(args, f"{path.name}  {'ok' if error is None else 'FAILED'}  {seconds:.0f} s"
                   f"{'  (over the budget)' if seconds > NOTEBOOK_BUDGET_S else ''}{first_error}")
    if not args.quiet:
        for cell in notebook.cells:
            if cell.cell_type != "code":
                continue
            first = cell.source.splitlines()[0] if cell.source else ""
            print(f"--- In [{cell.get('execution_count') or ' '}]: {first}")
            shown = cell_text(cell)
            if shown:
                print(shown)
    target = path if args.write_back else (args.output / path.name if args.output else None)
    if target is not None and not gpu:
        print(f"{path.name}: no CUDA device here, so the cells tagged gpu were left out and nothing is saved")
        target = None
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, target)
        print(f"{path.name}: executed notebook saved to {target}")
    print(f"{path.name}: {seconds:.0f} s{' (over the ' + str(NOTEBOOK_BUDGET_S) + ' s budget)' if seconds > NOTEBOOK_BUDGET_S else ''}")
    if error is not None:
        print(f"{path.name}: stopped at an unexpected error:\n{error}", file=sys.stderr)
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", type=Path, nargs="*", help="default: every notebooks/*.ipynb")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--write-back", action="store_true", help="save each executed notebook over its source")
    where.add_argument("--output", type=Path, help="save the executed notebooks in this folder")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    parser.add_argument("--quiet", action="store_true", help="print only one line per notebook")
    parser.add_argument("--log", type=Path, help="append a line per notebook (and one for the run) to this file")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at once, each in its own process")
    args = parser.parse_args()
    notebooks = args.notebooks or sorted((REPO / "notebooks").glob("*.ipynb"))
    started = time.monotonic()
    if args.jobs > 1 and len(notebooks) > 1:
        results = run_in_processes(notebooks, args)
    else:
        gpu = has_cuda()
        if not gpu:
            print("no CUDA device here: the cells tagged gpu are left out")
        results = [run_one(path, args, gpu) for path in notebooks]
    failed = [path.name for path, ok in zip(notebooks, results) if not ok]
    if len(notebooks) > 1:
        log_line(args, f"{len(notebooks)} notebooks in {time.monotonic() - started:.0f} s; "
                       + (f"failed: {', '.join(failed)}" if failed else "all ran"))
    return 0 if not failed else 1


def run_in_processes(notebooks: list[Path], args: argparse.Namespace) -> list[bool]:
    """Each notebook through this script in a process of its own, ``args.jobs`` at a time; their printouts
    follow one another, whole, as each finishes."""
    passed = [str(path) for path in notebooks]
    flags = ["--timeout", str(args.timeout)] + (["--quiet"] if args.quiet else []) + (
        ["--write-back"] if args.write_back else ["--output", str(args.output)] if args.output else []) + (
        ["--log", str(args.log)] if args.log else [])

    def one(path: str) -> bool:
        done = subprocess.run([sys.executable, __file__, path, *flags], capture_output=True, text=True)
        print(done.stdout + done.stderr, end="", flush=True)
        return done.returncode == 0

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        return list(pool.map(one, passed))


if __name__ == "__main__":
    sys.exit(main())
