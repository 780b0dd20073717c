"""The breakdown's renderings: text lines, the HTML table with its figure."""

from __future__ import annotations

from jupyter_cudamem.breakdown import Category, Phase, TrackedPeak, breakdown_at_peak
from jupyter_cudamem.report.breakdown import breakdown_figure, breakdown_html, breakdown_lines

MiB = 1024**2


def sample():
    held = {
        (Category.PARAMETERS, "model.encoder"): 100 * MiB,
        (Category.OPTIMIZER_STATE, "model.encoder"): 200 * MiB,
        (Category.GRADIENTS, "model.encoder"): 100 * MiB,
        (Category.TEMPORARIES, ""): 50 * MiB,
        (Category.ACTIVATIONS, "model.<head>"): 30 * MiB,
    }
    return breakdown_at_peak(500 * MiB, TrackedPeak("cuda:0", held, Phase.OPTIMIZER_STEP))


def test_text_names_phase_categories_modules_and_the_advice_for_the_largest():
    text = "\n".join(breakdown_lines(sample()))
    assert "where the peak went: 500.00 MiB on cuda:0, reached in the optimizer step" in text
    assert "optimizer state 40%" in text  # 200 of 500
    assert "model.encoder" in text and "400.00 MiB" in text
    # optimizer state is the largest: a bf16 state halves it; in the step, fused saves its 50 MiB of copies
    assert "a lower-precision optimizer" in text and "saves about 100.00 MiB" in text
    assert "fused=True" in text and "saves up to 50.00 MiB" in text
    assert "other" in text and "20.00 MiB" in text  # 500 - 480 not seen by the tracker


def test_html_escapes_module_names_and_embeds_the_figure():
    page = breakdown_html(sample())
    assert "model.&lt;head&gt;" in page and "model.<head>" not in page
    assert 'src="data:image/png;base64,' in page
    assert "<th>optimizer state</th>" in page


def test_figure_has_a_bar_for_the_peak_and_each_module():
    figure = breakdown_figure(sample())
    [axes] = figure.axes
    labels = [tick.get_text() for tick in axes.get_yticklabels()]
    assert sorted(labels) == sorted(["whole peak", "model.encoder", "model.<head>", "other"])
    assert len(axes.patches) == 4 * 6  # one segment per row and category, zero-wide where it holds nothing
