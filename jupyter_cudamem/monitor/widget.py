"""Views over a ``Poller``: an ipywidgets panel, or one line of text where widgets cannot show.

A view never owns the thread: it subscribes to the poller, renders each state it is handed, and
writes to the frontend only when what it shows changed (the poller already limits how often it is
called). Like tqdm's notebook bar it uses stock widgets only (HTML, Button, Image, VBox/HBox), so
nothing needs a frontend build, and it falls back to text where ipywidgets or a widget frontend is
missing, instead of failing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .poller import Poller
from .state import MonitorState
from .render import DEFAULT_ALERT_FRACTION, panel_html, text_line
from .snapshot import Snapshot

if TYPE_CHECKING:
    from IPython.core.display_functions import DisplayHandle
    from IPython.core.interactiveshell import InteractiveShell
    from ipywidgets import Widget

NO_WIDGET_HINT = (
    "no panel here? this frontend does not show ipywidgets: "
    "`%config CudaMemMonitor.use_widgets = False` then `%cudamem_monitor` gives a live text line"
)
NO_IPYWIDGETS_NOTE = "ipywidgets is not installed, so the monitor shows one line of text: pip install ipywidgets"


def _display(*args: Any, **kwargs: Any) -> DisplayHandle | None:
    from IPython.display import display

    return display(*args, **kwargs)


class TextView:
    """The monitor as one line of text.

    ``live``: in a kernel whose frontend cannot show widgets, the line is updated in place through a
    display id. Not live (terminal IPython): printed once; printing from a thread would garble the
    prompt, so ``%cudamem_monitor`` prints the current line again when asked.
    """

    def __init__(self, poller: Poller, alert_fraction: float = DEFAULT_ALERT_FRACTION, live: bool = False):
        self.poller = poller
        self.alert_fraction = alert_fraction
        self.live = live
        self.updates_sent = 0
        self._line: str | None = None
        self._handle: DisplayHandle | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def line(self, state: MonitorState | None = None) -> str:
        return text_line(state or self.poller.state(), self.alert_fraction)

    def show(self) -> None:
        self._line = self.line()
        if self.live:
            self._handle = _display({"text/plain": self._line}, raw=True, display_id=True)
            self._unsubscribe = self.poller.subscribe(self.render)
        else:
            _display({"text/plain": self._line}, raw=True)

    def render(self, state: MonitorState | None = None) -> None:
        line = self.line(state)
        if line == self._line or self._handle is None:
            return
        self._line = line
        self._handle.update({"text/plain": line}, raw=True)
        self.updates_sent += 1

    def detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None


class WidgetView:
    """The ipywidgets panel: one HTML body (bars, numbers, sparklines), Stop and Snapshot buttons.

    Raises ``ImportError`` where ipywidgets is not installed; the caller falls back to text.
    """

    def __init__(
        self,
        poller: Poller,
        alert_fraction: float = DEFAULT_ALERT_FRACTION,
        on_stop: Callable[[], None] | None = None,
    ):
        import ipywidgets as widgets

        self.poller = poller
        self.alert_fraction = alert_fraction
        self._on_stop = on_stop or (lambda: poller.stop(reason="stop button"))
        self.updates_sent = 0
        state = poller.state()
        self.body = widgets.HTML(value=self._html(state))
        self.stop_button = widgets.Button(
            description="Stop", icon="stop", tooltip="stop the monitor thread", disabled=not state.running
        )
        self.snapshot_button = widgets.Button(
            description="Snapshot", icon="camera", tooltip="plot the recorded history with matplotlib"
        )
        self.image = widgets.Image(format="png", layout=widgets.Layout(display="none"))
        self.stop_button.on_click(lambda _button: self._on_stop())
        self.snapshot_button.on_click(lambda _button: self.snapshot())
        self.box = widgets.VBox([self.body, widgets.HBox([self.stop_button, self.snapshot_button]), self.image])
        self._unsubscribe: Callable[[], None] | None = poller.subscribe(self.render)

    def _html(self, state: MonitorState) -> str:
        return panel_html(state, self.poller.histories(), self.alert_fraction)

    def _set(self, widget: Widget, name: str, value: object) -> None:
        # Assigning an equal value sends nothing (traitlets does not notify), but we skip it
        # explicitly and count what does go out: the benchmark reports messages per second.
        if getattr(widget, name) != value:
            setattr(widget, name, value)
            self.updates_sent += 1

    def render(self, state: MonitorState | None = None) -> None:
        state = state or self.poller.state()
        self._set(self.body, "value", self._html(state))
        self._set(self.stop_button, "disabled", not state.running)

    def snapshot(self) -> Snapshot:
        """Plot the history into the panel (under the buttons) and return it."""
        snapshot = Snapshot.of(self.poller.state(), self.poller.histories(), self.alert_fraction)
        self._set(self.image, "value", snapshot.png())
        self._set(self.image.layout, "display", None)
        return snapshot

    def show(self) -> None:
        bundle = self.box._repr_mimebundle_()
        # What a frontend without a widget manager shows in place of the panel.
        bundle["text/plain"] = f"{text_line(self.poller.state(), self.alert_fraction)} [{NO_WIDGET_HINT}]"
        _display(bundle, raw=True)

    def detach(self) -> None:
        """Stop following the poller (the panel keeps its last picture)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._set(self.stop_button, "disabled", True)


MonitorView = TextView | WidgetView


def has_widget_frontend(shell: InteractiveShell) -> bool:
    """Whether a Jupyter frontend may show widgets: only a kernel (not terminal IPython) has one."""
    return getattr(shell, "kernel", None) is not None


def make_view(
    poller: Poller,
    shell: InteractiveShell,
    *,
    alert_fraction: float = DEFAULT_ALERT_FRACTION,
    use_widgets: bool = True,
    on_stop: Callable[[], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> MonitorView:
    """The best view this shell can show: the panel in a kernel, else a line of text."""
    if not has_widget_frontend(shell):
        return TextView(poller, alert_fraction, live=False)
    if use_widgets:
        try:
            return WidgetView(poller, alert_fraction, on_stop=on_stop)
        except ImportError:
            if note is not None:
                note(NO_IPYWIDGETS_NOTE)
    return TextView(poller, alert_fraction, live=True)
