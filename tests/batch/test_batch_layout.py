"""The batch package stays in rooms a reader can hold: no module over 600 lines, no class over 300
(``tests/layout.py`` counts them)."""

from pathlib import Path

import jupyter_cudamem.batch
from tests.layout import too_long

BATCH = Path(jupyter_cudamem.batch.__file__).parent


def test_no_module_in_batch_is_over_600_lines_nor_a_class_over_300():
    assert len(sorted(BATCH.glob("**/*.py"))) > 5, f"no modules found in {BATCH}"
    assert too_long(BATCH) == []
