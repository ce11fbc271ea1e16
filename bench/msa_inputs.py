#!/usr/bin/env python3
"""The benchmark cases and their block selections, shared bit for bit with
`runtime/examples/bench.rs` (numpy only; no torch needed).

Recipe (bench/README.md, "Inputs"):

* splitmix64, counter form: ``rand(seed, i) = mix64(seed + (i + 1) * GAMMA)`` (mod 2^64), which is
  the i-th output (0-based) of the usual sequential splitmix64 seeded with ``seed``;
  ``GAMMA = 0x9E3779B97F4A7C15``,
  ``mix64(z) = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^ (z >> 31)``.
* Selection ``q2k [4, T, 16]`` int32, document-local block ids, -1 padding. For index head h and
  compact token t of a document starting at ``start``: ``p = t - start``, ``own = p // 128``.
  Slot 0 is ``own`` (the forced local block). Every earlier block ``c in [0, own)`` gets the key
  ``rand(seed, (h * T + t) * 65536 + c)``; the ``n = min(topk - 1, own)`` candidates with the
  smallest ``(key, c)`` fill slots ``1..n`` in that order; the remaining slots are -1.
* Checksum of a q2k: ``sum_i mix64((i << 32) | uint32(q2k_flat[i])) mod 2^64`` over the C-order
  flat index i of ``[4, T, 16]``.
* Keys attended by (h, t): ``sum over valid slots b of min(128, p - 128 b + 1)``; useful backward
  FLOP = ``10 * 128 * 16 * sum_(h, t) keys`` (= 10 * 128 * sum over the 64 query heads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1

BLOCK = 128
TOPK = 16
NUM_INDEX_HEADS = 4
HEADS_PER_GROUP = 16
HEAD_DIM = 128
DEFAULT_SEED = 20261129
# Key index stride per (head, token): candidates c < 65536 (documents up to 8M tokens).
CAND_STRIDE = 65536

# Packed case: 10 documents of 2K-16K tokens, 65536 in all; lengths deliberately not multiples of
# 128 (blocks are document-local, so a block can straddle two 128-aligned stream blocks).
PACKED_64K = [9000, 2048, 16384, 5123, 3001, 12000, 2500, 7777, 4100, 3603]

# name -> document lengths. The timed cases come first; the check cases are small and only used
# for correctness against the fp32 reference.
CASES = {
    "doc8k": [8192],
    "doc32k": [32768],
    "packed64k": PACKED_64K,
    # long documents (issue 19): one document each, and 1M tokens in 30 packed documents
    "doc16k": [16384],
    "doc64k": [65536],
    "doc128k": [131072],
    "doc256k": [262144],
    "doc1m": [1048576],
    "packed1m": [n * k for k in (1, 3, 12) for n in PACKED_64K],
    # 64K tokens in equal documents, for where the KV forward starts to pay (Auto's threshold)
    "docs2k": [2048] * 32,
    "docs4k": [4096] * 16,
}
TIMED_CASES = ["doc8k", "doc32k", "packed64k"]
# name -> (document lengths, topk)
CHECK_CASES = {
    # every block at or before the own block is selected (documents have <= 11 blocks): the
    # full causal document mask, so the dense SDPA baseline can be checked on it too
    "check2doc_top16": ([700, 1348], 16),
    # own block + at most 3 random earlier blocks: real sparsity, varlen
    "check2doc_top4": ([700, 1348], 4),
    # one document, own block + at most 3 random earlier blocks (fla's non-varlen path)
    "check1doc_top4": ([2048], 4),
}


def mix64_int(z: int) -> int:
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def rand_int(seed: int, i: int) -> int:
    """Scalar reference of the counter-form splitmix64."""
    return mix64_int(seed + (i + 1) * GAMMA)


def _np():
    import numpy as np

    return np


def mix64(z):
    """Vectorised mix64 over a numpy uint64 array (wrapping arithmetic)."""
    np = _np()
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(MIX1)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(MIX2)
    return z ^ (z >> np.uint64(31))


def rand(seed: int, i):
    """rand(seed, i) for a numpy uint64 array of counters i."""
    np = _np()
    with np.errstate(over="ignore"):
        z = np.uint64(seed & MASK64) + (i + np.uint64(1)) * np.uint64(GAMMA)
        return mix64(z)


def cu_seqlens(docs):
    cu = [0]
    for n in docs:
        if n <= 0:
            raise ValueError(f"document length {n} must be positive")
        cu.append(cu[-1] + n)
    return cu


def make_q2k(docs, seed: int = DEFAULT_SEED, topk: int = TOPK):
    """q2k [4, T, 16] int32 by the recipe in the module docstring."""
    np = _np()
    if not 1 <= topk <= TOPK:
        raise ValueError("topk must be in 1..=16")
    cu = cu_seqlens(docs)
    t_total = cu[-1]
    q2k = np.full((NUM_INDEX_HEADS, t_total, TOPK), -1, dtype=np.int32)
    for d, length in enumerate(docs):
        start = cu[d]
        p = np.arange(length, dtype=np.int64)
        own = p // BLOCK
        nb = (length + BLOCK - 1) // BLOCK
        c = np.arange(nb, dtype=np.uint64)
        extra = min(topk - 1, nb - 1)
        for h in range(NUM_INDEX_HEADS):
            q2k[h, start:start + length, 0] = own
            if extra <= 0 or nb <= 1:
                continue
            rows = (np.uint64(h * t_total + start) + p.astype(np.uint64)) * np.uint64(CAND_STRIDE)
            keys = rand(seed, rows[:, None] + c[None, :])
            keys[c[None, :] >= own.astype(np.uint64)[:, None]] = np.uint64(MASK64)
            # stable: equal keys keep the smaller c first, so excluded candidates (key = max,
            # larger c) never precede a valid one
            order = np.argsort(keys, axis=1, kind="stable")[:, :extra].astype(np.int32)
            n = np.minimum(own, extra)
            take = np.arange(extra)[None, :] < n[:, None]
            q2k[h, start:start + length, 1:1 + extra] = np.where(take, order, -1)
    return q2k, cu


def q2k_checksum(q2k) -> int:
    np = _np()
    flat = np.ascontiguousarray(q2k, dtype=np.int32).reshape(-1)
    i = np.arange(flat.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        words = (i << np.uint64(32)) | flat.view(np.uint32).astype(np.uint64)
        return int(np.add.reduce(mix64(words), dtype=np.uint64))


def local_positions(cu):
    np = _np()
    pos = np.empty(cu[-1], dtype=np.int64)
    for d in range(len(cu) - 1):
        pos[cu[d]:cu[d + 1]] = np.arange(cu[d + 1] - cu[d])
    return pos


def keys_attended(q2k, cu) -> int:
    """sum over (index head, token) of the causal keys in the selected blocks."""
    np = _np()
    pos = local_positions(cu)[None, :, None]
    b = q2k.astype(np.int64)
    per = np.where(b >= 0, np.clip(pos - BLOCK * b + 1, 0, BLOCK), 0)
    return int(per.sum())


def dense_keys(cu) -> int:
    """sum over tokens of the document-causal key count (pos + 1): the dense causal reference."""
    return int(sum(n * (n + 1) // 2 for n in (cu[i + 1] - cu[i] for i in range(len(cu) - 1))))


def useful_flop(keys: int) -> float:
    """MSA convention: 2 (3 Dqk + 2 Dv) = 10 * 128 FLOP per (query head, key); 16 heads per index head."""
    return 10.0 * HEAD_DIM * HEADS_PER_GROUP * keys


def tile_tasks(q2k, cu) -> int:
    """Task tiles of the KV-parallel schedule: per (index head, document block), ceil(n / 8) where n
    is the number of queries that selected it (= sum over work items of ceil(q_count / 8), since
    work items split rows at multiples of 8)."""
    np = _np()
    tasks = 0
    for d in range(len(cu) - 1):
        seg = q2k[:, cu[d]:cu[d + 1], :]
        nb = (cu[d + 1] - cu[d] + BLOCK - 1) // BLOCK
        for h in range(NUM_INDEX_HEADS):
            ids = seg[h][seg[h] >= 0]
            counts = np.bincount(ids, minlength=nb)
            tasks += int(((counts + 7) // 8).sum())
    return tasks


def workspace_layout(cu):
    """(document_workspace_starts, W): documents start at 128-aligned workspace rows."""
    starts, w = [], 0
    for d in range(len(cu) - 1):
        starts.append(w)
        w += (cu[d + 1] - cu[d] + BLOCK - 1) // BLOCK * BLOCK
    return starts, w


def describe(name, docs, seed, topk=TOPK):
    q2k, cu = make_q2k(docs, seed, topk)
    return describe_q2k(name, docs, seed, topk, q2k, cu)


def read_inputs(directory, name, docs):
    """(q2k [4, T, 16] int32, cu_seqlens) from the raw files of ``write_inputs`` (or of the Rust
    bench's ``--write-inputs``); checks cu_seqlens against ``docs`` and the q2k size."""
    np = _np()
    base = os.path.join(directory, name)
    cu = np.fromfile(base + ".cu_seqlens.i32", dtype="<i4").tolist()
    if cu != cu_seqlens(docs):
        raise ValueError(f"{base}.cu_seqlens.i32 does not hold the documents of case {name}")
    q2k = np.fromfile(base + ".q2k.i32", dtype="<i4")
    if q2k.size != NUM_INDEX_HEADS * cu[-1] * TOPK:
        raise ValueError(f"{base}.q2k.i32 has {q2k.size} entries, expected 4 * T * 16")
    return q2k.reshape(NUM_INDEX_HEADS, cu[-1], TOPK).astype(np.int32), cu


def describe_q2k(name, docs, seed, topk, q2k, cu):
    """The case summary of ``describe`` for a given selection."""
    keys = keys_attended(q2k, cu)
    return {
        "name": name,
        "tokens": cu[-1],
        "documents": len(docs),
        "doc_lengths": list(docs),
        "cu_seqlens": cu,
        "seed": seed,
        "topk": topk,
        "q2k_checksum": f"{q2k_checksum(q2k):016x}",
        "keys_attended": keys,
        "useful_flop": useful_flop(keys),
        "dense_causal_keys_per_head": dense_keys(cu),
        "tile_tasks": tile_tasks(q2k, cu),
    }, q2k, cu


def write_inputs(directory, name, q2k, cu, seed, topk):
    """Writes <name>.q2k.i32 ([4, T, 16] int32 LE, C order), <name>.cu_seqlens.i32 (int32 LE)
    and <name>.npz (q2k, cu_seqlens, seed, topk)."""
    np = _np()
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, name)
    np.ascontiguousarray(q2k, dtype="<i4").tofile(base + ".q2k.i32")
    np.asarray(cu, dtype="<i4").tofile(base + ".cu_seqlens.i32")
    np.savez(base + ".npz", q2k=q2k, cu_seqlens=np.asarray(cu, dtype=np.int32),
             seed=np.uint64(seed), topk=np.int32(topk))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(TIMED_CASES),
                    help=f"comma list of {', '.join(list(CASES) + list(CHECK_CASES))}")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--write", metavar="DIR", help="also write the raw inputs of each case to DIR")
    args = ap.parse_args(argv)
    # sanity: the vectorised generator equals the scalar definition
    np = _np()
    probe = np.arange(5, dtype=np.uint64) * np.uint64(7919)
    assert [int(x) for x in rand(args.seed, probe)] == [rand_int(args.seed, int(i)) for i in probe]
    out = []
    for name in args.cases.split(","):
        if name in CASES:
            docs, topk = CASES[name], TOPK
        elif name in CHECK_CASES:
            docs, topk = CHECK_CASES[name]
        else:
            sys.exit(f"unknown case {name!r}")
        info, q2k, cu = describe(name, docs, args.seed, topk)
        if args.write:
            write_inputs(args.write, name, q2k, cu, args.seed, topk)
        out.append(info)
        print(f"{name:16s} T={info['tokens']:6d} docs={info['documents']:2d} topk={topk:2d} "
              f"keys={info['keys_attended']:12d} tasks={info['tile_tasks']:8d} "
              f"checksum={info['q2k_checksum']}")
    return out


if __name__ == "__main__":
    main()
