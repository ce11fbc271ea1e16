//! A model, not a measurement: the DRAM bytes per task the KV forward's sum pass would move
//! through an LRU L2 of a given size, for several task-window sizes, on the benchmark's
//! selections (`bench --write-inputs DIR`). No GPU is needed.
//!
//! ```text
//! cargo run --release -p msa-runtime --example forward_l2_model -- DIR doc64k,doc1m [L2_MIB] [WAVE] [POLICY] [KV_MIB]
//! ```
//!
//! The tasks are the device task build's (the CPU oracle, `reference::tasks::build_task_tables_with`),
//! re-sorted per window size `2^s` by `(index head, document, local first query >> s, key block,
//! first query)`: the locality order of `docs/design.md` §2.2 with one window size for every
//! document. The walks are the runtime's: 64-row walks split in two (`PART` below), `WAVE`
//! CTAs (default 132, one per SM) running at once, interleaved row by row. Per task a CTA loads its block's K/V (64 KB) when its
//! segment changes, then per valid query slot reads Q (4 KB: 16 heads × 128 d, bf16) and adds
//! into the `o_pool` row (4 KB of f16). An access misses when the bytes of the distinct
//! objects touched since its object's last access exceed `L2_MIB` (default 40 of the H100's
//! 50 MB); a miss costs the object's bytes, and an `o_pool` miss twice (read, then written
//! back). Concurrency and the cache's sets are not modelled. The last two columns count what
//! crosses L2 whether it hits or not (the sum pass is bound by L2 throughput, session 25): the
//! valid query slots per task (4 KB of Q and 4 KB of `o_pool` each) and the K/V loads per task
//! (64 KB per segment a CTA starts).
//!
//! `POLICY` `kvfirst` models the K/V loads marked `evict_first` (`forward_kv::L2Hints`):
//! a Q or `o_pool` access then counts only the Q and `o_pool` bytes since its last access (the
//! K/V lines are evicted first), and a K/V access hits only within `KV_MIB` (default 4) of
//! all bytes since.
//!
//! Per case it first prints the task and valid-slot counts of the tables the model uses (the
//! backward's windows) and of the runtime's (`FORWARD_KV_LOCALITY`): the same, since windows
//! only order the tasks.
//!
//! Environment: `WINDOWS=11,12` replaces the window list (default `2^9 .. 2^15` and the
//! uncapped rule `9,2`'s window for the longest document); `PART=16` sets the rows per CTA (default 32: the 64-row walks
//! split in two).

use msa_runtime::build_schedule;
use msa_runtime::contract::{Locality, BLOCK_SIZE};
use msa_runtime::forward_kv::FORWARD_KV_LOCALITY;
use msa_runtime::reference::tasks::{build_task_tables_with, task_capacity};
use std::error::Error;

mod common;
use common::read_i32s;

type Res<T> = Result<T, Box<dyn Error>>;

/// Byte-weighted LRU stack distances: a Fenwick tree over access times holds each object's
/// size at the time of its latest access.
struct Stack {
    tree: Vec<u64>,
    last: Vec<u32>,
    now: usize,
}

impl Stack {
    fn new(accesses: usize, objects: usize) -> Self {
        Stack {
            tree: vec![0; accesses + 1],
            last: vec![u32::MAX; objects],
            now: 0,
        }
    }

    fn add(&mut self, mut i: usize, v: i64) {
        i += 1;
        while i < self.tree.len() {
            self.tree[i] = self.tree[i].wrapping_add(v as u64);
            i += i & i.wrapping_neg();
        }
    }

    fn prefix(&self, mut i: usize) -> u64 {
        let mut s = 0u64;
        while i > 0 {
            s = s.wrapping_add(self.tree[i]);
            i -= i & i.wrapping_neg();
        }
        s
    }

    /// Touches `object` of `size` bytes; returns whether it was within `cap` bytes.
    fn touch(&mut self, object: usize, size: u64, cap: u64) -> bool {
        let t = self.now;
        self.now += 1;
        let prev = self.last[object];
        let hit = prev != u32::MAX && {
            let between = self.prefix(t) - self.prefix(prev as usize + 1);
            between + size <= cap
        };
        if prev != u32::MAX {
            self.add(prev as usize, -(size as i64));
        }
        self.add(t, size as i64);
        self.last[object] = t as u32;
        hit
    }
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(cases)) = (args.get(1), args.get(2)) else {
        return Err(
            "usage: forward_l2_model DIR case,case [L2_MIB] [WAVE] [none|kvfirst] [KV_MIB]".into(),
        );
    };
    let cap = args
        .get(3)
        .map(|s| s.parse::<u64>())
        .transpose()?
        .unwrap_or(40)
        << 20;
    let wave: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(132);
    let part: usize = match std::env::var("PART") {
        Ok(p) => p.parse()?,
        Err(_) => 32,
    };
    let kv_first = match args.get(5).map(String::as_str) {
        None | Some("none") => false,
        Some("kvfirst") => true,
        Some(p) => return Err(format!("POLICY {p:?}: expected none or kvfirst").into()),
    };
    let kv_cap = args
        .get(6)
        .map(|s| s.parse::<u64>())
        .transpose()?
        .unwrap_or(4)
        << 20;
    println!(
        "L2 {} MiB, {wave} CTAs, K/V evict_first: {kv_first}",
        cap >> 20
    );
    println!(
        "| case | window | rows | K/V KB per task | Q KB | o_pool KB | all KB per task | \
         slots per task | K/V loads KB per task |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for name in cases.split(',') {
        let cu = read_i32s(&format!("{dir}/{name}.cu_seqlens.i32"))?;
        let q2k = read_i32s(&format!("{dir}/{name}.q2k.i32"))?;
        let t = *cu.last().ok_or("empty cu_seqlens")? as usize;
        let schedule = build_schedule(&q2k, &cu, 64)?;
        let tables = build_task_tables_with(
            &schedule,
            132,
            task_capacity(&schedule),
            Locality::default(),
        );
        let n = tables.num_rows();
        // The runtime's own tables, under its capped windows: the windows order the tasks and
        // do not change them, so the model's tasks are the pass's.
        let own = build_task_tables_with(
            &schedule,
            132,
            task_capacity(&schedule),
            FORWARD_KV_LOCALITY,
        );
        let valid = |q: &[i32]| q.iter().filter(|&&q| q >= 0).count();
        let slots = valid(&tables.qrows);
        println!(
            "{name}: {n} tasks, {slots} valid slots; under FORWARD_KV_LOCALITY: {} tasks, {} \
             valid slots",
            own.num_rows(),
            valid(&own.qrows)
        );
        let doc_of = |row: usize| cu.partition_point(|&c| c as usize <= row) - 1;
        let max_blocks = cu
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0)
            .div_ceil(BLOCK_SIZE);
        let blocks_log2 = usize::BITS - max_blocks.max(1).next_power_of_two().leading_zeros() - 1;
        let mut windows: Vec<u32> = match std::env::var("WINDOWS") {
            Ok(list) => list
                .split(',')
                .map(|w| w.parse())
                .collect::<Result<_, _>>()?,
            Err(_) => (9..=15).chain([blocks_log2 + 2]).collect(),
        };
        windows.sort_unstable();
        windows.dedup();
        for s in windows {
            let key = |r: usize| {
                let q0 = tables.qrows[8 * r] as usize;
                let d = doc_of(q0);
                let local = q0 - cu[d] as usize;
                (
                    tables.meta[4 * r + 1],
                    d,
                    local >> s,
                    tables.meta[4 * r + 2],
                    q0,
                )
            };
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by_key(|&r| key(r));
            let kv_objects = 4
                * (tables
                    .meta
                    .iter()
                    .skip(2)
                    .step_by(4)
                    .max()
                    .copied()
                    .unwrap_or(0) as usize
                    + 1);
            let mut stack = Stack::new(n * 17 + 1, 8 * t + kv_objects);
            // With `kvfirst`, the Q and o_pool accesses alone, in their own stack.
            let mut rows_stack = Stack::new(if kv_first { n * 16 + 1 } else { 1 }, 8 * t);
            let kv_hit_cap = if kv_first { kv_cap } else { cap };
            let (mut kv_b, mut q_b, mut o_b) = (0u64, 0u64, 0u64);
            // What crosses L2 hit or miss: the segments' K/V loads (the query slots are the
            // tables' `slots`, whatever the order).
            let mut kv_loads = 0u64;
            // CTA walks of `part` rows (the 64-row walks split in two by default); `wave`
            // CTAs at once.
            let parts: Vec<(usize, usize)> = (0..n)
                .step_by(part)
                .map(|lo| (lo, (lo + part).min(n)))
                .collect();
            for group in parts.chunks(wave) {
                let mut seg: Vec<Option<(i32, i32)>> = vec![None; group.len()];
                for j in 0..part {
                    for (c, &(lo, hi)) in group.iter().enumerate() {
                        let i = lo + j;
                        if i >= hi {
                            continue;
                        }
                        let r = order[i];
                        let (head, kb) = (tables.meta[4 * r + 1], tables.meta[4 * r + 2]);
                        if seg[c] != Some((head, kb)) {
                            seg[c] = Some((head, kb));
                            kv_loads += 65536;
                            let obj = 8 * t + 4 * kb as usize + head as usize;
                            if !stack.touch(obj, 65536, kv_hit_cap) {
                                kv_b += 65536;
                            }
                        }
                        for &q in &tables.qrows[8 * r..8 * r + 8] {
                            if q < 0 {
                                continue;
                            }
                            let q = head as usize * t + q as usize;
                            let mut touch = |object: usize| {
                                let all = stack.touch(object, 4096, cap);
                                if kv_first {
                                    rows_stack.touch(object, 4096, cap)
                                } else {
                                    all
                                }
                            };
                            if !touch(q) {
                                q_b += 4096;
                            }
                            if !touch(4 * t + q) {
                                o_b += 8192;
                            }
                        }
                    }
                }
            }
            let per = |b: u64| b as f64 / n as f64 / 1024.0;
            println!(
                "| {name} | 2^{s} | {n} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} |",
                per(kv_b),
                per(q_b),
                per(o_b),
                per(kv_b + q_b + o_b),
                slots as f64 / n as f64,
                per(kv_loads)
            );
        }
    }
    Ok(())
}
