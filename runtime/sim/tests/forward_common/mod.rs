//! What the forward simulator tests share: a case's random inputs with the f32 CPU
//! reference's outputs, and the comparison at the seed's tolerances (`out` within 0.025
//! max-abs / 0.006 L2-rel, `lse` within 1e-3, empty rows exactly `out = 0`, `lse = −∞`).

#![allow(dead_code)]

use half::bf16;
use msa_runtime::reference::{self, O_TOLERANCE};
use msa_runtime::{workspace_layout, ResidentSchedule, ScheduleBuildSizes, Span};
use msa_sim::backward::Rng;
use msa_sim::device::SimDevice;

/// Elements of one token's Q row, `[64, 128]`.
pub const Q_ROW: usize = 64 * 128;
/// Elements of one token's K/V row, `[4, 128]`.
pub const KV_ROW: usize = 4 * 128;

/// One case's inputs and the CPU reference's outputs.
pub struct Inputs {
    pub t: usize,
    pub q: Vec<bf16>,
    pub ka: Vec<bf16>,
    pub va: Vec<bf16>,
    pub want_out: Vec<f32>,
    pub want_lse: Vec<f32>,
}

/// Random Q/K/V for the documents `cu` (K/V in the aligned layout) and the reference
/// forward of `q2k` on them.
pub fn inputs(cu: &[i32], q2k: &[i32], seed: u64) -> Inputs {
    let t = *cu.last().unwrap() as usize;
    let mut rng = Rng(seed);
    let (q, q32) = rng.bf16s(t * Q_ROW);
    let (_, k32) = rng.bf16s(t * KV_ROW);
    let (_, v32) = rng.bf16s(t * KV_ROW);
    let want = reference::forward(&q32, &k32, &v32, q2k, cu).expect("reference");
    let (_, w) = workspace_layout(cu).expect("layout");
    let aligned = |x: &[f32]| -> Vec<bf16> {
        reference::to_aligned(x, cu, 4)
            .unwrap()
            .iter()
            .map(|&x| bf16::from_f32(x))
            .collect()
    };
    let (ka, va) = (aligned(&k32), aligned(&v32));
    assert_eq!(ka.len(), w * KV_ROW);
    Inputs {
        t,
        q,
        ka,
        va,
        want_out: want.out,
        want_lse: want.lse,
    }
}

/// Compares with the reference: `out` within the O tolerance, `lse` within 1e-3, empty rows
/// exactly 0 and −∞.
pub fn compare(inp: &Inputs, out: &[f32], lse: &[f32]) -> Result<String, String> {
    let stats = O_TOLERANCE
        .check("out", out, &inp.want_out)
        .map_err(|e| e.to_string())?;
    let mut lse_err = 0f32;
    for (i, (&g, &e)) in lse.iter().zip(&inp.want_lse).enumerate() {
        if e == f32::NEG_INFINITY {
            if g != e {
                return Err(format!("lse[{i}] of an empty row is {g}"));
            }
            if out[i * 128..i * 128 + 128].iter().any(|&x| x != 0.0) {
                return Err(format!("out of empty row {i} is not 0"));
            }
        } else {
            let d = (g - e).abs();
            if d.is_nan() || d > 1e-3 {
                return Err(format!("lse[{i}] = {g}, want {e}"));
            }
            lse_err = lse_err.max(d);
        }
    }
    Ok(format!("{stats}; lse max-abs {lse_err:.2e}"))
}

/// The device schedule of `q2k` over the documents `cu` (`W = w`), built on `dev` as
/// `run_forward` builds it; returns it and the uploaded `q2k`.
pub fn device_schedule(
    dev: &mut SimDevice,
    cu: &[i32],
    q2k: &[i32],
    w: usize,
) -> (ResidentSchedule<SimDevice>, Span<i32>) {
    let t = *cu.last().unwrap() as usize;
    let sizes = ScheduleBuildSizes::new(t, cu.len() - 1, w, 64).expect("sizes");
    let mut s = ResidentSchedule::new(dev, sizes).expect("schedule");
    let q2k_d = dev.upload_new("q2k", q2k);
    let cu_d = dev.upload_new("cu", cu);
    let q2k_s = Span::new(q2k_d.ptr.addr(), q2k.len());
    s.build(dev, q2k_s, Span::new(cu_d.ptr.addr(), cu.len()))
        .expect("build");
    (s, q2k_s)
}
