"""A randomized world of training and inference steps, as PyTorch's caching allocator sees them, to run
``%oomfix``'s batch search against (``tests/oomfix/test_simulator.py``, ``benchmarks/oomfix_simulated.py``).

Each ``Step`` is a cell: it may build its model (parameters allocated in the run) or train one built in an
earlier cell (parameters held below the search's reference level); its forward pass keeps activations for
the backward pass (batch-sized, some with a batch-independent part) and takes a library workspace; its
backward pass creates the activations' gradients and, where ``.grad`` is ``None``, the parameters'
gradients; its optimizer step creates the state (0, 1 or 2 tensors per parameter, at the first step
only) and foreach temporaries; inference frees each activation once the next exists. A tensor's size
is its shape's; what changes between runs at one batch is the library workspace (another cuDNN
algorithm, half to one and a half times the size). A run is a list of allocator events, played through the
project's replay of the caching allocator (``jupyter_cudamem.growth.replay``) under the card's cap:
rounding to 512 bytes and 2 MiB, segments, splits and fragments are the allocator's, and a failure
reports what was allocated, what was asked for and what was reserved but unusable, as an OOM does.

The space drawn (``draw``): largest fitting batch 1 to 100,000 (log-uniform), batch-independent memory
(parameters, gradients, optimizer state, temporaries) 0 to 90% of the card, caps of 4 to 80 GiB, the
model built in the cell or earlier, optimizer state made at the first step or already there,
gradients freed or kept, 2 to 40 parameter tensors (log-uniform: a few large ones are where the
allocator's fragments and weight-sized activations matter most), 1 to 16 activations (in a third of
training steps, some of one sample's the size of a weight, as where a sequence is as long as the model
is wide), 1 to 4 passes of the step a run (the cell's loop; 1 in two fifths of the steps: in a loop the
state the first pass makes is held through every later pass, and each pass's input is freed only once
the next is bound), the optimizer's steps marked in the recording of four fifths of the training steps (as
a torch optimizer's hooks mark them: ``RecordedRun.steps``), start ratios 1.05 to 100 (log-uniform).

The ground truth (``largest_fitting``) is noise-free runs from the failed cell's state: the largest
batch that fits, and keeps fitting in the runs after it (each from where the last left the allocator),
below the bound its allocated bytes set, found stepping down from that bound. The
allocator is not monotone in the batch (a run can fail at one batch and fit at a larger one, where its
blocks fall into segments otherwise), and a bisection from below can stop at the top of a lower window
(7 of 400 models); from above, the truth is the largest batch that fits.
"""

from __future__ import annotations

import functools
import math
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from jupyter_cudamem.growth import FixedMemory
from jupyter_cudamem.growth.fitting import allocated_limit, fits_in_a_row, held_at_start, largest_below
from jupyter_cudamem.growth.line import EventLine
from jupyter_cudamem.growth.replay import Event, StartSegment, block_bytes, replay, segment_bytes
from jupyter_cudamem.growth.replay import RecordedRun
from jupyter_cudamem.batchsearch import BatchSearch, Observation

MiB = 2**20
GiB = 2**30
T = TypeVar("T")
CAPS_GIB = (4, 6, 8, 12, 16, 24, 40, 48, 80)


@dataclass(frozen=True)
class Step:
    """One cell's step (see the module docstring). Sizes in bytes; ``activations`` are
    ``(fixed_bytes, bytes_per_sample)`` of each tensor kept for the backward pass; a run does the step
    ``steps`` times (the cell's loop)."""

    cap_bytes: int
    parameters: tuple[int, ...]
    built_in_cell: bool
    training: bool
    state_per_parameter: int
    state_exists: bool
    grads_kept: bool
    temporaries: tuple[int, ...]  # which parameter tensors the foreach step copies (indices)
    input_per_sample: float
    activations: tuple[tuple[float, float], ...]
    workspace_bytes: int
    noise: float
    steps: int = 1  # the cell's loop: how many times a run does the step
    marked: bool = False  # whether a run's recording marks its optimizer steps (a torch optimizer's hooks)

    def marks(self, stepped: bool) -> Marks:
        """Where a run's optimizer steps are in its events (none where not ``marked``)."""
        return _plan(self, stepped)[2]

    # -- what persists ------------------------------------------------------------------------------
    def held_at_start(self, stepped: bool) -> list[int]:
        """The tensors allocated when a run starts: a model built earlier and, once a training step has
        run (``stepped``, or before the failed cell), its optimizer's state and kept gradients."""
        if self.built_in_cell:
            return []  # the rerun sets the last model aside and builds its own
        held = list(self.parameters)
        if self.training and (stepped or self.state_exists):
            held += [p for p in self.parameters for _ in range(self.state_per_parameter)]
            if self.grads_kept:
                held += list(self.parameters)
        return held

    def fixed_memory(self, stepped: bool) -> FixedMemory:
        """What ``attribution.training_state`` would read from the namespace before a run."""
        created = not self.built_in_cell and self.training and (stepped or self.state_exists)
        params = sum(self.parameters)
        return FixedMemory(
            parameters_bytes=params if self.built_in_cell else 0,
            gradients_bytes=0 if not self.training or (created and self.grads_kept) else params,
            optimizer_state_bytes=0 if not self.training or created else params * self.state_per_parameter,
            tensor_bytes=frozenset(self.parameters),
            gradient_sizes=() if not self.training or (created and self.grads_kept) else self.parameters,
            state_sizes=() if not self.training or created else self.parameters * self.state_per_parameter,
            built_sizes=self.parameters if self.built_in_cell else (),
            trains=self.training,
        )

    # -- one run ------------------------------------------------------------------------------------
    def events(self, batch: int, stepped: bool, rng: random.Random | None) -> tuple[list[Event], dict[int, int]]:
        """The run's events, and each allocation it leaves (a model it builds, optimizer state, kept
        gradients) with where it sits in ``held_at_start(stepped=True)``, the list the next run starts
        with (``None``: not held there, the next run sets it aside and makes it again)."""
        plan, stays, _ = _plan(self, stepped)
        jitter = 1.0 if rng is None else rng.uniform(1 - self.noise, 1 + self.noise)
        workspace = max(int(self.workspace_bytes * jitter), 1)
        events: list[Event] = [
            (kind, key, 0, 0) if kind == "free" else
            (kind, key, workspace if per_sample is None else max(int(fixed + per_sample * batch), 1), 0)
            for kind, key, fixed, per_sample in plan
        ]
        return events, dict(stays)


_Planned = tuple[str, int, float, "float | None"]
Marks = tuple[tuple[int, int], ...]
"""Each optimizer ``step()`` of a run as ``(first event, event after its last)``, as ``RecordedRun.steps``."""


class _Planner:
    """A run's events as they are planned: each allocation's key is its place in the list."""

    def __init__(self) -> None:
        self.events: list[_Planned] = []
        self.stays: dict[int, int | None] = {}
        self.marks: list[tuple[int, int]] = []

    def alloc(self, fixed: float, per_sample: float | None = 0) -> int:
        key = len(self.events)
        self.events.append(("alloc", key, fixed, per_sample))
        return key

    def free(self, key: int) -> None:
        self.events.append(("free", key, 0, 0))


@functools.lru_cache(maxsize=256)
def _plan(step: Step, stepped: bool) -> tuple[tuple[_Planned, ...], dict[int, int | None], Marks]:
    """A run's events with each allocation's size as ``fixed + per_sample * batch`` (``per_sample``
    ``None``: the library's workspace, drawn anew each run), what it leaves (``Step.events``) and where its
    optimizer steps are (where ``step.marked``): the same for every batch, so made once per step."""
    plan = _Planner()
    has_state = not step.built_in_cell and (stepped or step.state_exists)
    has_grads = has_state and step.grads_kept
    if step.built_in_cell:
        for size in step.parameters:
            plan.stays[plan.alloc(size)] = None
    x: int | None = None
    for _ in range(step.steps):
        x, has_state, has_grads = _one_step(step, plan, x, has_state, has_grads)
    if x is not None:
        plan.free(x)
    stays = dict.fromkeys(plan.stays) if step.built_in_cell else plan.stays  # the next run builds its own
    return tuple(plan.events), stays, tuple(plan.marks) if step.marked else ()


def _one_step(step: Step, plan: _Planner, previous_input: int | None, has_state: bool,
              has_grads: bool) -> tuple[int, bool, bool]:
    """One pass of the cell's loop: its input (the last pass's freed once the name is bound again), forward,
    backward and step; returns the input, and whether the optimizer's state and the gradients are held now."""
    alloc, free, stays = plan.alloc, plan.free, plan.stays
    count = len(step.parameters)
    x = alloc(0.0, step.input_per_sample)
    if previous_input is not None:
        free(previous_input)
    kept: list[tuple[int, tuple[float, float]]] = []
    middle = len(step.activations) // 2
    for index, (fixed, per_sample) in enumerate(step.activations):
        key = alloc(fixed, per_sample)
        if not step.training and kept:
            free(kept.pop()[0])
        kept.append((key, (fixed, per_sample)))
        if index == middle and step.workspace_bytes:
            # A library's workspace: its size is the algorithm's, which another run may pick otherwise.
            free(alloc(step.workspace_bytes, None))
    if not step.training:
        for key, _ in kept:
            free(key)
        return x, has_state, has_grads
    grads: list[int] = []
    pending = list(step.parameters) if not has_grads else []
    share = max(1, math.ceil(len(pending) / max(len(kept), 1)))
    previous: int | None = None
    for key, size in reversed(kept):
        gradient = alloc(*size)
        if previous is not None:
            free(previous)
        free(key)
        previous = gradient
        for _ in range(min(share, len(pending))):
            index = len(pending) - 1
            grads.append(alloc(pending.pop()))
            stays[grads[-1]] = count * (1 + step.state_per_parameter) + index
    if previous is not None:
        free(previous)
    while pending:
        index = len(pending) - 1
        grads.append(alloc(pending.pop()))
        stays[grads[-1]] = count * (1 + step.state_per_parameter) + index
    begins = len(plan.events)
    if not has_state:
        made = 0
        for size in step.parameters:
            for _ in range(step.state_per_parameter):
                stays[alloc(size)] = count + made  # where held_at_start(True) lists it
                made += 1
    temporaries = [alloc(step.parameters[i]) for i in step.temporaries]
    for key in temporaries:
        free(key)
    plan.marks.append((begins, len(plan.events)))
    if not step.grads_kept:
        for key in grads:
            free(key)
            stays.pop(key, None)
    return x, True, step.grads_kept


def start_segments(held: list[int]) -> tuple[StartSegment, ...]:
    """Each held tensor in a segment of its own, as after ``empty_cache()`` (a simplification: the real
    allocator packs small tensors together)."""
    return _start_segments(tuple(held))


@functools.lru_cache(maxsize=64)
def _start_segments(held: tuple[int, ...]) -> tuple[StartSegment, ...]:
    segments = []
    address = 1 << 40
    for size in held:
        block = block_bytes(size)
        segment = segment_bytes(block)
        small = block <= 1 << 20
        rest = segment - block
        if small or rest > 1 << 20:
            blocks = ((block, True),) + (((rest, False),) if rest else ())
        else:
            blocks = ((segment, True),)
        segments.append(StartSegment(address, small, blocks))
        address += segment + (1 << 30)
    return tuple(segments)


def _allocated(segments: tuple[StartSegment, ...]) -> int:
    return sum(size for s in segments for size, used in s.blocks if used)


def _reserved(segments: tuple[StartSegment, ...]) -> int:
    return sum(size for s in segments for size, _ in s.blocks)


@dataclass
class Run:
    fitted: bool
    peak_bytes: int  # above the run's start; what it held when it failed
    need_bytes: int | None
    stuck_bytes: int | None
    recorded: RecordedRun


def run(step: Step, batch: int, stepped: bool, rng: random.Random | None) -> Run:
    segments = start_segments(step.held_at_start(stepped))
    start = _allocated(segments)
    events, stays = step.events(batch, stepped, rng)
    result = replay(events, segments, step.cap_bytes)
    after = start_segments(step.held_at_start(True))
    left = tuple((after[index].address if index is not None and index < len(after) else -1 - key, key)
                 for key, index in stays.items())
    marks = step.marks(stepped)
    recorded = RecordedRun(segments, tuple(events), left, steps=marks)
    if result.fits:
        return Run(True, result.peak_allocated_bytes - start, None, None, recorded)
    assert result.failed_at is not None and result.allocated_at_failure_bytes is not None
    held = result.allocated_at_failure_bytes - start
    stuck = (result.reserved_at_failure_bytes or 0) - result.allocated_at_failure_bytes
    # PyTorch's history of a failed run ends with the request that raised.
    # A step still open when the run raised runs to the end of its history.
    end = result.failed_at + 1
    recorded = RecordedRun(segments, tuple(events[:end]), (),
                           steps=tuple((first, min(after, end)) for first, after in marks if first < end))
    return Run(False, held, held + block_bytes(events[result.failed_at][2]), stuck, recorded)


def fits(step: Step, batch: int, stepped: bool, rng: random.Random | None) -> bool:
    """``run(...).fitted`` without what a search is handed (what the run left, its recording)."""
    return replay(step.events(batch, stepped, rng)[0], start_segments(step.held_at_start(stepped)), step.cap_bytes).fits


def fits_again_and_again(step: Step, batch: int) -> bool:
    """A noise-free run from the failed cell's state fits, and so do the runs after it, as the user reruns it
    after the fix (``growth.fitting.fits_in_a_row``: the first from an emptied cache, each later one from
    where the last left the allocator)."""
    return fits_in_a_row(step.events(batch, False, None)[0], start_segments(step.held_at_start(False)), step.cap_bytes)


def largest_fitting(step: Step, limit: int = 10**7) -> int:
    """The largest batch that keeps fitting from the failed cell's state (0: none), assuming every batch
    below one that does does: below the bound the allocated bytes set, the replay steps down and bisects."""
    fixed_at = {event[1]: event[2] for event in step.events(0, False, None)[0] if event[0] != "free"}
    grown = step.events(limit, False, None)[0]
    lines: list[EventLine] = [(kind, key, stream, 0.0, 0.0, 1.0) if kind == "free" else
                              (kind, key, stream, float(fixed_at[key]), (size - fixed_at[key]) / limit, 1.0)
                              for kind, key, size, stream in grown]
    held = held_at_start(start_segments(step.held_at_start(False)))
    # Sizes are truncated to whole bytes: a sample's share of one byte per tensor keeps the bound above.
    slack = len(lines) / limit
    bound = allocated_limit([(k, key, st, f - 1, p - slack, e) for k, key, st, f, p, e in lines], held, step.cap_bytes)
    high = min(limit, math.floor(bound)) if bound < math.inf else limit
    return largest_below(lambda batch: fits_again_and_again(step, batch), high)


def halving(step: Step, start: int, seed: int) -> int:
    """The seeds' loop: half the batch after each OOM, until one fits and keeps fitting as the user runs it
    again (0: none did); each batch with the same jitter between runs as the search's."""
    rng = random.Random(seed)
    batch = start // 2
    while batch >= 1 and not fits_in_a_row(step.events(batch, False, rng)[0], start_segments(step.held_at_start(False)),
                                           step.cap_bytes):
        batch //= 2
    return batch


class _WorstWorkspace(random.Random):
    """A run's jitter at its most: the largest workspace the library may pick."""

    def uniform(self, a: float, b: float) -> float:
        return b


def safe_largest(step: Step, upper: int) -> int:
    """The largest batch up to ``upper`` that fits with the largest workspace a run may draw."""
    return largest_below(lambda batch: fits(step, batch, False, _WorstWorkspace()), upper)


def told(step: Step, batches: tuple[int, ...], seed: int) -> int:
    """What a search told where to try ends on: it tries ``batches`` in turn (one larger than what fitted),
    each run with the same jitter between runs as the search's and halving's, and ends on the largest that
    fitted (0: none). It knows everything but the workspace the next run draws."""
    rng = random.Random(seed)
    best = 0
    for batch in batches:
        if batch > best and fits(step, batch, False, rng):
            best = batch
    return best


@dataclass(frozen=True)
class Told:
    """Halving's end in one model, and where searches told the answer end (``told``): told halving's own
    end, tried up to three times (``given_halving``); told the largest batch that fits without the jitter
    between runs, tried twice, and then the largest that fits with the largest workspace
    (``given_largest``)."""

    largest: int
    halving: int
    given_halving: int
    given_largest: int


def told_cases(count: int, seed: int, drawn: list[Drawn] | None = None) -> list[Told]:
    """``Told`` for the models ``cases`` draws for the same ``count`` and ``seed`` (``drawn``: the first of
    them, where a ``cases`` of the same seed drew them already)."""
    out: list[Told] = []
    models = drawn[:count] if drawn is not None and len(drawn) >= count else draws(draw, count, seed)
    for step, start, largest in models:
        seed_here = len(out)
        halved = halving(step, start, seed=seed_here)
        safe = safe_largest(step, largest)
        out.append(Told(largest, halved, told(step, (halved,) * 3, seed_here),
                        told(step, (largest, largest, safe), seed_here)))
    return out


def met_goal(found: int, largest: int, reruns: int) -> bool:
    """The issue's goal for one search: at most the largest batch that keeps fitting (above it, the next
    runs fail), within one sample of it where it is 10 or less, else 0.90 of it, in at most 3 reruns."""
    return (largest - 1 if largest <= 10 else 0.90 * largest) <= found <= largest and reruns <= 3


def below_halving(found: int, halving: int | None, largest: int) -> bool:
    """Below halving's end where that end keeps fitting as the search's answer must (at most ``largest``):
    as in the sweep (``benchmarks/oomfix.py``'s ``goal_misses``), a batch that does not is no bar."""
    return halving is not None and found < halving <= largest


@dataclass(frozen=True)
class Case:
    step: Step
    largest: int
    start: int
    found: int
    reruns: int
    halving: int | None  # None: not run, the search found the largest batch, which halving cannot pass

    @property
    def met_goal(self) -> bool:
        return met_goal(self.found, self.largest, self.reruns)

    @property
    def worse_than_halving(self) -> bool:
        return below_halving(self.found, self.halving, self.largest)

    @property
    def fixed_share(self) -> float:
        step = self.step
        params = sum(step.parameters)
        fixed = params
        if step.training:
            fixed += params * (1 + step.state_per_parameter) + sum(step.parameters[i] for i in step.temporaries)
        return fixed / step.cap_bytes


def search(step: Step, start: int, seed: int, max_tries: int = 3, recorded: bool = True,
           restored: bool = True, failures_recorded: bool = True) -> tuple[int, int, BatchSearch]:
    """``%oomfix``'s search from a failure at ``start``, as the driver runs it: every figure above the
    reference level (what the failed cell started with), the level and the allocator's segments handed
    over before each try. ``recorded=False`` plays a torch without the allocator's history;
    ``restored=False`` a fix that could not put the model and optimizer back before each rerun (their
    host copy would not fit), so a try that fitted leaves its optimizer state and kept gradients to the
    next. ``failures_recorded=False`` hides a failed try's requests from the search (only fitted ones are
    replayed)."""
    rng = random.Random(seed)
    failed = run(step, start, False, None)  # as ``draw`` saw it fail; later runs jitter
    assert not failed.fitted, "the start must fail"
    reference_segments = start_segments(step.held_at_start(False))
    reference = _allocated(reference_segments)
    budget = step.cap_bytes - _reserved(reference_segments) + (_reserved(reference_segments) - reference)
    policy = BatchSearch(start, budget, max_tries=max_tries, need_bytes=failed.need_bytes,
                         stuck_bytes=failed.stuck_bytes or None, fixed=step.fixed_memory(False))
    stepped = False
    while True:
        segments = start_segments(step.held_at_start(stepped))
        level = _allocated(segments) - reference
        policy.set_level(level)
        policy.set_allocator(segments if recorded else None, step.cap_bytes if recorded else None)
        batch = policy.next()
        if batch is None:
            break
        result = run(step, batch, stepped, rng)
        if result.fitted:
            observation = Observation(True, peak_bytes=result.peak_bytes + level, start_bytes=level,
                                      recorded=result.recorded if recorded else None)
            stepped = (stepped or step.training) and not restored
        else:
            observation = Observation(False, need_bytes=(result.need_bytes or 0) + level,
                                      held_bytes=result.peak_bytes + level, start_bytes=level,
                                      stuck_bytes=result.stuck_bytes or None,
                                      recorded=result.recorded if recorded and failures_recorded else None)
        policy.record(batch, observation)
    return policy.answer or 0, len(policy.attempts), policy


Drawn = tuple[Step, int, int]
"""What ``draw`` gives: a step, its start batch and its largest fitting batch."""


def draw(rng: random.Random) -> Drawn | None:
    """One step, its start batch and its largest fitting batch, from the space in the module docstring;
    ``None`` when the drawn step cannot fit a batch of 1 (it is drawn again)."""
    cap = rng.choice(CAPS_GIB) * GiB
    target = int(round(math.exp(rng.uniform(0, math.log(100_000)))))
    share = rng.uniform(0.0, 0.9)
    training = rng.random() < 0.8
    state_per_parameter = rng.choices((0, 1, 2), (0.15, 0.2, 0.65))[0] if training else 0
    n_params = int(math.exp(rng.uniform(math.log(2), math.log(41))))  # 2 to 40, log-uniform
    weights = [rng.uniform(0.2, 1.0) for _ in range(n_params)]
    temporaries = tuple(i for i in range(n_params) if rng.random() < 0.6) if training and rng.random() < 0.6 else ()
    temp_share = sum(weights[i] for i in temporaries) / sum(weights)
    copies = 1 + (1 + state_per_parameter + temp_share if training else 0)
    params_total = share * cap / copies
    parameters = tuple(max(int(params_total * w / sum(weights)), 512) for w in weights)
    n_acts = rng.randint(1, 16)
    act_weights = [rng.uniform(0.1, 1.0) for _ in range(n_acts)]
    room = cap * 0.97 - share * cap
    if room <= 0:
        return None
    per_sample = room / target / (1.05 if training else 0.5)
    # Batch-major activations, a few with a small batch-independent part (a class token, padding), and
    # a few batch-independent tensors kept for the backward pass (masks, position tables).
    activations = [(rng.uniform(0, 1) * per_sample * w / sum(act_weights) if rng.random() < 0.2 else 0.0,
                    per_sample * w / sum(act_weights)) for w in act_weights]
    if training and rng.random() < 0.3:
        # A transformer whose sequence is as long as it is wide: one sample's activation is exactly the
        # size of a weight (1,024 tokens of width 1,024 and a 1,024 x 1,024 matrix).
        weight = rng.choice(parameters)
        activations = [(0.0, float(weight)) if rng.random() < 0.5 else a for a in activations]
    for _ in range(rng.choice((0, 0, 1, 3))):
        activations.insert(rng.randrange(len(activations) + 1), (rng.uniform(0, 0.05) * room, 0.0))
    built = rng.random() < 0.5
    steps = rng.choice((1, 1, 2, 3, 4))
    marked = training and rng.random() < 0.8
    step = Step(
        cap_bytes=cap,
        parameters=parameters,
        built_in_cell=built,
        training=training,
        state_per_parameter=state_per_parameter,
        state_exists=(not built) and training and rng.random() < 0.3,
        grads_kept=training and rng.random() < 0.3,
        temporaries=temporaries,
        input_per_sample=per_sample * rng.uniform(0.0, 0.1),
        activations=tuple(activations),
        workspace_bytes=rng.choice((0, 8 * MiB, 32 * MiB, 64 * MiB, int(0.02 * room))),
        noise=0.5,
        steps=steps,
        marked=marked,
    )
    largest = largest_fitting(step)
    if largest < 1 or largest >= 10**7:
        return None
    ratio = math.exp(rng.uniform(math.log(1.05), math.log(100)))
    start = max(int(round(largest * ratio)), largest + 1)
    if start < 2 or fits(step, start, False, None):
        return None
    return step, start, largest


def draws(drawer: Callable[[random.Random], T | None], count: int, seed: int) -> Iterator[T]:
    """``count`` draws of ``drawer`` from one generator of ``seed``, drawing again where it gives ``None``."""
    rng = random.Random(seed)
    made = 0
    while made < count:
        drawn = drawer(rng)
        if drawn is not None:
            made += 1
            yield drawn


def cases(count: int, seed: int, recorded: bool = True, restored: bool = True,
          drawn: list[Drawn] | None = None) -> list[Case]:
    """The search over ``count`` models of ``seed`` (``drawn``: the first of them, where drawn already)."""
    out: list[Case] = []
    models = drawn[:count] if drawn is not None and len(drawn) >= count else draws(draw, count, seed)
    for step, start, largest in models:
        found, reruns, _ = search(step, start, seed=len(out), recorded=recorded, restored=restored)
        halved = halving(step, start, seed=len(out)) if found < largest else None
        out.append(Case(step, largest, start, found, reruns, halved))
    return out


CHUNKS = 20
"""``many_cases`` draws its models in this many chunks, each from a seed of its own, so that the models
drawn are the same whatever the number of processes that draw them."""


_Job = tuple[int, int, bool, list[Drawn] | None]
"""A chunk's count, seed, whether its runs are recorded, and its models where they were drawn already."""

_DRAWN: dict[int, list[Drawn]] = {}
"""The models ``many_cases`` drew in this process, by chunk seed. Why: the first models of a seed are the
same whatever the count, and ``many_told`` asks for the first of the chunks ``tests/oomfix/test_simulator.py``
drew a moment before; drawing one (finding its largest batch) is a sixth of a case."""


def _chunk(args: _Job) -> list[Case]:
    return cases(args[0], args[1], args[2], drawn=args[3])


def _told_chunk(args: _Job) -> list[Told]:
    return told_cases(args[0], args[1], args[3])


def many_cases(count: int, seed: int, recorded: bool = True, processes: int | None = None) -> list[Case]:
    """``count`` cases in ``CHUNKS`` chunks of seeds ``seed * 1000 + i``, drawn by ``processes`` processes
    (every core by default): the same cases on one core or many."""
    made = _in_chunks(_chunk, count, seed, recorded, processes)
    first = 0
    for size, chunk_seed in _chunks(count, seed):
        if size > len(_DRAWN.get(chunk_seed, ())):
            _DRAWN[chunk_seed] = [(case.step, case.start, case.largest) for case in made[first:first + size]]
        first += size
    return made


def many_told(count: int, seed: int, processes: int | None = None) -> list[Told]:
    """``told_cases`` over the models ``many_cases`` draws for the same ``count`` and ``seed``."""
    return _in_chunks(_told_chunk, count, seed, True, processes)


def _chunks(count: int, seed: int) -> list[tuple[int, int]]:
    """The count and seed of each chunk ``many_cases`` draws ``count`` models of ``seed`` in."""
    sizes = [count // CHUNKS + (1 if i < count % CHUNKS else 0) for i in range(CHUNKS)]
    return [(size, seed * 1000 + i) for i, size in enumerate(sizes) if size]


def _in_chunks(job: Callable[[_Job], list[T]], count: int, seed: int, recorded: bool,
               processes: int | None) -> list[T]:
    from concurrent.futures import ProcessPoolExecutor

    jobs: list[_Job] = [(size, chunk_seed, recorded, _DRAWN.get(chunk_seed)) for size, chunk_seed in _chunks(count, seed)]
    workers = processes or os.cpu_count() or 1
    if workers == 1:
        return [item for args in jobs for item in job(args)]
    with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
        return [item for part in pool.map(job, jobs) for item in part]
