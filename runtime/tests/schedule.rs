//! `Schedule` validation and the CPU schedule builder (`docs/design.md` §1.3, §1.5, §2.1, §4.2).
//!
//! Expected values come from hand-worked examples or from brute force written here, never from
//! the code under test.

mod common;

use common::Parts;
use msa_runtime::{
    build_schedule, causal_support, check_capacity, workspace_layout, Schedule, ScheduleError,
    SelectionFault,
};

const HEADS: usize = 4;
const TOPK: usize = 16;

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

    /// Uniform-ish in `[0, n)`, `n > 0`.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn cu_from_lengths(lengths: &[usize]) -> Vec<i32> {
    let mut cu = vec![0i32];
    for &l in lengths {
        cu.push(cu[cu.len() - 1] + l as i32);
    }
    cu
}

/// The field an `Invalid` rejection names (panics on success or another variant).
fn invalid_field(r: Result<Schedule, ScheduleError>) -> String {
    match r {
        Err(ScheduleError::Invalid { field, .. }) => field,
        Err(other) => panic!("expected ScheduleError::Invalid, got {other:?}"),
        Ok(_) => panic!("expected a rejection, got a schedule"),
    }
}

/// A small valid schedule: document 0 has 130 tokens (blocks 0, 1), document 1 has 1 token;
/// causal support, 8 queries per work item.
///
/// CSR rows: 0 = (doc 0, block 0), 1 = (doc 1, block 0), 2 = (doc 0, block 1).
fn small_base() -> Parts {
    let cu = vec![0, 130, 131];
    let s = build_schedule(&causal_support(&cu).unwrap(), &cu, 8).expect("valid base");
    Parts::of(&s)
}

/// Row of metadata item `i` as a mutable slice.
fn meta_mut(p: &mut Parts, i: usize) -> &mut [i32] {
    &mut p.metadata[i * 6..(i + 1) * 6]
}

// ---------------------------------------------------------------------------------------------
// workspace_layout and the §4.2 geometry example
// ---------------------------------------------------------------------------------------------

/// Document runs of a BSHD document map (0 = padding), packed in order.
fn cu_from_document_map(map: &[&[i32]]) -> Vec<i32> {
    let mut lengths = Vec::new();
    for row in map {
        let mut run: Option<(i32, usize)> = None;
        for &id in row.iter() {
            run = match run {
                Some((cur, n)) if cur == id => Some((cur, n + 1)),
                prev => {
                    if let Some((cur, n)) = prev {
                        if cur != 0 {
                            lengths.push(n);
                        }
                    }
                    Some((id, 1))
                }
            };
        }
        if let Some((cur, n)) = run {
            if cur != 0 {
                lengths.push(n);
            }
        }
    }
    cu_from_lengths(&lengths)
}

#[test]
fn geometry_example_of_the_packing_tests() {
    let cu = cu_from_document_map(&[&[1, 1, 1, 2, 2, 0, 0, 0], &[0, 0, 1, 1, 1, 1, 0, 0]]);
    assert_eq!(cu, vec![0, 3, 5, 9]);
    let (starts, w) = workspace_layout(&cu).unwrap();
    assert_eq!(starts, vec![0, 128, 256]);
    assert_eq!(w, 384);

    let s = build_schedule(&causal_support(&cu).unwrap(), &cu, 8).unwrap();
    assert_eq!(s.document_workspace_starts(), &[0, 128, 256]);
    assert_eq!(s.workspace_rows(), 384);
    assert_eq!(s.rows(), 3);
    assert_eq!(s.num_documents(), 3);
    assert_eq!(s.num_tokens(), 9);
    // Each document is one block; every query selects its own block: rows hold 0..len.
    for h in 0..HEADS {
        assert_eq!(s.row_queries(h, 0).unwrap(), &[0, 1, 2]);
        assert_eq!(s.row_queries(h, 1).unwrap(), &[0, 1]);
        assert_eq!(s.row_queries(h, 2).unwrap(), &[0, 1, 2, 3]);
    }
}

#[test]
fn workspace_layout_aligns_and_skips_empty_documents() {
    let (starts, w) = workspace_layout(&[0, 128, 128, 129, 400]).unwrap();
    assert_eq!(starts, vec![0, 128, 128, 256]);
    assert_eq!(w, 256 + 384);
}

#[test]
fn workspace_layout_rejections() {
    let field = |cu: &[i32]| match workspace_layout(cu) {
        Err(ScheduleError::Invalid { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    assert_eq!(field(&[0]), "cu_seqlens.len()");
    assert_eq!(field(&[1, 4]), "cu_seqlens[0]");
    assert_eq!(field(&[0, 5, 4]), "cu_seqlens[2]");
    assert_eq!(field(&[0, i32::MAX]), "workspace rows");
}

// ---------------------------------------------------------------------------------------------
// causal_support
// ---------------------------------------------------------------------------------------------

#[test]
fn causal_support_selects_every_block_up_to_own_nearest_first() {
    let cu = vec![0, 300, 301];
    let q2k = causal_support(&cu).unwrap();
    assert_eq!(q2k.len(), HEADS * 301 * TOPK);
    let list = |h: usize, t: usize| &q2k[(h * 301 + t) * TOPK..(h * 301 + t + 1) * TOPK];
    let pad = |ids: &[i32]| {
        let mut v = ids.to_vec();
        v.resize(TOPK, -1);
        v
    };
    for h in 0..HEADS {
        assert_eq!(list(h, 0), pad(&[0]).as_slice());
        assert_eq!(list(h, 127), pad(&[0]).as_slice());
        assert_eq!(list(h, 128), pad(&[1, 0]).as_slice());
        assert_eq!(list(h, 299), pad(&[2, 1, 0]).as_slice());
        // Token 300 opens document 1: its own block is 0 again.
        assert_eq!(list(h, 300), pad(&[0]).as_slice());
    }
}

#[test]
fn causal_support_truncates_to_the_16_nearest_blocks() {
    let cu = vec![0, 2177];
    let q2k = causal_support(&cu).unwrap();
    let last = &q2k[2176 * TOPK..2177 * TOPK];
    let want: Vec<i32> = (2..=17).rev().collect();
    assert_eq!(last, want.as_slice());
}

#[test]
fn causal_support_of_invalid_offsets_is_empty() {
    for bad in [&[0][..], &[3, 5], &[0, 5, 2]] {
        let err = causal_support(bad).expect_err("invalid cu_seqlens accepted");
        assert!(err.field().starts_with("cu_seqlens"), "{err}");
    }
    // Asked for 2^30 tokens (2^36 ids) it refuses with the bound instead of aborting.
    let err = causal_support(&[0, 1 << 30]).expect_err("huge support accepted");
    assert!(err.to_string().contains("T·16 <= i32::MAX"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// build_schedule against brute force
// ---------------------------------------------------------------------------------------------

/// Checks a built schedule against an independent brute force over `q2k`.
fn check_against_brute_force(q2k: &[i32], lengths: &[usize], qpw: usize) -> Schedule {
    let cu = cu_from_lengths(lengths);
    let s = build_schedule(q2k, &cu, qpw).expect("valid selection");
    let t_total: usize = lengths.iter().sum();
    let blocks: Vec<usize> = lengths.iter().map(|l| l.div_ceil(128)).collect();

    // Rows level-major, round-robin across documents, by the definition.
    let max_blocks = blocks.iter().copied().max().unwrap_or(0);
    let mut order = Vec::new();
    for level in 0..max_blocks {
        for (d, &b) in blocks.iter().enumerate() {
            if b > level {
                order.push((d, level));
            }
        }
    }
    let rows = order.len();
    assert_eq!(s.rows(), rows);
    assert_eq!(s.rows(), blocks.iter().sum::<usize>());

    // Workspace: Σ of aligned lengths before each document.
    let mut ws = Vec::new();
    let mut acc = 0;
    for &l in lengths {
        ws.push(acc as i32);
        acc += l.div_ceil(128) * 128;
    }
    assert_eq!(s.document_workspace_starts(), ws.as_slice());
    assert_eq!(s.workspace_rows(), acc);
    assert_eq!(s.workspace_rows(), rows * 128);
    assert_eq!(s.num_tokens(), t_total);
    assert_eq!(s.cu_seqlens(), cu.as_slice());

    let cap = (t_total * TOPK).max(1);
    assert_eq!(s.edge_capacity(), cap);
    let row_ptr = s.row_ptr();
    let q_indices = s.q_indices();
    assert_eq!(row_ptr.len(), HEADS * (rows + 1));
    assert_eq!(q_indices.len(), HEADS * cap);

    for h in 0..HEADS {
        let offs = &row_ptr[h * (rows + 1)..(h + 1) * (rows + 1)];
        assert_eq!(offs[0], 0);
        for (row, &(d, k)) in order.iter().enumerate() {
            // Every query of document d whose list holds block k, ascending.
            let start = cu[d] as usize;
            let want: Vec<i32> = (0..lengths[d])
                .filter(|&q| {
                    let t = start + q;
                    q2k[(h * t_total + t) * TOPK..(h * t_total + t + 1) * TOPK]
                        .contains(&(k as i32))
                })
                .map(|q| q as i32)
                .collect();
            let got = &q_indices[h * cap + offs[row] as usize..h * cap + offs[row + 1] as usize];
            assert_eq!(
                got,
                want.as_slice(),
                "head {h} row {row} (doc {d} block {k})"
            );
        }
        let used = offs[rows] as usize;
        let selected = (0..t_total * TOPK)
            .filter(|&i| q2k[h * t_total * TOPK + i] >= 0)
            .count();
        assert_eq!(used, selected, "head {h}: one edge per selected id");
        assert!(q_indices[h * cap + used..(h + 1) * cap]
            .iter()
            .all(|&q| q == -1));
    }

    // Work items: exact capacity, count, zero padding.
    let meta = s.scheduler_metadata();
    let n = s.work_count();
    assert!(n >= 0);
    let n = n as usize;
    assert_eq!(s.work_capacity(), n.max(1));
    assert_eq!(s.num_work(), n);
    assert!(meta[n * 6..].iter().all(|&v| v == 0));

    let mut covered: Vec<Vec<u8>> = (0..HEADS)
        .map(|h| vec![0u8; row_ptr[h * (rows + 1) + rows] as usize])
        .collect();
    let mut prev_key: Option<(i32, i32, i32)> = None;
    for i in 0..n {
        let m = &meta[i * 6..(i + 1) * 6];
        let (h, row, qb, qc, d, k) = (m[0], m[1], m[2], m[3], m[4], m[5]);
        let key = (h, row, qb);
        if let Some(p) = prev_key {
            assert!(p < key, "item {i}: order is head, row, q_begin");
        }
        prev_key = Some(key);
        let (h, row) = (h as usize, row as usize);
        assert_eq!(
            (d as usize, k as usize),
            order[row],
            "item {i}: document block of its row"
        );
        let lo = row_ptr[h * (rows + 1) + row] as usize;
        let row_len = row_ptr[h * (rows + 1) + row + 1] as usize - lo;
        assert_eq!(
            qb as usize % qpw,
            0,
            "item {i}: q_begin is a multiple of the chunk"
        );
        assert_eq!(qb % 8, 0);
        assert!(qc >= 1);
        let end = qb as usize + qc as usize;
        assert!(end <= row_len);
        if end < row_len {
            assert_eq!(
                qc as usize, qpw,
                "item {i}: only a row's last item is short"
            );
            assert_eq!(qc % 8, 0);
        }
        for c in &mut covered[h][lo + qb as usize..lo + end] {
            *c += 1;
        }
        assert_eq!(s.work_item(i).map(|w| w.q_count), Some(qc as usize));
    }
    for (h, c) in covered.iter().enumerate() {
        assert!(
            c.iter().all(|&x| x == 1),
            "head {h}: every edge covered exactly once"
        );
    }
    s
}

#[test]
fn packed_documents_with_causal_support() {
    let lengths = [127, 129, 1, 2, 3, 5, 128];
    let cu = cu_from_lengths(&lengths);
    let q2k = causal_support(&cu).unwrap();
    for qpw in [8, 16, 64, 4096] {
        check_against_brute_force(&q2k, &lengths, qpw);
    }
    let s = build_schedule(&q2k, &cu, 8).unwrap();
    // Hand-worked: blocks (1,2,1,1,1,1,1); level 0 gives rows 0..7, doc 1's block 1 is row 7.
    let want_rows: [&[i32]; 8] = [
        &(0..127).collect::<Vec<_>>(),
        &(0..129).collect::<Vec<_>>(),
        &[0],
        &[0, 1],
        &[0, 1, 2],
        &[0, 1, 2, 3, 4],
        &(0..128).collect::<Vec<_>>(),
        &[128],
    ];
    for h in 0..HEADS {
        for (row, want) in want_rows.iter().enumerate() {
            assert_eq!(s.row_queries(h, row).unwrap(), *want, "head {h} row {row}");
        }
    }
    // Items per head: ceil(len/8) over the rows above = 16+17+1+1+1+1+16+1.
    assert_eq!(s.num_work(), 4 * 54);
    let first = s.work_item(0).unwrap();
    assert_eq!(
        (
            first.index_head,
            first.row_linear,
            first.q_begin,
            first.q_count
        ),
        (0, 0, 0, 8)
    );
    let row1_last = s.work_item(16 + 16).unwrap();
    assert_eq!(
        (
            row1_last.row_linear,
            row1_last.q_begin,
            row1_last.q_count,
            row1_last.document_ordinal
        ),
        (1, 128, 1, 1)
    );
    assert_eq!(s.work_item_queries(16 + 16).unwrap(), &[128]);
}

#[test]
fn one_long_document_truncated_to_top16() {
    let lengths = [2177];
    let q2k = causal_support(&cu_from_lengths(&lengths)).unwrap();
    for qpw in [8, 24, 4096] {
        let s = check_against_brute_force(&q2k, &lengths, qpw);
        // Hand-worked: block b is selected by the queries of blocks b..=b+15.
        let len = |row: usize| s.row_range(0, row).unwrap().len();
        assert_eq!(len(0), 2048);
        assert_eq!(len(1), 2048);
        assert_eq!(len(2), 2177 - 256);
        assert_eq!(len(17), 1);
        assert_eq!(s.row_queries(3, 17).unwrap(), &[2176]);
    }
}

/// A random selection: own block forced, up to 15 distinct earlier blocks, random slot order.
fn random_selection(lengths: &[usize], rng: &mut SplitMix64) -> Vec<i32> {
    let t_total: usize = lengths.iter().sum();
    let mut q2k = vec![-1i32; HEADS * t_total * TOPK];
    for h in 0..HEADS {
        let mut t = 0;
        for &len in lengths {
            for q in 0..len {
                let own = q / 128;
                let mut ids = vec![own as i32];
                let extra = rng.below(TOPK);
                for _ in 0..extra {
                    let b = rng.below(own + 1) as i32;
                    if !ids.contains(&b) {
                        ids.push(b);
                    }
                }
                let list = &mut q2k[(h * t_total + t) * TOPK..(h * t_total + t + 1) * TOPK];
                // Scatter the ids over random distinct slots.
                let mut slots: Vec<usize> = (0..TOPK).collect();
                for (i, id) in ids.into_iter().enumerate() {
                    let j = i + rng.below(TOPK - i);
                    slots.swap(i, j);
                    list[slots[i]] = id;
                }
                t += 1;
            }
        }
    }
    q2k
}

#[test]
fn random_selections_match_brute_force() {
    let mut rng = SplitMix64(20260902);
    let cases: [&[usize]; 4] = [
        &[1, 300, 129, 700, 128, 513],
        &[2177],
        &[0, 5, 0, 1030, 17],
        &[4093],
    ];
    for lengths in cases {
        let q2k = random_selection(lengths, &mut rng);
        for qpw in [8, 40] {
            check_against_brute_force(&q2k, lengths, qpw);
        }
    }
}

#[test]
fn all_padding_selection_gives_an_empty_csr() {
    let lengths = [3, 200];
    let t: usize = lengths.iter().sum();
    let q2k = vec![-1i32; HEADS * t * TOPK];
    let s = check_against_brute_force(&q2k, &lengths, 8);
    assert_eq!(s.work_count(), 0);
    assert_eq!(s.work_capacity(), 1);
    assert_eq!(s.scheduler_metadata(), &[0; 6]);
    assert!(s.row_ptr().iter().all(|&v| v == 0));
}

// ---------------------------------------------------------------------------------------------
// build_schedule rejections
// ---------------------------------------------------------------------------------------------

fn selection_fault(
    r: Result<Schedule, ScheduleError>,
) -> (usize, usize, usize, i32, SelectionFault) {
    match r {
        Err(ScheduleError::Selection {
            head,
            row,
            slot,
            block,
            fault,
        }) => (head, row, slot, block, fault),
        other => panic!("expected ScheduleError::Selection, got {other:?}"),
    }
}

#[test]
fn builder_rejects_bad_queries_per_work() {
    let cu = vec![0, 10];
    let q2k = causal_support(&cu).unwrap();
    for qpw in [0, 4, 12, 4095] {
        assert_eq!(
            invalid_field(build_schedule(&q2k, &cu, qpw)),
            "queries_per_work"
        );
    }
}

#[test]
fn builder_rejects_wrong_q2k_length() {
    let cu = vec![0, 10];
    let mut q2k = causal_support(&cu).unwrap();
    q2k.pop();
    assert_eq!(invalid_field(build_schedule(&q2k, &cu, 8)), "q2k.len()");
    assert_eq!(invalid_field(build_schedule(&[], &cu, 8)), "q2k.len()");
}

#[test]
fn builder_rejects_bad_cu_seqlens() {
    assert_eq!(
        invalid_field(build_schedule(&[], &[0], 8)),
        "cu_seqlens.len()"
    );
    assert_eq!(
        invalid_field(build_schedule(&[], &[2, 4], 8)),
        "cu_seqlens[0]"
    );
    assert_eq!(
        invalid_field(build_schedule(&[], &[0, 4, 3], 8)),
        "cu_seqlens[2]"
    );
    // No token at all: a schedule needs rows >= 1.
    assert_eq!(
        invalid_field(build_schedule(&[], &[0, 0, 0], 8)),
        "cu_seqlens[2]"
    );
}

/// Documents 130 and 5 tokens: doc 0 has blocks 0, 1; doc 1 starts at compact row 130.
fn two_docs() -> (Vec<i32>, Vec<i32>, usize) {
    let cu = vec![0, 130, 135];
    (causal_support(&cu).unwrap(), cu, 135)
}

#[test]
fn builder_rejects_ids_below_padding() {
    let (mut q2k, cu, t) = two_docs();
    q2k[(2 * t + 131) * TOPK + 5] = -2;
    let (head, row, slot, block, fault) = selection_fault(build_schedule(&q2k, &cu, 8));
    assert_eq!((head, row, slot, block), (2, 131, 5, -2));
    assert_eq!(fault, SelectionFault::BelowPadding);
}

#[test]
fn builder_rejects_ids_past_the_document_end() {
    let (mut q2k, cu, t) = two_docs();
    // Query 129 of doc 0 (own block 1) names block 2; doc 0 has 2 blocks.
    q2k[(t + 129) * TOPK + 2] = 2;
    let (head, row, slot, block, fault) = selection_fault(build_schedule(&q2k, &cu, 8));
    assert_eq!((head, row, slot, block), (1, 129, 2, 2));
    assert_eq!(fault, SelectionFault::PastDocumentEnd { num_blocks: 2 });
    // Doc 1 has one block: block 1 there is past its end even though doc 0 has a block 1.
    let (mut q2k, cu, t) = two_docs();
    q2k[(3 * t + 134) * TOPK + 1] = 1;
    let (head, row, _, _, fault) = selection_fault(build_schedule(&q2k, &cu, 8));
    assert_eq!((head, row), (3, 134));
    assert_eq!(fault, SelectionFault::PastDocumentEnd { num_blocks: 1 });
}

#[test]
fn builder_rejects_ids_after_the_own_block() {
    let (mut q2k, cu, _) = two_docs();
    // Query 127 of doc 0 is in block 0; block 1 lies in the future.
    q2k[127 * TOPK + 1] = 1;
    let (head, row, slot, block, fault) = selection_fault(build_schedule(&q2k, &cu, 8));
    assert_eq!((head, row, slot, block), (0, 127, 1, 1));
    assert_eq!(fault, SelectionFault::AfterOwnBlock { own_block: 0 });
}

#[test]
fn builder_rejects_repeated_ids() {
    let (mut q2k, cu, t) = two_docs();
    // Query 129 holds [1, 0, -1, ...]; repeat block 1 at slot 9.
    q2k[(3 * t + 129) * TOPK + 9] = 1;
    let (head, row, slot, block, fault) = selection_fault(build_schedule(&q2k, &cu, 8));
    assert_eq!((head, row, slot, block), (3, 129, 9, 1));
    assert_eq!(fault, SelectionFault::Repeated { first_slot: 0 });
    let err = build_schedule(&q2k, &cu, 8).unwrap_err();
    assert_eq!(err.field(), "q2k[3,129,9]");
    assert!(err.to_string().contains("found block 1"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Schedule::new
// ---------------------------------------------------------------------------------------------

#[test]
fn small_base_is_as_worked_by_hand() {
    let p = small_base();
    let s = p.clone().build().unwrap();
    assert_eq!(s.rows(), 3);
    assert_eq!(s.edge_capacity(), 131 * 16);
    for h in 0..HEADS {
        assert_eq!(&s.row_ptr()[h * 4..h * 4 + 4], &[0, 130, 131, 133]);
        assert_eq!(s.row_queries(h, 2).unwrap(), &[128, 129]);
    }
    // Per head: row 0 has ceil(130/8) = 17 items, rows 1 and 2 one each.
    assert_eq!(s.work_count(), 4 * 19);
    assert_eq!(s.work_capacity(), 4 * 19);
    assert_eq!(s.metadata_row(16), Some([0, 0, 128, 2, 0, 0]));
    assert_eq!(s.metadata_row(17), Some([0, 1, 0, 1, 1, 0]));
    assert_eq!(s.metadata_row(18), Some([0, 2, 0, 2, 0, 1]));
    assert_eq!(s.metadata_row(4 * 19), None);
    assert_eq!(s.metadata_row(usize::MAX), None);
    assert_eq!(s.work_item(usize::MAX), None);
    assert_eq!(s.row_range(4, 0), None);
    assert_eq!(s.row_range(0, 3), None);
    assert_eq!(s.row_queries(0, usize::MAX), None);
    assert_eq!(s.workspace_rows(), 256 + 128);
}

#[test]
fn work_count_is_clamped_not_rejected() {
    let mut p = small_base();
    let cap = p.metadata.len() as i32 / 6;
    p.work_count = cap + 7;
    let s = p.clone().build().unwrap();
    assert_eq!(s.work_count(), cap + 7);
    assert_eq!(s.num_work(), cap as usize);
    assert_eq!(s.work_items().count(), cap as usize);

    p.work_count = -3;
    let s = p.clone().build().unwrap();
    assert_eq!(s.num_work(), 0);
    assert_eq!(s.work_item(0), None);

    p.work_count = 0;
    assert_eq!(p.clone().build().unwrap().num_work(), 0);

    // A truncated count only validates the items it keeps: break item 5, keep 5.
    p.work_count = 5;
    meta_mut(&mut p, 5)[0] = 99;
    assert_eq!(p.clone().build().unwrap().num_work(), 5);
    p.work_count = 6;
    assert_eq!(
        invalid_field(p.build()),
        "scheduler_metadata[5,0] (index_head)"
    );
}

#[test]
fn work_count_past_capacity_counts_zero_padding_rows() {
    // No items: capacity 1 with a zero row; a count of 8 clamps to 1 and the zero row is not a
    // valid item (q_count 0).
    let cu = vec![0, 3];
    let s = build_schedule(&[-1; 4 * 3 * 16], &cu, 8).unwrap();
    let mut p = Parts::of(&s);
    p.work_count = 8;
    assert_eq!(
        invalid_field(p.build()),
        "scheduler_metadata[0,3] (q_count)"
    );
}

#[test]
fn rejects_bad_cu_seqlens() {
    let mut p = small_base();
    p.cu_seqlens = vec![0];
    assert_eq!(invalid_field(p.build()), "cu_seqlens.len()");
    let mut p = small_base();
    p.cu_seqlens = vec![1, 130, 131];
    assert_eq!(invalid_field(p.build()), "cu_seqlens[0]");
    let mut p = small_base();
    p.cu_seqlens = vec![0, 130, 129];
    assert_eq!(invalid_field(p.build()), "cu_seqlens[2]");
    let mut p = small_base();
    p.cu_seqlens = vec![0, 0, 0];
    assert_eq!(invalid_field(p.build()), "cu_seqlens[2]");
    let mut p = small_base();
    p.cu_seqlens = vec![0, 130, i32::MAX];
    assert_eq!(invalid_field(p.build()), "workspace rows");
}

#[test]
fn rejects_bad_workspace_starts() {
    let mut p = small_base();
    p.ws_starts = vec![0];
    assert_eq!(invalid_field(p.build()), "document_workspace_starts.len()");
    let mut p = small_base();
    p.ws_starts = vec![-128, 256];
    assert_eq!(invalid_field(p.build()), "document_workspace_starts[0]");
    let mut p = small_base();
    p.ws_starts = vec![0, 300];
    assert_eq!(invalid_field(p.build()), "document_workspace_starts[1]");
    // Doc 0 spans 2 blocks: starting doc 1 at 128 overlaps it.
    let mut p = small_base();
    p.ws_starts = vec![0, 128];
    assert_eq!(invalid_field(p.build()), "document_workspace_starts[1]");
    let mut p = small_base();
    p.ws_starts = vec![128, 0];
    assert_eq!(invalid_field(p.build()), "document_workspace_starts[1]");
    // The last document would end past i32::MAX.
    let mut p = small_base();
    p.ws_starts = vec![0, i32::MAX - 127];
    assert_eq!(invalid_field(p.build()), "document_workspace_starts[1]");
}

#[test]
fn workspace_starts_may_leave_aligned_gaps() {
    let mut p = small_base();
    p.ws_starts = vec![128, 1024];
    let s = p.build().unwrap();
    assert_eq!(s.workspace_rows(), 1024 + 128);
    assert_eq!(s.rows(), 3);
}

#[test]
fn rejects_bad_shapes() {
    let mut p = small_base();
    p.row_ptr.pop();
    assert_eq!(invalid_field(p.build()), "row_ptr.len()");
    // A whole extra row per head: rows must equal Σ ceil(len/128) = 3.
    let mut p = small_base();
    p.row_ptr = [[0, 130, 131, 133, 133]; 4].concat();
    assert_eq!(invalid_field(p.build()), "row_ptr.len()");
    let mut p = small_base();
    p.q_indices.clear();
    assert_eq!(invalid_field(p.build()), "q_indices.len()");
    let mut p = small_base();
    p.q_indices.push(-1);
    assert_eq!(invalid_field(p.build()), "q_indices.len()");
    let mut p = small_base();
    p.metadata.clear();
    assert_eq!(invalid_field(p.build()), "scheduler_metadata.len()");
    let mut p = small_base();
    p.metadata.push(0);
    assert_eq!(invalid_field(p.build()), "scheduler_metadata.len()");
}

#[test]
fn rejects_bad_row_ptr_values() {
    let mut p = small_base();
    p.row_ptr[2 * 4] = -1;
    assert_eq!(invalid_field(p.build()), "row_ptr[2,0]");
    let mut p = small_base();
    p.row_ptr[4 + 2] = 129; // head 1: [0, 130, 129, 133]
    assert_eq!(invalid_field(p.build()), "row_ptr[1,2]");
    let mut p = small_base();
    let cap = p.q_indices.len() as i32 / 4;
    p.row_ptr[3 * 4 + 3] = cap + 1;
    assert_eq!(invalid_field(p.build()), "row_ptr[3,3]");
}

#[test]
fn rejects_edges_outside_their_row() {
    let cap = small_base().q_indices.len() / 4;
    // Row 1 is doc 1 (1 token): query 1 is past its end.
    let mut p = small_base();
    p.q_indices[cap + 130] = 1;
    assert_eq!(invalid_field(p.build()), "q_indices[1,130]");
    // Row 2 is doc 0 block 1: query 5 is before the block.
    let mut p = small_base();
    p.q_indices[2 * cap + 131] = 5;
    assert_eq!(invalid_field(p.build()), "q_indices[2,131]");
    let mut p = small_base();
    p.q_indices[10] = -1;
    assert_eq!(invalid_field(p.build()), "q_indices[0,10]");
}

#[test]
fn rejects_edges_out_of_order() {
    let cap = small_base().q_indices.len() / 4;
    let mut p = small_base();
    p.q_indices.swap(3 * cap + 131, 3 * cap + 132); // row 2: [129, 128]
    assert_eq!(invalid_field(p.build()), "q_indices[3,132]");
    let mut p = small_base();
    p.q_indices[41] = 40; // row 0: ..., 40, 40, ...
    assert_eq!(invalid_field(p.build()), "q_indices[0,41]");
}

#[test]
fn rejects_bad_metadata_columns() {
    let cases: [(usize, i32, &str); 12] = [
        (0, 4, "scheduler_metadata[3,0] (index_head)"),
        (0, -1, "scheduler_metadata[3,0] (index_head)"),
        (1, 3, "scheduler_metadata[3,1] (row_linear)"),
        (1, -1, "scheduler_metadata[3,1] (row_linear)"),
        (4, 2, "scheduler_metadata[3,4] (document_ordinal)"),
        (4, -1, "scheduler_metadata[3,4] (document_ordinal)"),
        (5, 2, "scheduler_metadata[3,5] (document_local_kblock)"),
        (5, -1, "scheduler_metadata[3,5] (document_local_kblock)"),
        // Block 1 of doc 0 exists but is CSR row 2, not row 0.
        (5, 1, "scheduler_metadata[3,1] (row_linear)"),
        (2, -8, "scheduler_metadata[3,2] (q_begin)"),
        (3, 0, "scheduler_metadata[3,3] (q_count)"),
        (3, -5, "scheduler_metadata[3,3] (q_count)"),
    ];
    for (col, value, field) in cases {
        let mut p = small_base();
        meta_mut(&mut p, 3)[col] = value;
        assert_eq!(invalid_field(p.build()), field, "column {col} = {value}");
    }
}

#[test]
fn rejects_work_items_past_their_row() {
    // Item 16 is head 0 row 0, edges [128, 130) of 130.
    let mut p = small_base();
    meta_mut(&mut p, 16)[3] = 3;
    assert_eq!(
        invalid_field(p.build()),
        "scheduler_metadata[16,3] (q_count)"
    );
    let mut p = small_base();
    meta_mut(&mut p, 16)[2] = 136;
    assert_eq!(
        invalid_field(p.build()),
        "scheduler_metadata[16,3] (q_count)"
    );
    // No overflow on extreme values.
    let mut p = small_base();
    meta_mut(&mut p, 16)[2] = i32::MAX;
    meta_mut(&mut p, 16)[3] = i32::MAX;
    assert_eq!(
        invalid_field(p.build()),
        "scheduler_metadata[16,3] (q_count)"
    );
}

#[test]
fn rejects_work_items_sharing_an_edge() {
    // Item 1 covers head 0 row 0 edges [8, 16); stretch item 0 over [0, 9).
    let mut p = small_base();
    meta_mut(&mut p, 0)[3] = 9;
    assert_eq!(invalid_field(p.build()), "scheduler_metadata[1]");
    // A duplicate item later in the list.
    let mut p = small_base();
    let dup: Vec<i32> = p.metadata[18 * 6..19 * 6].to_vec();
    p.metadata.extend(dup);
    p.work_count += 1;
    let n = p.work_count as usize - 1;
    assert_eq!(invalid_field(p.build()), format!("scheduler_metadata[{n}]"));
    // Equal edge ranges of different heads are different edges: the base itself has them.
    let p = small_base();
    assert_eq!(p.metadata[0..6], [0, 0, 0, 8, 0, 0]);
    assert_eq!(p.metadata[19 * 6..20 * 6], [1, 0, 0, 8, 0, 0]);
    assert!(p.build().is_ok());
}

#[test]
fn error_messages_name_field_value_and_expectation() {
    let mut p = small_base();
    p.row_ptr[4 + 2] = 129;
    let msg = p.build().unwrap_err().to_string();
    assert!(msg.contains("row_ptr[1,2]"), "{msg}");
    assert!(msg.contains("found 129"), "{msg}");
    assert!(msg.contains("non-decreasing"), "{msg}");
}

#[test]
fn capacity_limits_are_refused_where_the_schedule_is_built() {
    // One token more than MAX_TOKENS, in two documents and no edges: refused by Schedule::new
    // itself (not later by run_on), and by check_capacity before anything is allocated.
    let t: i32 = (1 << 20) + 1;
    let cu = vec![0, 1 << 19, t];
    let rows = ((1usize << 19) / 128) + (t as usize - (1 << 19)).div_ceil(128);
    let err = Schedule::new(
        vec![0; 4 * (rows + 1)],
        vec![-1; 4],
        vec![0; 6],
        0,
        cu.clone(),
        vec![0, 1 << 19],
    )
    .expect_err("a schedule past MAX_TOKENS was built");
    let msg = err.to_string();
    assert!(
        matches!(err, ScheduleError::Capacity { limit: 1048576, .. }),
        "{msg}"
    );
    assert!(msg.contains("tokens T = 1048577"), "{msg}");
    assert_eq!(check_capacity(&cu), Err(err));
    // At the limit it is accepted.
    let cu = vec![0, 1 << 20];
    assert_eq!(check_capacity(&cu), Ok(()));
    // A huge edge capacity is refused with its own bound.
    let err = msa_runtime::check_shape_capacity(8, 128, 1 << 30, 1).unwrap_err();
    assert!(err.to_string().contains("4·edge_capacity"), "{err}");
}
