"""The magics stay thin enough to read: no module over 600 lines, no class over 300
(``tests/layout.py`` counts them)."""

from pathlib import Path

import jupyter_cudamem.magics
from tests.layout import too_long

MAGICS = Path(jupyter_cudamem.magics.__file__).parent


def test_no_module_in_magics_is_over_600_lines_nor_a_class_over_300():
    assert len(sorted(MAGICS.glob("**/*.py"))) > 10, f"no modules found in {MAGICS}"
    assert too_long(MAGICS) == []
