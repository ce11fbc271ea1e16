//! Times `msa_runtime::run_backward` on the benchmark cases of `bench/` (see `bench/README.md`).
//!
//! ```sh
//! cargo run -p msa-runtime --release --example bench                       # all timed cases
//! cargo run -p msa-runtime --release --example bench -- --cases doc8k --json ours.json
//! cargo run -p msa-runtime --release --example bench -- --inputs-only      # no GPU needed
//! ```
//!
//! Cases (identical to `bench/msa_inputs.py`): `doc8k` (one document of 8192 tokens), `doc32k`
//! (one of 32768), `packed64k` (65536 tokens in 10 documents of 2K–16K), each with the random
//! top-16 selection of the shared splitmix64 recipe; the long-document cases `doc16k`, `doc64k`,
//! `doc128k`, `doc256k`, `doc1m` (one document each) and `packed1m` (1,048,576 tokens in 30
//! documents of 2K–196K) and the small `check*` cases exist too.
//!
//! Options:
//! - `--cases a,b,…`  cases to run (default `doc8k,doc32k,packed64k`)
//! - `--seed N`       selection seed (default 20261129, as in `bench/msa_inputs.py`)
//! - `--reps R`       timed calls per case (default 20), `--warmup W` untimed calls first (default 3)
//! - `--inputs DIR`   compare the generated `q2k`/`cu_seqlens` with the raw files
//!   `DIR/<case>.q2k.i32` / `DIR/<case>.cu_seqlens.i32` that `bench/baselines.py` writes; exit 1 on
//!   any difference
//! - `--json PATH`    also write the results as JSON
//! - `--ceiling TFLOPS` matmul ceiling (e.g. from `bench/baselines.py`'s JSON) for the fraction
//!   column
//! - `--no-flush`     do not overwrite a 256 MiB buffer (L2 flush) before each timed call
//! - `--inputs-only`  print each case's size, keys attended, task count and q2k checksum, and
//!   stop (no GPU needed)
//! - `--locality MIN,BLOCKS` the task order's locality rule (`msa_runtime::contract::Locality`:
//!   windows of at least `2^MIN` queries and `2^BLOCKS` queries per key block; default
//!   `Locality::default()`; `9,0` is the seed's 512-query window on one document of up to 64K
//!   tokens). Repeatable: the first rule is the case's main timing (checked, device schedule
//!   columns); each further one is timed on the same inputs right after it, `locality_sweep`
//!   in the JSON
//! - `--host-schedule-only` skip the device schedule build's timings (the `sched_ms` columns)
//! - `--write-inputs DIR` write each case's `q2k` and `cu_seqlens` as `DIR/<case>.q2k.i32` /
//!   `DIR/<case>.cu_seqlens.i32` (the raw files `--inputs` reads), for `bench/baselines.py
//!   --q2k-from DIR` at lengths where its numpy recipe is too slow
//! - `--deterministic` also time the deterministic mode (`MsaBackward::set_deterministic`) on
//!   the same inputs right after the default one, with its ratio to the default median; two
//!   more deterministic calls must give the same bits, and `--check N` checks one of them too;
//!   then `reps` interleaved pairs (a default call, a deterministic call) give a second ratio
//!   under the same clocks and temperature for both modes
//! - `--check N`      after timing, one more call whose gradients are checked against exact
//!   sampled references (`msa_runtime::reference::sampled`): N random dq rows and N/100 random
//!   key blocks of dk/dv, at the seed tolerances
//!
//! - `--sync-each`    read each call's events right after it (the host waits for the GPU once per
//!   call; the timing of sessions before 2026-12-02) instead of once after the last call
//! - `--breakdown`    after the timings, `reps` more calls of the host-schedule and the
//!   device-schedule path through `msa_runtime::TimedBackend` (events around every kernel,
//!   zeroing and upload, the events of all calls read at the end): each operation's median
//!   ms, their sum, and the stream's idle time inside a call (its span minus that sum)
//!
//! What is timed: one `MsaBackward::run` call (what `run_backward` runs) between two CUDA events
//! on the stream: delta preprocess, pool zeroing, the schedule upload, the device task build, the
//! main kernel and the postprocess, plus the stream-ordered allocation of the three outputs. The
//! host-side `build_schedule` is not timed. Median and minimum over the timed calls. As
//! `bench/baselines.py` times the baselines, the events of all timed calls are read after one
//! synchronize at the end, so the host enqueues a call while the GPU runs the ones before (as
//! in a training step); a call's span still includes any wait of the GPU for the host inside it.
//!
//! Inputs: q, dO, out random bf16 uniform in [-√3, √3) (unit variance), k/v likewise, scattered
//! into the aligned workspace with zero padding rows. `out` and `lse` are synthetic (not the
//! forward's): lse[t, h] = ln(keys attended by (t, h)) + 1/2, which is what unit-variance scores
//! give on average, so every value stays finite; the gradients are therefore not meaningful and
//! are not checked here (the GPU tests check numerics). The sparse work does not depend on the
//! values.
//!
//! Then the device schedule build (issue 10) on the same case: `ResidentSchedule::build` from
//! the device `q2k`/`cu_seqlens` alone between two events (`sched_ms`, checked bit-exact against
//! `build_schedule` first), and the backward with it, build included (`dev_ms`: build +
//! `run_backward` on the resident schedule, no host schedule anywhere). `sched%` is
//! `sched_ms / ms_med`, the build's share of the host-schedule backward. The device build covers
//! every case (`MAX_BUILD_TOKENS` = `MAX_TOKENS`); a case past it would show `-` there and
//! time the host-schedule path only.
//!
//! Without a GPU (no libcuda, no device, or an error opening it) it says so and exits 0.

use cudarc::driver::DevicePtr;
use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream};
use half::bf16;
use msa_runtime::contract::Locality;
use msa_runtime::contract::{
    BLOCK_SIZE, HEAD_DIM, NUM_INDEX_HEADS, NUM_KV_HEADS, NUM_Q_HEADS, QUERY_CHUNK, TOPK_BLOCKS,
};
use msa_runtime::reference::{sampled, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{
    build_schedule, driver_present, run_backward, workspace_layout, BackwardBuffers, CudaBackend,
    Device, MsaBackward, ResidentSchedule, ScheduleBuildSizes, Span, TimedBackend,
    MAX_BUILD_TOKENS,
};
use std::error::Error;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;

mod common;
use common::read_i32s;

type Res<T> = Result<T, Box<dyn Error>>;

// ---------------------------------------------------------------------------------------------
// The shared input recipe (bench/msa_inputs.py; bench/README.md "Inputs")

const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
const DEFAULT_SEED: u64 = 20_261_129;
/// Key-index stride per (head, token): candidate blocks `c < 65536`.
const CAND_STRIDE: u64 = 65_536;
const MUL1: u64 = 0xbf58_476d_1ce4_e5b9;
const MUL2: u64 = 0x94d0_49bb_1331_11eb;

/// Documents of the packed case: 65536 tokens, 2K–16K each, not multiples of 128.
const PACKED_64K: [i32; 10] = [9000, 2048, 16384, 5123, 3001, 12000, 2500, 7777, 4100, 3603];

/// `packed1m`: 1,048,576 tokens in 30 documents of 2K to 196K tokens: the packed64k lengths,
/// then three and twelve times them.
fn packed_1m() -> Vec<i32> {
    [1, 3, 12]
        .iter()
        .flat_map(|&k| PACKED_64K.iter().map(move |&n| n * k))
        .collect()
}

/// (name, document lengths, topk); the first three are the timed cases.
fn case_table() -> Vec<(&'static str, Vec<i32>, usize)> {
    vec![
        ("doc8k", vec![8192], 16),
        ("doc32k", vec![32768], 16),
        ("packed64k", PACKED_64K.to_vec(), 16),
        ("doc16k", vec![16384], 16),
        ("doc64k", vec![65536], 16),
        ("doc128k", vec![131_072], 16),
        ("doc256k", vec![262_144], 16),
        ("doc1m", vec![1_048_576], 16),
        ("packed1m", packed_1m(), 16),
        ("check2doc_top16", vec![700, 1348], 16),
        ("check2doc_top4", vec![700, 1348], 4),
        ("check1doc_top4", vec![2048], 4),
    ]
}
const TIMED_CASES: &str = "doc8k,doc32k,packed64k";

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(MUL1);
    z = (z ^ (z >> 27)).wrapping_mul(MUL2);
    z ^ (z >> 31)
}

/// The i-th (0-based) output of splitmix64 seeded with `seed`.
fn rand(seed: u64, i: u64) -> u64 {
    mix64(seed.wrapping_add(i.wrapping_add(1).wrapping_mul(GAMMA)))
}

fn cu_seqlens(docs: &[i32]) -> Vec<i32> {
    let mut cu = vec![0i32];
    for &n in docs {
        cu.push(cu[cu.len() - 1] + n);
    }
    cu
}

/// `q2k [4, T, 16]`: slot 0 the own block, then the `min(topk-1, own)` earlier blocks with the
/// smallest `(rand(seed, (h·T + t)·65536 + c), c)`, then -1. Rows are filled in parallel; each
/// row's result depends on its index alone.
fn make_q2k(cu: &[i32], seed: u64, topk: usize) -> Vec<i32> {
    let t_total = cu[cu.len() - 1] as usize;
    let mut q2k = vec![-1i32; NUM_INDEX_HEADS * t_total * TOPK_BLOCKS];
    // The own block of each token, from its document's start.
    let mut own = vec![0u32; t_total];
    for w in cu.windows(2) {
        let doc = &mut own[w[0] as usize..w[1] as usize];
        for (p, o) in doc.iter_mut().enumerate() {
            *o = (p / BLOCK_SIZE) as u32;
        }
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |p| p.get())
        .min(32);
    let rows_per_part = (NUM_INDEX_HEADS * t_total).div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (part_index, part) in q2k.chunks_mut(rows_per_part * TOPK_BLOCKS).enumerate() {
            let own = &own;
            s.spawn(move || {
                let mut cand: Vec<(u64, u32)> = Vec::new();
                for (i, slots) in part.chunks_mut(TOPK_BLOCKS).enumerate() {
                    let flat = part_index * rows_per_part + i; // h·T + t
                    let own = own[flat % t_total];
                    slots[0] = own as i32;
                    let n = (own as usize).min(topk.saturating_sub(1));
                    if n == 0 {
                        continue;
                    }
                    let row = flat as u64 * CAND_STRIDE;
                    cand.clear();
                    cand.extend((0..own).map(|c| (rand(seed, row + u64::from(c)), c)));
                    // The n smallest keys, ascending (keys are unique: c breaks ties).
                    if n < cand.len() {
                        cand.select_nth_unstable(n - 1);
                    }
                    cand[..n].sort_unstable();
                    for (slot, &(_, c)) in slots[1..=n].iter_mut().zip(&cand) {
                        *slot = c as i32;
                    }
                }
            });
        }
    });
    q2k
}

/// `Σ_i mix64((i << 32) | (q2k[i] as u32))` (wrapping), as in `msa_inputs.q2k_checksum`.
fn q2k_checksum(q2k: &[i32]) -> u64 {
    q2k.iter().enumerate().fold(0u64, |acc, (i, &v)| {
        acc.wrapping_add(mix64(((i as u64) << 32) | u64::from(v as u32)))
    })
}

/// Useful backward FLOP (MSA convention): 10·128 per (query head, attended key), 16 query heads
/// per index head.
fn useful_flop(keys: usize) -> f64 {
    keys as f64 * 10.0 * HEAD_DIM as f64 * (NUM_Q_HEADS / NUM_INDEX_HEADS) as f64
}

/// FLOP one 128-key × (8 queries × 16 heads) task tile executes: 5 GEMMs of 2·128³.
const TILE_FLOP: f64 = 5.0 * 2.0 * 128.0 * 128.0 * 128.0;

// ---------------------------------------------------------------------------------------------
// Options

struct Options {
    cases: Vec<String>,
    seed: u64,
    reps: usize,
    warmup: usize,
    inputs: Option<String>,
    json: Option<String>,
    ceiling: Option<f64>,
    flush: bool,
    inputs_only: bool,
    localities: Vec<Locality>,
    check: usize,
    device_schedule: bool,
    write_inputs: Option<String>,
    deterministic: bool,
    sync_each: bool,
    breakdown: bool,
}

const USAGE: &str = "usage: bench [--cases a,b] [--seed N] [--reps R] [--warmup W] [--inputs DIR] \
[--json PATH] [--ceiling TFLOPS] [--no-flush] [--inputs-only] [--locality MIN,BLOCKS]... [--check N] \
[--host-schedule-only] [--write-inputs DIR] [--deterministic] [--sync-each] [--breakdown]";

fn parse_args() -> Result<Options, String> {
    let mut o = Options {
        cases: TIMED_CASES.split(',').map(String::from).collect(),
        seed: DEFAULT_SEED,
        reps: 20,
        warmup: 3,
        inputs: None,
        json: None,
        ceiling: None,
        flush: true,
        inputs_only: false,
        localities: Vec::new(),
        check: 0,
        device_schedule: true,
        deterministic: false,
        write_inputs: None,
        sync_each: false,
        breakdown: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> Result<String, String> {
            args.next().ok_or_else(|| format!("{name} needs a value"))
        };
        let number = |name: &str, v: String| -> Result<u64, String> {
            v.parse()
                .map_err(|_| format!("{name} needs a non-negative integer, got `{v}`"))
        };
        match a.as_str() {
            "--cases" => {
                let v = value("--cases")?;
                o.cases = v
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect();
            }
            "--seed" => o.seed = number("--seed", value("--seed")?)?,
            "--reps" => o.reps = number("--reps", value("--reps")?)?.max(1) as usize,
            "--warmup" => o.warmup = number("--warmup", value("--warmup")?)? as usize,
            "--inputs" => o.inputs = Some(value("--inputs")?),
            "--json" => o.json = Some(value("--json")?),
            "--ceiling" => {
                let v = value("--ceiling")?;
                o.ceiling = Some(
                    v.parse::<f64>()
                        .ok()
                        .filter(|x| *x > 0.0)
                        .ok_or_else(|| format!("--ceiling needs a positive number, got `{v}`"))?,
                );
            }
            "--no-flush" => o.flush = false,
            "--sync-each" => o.sync_each = true,
            "--breakdown" => o.breakdown = true,
            "--locality" => {
                let v = value("--locality")?;
                let parts: Vec<&str> = v.split(',').collect();
                let (Some(a), Some(b), 2) = (parts.first(), parts.get(1), parts.len()) else {
                    return Err(format!(
                        "--locality needs MIN_WINDOW_LOG2,BLOCKS_LOG2, got `{v}`"
                    ));
                };
                let l = Locality::uncapped(
                    number("--locality", a.to_string())? as u32,
                    number("--locality", b.to_string())? as u32,
                );
                l.validate()?;
                o.localities.push(l);
            }
            "--host-schedule-only" => o.device_schedule = false,
            "--deterministic" => o.deterministic = true,
            "--write-inputs" => o.write_inputs = Some(value("--write-inputs")?),
            "--check" => o.check = number("--check", value("--check")?)? as usize,
            "--inputs-only" => o.inputs_only = true,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
        }
    }
    if o.localities.is_empty() {
        o.localities.push(Locality::default());
    }
    let known: Vec<&str> = case_table().iter().map(|c| c.0).collect();
    for c in &o.cases {
        if !known.contains(&c.as_str()) {
            return Err(format!("unknown case `{c}`; known: {}", known.join(", ")));
        }
    }
    Ok(o)
}

// ---------------------------------------------------------------------------------------------
// Cases

struct Case {
    name: String,
    docs: Vec<i32>,
    topk: usize,
    cu: Vec<i32>,
    q2k: Vec<i32>,
    kept: Vec<usize>,
    keys: usize,
    checksum: u64,
}

fn make_case(name: &str, seed: u64) -> Case {
    let (_, docs, topk) = case_table()
        .into_iter()
        .find(|c| c.0 == name)
        .expect("validated case name");
    let cu = cu_seqlens(&docs);
    let q2k = make_q2k(&cu, seed, topk);
    let kept = msa_runtime::reference::keys_attended(&q2k, &cu).expect("a generated case is valid");
    Case {
        name: name.to_string(),
        docs,
        topk,
        keys: kept.iter().sum(),
        checksum: q2k_checksum(&q2k),
        cu,
        q2k,
        kept,
    }
}

/// Compares the case with the raw files `bench/baselines.py` wrote.
fn compare_inputs(dir: &str, case: &Case) -> Res<()> {
    let cu = read_i32s(&format!("{dir}/{}.cu_seqlens.i32", case.name))?;
    if cu != case.cu {
        return Err(format!("{}: cu_seqlens differ from {dir}", case.name).into());
    }
    let q2k = read_i32s(&format!("{dir}/{}.q2k.i32", case.name))?;
    if q2k.len() != case.q2k.len() {
        return Err(format!(
            "{}: q2k in {dir} has {} entries, expected {}",
            case.name,
            q2k.len(),
            case.q2k.len()
        )
        .into());
    }
    if let Some(i) = q2k.iter().zip(&case.q2k).position(|(a, b)| a != b) {
        let per_head = case.q2k.len() / NUM_INDEX_HEADS;
        let (h, rest) = (i / per_head, i % per_head);
        return Err(format!(
            "{}: q2k differs at flat index {i} (head {h}, token {}, slot {}): file {} vs generated {}",
            case.name,
            rest / TOPK_BLOCKS,
            rest % TOPK_BLOCKS,
            q2k[i],
            case.q2k[i]
        )
        .into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Timing

/// Random bf16 uniform in [-√3, √3), filled in parallel; chunk j uses splitmix64 seeded with
/// `rand(seed, j)`.
fn random_bf16(n: usize, seed: u64) -> Vec<bf16> {
    let mut v = vec![bf16::ZERO; n];
    let threads = std::thread::available_parallelism()
        .map_or(1, |p| p.get())
        .min(32);
    let chunk = n.div_ceil(threads).max(1 << 16);
    std::thread::scope(|s| {
        for (j, part) in v.chunks_mut(chunk).enumerate() {
            s.spawn(move || {
                let mut state = rand(seed, j as u64);
                let scale = 3f32.sqrt();
                for x in part {
                    state = state.wrapping_add(GAMMA);
                    let u = (mix64(state) >> 40) as f32 / (1u64 << 24) as f32;
                    *x = bf16::from_f32((u * 2.0 - 1.0) * scale);
                }
            });
        }
    });
    v
}

/// Compact `[T, 4, 128]` rows scattered into the aligned `[W, 4, 128]` layout, zero padding.
fn to_aligned(compact: &[bf16], cu: &[i32], starts: &[i32], w: usize) -> Vec<bf16> {
    let row = NUM_KV_HEADS * HEAD_DIM;
    let mut out = vec![bf16::ZERO; w * row];
    for (d, &ws) in starts.iter().enumerate() {
        let (lo, hi) = (cu[d] as usize, cu[d + 1] as usize);
        let at = ws as usize * row;
        out[at..at + (hi - lo) * row].copy_from_slice(&compact[lo * row..hi * row]);
    }
    out
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

struct Timing {
    tokens: usize,
    workspace_rows: usize,
    work_items: usize,
    tasks: usize,
    samples: Vec<f32>,
    median_ms: f32,
    min_ms: f32,
    /// The device schedule path, when `T` is within the device build's limit.
    device: Option<DeviceTiming>,
    /// Device bytes of the call's inputs and outputs.
    io_bytes: usize,
    /// `MsaBackward::workspace_bytes` after the timed calls.
    workspace_bytes: usize,
    /// The further locality rules (`--locality` after the first), timed on the same inputs.
    sweep: Vec<SweepTiming>,
    /// The deterministic mode on the same inputs (`--deterministic`).
    det: Option<DetTiming>,
}

/// One further locality rule's timing.
struct SweepTiming {
    locality: Locality,
    median_ms: f32,
    min_ms: f32,
    samples: Vec<f32>,
}

/// The deterministic mode's timing (`--deterministic`).
struct DetTiming {
    median_ms: f32,
    min_ms: f32,
    samples: Vec<f32>,
    /// `MsaBackward::workspace_bytes` of the deterministic backward.
    workspace_bytes: usize,
    /// Interleaved `[default, deterministic]` call times, ms.
    pairs: Vec<[f32; 2]>,
}

impl DetTiming {
    /// Medians of the interleaved default and deterministic calls, and their ratio.
    fn paired(&self) -> (f32, f32, f32) {
        let d = median(self.pairs.iter().map(|p| p[0]).collect());
        let x = median(self.pairs.iter().map(|p| p[1]).collect());
        (d, x, x / d)
    }
}

/// The device schedule build's timings.
struct DeviceTiming {
    /// Device schedule build alone: median and minimum.
    sched_median_ms: f32,
    sched_min_ms: f32,
    /// Device schedule build plus the backward on it: median.
    device_path_median_ms: f32,
}

fn time_case(stream: &Arc<CudaStream>, case: &Case, o: &Options, seed: u64) -> Res<Timing> {
    let schedule = build_schedule(&case.q2k, &case.cu, 64)?;
    let (t, w) = (schedule.num_tokens(), schedule.workspace_rows());
    let tasks: usize = schedule
        .work_items()
        .map(|it| it.q_count.div_ceil(QUERY_CHUNK))
        .sum();
    let (starts, w2) = workspace_layout(&case.cu)?;
    assert_eq!(w, w2, "workspace rows");

    let q_len = t * NUM_Q_HEADS * HEAD_DIM;
    let kv_len = t * NUM_KV_HEADS * HEAD_DIM;
    let q = random_bf16(q_len, seed ^ 1);
    let dout = random_bf16(q_len, seed ^ 2);
    let out = random_bf16(q_len, seed ^ 3);
    let k = to_aligned(&random_bf16(kv_len, seed ^ 4), &case.cu, &starts, w);
    let v = to_aligned(&random_bf16(kv_len, seed ^ 5), &case.cu, &starts, w);
    let heads_per_group = NUM_Q_HEADS / NUM_KV_HEADS;
    let lse: Vec<f32> = (0..t * NUM_Q_HEADS)
        .map(|row| {
            let (tok, h) = (row / NUM_Q_HEADS, row % NUM_Q_HEADS);
            (case.kept[(h / heads_per_group) * t + tok].max(1) as f32).ln() + 0.5
        })
        .collect();

    let d_q = stream.clone_htod(&q)?;
    let d_k = stream.clone_htod(&k)?;
    let d_v = stream.clone_htod(&v)?;
    let d_out = stream.clone_htod(&out)?;
    let d_dout = stream.clone_htod(&dout)?;
    let d_lse = stream.clone_htod(&lse)?;
    let host = (o.check > 0).then_some((q, k, v, out, dout, lse));
    let det_host = if o.deterministic { host.clone() } else { None };
    let mut flush: Option<CudaSlice<u8>> = if o.flush {
        Some(stream.alloc_zeros::<u8>(256 << 20)?)
    } else {
        None
    };

    // One call of `b` on the case's inputs and host schedule.
    let run = |b: &mut MsaBackward| {
        b.run(
            stream,
            &d_q.as_view(),
            &d_k.as_view(),
            &d_v.as_view(),
            &d_dout.as_view(),
            &d_lse.as_view(),
            &d_out.as_view(),
            &schedule,
        )
    };
    // One timed call of `b` after the L2 flush: its two events (its gradients dropped,
    // stream-ordered).
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut timed_call = |b: &mut MsaBackward| -> Res<Pair> {
        if let Some(buf) = flush.as_mut() {
            stream.memset_zeros(buf)?;
        }
        let start = stream.record_event(timing)?;
        let grads = run(b)?;
        let end = stream.record_event(timing)?;
        drop(grads);
        Ok((start, end))
    };
    // `warmup` untimed then `reps` timed calls with the locality rule `l`; returns the samples
    // and the backward (its workspace still allocated).
    let mut time_rule = |l: Locality, deterministic: bool| -> Res<(Vec<f32>, MsaBackward)> {
        let mut backward = MsaBackward::new();
        backward.set_locality(l);
        backward.set_deterministic(deterministic);
        for _ in 0..o.warmup {
            drop(run(&mut backward)?);
        }
        stream.synchronize()?;
        let mut samples = Samples::new(o.sync_each);
        for _ in 0..o.reps {
            samples.push(timed_call(&mut backward)?)?;
        }
        Ok((samples.finish(stream)?, backward))
    };
    let (samples, mut backward) = time_rule(o.localities[0], false)?;
    let workspace_bytes = backward.workspace_bytes();
    if let Some((q, k, v, out, dout, lse)) = host {
        let grads = run(&mut backward)?;
        let x = sampled::Inputs {
            q: &q,
            k_aligned: &k,
            v_aligned: &v,
            grad_out: &dout,
            out: &out,
            lse: &lse,
            q2k: &case.q2k,
            cu_seqlens: &case.cu,
            ws_starts: &starts,
        };
        check_sampled(stream, &x, &grads, o.check, seed)?;
    }
    drop(backward);
    let mut sweep = Vec::new();
    for &l in &o.localities[1..] {
        let (s, b) = time_rule(l, false)?;
        drop(b);
        sweep.push(SweepTiming {
            locality: l,
            median_ms: median(s.clone()),
            min_ms: s.iter().copied().fold(f32::INFINITY, f32::min),
            samples: s,
        });
    }
    // The deterministic mode on the same inputs (`--deterministic`), checked like the default
    // one when `--check` asks, and its calls compared bit for bit.
    let det = if o.deterministic {
        let (s, mut b) = time_rule(o.localities[0], true)?;
        let (g1, g2) = (run(&mut b)?, run(&mut b)?);
        let same = stream.clone_dtoh(&g1.dq)? == stream.clone_dtoh(&g2.dq)?
            && stream.clone_dtoh(&g1.dk_aligned)? == stream.clone_dtoh(&g2.dk_aligned)?
            && stream.clone_dtoh(&g1.dv_aligned)? == stream.clone_dtoh(&g2.dv_aligned)?;
        if !same {
            return Err(format!("{}: two deterministic calls differ", case.name).into());
        }
        if let Some((q, k, v, out, dout, lse)) = &det_host {
            let x = sampled::Inputs {
                q,
                k_aligned: k,
                v_aligned: v,
                grad_out: dout,
                out,
                lse,
                q2k: &case.q2k,
                cu_seqlens: &case.cu,
                ws_starts: &starts,
            };
            check_sampled(stream, &x, &g1, o.check, seed)?;
        }
        let bytes = b.workspace_bytes();
        // Interleaved pairs (a default call, then a deterministic one, each after the L2
        // flush): both modes under the same clocks and thermal state, whatever the drift
        // between the two blocks of calls above.
        let mut dflt = MsaBackward::new();
        dflt.set_locality(o.localities[0]);
        for _ in 0..o.warmup.max(1) {
            drop(run(&mut dflt)?);
        }
        let mut interleaved = Samples::new(o.sync_each);
        for _ in 0..o.reps {
            interleaved.push(timed_call(&mut dflt)?)?;
            interleaved.push(timed_call(&mut b)?)?;
        }
        let pairs = interleaved
            .finish(stream)?
            .chunks_exact(2)
            .map(|p| [p[0], p[1]])
            .collect();
        Some(DetTiming {
            median_ms: median(s.clone()),
            min_ms: s.iter().copied().fold(f32::INFINITY, f32::min),
            samples: s,
            workspace_bytes: bytes,
            pairs,
        })
    } else {
        None
    };
    if o.breakdown {
        let io = Io {
            q: &d_q,
            k: &d_k,
            v: &d_v,
            grad_out: &d_dout,
            lse: &d_lse,
            out: &d_out,
        };
        breakdown(stream, &io, &schedule, case, o, flush.as_mut())?;
    }
    let min_ms = samples.iter().copied().fold(f32::INFINITY, f32::min);

    // The device schedule build, sized from T, the document count and W alone; it covers
    // T <= MAX_BUILD_TOKENS (longer inputs take the host schedule only).
    let device = if o.device_schedule && t <= MAX_BUILD_TOKENS {
        let mut backend = CudaBackend::new(stream)?;
        let sizes = ScheduleBuildSizes::new(t, case.cu.len() - 1, w, 64)?;
        let mut resident = ResidentSchedule::new(&mut backend, sizes)?;
        let d_q2k = stream.clone_htod(&case.q2k)?;
        let d_cu = stream.clone_htod(&case.cu)?;
        let q2k_span = Span::new(d_q2k.device_ptr(stream).0, case.q2k.len());
        let cu_span = Span::new(d_cu.device_ptr(stream).0, case.cu.len());
        resident.build(&mut backend, q2k_span, cu_span)?;
        resident.status(&mut backend)?;
        if resident.read_tables(&mut backend)?.to_schedule()? != schedule {
            return Err(format!(
                "{}: the device schedule differs from build_schedule",
                case.name
            )
            .into());
        }
        // Warm-up calls run the same body (the backward's cached workspaces adapt to the
        // resident schedule's capacities there, not in a timed call).
        let mut timed = |with_backward: bool| -> Res<Vec<f32>> {
            let mut samples = Samples::new(o.sync_each);
            for i in 0..o.warmup + o.reps {
                if let Some(buf) = flush.as_mut() {
                    stream.memset_zeros(buf)?;
                }
                let start = stream.record_event(timing)?;
                resident.build(&mut backend, q2k_span, cu_span)?;
                let grads = if with_backward {
                    Some(run_backward(
                        stream,
                        &d_q.as_view(),
                        &d_k.as_view(),
                        &d_v.as_view(),
                        &d_dout.as_view(),
                        &d_lse.as_view(),
                        &d_out.as_view(),
                        &resident,
                    )?)
                } else {
                    None
                };
                let end = stream.record_event(timing)?;
                if i >= o.warmup {
                    samples.push((start, end))?;
                }
                drop(grads);
            }
            samples.finish(stream)
        };
        let sched = timed(false)?;
        let device_path = timed(true)?;
        resident.status(&mut backend)?;
        Some(DeviceTiming {
            sched_median_ms: median(sched.clone()),
            sched_min_ms: sched.iter().copied().fold(f32::INFINITY, f32::min),
            device_path_median_ms: median(device_path),
        })
    } else {
        None
    };
    Ok(Timing {
        tokens: t,
        workspace_rows: w,
        work_items: schedule.num_work(),
        tasks,
        median_ms: median(samples.clone()),
        min_ms,
        samples,
        device,
        io_bytes: 2 * (4 * q_len + 4 * w * NUM_KV_HEADS * HEAD_DIM) + 4 * t * NUM_Q_HEADS,
        workspace_bytes,
        sweep,
        det,
    })
}

/// The backward's inputs on the device.
struct Io<'a> {
    q: &'a CudaSlice<bf16>,
    k: &'a CudaSlice<bf16>,
    v: &'a CudaSlice<bf16>,
    grad_out: &'a CudaSlice<bf16>,
    lse: &'a CudaSlice<f32>,
    out: &'a CudaSlice<bf16>,
}

/// One call's operations through a [`TimedBackend`]: name, start (ms after the first
/// operation of the batch), duration (ms).
type Op<'a> = (&'a str, f32, f32);

/// `--breakdown`: `reps` calls of each path through a [`TimedBackend`] after one warm-up,
/// pipelined as the timed calls are; prints each operation's median ms in issue order, the
/// sum of the medians and the median idle time of the stream inside a call.
fn breakdown(
    stream: &Arc<CudaStream>,
    io: &Io<'_>,
    schedule: &msa_runtime::Schedule,
    case: &Case,
    o: &Options,
    mut flush: Option<&mut CudaSlice<u8>>,
) -> Res<()> {
    let span = |s: &CudaSlice<bf16>| Span::new(s.device_ptr(stream).0, s.len());
    let (dq, dk, dv) = (
        stream.alloc_zeros::<bf16>(io.q.len())?,
        stream.alloc_zeros::<bf16>(io.k.len())?,
        stream.alloc_zeros::<bf16>(io.v.len())?,
    );
    let buffers = BackwardBuffers {
        q: span(io.q),
        k_aligned: span(io.k),
        v_aligned: span(io.v),
        grad_out: span(io.grad_out),
        lse: Span::new(io.lse.device_ptr(stream).0, io.lse.len()),
        out: span(io.out),
        dq: span(&dq),
        dk_aligned: span(&dk),
        dv_aligned: span(&dv),
    };
    let mut backend = TimedBackend::new(CudaBackend::new(stream)?);
    let mut backward = MsaBackward::<TimedBackend>::new();
    backward.set_locality(o.localities[0]);
    let (t, w) = (schedule.num_tokens(), schedule.workspace_rows());
    let mut resident = if o.device_schedule && t <= MAX_BUILD_TOKENS {
        let sizes = ScheduleBuildSizes::new(t, case.cu.len() - 1, w, 64)?;
        let r = ResidentSchedule::new(&mut backend, sizes)?;
        let q2k = stream.clone_htod(&case.q2k)?;
        let cu = stream.clone_htod(&case.cu)?;
        Some((r, q2k, cu))
    } else {
        None
    };
    for device_path in [false, true] {
        if device_path && resident.is_none() {
            break;
        }
        for i in 0..=o.reps {
            if i == 1 {
                // The first call warms the workspaces up; the others are the samples.
                stream.synchronize()?;
                backend.clear();
            }
            if let Some(buf) = flush.as_deref_mut() {
                stream.memset_zeros(buf)?;
            }
            match resident.as_mut().filter(|_| device_path) {
                None => backward.run_on(&mut backend, &buffers, schedule)?,
                Some((r, q2k, cu)) => {
                    let q2k = Span::new(q2k.device_ptr(stream).0, q2k.len());
                    let cu = Span::new(cu.device_ptr(stream).0, cu.len());
                    r.build(&mut backend, q2k, cu)?;
                    backward.run_on(&mut backend, &buffers, &*r)?;
                }
            }
        }
        let ops = backend.take()?;
        if ops.is_empty() || ops.len() % o.reps != 0 {
            return Err(format!("breakdown: {} operations in {} calls", ops.len(), o.reps).into());
        }
        let calls: Vec<&[Op<'_>]> = ops.chunks_exact(ops.len() / o.reps).collect();
        let med = |f: &dyn Fn(&[Op<'_>]) -> f32| median(calls.iter().map(|c| f(c)).collect());
        let mut line = format!(
            "  breakdown ({} schedule, median of {}):",
            if device_path { "device" } else { "host" },
            o.reps
        );
        let mut sum = 0.0;
        for k in 0..calls[0].len() {
            let ms = med(&|c| c[k].2);
            sum += ms;
            let _ = write!(line, " {} {ms:.3};", calls[0][k].0);
        }
        // A call's span: its first operation's start to its last one's end.
        let span_of = |c: &[Op<'_>]| c[c.len() - 1].1 + c[c.len() - 1].2 - c[0].1;
        let span_ms = med(&|c| span_of(c));
        let idle = med(&|c| span_of(c) - c.iter().map(|x| x.2).sum::<f32>());
        println!("{line} sum {sum:.3}; span {span_ms:.3}, idle inside it {idle:.3}");
    }
    Ok(())
}

/// The events before and after one timed call.
type Pair = (CudaEvent, CudaEvent);

/// The timed calls' event pairs. By default the host does not wait between calls, as
/// `bench/baselines.py` times the baselines (events recorded around each call, one
/// synchronize after the last): host enqueue time then overlaps the GPU's work of the calls
/// before, as in a training step. `--sync-each` reads each pair right after its call instead
/// (the host waits for the GPU once per call; the stream-ordered memory pool trims its free
/// memory at that wait, so the next call's output allocation maps it again).
struct Samples {
    sync_each: bool,
    pending: Vec<Pair>,
    ms: Vec<f32>,
}

impl Samples {
    fn new(sync_each: bool) -> Self {
        Samples {
            sync_each,
            pending: Vec::new(),
            ms: Vec::new(),
        }
    }

    fn push(&mut self, (start, end): Pair) -> Res<()> {
        if self.sync_each {
            self.ms.push(start.elapsed_ms(&end)?);
        } else {
            self.pending.push((start, end));
        }
        Ok(())
    }

    /// Every sample in ms, in call order, after one synchronize of `stream`.
    fn finish(mut self, stream: &Arc<CudaStream>) -> Res<Vec<f32>> {
        stream.synchronize()?;
        for (start, end) in &self.pending {
            self.ms.push(start.elapsed_ms(end)?);
        }
        Ok(self.ms)
    }
}

/// A JSON number, or `null`.
fn opt(v: Option<f32>) -> String {
    v.map_or("null".to_string(), |x| format!("{x:.4}"))
}

/// Compares `n` random dq rows and `max(1, n/100)` random key blocks of dk/dv (each with its
/// kv head) with the exact sampled references of `msa_runtime::reference::sampled`, at the
/// seed tolerances over the sampled values. Prints one line per tensor; an error on a miss.
fn check_sampled(
    stream: &Arc<CudaStream>,
    x: &sampled::Inputs,
    grads: &msa_runtime::Gradients,
    n: usize,
    seed: u64,
) -> Res<()> {
    let t = *x.cu_seqlens.last().unwrap_or(&0) as usize;
    let docs = x.cu_seqlens.len() - 1;
    let pick = |i: u64, m: usize| (rand(seed ^ 0x5eed, i) % m as u64) as usize;
    let rows: Vec<(usize, usize)> = (0..n as u64)
        .map(|i| (pick(2 * i, t), pick(2 * i + 1, NUM_Q_HEADS)))
        .collect();
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for &(tok, h) in &rows {
        let at = (tok * NUM_Q_HEADS + h) * HEAD_DIM;
        let dev = stream.clone_dtoh(&grads.dq.slice(at..at + HEAD_DIM))?;
        got.extend(dev.iter().map(|v| v.to_f32()));
        want.extend(sampled::dq_row(x, tok, h));
    }
    let stats = DQ_TOLERANCE.check("dq (sampled rows)", &got, &want)?;
    println!("  check: {} dq rows: {stats}", rows.len());

    let blocks: Vec<(usize, usize, usize)> = (0..n.div_ceil(100).max(1) as u64)
        .map(|i| {
            let d = pick(3 * i + 1_000_000, docs);
            let len = (x.cu_seqlens[d + 1] - x.cu_seqlens[d]) as usize;
            let kb = pick(3 * i + 1_000_001, len.div_ceil(BLOCK_SIZE).max(1));
            (pick(3 * i + 1_000_002, NUM_KV_HEADS), d, kb)
        })
        .collect();
    let refs: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let jobs: Vec<_> = blocks
            .iter()
            .map(|&(g, d, kb)| s.spawn(move || sampled::dk_dv_block(x, g, d, kb)))
            .collect();
        jobs.into_iter()
            .map(|j| j.join().expect("reference thread"))
            .collect()
    });
    let (mut gk, mut wk, mut gv, mut wv) = (vec![], vec![], vec![], vec![]);
    for (&(g, d, kb), (rk, rv)) in blocks.iter().zip(refs) {
        let row0 = x.ws_starts[d] as usize + kb * BLOCK_SIZE;
        for j in 0..BLOCK_SIZE {
            let at = ((row0 + j) * NUM_KV_HEADS + g) * HEAD_DIM;
            let dk = stream.clone_dtoh(&grads.dk_aligned.slice(at..at + HEAD_DIM))?;
            let dv = stream.clone_dtoh(&grads.dv_aligned.slice(at..at + HEAD_DIM))?;
            gk.extend(dk.iter().map(|v| v.to_f32()));
            gv.extend(dv.iter().map(|v| v.to_f32()));
            wk.extend_from_slice(&rk[j * HEAD_DIM..][..HEAD_DIM]);
            wv.extend_from_slice(&rv[j * HEAD_DIM..][..HEAD_DIM]);
        }
    }
    let sk = DK_TOLERANCE.check("dk (sampled blocks)", &gk, &wk)?;
    let sv = DV_TOLERANCE.check("dv (sampled blocks)", &gv, &wv)?;
    println!(
        "  check: {} key blocks {blocks:?}: dk {sk}; dv {sv}",
        blocks.len()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Output

fn json_case(case: &Case, tm: Option<&Timing>, o: &Options) -> String {
    let mut s = String::new();
    let docs: Vec<String> = case.docs.iter().map(i32::to_string).collect();
    let cu: Vec<String> = case.cu.iter().map(i32::to_string).collect();
    let flop = useful_flop(case.keys);
    let _ = write!(
        s,
        "{{\"name\": \"{}\", \"tokens\": {}, \"documents\": {}, \"doc_lengths\": [{}], \
         \"cu_seqlens\": [{}], \"seed\": {}, \"topk\": {}, \"q2k_checksum\": \"{:016x}\", \
         \"keys_attended\": {}, \"useful_flop\": {:.6e}",
        case.name,
        case.cu[case.cu.len() - 1],
        case.docs.len(),
        docs.join(", "),
        cu.join(", "),
        o.seed,
        case.topk,
        case.checksum,
        case.keys,
        flop
    );
    if let Some(tm) = tm {
        let samples: Vec<String> = tm.samples.iter().map(|x| format!("{x:.4}")).collect();
        let tile_flop = tm.tasks as f64 * TILE_FLOP;
        let useful = flop / (f64::from(tm.median_ms) * 1e-3) / 1e12;
        let _ = write!(
            s,
            ", \"workspace_rows\": {}, \"work_items\": {}, \"tile_tasks\": {}, \
             \"tile_flop\": {:.6e}, \"ms_median\": {:.4}, \"ms_min\": {:.4}, \
             \"useful_tflops\": {:.2}, \"tile_tflops\": {:.2}, \"fraction_of_ceiling\": {}, \
             \"samples_ms\": [{}], \"device_schedule_ms_median\": {}, \
             \"device_schedule_ms_min\": {}, \"device_path_ms_median\": {}",
            tm.workspace_rows,
            tm.work_items,
            tm.tasks,
            tile_flop,
            tm.median_ms,
            tm.min_ms,
            useful,
            tile_flop / (f64::from(tm.median_ms) * 1e-3) / 1e12,
            o.ceiling
                .map_or("null".to_string(), |c| format!("{:.4}", useful / c)),
            samples.join(", "),
            opt(tm.device.as_ref().map(|d| d.sched_median_ms)),
            opt(tm.device.as_ref().map(|d| d.sched_min_ms)),
            opt(tm.device.as_ref().map(|d| d.device_path_median_ms)),
        );
        let l = o.localities[0];
        let sweep: Vec<String> = tm
            .sweep
            .iter()
            .map(|st| {
                let samples: Vec<String> = st.samples.iter().map(|x| format!("{x:.4}")).collect();
                format!(
                    "{{\"min_window_log2\": {}, \"blocks_log2\": {}, \"ms_median\": {:.4}, \
                     \"ms_min\": {:.4}, \"useful_tflops\": {:.2}, \"samples_ms\": [{}]}}",
                    st.locality.min_window_log2,
                    st.locality.blocks_log2,
                    st.median_ms,
                    st.min_ms,
                    flop / (f64::from(st.median_ms) * 1e-3) / 1e12,
                    samples.join(", ")
                )
            })
            .collect();
        let _ = write!(
            s,
            ", \"locality\": {{\"min_window_log2\": {}, \"blocks_log2\": {}}}, \
             \"io_bytes\": {}, \"workspace_bytes\": {}, \"locality_sweep\": [{}]",
            l.min_window_log2,
            l.blocks_log2,
            tm.io_bytes,
            tm.workspace_bytes,
            sweep.join(", ")
        );
        if let Some(d) = &tm.det {
            let samples: Vec<String> = d.samples.iter().map(|x| format!("{x:.4}")).collect();
            let _ = write!(
                s,
                ", \"deterministic\": {{\"ms_median\": {:.4}, \"ms_min\": {:.4}, \
                 \"ratio_to_default\": {:.4}, \"workspace_bytes\": {}, \"samples_ms\": [{}], \
                 \"interleaved\": {{\"default_ms_median\": {:.4}, \"ms_median\": {:.4}, \
                 \"ratio\": {:.4}, \"pairs_ms\": [{}]}}}}",
                d.median_ms,
                d.min_ms,
                d.median_ms / tm.median_ms,
                d.workspace_bytes,
                samples.join(", "),
                d.paired().0,
                d.paired().1,
                d.paired().2,
                d.pairs
                    .iter()
                    .map(|p| format!("[{:.4}, {:.4}]", p[0], p[1]))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    s.push('}');
    s
}

fn write_json(o: &Options, device: &str, entries: &[String]) -> Res<()> {
    let Some(path) = &o.json else { return Ok(()) };
    let ceiling = o.ceiling.map_or("null".to_string(), |c| format!("{c:.2}"));
    let text = format!(
        "{{\n\"method\": \"msa_runtime::run_backward\",\n\"device\": {},\n\"reps\": {},\n\
         \"warmup\": {},\n\"l2_flush\": {},\n\"sync_each\": {},\n\"matmul_ceiling_tflops\": {ceiling},\n\
         \"cases\": [\n{}\n]\n}}\n",
        json_str(device),
        o.reps,
        o.warmup,
        o.flush,
        o.sync_each,
        entries.join(",\n")
    );
    std::fs::write(path, text).map_err(|e| format!("{path}: {e}"))?;
    println!("wrote {path}");
    Ok(())
}

fn run(o: &Options) -> Res<()> {
    let cases: Vec<Case> = o.cases.iter().map(|n| make_case(n, o.seed)).collect();
    if let Some(dir) = &o.inputs {
        for c in &cases {
            compare_inputs(dir, c)?;
        }
        println!("inputs: q2k and cu_seqlens identical to the files in {dir}");
    }
    if let Some(dir) = &o.write_inputs {
        std::fs::create_dir_all(dir).map_err(|e| format!("{dir}: {e}"))?;
        for c in &cases {
            for (ext, v) in [("q2k", &c.q2k), ("cu_seqlens", &c.cu)] {
                let path = format!("{dir}/{}.{ext}.i32", c.name);
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                std::fs::write(&path, bytes).map_err(|e| format!("{path}: {e}"))?;
            }
        }
        println!(
            "inputs: wrote q2k and cu_seqlens of {} case(s) to {dir}",
            cases.len()
        );
    }
    if o.inputs_only {
        for c in &cases {
            let schedule = build_schedule(&c.q2k, &c.cu, 64)?;
            let tasks: usize = schedule
                .work_items()
                .map(|it| it.q_count.div_ceil(QUERY_CHUNK))
                .sum();
            println!(
                "{:16} T={:6} docs={:2} topk={:2} keys={:12} tasks={:8} useful_flop={:.4e} \
                 checksum={:016x}",
                c.name,
                c.cu[c.cu.len() - 1],
                c.docs.len(),
                c.topk,
                c.keys,
                tasks,
                useful_flop(c.keys),
                c.checksum
            );
        }
        let entries: Vec<String> = cases.iter().map(|c| json_case(c, None, o)).collect();
        return write_json(o, "none (--inputs-only)", &entries);
    }

    if !driver_present() {
        println!("no CUDA driver (libcuda.so) on this machine; nothing to time");
        return Ok(());
    }
    let device = match Device::open(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no usable GPU ({e}); nothing to time");
            return Ok(());
        }
    };
    let (major, minor) = device.capability();
    let name = device.context().name().unwrap_or_else(|_| "?".into());
    let device_desc = format!(
        "{name} (compute capability {major}.{minor}, {} SMs)",
        device.sm_count()
    );
    println!("device 0: {device_desc}");
    let stream = device.context().default_stream();

    println!(
        "{:<10} {:>6} {:>4} {:>10} {:>10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>9} {:>7}",
        "case",
        "T",
        "docs",
        "tasks",
        "keys",
        "ms_med",
        "ms_min",
        "useful",
        "tile",
        "frac",
        "sched_ms",
        "dev_ms",
        "sched%"
    );
    let mut entries = Vec::new();
    let mut failed = 0usize;
    for c in &cases {
        let tm = match time_case(&stream, c, o, o.seed) {
            Ok(tm) => tm,
            Err(e) => {
                eprintln!("{}: error: {e}", c.name);
                failed += 1;
                let mut entry = json_case(c, None, o);
                entry.pop();
                entry.push_str(&format!(", \"error\": {}}}", json_str(&e.to_string())));
                entries.push(entry);
                write_json(o, &device_desc, &entries)?;
                continue;
            }
        };
        let useful = useful_flop(c.keys) / (f64::from(tm.median_ms) * 1e-3) / 1e12;
        let tile = tm.tasks as f64 * TILE_FLOP / (f64::from(tm.median_ms) * 1e-3) / 1e12;
        let (sched, dev, share) = match &tm.device {
            Some(d) => (
                format!("{:.4}", d.sched_median_ms),
                format!("{:.3}", d.device_path_median_ms),
                format!("{:.2}%", 100.0 * d.sched_median_ms / tm.median_ms),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "{:<10} {:>6} {:>4} {:>10} {:>10} {:>9.3} {:>9.3} {:>8.1} {:>8.1} {:>8} {:>9} {:>9} \
             {:>7}",
            c.name,
            tm.tokens,
            c.docs.len(),
            tm.tasks,
            c.keys,
            tm.median_ms,
            tm.min_ms,
            useful,
            tile,
            o.ceiling
                .map_or("-".to_string(), |x| format!("{:.3}", useful / x)),
            sched,
            dev,
            share
        );
        let gib = |b: usize| b as f64 / f64::from(1u32 << 30);
        println!(
            "  locality {},{}; inputs + outputs {:.2} GiB, workspace {:.2} GiB ({:.1} %)",
            o.localities[0].min_window_log2,
            o.localities[0].blocks_log2,
            gib(tm.io_bytes),
            gib(tm.workspace_bytes),
            100.0 * tm.workspace_bytes as f64 / tm.io_bytes as f64
        );
        if let Some(d) = &tm.det {
            println!(
                "  deterministic: ms_med {:.3} ms_min {:.3} useful {:.1}, {:.3}x the default \
                 median; workspace {:.2} GiB; two calls bitwise equal",
                d.median_ms,
                d.min_ms,
                useful_flop(c.keys) / (f64::from(d.median_ms) * 1e-3) / 1e12,
                d.median_ms / tm.median_ms,
                gib(d.workspace_bytes)
            );
            let (pd, px, ratio) = d.paired();
            println!(
                "  deterministic, interleaved with default calls: default ms_med {pd:.3}, \
                 deterministic ms_med {px:.3}, {ratio:.3}x"
            );
        }
        for st in &tm.sweep {
            println!(
                "  locality {},{}: ms_med {:.3} ms_min {:.3} useful {:.1}",
                st.locality.min_window_log2,
                st.locality.blocks_log2,
                st.median_ms,
                st.min_ms,
                useful_flop(c.keys) / (f64::from(st.median_ms) * 1e-3) / 1e12
            );
        }
        entries.push(json_case(c, Some(&tm), o));
        // after every case, so a run cut short keeps what it finished
        write_json(o, &device_desc, &entries)?;
    }
    println!(
        "ms: median / min of {} run_backward calls after {} warm-up{}; useful and tile in TFLOP/s; \
         frac = useful / matmul ceiling; sched_ms: median device schedule build; dev_ms: median \
         build + run_backward on it; sched% = sched_ms / ms_med{}",
        o.reps,
        o.warmup,
        if o.flush { ", L2 flushed before each" } else { "" },
        if o.sync_each {
            "; each call's events read right after it (--sync-each)"
        } else {
            "; events read after the last call (no host wait between calls)"
        }
    );
    if failed > 0 {
        return Err(format!("{failed} case(s) failed").into());
    }
    Ok(())
}

/// A JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn main() -> ExitCode {
    let options = match parse_args() {
        Ok(o) => o,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
