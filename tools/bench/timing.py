"""The one timer of every benchmark family: the method of /work/shared/peers.md, so figures compare.

CUDA events around one call, a 256 MiB write before each call to flush L2, the median over the timed
calls after warm-up; two times per call: gpu (a GPU spin queued before the start event, so the whole
call is queued before the clock starts: pure GPU time) and ev (plain events after a synchronize: the
host's launch time shows whenever the host is slower than the GPU).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable


def median(v):
    return statistics.median(v) if v else float("nan")


def p90(v):
    s = sorted(v)
    return s[min(len(s) - 1, int(0.9 * len(s)))] if s else float("nan")


class GpuTimer:
    """CUDA-event timing of one call at a time, L2 flushed before each call."""

    def __init__(self, torch, device: str, reps: int, warmup: int, flush_bytes: int = 256 << 20):
        self.torch = torch
        self.reps = reps
        self.warmup = warmup
        self.flush_buf = torch.empty(flush_bytes // 4, dtype=torch.int32, device=device)
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.has_sleep = hasattr(torch.cuda, "_sleep")
        self.cycles_per_us = self._calibrate_sleep() if self.has_sleep else 0.0

    def _calibrate_sleep(self) -> float:
        torch = self.torch
        cycles = 1_000_000
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        ms = []
        for _ in range(5):
            self.start.record()
            torch.cuda._sleep(cycles)
            self.end.record()
            self.end.synchronize()
            ms.append(self.start.elapsed_time(self.end))
        return cycles / max(median(ms) * 1e3, 1e-3)

    def flush(self):
        self.flush_buf.zero_()

    def _gpu_pass(self, fn, prep, sleep_us, reps):
        torch = self.torch
        cycles = int(sleep_us * self.cycles_per_us)
        times, host, late = [], [], 0
        for _ in range(reps):
            prep()
            self.flush()
            t0 = time.perf_counter()
            if cycles:
                torch.cuda._sleep(cycles)
            self.start.record()
            t1 = time.perf_counter()
            fn()
            t2 = time.perf_counter()
            self.end.record()
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            times.append(self.start.elapsed_time(self.end))
            host.append((t2 - t1) * 1e6)
            late += (t3 - t0) * 1e6 > sleep_us
        return times, host, late

    def time(self, fn: Callable[[], object], prep: Callable[[], object] | None = None,
             reps: int | None = None, warmup: int | None = None) -> dict:
        """Median gpu and ev times of fn() in ms, with min/p90, host enqueue time and the spin used.
        reps/warmup override the run's (--reps, --warmup) for calls that take seconds (e79's peers)."""
        torch = self.torch
        prep = prep or (lambda: None)
        reps = self.reps if reps is None else reps
        warmup = self.warmup if warmup is None else warmup
        warm = []
        for _ in range(warmup):
            prep()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            warm.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        # The spin must outlast the host's enqueueing of the whole call, or the gpu time would
        # include host gaps; a host-bound call (autograd, torch.compile guards) needs a longer one.
        sleep_us = min(max(100.0, 2.0 * median(warm) + 50.0), 50_000.0) if self.has_sleep else 0.0
        for _ in range(3):
            gpu, host, late = self._gpu_pass(fn, prep, sleep_us, reps)
            if not self.has_sleep or late <= reps // 10 or sleep_us >= 50_000.0:
                break
            sleep_us = min(sleep_us * 4, 50_000.0)
        ev = []
        for _ in range(reps):
            prep()
            self.flush()
            torch.cuda.synchronize()
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            ev.append(self.start.elapsed_time(self.end))
        return {
            "gpu_ms": median(gpu), "gpu_min_ms": min(gpu), "gpu_p90_ms": p90(gpu),
            "ev_ms": median(ev), "ev_min_ms": min(ev), "ev_p90_ms": p90(ev),
            "host_us": median(host), "sleep_us": sleep_us, "not_fully_queued": late if self.has_sleep else None,
            "reps": reps,
        }


    def time_rounds(self, fns: list, rounds: int = 10, per_round: int | None = None,
                    warmup: int | None = None) -> list:
        """Several callables (fns[0] the base, kspec's) timed interleaved, so that a slow stretch of the host
        moves all of them alike instead of deciding one row: `rounds` rounds, in each every fn in turn (round
        r starting at fn r), `per_round` calls of gpu and ev timing each (default reps / rounds, at least 5).
        Per fn: gpu_ms and ev_ms the median over rounds of the round's median (min/p90 over the rounds'),
        host_us likewise, and x_gpu / x_ev the median over rounds of that round's ratio, this fn's time over
        fns[0]'s (> 1: the base is faster), and gpu_rounds_ms / ev_rounds_ms the rounds' medians in order (for
        ratios to another fn, round by round: round_ratio). Each fn's spin (gpu) is sized from its own warm-up, grown for the
        next round where more than a tenth of a round's calls were not queued behind it."""
        torch = self.torch
        warmup = self.warmup if warmup is None else warmup
        per_round = per_round or max(5, self.reps // rounds)
        sleep = []
        for fn in fns:
            warm = []
            for _ in range(warmup):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                warm.append((time.perf_counter() - t0) * 1e6)
                torch.cuda.synchronize()
            sleep.append(min(max(100.0, 2.0 * median(warm) + 50.0), 50_000.0) if self.has_sleep else 0.0)
        n = len(fns)
        gpu, ev, host, late = ([[] for _ in fns] for _ in range(4))
        for r in range(rounds):
            for k in range(n):
                i = (r + k) % n
                g, h, lt = self._gpu_pass(fns[i], lambda: None, sleep[i], per_round)
                if self.has_sleep and lt > per_round // 10:
                    sleep[i] = min(sleep[i] * 4, 50_000.0)
                e = []
                for _ in range(per_round):
                    self.flush()
                    torch.cuda.synchronize()
                    self.start.record()
                    fns[i]()
                    self.end.record()
                    self.end.synchronize()
                    e.append(self.start.elapsed_time(self.end))
                gpu[i].append(median(g))
                ev[i].append(median(e))
                host[i].append(median(h))
                late[i].append(lt)
        out = []
        for i in range(n):
            out.append({
                "gpu_ms": median(gpu[i]), "gpu_min_ms": min(gpu[i]), "gpu_p90_ms": p90(gpu[i]),
                "ev_ms": median(ev[i]), "ev_min_ms": min(ev[i]), "ev_p90_ms": p90(ev[i]),
                "host_us": median(host[i]), "sleep_us": sleep[i],
                "not_fully_queued": sum(late[i]) if self.has_sleep else None,
                "x_gpu": median([a / b for a, b in zip(gpu[i], gpu[0])]),
                "x_ev": median([a / b for a, b in zip(ev[i], ev[0])]),
                "gpu_rounds_ms": gpu[i], "ev_rounds_ms": ev[i], "rounds": rounds, "reps": rounds * per_round,
            })
        return out


def round_ratio(a: dict, b: dict, key: str = "gpu") -> float:
    """The median over rounds of a's time over b's in the same round (two results of one time_rounds call)."""
    return median([x / y for x, y in zip(a[f"{key}_rounds_ms"], b[f"{key}_rounds_ms"])])


def host_per_call_us(fn, sync, calls: int, repeats: int = 5) -> dict:
    """Host wall clock of `calls` back-to-back calls, divided by `calls` (median of `repeats`)."""
    for _ in range(min(calls, 200)):
        fn()
    sync()
    per_call, with_sync = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        per_call.append((t1 - t0) / calls * 1e6)
        with_sync.append((t2 - t0) / calls * 1e6)
    return {"us": median(per_call), "min_us": min(per_call), "us_incl_sync": median(with_sync),
            "calls": calls, "repeats": repeats}
