//! The runtime's host flow (`MsaBackward::run_on`) with the simulator as its backend: the
//! launch sequence and geometry of `docs/design.md` §3.1, the workspace cache, typed input errors
//! that issue nothing, and kernel faults surfacing as `RuntimeError::Simulator`. No GPU needed.

use half::bf16;
use msa_runtime::contract::grid_launch_bound;
use msa_runtime::tasks::TaskBuildSizes;
use msa_runtime::{MsaBackward, RuntimeError, Span};
use msa_sim::backward::{self, upload, Case};
use msa_sim::device::{sim_error, Arch, SimDevice};
use msa_sim::{FaultKind, SimError};

fn tiny() -> Case {
    backward::case(&[5, 3, 130], 9).expect("case")
}

fn names(dev: &SimDevice) -> Vec<&'static str> {
    dev.launches().iter().map(|r| r.kernel).collect()
}

fn read_bits(dev: &SimDevice, s: Span<bf16>) -> Vec<u16> {
    dev.read::<bf16>(s.addr, s.len)
        .expect("read")
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

#[test]
fn run_on_issues_the_documented_sequence_and_geometry() {
    let c = tiny();
    let (t, w) = (c.schedule.num_tokens(), c.schedule.workspace_rows());
    for (arch, main, sms) in [
        (Arch::Sm90, "msa_backward_sm90", 7),
        (Arch::Sm100, "msa_backward_sm100", 3),
    ] {
        let mut dev = SimDevice::new(arch, sms);
        let io = upload(&mut dev, &c);
        MsaBackward::<SimDevice>::new()
            .run_on(&mut dev, &io, &c.schedule)
            .unwrap_or_else(|e| panic!("{arch:?}: {e}"));
        assert_eq!(
            names(&dev),
            [
                "bwd_preprocess",
                "task_scan_work",
                "task_assign_segments",
                "task_scan_bins",
                "task_scatter_tables",
                main,
                "bwd_postprocess",
            ],
            "{arch:?}: kernel order"
        );
        // Seed-design §3.1 / §2.4: the grids of the launch sequence.
        let capacity = TaskBuildSizes::new(&c.schedule, sms).unwrap().capacity;
        let l = dev.launches();
        assert_eq!(l[0].grid, (t.div_ceil(2) as u32, 1, 1), "preprocess grid");
        assert_eq!(l[1].grid, (1, 1, 1), "task_scan_work grid");
        assert_eq!(l[3].grid, (1, 1, 1), "task_scan_bins grid");
        assert_eq!(
            l[5].grid,
            (grid_launch_bound(capacity, sms) as u32, 1, 1),
            "{arch:?}: main grid for {sms} SMs"
        );
        // The Hopper kernel writes dq [T, 64, 128] itself: the postprocess only casts dK/dV
        // (its dQ half gets T = 0); the Blackwell pool is de-interleaved there.
        let dq_tokens = if arch == Arch::Sm90 { 0 } else { t };
        assert_eq!(
            l[6].grid,
            ((2 * dq_tokens).max(w / 2) as u32, 2, 1),
            "{arch:?}: postprocess grid"
        );
        let g = [io.dq, io.dk_aligned, io.dv_aligned].map(|s| {
            dev.read::<bf16>(s.addr, s.len)
                .unwrap()
                .iter()
                .map(|x| x.to_f32())
                .collect::<Vec<f32>>()
        });
        let e = &c.expected;
        for (tol, name, got, want) in [
            (msa_runtime::reference::DQ_TOLERANCE, "dq", &g[0], &e.dq),
            (
                msa_runtime::reference::DK_TOLERANCE,
                "dk",
                &g[1],
                &e.dk_aligned,
            ),
            (
                msa_runtime::reference::DV_TOLERANCE,
                "dv",
                &g[2],
                &e.dv_aligned,
            ),
        ] {
            let stats = tol
                .check(name, got, want)
                .unwrap_or_else(|m| panic!("{arch:?} {m}"));
            println!("{arch:?} {name}: {stats}");
        }
    }
}

#[test]
fn a_repeated_call_allocates_nothing_and_repeats_every_bit() {
    let c = tiny();
    let mut dev = SimDevice::new(Arch::Sm90, 5);
    let io = upload(&mut dev, &c);
    let mut b = MsaBackward::<SimDevice>::new();
    b.run_on(&mut dev, &io, &c.schedule).unwrap();
    let first = [io.dq, io.dk_aligned, io.dv_aligned].map(|s| read_bits(&dev, s));
    let allocations = b.allocation_count();
    assert_eq!(allocations, 2, "gradient workspace and task workspace");
    b.run_on(&mut dev, &io, &c.schedule).unwrap();
    assert_eq!(
        b.allocation_count(),
        allocations,
        "a second call reallocated"
    );
    let second = [io.dq, io.dk_aligned, io.dv_aligned].map(|s| read_bits(&dev, s));
    assert!(first == second, "the second call's gradients differ");
    assert_eq!(
        b.capacity(),
        Some((c.schedule.num_tokens(), c.schedule.workspace_rows()))
    );
}

/// Runs `io` and expects an input error naming `field`, with nothing launched or written.
fn expect_input_error(c: &Case, field: &str, edit: impl Fn(&mut msa_runtime::BackwardBuffers)) {
    let mut dev = SimDevice::new(Arch::Sm100, 4);
    let mut io = upload(&mut dev, c);
    let poison = vec![bf16::from_bits(0x7fc1); io.dq.len];
    dev.gpu()
        .write(msa_sim::DevPtr(io.dq.addr), &poison)
        .unwrap();
    let before = read_bits(&dev, io.dq);
    edit(&mut io);
    let err = MsaBackward::<SimDevice>::new()
        .run_on(&mut dev, &io, &c.schedule)
        .expect_err("invalid input accepted");
    match &err {
        RuntimeError::Input { field: f, .. } => assert_eq!(*f, field, "{err}"),
        other => panic!("expected an input error for `{field}`, got {other}"),
    }
    assert!(
        dev.launches().is_empty(),
        "{field}: launched {:?}",
        names(&dev)
    );
    let io_dq = Span::<bf16>::new(io.dq.addr - io.dq.addr % 16, before.len());
    assert_eq!(read_bits(&dev, io_dq), before, "{field}: dq was written");
    println!("{field}: {err}");
}

#[test]
fn invalid_inputs_are_typed_errors_that_issue_nothing() {
    let c = tiny();
    expect_input_error(&c, "q", |io| io.q = io.q.prefix(io.q.len - 1));
    expect_input_error(&c, "k_aligned", |io| {
        io.k_aligned = io.k_aligned.prefix(io.k_aligned.len - 128)
    });
    expect_input_error(&c, "lse", |io| io.lse = io.lse.prefix(io.lse.len + 64));
    expect_input_error(&c, "dv_aligned", |io| {
        io.dv_aligned = io.dv_aligned.prefix(1)
    });
    expect_input_error(&c, "dq", |io| io.dq = Span::new(io.dq.addr + 2, io.dq.len));
    expect_input_error(&c, "grad_out", |io| {
        io.grad_out = Span::new(io.grad_out.addr + 8, io.grad_out.len)
    });
}

#[test]
fn a_fault_in_the_main_kernel_is_a_simulator_error_and_stops_the_sequence() {
    let c = tiny();
    let shipped = backward::MainKernel::sm90();
    // A `trap` as the kernel's first instruction (before its first parameter load).
    let at = shipped.ptx.find("ld.param").expect("a parameter load");
    let ptx = format!("{}trap;\n\t{}", &shipped.ptx[..at], &shipped.ptx[at..]);
    let mut dev = SimDevice::new(Arch::Sm90, 4);
    dev.override_ptx(shipped.name, ptx);
    let io = upload(&mut dev, &c);
    let err = MsaBackward::<SimDevice>::new()
        .run_on(&mut dev, &io, &c.schedule)
        .expect_err("a trapping kernel passed");
    let sim = sim_error(&err).unwrap_or_else(|| panic!("not a simulator error: {err}"));
    assert!(
        matches!(
            sim,
            SimError::Fault {
                kind: FaultKind::Trap,
                ..
            }
        ),
        "{sim}"
    );
    assert!(err.to_string().contains("msa_backward_sm90"), "{err}");
    assert_eq!(
        names(&dev).last(),
        Some(&"task_scatter_tables"),
        "ran past the fault"
    );
    println!("{err}");
}
