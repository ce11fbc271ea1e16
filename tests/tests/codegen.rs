//! Snapshot, freshness, determinism and ptxas tests of everything codegen emits.

use codegen::ptx::*;
use codegen::Target;
use msa_tests::{assemble, ptxas, workspace_root};

fn snapshot(name: &str, text: &str) {
    insta::with_settings!({
        snapshot_path => workspace_root().join("tests/snapshots"),
        prepend_module_to_snapshot => false,
        omit_expression => true,
    }, {
        insta::assert_snapshot!(name, text);
    });
}

#[test]
fn ptx_snapshots() {
    for k in codegen::build_all().unwrap() {
        let text = codegen::ptx::print::module(&k).unwrap();
        snapshot(&format!("{}.{}.ptx", k.name, k.target.name()), &text);
    }
}

/// The reviewer's summary, with the figures ptxas reports for the same PTX. Every kernel must
/// assemble with no unusual ptxas output and no spills.
#[test]
fn summaries_with_ptxas_figures() {
    let Some(ptxas) = ptxas() else { return };
    for k in codegen::build_all().unwrap() {
        let text = codegen::ptx::print::module(&k).unwrap();
        let arch = k.target.name();
        let r = assemble(&ptxas, &text, arch, &k.name)
            .unwrap_or_else(|log| panic!("ptxas -arch={arch} rejected {}:\n{log}", k.name));
        assert_eq!(
            (r.spill_stores, r.spill_loads),
            (0, 0),
            "{} ({arch}) spills",
            k.name
        );
        assert!(
            r.unusual.is_empty(),
            "{} ({arch}): ptxas said {:?}",
            k.name,
            r.unusual
        );
        let summary = format!(
            "{}ptxas -arch={arch}: {} registers, {} B stack, {} B spill stores, {} B spill loads, {} B smem\n",
            codegen::summary::summary(&k),
            r.registers,
            r.stack_bytes,
            r.spill_stores,
            r.spill_loads,
            r.smem_bytes
        );
        snapshot(&format!("{}.{}.summary", k.name, arch), &summary);
    }
}

#[test]
fn generated_dir_is_fresh() {
    let files = codegen::generate().unwrap();
    let dir = codegen::generated_dir();
    let mut stale = Vec::new();
    for f in &files {
        match std::fs::read_to_string(dir.join(&f.path)) {
            Ok(on_disk) if on_disk == f.contents => {}
            Ok(_) => stale.push(format!("{} differs", f.path)),
            Err(_) => stale.push(format!("{} is missing", f.path)),
        }
    }
    let produced: std::collections::BTreeSet<&str> =
        files.iter().map(|f| f.path.as_str()).collect();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().to_string();
        if !produced.contains(name.as_str()) {
            stale.push(format!("{name} is not produced by codegen"));
        }
    }
    assert!(
        stale.is_empty(),
        "generated/ is stale ({}); run `cargo run -p codegen` and commit the result",
        stale.join(", ")
    );
}

#[test]
fn output_is_deterministic() {
    assert_eq!(codegen::generate().unwrap(), codegen::generate().unwrap());
}

#[test]
fn every_kernel_has_both_targets_and_lowest_versions() {
    // Shared kernels ship for both targets; a main kernel ships for the one it was built for.
    for desc in codegen::kernels::all() {
        let base = desc.name.strip_suffix("_det").unwrap_or(desc.name);
        let hopper_only = base.ends_with("_sm90");
        let blackwell_only = base.ends_with("_sm100");
        assert_eq!(
            desc.targets.contains(&Target::Sm90a),
            !blackwell_only,
            "{}",
            desc.name
        );
        assert_eq!(
            desc.targets.contains(&Target::Sm100a),
            !hopper_only,
            "{}",
            desc.name
        );
    }
    for k in codegen::build_all().unwrap() {
        let text = codegen::ptx::print::module(&k).unwrap();
        // The Hopper kernels with vector reductions need PTX 8.1.
        let expected = match (k.target, k.name.as_str()) {
            (Target::Sm90a, "msa_backward_sm90" | "msa_backward_sm90_det") => ".version 8.1\n",
            (Target::Sm90a, _) => ".version 8.0\n",
            (Target::Sm100a, _) => ".version 8.6\n",
        };
        assert!(
            text.contains(expected),
            "{} ({}) should use {expected}",
            k.name,
            k.target
        );
    }
}

/// A kernel that touches every instruction family the builder offers, so that ptxas checks
/// the printed syntax of each for both targets.
fn coverage_kernel(target: Target) -> Kernel {
    let mut b = KernelBuilder::new("dsl_coverage", target, (128, 1, 1));
    let src_p = b.param_ptr("src", HostElem::F32, false);
    let dst_p = b.param_ptr("dst", HostElem::F32, true);
    let n_p = b.param_u32("n");
    let k_p = b.param_s32("k");
    let tmap = b.param_tensor_map("tmap");
    let smem = b.shared_array("tile", 1024, 128);
    let flags = b.shared_array("flags", 16, 16);

    let src = b.ld_param_ptr(&src_p);
    let dst = b.ld_param_ptr(&dst_p);
    let n = b.ld_param(&n_p);
    let k = b.ld_param(&k_p);
    let tm = b.tensor_map_addr(&tmap);
    let tid = b.sreg(SReg::TidX);
    let lane = b.sreg(SReg::LaneId);
    let _ = (
        b.sreg(SReg::CtaidX),
        b.sreg(SReg::NtidX),
        b.sreg(SReg::NctaidX),
    );
    let off = b.mul_wide(tid, 16u32);
    let a = b.add(src, off);
    let v: [Reg<F32>; 4] = b.ld_global_nc_v(&global(a, 0));
    let w: [Reg<F32>; 2] = b.ld_v(&global(a, 16));
    let s0 = b.ld::<F32, _>(&global(a, 32));
    let x = b.fma(v[0], v[1], s0);
    let x = b.fmul(x, 0.5f32);
    let x = b.add(x, w[0]);
    let x = b.sub(x, w[1]);
    let x = b.max(x, v[2]);
    let x = b.min(x, v[3]);
    let x = b.ex2_approx(x);
    let packed = b.cvt_bf16x2(x, v[0]);
    let (lo, hi) = b.bf16x2_to_f32(packed);
    let sum = b.add(lo, hi);
    let sum = b.shfl(Shfl::Bfly, sum, 1u32, 0x1f);
    let sum = b.shfl(Shfl::Down, sum, 2u32, 0x1f);
    let ts = b.shared_base(&smem);
    let t4 = b.shl(tid, 2u32);
    let slot = b.add(ts, t4);
    b.st(&shared(slot, 0), sum);
    b.bar_sync(0, None);
    b.bar_sync(1, Some(128));
    let back = b.ld::<F32, _>(&shared(slot, 0));
    let q: [Reg<U32>; 4] = b.ld_v(&smem.at(16));
    b.st_v(&smem.at(32), q);
    let i = b.cvt::<S32, F32>(back);
    let i = b.add(i, k);
    let i = b.mul_lo(i, 3i32);
    let i = b.shr(i, 1u32);
    let f = b.cvt::<F32, S32>(i);
    let u = b.cvt::<U32, F32>(f);
    let u = b.rem(u, 7u32);
    let u = b.div(u, 2u32);
    let u = b.mad_lo(u, 5u32, tid);
    let u = b.xor(u, lane);
    let u = b.or(u, 1u32);
    let sel = b.setp(Cmp::Lt, u, n);
    let ge = b.setp(Cmp::Ge, tid, 64u32);
    let both = b.and_pred(sel, ge);
    let either = b.or_pred(both, sel);
    let either = b.not_pred(either);
    let r = b.selp(u, 0u32, either);
    let old = b.atom::<U32, _>(AtomOp::Add, &flags.at(0), r);
    let _ = b.atom::<S32, _>(AtomOp::Min, &global(dst, 64), k);
    b.red::<S32, _>(AtomOp::Max, &global(dst, 68), k);
    b.red::<U32, _>(AtomOp::Or, &global(dst, 72), old);
    let policy = b.policy_evict_last(1.0);
    b.red_add_f32(&global(dst, 0), sum);
    b.red_add_v4_f32(&global(dst, 16), v, None);
    b.red_add_v4_f32(&global(dst, 32), v, Some(policy));
    b.red_add_bf16x2(&global(dst, 48), packed, None);
    b.red_add_bf16x2(&global(dst, 52), packed, Some(policy));
    let wide = b.cvt::<U64, U32>(r);
    let wide = b.add(wide, tm);
    let bits = b.bitcast::<B64, U64>(wide);
    let bits = b.and(bits, 0xffu64);
    let back = b.bitcast::<U64, B64>(bits);
    b.st(&global(dst, 80), back);
    let perm = b.prmt(packed, packed, 0x5410);
    b.st(&global(dst, 88), perm);
    b.for_range(0u32, n, 32, "loop", |b, i| {
        let o = b.mul_wide(i, 4u32);
        let p = b.add(dst, o);
        b.st(&global(p, 0), i);
    });
    b.if_then(sel, "tail", |b| b.st::<U32, _>(&global(dst, 96), 7u32));
    b.predicated(sel, true, |b| b.st::<U32, _>(&global(dst, 100), 9u32));
    b.ret();
    b.finish().unwrap()
}

#[test]
fn dsl_coverage_assembles_for_every_target() {
    for target in Target::ALL {
        let k = coverage_kernel(target);
        let text = codegen::ptx::print::module(&k).unwrap();
        assert!(text.contains(".param .align 64 .b8 tmap[128]"), "{text}");
        assert!(
            text.contains(".shared .align 128 .b8 tile[1024];"),
            "{text}"
        );
        // Vector red needs PTX 8.1 on sm_90a; the policy picks the lowest version that works.
        let want = if target == Target::Sm90a {
            "8.1"
        } else {
            "8.6"
        };
        assert!(text.contains(&format!(".version {want}\n")), "{text}");
        let Some(ptxas) = ptxas() else { return };
        let r = assemble(&ptxas, &text, target.name(), "dsl_coverage").unwrap_or_else(|log| {
            panic!("ptxas rejected the coverage kernel for {target}:\n{log}\n{text}")
        });
        assert!(r.unusual.is_empty(), "{target}: {:?}", r.unusual);
    }
}

#[test]
fn the_main_kernels_take_one_parameter_list_per_mode() {
    // The runtime launches either main kernel of a mode with one argument list (built by the
    // sm90 binding), so their parameters must be the same names and kinds in the same order;
    // the deterministic list is the default one (with fixed-point pools) without the default
    // mode's last parameter, the dQ pool's tensor map, and with two others at the end.
    let params = |name: &str| -> Vec<(String, String)> {
        let k = codegen::build_all()
            .unwrap()
            .into_iter()
            .find(|k| k.name == name)
            .unwrap_or_else(|| panic!("no kernel {name}"));
        k.params
            .iter()
            .map(|p| (p.name.clone(), format!("{:?}", p.kind)))
            .collect()
    };
    let (sm90, sm100) = (params("msa_backward_sm90"), params("msa_backward_sm100"));
    let (det90, det100) = (
        params("msa_backward_sm90_det"),
        params("msa_backward_sm100_det"),
    );
    assert_eq!(sm90, sm100);
    assert_eq!(det90, det100);
    let names = |v: &[(String, String)]| v.iter().map(|p| p.0.clone()).collect::<Vec<_>>();
    let mut expected = names(&sm90);
    assert_eq!(expected.pop().as_deref(), Some("tmap_dq"));
    expected.extend(["row_bounds".to_string(), "bounds".to_string()]);
    assert_eq!(names(&det90), expected);
}

#[test]
fn the_runtime_mirrors_the_fixed_point_bounds_size() {
    assert_eq!(
        codegen::kernels::fixed_point::BOUND_WORDS as usize,
        msa_runtime::ops::BOUND_WORDS
    );
}

#[test]
fn the_kv_forward_combine_window_is_one_fact_on_both_sides() {
    // `fwd_kv_combine` (the kernel) and `forward_kv::combine_row` (its host form) must accept
    // the same rows.
    use codegen::kernels::forward_kv_rows::{MAX_EXCESS, MAX_GAP};
    use msa_runtime::forward_kv::{MAX_REFERENCE_EXCESS, MAX_REFERENCE_GAP};
    assert_eq!(MAX_GAP, MAX_REFERENCE_GAP);
    assert_eq!(MAX_EXCESS, MAX_REFERENCE_EXCESS);
}

#[test]
fn the_paired_pool_layout_is_one_fact_on_both_sides() {
    // The runtime sizes, aligns and labels the pool that the sum pass and the combine address.
    use codegen::kernels::l2_sides::{ANCHORS, CHUNK_BYTES, KV_CHUNKS};
    use msa_runtime::forward_kv::{PAIR_ANCHORS, PAIR_CHUNK_BYTES, PAIR_KV_CHUNKS};
    assert_eq!(ANCHORS as usize, PAIR_ANCHORS);
    assert_eq!(CHUNK_BYTES as usize, PAIR_CHUNK_BYTES);
    assert_eq!(KV_CHUNKS as usize, PAIR_KV_CHUNKS);
    // A K/V tile image is 128 keys × 128 d bf16.
    assert_eq!(PAIR_KV_CHUNKS * PAIR_CHUNK_BYTES, 128 * 128 * 2);
    // One copy is a row of 16 heads × 128 d f16, and the anchor mask needs a power of two.
    assert_eq!(PAIR_CHUNK_BYTES, 16 * 128 * 2);
    assert!(ANCHORS.is_power_of_two());
}

#[test]
fn the_row_kernels_grids_are_one_fact_on_both_sides() {
    // The runtime sizes these grids without codegen: its constants must match the kernels'.
    use msa_runtime::contract::NUM_Q_HEADS;
    assert_eq!(
        codegen::kernels::preprocess::ROWS_PER_CTA as usize,
        msa_runtime::ops::PREPROCESS_TOKENS_PER_CTA * NUM_Q_HEADS
    );
    assert_eq!(
        codegen::kernels::forward_kv_rows::ROWS_PER_CTA as usize,
        msa_runtime::forward_kv::ROW_KERNEL_ROWS_PER_CTA
    );
    assert_eq!(
        codegen::kernels::forward_kv_rows::COMBINE_ROWS_PER_CTA as usize,
        msa_runtime::forward_kv::COMBINE_ROWS_PER_CTA
    );
    assert_eq!(
        codegen::kernels::forward_kv_rows::COMBINE_MAX_CTAS_PER_SM as usize,
        msa_runtime::forward_kv::COMBINE_MAX_CTAS_PER_SM
    );
    assert_eq!(
        codegen::kernels::forward_kv_rows::REFERENCE_ROWS_PER_CTA as usize,
        msa_runtime::forward_kv::REFERENCE_ROWS_PER_CTA
    );
}

/// Every kernel that times atomics with `%clock` (the paired pool's side probes) keeps each
/// atomic's round trip between its two clock reads in the SASS ptxas makes of it: session 29's
/// kernels did not, and their side labels were noise (`msa_tests::check_clock_order`).
#[test]
fn timed_atomics_return_before_the_second_clock_read() {
    let (Some(ptxas), Some(nvdisasm)) = (ptxas(), msa_tests::nvdisasm()) else {
        return;
    };
    let mut timed = Vec::new();
    for k in codegen::build_all().unwrap() {
        let text = codegen::ptx::print::module(&k).unwrap();
        if !text.contains("%clock") {
            continue;
        }
        let arch = k.target.name();
        let sass = msa_tests::sass(&ptxas, &nvdisasm, &text, arch, &k.name)
            .unwrap_or_else(|log| panic!("{} ({arch}): {log}", k.name));
        let atoms = msa_tests::check_clock_order(&sass)
            .unwrap_or_else(|why| panic!("{} ({arch}): {why}", k.name));
        assert!(
            atoms > 0,
            "{} ({arch}) reads %clock but times no atomic",
            k.name
        );
        timed.push(format!("{} {arch}", k.name));
    }
    timed.sort();
    assert_eq!(
        timed,
        [
            "fwd_kv_homes sm_100a",
            "fwd_kv_homes sm_90a",
            "msa_forward_kv_f16p_sm90 sm_90a"
        ]
    );
}

/// The check itself, on SASS as ptxas 13.5 scheduled session 29's `fwd_kv_homes` (the clock
/// read right after the atomic, its consumer fused in after), on the dead-store variant (the
/// atomic turned into a `REDG`), and on the fixed order.
#[test]
fn the_clock_order_check_rejects_session_29s_schedule() {
    let broken = "
        /*0a30*/                   S2UR UR4, SR_CLOCKLO ;
        /*0a50*/                   ATOMG.E.ADD.STRONG.GPU PT, R12, desc[UR6][R10.64], RZ ;
        /*0a60*/                   S2UR UR5, SR_CLOCKLO ;
        /*0a80*/                   UIADD3 UR4, -UR4, UR5, URZ ;
        /*0a90*/                   LEA.HI R12, R12, UR4, RZ, 0x1 ;";
    let why = msa_tests::check_clock_order(broken).unwrap_err();
    assert!(why.contains("before any instruction waits"), "{why}");
    let reduced = "
        /*01d0*/                   S2UR UR4, SR_CLOCKLO ;
        /*01e0*/               @P1 REDG.E.ADD.STRONG.GPU desc[UR8][R10.64], RZ ;
        /*01f0*/                   CS2R.32 R7, SR_CLOCKLO ;";
    let why = msa_tests::check_clock_order(reduced).unwrap_err();
    assert!(
        why.contains("2 clock reads for 0 returning atomics"),
        "{why}"
    );
    let fixed = "
        /*07a0*/                   S2UR UR16, SR_CLOCKLO ;
        /*07e0*/               @P1 ATOMG.E.ADD.STRONG.GPU PT, R3, desc[UR14][R2.64], RZ ;
        /*07f0*/              @!P3 STS [R10], R3 ;
        /*0800*/                   CS2R.32 R5, SR_CLOCKLO ;";
    assert_eq!(msa_tests::check_clock_order(fixed), Ok(1));
}
