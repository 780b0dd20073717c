"""The monitor package stays in rooms a reader can hold: no module over 600 lines, no class over 300
(``tests/layout.py`` counts them)."""

from pathlib import Path

import jupyter_cudamem.monitor
from tests.layout import too_long

MONITOR = Path(jupyter_cudamem.monitor.__file__).parent


def test_no_module_in_monitor_is_over_600_lines_nor_a_class_over_300():
    assert len(sorted(MONITOR.glob("**/*.py"))) > 5, f"no modules found in {MONITOR}"
    assert too_long(MONITOR) == []
