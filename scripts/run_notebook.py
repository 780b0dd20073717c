"""Execute a notebook headless in a real kernel and print what each cell showed.

    python scripts/run_notebook.py notebooks/00_quickstart.ipynb [--output executed.ipynb]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--output", type=Path, help="save the executed notebook here")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    args = parser.parse_args()
    notebook = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=args.timeout, resources={"metadata": {"path": str(args.notebook.parent)}}
    )
    failed = None
    try:
        client.execute()
    except CellExecutionError as error:
        failed = error
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        print(f"--- In [{cell.get('execution_count') or ' '}]: {cell.source.splitlines()[0] if cell.source else ''}")
        shown = cell_text(cell)
        if shown:
            print(shown)
    if args.output:
        nbformat.write(notebook, args.output)
        print(f"executed notebook saved to {args.output}")
    if failed is not None:
        print(f"notebook stopped at an unexpected error:\n{failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
