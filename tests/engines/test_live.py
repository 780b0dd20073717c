"""The engines monitor without a cluster: an engine's feed over a fake card, and the client's gathering thread
driven by hand with a fake clock."""

from __future__ import annotations

from jupyter_cudamem.engines.live import (
    EngineFeed,
    EngineLiveStatus,
    EngineReading,
    EnginesLive,
    live_html,
    live_text,
)
from jupyter_cudamem.engines.records import EngineIdentity
from jupyter_cudamem.monitor.poller import Poller

from tests.fakes import GiB, FakeClock
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

IDENTITY = EngineIdentity(host="node-1", pid=4242)


def test_an_engine_feed_sends_changes_and_a_keepalive_not_every_tick(hardware, machine):
    clock = FakeClock()
    sent: list[EngineReading] = []
    poller = Poller(hardware, interval_s=1.0, max_updates_per_s=100, clock=clock, monotonic=clock, keepalive_s=5.0)
    poller.subscribe(EngineFeed(7, IDENTITY, sent.append, clock=clock))
    poller.tick()
    assert len(sent) == 1 and sent[0].engine_id == 7 and sent[0].sequence == 1
    for _ in range(4):  # nothing moves for 4 s: nothing is sent
        clock.now += 1.0
        poller.tick()
    assert len(sent) == 1
    clock.now += 1.0  # 5 s of silence: the keepalive, same figures
    poller.tick()
    assert len(sent) == 2 and sent[1].devices == sent[0].devices and sent[1].sequence == 2
    machine.allocate(0, 3 * GiB)  # a shown figure moves: sent at once
    clock.now += 1.0
    poller.tick()
    assert len(sent) == 3
    # 512 MiB of context plus the 3 GiB reserved, on the engine's own process.
    assert sent[2].devices[0].process_bytes == 3 * GiB + 512 * 1024**2
    assert sent[2].devices[0].uuid == machine.gpus[0].uuid.removeprefix("GPU-")


def reading(engine: int, sequence: int, used_gib: int = 1) -> EngineReading:
    from jupyter_cudamem.engines.live import ReadingDevice

    device = ReadingDevice("GPU-1234567890abcdef", "H100", "cuda:0", used_gib * GiB, 80 * GiB, used_gib * GiB, 5, used_gib * GiB, None)
    return EngineReading(engine, EngineIdentity("node-1", 100 + engine), sequence, 1000.0 + sequence, (device,), True, None, None)


class Transport:
    """What ipyparallel's client holds: the latest reading of each engine, and the engines registered."""

    def __init__(self):
        self.latest: dict[int, EngineReading] = {}
        self.registered = {0, 1}
        self.broken = False

    def readings(self):
        if self.broken:
            raise ConnectionError("client closed")
        return dict(self.latest)


def test_the_client_shows_live_silent_and_gone_engines_and_keeps_going():
    clock = FakeClock()
    transport = Transport()
    live = EnginesLive([0, 1], transport.readings, lambda: transport.registered, interval_s=1.0, silent_after_s=15.0, monotonic=clock)
    shown = []
    live.subscribe(shown.append)
    live.tick()
    assert [r.status for r in live.state().engines] == [EngineLiveStatus.WAITING, EngineLiveStatus.WAITING]

    transport.latest = {0: reading(0, 1), 1: reading(1, 1, used_gib=2)}
    clock.now += 1.0
    live.tick()
    assert [r.status for r in live.state().engines] == [EngineLiveStatus.LIVE, EngineLiveStatus.LIVE]
    notified = len(shown)
    clock.now += 1.0
    live.tick()  # nothing new: no notification
    assert len(shown) == notified

    # Engine 0 keeps sending (keepalives), engine 1 falls silent: after 15 s it is shown as not answering.
    for second in range(2, 18):
        transport.latest[0] = reading(0, second)
        clock.now += 1.0
        live.tick()
    rows = {r.engine_id: r for r in live.state().engines}
    assert rows[0].status == EngineLiveStatus.LIVE and rows[1].status == EngineLiveStatus.SILENT
    assert "engine 1 [node-1 pid 101] not answering for 17.00 s" in live_text(live.state())

    # Engine 1 is unregistered (it died): gone; engine 0 is still live, and a failing read stops nothing.
    transport.registered = {0}
    live.tick()
    assert {r.engine_id: r.status for r in live.state().engines} == {0: EngineLiveStatus.LIVE, 1: EngineLiveStatus.GONE}
    transport.broken = True
    live.tick()
    assert live.state().error == "ConnectionError: client closed"
    assert "color:#7f7f7f" in live_html(live.state())


def test_the_thread_starts_stops_and_survives_a_broken_view():
    transport = Transport()
    transport.latest = {0: reading(0, 1)}
    live = EnginesLive([0], transport.readings, lambda: transport.registered, interval_s=0.05)

    def broken_view(state):
        raise RuntimeError("view gone")

    live.subscribe(broken_view)
    live.start()
    assert live.running
    live.stop(reason="test")
    assert not live.running
    assert live.state().stop_reason == "test"
    assert "stopped (test)" in live_text(live.state())
