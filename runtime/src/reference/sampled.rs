//! Exact references for single rows of dQ and single key blocks of dK/dV, for sizes at which
//! the full reference ([`backward`](super::backward)) would take hours (a 1M-token document).
//!
//! The math is the backward's (module docs of [`super`]): with the given `out` and `lse`,
//! `P = exp(scale·q·k − lse)` over the kept keys, `Delta = Σ out∘dO`,
//! `dS = P∘(dO·v − Delta)`, `dQ = scale·Σ dS·k`, `dK = scale·Σ dS·q`, `dV = Σ P·dO`. It is
//! evaluated directly from the bf16 inputs in the layouts the kernels read (`k`/`v` aligned
//! `[W, 4, 128]`), with f64 accumulation, so it needs no f32 copy of a 1M-token problem and
//! touches only what the sampled outputs depend on. A dQ row needs its query's 16 blocks; a
//! dK/dV block needs the queries whose lists select it.

use crate::contract::{
    BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, SOFTMAX_SCALE, TOPK_BLOCKS,
};
use half::bf16;

const HEADS: usize = NUM_Q_HEADS / NUM_KV_HEADS;

/// The inputs of one backward in the kernels' layouts.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    /// `q [T, 64, 128]`.
    pub q: &'a [bf16],
    /// `k_aligned [W, 4, 128]`.
    pub k_aligned: &'a [bf16],
    /// `v_aligned [W, 4, 128]`.
    pub v_aligned: &'a [bf16],
    /// `grad_out [T, 64, 128]`.
    pub grad_out: &'a [bf16],
    /// `out [T, 64, 128]`.
    pub out: &'a [bf16],
    /// `lse [T, 64]` (natural log; `-inf` for a row with no key).
    pub lse: &'a [f32],
    /// `q2k [4, T, 16]`, document-local block ids, `-1` padding.
    pub q2k: &'a [i32],
    /// `cu_seqlens [docs + 1]`.
    pub cu_seqlens: &'a [i32],
    /// `document_workspace_starts [docs]`.
    pub ws_starts: &'a [i32],
}

fn f(x: bf16) -> f64 {
    f64::from(x.to_f32())
}

fn dot(a: &[bf16], b: &[bf16]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| f(x) * f(y)).sum()
}

impl Inputs<'_> {
    fn tokens(&self) -> usize {
        *self.cu_seqlens.last().unwrap_or(&0) as usize
    }

    /// `(document, local position)` of compact token `t`.
    fn locate(&self, t: usize) -> (usize, usize) {
        let d = self.cu_seqlens.partition_point(|&c| c as usize <= t) - 1;
        (d, t - self.cu_seqlens[d] as usize)
    }

    fn q_row(&self, t: usize, h: usize) -> &[bf16] {
        &self.q[(t * NUM_Q_HEADS + h) * HEAD_DIM..][..HEAD_DIM]
    }

    fn do_row(&self, t: usize, h: usize) -> &[bf16] {
        &self.grad_out[(t * NUM_Q_HEADS + h) * HEAD_DIM..][..HEAD_DIM]
    }

    fn kv_row<'b>(&self, x: &'b [bf16], row: usize, g: usize) -> &'b [bf16] {
        &x[(row * NUM_KV_HEADS + g) * HEAD_DIM..][..HEAD_DIM]
    }

    /// The kept keys of `(t, group g)` as aligned workspace rows.
    fn kept(&self, t: usize, g: usize) -> Vec<usize> {
        let (d, p) = self.locate(t);
        let ws = self.ws_starts[d] as usize;
        let ids = &self.q2k[(g * self.tokens() + t) * TOPK_BLOCKS..][..TOPK_BLOCKS];
        let mut rows = Vec::new();
        // A block listed twice is attended once (membership, as in the full reference).
        for (i, &b) in ids.iter().enumerate() {
            if b < 0 || ids[..i].contains(&b) {
                continue;
            }
            let first = b as usize * BLOCK_SIZE;
            if first <= p {
                rows.extend(ws + first..=ws + p.min(first + BLOCK_SIZE - 1));
            }
        }
        rows
    }

    /// `(P, dS)` of row `(t, h)` at aligned key `row`.
    fn p_ds(&self, t: usize, h: usize, row: usize, delta: f64) -> (f64, f64) {
        let g = h / HEADS;
        let lse = f64::from(self.lse[t * NUM_Q_HEADS + h]);
        if lse == f64::NEG_INFINITY {
            return (0.0, 0.0);
        }
        let scale = f64::from(SOFTMAX_SCALE);
        let s = scale * dot(self.q_row(t, h), self.kv_row(self.k_aligned, row, g));
        let p = (s - lse).exp();
        let dp = dot(self.do_row(t, h), self.kv_row(self.v_aligned, row, g));
        (p, p * (dp - delta))
    }

    fn delta(&self, t: usize, h: usize) -> f64 {
        let o = &self.out[(t * NUM_Q_HEADS + h) * HEAD_DIM..][..HEAD_DIM];
        dot(o, self.do_row(t, h))
    }
}

/// `dq[t, h, :]`.
pub fn dq_row(x: &Inputs, t: usize, h: usize) -> Vec<f32> {
    let g = h / HEADS;
    let delta = x.delta(t, h);
    let scale = f64::from(SOFTMAX_SCALE);
    let mut acc = [0f64; HEAD_DIM];
    for row in x.kept(t, g) {
        let (_, ds) = x.p_ds(t, h, row, delta);
        for (a, &k) in acc.iter_mut().zip(x.kv_row(x.k_aligned, row, g)) {
            *a += scale * ds * f(k);
        }
    }
    acc.iter().map(|&a| a as f32).collect()
}

/// `dk_aligned` and `dv_aligned` of kv head `g` for the 128 aligned rows of key block
/// `local_kblock` of document `doc`, each `[128, 128]` (rows past the document are zero).
pub fn dk_dv_block(x: &Inputs, g: usize, doc: usize, local_kblock: usize) -> (Vec<f32>, Vec<f32>) {
    let scale = f64::from(SOFTMAX_SCALE);
    let (start, end) = (x.cu_seqlens[doc] as usize, x.cu_seqlens[doc + 1] as usize);
    let first_key = local_kblock * BLOCK_SIZE;
    let base = x.ws_starts[doc] as usize + first_key;
    let mut dk = vec![0f64; BLOCK_SIZE * HEAD_DIM];
    let mut dv = vec![0f64; BLOCK_SIZE * HEAD_DIM];
    let tokens = x.tokens();
    for t in start + first_key..end {
        let ids = &x.q2k[(g * tokens + t) * TOPK_BLOCKS..][..TOPK_BLOCKS];
        if !ids.contains(&(local_kblock as i32)) {
            continue;
        }
        let p_local = t - start;
        let keys = (p_local - first_key + 1).min(BLOCK_SIZE);
        for h in g * HEADS..(g + 1) * HEADS {
            let delta = x.delta(t, h);
            let (q, d_o) = (x.q_row(t, h), x.do_row(t, h));
            for j in 0..keys {
                let (p, ds) = x.p_ds(t, h, base + j, delta);
                let dk_row = &mut dk[j * HEAD_DIM..][..HEAD_DIM];
                for (a, &qv) in dk_row.iter_mut().zip(q) {
                    *a += scale * ds * f(qv);
                }
                let dv_row = &mut dv[j * HEAD_DIM..][..HEAD_DIM];
                for (a, &dov) in dv_row.iter_mut().zip(d_o) {
                    *a += p * f(dov);
                }
            }
        }
    }
    let narrow = |v: Vec<f64>| v.into_iter().map(|a| a as f32).collect();
    (narrow(dk), narrow(dv))
}
