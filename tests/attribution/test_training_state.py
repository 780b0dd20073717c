"""What a training step holds whatever its batch, read from the namespace (attribution/training_state.py)."""

import torch

from jupyter_cudamem.attribution.probe import TensorProbe
from jupyter_cudamem.attribution.training_state import fixed_memory

CPU = TensorProbe((torch.Tensor,), (torch.nn.Module,), (torch.optim.Optimizer,), on_device=lambda t: True)


def test_a_fresh_adamw_will_make_two_tensors_per_parameter_and_a_model_built_in_the_cell_counts_its_weights():
    model = torch.nn.Linear(100, 10)  # 1000 + 10 float32: 4,040 bytes
    optimizer = torch.optim.AdamW(model.parameters())
    fixed = fixed_memory({"model": model, "optimizer": optimizer}, rebuilt={"model", "optimizer"}, probe=CPU)
    assert fixed is not None
    assert fixed.parameters_bytes == 4040
    assert fixed.gradients_bytes == 4040
    assert fixed.optimizer_state_bytes == 2 * 4040
    assert fixed.tensor_bytes >= {4000, 40}
    assert fixed.is_parameter_sized(4000) and not fixed.is_parameter_sized(4 * 4000)
    assert sorted(fixed.gradient_sizes) == [40, 4000] and sorted(fixed.built_sizes) == [40, 4000]
    assert sorted(fixed.state_sizes) == [40, 40, 4000, 4000] and fixed.trains


def test_after_a_step_nothing_is_left_to_create_and_a_model_from_an_earlier_cell_is_below_the_reference():
    model = torch.nn.Linear(100, 10)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 100)).sum().backward()
    optimizer.step()
    fixed = fixed_memory({"model": model, "opt": optimizer}, rebuilt=set(), probe=CPU)
    assert fixed is not None
    assert (fixed.parameters_bytes, fixed.gradients_bytes, fixed.optimizer_state_bytes) == (0, 0, 0)


def test_sgd_with_momentum_makes_one_tensor_and_inference_makes_none():
    model = torch.nn.Linear(10, 10)  # 110 float32: 440 bytes
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert fixed_memory({"m": model, "o": sgd}, set(), CPU).optimizer_state_bytes == 440
    inference = fixed_memory({"m": model, "o": sgd}, set(), CPU, trains=False)
    assert (inference.gradients_bytes, inference.optimizer_state_bytes) == (0, 0)
    assert not inference.trains and inference.gradient_sizes == () and inference.state_sizes == ()


def test_models_in_a_dict_are_found_and_shared_parameters_count_once():
    encoder = torch.nn.Linear(10, 10)
    model = torch.nn.Sequential(encoder, torch.nn.ReLU())
    fixed = fixed_memory({"models": {"encoder": encoder, "full": model}}, rebuilt={"models"}, probe=CPU)
    assert fixed.parameters_bytes == 440 and fixed.gradients_bytes == 440


def test_nothing_on_the_device_is_no_reading():
    model = torch.nn.Linear(10, 10)
    assert fixed_memory({"m": model}, set(), TensorProbe((torch.Tensor,), (torch.nn.Module,), ())) is None
    assert fixed_memory({"x": 1}, set(), CPU) is None
    assert fixed_memory({"m": model}, set(), None) is None


def test_a_model_and_optimizer_the_cell_builds_again_count_their_gradients_and_state_whatever_the_failed_run_left():
    # The failed run built both and took a step before it ran out (a loop's second step): its model holds
    # gradients and its AdamW state. The rerun builds new ones, which start with neither.
    model = torch.nn.Linear(100, 10)  # 4,040 bytes
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 100)).sum().backward()
    optimizer.step()
    model(torch.randn(3, 100)).sum().backward()
    built_again = fixed_memory({"model": model, "optimizer": optimizer}, rebuilt={"model", "optimizer"}, probe=CPU)
    assert (built_again.parameters_bytes, built_again.gradients_bytes, built_again.optimizer_state_bytes) == (
        4040, 4040, 2 * 4040)
    # Only the optimizer built again: the model from an earlier cell keeps the gradients it holds.
    optimizer_again = fixed_memory({"model": model, "optimizer": optimizer}, rebuilt={"optimizer"}, probe=CPU)
    assert (optimizer_again.gradients_bytes, optimizer_again.optimizer_state_bytes) == (0, 2 * 4040)


def test_a_model_the_cell_never_reads_makes_no_gradients():
    # Notebook 00: a model of 64 MiB of parameters trained, and a list of layers beside it the cell never
    # touches. Only the model's parameters are read, so only their gradients are counted.
    torch.manual_seed(0)
    model, layers = torch.nn.Linear(10, 10), [torch.nn.Linear(100, 100)]  # 440 and 40,400 bytes
    optimizer = torch.optim.SGD(layers[0].parameters(), momentum=0.9)  # steps the layers: never read either
    namespace = {"model": model, "layers": layers, "optimizer": optimizer}
    everything = fixed_memory(namespace, set(), CPU)
    assert everything.gradients_bytes == 440 + 40_400 and everything.optimizer_state_bytes == 40_400
    read = {id(p) for p in model.parameters()}
    fixed = fixed_memory(namespace, set(), CPU, read=read)
    assert fixed.gradients_bytes == 440 and fixed.optimizer_state_bytes == 0


def test_parameters_in_one_flat_storage_make_its_size_a_parameters_and_a_trained_gradients():
    # As cuDNN's LSTM on the GPU: every weight a view of one flat buffer, and its backward pass makes the
    # gradients as one flat buffer too. The buffer's size is a request that does not grow with the batch.
    flat = torch.zeros(1000 + 200)  # 4,800 bytes
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(flat[:1000])
    module.bias = torch.nn.Parameter(flat[1000:])
    optimizer = torch.optim.Adam(module.parameters())
    fixed = fixed_memory({"rnn": module, "opt": optimizer}, rebuilt=set(), probe=CPU)
    assert fixed.is_parameter_sized(4800) and fixed.is_parameter_sized(4000)
    assert sorted(fixed.trainable_sizes) == [800, 4000, 4800]
    assert fixed.gradients_bytes == 4800 and sorted(fixed.gradient_sizes) == [800, 4000]  # counted once
    separate = fixed_memory({"m": torch.nn.Linear(100, 10)}, rebuilt=set(), probe=CPU)
    assert sorted(separate.trainable_sizes) == [40, 4000]  # separate storages add nothing
