//! The simulator against outputs recorded on an H200 (`tests/data/h200_recorded.bin`, see
//! `common/recorded.rs`): CI checks, without a GPU, that the wgmma numerics model, the
//! shuffles and the reductions/atomics still reproduce the hardware bit for bit.

mod common;

use common::probe::{probe_sets, N};
use common::recorded::{parse, probe_record, probe_rows};
use common::warp::{red_atom_scenario, shfl_scenario};
use common::*;

fn recorded() -> Vec<(String, Vec<u8>)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/h200_recorded.bin");
    parse(&std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}")))
}

fn find<'a>(recs: &'a [(String, Vec<u8>)], name: &str) -> &'a [u8] {
    &recs
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no record `{name}`"))
        .1
}

#[test]
fn wgmma_probes_match_the_recorded_h200_accumulators() {
    let recs = recorded();
    let mut total = 0;
    for set in probe_sets() {
        let gpu = u32s(find(&recs, &probe_record(set.name)));
        let one = set.truncated(1);
        let sim = one.unpack(&run_sim(&one.scenario()).unwrap()[0]);
        let sim = &sim[..probe_rows(one.name) * N];
        assert_eq!(gpu.len(), sim.len(), "{}", one.name);
        if let Some(i) = (0..sim.len()).find(|&i| gpu[i] != sim[i]) {
            let n = (0..sim.len()).filter(|&i| gpu[i] != sim[i]).count();
            panic!(
                "{}: {n} of {} accumulators differ, first (m {}, n {}): H200 {:#010x}, \
                 simulator {:#010x}",
                one.name,
                sim.len(),
                i / N,
                i % N,
                gpu[i],
                sim[i]
            );
        }
        total += sim.len();
    }
    println!("{total} accumulators bit-identical to the H200's");
}

#[test]
fn shfl_and_red_atom_match_the_recorded_h200_bytes() {
    let recs = recorded();
    for s in [shfl_scenario(), red_atom_scenario()] {
        let gpu = find(&recs, s.name);
        let sim = &run_sim(&s).unwrap()[0];
        assert_eq!(gpu.len(), sim.len(), "{}", s.name);
        if let Some(b) = (0..gpu.len()).find(|&b| gpu[b] != sim[b]) {
            panic!(
                "{}: byte {b}: H200 {:#04x}, simulator {:#04x}",
                s.name, gpu[b], sim[b]
            );
        }
    }
}
