"""``%cudamem_monitor``: start, show, stop and snapshot the live GPU monitor of this shell.

Thin: parses options, keeps the shell's one ``Poller`` and its current view, and hands the rest to
``jupyter_cudamem.monitor``. The poller reads through the extension's ``Hardware``, so it shares the
NVML session and the device map with ``%%cudamem``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, observe

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

ACTIONS = ("start", "stop", "snapshot")


@magics_class
class CudaMemMonitor(CudaMemMagicsBase):
    """The live GPU monitor. Configure with ``%config CudaMemMonitor.<option> = ...``."""

    interval_s = Float(DEFAULT_INTERVAL_S, help="Seconds between two readings (--interval).").tag(config=True)
    history_s = Float(
        DEFAULT_HISTORY_S, help="Seconds of history kept for the sparkline and the snapshot (--history)."
    ).tag(config=True)
    alert_fraction = Float(
        DEFAULT_ALERT_FRACTION, min=0.0, max=1.0, help="Fraction of the card's memory past which the bar turns red."
    ).tag(config=True)
    max_updates_per_s = Float(
        DEFAULT_MAX_UPDATES_PER_S, help="Most updates a second sent to the frontend, whatever the interval."
    ).tag(config=True)
    use_widgets = Bool(
        True, help="Show the ipywidgets panel in a kernel; False shows a live line of text instead."
    ).tag(config=True)

    def __init__(self, shell: Any, hardware: Any, extension: Any = None, **kwargs: Any):
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
        type=float,
        metavar="SECONDS",
        help="seconds between two readings (default: CudaMemMonitor.interval_s, 1).",
    )
    @argument("--devices", metavar="0,1", help="CUDA devices to watch, by cuda:N number (default: all).")
    @argument(
        "--history",
        type=float,
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
        args = parse_argstring(self.cudamem_monitor, line)
        return self.run(args.action, interval_s=args.interval, devices=args.devices, history_s=args.history)

    def run(
        self,
        action: str | None = "start",
        *,
        interval_s: float | None = None,
        devices: str | Sequence[int] | None = None,
        history_s: float | None = None,
    ) -> Snapshot | None:
        """What ``%cudamem_monitor`` and ``jupyter_cudamem.monitor.monitor()`` do."""
        action = action or "start"
        if action not in ACTIONS:
            raise CudaMemError(f"unknown monitor action {action!r}; use one of {', '.join(ACTIONS)}")
        if action != "start" and (interval_s is not None or devices is not None or history_s is not None):
            raise CudaMemError(f"'{action}' takes no options; options go with starting the monitor")
        if action == "stop":
            self.stop()
            return None
        if action == "snapshot":
            return self.snapshot()
        self.start(interval_s=interval_s, devices=devices, history_s=history_s)
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
    ) -> Poller:
        """Start the shell's poller (or change the running one's options) and show a view of it."""
        if interval_s is not None or history_s is not None:
            validate_settings(
                self.interval_s if interval_s is None else interval_s,
                self.history_s if history_s is None else history_s,
                self.max_updates_per_s,
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
                self.note("the monitor is not running; start it with %cudamem_monitor")
            return
        self.poller.stop(reason="%cudamem_monitor stop")
        if not quiet:
            self.note("monitor stopped; %cudamem_monitor snapshot still plots what it recorded")

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
    def _timing_changed(self, change: Any) -> None:
        if self.poller is None:
            return
        try:
            self.poller.reconfigure(**{change["name"]: change["new"]})
        except CudaMemError as error:
            self.note(str(error))

    @observe("alert_fraction")
    def _alert_changed(self, change: Any) -> None:
        if self.view is not None:
            self.view.alert_fraction = change["new"]
            self.view.render()
