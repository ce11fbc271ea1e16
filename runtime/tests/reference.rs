//! Validation of the f32 CPU reference (`msa_runtime::reference`) against independent f64
//! formulations written here (`docs/design.md` §1.4, §1.5, §3.2, §3.6, §4.3).
//!
//! The f64 code below deliberately shares nothing with the module: it spells out the mask of
//! §1.4 per (query, key) pair and works on dense rows / dense T×T matrices.

use half::bf16;
use msa_runtime::reference::{self, ReferenceError};

// Topology written out from the spec, not taken from the crate, so a wrong constant shows up.
const HQ: usize = 64;
const HKV: usize = 4;
const HPG: usize = 16; // q-heads per kv group
const D: usize = 128;
const BLOCK: usize = 128;
const TOPK: usize = 16;

fn scale() -> f64 {
    1.0 / 128f64.sqrt()
}

/// splitmix64: a tiny deterministic PRNG, so the cases need no extra dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `n` values uniform in (−amp, amp), rounded to bf16 like the real inputs.
    fn bf16_values(&mut self, n: usize, amp: f64) -> Vec<f32> {
        (0..n)
            .map(|_| bf16::from_f64(amp * (2.0 * self.unit() - 1.0)).to_f32())
            .collect()
    }
}

/// A packed problem in compact layout.
struct Case {
    cu: Vec<i32>,
    tokens: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    q2k: Vec<i32>,
}

fn cu_seqlens(lens: &[usize]) -> Vec<i32> {
    let mut cu = vec![0i32];
    for &l in lens {
        cu.push(cu.last().unwrap() + l as i32);
    }
    cu
}

/// Random q/k/v and a random selection: the own block always, every other block of the
/// document (earlier or later) with probability 1/2, sometimes a duplicate, all at random
/// slots among `-1` padding.
fn random_case(lens: &[usize], seed: u64) -> Case {
    let mut rng = Rng(seed);
    let cu = cu_seqlens(lens);
    let tokens = *cu.last().unwrap() as usize;
    let q = rng.bf16_values(tokens * HQ * D, 1.5);
    let k = rng.bf16_values(tokens * HKV * D, 1.5);
    let v = rng.bf16_values(tokens * HKV * D, 1.0);
    let mut q2k = vec![-1i32; HKV * tokens * TOPK];
    for g in 0..HKV {
        for t in 0..tokens {
            let (start, end) = doc_bounds(&cu, t);
            let own = (t - start) / BLOCK;
            let mut ids = vec![own as i32];
            for b in 0..(end - start).div_ceil(BLOCK) {
                if b != own && rng.below(2) == 1 {
                    ids.push(b as i32);
                }
            }
            if rng.below(4) == 0 {
                ids.push(own as i32);
            }
            let slots = &mut q2k[(g * tokens + t) * TOPK..][..TOPK];
            for id in ids {
                let mut j = rng.below(TOPK);
                while slots[j] != -1 {
                    j = (j + 1) % TOPK;
                }
                slots[j] = id;
            }
        }
    }
    Case {
        cu,
        tokens,
        q,
        k,
        v,
        q2k,
    }
}

/// `[start, end)` of the document holding compact token `t`.
fn doc_bounds(cu: &[i32], t: usize) -> (usize, usize) {
    let d = cu.windows(2).position(|w| t < w[1] as usize).unwrap();
    (cu[d] as usize, cu[d + 1] as usize)
}

/// The mask of `docs/design.md` §1.4, straight from its three conditions.
fn attends(cu: &[i32], q2k: &[i32], tokens: usize, g: usize, t: usize, s: usize) -> bool {
    let (start, end) = doc_bounds(cu, t);
    let same_doc = (start..end).contains(&s);
    let causal = s <= t;
    let selected = same_doc && {
        let block = ((s - start) / BLOCK) as i32;
        q2k[(g * tokens + t) * TOPK..][..TOPK].contains(&block)
    };
    same_doc && causal && selected
}

// The f64 loops use plain indices: iterator chains are several times slower in the
// unoptimised builds tests run in.
/// The dense mask `[g][t·T + s]` of the whole case, from [`attends`].
fn dense_mask(c: &Case) -> Vec<Vec<bool>> {
    let n = c.tokens;
    (0..HKV)
        .map(|g| {
            (0..n * n)
                .map(|ts| attends(&c.cu, &c.q2k, n, g, ts / n, ts % n))
                .collect()
        })
        .collect()
}

fn dot64(a: &[f64], b: &[f64]) -> f64 {
    let (a, b) = (&a[..D], &b[..D]);
    let mut acc = [0.0f64; 4];
    let mut i = 0;
    while i < D {
        acc[0] += a[i] * b[i];
        acc[1] += a[i + 1] * b[i + 1];
        acc[2] += a[i + 2] * b[i + 2];
        acc[3] += a[i + 3] * b[i + 3];
        i += 4;
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3])
}

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// `assert_eq!` for long vectors: reports the first differing index, not the whole vector.
fn assert_same<T: PartialEq + std::fmt::Debug>(name: &str, got: &[T], expected: &[T]) {
    assert_eq!(got.len(), expected.len(), "{name}: length");
    let diff = got.iter().zip(expected).position(|(a, e)| a != e);
    if let Some(i) = diff {
        let count = got.iter().zip(expected).filter(|(a, e)| a != e).count();
        panic!(
            "{name}: {count} elements differ, first at {i}: got {:?}, expected {:?}",
            got[i], expected[i]
        );
    }
}

fn assert_same_grads(name: &str, got: &reference::Gradients, expected: &reference::Gradients) {
    assert_same(&format!("{name} dQ"), &got.dq, &expected.dq);
    assert_same(&format!("{name} dK"), &got.dk, &expected.dk);
    assert_same(&format!("{name} dV"), &got.dv, &expected.dv);
    assert_same(
        &format!("{name} dK aligned"),
        &got.dk_aligned,
        &expected.dk_aligned,
    );
    assert_same(
        &format!("{name} dV aligned"),
        &got.dv_aligned,
        &expected.dv_aligned,
    );
    assert_eq!(got.workspace_rows, expected.workspace_rows, "{name} W");
}

fn run_forward(c: &Case) -> reference::Forward {
    reference::forward(&c.q, &c.k, &c.v, &c.q2k, &c.cu).unwrap()
}

fn run_backward(c: &Case, fwd: &reference::Forward, dout: &[f32]) -> reference::Gradients {
    reference::backward(&c.q, &c.k, &c.v, &c.q2k, &c.cu, &fwd.out, &fwd.lse, dout).unwrap()
}

// ---------------------------------------------------------------------------------------------
// 1. Finite differences in f64.

/// f64 inputs of the finite-difference check.
struct Case64<'a> {
    c: &'a Case,
    mask: Vec<Vec<bool>>,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    w: Vec<f64>,
}

impl Case64<'_> {
    /// `Σ_d O[t,h,d]·W[t,h,d]` of one row, by a dense f64 softmax over all T keys.
    fn row_loss(&self, t: usize, h: usize) -> f64 {
        let c = self.c;
        let g = h / HPG;
        let q = &self.q[(t * HQ + h) * D..][..D];
        let scores: Vec<f64> = (0..c.tokens)
            .map(|s| {
                if self.mask[g][t * c.tokens + s] {
                    scale() * dot64(q, &self.k[(s * HKV + g) * D..][..D])
                } else {
                    f64::NEG_INFINITY
                }
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if max == f64::NEG_INFINITY {
            return 0.0;
        }
        let sum: f64 = scores.iter().map(|x| (x - max).exp()).sum();
        let w = &self.w[(t * HQ + h) * D..][..D];
        let mut loss = 0.0;
        for (s, &x) in scores.iter().enumerate() {
            if x > f64::NEG_INFINITY {
                loss += (x - max).exp() / sum * dot64(&self.v[(s * HKV + g) * D..], w);
            }
        }
        loss
    }

    fn loss(&self, rows: &[(usize, usize)]) -> f64 {
        rows.iter().map(|&(t, h)| self.row_loss(t, h)).sum()
    }
}

#[derive(Clone, Copy, Debug)]
enum Input {
    Q,
    K,
    V,
}

impl Case64<'_> {
    fn entry(&mut self, which: Input, index: usize) -> &mut f64 {
        match which {
            Input::Q => &mut self.q[index],
            Input::K => &mut self.k[index],
            Input::V => &mut self.v[index],
        }
    }

    /// Central difference of the loss over `rows`, the rows that depend on the entry (the
    /// others cancel exactly).
    fn central_difference(&mut self, which: Input, index: usize, rows: &[(usize, usize)]) -> f64 {
        const EPS: f64 = 1e-4;
        let x0 = *self.entry(which, index);
        *self.entry(which, index) = x0 + EPS;
        let up = self.loss(rows);
        *self.entry(which, index) = x0 - EPS;
        let down = self.loss(rows);
        *self.entry(which, index) = x0;
        (up - down) / (2.0 * EPS)
    }
}

/// Two documents (5 and 131 tokens, so the second has two blocks); loss `L = Σ O·W`, so
/// `dout = W`. Sampled entries of q, k, v: f64 central differences vs the module's f32 grads.
#[test]
fn gradients_match_f64_finite_differences() {
    let c = random_case(&[5, 131], 20260902);
    let mut rng = Rng(7);
    let w = rng.bf16_values(c.tokens * HQ * D, 1.0);
    let fwd = run_forward(&c);
    let grads = run_backward(&c, &fwd, &w);
    let mut c64 = Case64 {
        c: &c,
        mask: dense_mask(&c),
        q: to64(&c.q),
        k: to64(&c.k),
        v: to64(&c.v),
        w: to64(&w),
    };

    // (input, flat index, the (t, h) rows whose output depends on that entry)
    type Sample = (Input, usize, Vec<(usize, usize)>);
    let mut samples: Vec<Sample> = Vec::new();
    for _ in 0..24 {
        let (t, h, i) = (rng.below(c.tokens), rng.below(HQ), rng.below(D));
        samples.push((Input::Q, (t * HQ + h) * D + i, vec![(t, h)]));
    }
    // Keys at both ends of both blocks and of the short document. Rows of a key late in the
    // block are cheap; key 5 (first of the long document) feeds nearly every row, so only
    // its K entry is probed.
    let keys = [0usize, 4, 5, 82, 120, 132, 133, 135];
    for (n, &s) in keys.iter().enumerate() {
        for which in [Input::K, Input::V] {
            if s == 5 && matches!(which, Input::V) {
                continue;
            }
            let g = (n + matches!(which, Input::V) as usize) % HKV;
            let rows: Vec<(usize, usize)> = (0..c.tokens)
                .flat_map(|t| (g * HPG..(g + 1) * HPG).map(move |h| (t, h)))
                .filter(|&(t, _)| c64.mask[g][t * c.tokens + s])
                .collect();
            assert!(!rows.is_empty(), "key {s} group {g} is attended by no row");
            samples.push((which, (s * HKV + g) * D + rng.below(D), rows));
        }
    }

    let mut worst: f64 = 0.0;
    for (which, index, rows) in &samples {
        let fd = c64.central_difference(*which, *index, rows);
        let got = f64::from(match which {
            Input::Q => grads.dq[*index],
            Input::K => grads.dk[*index],
            Input::V => grads.dv[*index],
        });
        // f32 vs f64: relative 1e-3 of the value, with a floor for entries near zero.
        let err = (got - fd).abs() / (fd.abs() + 1e-2);
        worst = worst.max(err);
        assert!(
            err <= 1e-3,
            "d{which:?}[{index}]: module {got:e}, finite difference {fd:e} (scaled error {err:e})"
        );
    }
    // The check must have probed real gradient, not just zeros.
    assert!(samples.len() == 24 + 15 && grads.dk.iter().any(|&x| x.abs() > 1e-2));
    eprintln!("finite differences: worst scaled error {worst:e}");
}

// ---------------------------------------------------------------------------------------------
// 2. Dense masked attention in f64.

/// Forward and backward of one q-head with full T×T matrices and −inf masking.
struct DenseHead {
    o: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn dense_head(c: &Case, mask: &[Vec<bool>], h: usize, dout: &[f32]) -> DenseHead {
    let (n, g) = (c.tokens, h / HPG);
    let gather = |x: &[f32], heads: usize, head: usize| -> Vec<f64> {
        (0..n)
            .flat_map(|t| {
                x[(t * heads + head) * D..][..D]
                    .iter()
                    .map(|&v| f64::from(v))
            })
            .collect()
    };
    let (q, k, v) = (
        gather(&c.q, HQ, h),
        gather(&c.k, HKV, g),
        gather(&c.v, HKV, g),
    );
    let go = gather(dout, HQ, h);

    // S, masked with −inf, then a dense row softmax.
    let mut p = vec![f64::NEG_INFINITY; n * n];
    for t in 0..n {
        for s in 0..n {
            if mask[g][t * n + s] {
                p[t * n + s] = scale() * dot64(&q[t * D..], &k[s * D..]);
            }
        }
    }
    let mut lse = vec![f64::NEG_INFINITY; n];
    for t in 0..n {
        let row = &mut p[t * n..(t + 1) * n];
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if max > f64::NEG_INFINITY {
            lse[t] = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
        }
        for x in row.iter_mut() {
            // exp(−inf − lse) = 0 for masked keys; a fully masked row is all zero.
            *x = if lse[t] > f64::NEG_INFINITY {
                (*x - lse[t]).exp()
            } else {
                0.0
            };
        }
    }

    // O = P·V, Delta = rowsum(O∘dO), dS = P∘(dO·Vᵀ − Delta), dQ = scale·dS·K,
    // dK = scale·dSᵀ·Q, dV = Pᵀ·dO. Exact zeros of P (masked) are skipped: they add nothing.
    let zeros = || vec![0.0f64; n * D];
    let (mut o, mut dq, mut dk, mut dv) = (zeros(), zeros(), zeros(), zeros());
    for t in 0..n {
        for s in 0..n {
            let pr = p[t * n + s];
            if pr != 0.0 {
                for i in 0..D {
                    o[t * D + i] += pr * v[s * D + i];
                }
            }
        }
    }
    for t in 0..n {
        let delta = dot64(&o[t * D..], &go[t * D..]);
        for s in 0..n {
            let pr = p[t * n + s];
            if pr == 0.0 {
                continue;
            }
            let ds = pr * (dot64(&go[t * D..], &v[s * D..]) - delta);
            for i in 0..D {
                dq[t * D + i] += scale() * ds * k[s * D + i];
                dk[s * D + i] += scale() * ds * q[t * D + i];
                dv[s * D + i] += pr * go[t * D + i];
            }
        }
    }
    DenseHead { o, lse, dq, dk, dv }
}

/// Several documents (1 and 2 blocks) with a random selection of own, earlier and later blocks,
/// duplicates and padding. dO is non-zero on two heads per group (the dense f64 side is
/// O(T²) per head); the other heads must then get exactly zero dQ.
#[test]
fn sparse_reference_matches_dense_masked_attention() {
    let c = random_case(&[2, 190, 1, 6], 20260903);
    let n = c.tokens;
    // The selection must hold earlier non-own blocks that survive causality.
    let earlier = (0..HKV * n)
        .filter(|&r| {
            let t = r % n;
            let own = ((t - doc_bounds(&c.cu, t).0) / BLOCK) as i32;
            c.q2k[r * TOPK..][..TOPK].iter().any(|&b| b >= 0 && b < own)
        })
        .count();
    assert!(earlier > 50, "only {earlier} rows select an earlier block");

    let heads = [0usize, 9, 16, 30, 33, 47, 48, 63];
    let mut rng = Rng(11);
    let mut dout = vec![0.0f32; n * HQ * D];
    for t in 0..n {
        for &h in &heads {
            let row = rng.bf16_values(D, 1.0);
            dout[(t * HQ + h) * D..][..D].copy_from_slice(&row);
        }
    }
    let fwd = run_forward(&c);
    let grads = run_backward(&c, &fwd, &dout);
    let mask = dense_mask(&c);

    let (mut o_exp, mut o_got) = (Vec::new(), Vec::new());
    let (mut lse_exp, mut lse_got) = (Vec::new(), Vec::new());
    let (mut dq_exp, mut dq_got) = (Vec::new(), Vec::new());
    let (mut dk_exp, mut dv_exp) = (vec![0.0f64; n * HKV * D], vec![0.0f64; n * HKV * D]);
    for &h in &heads {
        let dense = dense_head(&c, &mask, h, &dout);
        let g = h / HPG;
        for t in 0..n {
            let row = (t * HQ + h) * D;
            o_exp.extend(dense.o[t * D..][..D].iter().map(|&x| x as f32));
            o_got.extend_from_slice(&fwd.out[row..row + D]);
            dq_exp.extend(dense.dq[t * D..][..D].iter().map(|&x| x as f32));
            dq_got.extend_from_slice(&grads.dq[row..row + D]);
            lse_exp.push(dense.lse[t] as f32);
            lse_got.push(fwd.lse[t * HQ + h]);
            for i in 0..D {
                dk_exp[(t * HKV + g) * D + i] += dense.dk[t * D + i];
                dv_exp[(t * HKV + g) * D + i] += dense.dv[t * D + i];
            }
        }
    }
    let dk_exp: Vec<f32> = dk_exp.iter().map(|&x| x as f32).collect();
    let dv_exp: Vec<f32> = dv_exp.iter().map(|&x| x as f32).collect();

    let tol = |name: &str, got: &[f32], exp: &[f32]| {
        let peak = exp
            .iter()
            .filter(|x| x.is_finite())
            .fold(0f32, |m, x| m.max(x.abs()));
        let stats = reference::check_close(name, got, exp, 1e-5 * peak, 1e-5).unwrap();
        eprintln!("{name}: {stats}");
    };
    tol("O", &o_got, &o_exp);
    tol("LSE", &lse_got, &lse_exp);
    tol("dQ", &dq_got, &dq_exp);
    tol("dK", &grads.dk, &dk_exp);
    tol("dV", &grads.dv, &dv_exp);
    for t in 0..n {
        for h in (0..HQ).filter(|h| !heads.contains(h)) {
            let row = &grads.dq[(t * HQ + h) * D..][..D];
            assert!(
                row.iter().all(|&x| x == 0.0),
                "dQ[{t},{h}] is non-zero with dO = 0"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Empty rows, padding, order and duplicates.

/// `q2k` with every entry `-1`, then the listed `(group, token, slots)` rows.
fn q2k_with(tokens: usize, rows: &[(usize, usize, &[i32])]) -> Vec<i32> {
    let mut q2k = vec![-1i32; HKV * tokens * TOPK];
    for &(g, t, ids) in rows {
        q2k[(g * tokens + t) * TOPK..][..ids.len()].copy_from_slice(ids);
    }
    q2k
}

/// Rows that keep no key (all `-1`, or only a later block) give `O = 0`, `LSE = -inf`, zero
/// dQ, and add nothing to dK/dV even with a non-zero dO. `-1` padding, slot order and
/// duplicate ids do not change any result.
#[test]
fn empty_rows_are_zero_and_padding_ids_are_ignored() {
    let lens = [4usize, 130];
    let mut c = random_case(&lens, 20260906);
    let n = c.tokens;
    // Most rows select nothing, which keeps this test cheap; token 4 + l is local row l of doc 1.
    let messy: [(usize, usize, &[i32]); 9] = [
        (0, 0, &[-1, -1, 0]),
        (0, 3, &[0, 0, -1, 0]),
        (2, 2, &[-1, -1, -1, -1, -1, -1, -1, 0]),
        (3, 3, &[-1, 0, -1, 0]),
        (0, 4 + 5, &[-1, 0]),
        (0, 4 + 128, &[1, -1, 0, 1]),
        (1, 4 + 129, &[-1, -1, -1, 0]), // an earlier block only (own block not selected)
        (2, 4 + 5, &[1, -1, 1]),        // a later block only: empty
        (3, 4 + 10, &[-1, 1]),          // a later block only: empty
    ];
    let canonical: [(usize, usize, &[i32]); 9] = [
        (0, 0, &[0]),
        (0, 3, &[0]),
        (2, 2, &[0]),
        (3, 3, &[0]),
        (0, 4 + 5, &[0]),
        (0, 4 + 128, &[0, 1]),
        (1, 4 + 129, &[0]),
        (2, 4 + 5, &[1]),
        (3, 4 + 10, &[1]),
    ];
    c.q2k = q2k_with(n, &messy);
    let dout = Rng(5).bf16_values(n * HQ * D, 1.0);
    let fwd = run_forward(&c);
    let grads = run_backward(&c, &fwd, &dout);

    let mask = dense_mask(&c);
    let mut empty_rows = 0;
    for t in 0..n {
        for (g, mask_g) in mask.iter().enumerate() {
            let empty = !(0..n).any(|s| mask_g[t * n + s]);
            empty_rows += usize::from(empty);
            for h in g * HPG..(g + 1) * HPG {
                let (row, lse) = ((t * HQ + h) * D, fwd.lse[t * HQ + h]);
                let (o, dq) = (&fwd.out[row..row + D], &grads.dq[row..row + D]);
                if empty {
                    assert_eq!(lse, f32::NEG_INFINITY, "LSE[{t},{h}] of an empty row");
                    assert!(o.iter().all(|&x| x == 0.0), "O[{t},{h}] of an empty row");
                    assert!(dq.iter().all(|&x| x == 0.0), "dQ[{t},{h}] of an empty row");
                } else {
                    assert!(lse.is_finite(), "LSE[{t},{h}] = {lse} of a kept row");
                    assert!(o.iter().chain(dq).all(|x| x.is_finite()));
                    assert!(o.iter().any(|&x| x != 0.0), "O[{t},{h}] of a kept row is 0");
                }
            }
        }
    }
    assert_eq!(empty_rows, HKV * n - canonical.len() + 2);
    for (name, x) in [("dK", &grads.dk), ("dV", &grads.dv)] {
        assert!(
            x.iter().all(|v| v.is_finite()),
            "{name} has a non-finite value"
        );
        // A key no query attends gets exactly zero; an attended one gets something.
        for s in 0..n {
            for g in 0..HKV {
                let attended = (0..n).any(|t| mask[g][t * n + s]);
                let key = &x[(s * HKV + g) * D..][..D];
                assert_eq!(
                    key.iter().any(|&v| v != 0.0),
                    attended,
                    "{name}[{s},{g}]: attended = {attended}"
                );
            }
        }
    }

    // dO on empty rows must not matter anywhere.
    let mut dout_masked = dout.clone();
    for t in 0..n {
        for h in 0..HQ {
            if fwd.lse[t * HQ + h] == f32::NEG_INFINITY {
                dout_masked[(t * HQ + h) * D..][..D].fill(0.0);
            }
        }
    }
    assert_same_grads("masked dO", &run_backward(&c, &fwd, &dout_masked), &grads);

    // An LSE of -inf marks a row as empty to backward (the kernel's P = 0), even one that
    // keeps keys: it then contributes exactly what a zero dO would. Token 4+128 keeps blocks
    // 0 and 1 in group 0 (heads 0..16): mark heads 3..9 only; token 4+129 keeps block 0 in
    // group 1 (heads 16..32): mark all its heads.
    let marked = [(4 + 128, 3..9), (4 + 129, 0..HQ)];
    let mut lse = fwd.lse.clone();
    let mut dout_zeroed = dout.clone();
    for (t, heads) in marked.clone() {
        lse[t * HQ + heads.start..t * HQ + heads.end].fill(f32::NEG_INFINITY);
        dout_zeroed[(t * HQ + heads.start) * D..(t * HQ + heads.end) * D].fill(0.0);
    }
    let (q, k, v) = (&c.q, &c.k, &c.v);
    let with_lse = reference::backward(q, k, v, &c.q2k, &c.cu, &fwd.out, &lse, &dout).unwrap();
    let with_dout = run_backward(&c, &fwd, &dout_zeroed);
    assert_same_grads("LSE -inf", &with_lse, &with_dout);
    for (t, heads) in marked {
        let dq = &with_lse.dq[(t * HQ + heads.start) * D..(t * HQ + heads.end) * D];
        assert!(dq.iter().all(|&x| x == 0.0), "dQ of marked heads at {t}");
    }
    let kept_dq = &with_lse.dq[(132 * HQ + 9) * D..(132 * HQ + 16) * D];
    assert!(
        kept_dq.iter().any(|&x| x != 0.0),
        "unmarked heads lost their dQ"
    );

    // The same sets written canonically give identical results.
    let messy_q2k = std::mem::replace(&mut c.q2k, q2k_with(n, &canonical));
    assert_ne!(messy_q2k, c.q2k);
    let fwd_canonical = run_forward(&c);
    assert_same("canonical O", &fwd_canonical.out, &fwd.out);
    assert_same("canonical LSE", &fwd_canonical.lse, &fwd.lse);
    let grads_canonical = run_backward(&c, &fwd_canonical, &dout);
    assert_same_grads("canonical", &grads_canonical, &grads);
}

/// A document across token 1024 (where the reference splits its work into query chunks and sums
/// dK/dV partials) gives the results of the same document alone, after other documents whose
/// rows select nothing. O, LSE and dQ are per query and must match bit for bit.
#[test]
fn document_across_work_chunks_matches_document_alone() {
    let (before, len) = (994usize, 60usize);
    let alone = random_case(&[len], 20260908);
    let n = before + len;
    let mut c = Case {
        cu: vec![0, 500, before as i32, n as i32],
        tokens: n,
        q: vec![0.0; n * HQ * D],
        k: vec![0.0; n * HKV * D],
        v: vec![0.0; n * HKV * D],
        q2k: vec![-1; HKV * n * TOPK],
    };
    c.q[before * HQ * D..].copy_from_slice(&alone.q);
    c.k[before * HKV * D..].copy_from_slice(&alone.k);
    c.v[before * HKV * D..].copy_from_slice(&alone.v);
    for g in 0..HKV {
        c.q2k[(g * n + before) * TOPK..][..len * TOPK]
            .copy_from_slice(&alone.q2k[g * len * TOPK..][..len * TOPK]);
    }
    let dout_alone = Rng(13).bf16_values(len * HQ * D, 1.0);
    let mut dout = vec![0.0; n * HQ * D];
    dout[before * HQ * D..].copy_from_slice(&dout_alone);

    let (fwd_alone, fwd) = (run_forward(&alone), run_forward(&c));
    let (grads_alone, grads) = (
        run_backward(&alone, &fwd_alone, &dout_alone),
        run_backward(&c, &fwd, &dout),
    );
    assert_same("O", &fwd.out[before * HQ * D..], &fwd_alone.out);
    assert_same("LSE", &fwd.lse[before * HQ..], &fwd_alone.lse);
    assert!(fwd.lse[..before * HQ]
        .iter()
        .all(|&x| x == f32::NEG_INFINITY));
    assert_same("dQ", &grads.dq[before * HQ * D..], &grads_alone.dq);
    for (name, got, exp) in [
        ("dK", &grads.dk, &grads_alone.dk),
        ("dV", &grads.dv, &grads_alone.dv),
    ] {
        assert!(
            got[..before * HKV * D].iter().all(|&x| x == 0.0),
            "{name} of empty documents"
        );
        // Keys before token 1024 get two partial sums here: equal up to f32 rounding.
        let tail = &got[before * HKV * D..];
        reference::check_close(name, tail, exp, 2e-5, 1e-5).unwrap();
    }
    let ws = grads.workspace_rows;
    assert_eq!(
        ws,
        500usize.div_ceil(BLOCK) * BLOCK + 494usize.div_ceil(BLOCK) * BLOCK + BLOCK
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Aligned workspace layout.

/// Geometry of `docs/design.md` §4.2: `cu_seqlens [0,3,5,9]` puts the documents at workspace rows
/// 0, 128 and 256 of `W = 384`; the scatter and gather are inverse; backward's aligned dK/dV
/// are the compact ones scattered.
#[test]
fn aligned_layout_places_documents_on_block_boundaries() {
    let cu = [0, 3, 5, 9];
    let rows = [0usize, 1, 2, 128, 129, 256, 257, 258, 259];
    for heads in [1usize, 4] {
        let width = heads * D;
        let compact: Vec<f32> = (0..9 * width).map(|i| i as f32 + 1.0).collect();
        let aligned = reference::to_aligned(&compact, &cu, heads).unwrap();
        assert_eq!(aligned.len(), 384 * width);
        let mut expected = vec![0.0f32; 384 * width];
        for (t, &r) in rows.iter().enumerate() {
            expected[r * width..(r + 1) * width].copy_from_slice(&compact[t * width..][..width]);
        }
        assert_same(&format!("aligned, heads = {heads}"), &aligned, &expected);
        let back = reference::from_aligned(&aligned, &cu, heads).unwrap();
        assert_same(&format!("round trip, heads = {heads}"), &back, &compact);
    }

    let c = random_case(&[3, 2, 4], 20260907);
    assert_eq!(c.cu, cu);
    let dout = Rng(9).bf16_values(9 * HQ * D, 1.0);
    let fwd = run_forward(&c);
    let grads = run_backward(&c, &fwd, &dout);
    assert_eq!(grads.workspace_rows, 384);
    let width = HKV * D;
    for (name, compact, aligned) in [
        ("dK", &grads.dk, &grads.dk_aligned),
        ("dV", &grads.dv, &grads.dv_aligned),
    ] {
        assert_eq!(aligned.len(), 384 * width, "{name}");
        for r in 0..384 {
            let got = &aligned[r * width..(r + 1) * width];
            match rows.iter().position(|&x| x == r) {
                Some(t) => assert_eq!(got, &compact[t * width..][..width], "{name} row {r}"),
                None => assert!(got.iter().all(|&x| x == 0.0), "{name} padding row {r}"),
            }
        }
        assert!(compact.iter().any(|&x| x != 0.0), "{name} is all zero");
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Delta preprocess and postprocess.

/// Hand-computed delta values, dQ pool positions and bf16 round-to-nearest-even cases.
#[test]
fn preprocess_delta_and_postprocess_match_hand_examples() {
    // delta[t,h] = Σ_d O·dO over [2,64,128].
    let mut out = vec![0.0f32; 2 * HQ * D];
    let mut dout = vec![0.0f32; 2 * HQ * D];
    let at = |t: usize, h: usize, d: usize| (t * HQ + h) * D + d;
    for d in 0..D {
        out[at(1, 3, d)] = 1.0;
        dout[at(1, 3, d)] = d as f32; // Σ 0..127 = 8128
    }
    out[at(0, 63, 0)] = 2.0;
    dout[at(0, 63, 0)] = -1.5; // -3
    out[at(0, 5, 0)] = 1.0;
    dout[at(0, 5, 0)] = 1.0;
    out[at(0, 5, 127)] = 0.5;
    dout[at(0, 5, 127)] = 0.25; // 1 + 0.125
    out[at(1, 7, 9)] = 4.0; // dO is zero there: 0
    let delta = reference::preprocess_delta(&out, &dout, 2).unwrap();
    let mut expected = vec![0.0f32; 2 * HQ];
    expected[64 + 3] = 8128.0;
    expected[63] = -3.0;
    expected[5] = 1.125;
    assert_same("delta", &delta, &expected);

    // dQ pool [T,32,128,2]: element (t, hp, d, e) holds dQ[t, 2hp+e, d].
    let b = bf16::from_f32;
    let mut pool = vec![b(0.0); 2 * HQ * D];
    let cases = [
        // (pool index, value, dq index) with (t, hp, d, e) -> (t, h, d) worked out by hand:
        (0, -2.0, 0),       // (0,0,0,0) -> (0,0,0)
        (1, 0.75, 128),     // (0,0,0,1) -> (0,1,0)
        (2, 1.5, 1),        // (0,0,1,0) -> (0,0,1)
        (8191, 6.0, 8191),  // (0,31,127,1) -> (0,63,127)
        (8719, 3.5, 8839),  // (1,2,7,1) -> (1,5,7): ((1·32+2)·128+7)·2+1, (1·64+5)·128+7
        (8454, -8.0, 8451), // (1,1,3,0) -> (1,2,3): (33·128+3)·2, (66·128+3)
    ];
    for &(p, v, _) in &cases {
        pool[p] = b(v);
    }
    let dk_pool: Vec<f32> = [
        1.0 + 2f32.powi(-8),       // tie -> even: 1.0
        1.0078125 + 2f32.powi(-8), // tie -> even: 1.015625
        1.0 + 3.0 * 2f32.powi(-9), // above the tie: 1.0078125
        -(1.0 + 2f32.powi(-8)),    // -1.0
        65504.0,                   // 1.1111111111b·2^15 rounds up to 2^16
        f32::MAX,                  // rounds past bf16::MAX: +inf
        3.0,
    ]
    .into_iter()
    .chain(std::iter::repeat(0.0))
    .take(2 * HKV * D)
    .collect();
    let mut dv_pool = vec![0.0f32; HKV * D];
    dv_pool[511] = -0.3; // -0.30078125 (0xBE9A) and not -0.298828125
    dv_pool[1] = f32::NAN;
    let (dq, dk, dv) = reference::postprocess(&pool, &dk_pool, &dv_pool).unwrap();
    let mut dq_expected = vec![b(0.0); 2 * HQ * D];
    for &(_, v, q) in &cases {
        dq_expected[q] = b(v);
    }
    assert_same("dQ", &dq, &dq_expected);
    let dk_bits: Vec<u16> = dk[..7].iter().map(|x| x.to_bits()).collect();
    // 1.0 = 0x3F80, 1.015625 = 0x3F82, 1.0078125 = 0x3F81, 65536 = 0x4780, inf = 0x7F80, 3 = 0x4040.
    assert_eq!(
        dk_bits,
        [0x3F80, 0x3F82, 0x3F81, 0xBF80, 0x4780, 0x7F80, 0x4040]
    );
    assert!(dk[7..].iter().all(|x| x.to_bits() == 0));
    assert_eq!(dv.len(), HKV * D);
    assert_eq!(dv[511].to_bits(), 0xBE9A);
    assert!(dv[1].is_nan());

    // interleave_dq_pool is the inverse permutation, for f32 and bf16 alike.
    let dq_f32: Vec<f32> = (0..2 * HQ * D).map(|i| i as f32).collect();
    let pool_f32 = reference::interleave_dq_pool(&dq_f32).unwrap();
    assert_eq!(pool_f32[8719], 8839.0);
    assert_eq!(pool_f32[1], 128.0);
    let back = reference::deinterleave_dq_pool(&pool_f32).unwrap();
    assert_same("de-interleaved", &back, &dq_f32);
    let repacked = reference::interleave_dq_pool(&dq_expected).unwrap();
    assert_same("re-interleaved", &repacked, &pool);
}

// ---------------------------------------------------------------------------------------------
// 6. The tolerance checker.

#[test]
fn check_close_reports_failures_and_passes_within_tolerance() {
    use reference::check_close;
    // Figures: ‖(0, 0.5)‖ / ‖(3, 4)‖ = 0.1, worst index 1.
    let stats = check_close("x", &[3.0, 4.5], &[3.0, 4.0], 0.5, 0.1).unwrap();
    assert_eq!((stats.max_abs, stats.worst_index, stats.len), (0.5, 1, 2));
    assert!((stats.l2_rel.unwrap() - 0.1).abs() < 1e-12);
    assert_eq!((stats.worst_got, stats.worst_expected), (4.5, 4.0));

    let expected: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.37).sin()).collect();
    let close: Vec<f32> = expected.iter().map(|x| x + 1e-3).collect();
    let tol = reference::DQ_TOLERANCE;
    assert!(tol.check("dQ", &close, &expected).is_ok());

    // One bad element: max-abs fails, the message names tensor, index and figures.
    let mut spike = expected.clone();
    spike[7] += 0.05;
    let err = tol.check("dQ", &spike, &expected).unwrap_err();
    for part in [
        "dQ",
        "index 7",
        "max-abs 5.000e-2",
        "tolerances max-abs 3.500e-2",
    ] {
        assert!(err.contains(part), "{part:?} missing from {err:?}");
    }
    assert!(err.contains("(max-abs failed)"), "{err}");

    // Small everywhere but biased: only L2-rel fails (1% > 0.7%).
    let biased: Vec<f32> = expected.iter().map(|x| x * 1.01).collect();
    let err = check_close("dK", &biased, &expected, 0.075, 0.007).unwrap_err();
    assert!(
        err.starts_with("dK:") && err.contains("(L2-rel failed)"),
        "{err}"
    );

    // Non-finite values: equal infinities match (LSE of empty rows), anything else fails.
    let lse = [f32::NEG_INFINITY, 1.0];
    assert!(check_close("LSE", &lse, &lse, 0.0, 0.0).is_ok());
    let err = check_close("LSE", &[1.0, 1.0], &lse, 1.0, 1.0).unwrap_err();
    assert!(err.contains("LSE") && err.contains("index 0"), "{err}");
    let err = check_close("O", &[0.0, f32::NAN], &[0.0, 0.0], 1.0, 1.0).unwrap_err();
    assert!(
        err.contains("O:") && err.contains("index 1") && err.contains("NaN"),
        "{err}"
    );

    // ‖expected‖ = 0: L2-rel is undefined and only max-abs judges.
    let zeros = [0.0f32; 4];
    let stats = check_close("dV", &[0.0, 1e-6, 0.0, 0.0], &zeros, 1e-5, 0.0).unwrap();
    assert_eq!(stats.l2_rel, None);
    assert!(check_close("dV", &[0.0, 0.5, 0.0, 0.0], &zeros, 0.1, 0.007).is_err());

    let err = check_close("dQ", &[1.0], &[1.0, 2.0], 1.0, 1.0).unwrap_err();
    assert!(err.contains("dQ") && err.contains("length"), "{err}");

    // The §4.3 figures.
    let pairs = [
        (reference::O_TOLERANCE, 0.025, 0.006),
        (reference::DQ_TOLERANCE, 0.035, 0.007),
        (reference::DK_TOLERANCE, 0.075, 0.007),
        (reference::DV_TOLERANCE, 0.1, 0.007),
    ];
    for (t, max_abs, l2_rel) in pairs {
        assert_eq!((t.max_abs, t.l2_rel), (max_abs, l2_rel));
    }
}

// ---------------------------------------------------------------------------------------------
// 7. Bad inputs.

#[test]
fn invalid_inputs_return_typed_errors() {
    let c = random_case(&[3, 130], 1);
    let n = c.tokens;
    let length_field = |e: ReferenceError| match e {
        ReferenceError::Length { field, .. } => field,
        other => panic!("expected a length error, got {other:?}"),
    };
    let fwd = |q: &[f32], k: &[f32], q2k: &[i32], cu: &[i32]| {
        reference::forward(q, k, &c.v, q2k, cu).unwrap_err()
    };
    assert_eq!(length_field(fwd(&c.q[1..], &c.k, &c.q2k, &c.cu)), "q");
    assert_eq!(length_field(fwd(&c.q, &c.k[..5], &c.q2k, &c.cu)), "k");
    assert_eq!(length_field(fwd(&c.q, &c.k, &c.q2k[1..], &c.cu)), "q2k");
    assert!(matches!(
        fwd(&c.q, &c.k, &c.q2k, &[1, 133]),
        ReferenceError::Schedule(_)
    ));
    assert!(matches!(
        fwd(&c.q, &c.k, &c.q2k, &[0, 134, 133]),
        ReferenceError::Schedule(_)
    ));
    // Block 2 does not exist in a 130-token document; -2 is not the padding id.
    for bad in [2, -2] {
        let mut q2k = c.q2k.clone();
        q2k[(n + 7) * TOPK + 3] = bad;
        let err = fwd(&c.q, &c.k, &q2k, &c.cu);
        let msg = err.to_string();
        assert!(
            matches!(&err, ReferenceError::Value { field, .. } if field == "q2k[1, 7, 3]"),
            "{msg}"
        );
        assert!(
            msg.contains(&bad.to_string()) && msg.contains("document 1 (0..2)"),
            "{msg}"
        );
    }
    let msg = fwd(&c.q[1..], &c.k, &c.q2k, &c.cu).to_string();
    assert!(
        msg.contains("`q`") && msg.contains(&(n * HQ * D - 1).to_string()),
        "{msg}"
    );

    let ok = run_forward(&c);
    let bwd = |out: &[f32], lse: &[f32], dout: &[f32]| {
        let (q, k, v) = (&c.q, &c.k, &c.v);
        reference::backward(q, k, v, &c.q2k, &c.cu, out, lse, dout).unwrap_err()
    };
    assert_eq!(length_field(bwd(&ok.out[1..], &ok.lse, &ok.out)), "out");
    assert_eq!(length_field(bwd(&ok.out, &ok.lse[1..], &ok.out)), "lse");
    assert_eq!(length_field(bwd(&ok.out, &ok.lse, &ok.out[1..])), "dout");

    let e = reference::to_aligned(&[0.0; 5], &c.cu, 4).unwrap_err();
    assert_eq!(length_field(e), "compact");
    let e = reference::from_aligned(&[0.0; 5], &c.cu, 4).unwrap_err();
    assert_eq!(length_field(e), "aligned");
    let e = reference::preprocess_delta(&ok.out, &ok.out[1..], n).unwrap_err();
    assert_eq!(length_field(e), "dout");
    let e = reference::interleave_dq_pool(&[0.0f32; 5]).unwrap_err();
    assert_eq!(length_field(e), "dq");
    let pool = vec![bf16::ZERO; HQ * D];
    let e = reference::postprocess(&pool[1..], &[], &[]).unwrap_err();
    assert_eq!(length_field(e), "dq_pool");
    let e = reference::postprocess(&pool, &[0.0; 3], &[]).unwrap_err();
    assert_eq!(length_field(e), "dk_pool");
    let e = reference::postprocess(&pool, &[], &[0.0; 3]).unwrap_err();
    assert_eq!(length_field(e), "dv_pool");
}

// ---------------------------------------------------------------------------------------------
// The sampled references against the full one.

#[test]
fn sampled_rows_and_blocks_match_the_full_reference() {
    use reference::sampled::{dk_dv_block, dq_row, Inputs};
    let lens = [300, 1, 700, 129];
    let c = random_case(&lens, 4242);
    let fwd = run_forward(&c);
    let mut rng = Rng(4243);
    let dout = rng.bf16_values(c.tokens * HQ * D, 1.0);
    let out: Vec<f32> = fwd
        .out
        .iter()
        .map(|&x| bf16::from_f32(x).to_f32())
        .collect();
    let full = reference::backward(&c.q, &c.k, &c.v, &c.q2k, &c.cu, &out, &fwd.lse, &dout).unwrap();
    let b = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<bf16>>();
    let k_aligned = reference::to_aligned(&c.k, &c.cu, HKV).unwrap();
    let v_aligned = reference::to_aligned(&c.v, &c.cu, HKV).unwrap();
    let (starts, _) = msa_runtime::workspace_layout(&c.cu).unwrap();
    let (q, k, v, d_o, o) = (b(&c.q), b(&k_aligned), b(&v_aligned), b(&dout), b(&out));
    let x = Inputs {
        q: &q,
        k_aligned: &k,
        v_aligned: &v,
        grad_out: &d_o,
        out: &o,
        lse: &fwd.lse,
        q2k: &c.q2k,
        cu_seqlens: &c.cu,
        ws_starts: &starts,
    };
    let close = |what: &str, got: &[f32], want: &[f32]| {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "{what}[{i}]: sampled {g}, full {w}"
            );
        }
    };
    // Every third token (all heads) keeps the test short; all blocks below.
    for t in (0..c.tokens).step_by(3) {
        for h in 0..HQ {
            let want = &full.dq[(t * HQ + h) * D..][..D];
            close(&format!("dq[{t},{h}]"), &dq_row(&x, t, h), want);
        }
    }
    let mut blocks = 0;
    for (doc, &len) in lens.iter().enumerate() {
        for kb in 0..len.div_ceil(BLOCK) {
            for g in 0..HKV {
                let (dk, dv) = dk_dv_block(&x, g, doc, kb);
                let row0 = starts[doc] as usize + kb * BLOCK;
                for j in 0..BLOCK {
                    let at = ((row0 + j) * HKV + g) * D;
                    let what = format!("doc {doc} block {kb} group {g} key {j}");
                    close(
                        &format!("dk {what}"),
                        &dk[j * D..][..D],
                        &full.dk_aligned[at..][..D],
                    );
                    close(
                        &format!("dv {what}"),
                        &dv[j * D..][..D],
                        &full.dv_aligned[at..][..D],
                    );
                }
                blocks += 1;
            }
        }
    }
    assert_eq!(blocks, 4 * (3 + 1 + 6 + 2));
}
