import pytest

from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.units import format_bytes, format_seconds, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 1024**3),
        ("24 GiB", 24 * 1024**3),
        ("1.5gib", int(1.5 * 1024**3)),
        ("512MiB", 512 * 1024**2),
        ("24GB", 24 * 10**9),
        ("4096", 4096),
        (2048, 2048),
        ("1TiB", 1024**4),
        ("100k", 100_000),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "", "GiB", "12 parsecs", "-1GiB", "0", True])
def test_parse_size_rejects_with_a_hint(text):
    with pytest.raises(CudaMemError) as error:
        parse_size(text)
    message = str(error.value)
    assert "\n" not in message
    assert "GiB" in message or "positive" in message


@pytest.mark.parametrize(
    ("size", "signed", "expected"),
    [
        (0, False, "0 B"),
        (1023, False, "1023 B"),
        (1024, False, "1.00 KiB"),
        (1536 * 1024**2, False, "1.50 GiB"),
        (-2 * 1024**3, True, "-2.00 GiB"),
        (3 * 1024**2, True, "+3.00 MiB"),
        (5 * 1024**4, False, "5.00 TiB"),
        (None, False, "n/a"),
    ],
)
def test_format_bytes(size, signed, expected):
    assert format_bytes(size, signed=signed) == expected


def test_format_seconds():
    assert format_seconds(0.25) == "250 ms"
    assert format_seconds(3.214) == "3.21 s"
    assert format_seconds(125) == "2 min 5 s"
