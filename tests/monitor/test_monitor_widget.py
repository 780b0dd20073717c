"""The views: the widget panel sends messages only on change, its buttons work, and text stands in
wherever widgets cannot show."""

from __future__ import annotations

import sys
import threading

import ipywidgets
import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from jupyter_cudamem.hardware import Hardware
from jupyter_cudamem.monitor.poller import THREAD_NAME, Poller
from jupyter_cudamem.monitor.widget import NO_IPYWIDGETS_NOTE, NO_WIDGET_HINT, TextView, WidgetView, make_view
from tests.fakes import FakeAllocator, FakeClock, FakeMachine, FakeNvml, GiB


@pytest.fixture
def machine() -> FakeMachine:
    return FakeMachine()


@pytest.fixture
def monotonic() -> FakeClock:
    return FakeClock()


@pytest.fixture
def poller(machine, monotonic) -> Poller:
    hardware = Hardware(
        allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid, pid_exists=lambda p: True
    )
    return Poller(hardware, interval_s=0.05, monotonic=monotonic)


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, dict]]:
    """Every message a widget would send to the frontend (there is none in tests: count them)."""
    messages: list[tuple[str, dict]] = []
    monkeypatch.setattr(
        ipywidgets.Widget, "_send", lambda self, msg, buffers=None: messages.append((self.model_id, msg))
    )
    return messages


@pytest.fixture
def shell() -> InteractiveShell:
    return InteractiveShell.instance()


def test_panel_messages_go_out_only_when_a_shown_value_changes(poller, machine, monotonic, sent):
    poller.tick()
    view = WidgetView(poller)
    sent.clear()
    for _ in range(20):
        monotonic.advance(1.0)
        poller.tick()
    assert sent == []
    assert view.updates_sent == 0
    machine.allocate(0, 3 * GiB)
    monotonic.advance(1.0)
    poller.tick()
    body = [msg for model, msg in sent if model == view.body.model_id]
    assert len(body) == 1 and "3.50 GiB" in body[0]["state"]["value"]
    assert len(sent) == view.updates_sent == 1


def test_fast_changes_reach_the_frontend_a_few_times_a_second_at_most(poller, machine, monotonic, sent):
    view = WidgetView(poller)
    sent.clear()
    for _ in range(100):  # 5 s of a change every 50 ms
        machine.allocate(0, 64 * 1024**2)
        poller.tick()
        monotonic.advance(0.05)
    assert 15 <= len(sent) <= 5 * 4 + 1
    assert view.updates_sent == len(sent)


def test_panel_turns_red_past_the_alert_fraction(poller, machine, monotonic):
    poller.tick()
    view = WidgetView(poller, alert_fraction=0.5)
    assert 'data-alert="false"' in view.body.value
    machine.allocate(0, 45 * GiB)
    monotonic.advance(1.0)
    poller.tick()
    assert 'data-alert="true"' in view.body.value
    view.alert_fraction = 0.9
    view.render()
    assert 'data-alert="false"' in view.body.value


def test_stop_button_stops_the_thread_and_the_panel_says_so(poller):
    view = WidgetView(poller)
    assert poller.start()
    assert view.stop_button.disabled is False
    view.stop_button.click()
    assert not poller.running
    assert [t for t in threading.enumerate() if t.name == THREAD_NAME] == []
    assert view.stop_button.disabled is True
    assert "stopped" in view.body.value


def test_snapshot_button_shows_the_history_as_a_png(poller, machine):
    poller.tick()
    machine.allocate(0, GiB)
    poller.tick()
    view = WidgetView(poller)
    assert view.image.layout.display == "none"
    view.snapshot_button.click()
    assert bytes(view.image.value).startswith(b"\x89PNG")
    assert view.image.layout.display is None


def test_a_detached_view_no_longer_follows_the_poller(poller, machine, monotonic):
    poller.tick()
    view = WidgetView(poller)
    before = view.body.value
    view.detach()
    machine.allocate(0, GiB)
    monotonic.advance(1.0)
    poller.tick()
    assert poller.notifications == 2
    assert view.body.value == before


def test_panel_is_displayed_with_a_text_fallback_for_frontends_without_widgets(poller, shell):
    poller.tick()
    view = WidgetView(poller)
    with capture_output() as captured:
        view.show()
    (output,) = captured.outputs
    assert output.data["application/vnd.jupyter.widget-view+json"]["model_id"] == view.box.model_id
    text = output.data["text/plain"]
    assert text.startswith("cudamem monitor (stopped): cuda:0 0 B / 80.00 GiB") and NO_WIDGET_HINT in text
    assert "\n" not in text
    assert "VBox" not in text


def test_terminal_ipython_gets_one_line_of_text(poller, shell):
    poller.tick()
    assert not hasattr(shell, "kernel")
    view = make_view(poller, shell)
    assert isinstance(view, TextView) and not view.live
    with capture_output() as captured:
        view.show()
    (output,) = captured.outputs
    assert list(output.data) == ["text/plain"]
    assert "\n" not in output.data["text/plain"] and output.data["text/plain"].startswith("cudamem monitor")


def test_kernel_without_ipywidgets_gets_a_live_text_line_not_an_error(poller, machine, monotonic, shell, monkeypatch):
    monkeypatch.setattr(shell, "kernel", object(), raising=False)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import fails as when it is not installed
    notes: list[str] = []
    poller.tick()
    view = make_view(poller, shell, note=notes.append)
    assert isinstance(view, TextView) and view.live
    assert notes == [NO_IPYWIDGETS_NOTE]
    with capture_output() as captured:
        view.show()
        machine.allocate(0, 2 * GiB)
        monotonic.advance(1.0)
        poller.tick()
    assert view.updates_sent == 1
    assert len(captured.outputs) == 2
    assert "2.50 GiB" in captured.outputs[-1].data["text/plain"]


def test_kernel_with_ipywidgets_gets_the_panel_unless_configured_off(poller, shell, monkeypatch):
    monkeypatch.setattr(shell, "kernel", object(), raising=False)
    assert isinstance(make_view(poller, shell), WidgetView)
    assert isinstance(make_view(poller, shell, use_widgets=False), TextView)
