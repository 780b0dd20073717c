"""Asking engines through a stand-in for ipyparallel's client: who is asked, how long, and what each answer becomes."""

from __future__ import annotations

import pytest

from jupyter_cudamem.engines.gather import ask_engines, parse_targets
from jupyter_cudamem.engines.records import EngineIdentity, EngineReport, EngineStatus
from jupyter_cudamem.errors import CudaMemError

from tests.fakes import FakeClock

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free


class Result:
    """An ``AsyncResult`` that is ready after ``ready_after_s`` of the fake clock, with ``value`` or ``error``."""

    def __init__(self, clock, ready_after_s, value=None, error=None):
        self.clock, self.ready_at, self.value, self.error = clock, clock.now + ready_after_s, value, error
        self.aborted = False
        self.waited = []

    def wait(self, timeout):
        self.waited.append(timeout)
        self.clock.now = min(self.ready_at, self.clock.now + timeout) if self.ready_at > self.clock.now else self.clock.now

    def ready(self):
        return self.clock.now >= self.ready_at

    def get(self, timeout):
        if self.error:
            raise self.error
        return self.value

    def abort(self):
        self.aborted = True


class Client:
    def __init__(self, clock, answers, registered):
        self.clock, self.answers, self.ids = clock, answers, registered
        self.asked = []
        self.results = {}

    def __getitem__(self, engine):
        client = self

        class View:
            def apply_async(self, request, *args):
                client.asked.append((engine, request.__name__, args))
                result = client.results[engine] = Result(client.clock, *client.answers[engine])
                return result

        return View()


def report(loaded=True):
    return EngineReport(EngineIdentity("h", 1), loaded=loaded)


def request(cells):
    raise AssertionError("runs on the engines, not here")


class RemoteError(Exception):
    ename, evalue = "ValueError", "bad batch\nsecond line"


def test_each_engine_is_asked_once_and_waited_for_at_most_the_timeout_in_all():
    clock = FakeClock()
    client = Client(
        clock,
        {0: (1.0, report()), 1: (100.0, report()), 2: (0.5, report(loaded=False)), 3: (0.0, None, RemoteError())},
        registered=[0, 1, 2, 3],
    )
    answers = ask_engines(client, [0, 1, 2, 3, 4], request, 5, timeout_s=10.0, monotonic=clock)
    assert sorted(client.asked) == [(e, "request", (5,)) for e in (0, 1, 2, 3)]  # 4 is not registered: not asked
    assert [(a.engine_id, a.status) for a in answers] == [
        (0, EngineStatus.ANSWERED),
        (1, EngineStatus.NO_ANSWER),
        (2, EngineStatus.NOT_LOADED),
        (3, EngineStatus.FAILED),
        (4, EngineStatus.GONE),
    ]
    assert clock.now == 1000.0 + 10.0  # engine 1 used what was left of the 10 s, the others waited for nothing more
    assert client.results[1].aborted and not client.results[0].aborted
    assert answers[3].note == "ValueError: bad batch"
    assert answers[1].note == "none within 10 s (busy running a cell, or hung)"
    assert answers[2].note == "run %px %load_ext jupyter_cudamem"


@pytest.mark.parametrize("text, ids", [("0", [0]), ("0,2", [0, 2]), ("1-3", [1, 2, 3]), ("4, 0-1", [4, 0, 1]), ("2,2", [2])])
def test_targets(text, ids):
    assert parse_targets(text) == ids


@pytest.mark.parametrize("text", ["", "a", "1-", "-2", "1;2"])
def test_bad_targets_say_what_they_take(text):
    with pytest.raises(CudaMemError, match=r"--targets takes engine ids such as 0,2 or 0-3"):
        parse_targets(text)


@pytest.mark.parametrize("text, says", [("3-1", "runs backwards, so it names no engine: write 1-3"),
                                        ("0-99999999999", "more than 10,000 engines"),
                                        ("0-5000,6000-20000", "more than 10,000 engines")])
def test_a_backwards_or_endless_range_is_one_line_at_once(text, says):
    with pytest.raises(CudaMemError, match=says):  # 0-99999999999 listed every id: minutes, gigabytes
        parse_targets(text)
