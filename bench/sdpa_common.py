"""What the PyTorch baselines and decode benchmarks share: timing with CUDA events, eager and graphed."""
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


def graph_ms(fn, replays=20):
    """Milliseconds per replay of a CUDA graph of fn: three warm-up calls on a side stream, the
    capture, then the median over 9 timed runs of `replays` back-to-back replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(lambda: [graph.replay() for _ in range(replays)], warmup=2, reps=9) / replays
