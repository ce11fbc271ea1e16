//! The micro-kernels of `async_micro.rs` on a real GPU (sm_90) next to the simulator: TMA
//! bytes (swizzle, out-of-range fill, unaligned destinations), mbarrier phase results,
//! `elect.sync`, and wgmma accumulators (layouts exactly, accumulation order reported).
//!
//! Without a GPU it prints `SKIP` and passes; with `REQUIRE_GPU=1` a missing GPU fails. On an
//! H200 machine without Rust, build here and copy the binary over:
//! `cargo test --release -p msa-sim --test h200_compare --no-run`, then run
//! `REQUIRE_GPU=1 target/release/deps/h200_compare-* --nocapture --test-threads 1`.

mod common;

use std::sync::Arc;

use common::*;
use cudarc::driver::{sys, CudaSlice, DevicePtr, LaunchConfig as CuConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use msa_runtime::backward::TileMapSpec;
use msa_runtime::Device;

fn device() -> Option<Arc<Device>> {
    match Device::open(0) {
        Ok(d) if d.capability() == (9, 0) => Some(d),
        Ok(d) => {
            let why = format!("device capability {:?} is not 9.0", d.capability());
            assert!(std::env::var("REQUIRE_GPU").as_deref() != Ok("1"), "{why}");
            eprintln!("SKIP: {why}");
            None
        }
        Err(e) => {
            assert!(
                std::env::var("REQUIRE_GPU").as_deref() != Ok("1"),
                "REQUIRE_GPU=1 but no GPU: {e}"
            );
            eprintln!("SKIP: no GPU ({e})");
            None
        }
    }
}

/// Runs a scenario on the GPU; returns the outputs.
fn run_gpu(dev: &Device, s: &Scenario) -> Result<Vec<Vec<u8>>, String> {
    let ctx = dev.context();
    let stream = ctx.default_stream();
    let err = |what: &str| {
        let what = what.to_string();
        move |e: cudarc::driver::DriverError| format!("{what}: {e}")
    };
    let module = ctx
        .load_module(Ptx::from_src(s.ptx.clone()))
        .map_err(err("JIT"))?;
    let f = module.load_function(s.kernel).map_err(err("function"))?;
    f.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        s.dynamic_smem as i32,
    )
    .map_err(err("smem attribute"))?;
    let ins: Vec<CudaSlice<u8>> = s
        .inputs
        .iter()
        .map(|b| stream.clone_htod(b).map_err(err("upload")))
        .collect::<Result<_, _>>()?;
    let outs: Vec<CudaSlice<u8>> = s
        .outputs
        .iter()
        .map(|&n| stream.alloc_zeros::<u8>(n).map_err(err("alloc")))
        .collect::<Result<_, _>>()?;
    let mut maps = Vec::new();
    let mut scalars = Vec::new();
    for a in &s.args {
        match a {
            ArgSpec::Map(m) => {
                let (base, _guard) = ins[m.input].device_ptr(&stream);
                let spec = TileMapSpec {
                    map: "micro-kernel map",
                    global_dim: m.global_dim,
                    global_strides: m.global_strides,
                    box_dim: m.box_dim,
                    element_strides: [1, 1, 1],
                };
                maps.push(spec.encode(base).map_err(|e| e.to_string())?);
            }
            ArgSpec::U32(v) => scalars.push(*v),
            _ => {}
        }
    }
    let mut b = stream.launch_builder(&f);
    let (mut mi, mut si) = (0, 0);
    for a in &s.args {
        match a {
            ArgSpec::Map(_) => {
                b.arg(&maps[mi]);
                mi += 1;
            }
            ArgSpec::In(i) => {
                b.arg(&ins[*i]);
            }
            ArgSpec::Out(i) => {
                b.arg(&outs[*i]);
            }
            ArgSpec::U32(_) => {
                b.arg(&scalars[si]);
                si += 1;
            }
        }
    }
    let cfg = CuConfig {
        grid_dim: (1, 1, 1),
        block_dim: (s.threads, 1, 1),
        shared_mem_bytes: s.dynamic_smem,
    };
    unsafe { b.launch(cfg) }.map_err(err("launch"))?;
    stream.synchronize().map_err(err("kernel"))?;
    outs.iter()
        .map(|o| stream.clone_dtoh(o).map_err(err("download")))
        .collect()
}

/// First differing byte of two outputs, as a message.
fn byte_diff(name: &str, gpu: &[Vec<u8>], sim: &[Vec<u8>]) -> Option<String> {
    for (o, (g, s)) in gpu.iter().zip(sim).enumerate() {
        if let Some(b) = (0..g.len()).find(|&b| g[b] != s[b]) {
            let n = g.iter().zip(s).filter(|(x, y)| x != y).count();
            return Some(format!(
                "{name}: output {o} differs in {n} of {} bytes, first at byte {b}: GPU {:#04x}, \
                 simulator {:#04x}",
                g.len(),
                g[b],
                s[b]
            ));
        }
    }
    None
}

fn exact(scenarios: Vec<Scenario>) {
    let Some(dev) = device() else { return };
    let mut failures = Vec::new();
    for s in scenarios {
        let sim = run_sim(&s).map_err(|e| e.to_string());
        let gpu = run_gpu(&dev, &s);
        match (gpu, sim) {
            (Err(g), Err(m)) => println!("{}: both refuse it: GPU {g}; simulator {m}", s.name),
            (Err(g), Ok(_)) => {
                failures.push(format!("{}: GPU: {g}; the simulator accepts it", s.name))
            }
            (Ok(_), Err(m)) => failures.push(format!("{}: GPU runs it; simulator: {m}", s.name)),
            (Ok(gpu), Ok(sim)) => match byte_diff(s.name, &gpu, &sim) {
                Some(d) => failures.push(d),
                None => println!("{}: GPU and simulator agree byte for byte", s.name),
            },
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn mbarrier_elect_and_tma_match_the_gpu() {
    exact(vec![
        mbarrier_scenario(),
        elect_scenario(),
        tma_query_rows(),
        tma_key_rows(),
    ]);
}

// A faulting launch poisons the context: run each of these in its own process
// (`h200_compare <test name>`).

#[test]
fn wgmma_matches_the_gpu() {
    let Some(dev) = device() else { return };
    let mut failures = Vec::new();
    for (i, form) in [WgmmaForm::SsKK, WgmmaForm::RsMn, WgmmaForm::SsMnMn]
        .into_iter()
        .enumerate()
    {
        let c = wgmma_case(form, 100 + i as u64);
        let name = c.scenario.name;
        let sim = c.unpack(&run_sim(&c.scenario).unwrap()[0]);
        let gpu = match run_gpu(&dev, &c.scenario) {
            Ok(o) => c.unpack(&o[0]),
            Err(e) => {
                failures.push(format!("{name}: GPU: {e}"));
                continue;
            }
        };
        let (exact, mag) = c.reference();
        let (mut worst_sim, mut worst_ref, mut same) = (0f64, 0f64, 0);
        for e in 0..gpu.len() {
            let scale = mag[e].max(f64::MIN_POSITIVE);
            worst_sim = worst_sim.max((gpu[e] as f64 - sim[e] as f64).abs() / scale);
            worst_ref = worst_ref.max((gpu[e] as f64 - exact[e]).abs() / scale);
            same += (gpu[e].to_bits() == sim[e].to_bits()) as usize;
        }
        println!(
            "{name}: {same} of {} accumulators bit-identical to the simulator; worst |GPU − sim| \
             = {worst_sim:.2e}, |GPU − exact| = {worst_ref:.2e} of Σ|a·b|",
            gpu.len()
        );
        if worst_sim > 1e-5 {
            failures.push(format!(
                "{name}: GPU and simulator differ by {worst_sim:.2e} of Σ|a·b| (a layout mismatch)"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
