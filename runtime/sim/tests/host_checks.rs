//! The backward's host checks on its buffers (issue 12): a null base, or an output overlapping
//! another output or an input, is a typed error naming the buffers, issued before anything
//! runs; exact in-place use of an input is accepted only after `allow_in_place(true)`, and
//! then gives the reference's gradients. No GPU needed.

use half::bf16;
use msa_runtime::reference::{DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{BackwardBuffers, MsaBackward, RuntimeError, Span};
use msa_sim::backward::{self, to_f32, upload, Case};
use msa_sim::device::{Arch, SimDevice};
use msa_sim::DevPtr;

const FIELDS: [&str; 9] = [
    "q",
    "k_aligned",
    "v_aligned",
    "grad_out",
    "lse",
    "out",
    "dq",
    "dk_aligned",
    "dv_aligned",
];

fn tiny() -> Case {
    backward::case(&[5, 130], 21).expect("case")
}

/// The base address of field `name`, for editing.
fn addr_mut<'a>(io: &'a mut BackwardBuffers, name: &str) -> &'a mut u64 {
    match name {
        "q" => &mut io.q.addr,
        "k_aligned" => &mut io.k_aligned.addr,
        "v_aligned" => &mut io.v_aligned.addr,
        "grad_out" => &mut io.grad_out.addr,
        "lse" => &mut io.lse.addr,
        "out" => &mut io.out.addr,
        "dq" => &mut io.dq.addr,
        "dk_aligned" => &mut io.dk_aligned.addr,
        "dv_aligned" => &mut io.dv_aligned.addr,
        _ => unreachable!("{name}"),
    }
}

/// Runs `edit`ed buffers and returns the error, after checking that nothing was launched and
/// that no output changed.
fn refused(c: &Case, in_place: bool, edit: impl Fn(&mut BackwardBuffers)) -> RuntimeError {
    let mut dev = SimDevice::new(Arch::Sm90, 4);
    let mut io = upload(&mut dev, c);
    let marker = |len| vec![bf16::from_bits(0x7fc1); len];
    for s in [io.dq, io.dk_aligned, io.dv_aligned] {
        dev.gpu().write(DevPtr(s.addr), &marker(s.len)).unwrap();
    }
    let outputs = [io.dq, io.dk_aligned, io.dv_aligned];
    edit(&mut io);
    let err = MsaBackward::<SimDevice>::new()
        .allow_in_place(in_place)
        .run_on(&mut dev, &io, &c.schedule)
        .expect_err("bad buffers accepted");
    assert!(dev.launches().is_empty(), "{err}: something was launched");
    for s in outputs {
        let now = dev.read::<bf16>(s.addr, s.len).unwrap();
        assert!(now.iter().all(|x| x.to_bits() == 0x7fc1), "{err}: written");
    }
    err
}

#[test]
fn a_null_base_is_refused_for_every_buffer() {
    let c = tiny();
    for field in FIELDS {
        let err = refused(&c, false, |io| *addr_mut(io, field) = 0);
        match &err {
            RuntimeError::NullBuffer { field: f } => assert_eq!(*f, field, "{err}"),
            other => panic!("{field}: expected NullBuffer, got {other}"),
        }
        assert!(err.to_string().contains(field), "{err}");
    }
}

/// Expects an overlap error naming `a` and `b` (in either order).
fn expect_overlap(err: &RuntimeError, a: &str, b: &str) {
    match err {
        RuntimeError::Overlap { first, second, .. } => {
            let mut got = [*first, *second];
            let mut want = [a, b];
            got.sort_unstable();
            want.sort_unstable();
            assert_eq!(got, want, "{err}");
        }
        other => panic!("expected an overlap of `{a}` and `{b}`, got {other}"),
    }
    println!("{err}");
}

#[test]
fn outputs_overlapping_each_other_are_refused_even_in_place() {
    let c = tiny();
    for in_place in [false, true] {
        // The case: dv_aligned aliasing dk_aligned returned Ok with a wrong dk.
        let err = refused(&c, in_place, |io| io.dv_aligned.addr = io.dk_aligned.addr);
        expect_overlap(&err, "dk_aligned", "dv_aligned");
        // dk_aligned carved from inside dq.
        let err = refused(&c, in_place, |io| io.dk_aligned.addr = io.dq.addr + 16);
        expect_overlap(&err, "dq", "dk_aligned");
    }
}

#[test]
fn an_output_on_an_input_needs_the_explicit_opt_in() {
    let c = tiny();
    let err = refused(&c, false, |io| io.dq.addr = io.q.addr);
    expect_overlap(&err, "q", "dq");
    assert!(err.to_string().contains("allow_in_place"), "{err}");
    let err = refused(&c, false, |io| io.dk_aligned.addr = io.v_aligned.addr);
    expect_overlap(&err, "v_aligned", "dk_aligned");
    // Partial overlaps are never accepted, nor an output on an input of another size.
    let err = refused(&c, true, |io| io.dq.addr = io.out.addr + 256);
    expect_overlap(&err, "out", "dq");
    let err = refused(&c, true, |io| io.dq.addr = io.lse.addr);
    expect_overlap(&err, "lse", "dq");
}

#[test]
fn inputs_may_share_memory() {
    // Inputs are only read: q and grad_out on the same bytes is accepted (and computes the
    // backward of dO = q, which the reference does not cover, so only success is checked).
    let c = tiny();
    let mut dev = SimDevice::new(Arch::Sm90, 4);
    let mut io = upload(&mut dev, &c);
    io.grad_out.addr = io.q.addr;
    MsaBackward::<SimDevice>::new()
        .run_on(&mut dev, &io, &c.schedule)
        .expect("overlapping inputs");
}

#[test]
fn in_place_outputs_give_the_reference_gradients() {
    let c = tiny();
    let (t, w) = (c.schedule.num_tokens(), c.schedule.workspace_rows());
    for arch in [Arch::Sm90, Arch::Sm100] {
        // dq on each input of its size: on q and grad_out (which the main kernel reads) it
        // needs a separate dQ pool; on out (read only by the preprocess, before dq is zeroed)
        // the main kernel reduces into dq itself, as without in-place use.
        for dq_on in ["q", "grad_out", "out"] {
            let mut dev = SimDevice::new(arch, 4);
            let mut io = upload(&mut dev, &c);
            // Every output on top of an input of the same shape.
            let base = match dq_on {
                "q" => io.q,
                "grad_out" => io.grad_out,
                _ => io.out,
            };
            io.dq = Span::new(base.addr, base.len);
            io.dk_aligned = Span::new(io.k_aligned.addr, io.k_aligned.len);
            io.dv_aligned = Span::new(io.v_aligned.addr, io.v_aligned.len);
            let mut backward = MsaBackward::<SimDevice>::new();
            backward
                .allow_in_place(true)
                .run_on(&mut dev, &io, &c.schedule)
                .unwrap_or_else(|e| panic!("{arch:?}, dq on {dq_on}: {e}"));
            let layout = backward.pool_layout().expect("allocated");
            assert_eq!(
                layout.dq_pool.is_some(),
                dq_on != "out",
                "{arch:?}, dq on {dq_on}: {layout:?}"
            );
            let read = |s: Span<bf16>| to_f32(&dev.read::<bf16>(s.addr, s.len).unwrap());
            let e = &c.expected;
            DQ_TOLERANCE.check("dq", &read(io.dq), &e.dq).unwrap();
            DK_TOLERANCE
                .check("dk", &read(io.dk_aligned), &e.dk_aligned)
                .unwrap();
            DV_TOLERANCE
                .check("dv", &read(io.dv_aligned), &e.dv_aligned)
                .unwrap();
            println!("{arch:?}: dq on {dq_on}: reference gradients, {layout:?}");
        }
    }
    // Without in-place use the workspace holds no dQ pool: dK/dV pools and delta only.
    let mut dev = SimDevice::new(Arch::Sm90, 4);
    let io = upload(&mut dev, &c);
    let mut backward = MsaBackward::<SimDevice>::new();
    backward
        .run_on(&mut dev, &io, &c.schedule)
        .expect("backward");
    assert_eq!(
        backward.pool_layout(),
        Some(msa_runtime::backward::PoolLayout::new(t, w, false).unwrap())
    );
}
