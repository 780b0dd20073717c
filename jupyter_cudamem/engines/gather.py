"""The thin adapter over ipyparallel: which engines to ask, ask each, and wait a bounded time.

Each engine gets its own request (``client[engine].apply_async``), so one busy or hung engine delays
nothing but its own row: after ``timeout_s`` it is shown as not answering, its request is withdrawn
(an engine still running a long cell would otherwise run it later for nobody), and the others are shown.
An engine the controller no longer lists (it died, or was stopped) is shown as gone without asking.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import CudaMemError
from ..units import whole_number
from .records import EngineAnswer, EngineReport, EngineStatus

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell
    from ipykernel.zmqshell import ZMQInteractiveShell
    from ipyparallel import Client, DirectView

    from .live import EngineReading

INSTALL_HINT = (
    "ipyparallel is not installed, so there are no engines to gather from: "
    "pip install '.[parallel]' from the jupyter-cudamem clone (or pip install ipyparallel)"
)
NO_VIEW_HINT = (
    "no ipyparallel client in this kernel: connect one first, e.g. "
    "cluster = ipyparallel.Cluster(n=2); cluster.start_cluster_sync(); rc = cluster.connect_client_sync()"
)
DEFAULT_TIMEOUT_S = 10.0
MIN_TIMEOUT_S = 0.01
MAX_TIMEOUT_S = 3600.0
"""The longest wait for the engines' answers: an hour (a longer one outlives any cell that asks)."""


MAX_TARGETS = 10_000
"""The most engine ids ``--targets`` names (a cluster of more is not one a notebook drives)."""


def ipyparallel_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("ipyparallel") is None


def px_view(shell: InteractiveShell) -> DirectView:
    """The view ``%px`` runs on in this shell (ipyparallel registers it when a client connects)."""
    if ipyparallel_missing():
        raise CudaMemError(INSTALL_HINT)
    registry = getattr(getattr(shell, "magics_manager", None), "registry", {})
    for magics in registry.values():
        if type(magics).__name__ == "ParallelMagics" and getattr(magics, "suffix", None) == "":
            view = getattr(magics, "view", None)
            if view is None:
                continue
            if getattr(view.client, "_closed", False):  # %px keeps the view of a client closed since
                raise CudaMemError("the ipyparallel client behind %px is closed: " + NO_VIEW_HINT.split(": ", 1)[1])
            return view
    raise CudaMemError(NO_VIEW_HINT)


def engine_ids(view: DirectView) -> list[int]:
    """The engines a view targets, as ids (``'all'`` and ``None`` mean every engine registered now)."""
    targets = view.targets
    if targets is None or targets == "all":
        return sorted(view.client.ids)
    if isinstance(targets, int):
        return [targets]
    return [int(t) for t in targets]


def parse_targets(text: str) -> list[int]:
    """``"0,2,4-6"`` -> ``[0, 2, 4, 5, 6]``: engine ids, ranges with both ends included."""
    ids: list[int] = []
    for token in text.split(","):
        first, dash, last = token.strip().partition("-")
        start, end = whole_number(first), whole_number(last if dash else first)
        if start is None or end is None:
            raise CudaMemError(f"--targets takes engine ids such as 0,2 or 0-3; got {text!r}")
        if end < start:
            raise CudaMemError(f"--targets {token.strip()} runs backwards, so it names no engine: write {end}-{start}")
        if len(ids) + end - start >= MAX_TARGETS:  # a typo's 0-99999999 would take minutes and gigabytes to list
            raise CudaMemError(f"--targets names more than {MAX_TARGETS:,} engines; name the engines there are, such as 0-3")
        ids.extend(range(start, end + 1))
    return list(dict.fromkeys(ids))


def _one_line(error: BaseException) -> str:
    name = getattr(error, "ename", None) or type(error).__name__
    value = getattr(error, "evalue", None) or str(error)
    return f"{name}: {value}".splitlines()[0]


def ask(
    client: Client,
    engines: Iterable[int],
    request: Callable[..., Any],
    *args: object,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    monotonic: Callable[[], float] = time.monotonic,
) -> dict[int, tuple[EngineStatus, Any, str]]:
    """Run ``request(*args)`` on each engine; wait at most ``timeout_s`` in all. Per engine: how it answered
    (``ANSWERED``, ``NO_ANSWER``, ``GONE`` or ``FAILED``), its value, and a note."""
    registered = set(client.ids)
    answers: dict[int, tuple[EngineStatus, Any, str]] = {}
    pending: dict[int, Any] = {}
    for engine in engines:
        if engine not in registered:
            answers[engine] = (EngineStatus.GONE, None, "not registered with the controller")
        else:
            pending[engine] = client[engine].apply_async(request, *args)
    deadline = monotonic() + timeout_s
    for engine, result in pending.items():
        result.wait(max(deadline - monotonic(), 0.0))
        if not result.ready():
            try:
                result.abort()  # still queued behind a running cell: nobody will read the answer
            except Exception:  # already started or finished: nothing to withdraw
                pass
            answers[engine] = (EngineStatus.NO_ANSWER, None, f"none within {timeout_s:g} s (busy running a cell, or hung)")
            continue
        try:
            answers[engine] = (EngineStatus.ANSWERED, result.get(0), "")
        except Exception as error:  # the request failed there: one line, the others still count
            answers[engine] = (EngineStatus.FAILED, None, _one_line(error))
    return {engine: answers[engine] for engine in sorted(answers)}


def ask_engines(
    client: Client,
    engines: Iterable[int],
    request: Callable[..., EngineReport],
    *args: object,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    monotonic: Callable[[], float] = time.monotonic,
) -> list[EngineAnswer]:
    """``ask`` for ``EngineReport``s: one ``EngineAnswer`` per engine, in engine order."""
    answers = []
    for engine, (status, value, note) in ask(client, engines, request, *args, timeout_s=timeout_s, monotonic=monotonic).items():
        if status is not EngineStatus.ANSWERED:
            answers.append(EngineAnswer(engine, status, note=note))
        elif not isinstance(value, EngineReport):
            answers.append(EngineAnswer(engine, EngineStatus.FAILED, note=f"unexpected answer {type(value).__name__}"))
        elif not value.loaded:
            answers.append(EngineAnswer(engine, EngineStatus.NOT_LOADED, value, note="run %px %load_ext jupyter_cudamem"))
        else:
            answers.append(EngineAnswer(engine, EngineStatus.ANSWERED, value))
    return answers


# -- the live monitor's transport -----------------------------------------------------------------------
def feed_sender(shell: ZMQInteractiveShell, channel: str) -> Callable[[EngineReading], None]:
    """Engine side: a ``send(reading)`` that publishes on the engine's IOPub, as ipyparallel's
    ``publish_data`` does, but under a fixed parent ``channel`` instead of the request running now.

    ipyparallel's client files each data message under its parent's id; a fixed id keeps every engine's
    latest reading in one place on the client, whatever cell the engine runs meanwhile. The parent's
    session is the client's (taken from the request that started the feed): the client ignores any other.
    ``publish_data`` cannot be used as is from the poller thread: its parent is whatever request the engine
    handles at that moment.
    """
    from ipyparallel.serialize import serialize_object
    from jupyter_client.session import extract_header

    publisher = shell.data_pub
    session, socket = publisher.session, publisher.pub_socket
    parent = dict(extract_header(shell.get_parent()))
    parent["msg_id"] = channel

    def send(reading: EngineReading) -> None:
        data = {str(reading.engine_id): reading}
        buffers = serialize_object(data, buffer_threshold=session.buffer_threshold, item_threshold=session.item_threshold)
        session.send(socket, "data_message", content={"keys": list(data)}, parent=parent, buffers=buffers, ident=publisher.topic)

    return send


def feed_readings(client: Client, channel: str) -> Callable[[], dict[int, EngineReading]]:
    """Client side: the latest reading of each engine on ``channel``, read without waiting on any engine."""
    from .live import EngineReading

    def readings() -> dict[int, EngineReading]:
        metadata = client.metadata.get(channel)  # .get: the defaultdict must not grow an entry for nothing
        if metadata is None:
            return {}
        data = dict(metadata["data"])
        return {int(key): value for key, value in data.items() if isinstance(value, EngineReading)}

    return readings
