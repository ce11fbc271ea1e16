//! Printing wrappers around `msa_sim::backward` shared by the backward tests of both main
//! kernels: they log what ran and panic where a test should fail.

use msa_sim::backward::{self, Case, Grads, MainKernel};
use msa_sim::{Limits, SimError};

/// The causal problem over documents of `lengths` tokens, with its reference gradients.
pub fn case(lengths: &[i32], seed: u64) -> Case {
    let c = backward::case(lengths, seed).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "documents {lengths:?}: T = {}, W = {}, CPU reference {:.2} s",
        c.schedule.num_tokens(),
        c.expected.workspace_rows,
        c.reference_time.as_secs_f64()
    );
    c
}

/// The runtime's launch sequence on the simulator with `kernel` as the main kernel.
pub fn run(
    c: &Case,
    kernel: &MainKernel,
    limits: Limits,
    num_sms: usize,
) -> Result<Grads, SimError> {
    let g = backward::run(c, kernel, limits, num_sms)?;
    println!(
        "  {} task rows on {} CTAs ({num_sms} SMs): preprocess + task build {:.2} s, \
         main kernel {:.2} s ({} warp instructions), total {:.2} s",
        g.tasks,
        g.ctas,
        g.before_main.as_secs_f64(),
        g.main_time.as_secs_f64(),
        g.warp_instructions,
        g.total.as_secs_f64()
    );
    Ok(g)
}

/// Panics with every failure unless dq, dk and dv are within the seed tolerances.
pub fn check(c: &Case, g: &Grads, label: &str) {
    match backward::check(c, g) {
        Ok(lines) => lines.iter().for_each(|l| println!("  {label} {l}")),
        Err(msg) => panic!("{label}:\n{msg}"),
    }
}
