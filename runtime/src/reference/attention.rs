//! Sparse attention forward and backward over the selected blocks only.

use std::ops::Range;

use super::layout::{preprocess_delta, to_aligned};
use super::{blocks_of, check_len, num_tokens, ReferenceError, KV_ROW, Q_ROW};
use crate::contract::{
    BLOCK_SIZE, HEAD_DIM, MAIN_HEADS_PER_INDEX, NUM_KV_HEADS, NUM_Q_HEADS, SOFTMAX_SCALE,
    TOPK_BLOCKS,
};

/// Output of [`forward`].
#[derive(Debug, Clone, PartialEq)]
pub struct Forward {
    /// Attention output `O`, `[T,64,128]`; zero for rows without a kept key.
    pub out: Vec<f32>,
    /// Natural-log sum-exp of the scaled scores, `[T,64]`; `-inf` for rows without a kept key.
    pub lse: Vec<f32>,
}

/// Output of [`backward`].
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients {
    /// `dQ`, compact `[T,64,128]`.
    pub dq: Vec<f32>,
    /// `dK`, compact `[T,4,128]`.
    pub dk: Vec<f32>,
    /// `dV`, compact `[T,4,128]`.
    pub dv: Vec<f32>,
    /// `dK` in the aligned workspace layout `[W,4,128]` the kernel writes; padding rows are zero.
    pub dk_aligned: Vec<f32>,
    /// `dV` in the aligned workspace layout `[W,4,128]`; padding rows are zero.
    pub dv_aligned: Vec<f32>,
    /// `W`, the workspace rows (`Σ ceil(len/128)·128`).
    pub workspace_rows: usize,
}

/// Validated inputs shared by forward and backward.
struct Problem<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    q2k: &'a [i32],
    cu: &'a [i32],
    tokens: usize,
}

impl<'a> Problem<'a> {
    fn new(
        q: &'a [f32],
        k: &'a [f32],
        v: &'a [f32],
        q2k: &'a [i32],
        cu: &'a [i32],
    ) -> Result<Self, ReferenceError> {
        let tokens = num_tokens(cu)?;
        check_len("q", q.len(), tokens, Q_ROW, "[T,64,128]")?;
        check_len("k", k.len(), tokens, KV_ROW, "[T,4,128]")?;
        check_len("v", v.len(), tokens, KV_ROW, "[T,4,128]")?;
        check_len(
            "q2k",
            q2k.len(),
            tokens,
            NUM_KV_HEADS * TOPK_BLOCKS,
            "[4,T,16]",
        )?;
        let p = Problem {
            q,
            k,
            v,
            q2k,
            cu,
            tokens,
        };
        p.check_block_ids()?;
        Ok(p)
    }

    /// Ids must be -1 (padding) or a block of the query's own document. Ids past the query's
    /// own block are legal: causality removes all their keys.
    fn check_block_ids(&self) -> Result<(), ReferenceError> {
        for d in 0..self.cu.len() - 1 {
            let docs = self.doc_range(d);
            let blocks = blocks_of(docs.len());
            for g in 0..NUM_KV_HEADS {
                for t in docs.clone() {
                    for (j, &id) in self.selection(g, t).iter().enumerate() {
                        if id < -1 || (id >= 0 && id as usize >= blocks) {
                            return Err(ReferenceError::Value {
                                field: format!("q2k[{g}, {t}, {j}]"),
                                found: id.to_string(),
                                expected: format!("-1 or a block id of document {d} (0..{blocks})"),
                            });
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn doc_range(&self, d: usize) -> Range<usize> {
        self.cu[d] as usize..self.cu[d + 1] as usize
    }

    fn selection(&self, g: usize, t: usize) -> &[i32] {
        let row = (g * self.tokens + t) * TOPK_BLOCKS;
        &self.q2k[row..row + TOPK_BLOCKS]
    }

    fn q_row(&self, t: usize, h: usize) -> &Row {
        row(self.q, (t * NUM_Q_HEADS + h) * HEAD_DIM)
    }

    fn k_row(&self, s: usize, g: usize) -> &Row {
        row(self.k, (s * NUM_KV_HEADS + g) * HEAD_DIM)
    }

    fn v_row(&self, s: usize, g: usize) -> &Row {
        row(self.v, (s * NUM_KV_HEADS + g) * HEAD_DIM)
    }

    /// The kept keys of query `t` (in document `docs`) for group `g`, as ascending compact
    /// ranges, one per distinct selected block that holds a key `<= t`.
    ///
    /// `q2k` is a set (seed-design §1.4 (a)): order is irrelevant and a repeated id counts once.
    fn kept_keys(
        &self,
        g: usize,
        t: usize,
        docs: &Range<usize>,
        ranges: &mut [Range<usize>; TOPK_BLOCKS],
    ) -> usize {
        let mut ids = [0usize; TOPK_BLOCKS];
        let mut n = 0;
        for &id in self.selection(g, t) {
            if id >= 0 {
                ids[n] = id as usize;
                n += 1;
            }
        }
        let ids = &mut ids[..n];
        ids.sort_unstable();
        let mut count = 0;
        let mut prev = None;
        for &b in ids.iter() {
            let lo = docs.start + b * BLOCK_SIZE;
            if prev == Some(b) || lo > t {
                continue;
            }
            prev = Some(b);
            let hi = (lo + BLOCK_SIZE).min(docs.end).min(t + 1);
            ranges[count] = lo..hi;
            count += 1;
        }
        count
    }

    /// Splits the documents into at most `parts` runs of whole documents, balanced by tokens.
    fn document_runs(&self, parts: usize) -> Vec<Range<usize>> {
        let docs = self.cu.len() - 1;
        let parts = parts.clamp(1, docs.max(1));
        let target = self.tokens.div_ceil(parts).max(1);
        let mut runs = Vec::with_capacity(parts);
        let mut first = 0;
        for d in 0..docs {
            let filled = self.cu[d + 1] as usize - self.cu[first] as usize;
            if filled >= target && runs.len() + 1 < parts {
                runs.push(first..d + 1);
                first = d + 1;
            }
        }
        runs.push(first..docs);
        runs
    }

    fn tokens_of(&self, docs: &Range<usize>) -> Range<usize> {
        self.cu[docs.start] as usize..self.cu[docs.end] as usize
    }
}

/// Jobs per kv group: enough to keep every core busy. Results do not depend on it.
fn runs_per_group() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.div_ceil(NUM_KV_HEADS)
}

/// Splits a per-group buffer with `width` elements per token into one slice per document run.
fn split_runs<'b>(
    mut buf: &'b mut [f32],
    p: &Problem,
    runs: &[Range<usize>],
    width: usize,
) -> Vec<&'b mut [f32]> {
    let mut parts = Vec::with_capacity(runs.len());
    for run in runs {
        let (head, rest) = buf.split_at_mut(p.tokens_of(run).len() * width);
        parts.push(head);
        buf = rest;
    }
    parts
}

/// Moves per-group buffers `[T, heads_per_group, 128]` into one `[T, groups·heads_per_group, 128]`.
fn merge_groups(groups: &[Vec<f32>], tokens: usize, row: usize) -> Vec<f32> {
    let mut merged = vec![0.0; tokens * row * groups.len()];
    for (g, buf) in groups.iter().enumerate() {
        for (t, src) in buf.chunks_exact(row).enumerate() {
            let at = (t * groups.len() + g) * row;
            merged[at..at + row].copy_from_slice(src);
        }
    }
    merged
}

// The unrolled loops below step by 8 and 4.
const _: () = assert!(HEAD_DIM / 8 * 8 == HEAD_DIM);

/// One head's row of 128 elements.
type Row = [f32; HEAD_DIM];

/// The `HEAD_DIM` elements of `data` at `at`, as a fixed-size row.
#[inline]
pub(super) fn row(data: &[f32], at: usize) -> &Row {
    data[at..at + HEAD_DIM]
        .try_into()
        .expect("a HEAD_DIM slice converts to a HEAD_DIM array")
}

#[inline]
fn row_mut(data: &mut [f32], at: usize) -> &mut Row {
    (&mut data[at..at + HEAD_DIM])
        .try_into()
        .expect("a HEAD_DIM slice converts to a HEAD_DIM array")
}

// The two inner loops below are written with plain indices on fixed-size rows rather than
// iterator chains: same machine code in release (it vectorises), but several times faster in
// unoptimised test builds.

/// f32 dot product of two rows with eight interleaved partial sums (fixed order).
#[inline]
pub(super) fn dot(a: &Row, b: &Row) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut i = 0;
    while i < HEAD_DIM {
        acc[0] += a[i] * b[i];
        acc[1] += a[i + 1] * b[i + 1];
        acc[2] += a[i + 2] * b[i + 2];
        acc[3] += a[i + 3] * b[i + 3];
        acc[4] += a[i + 4] * b[i + 4];
        acc[5] += a[i + 5] * b[i + 5];
        acc[6] += a[i + 6] * b[i + 6];
        acc[7] += a[i + 7] * b[i + 7];
        i += 8;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `y += a·x`.
#[inline]
fn axpy(y: &mut Row, a: f32, x: &Row) {
    let mut i = 0;
    while i < HEAD_DIM {
        y[i] += a * x[i];
        y[i + 1] += a * x[i + 1];
        y[i + 2] += a * x[i + 2];
        y[i + 3] += a * x[i + 3];
        i += 4;
    }
}

/// Sparse attention forward (seed-design §1.4), in f32.
///
/// `q [T,64,128]`, `k`/`v [T,4,128]`, `q2k [4,T,16]` (document-local block ids, `-1` pads) and
/// `cu_seqlens [docs+1]`; `T = cu_seqlens[docs]`. Loops only over the keys of the selected
/// blocks. Rows without a kept key get `O = 0` and `LSE = -inf`.
///
/// # Errors
/// [`ReferenceError`] if `cu_seqlens` is malformed, a slice length does not match `T`, or a
/// `q2k` id is neither `-1` nor a block of the query's document.
pub fn forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q2k: &[i32],
    cu_seqlens: &[i32],
) -> Result<Forward, ReferenceError> {
    let p = Problem::new(q, k, v, q2k, cu_seqlens)?;
    let runs = p.document_runs(runs_per_group());
    let group_out = MAIN_HEADS_PER_INDEX * HEAD_DIM;
    let mut outs = vec![vec![0.0f32; p.tokens * group_out]; NUM_KV_HEADS];
    let mut lses = vec![vec![f32::NEG_INFINITY; p.tokens * MAIN_HEADS_PER_INDEX]; NUM_KV_HEADS];
    std::thread::scope(|scope| {
        for (g, (out, lse)) in outs.iter_mut().zip(lses.iter_mut()).enumerate() {
            let outs = split_runs(out, &p, &runs, group_out);
            let lses = split_runs(lse, &p, &runs, MAIN_HEADS_PER_INDEX);
            for ((run, out), lse) in runs.iter().zip(outs).zip(lses) {
                let p = &p;
                scope.spawn(move || forward_run(p, g, run.clone(), out, lse));
            }
        }
    });
    Ok(Forward {
        out: merge_groups(&outs, p.tokens, group_out),
        lse: merge_groups(&lses, p.tokens, MAIN_HEADS_PER_INDEX),
    })
}

/// Forward of group `g` over a run of documents; `out`/`lse` start at the run's first token.
fn forward_run(p: &Problem, g: usize, docs: Range<usize>, out: &mut [f32], lse: &mut [f32]) {
    let base = p.tokens_of(&docs).start;
    let mut ranges: [Range<usize>; TOPK_BLOCKS] = Default::default();
    // Scaled scores, then probabilities, of one (query, head): at most 16 blocks of keys.
    let mut scores = Vec::with_capacity(TOPK_BLOCKS * BLOCK_SIZE);
    for d in docs {
        let doc = p.doc_range(d);
        for t in doc.clone() {
            let n = p.kept_keys(g, t, &doc, &mut ranges);
            if n == 0 {
                continue; // out stays 0, lse stays -inf
            }
            let kept = &ranges[..n];
            for hl in 0..MAIN_HEADS_PER_INDEX {
                let q_row = p.q_row(t, g * MAIN_HEADS_PER_INDEX + hl);
                scores.clear();
                for s in kept.iter().flat_map(Range::clone) {
                    scores.push(SOFTMAX_SCALE * dot(q_row, p.k_row(s, g)));
                }
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for x in scores.iter_mut() {
                    *x = (*x - max).exp();
                    sum += *x;
                }
                let row = (t - base) * MAIN_HEADS_PER_INDEX + hl;
                lse[row] = max + sum.ln();
                let o = row_mut(out, row * HEAD_DIM);
                for (s, &pr) in kept.iter().flat_map(Range::clone).zip(scores.iter()) {
                    axpy(o, pr, p.v_row(s, g));
                }
                let inv = 1.0 / sum;
                o.iter_mut().for_each(|x| *x *= inv);
            }
        }
    }
}

/// Sparse attention backward (seed-design §1.4, §3), in f32.
///
/// Takes the forward inputs plus `out [T,64,128]` (the forward output the kernel is given),
/// `lse [T,64]` and `dout [T,64,128]`. With `P = exp(scale·S − lse)` over the kept keys,
/// `Delta = rowsum(O∘dO)` ([`preprocess_delta`]) and `dS = P∘(dO·Vᵀ − Delta)`:
/// `dQ = scale·dS·K`, `dK = scale·dSᵀ·Q`, `dV = Pᵀ·dO`, summed over the 16 q-heads of each
/// kv group. A row whose `lse` is `-inf` (no kept key) contributes nothing. `dK`/`dV` are
/// returned both compact and scattered into the aligned `[W,4,128]` workspace layout.
///
/// # Errors
/// As [`forward`], plus a length mismatch of `out`, `lse` or `dout`.
#[allow(clippy::too_many_arguments)] // mirrors the kernel's argument list
pub fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q2k: &[i32],
    cu_seqlens: &[i32],
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
) -> Result<Gradients, ReferenceError> {
    let p = Problem::new(q, k, v, q2k, cu_seqlens)?;
    check_len("out", out.len(), p.tokens, Q_ROW, "[T,64,128]")?;
    check_len("lse", lse.len(), p.tokens, NUM_Q_HEADS, "[T,64]")?;
    check_len("dout", dout.len(), p.tokens, Q_ROW, "[T,64,128]")?;
    let delta = preprocess_delta(out, dout, p.tokens)?;
    let rows = RowInputs {
        lse,
        delta: &delta,
        dout,
    };

    let runs = p.document_runs(runs_per_group());
    let group_q = MAIN_HEADS_PER_INDEX * HEAD_DIM;
    let mut dqs = vec![vec![0.0f32; p.tokens * group_q]; NUM_KV_HEADS];
    let mut dks = vec![vec![0.0f32; p.tokens * HEAD_DIM]; NUM_KV_HEADS];
    let mut dvs = vec![vec![0.0f32; p.tokens * HEAD_DIM]; NUM_KV_HEADS];
    std::thread::scope(|scope| {
        let groups = dqs.iter_mut().zip(dks.iter_mut()).zip(dvs.iter_mut());
        for (g, ((dq, dk), dv)) in groups.enumerate() {
            let dq = split_runs(dq, &p, &runs, group_q);
            let dk = split_runs(dk, &p, &runs, HEAD_DIM);
            let dv = split_runs(dv, &p, &runs, HEAD_DIM);
            for (run, ((dq, dk), dv)) in runs.iter().zip(dq.into_iter().zip(dk).zip(dv)) {
                let (p, rows) = (&p, &rows);
                let grads = RunGrads { dq, dk, dv };
                scope.spawn(move || backward_run(p, rows, g, run.clone(), grads));
            }
        }
    });

    let dk = merge_groups(&dks, p.tokens, HEAD_DIM);
    let dv = merge_groups(&dvs, p.tokens, HEAD_DIM);
    let (_, workspace_rows) = crate::schedule::workspace_layout(cu_seqlens)?;
    Ok(Gradients {
        dq: merge_groups(&dqs, p.tokens, group_q),
        dk_aligned: to_aligned(&dk, cu_seqlens, NUM_KV_HEADS)?,
        dv_aligned: to_aligned(&dv, cu_seqlens, NUM_KV_HEADS)?,
        dk,
        dv,
        workspace_rows,
    })
}

/// Per-row backward inputs, `[T,64]` / `[T,64,128]`.
struct RowInputs<'a> {
    lse: &'a [f32],
    delta: &'a [f32],
    dout: &'a [f32],
}

/// One job's gradient slices, starting at the run's first token: `dq [n,16,128]`,
/// `dk`/`dv [n,128]` of one kv group.
struct RunGrads<'b> {
    dq: &'b mut [f32],
    dk: &'b mut [f32],
    dv: &'b mut [f32],
}

/// Backward of group `g` over a run of documents. Keys only receive gradient from queries of
/// their own document, so the run owns every dK/dV row it writes.
fn backward_run(p: &Problem, rows: &RowInputs, g: usize, docs: Range<usize>, out: RunGrads) {
    let base = p.tokens_of(&docs).start;
    let mut ranges: [Range<usize>; TOPK_BLOCKS] = Default::default();
    for d in docs {
        let doc = p.doc_range(d);
        for t in doc.clone() {
            let n = p.kept_keys(g, t, &doc, &mut ranges);
            for hl in 0..MAIN_HEADS_PER_INDEX {
                let h = g * MAIN_HEADS_PER_INDEX + hl;
                let lse = rows.lse[t * NUM_Q_HEADS + h];
                if n == 0 || lse == f32::NEG_INFINITY {
                    continue; // no kept key: P = 0, so every gradient term is 0
                }
                let delta = rows.delta[t * NUM_Q_HEADS + h];
                let q_row = p.q_row(t, h);
                let do_row = row(rows.dout, (t * NUM_Q_HEADS + h) * HEAD_DIM);
                let dq = row_mut(out.dq, ((t - base) * MAIN_HEADS_PER_INDEX + hl) * HEAD_DIM);
                for s in ranges[..n].iter().flat_map(Range::clone) {
                    let (k_row, v_row) = (p.k_row(s, g), p.v_row(s, g));
                    let pr = (SOFTMAX_SCALE * dot(q_row, k_row) - lse).exp();
                    let ds = pr * (dot(do_row, v_row) - delta);
                    let key = (s - base) * HEAD_DIM;
                    axpy(row_mut(out.dv, key), pr, do_row);
                    axpy(row_mut(out.dk, key), SOFTMAX_SCALE * ds, q_row);
                    axpy(dq, SOFTMAX_SCALE * ds, k_row);
                }
            }
        }
    }
}
