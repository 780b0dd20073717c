"""A Jupyter frontend on loopback and headless Chromium for the browser test, started and always stopped.

The frontends are JupyterLab and Notebook 7 (``jupyter notebook``, what users of the classic interface
get now). Notebook 7 is built from JupyterLab's components, so one server setup, one way of driving a
notebook and one set of selectors serve both; what differs is in :class:`Frontend`.

The browser is the system's Chromium (Debian's ``chromium`` package), driven by Playwright's Python
API through ``executable_path``: ``playwright install`` (which downloads a browser) is never needed.
Everything the server or the kernel would read from the user's home (Jupyter and IPython config,
JupyterLab settings and workspaces, kernel specs) is pointed into a temporary directory, so the test
neither depends on nor changes the machine it runs on.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = Path(__file__).resolve().parent / "screenshots"

# Chromium in a closed network: without the background-networking flags its own connections (updates,
# field trials, sync) are refused and slow everything down. Playwright adds --headless and an empty
# temporary --user-data-dir itself.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# User settings for the test, read by both frontends (Notebook 7 runs JupyterLab's plugins): no news or
# update checks (they would reach the network and pop up a toast over the screenshots), and every cell
# attached to the page so locators find them.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}

SERVER_START_TIMEOUT_S = 90
SERVER_STOP_TIMEOUT_S = 20


CHROMIUM_MISSING = "chromium (Debian: apt-get install chromium; or set CHROMIUM=/path/to/chromium)"


def find_chromium() -> str | None:
    """``$CHROMIUM`` if set, else the first Chromium on PATH."""
    configured = os.environ.get("CHROMIUM")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Frontend(enum.Enum):
    """A web frontend of jupyter_server: the module that starts it, its app's config class, where a notebook
    opens, and the name its page's application gives itself (``window.jupyterapp.name``)."""

    LAB = ("jupyterlab", "LabApp", "lab/tree", "JupyterLab")
    NOTEBOOK = ("notebook", "JupyterNotebookApp", "notebooks", "Jupyter Notebook")

    def __init__(self, module: str, app: str, notebooks: str, app_name: str) -> None:
        self.module = module
        self.app = app
        self.notebooks = notebooks
        self.app_name = app_name


def missing_tools(frontend: Frontend) -> str | None:
    """Why the browser test cannot run ``frontend`` here, or ``None`` when it can."""
    missing = []
    if find_chromium() is None:
        missing.append(CHROMIUM_MISSING)
    modules = [name for name in ("playwright", frontend.module, "ipywidgets") if importlib.util.find_spec(name) is None]
    if modules:
        missing.append(" and ".join(modules) + " (`make test-browser` installs them: pip install -e '.[browser]')")
    return "browser test needs " + "; ".join(missing) if missing else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class JupyterServer:
    """``frontend``'s server on 127.0.0.1 with a random token, rooted in ``workdir / "root"``."""

    def __init__(self, workdir: Path, frontend: Frontend):
        self.workdir = workdir
        self.frontend = frontend
        self.root = workdir / "root"
        self.log_path = workdir / f"{frontend.module}.log"
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.kernel_pids: list[int] = []  # every kernel the test started; none may outlive the server
        self._log: Any = None

    # -- lifecycle ----------------------------------------------------------------------------
    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        private = {
            "JUPYTER_CONFIG_DIR": "jupyter-config",
            "JUPYTER_DATA_DIR": "jupyter-data",
            "JUPYTER_RUNTIME_DIR": "jupyter-runtime",
            "JUPYTERLAB_SETTINGS_DIR": "lab-settings",
            "JUPYTERLAB_WORKSPACES_DIR": "lab-workspaces",
            "IPYTHONDIR": "ipython",
        }
        for variable, name in private.items():
            path = self.workdir / name
            path.mkdir(parents=True, exist_ok=True)
            env[variable] = str(path)
        for relative, values in LAB_SETTINGS.items():
            settings = self.workdir / "lab-settings" / relative
            settings.parent.mkdir(parents=True, exist_ok=True)
            settings.write_text(json.dumps(values))
        env.pop("JUPYTER_TOKEN", None)
        return env

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            self.frontend.module,
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            # window.jupyterapp, so the test runs cells through the same commands as the Run menu.
            f"--{self.frontend.app}.expose_app_in_browser=True",
            # Nothing that reaches the network or is not needed: no PyPI extension manager (JupyterLab's
            # server extension is loaded under Notebook 7 too), no terminals.
            "--LabApp.extension_manager=readonly",
            "--ServerApp.terminals_enabled=False",
        ]
        if os.geteuid() == 0:  # CI containers run as root; the server refuses that unless told
            command.append("--allow-root")
        self._log = open(self.log_path, "wb")
        # Its own process group, so stop() can end the server and anything it forked without
        # touching other processes. (Kernels get their own sessions; the server shuts them down.)
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=self._environment(), start_new_session=True
        )
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.frontend.module} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.25)
        raise RuntimeError(
            f"{self.frontend.module} did not answer within {SERVER_START_TIMEOUT_S} s:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Ask the server to shut down (it stops its kernels), then make sure it is gone."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(Exception):
                self.api("POST", "/api/shutdown")
            try:
                process.wait(timeout=SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=5)
        if self._log is not None:
            self._log.close()
        self.process = None

    def __enter__(self) -> JupyterServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- helpers ------------------------------------------------------------------------------
    def api(self, method: str, path: str) -> Any:
        request = urllib.request.Request(
            self.base_url + path, method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            body = response.read()
        return json.loads(body) if body else None

    def url(self, notebook: str) -> str:
        """Where ``notebook`` opens alone: JupyterLab from an empty workspace (?reset), not with the tabs an
        earlier test left open; Notebook 7 opens one notebook a page anyway."""
        reset = "reset&" if self.frontend is Frontend.LAB else ""
        return f"{self.base_url}/{self.frontend.notebooks}/{notebook}?{reset}token={self.token}"

    def stop_kernels(self) -> None:
        """Shut down every kernel session (what closing a notebook and its kernel does)."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")

    def log_tail(self, lines: int = 40) -> str:
        if self._log is not None:
            self._log.flush()
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])


def end_process(pid: int, timeout_s: float = 10.0) -> bool:
    """Wait for ``pid`` to exit, killing it if it outlives ``timeout_s``; ``True`` if it had to be killed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True


@contextlib.contextmanager
def chromium_browser() -> Iterator[Any]:
    """Headless system Chromium through Playwright, closed on exit."""
    from playwright.sync_api import sync_playwright

    executable = find_chromium()
    assert executable is not None, "browser test needs " + CHROMIUM_MISSING
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


# -- driving a notebook (the same application API in both frontends) ----------------------------------------------------------
# Each snippet finds the notebook by its path, never "the current widget", which may be another tab.
_FIND_PANEL = """const panel = Array.from(window.jupyterapp ? window.jupyterapp.shell.widgets('main') : [])
  .find(widget => widget.context && widget.context.path === path && widget.content && widget.sessionContext);"""

_KERNEL_IDLE = f"""path => {{
  {_FIND_PANEL}
  const context = panel && panel.sessionContext;
  const kernel = context && context.session && context.session.kernel;
  return Boolean(context && context.isReady && kernel && kernel.status === 'idle');
}}"""

_RUN_ALL = f"""path => {{
  {_FIND_PANEL}
  window.jupyterapp.shell.activateById(panel.id);
  window.jupyterapp.commands.execute('notebook:run-all-cells');
}}"""

_ALL_EXECUTED = f"""path => {{
  {_FIND_PANEL}
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const cells = panel.content.widgets.filter(cell => cell.model.type === 'code');
  return cells.every(cell => cell.model.executionCount !== null) && Boolean(kernel) && kernel.status === 'idle';
}}"""


def open_notebook(page: Any, server: JupyterServer, name: str, timeout_s: float = 90) -> None:
    """Open ``name`` alone in the server's frontend and wait until its kernel is started and idle."""
    page.goto(server.url(name), timeout=timeout_s * 1000)
    page.wait_for_function(_KERNEL_IDLE, arg=name, timeout=timeout_s * 1000, polling=200)
    # The frontend asked for, not another one the server redirected to.
    app_name = page.evaluate("() => window.jupyterapp.name")
    assert app_name == server.frontend.app_name, f"{page.url} opened {app_name!r}, not {server.frontend.app_name!r}"


def run_all_cells(page: Any, name: str, timeout_s: float = 90) -> None:
    """Run every cell as Run > Run All Cells does; wait until each has run and the kernel is idle."""
    page.evaluate(_RUN_ALL, name)
    page.wait_for_function(_ALL_EXECUTED, arg=name, timeout=timeout_s * 1000, polling=200)


def code_cell(page: Any, index: int) -> Any:
    """The ``index``-th code cell of the open notebook (input and output)."""
    return page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-CodeCell").nth(index)


def screenshot(target: Any, name: str) -> Path:
    """Save a screenshot of a page or element to ``tests/browser/screenshots/NAME.png``."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    target.screenshot(path=str(path))
    return path


def publish(paths: list[Path]) -> None:
    """Copy screenshots into ``$CUDAMEM_DOCS_IMAGES`` (``make docs-images`` sets it to docs/images)."""
    destination = os.environ.get("CUDAMEM_DOCS_IMAGES")
    if not destination:
        return
    folder = Path(destination)
    if not folder.is_absolute():
        folder = REPO / folder
    folder.mkdir(parents=True, exist_ok=True)
    for path in paths:
        shutil.copyfile(path, folder / path.name)
