//! The shipped PTX (the `VARIANTS` the runtime JIT-loads) run through the runtime's own launch
//! functions on the simulator ([`SimDevice`]) against the CPU references of `msa_runtime`. No
//! GPU needed.

use std::time::Instant;

use half::bf16;
use msa_runtime::backend::Backend;
use msa_runtime::contract::Locality;
use msa_runtime::ops::{postprocess as run_postprocess, preprocess};
use msa_runtime::reference::tasks::{build_task_tables, build_task_tables_with, task_capacity};
use msa_runtime::reference::{postprocess, preprocess_delta};
use msa_runtime::schedule::Schedule;
use msa_runtime::tasks::{DeviceSchedule, TaskBuildSizes, TaskWorkspace, BIN_CHUNK};
use msa_runtime::{build_schedule, causal_support, Span};
use msa_sim::backward::{cu_of, Rng};
use msa_sim::device::{Arch, SimDevice};
use msa_sim::Element;

const ARCHES: [Arch; 2] = [Arch::Sm90, Arch::Sm100];

/// The draws these tests take from the simulator's seeded stream ([`Rng`]).
trait Draws {
    /// A bf16 of random sign, significand and exponent in `2^[-6, 2)`.
    fn bf16(&mut self) -> bf16;
    /// Uniform in `[lo, hi)`, from 24 random bits.
    fn f32_in(&mut self, lo: f32, hi: f32) -> f32;
}

impl Draws for Rng {
    fn bf16(&mut self) -> bf16 {
        let r = self.next_u64();
        let sign = (r & 1) as u16;
        let exp = 127 - 6 + ((r >> 1) % 8) as u16;
        let man = ((r >> 8) & 0x7f) as u16;
        bf16::from_bits(sign << 15 | exp << 7 | man)
    }

    fn f32_in(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }
}

/// `data` in a fresh buffer of `dev`.
fn span<T: Element>(dev: &mut SimDevice, name: &str, data: &[T]) -> Span<T> {
    Span::new(dev.upload_new(name, data).ptr.addr(), data.len())
}

// ---------------------------------------------------------------------------------------------
// bwd_preprocess
// ---------------------------------------------------------------------------------------------

/// The kernel's own summation order: lane `l` of a row's 16 lanes accumulates elements
/// `8l..8l+8` with `fma.rn` from 0, then a butterfly over lanes 1, 2, 4, 8.
fn delta_in_kernel_order(o: &[bf16], d: &[bf16]) -> f32 {
    let mut part = [0f32; 16];
    for (l, p) in part.iter_mut().enumerate() {
        for i in 8 * l..8 * l + 8 {
            *p = o[i].to_f32().mul_add(d[i].to_f32(), *p);
        }
    }
    for step in [1, 2, 4, 8] {
        let prev = part;
        for (l, p) in part.iter_mut().enumerate() {
            *p = prev[l] + prev[l ^ step];
        }
    }
    part[0]
}

#[test]
fn preprocess_matches_the_reference() {
    const HEADS: usize = 64;
    const DIM: usize = 128;
    for arch in ARCHES {
        // 300 tokens: three CTAs along x, the last one partial.
        let tokens = 300;
        let n = tokens * HEADS * DIM;
        let mut rng = Rng(11 + arch as u64);
        let out: Vec<bf16> = (0..n).map(|_| rng.bf16()).collect();
        let dout: Vec<bf16> = (0..n).map(|_| rng.bf16()).collect();

        // The runtime's `preprocess` (grid, arguments) on a simulated device.
        let mut dev = SimDevice::new(arch, 1);
        let o_d = span(&mut dev, "out", &out);
        let do_d = span(&mut dev, "dout", &dout);
        // Poisoned so that a row the kernel skips would show.
        let delta_d = span(&mut dev, "delta", &vec![f32::NAN; tokens * HEADS]);
        let t0 = Instant::now();
        preprocess(&mut dev, o_d, do_d, delta_d, tokens).unwrap_or_else(|e| panic!("{e}"));
        println!(
            "{arch:?} bwd_preprocess: {:?} in {:?}",
            dev.launches(),
            t0.elapsed()
        );
        let got: Vec<f32> = dev.read(delta_d.addr, tokens * HEADS).expect("read");

        let of: Vec<f32> = out.iter().map(|x| x.to_f32()).collect();
        let dof: Vec<f32> = dout.iter().map(|x| x.to_f32()).collect();
        let expected = preprocess_delta(&of, &dof, tokens).expect("reference");
        let mut worst = 0f64;
        for r in 0..tokens * HEADS {
            let row = r * DIM..(r + 1) * DIM;
            // Bit-exact against the kernel's own order...
            let exact = delta_in_kernel_order(&out[row.clone()], &dout[row.clone()]);
            assert_eq!(
                got[r].to_bits(),
                exact.to_bits(),
                "{arch:?} row {r}: {} vs kernel-order {}",
                got[r],
                exact
            );
            // ...and within a few ulps of Σ|o·do| of the reference (a different order).
            let scale: f64 = row
                .map(|i| (of[i] as f64 * dof[i] as f64).abs())
                .sum::<f64>();
            let err = (got[r] as f64 - expected[r] as f64).abs() / (scale * f32::EPSILON as f64);
            worst = worst.max(err);
            assert!(
                err <= 4.0,
                "{arch:?} row {r}: {} vs {} ({err} ulp of Σ|o·do|)",
                got[r],
                expected[r]
            );
        }
        println!("{arch:?} bwd_preprocess: worst |sim − reference| = {worst:.3} ε·Σ|o·do|");
    }
}

// ---------------------------------------------------------------------------------------------
// bwd_postprocess
// ---------------------------------------------------------------------------------------------

/// f32 values that exercise round-to-nearest-even: ties both ways, subnormals, overflow.
fn tricky_f32(rng: &mut Rng, i: usize) -> f32 {
    match i % 16 {
        0 => f32::from_bits(0x3f80_8000), // 1 + 2^-8: tie, stays 1.0
        1 => f32::from_bits(0x3f81_8000), // tie, rounds up
        2 => f32::from_bits(0xbf80_8001), // just above the tie
        3 => f32::from_bits(0x0000_0001), // smallest subnormal
        4 => f32::from_bits(0x0040_8000), // subnormal tie
        5 => f32::MAX,                    // rounds to +inf
        6 => -0.0,
        7 => f32::NEG_INFINITY,
        8 => f32::from_bits(0x7f7f_8000), // tie at the top: to inf
        _ => rng.f32_in(-3.0, 3.0) * 2f32.powi((rng.next_u64() % 40) as i32 - 20),
    }
}

#[test]
fn postprocess_is_bit_exact() {
    const ROW: usize = 64 * 128;
    const KV_ROW: usize = 4 * 128;
    for arch in ARCHES {
        // dq-bound (2T > W/2) and kv-bound (W/2 > 2T) grids.
        for (tokens, ws_rows) in [(37usize, 128usize), (20, 256)] {
            let mut rng = Rng(5 + tokens as u64);
            let dq_pool: Vec<bf16> = (0..tokens * ROW).map(|_| rng.bf16()).collect();
            let dk_pool: Vec<f32> = (0..ws_rows * KV_ROW)
                .map(|i| tricky_f32(&mut rng, i))
                .collect();
            let dv_pool: Vec<f32> = (0..ws_rows * KV_ROW)
                .map(|i| tricky_f32(&mut rng, i + 3))
                .collect();

            // The runtime's `postprocess` (grid, arguments) on a simulated device, from a
            // separate pool and in place (`dq` is the pool, as in the backward).
            for in_place in [false, true] {
                let mut dev = SimDevice::new(arch, 1);
                let a = (
                    span(&mut dev, "dq_pool", &dq_pool),
                    span(&mut dev, "dk_pool", &dk_pool),
                    span(&mut dev, "dv_pool", &dv_pool),
                );
                let poison = |n| vec![bf16::from_bits(0x7fc1); n];
                let o = [
                    if in_place {
                        a.0
                    } else {
                        span(&mut dev, "dq", &poison(tokens * ROW))
                    },
                    span(&mut dev, "dk", &poison(ws_rows * KV_ROW)),
                    span(&mut dev, "dv", &poison(ws_rows * KV_ROW)),
                ];
                let t0 = Instant::now();
                run_postprocess(&mut dev, a.0, a.1, a.2, o[0], o[1], o[2], tokens, ws_rows)
                    .unwrap_or_else(|e| panic!("{e}"));
                println!(
                    "{arch:?} bwd_postprocess T={tokens} W={ws_rows} in place {in_place}: {:?} in {:?}",
                    dev.launches(),
                    t0.elapsed()
                );

                let (dq, dk, dv) = postprocess(&dq_pool, &dk_pool, &dv_pool).expect("reference");
                for (name, out, want) in [("dq", o[0], dq), ("dk", o[1], dk), ("dv", o[2], dv)] {
                    let got: Vec<bf16> = dev.read(out.addr, want.len()).expect("read");
                    if let Some(i) =
                        (0..want.len()).find(|&i| got[i].to_bits() != want[i].to_bits())
                    {
                        panic!(
                            "{arch:?} T={tokens} W={ws_rows} in place {in_place} {name}[{i}]: \
                             {:#06x} vs reference {:#06x}",
                            got[i].to_bits(),
                            want[i].to_bits()
                        );
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Task build
// ---------------------------------------------------------------------------------------------

fn causal(lengths: &[i32]) -> Schedule {
    let cu = cu_of(lengths);
    build_schedule(&causal_support(&cu).unwrap(), &cu, 16).expect("valid schedule")
}

fn check_task_build(what: &str, schedule: &Schedule, num_sms: usize) {
    check_task_build_with(what, schedule, num_sms, Locality::default());
}

fn check_task_build_with(what: &str, schedule: &Schedule, num_sms: usize, locality: Locality) {
    let expected = build_task_tables_with(schedule, num_sms, task_capacity(schedule), locality);
    for arch in ARCHES {
        // The runtime's own task build (sizing, carving, the four launches) on the simulator.
        let mut dev = SimDevice::new(arch, num_sms);
        let t0 = Instant::now();
        let sizes = TaskBuildSizes::with_locality(schedule, num_sms, locality).expect("sizes");
        let uploaded = DeviceSchedule::upload(&mut dev, schedule).expect("upload");
        let mut build =
            TaskWorkspace::new(&mut dev, sizes, schedule.work_capacity()).expect("workspace");
        build
            .build(&mut dev, &uploaded)
            .unwrap_or_else(|e| panic!("{what} on {arch:?}: {e}"));
        let elapsed = t0.elapsed();
        let got = build.read_tables(&mut dev).expect("read back");
        let warp_instructions: u64 = dev.launches().iter().map(|s| s.warp_instructions).sum();
        println!(
            "{what}, {num_sms} SMs, {arch:?}: {} rows, desc {:?}, {warp_instructions} warp instructions in {elapsed:?}",
            got.desc[0], got.desc
        );
        assert_eq!(got.desc, expected.desc, "{what} {arch:?}: descriptor");
        let rows = expected.num_rows();
        for (name, got, want, width) in [
            ("task_meta", &got.meta, &expected.meta, 4),
            ("task_qrows", &got.qrows, &expected.qrows, 8),
            ("task_qpos", &got.qpos, &expected.qpos, 8),
        ] {
            assert_eq!(got.len(), rows * width, "{what} {arch:?}: {name} rows");
            if let Some(r) =
                (0..rows).find(|&r| got[r * width..][..width] != want[r * width..][..width])
            {
                panic!(
                    "{what} {arch:?}: {name} row {r}: {:?} vs oracle {:?}",
                    &got[r * width..][..width],
                    &want[r * width..][..width]
                );
            }
        }
    }
}

#[test]
fn task_build_matches_the_oracle() {
    // The case of the issue: documents (127,129,1,2,3,5,128), 8 SMs.
    let s = causal(&[127, 129, 1, 2, 3, 5, 128]);
    check_task_build("docs (127,129,1,2,3,5,128)", &s, 8);
}

#[test]
fn task_build_zeroes_a_buffer_on_the_scans_spare_ctas_and_keeps_its_tables() {
    // The KV forward's o_pool is zeroed by the two scans' spare CTAs: every word of the
    // region (an odd count, so the halves differ), nothing beyond it, and the same tables.
    let s = causal(&[127, 129, 1, 2, 3, 5, 128]);
    let num_sms = 3;
    let expected = build_task_tables_with(&s, num_sms, task_capacity(&s), Locality::default());
    let mut dev = SimDevice::new(ARCHES[0], num_sms);
    let sizes = TaskBuildSizes::with_locality(&s, num_sms, Locality::default()).expect("sizes");
    let uploaded = DeviceSchedule::upload(&mut dev, &s).expect("upload");
    let mut build = TaskWorkspace::new(&mut dev, sizes, s.work_capacity()).expect("workspace");
    let (words, guard) = (1001usize, 64usize);
    let buf = dev.alloc("zeroed", 16 * (words + guard)).expect("alloc");
    let at = dev.address(&buf);
    dev.upload("zeroed", at, &vec![0xA5u8; 16 * (words + guard)])
        .expect("fill");
    let refs = uploaded.refs();
    build
        .build_zeroing(&mut dev, &refs, Some((at, 16 * words)))
        .expect("build");
    let got = build.read_tables(&mut dev).expect("read back");
    assert_eq!(got.desc, expected.desc, "descriptor");
    assert_eq!(got.meta, expected.meta[..got.meta.len()], "task_meta");
    let bytes = dev
        .download("zeroed", at, 16 * (words + guard))
        .expect("read");
    if let Some(i) = bytes[..16 * words].iter().position(|&b| b != 0) {
        panic!("byte {i} of the region is {:#x}, not zeroed", bytes[i]);
    }
    assert!(
        bytes[16 * words..].iter().all(|&b| b == 0xA5),
        "a byte past the region changed"
    );
    // A misaligned region is refused before any launch.
    let err = build
        .build_zeroing(&mut dev, &refs, Some((at + 4, 16 * words)))
        .expect_err("misaligned");
    assert!(err.to_string().contains("16-byte aligned"), "{err}");
}

#[test]
fn task_build_matches_the_oracle_for_other_sm_counts() {
    let s = causal(&[127, 129, 1, 2, 3, 5, 128]);
    for sms in [1, 3, 148] {
        check_task_build("docs (127,129,1,2,3,5,128)", &s, sms);
    }
}

#[test]
fn task_build_matches_the_oracle_with_64_rows_per_cta() {
    // More than 2400 tasks: the walk switches to 64 rows per CTA; several scan tiles of bins.
    let s = causal(&[1500, 700, 300]);
    let tasks = build_task_tables(&s, 132).num_rows();
    assert!(tasks > 2400, "{tasks} tasks");
    check_task_build("docs (1500,700,300)", &s, 132);
}

#[test]
fn task_build_matches_the_oracle_with_several_windows_per_document() {
    // The default rule gives these short documents one window each; smaller windows (the
    // seed's 512 queries, 128 queries, and one query per block of the document) exercise
    // the per-document window shifts and bin bases, including empty and one-token documents.
    let s = causal(&[1500, 0, 700, 1, 300, 129]);
    // Capped rules: windows under one query per block of the document (the KV forward's
    // L2-sized windows), many bins per task.
    let capped = [(0, 2, 5), (3, 0, 3), (7, 2, 7)].map(|(a, b, c)| Locality::capped(a, b, c));
    // Windows of 8 queries: bins for several CTAs of the bin scan, each starting from the
    // chunks before it.
    let many = TaskBuildSizes::with_locality(&s, 8, capped[1])
        .unwrap()
        .bins;
    assert!(many > 2 * BIN_CHUNK, "{many} bins");
    let rules = [(9, 0), (7, 0), (0, 0), (0, 2)].map(|(a, b)| Locality::uncapped(a, b));
    for rule in rules.into_iter().chain(capped) {
        check_task_build_with(
            &format!("docs (1500,0,700,1,300,129), {rule:?}"),
            &s,
            8,
            rule,
        );
    }
}

/// `s` with its work items (metadata rows) reordered by `order`.
fn reorder_items(s: &Schedule, order: &[usize]) -> Schedule {
    let meta = s.scheduler_metadata();
    let items: Vec<&[i32]> = (0..s.num_work()).map(|i| &meta[6 * i..6 * i + 6]).collect();
    let mut new: Vec<i32> = order
        .iter()
        .flat_map(|&i| items[i].iter().copied())
        .collect();
    new.resize(meta.len(), 0);
    Schedule::new(
        s.row_ptr().to_vec(),
        s.q_indices().to_vec(),
        new,
        s.work_count(),
        s.cu_seqlens().to_vec(),
        s.document_workspace_starts().to_vec(),
    )
    .expect("a reordering of valid items is valid")
}

#[test]
fn task_build_matches_the_oracle_when_a_segment_is_split() {
    // Item 1 moved to the back: segment (head 0, window 0, kblock 0) is no longer one run,
    // so the device flags it and keeps forward order.
    let s = causal(&[700, 300]);
    let n = s.num_work();
    let mut order: Vec<usize> = (0..n).collect();
    let moved = order.remove(1);
    order.push(moved);
    let split = reorder_items(&s, &order);
    let tables = build_task_tables(&split, 8);
    assert_eq!(tables.desc[7], 2, "the oracle flags the split segment");
    check_task_build("split segment", &split, 8);
}

#[test]
fn task_build_matches_the_oracle_when_rows_are_shuffled() {
    // Whole (head, row) runs of items in another order: segments stay contiguous.
    let s = causal(&[700, 300, 45]);
    let meta = s.scheduler_metadata();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for i in 0..s.num_work() {
        let key = &meta[6 * i..6 * i + 2];
        match groups.last_mut() {
            Some(g) if &meta[6 * g[0]..6 * g[0] + 2] == key => g.push(i),
            _ => groups.push(vec![i]),
        }
    }
    let mut rng = Rng(3);
    for i in (1..groups.len()).rev() {
        groups.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let order: Vec<usize> = groups.concat();
    let shuffled = reorder_items(&s, &order);
    assert_eq!(build_task_tables(&shuffled, 8).desc[7], 0);
    check_task_build("shuffled rows", &shuffled, 8);
}

// ---------------------------------------------------------------------------------------------
// bwd_preprocess_det
// ---------------------------------------------------------------------------------------------

/// `Σ|x|` of one 128-element row in the kernel's order (as [`delta_in_kernel_order`]).
fn l1_in_kernel_order(d: &[bf16]) -> f32 {
    let mut part = [0f32; 16];
    for (l, p) in part.iter_mut().enumerate() {
        for x in &d[8 * l..8 * l + 8] {
            *p += x.to_f32().abs();
        }
    }
    for step in [1, 2, 4, 8] {
        let prev = part;
        for (l, p) in part.iter_mut().enumerate() {
            *p = prev[l] + prev[l ^ step];
        }
    }
    part[0]
}

/// The deterministic preprocess's outputs, computed here from the inputs: delta (bit-exact
/// in the kernel's summation order), `a[t, g] = max_{h∈g} max(‖dO[t,h]‖₁, |Δ[t,h]|)` for every
/// row (the buffer is poisoned first, so a row the kernel skips shows), and the group maxima
/// of the `bounds` words (`docs/design.md` §3.8; layout of `codegen`'s `fixed_point`: words
/// `g`, `4 + g`, `8 + g`, `12 + g`, `16 + g` hold max |K|, |V|, |Q|, a, |dO| of group `g`).
#[test]
fn deterministic_preprocess_matches_a_cpu_computation() {
    use msa_runtime::ops::{preprocess_deterministic, FixedPointPools, BOUND_WORDS};
    const HEADS: usize = 64;
    const DIM: usize = 128;
    // Every f32 compared as bits: maxima of non-negative floats are exact.
    let bits = |x: f32| x.to_bits();
    for arch in ARCHES {
        // T = 300: three token CTAs, the last partial; W = 512: a K/V CTA past the tokens.
        let (tokens, ws) = (300usize, 512usize);
        let n = tokens * HEADS * DIM;
        let kv_n = ws * 4 * DIM;
        let mut rng = Rng(41 + arch as u64);
        let mut gen = |len: usize| -> Vec<bf16> { (0..len).map(|_| rng.bf16()).collect() };
        let (out, dout, q, k, v) = (gen(n), gen(n), gen(n), gen(kv_n), gen(kv_n));

        let mut dev = SimDevice::new(arch, 1);
        let spans = [&out, &dout, &q, &k, &v].map(|x| span(&mut dev, "input", x));
        let delta = span(&mut dev, "delta", &vec![f32::NAN; tokens * HEADS]);
        let row_bounds = span(&mut dev, "row_bounds", &vec![-1i32; tokens * 4]);
        let bounds = span(&mut dev, "bounds", &[0i32; BOUND_WORDS]);
        let pools = FixedPointPools {
            dq: span(&mut dev, "dq_pool", &vec![0f32; n]),
            dk: span(&mut dev, "dk_pool", &vec![0i32; 2 * kv_n]),
            dv: span(&mut dev, "dv_pool", &vec![0i32; 2 * kv_n]),
            row_bounds,
            bounds,
        };
        let [o_d, do_d, q_d, k_d, v_d] = spans;
        preprocess_deterministic(
            &mut dev, o_d, do_d, q_d, k_d, v_d, delta, &pools, tokens, ws,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let got_delta: Vec<f32> = dev.read(delta.addr, tokens * HEADS).expect("read");
        let got_rows: Vec<u32> = dev.read(row_bounds.addr, tokens * 4).expect("read");
        let got_bounds: Vec<u32> = dev.read(bounds.addr, BOUND_WORDS).expect("read");

        let mut want_bounds = [0u32; BOUND_WORDS];
        let abs_max = |x: &[bf16]| x.iter().map(|v| bits(v.to_f32().abs())).max().unwrap();
        for t in 0..tokens {
            for g in 0..4 {
                let mut a = 0u32;
                for h in 16 * g..16 * g + 16 {
                    let r = t * HEADS + h;
                    let row = r * DIM..(r + 1) * DIM;
                    let d = delta_in_kernel_order(&out[row.clone()], &dout[row.clone()]);
                    assert_eq!(
                        bits(got_delta[r]),
                        bits(d),
                        "{arch:?} delta of token {t} head {h}: {} vs {d}",
                        got_delta[r]
                    );
                    let l1 = l1_in_kernel_order(&dout[row.clone()]);
                    a = a.max(bits(l1)).max(bits(d.abs()));
                    let w = &mut want_bounds;
                    w[8 + g] = w[8 + g].max(abs_max(&q[row.clone()]));
                    w[16 + g] = w[16 + g].max(abs_max(&dout[row]));
                }
                assert_eq!(
                    got_rows[4 * t + g],
                    a,
                    "{arch:?} a[{t}, {g}]: {} vs {}",
                    f32::from_bits(got_rows[4 * t + g]),
                    f32::from_bits(a)
                );
                want_bounds[12 + g] = want_bounds[12 + g].max(a);
            }
        }
        for r in 0..ws {
            for g in 0..4 {
                let row = (4 * r + g) * DIM..(4 * r + g + 1) * DIM;
                want_bounds[g] = want_bounds[g].max(abs_max(&k[row.clone()]));
                want_bounds[4 + g] = want_bounds[4 + g].max(abs_max(&v[row]));
            }
        }
        assert_eq!(got_bounds, want_bounds.to_vec(), "{arch:?} bounds words");
        println!("{arch:?} bwd_preprocess_det: delta, a[t, g] and the bounds words exact");
    }
}
