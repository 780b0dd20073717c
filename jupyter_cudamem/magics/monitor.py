"""``%cudamem_monitor``: start, show, stop and snapshot the live GPU monitor of this shell.

Thin: parses options, keeps the shell's one ``Poller`` and its current view, and hands the rest to
``jupyter_cudamem.monitor``. The poller reads through the extension's ``Hardware``, so it shares the
NVML session and the device map with ``%%cudamem``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from traitlets import Bool, TraitError, observe, validate

from ..errors import CudaMemError
from ..monitor.poller import (
    DEFAULT_HISTORY_S,
    DEFAULT_INTERVAL_S,
    DEFAULT_MAX_UPDATES_PER_S,
    Poller,
    validate_settings,
)
from ..monitor.render import DEFAULT_ALERT_FRACTION, text_line
from ..monitor.snapshot import Snapshot
from ..monitor.widget import MonitorView, make_view
from .base import CudaMemMagicsBase, one_line_errors, parse_devices
from .options import Float, number_option, parse_line

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.utils.bunch import Bunch
    from . import Extension
    from ..hardware import Hardware

ACTIONS = ("start", "stop", "snapshot")

# How each front end spells the timing options, so an error names what the user typed.
MAGIC_NAMES = {"interval_s": "--interval", "history_s": "--history", "max_updates_per_s": "CudaMemMonitor.max_updates_per_s"}
PYTHON_NAMES = {"interval_s": "interval_s", "history_s": "history_s", "max_updates_per_s": "CudaMemMonitor.max_updates_per_s"}
CONFIG_NAMES = {name: f"CudaMemMonitor.{name}" for name in MAGIC_NAMES}


@magics_class
class CudaMemMonitor(CudaMemMagicsBase):
    """The live GPU monitor. Configure with ``%config CudaMemMonitor.<option> = ...``."""

    interval_s = Float(DEFAULT_INTERVAL_S, help="Seconds between two readings (--interval).").tag(config=True)
    history_s = Float(
        DEFAULT_HISTORY_S, help="Seconds of history kept for the sparkline and the snapshot (--history)."
    ).tag(config=True)
    alert_fraction = Float(
        DEFAULT_ALERT_FRACTION, help="Fraction of the card's memory past which the bar turns red."
    ).tag(config=True)
    max_updates_per_s = Float(
        DEFAULT_MAX_UPDATES_PER_S, help="Most updates a second sent to the frontend, whatever the interval."
    ).tag(config=True)
    use_widgets = Bool(
        True,
        help="Show the ipywidgets panel in a kernel; False shows a live line of text instead. Applies to the "
        "next view shown (%cudamem_monitor again).",
    ).tag(config=True)

    # Checked when set (``%config`` prints the one line); the running monitor takes every valid change at once.
    @validate("interval_s", "history_s", "max_updates_per_s")
    def _validate_settings(self, proposal: Bunch) -> float:
        values = {name: getattr(self, name) for name in CONFIG_NAMES}
        values[proposal["trait"].name] = proposal["value"]
        try:
            validate_settings(values["interval_s"], values["history_s"], values["max_updates_per_s"], CONFIG_NAMES)
        except CudaMemError as error:
            raise TraitError(str(error)) from None
        return proposal["value"]

    @validate("alert_fraction")
    def _check_alert_fraction(self, proposal: Bunch) -> float:
        value = proposal["value"]
        if not 0.0 <= value <= 1.0:
            raise TraitError(
                f"CudaMemMonitor.alert_fraction takes a fraction of the card's memory from 0 to 1, such as 0.9; got {value!r}"
            )
        return value

    def __init__(self, shell: InteractiveShell, hardware: Hardware, extension: Extension, **kwargs: object):
        # Set before the base class loads the shell's config, which calls the observers below.
        self.poller: Poller | None = None
        self.view: MonitorView | None = None
        super().__init__(shell=shell, hardware=hardware, extension=extension, **kwargs)

    # -- the magic ----------------------------------------------------------------------------
    @magic_arguments()
    @argument(
        "action",
        nargs="?",
        choices=ACTIONS,
        default="start",
        help="start (the default: start or show the monitor), stop, or snapshot (plot the recorded history).",
    )
    @argument(
        "--interval",
        type=number_option("seconds between two readings"),
        metavar="SECONDS",
        help="seconds between two readings (default: CudaMemMonitor.interval_s, 1).",
    )
    @argument("--devices", metavar="0,1", help="CUDA devices to watch, by cuda:N number (default: all).")
    @argument(
        "--history",
        type=number_option("seconds of history"),
        metavar="SECONDS",
        help="seconds of history kept for the sparkline and snapshot (default: CudaMemMonitor.history_s, 300).",
    )
    @line_magic
    @one_line_errors
    def cudamem_monitor(self, line: str = "") -> Snapshot | None:
        """Watch GPU memory live while later cells run.

        ``%cudamem_monitor`` shows a panel per GPU (used / total, this kernel versus other processes,
        utilisation, a sparkline, the peak since start) that updates from a background thread.
        A second call shows the same monitor again; it never starts a second thread.
        """
        args = parse_line(self.cudamem_monitor, line)
        return self.run(args.action, interval_s=args.interval, devices=args.devices, history_s=args.history)

    def run(
        self,
        action: str | None = "start",
        *,
        interval_s: float | None = None,
        devices: str | Sequence[int] | None = None,
        history_s: float | None = None,
        names: dict[str, str] = MAGIC_NAMES,
    ) -> Snapshot | None:
        """What ``%cudamem_monitor`` and ``jupyter_cudamem.monitor()`` do; ``names`` spells the options
        in errors as the caller's user wrote them."""
        action = action or "start"
        for key, value in (("interval_s", interval_s), ("history_s", history_s)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise CudaMemError(f"{names[key]} takes a number of seconds; got {value!r}")
        if action not in ACTIONS:
            raise CudaMemError(f"unknown monitor action {action!r}; use one of {', '.join(ACTIONS)}")
        if action != "start" and (interval_s is not None or devices is not None or history_s is not None):
            raise CudaMemError(f"'{action}' takes no options; options go with starting the monitor")
        if action == "stop":
            self.stop()
            return None
        if action == "snapshot":
            return self.snapshot()
        self.start(interval_s=interval_s, devices=devices, history_s=history_s, names=names)
        return None

    # -- actions ------------------------------------------------------------------------------
    def _check_devices(self, wanted: tuple[int, ...]) -> None:
        available = self.hardware.device_map.devices()
        missing = [index for index in wanted if index >= len(available)]
        if missing:
            seen = ", ".join(f"cuda:{i}" for i in range(len(available))) or "no device"
            raise CudaMemError(f"no cuda:{missing[0]} here; this process sees {seen}")

    def start(
        self,
        *,
        interval_s: float | None = None,
        devices: str | Sequence[int] | None = None,
        history_s: float | None = None,
        names: dict[str, str] = MAGIC_NAMES,
    ) -> Poller:
        """Start the shell's poller (or change the running one's options) and show a view of it."""
        if interval_s is not None or history_s is not None:
            validate_settings(
                self.interval_s if interval_s is None else interval_s,
                self.history_s if history_s is None else history_s,
                self.max_updates_per_s,
                names,
            )
        selection = None if devices is None else parse_devices(devices)
        unavailable = self.hardware.nvml.status()
        if selection is not None and unavailable is None:
            self._check_devices(selection)
        poller = self.poller
        if poller is None:
            poller = self.poller = Poller(
                self.hardware,
                interval_s=self.interval_s if interval_s is None else interval_s,
                history_s=self.history_s if history_s is None else history_s,
                devices=selection,
                max_updates_per_s=self.max_updates_per_s,
            )
        elif poller.running:
            poller.reconfigure(interval_s=interval_s, history_s=history_s)
            if devices is not None:
                poller.select(selection)
        else:
            poller.reconfigure(
                interval_s=self.interval_s if interval_s is None else interval_s,
                history_s=self.history_s if history_s is None else history_s,
            )
            poller.select(selection)
        if not poller.start():
            # No GPU or no driver: one line, no panel, no thread.
            self._display_line(text_line(poller.state(), self.alert_fraction))
            return poller
        self._show()
        return poller

    def _display_line(self, line: str) -> None:
        from IPython.display import display

        display({"text/plain": line}, raw=True)

    def _show(self) -> None:
        assert self.poller is not None
        if self.view is not None:
            self.view.detach()  # one live view per monitor: older panels keep their last picture
        self.view = make_view(
            self.poller,
            self.shell,
            alert_fraction=self.alert_fraction,
            use_widgets=self.use_widgets,
            on_stop=lambda: self.stop(quiet=True),
            note=self.note,
        )
        self.view.show()

    def stop(self, quiet: bool = False) -> None:
        if self.poller is None or not self.poller.running:
            if not quiet:
                self.tell("the monitor is not running; start it with %cudamem_monitor")
            return
        self.poller.stop(reason="%cudamem_monitor stop")
        if not quiet:
            self.tell("monitor stopped; %cudamem_monitor snapshot still plots what it recorded")

    def snapshot(self) -> Snapshot:
        poller = self.poller
        if poller is None or not poller.histories():
            raise CudaMemError("nothing recorded yet: start the monitor with %cudamem_monitor")
        return Snapshot.of(poller.state(), poller.histories(), self.alert_fraction)

    def close(self) -> None:
        """Stop and join the thread (NVML is shut down right after, on unload) and let views go."""
        if self.poller is not None:
            self.poller.stop(reason="extension unloaded")
        if self.view is not None:
            self.view.detach()
            self.view = None

    # -- live configuration -------------------------------------------------------------------
    @observe("interval_s", "history_s", "max_updates_per_s")
    def _timing_changed(self, change: Bunch) -> None:
        if self.poller is None:
            return
        try:
            self.poller.reconfigure(**{change["name"]: change["new"]})
        except CudaMemError as error:
            self.note(str(error))

    @observe("alert_fraction")
    def _alert_changed(self, change: Bunch) -> None:
        if self.view is not None:
            self.view.alert_fraction = change["new"]
            self.view.render()


def call_monitor(*args: Any, **kwargs: Any) -> Snapshot | None:
    """``monitor(...)`` as the callable ``jupyter_cudamem.monitor`` calls it: a wrong argument, or a bad
    value, is one line (IPython's ``UsageError``), never a traceback through our frames."""
    __tracebackhide__ = True  # noqa: F841
    import inspect

    from IPython.core.error import UsageError

    try:
        inspect.signature(monitor).bind(*args, **kwargs)
    except TypeError as error:
        raise UsageError(
            f"monitor(): {error}; it takes monitor(action, interval_s=..., devices=..., history_s=...), action "
            "one of 'start', 'stop', 'snapshot'"
        ) from None
    try:
        return monitor(*args, **kwargs)
    except CudaMemError as error:
        raise UsageError(str(error)) from None


def monitor(
    action: str | None = None,
    *,
    interval_s: float | None = None,
    devices: str | Sequence[int] | None = None,
    history_s: float | None = None,
) -> Snapshot | None:
    """Start (or show again), stop, or snapshot the live GPU monitor of the current IPython shell.

    ``from jupyter_cudamem import monitor; monitor()`` does what ``%cudamem_monitor`` does. Loads the
    extension if needed, so the monitor shares the NVML session and the devices of ``%%cudamem``.
    ``action`` is ``None``/``"start"``, ``"stop"`` or ``"snapshot"`` (which returns a ``Snapshot``:
    ``.figure()`` is a matplotlib figure). Sizes are bytes, times seconds.
    """
    from IPython import get_ipython

    from . import loaded

    shell = get_ipython()
    if shell is None:
        raise CudaMemError("monitor() shows its panel in IPython or Jupyter; call it from a notebook or IPython")
    if loaded(shell) is None:
        shell.extension_manager.load_extension("jupyter_cudamem")
    extension = loaded(shell)
    magics = extension.get(CudaMemMonitor) if extension is not None else None
    if not isinstance(magics, CudaMemMonitor):
        raise CudaMemError("the monitor is not registered in this shell: run %load_ext jupyter_cudamem")
    return magics.run(action, interval_s=interval_s, devices=devices, history_s=history_s, names=PYTHON_NAMES)

