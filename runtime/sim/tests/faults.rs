//! Planted bugs: each must be reported with the kernel, PC, source line, CTA and thread (or,
//! for a deadlock, every blocked warp's PC and barrier), never hang or pass silently.

use msa_sim::{
    Arg, FaultKind, Gpu, LaunchConfig, Limits, MemoryFaultKind, Module, ParseError, SimError,
};

const HEADER: &str = ".version 8.0\n.target sm_90a\n.address_size 64\n";

fn module(body: &str) -> Module {
    let text = format!("{HEADER}{body}");
    Module::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// Line (1-based) of the first line of `HEADER + body` containing `needle`.
fn line_of(body: &str, needle: &str) -> usize {
    format!("{HEADER}{body}")
        .lines()
        .position(|l| l.contains(needle))
        .expect("needle present")
        + 1
}

const STORE_TID: &str = r#"
.visible .entry oob(
	.param .u64 .ptr .align 16 buf
)
{
	.reg .u32 %r<4>;
	.reg .u64 %rd<4>;
	ld.param.u64 %rd0, [buf];
	cvta.to.global.u64 %rd1, %rd0;
	mov.u32 %r0, %tid.x;
	mov.u32 %r1, %ctaid.x;
	mad.lo.u32 %r2, %r1, 64, %r0;
	mul.wide.u32 %rd2, %r2, 4;
	add.u64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r2; // the store
	ret;
}
"#;

#[test]
fn out_of_bounds_global_store_names_kernel_pc_cta_and_thread() {
    let m = module(STORE_TID);
    let mut gpu = Gpu::new();
    // 100 elements, 2 CTAs of 64 threads: thread 36 of CTA 1 writes element 100.
    let buf = gpu.alloc("buf", 100 * 4);
    let err = gpu
        .launch(
            m.kernel("oob").unwrap(),
            &LaunchConfig::new((2, 1, 1), (64, 1, 1)),
            &[Arg::Ptr(buf)],
        )
        .unwrap_err();
    let SimError::Fault { at, kind } = &err else {
        panic!("expected a fault, got {err}")
    };
    assert_eq!(at.kernel, "oob");
    assert_eq!(at.cta, [1, 0, 0]);
    assert_eq!(at.thread, [36, 0, 0]);
    assert_eq!(at.pc, 7);
    assert_eq!(at.line, line_of(STORE_TID, "// the store"));
    assert_eq!(at.instruction, "st.global.u32 [%rd3], %r2;");
    let FaultKind::Memory(mf) = kind else {
        panic!("{kind}")
    };
    assert_eq!(mf.kind, MemoryFaultKind::OutOfBounds);
    assert_eq!(mf.address, buf.addr() + 400);
    assert_eq!(mf.size, 4);
    let msg = err.to_string();
    for part in [
        "out-of-bounds global store of 4 bytes",
        "0 bytes past the end of allocation `buf`",
        "kernel `oob`",
        "pc 7",
        "CTA (1,0,0)",
        "thread (36,0,0)",
    ] {
        assert!(msg.contains(part), "`{part}` missing in: {msg}");
    }
    // Earlier threads of the faulting CTA and all of CTA 0 did store.
    let v: Vec<u32> = gpu.read(buf, 100).unwrap();
    assert_eq!(v[..64], (0..64).collect::<Vec<u32>>()[..]);
}

#[test]
fn unallocated_and_misaligned_accesses_fault() {
    let m = module(STORE_TID);
    let k = m.kernel("oob").unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1));
    // A pointer truncated to 32 bits points at no allocation.
    let mut gpu = Gpu::new();
    let buf = gpu.alloc("buf", 1024);
    let err = gpu
        .launch(k, &cfg, &[Arg::U64(buf.addr() & 0xffff_ffff)])
        .unwrap_err();
    assert!(err.to_string().contains("below every allocation"), "{err}");
    // A pointer off by 2 bytes: misaligned 4-byte stores.
    let err = gpu.launch(k, &cfg, &[Arg::Ptr(buf.offset(2))]).unwrap_err();
    let SimError::Fault {
        at,
        kind: FaultKind::Memory(mf),
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(mf.kind, MemoryFaultKind::Misaligned);
    assert_eq!(at.thread, [0, 0, 0]);
}

#[test]
fn shared_memory_is_bounds_checked() {
    let body = r#"
.visible .entry sh()
{
	.reg .u32 %r<4>;
	.shared .align 4 .b8 tile[256];
	mov.u32 %r0, %tid.x;
	shl.b32 %r1, %r0, 2;
	mov.u32 %r2, tile;
	add.u32 %r3, %r2, %r1;
	st.shared.u32 [%r3+-4], %r0;
	ret;
}
"#;
    let m = module(body);
    let mut gpu = Gpu::new();
    let err = gpu
        .launch(
            m.kernel("sh").unwrap(),
            &LaunchConfig::new((1, 1, 1), (65, 1, 1)),
            &[],
        )
        .unwrap_err();
    // Thread 0 writes tile[-1]: the address wraps below 0.
    let SimError::Fault { at, kind } = &err else {
        panic!("{err}")
    };
    assert_eq!(at.thread, [0, 0, 0]);
    assert!(
        kind.to_string().contains("out-of-bounds shared store"),
        "{kind}"
    );
    assert!(
        kind.to_string().contains("256 bytes of shared memory"),
        "{kind}"
    );
}

const HALF_BARRIER: &str = r#"
.visible .entry hang()
{
	.reg .pred %p<2>;
	.reg .u32 %r<2>;
	mov.u32 %r0, %tid.x;
	setp.ge.u32 %p0, %r0, 32;
	@%p0 bra $L_0_done;
	bar.sync 1, 64; // only warp 0 gets here
$L_0_done:
	ret;
}
"#;

#[test]
fn a_barrier_not_all_threads_reach_is_a_deadlock() {
    let m = module(HALF_BARRIER);
    let mut gpu = Gpu::new();
    let err = gpu
        .launch(
            m.kernel("hang").unwrap(),
            &LaunchConfig::new((1, 1, 1), (64, 1, 1)),
            &[],
        )
        .unwrap_err();
    let SimError::Deadlock(stall) = &err else {
        panic!("expected a deadlock, got {err}")
    };
    assert_eq!(stall.kernel, "hang");
    assert_eq!(stall.cta, [0, 0, 0]);
    assert_eq!(stall.warps.len(), 1, "warp 1 exited: {err}");
    let w = &stall.warps[0];
    assert_eq!(w.warp, 0);
    assert_eq!(w.groups.len(), 1);
    let g = &w.groups[0];
    assert_eq!(g.lanes, u32::MAX);
    assert_eq!(g.pc, 3);
    assert_eq!(g.line, line_of(HALF_BARRIER, "bar.sync 1, 64"));
    assert_eq!(g.instruction, "bar.sync 1, 64;");
    assert_eq!(
        g.waiting_for,
        "blocked on barrier 1 (32 of 64 threads arrived)"
    );
    let msg = err.to_string();
    assert!(msg.contains("deadlock"), "{msg}");
    assert!(msg.contains("warp 0 lanes 0-31: pc 3"), "{msg}");
}

#[test]
fn warps_waiting_on_different_barriers_are_a_deadlock() {
    let body = r#"
.visible .entry crossed()
{
	.reg .pred %p<2>;
	.reg .u32 %r<2>;
	mov.u32 %r0, %tid.x;
	setp.ge.u32 %p0, %r0, 32;
	@%p0 bra $L_0_second;
	bar.sync 0;
	ret;
$L_0_second:
	bar.sync 2, 64;
	ret;
}
"#;
    let m = module(body);
    let mut gpu = Gpu::new();
    let err = gpu
        .launch(
            m.kernel("crossed").unwrap(),
            &LaunchConfig::new((1, 1, 1), (64, 1, 1)),
            &[],
        )
        .unwrap_err();
    let SimError::Deadlock(stall) = &err else {
        panic!("{err}")
    };
    let waits: Vec<(u32, usize, &str)> = stall
        .warps
        .iter()
        .map(|w| (w.warp, w.groups[0].pc, w.groups[0].waiting_for.as_str()))
        .collect();
    assert_eq!(
        waits,
        [
            (
                0,
                3,
                "blocked on barrier 0 (all threads of the CTA; 32 of 64 live threads arrived)"
            ),
            (1, 5, "blocked on barrier 2 (32 of 64 threads arrived)"),
        ],
        "{err}"
    );
}

#[test]
fn a_divergent_shuffle_is_reported() {
    let body = r#"
.visible .entry div()
{
	.reg .pred %p<2>;
	.reg .u32 %r<3>;
	mov.u32 %r0, %laneid;
	setp.lt.u32 %p0, %r0, 16;
	@%p0 bra $L_0_skip;
	shfl.sync.bfly.b32 %r1, %r0, 1, 0x1f, 0xffffffff;
$L_0_skip:
	ret;
}
"#;
    let m = module(body);
    let mut gpu = Gpu::new();
    let err = gpu
        .launch(
            m.kernel("div").unwrap(),
            &LaunchConfig::new((1, 1, 1), (32, 1, 1)),
            &[],
        )
        .unwrap_err();
    let SimError::Fault {
        at,
        kind: FaultKind::Sync(msg),
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(at.pc, 3);
    assert_eq!(at.thread, [16, 0, 0]);
    assert!(msg.contains("lane 0 is not converged"), "{msg}");
}

#[test]
fn division_by_zero_faults() {
    let body = r#"
.visible .entry dz()
{
	.reg .u32 %r<3>;
	mov.u32 %r0, %tid.x;
	div.u32 %r1, 100, %r0;
	ret;
}
"#;
    let m = module(body);
    let err = Gpu::new()
        .launch(
            m.kernel("dz").unwrap(),
            &LaunchConfig::new((1, 1, 1), (32, 1, 1)),
            &[],
        )
        .unwrap_err();
    assert!(
        matches!(&err, SimError::Fault { at, kind: FaultKind::DivisionByZero } if at.thread == [0, 0, 0]),
        "{err}"
    );
}

#[test]
fn an_infinite_loop_hits_the_step_limit() {
    let body = r#"
.visible .entry spin()
{
$L_0_top:
	bra $L_0_top;
}
"#;
    let m = module(body);
    let mut gpu = Gpu::with_limits(Limits {
        max_steps_per_cta: 10_000,
        ..Limits::default()
    });
    let err = gpu
        .launch(
            m.kernel("spin").unwrap(),
            &LaunchConfig::new((1, 1, 1), (64, 1, 1)),
            &[],
        )
        .unwrap_err();
    let SimError::StepLimit { limit, stall } = &err else {
        panic!("{err}")
    };
    assert_eq!(*limit, 10_000);
    assert_eq!(stall.warps.len(), 2);
    assert!(err.to_string().contains("pc 0"), "{err}");
}

#[test]
fn bad_launches_are_rejected_before_running() {
    let m = module(STORE_TID);
    let k = m.kernel("oob").unwrap();
    let mut gpu = Gpu::new();
    let buf = gpu.alloc("buf", 4096);
    let cfg = LaunchConfig::new((1, 1, 1), (64, 1, 1));
    let msg = |r: Result<_, SimError>| r.unwrap_err().to_string();
    assert!(msg(gpu.launch(k, &cfg, &[])).contains("0 arguments given, the kernel declares 1"));
    assert!(msg(gpu.launch(k, &cfg, &[Arg::U32(1)])).contains("wrong kind"));
    let big = LaunchConfig::new((1, 1, 1), (2048, 1, 1));
    assert!(msg(gpu.launch(k, &big, &[Arg::Ptr(buf)])).contains("2048 threads"));
    let empty = LaunchConfig::new((0, 1, 1), (64, 1, 1));
    assert!(msg(gpu.launch(k, &empty, &[Arg::Ptr(buf)])).contains("empty grid"));
    let shared = cfg.with_dynamic_shared(300 * 1024);
    assert!(msg(gpu.launch(k, &shared, &[Arg::Ptr(buf)])).contains("shared memory"));
}

#[test]
fn unsupported_and_malformed_text_name_the_line() {
    let text = format!(
        "{HEADER}.visible .entry k()\n{{\n\t.reg .f32 %f<2>;\n\tadd.rz.f32 %f0, %f1, %f1;\n\tret;\n}}\n"
    );
    match Module::parse(&text) {
        Err(ParseError::Unsupported {
            opcode, line, text, ..
        }) => {
            assert_eq!(opcode, "add.rz.f32");
            assert_eq!(line, 7);
            assert_eq!(text, "add.rz.f32 %f0, %f1, %f1;");
        }
        other => panic!("{other:?}"),
    }
    let e = Module::parse(&text).unwrap_err().to_string();
    assert!(
        e.starts_with("unsupported instruction `add.rz.f32` at line 7"),
        "{e}"
    );

    let bad = format!(
        "{HEADER}.visible .entry k()\n{{\n\t.reg .u32 %r<2>;\n\tadd.u32 %r0, %r9, 1;\n}}\n"
    );
    let e = Module::parse(&bad).unwrap_err();
    assert!(matches!(e, ParseError::Syntax { line: 7, .. }), "{e}");
    assert!(
        e.to_string().contains("`%r9` is not a declared register"),
        "{e}"
    );

    let label = format!("{HEADER}.visible .entry k()\n{{\n\tbra $L_nowhere;\n}}\n");
    let e = Module::parse(&label).unwrap_err().to_string();
    assert!(e.contains("unknown label `$L_nowhere`"), "{e}");
}
