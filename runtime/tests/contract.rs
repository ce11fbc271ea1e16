//! The topology constants and the CTA-walk rule against `docs/design.md` §1.1, §2.4 and §4.1.

use msa_runtime::contract::*;

const SMS: [usize; 4] = [1, 8, 132, 148];

#[test]
fn topology_constants() {
    assert_eq!(BLOCK_SIZE, 128);
    assert_eq!(HEAD_DIM, 128);
    assert_eq!(INDEX_DIM, 128);
    assert_eq!(NUM_Q_HEADS, 64);
    assert_eq!(NUM_KV_HEADS, 4);
    assert_eq!(NUM_INDEX_HEADS, 4);
    assert_eq!(MAIN_HEADS_PER_INDEX, 16);
    assert_eq!(TOPK_BLOCKS, 16);
    assert_eq!(QUERY_CHUNK, 8);
    assert_eq!(ROWS_PER_CTA_SMALL, 4);
    assert_eq!(ROWS_PER_CTA_LARGE, 64);
    assert_eq!(ROWS_PER_CTA_SWITCH, 2400);
    // The seed's values, documented; this implementation uses `Locality` instead.
    assert_eq!(LOCALITY_WINDOW, 512);
    assert_eq!(MAX_BINS, 4_194_304);
    assert_eq!(MAX_TOKENS, 1 << 20);
}

#[test]
fn locality_windows_and_the_bin_bound() {
    let l = Locality::default();
    assert_eq!((l.min_window_log2, l.blocks_log2), (13, 5));
    // max(8192, 32·blocks), rounded up to a power of two.
    for (blocks, log2) in [(0, 13), (1, 13), (64, 13), (256, 13), (257, 14), (8192, 18)] {
        assert_eq!(l.window_log2(blocks), log2, "{blocks} blocks");
    }
    assert_eq!(l.document_bins(0), 0);
    assert_eq!(l.document_bins(1), 1);
    assert_eq!(l.document_bins(8192), 64);
    assert_eq!(l.document_bins(8193), 65 * 2);
    // The bound from T and the document count holds for every split of T into documents.
    let mut state = 7u64;
    let mut next = |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    for rule in [
        l,
        Locality::uncapped(9, 0),
        Locality::uncapped(0, 7),
        // Capped windows: a window of 2^9 queries for documents of up to 2^7 blocks.
        Locality::capped(0, 2, 9),
        Locality::capped(9, 2, 12),
    ] {
        for _ in 0..2000 {
            let docs = 1 + next(40) as usize;
            let lens: Vec<usize> = (0..docs)
                .map(|_| match next(4) {
                    0 => next(3) as usize,
                    1 => next(300) as usize,
                    2 => next(20_000) as usize,
                    _ => next(400_000) as usize,
                })
                .collect();
            let t: usize = lens.iter().sum();
            let exact: usize = lens.iter().map(|&n| rule.document_bins(n)).sum();
            assert!(
                exact <= rule.bins_per_head_bound(t, docs),
                "{rule:?} {lens:?}"
            );
        }
    }
    assert!(Locality::uncapped(31, 0).validate().is_err());
    assert!(Locality::uncapped(0, 8).validate().is_err());
    for max_window_log2 in [8, 31] {
        let e = Locality::capped(9, 2, max_window_log2)
            .validate()
            .unwrap_err();
        assert!(
            e.contains(&format!("max_window_log2 = {max_window_log2}")),
            "{e}"
        );
    }
    assert!(l.validate().is_ok());
}

#[test]
fn softmax_scale_is_128_pow_minus_half() {
    assert_eq!(SOFTMAX_SCALE, 128f64.powf(-0.5) as f32);
    assert_eq!(SOFTMAX_SCALE, (1.0 / 128f64.sqrt()) as f32);
    assert_eq!(SOFTMAX_SCALE.to_bits(), 0x3db5_04f3);
}

#[test]
fn rows_per_cta_switches_above_2400() {
    assert_eq!(rows_per_cta(0), 4);
    assert_eq!(rows_per_cta(1), 4);
    assert_eq!(rows_per_cta(2400), 4);
    assert_eq!(rows_per_cta(2401), 64);
    assert_eq!(rows_per_cta(usize::MAX), 64);
}

#[test]
fn documented_chunk_map_examples() {
    assert_eq!(chunk_map(0, 4, 8), (0, 1, 0));
    assert_eq!(chunk_map(32, 4, 8), (8, 1, 8));
    assert_eq!(chunk_map(49, 4, 8), (8, 3, 14));
    assert_eq!(chunk_map(1, 4, 8), (0, 4, 1));
    assert_eq!(chunk_map(2401, 64, 8), (32, 45, 40));
    assert_eq!(chunk_map(2560, 64, 8), (40, 1, 40));
}

#[test]
fn chunk_map_worked_by_hand() {
    // 16 rows on 8 SMs: no full wave, tails of 2 are too short: plain 4-row chunks.
    assert_eq!(chunk_map(16, 4, 8), (0, 4, 4));
    // 17 rows: tails of ceil(17/8) = 3 rows, ceil(17/3) = 6 CTAs.
    assert_eq!(chunk_map(17, 4, 8), (0, 3, 6));
    // 600 chunks = 4 waves of 132 + 72; 288 rows left in tails of 3.
    assert_eq!(chunk_map(2400, 4, 132), (528, 3, 624));
    // 38 chunks on 1 SM, but the 38th is partial: 37 full CTAs and one 33-row tail.
    assert_eq!(chunk_map(2401, 64, 1), (37, 33, 38));
    // 79 chunks < 148 SMs: all tails, ceil(5000/148) = 34 rows each.
    assert_eq!(chunk_map(5000, 64, 148), (0, 34, 148));
}

#[test]
fn grid_launch_bound_formula() {
    // max(min(cap, 2400)/4, cap/64) + sms, worked by hand.
    assert_eq!(grid_launch_bound(0, 8), 8);
    assert_eq!(grid_launch_bound(1, 8), 8);
    assert_eq!(grid_launch_bound(2000, 8), 500 + 8);
    assert_eq!(grid_launch_bound(2400, 148), 600 + 148);
    assert_eq!(grid_launch_bound(20000, 148), 600 + 148);
    assert_eq!(grid_launch_bound(200000, 132), 3125 + 132);
}

#[test]
fn zero_sms_or_rows_per_cta_act_as_one() {
    assert_eq!(chunk_map(10, 4, 0), chunk_map(10, 4, 1));
    assert_eq!(chunk_map(10, 0, 8), chunk_map(10, 1, 8));
    assert_eq!(chunk_map(0, 0, 0), (0, 1, 0));
    assert_eq!(grid_launch_bound(2000, 0), grid_launch_bound(2000, 1));
    assert_eq!(grid_launch_bound(2000, 0), 501);
    let walk = chunk_map(10, 0, 0);
    assert_eq!(cta_interval(0, 10, 0, walk), cta_interval(0, 10, 1, walk));
    assert_walk_covers(10, 0, 0);
    assert_eq!(grid_launch_bound(usize::MAX, usize::MAX), usize::MAX);
}

/// Checks the walk of `n` rows with `r` rows per CTA on `s` SMs (`docs/design.md` §4.1).
fn assert_walk_covers(n: usize, r: usize, s: usize) {
    let walk = chunk_map(n, r, s);
    let grid = walk.2;
    let mut covered = vec![0u8; n];
    let mut next = 0;
    for b in 0..grid {
        let iv = cta_interval(b, n, r, walk);
        assert_eq!(iv.start, next, "n={n} r={r} s={s} cta={b}: not contiguous");
        assert!(
            iv.end > iv.start,
            "n={n} r={r} s={s} cta={b}: empty inside the grid"
        );
        for row in iv.clone() {
            covered[row] += 1;
        }
        next = iv.end;
    }
    assert_eq!(next, n, "n={n} r={r} s={s}: walk ends early");
    assert!(covered.iter().all(|&c| c == 1), "n={n} r={r} s={s}");
    for b in [
        grid,
        grid + 1,
        grid + s,
        grid_launch_bound(n, s),
        usize::MAX,
    ] {
        if b >= grid {
            assert!(
                cta_interval(b, n, r, walk).is_empty(),
                "n={n} s={s} cta={b}"
            );
        }
    }
}

#[test]
fn walk_covers_every_row_once() {
    let mut counts: Vec<usize> = (0..3000).collect();
    for s in SMS {
        counts.extend(s * 64..s * 64 + 512);
    }
    counts.sort_unstable();
    counts.dedup();
    for &s in &SMS {
        for &n in &counts {
            assert_walk_covers(n, rows_per_cta(n), s);
        }
    }
}

#[test]
fn walk_intervals_follow_the_documented_rule() {
    // chunk_map(49, 4, 8) = (8, 3, 14): eight 4-row CTAs, then 3-row tails, the last one short.
    let walk = chunk_map(49, 4, 8);
    let got: Vec<_> = (0..15).map(|b| cta_interval(b, 49, 4, walk)).collect();
    let mut want: Vec<_> = (0..8).map(|b| b * 4..b * 4 + 4).collect();
    want.extend([32..35, 35..38, 38..41, 41..44, 44..47, 47..49, 49..49]);
    assert_eq!(got, want);
    // Short tails fall back to plain chunks: chunk_map(1, 4, 8) = (0, 4, 1).
    assert_eq!(cta_interval(0, 1, 4, chunk_map(1, 4, 8)), 0..1);
    // Nothing to walk.
    assert!(cta_interval(0, 0, 4, chunk_map(0, 4, 8)).is_empty());
}

#[test]
fn launch_bound_covers_every_count_up_to_capacity() {
    let caps = [0usize, 1, 2000, 20000, 200000];
    let max_cap = caps[caps.len() - 1];
    for s in SMS {
        // One pass over n with a running maximum serves every capacity.
        let mut running = 0;
        let mut caps_iter = caps.iter().peekable();
        for n in 0..=max_cap {
            running = running.max(chunk_map(n, rows_per_cta(n), s).2);
            while let Some(&&cap) = caps_iter.peek() {
                if cap != n {
                    break;
                }
                let bound = grid_launch_bound(cap, s);
                assert!(running <= bound, "cap={cap} sms={s}: {running} > {bound}");
                caps_iter.next();
            }
        }
    }
}
