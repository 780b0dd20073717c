"""The whole package stays in rooms a reader can hold: no module over 600 lines, no class over 300
(``tests/layout.py`` counts them; its self-test in ``tests/attribution/test_attribution_layout.py`` breaks
both limits on purpose)."""

from pathlib import Path

import jupyter_cudamem
from tests.layout import too_long
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

PACKAGE = Path(jupyter_cudamem.__file__).parent


def test_no_module_of_the_package_is_over_600_lines_nor_a_class_over_300():
    assert len(sorted(PACKAGE.glob("**/*.py"))) > 100, f"no modules found in {PACKAGE}"
    assert too_long(PACKAGE) == []
