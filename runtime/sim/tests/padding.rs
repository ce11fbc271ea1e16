//! The padding rows of the aligned layout (issue 12): the runtime's `kv_to_aligned` writes
//! every aligned row, so K/V buffers that start as NaN (what `torch.empty` may hand out) give
//! the same gradients as zero-padded ones; `kv_from_aligned` is its inverse on the real rows.
//! Expected values come from the CPU reference (`reference::to_aligned`/`from_aligned`, and
//! `reference::backward` through `msa_sim::backward::case`), never from the kernels.

use half::bf16;
use msa_runtime::reference::{self, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{
    build_schedule, causal_support, from_aligned_on, to_aligned_on, BackwardBuffers, MsaBackward,
    Schedule, Span,
};
use msa_sim::backward::{self, download_gradients, to_bf16, to_f32, upload, Inputs, Rng, KV_ROW};
use msa_sim::device::{Arch, SimDevice};
use msa_sim::DevPtr;

/// A quiet NaN in bf16.
const NAN: u16 = 0x7fc1;

fn nans(n: usize) -> Vec<bf16> {
    vec![bf16::from_bits(NAN); n]
}

fn span(dev: &mut SimDevice, name: &str, data: &[bf16]) -> Span<bf16> {
    let b = dev.upload_new(name, data);
    Span::new(b.ptr.0, data.len())
}

fn bits(dev: &SimDevice, s: Span<bf16>) -> Vec<u16> {
    dev.read::<bf16>(s.addr, s.len)
        .expect("read")
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn to_bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Rows `[W, 4, 128]` that are padding: not covered by any document's real rows.
fn padding_rows(s: &Schedule) -> Vec<usize> {
    let mut real = vec![false; s.workspace_rows()];
    let cu = s.cu_seqlens();
    for (d, &ws) in s.document_workspace_starts().iter().enumerate() {
        for r in 0..(cu[d + 1] - cu[d]) as usize {
            real[ws as usize + r] = true;
        }
    }
    (0..real.len()).filter(|&r| !real[r]).collect()
}

/// The causal schedule over `cu` with an extra gap of `gap_blocks` key blocks before every
/// document after the first (valid: `document_workspace_starts` may leave gaps).
fn schedule_with_gaps(cu: &[i32], gap_blocks: i32) -> Schedule {
    let s = build_schedule(&causal_support(cu).unwrap(), cu, 64).unwrap();
    let starts: Vec<i32> = s
        .document_workspace_starts()
        .iter()
        .enumerate()
        .map(|(d, &ws)| ws + 128 * gap_blocks * d as i32)
        .collect();
    Schedule::new(
        s.row_ptr().to_vec(),
        s.q_indices().to_vec(),
        s.scheduler_metadata().to_vec(),
        s.work_count(),
        cu.to_vec(),
        starts,
    )
    .expect("a schedule with gaps between documents")
}

#[test]
fn to_aligned_writes_every_row_and_from_aligned_inverts_it() {
    let cu = [0, 5, 8, 138, 394];
    for (name, s) in [
        (
            "dense",
            build_schedule(&causal_support(&cu).unwrap(), &cu, 64).unwrap(),
        ),
        ("with gaps", schedule_with_gaps(&cu, 2)),
    ] {
        let (t, w) = (s.num_tokens(), s.workspace_rows());
        let mut rng = Rng(12);
        let (k, _) = rng.bf16s(t * KV_ROW);
        let (v, _) = rng.bf16s(t * KV_ROW);
        // The expected aligned rows, row by row from the documents' starts.
        let mut want_k = vec![0u16; w * KV_ROW];
        let mut want_v = vec![0u16; w * KV_ROW];
        for (d, &ws) in s.document_workspace_starts().iter().enumerate() {
            for r in 0..(cu[d + 1] - cu[d]) as usize {
                let (src, dst) = ((cu[d] as usize + r) * KV_ROW, (ws as usize + r) * KV_ROW);
                for e in 0..KV_ROW {
                    want_k[dst + e] = k[src + e].to_bits();
                    want_v[dst + e] = v[src + e].to_bits();
                }
            }
        }
        if name == "dense" {
            // The CPU reference's scatter agrees (zero padding, same rows).
            let cpu = to_bf16(&reference::to_aligned(&to_f32(&k), &cu, 4).unwrap());
            assert_eq!(to_bits(&cpu), want_k, "reference::to_aligned");
        }
        for arch in [Arch::Sm90, Arch::Sm100] {
            let mut dev = SimDevice::new(arch, 4);
            let (ks, vs) = (span(&mut dev, "k", &k), span(&mut dev, "v", &v));
            let ka = span(&mut dev, "k_aligned", &nans(w * KV_ROW));
            let va = span(&mut dev, "v_aligned", &nans(w * KV_ROW));
            to_aligned_on(&mut dev, &s, ks, vs, ka, va).expect("to_aligned_on");
            assert_eq!(bits(&dev, ka), want_k, "{name} {arch:?}: k_aligned");
            assert_eq!(bits(&dev, va), want_v, "{name} {arch:?}: v_aligned");
            let (dk, dv) = (
                span(&mut dev, "dk", &nans(t * KV_ROW)),
                span(&mut dev, "dv", &nans(t * KV_ROW)),
            );
            from_aligned_on(&mut dev, &s, ka, va, dk, dv).expect("from_aligned_on");
            assert_eq!(bits(&dev, dk), to_bits(&k), "{name} {arch:?}: k round trip");
            assert_eq!(bits(&dev, dv), to_bits(&v), "{name} {arch:?}: v round trip");
            assert!(!padding_rows(&s).is_empty());
        }
    }
}

#[test]
fn layout_moves_check_lengths_and_overlaps_before_launching() {
    let cu = [0, 5, 130];
    let s = build_schedule(&causal_support(&cu).unwrap(), &cu, 64).unwrap();
    let (t, w) = (s.num_tokens(), s.workspace_rows());
    let mut dev = SimDevice::new(Arch::Sm90, 4);
    let k = span(&mut dev, "k", &vec![bf16::ONE; t * KV_ROW]);
    let ka = span(&mut dev, "k_aligned", &nans(w * KV_ROW));
    let va = span(&mut dev, "v_aligned", &nans(w * KV_ROW));
    let err = to_aligned_on(&mut dev, &s, k, k.prefix(t * KV_ROW - 1), ka, va).unwrap_err();
    assert!(err.to_string().contains("input `v`"), "{err}");
    let err = to_aligned_on(&mut dev, &s, k, k, ka, ka).unwrap_err();
    assert!(
        err.to_string().contains("`k_aligned`") && err.to_string().contains("`v_aligned`"),
        "{err}"
    );
    let err = to_aligned_on(&mut dev, &s, k, k, ka, Span::new(0, w * KV_ROW)).unwrap_err();
    assert!(err.to_string().contains("null"), "{err}");
    assert!(dev.launches().is_empty(), "a refused call launched");
    assert!(
        bits(&dev, ka).iter().all(|&b| b == NAN),
        "k_aligned written"
    );
}

/// The backward with its aligned K/V (and outputs) NaN-filled, then rebuilt on the device from
/// compact rows by `to_aligned_on`: finite gradients within the tolerances of the reference.
fn nan_filled_run(arch: Arch) {
    let c = backward::case(&[5, 3, 130], 9).expect("case");
    let cu = c.schedule.cu_seqlens().to_vec();
    let (t, w) = (c.schedule.num_tokens(), c.schedule.workspace_rows());
    let k = to_bf16(&reference::from_aligned(&to_f32(&c.k_aligned), &cu, 4).unwrap());
    let v = to_bf16(&reference::from_aligned(&to_f32(&c.v_aligned), &cu, 4).unwrap());
    let mut dev = SimDevice::new(arch, 5);
    let io: BackwardBuffers = upload(&mut dev, &c);
    // Garbage in every row of the aligned inputs and outputs, padding included.
    for s in [io.k_aligned, io.v_aligned, io.dk_aligned, io.dv_aligned] {
        dev.gpu().write(DevPtr(s.addr), &nans(s.len)).unwrap();
    }
    let (ks, vs) = (span(&mut dev, "k", &k), span(&mut dev, "v", &v));
    to_aligned_on(&mut dev, &c.schedule, ks, vs, io.k_aligned, io.v_aligned).unwrap();
    MsaBackward::<SimDevice>::new()
        .run_on(&mut dev, &io, &c.schedule)
        .unwrap_or_else(|e| panic!("{arch:?}: {e}"));
    let g = download_gradients(&mut dev, &c.schedule, &io).unwrap();
    let e = &c.expected;
    let dk_want = reference::from_aligned(&e.dk_aligned, &cu, 4).unwrap();
    let dv_want = reference::from_aligned(&e.dv_aligned, &cu, 4).unwrap();
    for (tol, name, got, want) in [
        (DQ_TOLERANCE, "dq", &g.dq, &e.dq),
        (DK_TOLERANCE, "dk", &g.dk, &dk_want),
        (DV_TOLERANCE, "dv", &g.dv, &dv_want),
    ] {
        let got = to_f32(got);
        assert!(
            got.iter().all(|x| x.is_finite()),
            "{arch:?} {name}: non-finite"
        );
        let stats = tol
            .check(name, &got, want)
            .unwrap_or_else(|m| panic!("{arch:?} {m}"));
        println!("{arch:?} {name}: {stats}");
    }
    // The aligned gradients' padding rows are zero, as documented.
    let dk = bits(&dev, io.dk_aligned);
    for r in padding_rows(&c.schedule) {
        assert!(dk[r * KV_ROW..(r + 1) * KV_ROW].iter().all(|&b| b == 0));
    }
    assert!(t < w && dk.len() == w * KV_ROW);
}

#[test]
fn nan_in_every_padding_row_cannot_reach_the_gradients_sm90() {
    nan_filled_run(Arch::Sm90);
}

#[test]
fn nan_in_every_padding_row_cannot_reach_the_gradients_sm100() {
    nan_filled_run(Arch::Sm100);
}

/// Why the contract exists: aligned buffers whose padding rows hold NaN, passed straight to
/// the backward (no `to_aligned`), poison the gradients. If the main kernels ever become
/// immune, this test fails and the `BackwardBuffers` docs should say so.
#[test]
fn nan_padding_written_by_hand_poisons_the_gradients() {
    let c = backward::case(&[5, 130], 10).expect("case");
    let mut dev = SimDevice::new(Arch::Sm90, 5);
    let io = upload(&mut dev, &c);
    for s in [io.k_aligned, io.v_aligned] {
        let mut data = c.k_aligned.clone();
        if s.addr == io.v_aligned.addr {
            data = c.v_aligned.clone();
        }
        for r in padding_rows(&c.schedule) {
            data[r * KV_ROW..(r + 1) * KV_ROW].fill(bf16::from_bits(NAN));
        }
        dev.gpu().write(DevPtr(s.addr), &data).unwrap();
    }
    MsaBackward::<SimDevice>::new()
        .run_on(&mut dev, &io, &c.schedule)
        .unwrap();
    let dq = to_f32(&dev.read::<bf16>(io.dq.addr, io.dq.len).unwrap());
    let bad = dq.iter().filter(|x| !x.is_finite()).count();
    println!("non-finite dq values: {bad} of {}", dq.len());
    assert!(bad > 0, "NaN padding no longer reaches dq: update the docs");
}

#[test]
fn the_upload_helper_runs_user_tensors() {
    let c = backward::case(&[3, 129], 11).expect("case");
    let cu = c.schedule.cu_seqlens().to_vec();
    let k = to_bf16(&reference::from_aligned(&to_f32(&c.k_aligned), &cu, 4).unwrap());
    let v = to_bf16(&reference::from_aligned(&to_f32(&c.v_aligned), &cu, 4).unwrap());
    let inputs = Inputs {
        q: &c.q,
        k: &k,
        v: &v,
        grad_out: &c.dout,
        lse: &c.lse,
        out: &c.out,
    };
    let mut dev = SimDevice::new(Arch::Sm100, 3);
    let io = backward::upload_inputs(&mut dev, &c.schedule, &inputs).unwrap();
    MsaBackward::<SimDevice>::new()
        .run_on(&mut dev, &io, &c.schedule)
        .unwrap();
    let g = download_gradients(&mut dev, &c.schedule, &io).unwrap();
    let e = &c.expected;
    let dk_want = reference::from_aligned(&e.dk_aligned, &cu, 4).unwrap();
    DQ_TOLERANCE.check("dq", &to_f32(&g.dq), &e.dq).unwrap();
    DK_TOLERANCE.check("dk", &to_f32(&g.dk), &dk_want).unwrap();
}
