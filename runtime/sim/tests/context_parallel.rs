//! Context parallelism (`msa_runtime::cp`) on the simulator: `R` logical ranks, each a thread
//! with its own simulated device, exchange through `HostGroup`; their gradients, reassembled,
//! are checked against the f32 CPU reference at the seed's tolerances and against the
//! single-device backward of the whole sequence. Covers packed documents straddling a rank
//! boundary, one document split over two and three ranks, a rank holding a document's
//! single short block, and the layout's and the flow's input checks. The context-parallel
//! forward (`CpForward`) is checked the same way (out and lse against the reference), and
//! chained: its out, lse and returned schedule feed the context-parallel backward; and again
//! with each rank's schedule built on the device (`RankSchedule`, `CpForward::run_on_device`),
//! whose tables must equal the host's.

use half::bf16;
use msa_runtime::contract::BLOCK_SIZE;
use msa_runtime::reference::{self, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE, O_TOLERANCE};
use msa_runtime::{
    build_schedule, CpBackward, CpBuffers, CpForward, CpForwardBuffers, CpLayout, HostGroup,
    MsaBackward, RankSchedule, RuntimeError, Span,
};
use msa_sim::backward::{cu_of, random_q2k, to_bf16, to_f32, Rng};
use msa_sim::device::{Arch, SimDevice};
use msa_sim::Element;

/// `data` on `dev`, as a span.
fn up<T: Element>(dev: &mut SimDevice, name: &str, data: &[T]) -> Span<T> {
    Span::new(dev.upload_new(name, data).ptr.0, data.len())
}

const Q_ROW: usize = 64 * 128;
const KV_ROW: usize = 4 * 128;

struct Problem {
    cu: Vec<i32>,
    q2k: Vec<i32>,
    q: Vec<bf16>,
    k_aligned: Vec<bf16>,
    v_aligned: Vec<bf16>,
    dout: Vec<bf16>,
    out: Vec<bf16>,
    lse: Vec<f32>,
    expected: reference::Gradients,
}

fn problem(lengths: &[i32], seed: u64) -> Problem {
    let cu = cu_of(lengths);
    let t = *cu.last().unwrap() as usize;
    let mut rng = Rng(seed);
    let q2k = random_q2k(&cu, &mut rng, &[]);
    let (q, q32) = rng.bf16s(t * Q_ROW);
    let (_, k32) = rng.bf16s(t * KV_ROW);
    let (_, v32) = rng.bf16s(t * KV_ROW);
    let (dout, do32) = rng.bf16s(t * Q_ROW);
    let fwd = reference::forward(&q32, &k32, &v32, &q2k, &cu).expect("forward");
    let out = to_bf16(&fwd.out);
    let expected = reference::backward(&q32, &k32, &v32, &q2k, &cu, &to_f32(&out), &fwd.lse, &do32)
        .expect("backward");
    let aligned = |x: &[f32]| to_bf16(&reference::to_aligned(x, &cu, 4).expect("aligned"));
    Problem {
        k_aligned: aligned(&k32),
        v_aligned: aligned(&v32),
        cu,
        q2k,
        q,
        dout,
        out,
        lse: fwd.lse,
        expected,
    }
}

/// `f(rank, comm)` on `ranks` logical ranks, each on a thread of its own with its
/// `HostGroup` handle; the results in rank order.
fn on_ranks<T: Send>(ranks: usize, f: impl Fn(usize, &mut HostGroup) -> T + Sync) -> Vec<T> {
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = HostGroup::new(ranks)
            .into_iter()
            .enumerate()
            .map(|(rank, mut comm)| scope.spawn(move || f(rank, &mut comm)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    })
}

/// One rank's gradients: dq of its tokens, dk/dv of its slice.
type RankGrads = (Vec<bf16>, Vec<bf16>, Vec<bf16>);

/// Runs the context-parallel backward of `p` over `ranks` logical ranks.
fn run_cp(p: &Problem, ranks: usize) -> Vec<RankGrads> {
    let layout = CpLayout::new(&p.cu, ranks).expect("layout");
    let s = layout.slice_rows();
    let layout = &layout;
    on_ranks(ranks, |rank, comm| {
        let rows = layout.token_rows(rank);
        let schedule = layout
            .local_schedule(rank, &layout.rank_q2k(rank, &p.q2k).unwrap(), 64)
            .expect("local schedule");
        assert_eq!(schedule.query_rows(), rows);
        let mut dev = SimDevice::new(Arch::Sm90, 3);
        // The rank's slice of the aligned K/V: rows [r·S, (r+1)·S), zero past W.
        let slice = |x: &[bf16]| layout.rank_slice(rank, x).expect("slice");
        let qr = rows.start * Q_ROW..rows.end * Q_ROW;
        let io = CpBuffers {
            q: up(&mut dev, "q", &p.q[qr.clone()]),
            grad_out: up(&mut dev, "grad_out", &p.dout[qr.clone()]),
            out: up(&mut dev, "out", &p.out[qr.clone()]),
            lse: up(&mut dev, "lse", &p.lse[rows.start * 64..rows.end * 64]),
            k_slice: up(&mut dev, "k_slice", &slice(&p.k_aligned)),
            v_slice: up(&mut dev, "v_slice", &slice(&p.v_aligned)),
            dq: up(&mut dev, "dq", &vec![bf16::ZERO; rows.len() * Q_ROW]),
            dk_slice: up(&mut dev, "dk_slice", &vec![bf16::ZERO; s * KV_ROW]),
            dv_slice: up(&mut dev, "dv_slice", &vec![bf16::ZERO; s * KV_ROW]),
        };
        let mut backward = CpBackward::<SimDevice>::new();
        backward
            .run_on(&mut dev, comm, layout, &io, &schedule)
            .expect("cp backward");
        backward.status(&mut dev).expect("no rank is flagged");
        // A call that fails its checks (on every rank, before any gather) leaves no verdict
        // behind, not the previous call's.
        let bad = CpBuffers {
            dk_slice: Span::new(io.dk_slice.addr, 0),
            ..io
        };
        let e = backward.run_on(&mut dev, comm, layout, &bad, &schedule);
        assert!(
            matches!(
                e,
                Err(RuntimeError::Input {
                    field: "dk_slice",
                    ..
                })
            ),
            "{e:?}"
        );
        let after = backward.status(&mut dev);
        assert!(
            matches!(after, Err(RuntimeError::Input { .. })),
            "{after:?}"
        );
        let read = |x: Span<bf16>| dev.read::<bf16>(x.addr, x.len).expect("read");
        (read(io.dq), read(io.dk_slice), read(io.dv_slice))
    })
}

/// The single-device backward of the whole sequence on the simulator.
fn run_single(p: &Problem) -> RankGrads {
    let schedule = build_schedule(&p.q2k, &p.cu, 64).expect("schedule");
    let mut dev = SimDevice::new(Arch::Sm90, 3);
    let (t, w) = (schedule.num_tokens(), schedule.workspace_rows());
    let d = &mut dev;
    let io = msa_runtime::BackwardBuffers {
        q: up(d, "q", &p.q),
        k_aligned: up(d, "k_aligned", &p.k_aligned),
        v_aligned: up(d, "v_aligned", &p.v_aligned),
        grad_out: up(d, "grad_out", &p.dout),
        out: up(d, "out", &p.out),
        dq: up(d, "dq", &vec![bf16::ZERO; t * Q_ROW]),
        dk_aligned: up(d, "dk_aligned", &vec![bf16::ZERO; w * KV_ROW]),
        dv_aligned: up(d, "dv_aligned", &vec![bf16::ZERO; w * KV_ROW]),
        lse: up(d, "lse", &p.lse),
    };
    MsaBackward::<SimDevice>::new()
        .run_on(&mut dev, &io, &schedule)
        .expect("backward");
    let read = |x: Span<bf16>| dev.read::<bf16>(x.addr, x.len).expect("read");
    (read(io.dq), read(io.dk_aligned), read(io.dv_aligned))
}

fn check(lengths: &[i32], ranks: usize, seed: u64) {
    let p = problem(lengths, seed);
    let layout = CpLayout::new(&p.cu, ranks).expect("layout");
    let w = layout.workspace_rows();
    let per_rank = run_cp(&p, ranks);
    let dq: Vec<bf16> = per_rank.iter().flat_map(|g| g.0.clone()).collect();
    let dk: Vec<bf16> = per_rank.iter().flat_map(|g| g.1.clone()).collect();
    let dv: Vec<bf16> = per_rank.iter().flat_map(|g| g.2.clone()).collect();
    // Rows past W (the last slice's tail) hold no key: exactly zero.
    assert!(dk[w * KV_ROW..]
        .iter()
        .chain(&dv[w * KV_ROW..])
        .all(|x| x.to_bits() == 0));
    let (dk, dv) = (&dk[..w * KV_ROW], &dv[..w * KV_ROW]);
    let e = &p.expected;
    let stats = [
        DQ_TOLERANCE.check("dq", &to_f32(&dq), &e.dq),
        DK_TOLERANCE.check("dk", &to_f32(dk), &e.dk_aligned),
        DV_TOLERANCE.check("dv", &to_f32(dv), &e.dv_aligned),
    ];
    for s in &stats {
        if let Err(m) = s {
            panic!("{lengths:?} over {ranks} ranks against the reference: {m}");
        }
    }
    // Against one device: dQ has the same contributions (summed in another order by the
    // atomics), dK/dV one more fp32 rounding per rank.
    let single = run_single(&p);
    for (name, got, one) in [
        ("dq", &dq[..], &single.0),
        ("dk", dk, &single.1),
        ("dv", dv, &single.2),
    ] {
        DQ_TOLERANCE
            .check(name, &to_f32(got), &to_f32(one))
            .unwrap_or_else(|m| panic!("{lengths:?}, {ranks} ranks against one device: {m}"));
    }
    println!(
        "{lengths:?} over {ranks} ranks (token rows {:?}): {:?}",
        (0..ranks).map(|r| layout.token_rows(r)).collect::<Vec<_>>(),
        stats.map(|s| s.map(|s| (s.max_abs, s.l2_rel)).ok())
    );
}

// Small shapes: the simulator runs every rank's backward and the single-device one.

#[test]
fn packed_documents_straddling_the_rank_boundary() {
    // 2 + 2 + 1 blocks in slices of 3: the second document is cut after its block 0, and
    // the last slice ends in a zero block.
    check(&[130, 250, 20], 2, 31);
}

#[test]
fn one_document_over_three_ranks() {
    // 3 blocks, one per rank: both boundaries inside the document.
    check(&[384], 3, 32);
}

#[test]
fn tiny_documents_over_two_ranks() {
    check(&[1, 5, 127, 3, 9, 130], 2, 34);
}

#[test]
fn the_layout_tiles_tokens_and_rows_and_names_its_limits() {
    let cu = cu_of(&[200, 500, 70]);
    let l = CpLayout::new(&cu, 2).unwrap();
    assert_eq!(
        (l.workspace_rows(), l.slice_rows(), l.gathered_rows()),
        (896, 512, 1024)
    );
    assert_eq!((l.token_rows(0), l.token_rows(1)), (0..456, 456..770));
    assert_eq!((l.block_rows(0), l.block_rows(1)), (0..512, 512..896));
    // Rank 0: document 0 whole, the first 256 tokens of document 1; rank 1: the rest.
    assert_eq!(l.local_cu_seqlens(0), vec![0, 200, 456]);
    assert_eq!(l.local_cu_seqlens(1), vec![0, 244, 314]);
    for r in 0..2 {
        let pieces = l.local_cu_seqlens(r);
        let (_, w) = msa_runtime::workspace_layout(&pieces).unwrap();
        assert_eq!(
            w,
            l.block_rows(r).len(),
            "rank {r}: pieces pack into its block rows"
        );
    }
    // 7 blocks cannot be split into 5 non-empty slices of ceil(7/5) = 2.
    // 7 blocks split into 1-4 or 7 ranks, not 5 or 6.
    for r in [1, 2, 3, 4, 7] {
        let l = CpLayout::new(&cu, r).unwrap();
        let tiled: Vec<usize> = (0..r).flat_map(|i| l.token_rows(i)).collect();
        assert_eq!(
            tiled,
            (0..770).collect::<Vec<_>>(),
            "{r} ranks tile the tokens"
        );
        assert!((0..r).all(|i| !l.block_rows(i).is_empty()));
        // Each rank starts at one of its document's 128-token block boundaries.
        for i in 0..r {
            let start = l.token_rows(i).start as i32;
            let doc_start = *cu.iter().rfind(|&&c| c <= start).unwrap();
            assert_eq!(
                (start - doc_start) % BLOCK_SIZE as i32,
                0,
                "{r} ranks, rank {i}"
            );
        }
    }
    let e = CpLayout::new(&cu, 5).unwrap_err();
    assert!(e.to_string().contains("nearest: 4 or 7"), "{e}");
    assert!(CpLayout::new(&cu, 6).is_err());
    assert!(CpLayout::new(&cu, 0).is_err());
}

#[test]
fn mismatched_inputs_are_typed_errors_before_anything_runs() {
    let p = problem(&[200, 500, 70], 35);
    let layout = CpLayout::new(&p.cu, 2).unwrap();
    let rows = layout.token_rows(1);
    let local = layout.rank_q2k(1, &p.q2k).unwrap();
    // A schedule of rank 1 given to rank 0.
    let wrong = layout.local_schedule(1, &local, 64).unwrap();
    let mut groups = HostGroup::new(2);
    let mut dev = SimDevice::new(Arch::Sm90, 3);
    let n0 = layout.token_rows(0).len();
    let s = layout.slice_rows();
    let zeros = |n: usize| vec![bf16::ZERO; n];
    let d = &mut dev;
    let io = CpBuffers {
        q: up(d, "q", &zeros(n0 * Q_ROW)),
        grad_out: up(d, "grad_out", &zeros(n0 * Q_ROW)),
        out: up(d, "out", &zeros(n0 * Q_ROW)),
        lse: up(d, "lse", &vec![0f32; n0 * 64]),
        k_slice: up(d, "k", &zeros(s * KV_ROW)),
        v_slice: up(d, "v", &zeros(s * KV_ROW)),
        dq: up(d, "dq", &zeros(n0 * Q_ROW)),
        dk_slice: up(d, "dk", &zeros(s * KV_ROW)),
        dv_slice: up(d, "dv", &zeros(s * KV_ROW)),
    };
    let launches = dev.launches().len();
    let mut cp = CpBackward::<SimDevice>::new();
    let e = cp
        .run_on(&mut dev, &mut groups[0], &layout, &io, &wrong)
        .unwrap_err();
    assert!(
        matches!(&e, RuntimeError::Input { field, .. } if *field == "schedule"),
        "{e}"
    );
    // A whole-sequence schedule is not a rank's.
    let whole = build_schedule(&p.q2k, &p.cu, 64).unwrap();
    assert!(cp
        .run_on(&mut dev, &mut groups[0], &layout, &io, &whole)
        .is_err());
    // A K slice of the wrong length.
    let right = layout
        .local_schedule(0, &layout.rank_q2k(0, &p.q2k).unwrap(), 64)
        .unwrap();
    let short = CpBuffers {
        k_slice: Span::new(io.k_slice.addr, s * KV_ROW - 1),
        ..io
    };
    let e = cp
        .run_on(&mut dev, &mut groups[0], &layout, &short, &right)
        .unwrap_err();
    assert!(e.to_string().contains("k_slice"), "{e}");
    assert_eq!(dev.launches().len(), launches, "nothing was launched");
    // A local q2k with an out-of-range id names the compact row.
    let mut bad = local;
    bad[3] = 99;
    let e = layout.local_schedule(1, &bad, 64).unwrap_err();
    assert!(
        e.to_string()
            .contains(&format!("compact query row {}", rows.start)),
        "{e}"
    );
}

#[test]
fn a_rank_schedule_is_the_whole_build_with_the_other_rows_silent() {
    let cu = cu_of(&[300, 1, 700, 129]);
    let t = 1130;
    let q2k = random_q2k(&cu, &mut Rng(36), &[2]);
    let layout = CpLayout::new(&cu, 3).unwrap();
    for r in 0..3 {
        let rows = layout.token_rows(r);
        let local = layout
            .local_schedule(r, &layout.rank_q2k(r, &q2k).unwrap(), 64)
            .unwrap();
        // The whole-sequence build of a selection in which the other ranks' queries pick
        // nothing has the same CSR rows, edges and work items.
        let mut silent = vec![-1; q2k.len()];
        for h in 0..4 {
            let at = (h * t + rows.start) * 16..(h * t + rows.end) * 16;
            silent[at.clone()].copy_from_slice(&q2k[at]);
        }
        let whole = build_schedule(&silent, &cu, 64).unwrap();
        assert_eq!(local.query_rows(), rows);
        assert_eq!(local.row_ptr(), whole.row_ptr(), "rank {r}");
        assert_eq!(local.scheduler_metadata(), whole.scheduler_metadata());
        for h in 0..4 {
            for row in 0..local.rows() {
                assert_eq!(local.row_queries(h, row), whole.row_queries(h, row));
            }
        }
        assert_eq!(local.edge_capacity(), rows.len() * 16);
        // Restricting the silent whole build to the rank's rows is accepted; to other rows not
        // (unless the rank's queries selected nothing there).
        assert!(whole.clone().restrict_queries(rows.clone()).is_ok());
        let other = layout.token_rows((r + 1) % 3);
        let e = whole.restrict_queries(other).unwrap_err();
        assert!(e.to_string().contains("q_indices["), "{e}");
    }
}

// ---------------------------------------------------------------------------------------------
// The context-parallel forward
// ---------------------------------------------------------------------------------------------

/// One rank's forward outputs, `out` and `lse` of its tokens.
type RankForward = (Vec<bf16>, Vec<f32>);

/// Rank `rank`'s forward buffers on `dev`: its queries and K/V slices, and outputs filled with
/// NaN (the forward must write every element).
fn rank_forward_io(
    dev: &mut SimDevice,
    p: &Problem,
    layout: &CpLayout,
    rank: usize,
) -> CpForwardBuffers {
    let rows = layout.token_rows(rank);
    let t = rows.len();
    let slice = |x: &[bf16]| layout.rank_slice(rank, x).expect("slice");
    CpForwardBuffers {
        q: up(dev, "q", &p.q[rows.start * Q_ROW..rows.end * Q_ROW]),
        k_slice: up(dev, "k_slice", &slice(&p.k_aligned)),
        v_slice: up(dev, "v_slice", &slice(&p.v_aligned)),
        out: up(dev, "out", &vec![bf16::from_f32(f32::NAN); t * Q_ROW]),
        lse: up(dev, "lse", &vec![f32::NAN; t * 64]),
    }
}

/// Rank `rank`'s backward buffers on `dev` over its forward buffers `fio` (its out and lse as
/// the backward's inputs): its grad_out, `dq` filled with `dq_fill`, zero dK/dV slices.
fn rank_backward_io(
    dev: &mut SimDevice,
    p: &Problem,
    layout: &CpLayout,
    rank: usize,
    fio: &CpForwardBuffers,
    dq_fill: bf16,
) -> CpBuffers {
    let rows = layout.token_rows(rank);
    let s = layout.slice_rows();
    CpBuffers {
        q: fio.q,
        grad_out: up(
            dev,
            "grad_out",
            &p.dout[rows.start * Q_ROW..rows.end * Q_ROW],
        ),
        out: fio.out,
        lse: fio.lse,
        k_slice: fio.k_slice,
        v_slice: fio.v_slice,
        dq: up(dev, "dq", &vec![dq_fill; rows.len() * Q_ROW]),
        dk_slice: up(dev, "dk_slice", &vec![bf16::ZERO; s * KV_ROW]),
        dv_slice: up(dev, "dv_slice", &vec![bf16::ZERO; s * KV_ROW]),
    }
}

/// Runs the context-parallel forward of `p` over `ranks` logical ranks on `arch`, then, on
/// each rank, the context-parallel backward on the forward's own `out`, `lse` and schedule:
/// the host-validated one, or with `device` the rank's schedule built on the device from its
/// device rows of the selection (its tables checked against the host's first).
fn run_cp_chain(
    p: &Problem,
    ranks: usize,
    arch: Arch,
    device: bool,
) -> Vec<(RankForward, RankGrads)> {
    let layout = CpLayout::new(&p.cu, ranks).expect("layout");
    let layout = &layout;
    on_ranks(ranks, |rank, comm| {
        let rows = layout.token_rows(rank);
        let mut dev = SimDevice::new(arch, 3);
        let fio = rank_forward_io(&mut dev, p, layout, rank);
        let q2k = layout.rank_q2k(rank, &p.q2k).unwrap();
        let host = layout
            .local_schedule(rank, &q2k, 64)
            .expect("local schedule");
        let mut resident = None;
        if device {
            let d_q2k = up(&mut dev, "q2k_local", &q2k);
            let mut rs = RankSchedule::new(&mut dev, layout, rank).expect("rank schedule");
            CpForward::<SimDevice>::new()
                .run_on_device(&mut dev, comm, layout, &fio, d_q2k, &mut rs)
                .expect("cp forward on a device schedule");
            rs.status(&mut dev).expect("a valid selection");
            assert_eq!(rs.resident().query_rows(), rows);
            // The device tables are the host's (the edge capacity aside: 16·T against 16·T_r).
            let tables = rs.resident().read_tables(&mut dev).expect("tables");
            let built = tables.to_schedule().expect("device tables validate");
            assert_eq!(built.row_ptr(), host.row_ptr(), "rank {rank}: row_ptr");
            assert_eq!(built.scheduler_metadata(), host.scheduler_metadata());
            assert_eq!(built.work_count(), host.work_count());
            for h in 0..4 {
                for row in 0..host.rows() {
                    assert_eq!(built.row_queries(h, row), host.row_queries(h, row));
                }
            }
            resident = Some(rs);
        } else {
            let schedule = CpForward::<SimDevice>::new()
                .run_on(&mut dev, comm, layout, &fio, &q2k)
                .expect("cp forward");
            assert_eq!(schedule.query_rows(), rows);
            assert_eq!(schedule.row_ptr(), host.row_ptr());
        }
        let out = dev.read::<bf16>(fio.out.addr, fio.out.len).expect("read");
        let lse = dev.read::<f32>(fio.lse.addr, fio.lse.len).expect("read");
        let bio = rank_backward_io(&mut dev, p, layout, rank, &fio, bf16::ZERO);
        let mut backward = CpBackward::<SimDevice>::new();
        match &resident {
            Some(rs) => backward.run_on(&mut dev, comm, layout, &bio, rs),
            None => backward.run_on(&mut dev, comm, layout, &bio, &host),
        }
        .expect("cp backward");
        backward.status(&mut dev).expect("no rank is flagged");
        let read = |x: Span<bf16>| dev.read::<bf16>(x.addr, x.len).expect("read");
        (
            (out, lse),
            (read(bio.dq), read(bio.dk_slice), read(bio.dv_slice)),
        )
    })
}

/// The context-parallel forward of `lengths` over `ranks` ranks against the reference forward
/// (out within the O tolerance, lse within 1e-3, empty rows exactly 0 and −∞), then the
/// backward chained on it against the reference backward of the reference forward's outputs.
fn check_forward(lengths: &[i32], ranks: usize, seed: u64, arch: Arch, device: bool) {
    let p = problem(lengths, seed);
    let t = *p.cu.last().unwrap() as usize;
    let layout = CpLayout::new(&p.cu, ranks).expect("layout");
    let w = layout.workspace_rows();
    let per_rank = run_cp_chain(&p, ranks, arch, device);
    let out: Vec<f32> = to_f32(
        &per_rank
            .iter()
            .flat_map(|r| r.0 .0.clone())
            .collect::<Vec<_>>(),
    );
    let lse: Vec<f32> = per_rank.iter().flat_map(|r| r.0 .1.clone()).collect();
    assert_eq!((out.len(), lse.len()), (t * Q_ROW, t * 64));
    let want_out = to_f32(&p.out);
    let o = O_TOLERANCE
        .check("out", &out, &want_out)
        .unwrap_or_else(|m| panic!("{lengths:?} over {ranks} ranks, forward: {m}"));
    let mut lse_err = 0f32;
    for (i, (&g, &e)) in lse.iter().zip(&p.lse).enumerate() {
        if e == f32::NEG_INFINITY {
            assert_eq!(g, e, "lse[{i}] of an empty row");
            assert!(
                out[i * 128..i * 128 + 128].iter().all(|&x| x == 0.0),
                "out of empty row {i}"
            );
        } else {
            let d = (g - e).abs();
            assert!(
                d <= 1e-3,
                "{lengths:?} over {ranks} ranks: lse[{i}] = {g}, want {e}"
            );
            lse_err = lse_err.max(d);
        }
    }
    let dq: Vec<bf16> = per_rank.iter().flat_map(|r| r.1 .0.clone()).collect();
    let dk: Vec<bf16> = per_rank.iter().flat_map(|r| r.1 .1.clone()).collect();
    let dv: Vec<bf16> = per_rank.iter().flat_map(|r| r.1 .2.clone()).collect();
    let e = &p.expected;
    let stats = [
        DQ_TOLERANCE.check("dq", &to_f32(&dq), &e.dq),
        DK_TOLERANCE.check("dk", &to_f32(&dk[..w * KV_ROW]), &e.dk_aligned),
        DV_TOLERANCE.check("dv", &to_f32(&dv[..w * KV_ROW]), &e.dv_aligned),
    ];
    for st in &stats {
        if let Err(m) = st {
            panic!("{lengths:?} over {ranks} ranks, backward on the cp forward: {m}");
        }
    }
    println!(
        "{arch:?} {lengths:?} over {ranks} ranks (device schedules: {device}): forward {o}, \
         lse max-abs {lse_err:.2e}; backward {:?}",
        stats.map(|s| s.map(|s| (s.max_abs, s.l2_rel)).ok())
    );
}

#[test]
fn cp_forward_of_packed_documents_straddling_the_boundary_then_backward() {
    check_forward(&[130, 250, 20], 2, 41, Arch::Sm90, false);
}

#[test]
fn device_rank_schedules_of_packed_documents_straddling_the_boundary() {
    check_forward(&[130, 250, 20], 2, 45, Arch::Sm90, true);
}

#[test]
fn device_rank_schedules_on_sm100_of_one_document_over_three_ranks() {
    check_forward(&[384], 3, 46, Arch::Sm100, true);
}

#[test]
fn a_bad_selection_on_a_device_rank_schedule_is_flagged_and_gives_empty_rows() {
    let p = problem(&[130, 250, 20], 47);
    let layout = CpLayout::new(&p.cu, 2).expect("layout");
    let layout = &layout;
    let per_rank = on_ranks(2, |rank, comm| {
        let rows = layout.token_rows(rank);
        let mut dev = SimDevice::new(Arch::Sm90, 3);
        let mut q2k = layout.rank_q2k(rank, &p.q2k).unwrap();
        if rank == 1 {
            // Head 0, the rank's first query: a block after its own one.
            q2k[0] = 5;
        }
        let fio = rank_forward_io(&mut dev, &p, layout, rank);
        let d_q2k = up(&mut dev, "q2k_local", &q2k);
        let mut rs = RankSchedule::new(&mut dev, layout, rank).expect("rank schedule");
        CpForward::<SimDevice>::new()
            .run_on_device(&mut dev, comm, layout, &fio, d_q2k, &mut rs)
            .expect("a flagged selection is not a host error");
        let verdict = rs.status(&mut dev);
        let bio = rank_backward_io(&mut dev, &p, layout, rank, &fio, bf16::from_f32(1.0));
        let mut backward = CpBackward::<SimDevice>::new();
        let before = backward.status(&mut dev);
        backward
            .run_on(&mut dev, comm, layout, &bio, &rs)
            .expect("cp backward");
        let group = backward.status(&mut dev);
        assert!(
            matches!(before, Err(RuntimeError::Input { .. })),
            "status before any call: {before:?}"
        );
        let out = dev.read::<bf16>(fio.out.addr, fio.out.len).expect("read");
        let lse = dev.read::<f32>(fio.lse.addr, fio.lse.len).expect("read");
        let dq = dev.read::<bf16>(bio.dq.addr, bio.dq.len).expect("read");
        (verdict, out, lse, dq, rows, group)
    });
    // Rank 1's fault reaches every rank: its queries are missing from every rank's dK/dV.
    for (rank, r) in per_rank.iter().enumerate() {
        match &r.5 {
            Err(RuntimeError::CpRankFlagged { ranks }) => assert_eq!(ranks, &[1], "rank {rank}"),
            other => panic!("rank {rank}: the group's verdict is {other:?}"),
        }
    }
    let (ok, bad) = (&per_rank[0], &per_rank[1]);
    assert!(ok.0.is_ok(), "rank 0's selection is valid");
    let e = bad.0.as_ref().unwrap_err();
    assert!(
        matches!(e, RuntimeError::ScheduleFlagged(_))
            && e.to_string()
                .contains(&format!("compact query row {}", bad.4.start)),
        "{e}"
    );
    // The flagged rank's rows are empty (never a wrong value), its dq zero.
    assert!(bad.1.iter().all(|x| x.to_f32() == 0.0));
    assert!(bad.2.iter().all(|&x| x == f32::NEG_INFINITY));
    assert!(bad.3.iter().all(|x| x.to_bits() == 0));
    // The other rank's rows are its real forward.
    assert!(ok
        .2
        .iter()
        .all(|x| x.is_finite() || *x == f32::NEG_INFINITY));
    assert!(ok.1.iter().any(|x| x.to_f32() != 0.0));
}

#[test]
fn cp_forward_of_one_document_over_three_ranks_then_backward() {
    check_forward(&[384], 3, 42, Arch::Sm90, false);
}

#[test]
fn cp_forward_on_sm100_of_tiny_documents_over_two_ranks_then_backward() {
    check_forward(&[1, 5, 127, 3, 9, 130], 2, 43, Arch::Sm100, false);
}

#[test]
fn cp_forward_rejects_a_bad_selection_before_anything_runs() {
    let p = problem(&[130, 250, 20], 44);
    let layout = CpLayout::new(&p.cu, 2).expect("layout");
    let mut q2k = layout.rank_q2k(1, &p.q2k).unwrap();
    let t1 = layout.token_rows(1).len();
    // Head 0, the rank's first query: a block after its own one.
    q2k[0] = 5;
    assert!(t1 > 0);
    let mut dev = SimDevice::new(Arch::Sm90, 3);
    let s = layout.slice_rows();
    let zeros = vec![bf16::ZERO; s * KV_ROW];
    let io = CpForwardBuffers {
        q: up(&mut dev, "q", &vec![bf16::ZERO; t1 * Q_ROW]),
        k_slice: up(&mut dev, "k", &zeros),
        v_slice: up(&mut dev, "v", &zeros),
        out: up(&mut dev, "out", &vec![bf16::ZERO; t1 * Q_ROW]),
        lse: up(&mut dev, "lse", &vec![0f32; t1 * 64]),
    };
    // A group of one rank claiming to be rank 1 of 2 would wait for its peer: the error
    // must come first, from the host checks.
    let mut comm = HostGroup::new(2).pop().unwrap();
    let e = CpForward::<SimDevice>::new()
        .run_on(&mut dev, &mut comm, &layout, &io, &q2k)
        .unwrap_err();
    assert!(matches!(e, RuntimeError::Schedule(_)), "{e}");
    assert!(
        dev.launches().is_empty(),
        "nothing may run on a bad selection"
    );
    let short = CpForwardBuffers {
        lse: Span::new(io.lse.addr, t1 * 64 - 1),
        ..io
    };
    let good = layout.rank_q2k(1, &p.q2k).unwrap();
    let e = CpForward::<SimDevice>::new()
        .run_on(&mut dev, &mut comm, &layout, &short, &good)
        .unwrap_err()
        .to_string();
    assert!(e.contains("lse"), "{e}");
    // `out` on `q`: an overlap, refused before the gather (which would wait for rank 0).
    let on_q = CpForwardBuffers { out: io.q, ..io };
    let e = CpForward::<SimDevice>::new()
        .run_on(&mut dev, &mut comm, &layout, &on_q, &good)
        .unwrap_err();
    assert!(matches!(e, RuntimeError::Overlap { .. }), "{e}");
    assert!(dev.launches().is_empty());
}
