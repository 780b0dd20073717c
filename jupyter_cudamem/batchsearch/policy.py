"""Choose the next batch size to try, so that few reruns land near the largest batch that fits.

The protocol the driver uses, and the tests exercise: ``next()`` gives the batch to try (``None`` once
the search has ended, ``stopped`` then says why), the caller runs it and ``record(batch, observation)``
says what happened. Nothing here assumes how far the failed batch was from one that fits.

What it uses, all measured (``jupyter_cudamem.growth`` holds the memory model):

- **the failure's figures**: what was allocated when the cell failed, less what was allocated when it
  started, plus the allocation it asked for, is a lower bound of the failed batch's need
  (``need_bytes``); each failed try gives the same, and what it held before failing;
- **the budget**: what the cell may allocate above what is allocated when it starts (the headroom
  measured after the cleanup). Every figure is read from that one reference level: a try that fits
  leaves state the user keeps (gradients, an optimizer's first-step state), so later tries start higher
  (``set_level``), and that state counts against them;
- **the batch-independent part** (``growth.FixedMemory``, read from the namespace's models and
  optimizers before any rerun): the parameters of a model the cell builds again (held at every moment
  of a run after it is built), and the sizes of single parameter tensors, so that a recorded request of
  such a size that the run left allocated (AdamW's state made at its first step, a model it built) is
  taken as not growing with the batch. Without it one measured peak bounds the growth from above only: the line through that
  peak and zero (through the built parameters, where known), which fits whatever the fixed part is;
  two measured peaks fit it (``growth.fit``).

The tries, in order:

1. **Probe** at ``failed x min(1, budget / need) / FIRST_PROBE_DIVISOR``: nothing measured says how
   much too big the failed batch was (a failure's need is only "more than the budget"), so the probe
   must fit for any start the goal covers (up to 64x the largest batch that fits) -- see
   ``FIRST_PROBE_DIVISOR``. A failed probe probes again, ``AGAIN_PROBE_DIVISOR`` lower. Its peak may be
   mostly weights, gradients and optimizer state (a fine-tune whose largest batch is a few dozen): the
   replay below keeps the state the probe left at its size, so the next try is not put at 0 or 1.
2. **The largest batch the allocator's replay of the probe fits** (below), each request scaled with the
   batch but the parameter-sized ones the probe left allocated: a bound from above on every phase of the
   run (forward, backward, optimizer step), so this try fits and lands where its peak is mostly the
   batch's. A parameter-sized request the probe freed is scaled too: at batch 1 a sequence as long as the
   model is wide makes activations the size of a weight (the H100 put the next try at 21 where 6 fits
   when those were kept; ``tests/gpu/test_oomfix_finetune_gpu.py``).
3. **The largest batch the replay of the two tries fits**, each request on the line its two sizes give:
   an estimate, not a bound.

Every prediction keeps a margin; the search stops only when no larger whole batch is predicted to fit.
While reruns are left, a batch predicted to fit but for the margin (with the jitter of runs at one
batch, ``JITTER``) is tried too, halving's batches (half the failed one, a quarter...) first: fitting
one, the search ends on no less than halving would. On the last rerun, a batch of halving's that the
replay (or the line) fits with no margin at all is tried instead of the margin's: a failed batch near a
power of two times the largest lets halving land within the margin of it. By the replay it is tried
even where what fitted is below halving's next batch, so that a failure ends below halving too (by the
line, which is no bound, only where what fitted is at least that batch): in the project's
simulator (``benchmarks/oomfix_simulated.py``; seeds 2026 and 7, 10,000 models each) trying it there
lifted 51 searches to halving's batch or above and left one (whose try failed on a workspace drawn
larger) below it; asking there for the margin of runs at one batch (``JITTER``) lifted 36 and lowered none.
"Fits" is every batch up to the largest that does: the allocator is not monotone in the batch, and a
single batch that fits above ones that fail is a window the next run's jitter closes. A gain of one
sample is a gain: there is no minimum share.

A failure whose bytes fit the budget (what it held plus what it asked for is within it) failed on the
allocator's fragments: its OOM message says how much PyTorch held reserved but could not use for the
allocation (split blocks it cannot give back), and that much of the budget is not usable for the
allocated line (``stuck_bytes``). Near the limit those fragments are what a line on allocated bytes
cannot see: at 1.02-1.1x the largest fitting batch, 0.5 GiB for a GRU, 0.3-0.7 GiB for an LSTM,
1.1-1.2 GiB for an MLP whose tensors are a fifth of a 6 GiB cap each, 0.02-0.12 GiB for convnets
(the project's ``benchmarks/fit_limit.py``, H100). From the failed cell and from a try alike they are
taken per sample of the batch that failed (the fragments are pieces of the batch's own tensors), and
steepen the line. Taken whole from a try, a GPT-2 medium ``generate()`` over its prompts a batch at a
time (the sweep's ``gpt2_medium_generate_in_batches``, before its long runs were recorded as windows)
lost 1.8 GiB of room to the fragments of its try at 30 and ended on 18 where 29 fits (per sample: 22).

Any other try that fails where the line said it fits shows that less is usable than measured (memory
outside PyTorch, a line that bends): the usable budget lies between what the try held (usable for
certain) and what failed, and becomes their midpoint. A second such contradiction, or a failure that
held all the line gave it, means the peak is not a line: bisection between the largest batch that
fitted and the smallest that failed.

**The allocator's replay.** Where PyTorch recorded the tries' allocations (``recording``), the search
replays them through a model of its caching allocator under the cap (``growth.replay``), from the
segments the next try starts with, without what an earlier try left that those segments still hold
(AdamW's state made at the probe's first step is not made again). It decides every prediction: it sees
every phase of a run and the pieces of split segments that no allocation can use, which a line on
allocated peaks cannot (measured on the H100 by ``benchmarks/fit_limit.py``: the cap left 22% more
than the allocated peak of the largest fitting batch for an MLP, 13% for an LSTM, 9% for a GRU, 1-3%
for convnets; from two runs at 0.3x and 0.6x of it, replays put that batch at 0.97-1.00 of it for eight
of nine workloads and 0.92 for a CNN whose cuDNN workspace is optional, never above, where the line
through the same two runs overshot by up to 23%: ``benchmarks/replay.py``). The line and the failures'
figures decide where nothing was recorded.

**A failed try's own requests.** A try that failed above the one recorded run that fitted is recorded up
to the request that raised: the requests both made are put on the line through their two sizes, as from
two runs, and the rest of the fitted run's as from one (``growth.fitting.fitting_from_one_and_failure``).
One run cannot tell a tensor of fixed size (a mask, a position table, a workspace) from a batch's, and
scaled with the batch it is no bound in the allocator: larger blocks land in other segments and leave
other fragments (in the project's simulator a fine-tune probed at 2, whose 11 MiB masks the one-run
replay scaled to 222 MiB at 39, was put at 39 where 35 and above fail in the fragments the real masks
leave). That replay decides the next try where it fails at the failed batch with no margin, as the try
did (``Tries.paired_failure``); in the simulator (seeds 2026 and 7, 10,000 models each) it lifted the
models that meet the goal from 9,923 to 9,944 and 9,936, and cut those that end below halving from 58
and 53 to 43 and 40. Where it does not fail there, what made the try fail is not in it: the replay's
cap is lowered by what PyTorch held but could not use then, and the next try is at least 10% below the
failure.

**Memory that grows faster than the batch.** A tensor of every sample against every other (a
contrastive loss's batch x batch logits, their softmax and gradient) is a sliver of a small probe's peak
and most of the peak near the largest batch: one run's replay, scaling every request with the batch,
puts the next try near the failed batch. Two sizes of a request that are the same whole multiple of the
square (or cube) of their batches put it on that power (``growth.pairing.law_through``), and where a
replay fits a batch that failed, the next try is also bounded by the least growth the failures show, as
the line's is. In the project's simulated world of such steps (``tests/oomfix/superlinear.py``) every
one of 10,000 meets the goal; on an H100, an InfoNCE step capped at 2 GiB went from ending on its probe
(223, where 10,836 fits) to 10,510 (``tests/gpu/test_oomfix_contrastive_gpu.py``).

The line is fitted on allocated peaks, not reserved ones: under a cap cuDNN asks for its largest
convolution workspace first and settles for less when refused, so a CNN's reserved peak reached a
6 GiB cap at a batch that needed 3 GiB allocated (the project's ``benchmarks/oomfix.py``, H100).

Pure arithmetic: no torch, no IPython. Sizes in bytes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..growth import Growth, lowest_slope
from ..growth.fitting import REPLAY_MARGIN
from ..units import MiB

from .state import Attempt, Observation, Tries

FIRST_PROBE_DIVISOR = 64
"""The first probe is the failed batch over 64 (times budget/need when the failure's figures show the
need was larger than the budget). The goal covers starts up to 64x the largest batch that fits, so the
probe fits at every one of them; at a 1.5x start it sits at 1/43 of the largest fitting batch, still
large enough that its peak (and the surest batch computed from it) is measured well above the
allocator's rounding. A smaller divisor wastes the probe for the starts the goal names."""

AGAIN_PROBE_DIVISOR = 8
"""A probe that fails shows the start was more than 64x too big: the next probe is 8x lower again
(covering starts up to 512x), not 64x (which would leave the second probe so small that the line from
it is mostly rounding)."""

JITTER = 0.005
"""How much two runs of a step at one batch differ: peaks measured twice differ by up to half a percent
(cuDNN or cuBLAS picking another algorithm and workspace; the project's ``benchmarks/oomfix.py`` runs on
the H100). A batch that fits with this much to spare but not with the margin is "predicted to fit but for
the margin": the search still tries it while reruns are left."""

MARGIN = 0.04
"""The fraction of the room above the fixed part that a predicted batch leaves unused: peaks of a step
measured twice differ by a fraction of a percent, and the allocator's blocks and fragmentation take a
few percent more of a cap than the allocated bytes show. 4% is the smallest that kept every rerun of
the H100 benchmark's predicted batches from failing. Taken from the room the batch's tensors use, not
from the whole budget: a margin of the whole would cost a cell whose weights fill half the budget 8% of
its batch for nothing (weights are allocated once, in one place, and do not vary)."""


@dataclass
class BatchSearch(Tries):
    """The policy for one failed batch (see the module docstring), over what its tries showed (``Tries``).
    ``max_tries`` bounds the reruns."""

    max_tries: int = 3
    margin: float = MARGIN
    stopped: str | None = None
    reason: str = ""  # why the batch ``next()`` returned last was chosen
    _contradictions: int = 0
    _pending: tuple[int, str, float | None] | None = None  # (batch, reason, predicted peak)
    _chosen_by_replay: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_tries < 1:
            raise ValueError("max_tries must be at least 1")

    # -- the protocol -------------------------------------------------------------------------------
    def next(self) -> int | None:
        """The batch to try next; ``None`` once the search has ended (``stopped`` says why)."""
        if self.stopped is not None:
            return None
        choice = self._choose()
        if choice is None:
            return None
        batch, reason, predicted = choice
        self._pending = (batch, reason, predicted)
        self.reason = reason
        return batch

    def next_batch(self) -> int | None:
        """The same as ``next()`` (the name the dry run's plan uses)."""
        return self.next()

    def record(self, batch: int, observation: Observation | bool, peak_bytes: int | None = None) -> Attempt:
        """Record what a try of ``batch`` showed (``True``/``False`` with ``peak_bytes`` is short for an
        ``Observation``)."""
        if isinstance(observation, bool):
            observation = Observation(observation, peak_bytes if observation else None,
                                      held_bytes=None if observation else peak_bytes)
        pending = self._pending if self._pending is not None and self._pending[0] == batch else None
        self._pending = None
        reason = pending[1] if pending is not None else "chosen by the caller"
        predicted = pending[2] if pending is not None else None
        if not observation.fitted and pending is not None and self._chosen_by_replay:
            # The replay said it fits: what PyTorch held reserved but could not use when it failed (or, where
            # it held none, the allocation that failed) is what the replay did not see; the next replay
            # plays under a cap lower by that much.
            held = observation.held_bytes or 0
            missed = observation.stuck_bytes or max((observation.need_bytes or held) - held, 0)
            self._replay_cut_bytes = max(self._replay_cut_bytes, missed)
        if not observation.fitted and self._failed_on_fragments(observation.need_bytes, observation.stuck_bytes):
            # Not the line's error: the fragments are pieces of the try's own tensors, so per sample of
            # its batch they steepen the line, as the failed cell's do.
            self._stuck_per_sample = max(self._stuck_per_sample, float(observation.stuck_bytes or 0) / batch)
            self._contradictions += 1
        elif not observation.fitted and predicted is not None:
            self._contradicted(predicted, observation)
        attempt = Attempt(batch, observation, reason)
        self.attempts.append(attempt)
        return attempt

    def stop(self, reason: str) -> None:
        """End the search (the caller's reason: an error that is not an OOM, a change that cannot be made)."""
        if self.stopped is None:
            self.stopped = reason

    # -- the policy ---------------------------------------------------------------------------------
    def _choose(self) -> tuple[int, str, float | None] | None:
        if len(self.attempts) >= self.max_tries:
            self.stop(f"the {self.max_tries} tries allowed are spent")
            return None
        low = self.best or 0
        high = self.smallest_failed
        if high - low <= 1:
            self.stop(f"{low} fits and {high} does not" if low else "no smaller batch is left to try")
            return None
        growth = self.growth()
        if growth is None:
            if low:  # a try fitted but its peak was not measured
                return self._bounded((low + high) // 2, low, high, "bisection (no peak measured)", None)
            return self._probe(high)
        if self._contradictions >= 2 and self.paired_failure() is None:
            return self._bounded((low + high) // 2, low, high, "bisection (the line was contradicted twice)", None)
        predicted, how = self._predicted(growth)
        predicted = min(predicted, high - 1)
        # Every batch up to the largest that fits but for the margin (the allocator is not monotone in the
        # batch: a single batch that fits above ones that fail is a window the next run's jitter closes),
        # or with no margin at all; each replayed only when asked.
        nominal_largest = functools.cache(lambda: self._nominal_largest(growth, high))
        exact_largest = functools.cache(lambda: self._nominal_largest(growth, high, 0.0))
        for halving in self._halving_candidates(max(low, predicted), high):
            if self._last_try():
                if (self._chosen_by_replay or 2 * low >= halving) and exact_largest() >= halving:
                    # On the last rerun, a batch halving tries that fits with no margin at all: where the
                    # failed batch is near a power of two times the largest, halving lands within the margin
                    # of it, and the margin's batch would end below halving. By the line (no replay), only
                    # where what fitted is at least halving's next batch below it: the line is no bound.
                    return self._bounded(halving, low, high, f"{how}; {halving}, halving's, fits with no margin",
                                         growth.peak_high(halving))
            elif nominal_largest() >= halving:
                # A batch halving from the failed one would try, predicted to fit but for the margin: fitting
                # it, the search ends on at least what halving ends on.
                return self._bounded(halving, low, high, f"{how}; {halving}, halving's, fits but for the margin",
                                     growth.peak_high(halving))
        if predicted > low:
            return self._bounded(predicted, low, high, how, growth.peak_high(predicted))
        # No larger batch is predicted to fit with the margin; a rerun is left.
        if nominal_largest() >= low + 1:
            largest = nominal_largest()
            return self._bounded(largest, low, high, f"{how}; {largest} fits but for the margin, and a rerun is left",
                                 growth.peak_high(largest))
        untried = min(self._halving_candidates(low, high), default=None)
        if untried is not None and 2 * low >= untried and not self._last_try():
            # The batch halving ends on if those above it fail (the smallest it tries above what fitted) is
            # untried: a rerun of it ends the search on no less than halving ends on, fitted or not (if it
            # fails, halving's next is at most what fitted). Not on the last rerun: should it fail, the
            # driver reruns the best batch with the one left, so the variables and the model hold one run
            # of the cell it reports.
            return self._bounded(untried, low, high, f"{how}; {untried}, halving's next batch, is untried",
                                 growth.peak_high(untried))
        fixed = min(growth.fixed_bytes, self.usable_bytes)
        if self._one_batch_measured() and growth.anchor[1] < fixed + (self.usable_bytes - fixed) * (1 - self.margin):
            # Only one run bounds the growth, from above (it is no estimate), its peak left room: the next
            # whole sample says more, and makes a second run to measure the growth from.
            return self._bounded(low + 1, low, high, f"{how}; {low + 1}, one more sample, while reruns are left",
                                 growth.peak_high(low + 1))
        self.stop(f"{how}: {low}, which fitted, is the largest batch predicted to fit")
        return None

    def _nominal_largest(self, growth: Growth, high: int, margin: float = JITTER) -> int:
        """The largest batch below ``high`` that fits but for the margin, that is with only what runs at
        one batch differ by (``JITTER``; or with ``margin``): by the replay, or by the line with its
        steepest slope."""
        if self._chosen_by_replay:
            plain = self.replayed(margin)
            if plain is not None:
                return plain.largest(high - 1)
        fixed = min(growth.fixed_bytes, self.usable_bytes)
        return min(growth.largest_batch(fixed + (self.usable_bytes - fixed) * (1 - margin), sure=True), high - 1)

    def _last_try(self) -> bool:
        return len(self.attempts) == self.max_tries - 1

    def _halving_candidates(self, low: int, high: int) -> list[int]:
        """The batches halving from the failed one tries (half, a quarter...) between ``low`` and ``high``,
        largest first."""
        found, batch = [], self.failed_batch // 2
        while batch > low:
            if batch < high:
                found.append(batch)
            batch //= 2
        return found

    def _predicted(self, growth: Growth) -> tuple[int, str]:
        """The largest batch predicted to fit with the margins, and how.

        The allocator's replay, where the tries were recorded, decides: it replays the tries' own
        requests, so it sees every phase of a run (the forward pass, the backward pass, the optimizer's
        step), what does not grow with the batch and what the allocator cannot use. The line through
        the measured peaks decides where there is no recording. Either way no batch needs more than the
        budget by the least growth the failures show (``growth.lowest_slope``)."""
        replayed = self.replayed_batch(REPLAY_MARGIN)
        self._chosen_by_replay = replayed is not None
        if replayed is not None:
            predicted = replayed
            how = f"the allocator's replay of the tries fits up to {replayed} with a {REPLAY_MARGIN:.0%} margin"
            paired = self.paired_failure()
            if paired is not None:
                how = (f"the allocator's replay of the tries, with the requests of the one that failed at "
                       f"{paired.batch} up to its failure, fits up to {replayed} with a {REPLAY_MARGIN:.0%} margin")
            if self._replay_cut_bytes and paired is None:
                # A batch the replay said fits did not: the replay under the cap less what that run could
                # not use is one bound; the failed batch less five margins is another, as the replay was
                # close in bytes (it saw every request); the larger of the two is tried.
                near = int(self.smallest_failed * (1 - 5 * REPLAY_MARGIN))
                if near > predicted:
                    predicted = near
                    how = f"{self.smallest_failed}, which the allocator's replay said fits, failed: {near} is 10% below it"
        else:
            # The margin is kept from the room above the fixed part: that is where the batch's tensors are
            # placed, and what varies between runs and fragments; a model's weights do neither.
            fixed = min(growth.fixed_bytes, self.usable_bytes)
            target = fixed + (self.usable_bytes - fixed) * (1 - self.margin)
            predicted = growth.largest_batch(target, sure=True)
            if self._one_batch_measured():
                held = "its parameters" if self.fixed is not None and self.fixed.surely_held_bytes else "zero"
                how = f"surest from {growth.anchor[0]}'s peak (line through it and {held})"
            else:
                how = (f"line through measured peaks: {growth.fixed_bytes / MiB:.0f} MiB fixed + "
                       f"{growth.per_sample_bytes / MiB:.3f} MiB per sample")
        bound = self._failures_bound(growth)
        # A replay is bounded so only where it fits a batch that failed (a replay, one more pass, asked last).
        if bound is not None and bound < predicted and (not self._chosen_by_replay or self._replay_fits_a_failure()):
            predicted = bound
            if self._chosen_by_replay:
                how += f"; the least growth the failures show reaches the budget at {bound}"
        return predicted, how

    def _replay_fits_a_failure(self) -> bool:
        """Whether the replay, with no margin, fits the smallest batch that failed: it missed what grows."""
        exact = self.replayed(0.0)
        return exact is not None and exact.fits(self.smallest_failed)

    def _failures_bound(self, growth: Growth) -> int | None:
        """No batch needing more than the budget by the least growth the failures show: from what fitted to
        what a failure needed at least (``growth.lowest_slope``). The replay is bounded so too: a one-run
        replay from a small probe takes every request as proportional to the batch, and a tensor of every
        sample against every other (a contrastive loss's logits) is a sliver of the probe's peak and most
        of the failure's (on an H100, ``tests/gpu/test_oomfix_contrastive_gpu.py``: the replay of a probe
        at 223 put the next try at 32,507 where 10,836 fits)."""
        slowest = lowest_slope(self._fitted_points(), self._failed_points())
        if slowest <= 0:
            return None
        anchor_batch, anchor_peak = growth.anchor
        return int(math.floor(anchor_batch + (self.usable_bytes - anchor_peak) / slowest))

    def _probe(self, high: int) -> tuple[int, str, float | None] | None:
        failed_tries = sum(1 for a in self.attempts if not a.fitted)
        divisor = FIRST_PROBE_DIVISOR if failed_tries == 0 else AGAIN_PROBE_DIVISOR
        need = self._need_at(high)
        scale = min(1.0, self.budget_bytes / need) if need else 1.0
        batch = max(int(high * scale / divisor), 1)
        return self._bounded(batch, 0, high, f"probe: the failed {high} / {divisor / scale:.0f}", None)

    def _bounded(self, batch: int, low: int, high: int, reason: str,
                 predicted: float | None) -> tuple[int, str, float | None] | None:
        batch = min(max(batch, low + 1, 1), high - 1)
        if batch <= low or batch >= high:
            self.stop("no batch is left between the largest that fitted and the smallest that failed")
            return None
        return batch, reason, predicted

    def _contradicted(self, predicted_peak: float, observation: Observation) -> None:
        """A try failed where the line said it fits (see the module docstring)."""
        self._contradictions += 1
        held = observation.held_bytes
        if held is not None and held >= predicted_peak * (1 - self.margin):
            # It held as much as the line says it needs and still wanted more: not a line.
            self._contradictions = max(self._contradictions, 2)
            return
        # The usable budget is below what failed (the least of the line's peak and the failure's need)
        # and at least what the try held: their midpoint, a bisection in bytes that never lands above
        # a failure. On the H100 benchmark's CNN the midpoint came within 8% of the largest batch that
        # fits, the held figure alone within 15%; a fixed step below the failure (one margin) failed
        # again on a cell whose backward needs a workspace the forward did not.
        failed_at = min(predicted_peak, self.usable_bytes)
        if observation.need_bytes is not None:
            failed_at = min(failed_at, float(observation.need_bytes))
        floor = float(held) if held is not None else failed_at * (1 - 4 * self.margin)
        estimate = (floor + failed_at) / 2
        self._usable_bytes = min(self.usable_bytes, estimate)

    def run(self, try_batch) -> int | None:
        """Drive the whole search with ``try_batch(batch) -> Observation``; return the best batch.
        (The driver runs the same loop with its own tries; this is for tests and benchmarks.)"""
        while (batch := self.next()) is not None:
            self.record(batch, try_batch(batch))
        return self.best
