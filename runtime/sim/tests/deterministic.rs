//! The deterministic mode (`MsaBackward::set_deterministic`, `docs/design.md` §3.8) on the
//! simulator, both main kernels: the whole chain (`bwd_preprocess_det`, task build, the
//! `_det` main kernel, `bwd_postprocess_det`) against the f32 CPU reference at the default
//! mode's tolerances, and bitwise equal gradients whatever order the CTAs run in, with
//! starved warps and other tcgen05 completion orders. dQ is bitwise equal on another SM count
//! too (another grid and CTA walk); dK/dV are then only within tolerance, since their
//! per-segment partial sums follow the walk. The default mode under the same reorderings is
//! run as well: its bits change, so these tests would see nondeterminism.

use msa_sim::backward::{Case, Grads, MainKernel};
use msa_sim::device::Arch;
use msa_sim::{CtaOrder, Limits, UmmaOrder};

mod chain;
use chain::{case, check};

fn run(c: &Case, kernel: &MainKernel, limits: Limits, sms: usize) -> Grads {
    chain::run(c, kernel, limits, sms).unwrap_or_else(|e| panic!("{}: {e}", kernel.name))
}

/// The number of elements whose bits differ between two runs, per gradient (dq, dk, dv).
fn differing(a: &Grads, b: &Grads) -> [usize; 3] {
    std::array::from_fn(|i| {
        a.bits[i]
            .iter()
            .zip(&b.bits[i])
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count()
    })
}

/// `arch`'s deterministic chain on `c` and `sms` SMs under each of `orders` (the first within
/// the seed tolerances of the reference, every other one bitwise equal to it), then on
/// `other_sms` SMs (within tolerance, dq bitwise equal), then the default chain under the
/// first two orders, which must differ somewhere.
fn check_mode(arch: Arch, c: &Case, sms: usize, other_sms: usize, orders: &[(Limits, &str)]) {
    let det = MainKernel::deterministic(arch);
    let (l0, label0) = orders[0];
    let first = run(c, &det, l0, sms);
    assert!(first.tasks > 0);
    assert!(
        first.kernels.contains(&"bwd_preprocess_det")
            && first.kernels.contains(&det.name)
            && first.kernels.contains(&"bwd_postprocess_det"),
        "the deterministic chain ran {:?}",
        first.kernels
    );
    check(c, &first, &format!("deterministic, {label0}"));
    for &(limits, label) in &orders[1..] {
        let g = run(c, &det, limits, sms);
        assert_eq!(
            differing(&first, &g),
            [0; 3],
            "{}: {label} differs from {label0} (elements of dq, dk, dv)",
            det.name
        );
        println!("  deterministic, {label}: bitwise equal to {label0}");
    }
    let g = run(c, &det, l0, other_sms);
    check(c, &g, &format!("deterministic, {other_sms} SMs"));
    let d = differing(&first, &g);
    assert_eq!(d[0], 0, "{}: dq on {other_sms} SMs differs", det.name);
    println!("  deterministic, {other_sms} SMs: dq bitwise equal, {d:?} elements differ");

    let default = MainKernel::shipped(arch);
    let (l1, label1) = orders[1];
    let a = run(c, &default, l0, sms);
    let b = run(c, &default, l1, sms);
    let d = differing(&a, &b);
    println!("  default mode, {label1} against {label0}: {d:?} elements differ");
    assert_ne!(
        d, [0; 3],
        "the default mode gave the same bits under both orders: this test would not see \
         nondeterminism"
    );
}

fn order(cta_order: CtaOrder) -> Limits {
    Limits {
        cta_order,
        ..Limits::default()
    }
}

#[test]
fn deterministic_sm90_is_bitwise_stable_across_cta_orders_and_warp_schedules() {
    let c = case(&[127, 129, 4], 7002);
    check_mode(
        Arch::Sm90,
        &c,
        2,
        5,
        &[
            (Limits::default(), "CTAs in order"),
            (order(CtaOrder::Reversed), "CTAs reversed"),
            (
                Limits {
                    // The second consumer warpgroup's warps (8..12) run last.
                    starved_warps: 0xf00,
                    ..order(CtaOrder::Seeded(11))
                },
                "CTAs shuffled, consumer 1 starved",
            ),
        ],
    );
}

#[test]
fn deterministic_sm100_is_bitwise_stable_across_cta_orders_warp_schedules_and_mma_orders() {
    let c = case(&[127, 129, 4], 7002);
    check_mode(
        Arch::Sm100,
        &c,
        2,
        5,
        &[
            (Limits::default(), "CTAs in order"),
            (order(CtaOrder::Reversed), "CTAs reversed"),
            (
                Limits {
                    // The reduce warps (8..12) run last; MMAs complete in a seeded order.
                    starved_warps: 0xf00,
                    umma_order: UmmaOrder::Seeded(5),
                    ..order(CtaOrder::Seeded(12))
                },
                "CTAs shuffled, reduce warps starved, seeded MMA order",
            ),
        ],
    );
}
