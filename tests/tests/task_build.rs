//! The device task build: sizing on the CPU, and on the GPU exact agreement of the device
//! tables with the CPU oracle (`reference::tasks`), plus the mirrored CTA-walk rule.

use codegen::kernels::{common, task_build as tb};
use codegen::ptx::*;
use codegen::Target;
use msa_runtime::contract::Locality;
use msa_runtime::reference::tasks::{build_task_tables_with, task_capacity, TaskTables};
use msa_runtime::tasks::{DeviceSchedule, TaskBuildSizes, TaskWorkspace};
use msa_runtime::CudaBackend;
use msa_runtime::{
    build_schedule, causal_support, chunk_map, contract, rows_per_cta, Device, RuntimeError,
    Schedule,
};
use msa_tests::{gpu_stream, Rng};
use std::sync::Arc;

fn docs(lengths: &[i32]) -> Vec<i32> {
    let mut cu = vec![0];
    for l in lengths {
        cu.push(cu.last().unwrap() + l);
    }
    cu
}

fn causal(lengths: &[i32], qpw: usize) -> Schedule {
    let cu = docs(lengths);
    build_schedule(&causal_support(&cu).unwrap(), &cu, qpw).unwrap()
}

/// The same schedule with other metadata rows or work count.
fn with(s: &Schedule, metadata: Vec<i32>, work_count: i32) -> Schedule {
    Schedule::new(
        s.row_ptr().to_vec(),
        s.q_indices().to_vec(),
        metadata,
        work_count,
        s.cu_seqlens().to_vec(),
        s.document_workspace_starts().to_vec(),
    )
    .unwrap()
}

#[test]
fn codegen_mirrors_the_host_contract_constants() {
    assert_eq!(
        tb::ROWS_PER_CTA_SWITCH as usize,
        contract::ROWS_PER_CTA_SWITCH
    );
    assert_eq!(
        tb::ROWS_PER_CTA_SMALL as usize,
        contract::ROWS_PER_CTA_SMALL
    );
    assert_eq!(
        tb::ROWS_PER_CTA_LARGE as usize,
        contract::ROWS_PER_CTA_LARGE
    );
    assert_eq!(tb::QUERY_CHUNK as usize, contract::QUERY_CHUNK);
    assert_eq!(tb::BIN_CHUNK as usize, msa_runtime::tasks::BIN_CHUNK);
    use msa_runtime::reference::tasks as oracle;
    assert_eq!(
        tb::FLAG_CAPACITY_OVERFLOW as i32,
        oracle::FLAG_CAPACITY_OVERFLOW
    );
    assert_eq!(
        tb::FLAG_NONCONTIGUOUS_SEGMENTS as i32,
        oracle::FLAG_NONCONTIGUOUS_SEGMENTS
    );
    assert_eq!(
        tb::FLAG_CAPACITY_OVERFLOW as i32,
        msa_runtime::tasks::FLAG_CAPACITY_OVERFLOW
    );
}

#[test]
fn sizes_follow_the_design_formulas() {
    let s = causal(&[127, 129, 1, 2, 3, 5, 128], 64);
    let z = TaskBuildSizes::new(&s, 8).unwrap();
    let (t, w) = (s.num_tokens(), s.workspace_rows());
    assert_eq!((t, w), (395, 1024));
    assert_eq!(z.capacity, 4 * s.edge_capacity() / 8 + s.work_capacity());
    // One head's bins: ceil(T/32) + ceil(T/128) + docs = 13 + 4 + 7 (the default rule's
    // 2^blocks_log2 = 32 queries per key block).
    assert_eq!(z.num_docs, 7);
    assert_eq!(z.bins_per_head, 13 + 4 + 7);
    assert_eq!(z.bins, 4 * z.bins_per_head);
    assert!(
        z.bins_per_head
            >= (0..7)
                .map(|d| {
                    let len = (s.cu_seqlens()[d + 1] - s.cu_seqlens()[d]) as usize;
                    z.locality.document_bins(len)
                })
                .sum::<usize>()
    );
    assert_eq!(
        z.scratch_words,
        8 + s.work_capacity()
            + z.capacity
            + 4 * z.bins
            + z.bins.div_ceil(8192)
            + 2 * 7
            + 1
            + 4 * z.capacity
    );
    assert_eq!(z.table_words, 20 * z.capacity);
    assert_eq!(z.grid_launch, contract::grid_launch_bound(z.capacity, 8));
    assert!(matches!(
        TaskBuildSizes::new(&s, 0),
        Err(RuntimeError::Input {
            field: "num_sms",
            ..
        })
    ));
}

#[test]
fn locality_bins_grow_linearly_up_to_a_million_tokens() {
    // One document of 2^20 tokens and no edges: the seed's bins were 4·2048·8192 = 2^26 (past
    // its 2^22 limit); ours are 4·(2^20/32 + 2^13 + 1).
    let t = 1 << 20;
    let rows = (t as usize).div_ceil(128);
    let s = Schedule::new(
        vec![0; 4 * (rows + 1)],
        vec![-1; 4],
        vec![0; 6],
        0,
        vec![0, t],
        vec![0],
    )
    .unwrap();
    let z = TaskBuildSizes::new(&s, 132).unwrap();
    assert_eq!(z.bins, 4 * ((1 << 15) + (1 << 13) + 1));
    // The document's exact bins: windows of 2^18 queries (32·8192 blocks), 4 of them.
    assert_eq!(z.locality.document_bins(t as usize), 4 * 8192);
    let bad = contract::Locality::uncapped(13, 8);
    match TaskBuildSizes::with_locality(&s, 132, bad) {
        Err(RuntimeError::Input {
            field,
            found,
            expected,
        }) => {
            assert_eq!(field, "locality");
            assert!(found.contains("blocks_log2: 8"), "{found}");
            assert!(expected.contains("above 7"), "{expected}");
        }
        other => panic!("expected an input error, got {other:?}"),
    }
}

fn expected_desc(tables: &TaskTables, schedule: &Schedule, sms: usize) -> [i32; 8] {
    let n = tables.num_rows();
    let r = rows_per_cta(n);
    let (full, tail, grid) = chunk_map(n, r, sms);
    let total: usize = schedule.work_items().map(|w| w.q_count.div_ceil(8)).sum();
    [
        n as i32,
        r as i32,
        full as i32,
        tail as i32,
        grid as i32,
        schedule.num_work() as i32,
        total as i32,
        tables.desc[7],
    ]
}

/// Builds the tables on the device and compares them with the oracle exactly.
fn check_device_build(
    stream: &Arc<cudarc::driver::CudaStream>,
    label: &str,
    schedule: &Schedule,
    sms: usize,
    capacity: Option<usize>,
) -> [i32; 8] {
    check_device_build_with(stream, label, schedule, sms, capacity, Locality::default())
}

/// [`check_device_build`] under another locality rule.
fn check_device_build_with(
    stream: &Arc<cudarc::driver::CudaStream>,
    label: &str,
    schedule: &Schedule,
    sms: usize,
    capacity: Option<usize>,
    locality: Locality,
) -> [i32; 8] {
    let mut sizes = TaskBuildSizes::with_locality(schedule, sms, locality).unwrap();
    if let Some(cap) = capacity {
        sizes.capacity = cap;
    }
    let cap = capacity.unwrap_or_else(|| task_capacity(schedule));
    let expected = build_task_tables_with(schedule, sms, cap, locality);
    assert_eq!(
        expected.desc,
        expected_desc(&expected, schedule, sms),
        "{label}: oracle descriptor"
    );
    let mut backend = CudaBackend::new(stream).unwrap();
    let dev_schedule = DeviceSchedule::upload(&mut backend, schedule).unwrap();
    let mut ws = TaskWorkspace::new(&mut backend, sizes, schedule.work_capacity()).unwrap();
    ws.build(&mut backend, &dev_schedule).unwrap();
    let flags = ws.read_flags(&backend).unwrap();
    let got = ws.read_tables(&mut backend).unwrap();
    assert_eq!(
        flags.wait().unwrap(),
        expected.desc[7],
        "{label}: flags readback"
    );
    assert_eq!(got.desc, expected.desc, "{label}: descriptor");
    assert!(
        sizes.grid_launch >= got.desc[4] as usize,
        "{label}: grid bound"
    );
    for (name, g, e, w) in [
        ("task_meta", &got.meta, &expected.meta, 4),
        ("task_qrows", &got.qrows, &expected.qrows, 8),
        ("task_qpos", &got.qpos, &expected.qpos, 8),
    ] {
        if let Some(i) = (0..g.len().max(e.len())).find(|&i| g.get(i) != e.get(i)) {
            let row = i / w;
            panic!(
                "{label}: {name} differs first at row {row}: device {:?}, oracle {:?}",
                g.get(row * w..(row + 1) * w),
                e.get(row * w..(row + 1) * w)
            );
        }
    }
    println!(
        "{label}: sms {sms}: {} rows, desc {:?} — exact",
        got.desc[0], got.desc
    );
    got.desc
}

#[test]
fn device_tables_equal_the_oracle_on_documents() {
    let Some(stream) = gpu_stream() else { return };
    let real_sms = Device::of(stream.context()).unwrap().sm_count();
    for (label, lengths) in [
        (
            "docs (127,129,1,2,3,5,128)",
            &[127, 129, 1, 2, 3, 5, 128][..],
        ),
        ("doc (4093)", &[4093][..]),
    ] {
        for qpw in [16, 64] {
            let s = causal(lengths, qpw);
            for sms in [8, real_sms] {
                let d = check_device_build(&stream, &format!("{label} qpw {qpw}"), &s, sms, None);
                assert_eq!(d[7], 0, "{label}: flags");
            }
        }
    }
    // A random top-16 over several documents, own block forced.
    let cu = docs(&[3000, 1, 700, 2500]);
    let t = *cu.last().unwrap() as usize;
    let mut rng = Rng::new(20260906);
    let mut q2k = vec![-1i32; 4 * t * 16];
    for d in 0..cu.len() - 1 {
        for tok in cu[d] as usize..cu[d + 1] as usize {
            let own = (tok - cu[d] as usize) / 128;
            for g in 0..4 {
                let mut chosen = vec![own as i32];
                let mut cand: Vec<i32> = (0..own as i32).collect();
                while chosen.len() < 16 && !cand.is_empty() {
                    let k = (rng.next_u64() % cand.len() as u64) as usize;
                    chosen.push(cand.swap_remove(k));
                }
                q2k[(g * t + tok) * 16..][..chosen.len()].copy_from_slice(&chosen);
            }
        }
    }
    let s = build_schedule(&q2k, &cu, 32).unwrap();
    check_device_build(&stream, "random top-16", &s, real_sms, None);
    // Windows smaller than these documents: several per document, per-document bin bases.
    // Capped rules: windows under one query per block of the document (the KV forward's
    // L2-sized windows), many bins per task.
    let capped = [(0, 2, 5), (3, 0, 3), (7, 2, 7)].map(|(a, b, c)| Locality::capped(a, b, c));
    let rules = [(9, 0), (7, 0), (0, 0), (0, 2)].map(|(a, b)| Locality::uncapped(a, b));
    for rule in rules.into_iter().chain(capped) {
        check_device_build_with(
            &stream,
            &format!("random top-16, {rule:?}"),
            &s,
            real_sms,
            None,
            rule,
        );
    }
}

#[test]
fn device_handles_truncated_work_counts() {
    let Some(stream) = gpu_stream() else { return };
    let s = causal(&[4096], 16);
    let cap = s.work_capacity();
    let d = check_device_build(
        &stream,
        "work_capacity+7",
        &with(&s, s.scheduler_metadata().to_vec(), cap as i32 + 7),
        132,
        None,
    );
    assert_eq!(d[5] as usize, cap, "clamped");
    let d = check_device_build(
        &stream,
        "work_count 0",
        &with(&s, s.scheduler_metadata().to_vec(), 0),
        132,
        None,
    );
    assert_eq!(d[..2], [0, 4]);
    // The counts whose task rows straddle the 2400-row switch.
    let mut rows = 0;
    let mut below = 0;
    for (w, item) in s.work_items().enumerate() {
        rows += item.q_count.div_ceil(8);
        if rows <= 2400 {
            below = w + 1;
        }
    }
    let d = check_device_build(
        &stream,
        "just below the switch",
        &with(&s, s.scheduler_metadata().to_vec(), below as i32),
        132,
        None,
    );
    assert!(d[0] <= 2400 && d[1] == 4, "{d:?}");
    let d = check_device_build(
        &stream,
        "just above the switch",
        &with(&s, s.scheduler_metadata().to_vec(), below as i32 + 1),
        132,
        None,
    );
    assert!(d[0] > 2400 && d[1] == 64, "{d:?}");
}

#[test]
fn device_flags_overflow_and_split_buckets() {
    let Some(stream) = gpu_stream() else { return };
    let s = causal(&[127, 129, 1, 2, 3, 5, 128], 16);
    let total: usize = s.work_items().map(|w| w.q_count.div_ceil(8)).sum();
    let d = check_device_build(&stream, "forced overflow", &s, 8, Some(total - 1));
    assert_eq!((d[0], d[7] & 1), (0, 1));

    // Move the last work item to the front: the last bucket's tasks no longer form one run
    // (it has several items), so the tables stay in source order.
    let s = causal(&[1024], 8);
    let n = s.num_work();
    let md = s.scheduler_metadata();
    let mut permuted = md[(n - 1) * 6..n * 6].to_vec();
    permuted.extend_from_slice(&md[..(n - 1) * 6]);
    permuted.extend_from_slice(&md[n * 6..]);
    let d = check_device_build(
        &stream,
        "split bucket",
        &with(&s, permuted, n as i32),
        8,
        None,
    );
    assert_eq!(d[7], 2);
}

/// A probe kernel that evaluates the device walk rule (`common::chunk_map`, `rows_per_cta`)
/// for a list of row counts, JIT-compiled from the same description scatter_tables uses.
fn walk_probe(target: Target) -> String {
    let mut b = KernelBuilder::new("walk_probe", target, (256, 1, 1));
    let ns_p = b.param_ptr("ns", HostElem::U32, false);
    let out_p = b.param_ptr("out", HostElem::U32, true);
    let count_p = b.param_u32("count");
    let sms_p = b.param_u32("num_sms");
    let tid = b.sreg(SReg::TidX);
    let cta = b.sreg(SReg::CtaidX);
    let i = b.mad_lo(cta, 256u32, tid);
    let count = b.ld_param(&count_p);
    let live = b.setp(Cmp::Lt, i, count);
    b.if_then(live, "done", |b| {
        let ns = b.ld_param_ptr(&ns_p);
        let out = b.ld_param_ptr(&out_p);
        let sms = b.ld_param(&sms_p);
        let n = common::load_u32(b, ns, i);
        let r = common::rows_per_cta(
            b,
            n,
            tb::ROWS_PER_CTA_SWITCH,
            tb::ROWS_PER_CTA_SMALL,
            tb::ROWS_PER_CTA_LARGE,
        );
        let (full, tail, grid) = common::chunk_map(b, n, r, sms);
        let a = common::elem_bytes(b, out, i, 16);
        b.st_v(&a, [r, full, tail, grid]);
    });
    b.ret();
    codegen::ptx::print::module(&b.finish().unwrap()).unwrap()
}

#[test]
fn device_walk_rule_agrees_with_the_host_rule() {
    let Some(stream) = gpu_stream() else { return };
    let dev = Device::of(stream.context()).unwrap();
    let target = match dev.capability() {
        (9, 0) => Target::Sm90a,
        (10, 0) => Target::Sm100a,
        cc => panic!("no target for {cc:?}"),
    };
    let ptx = walk_probe(target);
    let f = dev
        .function("walk_probe", &[(dev.capability(), ptx.as_str())])
        .unwrap();
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    for sms in [1usize, 8, 132, 148] {
        let mut ns: Vec<u32> = (0..3000).collect();
        ns.extend((sms * 64..sms * 64 + 512).map(|n| n as u32));
        let d_ns = stream.clone_htod(&ns).unwrap();
        let mut d_out = stream.alloc_zeros::<u32>(ns.len() * 4).unwrap();
        let count = ns.len() as u32;
        let sms32 = sms as u32;
        let mut launch = stream.launch_builder(&f);
        launch.arg(&d_ns).arg(&mut d_out).arg(&count).arg(&sms32);
        let cfg = LaunchConfig {
            grid_dim: (count.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { launch.launch(cfg) }.unwrap();
        let out = stream.clone_dtoh(&d_out).unwrap();
        for (k, &n) in ns.iter().enumerate() {
            let n = n as usize;
            let r = rows_per_cta(n);
            let (full, tail, grid) = chunk_map(n, r, sms);
            assert_eq!(
                out[4 * k..4 * k + 4],
                [r as u32, full as u32, tail as u32, grid as u32],
                "n={n} sms={sms}"
            );
        }
        println!("walk rule: {} row counts agree for {sms} SMs", ns.len());
    }
}
