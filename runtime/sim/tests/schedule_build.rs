//! The device schedule build (`ResidentSchedule`) on the simulator against the CPU
//! `build_schedule`: randomized selections with the awkward cases of issue 10, every
//! validation flag provoked (with the error the host reports for the same input), and a
//! backward on a flagged or device-built schedule. No GPU needed.

use half::bf16;
use msa_runtime::backend::bytes_of;
use msa_runtime::schedule_build::{COUNT_WINDOW, FLAG_CU_SEQLENS, FLAG_SELECTION, FLAG_WORKSPACE};
use msa_runtime::Backend;
use msa_runtime::{
    build_schedule, causal_support, max_workspace_rows, workspace_layout, MsaBackward,
    ResidentSchedule, RuntimeError, ScheduleBuildSizes, ScheduleError, Span,
};
use msa_sim::backward::{cu_of, random_q2k, Rng};
use msa_sim::device::{Arch, SimDevice};

const ARCHES: [Arch; 2] = [Arch::Sm90, Arch::Sm100];

/// Builds on the simulator; returns the device and the schedule.
fn device_build(
    arch: Arch,
    q2k: &[i32],
    cu: &[i32],
    workspace_rows: usize,
    qpw: usize,
) -> (SimDevice, ResidentSchedule<SimDevice>) {
    device_build_windowed(arch, q2k, cu, workspace_rows, qpw, COUNT_WINDOW)
}

/// [`device_build`] with `count_window` key blocks per pass of the selection mask.
fn device_build_windowed(
    arch: Arch,
    q2k: &[i32],
    cu: &[i32],
    workspace_rows: usize,
    qpw: usize,
    count_window: usize,
) -> (SimDevice, ResidentSchedule<SimDevice>) {
    let t = q2k.len() / 64;
    let mut dev = SimDevice::new(arch, 8);
    let mut sizes = ScheduleBuildSizes::new(t, cu.len() - 1, workspace_rows, qpw).expect("sizes");
    sizes.count_window = count_window;
    let mut s = ResidentSchedule::new(&mut dev, sizes).expect("allocate");
    rebuild(&mut dev, &mut s, q2k, cu);
    (dev, s)
}

/// Uploads `q2k`/`cu` and builds into the existing `s`.
fn rebuild(dev: &mut SimDevice, s: &mut ResidentSchedule<SimDevice>, q2k: &[i32], cu: &[i32]) {
    let q = dev.upload_new("q2k", q2k);
    let c = dev.upload_new("cu_seqlens", cu);
    s.build(
        dev,
        Span::new(q.ptr.addr(), q2k.len()),
        Span::new(c.ptr.addr(), cu.len()),
    )
    .unwrap_or_else(|e| panic!("build: {e}"));
}

/// The device tables equal `build_schedule`'s, and the padding is what the docs say.
fn check_tables(what: &str, q2k: &[i32], cu: &[i32], workspace_rows: usize, qpw: usize) {
    check_tables_windowed(what, q2k, cu, workspace_rows, qpw, COUNT_WINDOW);
}

/// [`check_tables`] with `count_window` key blocks per pass of the selection mask.
fn check_tables_windowed(
    what: &str,
    q2k: &[i32],
    cu: &[i32],
    workspace_rows: usize,
    qpw: usize,
    count_window: usize,
) {
    for arch in ARCHES {
        let (mut dev, s) = device_build_windowed(arch, q2k, cu, workspace_rows, qpw, count_window);
        compare(what, arch, &mut dev, &s, q2k, cu, qpw);
    }
}

/// The tables of the last build of `s` equal `build_schedule`'s, padding included.
fn compare(
    what: &str,
    arch: Arch,
    dev: &mut SimDevice,
    s: &ResidentSchedule<SimDevice>,
    q2k: &[i32],
    cu: &[i32],
    qpw: usize,
) {
    let host = build_schedule(q2k, cu, qpw).unwrap_or_else(|e| panic!("{what}: host: {e}"));
    {
        s.status(dev)
            .unwrap_or_else(|e| panic!("{what} {arch:?}: flagged a valid input: {e}"));
        let tables = s.read_tables(dev).expect("read back");
        let got = tables
            .to_schedule()
            .unwrap_or_else(|e| panic!("{what} {arch:?}: device tables invalid: {e}"));
        assert_eq!(got.cu_seqlens(), host.cu_seqlens(), "{what} {arch:?}");
        assert_eq!(
            got.document_workspace_starts(),
            host.document_workspace_starts(),
            "{what} {arch:?}: document_workspace_starts"
        );
        assert_eq!(got.row_ptr(), host.row_ptr(), "{what} {arch:?}: row_ptr");
        if let Some(i) =
            (0..host.q_indices().len()).find(|&i| got.q_indices()[i] != host.q_indices()[i])
        {
            panic!(
                "{what} {arch:?}: q_indices[{i}] = {} vs host {}",
                got.q_indices()[i],
                host.q_indices()[i]
            );
        }
        assert_eq!(
            got.work_count(),
            host.work_count(),
            "{what} {arch:?}: work_count"
        );
        assert_eq!(
            got.scheduler_metadata(),
            host.scheduler_metadata(),
            "{what} {arch:?}: scheduler_metadata"
        );
        assert_eq!(got, host, "{what} {arch:?}: the whole schedule");
        // Padding: rows past the real count repeat each head's total, metadata past
        // work_count is zero.
        let stride = s.sizes().rows_capacity + 1;
        for h in 0..4 {
            let total = host.row_ptr()[h * (host.rows() + 1) + host.rows()];
            assert!(
                tables.row_ptr[h * stride + host.rows()..(h + 1) * stride]
                    .iter()
                    .all(|&v| v == total),
                "{what} {arch:?}: row_ptr padding of head {h}"
            );
        }
        let used = 6 * host.num_work();
        assert!(
            tables.scheduler_metadata[used..].iter().all(|&v| v == 0),
            "{what} {arch:?}: metadata padding"
        );
        println!(
            "{what} {arch:?}: T = {}, {} docs, {} rows, {} items: equal to build_schedule",
            host.num_tokens(),
            host.num_documents(),
            host.rows(),
            host.num_work()
        );
    }
}

fn dense_w(cu: &[i32]) -> usize {
    workspace_layout(cu).expect("layout").1
}

#[test]
fn causal_support_matches_build_schedule() {
    for lengths in [&[127, 129, 1, 2, 3, 5, 128][..], &[300], &[1]] {
        let cu = cu_of(lengths);
        check_tables(
            &format!("causal {lengths:?}"),
            &causal_support(&cu).unwrap(),
            &cu,
            dense_w(&cu),
            64,
        );
    }
}

#[test]
fn random_selections_match_build_schedule() {
    let mut rng = Rng(20261201);
    let cases: [(&str, Vec<i32>, Vec<usize>, usize); 5] = [
        (
            "1-token docs and odd lengths",
            vec![1, 130, 1, 257, 5, 1],
            vec![],
            8,
        ),
        (
            "a head that selects nothing",
            vec![200, 77, 385],
            vec![2],
            16,
        ),
        (
            "many tiny documents",
            (0..150).map(|i| 1 + i % 5).collect(),
            vec![],
            64,
        ),
        ("two silent heads", vec![640, 3], vec![0, 3], 24),
        ("one long document", vec![1000], vec![], 64),
    ];
    for (what, lengths, silent, qpw) in cases {
        let cu = cu_of(&lengths);
        let q2k = random_q2k(&cu, &mut rng, &silent);
        check_tables(what, &q2k, &cu, dense_w(&cu), qpw);
    }
}

#[test]
fn a_larger_workspace_and_empty_documents_change_nothing() {
    // Empty documents in the middle and at the end, and W past the dense layout (the host
    // bound a caller without the lengths would allocate).
    let mut rng = Rng(7);
    let cu = cu_of(&[0, 129, 0, 40, 0]);
    let q2k = random_q2k(&cu, &mut rng, &[]);
    let w = max_workspace_rows(169, 5);
    assert!(w > dense_w(&cu));
    check_tables("empty documents, W bound", &q2k, &cu, w, 16);
}

#[test]
fn more_documents_than_one_scan_tile() {
    // 9003 documents (two 8192-entry tiles of the documents scan), most of them empty so that
    // the per-block kernels stay small in the simulator.
    let mut lengths = vec![5];
    lengths.extend(std::iter::repeat_n(0, 4500));
    lengths.push(130);
    lengths.extend(std::iter::repeat_n(0, 4500));
    lengths.push(7);
    let cu = cu_of(&lengths);
    let q2k = random_q2k(&cu, &mut Rng(4), &[]);
    check_tables("9003 documents", &q2k, &cu, dense_w(&cu), 8);
}

#[test]
fn more_long_documents_than_count_threads() {
    // 150 documents of two or three blocks among short and empty ones: the sum over long
    // documents that numbers a row takes two strides of schedule_count's 128 threads, and
    // rows of the same level interleave across documents of different lengths. Heads 1..4
    // select nothing (their rows are numbered by head 0's CTAs all the same).
    let pattern = [129, 300, 140, 1, 257, 0, 383];
    let lengths: Vec<i32> = (0..210).map(|i| pattern[i % pattern.len()]).collect();
    assert!(lengths.iter().filter(|&&l| l > 128).count() > 128);
    let cu = cu_of(&lengths);
    let q2k = random_q2k(&cu, &mut Rng(11), &[1, 2, 3]);
    check_tables("150 long documents", &q2k, &cu, dense_w(&cu), 16);
}

/// Builds `q2k`/`cu` on both targets and expects a flagged status whose error equals
/// `expected` and a build with no work.
fn expect_fault(
    what: &str,
    q2k: &[i32],
    cu: &[i32],
    w: usize,
    flag: i32,
    expected: &ScheduleError,
) {
    for arch in ARCHES {
        let (mut dev, s) = device_build(arch, q2k, cu, w, 16);
        let status: Vec<i32> = dev.read(s.status_ptr().addr(), 1).expect("status");
        assert_eq!(
            status[0] & flag,
            flag,
            "{what} {arch:?}: flag {flag} in {:#x}",
            status[0]
        );
        match s.status(&mut dev) {
            Err(RuntimeError::ScheduleFlagged(e)) => {
                assert_eq!(&e, expected, "{what} {arch:?}");
                println!(
                    "{what} {arch:?}: {}",
                    RuntimeError::ScheduleFlagged(e.clone())
                );
            }
            other => panic!("{what} {arch:?}: expected a flagged schedule, got {other:?}"),
        }
        let tables = s.read_tables(&mut dev).expect("read back");
        assert_eq!(
            tables.work_count, 0,
            "{what} {arch:?}: a flagged build has no work"
        );
    }
}

/// The host's error for the same input.
fn host_error(q2k: &[i32], cu: &[i32]) -> ScheduleError {
    build_schedule(q2k, cu, 16).expect_err("the host rejects it too")
}

#[test]
fn every_selection_fault_is_flagged_as_the_host_reports_it() {
    let cu = cu_of(&[130, 300]);
    let base = causal_support(&cu).unwrap();
    let t = 430usize;
    let at = |h: usize, row: usize, slot: usize| (h * t + row) * 16 + slot;
    let w = dense_w(&cu);
    let mut cases: Vec<(&str, Vec<i32>)> = Vec::new();
    // Below padding: head 1, row 200 (doc 1, own block 0), slot 5.
    let mut q = base.clone();
    q[at(1, 200, 5)] = -7;
    cases.push(("below -1", q));
    // Past the document's end: doc 1 has 3 blocks; row 429 is its last query.
    let mut q = base.clone();
    q[at(3, 429, 2)] = 3;
    cases.push(("past the end", q));
    // After the own block: row 131 (doc 1, q = 1, own block 0) selects block 1.
    let mut q = base.clone();
    q[at(0, 131, 1)] = 1;
    cases.push(("after own block", q));
    // Repeated: row 129 (doc 0 q = 129, own 1: list [1, 0, -1...]) repeats 0 in slot 9.
    let mut q = base.clone();
    q[at(2, 129, 9)] = 0;
    cases.push(("repeated", q));
    // Several faults: the first in (head, row, slot) order wins, as on the host.
    let mut q = base.clone();
    q[at(2, 5, 3)] = 4;
    q[at(1, 400, 15)] = -2;
    q[at(1, 400, 12)] = 0;
    q[at(1, 400, 11)] = 0;
    cases.push(("first of several", q));
    for (what, q2k) in cases {
        let expected = host_error(&q2k, &cu);
        assert!(
            matches!(expected, ScheduleError::Selection { .. }),
            "{expected}"
        );
        expect_fault(what, &q2k, &cu, w, FLAG_SELECTION, &expected);
    }
}

#[test]
fn malformed_cu_seqlens_and_a_small_workspace_are_flagged() {
    let good = cu_of(&[100, 200, 50]);
    let q2k = vec![-1i32; 64 * 350];
    let w = dense_w(&good);
    // Not starting at 0 (the host's error is identical).
    let cu = vec![3, 100, 300, 350];
    expect_fault(
        "cu_seqlens[0] != 0",
        &q2k,
        &cu,
        w,
        FLAG_CU_SEQLENS,
        &host_error(&q2k, &cu),
    );
    // Decreasing (identical to the host's error).
    let cu = vec![0, 200, 100, 350];
    expect_fault(
        "decreasing",
        &q2k,
        &cu,
        w,
        FLAG_CU_SEQLENS,
        &host_error(&q2k, &cu),
    );
    // Not ending at T (the host names q2k's length instead: the shapes disagree).
    let cu = vec![0, 100, 300, 349];
    let expected = ScheduleError::Invalid {
        field: "cu_seqlens[3]".into(),
        found: "349".into(),
        expected: "T = 350, the tokens of q2k [4, T, 16]".into(),
    };
    expect_fault("last != T", &q2k, &cu, w, FLAG_CU_SEQLENS, &expected);
    // W below the dense layout (4 blocks = 512 rows needed, 384 given).
    let expected = ScheduleError::Invalid {
        field: "workspace_rows".into(),
        found: "384".into(),
        expected: ">= Σ ceil(len_d/128)·128 = 512 (the aligned layout of cu_seqlens)".into(),
    };
    expect_fault(
        "small workspace",
        &q2k,
        &good,
        384,
        FLAG_WORKSPACE,
        &expected,
    );
}

#[test]
fn shapes_are_checked_on_the_host_before_any_launch() {
    for (t, d, w, qpw, field) in [
        (0, 1, 128, 8, "q2k"),
        ((1 << 20) + 128, 1, (1 << 20) + 128, 8, "q2k"),
        (10, 0, 128, 8, "cu_seqlens"),
        (10, 1, 100, 8, "workspace_rows"),
        (10, 1, 128, 12, "queries_per_work"),
    ] {
        match ScheduleBuildSizes::new(t, d, w, qpw) {
            Err(RuntimeError::Input { field: f, .. }) => assert_eq!(f, field),
            other => panic!("T={t} D={d} W={w} qpw={qpw}: {other:?}"),
        }
    }
    let mut dev = SimDevice::new(Arch::Sm90, 1);
    let sizes = ScheduleBuildSizes::new(10, 1, 128, 8).unwrap();
    let mut s = ResidentSchedule::new(&mut dev, sizes).unwrap();
    let q = dev.upload_new("q2k", &vec![-1i32; 640]);
    let c = dev.upload_new("cu", &[0i32, 10]);
    let err = s
        .build(
            &mut dev,
            Span::new(q.ptr.addr(), 639),
            Span::new(c.ptr.addr(), 2),
        )
        .unwrap_err();
    assert!(
        matches!(err, RuntimeError::Input { field: "q2k", .. }),
        "{err}"
    );
    let err = s
        .build(
            &mut dev,
            Span::new(q.ptr.addr(), 640),
            Span::new(c.ptr.addr(), 3),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            RuntimeError::Input {
                field: "cu_seqlens",
                ..
            }
        ),
        "{err}"
    );
    assert!(dev.launches().is_empty(), "nothing launched");
}

#[test]
fn the_capacity_bounds_hold_for_random_lengths() {
    // The row bound of ScheduleBuildSizes against the exact counts.
    let mut rng = Rng(99);
    for _ in 0..2000 {
        let docs = 1 + rng.below(40);
        let lengths: Vec<i32> = (0..docs)
            .map(|_| match rng.below(4) {
                0 => rng.below(3) as i32,
                1 => 128 + rng.below(3) as i32,
                _ => rng.below(3000) as i32,
            })
            .collect();
        let t: usize = lengths.iter().map(|&l| l as usize).sum();
        if t == 0 {
            continue;
        }
        let nb: Vec<usize> = lengths
            .iter()
            .map(|&l| (l as usize).div_ceil(128))
            .collect();
        let rows: usize = nb.iter().sum();
        let z = ScheduleBuildSizes::new(t, docs, 128 * rows, 8).unwrap();
        assert!(rows <= z.rows_capacity, "{lengths:?}: rows");
        assert!(
            128 * rows <= max_workspace_rows(t, docs),
            "{lengths:?}: W bound"
        );
    }
}

#[test]
fn a_backward_on_a_flagged_schedule_writes_zero_gradients() {
    let c = msa_sim::backward::case(&[100, 60], 3).expect("case");
    let cu = c.schedule.cu_seqlens().to_vec();
    let mut q2k = causal_support(&cu).unwrap();
    q2k[16 * 50 + 4] = 9; // past the end of document 0
    for arch in [Arch::Sm90] {
        let (mut dev, s) = device_build(arch, &q2k, &cu, c.schedule.workspace_rows(), 64);
        let io = msa_sim::backward::upload(&mut dev, &c);
        // Poison the outputs: every element must be overwritten with zero.
        for span in [io.dq, io.dk_aligned, io.dv_aligned] {
            let poison = vec![bf16::from_bits(0x7fc1); span.len];
            Backend::upload(&mut dev, "poison", span.addr, bytes_of(&poison)).unwrap();
        }
        MsaBackward::<SimDevice>::new()
            .run_on(&mut dev, &io, &s)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            s.status(&mut dev),
            Err(RuntimeError::ScheduleFlagged(_))
        ));
        for (name, span) in [("dq", io.dq), ("dk", io.dk_aligned), ("dv", io.dv_aligned)] {
            let got: Vec<bf16> = dev.read(span.addr, span.len).expect("read");
            assert!(
                got.iter().all(|x| x.to_bits() == 0),
                "{arch:?} {name} is not all zero"
            );
        }
    }
}

#[test]
fn a_backward_on_a_device_schedule_equals_the_host_schedule_path() {
    let c = msa_sim::backward::case(&[130, 3], 5).expect("case");
    let cu = c.schedule.cu_seqlens().to_vec();
    let q2k = causal_support(&cu).unwrap();
    let arch = Arch::Sm90;
    let read = |dev: &SimDevice, io: &msa_runtime::BackwardBuffers| -> Vec<Vec<u16>> {
        [io.dq, io.dk_aligned, io.dv_aligned]
            .iter()
            .map(|s| {
                dev.read::<bf16>(s.addr, s.len)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            })
            .collect()
    };
    let mut host_dev = SimDevice::new(arch, 8);
    let io = msa_sim::backward::upload(&mut host_dev, &c);
    MsaBackward::<SimDevice>::new()
        .run_on(&mut host_dev, &io, &c.schedule)
        .unwrap();
    let host = read(&host_dev, &io);

    let (mut dev, s) = device_build(arch, &q2k, &cu, c.schedule.workspace_rows(), 64);
    let io = msa_sim::backward::upload(&mut dev, &c);
    MsaBackward::<SimDevice>::new()
        .run_on(&mut dev, &io, &s)
        .unwrap();
    s.status(&mut dev).unwrap();
    assert!(
        read(&dev, &io) == host,
        "device-schedule gradients differ from the host path"
    );
    assert!(host[0].iter().any(|&x| x != 0), "non-trivial gradients");
}

#[test]
fn after_reserve_a_backward_on_a_device_schedule_allocates_nothing() {
    let c = msa_sim::backward::case(&[130, 3], 5).expect("case");
    let cu = c.schedule.cu_seqlens().to_vec();
    let (mut dev, s) = device_build(
        Arch::Sm90,
        &causal_support(&cu).unwrap(),
        &cu,
        c.schedule.workspace_rows(),
        64,
    );
    let io = msa_sim::backward::upload(&mut dev, &c);
    let mut backward = MsaBackward::<SimDevice>::new();
    backward.reserve(&mut dev, &s).unwrap();
    let reserved = backward.allocation_count();
    assert_eq!(reserved, 2, "gradient and task workspaces");
    let launched = dev.launches().len();
    backward.run_on(&mut dev, &io, &s).unwrap();
    assert_eq!(backward.allocation_count(), reserved, "run_on allocated");
    let names: Vec<&str> = dev.launches()[launched..]
        .iter()
        .map(|l| l.kernel)
        .collect();
    assert!(
        !names.iter().any(|n| n.starts_with("schedule_")),
        "{names:?}"
    );
    println!("after reserve: {names:?}");
}

#[test]
fn several_mask_windows_match_build_schedule() {
    // schedule_count's mask covers `count_window` key blocks per pass: 1, 4 and 8 blocks here
    // give up to 24 passes per query block, the path documents of more than 1024 blocks take.
    let mut rng = Rng(20261202);
    let cases: [(&str, Vec<i32>, usize); 3] = [
        ("24 blocks, window 1", vec![3000], 1),
        ("packed, window 4", vec![700, 1, 1500, 129, 900], 4),
        ("odd lengths, window 8", vec![1100, 2047, 3], 8),
    ];
    for (what, lengths, window) in cases {
        let cu = cu_of(&lengths);
        let q2k = random_q2k(&cu, &mut rng, &[]);
        check_tables_windowed(what, &q2k, &cu, dense_w(&cu), 16, window);
    }
}

#[test]
fn a_schedule_rebuilt_on_new_inputs_and_after_faults_matches_build_schedule() {
    // The build's handoff words and row counters are reused by every build of a
    // ResidentSchedule: valid, faulty and valid inputs in turn, all of the same shapes.
    let mut rng = Rng(11);
    let cu = cu_of(&[300, 1, 211]);
    let w = dense_w(&cu);
    let first = random_q2k(&cu, &mut rng, &[]);
    let second = random_q2k(&cu, &mut rng, &[1]);
    let mut faulty = second.clone();
    faulty[(2 * 512 + 400) * 16 + 7] = 3; // past the end of document 2 (2 blocks)
    let bad_cu = vec![0, 300, 200, 512];
    for arch in ARCHES {
        let (mut dev, mut s) = device_build(arch, &first, &cu, w, 16);
        compare("first build", arch, &mut dev, &s, &first, &cu, 16);
        rebuild(&mut dev, &mut s, &faulty, &cu);
        assert!(matches!(
            s.status(&mut dev),
            Err(RuntimeError::ScheduleFlagged(
                ScheduleError::Selection { .. }
            ))
        ));
        rebuild(&mut dev, &mut s, &second, &bad_cu);
        assert!(matches!(
            s.status(&mut dev),
            Err(RuntimeError::ScheduleFlagged(ScheduleError::Invalid { .. }))
        ));
        rebuild(&mut dev, &mut s, &second, &cu);
        compare(
            "after two flagged builds",
            arch,
            &mut dev,
            &s,
            &second,
            &cu,
            16,
        );
    }
}
