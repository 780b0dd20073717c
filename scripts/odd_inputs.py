"""A sweep of odd inputs through every magic and setting of jupyter_cudamem, checked against a plain cell.

    python -m scripts.odd_inputs                 # an InteractiveShell in this process, this machine's hardware
    python -m scripts.odd_inputs --fake-gpu      # the same over tests/fakes.py's card (paths that need a GPU)
    python -m scripts.odd_inputs --kernel        # the same cells through a real ipykernel (jupyter_client)
    python -m scripts.odd_inputs --only oomfix   # cases whose name contains this (--skip: leave them out)

Run from the repository root. Each case is a cell. For each, it checks what a user sees and keeps:

1. no traceback frame from ``jupyter_cudamem`` in what the shell printed;
2. an error of ours is one line (IPython's ``UsageError``, a ``%config`` refusal);
3. the namespace is changed only as the same cell without the magic changes it;
4. a body's own error is the plain cell's (type and message), and the line form raises it again
   (``print('after')`` after it does not run).

It prints each failing case with what differed, then one line per distinct message of ours (to read whether
each says what to do), and exits 1 when a case failed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

OURS = re.compile(r"jupyter_cudamem[/\\][\w/\\]*\.py")
COLOUR = re.compile(r"\x1b\[[0-9;]*m")
NUMBERS = ((re.compile(r"(In|Out|Cell In) ?\[\d+\]"), r"\1[N]"), (re.compile(r"at 0x[0-9a-f]+"), "at 0x"),
           (re.compile(r"/tmp/ipykernel_\d+/\d+\.py"), "<cell>"), (re.compile(r"<ipython-input-\d+-\w+>"), "<cell>"),
           (re.compile(r"\(\d+\.py, line"), "(<cell>, line"))
# What our magics print about the cell beside the cell's own output (the report, the notes).
OUR_LINES = ("cudamem", "Not measured:", "Nothing measured:", "(the figures", "%%oomfix:", "NVML:", "Nothing left",
             "UsageError:")

# Option values: empty, signs, zero, huge, non-finite, non-ASCII digits, quotes, odd text.
VALUES = (
    "", "-1", "0", "-0", "1", "2", "0.5", "10**400", "1" + "0" * 400, "9" * 5000, "1e308", "1e400", "-1e400", "inf",
    "-inf", "nan", "NaN", "٣", "３", "²", "½", "1_0", "0x10", "1e10", "1e-400", "'2'", '"2"', "' 2 '", "''", '""', "'",
    '"', "ü", "é9", "--", "-", "=", ",", "0,1", "0,,1", "0-", "3-1", "0-99999999999", "cuda:0", "cuda:-1", "2GiB",
    "1e3GiB", "-2GiB", "0GiB", "0.0001B", "1.5.5", "9" * 400 + "GiB", "9" * 400 + ".5MiB", "1" + "0" * 30 + "TiB",
    "'a b'", "$x", "{x}", "{undefined_name}", "{", "$", "True", "None", "batch,batch", "cleanup,,batch", "ALL",
    " batch ", "'batch, autocast'", '"RTX 4090"', "T4,T4", "X", "\\", "a\\ b", "#", "%", "%%",
)
CONFIG_VALUES = (
    "''", "' '", "-1", "0", "-0.0", "1", "10**400", "-10**400", "1e308", "-1e308", "float('inf')", "float('nan')",
    "-float('inf')", "'٣'", "'３'", "'²'", "'\"1\"'", "\"'1'\"", "None", "True", "False", "[]", "{}", "'1 GiB'",
    "b'1'", "1j", "object()", "'9' * 400 + 'GiB'", "'inf'", "'nan'", "2**63", "2**31", "1e-300", "'ü'",
    "{'X': 1}", "{'X': 'inf'}", "{'X': '1e400GiB'}", "{'X': {}}", "{'X': None}", "{'ü': 2}", "{1: 2}",
    "{'X': [1]}", "{'X': {'memory': 2, 'ecc': 'x'}}", "{'X': {'memory': 2, 'extra': 1}}", "'cleanup'", "'batch,'",
    "', '", "'autocast,autocast'", "0.999999", "1 - 1e-17",
)
TRAITS = {
    "CudaMem": ("reset_peak", "auto_threshold", "process_memory", "trace_dir", "trace_max_entries", "history_size",
                "cards", "attribute_threshold", "breakdown", "verbose", "nvtx"),
    "CudaMemMonitor": ("interval_s", "history_s", "alert_fraction", "max_updates_per_s", "use_widgets"),
    "OomFix": ("max_tries", "strategies", "autocast", "confirm", "margin", "verbose"),
    "CudaMemPlan": ("margin", "calibrated_margin"),
    "CudaMemEngines": ("timeout_s", "history_cells", "interval_s"),
}
# After a setting, a cell that reads it: the setting must never make a later cell fail with a traceback.
FOLLOW_UP = {
    "CudaMem": ("%%cudamem\nok_ = 1", "%cudamem on", "ok_ = 2", "%cudamem status", "%cudamem off",
                "%%cudamem_plan\nbatch_size = 2\nok_ = 3", "%cudamem_history", "%cudamem -v ok_ = 4"),
    "CudaMemMonitor": ("%cudamem_monitor", "%cudamem_monitor stop", "%cudamem_monitor snapshot"),
    "OomFix": ("%%oomfix\nok_ = 1", "%oomfix --dry-run", "%%oomfix --dry-run\nok_ = 2"),
    "CudaMemPlan": ("%%cudamem_plan\nbatch_size = 4\nok_ = 1",),
    "CudaMemEngines": ("%cudamem_engines", "%cudamem_engines status"),
}

BODIES_EXTRA = (
    "await __import__('asyncio').sleep(0)", "x = await __import__('asyncio').sleep(0, result=3)\nx",
    "return 1", "yield 2", "  x = 1\n y = 2", "def f():\n  a = 1\n    b = 2", "raise KeyboardInterrupt",
    "raise SystemExit", "raise SystemExit(0)", "import sys; sys.exit('msg')", "raise IndentationError('i')",
    "raise MemoryError", "raise RecursionError", "def r(): return r()\nr()", "raise StopAsyncIteration",
    "import warnings; warnings.warn('w')", "raise Exception('multi\\nline')", "raise ValueError",
    "raise BaseExceptionGroup('g', [ValueError(1), KeyError(2)])", "raise ExceptionGroup('g', [ValueError(1)])",
    "class X(Exception):\n  def __str__(self): raise RuntimeError('no str')\nraise X()",
    "ñ = 1\nñ", "π = 3.14\nπ * 2", "变量 = 'ü'\n变量", "x\u200b = 1", "x = 1 # comment ü", "'\udcff'",
    "%cudamem_monitor", "%cudamem status", "%cudamem ok2_ = 5", "%%cudamem\nx = 1", "%oomfix --dry-run",
    "%cudamem_history", "%cudamem_engines status", "x = %cudamem 5\nx", "%time 1", "%config CudaMem.verbose",
    "get_ipython().run_line_magic('cudamem', '1/0')", "get_ipython().run_cell_magic('cudamem', '', '1/0')",
    "try:\n    get_ipython().run_line_magic('cudamem', '1/0')\nexcept ZeroDivisionError:\n    caught = 1\ncaught",
    "try:\n    get_ipython().run_cell_magic('cudamem', '-q', 'raise KeyError(3)')\nexcept KeyError:\n    caught = 2",
    "try:\n    get_ipython().run_cell_magic('oomfix', '', 'raise KeyError(3)')\nexcept KeyError:\n    caught = 3",
    "try:\n    get_ipython().run_cell_magic('cudamem_plan', '', '1/0')\nexcept ZeroDivisionError:\n    caught = 4",
    "get_ipython().run_line_magic('cudamem', '--bogus 1')", "get_ipython().run_cell_magic('cudamem', '--bogus', '1')",
    "get_ipython().run_line_magic('cudamem_monitor', 'bogus')", "get_ipython().run_cell_magic('cudamem_plan', '', '')",
)


@dataclass
class Case:
    name: str
    source: str
    plain: str | None = None  # the cell that should behave the same (None: ours; a one-line error or success)
    line_form: bool = False  # the body runs as `%cudamem STATEMENT`: its error is raised again
    then: tuple[str, ...] = ()  # cells run after it, each checked as ours


@dataclass
class Seen:
    success: bool
    error: str | None
    error_type: str | None
    output: str
    names: dict[str, str] = field(default_factory=dict)


def normalise(text: str) -> str:
    text = COLOUR.sub("", text)
    for pattern, replacement in NUMBERS:
        text = pattern.sub(replacement, text)
    return text


def user_output(text: str) -> str:
    """The cell's own output: our report and notes taken out, cell numbers and colours normalised."""
    lines = [line for line in normalise(text).splitlines() if not line.lstrip().startswith(OUR_LINES)]
    return "\n".join(lines).strip()


# -- the cases ------------------------------------------------------------------------------------------------
def option_cases(shell: Any) -> Iterator[Case]:
    """Every option of every magic of ours, with every odd value, `--opt V` and `--opt=V`; flags twice, alone,
    with a value; unknown flags; an option with its value missing."""
    from jupyter_cudamem.magics.cellrun import _ours

    for kind in ("line", "cell"):
        for name, magic in sorted(shell.magics_manager.magics[kind].items()):
            if not _ours(magic):
                continue
            prefix = "%" if kind == "line" else "%%"
            body = "ok_ = 1" if name == "cudamem" and kind == "line" else ""
            tail = ("\nok_ = 1\nbatch_size = 2" if kind == "cell" else (" " + body if body else ""))
            parser = magic.parser
            for action in parser._actions:
                for option in action.option_strings:
                    if option in ("-h", "--help"):
                        continue
                    if action.nargs == 0:
                        for extra in ("", f" {option}", " 1", " --", " =x"):
                            yield Case(f"{kind}:{name} flag {option}{extra}", f"{prefix}{name} {option}{extra}{tail}")
                        continue
                    yield Case(f"{kind}:{name} {option} (no value)", f"{prefix}{name} {option}{tail}")
                    for value in VALUES:
                        yield Case(f"{kind}:{name} {option} {value[:30]!r}", f"{prefix}{name} {option} {value}{tail}")
                        yield Case(f"{kind}:{name} {option}={value[:30]!r}", f"{prefix}{name} {option}={value}{tail}")
                    yield Case(f"{kind}:{name} {option} twice", f"{prefix}{name} {option} 1 {option} 2{tail}")
            positional = [a for a in parser._actions if not a.option_strings]
            for action in positional:
                for word in (*(action.choices or ()), "bogus", "STOP", "ｓｔｏｐ", "stop stop", "'stop'", "ñ", "-"):
                    yield Case(f"{kind}:{name} action {word!r}", f"{prefix}{name} {word}{tail}")
            for odd in ("--bogus", "-Z", "---", "--=", "-", "—q", "–q", "--quiet=1", "\t", "  ", "# comment", "ü",
                        "$undefined", "{undefined}", "{1/0}", "'unclosed", '"unclosed', "a'b"):
                yield Case(f"{kind}:{name} odd {odd!r}", f"{prefix}{name} {odd}{tail}")


def line_form_cases() -> Iterator[Case]:
    """`%cudamem STATEMENT` against the statement alone, and code after it in the cell."""
    from tests.plain.forms import FAILURES, LAST_LINES, STATEMENTS

    statements = [s for s in (*STATEMENTS, *LAST_LINES, *FAILURES, *BODIES_EXTRA) if s and "\n" not in s]
    for statement in dict.fromkeys(statements):
        for options in ("", "-q ", "-o -q ", "-v "):
            yield Case(f"line-form {options}{statement[:40]!r}", f"%cudamem {options}{statement}",
                       plain=statement, line_form=True)
        yield Case(f"line-form then print {statement[:40]!r}", f"%cudamem {statement}\nprint('after')",
                   plain=f"{statement}\nprint('after')", line_form=True)
    for statement in ("x = 1 -q", "x = 1 --quiet", "-x", "(-1)", "on = 3", "on", "off()", "status = 1",
                      "ñ = 1", "on; x = 1", "--", "-- x = 1", "x = 1 # -q", "'-q'", "x = -1", "x = {1}", "$x",
                      "{x}", "!echo hi", "%time 1", "?", "x?", "1; 2", "\\", "@x"):
        yield Case(f"line-form odd {statement!r}", f"%cudamem {statement}")


def body_cases(quick: bool) -> Iterator[Case]:
    """Every body form of tests/plain/forms.py (and more), under each cell magic, against the plain cell."""
    from tests.plain.forms import bodies

    found = bodies() + list(BODIES_EXTRA)
    if quick:
        found = found[::7] + list(BODIES_EXTRA)
    heads = ("%%cudamem", "%%cudamem -q", "%%oomfix", "%%oomfix --dry-run", "%%oomfix --yes", "%%cudamem_plan")
    for body in dict.fromkeys(found):
        for head in heads:
            yield Case(f"body {head} {body[:40]!r}", f"{head}\n{body}", plain=body)


def config_cases() -> Iterator[Case]:
    for owner, names in TRAITS.items():
        for trait in names:
            for value in CONFIG_VALUES:
                yield Case(f"config {owner}.{trait} = {value[:30]}", f"%config {owner}.{trait} = {value}",
                           then=FOLLOW_UP[owner])
        for line in (f"%config {owner}.unknown = 1", f"%config {owner}.", f"%config {owner}.margin =",
                     f"%config {owner}", f"%config {owner}.{names[0]} = (", f"%config {owner}.{names[0]}"):
            yield Case(f"config {line}", line)


def session_cases() -> Iterator[Case]:
    """What a session does around the magics: reloads, twice, after failures."""
    yield Case("oomfix when nothing failed", "%oomfix")
    yield Case("oomfix --dry-run when nothing failed", "%oomfix --dry-run")
    for error in ("1/0", "raise KeyError('k')", "raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')",
                  "batch_size = 64\nm.allocate(0, 500 * 1024**3)",  # the fake card's own OOM (--fake-gpu)
                  "raise MemoryError", "x = (", "%cudamem --bogus", "raise SystemExit", "raise KeyboardInterrupt"):
        for then in ("%oomfix", "%oomfix --dry-run", "%oomfix --yes", "%oomfix --del ok_ --yes", "%oomfix -o",
                     "%oomfix --apply --yes", "%oomfix --strategy batch --dry-run", "%oomfix --del ñ --dry-run",
                     "%oomfix --del __builtins__ --yes", "%oomfix --del get_ipython --dry-run",
                     "%oomfix --strategy '' --dry-run", "%oomfix --strategy ' , ' --dry-run"):
            yield Case(f"{then} after {error!r}", error, plain=error, then=(then,))
    for first, second in (("%cudamem_monitor", "%cudamem_monitor"), ("%cudamem_monitor stop", "%cudamem_monitor stop"),
                          ("%cudamem_monitor --interval 0.05", "%cudamem_monitor --interval 3600"),
                          ("%cudamem on", "%cudamem on"), ("%cudamem off", "%cudamem off"),
                          ("%cudamem_engines on", "%cudamem_engines off"), ("%cudamem_engines stop", "%cudamem_engines")):
        yield Case(f"twice {first} / {second}", first, then=(second,))
    reload = ("%unload_ext jupyter_cudamem", "%load_ext jupyter_cudamem")
    yield Case("unload then load", reload[0], then=(reload[1], "%%cudamem\nok_ = 1", "%cudamem status"))
    yield Case("monitor, unload, load", "%cudamem_monitor", then=(*reload, "%cudamem_monitor", "%cudamem_monitor stop"))
    yield Case("on, unload, cell, load", "%cudamem on", then=(reload[0], "ok_ = 1", reload[1], "%cudamem status",
                                                              "%cudamem off"))
    yield Case("unload twice", reload[0], then=(reload[0], reload[1], reload[1]))
    yield Case("reload_ext", "%reload_ext jupyter_cudamem", then=("%%cudamem\nok_ = 1",))
    yield Case("unload inside %%cudamem", "%%cudamem\n%unload_ext jupyter_cudamem\nok_ = 1", then=(reload[1],))
    yield Case("unload inside %%oomfix", "%%oomfix\n%unload_ext jupyter_cudamem\nok_ = 1", then=(reload[1],))
    yield Case("unload inside %%cudamem_plan", "%%cudamem_plan\n%unload_ext jupyter_cudamem\nbatch_size = 2",
               then=(reload[1],))
    yield Case("unload inside line form", "%cudamem get_ipython().run_line_magic('unload_ext', 'jupyter_cudamem')",
               then=(reload[1],))
    yield Case("history after clear", "%cudamem_history --clear", then=("%cudamem_history", "%cudamem_history --plot",
                                                                        "%cudamem_history -o", "%cudamem_history --all"))
    for line in ("--save /dev/null/x.csv", "--save ''", "--save x.txt", "--save .csv", "--save /", "--save ~",
                 "--plot --save x.csv", "--cells 0", "--cells -", "--cells 5-1", "--cells 1-99999999999999",
                 "--cells ٣", "--cells 1,,2", "--last 0", "--clear --all", "--save /tmp/odd_inputs_dir/"):
        yield Case(f"history {line}", "%%cudamem -q\nok_ = 1", then=(f"%cudamem_history {line}",))
    yield Case("monitor from python bad", "from jupyter_cudamem import monitor\nmonitor(interval_s=float('nan'))")
    yield Case("monitor from python action", "from jupyter_cudamem import monitor\nmonitor('bogus')")
    yield Case("monitor from python devices", "from jupyter_cudamem import monitor\nmonitor(devices='x')")
    yield Case("monitor from python devices list", "from jupyter_cudamem import monitor\nmonitor(devices=[-1])")
    yield Case("monitor from python history", "from jupyter_cudamem import monitor\nmonitor(history_s=10**400)")


def all_cases(only: str | None, skip: str | None, quick: bool, shell: Any) -> list[Case]:
    cases = [*option_cases(shell), *line_form_cases(), *body_cases(quick), *config_cases(), *session_cases()]
    return [case for case in cases if (only is None or only in case.name) and (skip is None or skip not in case.name)]


# -- running them -----------------------------------------------------------------------------------------------
class Runner:
    """Runs cells and reports what a user saw; ``InProcess`` and ``Kernel`` below."""

    def run(self, source: str) -> Seen:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class InProcess(Runner):
    def __init__(self, fake_gpu: bool):
        from IPython.testing.globalipapp import start_ipython

        self.shell = start_ipython()
        self.log = _Log()
        logging.getLogger().addHandler(self.log)
        self.shell.log.addHandler(self.log)
        self.fake_gpu = fake_gpu
        self._load()
        self.baseline = {k: v for k, v in self.shell.user_ns.items() if k not in ("_", "__", "___")}

    def _load(self) -> None:
        if self.fake_gpu:
            from jupyter_cudamem import magics
            from jupyter_cudamem.hardware import Hardware
            from tests.fakes import FakeAllocator, FakeMachine, FakeNvml

            machine = FakeMachine()
            self.shell.user_ns["m"] = machine
            magics.unload(self.shell)
            magics.load(self.shell, Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid,
                                             pid_exists=lambda pid: True))
        else:
            self.shell.run_cell("%load_ext jupyter_cudamem")

    def reset(self) -> None:
        from jupyter_cudamem import magics

        ns = self.shell.user_ns
        for name in [n for n in ns if n not in self.baseline]:
            del ns[name]
        ns.update(self.baseline)
        for name in ("_", "__", "___"):  # IPython sets these only where no cell bound one
            ns.pop(name, None)
        for name in ("last_exc", "last_value", "last_traceback", "last_type"):
            if hasattr(sys, name):
                delattr(sys, name)
        extension = magics.loaded(self.shell)
        if extension is None:
            self._load()
            extension = magics.loaded(self.shell)
        for instance in extension.magics:  # settings back to their defaults
            for name, trait in instance.traits(config=True).items():
                default = trait.default()
                if getattr(instance, name) != default:
                    instance.set_trait(name, default)
        for name in list(self.shell.config):
            if name.startswith(("CudaMem", "OomFix")):
                del self.shell.config[name]

    def run(self, source: str) -> Seen:
        out, err = io.StringIO(), io.StringIO()
        self.log.lines.clear()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result = self.shell.run_cell(source, store_history=True)
        error = result.error_before_exec if result.error_before_exec is not None else result.error_in_exec
        text = out.getvalue() + err.getvalue() + "".join(f"\n[log] {line}" for line in self.log.lines)
        return Seen(result.success, None if error is None else str(error),
                    None if error is None else type(error).__name__, text, self.names())

    def names(self) -> dict[str, str]:
        ns = self.shell.user_ns
        shown = {}
        for name, value in ns.items():
            if name.startswith("_") and name != "_" or name in ("In", "Out", "exit", "quit", "get_ipython"):
                continue
            if name in self.baseline and self.baseline[name] is value:
                continue
            try:
                shown[name] = re.sub(r" at 0x[0-9a-f]+", "", repr(value))[:200]
            except Exception as error:  # noqa: BLE001 - a repr that fails
                shown[name] = f"<repr failed: {type(error).__name__}>"
        return shown


class Kernel(Runner):
    """A real ipykernel through jupyter_client, run from this checkout."""

    def __init__(self, fake_gpu: bool):
        import os

        from jupyter_client import KernelManager

        env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=os.getcwd(), env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        setup = "%load_ext jupyter_cudamem"
        if fake_gpu:
            setup = ("from jupyter_cudamem import magics; from jupyter_cudamem.hardware import Hardware\n"
                     "from tests.fakes import FakeAllocator, FakeMachine, FakeNvml\nm = FakeMachine()\n"
                     "magics.unload(get_ipython()); magics.load(get_ipython(), Hardware(allocator=FakeAllocator(m), "
                     "nvml=FakeNvml(m), pid=m.pid, pid_exists=lambda pid: True))")
        self.setup = setup
        seen = self.run(setup + "\nimport jupyter_cudamem; print(jupyter_cudamem.__file__)")
        assert seen.success and os.getcwd() in seen.output, seen
        self.run("_baseline_names = set(globals())")

    def reset(self) -> None:
        self.run("for _n in set(globals()) - _baseline_names - {'_n'}:\n    del globals()[_n]\n"
                 "from jupyter_cudamem import magics as _m\n"
                 "if _m.loaded(get_ipython()) is None:\n    get_ipython().run_cell(" + repr(self.setup) + ")\n"
                 "for _i in _m.loaded(get_ipython()).magics:\n"
                 "    for _k, _t in _i.traits(config=True).items():\n"
                 "        if getattr(_i, _k) != _t.default(): _i.set_trait(_k, _t.default())")

    def run(self, source: str, timeout: float = 120) -> Seen:
        msg_id = self.client.execute(source, store_history=True)
        output: list[str] = []
        error: dict[str, Any] | None = None
        deadline = time.monotonic() + timeout
        while True:
            message = self.client.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.1))
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                output.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                output.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                error = content
                output.append("\n".join(content["traceback"]) + "\n")
            elif kind == "status" and content["execution_state"] == "idle":
                break
        reply = self.client.get_shell_msg(timeout=timeout)
        success = reply["content"]["status"] == "ok" and error is None
        if error is None and reply["content"]["status"] == "error":
            error = reply["content"]
        return Seen(success, None if error is None else error.get("evalue"),
                    None if error is None else error.get("ename"), "".join(output))

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


# -- the checks ----------------------------------------------------------------------------------------------
def check(runner: Runner, case: Case, messages: dict[str, str]) -> list[str]:
    problems: list[str] = []
    plain = None
    if case.plain is not None:
        runner.reset()
        plain = runner.run(case.plain)
    runner.reset()
    seen = runner.run(case.source)
    problems += _ours_checked(seen, case.source, messages, body_failed=plain is not None and not plain.success)
    if plain is not None:
        problems += _same_as_plain(plain, seen, case)
    for cell in case.then:
        after = runner.run(cell)
        problems += [f"then {cell!r}: {p}" for p in _ours_checked(after, cell, messages, body_failed=False)]
    return problems


def _ours_checked(seen: Seen, source: str, messages: dict[str, str], body_failed: bool) -> list[str]:
    problems = []
    frames = OURS.findall(normalise(seen.output))
    if set(frames) == {"jupyter_cudamem/magics/base.py"} and "raise carried.error" in seen.output:
        frames = []  # README: a SyntaxError (or exception group) the line form raises shows the magic's one frame
    if frames:
        problems.append(f"traceback frames of ours shown: {sorted(set(frames))}: {_tail(seen.output)}")
    if seen.error_type == "UsageError":
        if "\n" in (seen.error or "").strip():
            problems.append(f"UsageError of more than one line: {seen.error!r}")
        messages.setdefault(_message_key(seen.error or ""), source)
    elif seen.error_type is not None and not body_failed and seen.error_type not in _USERS_OWN:
        problems.append(f"failed with {seen.error_type}: {seen.error!r}: {_tail(seen.output)}")
    for line in normalise(seen.output).splitlines():
        if line.startswith("[log] "):
            if "\n" in line.strip():
                problems.append(f"log of more than one line: {line!r}")
            messages.setdefault(_message_key(line[6:]), source)
        if line.startswith("cudamem: "):
            messages.setdefault(_message_key(line), source)
    if "Traceback (most recent call last)" in seen.output and not body_failed and seen.error_type is None:
        problems.append(f"a traceback was printed in a cell that succeeded: {_tail(seen.output)}")
    return problems


# Errors a cell of ours may end with that are the user's (a statement's own, in a case with no plain twin).
_USERS_OWN = {"NameError", "SyntaxError", "ZeroDivisionError", "KeyError", "RuntimeError", "ValueError", "TypeError",
              "MemoryError", "SystemExit", "KeyboardInterrupt", "IndentationError", "AttributeError", "TabError"}


# Differences from a plain cell that are meant: IPython refuses an empty cell magic body before any magic runs;
# %%cudamem_plan answers in one line where the cell used no GPU memory (README, "no plan can be made").
INTENDED = ("cell body is empty", "nothing to plan")


def _same_as_plain(plain: Seen, seen: Seen, case: Case) -> list[str]:
    problems: list[str] = []
    if seen.error_type == "UsageError" and any(part in (seen.error or "") for part in INTENDED):
        return problems
    if plain.success != seen.success:
        problems.append(f"success: plain {plain.success} != magic {seen.success} ({seen.error_type}: {seen.error!r})")
    after = "print('after')" in case.source  # the plain twin has one more line: its message may name line 2
    if (plain.error_type, "" if after else normalise(plain.error or "")) != (
            seen.error_type, "" if after else normalise(seen.error or "")) and not (
            plain.error_type is None and seen.error_type is None):
        problems.append(f"error: plain {plain.error_type}: {plain.error!r} != magic {seen.error_type}: {seen.error!r}")
    if plain.names != seen.names:
        differ = {k: (plain.names.get(k), seen.names.get(k)) for k in set(plain.names) | set(seen.names)
                  if plain.names.get(k) != seen.names.get(k)}
        if not (case.line_form and set(differ) <= {"_"}):  # the line form shows no Out of its own
            problems.append(f"names differ (plain, magic): {differ}")
    printed = re.compile(r"^after$", re.MULTILINE)
    if after and bool(printed.search(seen.output)) != bool(printed.search(plain.output)):
        problems.append("code after the line form ran where the plain cell's did not (or the reverse)")
    return problems


def _message_key(text: str) -> str:
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text))[:160]


def _tail(text: str) -> str:
    return normalise(text).strip()[-600:].replace("\n", "\n      ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake-gpu", action="store_true", help="run over tests/fakes.py's card")
    parser.add_argument("--kernel", action="store_true", help="run the cells through a real ipykernel")
    parser.add_argument("--only", help="only the cases whose name contains this")
    parser.add_argument("--skip", help="leave out the cases whose name contains this")
    parser.add_argument("--quick", action="store_true", help="a seventh of the body forms")
    parser.add_argument("--messages", action="store_true", help="print each distinct message of ours")
    args = parser.parse_args(argv)
    local = InProcess(args.fake_gpu)
    cases = all_cases(args.only, args.skip, args.quick, local.shell)
    runner: Runner = Kernel(args.fake_gpu) if args.kernel else local
    threads_before = {t.ident for t in threading.enumerate()}
    failed, messages = 0, {}
    started = time.monotonic()
    for number, case in enumerate(cases, 1):
        try:
            problems = check(runner, case, messages)
        except Exception as error:  # noqa: BLE001 - the harness's own trouble: say which case
            problems = [f"harness: {type(error).__name__}: {error}"]
        if problems:
            failed += 1
            print(f"FAIL {case.name}\n  cell: {case.source[:300]!r}")
            for problem in problems:
                print(f"    - {problem}")
        if number % 500 == 0:
            print(f"... {number}/{len(cases)} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    if isinstance(runner, InProcess):
        runner.run("%unload_ext jupyter_cudamem")
        left = [t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
        if left:
            failed += 1
            print(f"FAIL threads left after %unload_ext: {left}")
    if isinstance(runner, Kernel):
        runner.close()
    if args.messages:
        print("\nmessages of ours (one per distinct text):")
        for message, source in sorted(messages.items()):
            print(f"  {message}\n      from {source[:100]!r}")
    print(f"{len(cases)} cases, {failed} failed, {time.monotonic() - started:.0f} s"
          f" ({'kernel' if args.kernel else 'InteractiveShell'}, {'fake GPU' if args.fake_gpu else 'this machine'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
