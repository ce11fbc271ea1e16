//! The cases `scripts/sanitize.sh` runs under compute-sanitizer: each runs the whole
//! `run_backward` (preprocess, task build, main kernel, postprocess) once on the GPU and
//! compares the gradients with the CPU reference at the seed tolerances.
//!
//! ```sh
//! cargo run -p msa-tests --release --example sanitize_cases -- all
//! cargo run -p msa-tests --release --example sanitize_cases -- packed-holes two-docs
//! ```
//!
//! Cases:
//! - `packed-holes`: five short documents (1, 127, 129, 300, 700 tokens), random top-16 in
//!   shuffled slots with −1 holes;
//! - `two-docs`: documents of 700 and 1348 tokens, random top-16;
//! - `doc2k`: one document of 2048 tokens, random top-16.
//!
//! Exit status 1 when a case's gradients miss the tolerances or the backward fails; 2 for a
//! usage error or when no GPU is usable.

use msa_tests::cases::{compare, docs, random_top16, DeviceInputs, Problem};
use msa_tests::Rng;
use std::process::ExitCode;

/// (name, document lengths, selection seed, data seed).
const CASES: [(&str, &[i32], u64, u64); 3] = [
    ("packed-holes", &[1, 127, 129, 300, 700], 18_001, 18_002),
    ("two-docs", &[700, 1348], 18_003, 18_004),
    ("doc2k", &[2048], 18_005, 18_006),
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let wanted: Vec<&str> = if args.is_empty() || args.iter().any(|a| a == "all") {
        CASES.iter().map(|c| c.0).collect()
    } else {
        args.iter().map(String::as_str).collect()
    };
    if let Some(bad) = wanted.iter().find(|w| !CASES.iter().any(|c| c.0 == **w)) {
        let names: Vec<&str> = CASES.iter().map(|c| c.0).collect();
        eprintln!("unknown case `{bad}`; cases: {}, all", names.join(", "));
        return ExitCode::from(2);
    }
    let stream = match msa_runtime::Device::open(0) {
        Ok(dev) => dev.context().default_stream(),
        Err(e) => {
            eprintln!("no usable GPU: {e}");
            return ExitCode::from(2);
        }
    };
    let mut failed = false;
    for &(name, lengths, sel_seed, data_seed) in CASES.iter().filter(|c| wanted.contains(&c.0)) {
        let cu = docs(lengths);
        let q2k = random_top16(&cu, &mut Rng::new(sel_seed));
        let p = Problem::new(name, cu, q2k, data_seed);
        let inputs = DeviceInputs::upload(&stream, &p);
        let result = inputs
            .run(&stream, &p.schedule, None)
            .map_err(|e| e.to_string())
            .and_then(|g| compare(&stream, &p, &g, "run_backward"));
        match result {
            Ok(lines) => {
                lines.iter().for_each(|l| println!("{l}"));
                println!("case {name}: ok");
            }
            Err(msg) => {
                println!("case {name}: FAILED\n{msg}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
