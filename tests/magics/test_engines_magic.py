"""``%cudamem_engines`` in a shell with no cluster: what it says without ipyparallel, without a client, and on bad
input; its every-%px-cell hook goes with the extension."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest
from IPython.core.error import UsageError

from jupyter_cudamem import magics
from jupyter_cudamem.engines import gather


def test_without_ipyparallel_it_says_how_to_get_it(shell, monkeypatch):
    monkeypatch.setattr(gather, "ipyparallel_missing", lambda: True)
    for line in ("", "-o", "on", "monitor", "--history"):
        with pytest.raises(UsageError, match=r"ipyparallel is not installed.*pip install '\.\[parallel\]' from the jupyter-cudamem clone"):
            shell.run_line_magic("cudamem_engines", line)


def test_loading_the_extension_does_not_import_ipyparallel():
    import subprocess

    code = (
        "from IPython.testing.globalipapp import start_ipython; import sys; ip = start_ipython(); "
        "ip.run_line_magic('load_ext', 'jupyter_cudamem'); print('ipyparallel' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr[-2000:]


def test_without_a_client_it_says_how_to_connect_one(shell, monkeypatch):
    pytest.importorskip("ipyparallel")
    registry = {name: magics for name, magics in shell.magics_manager.registry.items() if type(magics).__name__ != "ParallelMagics"}
    monkeypatch.setattr(shell.magics_manager, "registry", registry)
    with pytest.raises(UsageError, match=r"^no ipyparallel client in this kernel: connect one first"):
        shell.run_line_magic("cudamem_engines", "")


def test_a_closed_client_is_one_line(shell, monkeypatch):
    class ParallelMagics:  # what ipyparallel leaves registered after its client is closed
        suffix = ""

        class view:
            class client:
                _closed = True

    monkeypatch.setitem(shell.magics_manager.registry, "ParallelMagics", ParallelMagics())
    monkeypatch.setattr(gather, "ipyparallel_missing", lambda: False)
    with pytest.raises(UsageError, match=r"^the ipyparallel client behind %px is closed: connect one first"):
        shell.run_line_magic("cudamem_engines", "")


@pytest.mark.parametrize(
    "line, message",
    [
        ("--last 3", "--last goes with --history"),
        ("--history --last 0", "argument --last: takes a number of cells, a whole number from 1"),
        ("--targets x", "--targets takes engine ids such as 0,2 or 0-3; got 'x'"),
        ("--interval 2", "'show' takes --history, --last, --targets, --timeout, -o; --interval does not go with it"),
        ("monitor --history", "'monitor' takes --interval, --targets; --history does not go with it"),
        ("on --targets 1", "'on' takes no options; --targets does not go with it"),
        ("monitor --interval 0.01", "--interval takes seconds between readings from 0.05 to 3600; got 0.01"),
        ("monitor --interval 1e10", "--interval takes seconds between readings from 0.05 to 3600; got 1e+10"),
        ("monitor --interval inf", "--interval takes seconds between readings from 0.05 to 3600; got inf"),
        ("--timeout inf", "--timeout takes seconds to wait for the engines from 0.01 to 3600; got inf"),
        ("--timeout 1e308", "--timeout takes seconds to wait for the engines from 0.01 to 3600; got 1e+308"),
        ("--timeout nan", "--timeout takes seconds to wait for the engines from 0.01 to 3600; got nan"),
        ("--timeout 0", "--timeout takes seconds to wait for the engines from 0.01 to 3600; got 0"),
        ("--targets ²", "--targets takes engine ids such as 0,2 or 0-3; got '²'"),
        ("--targets 0-²", "--targets takes engine ids such as 0,2 or 0-3; got '0-²'"),
        ("--targets '0, 2' --interval 1", "--interval does not go with it"),  # quoted: one value, as a shell reads it
    ],
)
def test_bad_options_are_one_line(shell, monkeypatch, line, message):
    monkeypatch.setattr(gather, "ipyparallel_missing", lambda: False)

    class View:
        targets = "all"

        class client:
            ids = [0]
            _closed = False

    monkeypatch.setattr("jupyter_cudamem.magics.engines.px_view", lambda shell: View())
    with pytest.raises(UsageError, match=re.escape(message)):
        shell.run_line_magic("cudamem_engines", line)


def test_status_stop_and_unload(shell, monkeypatch, capsys):
    shell.run_line_magic("cudamem_engines", "status")
    assert "cudamem engines: the table after each %px cell is off" in capsys.readouterr().out
    shell.run_line_magic("cudamem_engines", "stop")
    assert "the engines monitor is not running" in capsys.readouterr().out  # an answer, not an error
    from jupyter_cudamem.magics.engines import CudaMemEngines

    engines = magics.loaded(shell).get(CudaMemEngines)
    stopped = []
    engines.live = SimpleNamespace(stop=lambda reason: stopped.append(reason), engines=[])  # a monitor running
    shell.run_line_magic("cudamem_engines", "stop")
    assert stopped and engines.live is None
    assert "the engines monitor stopped" in capsys.readouterr().out  # as %cudamem_monitor stop says it
    monkeypatch.setattr("jupyter_cudamem.magics.engines.px_view", lambda shell: object())
    shell.run_line_magic("cudamem_engines", "on")

    hook = magics.loaded(shell).get(CudaMemEngines)._after_cell
    assert hook in shell.events.callbacks["post_run_cell"]
    magics.unload(shell)
    assert hook not in shell.events.callbacks["post_run_cell"]
    assert "cudamem_engines" not in shell.magics_manager.magics["line"]


@pytest.mark.parametrize(
    "cell, gathered",
    [
        ("%%px\n%%cudamem\nstep()", True),
        ("%%px --targets 1\nstep()", True),
        ("%px step()", True),
        ("%%px --noblock\nstep()", False),  # the engines are still running it
        ("%%px -a\nstep()", False),
        ("%pxresult", False),
        ("%pxconfig --block", False),
        ("step()", False),
        ("x = '%px'", False),
    ],
)
def test_which_cells_the_table_follows(cell, gathered):
    from jupyter_cudamem.magics.engines import CudaMemEngines

    assert CudaMemEngines._is_px_cell(cell) is gathered
