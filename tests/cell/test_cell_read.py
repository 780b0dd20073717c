"""A cell read once (jupyter_cudamem/cell/read.py): the names it binds before reading them, the names it
reads, its traits, and what a rerun binds again."""

from jupyter_cudamem.cell.read import read_cell
from jupyter_cudamem.cell.source import default_transform


def test_names_bound_before_they_are_read():
    source = (
        "x = torch.randn(batch_size, 256, device='cuda')\n"
        "h = h.detach()\n"  # read first: its old value is needed
        "out, hidden = model(x, h)\n"
        "loss = out.sum()\n"
        "loss.backward()\n"
        "total += loss.item()\n"  # augmented: read first
        "for step in range(2):\n    y = step\n"
    )
    assert list(read_cell(source).rebinds) == ["x", "out", "hidden", "loss", "step", "y"]
    wrapped = "with torch.autocast('cuda', dtype=torch.bfloat16):\n    x = make(8)\n    y = model(x)\n"
    assert list(read_cell(wrapped).rebinds) == ["x", "y"]
    assert list(read_cell("x = x.cuda()\n").rebinds) == []
    assert list(read_cell("def f(:\n").rebinds) == []


def test_names_bound_in_a_loop_are_listed_unless_read_after_it():
    training_loop = (
        "for step in range(2):\n"
        "    tokens = torch.randint(0, 10000, (bs, 129), device=dev)\n"
        "    logits = lm(tokens[:, :-1])\n"
        "    loss = loss_fn(logits, tokens)\n"
        "    loss.backward()\n"
    )
    assert list(read_cell(training_loop).rebinds) == ["step", "tokens", "logits", "loss"]
    # Read after the loop: if the loop ran no step, the old value is what is read, so it stays bound.
    assert list(read_cell(training_loop + "print(loss.item())\n").rebinds) == ["step", "tokens", "logits"]
    # Read in the loop before this iteration binds it: the previous value is needed.
    assert list(read_cell("for i in range(3):\n    if i:\n        use(prev)\n    prev = f(i)\n").rebinds) == ["i"]
    # A branch and a try are walked in order too.
    assert list(read_cell("if big:\n    out = model(x)\nelse:\n    out = None\n").rebinds) == ["out"]
    assert list(read_cell("try:\n    y = g(x)\nexcept E:\n    y = None\nz = y\n").rebinds) == ["z"]
    # A function's body binds nothing at the top level, and what it reads is read.
    assert list(read_cell("for i in r:\n    def f():\n        return w\n    w = 1\n").rebinds) == ["i"]




def test_names_bound_before_read_in_ipython_input_as_the_shell_runs_it():
    # The driver sets aside what ``rebinds`` lists, read through the shell's transform.
    cases = {
        "x = make(b)\nh = h * 2\nfor _ in range(n):\n    out = model(x)\n": ["x", "_", "out"],  # h is read first
        "with torch.autocast('cuda', dtype=torch.bfloat16):\n    x = make(8)\n    y = model(x)\n": ["x", "y"],
        "!nvidia-smi\nx = make(b)\n%time y = model(x)\n": ["x"],  # y is bound inside %time's call
        "%%time\nx = make(b)\n": [],  # a cell magic's body runs as one call: nothing bound at the top
        "def f(:\n": [],
    }
    for source, names in cases.items():
        assert list(read_cell(source, default_transform).rebinds) == names, source


def test_a_cell_read_once_holds_its_reads_traits_and_names_under_a_cell_magic():
    read = read_cell("%%time\nx = make(b)\nloss = model(x).sum()\nloss.backward()\n")
    # Under a cell magic the body binds x and loss (what the restorer skips), but a rerun runs it as one
    # call of the magic: it binds nothing again in the namespace.
    assert read.binds_first == ("x", "loss") and read.rebinds == ()
    assert read.reads == ("make", "b", "model", "x", "loss")
    assert read.traits.trains and read.traits.calls_model and not read.traits.autocast
    assert read.parsed is not None and read.parsed.header_lines == 1


def test_a_cell_that_does_not_parse_is_read_from_its_text():
    read = read_cell("loss = model(x\nloss.backward(\n")
    assert read.parsed is None and read.binds_first == read.reads == read.rebinds == ()
    assert read.traits.trains and read.traits.calls_model  # from the text: ".backward(" and "("
