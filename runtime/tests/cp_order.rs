//! The order in which the context-parallel flows issue their work (issue 16's overlap): the
//! K/V gather before the backward's preprocess, zeroing and task build, which do not read
//! K/V, and the collective's `wait` only right before the main kernel, the first reader; the
//! reduce-scatter after the main kernel and a `wait` before the postprocess reads its result.
//! The forward waits for its gather before its one launch. Checked on a backend and a
//! collective that only record what they are asked to do.

use half::bf16;
use msa_runtime::backend::TileMapSpec;
use msa_runtime::tma::TensorMap;
use msa_runtime::{
    Backend, Collective, CpBackward, CpBuffers, CpForward, CpForwardBuffers, CpLayout, KernelArg,
    KernelSpec, RuntimeError, Span,
};
use std::cell::RefCell;
use std::rc::Rc;

type Log = Rc<RefCell<Vec<String>>>;

struct Recorder {
    next: u64,
    log: Log,
}

impl Backend for Recorder {
    type Buffer = u64;

    fn capability(&self) -> (i32, i32) {
        (9, 0)
    }

    fn sm_count(&self) -> usize {
        132
    }

    fn ordinal(&self) -> usize {
        0
    }

    fn memory_space(&self) -> u64 {
        7
    }

    fn alloc(&mut self, _what: &'static str, bytes: usize) -> Result<u64, RuntimeError> {
        let addr = self.next;
        self.next += (bytes as u64).next_multiple_of(1024).max(1024);
        Ok(addr)
    }

    fn address(&self, buffer: &u64) -> u64 {
        *buffer
    }

    fn upload(&mut self, what: &'static str, _: u64, _: &[u8]) -> Result<(), RuntimeError> {
        self.log.borrow_mut().push(format!("upload {what}"));
        Ok(())
    }

    fn zero(&mut self, what: &'static str, _: u64, _: usize) -> Result<(), RuntimeError> {
        self.log.borrow_mut().push(format!("zero {what}"));
        Ok(())
    }

    fn download(&mut self, _: &'static str, _: u64, bytes: usize) -> Result<Vec<u8>, RuntimeError> {
        Ok(vec![0; bytes])
    }

    fn load(&mut self, _: &KernelSpec) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn tensor_map(&mut self, _: &TileMapSpec, _: u64) -> Result<TensorMap, RuntimeError> {
        Ok(TensorMap([0; 128]))
    }

    unsafe fn launch(
        &mut self,
        kernel: &KernelSpec,
        _: (u32, u32, u32),
        _: &[KernelArg],
    ) -> Result<(), RuntimeError> {
        self.log
            .borrow_mut()
            .push(format!("launch {}", kernel.name));
        Ok(())
    }
}

/// Rank 0 of a group of two whose collectives only record their calls.
struct Comm {
    log: Log,
}

impl Collective<Recorder> for Comm {
    fn ranks(&self) -> usize {
        2
    }

    fn rank(&self) -> usize {
        0
    }

    fn all_gather_bf16(
        &mut self,
        _: &mut Recorder,
        _: Span<bf16>,
        _: Span<bf16>,
    ) -> Result<(), RuntimeError> {
        self.log.borrow_mut().push("gather".into());
        Ok(())
    }

    fn reduce_scatter_f32_in_place(
        &mut self,
        _: &mut Recorder,
        _: Span<f32>,
    ) -> Result<(), RuntimeError> {
        self.log.borrow_mut().push("reduce-scatter".into());
        Ok(())
    }

    fn wait(&mut self, _: &mut Recorder) -> Result<(), RuntimeError> {
        self.log.borrow_mut().push("wait".into());
        Ok(())
    }
}

/// Position of the first entry of `log` that starts with `what`.
fn first(log: &[String], what: &str) -> usize {
    log.iter()
        .position(|l| l.starts_with(what))
        .unwrap_or_else(|| panic!("no `{what}` in {log:#?}"))
}

/// Position of the last entry of `log` that starts with `what`.
fn last(log: &[String], what: &str) -> usize {
    log.iter()
        .rposition(|l| l.starts_with(what))
        .unwrap_or_else(|| panic!("no `{what}` in {log:#?}"))
}

fn setup() -> (Log, Recorder, Comm, CpLayout, Vec<i32>) {
    let log: Log = Rc::default();
    let backend = Recorder {
        next: 1 << 30,
        log: log.clone(),
    };
    let comm = Comm { log: log.clone() };
    // Two documents, 600 tokens: 5 blocks, slices of 3.
    let cu = vec![0, 300, 600];
    let layout = CpLayout::new(&cu, 2).unwrap();
    let q2k = msa_runtime::causal_support(&cu).unwrap();
    (log, backend, comm, layout, q2k)
}

/// Distinct, aligned spans of `n` elements each.
fn spans<T>(at: &mut u64, n: usize) -> Span<T> {
    let s = Span::new(*at, n);
    *at += (n as u64 * 4).next_multiple_of(1024);
    s
}

#[test]
fn the_backward_gathers_before_its_preprocess_and_waits_only_before_the_main_kernel() {
    let (log, mut backend, mut comm, layout, q2k) = setup();
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
        .run_on(&mut backend, &mut comm, &layout, &io, &schedule)
        .unwrap();
    let log = log.borrow();
    let waits: Vec<usize> = (0..log.len()).filter(|&i| log[i] == "wait").collect();
    assert_eq!(waits.len(), 2, "{log:#?}");
    assert!(
        last(&log, "gather") < first(&log, "launch bwd_preprocess"),
        "{log:#?}"
    );
    assert!(last(&log, "launch task_") < waits[0], "{log:#?}");
    assert!(
        waits[0] < first(&log, "launch msa_backward_sm90"),
        "{log:#?}"
    );
    assert_eq!(
        waits[0] + 1,
        first(&log, "launch msa_backward_sm90"),
        "{log:#?}"
    );
    assert!(first(&log, "launch msa_backward_sm90") < first(&log, "reduce-scatter"));
    assert!(last(&log, "reduce-scatter") < waits[1], "{log:#?}");
    // The last postprocess rounds the reduced pools (the one before it, inside the local
    // backward, finishes dQ alone).
    assert!(waits[1] < last(&log, "launch bwd_postprocess"), "{log:#?}");
}

#[test]
fn the_forward_waits_for_its_gather_before_its_launch() {
    let (log, mut backend, mut comm, layout, q2k) = setup();
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
            &mut comm,
            &layout,
            &io,
            &layout.rank_q2k(0, &q2k).unwrap(),
        )
        .unwrap();
    let log = log.borrow();
    assert_eq!(
        log.iter()
            .filter(|l| l.starts_with("gather") || *l == "wait" || l.starts_with("launch"))
            .collect::<Vec<_>>(),
        ["gather", "gather", "wait", "launch msa_forward_sm90"],
        "{log:#?}"
    );
    assert!(first(&log, "upload") < first(&log, "gather"), "{log:#?}");
}
