"""``%oomfix``'s and ``%%oomfix``'s options: the ones both forms share (with their help), and what they
are checked against before anything runs (``OomFix``'s settings fill what is not given)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from IPython.core.magic_arguments import argument

from ..errors import CudaMemError
from ..hardware import Hardware
from ..oomfix.options import check_deletable, check_max_tries, check_strategies
from ..oomfix.strategies import STRATEGIES, Strategy
from .options import count_option


def oomfix_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """The options both forms share."""
    for decorator in reversed((
        argument("--dry-run", action="store_true", help="Diagnose only: free nothing, rerun nothing."),
        argument("--max-tries", type=count_option("a number of reruns"), default=None, metavar="N",
                 help="At most N reruns (default: OomFix.max_tries, 3)."),
        argument("--del", dest="delete", action="append", default=[], metavar="NAME",
                 help="Also delete this variable before rerunning (repeatable). Nothing of yours is deleted otherwise."),
        argument("--apply", action="store_true",
                 help="Put the cell that fitted into the next input (shown, never run silently)."),
        argument("--yes", "-y", action="store_true",
                 help="Do not ask before rerunning; the rerun repeats the cell's side effects."),
        argument("--no-autocast", action="store_true", help="Never try torch.autocast."),
        argument("--no-restore", action="store_true",
                 help="Put nothing back before each rerun: not the model and optimizer state the cell trains (needed "
                      "where that copy would not fit in host memory), nor the lists and counters it changes; each "
                      "rerun's steps and entries then stay."),
        argument("--strategy", default=None, metavar="LIST",
                 help=f"Strategies to try, in order, comma-separated: {', '.join(STRATEGIES)} (default: all)."),
        argument("-v", "--verbose", action="store_true",
                 help="Show everything under the three first lines: the diagnosis's figures and holders, every try, "
                      "the diff, notes and advice (default: OomFix.verbose; in HTML they are one click away)."),
        argument("-o", "--output", action="store_true",
                 help="Show the outcome and also return it, as %%timeit -o does: outcome = %%oomfix -o "
                      "(.tries, .diff, .fixed_source); None where no fix was tried (the rerun declined, or a %%%%oomfix "
                      "cell that did not run out of memory)."),
    )):
        function = decorator(function)
    return function


def require_gpu(hardware: Hardware) -> None:
    reason = hardware.allocator.status()
    if reason is not None:
        raise CudaMemError(f"%oomfix needs a CUDA device: {reason}")


def chosen_strategies(args: argparse.Namespace, configured: str, autocast: bool) -> tuple[Strategy, ...]:
    """The strategies to try: ``--strategy`` or ``OomFix.strategies``, less autocast where it is off."""
    chosen = check_strategies(args.strategy if args.strategy is not None else configured)
    if args.no_autocast or not autocast:
        chosen = tuple(s for s in chosen if s is not Strategy.AUTOCAST)
    if not chosen:
        raise CudaMemError("no strategy left to try: --strategy autocast with --no-autocast leaves nothing")
    return chosen


def check_options(args: argparse.Namespace, configured: str, autocast: bool) -> None:
    """The options' values, checked before anything runs; each error is one line."""
    if args.max_tries is not None:
        check_max_tries(args.max_tries)
    check_deletable(args.delete)
    chosen_strategies(args, configured, autocast)
