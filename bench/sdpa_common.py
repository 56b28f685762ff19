"""What the PyTorch SDPA baselines share: timing with CUDA events."""
import statistics

import torch


def time_ms(fn, warmup=2, reps=7):
    """Median milliseconds of fn over reps timed runs after warmup runs (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
