"""Train one arm (dense, nsa, nsa_backbone) of the comparison from scratch, in resumable chunks.

    python3 train/train.py --arm nsa --out-dir out/quality/nsa --resume --time-limit 540

Every arm gets the same data stream, steps, batch, optimizer (AdamW), schedule (linear warmup,
cosine decay to min_lr_frac * lr) and seed; only the attention differs (train/model.py). bf16
autocast on CUDA, fp32 on the CPU.

Chunks: ``--resume`` continues from ``<out-dir>/checkpoint.pt`` when it exists (model, optimizer,
step, tokens, training wall-clock and the data stream's RNG state) and starts fresh otherwise, so
the same command, repeated, finishes the run; it exits at once when the run is complete.
``--time-limit S`` stops before the step that would end past S seconds after the process
started (the checkpoint's measured cost included) and saves a checkpoint; ``--chunk-steps N``
stops after N steps. Model, data and schedule settings are fixed when a run starts: on resume
they come from the checkpoint, and an explicit flag that disagrees is an error.

Output in --out-dir: ``log.jsonl`` (one line per step: step, tokens, wall_s (training time summed
over chunks), loss, lr, step_s, tok_per_s, peak_mem_mib; with retrieval answers in the batch also
answer_loss, answer_acc (their unweighted cross-entropy and argmax accuracy) and answers (how
many); during the distance curriculum max_distance), ``meta.json`` (settings, parameter
counts, data fingerprint, device, versions, one entry per chunk, ``complete``), ``checkpoint.pt``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `train` importable as a package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from train import data as data_mod
from train.model import ARMS, ModelConfig, build_model

# Presets: "gpu" is the comparison on one H200 (the paper's NSA blocks at 16K context); "tiny"
# is the CPU configuration the test suite runs (blocks scaled down so 256 tokens are sparse:
# 8 selection blocks of which n = 4 are attended, a 64-token window; one local block, so that
# with the backbone's forced block one place of the four is still chosen by the scores).
PRESETS = {
    "gpu": dict(layers=8, hidden=512, heads=8, kv_heads=2, seq_len=16384, batch=8, steps=400, lr=1e-3,
                warmup=40, cmp_block_len=32, cmp_stride=16, slc_block_len=64, n_selected=16, n_init=1, n_local=2,
                window=512),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, seq_len=256, batch=4, steps=20, lr=3e-3, warmup=2,
                 cmp_block_len=16, cmp_stride=8, slc_block_len=32, n_selected=4, n_init=1, n_local=1, window=64),
}
# Flags that may change between chunks of one run; every other setting is fixed at the start.
RUN_CONTROL = {"resume", "time_limit", "chunk_steps", "ckpt_every", "print_every", "device", "threads", "out_dir",
               "progress"}
CHECKPOINT = "checkpoint.pt"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (a preset's or a computed default, which the help names)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--arm", choices=ARMS, required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpu",
                   help="defaults for the flags left unset (gpu: 8 x 512, 16K context; tiny: the CPU test)")
    p.add_argument("--out-dir", help="run folder (default out/quality/<arm>)")
    g = p.add_argument_group("model (preset defaults)")
    for name in ("layers", "hidden", "heads", "kv_heads"):
        g.add_argument("--" + name.replace("_", "-"), type=int)
    g.add_argument("--mlp-hidden", type=int, help="SwiGLU width (default 8/3 hidden, multiple of 64)")
    g.add_argument("--rope-theta", type=float, default=10000.0)
    g = p.add_argument_group("NSA (preset defaults; paper names l, d, l', n, w)")
    for name in ("cmp_block_len", "cmp_stride", "slc_block_len", "n_selected", "n_init", "n_local", "window"):
        g.add_argument("--" + name.replace("_", "-"), type=int)
    g.add_argument("--phi", choices=("mean", "linear", "mlp"), default="mlp")
    g.add_argument("--phi-hidden", type=int, help="hidden width of the mlp phi (default: the layer's, 4 x head dim)")
    g.add_argument("--shared-kv", action="store_true", help="one K/V for the three branches (default: independent)")
    g.add_argument("--gate-hidden", type=int, default=0,
                   help="0 (default): the layer's linear gate, sigmoid(Linear(x)); N > 0: an MLP gate N wide")
    g.add_argument("--backbone-max-seqlen", type=int,
                   help="nsa_backbone: the longest sequence its schedule covers (default 4 x seq-len, the "
                        "longest evaluated length)")
    g = p.add_argument_group("data")
    g.add_argument("--seq-len", type=int)
    g.add_argument("--retrieval-frac", type=float, default=0.5, help="share of samples that are retrieval tasks")
    g.add_argument("--multikey-frac", type=float, default=0.5, help="share of retrieval samples that are multikey")
    g.add_argument("--n-keys", type=int, default=4, help="needles per multikey sample")
    g.add_argument("--answer-weight", type=float, default=1.0, help="loss weight of retrieval answer tokens")
    g.add_argument("--queries", type=int, default=1,
                   help="questions at the end of each multikey sample, about distinct needles (<= --n-keys)")
    g.add_argument("--needle-distance-start", type=int, default=0,
                   help="distance curriculum: the queried needle within this many tokens of the question at step 0, "
                        "growing geometrically to the whole sequence (0: off, needles uniform from the start)")
    g.add_argument("--needle-distance-steps", type=int,
                   help="steps over which the curriculum's distance grows to the whole sequence (default: half the run)")
    g.add_argument("--needle-distance-hold", type=int, default=0,
                   help="steps the curriculum stays at --needle-distance-start before it grows")
    g.add_argument("--retrieval-pack", type=int, default=0,
                   help="with the curriculum at distance d: a retrieval row holds samples of max(this, 2 d) tokens back "
                        "to back, each with its own needles and questions (0: one sample per row; a sample must fit "
                        "its needles and questions)")
    g.add_argument("--heldout-percent", type=int, default=5)
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, help="total optimizer steps of the run")
    g.add_argument("--batch", type=int, help="sequences per step")
    g.add_argument("--lr", type=float)
    g.add_argument("--warmup", type=int, help="linear warmup steps")
    g.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine decays to this fraction of lr")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--overfit", action="store_true",
                   help="train on the first batch at every step (a check that the model can fit it)")
    g = p.add_argument_group("run control (may change between chunks)")
    g.add_argument("--resume", action="store_true", help="continue from <out-dir>/checkpoint.pt if it exists")
    g.add_argument("--time-limit", type=float, default=0.0, help="seconds after start to stop and checkpoint (0: none)")
    g.add_argument("--chunk-steps", type=int, default=0, help="stop after this many steps in this process (0: none)")
    g.add_argument("--ckpt-every", type=int, default=100, help="also checkpoint every N steps (0: only at the end)")
    g.add_argument("--print-every", type=int, default=10, help="plain progress line every N steps (without tqdm)")
    g.add_argument("--progress", choices=("auto", "tqdm", "plain", "none"), default="auto")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    g.add_argument("--threads", type=int, default=0, help="CPU threads for torch and the NSA CPU backend (0: default)")
    args = p.parse_args(argv)
    args.explicit = {k for k, v in vars(args).items() if v is not None and v != p.get_default(k)}
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.backbone_max_seqlen is None:
        args.backbone_max_seqlen = 4 * args.seq_len
    if not 1 <= args.queries <= args.n_keys:
        p.error(f"--queries {args.queries}: must be in [1, --n-keys = {args.n_keys}]")
    if not 0 <= args.needle_distance_start <= args.seq_len:
        p.error(f"--needle-distance-start {args.needle_distance_start}: must be in [0, seq-len = {args.seq_len}]")
    if args.needle_distance_steps is None:
        args.needle_distance_steps = max(1, args.steps // 2) if args.needle_distance_start > 0 else 0
    elif args.needle_distance_start > 0 and args.needle_distance_steps < 1:
        p.error(f"--needle-distance-steps {args.needle_distance_steps}: must be >= 1")
    if args.needle_distance_hold < 0 or (args.needle_distance_hold and args.needle_distance_start <= 0):
        p.error(f"--needle-distance-hold {args.needle_distance_hold}: must be >= 0 and needs --needle-distance-start")
    if args.retrieval_pack and not (0 < args.retrieval_pack <= args.seq_len and args.needle_distance_start > 0):
        p.error(f"--retrieval-pack {args.retrieval_pack}: must be in [0, seq-len = {args.seq_len}] (0: off) and needs "
                f"--needle-distance-start")
    if args.out_dir is None:
        args.out_dir = os.path.join("out", "quality", args.arm)
    return args


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=data_mod.VOCAB_SIZE, n_layers=args.layers, hidden=args.hidden, n_heads=args.heads,
                       n_kv_heads=args.kv_heads, mlp_hidden=args.mlp_hidden, rope_theta=args.rope_theta,
                       attention=args.arm, cmp_block_len=args.cmp_block_len, cmp_stride=args.cmp_stride,
                       slc_block_len=args.slc_block_len, n_selected=args.n_selected, n_init=args.n_init,
                       n_local=args.n_local, window=args.window, phi=args.phi, phi_hidden=args.phi_hidden,
                       shared_kv=args.shared_kv, gate_hidden=args.gate_hidden,
                       backbone_max_seqlen=args.backbone_max_seqlen)


def lr_at(step: int, args) -> float:
    """Linear warmup over `warmup` steps, then cosine from lr to min_lr_frac * lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup - 1)
    low = args.lr * args.min_lr_frac
    return low + 0.5 * (args.lr - low) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model, args) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, args.beta2), eps=1e-8)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def git_commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("+dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux: the process's peak RSS


def save_checkpoint(path: Path, state: dict) -> float:
    start = time.perf_counter()
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return time.perf_counter() - start


def load_checkpoint(path: Path, device) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def trim_log(path: Path, step: int) -> None:
    """Drop log lines past the checkpoint's step (written after the last checkpoint of a run that
    was killed), so a resumed run's log continues without duplicates."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


class Progress:
    def __init__(self, mode: str, total: int, initial: int, every: int, label: str):
        self.bar, self.every, self.label, self.total = None, max(1, every), label, total
        if mode in ("auto", "tqdm"):
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc=label)
            except ImportError:
                if mode == "tqdm":
                    raise
        self.plain = self.bar is None and mode != "none"

    def update(self, step: int, loss: float, tps: float, lr: float, step_s: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {loss:.4f}, {tps:,.0f} tok/s, lr {lr:.2e}")
        elif self.plain and (step % self.every == 0 or step == self.total):
            print(f"{self.label} step {step}/{self.total} | loss {loss:.4f} | {tps:,.0f} tok/s | "
                  f"{step_s * 1e3:.0f} ms/step | lr {lr:.2e}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv=None) -> dict:
    t_start = time.perf_counter()
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path, log_path, meta_path = out / CHECKPOINT, out / "log.jsonl", out / "meta.json"
    device = pick_device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    ckpt = None
    if ckpt_path.exists():
        if not args.resume:
            raise SystemExit(f"{ckpt_path} exists: pass --resume to continue it, or choose another --out-dir")
        ckpt = load_checkpoint(ckpt_path, device)
        saved = ckpt["args"]
        for k in sorted(args.explicit - RUN_CONTROL):
            if k in saved and saved[k] != getattr(args, k):
                raise SystemExit(f"--{k.replace('_', '-')} = {getattr(args, k)!r} differs from the run's "
                                 f"{saved[k]!r} in {ckpt_path}: settings are fixed when a run starts")
        for k, v in saved.items():
            if k not in RUN_CONTROL and k != "explicit":
                setattr(args, k, v)
        if ckpt["step"] >= args.steps:
            print(f"{args.arm}: run complete ({ckpt['step']} of {args.steps} steps) in {out}", flush=True)
            return {"step": ckpt["step"], "steps": args.steps, "done": True, "out_dir": str(out)}

    cfg = model_config(args)
    cfg.save_branch_outputs = device.type == "cuda"  # faster NSA backward on CUDA; no effect on the math
    torch.manual_seed(args.seed)
    model = build_model(cfg, seed=args.seed, device=device)
    for layer in model.attention_layers():
        if hasattr(layer, "num_threads"):
            layer.num_threads = args.threads
    optimizer = make_optimizer(model, args)
    train_corpus, _, corpus_info = data_mod.load_corpora(args.heldout_percent)
    stream = data_mod.DataStream(train_corpus, args.seq_len, seed=args.seed, retrieval_frac=args.retrieval_frac,
                                 multikey_frac=args.multikey_frac, n_keys=args.n_keys,
                                 answer_weight=args.answer_weight, distance_start=args.needle_distance_start,
                                 distance_steps=args.needle_distance_steps, queries=args.queries,
                                 pack_len=args.retrieval_pack, distance_hold=args.needle_distance_hold)
    step, tokens_seen, wall = 0, 0, 0.0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        stream.set_state(ckpt["data_rng"])
        torch.set_rng_state(ckpt["torch_rng"])
        step, tokens_seen, wall = ckpt["step"], ckpt["tokens"], ckpt["wall_s"]
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        if meta.get("data", {}).get("fingerprint") not in (None, corpus_info["fingerprint"]):
            print(f"warning: the training data differ from the run's start ({meta['data']['fingerprint']} -> "
                  f"{corpus_info['fingerprint']}): another Python's standard library?", file=sys.stderr)
        trim_log(log_path, step)
        del ckpt
    else:
        if log_path.exists():
            log_path.unlink()
        meta = {
            "arm": args.arm, "args": {k: v for k, v in vars(args).items() if k not in RUN_CONTROL | {"explicit"}},
            "model": cfg.to_dict(), "params": model.param_counts(), "data": corpus_info,
            "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
            "peak_mem": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "process max RSS",
            "chunks": [],
        }
    chunk = {"start_step": step, "device": device_name(device), "torch": torch.__version__,
             "python": platform.python_version(), "commit": git_commit(),
             "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    meta.setdefault("chunks", []).append(chunk)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")

    def state() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "tokens": tokens_seen, "wall_s": wall, "data_rng": stream.state(), "torch_rng": torch.get_rng_state(),
                "args": {k: v for k, v in vars(args).items() if k != "explicit"}, "model_config": cfg.to_dict()}

    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    progress = Progress(args.progress, args.steps, step, args.print_every, args.arm)
    model.train()
    # A checkpoint's cost until one is measured: weights and two Adam moments in fp32 at ~200 MB/s.
    ckpt_cost = 1.0 + 12 * sum(p.numel() for p in model.parameters()) / 200e6
    last_step_s, steps_here, stop_reason = 0.0, 0, "done"
    loss_value, fixed = float("nan"), None
    with log_path.open("a") as log:
        while step < args.steps:
            if args.chunk_steps and steps_here >= args.chunk_steps:
                stop_reason = "chunk-steps"
                break
            # Stop before a step that could not finish, with its checkpoint, inside the limit.
            need = 1.5 * last_step_s + ckpt_cost + 1.0
            if args.time_limit and time.perf_counter() - t_start + need > args.time_limit:
                stop_reason = "time-limit"
                break
            t0 = time.perf_counter()
            lr = lr_at(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if args.overfit:  # the first batch of the stream, at every step
                if fixed is None:
                    fixed = data_mod.DataStream(train_corpus, args.seq_len, seed=args.seed,
                                                retrieval_frac=args.retrieval_frac, multikey_frac=args.multikey_frac,
                                                n_keys=args.n_keys, answer_weight=args.answer_weight
                                                ).next_batch(args.batch)
                tokens_np, weights_np = fixed
                answer_rows = []
            else:
                stream.set_step(step)
                tokens_np, weights_np = stream.next_batch(args.batch)
                answer_rows = stream.last_answers
            tokens = torch.from_numpy(tokens_np).to(device, non_blocking=True)
            weights = None if weights_np is None else torch.from_numpy(weights_np).to(device)
            answers, n_answers = None, sum(len(r) for r in answer_rows)
            if n_answers:
                mask = np.zeros((args.batch, args.seq_len), dtype=bool)
                for b, r in enumerate(answer_rows):
                    mask[b, r] = True
                answers = torch.from_numpy(mask).to(device)
            distance = None if args.overfit else stream.max_distance()
            with autocast:
                loss, answer_loss, answer_acc = model.loss_terms(tokens, weights, answers)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = loss.item()  # synchronises: step_s is the step's real time
            if not math.isfinite(loss_value):
                raise SystemExit(f"{args.arm}: loss is {loss_value} at step {step + 1}")
            last_step_s = time.perf_counter() - t0
            step += 1
            steps_here += 1
            tokens_seen += args.batch * args.seq_len
            wall += last_step_s
            tps = args.batch * args.seq_len / last_step_s
            row = {"step": step, "tokens": tokens_seen, "wall_s": round(wall, 4), "loss": loss_value, "lr": lr,
                   "step_s": round(last_step_s, 5), "tok_per_s": round(tps, 1),
                   "peak_mem_mib": round(peak_memory_mib(device), 1)}
            if answers is not None:  # the retrieval answers' targets of this batch (unweighted)
                row.update(answer_loss=round(answer_loss.item(), 5), answer_acc=round(answer_acc.item(), 5),
                           answers=n_answers)
            if distance is not None:
                row["max_distance"] = distance
            log.write(json.dumps(row) + "\n")
            log.flush()
            progress.update(step, loss_value, tps, lr, last_step_s)
            if args.ckpt_every and step % args.ckpt_every == 0 and step < args.steps:
                ckpt_cost = save_checkpoint(ckpt_path, state())
    progress.close()
    ckpt_cost = save_checkpoint(ckpt_path, state())
    chunk.update(end_step=step, steps=steps_here, stop=stop_reason, seconds=round(time.perf_counter() - t_start, 2),
                 peak_mem_mib=round(peak_memory_mib(device), 1))
    meta["complete"] = step >= args.steps
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    print(f"{args.arm}: step {step}/{args.steps} ({stop_reason}), loss {loss_value:.4f}, "
          f"checkpoint {ckpt_path} ({ckpt_cost:.1f} s)", flush=True)
    return {"step": step, "steps": args.steps, "done": step >= args.steps, "loss": loss_value,
            "out_dir": str(out), "stop": stop_reason}


if __name__ == "__main__":
    main()
