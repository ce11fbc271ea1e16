//! The CPU oracle of the device task build (`reference::tasks`, `docs/design.md` §2.2–§2.4).
//!
//! Expected values come from the block selection `q2k`, from a forward decode of the raw
//! schedule fields written here, or from hand-worked examples; never from the code under test.
//! `rows_per_cta`/`chunk_map` are tested in `tests/contract.rs`; here they are only called, except
//! for the documented examples worked by hand.

mod common;

use common::Parts;
use std::sync::OnceLock;

use msa_runtime::contract::Locality;
use msa_runtime::reference::tasks::{
    build_task_tables, build_task_tables_with, build_task_tables_with_capacity, task_capacity,
    TaskTables, FLAG_CAPACITY_OVERFLOW, FLAG_NONCONTIGUOUS_SEGMENTS,
};
use msa_runtime::{build_schedule, causal_support, chunk_map, rows_per_cta, Schedule};

const HEADS: usize = 4;
const TOPK: usize = 16;
const SLOTS: usize = 8;
const BLOCK: usize = 128;
/// The default locality rule's smallest window.
const WINDOW_MIN: u64 = 8192;
/// The seed's rule (512-query windows) as a `Locality`: on one document starting at token 0
/// its windows are the seed's global ones, so the hand-worked orders below keep the seed's
/// figures.
const SEED_RULE: Locality = Locality::uncapped(9, 0);

fn seed_tables(s: &Schedule, sms: usize, capacity: usize) -> TaskTables {
    build_task_tables_with(s, sms, capacity, SEED_RULE)
}
const SMS: [usize; 3] = [1, 8, 148];

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// splitmix64: a tiny deterministic PRNG, so the tests need no dependency.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// In `[0, n)`, `n > 0`.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

fn cu_from_lengths(lengths: &[usize]) -> Vec<i32> {
    let mut cu = vec![0i32];
    for &l in lengths {
        cu.push(cu[cu.len() - 1] + l as i32);
    }
    cu
}

/// Dense workspace starts `Σ_{e<d} ceil(len_e/128)·128`, written out here.
fn ws_from_lengths(lengths: &[usize]) -> Vec<i32> {
    let mut starts = Vec::new();
    let mut w = 0;
    for &l in lengths {
        starts.push(w as i32);
        w += l.div_ceil(BLOCK) * BLOCK;
    }
    starts
}

/// A random top-16 selection: every query keeps its own block and up to 15 random earlier
/// blocks of its document (sometimes fewer, `-1` padded), in random slot order.
fn random_selection(lengths: &[usize], seed: u64) -> Vec<i32> {
    let mut rng = SplitMix64(seed);
    let t_total: usize = lengths.iter().sum();
    let mut q2k = vec![-1i32; HEADS * t_total * TOPK];
    for g in 0..HEADS {
        let mut t = 0;
        for &len in lengths {
            for q in 0..len {
                let own = q / BLOCK;
                let mut earlier: Vec<i32> = (0..own as i32).collect();
                rng.shuffle(&mut earlier);
                let mut keep = (own + 1).min(TOPK);
                if rng.below(4) == 0 {
                    keep = 1 + rng.below(keep);
                }
                let mut list = vec![own as i32];
                list.extend_from_slice(&earlier[..keep - 1]);
                list.resize(TOPK, -1);
                rng.shuffle(&mut list);
                q2k[(g * t_total + t) * TOPK..][..TOPK].copy_from_slice(&list);
                t += 1;
            }
        }
    }
    q2k
}

/// One schedule of the shared corpus, with the inputs it was built from.
struct Case {
    name: String,
    lengths: Vec<usize>,
    q2k: Vec<i32>,
    schedule: Schedule,
}

/// Documents (127,129,1,2,3,5,128), (2177,) and (4093,) with causal support, and a random
/// top-16 selection, each with 8, 16 and 64 queries per work item. Built once per test binary.
fn corpus() -> &'static [Case] {
    static CORPUS: OnceLock<Vec<Case>> = OnceLock::new();
    CORPUS.get_or_init(|| {
        let selections: Vec<(&str, Vec<usize>, Option<u64>)> = vec![
            ("mixed causal", vec![127, 129, 1, 2, 3, 5, 128], None),
            ("2177 causal", vec![2177], None),
            ("4093 causal", vec![4093], None),
            ("random top-16", vec![1500, 37, 2300], Some(0x5eed)),
        ];
        let mut cases = Vec::new();
        for (name, lengths, seed) in selections {
            let cu = cu_from_lengths(&lengths);
            let q2k = match seed {
                None => causal_support(&cu).unwrap(),
                Some(seed) => random_selection(&lengths, seed),
            };
            for qpw in [8, 16, 64] {
                let schedule = build_schedule(&q2k, &cu, qpw).expect("valid selection");
                cases.push(Case {
                    name: format!("{name}, {qpw} queries per item"),
                    lengths: lengths.clone(),
                    q2k: q2k.clone(),
                    schedule,
                });
            }
        }
        cases
    })
}

/// One task row: `meta [4]`, `qrows [8]`, `qpos [8]`.
type Row = ([i32; 4], [i32; SLOTS], [i32; SLOTS]);
/// (head, document, window, local kblock, first query).
type Key = (u64, u64, u64, u64, u64);

fn table_rows(t: &TaskTables) -> Vec<Row> {
    let n = t.meta.len() / 4;
    assert_eq!(t.qrows.len(), n * SLOTS, "qrows is [n, 8]");
    assert_eq!(t.qpos.len(), n * SLOTS, "qpos is [n, 8]");
    (0..n)
        .map(|r| {
            (
                t.meta[r * 4..][..4].try_into().unwrap(),
                t.qrows[r * SLOTS..][..SLOTS].try_into().unwrap(),
                t.qpos[r * SLOTS..][..SLOTS].try_into().unwrap(),
            )
        })
        .collect()
}

/// Task rows in forward order, decoded here from the raw fields (`docs/design.md` §2.2).
fn forward_rows(s: &Schedule) -> Vec<Row> {
    let rows = s.rows();
    let ec = s.edge_capacity();
    let (cu, ws) = (s.cu_seqlens(), s.document_workspace_starts());
    let mut out = Vec::new();
    for m in s.scheduler_metadata().chunks_exact(6).take(valid_items(s)) {
        let [h, row, q_begin, q_count, doc, local] =
            <[i32; 6]>::try_from(m).unwrap().map(|v| v as usize);
        let start = s.row_ptr()[h * (rows + 1) + row] as usize + q_begin;
        for j in 0..q_count.div_ceil(SLOTS) {
            let valid = SLOTS.min(q_count - SLOTS * j);
            let kblock = ws[doc] as usize / BLOCK + local;
            let mut r: Row = ([0, h as i32, kblock as i32, valid as i32], [-1; 8], [-1; 8]);
            for slot in 0..valid {
                let q = s.q_indices()[h * ec + start + SLOTS * j + slot];
                r.1[slot] = cu[doc] + q;
                r.2[slot] = ws[doc] + q;
            }
            out.push(r);
        }
    }
    out
}

/// `clamp(work_count, 0, work_capacity)`, from the raw fields.
fn valid_items(s: &Schedule) -> usize {
    (s.work_count().max(0) as usize).min(s.scheduler_metadata().len() / 6)
}

/// `Σ ceil(q_count/8)` over the valid items, from the raw metadata.
fn total_tasks(s: &Schedule) -> usize {
    s.scheduler_metadata()
        .chunks_exact(6)
        .take(valid_items(s))
        .map(|m| (m[3] as usize).div_ceil(SLOTS))
        .sum()
}

/// `(head, workspace kblock, compact row)` of every selected (query, block) pair of `q2k`.
fn edges_of_selection(lengths: &[usize], q2k: &[i32]) -> Vec<(i32, i32, i32)> {
    let t_total: usize = lengths.iter().sum();
    let ws = ws_from_lengths(lengths);
    let mut out = Vec::new();
    for g in 0..HEADS {
        let mut t = 0;
        for (d, &len) in lengths.iter().enumerate() {
            for _ in 0..len {
                for &b in &q2k[(g * t_total + t) * TOPK..][..TOPK] {
                    if b >= 0 {
                        out.push((g as i32, ws[d] / BLOCK as i32 + b, t as i32));
                    }
                }
                t += 1;
            }
        }
    }
    out.sort_unstable();
    out
}

/// The same triples, read back from the task tables.
fn edges_of_tables(t: &TaskTables) -> Vec<(i32, i32, i32)> {
    let mut out = Vec::new();
    for (meta, qrows, _) in table_rows(t) {
        for &q in qrows.iter().take(meta[3].clamp(0, 8) as usize) {
            out.push((meta[1], meta[2], q));
        }
    }
    out.sort_unstable();
    out
}

/// First `(head, workspace kblock, compact row, tables − selection)` whose count in the tables
/// differs from `q2k` (whose lists never repeat a block, so every selected pair counts once).
///
/// A dense count grid instead of sorted triples keeps the debug-build runtime low.
fn coverage_mismatch(
    lengths: &[usize],
    q2k: &[i32],
    tables: &TaskTables,
) -> Option<(usize, usize, usize, i32)> {
    let t_total: usize = lengths.iter().sum();
    let ws = ws_from_lengths(lengths);
    let kblocks: usize = lengths.iter().map(|l| l.div_ceil(BLOCK)).sum();
    let mut grid = vec![0i32; HEADS * kblocks * t_total];
    for (meta, qrows, _) in table_rows(tables) {
        let (g, kb) = (meta[1] as usize, meta[2] as usize);
        for &t in qrows.iter().take(meta[3].clamp(0, 8) as usize) {
            let t = t as usize;
            if g >= HEADS || kb >= kblocks || t >= t_total {
                return Some((g, kb, t, 1));
            }
            grid[(g * kblocks + kb) * t_total + t] += 1;
        }
    }
    for g in 0..HEADS {
        let mut t = 0;
        for (d, &len) in lengths.iter().enumerate() {
            for _ in 0..len {
                for &b in &q2k[(g * t_total + t) * TOPK..][..TOPK] {
                    if b >= 0 {
                        let kb = ws[d] as usize / BLOCK + b as usize;
                        grid[(g * kblocks + kb) * t_total + t] -= 1;
                    }
                }
                t += 1;
            }
        }
    }
    let i = grid.iter().position(|&c| c != 0)?;
    Some((
        i / (kblocks * t_total),
        i / t_total % kblocks,
        i % t_total,
        grid[i],
    ))
}

/// Locality key of a row, written out here from the rule's description: per index head,
/// documents in order; in a document of `B` key blocks, windows of `2^s` document-local
/// queries with `2^s` the smallest power of two of at least `max(8192, 32·B)`; then the key
/// block; then the first query.
fn locality_key(s: &Schedule, row: &Row) -> Key {
    let (head, kblock, qmin) = (row.0[1] as u64, row.0[2] as u64, row.1[0] as i64);
    let cu = s.cu_seqlens();
    let doc = cu
        .windows(2)
        .position(|w| i64::from(w[0]) <= qmin && qmin < i64::from(w[1]))
        .expect("a row's first query lies in a document");
    let len = (cu[doc + 1] - cu[doc]) as u64;
    let blocks = len.div_ceil(BLOCK as u64);
    let mut window = 1u64;
    while window < WINDOW_MIN || window < 32 * blocks {
        window *= 2;
    }
    let local_q = (qmin - i64::from(cu[doc])) as u64;
    let local_kblock = kblock - s.document_workspace_starts()[doc] as u64 / BLOCK as u64;
    (
        head,
        doc as u64,
        local_q / window,
        local_kblock,
        qmin as u64,
    )
}

/// The descriptor expected for `n` rows, `num_work` items, `total` tasks and `flags`.
fn expected_desc(n: usize, num_sms: usize, num_work: usize, total: usize, flags: i32) -> [i32; 8] {
    let r = rows_per_cta(n);
    let (full, tail, grid) = chunk_map(n, r, num_sms);
    [
        n as i32,
        r as i32,
        full as i32,
        tail as i32,
        grid as i32,
        num_work as i32,
        total as i32,
        flags,
    ]
}

/// The 4093-token causal schedule with 8 queries per item (one task per item).
fn causal_4093_by_8() -> &'static Schedule {
    &corpus()
        .iter()
        .find(|c| c.name == "4093 causal, 8 queries per item")
        .expect("in the corpus")
        .schedule
}

/// Selection where only head 0 selects, and only each query's own block.
fn own_block_head0(t_total: usize) -> Vec<i32> {
    let mut q2k = vec![-1i32; HEADS * t_total * TOPK];
    for t in 0..t_total {
        q2k[t * TOPK] = (t / BLOCK) as i32;
    }
    q2k
}

// ---------------------------------------------------------------------------------------------
// 1. Coverage
// ---------------------------------------------------------------------------------------------

#[test]
fn every_selected_edge_is_covered_exactly_once() {
    for case in corpus() {
        let tables = build_task_tables(&case.schedule, 8);
        if let Some((g, kb, t, count)) = coverage_mismatch(&case.lengths, &case.q2k, &tables) {
            panic!(
                "{}: (head {g}, kblock {kb}, row {t}) covered {count} times more than selected",
                case.name
            );
        }
    }
}

#[test]
fn workspace_gaps_shift_the_kblocks() {
    // Same mixed-document schedule, each document moved 128·d rows further (gaps are valid).
    let case = corpus()
        .iter()
        .find(|c| c.name == "mixed causal, 16 queries per item")
        .expect("in the corpus");
    let mut parts = Parts::of(&case.schedule);
    for (d, start) in parts.ws_starts.iter_mut().enumerate() {
        *start += (BLOCK * d) as i32;
    }
    let gapped = parts.clone().build().expect("a valid rebuilt schedule");
    let tables = build_task_tables(&gapped, 8);
    let mut expected = Vec::new();
    for (g, kb, t) in edges_of_selection(&case.lengths, &case.q2k) {
        let d = (1..case.lengths.len() + 1)
            .find(|&e| (t as usize) < case.lengths[..e].iter().sum::<usize>())
            .unwrap()
            - 1;
        expected.push((g, kb + d as i32, t));
    }
    expected.sort_unstable();
    assert_eq!(edges_of_tables(&tables), expected);
    for (meta, qrows, qpos) in table_rows(&tables) {
        let d = (0..case.lengths.len())
            .rev()
            .find(|&d| qrows[0] >= parts.cu_seqlens[d])
            .unwrap();
        assert_eq!(qpos[0] - qrows[0], parts.ws_starts[d] - parts.cu_seqlens[d]);
        assert!(meta[2] as usize >= parts.ws_starts[d] as usize / BLOCK);
    }
    let rows = table_rows(&tables);
    assert!(rows
        .windows(2)
        .all(|p| locality_key(&gapped, &p[0]) < locality_key(&gapped, &p[1])));
}

// ---------------------------------------------------------------------------------------------
// 2. Slots
// ---------------------------------------------------------------------------------------------

#[test]
fn slots_are_ascending_in_document_and_padded_with_minus_one() {
    for case in corpus() {
        let cu = cu_from_lengths(&case.lengths);
        let ws = ws_from_lengths(&case.lengths);
        let tables = build_task_tables(&case.schedule, 8);
        for (r, (meta, qrows, qpos)) in table_rows(&tables).into_iter().enumerate() {
            let ctx = || format!("{}: row {r} {meta:?} {qrows:?} {qpos:?}", case.name);
            assert_eq!(meta[0], 0, "{}", ctx());
            assert!((0..HEADS as i32).contains(&meta[1]), "{}", ctx());
            let valid = meta[3];
            assert!((1..=8).contains(&valid), "{}", ctx());
            let valid = valid as usize;
            // The document owning the workspace block.
            let kb_row = meta[2] as usize * BLOCK;
            let d = (0..case.lengths.len())
                .find(|&d| {
                    let lo = ws[d] as usize;
                    kb_row >= lo && kb_row < lo + case.lengths[d].div_ceil(BLOCK) * BLOCK
                })
                .unwrap_or_else(|| panic!("{}: kblock in no document", ctx()));
            for s in 0..SLOTS {
                if s < valid {
                    assert!(qrows[s] >= cu[d] && qrows[s] < cu[d + 1], "{}", ctx());
                    assert_eq!(qpos[s] - qrows[s], ws[d] - cu[d], "{}", ctx());
                    // Edges of a block are queries at or after its start.
                    assert!(qpos[s] as usize >= kb_row, "{}", ctx());
                    if s > 0 {
                        assert!(qrows[s] > qrows[s - 1], "{}", ctx());
                    }
                } else {
                    assert_eq!((qrows[s], qpos[s]), (-1, -1), "{}", ctx());
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Locality order and descriptor
// ---------------------------------------------------------------------------------------------

#[test]
fn rows_follow_the_locality_key_and_the_descriptor_the_walk_rule() {
    for case in corpus() {
        let s = &case.schedule;
        let base = build_task_tables(s, SMS[0]);
        let rows = table_rows(&base);
        // The builder's order (head, row, q_begin) keeps every segment contiguous.
        assert_eq!(base.desc[7], 0, "{}: flags", case.name);
        for (i, p) in rows.windows(2).enumerate() {
            assert!(
                locality_key(s, &p[0]) < locality_key(s, &p[1]),
                "{}: rows {i}, {} out of key order: {:?} then {:?}",
                case.name,
                i + 1,
                p[0],
                p[1]
            );
        }
        let total = total_tasks(s);
        assert_eq!(rows.len(), total, "{}", case.name);
        // Exactly the forward tasks, sorted by the key written out here.
        let mut keyed: Vec<(Key, Row)> = forward_rows(s)
            .into_iter()
            .map(|r| (locality_key(s, &r), r))
            .collect();
        keyed.sort_unstable_by_key(|&(k, _)| k);
        if let Some(i) = (0..total).find(|&i| keyed[i].1 != rows[i]) {
            panic!(
                "{}: row {i} is {:?}, expected {:?}",
                case.name, rows[i], keyed[i].1
            );
        }
        let num_work = valid_items(s);
        for sms in SMS {
            // The SM count changes only the walk words of the descriptor.
            let tables = if sms == SMS[0] {
                base.clone()
            } else {
                build_task_tables(s, sms)
            };
            assert_eq!(
                tables.desc,
                expected_desc(total, sms, num_work, total, 0),
                "{}: desc, {sms} SMs",
                case.name
            );
            assert_eq!(
                (&tables.meta, &tables.qrows, &tables.qpos),
                (&base.meta, &base.qrows, &base.qpos)
            );
        }
    }
}

#[test]
fn locality_order_interleaves_rows_by_window_hand_worked() {
    // One causal 1024-token document: block b is selected by queries 128b..1023. Window 0
    // (queries 0..511) walks kblocks 0..3 with 64, 48, 32, 16 tasks = 160 rows; window 1 then
    // starts again at kblock 0, query 512; head 0 has 160 + 5·64 + 48 + 32 + 16 = 576 rows.
    let cu = vec![0, 1024];
    let s = build_schedule(&causal_support(&cu).unwrap(), &cu, 64).unwrap();
    let rows = table_rows(&seed_tables(&s, 8, task_capacity(&s)));
    assert_eq!(rows.len(), 4 * 576);
    let at = |r: usize| (rows[r].0[1], rows[r].0[2], rows[r].1[0], rows[r].0[3]);
    assert_eq!(at(0), (0, 0, 0, 8));
    assert_eq!(at(63), (0, 0, 504, 8));
    assert_eq!(at(64), (0, 1, 128, 8));
    assert_eq!(at(112), (0, 2, 256, 8));
    assert_eq!(at(159), (0, 3, 504, 8));
    assert_eq!(at(160), (0, 0, 512, 8));
    assert_eq!(at(224), (0, 1, 512, 8));
    assert_eq!(at(575), (0, 7, 1016, 8));
    assert_eq!(at(576), (1, 0, 0, 8));
}

#[test]
fn descriptor_matches_the_documented_walk_examples() {
    // Only head 0 selects, only the own block: every block of 128 queries gives 16 tasks.
    // (T, queries per item) -> descriptor with 8 SMs; walk values from `docs/design.md` §2.4.
    let cases: [(usize, usize, [i32; 8]); 5] = [
        // 1 task: chunk_map(1,4,8) = (0,4,1).
        (5, 8, [1, 4, 0, 4, 1, 1, 1, 0]),
        // 2 blocks = 32 tasks: (8,1,8).
        (256, 8, [32, 4, 8, 1, 8, 32, 32, 0]),
        // 3 blocks + 8 queries = 49 tasks in 4 items: (8,3,14).
        (392, 128, [49, 4, 8, 3, 14, 4, 49, 0]),
        // 150 blocks + 1 query = 2401 tasks in 151 items: 64 rows per CTA, (32,45,40).
        (19201, 128, [2401, 64, 32, 45, 40, 151, 2401, 0]),
        // 160 blocks = 2560 tasks: (40,1,40).
        (20480, 128, [2560, 64, 40, 1, 40, 160, 2560, 0]),
    ];
    for (t, qpw, desc) in cases {
        let cu = vec![0, t as i32];
        let s = build_schedule(&own_block_head0(t), &cu, qpw).unwrap();
        let tables = build_task_tables(&s, 8);
        assert_eq!(tables.desc, desc, "T = {t}");
        assert_eq!(tables.num_rows(), desc[0] as usize);
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Truncated work counts
// ---------------------------------------------------------------------------------------------

#[test]
fn work_count_is_clamped_and_truncates_the_tasks() {
    let cu = vec![0, 4096];
    // 24 queries per item: items give 3 tasks, a row's last item 1 or 2.
    let full = build_schedule(&causal_support(&cu).unwrap(), &cu, 24).unwrap();
    let parts = Parts::of(&full);
    let capacity = full.work_capacity();
    let reference = build_task_tables(&full, 8);
    let with_count = |count: i32| {
        let mut p = parts.clone();
        p.work_count = count;
        p.build().expect("a valid rebuilt schedule")
    };

    // Past the capacity: clamped onto all items.
    let over = build_task_tables(&with_count(capacity as i32 + 7), 8);
    assert_eq!(over.desc[5], capacity as i32);
    assert!(
        over == reference,
        "work_count past the capacity changed the tables"
    );

    // Zero and negative: no rows; chunk_map(0,4,8) = (0,1,0).
    for count in [0, -5] {
        let tables = build_task_tables(&with_count(count), 8);
        assert_eq!(tables.desc, [0, 4, 0, 1, 0, 0, 0, 0], "work_count {count}");
        assert!(tables.meta.is_empty() && tables.qrows.is_empty() && tables.qpos.is_empty());
    }

    // Around the 2400-row switch: prefix sums of ceil(q_count/8), computed here.
    let mut prefix = vec![0usize];
    for m in parts.items() {
        prefix.push(prefix[prefix.len() - 1] + (m[3] as usize).div_ceil(SLOTS));
    }
    let below = (0..prefix.len())
        .rev()
        .find(|&k| prefix[k] <= 2400)
        .unwrap();
    assert!(prefix[below + 1] > 2400);
    for (k, rows_per_cta) in [(below, 4), (below + 1, 64)] {
        let s = with_count(k as i32);
        let tables = build_task_tables(&s, 8);
        assert_eq!(tables.desc[0] as usize, prefix[k], "work_count {k}");
        assert_eq!(tables.desc[1], rows_per_cta, "work_count {k}");
        assert_eq!(tables.desc[5] as usize, k);
        assert_eq!(tables.desc[6] as usize, prefix[k]);
        let mut got = table_rows(&tables);
        let mut expected = forward_rows(&s);
        got.sort_unstable();
        expected.sort_unstable();
        assert!(
            got == expected,
            "work_count {k}: rows are not the first items' tasks"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Capacity
// ---------------------------------------------------------------------------------------------

#[test]
fn capacity_bounds_every_valid_schedule() {
    // 4·edge_capacity/8 + work_capacity; build_schedule uses edge_capacity = 16·T.
    for case in corpus() {
        let s = &case.schedule;
        let t: usize = case.lengths.iter().sum();
        assert_eq!(task_capacity(s), 8 * t + s.work_capacity(), "{}", case.name);
        assert!(total_tasks(s) <= task_capacity(s), "{}", case.name);
    }
    // edge_capacity = 3: 4·3/8 = 1 (not 4·(3/8) = 0). One item of 3 edges.
    let s = Schedule::new(
        vec![0, 3, 0, 0, 0, 0, 0, 0],
        vec![0, 1, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1],
        vec![0, 0, 0, 3, 0, 0],
        1,
        vec![0, 3],
        vec![0],
    )
    .unwrap();
    assert_eq!(task_capacity(&s), 2);
    let tables = build_task_tables(&s, 8);
    assert_eq!(tables.desc, [1, 4, 0, 4, 1, 1, 1, 0]);
    assert_eq!(tables.meta, vec![0, 0, 0, 3]);
    assert_eq!(tables.qrows, vec![0, 1, 2, -1, -1, -1, -1, -1]);
    assert_eq!(tables.qpos, tables.qrows);
}

#[test]
fn capacity_overflow_gives_no_rows() {
    let s = causal_4093_by_8();
    let total = total_tasks(s);
    let num_work = valid_items(s);
    let exact = build_task_tables_with_capacity(s, 8, total);
    assert_eq!(exact, build_task_tables(s, 8));
    for capacity in [total - 1, 1, 0] {
        let tables = build_task_tables_with_capacity(s, 8, capacity);
        assert_eq!(
            tables.desc,
            [
                0,
                4,
                0,
                1,
                0,
                num_work as i32,
                total as i32,
                FLAG_CAPACITY_OVERFLOW
            ],
            "capacity {capacity}"
        );
        assert_eq!(tables.num_rows(), 0);
        assert!(tables.qrows.is_empty() && tables.qpos.is_empty());
    }
}

#[test]
fn capacity_overflow_keeps_the_segment_flag_of_the_processed_prefix() {
    // The device assigns segments to its first `capacity` tasks even on overflow (§2.3 step
    // 2), so a split segment among them also raises flag 2.
    let s = split_bucket();
    let total = total_tasks(&s);
    let flags = |capacity| seed_tables(&s, 8, capacity).desc[7];
    let both = FLAG_CAPACITY_OVERFLOW | FLAG_NONCONTIGUOUS_SEGMENTS;
    // Tasks 0..=98: windows 0 and 1 are still contiguous runs; task 99 splits both.
    assert_eq!(flags(99), FLAG_CAPACITY_OVERFLOW);
    assert_eq!(flags(100), both);
    assert_eq!(flags(total - 1), both);
    assert_eq!(seed_tables(&s, 8, 100).num_rows(), 0);
}

// ---------------------------------------------------------------------------------------------
// 6–8. Work-item orders
// ---------------------------------------------------------------------------------------------

/// The 4093 causal schedule (one task per item) with item 1 moved to position 99.
///
/// Items 0..63 of head 0 are CSR row 0 (kblock 0), queries 0..511: segment (head 0, window 0,
/// kblock 0). Items 64.. are the same row's window 1. After the move, segment window 0 holds
/// forward tasks 0..=62 and 99, and task 99 also splits window 1's run 63..
fn split_bucket() -> Schedule {
    let parts = Parts::of(causal_4093_by_8());
    let mut items = parts.items();
    let moved = items.remove(1);
    items.insert(99, moved);
    parts
        .with_items(&items)
        .build()
        .expect("a valid rebuilt schedule")
}

#[test]
fn a_split_segment_keeps_source_order() {
    let s = split_bucket();
    let expected = forward_rows(&s);
    for sms in SMS {
        let tables = seed_tables(&s, sms, task_capacity(&s));
        assert_eq!(tables.desc[7], FLAG_NONCONTIGUOUS_SEGMENTS);
        let n = expected.len();
        assert_eq!(tables.desc, expected_desc(n, sms, n, n, 2));
        let rows = table_rows(&tables);
        assert_eq!(rows.len(), n);
        if let Some(i) = (0..n).find(|&i| rows[i] != expected[i]) {
            panic!("row {i}: {:?}, forward task {:?}", rows[i], expected[i]);
        }
    }
}

#[test]
fn moving_whole_rows_keeps_the_locality_tables() {
    // Every segment lies in one (head, CSR row); shuffling whole rows' runs of items keeps
    // each segment contiguous, so the tables must not change.
    let mut rng = SplitMix64(7);
    for case in corpus() {
        let parts = Parts::of(&case.schedule);
        let mut groups: Vec<Vec<[i32; 6]>> = Vec::new();
        for m in parts.items() {
            match groups.last_mut() {
                Some(g) if g[0][..2] == m[..2] => g.push(m),
                _ => groups.push(vec![m]),
            }
        }
        assert!(groups.len() > 2, "{}", case.name);
        rng.shuffle(&mut groups);
        let shuffled = parts
            .clone()
            .with_items(&groups.concat())
            .build()
            .expect("a valid rebuilt schedule");
        assert_ne!(shuffled.scheduler_metadata(), parts.metadata.as_slice());
        let got = build_task_tables(&shuffled, 8);
        assert_eq!(got.desc[7], 0, "{}", case.name);
        assert!(
            got == build_task_tables(&case.schedule, 8),
            "{}: tables changed",
            case.name
        );
    }
}

#[test]
fn reversed_order_inside_a_contiguous_segment_still_sorts_by_key() {
    // Items 0..63 of the 4093 causal schedule (8 queries each) are exactly segment (head 0,
    // window 0, kblock 0). Reversed, the segment is still one contiguous run (flag 2 clear) but
    // its forward order descends; rows are the argsort by key (§2.2), so the tables equal the
    // builder order's.
    let base = causal_4093_by_8();
    let parts = Parts::of(base);
    let mut items = parts.items();
    assert!(items[..64].iter().all(|m| m[..2] == [0, 0]));
    assert!(items[64][..2] == [0, 0] && items[64][2] == 512);
    items[..64].reverse();
    let reversed = parts
        .with_items(&items)
        .build()
        .expect("a valid rebuilt schedule");
    let got = build_task_tables(&reversed, 8);
    assert_eq!(got.desc[7], 0);
    assert!(got == build_task_tables(base, 8), "tables changed");
}

#[test]
fn long_documents_get_windows_that_grow_with_their_blocks() {
    // 33,000 tokens = 258 blocks: the default rule's windows are 2^14 queries (32·258 > 8192),
    // so the corpus's short documents never reach this branch of the key.
    let lengths = [33_000usize];
    let cu = cu_from_lengths(&lengths);
    let s = build_schedule(&random_selection(&lengths, 0x10_7a1), &cu, 64).unwrap();
    let rows = table_rows(&build_task_tables(&s, SMS[1]));
    assert_eq!(rows.len(), total_tasks(&s));
    for (i, p) in rows.windows(2).enumerate() {
        assert!(
            locality_key(&s, &p[0]) < locality_key(&s, &p[1]),
            "rows {i}, {} out of key order: {:?} then {:?}",
            i + 1,
            p[0],
            p[1]
        );
    }
    // Windows of 16384 queries: inside the first one each key block's rows run from query 0
    // past 8192, then the next block starts below 8192 again. With 8192-query windows the
    // first query would fall back below 8192 only where the head changes (3 times).
    let returns = rows
        .windows(2)
        .filter(|p| p[0].1[0] >= 8192 && p[1].1[0] < 8192)
        .count();
    assert!(returns > 3 * 64, "{returns} returns below query 8192");
}
