//! Sparse attention forward and backward over the selected blocks only.
//!
//! Work is split into jobs of one kv group × one chunk of [`QUERY_CHUNK_TOKENS`] queries on a
//! fixed token grid, run on a small worker pool. Forward jobs and dQ write disjoint rows. dK/dV
//! of a job go to a private partial buffer; partials are summed in job order afterwards. The
//! grid is a constant, so results depend only on the inputs, never on the core count.

use std::ops::Range;
use std::sync::{Mutex, PoisonError};

use super::layout::{preprocess_delta, to_aligned};
use super::rows::{axpy, dot, row, row_mut, Row};
use super::{check_len, num_tokens, ReferenceError, KV_ROW, Q_ROW};
use crate::contract::{
    BLOCK_SIZE, HEAD_DIM, MAIN_HEADS_PER_INDEX, NUM_KV_HEADS, NUM_Q_HEADS, SOFTMAX_SCALE,
    TOPK_BLOCKS,
};

/// Queries per job. Fixed (see the module doc); large enough that the per-job dK/dV partials
/// and their reduction stay cheap next to the attention work.
const QUERY_CHUNK_TOKENS: usize = 1024;

/// q-heads of one kv group, processed together.
const HEADS: usize = MAIN_HEADS_PER_INDEX;

/// Most kept keys of one query: 16 full blocks.
const MAX_KEYS: usize = TOPK_BLOCKS * BLOCK_SIZE;

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
        let q2k_row = NUM_KV_HEADS * TOPK_BLOCKS;
        check_len("q2k", q2k.len(), tokens, q2k_row, "[4,T,16]")?;
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
            let doc = self.doc_range(d);
            let blocks = doc.len().div_ceil(BLOCK_SIZE);
            for g in 0..NUM_KV_HEADS {
                for t in doc.clone() {
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

    /// The documents holding queries of `queries` (non-empty), each with its part of them.
    fn doc_pieces(&self, queries: &Range<usize>) -> Vec<(Range<usize>, Range<usize>)> {
        // The last document starting at or before the first query is the one holding it
        // (cu[0] = 0 <= start < T = cu[docs], so this skips empty documents and stays in range).
        let mut d = self.cu.partition_point(|&c| c as usize <= queries.start) - 1;
        let mut pieces = Vec::new();
        while d + 1 < self.cu.len() && (self.cu[d] as usize) < queries.end {
            let doc = self.doc_range(d);
            let piece = doc.start.max(queries.start)..doc.end.min(queries.end);
            if !piece.is_empty() {
                pieces.push((doc, piece));
            }
            d += 1;
        }
        pieces
    }

    fn selection(&self, g: usize, t: usize) -> &[i32] {
        let at = (g * self.tokens + t) * TOPK_BLOCKS;
        &self.q2k[at..at + TOPK_BLOCKS]
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

    /// The kept keys of query `t` (in document `doc`) for group `g`, as ascending compact
    /// ranges, one per distinct selected block that holds a key `<= t`. Returns their count.
    ///
    /// `q2k` is a set (`docs/design.md` §1.4 (a)): order is irrelevant and a repeated id counts once.
    fn kept_keys(
        &self,
        g: usize,
        t: usize,
        doc: &Range<usize>,
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
            let lo = doc.start + b * BLOCK_SIZE;
            if prev == Some(b) || lo > t {
                continue;
            }
            prev = Some(b);
            ranges[count] = lo..(lo + BLOCK_SIZE).min(doc.end).min(t + 1);
            count += 1;
        }
        count
    }

    /// The query chunks of the job grid.
    fn chunks(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (0..self.tokens.div_ceil(QUERY_CHUNK_TOKENS))
            .map(|c| c * QUERY_CHUNK_TOKENS..((c + 1) * QUERY_CHUNK_TOKENS).min(self.tokens))
    }
}

/// Runs every job on a pool of at most one worker per core.
fn run_jobs<J: Send>(jobs: Vec<J>, work: impl Fn(J) + Sync) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = cores.min(jobs.len());
    let queue = Mutex::new(jobs.into_iter());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                // A poisoned queue only means another worker panicked; the scope re-raises it.
                let job = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
                match job {
                    Some(job) => work(job),
                    None => break,
                }
            });
        }
    });
}

/// Moves per-group buffers `[T, n, 128]` into one `[T, groups·n, 128]` (`row = n·128`).
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

/// Sparse attention forward (`docs/design.md` §1.4), in f32.
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
    let mut outs = vec![vec![0.0f32; p.tokens * HEADS * HEAD_DIM]; NUM_KV_HEADS];
    let mut lses = vec![vec![f32::NEG_INFINITY; p.tokens * HEADS]; NUM_KV_HEADS];
    let mut jobs = Vec::new();
    for (g, (out, lse)) in outs.iter_mut().zip(lses.iter_mut()).enumerate() {
        let outs = out.chunks_mut(QUERY_CHUNK_TOKENS * HEADS * HEAD_DIM);
        let lses = lse.chunks_mut(QUERY_CHUNK_TOKENS * HEADS);
        for ((queries, out), lse) in p.chunks().zip(outs).zip(lses) {
            jobs.push((g, queries, out, lse));
        }
    }
    run_jobs(jobs, |(g, queries, out, lse)| {
        forward_chunk(&p, g, queries, out, lse)
    });
    Ok(Forward {
        out: merge_groups(&outs, p.tokens, HEADS * HEAD_DIM),
        lse: merge_groups(&lses, p.tokens, HEADS),
    })
}

/// Forward of group `g` for `queries`; `out [n,16,128]` / `lse [n,16]` start at its first query.
///
/// The 16 heads of the group share one key set, so each K/V row is loaded once per query and
/// used for all 16 heads (16× less memory traffic than a loop per head). Per head, the
/// arithmetic and its order are those of a plain per-head loop over ascending keys.
fn forward_chunk(p: &Problem, g: usize, queries: Range<usize>, out: &mut [f32], lse: &mut [f32]) {
    let base = queries.start;
    let mut ranges: [Range<usize>; TOPK_BLOCKS] = Default::default();
    // Scaled scores, then probabilities, `[16 heads][MAX_KEYS]`; allocated once per job.
    let mut scores = vec![0.0f32; HEADS * MAX_KEYS];
    for (doc, piece) in p.doc_pieces(&queries) {
        for t in piece {
            let n = p.kept_keys(g, t, &doc, &mut ranges);
            if n == 0 {
                continue; // out stays 0, lse stays -inf
            }
            let kept = &ranges[..n];
            let keys = kept.iter().map(Range::len).sum::<usize>();
            let q_rows: [&Row; HEADS] = std::array::from_fn(|hl| p.q_row(t, g * HEADS + hl));
            for (i, s) in kept.iter().flat_map(Range::clone).enumerate() {
                let k_row = p.k_row(s, g);
                for (hl, q_row) in q_rows.iter().enumerate() {
                    scores[hl * MAX_KEYS + i] = SOFTMAX_SCALE * dot(q_row, k_row);
                }
            }
            let mut inv_sum = [0.0f32; HEADS];
            for (hl, inv) in inv_sum.iter_mut().enumerate() {
                let head = &mut scores[hl * MAX_KEYS..hl * MAX_KEYS + keys];
                let max = head.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for x in head.iter_mut() {
                    *x = (*x - max).exp();
                    sum += *x;
                }
                lse[(t - base) * HEADS + hl] = max + sum.ln();
                *inv = 1.0 / sum;
            }
            let o = &mut out[(t - base) * HEADS * HEAD_DIM..][..HEADS * HEAD_DIM];
            for (i, s) in kept.iter().flat_map(Range::clone).enumerate() {
                let v_row = p.v_row(s, g);
                for hl in 0..HEADS {
                    axpy(row_mut(o, hl * HEAD_DIM), scores[hl * MAX_KEYS + i], v_row);
                }
            }
            for (o_row, inv) in o.chunks_exact_mut(HEAD_DIM).zip(inv_sum) {
                o_row.iter_mut().for_each(|x| *x *= inv);
            }
        }
    }
}

/// Sparse attention backward (`docs/design.md` §1.4, §3), in f32.
///
/// Takes the forward inputs plus `out [T,64,128]` (the forward output the kernel is given),
/// `lse [T,64]` and `dout [T,64,128]`. With `P = exp(scale·S − lse)` over the kept keys,
/// `Delta = rowsum(O∘dO)` ([`preprocess_delta`]) and `dS = P∘(dO·Vᵀ − Delta)`:
/// `dQ = scale·dS·K`, `dK = scale·dSᵀ·Q`, `dV = Pᵀ·dO`, summed over the 16 q-heads of each
/// kv group. A row whose `lse` is `-inf` contributes nothing (`P = 0`, as the kernel treats
/// it). `dK`/`dV` are returned both compact and scattered into the aligned `[W,4,128]` layout.
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

    let mut dqs = vec![vec![0.0f32; p.tokens * HEADS * HEAD_DIM]; NUM_KV_HEADS];
    let mut jobs = Vec::new();
    for (g, dq) in dqs.iter_mut().enumerate() {
        let dqs = dq.chunks_mut(QUERY_CHUNK_TOKENS * HEADS * HEAD_DIM);
        for (c, (queries, dq)) in p.chunks().zip(dqs).enumerate() {
            jobs.push((g, c, queries, dq));
        }
    }
    let partials = Mutex::new(Vec::with_capacity(jobs.len()));
    run_jobs(jobs, |(g, c, queries, dq)| {
        let partial = backward_chunk(&p, &rows, g, queries, dq);
        let mut partials = partials.lock().unwrap_or_else(PoisonError::into_inner);
        partials.push(((c, g), partial));
    });

    // Sum the partials in chunk order, so the result does not depend on scheduling.
    let mut partials = partials
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    partials.sort_unstable_by_key(|(key, _)| *key);
    let mut dks = vec![vec![0.0f32; p.tokens * HEAD_DIM]; NUM_KV_HEADS];
    let mut dvs = dks.clone();
    for ((_, g), part) in &partials {
        let at = part.first_key * HEAD_DIM;
        for (acc, x) in dks[*g][at..].iter_mut().zip(&part.dk) {
            *acc += x;
        }
        for (acc, x) in dvs[*g][at..].iter_mut().zip(&part.dv) {
            *acc += x;
        }
    }
    drop(partials);

    let dk = merge_groups(&dks, p.tokens, HEAD_DIM);
    let dv = merge_groups(&dvs, p.tokens, HEAD_DIM);
    let (_, workspace_rows) = crate::schedule::workspace_layout(cu_seqlens)?;
    Ok(Gradients {
        dq: merge_groups(&dqs, p.tokens, HEADS * HEAD_DIM),
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

/// dK/dV of one kv group from one chunk of queries, `[n,128]` for keys `first_key..`.
struct PartialKv {
    first_key: usize,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// Backward of group `g` for `queries`: writes their dQ (`dq [n,16,128]`, starting at the first
/// query) and returns their dK/dV contributions. Keys only receive gradient from queries of
/// their own document at or after them, so the partial spans the first query's document start
/// up to the last query.
///
/// As in [`forward_chunk`], each K/V row is loaded once per query for all 16 heads. Within the
/// chunk every accumulator sees its terms in the order of a plain (query, head, key) loop.
fn backward_chunk(
    p: &Problem,
    rows: &RowInputs,
    g: usize,
    queries: Range<usize>,
    dq_out: &mut [f32],
) -> PartialKv {
    let pieces = p.doc_pieces(&queries);
    let first_key = pieces.first().map_or(queries.start, |(doc, _)| doc.start);
    let keys = queries.end - first_key;
    let mut part = PartialKv {
        first_key,
        dk: vec![0.0; keys * HEAD_DIM],
        dv: vec![0.0; keys * HEAD_DIM],
    };
    let mut ranges: [Range<usize>; TOPK_BLOCKS] = Default::default();
    for (doc, piece) in pieces {
        for t in piece {
            let n = p.kept_keys(g, t, &doc, &mut ranges);
            let first = t * NUM_Q_HEADS + g * HEADS; // [t, 16g] in [T,64]
            let lse = &rows.lse[first..first + HEADS];
            let delta = &rows.delta[first..first + HEADS];
            // A row with lse = -inf has P = 0 (no kept key, or marked empty as in the kernel):
            // every term it would add is 0.
            let live: [bool; HEADS] = std::array::from_fn(|hl| lse[hl] != f32::NEG_INFINITY);
            if n == 0 || !live.contains(&true) {
                continue;
            }
            let q_rows: [&Row; HEADS] = std::array::from_fn(|hl| p.q_row(t, g * HEADS + hl));
            let do_rows: [&Row; HEADS] =
                std::array::from_fn(|hl| row(rows.dout, (first + hl) * HEAD_DIM));
            let dq = &mut dq_out[(t - queries.start) * HEADS * HEAD_DIM..][..HEADS * HEAD_DIM];
            for s in ranges[..n].iter().flat_map(Range::clone) {
                let (k_row, v_row) = (p.k_row(s, g), p.v_row(s, g));
                let key = (s - first_key) * HEAD_DIM;
                let dk = row_mut(&mut part.dk, key);
                let dv = row_mut(&mut part.dv, key);
                for hl in (0..HEADS).filter(|&hl| live[hl]) {
                    let pr = (SOFTMAX_SCALE * dot(q_rows[hl], k_row) - lse[hl]).exp();
                    let ds = pr * (dot(do_rows[hl], v_row) - delta[hl]);
                    axpy(dv, pr, do_rows[hl]);
                    axpy(dk, SOFTMAX_SCALE * ds, q_rows[hl]);
                    axpy(row_mut(dq, hl * HEAD_DIM), SOFTMAX_SCALE * ds, k_row);
                }
            }
        }
    }
    part
}
