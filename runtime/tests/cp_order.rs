//! The order in which the context-parallel flows issue their work (issue 16's overlap): the
//! K/V gather before the backward's preprocess, zeroing and task build, which do not read
//! K/V, and the collective's `wait` only right before the main kernel, the first reader; the
//! reduce-scatter after the main kernel and a `wait` before the postprocess reads its result.
//! The forward waits for its gather before its one launch. Checked on a backend and a
//! collective that only record what they are asked to do (`common::Recorder`).

mod common;

use common::Recorder;
use half::bf16;
use msa_runtime::{
    Collective, CpBackward, CpBuffers, CpForward, CpForwardBuffers, CpLayout, RuntimeError, Span,
};

/// Rank 0 of a group of two whose collectives only record their calls, in the backend's log.
struct Comm;

impl Collective<Recorder> for Comm {
    fn ranks(&self) -> usize {
        2
    }

    fn rank(&self) -> usize {
        0
    }

    fn all_gather_bf16(
        &mut self,
        backend: &mut Recorder,
        _: Span<bf16>,
        _: Span<bf16>,
    ) -> Result<(), RuntimeError> {
        backend.issued.push("gather");
        Ok(())
    }

    fn reduce_scatter_f32_in_place(
        &mut self,
        backend: &mut Recorder,
        _: Span<f32>,
    ) -> Result<(), RuntimeError> {
        backend.issued.push("reduce-scatter");
        Ok(())
    }

    fn wait(&mut self, backend: &mut Recorder) -> Result<(), RuntimeError> {
        backend.issued.push("wait");
        Ok(())
    }
}

/// Position of the first entry of `log` that starts with `what`.
fn first(log: &[&str], what: &str) -> usize {
    log.iter()
        .position(|l| l.starts_with(what))
        .unwrap_or_else(|| panic!("no `{what}` in {log:#?}"))
}

/// Position of the last entry of `log` that starts with `what`.
fn last(log: &[&str], what: &str) -> usize {
    log.iter()
        .rposition(|l| l.starts_with(what))
        .unwrap_or_else(|| panic!("no `{what}` in {log:#?}"))
}

fn setup() -> (CpLayout, Vec<i32>) {
    // Two documents, 600 tokens: 5 blocks, slices of 3.
    let cu = vec![0, 300, 600];
    let layout = CpLayout::new(&cu, 2).unwrap();
    let q2k = msa_runtime::causal_support(&cu).unwrap();
    (layout, q2k)
}

/// Distinct, aligned spans of `n` elements each.
fn spans<T>(at: &mut u64, n: usize) -> Span<T> {
    let s = Span::new(*at, n);
    *at += (n as u64 * 4).next_multiple_of(1024);
    s
}

#[test]
fn the_backward_gathers_before_its_preprocess_and_waits_only_before_the_main_kernel() {
    let (layout, q2k) = setup();
    let mut backend = Recorder::default();
    let rows = layout.token_rows(0);
    let schedule = layout
        .local_schedule(0, &layout.rank_q2k(0, &q2k).unwrap(), 64)
        .unwrap();
    let (t, s) = (rows.len(), layout.slice_rows());
    let mut at = 1u64 << 20;
    let io = CpBuffers {
        q: spans(&mut at, t * 8192),
        grad_out: spans(&mut at, t * 8192),
        out: spans(&mut at, t * 8192),
        lse: spans(&mut at, t * 64),
        k_slice: spans(&mut at, s * 512),
        v_slice: spans(&mut at, s * 512),
        dq: spans(&mut at, t * 8192),
        dk_slice: spans(&mut at, s * 512),
        dv_slice: spans(&mut at, s * 512),
    };
    CpBackward::<Recorder>::new()
        .run_on(&mut backend, &mut Comm, &layout, &io, &schedule)
        .unwrap();
    let log = &backend.issued;
    let waits: Vec<usize> = (0..log.len()).filter(|&i| log[i] == "wait").collect();
    assert!(log.contains(&"bwd_preprocess"), "{log:#?}");
    assert_eq!(waits.len(), 2, "{log:#?}");
    assert!(
        last(log, "gather") < first(log, "bwd_preprocess"),
        "{log:#?}"
    );
    assert!(last(log, "task_") < waits[0], "{log:#?}");
    assert!(waits[0] < first(log, "msa_backward_sm90"), "{log:#?}");
    assert_eq!(waits[0] + 1, first(log, "msa_backward_sm90"), "{log:#?}");
    assert!(first(log, "msa_backward_sm90") < first(log, "reduce-scatter"));
    assert!(last(log, "reduce-scatter") < waits[1], "{log:#?}");
    // The last postprocess rounds the reduced pools (the one before it, inside the local
    // backward, finishes dQ alone).
    assert!(waits[1] < last(log, "bwd_postprocess"), "{log:#?}");
}

#[test]
fn the_forward_waits_for_its_gather_before_its_launch() {
    let (layout, q2k) = setup();
    let mut backend = Recorder::default();
    let (t, s) = (layout.token_rows(0).len(), layout.slice_rows());
    let mut at = 1u64 << 20;
    let io = CpForwardBuffers {
        q: spans(&mut at, t * 8192),
        k_slice: spans(&mut at, s * 512),
        v_slice: spans(&mut at, s * 512),
        out: spans(&mut at, t * 8192),
        lse: spans(&mut at, t * 64),
    };
    CpForward::<Recorder>::new()
        .run_on(
            &mut backend,
            &mut Comm,
            &layout,
            &io,
            &layout.rank_q2k(0, &q2k).unwrap(),
        )
        .unwrap();
    let log = &backend.issued;
    let events: Vec<&str> = log
        .iter()
        .copied()
        .filter(|l| ["gather", "wait", "msa_forward_sm90"].contains(l))
        .collect();
    assert_eq!(
        events,
        ["gather", "gather", "wait", "msa_forward_sm90"],
        "{log:#?}"
    );
    assert!(
        first(log, "cp forward tables") < first(log, "gather"),
        "{log:#?}"
    );
}
