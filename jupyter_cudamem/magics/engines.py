"""``%cudamem_engines``: GPU memory across ipyparallel engines, gathered on the client.

Thin. On the client it asks the engines (``engines.gather``) and displays ``engines.table``; on an engine
the functions below are what the client's requests run (ipyparallel ships them by reference to this
module), reading the engine's own extension: its history, its last ``%oomfix``, its monitor's poller.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display
from traitlets import Int, TraitError, validate

from ..engines.gather import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, MIN_TIMEOUT_S, ask, ask_engines, engine_ids, feed_readings, feed_sender, parse_targets, px_view
from ..engines.live import KEEPALIVE_INTERVALS, EngineFeed, EnginesLive, LiveView, live_text
from ..engines.records import EngineStatus, EngineCell, EngineReport, OomfixSummary, this_engine
from ..engines.table import EnginesHistory, EnginesReport
from ..errors import CudaMemError
from ..monitor.poller import DEFAULT_INTERVAL_S, Poller
from ..monitor.settings import MAX_INTERVAL_S, MIN_INTERVAL_S
from ..units import number_in
from .base import CudaMemMagicsBase, one_line_errors
from .options import count_option, Float, number_option, parse_line

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionResult, InteractiveShell
    from ipyparallel import Client
    from traitlets.utils.bunch import Bunch
    from . import Extension
    from ..hardware import Hardware
    from ..oomfix.outcome import Outcome

ACTIONS = ("show", "on", "off", "status", "monitor", "stop")
DEFAULT_HISTORY_CELLS = 20


# -- what the client's requests run on an engine --------------------------------------------------------
def _engine_extension() -> Any:
    from IPython import get_ipython

    from . import loaded

    shell = get_ipython()
    return shell, (None if shell is None else loaded(shell))


def _oomfix_summary(outcome: Outcome | None) -> OomfixSummary | None:
    if outcome is None:
        return None
    return OomfixSummary(
        headline=outcome.headline(),
        fitted=outcome.fitted,
        dry_run=outcome.dry_run,
        strategy=None if outcome.strategy is None else outcome.strategy.value,  # plain, as the record's fields
        batch_before=outcome.batch_before,
        batch_after=outcome.batch_after,
        reruns=outcome.reruns,
        diff=outcome.diff,
    )


def engine_report(cells: int = 1) -> EngineReport:
    """On an engine: its identity, its latest ``cells`` measured cells and its last ``%oomfix``, as plain records."""
    from .cudamem import CudaMem
    from .oomfix import OomFix

    _, extension = _engine_extension()
    identity = this_engine()
    if extension is None:
        return EngineReport(identity=identity, loaded=False)
    cudamem = extension.get(CudaMem)
    oomfix = extension.get(OomFix)
    records = [] if cudamem is None else cudamem.history.records
    shown = records[-cells:] if cells > 0 else []
    return EngineReport(
        identity=identity,
        loaded=True,
        cells=tuple(EngineCell.of(record) for record in shown),
        cells_recorded=len(records),
        oomfix=_oomfix_summary(getattr(oomfix, "last_outcome", None)),
        unavailable=tuple(extension.hardware.unavailable()),
    )


def start_engine_feed(channel: str, interval_s: float) -> str | None:
    """On an engine: poll its GPUs with the monitor's poller and send each shown change on ``channel``.

    Returns ``None``, or why the engine cannot feed (the extension not loaded there). The poller is the
    engine's ``%cudamem_monitor`` poller (started headless when it was not running), so unloading the
    extension there stops it as it stops any monitor.
    """
    from .monitor import CudaMemMonitor

    shell, extension = _engine_extension()
    if extension is None:
        return "extension not loaded: run %px %load_ext jupyter_cudamem"
    engines_magics = extension.get(CudaMemEngines)
    monitor = extension.get(CudaMemMonitor)
    if not isinstance(engines_magics, CudaMemEngines) or not isinstance(monitor, CudaMemMonitor):
        return "this engine's jupyter_cudamem has no engines monitor"
    engines_magics.stop_feed(channel)
    poller = monitor.poller
    if poller is None:
        poller = monitor.poller = Poller(
            extension.hardware, interval_s=interval_s, history_s=monitor.history_s, max_updates_per_s=monitor.max_updates_per_s
        )
    started_here = not poller.running
    poller.reconfigure(interval_s=interval_s)
    poller.keepalive_s = KEEPALIVE_INTERVALS * interval_s
    engine_id = getattr(getattr(shell, "kernel", None), "engine_id", -1)
    feed = EngineFeed(engine_id, this_engine(), feed_sender(shell, channel))
    unsubscribe = poller.subscribe(feed)
    engines_magics.feeds[channel] = (unsubscribe, poller, started_here)
    if not poller.start():
        return poller.state().unavailable
    feed(poller.state())  # the first reading now: the client need not wait for a change
    return None


def stop_engine_feed(channel: str) -> None:
    """On an engine: stop sending on ``channel`` (and stop the poller if the feed started it)."""
    _, extension = _engine_extension()
    engines_magics = None if extension is None else extension.get(CudaMemEngines)
    if isinstance(engines_magics, CudaMemEngines):
        engines_magics.stop_feed(channel)


def timeout_seconds(value: object, name: str) -> float:
    return number_in(value, name, MIN_TIMEOUT_S, MAX_TIMEOUT_S, "seconds to wait for the engines")


def interval_seconds(value: object, name: str) -> float:
    return number_in(value, name, MIN_INTERVAL_S, MAX_INTERVAL_S, "seconds between readings")


def _as_trait(check: Callable[[object, str], float], value: object, name: str) -> float:
    try:
        return check(value, name)
    except CudaMemError as error:
        raise TraitError(str(error)) from None


@magics_class
class CudaMemEngines(CudaMemMagicsBase):
    """GPU memory across ipyparallel engines. Configure with ``%config CudaMemEngines.<option> = ...``."""

    timeout_s = Float(DEFAULT_TIMEOUT_S, help="Seconds the client waits for the engines' answers, in all.").tag(config=True)
    history_cells = Int(DEFAULT_HISTORY_CELLS, help="Measured cells per engine that --history shows.").tag(config=True)
    interval_s = Float(DEFAULT_INTERVAL_S, help="Seconds between two readings of the engines monitor.").tag(config=True)

    @validate("timeout_s")
    def _check_timeout(self, proposal: Bunch) -> float:
        return _as_trait(timeout_seconds, proposal["value"], "CudaMemEngines.timeout_s")

    @validate("interval_s")
    def _check_interval(self, proposal: Bunch) -> float:
        return _as_trait(interval_seconds, proposal["value"], "CudaMemEngines.interval_s")

    @validate("history_cells")
    def _check_history_cells(self, proposal: Bunch) -> int:
        if proposal["value"] < 1:
            raise TraitError(f"CudaMemEngines.history_cells takes a whole number, at least 1; got {proposal['value']!r}")
        return proposal["value"]

    def __init__(self, shell: InteractiveShell, hardware: Hardware, extension: Extension, **kwargs: object):
        super().__init__(shell=shell, hardware=hardware, extension=extension, **kwargs)
        self.auto = False
        self.last: EnginesReport | None = None
        self._last_shown: frozenset[tuple[int, int | None, float]] = frozenset()
        self.live: EnginesLive | None = None
        self.live_view: LiveView | None = None
        self._live_channel: str | None = None
        self._live_client: Client | None = None
        # On an engine: the feeds this engine sends to clients, by channel.
        self.feeds: dict[str, tuple[Any, Poller, bool]] = {}

    @magic_arguments()
    @argument(
        "action",
        nargs="?",
        choices=ACTIONS,
        default="show",
        help="show (the default: the engines' latest measured cells), on/off (show them after every %%px cell), "
        "status, monitor (watch the engines' GPUs live), stop (stop that monitor).",
    )
    @argument("--history", action="store_true", help="Show each engine's measured cells, not only its latest.")
    @argument("--last", type=count_option("a number of cells"), metavar="N",
              help="With --history: the latest N cells of each engine (default 20).")
    @argument("--targets", metavar="IDS", help="Engine ids, such as 0,2 or 0-3 (default: the engines %%px runs on).")
    @argument("--timeout", type=number_option("seconds to wait"), metavar="SECONDS",
              help="Seconds to wait for the engines (default 10).")
    @argument("--interval", type=number_option("seconds between readings"), metavar="SECONDS",
              help="monitor: seconds between readings (default 1).")
    @argument("-o", "--output", action="store_true", help="Show the table and also return it (records in .answers).")
    @line_magic
    @one_line_errors
    def cudamem_engines(self, line: str = "") -> EnginesReport | EnginesHistory | None:
        """GPU memory of every ipyparallel engine, gathered here.

        Load the extension on the engines (``%px %load_ext jupyter_cudamem``) and measure cells there
        (``%%px`` then ``%%cudamem``); ``%cudamem_engines`` shows each engine's latest measured cell in one
        table: host, engine, rank, pid, device by UUID, peak and deltas, NVML's figure for the engine's
        process, the spread between engines and the engine closest to running out of memory, and what
        ``%oomfix`` fixed on each engine. ``--history`` shows the cells per engine; ``monitor`` watches the
        engines' GPUs live.
        """
        args = parse_line(self.cudamem_engines, line)
        self._check_options(args)
        if args.action in ("on", "off", "status"):
            self._mode(args.action)
            return None
        if args.action == "stop":
            self.stop_monitor()
            return None
        view = px_view(self.shell)
        engines = parse_targets(args.targets) if args.targets else engine_ids(view)
        if args.action == "monitor":
            self.start_monitor(view.client, engines, args.interval if args.interval is not None else self.interval_s)
            return None
        if args.last is not None and not args.history:
            raise CudaMemError("--last goes with --history (the latest N cells of each engine)")
        timeout = self.timeout_s if args.timeout is None else timeout_seconds(args.timeout, "--timeout")
        cells = (args.last or self.history_cells) if args.history else 1
        answers = ask_engines(view.client, engines, engine_report, cells, timeout_s=timeout)
        result: EnginesReport | EnginesHistory = EnginesHistory(answers) if args.history else EnginesReport(answers)
        if isinstance(result, EnginesReport):
            self.last = result
        display(result)
        return result if args.output else None

    @staticmethod
    def _check_options(args: argparse.Namespace) -> None:
        """An option that the action would ignore is a mistake worth one line, not silence."""
        given = {
            "--history": args.history,
            "--last": args.last is not None,
            "--targets": args.targets is not None,
            "--timeout": args.timeout is not None,
            "--interval": args.interval is not None,
            "-o": args.output,
        }
        takes = {
            "show": {"--history", "--last", "--targets", "--timeout", "-o"},
            "monitor": {"--targets", "--interval"},
        }.get(args.action, set())
        wrong = [option for option, present in given.items() if present and option not in takes]
        if wrong:
            allowed = ", ".join(sorted(takes)) or "no options"
            raise CudaMemError(f"'{args.action}' takes {allowed}; {wrong[0]} does not go with it")

    # -- after every %%px cell ------------------------------------------------------------------------
    def _mode(self, action: str) -> None:
        if action == "on" and not self.auto:
            px_view(self.shell)  # no client yet: say so now, not after every cell
            self.shell.events.register("post_run_cell", self._after_cell)
            self.auto = True
        elif action == "off":
            self._auto_off()
        state = "on (shown where an engine measured something new)" if self.auto else "off"
        print(f"cudamem engines: the table after each %px cell is {state}")
        if action == "status" and self.live is not None:
            print(live_text(self.live.state()))

    def _auto_off(self) -> None:
        if self.auto:
            self.shell.events.unregister("post_run_cell", self._after_cell)
            self.auto = False

    @staticmethod
    def _is_px_cell(raw: str) -> bool:
        first = raw.lstrip().split("\n", 1)[0]
        if first.startswith("%%px"):  # its options: --noblock leaves the engines still running the cell
            return not any(flag in first.split() for flag in ("--noblock", "-a"))
        return first.startswith("%px ")

    def _after_cell(self, result: ExecutionResult | None = None) -> None:
        raw = getattr(getattr(result, "info", None), "raw_cell", None) or ""
        if not self._is_px_cell(raw):
            return
        try:
            view = px_view(self.shell)
            report = EnginesReport(ask_engines(view.client, engine_ids(view), engine_report, 1, timeout_s=self.timeout_s))
        except Exception as error:  # never break the user's cell because gathering failed
            self.note(f"engines not gathered: {error}")
            return
        shown = frozenset(
            (a.engine_id, a.latest.execution_count, a.latest.finished_at) for a in report.answers if a.latest is not None
        )
        if shown - self._last_shown:  # some engine measured a cell since the last table
            self._last_shown = shown
            self.last = report
            display(report)

    # -- the live monitor ---------------------------------------------------------------------------
    def start_monitor(self, client: Client, engines: list[int], interval_s: float) -> EnginesLive:
        interval_s = interval_seconds(interval_s, "--interval")
        self.stop_monitor(quiet=True)
        channel = f"cudamem-engines-{uuid.uuid4().hex[:12]}"
        started = ask(client, engines, start_engine_feed, channel, interval_s, timeout_s=self.timeout_s)
        live = EnginesLive(engines, feed_readings(client, channel), lambda: client.ids, interval_s=interval_s)
        self.live, self._live_channel, self._live_client = live, channel, client
        self.live_view = LiveView(live)
        live.start()
        self.live_view.show()
        for engine, (status, reason, note) in started.items():
            if status is not EngineStatus.ANSWERED or reason is not None:
                self.note(f"engine {engine} sends no readings: {note or reason}")
        return live

    def stop_monitor(self, quiet: bool = False) -> None:
        live, channel, client = self.live, self._live_channel, self._live_client
        if live is None:
            if not quiet:
                self.tell("the engines monitor is not running; start it with %cudamem_engines monitor")
            return
        live.stop(reason="%cudamem_engines stop")
        if self.live_view is not None:
            self.live_view.detach()
        self.live = self.live_view = self._live_channel = self._live_client = None
        if not quiet:
            self.tell("the engines monitor stopped")
        if client is not None and channel is not None:
            try:  # tell the engines that still answer; a dead one has nothing left to stop
                for engine in set(client.ids) & set(live.engines):
                    client[engine].apply_async(stop_engine_feed, channel)
            except Exception as error:
                self.note(f"engines not told to stop sending: {error}")

    # -- on an engine -------------------------------------------------------------------------------
    def stop_feed(self, channel: str) -> None:
        entry = self.feeds.pop(channel, None)
        if entry is None:
            return
        unsubscribe, poller, started_here = entry
        unsubscribe()
        if not any(p is poller for _, p, _ in self.feeds.values()):
            poller.keepalive_s = None  # no feed left: the engine's own monitor views need no keepalive
            if started_here:
                poller.stop(reason="the client's engines monitor stopped")

    def close(self) -> None:
        self._auto_off()
        self.stop_monitor(quiet=True)
        for channel in list(self.feeds):
            self.stop_feed(channel)
