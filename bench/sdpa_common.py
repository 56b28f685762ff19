"""What the PyTorch baselines and decode benchmarks share: timing with CUDA events, eager and graphed,
their command lines and their markdown tables."""
import argparse
import csv
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


def csv_args():
    """The SDPA baselines' command line, `CSV [--markdown OUT.md]`: (the arguments, the CSV's rows)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    return args, list(csv.DictReader(open(args.csv)))


def batch_lens_args(lens):
    """The decode benchmarks' command line, `[--batch 1,8,64] [--lens LENS] [--markdown OUT.md]`;
    lens: the default cache lengths."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--lens", default=lens)
    ap.add_argument("--markdown", default=None)
    return ap.parse_args()


def table_header(*columns):
    """The first two lines of a markdown table with these columns."""
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def add_row(lines, line):
    """Prints a table row as soon as it is measured and appends it to the table's lines."""
    print(line, flush=True)
    lines.append(line)


def write_markdown(path, lines):
    """The table's lines to the --markdown file, if one was given."""
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
