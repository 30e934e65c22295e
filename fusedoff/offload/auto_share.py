"""``host_share="auto"``: the host's share of a step chosen from what the steps themselves measure.

[note: the automatic host share] A step with a host share runs two paths at once (see [note: the
host share of a step] in host_share.py), and ends when the slower one does:

  device  from the step's start on the device to its last streamed chunk copied back (and the main
          stream's own work: resident tensors); it includes the copies down of the host share's
          gradients and parameters, queued first on the same copy stream;
  host    from the same start to those copies down being done, then the host kernels' time on the
          worker.

Each step's times give, at the share x it ran with (host-computed elements over the elements not
resident), the seconds per unit of share of each path's own work: a = (device - down) / (1 - x) for
the streamed chunks, b = host kernels / x for the host, and down / x for the copies down, which both
paths wait for. Linear in the share, the two paths are equal at x* = a / (a + b): the predicted
best share. The model is a guide, not the judge: host memory is shared by the copies and the host
kernels, so a path's rate changes with the share. The steps at each placed share are measured, and
after `MEASURED_STEPS` steps at one placement (their median step):

  * if another share measured a step shorter by more than `NOISE`, the share goes back to it;
  * else, if x* is not within `SAME_SHARE` of a share already measured or moved to (whole tensors
    are placed: a share may place as another one) and its predicted step is at
    least `MIN_GAIN` shorter than the best measured one, the share moves to x* (and is measured);
  * else it stays. A share measured again that moved by more than `MIN_GAIN` from what it measured
    before (another load on the host, a longer sequence) makes the other measurements stale: they are
    dropped, and the model may explore again.

So the share never stays where a measured share was faster, never flips between two it has measured,
and re-places (each time copying every state once in host memory) only on a measured or predicted
gain. The first `MEASURED_STEPS` steps run share 0 (streaming only: the measurement to beat), the next
`PROBE_SHARE`, so that the host's path is measured too; a probe whose tensors all exceed it hosts
nothing (see [note: the host share] in placement.py): it doubles, up to `MAX_PROBE`. Steps that
GradScaler skipped are not measured (the host kernels return at once). A share that would host the
same tensors as the placed one moves nothing (placement.py's `share_changed`).

What it measures includes what the host shares with others: the copies' and the host kernels' use
of host memory, and the other ranks of a node, which step at the same time as this one (each rank
measures its own steps while the others run theirs, and decides for itself; every result is the
same bit for bit whatever each decides).

Where nothing can be measured (a runtime without
timers: the host loopback, the simulator) or a tensor's result would depend on where it was stepped
(see `check_host_computable`), "auto" is 0.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PROBE_SHARE = 0.1
MIN_GAIN = 0.05
NOISE = 0.01  # two measured steps closer than this are the same
MEASURED_STEPS = 5
RETURNS = 2  # returns to a measured share on less than MIN_GAIN: after these, a return needs MIN_GAIN
MAX_PROBE = 0.5
# A best share this close to the one placed is that one: whole tensors move, and a share the
# placement cannot reach (every tensor larger than the difference) would re-place for nothing.
SAME_SHARE = 0.02
AUTO = "auto"


@dataclass(frozen=True)
class StepTimes:
    """What one step measured on one device (see [note: the automatic host share])."""

    hosted: int  # elements the host stepped
    streamed: int  # elements whose states streamed
    device_s: float
    down_s: float  # the host share's copies down done (0: none)
    host_s: float  # the host kernels' time on the worker
    measured_s: float | None = None  # the step's start to its last copy back, host share's included

    @property
    def share(self) -> float:
        outside = self.hosted + self.streamed
        return self.hosted / outside if outside else 0.0

    @property
    def step_s(self) -> float:
        """The step measured where it was, else the longer of its two paths."""
        if self.measured_s is not None:
            return self.measured_s
        return max(self.device_s, self.down_s + self.host_s if self.hosted else 0.0)


@dataclass
class AutoShare:
    """The automatic host share of one device: its measurements and the share they chose."""

    share: float = 0.0  # the share placed next (a target: whole tensors are placed)
    replans: int = 0  # times the share moved
    last: StepTimes | None = None
    predicted_s: float | None = None  # the step the model predicted for `share` when it moved there
    measured: dict[float, float] = field(default_factory=dict)  # placed share -> its median step (seconds)
    _device_rates: list[float] = field(default_factory=list)  # a: seconds per unit of streamed share
    _host_rates: list[float] = field(default_factory=list)  # b: seconds per unit of host share
    _down_rates: list[float] = field(default_factory=list)
    _steps: list[float] = field(default_factory=list)  # the steps measured at this placement
    _tried: list[float] = field(default_factory=list)  # the model's shares moved to (placed or not)
    _probed: bool = False
    _returns: int = 0

    def observe(self, times: StepTimes) -> bool:
        """One step's times; True where the share moved (the engine places afresh)."""
        self.last, x = times, times.share
        if times.streamed and x < 1.0:
            _push(self._device_rates, (times.device_s - times.down_s) / (1.0 - x))
        if times.hosted and x > 0.0:
            _push(self._host_rates, times.host_s / x)
            _push(self._down_rates, times.down_s / x)
        _push(self._steps, times.step_s)
        if len(self._steps) < MEASURED_STEPS:
            return False
        placed, step = round(x, 6), statistics.median(self._steps)
        before = self.measured.get(placed)
        if before is not None and abs(step - before) > MIN_GAIN * before:  # the balance moved
            self.measured.clear()
            self._tried.clear()
            self._returns = 0
        self.measured[placed] = step
        best, best_step = min(self.measured.items(), key=lambda item: item[1])
        if best_step < (1.0 - (NOISE if self._returns < RETURNS else MIN_GAIN)) * step:
            self._returns += 1
            # (as placed, a hair more: the placement takes each tensor that fits in the share)
            return self._move(min(1.0, best + 1e-9) if best else 0.0, None)
        if not self._probed:
            self._probed = True
            return self._move(PROBE_SHARE, None) if x == 0.0 else False
        if not self._host_rates:  # the probe hosted nothing (every tensor larger): a larger one
            return self._move(min(MAX_PROBE, 2.0 * self.share), None) if 0.0 < self.share < MAX_PROBE else False
        if not self._device_rates:
            return False
        a, b = statistics.median(self._device_rates), statistics.median(self._host_rates)
        down = statistics.median(self._down_rates)
        target = a / (a + b) if a + b > 0 else 0.0
        predicted = predicted_step(target, a, b, down)
        explored = [*self.measured, *self._tried]
        if any(abs(target - share) < SAME_SHARE for share in explored) or predicted > (1.0 - MIN_GAIN) * best_step:
            return False
        self._tried.append(target)
        return self._move(target, predicted)

    def _move(self, share: float, predicted: float | None) -> bool:
        self.share, self.predicted_s = share, predicted
        self.replans += 1
        self._steps = []
        return True

    def placed(self) -> None:
        """The placement was made afresh for another reason: its steps start counting again."""
        self._steps = []

    def report(self) -> dict:
        """``memory_stats()["host_share_auto"]``'s entry for this device."""
        last = self.last
        return {
            "share": self.share,
            "replans": self.replans,
            "measured_step_s": dict(sorted(self.measured.items())),
            "seconds_per_share": {"device": _median(self._device_rates), "host": _median(self._host_rates),
                                  "copies_down": _median(self._down_rates)},
            "predicted_step_s": self.predicted_s,
            "last_step": None if last is None else {"share": last.share, "device_s": last.device_s,
                                                    "host_s": last.down_s + last.host_s if last.hosted else 0.0,
                                                    "measured_step_s": last.measured_s},
        }


@dataclass
class _Timing:
    """One step's timers on one device, read at a later step (never waited for)."""

    runtime: object
    start: object
    runs: list  # the step's BucketRuns on this device (until `stop`)
    hosted: int
    streamed: int
    ends: list = field(default_factory=list)  # the device's work done (main stream, the copies back)
    hosts: list = field(default_factory=list)  # the HostShares that ran
    # Taken at the first look, once the host waited for the worker (the next step overwrites them):
    # each host share's (copies down, copy back) timers, the host kernels' seconds, a skipped step.
    host_timers: list | None = None
    host_s: float = 0.0
    skipped: bool = False
    looks: int = 0


PENDING = 4  # steps whose timers are looked at again while not complete (then dropped)


class AutoShares:
    """The automatic host shares of one engine's devices (see [note: the automatic host share]):
    their controllers over the engine's life, and the timers of its last step."""

    def __init__(self) -> None:
        self.by_device: dict = {}
        self._pending: list[_Timing] = []

    def share(self, option: float | str, device, measurable: bool) -> float:
        """The share a bucket on `device` is placed with for the group option `option` (a fraction,
        or "auto": this device's automatic share where the bucket is `measurable`, else 0)."""
        if option != AUTO:
            return float(option)
        if not measurable:
            return 0.0
        return self.by_device.setdefault(device, AutoShare()).share

    def start(self, runs) -> list[_Timing]:
        """Timers at the start of a step's `runs` (BucketRuns), on each device with an automatic share."""
        by_device: dict = {}
        for run in runs:
            if run.bucket.auto_share:
                by_device.setdefault(run.bucket.device, []).append(run)
        timings = []
        for device, device_runs in by_device.items():
            hosted = sum(run.hosted_numel for run in device_runs)
            streamed = sum(run.streamed_numel for run in device_runs)
            if hosted + streamed:
                rt = device_runs[0].bucket.runtime
                timings.append(_Timing(rt, rt.timer(rt.current_stream()), device_runs, hosted, streamed))
        return timings

    def stop(self, timings: list[_Timing]) -> None:
        """Timers at the end of the step's device work (its queueing done); read at a later step."""
        for timing in timings:
            rt = timing.runtime
            pipelines = {id(run.bucket.pipeline): run.bucket.pipeline for run in timing.runs}
            timing.hosts = [run.bucket.host for run in timing.runs if run.host is not None]
            timing.ends = [rt.timer(rt.current_stream())]
            timing.ends += [rt.timer(p.copy_out) for p in pipelines.values() if p is not None]
            timing.runs = []
        self._pending = [*self._pending, *timings][-PENDING:]

    def discard(self) -> None:
        """The step failed after `stop`: its times are not a step's."""
        self._pending = []

    def observe(self) -> None:
        """Feeds the steps' times to each device's controller, once their timers are complete (never
        waiting for them: a step whose timers are not is looked at again at the next steps, up to
        PENDING of them). The host has waited for the worker of each step before (its join, or the
        next step's): the host kernels' seconds are written. Steps that GradScaler skipped (found_inf:
        the host kernels changed nothing) are not measurements of a step."""
        pending, self._pending = self._pending, []
        for timing in pending:
            rt = timing.runtime
            if rt.capturing():  # (an event query would end a graph capture)
                self._pending.append(timing)
                continue
            if timing.host_timers is None:
                timing.host_timers = [(h.copied_down, h.copied_up) for h in timing.hosts]
                timing.host_s = sum(rt.task_seconds(h.last_task, h.compute_s) for h in timing.hosts)
                timing.skipped = any(h.skipped for h in timing.hosts)
                timing.hosts = []
            if timing.skipped:
                continue
            ends = [rt.seconds(timing.start, end) for end in timing.ends]
            downs = [rt.seconds(timing.start, down) for down, _ in timing.host_timers]
            ups = [rt.seconds(timing.start, up) for _, up in timing.host_timers]
            if any(t is None for t in (*ends, *downs, *ups)):
                timing.looks += 1
                if timing.looks < PENDING:
                    self._pending.append(timing)
                continue
            times = StepTimes(timing.hosted, timing.streamed, device_s=max(ends), down_s=min(downs, default=0.0),
                              host_s=timing.host_s, measured_s=max(ends + ups))
            auto = self.by_device.get(rt.device)
            if auto is not None:  # (None: its buckets were placed afresh under overlap_with, at 0)
                auto.observe(times)

    def placed(self) -> None:
        """Every bucket placed afresh for another reason than a share moved."""
        for auto in self.by_device.values():
            auto.placed()

    def report(self) -> dict | None:
        """``memory_stats()["host_share_auto"]``: by device (None: no automatic share)."""
        return {str(device): auto.report() for device, auto in self.by_device.items() if auto.last is not None} or None


def predicted_step(x: float, a: float, b: float, down: float) -> float:
    """The step at share `x` from the rates per unit of share: the device path (the copies down
    and the streamed chunks) and the host path (the copies down and the host kernels)."""
    return max(down * x + a * (1.0 - x), (down + b) * x if x > 0.0 else 0.0)


def _push(values: list[float], value: float) -> None:
    values.append(max(value, 0.0))
    del values[:-MEASURED_STEPS]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


__all__ = ["AUTO", "AutoShare", "AutoShares", "MEASURED_STEPS", "MIN_GAIN", "NOISE", "PROBE_SHARE", "StepTimes", "predicted_step"]
