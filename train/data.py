"""Offline training data: Python's own standard library as text, plus synthetic retrieval.

Nothing is downloaded. The language-modelling text is every ``.py`` file of the standard library
of the interpreter that runs this (``sysconfig.get_paths()['stdlib']``, without site-packages),
split into train and held-out *by file*: a file is held out when ``crc32(relative path) % 100 <
heldout_percent``, so the split depends only on the file's path, not on the machine's folder
layout or the order of a directory listing. Another Python version ships other files: compare
arms trained by the same interpreter (``corpus_info`` records its version and a fingerprint).

Tokens are bytes (0..255) plus three specials, so there is no tokenizer to train or fetch:

  BOS     starts every source file
  NEEDLE  brackets a planted fact: NEEDLE key value NEEDLE
  QUERY   starts the question at the end of a retrieval sample: QUERY key -> value

Retrieval samples are ``length + 1`` tokens (inputs ``[:-1]``, targets ``[1:]``):
``BOS haystack... NEEDLE key value NEEDLE ...haystack QUERY key value``, where the haystack is a
window of the corpus and the queried needle sits at ``depth`` (0: right after BOS, 1: right
before the query) of the haystack.

  passkey   one needle, key " pass key: ", value 5 random digits
  multikey  ``n_keys`` needles with distinct random 3-letter keys (" abc=") and 5-digit values at
            independent uniform depths; the query asks for one of them (associative recall)
"""
from __future__ import annotations

import functools
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

BOS = 256
NEEDLE = 257
QUERY = 258
VOCAB_SIZE = 264  # 256 bytes + 3 specials, rounded up to a multiple of 8 for the matrix shapes

TASKS = ("passkey", "multikey")
_PASSKEY_KEY = b" pass key: "
_DIGITS = 5


def encode(text) -> np.ndarray:
    """Bytes (or str as UTF-8) -> int64 tokens."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def decode(tokens) -> str:
    """Tokens -> text; specials shown as <bos>, <needle>, <query>."""
    names = {BOS: "<bos>", NEEDLE: "<needle>", QUERY: "<query>"}
    out, run = [], bytearray()
    for t in (int(x) for x in tokens):
        if t < 256:
            run.append(t)
            continue
        out.append(run.decode("utf-8", "replace"))
        run = bytearray()
        out.append(names.get(t, f"<{t}>"))
    out.append(run.decode("utf-8", "replace"))
    return "".join(out)


# ---- the corpus -----------------------------------------------------------------------------


@dataclass
class Corpus:
    tokens: np.ndarray  # [N] uint16: BOS + bytes of each file, files in path order
    files: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def window(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n consecutive tokens [n] int64 from a uniform random start."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        if n > len(self):
            raise ValueError(f"window of {n} tokens: the corpus has only {len(self)}")
        start = int(rng.integers(0, len(self) - n + 1))
        return self.tokens[start:start + n].astype(np.int64)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: Optional[str] = None) -> List[Tuple[str, str]]:
    """(relative posix path, absolute path) of every .py file under the standard library, sorted."""
    root = root or stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found.append((os.path.relpath(path, root).replace(os.sep, "/"), path))
    return sorted(found)


def is_heldout(relpath: str, heldout_percent: int) -> bool:
    return zlib.crc32(relpath.encode("utf-8")) % 100 < heldout_percent


@functools.lru_cache(maxsize=4)
def load_corpora(heldout_percent: int = 5, root: Optional[str] = None) -> Tuple[Corpus, Corpus, dict]:
    """(train, held-out, info) from the standard library's source files."""
    if not 0 < heldout_percent < 100:
        raise ValueError(f"heldout_percent = {heldout_percent}: must be in 1..99")
    parts = {False: [], True: []}
    for rel, path in stdlib_files(root):
        with open(path, "rb") as f:
            body = f.read()
        parts[is_heldout(rel, heldout_percent)].append(np.concatenate(
            [np.array([BOS], dtype=np.uint16), np.frombuffer(body, dtype=np.uint8).astype(np.uint16)]))
    if not parts[False] or not parts[True]:
        raise RuntimeError(f"no standard-library sources found under {root or stdlib_root()}")
    train = Corpus(np.concatenate(parts[False]), len(parts[False]))
    held = Corpus(np.concatenate(parts[True]), len(parts[True]))
    info = {
        "source": "python stdlib .py files", "stdlib": root or stdlib_root(), "python": sys.version.split()[0],
        "heldout_rule": f"crc32(relative path) % 100 < {heldout_percent}",
        "train_files": train.files, "heldout_files": held.files,
        "train_tokens": len(train), "heldout_tokens": len(held),
        "fingerprint": f"{zlib.crc32(train.tokens.tobytes()):08x}-{zlib.crc32(held.tokens.tobytes()):08x}",
    }
    return train, held, info


# ---- samples --------------------------------------------------------------------------------


@dataclass
class Sample:
    tokens: np.ndarray  # [length + 1] int64
    answer: Optional[Tuple[int, int]] = None  # answer tokens' span [start, end) in tokens
    needle: Optional[Tuple[int, int]] = None  # the queried needle's value span [start, end)
    depth: float = 0.0
    more_answers: Tuple[Tuple[int, int], ...] = ()  # the spans of further queries' answers

    def answer_rows(self) -> np.ndarray:
        """The input positions whose next-token prediction is an answer token (every query's)."""
        if self.answer is None:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(a - 1, b - 1) for a, b in (self.answer, *self.more_answers)])


def lm_sample(rng: np.random.Generator, corpus: Corpus, length: int) -> Sample:
    return Sample(corpus.window(rng, length + 1))


def _digits(rng: np.random.Generator, n: int) -> bytes:
    return bytes(int(d) + ord("0") for d in rng.integers(0, 10, n))


def _keys(rng: np.random.Generator, n: int) -> List[bytes]:
    seen: List[bytes] = []
    while len(seen) < n:
        key = b" " + bytes(int(c) + ord("a") for c in rng.integers(0, 26, 3)) + b"="
        if key not in seen:
            seen.append(key)
    return seen


def retrieval_sample(rng: np.random.Generator, corpus: Corpus, length: int, task: str,
                     depth: Optional[float] = None, n_keys: int = 4, max_distance: Optional[int] = None,
                     queries: int = 1) -> Sample:
    """One retrieval sample of length + 1 tokens; the queried needle at `depth` (uniform if None).
    max_distance (with depth None): the queried needle uniform among the last max_distance haystack
    tokens before the question instead of over the whole haystack (the same random draw, scaled:
    other needles stay uniform). queries (multikey): the sample ends with that many questions
    ``QUERY key value`` about distinct needles (max_distance then bounds each asked needle); the
    first is the one `depth`, `needle` and `answer` describe, the others' answers are in
    more_answers. queries = 1 draws exactly as before the option existed."""
    if task == "passkey":
        facts = [(_PASSKEY_KEY, _digits(rng, _DIGITS))]
        asked = [0]
    elif task == "multikey":
        if not 1 <= queries <= n_keys:
            raise ValueError(f"queries = {queries}: must be in [1, n_keys = {n_keys}]")
        facts = [(key, _digits(rng, _DIGITS)) for key in _keys(rng, n_keys)]
        asked = [int(rng.integers(0, n_keys))] if queries == 1 else [int(i) for i in rng.permutation(n_keys)[:queries]]
    else:
        raise ValueError(f"task = {task!r}: must be one of {TASKS}")
    depths = [float(rng.random()) for _ in facts]
    if depth is not None:
        depths[asked[0]] = float(depth)
    needles = [np.concatenate([[NEEDLE], encode(k), encode(v), [NEEDLE]]) for k, v in facts]
    questions = [(np.concatenate([[QUERY], encode(facts[i][0])]), encode(facts[i][1])) for i in asked]
    hay_len = length + 1 - 1 - sum(len(n) for n in needles) - sum(len(q) + len(a) for q, a in questions)
    if hay_len < 0:
        raise ValueError(f"length = {length}: too short for a {task} sample (needs >= {length - hay_len})")
    if depth is None and max_distance is not None:
        for i in asked:
            depths[i] = 1.0 - depths[i] * min(1.0, max_distance / max(hay_len, 1))
    hay = corpus.window(rng, hay_len)
    order = sorted(range(len(facts)), key=lambda i: (round(depths[i] * hay_len), i))
    out, prev, value_span = [np.array([BOS])], 0, None
    at = 1
    for i in order:
        off = int(round(depths[i] * hay_len))
        out.append(hay[prev:off])
        at += off - prev
        if i == asked[0]:
            start = at + 1 + len(facts[i][0])
            value_span = (start, start + len(facts[i][1]))
        out.append(needles[i])
        at += len(needles[i])
        prev = off
    out.append(hay[prev:])
    at += hay_len - prev
    answers = []
    for question, answer in questions:
        at += len(question)
        answers.append((at, at + len(answer)))
        out += [question, answer]
        at += len(answer)
    tokens = np.concatenate(out).astype(np.int64)
    assert tokens.shape[0] == length + 1
    return Sample(tokens, answers[0], value_span, depths[asked[0]], tuple(answers[1:]))


class DataStream:
    """The training batches: plain text windows mixed with retrieval samples.

    Each sample is retrieval with probability `retrieval_frac` (then multikey with probability
    `multikey_frac`, else passkey). All randomness comes from one numpy Generator whose state a
    checkpoint saves, so a resumed run sees exactly the batches a single run would have seen.

    Distance curriculum (distance_start > 0): at step s (set_step) the queried needle lies within
    distance_start haystack tokens of the question while s < distance_hold, then within
    distance_start * (seq_len / distance_start) ** ((s - distance_hold) / distance_steps), growing
    geometrically to the whole sequence at step distance_hold + distance_steps, uniform after.
    It depends only on the step, so a resumed run draws the same samples too.

    queries > 1: every multikey sample ends with that many questions about distinct needles
    (associative recall with several queries: more answer tokens to learn from per sample).

    pack_len > 0 (with the curriculum): while the curriculum bounds the distance to d, a retrieval
    row is several retrieval samples back to back, each max(pack_len, 2 d) tokens (the last takes
    what is left), every one with its own needles, questions and answers. Short distances then
    teach the lookup from many samples per row instead of one; from d >= seq_len / 4 on a row is
    one sample again. The samples of a row are not isolated: a question can see earlier samples'
    needles, which are farther away than its own.
    """

    def __init__(self, corpus: Corpus, seq_len: int, seed: int, retrieval_frac: float = 0.5,
                 multikey_frac: float = 0.5, n_keys: int = 4, answer_weight: float = 1.0,
                 distance_start: int = 0, distance_steps: int = 0, queries: int = 1, pack_len: int = 0,
                 distance_hold: int = 0):
        if not 0.0 <= retrieval_frac <= 1.0 or not 0.0 <= multikey_frac <= 1.0:
            raise ValueError(f"retrieval_frac = {retrieval_frac}, multikey_frac = {multikey_frac}: must be in [0, 1]")
        if distance_start < 0 or distance_start > seq_len or (distance_start > 0 and distance_steps < 1):
            raise ValueError(f"distance_start = {distance_start}, distance_steps = {distance_steps}: the start must be "
                             f"in [0, seq_len = {seq_len}] (0: off), and the steps >= 1 with a start")
        self.corpus, self.seq_len = corpus, seq_len
        self.retrieval_frac, self.multikey_frac = retrieval_frac, multikey_frac
        if not 1 <= queries <= n_keys:
            raise ValueError(f"queries = {queries}: must be in [1, n_keys = {n_keys}]")
        self.n_keys, self.answer_weight, self.queries = n_keys, answer_weight, queries
        if pack_len < 0 or pack_len > seq_len or (pack_len > 0 and distance_start <= 0):
            raise ValueError(f"pack_len = {pack_len}: must be in [0, seq_len = {seq_len}] (0: off), and needs the "
                             f"distance curriculum (distance_start = {distance_start})")
        if distance_hold < 0:
            raise ValueError(f"distance_hold = {distance_hold}: must be >= 0")
        self.distance_start, self.distance_steps, self.pack_len = distance_start, distance_steps, pack_len
        self.distance_hold = distance_hold
        self.step = 0
        self.last_answers: List[np.ndarray] = []
        self.rng = np.random.default_rng(seed)

    def set_step(self, step: int) -> None:
        self.step = step

    def max_distance(self) -> Optional[int]:
        """The curriculum's bound on the queried needle's distance at this step (None: uniform)."""
        grown = self.step - self.distance_hold
        if self.distance_start <= 0 or grown >= self.distance_steps:
            return None
        grow = (self.seq_len / self.distance_start) ** (max(grown, 0) / self.distance_steps)
        return int(round(self.distance_start * grow))

    def sample(self) -> Sample:
        if self.rng.random() < self.retrieval_frac:
            bound = self.max_distance()
            part = self.seq_len if not self.pack_len or bound is None else max(self.pack_len, 2 * bound)
            if 2 * part > self.seq_len:
                return self._retrieval(self.seq_len, bound)
            return self._packed(part, bound)
        return lm_sample(self.rng, self.corpus, self.seq_len)

    def _retrieval(self, length: int, bound: Optional[int]) -> Sample:
        task = "multikey" if self.rng.random() < self.multikey_frac else "passkey"
        return retrieval_sample(self.rng, self.corpus, length, task, None, self.n_keys, bound,
                                self.queries if task == "multikey" else 1)

    def _packed(self, part: int, bound: Optional[int]) -> Sample:
        """A row of seq_len + 1 tokens holding retrieval samples of part + 1 tokens each (the last
        one longer by the remainder); the first sample's answer, needle and depth describe the row,
        every other answer is in more_answers."""
        count = (self.seq_len + 1) // (part + 1)
        lengths = [part] * (count - 1) + [self.seq_len - (count - 1) * (part + 1)]
        pieces, answers, first, at = [], [], None, 0
        for length in lengths:
            s = self._retrieval(length, bound)
            pieces.append(s.tokens)
            answers += [(at + a, at + b) for a, b in (s.answer, *s.more_answers)]
            if first is None:
                first = s
            at += len(s.tokens)
        tokens = np.concatenate(pieces)
        assert tokens.shape[0] == self.seq_len + 1
        return Sample(tokens, answers[0], first.needle, first.depth, tuple(answers[1:]))

    def next_batch(self, batch: int) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """tokens [batch, seq_len + 1] int64 and per-target loss weights [batch, seq_len] (None:
        all ones; answer targets get answer_weight otherwise). last_answers then holds each row's
        answer targets (Sample.answer_rows)."""
        samples = [self.sample() for _ in range(batch)]
        self.last_answers = [s.answer_rows() for s in samples]
        tokens = np.stack([s.tokens for s in samples])
        if self.answer_weight == 1.0:
            return tokens, None
        weights = np.ones((batch, self.seq_len), dtype=np.float32)
        for b, rows in enumerate(self.last_answers):
            weights[b, rows] = self.answer_weight
        return tokens, weights

    def state(self) -> dict:
        return self.rng.bit_generator.state

    def set_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state


# ---- evaluation sets (identical for every arm: seeded by the cell, not by the run) -----------


def retrieval_eval_set(corpus: Corpus, length: int, depth: float, depth_index: int, task: str, samples: int,
                       seed: int = 1234, n_keys: int = 4) -> List[Sample]:
    rng = np.random.default_rng([seed, length, depth_index, TASKS.index(task)])
    return [retrieval_sample(rng, corpus, length, task, depth, n_keys) for _ in range(samples)]


def heldout_windows(corpus: Corpus, length: int, count: int) -> np.ndarray:
    """count evenly spaced windows [count, length + 1] int64 of the held-out corpus."""
    if length + 1 > len(corpus):
        raise ValueError(f"held-out windows of {length + 1} tokens: the held-out corpus has {len(corpus)}")
    starts = np.linspace(0, len(corpus) - length - 1, count).astype(np.int64)
    return np.stack([corpus.tokens[s:s + length + 1].astype(np.int64) for s in starts])
