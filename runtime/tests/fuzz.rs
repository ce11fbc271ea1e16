//! Property tests (proptest) over the inputs a user controls: `Schedule::new`,
//! `build_schedule`, the capacity checks and the backward's host checks on its buffers.
//! Each property is checked against a model written here from the contract, not against the
//! code under test. The case counts keep the whole file to a few seconds; set
//! `PROPTEST_CASES` to run longer.

mod common;

use common::{Parts, Recorder};
use half::bf16;
use msa_runtime::{
    build_schedule, causal_support, check_capacity, BackwardBuffers, MsaBackward, RuntimeError,
    Schedule, ScheduleError, SelectionFault, Span,
};
use proptest::prelude::*;
use proptest::test_runner::Config;

const KV_ROW: usize = 512;
const Q_ROW: usize = 8192;

fn config(cases: u32) -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    Config {
        cases,
        // Failures are reported, never saved into the source tree.
        failure_persistence: None,
        ..Config::default()
    }
}

/// Document lengths: mostly short, some crossing block boundaries, and empty ones.
fn lengths() -> impl Strategy<Value = Vec<i32>> {
    prop::collection::vec(
        prop_oneof![4 => 1..40i32, 2 => 120..140i32, 1 => 250..300i32, 1 => Just(0)],
        1..4,
    )
}

fn cu_of(lengths: &[i32]) -> Vec<i32> {
    let mut cu = vec![0];
    for l in lengths {
        cu.push(cu[cu.len() - 1] + l);
    }
    cu
}

/// The CSR rows in the contract's order: level-major, round robin across documents.
fn model_rows(cu: &[i32]) -> Vec<(usize, usize)> {
    let blocks: Vec<usize> = cu
        .windows(2)
        .map(|w| ((w[1] - w[0]) as usize).div_ceil(128))
        .collect();
    let mut rows = Vec::new();
    for level in 0..blocks.iter().copied().max().unwrap_or(0) {
        for (d, &b) in blocks.iter().enumerate() {
            if level < b {
                rows.push((d, level));
            }
        }
    }
    rows
}

/// The edges `(head, document, block, local query)` the valid work items of `s` cover, read
/// from the raw arrays; panics (fails the property) on anything the contract forbids.
fn covered_edges(s: &Schedule) -> Vec<(usize, usize, usize, i32)> {
    let cu = s.cu_seqlens();
    let rows = model_rows(cu);
    let n = rows.len();
    assert_eq!(s.row_ptr().len(), 4 * (n + 1));
    let cap = s.q_indices().len() / 4;
    let mut used = vec![false; 4 * cap];
    let mut edges = Vec::new();
    let work = s
        .work_count()
        .clamp(0, (s.scheduler_metadata().len() / 6) as i32) as usize;
    for i in 0..work {
        let m = &s.scheduler_metadata()[6 * i..6 * i + 6];
        let (h, row, qb, qc, d, kb) = (m[0], m[1], m[2], m[3], m[4], m[5]);
        assert!((0..4).contains(&h) && qb >= 0 && qc >= 1, "item {i}: {m:?}");
        let (h, row) = (h as usize, row as usize);
        assert_eq!(rows.get(row), Some(&(d as usize, kb as usize)), "item {i}");
        let lo = s.row_ptr()[h * (n + 1) + row] as usize;
        let hi = s.row_ptr()[h * (n + 1) + row + 1] as usize;
        let (first, end) = (lo + qb as usize, lo + (qb + qc) as usize);
        assert!(end <= hi && hi <= cap, "item {i} past its row");
        let len = cu[d as usize + 1] - cu[d as usize];
        for e in first..end {
            assert!(!used[h * cap + e], "edge {e} of head {h} covered twice");
            used[h * cap + e] = true;
            let q = s.q_indices()[h * cap + e];
            assert!(
                kb * 128 <= q && q < len,
                "item {i}: query {q} outside block {kb}"
            );
            edges.push((h, d as usize, kb as usize, q));
        }
    }
    let ws = s.document_workspace_starts();
    for d in 0..ws.len() {
        assert_eq!(ws[d] % 128, 0);
        if d > 0 {
            let prev = ((cu[d] - cu[d - 1]) as usize).div_ceil(128) as i32 * 128;
            assert!(ws[d] >= ws[d - 1] + prev, "document regions overlap");
        }
    }
    edges.sort_unstable();
    edges
}

/// The first entry of `q2k` (in head, row, slot order) that breaks the selection contract.
fn first_bad_entry(q2k: &[i32], cu: &[i32]) -> Option<(usize, usize, usize)> {
    let t = cu[cu.len() - 1] as usize;
    for h in 0..4 {
        for d in 0..cu.len() - 1 {
            for row in cu[d] as usize..cu[d + 1] as usize {
                let own = ((row - cu[d] as usize) / 128) as i32;
                let ids = &q2k[(h * t + row) * 16..][..16];
                for slot in 0..16 {
                    let id = ids[slot];
                    if id == -1 {
                        continue;
                    }
                    if id < -1 || id > own || ids[..slot].contains(&id) {
                        return Some((h, row, slot));
                    }
                }
            }
        }
    }
    None
}

proptest! {
    #![proptest_config(config(2000))]

    /// `build_schedule` on random selections: an error names the first bad entry; a schedule
    /// covers every selected (query, block) edge exactly once, in work items of the asked size.
    #[test]
    fn build_schedule_covers_exactly_the_selection(
        lens in lengths(),
        seed in any::<u64>(),
        noise in 0u32..4,
        qpw in prop_oneof![Just(8usize), Just(16), Just(64), Just(0), Just(12)],
    ) {
        let cu = cu_of(&lens);
        let t = cu[cu.len() - 1] as usize;
        // The causal support with some entries dropped or replaced by noise ids.
        let mut q2k = match causal_support(&cu) {
            Ok(q) => q,
            Err(e) => {
                prop_assert_eq!(t, 0, "{}", e);
                return Ok(());
            }
        };
        let mut x = seed | 1;
        for id in q2k.iter_mut() {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            match (x % 97, noise) {
                (0..=9, _) => *id = -1,
                (10, n) if n > 0 => *id = (x >> 8) as i32 % 5 - 2,
                _ => {}
            }
        }
        match build_schedule(&q2k, &cu, qpw) {
            Ok(s) => {
                prop_assert!(qpw % 8 == 0 && qpw > 0);
                prop_assert!(first_bad_entry(&q2k, &cu).is_none());
                let mut want = Vec::new();
                for h in 0..4 {
                    for d in 0..cu.len() - 1 {
                        for row in cu[d] as usize..cu[d + 1] as usize {
                            for &id in &q2k[(h * t + row) * 16..][..16] {
                                if id >= 0 {
                                    want.push((h, d, id as usize, row as i32 - cu[d]));
                                }
                            }
                        }
                    }
                }
                want.sort_unstable();
                prop_assert_eq!(covered_edges(&s), want);
                for i in 0..s.num_work() {
                    let item = s.work_item(i).unwrap();
                    prop_assert!(item.q_begin % qpw == 0 && item.q_count <= qpw);
                }
            }
            Err(ScheduleError::Selection { head, row, slot, block, fault }) => {
                prop_assert_eq!(first_bad_entry(&q2k, &cu), Some((head, row, slot)));
                prop_assert_eq!(q2k[(head * t + row) * 16 + slot], block);
                let is_repeat = matches!(fault, SelectionFault::Repeated { .. });
                let earlier = &q2k[(head * t + row) * 16..][..slot];
                prop_assert_eq!(is_repeat, earlier.contains(&block) && block >= 0);
            }
            Err(e) => {
                // Only the queries_per_work argument or an empty packing may be refused.
                prop_assert!(qpw % 8 != 0 || qpw == 0 || t == 0, "{}", e);
            }
        }
    }

    /// `Schedule::new` on a valid schedule with one field entry changed (or a length cut):
    /// never a panic, and whatever it accepts satisfies the contract.
    #[test]
    fn schedule_new_accepts_only_valid_mutations(
        lens in lengths(),
        field in 0usize..6,
        pick in any::<u64>(),
        value in prop_oneof![-3..300i32, Just(i32::MAX), Just(i32::MIN), Just(128), Just(256)],
        cut in any::<bool>(),
    ) {
        let cu = cu_of(&lens);
        let Ok(q2k) = causal_support(&cu) else { return Ok(()) };
        let Ok(s) = build_schedule(&q2k, &cu, 16) else { return Ok(()) };
        let mut p = Parts::of(&s);
        let mut none = Vec::new();
        let target: &mut Vec<i32> = match field {
            0 => &mut p.row_ptr,
            1 => &mut p.q_indices,
            2 => &mut p.metadata,
            3 => &mut p.cu_seqlens,
            4 => &mut p.ws_starts,
            _ => {
                p.work_count = value;
                &mut none
            }
        };
        if !target.is_empty() {
            let i = (pick % target.len() as u64) as usize;
            if cut {
                target.truncate(i);
            } else {
                target[i] = value;
            }
        }
        if let Ok(s) = p.build() {
            covered_edges(&s);
            prop_assert!(s.workspace_rows() % 128 == 0 && s.num_tokens() <= s.workspace_rows());
        }
    }

    /// `check_capacity` agrees with the documented limits on document shapes of any size, and never
    /// allocates: millions of tokens cost nothing to ask about.
    #[test]
    fn check_capacity_is_the_documented_bound(
        docs in 1usize..40_000,
        len_seed in any::<u64>(),
    ) {
        // Lengths up to 300k tokens, with T·16 inside int32 (what causal_support accepts).
        let most = (300_000u64).min((i32::MAX as u64 / 16) / docs as u64);
        let len = 1 + (len_seed % most) as i32;
        let lens = vec![len; docs];
        let total: i64 = len as i64 * docs as i64;
        let cu = cu_of(&lens);
        let t = total as u64;
        let w = docs as u64 * (len as u64).div_ceil(128) * 128;
        let edge_ok = 4 * 16 * t <= u32::MAX as u64;
        let tasks_ok = 64 * t / 8 + 8 * t + 4 * (w / 128) <= (u32::MAX / 4) as u64;
        let want = t <= 1 << 20 && edge_ok && tasks_ok;
        match check_capacity(&cu) {
            Ok(()) => prop_assert!(want, "accepted T = {}, W = {}", t, w),
            Err(e) => {
                prop_assert!(!want, "refused: {}", e);
                prop_assert!(matches!(e, ScheduleError::Capacity { .. }), "{}", e);
            }
        }
    }
}

/// How one buffer's base is chosen.
#[derive(Debug, Clone, Copy)]
enum Place {
    /// Its own region.
    Own,
    /// Null.
    Null,
    /// Its own region, off by 8 bytes.
    Misaligned,
    /// The base of buffer `j` plus `256·k` bytes.
    On(usize, u64),
}

fn place() -> impl Strategy<Value = Place> {
    prop_oneof![
        8 => Just(Place::Own),
        1 => Just(Place::Null),
        1 => Just(Place::Misaligned),
        2 => (0usize..9, 0u64..3).prop_map(|(j, k)| Place::On(j, k)),
    ]
}

proptest! {
    #![proptest_config(config(3000))]

    /// The host checks against a model of the rule: every base non-null and 16-byte aligned;
    /// no output overlapping another buffer, except (with the opt-in) an output exactly on an
    /// input of the same size. A refused call issues nothing.
    #[test]
    fn host_checks_follow_the_rule(
        places in prop::collection::vec(place(), 9),
        in_place in any::<bool>(),
    ) {
        let cu = [0, 5, 130];
        let s = build_schedule(&causal_support(&cu).unwrap(), &cu, 64).unwrap();
        let (t, w) = (s.num_tokens(), s.workspace_rows());
        // Field order of BackwardBuffers; bytes of each.
        let bytes = [
            t * Q_ROW * 2, w * KV_ROW * 2, w * KV_ROW * 2, t * Q_ROW * 2, t * 64 * 4,
            t * Q_ROW * 2, t * Q_ROW * 2, w * KV_ROW * 2, w * KV_ROW * 2,
        ];
        let own = |i: usize| (1u64 << 40) * (i as u64 + 1);
        let mut base = [0u64; 9];
        for i in 0..9 {
            base[i] = match places[i] {
                Place::Own => own(i),
                Place::Null => 0,
                Place::Misaligned => own(i) + 8,
                Place::On(j, k) => own(j) + 256 * k,
            };
        }
        let span = |i: usize, elem: usize| (base[i], bytes[i] / elem);
        let bf = |i: usize| { let (a, n) = span(i, 2); Span::<bf16>::new(a, n) };
        let io = BackwardBuffers {
            q: bf(0), k_aligned: bf(1), v_aligned: bf(2), grad_out: bf(3),
            lse: Span::new(base[4], bytes[4] / 4), out: bf(5),
            dq: bf(6), dk_aligned: bf(7), dv_aligned: bf(8),
        };
        // The model.
        let bad_base = base.iter().any(|&b| b == 0 || b % 16 != 0);
        let mut overlap = false;
        for i in 0..9 {
            for j in i + 1..9 {
                let (oi, oj) = (i >= 6, j >= 6);
                let meet = base[i] < base[j] + bytes[j] as u64 && base[j] < base[i] + bytes[i] as u64;
                let exact = base[i] == base[j] && bytes[i] == bytes[j];
                if (oi || oj) && meet && !(in_place && exact && oi != oj) {
                    overlap = true;
                }
            }
        }
        let mut dev = Recorder::default();
        let got = MsaBackward::<Recorder>::new()
            .allow_in_place(in_place)
            .run_on(&mut dev, &io, &s);
        match got {
            Ok(()) => {
                prop_assert!(!bad_base && !overlap, "accepted {:?}", places);
                prop_assert_eq!(dev.issued.last().copied(), Some("bwd_postprocess"));
            }
            Err(e) => {
                prop_assert!(bad_base || overlap, "refused {:?}: {}", places, e);
                prop_assert!(
                    matches!(e, RuntimeError::NullBuffer { .. } | RuntimeError::Overlap { .. }
                        | RuntimeError::Input { .. }),
                    "{}", e
                );
                prop_assert!(dev.issued.is_empty(), "issued {:?} before {}", dev.issued, e);
            }
        }
    }
}
