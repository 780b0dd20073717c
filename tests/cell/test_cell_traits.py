"""What a cell's code says about it, for the advice ``%oomfix`` gives (jupyter_cudamem/cell/traits.py)."""

import pytest

from jupyter_cudamem.cell.traits import cell_traits


@pytest.mark.parametrize(
    "source",
    [
        "logits = model(batch)",
        "out = self.encoder(tokens)",
        "y = net.forward(x)",
        "hidden = model[:3](features)",
        "images = pipe(prompt, num_inference_steps=20)",
    ],
)
def test_model_calls_are_recognised(source):
    assert cell_traits(source).calls_model


@pytest.mark.parametrize(
    "source",
    [
        "x = torch.randn(4096, 4096, device='cuda')",
        "train_step(1)",
        "scores = [w * x for w in weights]",
        "model = make_model().cuda()",
        "y = F.relu(x)",
    ],
)
def test_other_calls_are_not_model_calls(source):
    assert not cell_traits(source).calls_model


def test_training_cells_are_recognised():
    traits = cell_traits("loss = model(x).sum()\nloss.backward()\noptimizer.step()")
    assert traits.trains and traits.calls_model
